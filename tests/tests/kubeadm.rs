//! kubeadm upgrades across a cluster's machines: the controller tells the first control-plane
//! machine to reach a version to run `kubeadm upgrade apply`, holds the other control-plane
//! machines until the API server reports that version, then tells them (and the workers)
//! `kubeadm upgrade node`. The API server is the double (keelson_tests::kubeapi); the agents'
//! side of the protocol is spoken over HTTP as an agent speaks it.

use std::time::{Duration, Instant};

use keelson_tests::kubeapi::KubeApi;
use keelson_tests::{Answer, ApiClient, Controller};
use serde_json::{Value, json};

type R = anyhow::Result<()>;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

fn pool(name: &str, role: &str, max_unavailable: u32) -> Value {
    json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": name},
           "spec": {"selector": {"matchLabels": {"pool": name}}, "kubernetes": {"cluster": "prod"},
                    "rollout": {"maxUnavailable": max_unavailable},
                    "template": {"spec": {"roles": [role], "kubeadm": {"version": "v1.31.2", "source": {"package": "kubeadm"}}}}}})
}

fn request() -> Value {
    json!({"reason": "upgrade the node with kubeadm v1.31.2", "ttlSeconds": 60})
}

async fn ask(machine: &ApiClient) -> anyhow::Result<Answer> {
    machine.post("/v1/agent/disruptions", &request()).await
}

/// Asks as an agent does until a lease is granted: the lease, and every "wait" on the way.
async fn granted(machine: &ApiClient, secs: u64) -> anyhow::Result<(Value, Vec<String>)> {
    keelson_tests::lease_granted(machine, &request(), secs).await
}

/// The machine reports itself Ready at its current generation.
async fn ready(admin: &ApiClient, name: &str, machine: &ApiClient) -> R {
    let generation = admin.get(&format!("/v1/machines/{name}")).await?.body["metadata"]["generation"].as_u64().unwrap_or_default();
    let put = machine.put("/v1/agent/status", &keelson_tests::status_report(generation)).await?;
    anyhow::ensure!(put.status == 204, "{}", put.text);
    Ok(())
}

