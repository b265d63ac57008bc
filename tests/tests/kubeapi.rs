//! The Kubernetes API server double (`keelson_tests::kubeapi`) checked against Debian's kubectl
//! 1.20 (tests/fetch-kubectl): cordon, drain and uncordon do against it what they do against
//! a real cluster, and ask for nothing it does not serve.

use std::path::{Path, PathBuf};
use std::time::Duration;

use keelson_tests::kubeapi::KubeApi;
use serde_json::json;

type R = anyhow::Result<()>;

fn kubectl_path() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/kubectl/kubectl");
    assert!(path.exists(), "{} is missing: run tests/fetch-kubectl", path.display());
    path
}

struct Kubectl {
    dir: tempfile::TempDir,
}

struct Outcome {
    ok: bool,
    output: String,
}

impl Kubectl {
    fn new(api: &KubeApi) -> anyhow::Result<Kubectl> {
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("kubeconfig"), api.kubeconfig())?;
        Ok(Kubectl { dir })
    }

    async fn run(&self, args: &[&str]) -> anyhow::Result<Outcome> {
        let out = tokio::process::Command::new(kubectl_path())
            .arg("--kubeconfig")
            .arg(self.dir.path().join("kubeconfig"))
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .args(args)
            .env("HOME", self.dir.path())
            .kill_on_drop(true)
            .output()
            .await?;
        let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        Ok(Outcome { ok: out.status.success(), output })
    }
}

