//! Disruption leases: before an agent does anything that interrupts workloads (restarting
//! the runtime or kubelet, rebooting, restarting an etcd member) it asks for a lease. The
//! controller grants it while the machine's pool has fewer unexpired leases than its
//! `maxUnavailable` allows. A lease has a TTL the holder renews, so a dead holder never
//! blocks the pool for longer than that.
//!
//! Each lease is its own key, `/leases/<scope>/<machine>`, where the scope is the pool (or
//! `-<machine>` for a machine in no pool). Granting compares-and-swaps the scope's small
//! budget key `/lease-budgets/<scope>` in the same transaction, so two controllers (or two
//! requests) can never both take the last slot; renewing and releasing touch only the
//! lease's own key. A grant deletes the scope's expired leases in its transaction, each
//! compared at the revision it read, so a lease counted as expired cannot be renewed back to
//! life behind the grant's back.
//!
//! Earlier versions kept a pool's leases together in one key, `/leases/<scope>`: it grew
//! with every holder and was rewritten at every grant, renewal and release (at 1,000
//! holders that filled etcd's space quota in minutes). Such a key is split into lease keys
//! the first time its scope is used.

use std::collections::HashSet;

use keelson_api::cluster::KubernetesCluster;
use keelson_api::machine::{KubeadmUpgrade, Role};
use keelson_api::meta::{self, Name, Timestamp};
use keelson_api::pool::{DrainSpec, MachinePool};
use keelson_api::version::KubeVersion;
use keelson_api::window::MaintenanceWindow;
use serde::{Deserialize, Serialize};

use crate::drain::{Drain, DrainPhase, drain_key};
use crate::error::ApiError;
use crate::events::Append;
use crate::registry::{CAS_ATTEMPTS, POOLS, Registry, Versioned, after_conflict, decode, encode, event, owning_pool};
use crate::store::{Op, Precondition, StoreError};

pub const LEASES: &str = "/leases/";
/// One key per scope that every grant in it compares-and-swaps.
pub const LEASE_BUDGETS: &str = "/lease-budgets/";
pub const MIN_TTL_SECS: u64 = 10;
/// The most writes this module puts in one transaction: etcd refuses more than 128 by default
/// (`--max-txn-ops`), and the etcd store gathers writes of several callers into one.
const MAX_OPS_PER_WRITE: usize = 50;
pub const MAX_TTL_SECS: u64 = 3600;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Lease {
    pub id: String,
    pub machine: Name,
    pub reason: String,
    #[serde(with = "time::serde::rfc3339")]
    pub granted_at: Timestamp,
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: Timestamp,
    /// For a machine with kubeadm in its spec: the kubeadm upgrade it runs under this lease
    /// (crate::leases::kubeadm_for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeadm: Option<KubeadmUpgrade>,
}

/// Which machine of a cluster runs `kubeadm upgrade apply` for a version, stored under
/// `/kubeadm-apply/<cluster>` in the transaction that grants it its lease. While the API server
/// is older than `version`, every other control-plane machine waits for it; once the server
/// reports the version, they run `kubeadm upgrade node`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplyClaim {
    pub cluster: Name,
    pub version: KubeVersion,
    pub machine: Name,
    #[serde(with = "time::serde::rfc3339")]
    pub claimed_at: Timestamp,
}

pub const KUBEADM_APPLY: &str = "/kubeadm-apply/";

/// What a machine's kubeadm upgrade needs to know at its grant.
#[derive(Debug)]
struct KubeadmPlan {
    version: KubeVersion,
    control_plane: bool,
    /// The cluster its pool is linked to.
    cluster: Option<Name>,
}

/// The value of a scope's budget key: how many leases its last grant left held. The count
/// is for operators reading the store; what guards the budget is the key's revision.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Budget {
    held: usize,
}

/// The earlier layout: every lease of a scope in one key.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolLeases {
    leases: Vec<Lease>,
}

/// Why a lease was not granted now; the agent waits and asks again.
#[derive(Debug)]
pub enum Decision {
    Granted(Lease),
    Wait { message: String },
}

/// Where a machine's lease counts, and against what.
#[derive(Debug)]
struct Scope {
    /// The pool's name, or `-<machine>` for a machine in no pool.
    name: String,
    budget: usize,
    /// The scope's other members that are unavailable already.
    down: Vec<Name>,
    windows: Vec<MaintenanceWindow>,
    /// When the pool drains its machines' Kubernetes nodes (crate::drain).
    drain: Option<DrainPlan>,
    /// When the machine's spec has kubeadm.
    kubeadm: Option<KubeadmPlan>,
}

/// What a grant in a draining pool needs to start a drain.
#[derive(Debug)]
struct DrainPlan {
    cluster: Name,
    spec: DrainSpec,
    /// The machine's node; `None` while the machine has not said its hostname.
    node: Option<String>,
}

