//! Rollouts across a fleet: machines enrolled with the real agent binary, then driven by
//! simulated agents that speak the agent protocol (long-poll for the spec, status reports)
//! and apply a generation at once — or fail it when the spec carries the file `/etc/fail`,
//! as a real agent fails a step. The operator side is the real CLI. Each test runs on both
//! stores (SQLite, and an etcd member of its own).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use keelson_tests::{ApiClient, status_report, wait_for_pool_web};
use serde_json::json;

type R = anyhow::Result<()>;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

fn degraded_report(generation: u64) -> serde_json::Value {
    let now = time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_default();
    json!({
        "phase": "Degraded",
        "observedGeneration": generation,
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "Degraded", "lastTransitionTime": now},
            {"type": "UpToDate", "status": "False", "reason": "StepFailed", "lastTransitionTime": now},
            {"type": "Degraded", "status": "True", "reason": "StepFailed", "message": "step 1/1 (write /etc/fail) failed: refused", "lastTransitionTime": now},
        ],
    })
}

/// A simulated agent: reports each new generation applied (or failed) after `work`, and
/// heartbeats with its last report while idle, as the real agent does.
async fn agent(client: ApiClient, work: Duration) -> anyhow::Result<()> {
    let mut after = 0u64;
    let mut report: Option<serde_json::Value> = None;
    loop {
        let a = client.get(&format!("/v1/agent/spec?after={after}&timeoutSeconds=1")).await?;
        if a.status != 200 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        if a.body["deleting"] == true {
            // As the real agent does after its reset.
            client.post("/v1/agent/reset", &json!({"summary": "reset: simulated"})).await?;
            return Ok(());
        }
        let generation = a.body["generation"].as_u64().unwrap_or(0);
        if generation != after || report.is_none() {
            after = generation;
            tokio::time::sleep(work).await;
            let fails = a.body["spec"]["files"].as_array().is_some_and(|fs| fs.iter().any(|f| f["path"] == "/etc/fail"));
            report = Some(if fails { degraded_report(generation) } else { status_report(generation) });
        }
        if let Some(r) = &report {
            client.put("/v1/agent/status", r).await?;
        }
    }
}

fn pool(files: serde_json::Value, rollout: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": "web"},
           "spec": {"selector": {"matchLabels": {"pool": "web"}}, "rollout": rollout,
                    "template": {"spec": {"roles": ["worker"], "files": files}}}})
}

fn file(path: &str, content: &str) -> serde_json::Value {
    json!({"path": path, "content": content})
}

