//! Draining Kubernetes nodes around disruptions (DESIGN.md, "Kubernetes nodes").
//!
//! When a machine of a pool with `spec.kubernetes.drain` asks for a disruption lease and the
//! pool's budget allows it, the grant takes the budget slot at once but answers "wait": it
//! stores a drain record, `/drains/<machine>`, in phase `Draining`. The leader's drainer
//! then works on the node through the cluster's API server, with the kubeconfig only the
//! controller holds:
//!
//! 1. **Draining**: cordon the node (unless someone had cordoned it already: then it stays
//!    cordoned after, as they left it); evict its pods through the Eviction API, so that
//!    PodDisruptionBudgets decide (a 429 is retried with backoff); leave DaemonSet pods,
//!    mirror pods and pods annotated `keelson.io/exclude-from-drain: "true"`; refuse pods no
//!    controller would recreate, as `kubectl drain` does; wait until the evicted pods are
//!    gone. The machine's `Drained` condition says what is still in the way. Done: phase
//!    `Drained`, and the agent's next ask gets its lease.
//! 2. **Drained**: the agent disrupts the machine, renewing its lease. When it releases the
//!    lease (its health check passed), the lease stays held and the phase is `Uncordoning`.
//! 3. **Uncordoning**: uncordon the node and wait until it is Ready; only then are the lease
//!    and the record deleted, so the pool's next machine is not drained while this node is
//!    still coming back.
//!
//! A drain that does not finish within the pool's `timeoutSeconds` gives up: the node is
//! uncordoned, the lease deleted, and the record stays in phase `Failed` until
//! `retryAfterSeconds` pass, so the agent's asks wait rather than start a drain again at once.
//! While it drains or uncordons, the drainer renews the lease on the agent's behalf. A drain
//! whose lease is gone (it expired while no controller led) is abandoned the same way.
//!
//! Every step is idempotent and the phase is stored, so a new leader carries on from where
//! the last one stopped.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use keelson_api::cluster::KubernetesCluster;
use keelson_api::meta::{self, ConditionStatus, Name, Timestamp, annotation, condition};
use keelson_api::version::KubeVersion;
use kube::api::{Api, EvictParams, ListParams};
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::clusters::CLUSTERS;
use crate::error::ApiError;
use crate::http::App;
use crate::leases::{ApplyClaim, KUBEADM_APPLY, Lease};
use crate::registry::{Versioned, encode};
use crate::store::{Op, Precondition, StoreError};

pub const DRAINS: &str = "/drains/";

/// The annotation a kubelet puts on a static pod's mirror in the API server.
const MIRROR_POD: &str = "kubernetes.io/config.mirror";
/// Pause between a drain's steps while something is in the way (a budget refusing an
/// eviction, pods terminating, a node not Ready yet, an unreachable API server): from
/// `FIRST_BACKOFF`, doubled each step, at most `MAX_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How often the drainer looks for drains to work on, besides being woken.
const SCAN_EVERY: Duration = Duration::from_secs(2);
/// How often the clusters' API server versions are read (crate::clusters::skew_hold).
const VERSIONS_EVERY: Duration = Duration::from_secs(30);
/// Requests to the API server.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const READ_TIMEOUT: Duration = Duration::from_secs(30);

pub fn drain_key(machine: &Name) -> String {
    format!("{DRAINS}{machine}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DrainPhase {
    Draining,
    Drained,
    Uncordoning,
    Failed,
}

/// A machine's drain, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Drain {
    pub machine: Name,
    /// The disruption lease the drain is for, and its key.
    pub lease: String,
    pub lease_key: String,
    /// The lease time to live the agent asked for, for renewals made on its behalf.
    pub ttl_seconds: u64,
    pub cluster: Name,
    pub node: String,
    pub phase: DrainPhase,
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: Timestamp,
    pub timeout_seconds: u64,
    pub retry_after_seconds: u64,
    /// Whether the node was cordoned before this drain: `None` until the drainer looked.
    /// A node someone else cordoned is left cordoned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cordoned_before: Option<bool>,
    /// What the drain is doing or waiting for.
    #[serde(default)]
    pub message: String,
    /// Phase `Failed`: when the node may be drained again.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    pub retry_at: Option<Timestamp>,
}

