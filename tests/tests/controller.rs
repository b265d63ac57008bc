//! The controller, CLI and agent enrollment end to end: real binaries, real TLS, and each test
//! twice: on SQLite in a temporary directory and on an etcd member of its own (Debian's 3.4.23).

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use keelson_tests::{ApiClient, Controller, WatchEvents, machine_json, runtime_spec, status_report};
use serde_json::json;

type R = anyhow::Result<()>;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

async fn revision(admin: &ApiClient) -> anyhow::Result<String> {
    let a = admin.get("/v1/machines").await?;
    assert_eq!(a.status, 200, "{}", a.text);
    Ok(a.body["resourceVersion"].as_str().unwrap_or_default().to_owned())
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn sigterm_stops_the_controller_promptly(store) -> R {
        // systemd stops the service with SIGTERM and waits; so does the VM suite.
        let dir = tmp();
        let mut c = store.start(dir.path(), &[])?;
        assert_eq!(c.anonymous()?.get("/healthz").await?.text, "ok\n");
        let term = std::process::Command::new("kill").args(["-TERM", &c.child.id().to_string()]).status()?;
        assert!(term.success());
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if let Some(status) = c.child.try_wait()? {
                assert!(status.success(), "exited with {status}");
                return Ok(());
            }
            anyhow::ensure!(std::time::Instant::now() < deadline, "still running 10 s after SIGTERM");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn first_start_creates_the_ca_and_admin_conf_and_later_starts_reuse_them(store) -> R {
        let dir = tmp();
        let mut c = store.start(dir.path(), &[])?;
        let mode = std::fs::metadata(c.admin_conf())?.permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "admin.conf must be private");
        let ca_before = c.ca_pem()?;
        let conf_before = std::fs::read_to_string(c.admin_conf())?;
        assert_eq!(c.anonymous()?.get("/healthz").await?.text, "ok\n");
        c.restart()?;
        assert_eq!(c.ca_pem()?, ca_before);
        assert_eq!(std::fs::read_to_string(c.admin_conf())?, conf_before);
        // The old admin credential still works against the restarted controller.
        assert_eq!(c.admin()?.get("/v1/machines").await?.status, 200);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn quick_start_flow_through_the_cli(store) -> R {
        let dir = tmp();
        let agent_dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let token = c.token(&["--ttl", "1h", "--usages", "1", "--labels", "pool=workers,rack=r12"])?;
        assert!(token.starts_with("kst."), "{token}");
        c.enroll("worker-07", &token, agent_dir.path())?;
        let key_mode = std::fs::metadata(agent_dir.path().join("machine.key"))?.permissions().mode() & 0o777;
        assert_eq!(key_mode, 0o600);
        let files = tmp();
        let manifest = files.path().join("fleet.yaml");
        std::fs::write(
            &manifest,
            r#"apiVersion: keelson.io/v1alpha1
kind: MachinePool
metadata: {name: workers}
spec:
  selector: {matchLabels: {pool: workers}}
  template:
    spec:
      roles: [worker]
      containerRuntime: {name: containerd, version: 1.6.20~ds1-1+deb12u2, source: {package: containerd}}
---
apiVersion: keelson.io/v1alpha1
kind: Machine
metadata: {name: etcd-1}
spec:
  roles: [etcd]
  etcd: {cluster: main, version: 3.4.23, source: {package: etcd-server}}
"#,
        )?;
        let out = c.cli(&["apply", "-f", manifest.to_str().unwrap_or_default()])?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let table = String::from_utf8(c.cli(&["get", "machines"])?.stdout)?;
        let header = table.lines().next().unwrap_or_default();
        for col in ["NAME", "POOL", "ROLES", "READY", "UP-TO-DATE", "OS", "RUNTIME", "KUBELET", "ETCD", "AGE"] {
            assert!(header.contains(col), "missing column {col}: {header}");
        }
        assert!(table.lines().any(|l| l.contains("worker-07") && l.contains("workers")), "{table}");
        let out = c.cli(&["get", "machines", "worker-07", "-o", "json"])?;
        let m: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(m["spec"]["containerRuntime"]["version"], "1.6.20~ds1-1+deb12u2", "the pool's template became the spec");
        assert_eq!(m["metadata"]["labels"]["rack"], "r12", "token labels reach the machine");
        assert_eq!(m["status"]["pool"], "workers");
        assert!(m["status"]["facts"]["cpus"].as_u64().unwrap_or(0) >= 1, "facts were sent at enrollment");
        let out = c.cli(&["get", "pools", "-o", "yaml"])?;
        assert!(String::from_utf8(out.stdout)?.contains("machines: 1"));
        let out = c.cli(&["describe", "machine", "worker-07"])?;
        let text = String::from_utf8(out.stdout)?;
        assert!(text.contains("Enrolled") && text.contains("Reachable"), "{text}");
        let out = c.cli(&["get", "tokens", "-o", "json"])?;
        let tokens: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(tokens["items"][0]["status"]["usages"], 1);
        assert!(!String::from_utf8_lossy(&out.stdout).contains(token.rsplit('.').next().unwrap_or("x")), "the secret is never shown again");
        let out = c.cli(&["delete", "machine", "etcd-1"])?;
        assert!(out.status.success());
        let out = c.cli(&["get", "machines", "etcd-1"])?;
        assert!(!out.status.success());
        let err = String::from_utf8(out.stderr)?;
        assert_eq!(err.lines().count(), 1, "a server error is one line: {err}");
        assert!(err.contains("NotFound (404)"), "{err}");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn bad_input_is_refused_with_the_field_named_and_nothing_changes(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        assert_eq!(admin.put("/v1/machines/m1", &machine_json("m1", json!({}), runtime_spec("1.6.20~ds1-1+deb12u2"))).await?.status, 200);
        let before = revision(&admin).await?;

        let cases: Vec<(&str, serde_json::Value, &str)> = vec![
            (
                "unknown field",
                json!({"apiVersion": "keelson.io/v1alpha1", "kind": "Machine", "metadata": {"name": "m2"}, "spec": {"rolez": []}}),
                "spec.rolez",
            ),
            ("wrong kind", json!({"apiVersion": "keelson.io/v1alpha1", "kind": "Pod", "metadata": {"name": "m2"}}), "kind"),
            ("wrong apiVersion", json!({"apiVersion": "v1", "kind": "Machine", "metadata": {"name": "m2"}}), "apiVersion"),
            ("bad name", machine_json("M_2", json!({}), json!({})), "metadata.name"),
            (
                "bad kubelet version",
                machine_json("m2", json!({}), json!({"roles": ["worker"], "kubelet": {"version": "1.3x", "source": {"package": "kubelet"}}})),
                "spec.kubelet.version",
            ),
            (
                "bad digest",
                machine_json(
                    "m2",
                    json!({}),
                    json!({"roles": ["worker"], "kubelet": {"version": "1.30.4", "source": {"url": "https://a.invalid/k", "sha256": "xyz"}}}),
                ),
                "spec.kubelet.source.sha256",
            ),
            (
                "url without digest",
                machine_json(
                    "m2",
                    json!({}),
                    json!({"roles": ["worker"], "kubelet": {"version": "1.30.4", "source": {"url": "https://a.invalid/k"}}}),
                ),
                "spec.kubelet.source.sha256",
            ),
            ("bad package version", machine_json("m2", json!({}), runtime_spec("not a version")), "spec.containerRuntime.version"),
        ];
        for (what, body, field) in cases {
            let a = admin.post("/v1/machines", &body).await?;
            assert_eq!(a.status, 400, "{what}: {}", a.text);
            assert_eq!(a.body["reason"], "Invalid", "{what}");
            assert!(a.body["field"].as_str().unwrap_or("").starts_with(field), "{what}: field {:?}, want {field}", a.body["field"]);
            assert!(a.body["message"].as_str().unwrap_or("").contains(field), "{what}: message names the field: {}", a.text);
        }
        let malformed = admin.raw_post("/v1/machines", b"{\"kind\": ".to_vec()).await?;
        assert_eq!(malformed.status, 400);
        assert!(malformed.text.contains("malformed JSON"), "{}", malformed.text);
        let huge = admin.raw_post("/v1/machines", vec![b' '; 2 * 1024 * 1024]).await?;
        assert_eq!(huge.status, 413, "{}", huge.text);
        // A skipped kubelet minor on update.
        let v1 = json!({"roles": ["worker"], "kubelet": {"version": "1.28.2", "source": {"package": "kubelet"}}});
        assert_eq!(admin.put("/v1/machines/m1", &machine_json("m1", json!({}), v1)).await?.status, 200);
        let mid = revision(&admin).await?;
        let v3 = json!({"roles": ["worker"], "kubelet": {"version": "v1.30.0", "source": {"package": "kubelet"}}});
        let skip = admin.put("/v1/machines/m1", &machine_json("m1", json!({}), v3)).await?;
        assert_eq!(skip.status, 400);
        assert!(skip.text.contains("cannot skip a minor version"), "{}", skip.text);
        assert_eq!(revision(&admin).await?, mid, "refused writes change nothing");
        assert_ne!(before, mid);

        // The CLI checks files before it sends anything.
        let files = tmp();
        let bad = files.path().join("bad.yaml");
        std::fs::write(
            &bad,
            "apiVersion: keelson.io/v1alpha1\nkind: Machine\nmetadata: {name: m3}\nspec:\n  kubelet: {version: 1.3x, source: {package: kubelet}}\n",
        )?;
        let out = c.cli(&["apply", "-f", bad.to_str().unwrap_or_default()])?;
        assert!(!out.status.success());
        let err = String::from_utf8(out.stderr)?;
        assert!(err.contains("spec.kubelet.version: \"1.3x\" is not a Kubernetes version"), "{err}");
        std::fs::write(&bad, "kind: [unclosed")?;
        let out = c.cli(&["apply", "-f", bad.to_str().unwrap_or_default()])?;
        assert!(String::from_utf8(out.stderr)?.contains("malformed YAML"));
        assert_eq!(revision(&admin).await?, mid);
        assert_eq!(c.anonymous()?.get("/healthz").await?.status, 200, "the server keeps serving");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn optimistic_concurrency_refuses_a_stale_resource_version(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let a = admin.put("/v1/machines/m1", &machine_json("m1", json!({}), runtime_spec("1.6.20~ds1-1+deb12u2"))).await?;
        let rv = a.body["metadata"]["resourceVersion"].as_str().unwrap_or_default().to_owned();
        assert_eq!(a.body["metadata"]["generation"], 1);
        let mut next = machine_json("m1", json!({}), runtime_spec("1.6.20~ds1-1+deb12u3"));
        next["metadata"]["resourceVersion"] = json!(rv);
        let b = admin.put("/v1/machines/m1", &next).await?;
        assert_eq!(b.status, 200, "{}", b.text);
        assert_eq!(b.body["metadata"]["generation"], 2, "a spec change raises the generation");
        let stale = admin.put("/v1/machines/m1", &next).await?;
        assert_eq!(stale.status, 409, "{}", stale.text);
        assert_eq!(stale.body["reason"], "Conflict");
        // Re-applying the same spec does not raise the generation.
        let same = admin.put("/v1/machines/m1", &machine_json("m1", json!({"x": "y"}), runtime_spec("1.6.20~ds1-1+deb12u3"))).await?;
        assert_eq!(same.body["metadata"]["generation"], 2);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn tokens_are_checked_hashed_expiring_and_limited(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let once = c.token(&["--usages", "1"])?;
        c.enroll("m1", &once, tmp().path())?;
        let used_up = c.enroll("m2", &once, tmp().path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(used_up.contains("used up"), "{used_up}");
        let mut forged = once.clone();
        forged.replace_range(forged.len() - 1.., if forged.ends_with('a') { "b" } else { "a" });
        let wrong = c.enroll("m3", &forged, tmp().path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(wrong.contains("Unauthorized (401)") && wrong.contains("not valid"), "{wrong}");
        let short = c.token(&["--ttl", "1s"])?;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let expired = c.enroll("m4", &short, tmp().path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(expired.contains("expired"), "{expired}");
        // Only a hash is stored: the secret is in none of the store's files.
        let secret = once.rsplit('.').next().unwrap_or_default();
        let files = store.files(dir.path())?;
        assert!(!files.is_empty());
        for (path, bytes) in files {
            assert!(!bytes.windows(secret.len()).any(|w| w == secret.as_bytes()), "token secret stored in clear in {}", path.display());
        }
        let listed = admin.get("/v1/machines").await?;
        let names: Vec<&str> =
            listed.body["items"].as_array().map(|a| a.iter().filter_map(|m| m["metadata"]["name"].as_str()).collect()).unwrap_or_default();
        assert_eq!(names, vec!["m1"], "failed enrollments created nothing");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn enrollment_checks_the_csr_and_re_enrollment_needs_permission(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let anon = c.anonymous()?;
        let token = c.token(&["--usages", "10"])?;
        // A CSR whose CN is not the name asked for.
        let other: keelson_api::meta::Name = "someone-else".parse()?;
        let (_, csr) = keelson_agent::enroll::make_key_and_csr(&other)?;
        let a = anon.post("/v1/enroll", &json!({"token": token, "csr": csr, "name": "m1"})).await?;
        assert_eq!(a.status, 400, "{}", a.text);
        assert_eq!(a.body["field"], "csr");
        let garbage = anon
            .post(
                "/v1/enroll",
                &json!({"token": token, "csr": "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"}),
            )
            .await?;
        assert_eq!(garbage.status, 400);

        let first_dir = tmp();
        let first = c.enroll("m1", &token, first_dir.path())?;
        assert_eq!(first.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 200);
        let again = c.enroll("m1", &token, tmp().path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(again.contains("Conflict (409)") && again.contains("--allow-reenroll"), "{again}");
        let reenroll = c.token(&["--allow-reenroll"])?;
        let second = c.enroll("m1", &reenroll, tmp().path())?;
        assert_eq!(second.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 200);
        let old = first.get("/v1/agent/spec?timeoutSeconds=1").await?;
        assert_eq!(old.status, 403, "the replaced certificate no longer acts as the machine: {}", old.text);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn identities_reach_only_what_they_may(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let token = c.token(&["--usages", "2"])?;
        let m1 = c.enroll("m1", &token, tmp().path())?;
        c.enroll("m2", &token, tmp().path())?;
        let before = revision(&admin).await?;
        // A machine reads its own spec, and nothing of the admin API.
        let own = m1.get("/v1/agent/spec?timeoutSeconds=1").await?;
        assert_eq!(own.body["name"], "m1");
        for (method, path) in [("GET", "/v1/machines/m2"), ("GET", "/v1/machines"), ("GET", "/v1/tokens"), ("GET", "/metrics")] {
            let a = m1.request(method.parse()?, path, None).await?;
            assert_eq!(a.status, 403, "{method} {path}: {}", a.text);
        }
        let write = m1.put("/v1/machines/m2", &machine_json("m2", json!({}), json!({}))).await?;
        assert_eq!(write.status, 403);
        let tok = m1.post("/v1/tokens", &json!({})).await?;
        assert_eq!(tok.status, 403);
        // No certificate: 401 everywhere but enrollment and health.
        let anon = c.anonymous()?;
        assert_eq!(anon.get("/v1/machines").await?.status, 401);
        assert_eq!(anon.get("/v1/agent/spec").await?.status, 401);
        assert_eq!(anon.put("/v1/agent/status", &status_report(1)).await?.status, 401);
        // The admin is not a machine.
        assert_eq!(admin.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 403);
        // A certificate from another CA does not get through the TLS handshake.
        let other_dir = tmp();
        let other = Controller::start(other_dir.path(), &[])?;
        let foreign_conf =
            keelson_api::config::ClientConfig::from_yaml(&std::fs::read_to_string(other.admin_conf())?).map_err(anyhow::Error::msg)?;
        let foreign = ApiClient::new(&c.url, &c.ca_pem()?, Some((&foreign_conf.client_certificate, &foreign_conf.client_key)))?;
        assert!(foreign.get("/v1/machines").await.is_err(), "a foreign certificate must be refused");
        assert_eq!(revision(&admin).await?, before);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn long_poll_answers_within_a_second_of_a_change_and_status_never_moves_the_generation(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let token = c.token(&[])?;
        let m1 = c.enroll("m1", &token, tmp().path())?;
        let first = m1.get("/v1/agent/spec?after=0").await?;
        assert_eq!((first.body["changed"].clone(), first.body["generation"].clone()), (json!(true), json!(1)));
        // Nothing newer: waits the timeout, then says so.
        let started = Instant::now();
        let idle = m1.get("/v1/agent/spec?after=1&timeoutSeconds=1").await?;
        assert_eq!(idle.body["changed"], false);
        assert!(started.elapsed() >= Duration::from_millis(900), "answered too early: {:?}", started.elapsed());
        // A status write is not a spec change: the poll keeps waiting.
        assert_eq!(m1.put("/v1/agent/status", &status_report(1)).await?.status, 204);
        let m = admin.get("/v1/machines/m1").await?;
        assert_eq!(m.body["metadata"]["generation"], 1);
        assert_eq!(m.body["status"]["observedGeneration"], 1);
        assert_eq!(m.body["status"]["versions"]["containerRuntime"], "1.6.20~ds1-1+deb12u3");
        let ahead = m1.put("/v1/agent/status", &status_report(5)).await?;
        assert_eq!(ahead.status, 400, "observedGeneration newer than the generation is refused");
        // A spec change reaches a waiting agent at once.
        let poller = {
            let m1 = m1.clone();
            tokio::spawn(async move {
                let a = m1.get("/v1/agent/spec?after=1&timeoutSeconds=30").await;
                (Instant::now(), a)
            })
        };
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!poller.is_finished(), "the poll must wait for a change");
        let changed_at = Instant::now();
        let a = admin.put("/v1/machines/m1", &machine_json("m1", json!({}), runtime_spec("1.6.20~ds1-1+deb12u3"))).await?;
        assert_eq!(a.status, 200);
        let (answered_at, answer) = poller.await?;
        let answer = answer?;
        assert_eq!(answer.body["changed"], true);
        assert_eq!(answer.body["generation"], 2);
        assert_eq!(answer.body["spec"]["containerRuntime"]["version"], "1.6.20~ds1-1+deb12u3");
        let latency = answered_at.duration_since(changed_at);
        assert!(latency < Duration::from_secs(1), "spec reached the agent after {latency:?}");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn acknowledged_writes_survive_sigkill(store) -> R {
        let dir = tmp();
        let mut c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let mut tasks = Vec::new();
        for i in 0..100 {
            let admin = admin.clone();
            tasks.push(tokio::spawn(async move {
                let name = format!("m{i:03}");
                admin
                    .put(
                        &format!("/v1/machines/{name}"),
                        &machine_json(&name, json!({"n": i.to_string()}), runtime_spec("1.6.20~ds1-1+deb12u2")),
                    )
                    .await
            }));
        }
        let mut acknowledged = 0;
        for t in tasks {
            if t.await??.status == 200 {
                acknowledged += 1;
            }
        }
        assert_eq!(acknowledged, 100);
        c.kill();
        c.restart()?;
        let admin = c.admin()?;
        let list = admin.get("/v1/machines").await?;
        assert_eq!(list.body["items"].as_array().map(Vec::len), Some(100), "every acknowledged write is back after SIGKILL");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn pools_propagate_templates_and_release_machines(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        admin.put("/v1/machines/w1", &machine_json("w1", json!({"pool": "workers"}), json!({}))).await?;
        admin.put("/v1/machines/w2", &machine_json("w2", json!({"pool": "workers"}), json!({}))).await?;
        admin.put("/v1/machines/loner", &machine_json("loner", json!({}), runtime_spec("1.6.20~ds1-1+deb12u2"))).await?;
        let pool = |version: &str| {
            json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": "workers"},
                   "spec": {"selector": {"matchLabels": {"pool": "workers"}}, "template": {"spec": runtime_spec(version)}}})
        };
        // Machines joining a pool get its template at once (a rollout paces later revisions:
        // see tests/rollout.rs).
        let p = admin.put("/v1/pools/workers", &pool("1.6.20~ds1-1+deb12u3")).await?;
        assert_eq!(p.body["status"]["revision"], 1);
        for name in ["w1", "w2"] {
            let m = admin.get(&format!("/v1/machines/{name}")).await?;
            assert_eq!(m.body["spec"]["containerRuntime"]["version"], "1.6.20~ds1-1+deb12u3", "{name}");
            assert_eq!(m.body["metadata"]["generation"], 2, "{name}: empty spec, then the pool's template");
            assert_eq!((m.body["status"]["pool"].as_str(), m.body["status"]["poolRevision"].as_u64()), (Some("workers"), Some(1)), "{name}");
        }
        let loner = admin.get("/v1/machines/loner").await?;
        assert_eq!(loner.body["spec"]["containerRuntime"]["version"], "1.6.20~ds1-1+deb12u2", "a machine in no pool keeps its spec");
        // Giving a pool member its own spec is refused: the pool owns it.
        let own = admin.put("/v1/machines/w1", &machine_json("w1", json!({"pool": "workers"}), runtime_spec("1.6.20~ds1-1+deb12u2"))).await?;
        assert_eq!(own.status, 400);
        assert!(own.text.contains("belongs to pool workers"), "{}", own.text);
        let status = admin.get("/v1/pools/workers").await?;
        assert_eq!(status.body["status"]["machines"], 2);
        // Deleting the pool leaves the machines with the spec they had.
        let del = admin.request(reqwest::Method::DELETE, "/v1/pools/workers", None).await?;
        assert_eq!(del.status, 204);
        let w1 = admin.get("/v1/machines/w1").await?;
        assert_eq!(w1.body["spec"]["containerRuntime"]["version"], "1.6.20~ds1-1+deb12u3");
        assert!(w1.body["status"]["pool"].is_null());
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn a_history_of_large_events_keeps_its_newest_past_the_store_request_limit(store) -> R {
        // 240 events with messages of 8,000 bytes: about 1.9 MB, past etcd's 1.5 MiB limit
        // on one request, which a history kept as one value would meet at about 190 events.
        // A history of such long events keeps its newest that 11 segments of 64 KiB hold.
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let m1 = c.enroll("m1", &c.token(&[])?, tmp().path())?;
        for batch in 0..4 {
            let events: Vec<serde_json::Value> = (0..60)
                .map(|i| {
                    let n = batch * 60 + i;
                    json!({"time": "2026-12-06T00:00:00Z", "type": "Normal", "reason": "Step",
                           "message": format!("{n:04} {}", "x".repeat(7_995)), "source": "agent"})
                })
                .collect();
            let answer = m1.post("/v1/agent/events", &json!({"events": events})).await?;
            assert_eq!(answer.status, 204, "batch {batch}: {}", answer.text);
        }
        let history = admin.get("/v1/machines/m1/events").await?;
        assert_eq!(history.status, 200, "{}", history.text);
        let steps: Vec<&str> = history
            .body
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["reason"] == "Step")
            .filter_map(|e| e["message"].as_str()?.get(..4))
            .collect();
        assert!((80..=100).contains(&steps.len()), "{} kept", steps.len());
        let expected: Vec<String> = (240 - steps.len()..240).map(|n| format!("{n:04}")).collect();
        assert_eq!(steps, expected, "the newest, oldest first");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn silent_machines_become_unreachable_and_come_back(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &["--unreachable-after-seconds", "1"])?;
        let admin = c.admin()?;
        let token = c.token(&[])?;
        let m1 = c.enroll("m1", &token, tmp().path())?;
        let reachable = |body: &serde_json::Value| {
            body["status"]["conditions"].as_array().and_then(|cs| cs.iter().find(|c| c["type"] == "Reachable").map(|c| c["status"].clone()))
        };
        // Heartbeats that change nothing else keep it reachable, for three times the timeout.
        let report = status_report(1);
        let heartbeats_until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < heartbeats_until {
            assert_eq!(m1.put("/v1/agent/status", &report).await?.status, 204);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let m = admin.get("/v1/machines/m1").await?;
        assert_eq!(reachable(&m.body), Some(json!("True")), "{}", m.text);
        let events = admin.get("/v1/machines/m1/events").await?;
        assert!(!events.text.contains("Unreachable"), "{}", events.text);
        // Then silence.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let m = admin.get("/v1/machines/m1").await?;
            if reachable(&m.body) == Some(json!("False")) {
                assert_eq!(m.body["status"]["phase"], "Unreachable");
                break;
            }
            assert!(Instant::now() < deadline, "m1 never became unreachable: {}", m.text);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        m1.put("/v1/agent/status", &status_report(1)).await?;
        let m = admin.get("/v1/machines/m1").await?;
        assert_eq!(reachable(&m.body), Some(json!("True")));
        let events = admin.get("/v1/machines/m1/events").await?;
        assert!(events.text.contains("Unreachable"), "{}", events.text);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn an_idle_heartbeat_moves_the_heartbeat_time_and_leaves_the_machine_as_it_was(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let token = c.token(&[])?;
        let m1 = c.enroll("m1", &token, tmp().path())?;
        let report = status_report(1);
        assert_eq!(m1.put("/v1/agent/status", &report).await?.status, 204);
        let heartbeat = |body: &serde_json::Value| -> anyhow::Result<time::OffsetDateTime> {
            let text = body["status"]["lastHeartbeatTime"].as_str().ok_or_else(|| anyhow::anyhow!("no lastHeartbeatTime: {body}"))?;
            Ok(time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)?)
        };
        let before = admin.get("/v1/machines/m1").await?;
        let rv = revision(&admin).await?;
        let watch = admin.http.get(format!("{}/v1/machines?watch=true&resourceVersion={rv}", admin.base)).send().await?;
        assert_eq!(watch.status().as_u16(), 200);

        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(m1.put("/v1/agent/status", &report).await?.status, 204, "the same report again: a heartbeat");
        let after = admin.get("/v1/machines/m1").await?;
        assert_eq!(after.body["metadata"]["resourceVersion"], before.body["metadata"]["resourceVersion"], "{}", after.text);
        assert!(heartbeat(&after.body)? > heartbeat(&before.body)?, "before: {}\nafter: {}", before.text, after.text);
        let listed = admin.get("/v1/machines").await?;
        assert_eq!(listed.body["items"][0]["status"]["lastHeartbeatTime"], after.body["status"]["lastHeartbeatTime"], "{}", listed.text);

        // A report that changes something writes the machine; the watch's first event is that
        // change, not the heartbeat before it.
        let mut converging = report.clone();
        converging["phase"] = json!("Converging");
        assert_eq!(m1.put("/v1/agent/status", &converging).await?.status, 204);
        let changed = admin.get("/v1/machines/m1").await?;
        assert_ne!(changed.body["metadata"]["resourceVersion"], after.body["metadata"]["resourceVersion"]);
        assert_eq!(changed.body["status"]["phase"], "Converging");
        assert!(heartbeat(&changed.body)? > heartbeat(&after.body)?, "{}", changed.text);
        let first = WatchEvents::new(watch).next(Duration::from_secs(5)).await?;
        assert_eq!(first["object"]["status"]["phase"], "Converging", "{first}");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn watch_streams_changes_after_a_resource_version(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        admin.put("/v1/machines/a", &machine_json("a", json!({}), json!({}))).await?;
        let rv = revision(&admin).await?;
        let response = admin.http.get(format!("{}/v1/machines?watch=true&resourceVersion={rv}", admin.base)).send().await?;
        assert_eq!(response.status().as_u16(), 200);
        admin.put("/v1/machines/b", &machine_json("b", json!({}), json!({}))).await?;
        admin.put("/v1/machines/a", &machine_json("a", json!({}), runtime_spec("1.6.20~ds1-1+deb12u2"))).await?;
        let mut watch = WatchEvents::new(response);
        let events = [watch.next(Duration::from_secs(5)).await?, watch.next(Duration::from_secs(5)).await?];
        assert_eq!((events[0]["type"].as_str(), events[0]["object"]["metadata"]["name"].as_str()), (Some("ADDED"), Some("b")));
        assert_eq!((events[1]["type"].as_str(), events[1]["object"]["metadata"]["generation"].as_u64()), (Some("MODIFIED"), Some(2)));
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn metrics_count_requests_and_machines_by_condition(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let token = c.token(&[])?;
        let m1 = c.enroll("m1", &token, tmp().path())?;
        m1.put("/v1/agent/status", &status_report(1)).await?;
        let text = admin.get("/metrics").await?.text;
        assert!(text.contains("keelson_http_requests_total{route=\"/v1/agent/status\",method=\"PUT\",code=\"204\"} 1"), "{text}");
        assert!(text.contains("keelson_http_request_duration_seconds_bucket"), "{text}");
        assert!(text.contains("keelson_machines_by_condition{condition=\"Ready\",status=\"True\"} 1"), "{text}");
        assert_eq!(c.anonymous()?.get("/metrics").await?.status, 401);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn agents_rotate_their_certificates_and_old_ones_stop_working(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let token = c.token(&[])?;
        let state = tmp();
        let first = c.enroll("m1", &token, state.path())?;
        let key_before = std::fs::read_to_string(state.path().join("machine.key"))?;
        let name: keelson_api::meta::Name = "m1".parse()?;
        let expiry = keelson_agent::enroll::certificate_expiry(state.path())?;
        let days = (expiry - time::OffsetDateTime::now_utc()).whole_days();
        assert!((29..=30).contains(&days), "machine certificates last 30 days, got {days}");
        let controller = keelson_agent::client::Controller::from_state(state.path(), std::slice::from_ref(&c.url))?;
        keelson_agent::enroll::rotate(state.path(), &controller, &name).await?;
        assert_ne!(std::fs::read_to_string(state.path().join("machine.key"))?, key_before, "a new key, made on the machine");
        let cert = std::fs::read_to_string(state.path().join("machine.crt"))?;
        let key = std::fs::read_to_string(state.path().join("machine.key"))?;
        let second = ApiClient::new(&c.url, &c.ca_pem()?, Some((&cert, &key)))?;
        assert_eq!(second.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 200, "the new identity works");
        assert_eq!(first.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 200, "the old one too, until the switch is done");
        // Rotating again with the second certificate retires the first.
        let controller = keelson_agent::client::Controller::from_state(state.path(), std::slice::from_ref(&c.url))?;
        keelson_agent::enroll::rotate(state.path(), &controller, &name).await?;
        assert_eq!(first.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 403, "two rotations back is revoked");
        let events = c.admin()?.get("/v1/machines/m1/events").await?;
        assert!(events.text.contains("CertificateRotated"), "{}", events.text);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn a_deleted_machine_is_reset_by_its_agent_before_it_goes(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let token = c.token(&["--usages", "2"])?;
        let m = c.enroll("m1", &token, tmp().path())?;
        // Deleting an enrolled machine asks its agent to reset it first.
        let out = c.cli(&["delete", "machine", "m1"])?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("machine/m1 is being deleted"), "{}", String::from_utf8_lossy(&out.stdout));
        let pending = admin.get("/v1/machines/m1").await?;
        assert_eq!(pending.body["status"]["phase"], "Deleting");
        assert!(pending.body["metadata"]["deletionTimestamp"].is_string(), "{}", pending.text);
        let spec = m.get("/v1/agent/spec?after=0&timeoutSeconds=1").await?;
        assert_eq!(spec.body["deleting"], true, "{}", spec.text);
        // Nothing may change it meanwhile; a reset it did not ask for is refused elsewhere.
        let apply = admin.put("/v1/machines/m1", &machine_json("m1", json!({}), json!({}))).await?;
        assert_eq!(apply.status, 409, "{}", apply.text);
        let bad = m.post("/v1/agent/reset", &json!({"summary": "x", "extra": 1})).await?;
        assert_eq!(bad.status, 400, "{}", bad.text);
        assert_eq!(m.post("/v1/agent/reset", &json!({"summary": "reset: removed package containerd"})).await?.status, 204);
        assert_eq!(admin.get("/v1/machines/m1").await?.status, 404);
        // The identity is revoked, and the reset stays in the machine's events.
        assert!(matches!(m.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 401 | 403));
        let events = c.cli(&["events", "machine/m1", "-o", "json"])?;
        let events: serde_json::Value = serde_json::from_slice(&events.stdout)?;
        let reasons: Vec<&str> = events.as_array().into_iter().flatten().filter_map(|e| e["reason"].as_str()).collect();
        assert!(reasons.ends_with(&["DeletionRequested", "Reset", "Deleted"]), "{reasons:?}");
        // A machine whose agent is gone for good: --force deletes at once.
        let m2 = c.enroll("m2", &token, tmp().path())?;
        let forced = c.cli(&["delete", "machine", "m2", "--force"])?;
        assert!(String::from_utf8_lossy(&forced.stdout).contains("machine/m2 deleted"));
        assert_eq!(admin.get("/v1/machines/m2").await?.status, 404);
        assert!(matches!(m2.get("/v1/agent/spec?timeoutSeconds=1").await?.status, 401 | 403));
        // A reset nobody asked for is refused, and changes nothing.
        let token3 = c.token(&[])?;
        let m3 = c.enroll("m3", &token3, tmp().path())?;
        let unasked = m3.post("/v1/agent/reset", &json!({"summary": "reset: nothing"})).await?;
        assert_eq!(unasked.status, 409, "{}", unasked.text);
        assert!(unasked.text.contains("machine m3 is not being deleted"), "{}", unasked.text);
        assert_eq!(admin.get("/v1/machines/m3").await?.status, 200);
        admin.put("/v1/machines/never", &machine_json("never", json!({}), json!({}))).await?;
        assert_eq!(admin.request(reqwest::Method::DELETE, "/v1/machines/never", None).await?.status, 204, "not enrolled: gone at once");
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn a_forced_etcd_leave_reaches_the_agent_of_a_machine_being_deleted(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let token = c.token(&["--usages", "2"])?;
        let etcd = c.enroll("etcd-1", &token, tmp().path())?;
        let _worker = c.enroll("worker-1", &token, tmp().path())?;
        let etcd_spec = json!({"roles": ["etcd"], "etcd": {"cluster": "main", "version": "3.4.23", "source": {"package": "etcd-server"}}});
        assert_eq!(admin.put("/v1/machines/etcd-1", &machine_json("etcd-1", json!({}), etcd_spec)).await?.status, 200);

        // Refused, and nothing changes: a machine without a member; both ways of forcing at once.
        let out = c.cli(&["delete", "machine", "worker-1", "--force-etcd-leave"])?;
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("forceEtcdLeave: machine worker-1 runs no etcd member"), "{out:?}");
        assert!(admin.get("/v1/machines/worker-1").await?.body["metadata"]["deletionTimestamp"].is_null());
        let both = admin.request(reqwest::Method::DELETE, "/v1/machines/etcd-1?force=true&forceEtcdLeave=true", None).await?;
        assert_eq!(both.status, 400, "{}", both.text);
        assert!(both.text.contains("forceEtcdLeave"), "{}", both.text);
        assert_eq!(admin.get("/v1/machines/etcd-1").await?.status, 200);

        // An ordinary deletion first: the agent is to leave only while quorum allows.
        assert!(c.cli(&["delete", "machine", "etcd-1"])?.status.success());
        let first = etcd.get("/v1/agent/spec?after=0&timeoutSeconds=1").await?;
        assert_eq!(first.body["deleting"], true, "{}", first.text);
        assert!(first.body.get("forceEtcdLeave").is_none(), "{}", first.text);
        // Its agent reports while the removal is refused: the machine stays Deleting.
        let generation = first.body["generation"].as_u64().unwrap_or_default();
        let status = json!({"phase": "Ready", "observedGeneration": generation});
        assert_eq!(etcd.put("/v1/agent/status", &status).await?.status, 204);
        assert_eq!(admin.get("/v1/machines/etcd-1").await?.body["status"]["phase"], "Deleting");

        // The operator forces it: a new generation wakes the waiting agent, which now may leave.
        let out = c.cli(&["delete", "machine", "etcd-1", "--force-etcd-leave"])?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let forced = etcd.get(&format!("/v1/agent/spec?after={generation}&timeoutSeconds=1")).await?;
        assert_eq!((forced.body["changed"].clone(), forced.body["forceEtcdLeave"].clone()), (json!(true), json!(true)), "{}", forced.text);
        let m = admin.get("/v1/machines/etcd-1").await?;
        assert_eq!(m.body["metadata"]["annotations"]["keelson.io/force-etcd-leave"], "true", "{}", m.text);
        let events = admin.get("/v1/machines/etcd-1/events").await?;
        assert!(events.text.contains("EtcdLeaveForced"), "{}", events.text);
        Ok(())
    }
}