fn condition(pool: &serde_json::Value, type_: &str) -> (String, String) {
    pool["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .map(|c| (c["status"].as_str().unwrap_or("").to_owned(), c["message"].as_str().unwrap_or("").to_owned()))
        .unwrap_or_default()
}

fn rolled_out(pool: &serde_json::Value) -> bool {
    condition(pool, "RolledOut") == ("True".into(), format!("revision {}", pool["status"]["revision"]))
}

/// When each machine was given each pool revision, from the controller's SpecChanged events.
async fn given(admin: &ApiClient, names: &[String]) -> anyhow::Result<BTreeMap<String, Vec<(u64, time::OffsetDateTime)>>> {
    let mut out = BTreeMap::new();
    for n in names {
        let events = admin.get(&format!("/v1/machines/{n}/events")).await?;
        let mut times = Vec::new();
        for e in events.body.as_array().into_iter().flatten().filter(|e| e["reason"] == "SpecChanged") {
            let message = e["message"].as_str().unwrap_or("");
            let revision = message.rsplit(' ').next().and_then(|r| r.parse().ok()).unwrap_or(0);
            let time = time::OffsetDateTime::parse(e["time"].as_str().unwrap_or(""), &time::format_description::well_known::Rfc3339)?;
            times.push((revision, time));
        }
        out.insert(n.clone(), times);
    }
    Ok(out)
}

// Several threads: the simulated agents must keep running while the test waits on the CLI.
keelson_tests::on_both_stores! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn canary_waves_halt_undo_and_pause_across_a_fleet(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &["--reconcile-interval-seconds", "1"])?;
        let admin = c.admin()?;
        let soak = 2;
        let rollout = json!({"maxUnavailable": 2, "maxFailures": 1, "waveLabel": "rack", "canary": {"machines": 1, "soakSeconds": soak}});
        assert_eq!(admin.put("/v1/pools/web", &pool(json!([file("/etc/motd", "one\n")]), rollout.clone())).await?.status, 200);

        // Six machines in two racks, each enrolled with the real agent, then simulated.
        let mut names = Vec::new();
        let mut agents = tokio::task::JoinSet::new();
        let states = tmp();
        for rack in ["r1", "r2"] {
            let token = c.token(&["--usages", "3", "--labels", &format!("pool=web,rack={rack}")])?;
            for i in 0..3 {
                let name = format!("{rack}-m{i}");
                let client = c.enroll(&name, &token, &states.path().join(&name))?;
                agents.spawn(agent(client, Duration::from_millis(300)));
                names.push(name);
            }
        }
        wait_for_pool_web(&admin, "revision 1 rolled out to the six machines", 60, |p| rolled_out(p) && p["status"]["machines"] == 6).await?;

        // Revision 2: the canary (r1-m0) alone, a soak, then rack r1, then rack r2, two at a time.
        admin.put("/v1/pools/web", &pool(json!([file("/etc/motd", "two\n")]), rollout.clone())).await?;
        wait_for_pool_web(&admin, "revision 2 rolled out", 60, rolled_out).await?;
        let times = given(&admin, &names).await?;
        let at = |n: &str, rev: u64| times[n].iter().find(|(r, _)| *r == rev).map(|(_, t)| *t);
        let canary = at("r1-m0", 2).ok_or_else(|| anyhow::anyhow!("the canary never got revision 2: {times:?}"))?;
        for n in names.iter().filter(|n| *n != "r1-m0") {
            let t = at(n, 2).ok_or_else(|| anyhow::anyhow!("{n} never got revision 2"))?;
            assert!(t - canary >= time::Duration::seconds(soak), "{n} got revision 2 {} after the canary, before the {soak}s soak", t - canary);
        }
        let last_r1 = ["r1-m1", "r1-m2"].iter().filter_map(|n| at(n, 2)).max();
        let first_r2 = ["r2-m0", "r2-m1", "r2-m2"].iter().filter_map(|n| at(n, 2)).min();
        assert!(last_r1 < first_r2, "rack r2 started before rack r1 was done: {times:?}");

        // Revision 3 fails on the canary: the rollout halts with the reason; nobody else moves.
        admin.put("/v1/pools/web", &pool(json!([file("/etc/fail", "x\n")]), rollout.clone())).await?;
        let halted = wait_for_pool_web(&admin, "a halt", 30, |p| condition(p, "RolloutHalted").0 == "True").await?;
        let (_, why) = condition(&halted, "RolloutHalted");
        assert!(why.contains("r1-m0: step 1/1 (write /etc/fail) failed"), "{why}");
        tokio::time::sleep(Duration::from_secs(2)).await;
        let times = given(&admin, &names).await?;
        let moved: Vec<&String> = names.iter().filter(|n| times[*n].iter().any(|(r, _)| *r == 3)).collect();
        assert_eq!(moved, vec!["r1-m0"], "only the canary was given the failing revision");
        let status = c.cli(&["rollout", "status", "pool/web"])?;
        assert_eq!(status.status.code(), Some(1), "status exits non-zero on a halted rollout");
        assert!(String::from_utf8_lossy(&status.stderr).contains("halted"), "{}", String::from_utf8_lossy(&status.stderr));

        // Undo brings the canary back to revision 2's template as revision 4.
        let undo = c.cli(&["rollout", "undo", "pool/web"])?;
        assert!(undo.status.success(), "{}", String::from_utf8_lossy(&undo.stderr));
        let done = wait_for_pool_web(&admin, "the undo rolled out", 30, rolled_out).await?;
        assert_eq!(done["status"]["revision"], 4);
        assert_eq!(done["spec"]["template"]["spec"]["files"][0]["content"], "two\n");
        let history = c.cli(&["rollout", "history", "pool/web", "-o", "json"])?;
        let history: serde_json::Value = serde_json::from_slice(&history.stdout)?;
        let causes: Vec<&str> = history.as_array().into_iter().flatten().filter_map(|r| r["cause"].as_str()).collect();
        assert_eq!(causes, vec!["applied", "applied", "applied", "undo to revision 2"]);
        // Machines that never left revision 2's template were not touched by the undo.
        let m = admin.get("/v1/machines/r2-m2").await?;
        assert_eq!(m.body["status"]["poolRevision"], 4);
        let times = given(&admin, &names).await?;
        assert!(times["r2-m2"].iter().all(|(r, _)| *r != 4), "r2-m2 got a new generation for a template it had: {times:?}");

        // Paused: a new revision reaches nobody until resumed; `status --watch` follows it to the end.
        assert!(c.cli(&["rollout", "pause", "pool/web"])?.status.success());
        let paused_rollout = json!({"maxUnavailable": 2, "maxFailures": 1, "waveLabel": "rack", "paused": true});
        admin.put("/v1/pools/web", &pool(json!([file("/etc/motd", "five\n")]), paused_rollout)).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let p = admin.get("/v1/pools/web").await?;
        assert_eq!((p.body["status"]["revision"].as_u64(), p.body["status"]["waiting"].as_u64()), (Some(5), Some(6)), "{}", p.body["status"]);
        assert_eq!(p.body["status"]["message"], "paused");
        // Re-applying a member (a new label) does not hand it the paused revision either.
        let before = admin.get("/v1/machines/r2-m2").await?;
        let relabelled = keelson_tests::machine_json("r2-m2", json!({"pool": "web", "rack": "r2", "owner": "ops"}), json!({}));
        assert_eq!(admin.put("/v1/machines/r2-m2", &relabelled).await?.status, 200);
        let after = admin.get("/v1/machines/r2-m2").await?;
        assert_eq!(after.body["metadata"]["generation"], before.body["metadata"]["generation"]);
        assert_eq!(after.body["spec"], before.body["spec"]);
        assert_eq!(after.body["metadata"]["labels"]["owner"], "ops");
        assert!(c.cli(&["rollout", "resume", "pool/web"])?.status.success());
        let watch = c.cli(&["rollout", "status", "pool/web", "--watch"])?;
        assert!(watch.status.success(), "{}", String::from_utf8_lossy(&watch.stderr));
        let out = String::from_utf8_lossy(&watch.stdout);
        assert!(out.trim_end().ends_with("rolled out"), "{out}");
        assert!(out.contains("revision 5 ["), "{out}");
        agents.abort_all();
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn bad_rollout_requests_are_refused_and_change_nothing(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let bad = admin.put("/v1/pools/web", &pool(json!([]), json!({"maxFailures": 0, "canary": {"machines": 0}}))).await?;
        assert_eq!(bad.status, 400);
        assert!(bad.text.contains("spec.rollout.maxFailures") && bad.text.contains("spec.rollout.canary.machines"), "{}", bad.text);
        assert_eq!(admin.get("/v1/pools/web").await?.status, 404);
        admin.put("/v1/pools/web", &pool(json!([file("/etc/motd", "one\n")]), json!({}))).await?;
        let undo = admin.post("/v1/pools/web/rollout/undo", &json!({})).await?;
        assert_eq!(undo.status, 400);
        assert!(undo.text.contains("no earlier revision"), "{}", undo.text);
        let undo = admin.post("/v1/pools/web/rollout/undo", &json!({"toRevision": 7})).await?;
        assert!(undo.text.contains("revision 7 of pool web is not in its history (kept: 1)"), "{}", undo.text);
        let unknown = admin.post("/v1/pools/web/rollout/undo", &json!({"toRevison": 1})).await?;
        assert_eq!(unknown.status, 400, "{}", unknown.text);
        let p = admin.get("/v1/pools/web").await?;
        assert_eq!((p.body["status"]["revision"].as_u64(), p.body["metadata"]["generation"].as_u64()), (Some(1), Some(1)));
        let out = c.cli(&["rollout", "status", "web"])?;
        assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("expected pool/NAME"));
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn leases_count_members_that_are_not_ready_and_wait_for_the_maintenance_window(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        admin.put("/v1/pools/web", &pool(json!([]), json!({"maxUnavailable": 1}))).await?;
        let token = c.token(&["--usages", "2", "--labels", "pool=web"])?;
        let states = tmp();
        let a = c.enroll("a", &token, &states.path().join("a"))?;
        let b = c.enroll("b", &token, &states.path().join("b"))?;
        let ask = json!({"reason": "restart containerd", "ttlSeconds": 60});
        // b reports Ready; a reports nothing yet, so it is not Ready and uses the one slot.
        b.put("/v1/agent/status", &status_report(2)).await?;
        let wait = b.post("/v1/agent/disruptions", &ask).await?;
        assert_eq!(wait.status, 429, "{}", wait.text);
        assert!(wait.text.contains("1 of 1 allowed unavailable (a (not Ready))"), "{}", wait.text);
        a.put("/v1/agent/status", &status_report(2)).await?;
        let granted = b.post("/v1/agent/disruptions", &ask).await?;
        assert_eq!(granted.status, 201, "{}", granted.text);
        let id = granted.body["id"].as_str().unwrap_or_default().to_owned();
        assert_eq!(b.request(reqwest::Method::DELETE, &format!("/v1/agent/disruptions/{id}"), None).await?.status, 204);

        // A window that is not open now (an hour that has just passed, every day, in UTC).
        let hour = time::OffsetDateTime::now_utc().hour();
        let (start, end) = (format!("{:02}:00", (hour + 22) % 24), format!("{:02}:00", (hour + 23) % 24));
        let window = json!({"days": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"], "start": start, "end": end, "timeZone": "UTC"});
        let bad = admin
            .put(
                "/v1/pools/web",
                &pool(json!([]), json!({"maintenanceWindows": [{"days": [], "start": "25:00", "end": "01:00", "timeZone": "Mars/Base"}]})),
            )
            .await?;
        assert_eq!(bad.status, 400);
        assert!(bad.text.contains("maintenanceWindows[0]"), "{}", bad.text);
        assert_eq!(admin.put("/v1/pools/web", &pool(json!([]), json!({"maintenanceWindows": [window]}))).await?.status, 200);
        let closed = b.post("/v1/agent/disruptions", &ask).await?;
        assert_eq!(closed.status, 429, "{}", closed.text);
        assert!(
            closed.text.contains(&format!("outside the maintenance windows (Mon,Tue,Wed,Thu,Fri,Sat,Sun {start}–{end} UTC)")),
            "{}",
            closed.text
        );
        Ok(())
    }
}

fn named_pool(name: &str, content: &str, rollout: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": name},
           "spec": {"selector": {"matchLabels": {"pool": name}}, "rollout": rollout,
                    "template": {"spec": {"roles": ["worker"], "files": [file("/etc/motd", content)]}}}})
}