impl Drain {
    /// What an agent asking for its lease is told while the drain is not done.
    pub fn waiting(&self) -> String {
        match self.phase {
            DrainPhase::Draining if self.message.is_empty() => format!("draining node {}", self.node),
            DrainPhase::Draining => format!("draining node {}: {}", self.node, self.message),
            DrainPhase::Uncordoning => format!("bringing node {} back after the last disruption: {}", self.node, self.message),
            DrainPhase::Failed => {
                let at = self
                    .retry_at
                    .and_then(|t| t.replace_nanosecond(0).ok())
                    .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
                    .unwrap_or_default();
                format!("{}; draining node {} again at {at}", self.message, self.node)
            }
            DrainPhase::Drained => format!("node {} is drained", self.node),
        }
    }

    fn deadline(&self) -> Timestamp {
        self.started_at + time::Duration::seconds(self.timeout_seconds as i64)
    }

    /// Whether the drain cordoned the node, so must uncordon it.
    fn cordoned_it(&self) -> bool {
        self.cordoned_before == Some(false)
    }
}

/// The pods on a node a drain looked at.
#[derive(Debug, Default, PartialEq)]
struct Round {
    /// Pods the drain still waits for, each with why.
    in_the_way: Vec<String>,
    /// Pods left on the node by rule (DaemonSet, mirror, excluded).
    left: usize,
}

/// How a pod is treated by a drain.
#[derive(Debug, PartialEq, Eq)]
enum Treatment {
    /// Stays on the node: why.
    Leave(&'static str),
    /// Would not come back if evicted: why.
    Refuse(&'static str),
    /// Already terminating: waited for.
    Terminating,
    Evict,
}

fn treatment(pod: &Pod) -> Treatment {
    let meta = &pod.metadata;
    let annotated = |key: &str, value: Option<&str>| {
        meta.annotations.as_ref().and_then(|a| a.get(key)).is_some_and(|v| value.is_none_or(|want| v == want))
    };
    if meta.deletion_timestamp.is_some() {
        return Treatment::Terminating;
    }
    if annotated(MIRROR_POD, None) {
        return Treatment::Leave("mirror pod");
    }
    let controller = meta.owner_references.iter().flatten().find(|o| o.controller == Some(true));
    if controller.is_some_and(|o| o.kind == "DaemonSet") {
        return Treatment::Leave("DaemonSet pod");
    }
    if annotated(annotation::EXCLUDE_FROM_DRAIN, Some("true")) {
        return Treatment::Leave("excluded");
    }
    let finished = pod.status.as_ref().and_then(|s| s.phase.as_deref()).is_some_and(|p| p == "Succeeded" || p == "Failed");
    if controller.is_none() && !finished {
        return Treatment::Refuse(
            "no controller would recreate it: delete it, or annotate it keelson.io/exclude-from-drain=true to leave it",
        );
    }
    Treatment::Evict
}

fn pod_name(pod: &Pod) -> String {
    format!("{}/{}", pod.metadata.namespace.as_deref().unwrap_or("default"), pod.metadata.name.as_deref().unwrap_or_default())
}

fn node_ready(node: &Node) -> bool {
    node.status.as_ref().and_then(|s| s.conditions.as_ref()).is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn kube_error(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => format!("{} ({})", status_message(status), status.code),
        other => other.to_string(),
    }
}

/// A Status's message with its causes: a refused eviction says which budget refused it there.
fn status_message(status: &kube::core::Status) -> String {
    let causes: Vec<&str> =
        status.details.iter().flat_map(|d| d.causes.iter()).map(|c| c.message.as_str()).filter(|m| !m.is_empty()).collect();
    if causes.is_empty() { status.message.clone() } else { format!("{} ({})", status.message.trim_end_matches('.'), causes.join("; ")) }
}

/// The drainer: on the leader only, one task per drain being worked on.
#[derive(Clone)]
pub struct Drainer {
    app: Arc<App>,
    clients: Arc<tokio::sync::Mutex<HashMap<String, (u64, kube::Client)>>>,
}

impl std::fmt::Debug for Drainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drainer").finish_non_exhaustive()
    }
}