#[tokio::test]
async fn one_control_plane_machine_applies_and_the_others_follow_with_upgrade_node() -> R {
    let api = KubeApi::start().await?;
    let dir = tmp();
    let c = Controller::start(dir.path(), &[])?;
    let admin = c.admin()?;
    let cluster = json!({"apiVersion": "keelson.io/v1alpha1", "kind": "KubernetesCluster", "metadata": {"name": "prod"},
                         "spec": {"kubeconfig": api.kubeconfig()}});
    assert_eq!(admin.put("/v1/clusters/prod", &cluster).await?.status, 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    while admin.get("/v1/clusters/prod").await?.body["status"]["serverVersion"] != "v1.30.4" {
        anyhow::ensure!(Instant::now() < deadline, "the API server's version was not read");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Three control-plane machines whose budget would let two go at once, and a worker pool
    // bound for the same kubeadm.
    assert_eq!(admin.put("/v1/pools/cp", &pool("cp", "control-plane", 2)).await?.status, 200);
    let token = c.token(&["--usages", "3", "--labels", "pool=cp"])?;
    let states = tmp();
    let cp: Vec<ApiClient> =
        ["cp-1", "cp-2", "cp-3"].iter().map(|n| c.enroll(n, &token, &states.path().join(n))).collect::<Result<_, _>>()?;
    for (name, m) in ["cp-1", "cp-2", "cp-3"].iter().zip(&cp) {
        ready(&admin, name, m).await?;
    }
    let mut workers = pool("workers", "worker", 1);
    workers["spec"]["template"]["spec"] = json!({"roles": ["worker"]});
    assert_eq!(admin.put("/v1/pools/workers", &workers).await?.status, 200);
    let worker_token = c.token(&["--labels", "pool=workers"])?;
    let worker = c.enroll("w-1", &worker_token, &states.path().join("w-1"))?;
    ready(&admin, "w-1", &worker).await?;
    let applied = admin.put("/v1/pools/workers", &pool("workers", "worker", 1)).await?;
    assert_eq!(applied.status, 200, "{}", applied.text);
    keelson_tests::wait_for_pool(&admin, "workers", "the workers held for the control plane", 10, |p| {
        p["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("kubeadm v1.31.2 would be newer than cluster prod's API server (v1.30.4)"))
    })
    .await?;

    // The first to ask runs upgrade apply; the others wait for it, whatever the budget allows.
    let (apply, _) = granted(&cp[1], 5).await?;
    assert_eq!(apply["kubeadm"], "apply", "{apply}");
    let refused = ask(&cp[0]).await?;
    assert_eq!(refused.status, 429, "{}", refused.text);
    assert_eq!(
        refused.body["message"], "waiting for cp-2 to run kubeadm upgrade apply v1.31.2 (cluster prod's API server reports v1.30.4)",
        "{}",
        refused.text
    );
    // Asking again while holding it: the same lease, the same word.
    let (again, _) = granted(&cp[1], 5).await?;
    assert_eq!((&again["id"], &again["kubeadm"]), (&apply["id"], &apply["kubeadm"]));

    // cp-2's upgrade apply takes the API server to v1.31.2. The controller reads it while the
    // upgrade is under way (no re-registration needed), and the others upgrade their nodes.
    api.with(|c| c.version = "v1.31.2".into());
    let started = Instant::now();
    let (node, waits) = granted(&cp[0], 10).await?;
    assert_eq!(node["kubeadm"], "node", "{node}");
    assert!(started.elapsed() < Duration::from_secs(8), "the new version took {:?} to be read", started.elapsed());
    assert!(waits.iter().all(|w| w.starts_with("waiting for cp-2 to run kubeadm upgrade apply")), "{waits:#?}");
    assert_eq!(admin.get("/v1/clusters/prod").await?.body["status"]["serverVersion"], "v1.31.2");
    for (m, lease) in [(&cp[1], &apply), (&cp[0], &node)] {
        let id = lease["id"].as_str().unwrap_or_default();
        let released = m.request(reqwest::Method::DELETE, &format!("/v1/agent/disruptions/{id}"), None).await?;
        assert_eq!(released.status, 204, "{}", released.text);
    }
    let (third, _) = granted(&cp[2], 5).await?;
    assert_eq!(third["kubeadm"], "node", "{third}");

    // The workers move now, and upgrade their nodes.
    keelson_tests::wait_for_pool(&admin, "workers", "the workers moving", 20, |p| p["status"]["waiting"] == 0).await?;
    assert_eq!(admin.get("/v1/machines/w-1").await?.body["spec"]["kubeadm"]["version"], "v1.31.2");
    let (w, _) = granted(&worker, 5).await?;
    assert_eq!(w["kubeadm"], "node", "{w}");
    Ok(())
}

#[tokio::test]
async fn kubeadm_specs_are_checked_when_applied() -> R {
    let dir = tmp();
    let c = Controller::start(dir.path(), &[])?;
    let admin = c.admin()?;
    let mut bad = pool("cp", "etcd", 1);
    bad["spec"]["kubernetes"] = Value::Null;
    bad["spec"]["template"]["spec"]["kubeadm"]["source"] = json!({"url": "https://example.invalid/kubeadm"});
    let answer = admin.put("/v1/pools/cp", &bad).await?;
    assert_eq!(answer.status, 400, "{}", answer.text);
    for field in ["spec.template.spec.kubeadm: needs role worker or control-plane", "spec.template.spec.kubeadm.source.sha256"] {
        assert!(answer.text.contains(field), "{field} in {}", answer.text);
    }
    // A kubelet ahead of kubeadm.
    let mut ahead = pool("cp", "control-plane", 1);
    ahead["spec"]["kubernetes"] = Value::Null;
    ahead["spec"]["template"]["spec"]["kubelet"] = json!({"version": "v1.32.0", "source": {"package": "kubelet"}});
    let answer = admin.put("/v1/pools/cp", &ahead).await?;
    assert_eq!(answer.status, 400, "{}", answer.text);
    assert!(answer.text.contains("spec.template.spec.kubelet.version: v1.32.0 is newer than kubeadm v1.31.2"), "{}", answer.text);
    // Skipping a minor.
    let mut good = pool("cp", "control-plane", 1);
    good["spec"]["kubernetes"] = Value::Null;
    assert_eq!(admin.put("/v1/pools/cp", &good).await?.status, 200);
    good["spec"]["template"]["spec"]["kubeadm"]["version"] = json!("v1.33.0");
    let answer = admin.put("/v1/pools/cp", &good).await?;
    assert_eq!(answer.status, 400, "{}", answer.text);
    assert!(
        answer.text.contains("spec.template.spec.kubeadm.version: kubeadm cannot skip a minor version (1.31 to 1.33)"),
        "{}",
        answer.text
    );
    assert_eq!(admin.get("/v1/pools/cp").await?.body["spec"]["template"]["spec"]["kubeadm"]["version"], "v1.31.2");

    // A control-plane machine in a pool linked to no cluster: no one can say it goes first.
    let token = c.token(&["--labels", "pool=cp"])?;
    let states = tmp();
    let m = c.enroll("cp-1", &token, states.path())?;
    let refused = ask(&m).await?;
    assert_eq!(refused.status, 429, "{}", refused.text);
    assert!(refused.text.contains("link its pool to a cluster (spec.kubernetes.cluster)"), "{}", refused.text);
    Ok(())
}