/// Two nodes; on n1 two pods of a ReplicaSet whose budget keeps two of its three healthy, a
/// DaemonSet's pod and a mirror pod.
async fn cluster() -> anyhow::Result<KubeApi> {
    let api = KubeApi::start().await?;
    api.with(|c| {
        c.add_node("n1", true);
        c.add_node("n2", true);
        c.add_daemonset("kube-system", "logs");
        let owner =
            |kind: &str, name: &str| json!([{"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": "u-1", "controller": true}]);
        for (name, node) in [("web-1", "n1"), ("web-2", "n1"), ("web-3", "n2")] {
            c.add_pod(json!({"metadata": {"name": name, "labels": {"app": "web"}, "ownerReferences": owner("ReplicaSet", "web-7d9")},
                             "spec": {"nodeName": node, "containers": [{"name": "web", "image": "web:1"}]}}));
        }
        c.add_pod(json!({"metadata": {"name": "logs-x1", "namespace": "kube-system", "ownerReferences": owner("DaemonSet", "logs")},
                         "spec": {"nodeName": "n1", "containers": [{"name": "logs", "image": "logs:1"}]}}));
        c.add_pod(
            json!({"metadata": {"name": "etcd-n1", "namespace": "kube-system", "annotations": {"kubernetes.io/config.mirror": "abc"}},
                         "spec": {"nodeName": "n1", "containers": [{"name": "etcd", "image": "etcd:3.5"}]}}),
        );
        c.add_pdb(json!({"metadata": {"name": "web"}, "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}}}));
        c.replacement_ready_after = Some(Duration::from_secs(1));
    });
    Ok(api)
}

#[tokio::test]
async fn kubectl_cordons_drains_one_pod_at_a_time_within_the_budget_and_uncordons() -> R {
    let api = cluster().await?;
    let kubectl = Kubectl::new(&api)?;

    let cordon = kubectl.run(&["cordon", "n1"]).await?;
    assert!(cordon.ok && cordon.output.contains("node/n1 cordoned"), "{}", cordon.output);
    assert!(api.with(|c| c.unschedulable("n1")));

    let drain = kubectl.run(&["drain", "n1", "--ignore-daemonsets", "--timeout", "60s"]).await?;
    assert!(drain.ok, "{}", drain.output);
    for line in [
        "WARNING: ignoring DaemonSet-managed Pods: kube-system/logs-x1",
        "evicting pod default/web-1",
        "evicting pod default/web-2",
        "Cannot evict pod as it would violate the pod's disruption budget.",
        "pod/web-1 evicted",
        "pod/web-2 evicted",
        // kubectl 1.20 says "evicted" of the node where later releases say "drained".
        "node/n1 evicted",
    ] {
        assert!(drain.output.contains(line), "kubectl drain did not say {line:?}:\n{}", drain.output);
    }
    // Only the DaemonSet's pod and the mirror pod stay; the budget let one web pod go, then
    // the other once the first one's replacement was Ready on n2.
    let (mut left, log, unserved) = api.with(|c| (c.pods_on("n1"), c.log.clone(), c.unserved.clone()));
    left.sort();
    assert_eq!(left, ["kube-system/etcd-n1", "kube-system/logs-x1"], "{log:?}");
    let at = |entry: &str| log.iter().position(|l| l == entry).unwrap_or_else(|| panic!("{entry} is not in {log:?}"));
    let (first, second) = if at("evict default/web-1") < at("evict default/web-2") { ("web-1", "web-2") } else { ("web-2", "web-1") };
    assert!(at(&format!("refuse default/{second}")) < at(&format!("evict default/{second}")), "{log:?}");
    assert!(at(&format!("gone default/{first}")) < at(&format!("evict default/{second}")), "{log:?}");
    // The second went only once the first one's replacement, on n2, was Ready.
    let replaced = log
        .iter()
        .position(|l| l.starts_with(&format!("ready default/{first}-r")))
        .unwrap_or_else(|| panic!("{first} was not replaced: {log:?}"));
    assert!(replaced < at(&format!("evict default/{second}")), "{log:?}");
    assert!(api.with(|c| c.pods.values().filter(|p| p["spec"]["nodeName"] == "n2").count()) >= 3, "replacements run on n2");

    let uncordon = kubectl.run(&["uncordon", "n1"]).await?;
    assert!(uncordon.ok && uncordon.output.contains("node/n1 uncordoned"), "{}", uncordon.output);
    assert!(!api.with(|c| c.unschedulable("n1")));
    assert_eq!(api.with(|c| c.log.iter().filter(|l| l.ends_with(" n1")).cloned().collect::<Vec<_>>()), ["cordon n1", "uncordon n1"]);
    assert!(unserved.is_empty(), "kubectl asked for what the double does not serve: {unserved:?}");
    Ok(())
}

#[tokio::test]
async fn kubectl_drain_gives_up_at_its_timeout_while_a_budget_blocks() -> R {
    let api = cluster().await?;
    // No replacements: the budget never frees a second pod.
    api.with(|c| c.replacement_ready_after = None);
    let kubectl = Kubectl::new(&api)?;
    // Without --ignore-daemonsets kubectl evicts nothing, as on a real cluster.
    let refused = kubectl.run(&["drain", "n1"]).await?;
    assert!(!refused.ok && refused.output.contains("kube-system/logs-x1"), "{}", refused.output);
    assert!(api.with(|c| c.log.iter().all(|l| !l.starts_with("evict"))), "{:?}", api.with(|c| c.log.clone()));

    let drain = kubectl.run(&["drain", "n1", "--ignore-daemonsets", "--timeout", "8s"]).await?;
    assert!(!drain.ok, "{}", drain.output);
    assert!(drain.output.contains("global timeout reached: 8s"), "{}", drain.output);
    let (left, log, unserved) = api.with(|c| (c.pods_on("n1"), c.log.clone(), c.unserved.clone()));
    assert_eq!(left.iter().filter(|p| p.starts_with("default/web-")).count(), 1, "one web pod went, one stays: {left:?} {log:?}");
    assert!(log.iter().filter(|l| l.starts_with("refuse default/web-")).count() >= 1, "{log:?}");
    assert!(api.with(|c| c.unschedulable("n1")), "drain cordons first and leaves the node cordoned");
    assert!(unserved.is_empty(), "{unserved:?}");
    Ok(())
}

#[tokio::test]
async fn the_double_wants_its_token() -> R {
    let api = KubeApi::start().await?;
    let kubectl = Kubectl::new(&api)?;
    std::fs::write(kubectl.dir.path().join("kubeconfig"), api.kubeconfig().replace(&api.token, "wrong"))?;
    let get = kubectl.run(&["get", "nodes"]).await?;
    assert!(!get.ok && get.output.contains("Unauthorized"), "{}", get.output);
    Ok(())
}