impl Drainer {
    pub fn new(app: Arc<App>) -> Self {
        Drainer { app, clients: Arc::default() }
    }

    /// Works on every drain that needs it, and keeps the clusters' API server versions read,
    /// until `cancel` (the end of this leader's term).
    pub async fn run(self, cancel: CancellationToken) -> anyhow::Result<()> {
        tokio::join!(self.drains(cancel.clone()), self.versions(cancel));
        Ok(())
    }

    /// Reads the clusters' API server versions: a cluster registered or changed within a scan,
    /// every cluster every `VERSIONS_EVERY`. Apart from the drains, so that an unreachable
    /// cluster's timeouts hold up no drain.
    async fn versions(&self, cancel: CancellationToken) {
        let mut due = tokio::time::Instant::now();
        let mut read: HashMap<String, u64> = HashMap::new();
        loop {
            let all = tokio::time::Instant::now() >= due;
            if all {
                due = tokio::time::Instant::now() + VERSIONS_EVERY;
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = self.read_server_versions(all, &mut read) => {}
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(SCAN_EVERY) => {}
            }
        }
    }

    async fn drains(&self, cancel: CancellationToken) {
        let mut working: HashMap<String, tokio::task::AbortHandle> = HashMap::new();
        let mut tasks = JoinSet::new();
        loop {
            while let Some(done) = tasks.try_join_next() {
                if let Ok(machine) = done {
                    working.remove(&machine);
                }
            }
            working.retain(|_, handle| !handle.is_finished());
            match self.app.registry.list::<Drain>(DRAINS).await {
                Ok((drains, _)) => {
                    for d in drains {
                        let machine = d.object.machine.to_string();
                        let active = matches!(d.object.phase, DrainPhase::Draining | DrainPhase::Uncordoning);
                        if active && !working.contains_key(&machine) {
                            let this = self.clone();
                            let term = cancel.clone();
                            let key = machine.clone();
                            let handle = tasks.spawn(async move {
                                tokio::select! {
                                    _ = term.cancelled() => {}
                                    _ = this.work_on(&d.object.machine) => {}
                                }
                                key
                            });
                            working.insert(machine, handle);
                        }
                    }
                }
                Err(e) => tracing::warn!(error = %e, "could not list drains"),
            }
            tokio::select! {
                _ = cancel.cancelled() => {
                    tasks.shutdown().await;
                    return;
                }
                _ = tokio::time::sleep(SCAN_EVERY) => {}
                _ = self.app.registry.drain_wake.notified() => {}
            }
        }
    }

    /// Drives one machine's drain until it leaves the phases the drainer works in.
    async fn work_on(&self, machine: &Name) {
        let mut pause = FIRST_BACKOFF;
        loop {
            match self.step(machine).await {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => tracing::warn!(machine = %machine, error = %e, "drain step failed; trying again"),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_BACKOFF);
        }
    }

