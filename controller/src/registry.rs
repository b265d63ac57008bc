//! Resource semantics over the store: how machines, pools, tokens, identities and events are
//! kept, and the rules that apply when they change (generations, pool membership, enrollment).
//!
//! Key layout (JSON values):
//! - `/machines/<name>`   Machine (without `resourceVersion`, which is the key's mod revision)
//! - `/heartbeats/<name>` Heartbeat: when the machine last reported a status that changed nothing
//! - `/pools/<name>`      MachinePool
//! - `/tokens/<id>`       StoredToken: the BootstrapToken and the SHA-256 of its secret
//! - `/identities/<name>` Identity: the certificate serials that may act as the machine
//! - `/events/<name>/<n>` the machine's recent events, in segments, newest last (`events.rs`)
//! - `/revisions/<pool>/<revision, 20 digits>`  PoolRevision: a template kept for history and undo
//! - `/rollouts/<pool>`   RolloutState: what a rollout must remember across restarts

use std::collections::BTreeMap;
use std::sync::Arc;

use keelson_api::machine::{Machine, MachineSpec, Phase};
use keelson_api::meta::{self, ConditionStatus, Name, Timestamp, annotation, condition, set_condition};
use keelson_api::pool::MachinePool;
use keelson_api::token::{BootstrapToken, TokenSpec, TokenStatus, TokenString};
use keelson_api::validate::validate_spec_change;
use keelson_api::wire::{AgentStatus, EnrollRequest, EnrollResponse, Event, TokenCreated, TokenRequest};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::pki::{self, Authority};
use crate::store::{Entry, Op, Precondition, Store, StoreError};

pub const MACHINES: &str = "/machines/";
pub const HEARTBEATS: &str = "/heartbeats/";
pub const POOLS: &str = "/pools/";
pub const TOKENS: &str = "/tokens/";
pub const IDENTITIES: &str = "/identities/";
pub const EVENTS: &str = "/events/";
pub const REVISIONS: &str = "/revisions/";
pub const ROLLOUTS: &str = "/rollouts/";
/// Per etcd cluster: which machine started it (the claim is made once, atomically).
pub const ETCD_CLUSTERS: &str = "/etcd-clusters/";

/// Attempts at a read-modify-write before giving up on a busy key.
pub(crate) const CAS_ATTEMPTS: usize = 16;

/// Waits before attempt `attempt` + 1 at a compare-and-swap that lost to another writer: a
/// random time up to 2, 4, … 64 ms. Writers that met on a key then try again at different
/// times, instead of meeting again every round until one runs out of attempts.
pub(crate) async fn after_conflict(attempt: usize) {
    let most = 2u64 << attempt.min(5);
    tokio::time::sleep(std::time::Duration::from_millis(rand::random_range(0..=most))).await;
}
const DEFAULT_TOKEN_TTL_SECS: u64 = 24 * 3600;
const MAX_TOKEN_TTL_SECS: u64 = 365 * 24 * 3600;

/// An object with the store revision it was read at.
#[derive(Debug, Clone)]
pub struct Versioned<T> {
    pub object: T,
    pub revision: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredToken {
    pub token: BootstrapToken,
    pub secret_sha256: String,
}

/// The certificates that may act as a machine: the newest first, and the one it replaced
/// while the agent switches over. Deleting this revokes the machine's identity.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Identity {
    pub serials: Vec<String>,
    #[serde(with = "time::serde::rfc3339")]
    pub enrolled_at: Timestamp,
}

/// The time of a machine's latest status report, when that report changed nothing else. It is
/// kept apart from the machine, the way Kubernetes keeps node heartbeats in Lease objects: an
/// idle fleet's heartbeats then write a few bytes each instead of whole machines, and wake no
/// watch of machines (rollouts, long-polls, operators). A machine's `lastHeartbeatTime`, as
/// served, is the later of its own and this.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Heartbeat {
    #[serde(with = "time::serde::rfc3339")]
    pub time: Timestamp,
}

/// How a machine is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deletion {
    /// Its agent resets the machine first (an etcd member leaves its cluster only while the
    /// cluster keeps its quorum); then it goes.
    Reset,
    /// As `Reset`, but an etcd member leaves even when the cluster loses its quorum or its
    /// last member.
    ResetForcingEtcdLeave,
    /// At once, without the agent (a machine gone for good).
    Forget,
}

#[derive(Debug)]
pub struct Registry {
    pub store: Arc<dyn Store>,
    pub authority: Arc<Authority>,
    /// Enrollments all update their token's use count; taking them one at a time in this
    /// process avoids a storm of compare-and-swap retries when a fleet boots at once with one
    /// token. The compare-and-swap still guards against other writers.
    enroll_lock: tokio::sync::Mutex<()>,
    /// One rollout pass at a time in this process, so two passes never both fill the same
    /// free slot of a pool's budget.
    pub(crate) rollout_lock: tokio::sync::Mutex<()>,
    /// Disruption lease changes, one at a time in this process (crate::leases).
    pub(crate) lease_lock: tokio::sync::Mutex<()>,
    /// The pools' members and which are unavailable, for lease decisions (crate::census).
    pub(crate) census: std::sync::Mutex<crate::census::Census>,
    /// Every machine, decoded, for the leader's rollout pass and reachability check
    /// (crate::decoded).
    pub(crate) decoded_machines: tokio::sync::Mutex<crate::decoded::DecodedMachines>,
    /// Woken when a pool member's progress changes (generation applied, Ready, Degraded,
    /// reachability), so rollouts move at once rather than at the next periodic pass.
    pub rollout_wake: tokio::sync::Notify,
    /// Woken when a drain starts or its node is to be brought back (crate::drain).
    pub drain_wake: tokio::sync::Notify,
    /// Whether this replica leads (crate::leader): only the leader runs rollout passes.
    leading: tokio::sync::watch::Receiver<bool>,
}

