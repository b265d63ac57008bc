//! Kubernetes clusters registered on the controller: their kubeconfigs are read, kept and used
//! by the controller only, never served back and never reachable by an agent; pools link to
//! them. The kubeconfigs point at the API server double (keelson_tests::kubeapi).

use keelson_tests::kubeapi::KubeApi;

use serde_json::json;

type R = anyhow::Result<()>;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

fn cluster(name: &str, kubeconfig: &str) -> serde_json::Value {
    json!({"apiVersion": "keelson.io/v1alpha1", "kind": "KubernetesCluster", "metadata": {"name": name},
           "spec": {"kubeconfig": kubeconfig}})
}

fn pool(kubernetes: serde_json::Value) -> serde_json::Value {
    let mut p = json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": "workers"},
           "spec": {"selector": {"matchLabels": {"pool": "workers"}}, "template": {"spec": {"roles": ["worker"]}}}});
    if !kubernetes.is_null() {
        p["spec"]["kubernetes"] = kubernetes;
    }
    p
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn a_clusters_kubeconfig_is_kept_by_the_controller_and_never_served(store) -> R {
        let api = KubeApi::start().await?;
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let put = admin.put("/v1/clusters/prod", &cluster("prod", &api.kubeconfig())).await?;
        assert_eq!(put.status, 200, "{}", put.text);
        assert_eq!(put.body["status"]["server"], api.url.as_str(), "{}", put.text);
        assert_eq!((put.body["status"]["context"].as_str(), put.body["status"]["credential"].as_str()), (Some("double"), Some("token")));
        let got = admin.get("/v1/clusters/prod").await?;
        let listed = admin.get("/v1/clusters").await?;
        assert_eq!(listed.body["items"][0]["metadata"]["name"], "prod", "{}", listed.text);
        let table = c.cli(&["get", "clusters"])?;
        let table = String::from_utf8_lossy(&table.stdout).into_owned();
        assert!(table.contains("prod") && table.contains(&api.url), "{table}");
        for answer in [&put.text, &got.text, &listed.text, &table] {
            assert!(!answer.contains(&api.token) && !answer.contains("kubeconfig"), "the kubeconfig was served: {answer}");
        }

        // An agent reaches no cluster, and its spec carries none.
        let token = c.token(&["--labels", "pool=workers"])?;
        let states = tmp();
        let m = c.enroll("m1", &token, states.path())?;
        assert_eq!(m.get("/v1/clusters").await?.status, 403);
        assert_eq!(m.get("/v1/clusters/prod").await?.status, 403);
        assert_eq!(admin.put("/v1/pools/workers", &pool(json!({"cluster": "prod"}))).await?.status, 200);
        let spec = m.get("/v1/agent/spec").await?;
        assert_eq!(spec.status, 200, "{}", spec.text);
        assert!(!spec.text.contains(&api.token), "{}", spec.text);

        // Replacing the kubeconfig is an update: a new generation, the same uid.
        let again = admin.put("/v1/clusters/prod", &cluster("prod", &api.kubeconfig().replace("current-context: double\n", ""))).await?;
        assert_eq!(again.status, 200, "{}", again.text);
        assert_eq!(again.body["metadata"]["uid"], put.body["metadata"]["uid"]);
        assert_eq!(again.body["metadata"]["generation"], 2);
        Ok(())
    }
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn bad_clusters_and_links_are_refused_naming_the_field_and_change_nothing(store) -> R {
        let api = KubeApi::start().await?;
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let admin = c.admin()?;
        let plugin = api.kubeconfig().replace(&format!("token: {}", api.token), "exec:\n      command: aws");
        for (body, field, reason) in [
            (cluster("prod", &plugin), "spec.kubeconfig", "signs in through a plugin"),
            (cluster("prod", "not: [a kubeconfig"), "spec.kubeconfig", "not a kubeconfig"),
            (cluster("prod", ""), "spec.kubeconfig", "is required"),
            (json!({"apiVersion": "keelson.io/v1alpha1", "kind": "KubernetesCluster", "metadata": {"name": "prod"},
                    "spec": {"kubeconfig": api.kubeconfig(), "context": "staging"}}), "spec.kubeconfig", "has no context"),
            (json!({"apiVersion": "keelson.io/v1alpha1", "kind": "KubernetesCluster", "metadata": {"name": "prod"},
                    "spec": {"kubeconfig": api.kubeconfig(), "server": "x"}}), "spec", "unknown field `server`"),
        ] {
            let answer = admin.put("/v1/clusters/prod", &body).await?;
            assert_eq!(answer.status, 400, "{}", answer.text);
            assert!(answer.text.contains(field) && answer.text.contains(reason), "{field}: {reason}: {}", answer.text);
        }
        assert_eq!(admin.get("/v1/clusters/prod").await?.status, 404, "a refused cluster was stored");
        let out = c.cli(&["cluster", "register", "prod", "--kubeconfig", "/nonexistent/kubeconfig"])?;
        assert!(!out.status.success());

        // A pool links only to a registered cluster.
        let unknown = admin.put("/v1/pools/workers", &pool(json!({"cluster": "prod"}))).await?;
        assert_eq!(unknown.status, 400, "{}", unknown.text);
        assert!(unknown.text.contains("spec.kubernetes.cluster") && unknown.text.contains("no cluster prod"), "{}", unknown.text);
        assert_eq!(admin.get("/v1/pools/workers").await?.status, 404);

        // Registered through the CLI from a kubeconfig file; a linked cluster stays until
        // no pool links to it.
        let file = dir.path().join("kubeconfig");
        std::fs::write(&file, api.kubeconfig())?;
        let out = c.cli(&["cluster", "register", "prod", "--kubeconfig", &file.to_string_lossy()])?;
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(admin.put("/v1/pools/workers", &pool(json!({"cluster": "prod"}))).await?.status, 200);
        let linked = admin.request(reqwest::Method::DELETE, "/v1/clusters/prod", None).await?;
        assert_eq!(linked.status, 409, "{}", linked.text);
        assert!(linked.text.contains("linked to pool workers"), "{}", linked.text);
        assert_eq!(admin.get("/v1/clusters/prod").await?.status, 200);
        assert_eq!(admin.put("/v1/pools/workers", &pool(serde_json::Value::Null)).await?.status, 200);
        assert_eq!(admin.request(reqwest::Method::DELETE, "/v1/clusters/prod", None).await?.status, 204);
        assert_eq!(admin.get("/v1/clusters/prod").await?.status, 404);
        Ok(())
    }
}