    /// One step of a drain: whether the drainer comes back for another (after a pause that
    /// grows, as evictions a budget refuses are retried with backoff).
    async fn step(&self, machine: &Name) -> Result<bool, ApiError> {
        let Some(drain) = self.app.registry.get::<Drain>(&drain_key(machine)).await? else { return Ok(false) };
        let now = meta::now();
        let lease = self.app.registry.get::<Lease>(&drain.object.lease_key).await?.filter(|l| l.object.id == drain.object.lease);
        let live = lease.as_ref().filter(|l| l.object.expires_at > now);
        match drain.object.phase {
            DrainPhase::Draining => {
                if live.is_none() {
                    self.give_up(drain, lease, "Abandoned", "the disruption lease expired while the node was drained").await?;
                    return Ok(false);
                }
                if now >= drain.object.deadline() {
                    let message = format!("gave up after {}s: {}", drain.object.timeout_seconds, drain.object.message);
                    self.give_up(drain, lease, "DrainTimeout", &message).await?;
                    return Ok(false);
                }
                self.drain(drain, lease).await
            }
            DrainPhase::Uncordoning => self.uncordon(drain, lease).await,
            DrainPhase::Drained | DrainPhase::Failed => Ok(false),
        }
    }

    /// Reads registered clusters' API server versions into their status, for the version skew
    /// policy: every cluster's with `all`, else those registered or changed since they were
    /// last read (`read`: the revision each was at then). A cluster that cannot be reached
    /// keeps the version last read.
    async fn read_server_versions(&self, all: bool, read: &mut HashMap<String, u64>) {
        let clusters = match self.app.registry.list::<KubernetesCluster>(CLUSTERS).await {
            Ok((clusters, _)) => clusters,
            Err(e) => return tracing::warn!(error = %e, "could not list clusters"),
        };
        read.retain(|name, _| clusters.iter().any(|c| c.object.metadata.name_str() == name));
        // A cluster whose control plane a machine is upgrading with kubeadm is read at every
        // scan: the other control-plane machines wait for its new version.
        let upgrading: Vec<ApplyClaim> = match self.app.registry.list::<ApplyClaim>(KUBEADM_APPLY).await {
            Ok((claims, _)) => claims.into_iter().map(|c| c.object).collect(),
            Err(e) => return tracing::warn!(error = %e, "could not list kubeadm upgrades"),
        };
        for cluster in clusters {
            let Some(name) = cluster.object.metadata.name.clone() else { continue };
            let applying =
                upgrading.iter().any(|c| c.cluster == name && cluster.object.status.server_version.as_ref().is_none_or(|v| v < &c.version));
            if !all && !applying && read.get(name.as_str()) == Some(&cluster.revision) {
                continue;
            }
            read.insert(name.to_string(), cluster.revision);
            let answer = match self.client(&name).await {
                Ok(client) => client.apiserver_version().await.map_err(|e| kube_error(&e)),
                Err(e) => Err(e),
            };
            let version = answer.and_then(|info| {
                // Build metadata (v1.30.4+k3s1) says who built it, not what it is.
                let bare = info.git_version.split('+').next().unwrap_or_default();
                bare.parse::<KubeVersion>().map_err(|e| format!("{:?}: {e}", info.git_version))
            });
            let version = match version {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(cluster = %name, error = %e, "could not read the API server's version");
                    continue;
                }
            };
            if cluster.object.status.server_version.as_ref() == Some(&version) {
                continue;
            }
            let mut updated = cluster.object;
            updated.status.server_version = Some(version.clone());
            let op = Op::Put {
                key: format!("{CLUSTERS}{name}"),
                value: encode(&updated),
                precondition: Precondition::Revision(cluster.revision),
            };
            match self.app.registry.store.txn(vec![op]).await {
                Ok(revision) => {
                    read.insert(name.to_string(), revision);
                    tracing::info!(cluster = %name, version = %version, "read the API server's version");
                    // Pools held back by the version skew policy may move now.
                    self.app.registry.rollout_wake.notify_one();
                }
                Err(e) => tracing::warn!(cluster = %name, error = %e, "could not record the API server's version"),
            }
        }
    }

    async fn client(&self, cluster: &Name) -> Result<kube::Client, String> {
        let stored = self.app.registry.cluster(cluster.as_str()).await.map_err(|e| match e {
            ApiError::NotFound(_) => format!("cluster {cluster} is not registered"),
            other => other.to_string(),
        })?;
        let mut clients = self.clients.lock().await;
        if let Some((revision, client)) = clients.get(cluster.as_str())
            && *revision == stored.revision
        {
            return Ok(client.clone());
        }
        let spec = &stored.object.spec;
        let kubeconfig =
            kube::config::Kubeconfig::from_yaml(&spec.kubeconfig).map_err(|e| format!("cluster {cluster}'s kubeconfig: {e}"))?;
        let options = kube::config::KubeConfigOptions { context: spec.context.clone(), ..Default::default() };
        let mut config =
            kube::Config::from_custom_kubeconfig(kubeconfig, &options).await.map_err(|e| format!("cluster {cluster}'s kubeconfig: {e}"))?;
        config.connect_timeout = Some(CONNECT_TIMEOUT);
        config.read_timeout = Some(READ_TIMEOUT);
        // A 429 is a PodDisruptionBudget's answer the drain reports and retries itself, within
        // its timeout; kube's own retrying would hide it.
        config.default_retry = false;
        let client = kube::Client::try_from(config).map_err(|e| format!("cluster {cluster}: {e}"))?;
        clients.insert(cluster.to_string(), (stored.revision, client.clone()));
        Ok(client)
    }

    /// Cordons, evicts, and looks at what is left; `Drained` when nothing is in the way.
    async fn drain(&self, mut drain: Versioned<Drain>, lease: Option<Versioned<Lease>>) -> Result<bool, ApiError> {
        let (name, cluster) = (drain.object.node.clone(), drain.object.cluster.clone());
        let client = match self.client(&cluster).await {
            Ok(c) => c,
            Err(message) => return self.progress(drain, lease, message).await,
        };
        let nodes: Api<Node> = Api::all(client.clone());
        let node = match nodes.get_opt(&name).await {
            Ok(Some(node)) => node,
            Ok(None) => return self.drained(drain, lease, format!("node {name} is not in cluster {cluster}: nothing to drain")).await,
            Err(e) => return self.progress(drain, lease, format!("reading node {name}: {}", kube_error(&e))).await,
        };
        let unschedulable = node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
        if drain.object.cordoned_before.is_none() {
            // Stored before cordoning: a drainer that stops in between finds the node cordoned
            // and this saying it was not, so it still uncordons it after.
            drain.object.cordoned_before = Some(unschedulable);
            drain = self.save(drain, None, false).await?;
        }
        if drain.object.cordoned_it()
            && !unschedulable
            && let Err(e) = nodes.cordon(&name).await
        {
            return self.progress(drain, lease, format!("cordoning node {name}: {}", kube_error(&e))).await;
        }
        let round = match self.evict_round(&client, &name).await {
            Ok(round) => round,
            Err(message) => return self.progress(drain, lease, message).await,
        };
        if round.in_the_way.is_empty() {
            let message = format!("node {name} cordoned and emptied ({} pods left on it: DaemonSet, mirror or excluded)", round.left);
            return self.drained(drain, lease, message).await;
        }
        let message = format!("{} in the way: {}", round.in_the_way.len(), round.in_the_way.join("; "));
        self.progress(drain, lease, message).await
    }

    /// Evicts what may go from `node` now, and says what is still there.
    async fn evict_round(&self, client: &kube::Client, node: &str) -> Result<Round, String> {
        let all: Api<Pod> = Api::all(client.clone());
        let pods = all
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(|e| format!("listing the pods on node {node}: {}", kube_error(&e)))?;
        let mut round = Round::default();
        for pod in &pods.items {
            let name = pod_name(pod);
            match treatment(pod) {
                Treatment::Leave(_) => round.left += 1,
                Treatment::Refuse(why) => round.in_the_way.push(format!("{name}: {why}")),
                Treatment::Terminating => round.in_the_way.push(format!("{name}: terminating")),
                Treatment::Evict => {
                    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
                    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
                    match api.evict(pod.metadata.name.as_deref().unwrap_or_default(), &EvictParams::default()).await {
                        Ok(_) => round.in_the_way.push(format!("{name}: evicted, terminating")),
                        Err(kube::Error::Api(s)) if s.code == 404 => {}
                        Err(kube::Error::Api(s)) if s.code == 429 => round.in_the_way.push(format!("{name}: {}", status_message(&s))),
                        Err(e) => round.in_the_way.push(format!("{name}: eviction failed: {}", kube_error(&e))),
                    }
                }
            }
        }
        Ok(round)
    }

    /// Uncordons the node (when this drain cordoned it) and waits for it to be Ready; then
    /// the lease and the drain record go.
    async fn uncordon(&self, drain: Versioned<Drain>, lease: Option<Versioned<Lease>>) -> Result<bool, ApiError> {
        let (name, cluster, ours) = (drain.object.node.clone(), drain.object.cluster.clone(), drain.object.cordoned_it());
        let client = match self.client(&cluster).await {
            Ok(c) => c,
            Err(message) => return self.progress(drain, lease, message).await,
        };
        let nodes: Api<Node> = Api::all(client);
        let node = match nodes.get_opt(&name).await {
            Ok(Some(node)) => node,
            Ok(None) => return self.finish(drain, lease, format!("node {name} is not in cluster {cluster}")).await,
            Err(e) => return self.progress(drain, lease, format!("reading node {name}: {}", kube_error(&e))).await,
        };
        let unschedulable = node.spec.as_ref().and_then(|s| s.unschedulable).unwrap_or(false);
        if ours
            && unschedulable
            && let Err(e) = nodes.uncordon(&name).await
        {
            return self.progress(drain, lease, format!("uncordoning node {name}: {}", kube_error(&e))).await;
        }
        if !node_ready(&node) {
            return self.progress(drain, lease, format!("waiting for node {name} to be Ready")).await;
        }
        let how = if ours { "uncordoned" } else { "left cordoned, as it was before the drain" };
        self.finish(drain, lease, format!("node {name} is Ready and {how}")).await
    }

    /// Stores a drain's new state, and renews its lease on the agent's behalf when half its
    /// time to live has passed (or at once, with `renew`).
    async fn save(&self, drain: Versioned<Drain>, lease: Option<&Versioned<Lease>>, renew: bool) -> Result<Versioned<Drain>, ApiError> {
        let d = &drain.object;
        let mut ops = vec![Op::Put { key: drain_key(&d.machine), value: encode(d), precondition: Precondition::Revision(drain.revision) }];
        let now = meta::now();
        if let Some(l) = lease
            && (renew || due_for_renewal(&l.object, d.ttl_seconds, now))
        {
            let renewed = Lease { expires_at: now + time::Duration::seconds(d.ttl_seconds as i64), ..l.object.clone() };
            ops.push(Op::Put { key: d.lease_key.clone(), value: encode(&renewed), precondition: Precondition::Revision(l.revision) });
        }
        let revision = self.app.registry.store.txn(ops).await.map_err(conflict_is_retried)?;
        Ok(Versioned { object: drain.object, revision })
    }

    /// Records what the drain waits for (when it changed) and comes back shortly.
    async fn progress(&self, mut drain: Versioned<Drain>, lease: Option<Versioned<Lease>>, message: String) -> Result<bool, ApiError> {
        let changed = drain.object.message != message;
        if changed {
            drain.object.message = message.clone();
        }
        let renew = lease.as_ref().is_some_and(|l| due_for_renewal(&l.object, drain.object.ttl_seconds, meta::now()));
        if changed || renew {
            let (machine, phase) = (drain.object.machine.clone(), drain.object.phase);
            self.save(drain, lease.as_ref(), false).await?;
            if changed {
                let reason = if phase == DrainPhase::Uncordoning { "Uncordoning" } else { "Draining" };
                self.condition(&machine, ConditionStatus::False, reason, &message).await;
            }
        }
        Ok(true)
    }

    async fn drained(&self, mut drain: Versioned<Drain>, lease: Option<Versioned<Lease>>, message: String) -> Result<bool, ApiError> {
        drain.object.phase = DrainPhase::Drained;
        drain.object.message = message.clone();
        let machine = drain.object.machine.clone();
        // The agent asks again within seconds; its lease runs a full time to live from here.
        self.save(drain, lease.as_ref(), true).await?;
        self.condition(&machine, ConditionStatus::True, "Drained", &message).await;
        self.event(&machine, "Normal", "Drained", &message).await;
        Ok(false)
    }

    /// Ends a drain that did not finish: the node back as it was, the lease deleted, the
    /// record `Failed` until it may be tried again.
    async fn give_up(&self, drain: Versioned<Drain>, lease: Option<Versioned<Lease>>, reason: &str, message: &str) -> Result<(), ApiError> {
        let d = &drain.object;
        if d.cordoned_it() {
            match self.client(&d.cluster).await {
                Ok(client) => {
                    if let Err(e) = Api::<Node>::all(client).uncordon(&d.node).await
                        && !matches!(&e, kube::Error::Api(s) if s.code == 404)
                    {
                        return Err(ApiError::Internal(format!("uncordoning node {}: {}", d.node, kube_error(&e))));
                    }
                }
                Err(e) => return Err(ApiError::Internal(e)),
            }
        }
        let now = meta::now();
        let failed = Drain {
            phase: DrainPhase::Failed,
            message: message.to_owned(),
            retry_at: Some(now + time::Duration::seconds(d.retry_after_seconds as i64)),
            ..d.clone()
        };
        let mut ops =
            vec![Op::Put { key: drain_key(&d.machine), value: encode(&failed), precondition: Precondition::Revision(drain.revision) }];
        if let Some(l) = lease {
            ops.push(Op::Delete { key: d.lease_key.clone(), precondition: Precondition::Revision(l.revision) });
        }
        self.app.registry.store.txn(ops).await.map_err(conflict_is_retried)?;
        let message = format!("{message}; node {} {}", d.node, if d.cordoned_it() { "uncordoned" } else { "left as it was" });
        self.condition(&d.machine, ConditionStatus::False, reason, &message).await;
        self.event(&d.machine, "Warning", reason, &message).await;
        Ok(())
    }

    async fn finish(&self, drain: Versioned<Drain>, lease: Option<Versioned<Lease>>, message: String) -> Result<bool, ApiError> {
        let d = &drain.object;
        let mut ops = vec![Op::Delete { key: drain_key(&d.machine), precondition: Precondition::Revision(drain.revision) }];
        if let Some(l) = &lease {
            ops.push(Op::Delete { key: d.lease_key.clone(), precondition: Precondition::Revision(l.revision) });
        }
        self.app.registry.store.txn(ops).await.map_err(conflict_is_retried)?;
        self.condition(&d.machine, ConditionStatus::False, "Uncordoned", &message).await;
        self.event(&d.machine, "Normal", "Uncordoned", &format!("{message}; lease {} released", d.lease)).await;
        Ok(false)
    }

    /// Sets the machine's `Drained` condition. Not fatal when it fails: the drain's record
    /// holds the same, and the next step sets it again.
    async fn condition(&self, machine: &Name, status: ConditionStatus, reason: &str, message: &str) {
        let now = meta::now();
        let set = self
            .app
            .registry
            .update_machine(machine.as_str(), |m| {
                Ok(meta::set_condition(&mut m.status.conditions, condition::DRAINED, status, reason, message, now))
            })
            .await;
        if let Err(e) = set {
            tracing::warn!(machine = %machine, error = %e, "could not set the Drained condition");
        }
    }

    async fn event(&self, machine: &Name, type_: &str, reason: &str, message: &str) {
        if let Err(e) = self.app.registry.record_event(machine.as_str(), type_, reason, message, "controller").await {
            tracing::warn!(machine = %machine, error = %e, "could not record an event");
        }
    }
}