pub(crate) fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serialising our own types to JSON cannot fail: no maps with non-string keys.
    serde_json::to_vec(value).unwrap_or_else(|e| panic!("serialising a stored object: {e}"))
}

pub(crate) fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::Internal(format!("stored object {key} is unreadable: {e}")))
}

/// An event of a machine's history, as of now.
pub(crate) fn event(type_: &str, reason: &str, message: String, source: &str) -> Event {
    Event { time: meta::now(), type_: type_.to_owned(), reason: reason.to_owned(), message, source: source.to_owned() }
}

pub(crate) fn not_found(kind: &str, name: &str) -> ApiError {
    ApiError::NotFound(format!("{kind} {name:?} not found"))
}

/// Stamps the store revision into an object's metadata as its resourceVersion.
pub trait HasMeta {
    fn meta_mut(&mut self) -> &mut meta::ObjectMeta;
}
impl HasMeta for Machine {
    fn meta_mut(&mut self) -> &mut meta::ObjectMeta {
        &mut self.metadata
    }
}
impl HasMeta for MachinePool {
    fn meta_mut(&mut self) -> &mut meta::ObjectMeta {
        &mut self.metadata
    }
}
impl HasMeta for BootstrapToken {
    fn meta_mut(&mut self) -> &mut meta::ObjectMeta {
        &mut self.metadata
    }
}

impl HasMeta for keelson_api::cluster::KubernetesCluster {
    fn meta_mut(&mut self) -> &mut meta::ObjectMeta {
        &mut self.metadata
    }
}

impl<T: HasMeta> Versioned<T> {
    pub fn stamped(mut self) -> T {
        self.object.meta_mut().resource_version = Some(self.revision.to_string());
        self.object
    }
}

pub(crate) fn new_uid() -> String {
    let b: [u8; 16] = rand::random();
    let h = hex::encode(b);
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// Parses a client-supplied resourceVersion.
pub fn parse_resource_version(rv: Option<&str>) -> Result<Option<u64>, ApiError> {
    rv.map(|s| s.parse::<u64>().map_err(|_| ApiError::invalid("metadata.resourceVersion", format!("{s:?} is not a resourceVersion"))))
        .transpose()
}

/// What a rollout decides on: the generation applied and the conditions' statuses.
fn progress(m: &Machine) -> (u64, Vec<(String, ConditionStatus)>) {
    (m.status.observed_generation, m.status.conditions.iter().map(|c| (c.type_.clone(), c.status)).collect())
}

/// Applies an agent's report to its machine, all but the heartbeat's time.
fn apply_report(m: &mut Machine, report: &AgentStatus, now: Timestamp) -> Result<(), ApiError> {
    if report.observed_generation > m.metadata.generation {
        return Err(ApiError::invalid(
            "observedGeneration",
            format!("{} is newer than the machine's generation {}", report.observed_generation, m.metadata.generation),
        ));
    }
    let ours = |c: &meta::Condition| condition::SET_BY_CONTROLLER.contains(&c.type_.as_str());
    let kept: Vec<meta::Condition> = m.status.conditions.iter().filter(|c| ours(c)).cloned().collect();
    // A machine being deleted stays Deleting whatever its agent last was doing.
    m.status.phase = if m.metadata.deletion_timestamp.is_some() { Some(Phase::Deleting) } else { report.phase };
    m.status.observed_generation = report.observed_generation;
    m.status.conditions = report.conditions.iter().filter(|c| !ours(c)).cloned().collect();
    m.status.conditions.extend(kept);
    set_condition(&mut m.status.conditions, condition::REACHABLE, ConditionStatus::True, "Heartbeat", "", now);
    m.status.versions = report.versions.clone();
    if report.facts.is_some() {
        m.status.facts = report.facts.clone();
    }
    m.status.current_step = report.current_step.clone();
    if report.etcd.is_some() {
        m.status.etcd = report.etcd.clone();
    }
    Ok(())
}

/// Takes a heartbeat into a machine's `lastHeartbeatTime` when it is the later.
fn heard_at(m: &mut Machine, time: Timestamp) {
    if m.status.last_heartbeat_time.is_none_or(|t| t < time) {
        m.status.last_heartbeat_time = Some(time);
    }
}

/// The pool a machine with these labels belongs to: of the pools whose selector matches,
/// the oldest (then the first by name), so that adding a pool never steals machines.
pub fn owning_pool<'a>(pools: &'a [Versioned<MachinePool>], labels: &BTreeMap<String, String>) -> Option<&'a MachinePool> {
    pools
        .iter()
        .map(|p| &p.object)
        .filter(|p| p.spec.selector.matches(labels))
        .min_by(|a, b| (a.metadata.creation_timestamp, a.metadata.name_str()).cmp(&(b.metadata.creation_timestamp, b.metadata.name_str())))
}