fn kubelet_pool(name: &str, role: &str, version: &str) -> serde_json::Value {
    json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": name},
           "spec": {"selector": {"matchLabels": {"pool": name}}, "kubernetes": {"cluster": "prod"},
                    "template": {"spec": {"roles": [role], "kubelet": {"version": version, "source": {"package": "kubelet"}}}}}})
}

#[tokio::test]
async fn the_version_skew_policy_holds_kubelets_to_the_api_server() -> R {
    let api = KubeApi::start().await?;
    let dir = tmp();
    let c = keelson_tests::Controller::start(dir.path(), &[])?;
    let admin = c.admin()?;
    assert_eq!(admin.put("/v1/clusters/prod", &cluster("prod", &api.kubeconfig())).await?.status, 200);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while admin.get("/v1/clusters/prod").await?.body["status"]["serverVersion"] != "v1.30.4" {
        anyhow::ensure!(std::time::Instant::now() < deadline, "the API server's version was not read");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    // Refused when applied: a kubelet newer than the API server with no control plane
    // heading there, and one more than three minors older.
    for (version, why) in
        [("v1.31.0", "newer than cluster prod's API server (v1.30.4)"), ("v1.26.9", "more than three minor versions older")]
    {
        let bad = admin.put("/v1/pools/workers", &kubelet_pool("workers", "worker", version)).await?;
        assert_eq!(bad.status, 400, "{}", bad.text);
        assert!(bad.text.contains("spec.template.spec.kubelet.version") && bad.text.contains(why), "{}", bad.text);
    }
    assert_eq!(admin.get("/v1/pools/workers").await?.status, 404);

    // A worker at v1.30.4, then the control plane and the workers both bound for v1.31: the
    // workers wait for the API server.
    assert_eq!(admin.put("/v1/pools/workers", &kubelet_pool("workers", "worker", "v1.30.4")).await?.status, 200);
    let token = c.token(&["--labels", "pool=workers"])?;
    let states = tmp();
    let m = c.enroll("w1", &token, states.path())?;
    let generation = admin.get("/v1/machines/w1").await?.body["metadata"]["generation"].as_u64().unwrap_or_default();
    assert_eq!(m.put("/v1/agent/status", &keelson_tests::status_report(generation)).await?.status, 204);
    assert_eq!(admin.put("/v1/pools/cp", &kubelet_pool("cp", "control-plane", "v1.31.0")).await?.status, 200);
    let applied = admin.put("/v1/pools/workers", &kubelet_pool("workers", "worker", "v1.31.0")).await?;
    assert_eq!(applied.status, 200, "{}", applied.text);
    let held = keelson_tests::wait_for_pool(&admin, "workers", "the rollout held", 10, |p| {
        p["status"]["message"].as_str().is_some_and(|m| m.contains("would be newer than cluster prod's API server (v1.30.4)"))
    })
    .await?;
    assert_eq!(held["status"]["waiting"], 1, "{}", held["status"]);

    // The control plane is upgraded; the controller reads the new version (here at once: the
    // cluster's kubeconfig is registered again), and the workers move.
    api.with(|c| c.version = "v1.31.1".into());
    assert_eq!(admin.put("/v1/clusters/prod", &cluster("prod", &api.kubeconfig())).await?.status, 200);
    keelson_tests::wait_for_pool(&admin, "workers", "the rollout moving", 20, |p| p["status"]["waiting"] == 0).await?;
    assert_eq!(admin.get("/v1/machines/w1").await?.body["spec"]["kubelet"]["version"], "v1.31.0");
    Ok(())
}