/// Whether a lease the drainer holds for its agent is to be renewed now: when half its time to
/// live has passed, and in any case while fewer seconds are left than a few of the drainer's
/// pauses, so that a short time to live cannot run out between two steps.
fn due_for_renewal(lease: &Lease, ttl_seconds: u64, now: Timestamp) -> bool {
    let margin = (ttl_seconds / 2).max(3 * MAX_BACKOFF.as_secs());
    lease.expires_at - now < time::Duration::seconds(margin as i64)
}

/// A write that lost a race is tried again by the next step, from what is stored then.
fn conflict_is_retried(e: StoreError) -> ApiError {
    match e {
        StoreError::Conflict { .. } => ApiError::Conflict("the drain changed meanwhile".into()),
        other => other.into(),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(metadata: serde_json::Value, phase: &str) -> Pod {
        serde_json::from_value(json!({"metadata": metadata, "status": {"phase": phase}})).unwrap_or_else(|e| panic!("{e}"))
    }

    fn owned_by(kind: &str) -> serde_json::Value {
        json!([{"apiVersion": "apps/v1", "kind": kind, "name": "x", "uid": "u", "controller": true}])
    }

    #[test]
    fn a_drain_leaves_daemonset_mirror_and_excluded_pods_and_refuses_what_would_not_come_back() {
        let cases = [
            (json!({"name": "a", "ownerReferences": owned_by("ReplicaSet")}), "Running", Treatment::Evict),
            (json!({"name": "a", "ownerReferences": owned_by("DaemonSet")}), "Running", Treatment::Leave("DaemonSet pod")),
            (json!({"name": "a", "annotations": {"kubernetes.io/config.mirror": "h"}}), "Running", Treatment::Leave("mirror pod")),
            (
                json!({"name": "a", "ownerReferences": owned_by("StatefulSet"), "annotations": {"keelson.io/exclude-from-drain": "true"}}),
                "Running",
                Treatment::Leave("excluded"),
            ),
            // Only "true" excludes.
            (
                json!({"name": "a", "ownerReferences": owned_by("StatefulSet"), "annotations": {"keelson.io/exclude-from-drain": "yes"}}),
                "Running",
                Treatment::Evict,
            ),
            (
                json!({"name": "a", "deletionTimestamp": "2026-01-01T00:00:00Z", "ownerReferences": owned_by("ReplicaSet")}),
                "Running",
                Treatment::Terminating,
            ),
            // A finished pod without a controller loses nothing by going.
            (json!({"name": "a"}), "Succeeded", Treatment::Evict),
            // An owner that is not its controller would not recreate it.
            (
                json!({"name": "a", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "u"}]}),
                "Running",
                Treatment::Refuse(
                    "no controller would recreate it: delete it, or annotate it keelson.io/exclude-from-drain=true to leave it",
                ),
            ),
        ];
        for (metadata, phase, expected) in cases {
            assert_eq!(treatment(&pod(metadata.clone(), phase)), expected, "{metadata} {phase}");
        }
    }

    #[test]
    fn a_refused_eviction_says_which_budget_refused_it() {
        let status: kube::core::Status = serde_json::from_value(json!({
            "code": 429, "reason": "TooManyRequests", "message": "Cannot evict pod as it would violate the pod's disruption budget.",
            "details": {"causes": [{"reason": "DisruptionBudget", "message": "The disruption budget web needs 2 healthy pods and has 2 currently"}]}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            status_message(&status),
            "Cannot evict pod as it would violate the pod's disruption budget (The disruption budget web needs 2 healthy pods and has 2 currently)"
        );
    }
}