impl Registry {
    pub fn new(store: Arc<dyn Store>, authority: Arc<Authority>, leading: tokio::sync::watch::Receiver<bool>) -> Self {
        Registry {
            leading,
            store,
            authority,
            enroll_lock: tokio::sync::Mutex::new(()),
            rollout_lock: tokio::sync::Mutex::new(()),
            lease_lock: tokio::sync::Mutex::new(()),
            census: std::sync::Mutex::new(crate::census::Census::default()),
            decoded_machines: tokio::sync::Mutex::new(crate::decoded::DecodedMachines::default()),
            rollout_wake: tokio::sync::Notify::new(),
            drain_wake: tokio::sync::Notify::new(),
        }
    }

    /// A rollout pass at once, after an operator's change, when this replica leads. On a
    /// follower the change reaches the leader through the store, and wakes its pass there;
    /// two replicas never run passes side by side, so a pool's budget is filled by one.
    /// A pass is given up when leadership goes while it runs.
    pub(crate) async fn pass_if_leading(&self) -> Result<(), ApiError> {
        let mut leading = self.leading.clone();
        if !*leading.borrow_and_update() {
            return Ok(());
        }
        let lost = async {
            if leading.wait_for(|l| !*l).await.is_err() {
                // No election (one controller): it never loses.
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            passed = self.reconcile_pools() => passed,
            _ = lost => Ok(()),
        }
    }

    pub async fn get<T: DeserializeOwned>(&self, key: &str) -> Result<Option<Versioned<T>>, ApiError> {
        match self.store.get(key).await? {
            Some(e) => Ok(Some(Versioned { object: decode(key, &e.value)?, revision: e.mod_revision })),
            None => Ok(None),
        }
    }

    pub async fn list<T: DeserializeOwned>(&self, prefix: &str) -> Result<(Vec<Versioned<T>>, u64), ApiError> {
        let listing = self.store.list(prefix).await?;
        let mut items = Vec::with_capacity(listing.entries.len());
        for e in listing.entries.iter() {
            items.push(Versioned { object: decode(&e.key, &e.value)?, revision: e.mod_revision });
            // Decoding a whole fleet takes a runtime thread for hundreds of milliseconds;
            // this gives the thread back to waiting requests every so often (each decode
            // counts as one unit of the task's cooperative budget).
            tokio::task::coop::consume_budget().await;
        }
        Ok((items, listing.revision))
    }

    pub async fn machine(&self, name: &str) -> Result<Versioned<Machine>, ApiError> {
        self.get(&format!("{MACHINES}{name}")).await?.ok_or_else(|| not_found("machine", name))
    }

    /// A machine as served: its `lastHeartbeatTime` that of its latest report.
    pub async fn machine_as_seen(&self, name: &str) -> Result<Versioned<Machine>, ApiError> {
        let mut machine = self.machine(name).await?;
        if let Some(beat) = self.get::<Heartbeat>(&format!("{HEARTBEATS}{name}")).await? {
            heard_at(&mut machine.object, beat.object.time);
        }
        Ok(machine)
    }

    /// Every machine as served (`machine_as_seen`), and the revision of the listing.
    pub async fn machines_as_seen(&self) -> Result<(Vec<Versioned<Machine>>, u64), ApiError> {
        let (mut machines, revision) = self.list::<Machine>(MACHINES).await?;
        let beats = self.heartbeats().await?;
        for m in &mut machines {
            if let Some(&time) = beats.get(m.object.metadata.name_str()) {
                heard_at(&mut m.object, time);
            }
        }
        Ok((machines, revision))
    }

    /// Every machine, decoded, as of the store's newest revision, from the copy the leader's
    /// loops keep (crate::decoded).
    pub(crate) async fn decoded_fleet(&self) -> Result<(Vec<Versioned<Arc<Machine>>>, u64), ApiError> {
        self.decoded_machines.lock().await.catch_up(self.store.as_ref()).await
    }

    /// Drops the decoded fleet: a replica that stops leading does not need it, and the next
    /// term starts again from a listing.
    pub(crate) async fn forget_decoded_fleet(&self) {
        *self.decoded_machines.lock().await = crate::decoded::DecodedMachines::default();
    }

    /// Every machine's latest heartbeat time, by machine name.
    async fn heartbeats(&self) -> Result<std::collections::HashMap<String, Timestamp>, ApiError> {
        let listing = self.store.list(HEARTBEATS).await?;
        listing
            .entries
            .iter()
            .filter_map(|e| Some((e.key.strip_prefix(HEARTBEATS)?, e)))
            .map(|(name, e)| Ok((name.to_owned(), decode::<Heartbeat>(&e.key, &e.value)?.time)))
            .collect()
    }

    /// Read-modify-write of one machine, retried when it changed underneath. `change` returns
    /// false to leave the machine as it is.
    pub async fn update_machine<F>(&self, name: &str, mut change: F) -> Result<Versioned<Machine>, ApiError>
    where
        F: FnMut(&mut Machine) -> Result<bool, ApiError> + Send,
    {
        Ok(self.update_machine_guarded(name, None, |m, _| change(m)).await?.0)
    }

    /// `update_machine` for a change that also depends on another key, `guard`: `change` sees
    /// its entry as read, and the write goes ahead only if that key is still as it was.
    /// Returns the machine and whether it was written.
    async fn update_machine_guarded<F>(
        &self,
        name: &str,
        guard: Option<&str>,
        mut change: F,
    ) -> Result<(Versioned<Machine>, bool), ApiError>
    where
        F: FnMut(&mut Machine, Option<&Entry>) -> Result<bool, ApiError> + Send,
    {
        let key = format!("{MACHINES}{name}");
        for attempt in 0..CAS_ATTEMPTS {
            let mut current = self.machine(name).await?;
            let guarded = match guard {
                Some(g) => Some((g, self.store.get(g).await?)),
                None => None,
            };
            if !change(&mut current.object, guarded.as_ref().and_then(|(_, e)| e.as_ref()))? {
                return Ok((current, false));
            }
            let mut ops =
                vec![Op::Put { key: key.clone(), value: encode(&current.object), precondition: Precondition::Revision(current.revision) }];
            if let Some((g, entry)) = guarded {
                let precondition = entry.map_or(Precondition::Absent, |e| Precondition::Revision(e.mod_revision));
                ops.push(Op::Check { key: g.to_owned(), precondition });
            }
            match self.store.txn(ops).await {
                Ok(revision) => return Ok((Versioned { object: current.object, revision }, true)),
                Err(StoreError::Conflict { .. }) => {
                    after_conflict(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("machine {name} is changing too often to update; try again")))
    }

    /// Creates or updates a machine from an operator's object. `metadata.resourceVersion`, when
    /// given, makes the write conditional. The spec of a machine in a pool is the pool's template.
    pub async fn apply_machine(&self, input: Machine) -> Result<Versioned<Machine>, ApiError> {
        let name = input.metadata.name.clone().ok_or_else(|| ApiError::invalid("metadata.name", "is required"))?;
        let expected = parse_resource_version(input.metadata.resource_version.as_deref())?;
        let key = format!("{MACHINES}{name}");
        for attempt in 0..CAS_ATTEMPTS {
            let current: Option<Versioned<Machine>> = self.get(&key).await?;
            if let Some(rv) = expected {
                let found = current.as_ref().map(|c| c.revision);
                if found != Some(rv) {
                    return Err(ApiError::Conflict(match found {
                        Some(f) => format!("machine {name} has resourceVersion {f}, not {rv}: it changed since you read it"),
                        None => format!("machine {name} does not exist, so resourceVersion {rv} cannot match"),
                    }));
                }
            }
            if let Some(cur) = &current
                && cur.object.metadata.deletion_timestamp.is_some()
            {
                return Err(ApiError::Conflict(format!("machine {name} is being deleted (waiting for its agent to reset it)")));
            }
            let (pools, _) = self.list::<MachinePool>(POOLS).await?;
            let pool = owning_pool(&pools, &input.metadata.labels);
            let spec = match pool {
                Some(pool) => {
                    let template = &pool.spec.template.spec;
                    if input.spec != MachineSpec::default() && &input.spec != template {
                        return Err(ApiError::invalid(
                            "spec",
                            format!(
                                "machine {name} belongs to pool {} by its labels, so its spec is the pool's template; change the pool, or leave spec empty",
                                pool.metadata.name_str()
                            ),
                        ));
                    }
                    // A member keeps the revision the rollout gave it; a joiner takes the
                    // current one at once.
                    match &current {
                        Some(cur) if cur.object.status.pool == pool.metadata.name => cur.object.spec.clone(),
                        _ => template.clone(),
                    }
                }
                None => input.spec.clone(),
            };
            let pool_name = pool.and_then(|p| p.metadata.name.clone());
            let pool_revision = pool.map(|p| p.status.revision);
            let (machine, precondition) = match &current {
                Some(cur) => {
                    let mut m = cur.object.clone();
                    validate_spec_change("spec", &m.spec, &spec)?;
                    let joining = m.status.pool != pool_name;
                    if m.spec != spec {
                        m.metadata.generation += 1;
                        m.spec = spec;
                    }
                    m.metadata.labels = input.metadata.labels.clone();
                    m.metadata.annotations = input.metadata.annotations.clone();
                    if joining {
                        m.status.pool = pool_name;
                        m.status.pool_revision = pool_revision.filter(|_| m.status.pool.is_some());
                    }
                    (m, Precondition::Revision(cur.revision))
                }
                None => {
                    let mut m = Machine::new(name.clone());
                    m.metadata.labels = input.metadata.labels.clone();
                    m.metadata.annotations = input.metadata.annotations.clone();
                    m.metadata.generation = 1;
                    m.metadata.uid = Some(new_uid());
                    m.metadata.creation_timestamp = Some(meta::now());
                    m.spec = spec;
                    m.status.phase = Some(Phase::Pending);
                    m.status.pool_revision = pool_revision.filter(|_| pool_name.is_some());
                    m.status.pool = pool_name;
                    (m, Precondition::Absent)
                }
            };
            match self.store.txn(vec![Op::Put { key: key.clone(), value: encode(&machine), precondition }]).await {
                Ok(revision) => {
                    if current.as_ref().is_none_or(|c| c.object.metadata.generation != machine.metadata.generation) {
                        self.record_event(
                            name.as_str(),
                            "Normal",
                            "SpecChanged",
                            &format!("generation {}", machine.metadata.generation),
                            "controller",
                        )
                        .await?;
                    }
                    return Ok(Versioned { object: machine, revision });
                }
                Err(StoreError::Conflict { .. }) if expected.is_none() => after_conflict(attempt).await,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("machine {name} is changing too often to update; try again")))
    }

    /// Deletes a machine. An enrolled machine is first reset by its agent: it is marked
    /// (`deletionTimestamp`, a new generation so its long-poll answers) and goes when the agent
    /// reports the reset (`complete_reset`); `Deletion::Forget` deletes at once. Returns the
    /// marked machine, or `None` when it is gone. Its events stay.
    pub async fn delete_machine(&self, name: &Name, how: Deletion) -> Result<Option<Versioned<Machine>>, ApiError> {
        let enrolled = self.get::<Identity>(&format!("{IDENTITIES}{name}")).await?.is_some();
        if how == Deletion::ResetForcingEtcdLeave && self.machine(name.as_str()).await?.object.spec.etcd.is_none() {
            return Err(ApiError::invalid(
                "forceEtcdLeave",
                format!("forceEtcdLeave: machine {name} runs no etcd member (spec.etcd is not set)"),
            ));
        }
        if how == Deletion::Forget || !enrolled {
            self.forget_machine(name).await?;
            return Ok(None);
        }
        let now = meta::now();
        let (mut newly, mut forced) = (false, false);
        let marked = self
            .update_machine(name.as_str(), |m| {
                let force = how == Deletion::ResetForcingEtcdLeave
                    && m.metadata.annotations.get(annotation::FORCE_ETCD_LEAVE).is_none_or(|v| v != "true");
                if m.metadata.deletion_timestamp.is_some() && !force {
                    return Ok(false);
                }
                if force {
                    // Also on a machine already being deleted: its agent may be waiting on a
                    // refused removal, and the new generation wakes it.
                    m.metadata.annotations.insert(annotation::FORCE_ETCD_LEAVE.into(), "true".into());
                    forced = true;
                }
                if m.metadata.deletion_timestamp.is_none() {
                    m.metadata.deletion_timestamp = Some(now);
                    m.status.phase = Some(Phase::Deleting);
                    newly = true;
                }
                m.metadata.generation += 1;
                Ok(true)
            })
            .await?;
        if newly {
            self.record_event(name.as_str(), "Normal", "DeletionRequested", "waiting for the agent to reset the machine", "controller")
                .await?;
        }
        if forced {
            self.record_event(
                name.as_str(),
                "Warning",
                "EtcdLeaveForced",
                "the operator forced the etcd member's removal: it leaves even if the cluster loses its quorum or its last member",
                "controller",
            )
            .await?;
        }
        Ok(Some(marked))
    }

    /// The agent reset its machine after a deletion: forget it.
    pub async fn complete_reset(&self, name: &Name, summary: &str) -> Result<(), ApiError> {
        let m = self.machine(name.as_str()).await?;
        if m.object.metadata.deletion_timestamp.is_none() {
            return Err(ApiError::Conflict(format!("machine {name} is not being deleted")));
        }
        self.record_event(name.as_str(), "Normal", "Reset", summary, "agent").await?;
        self.forget_machine(name).await?;
        self.record_event(name.as_str(), "Normal", "Deleted", "reset by its agent; identity revoked", "controller").await
    }

    /// Removes the machine and revokes its identity, keeping its events.
    async fn forget_machine(&self, name: &Name) -> Result<(), ApiError> {
        let key = format!("{MACHINES}{name}");
        match self
            .store
            .txn(vec![
                Op::Delete { key, precondition: Precondition::Exists },
                Op::Delete { key: format!("{IDENTITIES}{name}"), precondition: Precondition::None },
                Op::Delete { key: format!("{HEARTBEATS}{name}"), precondition: Precondition::None },
            ])
            .await
        {
            Ok(_) => {
                // A pool member leaving changes its pool's budget and progress.
                self.rollout_wake.notify_one();
                Ok(())
            }
            Err(StoreError::Conflict { .. }) => Err(not_found("machine", name.as_str())),
            Err(e) => Err(e.into()),
        }
    }

    /// Stores what a machine's agent reported. The generation never changes here. A report
    /// that changes nothing but the time (an idle agent's heartbeat) writes only the machine's
    /// `Heartbeat`.
    pub async fn record_status(&self, name: &Name, report: AgentStatus) -> Result<(), ApiError> {
        let now = meta::now();
        let key = format!("{MACHINES}{name}");
        for attempt in 0..CAS_ATTEMPTS {
            let current = self.machine(name.as_str()).await?;
            let mut machine = current.object.clone();
            apply_report(&mut machine, &report, now)?;
            let ops = if machine == current.object {
                vec![
                    // Not if the machine changed since it was read (marked unreachable, say):
                    // then this report may change it back.
                    Op::Check { key: key.clone(), precondition: Precondition::Revision(current.revision) },
                    Op::Put {
                        key: format!("{HEARTBEATS}{name}"),
                        value: encode(&Heartbeat { time: now }),
                        precondition: Precondition::None,
                    },
                ]
            } else {
                machine.status.last_heartbeat_time = Some(now);
                vec![Op::Put { key: key.clone(), value: encode(&machine), precondition: Precondition::Revision(current.revision) }]
            };
            match self.store.txn_yielding(ops).await {
                Ok(_) => {
                    if machine.status.pool.is_some() && progress(&machine) != progress(&current.object) {
                        self.rollout_wake.notify_one();
                    }
                    return Ok(());
                }
                Err(StoreError::Conflict { .. }) => {
                    after_conflict(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("machine {name} is changing too often to update; try again")))
    }

    /// Marks machines that stopped reporting as unreachable. Returns how many changed.
    pub async fn mark_unreachable(&self, timeout: std::time::Duration) -> Result<usize, ApiError> {
        let now = meta::now();
        let silent_since = now - timeout;
        // The leader's decoded fleet, as the rollout pass sees it: heartbeats are stored apart
        // from the machines, which change only when they report.
        let (machines, _) = self.decoded_fleet().await?;
        let beats = self.heartbeats().await?;
        let mut changed = 0;
        for m in machines {
            let beat = beats.get(m.object.metadata.name_str()).copied();
            let Some(last) = m.object.status.last_heartbeat_time.max(beat) else { continue };
            let reachable = meta::find_condition(&m.object.status.conditions, condition::REACHABLE).map(|c| c.status);
            if last >= silent_since || reachable == Some(ConditionStatus::False) {
                continue;
            }
            let name = m.object.metadata.name_str().to_owned();
            let message = format!("no heartbeat since {}", last.format(&time::format_description::well_known::Rfc3339).unwrap_or_default());
            match self.mark_silent(&name, silent_since, &message, now).await {
                Ok(true) => {
                    changed += 1;
                    self.rollout_wake.notify_one();
                    self.record_event(&name, "Warning", "Unreachable", &message, "controller").await?;
                }
                Ok(false) | Err(ApiError::NotFound(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(changed)
    }

    /// Marks one machine unreachable unless it reported after `silent_since`, as of one
    /// reading of both its record and its heartbeat (a heartbeat in between wins). Returns
    /// whether it did.
    async fn mark_silent(&self, name: &str, silent_since: Timestamp, message: &str, now: Timestamp) -> Result<bool, ApiError> {
        let beat_key = format!("{HEARTBEATS}{name}");
        let (_, marked) = self
            .update_machine_guarded(name, Some(&beat_key), |machine, beat| {
                let mut seen = machine.status.last_heartbeat_time;
                if let Some(b) = beat {
                    let beat: Heartbeat = decode(&b.key, &b.value)?;
                    seen = seen.max(Some(beat.time));
                }
                if seen.is_none_or(|t| t >= silent_since) {
                    return Ok(false);
                }
                machine.status.phase = Some(Phase::Unreachable);
                Ok(set_condition(
                    &mut machine.status.conditions,
                    condition::REACHABLE,
                    ConditionStatus::False,
                    "HeartbeatTimeout",
                    message,
                    now,
                ))
            })
            .await?;
        Ok(marked)
    }

    pub async fn create_token(&self, req: TokenRequest) -> Result<TokenCreated, ApiError> {
        let ttl = req.ttl_seconds.unwrap_or(DEFAULT_TOKEN_TTL_SECS);
        if ttl == 0 || ttl > MAX_TOKEN_TTL_SECS {
            return Err(ApiError::invalid("ttlSeconds", format!("must be between 1 and {MAX_TOKEN_TTL_SECS}")));
        }
        if req.usage_limit == Some(0) {
            return Err(ApiError::invalid("usageLimit", "must be at least 1"));
        }
        for (k, v) in &req.labels {
            keelson_api::validate::check_label(k, v).map_err(|m| ApiError::invalid(format!("labels.{k}"), m))?;
        }
        for _ in 0..CAS_ATTEMPTS {
            let id = random_token_part(keelson_api::token::TOKEN_ID_LEN);
            let secret = random_token_part(keelson_api::token::TOKEN_SECRET_LEN);
            let token = TokenString { id: id.clone(), secret: secret.clone() };
            let name: Name = id.parse().map_err(|e: meta::NameError| ApiError::Internal(e.to_string()))?;
            let mut resource = BootstrapToken {
                api_version: keelson_api::API_VERSION.to_owned(),
                kind: keelson_api::KIND_TOKEN.to_owned(),
                metadata: meta::ObjectMeta::named(name),
                spec: TokenSpec {
                    expires_at: Some(meta::now() + time::Duration::seconds(ttl as i64)),
                    usage_limit: req.usage_limit,
                    labels: req.labels.clone(),
                    allow_reenroll: req.allow_reenroll,
                    description: req.description.clone(),
                },
                status: TokenStatus::default(),
            };
            resource.metadata.creation_timestamp = Some(meta::now());
            resource.metadata.uid = Some(new_uid());
            let stored = StoredToken { token: resource.clone(), secret_sha256: sha256_hex(&secret) };
            match self
                .store
                .txn(vec![Op::Put { key: format!("{TOKENS}{id}"), value: encode(&stored), precondition: Precondition::Absent }])
                .await
            {
                Ok(revision) => {
                    resource.metadata.resource_version = Some(revision.to_string());
                    return Ok(TokenCreated { token: token.to_string(), resource });
                }
                // Another token has the id: draw another.
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Internal("could not find a free token id".into()))
    }

    /// Enrolls a machine: checks the token, signs the CSR, and records the machine, its
    /// identity and the token's use in one transaction.
    pub async fn enroll(&self, req: EnrollRequest) -> Result<EnrollResponse, ApiError> {
        let token: TokenString = req.token.parse().map_err(|_| ApiError::Unauthorized("bootstrap token is malformed".into()))?;
        let csr = pki::parse_csr(&req.csr).map_err(|e| ApiError::invalid("csr", e.to_string()))?;
        let cn = pki::csr_common_name(&csr).ok_or_else(|| ApiError::invalid("csr", "the CSR has no subject common name"))?;
        let name: Name = match &req.name {
            Some(n) if n.as_str() != cn => {
                return Err(ApiError::invalid("csr", format!("the CSR's common name {cn:?} is not the enrolled name {:?}", n.as_str())));
            }
            Some(n) => n.clone(),
            None => cn.parse().map_err(|e: meta::NameError| ApiError::invalid("csr", format!("common name: {e}")))?,
        };
        let _one_at_a_time = self.enroll_lock.lock().await;
        for attempt in 0..CAS_ATTEMPTS {
            let token_key = format!("{TOKENS}{}", token.id);
            let Some(stored) = self.get::<StoredToken>(&token_key).await? else {
                return Err(ApiError::Unauthorized("bootstrap token is not valid".into()));
            };
            let presented = sha256_hex(&token.secret);
            if !bool::from(presented.as_bytes().ct_eq(stored.object.secret_sha256.as_bytes())) {
                return Err(ApiError::Unauthorized("bootstrap token is not valid".into()));
            }
            let mut tok = stored.object.token.clone();
            if tok.spec.expires_at.is_some_and(|t| t <= meta::now()) {
                return Err(ApiError::Unauthorized(format!("bootstrap token {} has expired", token.id)));
            }
            if tok.spec.usage_limit.is_some_and(|limit| tok.status.usages >= limit) {
                return Err(ApiError::Unauthorized(format!("bootstrap token {} is used up", token.id)));
            }
            let identity_key = format!("{IDENTITIES}{name}");
            let existing_identity: Option<Versioned<Identity>> = self.get(&identity_key).await?;
            if existing_identity.is_some() && !tok.spec.allow_reenroll {
                return Err(ApiError::Conflict(format!(
                    "machine {name} is already enrolled; re-enrolling it needs a token created with --allow-reenroll"
                )));
            }
            let issued = self.authority.issue_machine(&name, &req.csr).map_err(|e| ApiError::invalid("csr", e.to_string()))?;
            let machine_key = format!("{MACHINES}{name}");
            let existing: Option<Versioned<Machine>> = self.get(&machine_key).await?;
            let (pools, _) = self.list::<MachinePool>(POOLS).await?;
            let now = meta::now();
            let (mut machine, machine_pre) = match existing {
                Some(m) => (m.object, Precondition::Revision(m.revision)),
                None => {
                    let mut m = Machine::new(name.clone());
                    m.metadata.generation = 1;
                    m.metadata.uid = Some(new_uid());
                    m.metadata.creation_timestamp = Some(now);
                    (m, Precondition::Absent)
                }
            };
            for (k, v) in &tok.spec.labels {
                machine.metadata.labels.insert(k.clone(), v.clone());
            }
            if let Some(pool) = owning_pool(&pools, &machine.metadata.labels) {
                // A machine that was in this pool before (re-enrolling) keeps the revision the
                // rollout gave it; a new member takes the current one.
                if machine.status.pool != pool.metadata.name && machine.spec != pool.spec.template.spec {
                    machine.spec = pool.spec.template.spec.clone();
                    machine.metadata.generation += 1;
                    machine.status.pool_revision = Some(pool.status.revision);
                }
                machine.status.pool = pool.metadata.name.clone();
            }
            machine.status.phase = Some(Phase::Enrolled);
            if req.facts.is_some() {
                machine.status.facts = req.facts.clone();
            }
            machine.status.last_heartbeat_time = Some(now);
            set_condition(&mut machine.status.conditions, condition::REACHABLE, ConditionStatus::True, "Enrolled", "", now);
            tok.status.usages += 1;
            let identity = Identity { serials: vec![issued.serial.clone()], enrolled_at: now };
            let ops = vec![
                Op::Put {
                    key: token_key,
                    value: encode(&StoredToken { token: tok, secret_sha256: stored.object.secret_sha256 }),
                    precondition: Precondition::Revision(stored.revision),
                },
                Op::Put { key: machine_key, value: encode(&machine), precondition: machine_pre },
                Op::Put {
                    key: identity_key,
                    value: encode(&identity),
                    precondition: existing_identity.map_or(Precondition::Absent, |i| Precondition::Revision(i.revision)),
                },
            ];
            match self.store.txn(ops).await {
                Ok(_) => {
                    self.record_event(
                        name.as_str(),
                        "Normal",
                        "Enrolled",
                        &format!("with token {}, certificate serial {}", token.id, issued.serial),
                        "controller",
                    )
                    .await?;
                    return Ok(EnrollResponse { name, certificate: issued.cert_pem, ca_bundle: self.authority.cert_pem.clone() });
                }
                Err(StoreError::Conflict { .. }) => {
                    after_conflict(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("machine {name} or its token changed during enrollment; try again")))
    }

    /// Whether a certificate serial may currently act as the machine.
    pub async fn identity_is_current(&self, name: &Name, serial: &str) -> Result<bool, ApiError> {
        Ok(self.get::<Identity>(&format!("{IDENTITIES}{name}")).await?.is_some_and(|i| i.object.serials.iter().any(|s| s == serial)))
    }

    /// Issues a fresh certificate to an enrolled machine; the presenting certificate stays
    /// valid until the agent uses the new one.
    pub async fn rotate_certificate(&self, name: &Name, presenting_serial: &str, csr_pem: &str) -> Result<EnrollResponse, ApiError> {
        let csr = pki::parse_csr(csr_pem).map_err(|e| ApiError::invalid("csr", e.to_string()))?;
        if pki::csr_common_name(&csr).as_deref() != Some(name.as_str()) {
            return Err(ApiError::invalid("csr", format!("the CSR's common name must be {name}")));
        }
        let key = format!("{IDENTITIES}{name}");
        for attempt in 0..CAS_ATTEMPTS {
            let current: Versioned<Identity> =
                self.get(&key).await?.ok_or_else(|| ApiError::Forbidden(format!("machine {name} is not enrolled")))?;
            let issued = self.authority.issue_machine(name, csr_pem).map_err(|e| ApiError::invalid("csr", e.to_string()))?;
            let identity =
                Identity { serials: vec![issued.serial.clone(), presenting_serial.to_owned()], enrolled_at: current.object.enrolled_at };
            match self
                .store
                .txn(vec![Op::Put { key: key.clone(), value: encode(&identity), precondition: Precondition::Revision(current.revision) }])
                .await
            {
                Ok(_) => {
                    self.record_event(
                        name.as_str(),
                        "Normal",
                        "CertificateRotated",
                        &format!("new serial {}", issued.serial),
                        "controller",
                    )
                    .await?;
                    return Ok(EnrollResponse {
                        name: name.clone(),
                        certificate: issued.cert_pem,
                        ca_bundle: self.authority.cert_pem.clone(),
                    });
                }
                Err(StoreError::Conflict { .. }) => {
                    after_conflict(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict("identity changed during rotation; try again".into()))
    }
}

fn random_token_part(len: usize) -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..len).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

pub fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::StoreExt;
    use crate::store::sqlite::SqliteStore;

    /// Writers that meet on one machine all get through: one that lost a compare-and-swap
    /// waits a random while before its next attempt, instead of meeting the others again at
    /// once until it runs out of attempts.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn many_writers_on_one_machine_all_get_through() -> anyhow::Result<()> {
        const WRITERS: usize = 48;
        let dir = tempfile::tempdir()?;
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir.path().join("keelson.db"))?);
        let (authority, _) = Authority::load_or_create(dir.path())?;
        let (_, leading) = tokio::sync::watch::channel(true);
        let registry = Arc::new(Registry::new(store.clone(), Arc::new(authority), leading));
        store.put(&format!("{MACHINES}m"), encode(&Machine::new("m".parse()?)), Precondition::Absent).await?;
        let writers: Vec<_> = (0..WRITERS)
            .map(|i| {
                let registry = registry.clone();
                tokio::spawn(async move {
                    registry
                        .update_machine("m", |m| {
                            m.metadata.annotations.insert(format!("writer-{i}"), "was here".into());
                            Ok(true)
                        })
                        .await
                })
            })
            .collect();
        for w in writers {
            w.await??;
        }
        let machine = registry.machine("m").await?.object;
        assert_eq!(machine.metadata.annotations.len(), WRITERS, "a writer's change was lost");
        Ok(())
    }

    /// The reachability check reads the leader's decoded fleet, in which heartbeats do not
    /// show (they are stored apart): a machine whose only sign of life since the copy was made
    /// is a heartbeat stays reachable, and a silent one is marked. After the copy is dropped,
    /// as a replica that stops leading does, the next check sees the whole fleet again.
    #[tokio::test]
    async fn the_reachability_check_hears_heartbeats_the_decoded_fleet_does_not_hold() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir.path().join("keelson.db"))?);
        let (authority, _) = Authority::load_or_create(dir.path())?;
        let (_, leading) = tokio::sync::watch::channel(true);
        let registry = Registry::new(store.clone(), Arc::new(authority), leading);
        let long_ago = meta::now() - std::time::Duration::from_secs(120);
        for name in ["beating", "silent"] {
            let mut m = Machine::new(name.parse()?);
            m.status.last_heartbeat_time = Some(long_ago);
            store.put(&format!("{MACHINES}{name}"), encode(&m), Precondition::Absent).await?;
        }
        assert_eq!(registry.decoded_fleet().await?.0.len(), 2);
        store.put(&format!("{HEARTBEATS}beating"), encode(&Heartbeat { time: meta::now() }), Precondition::None).await?;

        assert_eq!(registry.mark_unreachable(std::time::Duration::from_secs(30)).await?, 1);
        let phase = |m: Versioned<Machine>| m.object.status.phase;
        assert_eq!(phase(registry.machine("silent").await?), Some(Phase::Unreachable));
        assert_ne!(phase(registry.machine("beating").await?), Some(Phase::Unreachable));

        registry.forget_decoded_fleet().await;
        let mut late = Machine::new("late".parse()?);
        late.status.last_heartbeat_time = Some(long_ago);
        store.put(&format!("{MACHINES}late"), encode(&late), Precondition::Absent).await?;
        assert_eq!(registry.mark_unreachable(std::time::Duration::from_secs(30)).await?, 1, "only the new machine is newly silent");
        assert_ne!(phase(registry.machine("beating").await?), Some(Phase::Unreachable));
        let (fleet, _) = registry.decoded_fleet().await?;
        let names: Vec<&str> = fleet.iter().map(|m| m.object.metadata.name_str()).collect();
        assert_eq!(names, ["beating", "late", "silent"]);
        Ok(())
    }
}