impl Scope {
    fn prefix(&self) -> String {
        format!("{LEASES}{}/", self.name)
    }

    fn lease_key(&self, machine: &Name) -> String {
        format!("{LEASES}{}/{machine}", self.name)
    }

    fn budget_key(&self) -> String {
        format!("{LEASE_BUDGETS}{}", self.name)
    }

    fn legacy_key(&self) -> String {
        format!("{LEASES}{}", self.name)
    }
}

/// Why no lease can be granted now, when the holders and the other unavailable members
/// (counted once when a holder is also down) fill the budget.
fn over_budget(leases: &[&Lease], down: &[Name], budget: usize) -> Option<String> {
    let holders: HashSet<&Name> = leases.iter().map(|l| &l.machine).collect();
    let unavailable: Vec<&Name> = down.iter().filter(|d| !holders.contains(d)).collect();
    let taken = leases.len() + unavailable.len();
    if taken < budget {
        return None;
    }
    let all: Vec<String> =
        leases.iter().map(|l| l.machine.to_string()).chain(unavailable.iter().map(|d| format!("{d} (not Ready)"))).collect();
    Some(format!("{taken} of {budget} allowed unavailable ({})", all.join(", ")))
}

fn check_ttl(ttl_secs: u64) -> Result<(), ApiError> {
    if (MIN_TTL_SECS..=MAX_TTL_SECS).contains(&ttl_secs) {
        Ok(())
    } else {
        Err(ApiError::invalid("ttlSeconds", format!("must be between {MIN_TTL_SECS} and {MAX_TTL_SECS}")))
    }
}

impl Registry {
    /// The scope and budget of a machine's lease: its pool's `maxUnavailable` over the pool's
    /// member count, and the other members that are unavailable already (not Ready, or
    /// unreachable), which use up the budget as leases do. A machine in no pool disrupts
    /// only itself.
    async fn lease_scope(&self, name: &Name) -> Result<Scope, ApiError> {
        let machine = self.machine(name.as_str()).await?;
        let (pools, _) = self.list::<MachinePool>(POOLS).await?;
        let kubeadm = |cluster: Option<&Name>| {
            machine.object.spec.kubeadm.as_ref().map(|k| KubeadmPlan {
                version: k.version.clone(),
                control_plane: machine.object.spec.roles.contains(&Role::ControlPlane),
                cluster: cluster.cloned(),
            })
        };
        let Some(pool) = owning_pool(&pools, &machine.object.metadata.labels) else {
            return Ok(Scope {
                name: format!("-{name}"),
                budget: 1,
                down: Vec::new(),
                windows: Vec::new(),
                drain: None,
                kubeadm: kubeadm(None),
            });
        };
        let (members, down) = {
            let mut census = self.census.lock().unwrap_or_else(|e| e.into_inner());
            census.catch_up(&*self.store, &pools);
            match census.tally(pool.metadata.name_str()) {
                Some(t) => (t.members, t.down.iter().filter(|n| n.as_str() != name.as_str()).filter_map(|n| n.parse().ok()).collect()),
                None => (0, Vec::new()),
            }
        };
        Ok(Scope {
            name: pool.metadata.name_str().to_owned(),
            budget: pool.spec.rollout.max_unavailable.resolve(members),
            down,
            windows: pool.spec.rollout.maintenance_windows.clone(),
            drain: pool.spec.kubernetes.as_ref().and_then(|k| {
                let spec = k.drain.clone()?;
                Some(DrainPlan { cluster: k.cluster.clone(), spec, node: crate::clusters::node_name(&machine.object) })
            }),
            kubeadm: kubeadm(pool.spec.kubernetes.as_ref().map(|k| &k.cluster)),
        })
    }

