//! The controller drains a machine's Kubernetes node before its agent disrupts it, and brings
//! the node back before the disruption lease is free: against the API server double
//! (keelson_tests::kubeapi), which kubectl has checked, with the agent's side of the protocol
//! spoken over HTTP as an agent speaks it.

use std::time::{Duration, Instant};

use keelson_tests::kubeapi::KubeApi;
use keelson_tests::{Answer, ApiClient, Controller, status_report};
use serde_json::{Value, json};

type R = anyhow::Result<()>;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

fn owner(kind: &str, name: &str) -> Value {
    json!([{"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": format!("u-{name}"), "controller": true}])
}

fn web_pod(name: &str, node: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"app": "web"}, "ownerReferences": owner("ReplicaSet", "web-7d9")},
           "spec": {"nodeName": node, "containers": [{"name": "web", "image": "web:1"}]}})
}

/// Pods a drain leaves where they are: a DaemonSet's, a mirror, and an excluded one.
fn staying_pods(node: &str) -> Vec<Value> {
    vec![
        json!({"metadata": {"name": format!("logs-{node}"), "namespace": "kube-system", "ownerReferences": owner("DaemonSet", "logs")},
               "spec": {"nodeName": node, "containers": [{"name": "logs", "image": "logs:1"}]}}),
        json!({"metadata": {"name": format!("etcd-{node}"), "namespace": "kube-system", "annotations": {"kubernetes.io/config.mirror": "abc"}},
               "spec": {"nodeName": node, "containers": [{"name": "etcd", "image": "etcd:3.5"}]}}),
        json!({"metadata": {"name": format!("cache-{node}"), "annotations": {"keelson.io/exclude-from-drain": "true"}},
               "spec": {"nodeName": node, "containers": [{"name": "cache", "image": "cache:1"}]}}),
    ]
}

/// A controller with cluster `prod` (the double) registered and pool `workers` draining its
/// nodes, and machines enrolled in it whose agents report the given hostnames.
async fn fleet(
    c: &Controller,
    api: &KubeApi,
    states: &std::path::Path,
    drain: Value,
    hostnames: &[(&str, &str)],
) -> anyhow::Result<Vec<ApiClient>> {
    let admin = c.admin()?;
    let cluster = json!({"apiVersion": "keelson.io/v1alpha1", "kind": "KubernetesCluster", "metadata": {"name": "prod"},
                         "spec": {"kubeconfig": api.kubeconfig()}});
    let put = admin.put("/v1/clusters/prod", &cluster).await?;
    anyhow::ensure!(put.status == 200, "{}", put.text);
    let pool = json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": "workers"},
        "spec": {"selector": {"matchLabels": {"pool": "workers"}}, "template": {"spec": {"roles": ["worker"]}},
                 "rollout": {"maxUnavailable": 1}, "kubernetes": {"cluster": "prod", "drain": drain}}});
    let put = admin.put("/v1/pools/workers", &pool).await?;
    anyhow::ensure!(put.status == 200, "{}", put.text);
    let token = c.token(&["--usages", &hostnames.len().to_string(), "--labels", "pool=workers"])?;
    let mut machines = Vec::new();
    for (name, hostname) in hostnames {
        let m = c.enroll(name, &token, &states.join(name))?;
        let mut report = status_report(1);
        report["facts"] = json!({"hostname": hostname});
        let put = m.put("/v1/agent/status", &report).await?;
        anyhow::ensure!(put.status == 204, "{}", put.text);
        machines.push(m);
    }
    Ok(machines)
}

async fn ask(machine: &ApiClient) -> anyhow::Result<Answer> {
    machine.post("/v1/agent/disruptions", &json!({"reason": "restart the kubelet", "ttlSeconds": 30})).await
}

/// Asks for a lease as an agent does until it is granted: its id, and every "wait" answer on the way.
async fn granted(machine: &ApiClient, secs: u64) -> anyhow::Result<(String, Vec<String>)> {
    let request = json!({"reason": "restart the kubelet", "ttlSeconds": 30});
    let (lease, waits) = keelson_tests::lease_granted(machine, &request, secs).await?;
    Ok((lease["id"].as_str().unwrap_or_default().to_owned(), waits))
}