keelson_tests::on_both_stores! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_pool_starts_only_when_the_pools_it_follows_have_rolled_out(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &["--reconcile-interval-seconds", "1"])?;
        let admin = c.admin()?;
        admin.put("/v1/pools/db", &named_pool("db", "one\n", json!({}))).await?;
        admin.put("/v1/pools/web", &named_pool("web", "one\n", json!({"after": ["db"]}))).await?;
        let states = tmp();
        let mut agents = tokio::task::JoinSet::new();
        for (pool, work_ms) in [("db", 3000), ("web", 100)] {
            let token = c.token(&["--usages", "1", "--labels", &format!("pool={pool}")])?;
            let client = c.enroll(&format!("{pool}-1"), &token, &states.path().join(pool))?;
            agents.spawn(agent(client, Duration::from_millis(work_ms)));
        }
        let converged_at = |name: &'static str, generation: u64| {
            let admin = admin.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    let m = admin.get(&format!("/v1/machines/{name}")).await?;
                    if m.body["status"]["observedGeneration"] == generation && m.body["metadata"]["generation"] == generation {
                        return anyhow::Ok(Instant::now());
                    }
                    anyhow::ensure!(Instant::now() < deadline, "{name} at generation {generation}: {}", m.body["status"]);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        converged_at("db-1", 2).await?;
        converged_at("web-1", 2).await?;
        // Both pools change together; web waits for db (3 s of work) to roll out.
        admin.put("/v1/pools/db", &named_pool("db", "two\n", json!({}))).await?;
        admin.put("/v1/pools/web", &named_pool("web", "two\n", json!({"after": ["db"]}))).await?;
        let web = admin.get("/v1/pools/web").await?;
        assert_eq!(web.body["status"]["message"], "waiting for pool db to roll out first", "{}", web.body["status"]);
        assert_eq!(admin.get("/v1/machines/web-1").await?.body["metadata"]["generation"], 2, "web-1 was given revision 2 before db rolled out");
        let db_done = converged_at("db-1", 3).await?;
        let web_done = converged_at("web-1", 3).await?;
        assert!(web_done > db_done);
        let times = given(&admin, &["db-1".to_owned(), "web-1".to_owned()]).await?;
        let db_given = times["db-1"].iter().find(|(r, _)| *r == 2).map(|(_, t)| *t);
        let web_given = times["web-1"].iter().find(|(r, _)| *r == 2).map(|(_, t)| *t);
        assert!(db_given.zip(web_given).is_some_and(|(d, w)| w - d >= time::Duration::seconds(3)), "{times:?}");
        agents.abort_all();
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn shrinking_a_pool_resets_marked_machines_first_then_by_order_one_at_a_time(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &["--reconcile-interval-seconds", "1"])?;
        let admin = c.admin()?;
        let web = |replicas: Option<u32>| {
            let mut p = pool(json!([file("/etc/motd", "one\n")]), json!({"maxUnavailable": 1}));
            p["spec"]["deletion"] = json!({"order": "Newest"});
            if let Some(r) = replicas {
                p["spec"]["replicas"] = json!(r);
            }
            p
        };
        admin.put("/v1/pools/web", &web(None)).await?;
        let token = c.token(&["--usages", "4", "--labels", "pool=web"])?;
        let states = tmp();
        let mut agents = tokio::task::JoinSet::new();
        for name in ["m1", "m2", "m3", "m4"] {
            let client = c.enroll(name, &token, &states.path().join(name))?;
            agents.spawn(agent(client, Duration::from_millis(100)));
            // Distinct creation times for the Newest order.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        wait_for_pool_web(&admin, "four machines rolled out", 30, |p| rolled_out(p) && p["status"]["machines"] == 4).await?;
        // m1 (the oldest) is marked: it goes first; then the newest, m4.
        let mut m1 = admin.get("/v1/machines/m1").await?.body;
        m1["metadata"]["annotations"] = json!({"keelson.io/delete-machine": "true"});
        m1["metadata"].as_object_mut().map(|o| o.remove("resourceVersion"));
        assert_eq!(admin.put("/v1/machines/m1", &m1).await?.status, 200);
        admin.put("/v1/pools/web", &web(Some(2))).await?;
        wait_for_pool_web(&admin, "two machines left", 30, |p| p["status"]["machines"] == 2).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while admin.get("/v1/machines/m4").await?.status != 404 || admin.get("/v1/machines/m1").await?.status != 404 {
            anyhow::ensure!(Instant::now() < deadline, "m1 and m4 were not both removed");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        for kept in ["m2", "m3"] {
            assert_eq!(admin.get(&format!("/v1/machines/{kept}")).await?.status, 200, "{kept}");
        }
        // One at a time (maxUnavailable 1): m4 was asked only after m1 had gone.
        let events = |name: &'static str| {
            let admin = admin.clone();
            async move { anyhow::Ok(admin.get(&format!("/v1/machines/{name}/events")).await?.body) }
        };
        let at = |events: &serde_json::Value, reason: &str| {
            events.as_array().into_iter().flatten().find(|e| e["reason"] == reason).and_then(|e| e["time"].as_str().map(str::to_owned))
        };
        let (e1, e4) = (events("m1").await?, events("m4").await?);
        let m1_gone = at(&e1, "Deleted").ok_or_else(|| anyhow::anyhow!("m1: {e1}"))?;
        let m4_asked = at(&e4, "ScaleIn").ok_or_else(|| anyhow::anyhow!("m4: {e4}"))?;
        let parse = |t: &str| time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339);
        assert!(parse(&m4_asked)? >= parse(&m1_gone)?, "m4 asked at {m4_asked}, m1 gone at {m1_gone}");
        assert!(at(&e4, "Reset").is_some(), "{e4}");
        agents.abort_all();
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_halted_rollout_with_auto_undo_rolls_itself_back_once(store) -> R {
        let dir = tmp();
        let c = store.start(dir.path(), &["--reconcile-interval-seconds", "1"])?;
        let admin = c.admin()?;
        let rollout = json!({"maxUnavailable": 1, "autoUndo": true});
        admin.put("/v1/pools/web", &pool(json!([file("/etc/motd", "good\n")]), rollout.clone())).await?;
        let token = c.token(&["--usages", "2", "--labels", "pool=web"])?;
        let states = tmp();
        let mut agents = tokio::task::JoinSet::new();
        for name in ["m1", "m2"] {
            agents.spawn(agent(c.enroll(name, &token, &states.path().join(name))?, Duration::from_millis(100)));
        }
        wait_for_pool_web(&admin, "revision 1 rolled out", 30, |p| rolled_out(p) && p["status"]["machines"] == 2).await?;
        admin.put("/v1/pools/web", &pool(json!([file("/etc/fail", "x\n")]), rollout)).await?;
        let back = wait_for_pool_web(&admin, "the automatic undo rolled out", 30, |p| p["status"]["revision"] == 3 && rolled_out(p)).await?;
        assert_eq!(back["spec"]["template"]["spec"]["files"][0]["path"], "/etc/motd");
        let history: serde_json::Value = serde_json::from_slice(&c.cli(&["rollout", "history", "pool/web", "-o", "json"])?.stdout)?;
        let cause = history[2]["cause"].as_str().unwrap_or_default();
        assert!(cause.starts_with("auto undo to revision 1: 1 of revision 2 failed"), "{cause}");
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(admin.get("/v1/pools/web").await?.body["status"]["revision"], 3, "undone once, and left there");
        agents.abort_all();
        Ok(())
    }
}
