//! keelson-kubeapi: the Kubernetes API server double (keelson_tests::kubeapi) as a process, for
//! the VM suite's `drain` scenario, where a controller on the build machine drains nodes whose
//! kubelets (the stand-in) run in guests. No real kube-apiserver can be had here (TESTBED.md).
//!
//! It serves, on loopback, one node per `--node` with the pods a drain meets: two pods of a
//! ReplicaSet whose PodDisruptionBudget lets one of its pods go at a time (an evicted pod is
//! replaced on another schedulable node, Ready a second later), and a DaemonSet's pod. It
//! writes a kubeconfig for it to `--kubeconfig`, and appends to `--log` every cordon,
//! eviction, refusal, deletion and uncordon as it happens, one JSON line each with the time it
//! was seen (within `POLL`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use keelson_tests::kubeapi::KubeApi;
use serde_json::json;

/// How often the double's log is read for new entries.
const POLL: Duration = Duration::from_millis(100);

#[derive(Parser)]
#[command(about = "Serve the Kubernetes API server double with the given nodes until killed")]
struct Args {
    /// Where to write the kubeconfig (CA and token embedded).
    #[arg(long)]
    kubeconfig: PathBuf,
    /// Where to append what clients did, one JSON line per entry.
    #[arg(long)]
    log: PathBuf,
    /// A node to serve (repeat); each gets the pods a drain meets.
    #[arg(long = "node", required = true)]
    nodes: Vec<String>,
    /// The version the API server reports.
    #[arg(long, default_value = "v1.30.4")]
    version: String,
    /// A kubeadm-made control plane at this version: kube-system/kubeadm-config names it, and
    /// the version reported follows what `kubeadm upgrade apply` writes there.
    #[arg(long)]
    kubeadm_version: Option<String>,
    /// Another address the certificate is for (repeat): the guests reach loopback as 10.0.2.2.
    #[arg(long = "san")]
    sans: Vec<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let api = KubeApi::start_with_names(&args.sans).await?;
    api.with(|c| {
        c.version = args.version.clone();
        if let Some(v) = &args.kubeadm_version {
            c.add_kubeadm_config(v);
        }
        c.add_daemonset("kube-system", "logs");
        let owner = |kind: &str, name: &str| json!([{"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": format!("u-{name}"), "controller": true}]);
        for node in &args.nodes {
            c.add_node(node, true);
            for i in 1..=2 {
                c.add_pod(json!({"metadata": {"name": format!("web-{node}-{i}"), "labels": {"app": "web"}, "ownerReferences": owner("ReplicaSet", "web-7d9")},
                                 "spec": {"nodeName": node, "containers": [{"name": "web", "image": "web:1"}]}}));
            }
            c.add_pod(json!({"metadata": {"name": format!("logs-{node}"), "namespace": "kube-system", "ownerReferences": owner("DaemonSet", "logs")},
                             "spec": {"nodeName": node, "containers": [{"name": "logs", "image": "logs:1"}]}}));
        }
        c.add_pdb(json!({"metadata": {"name": "web"}, "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": "web"}}}}));
        c.replacement_ready_after = Some(Duration::from_secs(1));
    });
    std::fs::write(&args.kubeconfig, api.kubeconfig())?;
    println!("keelson-kubeapi serving {} at {}", args.nodes.join(", "), api.url);
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(&args.log)?;
    let mut seen = 0;
    loop {
        let new: Vec<String> = api.with(|c| c.log[seen..].to_vec());
        seen += new.len();
        let time = time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339)?;
        for entry in new {
            writeln!(log, "{}", json!({"time": time, "entry": entry}))?;
        }
        tokio::time::sleep(POLL).await;
    }
}