/// The machine's `Drained` condition: (status, reason, message).
async fn drained(admin: &ApiClient, machine: &str) -> anyhow::Result<(String, String, String)> {
    let m = admin.get(&format!("/v1/machines/{machine}")).await?;
    let conditions = m.body["status"]["conditions"].as_array().cloned().unwrap_or_default();
    let c = conditions.iter().find(|c| c["type"] == "Drained").cloned().unwrap_or(Value::Null);
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    Ok((text(&c["status"]), text(&c["reason"]), text(&c["message"])))
}

async fn leases(admin: &ApiClient) -> anyhow::Result<Vec<String>> {
    let answer = admin.get("/v1/leases").await?;
    Ok(answer.body.as_array().into_iter().flatten().filter_map(|l| l["machine"].as_str().map(str::to_owned)).collect())
}

async fn until<F, Fut>(what: &str, secs: u64, mut check: F) -> R
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<bool>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check().await? {
        anyhow::ensure!(Instant::now() < deadline, "{what} did not happen within {secs}s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

fn position(log: &[String], entry: &str) -> usize {
    log.iter().position(|l| l == entry).unwrap_or_else(|| panic!("{entry} is not in the log: {log:#?}"))
}

keelson_tests::on_both_stores! {
    #[tokio::test]
    async fn a_node_is_drained_within_its_budgets_and_back_and_ready_before_the_lease_is_free(store) -> R {
        let api = KubeApi::start().await?;
        api.with(|c| {
            c.add_node("n1", true);
            c.add_node("n2", true);
            c.add_daemonset("kube-system", "logs");
            for (name, node) in [("web-1", "n1"), ("web-2", "n1"), ("web-3", "n2")] {
                c.add_pod(web_pod(name, node));
            }
            for pod in staying_pods("n1") {
                c.add_pod(pod);
            }
            // Two of the three web pods stay healthy: n1's go one at a time, each after its
            // replacement elsewhere is Ready.
            c.add_pdb(json!({"metadata": {"name": "web"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}}}));
            c.replacement_ready_after = Some(Duration::from_millis(500));
        });
        let dir = tmp();
        let c = store.start(dir.path(), &[])?;
        let states = tmp();
        let admin = c.admin()?;
        let machines = fleet(&c, &api, states.path(), json!({"timeoutSeconds": 60}), &[("m1", "N1"), ("m2", "n2")]).await?;
        let (m1, m2) = (&machines[0], &machines[1]);

        let (lease, waits) = granted(m1, 40).await?;
        assert!(waits.first().is_some_and(|w| w.starts_with("draining node n1")), "{waits:#?}");
        assert!(waits.iter().any(|w| w.contains("default/web-2") && w.contains("disruption budget web")), "{waits:#?}");
        let log = api.with(|c| c.log.clone());
        let cordon = position(&log, "cordon n1");
        assert!(cordon < position(&log, "evict default/web-1") && cordon < position(&log, "evict default/web-2"), "{log:#?}");
        assert!(log.contains(&"refuse default/web-2".to_owned()), "the budget never held an eviction back: {log:#?}");
        let mut left = api.with(|c| c.pods_on("n1"));
        left.sort();
        assert_eq!(left, ["default/cache-n1", "kube-system/etcd-n1", "kube-system/logs-n1"], "granted before the node was empty");
        assert!(api.with(|c| c.unschedulable("n1")));
        let (status, reason, message) = drained(&admin, "m1").await?;
        assert_eq!((status.as_str(), reason.as_str()), ("True", "Drained"), "{message}");
        assert!(message.contains("3 pods left on it"), "{message}");

        // The pool's budget is taken: n2 is not touched.
        let wait = ask(m2).await?;
        assert_eq!(wait.status, 429, "{}", wait.text);
        assert!(wait.text.contains("1 of 1 allowed unavailable (m1)"), "{}", wait.text);

        // The kubelet restarts: n1 is NotReady when the agent's health check has passed and it
        // releases the lease. The node is uncordoned, but the lease stays until it is Ready.
        api.with(|c| c.set_node_ready("n1", false));
        let released = m1.request(reqwest::Method::DELETE, &format!("/v1/agent/disruptions/{lease}"), None).await?;
        assert_eq!(released.status, 204, "{}", released.text);
        until("uncordon n1", 10, || async { Ok(!api.with(|c| c.unschedulable("n1"))) }).await?;
        until("the Drained condition saying why", 10, || async {
            Ok(drained(&admin, "m1").await?.2 == "waiting for node n1 to be Ready")
        }).await?;
        assert_eq!(leases(&admin).await?, ["m1"]);
        assert!(ask(m2).await?.text.contains("1 of 1 allowed unavailable (m1)"));
        assert!(!api.with(|c| c.log.contains(&"cordon n2".to_owned())), "n2 was cordoned beyond the pool's budget");

        api.with(|c| c.set_node_ready("n1", true));
        until("the lease freed", 10, || async { Ok(leases(&admin).await?.is_empty()) }).await?;
        until("the Drained condition saying the node is back", 10, || async {
            let (status, reason, message) = drained(&admin, "m1").await?;
            Ok((status.as_str(), reason.as_str(), message.as_str()) == ("False", "Uncordoned", "node n1 is Ready and uncordoned"))
        })
        .await?;
        until("the drain's events", 10, || async {
            let events = admin.get("/v1/machines/m1/events").await?;
            Ok(["DrainStarted", "Drained", "DisruptionReleased", "Uncordoned"].iter().all(|r| events.text.contains(&format!("\"{r}\""))))
        })
        .await?;
        // Now the pool's next machine is drained.
        let wait = ask(m2).await?;
        assert!(wait.status == 429 && wait.text.contains("draining node n2"), "{}", wait.text);
        Ok(())
    }
}

#[tokio::test]
async fn a_drain_a_budget_blocks_gives_up_at_its_timeout_and_leaves_nodes_as_it_found_them() -> R {
    let api = KubeApi::start().await?;
    api.with(|c| {
        c.add_node("n1", true);
        c.add_node("n2", true);
        for name in ["web-1", "web-2", "web-3"] {
            c.add_pod(web_pod(name, "n1"));
        }
        // No controller would bring this one back.
        c.add_pod(json!({"metadata": {"name": "debug"}, "spec": {"nodeName": "n1", "containers": [{"name": "sh", "image": "busybox"}]}}));
        c.add_daemonset("kube-system", "logs");
        for pod in staying_pods("n2") {
            c.add_pod(pod);
        }
        c.add_pdb(json!({"metadata": {"name": "web"}, "spec": {"minAvailable": 3, "selector": {"matchLabels": {"app": "web"}}}}));
        // An operator cordoned n2 for reasons of their own.
        if let Some(n2) = c.nodes.get_mut("n2") {
            n2["spec"]["unschedulable"] = json!(true);
        }
    });
    let dir = tmp();
    let c = Controller::start(dir.path(), &[])?;
    let states = tmp();
    let admin = c.admin()?;
    let machines =
        fleet(&c, &api, states.path(), json!({"timeoutSeconds": 10, "retryAfterSeconds": 120}), &[("m1", "n1"), ("m2", "n2")]).await?;
    let (m1, m2) = (&machines[0], &machines[1]);

    let started = Instant::now();
    let deadline = started + Duration::from_secs(30);
    let last = loop {
        let answer = ask(m1).await?;
        anyhow::ensure!(answer.status == 429, "{}", answer.text);
        let message = answer.body["message"].as_str().unwrap_or_default().to_owned();
        if message.contains("gave up after 10s") {
            break message;
        }
        anyhow::ensure!(Instant::now() < deadline, "the drain did not give up within 30s: {message}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(started.elapsed() >= Duration::from_secs(10), "gave up early: {last}");
    assert!(last.contains("draining node n1 again at"), "{last}");
    for why in [
        "default/web-1: Cannot evict pod as it would violate the pod's disruption budget (The disruption budget web needs 3 healthy pods",
        "default/debug: no controller would recreate it",
    ] {
        assert!(last.contains(why), "{why}: {last}");
    }
    until("the Drained condition saying the drain gave up", 10, || async {
        let (status, reason, message) = drained(&admin, "m1").await?;
        Ok(status == "False" && reason == "DrainTimeout" && message.ends_with("node n1 uncordoned"))
    })
    .await?;
    let log = api.with(|c| c.log.clone());
    assert!(position(&log, "cordon n1") < position(&log, "uncordon n1"), "{log:#?}");
    assert!(!api.with(|c| c.unschedulable("n1")));
    assert_eq!(api.with(|c| c.pods_on("n1")).len(), 4, "a pod went although its budget forbade it");
    assert!(leases(&admin).await?.is_empty(), "the lease of a drain that gave up is still held");
    let again = ask(m1).await?;
    assert!(again.status == 429 && again.text.contains("again at"), "the drain started again at once: {}", again.text);

    // The budget is free for n2, which an operator had cordoned: drained, and left cordoned.
    let (lease, _) = granted(m2, 20).await?;
    let released = m2.request(reqwest::Method::DELETE, &format!("/v1/agent/disruptions/{lease}"), None).await?;
    assert_eq!(released.status, 204, "{}", released.text);
    until("the lease freed", 10, || async { Ok(leases(&admin).await?.is_empty()) }).await?;
    assert!(api.with(|c| c.unschedulable("n2")), "a node someone else cordoned was uncordoned");
    until("the Drained condition saying the node was left cordoned", 10, || async {
        let (_, reason, message) = drained(&admin, "m2").await?;
        Ok((reason.as_str(), message.as_str()) == ("Uncordoned", "node n2 is Ready and left cordoned, as it was before the drain"))
    })
    .await?;
    assert_eq!(api.with(|c| c.pods_on("n2")).len(), 3);
    Ok(())
}

#[tokio::test]
async fn pools_without_drain_and_bad_drain_settings_leave_nodes_alone() -> R {
    let api = KubeApi::start().await?;
    api.with(|c| {
        c.add_node("n1", true);
        c.add_pod(web_pod("web-1", "n1"));
    });
    let dir = tmp();
    let c = Controller::start(dir.path(), &[])?;
    let states = tmp();
    let admin = c.admin()?;
    let machines = fleet(&c, &api, states.path(), Value::Null, &[("m1", "n1")]).await?;
    // No drain configured: the lease is granted at once and the node is not touched.
    let answer = ask(&machines[0]).await?;
    assert_eq!(answer.status, 201, "{}", answer.text);
    assert!(api.with(|c| c.log.is_empty()), "{:?}", api.with(|c| c.log.clone()));

    let mut pool = admin.get("/v1/pools/workers").await?.body;
    pool["spec"]["kubernetes"]["drain"] = json!({"timeoutSeconds": 5, "retryAfterSeconds": 100000});
    let bad = admin.put("/v1/pools/workers", &pool).await?;
    assert_eq!(bad.status, 400, "{}", bad.text);
    for field in ["spec.kubernetes.drain.timeoutSeconds", "spec.kubernetes.drain.retryAfterSeconds"] {
        assert!(bad.text.contains(field), "{field}: {}", bad.text);
    }
    pool["spec"]["kubernetes"]["drain"] = json!({"timeout": 60});
    let unknown = admin.put("/v1/pools/workers", &pool).await?;
    assert!(unknown.status == 400 && unknown.text.contains("unknown field `timeout`"), "{}", unknown.text);
    assert!(admin.get("/v1/pools/workers").await?.body["spec"]["kubernetes"].get("drain").is_none(), "a refused pool was stored");
    Ok(())
}