    /// Splits a scope's leases kept in the earlier one-key layout into lease keys, and moves
    /// its budget key so that a grant that read the scope before the split cannot commit.
    async fn split_legacy_leases(&self, scope: &Scope) -> Result<(), ApiError> {
        'attempt: for attempt in 0..CAS_ATTEMPTS {
            let Some(legacy) = self.get::<PoolLeases>(&scope.legacy_key()).await? else {
                return Ok(());
            };
            let unchanged = || Op::Check { key: scope.legacy_key(), precondition: Precondition::Revision(legacy.revision) };
            let now = meta::now();
            let held: Vec<&Lease> = legacy.object.leases.iter().filter(|l| l.expires_at > now).collect();
            // In parts small enough for one etcd transaction, each only while the one key is
            // as read: once another replica has split it, nothing here lands.
            for part in held.chunks(MAX_OPS_PER_WRITE) {
                let mut ops: Vec<Op> = part
                    .iter()
                    .map(|l| Op::Put { key: scope.lease_key(&l.machine), value: encode(l), precondition: Precondition::None })
                    .collect();
                ops.push(unchanged());
                match self.store.txn(ops).await {
                    Ok(_) => {}
                    Err(StoreError::Conflict { .. }) => {
                        after_conflict(attempt).await;
                        continue 'attempt;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            let ops = vec![
                Op::Delete { key: scope.legacy_key(), precondition: Precondition::Revision(legacy.revision) },
                Op::Put { key: scope.budget_key(), value: encode(&Budget { held: held.len() }), precondition: Precondition::None },
            ];
            match self.store.txn(ops).await {
                Ok(_) => {
                    tracing::info!(scope = scope.name, leases = held.len(), "split the scope's disruption leases into one key each");
                    return Ok(());
                }
                Err(StoreError::Conflict { .. }) => {
                    after_conflict(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict("leases are changing too often; try again".into()))
    }

    pub async fn acquire_lease(&self, name: &Name, reason: &str, ttl_secs: u64) -> Result<Decision, ApiError> {
        check_ttl(ttl_secs)?;
        let scope = self.lease_scope(name).await?;
        self.split_legacy_leases(&scope).await?;
        // A grant writes its event in its own transaction. When the scope has room as its lease
        // keys stand in memory, the machine's history is read before waiting for the other
        // grants (and again only if it moves meanwhile). A request that will most likely be
        // told to wait (agents ask again every few seconds) reads nothing from the store.
        let room = self.store.list_keys(&scope.prefix()).entries.len() + scope.down.len() < scope.budget;
        let mut history = if room { Some(self.events_tail(name.as_str()).await?) } else { None };
        // Grants in one scope conflict on its budget key: taking them one at a time in this
        // process spares them a storm of compare-and-swap retries when a wave starts. The
        // compare-and-swap still guards against other replicas.
        let one_at_a_time = self.lease_lock.lock().await;
        for attempt in 0..CAS_ATTEMPTS {
            // The budget key first, then the leases: the listing is at least as new as the
            // budget's revision, so it holds every lease granted up to it; a grant after it
            // moved the budget key, and the compare below fails.
            let budget = match self.store.get(&scope.budget_key()).await? {
                Some(entry) => Precondition::Revision(entry.mod_revision),
                None => Precondition::Absent,
            };
            let (leases, _) = self.list::<Lease>(&scope.prefix()).await?;
            let drain = self.get::<Drain>(&drain_key(name)).await?;
            let mut draining = None;
            let now = meta::now();
            let expires_at = now + time::Duration::seconds(ttl_secs as i64);
            let (held, expired): (Vec<&Versioned<Lease>>, Vec<&Versioned<Lease>>) = leases.iter().partition(|l| l.object.expires_at > now);

            let (lease, mut ops) = if let Some(mine) = held.iter().find(|l| &l.object.machine == name) {
                // Its node is being drained (or brought back) for it: not yet.
                if let Some(d) = drain.as_ref().filter(|d| d.object.lease == mine.object.id && d.object.phase != DrainPhase::Drained) {
                    return Ok(Decision::Wait { message: d.object.waiting() });
                }
                // A machine asking again while it holds a lease gets the same one, renewed.
                let lease = Lease { expires_at, ..mine.object.clone() };
                let op = Op::Put { key: scope.lease_key(name), value: encode(&lease), precondition: Precondition::Revision(mine.revision) };
                (lease, vec![op])
            } else if expired.len() > MAX_OPS_PER_WRITE {
                // More expired leases than one grant can delete (its holders died together):
                // delete some, each at the revision read so that none is renewed meanwhile.
                let ops = expired
                    .iter()
                    .take(MAX_OPS_PER_WRITE)
                    .map(|l| Op::Delete { key: scope.lease_key(&l.object.machine), precondition: Precondition::Revision(l.revision) })
                    .collect();
                match self.store.txn(ops).await {
                    Ok(_) => continue,
                    Err(StoreError::Conflict { .. }) => {
                        after_conflict(attempt).await;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            } else if let Some(d) = drain
                .as_ref()
                .filter(|d| scope.drain.is_some() && d.object.phase == DrainPhase::Failed && d.object.retry_at.is_some_and(|t| t > now))
            {
                return Ok(Decision::Wait { message: d.object.waiting() });
            } else if !keelson_api::window::any_open(&scope.windows, now) {
                let message = format!("outside the maintenance windows ({})", keelson_api::window::describe(&scope.windows));
                return Ok(Decision::Wait { message });
            } else if let Some(message) = over_budget(&held.iter().map(|l| &l.object).collect::<Vec<_>>(), &scope.down, scope.budget) {
                return Ok(Decision::Wait { message });
            } else {
                let id: [u8; 8] = rand::random();
                let mut lease = Lease {
                    id: hex::encode(id),
                    machine: name.clone(),
                    reason: reason.to_owned(),
                    granted_at: now,
                    expires_at,
                    kubeadm: None,
                };
                let mut ops =
                    vec![Op::Put { key: scope.budget_key(), value: encode(&Budget { held: held.len() + 1 }), precondition: budget }];
                if let Some(plan) = &scope.kubeadm {
                    match self.kubeadm_for(plan, name).await? {
                        Ok((upgrade, claim)) => {
                            lease.kubeadm = Some(upgrade);
                            ops.extend(claim);
                        }
                        Err(message) => return Ok(Decision::Wait { message }),
                    }
                }
                // The machine's own expired lease is overwritten below, the others deleted.
                let mine_expired = expired.iter().find(|l| &l.object.machine == name).map(|l| l.revision);
                ops.extend(
                    expired
                        .iter()
                        .filter(|l| &l.object.machine != name)
                        .map(|l| Op::Delete { key: scope.lease_key(&l.object.machine), precondition: Precondition::Revision(l.revision) }),
                );
                let precondition = mine_expired.map_or(Precondition::Absent, Precondition::Revision);
                ops.push(Op::Put { key: scope.lease_key(name), value: encode(&lease), precondition });
                if let Some(plan) = &scope.drain {
                    match self.drain_for(plan, &scope, &lease, ttl_secs, drain.as_ref()).await? {
                        Ok((record, drain_ops)) => {
                            ops.extend(drain_ops);
                            draining = Some(record);
                        }
                        Err(message) => return Ok(Decision::Wait { message }),
                    }
                }
                (lease, ops)
            };
            let (event_reason, message) = match &draining {
                Some(d) => {
                    ("DrainStarted", format!("lease {} for {reason}; draining node {} of cluster {} first", lease.id, d.node, d.cluster))
                }
                None => ("DisruptionGranted", format!("lease {} for {reason}", lease.id)),
            };
            let tail = match history.take() {
                Some(tail) => tail,
                None => self.events_tail(name.as_str()).await?,
            };
            let Append { ops: event_ops, trim } = tail.append(vec![event("Normal", event_reason, message, "controller")])?;
            ops.extend(event_ops);
            match self.store.txn(ops).await {
                Ok(_) => {
                    drop(one_at_a_time);
                    self.trim_after_append(name.as_str(), trim).await?;
                    let Some(record) = draining else { return Ok(Decision::Granted(lease)) };
                    self.drain_wake.notify_one();
                    return Ok(Decision::Wait { message: record.waiting() });
                }
                Err(StoreError::Conflict { .. }) => after_conflict(attempt).await,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict("leases are changing too often; try again".into()))
    }

    /// The kubeadm upgrade a new lease carries, and the write that claims the cluster's
    /// `kubeadm upgrade apply` for this machine when it is the first control-plane machine to
    /// reach the version; Err with why no lease can be granted yet. Workers always run
    /// `upgrade node` (their pools wait for the control plane: crate::clusters::skew_hold).
    async fn kubeadm_for(&self, plan: &KubeadmPlan, machine: &Name) -> Result<Result<(KubeadmUpgrade, Vec<Op>), String>, ApiError> {
        if !plan.control_plane {
            return Ok(Ok((KubeadmUpgrade::Node, Vec::new())));
        }
        let version = &plan.version;
        let Some(cluster_name) = &plan.cluster else {
            return Ok(Err(format!(
                "control-plane machine {machine} upgrades with kubeadm {version}: link its pool to a cluster (spec.kubernetes.cluster) \
                 so that the controller can choose the machine that runs kubeadm upgrade apply"
            )));
        };
        let Some(cluster) = self.get::<KubernetesCluster>(&format!("{}{cluster_name}", crate::clusters::CLUSTERS)).await? else {
            return Ok(Err(format!(
                "cluster {cluster_name} is not registered (keelson cluster register {cluster_name} --kubeconfig FILE)"
            )));
        };
        let Some(server) = &cluster.object.status.server_version else {
            return Ok(Err(format!(
                "waiting to read the version of cluster {cluster_name}'s API server (to choose the machine that runs kubeadm upgrade apply {version})"
            )));
        };
        if server >= version {
            return Ok(Ok((KubeadmUpgrade::Node, Vec::new())));
        }
        let key = format!("{KUBEADM_APPLY}{cluster_name}");
        let claim = self.get::<ApplyClaim>(&key).await?;
        if let Some(c) = &claim
            && &c.object.version == version
            && &c.object.machine != machine
            && self.still_applying(&c.object).await?
        {
            return Ok(Err(format!(
                "waiting for {} to run kubeadm upgrade apply {version} (cluster {cluster_name}'s API server reports {server})",
                c.object.machine
            )));
        }
        let record =
            ApplyClaim { cluster: cluster_name.clone(), version: version.clone(), machine: machine.clone(), claimed_at: meta::now() };
        let precondition = claim.map_or(Precondition::Absent, |c| Precondition::Revision(c.revision));
        Ok(Ok((KubeadmUpgrade::Apply, vec![Op::Put { key, value: encode(&record), precondition }])))
    }

    /// The machine that claimed a cluster's `kubeadm upgrade apply` still exists and still wants
    /// that version; else the claim is void and another control-plane machine takes it over.
    async fn still_applying(&self, claim: &ApplyClaim) -> Result<bool, ApiError> {
        let key = format!("{}{}", crate::registry::MACHINES, claim.machine);
        let machine = self.get::<keelson_api::machine::Machine>(&key).await?;
        Ok(machine.is_some_and(|m| {
            m.object.metadata.deletion_timestamp.is_none() && m.object.spec.kubeadm.is_some_and(|k| k.version == claim.version)
        }))
    }

    /// The drain a new lease in a draining pool starts, and the writes that store it with the
    /// grant; Err with why no lease can be granted yet.
    async fn drain_for(
        &self,
        plan: &DrainPlan,
        scope: &Scope,
        lease: &Lease,
        ttl_secs: u64,
        previous: Option<&Versioned<Drain>>,
    ) -> Result<Result<(Drain, Vec<Op>), String>, ApiError> {
        let cluster_key = format!("{}{}", crate::clusters::CLUSTERS, plan.cluster);
        if self.store.get(&cluster_key).await?.is_none() {
            return Ok(Err(format!(
                "pool {} drains nodes of cluster {}, which is not registered (keelson cluster register {} --kubeconfig FILE)",
                scope.name, plan.cluster, plan.cluster
            )));
        }
        let Some(node) = plan.node.clone() else {
            return Ok(Err(format!(
                "the machine's Kubernetes node is not known yet: its agent has not reported a hostname (or set annotation {})",
                keelson_api::meta::annotation::NODE_NAME
            )));
        };
        // A node an earlier drain cordoned and has not uncordoned yet is still ours to uncordon.
        let cordoned_before =
            previous.filter(|p| p.object.phase != DrainPhase::Failed && p.object.node == node).and_then(|p| p.object.cordoned_before);
        let record = Drain {
            machine: lease.machine.clone(),
            lease: lease.id.clone(),
            lease_key: scope.lease_key(&lease.machine),
            ttl_seconds: ttl_secs,
            cluster: plan.cluster.clone(),
            node,
            phase: DrainPhase::Draining,
            started_at: lease.granted_at,
            timeout_seconds: plan.spec.timeout_seconds,
            retry_after_seconds: plan.spec.retry_after_seconds,
            cordoned_before,
            message: String::new(),
            retry_at: None,
        };
        let precondition = previous.map_or(Precondition::Absent, |p| Precondition::Revision(p.revision));
        let ops = vec![
            Op::Put { key: drain_key(&lease.machine), value: encode(&record), precondition },
            Op::Check { key: cluster_key, precondition: Precondition::Exists },
        ];
        Ok(Ok((record, ops)))
    }

    /// Renews (`ttl_secs` Some) or releases (None) a machine's lease. Only the lease's own
    /// key changes: a release frees its slot for the next grant, and a renewal of a lease a
    /// grant has just counted as expired (and deleted) fails.
    pub async fn update_lease(&self, name: &Name, id: &str, ttl_secs: Option<u64>) -> Result<Option<Lease>, ApiError> {
        if let Some(t) = ttl_secs {
            check_ttl(t)?;
        }
        let scope = self.lease_scope(name).await?;
        self.split_legacy_leases(&scope).await?;
        let key = scope.lease_key(name);
        for attempt in 0..CAS_ATTEMPTS {
            let now = meta::now();
            let current = self.get::<Lease>(&key).await?.filter(|l| l.object.id == id && l.object.expires_at > now);
            let Some(current) = current else {
                return Err(ApiError::NotFound(format!("lease {id} of {name} not found (expired or released)")));
            };
            let precondition = Precondition::Revision(current.revision);
            // Released after a drain: the lease stays held until the node is back.
            let drain = match ttl_secs {
                None => self
                    .get::<Drain>(&drain_key(name))
                    .await?
                    .filter(|d| d.object.lease == id && matches!(d.object.phase, DrainPhase::Draining | DrainPhase::Drained)),
                Some(_) => None,
            };
            let uncordon = drain.is_some();
            let (mut ops, renewed, released) = match (drain, ttl_secs) {
                (Some(d), _) => {
                    let record = Drain { phase: DrainPhase::Uncordoning, message: String::new(), ..d.object };
                    let message = format!("lease {id}; bringing node {} back before the lease is free", record.node);
                    let ops = vec![
                        Op::Put { key: drain_key(name), value: encode(&record), precondition: Precondition::Revision(d.revision) },
                        Op::Check { key: key.clone(), precondition },
                    ];
                    (ops, None, Some(message))
                }
                (None, Some(t)) => {
                    let lease = Lease { expires_at: now + time::Duration::seconds(t as i64), ..current.object };
                    (vec![Op::Put { key: key.clone(), value: encode(&lease), precondition }], Some(lease), None)
                }
                (None, None) => (vec![Op::Delete { key: key.clone(), precondition }], None, Some(format!("lease {id}"))),
            };
            // A release writes its event in its own transaction.
            let mut trim = false;
            if let Some(message) = released {
                let append =
                    self.events_tail(name.as_str()).await?.append(vec![event("Normal", "DisruptionReleased", message, "controller")])?;
                ops.extend(append.ops);
                trim = append.trim;
            }
            match self.store.txn(ops).await {
                Ok(_) => {
                    self.trim_after_append(name.as_str(), trim).await?;
                    if uncordon {
                        self.drain_wake.notify_one();
                    }
                    return Ok(renewed);
                }
                Err(StoreError::Conflict { .. }) => after_conflict(attempt).await,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict("leases are changing too often; try again".into()))
    }

    /// Every unexpired lease, for operators and tests: lease keys, and any scope still in
    /// the earlier one-key layout.
    pub async fn leases(&self) -> Result<Vec<Lease>, ApiError> {
        let listing = self.store.list(LEASES).await?;
        let now = meta::now();
        let mut leases = Vec::new();
        for entry in &listing.entries {
            let found = if entry.key[LEASES.len()..].contains('/') {
                vec![decode::<Lease>(&entry.key, &entry.value)?]
            } else {
                decode::<PoolLeases>(&entry.key, &entry.value)?.leases
            };
            leases.extend(found.into_iter().filter(|l| l.expires_at > now));
        }
        Ok(leases)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::json;

    use super::*;
    use crate::pki::Authority;
    use crate::registry::MACHINES;
    use crate::store::sqlite::SqliteStore;
    use crate::store::{Entry, Listing, Since, Store, StoreExt, Watch};

    type R = anyhow::Result<()>;

    fn name(n: &str) -> Name {
        n.parse().unwrap_or_else(|e| panic!("{n}: {e:?}"))
    }

    /// A store holding pool `web` (`maxUnavailable` as given) and its Ready members.
    async fn fleet(dir: &tempfile::TempDir, max_unavailable: u32, members: &[&str]) -> anyhow::Result<Arc<dyn Store>> {
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir.path().join("keelson.db"))?);
        let pool = json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool",
            "metadata": {"name": "web", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"selector": {"matchLabels": {"pool": "web"}}, "template": {"spec": {"roles": ["worker"]}},
                     "rollout": {"maxUnavailable": max_unavailable}}});
        store.put(&format!("{POOLS}web"), serde_json::to_vec(&pool)?, Precondition::Absent).await?;
        for m in members {
            let machine = json!({"apiVersion": "keelson.io/v1alpha1", "kind": "Machine",
                "metadata": {"name": m, "labels": {"pool": "web"}},
                "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
            store.put(&format!("{MACHINES}{m}"), serde_json::to_vec(&machine)?, Precondition::Absent).await?;
        }
        Ok(store)
    }

    fn registry(dir: &tempfile::TempDir, store: &Arc<dyn Store>) -> anyhow::Result<Registry> {
        let (authority, _) = Authority::load_or_create(dir.path())?;
        let (_, leading) = tokio::sync::watch::channel(true);
        Ok(Registry::new(store.clone(), Arc::new(authority), leading))
    }

    async fn ask(registry: &Registry, machine: &str) -> anyhow::Result<Result<Lease, String>> {
        Ok(match registry.acquire_lease(&name(machine), "restart containerd", 60).await? {
            Decision::Granted(lease) => Ok(lease),
            Decision::Wait { message } => Err(message),
        })
    }

    fn granted(answer: Result<Lease, String>) -> Lease {
        answer.unwrap_or_else(|wait| panic!("not granted: {wait}"))
    }

    fn machines_holding(leases: Vec<Lease>) -> Vec<String> {
        let mut names: Vec<String> = leases.into_iter().map(|l| l.machine.to_string()).collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn each_lease_is_its_own_key_and_an_expired_one_frees_its_slot_for_good() -> R {
        let dir = tempfile::tempdir()?;
        let store = fleet(&dir, 2, &["a", "b", "c"]).await?;
        let registry = registry(&dir, &store)?;
        let a = granted(ask(&registry, "a").await?);
        let b = granted(ask(&registry, "b").await?);
        let wait = ask(&registry, "c").await?.err().unwrap_or_default();
        assert!(wait.starts_with("2 of 2 allowed unavailable (a, b"), "{wait}");
        // Asking again while holding renews the same lease.
        assert_eq!(granted(ask(&registry, "a").await?).id, a.id);

        // a's holder died: its lease runs out.
        let expired = Lease { expires_at: meta::now() - time::Duration::seconds(1), ..a.clone() };
        store.put("/leases/web/a", encode(&expired), Precondition::Exists).await?;
        let c = granted(ask(&registry, "c").await?);
        assert!(store.get("/leases/web/a").await?.is_none(), "the grant deleted the expired lease");
        let renewal = registry.update_lease(&name("a"), &a.id, Some(60)).await;
        assert!(matches!(renewal, Err(ApiError::NotFound(_))), "an expired lease came back: {renewal:?}");
        let budget: Budget = serde_json::from_slice(&store.get("/lease-budgets/web").await?.map(|e| e.value).unwrap_or_default())?;
        assert_eq!(budget.held, 2);

        // Renewal and release touch only the lease's own key.
        let before = store.get("/lease-budgets/web").await?.map(|e| e.mod_revision);
        let renewed = registry.update_lease(&name("b"), &b.id, Some(120)).await?.unwrap_or_else(|| panic!("no lease"));
        assert!(renewed.expires_at > b.expires_at);
        assert_eq!(registry.update_lease(&name("c"), &c.id, None).await?, None);
        assert_eq!(store.get("/lease-budgets/web").await?.map(|e| e.mod_revision), before);
        assert_eq!(machines_holding(registry.leases().await?), ["b"]);
        // A released lease is gone; a wrong id is not found.
        assert!(matches!(registry.update_lease(&name("c"), &c.id, None).await, Err(ApiError::NotFound(_))));
        assert!(matches!(registry.update_lease(&name("b"), &c.id, Some(60)).await, Err(ApiError::NotFound(_))));
        Ok(())
    }

    fn reasons(events: &[keelson_api::wire::Event]) -> Vec<&str> {
        events.iter().map(|e| e.reason.as_str()).collect()
    }

    #[tokio::test]
    async fn a_grant_and_a_release_write_their_events_in_their_own_transactions_even_when_the_history_moves() -> R {
        let dir = tempfile::tempdir()?;
        let store = fleet(&dir, 2, &["a", "b"]).await?;
        let registry = registry(&dir, &store)?;
        let before = store.revision();
        let a = granted(ask(&registry, "a").await?);
        assert_eq!(store.revision(), before + 1, "the grant and its event are one write");
        assert_eq!(registry.update_lease(&name("a"), &a.id, None).await?, None);
        assert_eq!(store.revision(), before + 2, "the release and its event are one write");
        assert_eq!(reasons(&registry.events("a").await?), ["DisruptionGranted", "DisruptionReleased"]);

        // b's grant reads b's history, then waits for another grant to finish; meanwhile b's
        // agent reports an event. The grant commits with its event after the agent's.
        let other_grant = registry.lease_lock.lock().await;
        let asking = ask(&registry, "b");
        tokio::pin!(asking);
        tokio::select! {
            _ = &mut asking => panic!("granted while another grant held the lock"),
            _ = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
        }
        registry.record_event("b", "Normal", "Step", "stopping containerd", "agent").await?;
        drop(other_grant);
        let b = granted(asking.await?);
        let events = registry.events("b").await?;
        assert_eq!(reasons(&events), ["Step", "DisruptionGranted"]);
        assert_eq!(events[1].message, format!("lease {} for restart containerd", b.id));
        Ok(())
    }

    /// A store that counts the reads of event histories asked of it.
    #[derive(Debug)]
    struct CountingHistoryReads {
        inner: Arc<dyn Store>,
        reads: AtomicUsize,
    }

    #[async_trait::async_trait]
    impl Store for CountingHistoryReads {
        async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
            self.inner.get(key).await
        }
        async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Entry>>, StoreError> {
            if keys.iter().any(|k| k.starts_with(crate::registry::EVENTS)) {
                self.reads.fetch_add(1, Ordering::SeqCst);
            }
            self.inner.get_many(keys).await
        }
        async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
            self.inner.list(prefix).await
        }
        fn list_keys(&self, prefix: &str) -> Listing {
            self.inner.list_keys(prefix)
        }
        async fn txn(&self, ops: Vec<Op>) -> Result<u64, StoreError> {
            self.inner.txn(ops).await
        }
        async fn watch(&self, prefix: &str, after: u64) -> Result<Watch, StoreError> {
            self.inner.watch(prefix, after).await
        }
        fn revision(&self) -> u64 {
            self.inner.revision()
        }
        fn since(&self, prefix: &str, after: Option<u64>) -> Since {
            self.inner.since(prefix, after)
        }
    }

    #[tokio::test]
    async fn a_request_told_to_wait_reads_no_history() -> R {
        let dir = tempfile::tempdir()?;
        let counting = Arc::new(CountingHistoryReads { inner: fleet(&dir, 1, &["a", "b"]).await?, reads: AtomicUsize::new(0) });
        let store: Arc<dyn Store> = counting.clone();
        let registry = registry(&dir, &store)?;
        let a = granted(ask(&registry, "a").await?);
        assert_eq!(counting.reads.load(Ordering::SeqCst), 1, "the grant read a's history");
        for _ in 0..3 {
            assert!(ask(&registry, "b").await?.is_err(), "b was granted a lease beyond the budget");
        }
        assert_eq!(counting.reads.load(Ordering::SeqCst), 1, "b's requests read its history");
        assert_eq!(registry.update_lease(&name("a"), &a.id, None).await?, None);
        granted(ask(&registry, "b").await?);
        assert_eq!(counting.reads.load(Ordering::SeqCst), 3, "the release and b's grant read a history each");
        assert_eq!(reasons(&registry.events("b").await?), ["DisruptionGranted"]);
        Ok(())
    }

    #[tokio::test]
    async fn leases_kept_in_one_key_by_an_earlier_version_count_and_are_split_on_first_use() -> R {
        let dir = tempfile::tempdir()?;
        let store = fleet(&dir, 1, &["a", "b", "c"]).await?;
        let registry = registry(&dir, &store)?;
        let now = meta::now();
        let lease = |m: &str, id: &str, expires_in: i64| Lease {
            id: id.into(),
            machine: name(m),
            reason: "reboot".into(),
            granted_at: now,
            expires_at: now + time::Duration::seconds(expires_in),
            kubeadm: None,
        };
        let legacy = PoolLeases { leases: vec![lease("a", "0a", 60), lease("b", "0b", -5)] };
        store.put("/leases/web", encode(&legacy), Precondition::Absent).await?;
        assert_eq!(machines_holding(registry.leases().await?), ["a"], "read from the earlier layout");

        let wait = ask(&registry, "c").await?.err().unwrap_or_default();
        assert_eq!(wait, "1 of 1 allowed unavailable (a)");
        assert!(store.get("/leases/web").await?.is_none(), "the one key was split");
        assert!(store.get("/leases/web/b").await?.is_none(), "the expired lease was dropped");
        assert_eq!(registry.update_lease(&name("a"), "0a", Some(60)).await?.map(|l| l.id), Some("0a".into()));
        assert_eq!(registry.update_lease(&name("a"), "0a", None).await?, None);
        granted(ask(&registry, "c").await?);
        Ok(())
    }

    #[tokio::test]
    async fn many_leases_move_in_transactions_etcd_takes() -> R {
        let dir = tempfile::tempdir()?;
        let store = fleet(&dir, 1, &["a", "b"]).await?;
        let registry = registry(&dir, &store)?;
        let now = meta::now();
        let lease = |i: usize, expires_in: i64| Lease {
            id: format!("{i:04}"),
            machine: name(&format!("gone-{i}")),
            reason: "reboot".into(),
            granted_at: now,
            expires_at: now + time::Duration::seconds(expires_in),
            kubeadm: None,
        };
        // 130 holders died together: a grant deletes them 50 at a time, then grants.
        for i in 0..130 {
            store.put(&format!("/leases/web/gone-{i}"), encode(&lease(i, -1)), Precondition::Absent).await?;
        }
        let before = store.revision();
        granted(ask(&registry, "a").await?);
        // Two deletions of 50, then the grant with the last 30 and the machine's event.
        assert_eq!(store.revision(), before + 3);
        assert_eq!(store.list("/leases/web/").await?.entries.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["/leases/web/a"]);

        // 130 live leases in the one-key layout are split in parts of 50.
        let legacy = PoolLeases { leases: (0..130).map(|i| lease(i, 60)).collect() };
        store.put("/leases/other", encode(&legacy), Precondition::Absent).await?;
        let scope = Scope { name: "other".into(), budget: 1, down: Vec::new(), windows: Vec::new(), drain: None, kubeadm: None };
        let before = store.revision();
        registry.split_legacy_leases(&scope).await?;
        assert_eq!(store.revision(), before + 4, "three parts and the last step");
        assert!(store.get("/leases/other").await?.is_none());
        assert_eq!(store.list("/leases/other/").await?.entries.len(), 130);
        Ok(())
    }

    #[tokio::test]
    async fn two_controllers_granting_at_once_never_exceed_the_budget() -> R {
        let dir = tempfile::tempdir()?;
        let members: Vec<String> = (0..12).map(|i| format!("m{i}")).collect();
        let store = fleet(&dir, 3, &members.iter().map(String::as_str).collect::<Vec<_>>()).await?;
        // Two registries over one store: each takes its own requests one at a time, so only
        // the budget key's compare-and-swap keeps them apart.
        let replicas = [Arc::new(registry(&dir, &store)?), Arc::new(registry(&dir, &store)?)];
        let asks = members.iter().enumerate().map(|(i, m)| {
            let registry = replicas[i % 2].clone();
            let machine = m.clone();
            tokio::spawn(async move { ask(&registry, &machine).await })
        });
        let mut grants = 0;
        for answer in futures_util::future::join_all(asks).await {
            grants += usize::from(answer??.is_ok());
        }
        assert_eq!(grants, 3);
        assert_eq!(replicas[0].leases().await?.len(), 3);
        Ok(())
    }
}
