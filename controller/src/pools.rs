//! MachinePools: their revisions (history and undo), pause and resume, and the rollout pass
//! that hands each member the current revision when the scheduler (`rollout`) says so.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use futures_util::stream::FuturesUnordered;
use futures_util::{StreamExt, TryStreamExt};
use keelson_api::cluster::KubernetesCluster;
use keelson_api::machine::{Machine, Phase};
use keelson_api::meta::{self, ConditionStatus, Name, annotation, condition, find_condition, set_condition};
use keelson_api::pool::{DeletionOrder, MachinePool, PoolEtcdStatus, PoolRevision, PoolStatus};
use keelson_api::validate::validate_spec_change;
use keelson_api::wire::Event;
use sha2::Digest;

use crate::error::ApiError;
use crate::registry::{
    CAS_ATTEMPTS, Deletion, MACHINES, POOLS, REVISIONS, ROLLOUTS, Registry, Versioned, after_conflict, encode, event, new_uid, not_found,
    owning_pool, parse_resource_version,
};
use crate::rollout::{self, Member, RolloutState};
use crate::store::{Op, Precondition, StoreError};

/// How a revision was made by an automatic undo (such revisions are not undone again).
const AUTO_UNDO: &str = "auto undo";
/// A rollout pass gives machines their revision in transactions of at most this many ops
/// (a machine, its newest event segment and the check that no newer one began are three),
/// within etcd's default of 128 compares, writes and reads each (`--max-txn-ops`)...
const GIVE_OPS_PER_TXN: usize = 126;
/// ... and of at most this many bytes, well within etcd's default request limit (1.5 MiB)
/// and the reply that reads the keys back when a transaction is refused.
const GIVE_BYTES_PER_TXN: usize = 512 * 1024;
/// Transactions of one pass in flight at once (etcd commits them in one round trip each).
const GIVE_TXNS_IN_PARALLEL: usize = 4;
/// Machines whose transactions a pass makes at a time: the next ones' event segments are read
/// while these are being committed.
const GIVE_CHUNK: usize = 500;
/// Machines given their revision one by one at the same time, after a transaction is
/// refused because one of its machines changed since the pass listed it.
const GIVE_IN_PARALLEL: usize = 16;

/// One transaction of a rollout pass.
#[derive(Default)]
struct GiveTxn {
    /// The machines it gives their revision, to give one by one when it is refused…
    names: Vec<String>,
    /// …and those of them whose event history is to be trimmed once it commits.
    to_trim: Vec<String>,
    ops: Vec<Op>,
    bytes: usize,
}

fn revision_key(pool: &str, revision: u64) -> String {
    format!("{REVISIONS}{pool}/{revision:020}")
}

fn revision_record(revision: u64, cause: String, pool: &MachinePool) -> PoolRevision {
    PoolRevision { revision, created: meta::now(), cause, template: pool.spec.template.clone() }
}

/// Gives `machine` its pool's current template and revision. `None` when it has them
/// already, or when its labels no longer match the pool; otherwise whether its spec changed
/// (a new generation).
fn take_revision(machine: &mut Machine, pool: &MachinePool) -> Option<bool> {
    if !pool.spec.selector.matches(&machine.metadata.labels) {
        return None;
    }
    let spec_changed = machine.spec != pool.spec.template.spec;
    if !spec_changed && !lags(machine, pool) {
        return None;
    }
    if spec_changed {
        machine.spec = pool.spec.template.spec.clone();
        machine.metadata.generation += 1;
    }
    machine.status.pool = pool.metadata.name.clone();
    machine.status.pool_revision = Some(pool.status.revision);
    Some(spec_changed)
}

/// Whether a machine's record of its pool and revision is not the pool's current one.
fn lags(machine: &Machine, pool: &MachinePool) -> bool {
    machine.status.pool.as_ref() != pool.metadata.name.as_ref() || machine.status.pool_revision != Some(pool.status.revision)
}

/// The event of a machine given a new generation by its pool.
fn spec_changed_event(machine: &Machine, pool: &MachinePool) -> Event {
    let message =
        format!("generation {} from pool {} revision {}", machine.metadata.generation, pool.metadata.name_str(), pool.status.revision);
    event("Normal", "SpecChanged", message, "controller")
}

fn op_bytes(op: &Op) -> usize {
    op.key().len()
        + match op {
            Op::Put { value, .. } => value.len(),
            Op::Delete { .. } | Op::Check { .. } => 0,
        }
}

/// How the scheduler sees a machine of a pool at `revision` with template `pool`.
fn member_view(m: &Machine, pool: &MachinePool) -> Member {
    let pool_name = pool.metadata.name.as_ref();
    let is_true = |t| find_condition(&m.status.conditions, t).is_some_and(|c| c.status == ConditionStatus::True);
    let unreachable = find_condition(&m.status.conditions, condition::REACHABLE).is_some_and(|c| c.status == ConditionStatus::False);
    let revision = if m.spec == pool.spec.template.spec {
        Some(pool.status.revision)
    } else if m.status.pool.as_ref() == pool_name {
        Some(m.status.pool_revision.unwrap_or(0))
    } else {
        None
    };
    let at_generation = m.status.observed_generation == m.metadata.generation;
    Member {
        name: m.metadata.name_str().to_owned(),
        priority: m.metadata.annotations.get(annotation::ROLLOUT_PRIORITY).and_then(|p| p.parse().ok()).unwrap_or(0),
        wave: pool.spec.rollout.wave_label.as_ref().and_then(|l| m.metadata.labels.get(l)).cloned().unwrap_or_default(),
        revision,
        converged: m.is_converged() && !unreachable,
        ready: is_true(condition::READY) && !unreachable,
        failed: (at_generation && is_true(condition::DEGRADED))
            .then(|| find_condition(&m.status.conditions, condition::DEGRADED).map(|c| c.message.clone()).unwrap_or_default()),
    }
}

/// The members to delete so that `replicas` stay: machines annotated
/// `keelson.io/delete-machine` first, then by `order` (Random is a fixed shuffle by uid, so a
/// pass never changes its mind). At most `budget` are being reset at once, counting those
/// already under way (`deleting`).
pub fn pick_for_deletion<'a>(
    live: &[&'a Machine],
    deleting: usize,
    replicas: usize,
    order: DeletionOrder,
    budget: usize,
) -> Vec<&'a Machine> {
    let excess = live.len().saturating_sub(replicas);
    let room = budget.saturating_sub(deleting);
    let mut ranked: Vec<&Machine> = live.to_vec();
    let shuffle = |m: &Machine| sha2::Sha256::digest(m.metadata.uid.as_deref().unwrap_or(m.metadata.name_str()).as_bytes()).to_vec();
    ranked.sort_by(|a, b| {
        let marked = |m: &Machine| !m.metadata.annotations.contains_key(annotation::DELETE_MACHINE);
        let by_order = match order {
            DeletionOrder::Oldest => a.metadata.creation_timestamp.cmp(&b.metadata.creation_timestamp),
            DeletionOrder::Newest => b.metadata.creation_timestamp.cmp(&a.metadata.creation_timestamp),
            DeletionOrder::Random => shuffle(a).cmp(&shuffle(b)),
        };
        marked(a).cmp(&marked(b)).then(by_order).then_with(|| a.metadata.name_str().cmp(b.metadata.name_str()))
    });
    ranked.into_iter().take(excess.min(room)).collect()
}

impl Registry {
    /// Creates or updates a pool. A template change makes a new revision, kept in the
    /// history; the rollout pass then moves the members to it at the pool's pace.
    /// Without `metadata.resourceVersion` the write is tried again when the rollout pass
    /// records the pool's status in between, as it does all the time during a rollout.
    pub async fn apply_pool(&self, input: MachinePool) -> Result<Versioned<MachinePool>, ApiError> {
        let name = input.metadata.name.clone().ok_or_else(|| ApiError::invalid("metadata.name", "is required"))?;
        let expected = parse_resource_version(input.metadata.resource_version.as_deref())?;
        let key = format!("{POOLS}{name}");
        for attempt in 0..CAS_ATTEMPTS {
            let Some((applied, new_revision)) = self.apply_pool_once(input.clone(), &name, expected, &key).await? else {
                after_conflict(attempt).await;
                continue;
            };
            if new_revision {
                self.prune_revisions(&applied.object).await?;
            }
            self.pass_if_leading().await?;
            return Ok(applied);
        }
        Err(ApiError::Conflict(format!("pool {name} is changing too often to update; try again")))
    }

    /// One compare-and-swap of `apply_pool`: the pool as written and whether its template
    /// made a new revision, or `None` when the pool changed since it was read here.
    async fn apply_pool_once(
        &self,
        input: MachinePool,
        name: &Name,
        expected: Option<u64>,
        key: &str,
    ) -> Result<Option<(Versioned<MachinePool>, bool)>, ApiError> {
        let current: Option<Versioned<MachinePool>> = self.get(key).await?;
        if let Some(rv) = expected
            && current.as_ref().map(|c| c.revision) != Some(rv)
        {
            return Err(ApiError::Conflict(format!("pool {name} changed since resourceVersion {rv}: read it again")));
        }
        let (pool, precondition, new_revision) = match &current {
            Some(cur) => {
                let mut p = cur.object.clone();
                validate_spec_change("spec.template.spec", &p.spec.template.spec, &input.spec.template.spec)?;
                let mut new_revision = false;
                if p.spec != input.spec {
                    p.metadata.generation += 1;
                    if p.spec.template != input.spec.template {
                        p.status.revision += 1;
                        new_revision = true;
                    }
                    p.spec = input.spec;
                }
                p.metadata.labels = input.metadata.labels;
                p.metadata.annotations = input.metadata.annotations;
                (p, Precondition::Revision(cur.revision), new_revision)
            }
            None => {
                let mut p = input;
                p.metadata.generation = 1;
                p.metadata.resource_version = None;
                p.metadata.uid = Some(new_uid());
                p.metadata.creation_timestamp = Some(meta::now());
                p.status = PoolStatus { revision: 1, ..Default::default() };
                (p, Precondition::Absent, true)
            }
        };
        let mut ops = vec![Op::Put { key: key.to_owned(), value: encode(&pool), precondition }];
        if new_revision {
            let record = revision_record(pool.status.revision, "applied".into(), &pool);
            ops.push(Op::Put {
                key: revision_key(name.as_str(), record.revision),
                value: encode(&record),
                precondition: Precondition::None,
            });
        }
        ops.extend(self.cluster_link(&pool).await?);
        match self.store.txn(ops).await {
            Ok(revision) => Ok(Some((Versioned { object: pool, revision }, new_revision))),
            // Created by someone else meanwhile, or changed by the rollout pass.
            Err(StoreError::Conflict { .. }) if expected.is_none() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes a pool with its history and rollout state; its machines keep their specs.
    pub async fn delete_pool(&self, name: &Name) -> Result<(), ApiError> {
        let mut ops = vec![Op::Delete { key: format!("{POOLS}{name}"), precondition: Precondition::Exists }];
        for r in self.store.list(&format!("{REVISIONS}{name}/")).await?.entries {
            ops.push(Op::Delete { key: r.key.clone(), precondition: Precondition::None });
        }
        ops.push(Op::Delete { key: format!("{ROLLOUTS}{name}"), precondition: Precondition::None });
        match self.store.txn(ops).await {
            Ok(_) => self.pass_if_leading().await,
            Err(StoreError::Conflict { key, .. }) if key.starts_with(POOLS) => Err(not_found("pool", name.as_str())),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn pool(&self, name: &str) -> Result<Versioned<MachinePool>, ApiError> {
        self.get(&format!("{POOLS}{name}")).await?.ok_or_else(|| not_found("pool", name))
    }

    /// The pool's kept revisions, oldest first.
    pub async fn revisions(&self, name: &str) -> Result<Vec<PoolRevision>, ApiError> {
        self.pool(name).await?;
        let (items, _) = self.list::<PoolRevision>(&format!("{REVISIONS}{name}/")).await?;
        Ok(items.into_iter().map(|v| v.object).collect())
    }

    async fn prune_revisions(&self, pool: &MachinePool) -> Result<(), ApiError> {
        let name = pool.metadata.name_str();
        let listing = self.store.list(&format!("{REVISIONS}{name}/")).await?;
        // The current revision plus `revisionHistoryLimit` earlier ones.
        let keep = pool.spec.rollout.revision_history_limit as usize + 1;
        let excess = listing.entries.len().saturating_sub(keep);
        let ops: Vec<Op> =
            listing.entries.iter().take(excess).map(|e| Op::Delete { key: e.key.clone(), precondition: Precondition::None }).collect();
        if !ops.is_empty() {
            self.store.txn(ops).await?;
        }
        Ok(())
    }

    /// Sets `spec.rollout.paused`.
    pub async fn set_paused(&self, name: &str, paused: bool) -> Result<Versioned<MachinePool>, ApiError> {
        let key = format!("{POOLS}{name}");
        for attempt in 0..CAS_ATTEMPTS {
            let current = self.pool(name).await?;
            let mut pool = current.object;
            if pool.spec.rollout.paused != paused {
                pool.spec.rollout.paused = paused;
                pool.metadata.generation += 1;
            }
            let put = Op::Put { key: key.clone(), value: encode(&pool), precondition: Precondition::Revision(current.revision) };
            match self.store.txn(vec![put]).await {
                Ok(revision) => {
                    self.pass_if_leading().await?;
                    return Ok(Versioned { object: pool, revision });
                }
                // The rollout pass recorded the pool's status meanwhile.
                Err(StoreError::Conflict { .. }) => {
                    after_conflict(attempt).await;
                    continue;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("pool {name} is changing too often to update; try again")))
    }

    /// Rolls the pool back to an earlier revision's template (by default the newest earlier
    /// one that differs from the current), as a new revision rolled out at the pool's pace.
    pub async fn undo_pool(&self, name: &str, to: Option<u64>) -> Result<Versioned<MachinePool>, ApiError> {
        let pool = {
            let _pass = self.rollout_lock.lock().await;
            // Another replica's rollout pass may record the pool's status meanwhile.
            let mut attempts = 1;
            loop {
                match self.undo_locked(name, to, None).await {
                    Err(ApiError::Conflict(_)) if attempts < CAS_ATTEMPTS => {
                        after_conflict(attempts).await;
                        attempts += 1;
                    }
                    undone => break undone?,
                }
            }
        };
        self.pass_if_leading().await?;
        Ok(pool)
    }

    async fn undo_locked(&self, name: &str, to: Option<u64>, auto: Option<&str>) -> Result<Versioned<MachinePool>, ApiError> {
        let current = self.pool(name).await?;
        let mut pool = current.object;
        let history = self.revisions(name).await?;
        let target = match to {
            Some(n) => history.iter().find(|r| r.revision == n).ok_or_else(|| {
                let kept = history.iter().map(|r| r.revision.to_string()).collect::<Vec<_>>().join(", ");
                ApiError::invalid("toRevision", format!("revision {n} of pool {name} is not in its history (kept: {kept})"))
            })?,
            None => history
                .iter()
                .rev()
                .find(|r| r.revision < pool.status.revision && r.template != pool.spec.template)
                .ok_or_else(|| ApiError::invalid("toRevision", format!("pool {name} has no earlier revision to go back to")))?,
        };
        if target.template == pool.spec.template {
            return Err(ApiError::invalid("toRevision", format!("revision {} is what pool {name} runs already", target.revision)));
        }
        validate_spec_change("spec.template.spec", &pool.spec.template.spec, &target.template.spec)?;
        let cause = match auto {
            Some(why) => format!("{AUTO_UNDO} to revision {}: {why}", target.revision),
            None => format!("undo to revision {}", target.revision),
        };
        pool.spec.template = target.template.clone();
        pool.metadata.generation += 1;
        pool.status.revision += 1;
        let record = revision_record(pool.status.revision, cause, &pool);
        let revision = self
            .store
            .txn(vec![
                Op::Put { key: format!("{POOLS}{name}"), value: encode(&pool), precondition: Precondition::Revision(current.revision) },
                Op::Put { key: revision_key(name, record.revision), value: encode(&record), precondition: Precondition::None },
            ])
            .await?;
        self.prune_revisions(&pool).await?;
        Ok(Versioned { object: pool, revision })
    }

    /// The rollout pass: for every pool, hands the current revision to the members the
    /// scheduler picks, records the pool's progress, and clears machines that left a pool
    /// (they keep the spec they had). Level-triggered: safe to run at any time, and run
    /// periodically so that rollouts move as machines report.
    pub async fn reconcile_pools(&self) -> Result<(), ApiError> {
        let _pass = self.rollout_lock.lock().await;
        let started = std::time::Instant::now();
        let (pools, _) = self.list::<MachinePool>(POOLS).await?;
        let (machines, _) = self.decoded_fleet().await?;
        let (clusters, _) = self.list::<KubernetesCluster>(crate::clusters::CLUSTERS).await?;
        let listed = started.elapsed();
        let by_name: std::collections::HashMap<&str, &Versioned<Arc<Machine>>> =
            machines.iter().map(|m| (m.object.metadata.name_str(), m)).collect();
        let mut members: BTreeMap<&str, Vec<&Machine>> = BTreeMap::new();
        let mut deleting: BTreeMap<&str, usize> = BTreeMap::new();
        for m in machines.iter().filter(|m| m.object.metadata.deletion_timestamp.is_some()) {
            if let Some(p) = owning_pool(&pools, &m.object.metadata.labels) {
                *deleting.entry(p.metadata.name_str()).or_default() += 1;
            }
        }
        // A machine being deleted is no longer the rollout's: its agent is resetting it.
        for m in machines.iter().filter(|m| m.object.metadata.deletion_timestamp.is_none()) {
            match owning_pool(&pools, &m.object.metadata.labels) {
                Some(p) => members.entry(p.metadata.name_str()).or_default().push(&m.object),
                None if m.object.status.pool.is_some() => {
                    self.leave_pool(m.object.metadata.name_str()).await?;
                }
                None => {}
            }
        }
        let views: BTreeMap<&str, Vec<Member>> = pools
            .iter()
            .map(|p| {
                let name = p.object.metadata.name_str();
                (name, members.get(name).map(|ms| ms.iter().map(|m| member_view(m, &p.object)).collect()).unwrap_or_default())
            })
            .collect();
        let rolled_out = |pool: &MachinePool, ms: &[Member]| ms.iter().all(|m| m.revision == Some(pool.status.revision) && m.converged);
        for p in &pools {
            let pool = &p.object;
            let name = pool.metadata.name_str();
            let ms = &views[name];
            let blocked_by: Vec<String> = pool
                .spec
                .rollout
                .after
                .iter()
                .filter(|before| {
                    pools
                        .iter()
                        .find(|q| q.object.metadata.name.as_ref() == Some(before))
                        .is_some_and(|q| !rolled_out(&q.object, &views[before.as_str()]))
                })
                .map(|n| n.to_string())
                .chain(
                    crate::clusters::control_plane_pools(pool, &pools)
                        .into_iter()
                        .filter(|q| !rolled_out(q, &views[q.metadata.name_str()]))
                        .map(|q| {
                            format!(
                                "{} (the control plane of cluster {})",
                                q.metadata.name_str(),
                                pool.spec.kubernetes.as_ref().map(|k| k.cluster.as_str()).unwrap_or_default()
                            )
                        }),
                )
                .collect();
            let held = crate::clusters::skew_hold(pool, &clusters);
            let state_key = format!("{ROLLOUTS}{name}");
            let stored: Option<Versioned<RolloutState>> = self.get(&state_key).await?;
            let state = stored.as_ref().map(|s| s.object.clone()).unwrap_or_default();
            let decision = rollout::schedule(rollout::Input {
                rollout: &pool.spec.rollout,
                revision: pool.status.revision,
                members: ms,
                state: state.clone(),
                blocked_by,
                held,
                now: meta::now(),
            });
            let picked: std::collections::BTreeSet<&str> = decision.update.iter().map(String::as_str).collect();
            let give: Vec<&Versioned<Arc<Machine>>> = members
                .get(name)
                .into_iter()
                .flatten()
                .filter(|machine| {
                    let at_template = machine.spec == pool.spec.template.spec;
                    picked.contains(machine.metadata.name_str()) || (at_template && lags(machine, pool))
                })
                .map(|machine| by_name[machine.metadata.name_str()])
                .collect();
            let given = give.len();
            self.give_revisions(&give, pool).await?;
            tracing::debug!(
                pool = name,
                given,
                listed_ms = listed.as_millis() as u64,
                so_far_ms = started.elapsed().as_millis() as u64,
                "rollout pass gave revisions"
            );
            if let Some(replicas) = pool.spec.replicas {
                let live = members.get(name).cloned().unwrap_or_default();
                let budget = pool.spec.rollout.max_unavailable.resolve(live.len());
                let order = pool.spec.deletion.order;
                let picked = pick_for_deletion(&live, deleting.get(name).copied().unwrap_or(0), replicas as usize, order, budget);
                for n in picked.iter().filter_map(|m| m.metadata.name.clone()) {
                    let why = format!("pool {name} keeps {replicas} machines (deletion order {order:?})");
                    self.record_event(n.as_str(), "Normal", "ScaleIn", &why, "controller").await?;
                    match self.delete_machine(&n, Deletion::Reset).await {
                        Ok(_) | Err(ApiError::NotFound(_)) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            if decision.state != state || stored.is_none() {
                self.store.txn(vec![Op::Put { key: state_key, value: encode(&decision.state), precondition: Precondition::None }]).await?;
            }
            self.record_pool_status(pool, p.revision, &decision, members.get(name).map(Vec::as_slice).unwrap_or_default()).await?;
            if let Some(why) = &decision.halted
                && pool.spec.rollout.auto_undo
                && !self.made_by_auto_undo(name, pool.status.revision).await?
            {
                match self.undo_locked(name, None, Some(why)).await {
                    Ok(undone) => {
                        tracing::warn!(pool = name, revision = undone.object.status.revision, %why, "rollout halted; undone automatically")
                    }
                    Err(e) => tracing::warn!(pool = name, error = %e, "rollout halted; automatic undo failed"),
                }
            }
        }
        Ok(())
    }

    async fn made_by_auto_undo(&self, pool: &str, revision: u64) -> Result<bool, ApiError> {
        let record = self.get::<PoolRevision>(&revision_key(pool, revision)).await?;
        Ok(record.is_some_and(|r| r.object.cause.starts_with(AUTO_UNDO)))
    }

    /// Gives listed machines their pool's current template and revision, many to a
    /// transaction: each machine (and its events) is a compare-and-swap on what the pass
    /// listed, so a 10,000-machine fan-out is a few hundred commits, not 20,000. A refused
    /// transaction commits nothing; its machines are then given their revision one by one,
    /// each read afresh.
    ///
    /// Machines are taken `GIVE_CHUNK` at a time, so the first transactions leave while the
    /// next machines' event segments are still being read.
    async fn give_revisions(&self, listed: &[&Versioned<Arc<Machine>>], pool: &MachinePool) -> Result<(), ApiError> {
        let mut chunks = listed.chunks(GIVE_CHUNK);
        let mut ready: VecDeque<GiveTxn> = VecDeque::new();
        let mut committing = FuturesUnordered::new();
        let mut trims = Vec::new();
        // The next chunk's transactions, made while earlier ones commit.
        let mut making = None;
        loop {
            while committing.len() < GIVE_TXNS_IN_PARALLEL
                && let Some(txn) = ready.pop_front()
            {
                committing.push(self.commit_give(txn, pool));
            }
            if making.is_none() && ready.len() <= GIVE_TXNS_IN_PARALLEL {
                making = chunks.next().map(|chunk| Box::pin(self.give_txns(chunk, pool)));
            }
            tokio::select! {
                made = async { making.as_mut().expect("only while making").await }, if making.is_some() => {
                    making = None;
                    ready.extend(made?);
                }
                Some(committed) = committing.next() => trims.extend(committed?),
                else => break,
            }
        }
        // Whole segments, in few transactions: in a uniform fleet every machine may begin a
        // new segment in the same pass.
        let deletes = trims.iter().flat_map(|name| self.events_trim(name)).collect();
        self.delete_in_chunks(deletes).await
    }

    /// The transactions that give `listed` machines their revision (those that lag), with
    /// the events of those whose spec changes.
    async fn give_txns(&self, listed: &[&Versioned<Arc<Machine>>], pool: &MachinePool) -> Result<Vec<GiveTxn>, ApiError> {
        let mut given = Vec::new();
        for v in listed {
            let mut machine = Machine::clone(&v.object);
            let Some(spec_changed) = take_revision(&mut machine, pool) else { continue };
            given.push((machine, v.revision, spec_changed));
        }
        let changed = given.iter().filter(|(_, _, spec_changed)| *spec_changed);
        let wanted = changed.map(|(machine, _, _)| (machine.metadata.name_str().to_owned(), vec![spec_changed_event(machine, pool)]));
        let mut appends = self.events_appends(wanted.collect()).await?.into_iter();
        let mut txns: Vec<GiveTxn> = Vec::new();
        for (machine, revision, spec_changed) in given {
            let name = machine.metadata.name_str();
            let mut ops = Vec::with_capacity(3);
            let mut trim = false;
            if spec_changed {
                let append = appends.next().ok_or_else(|| ApiError::Internal("an event append went missing".into()))?;
                ops.extend(append.ops);
                trim = append.trim;
            }
            ops.push(Op::Put { key: format!("{MACHINES}{name}"), value: encode(&machine), precondition: Precondition::Revision(revision) });
            let bytes: usize = ops.iter().map(op_bytes).sum();
            let full = txns.last().is_none_or(|t| t.ops.len() + ops.len() > GIVE_OPS_PER_TXN || t.bytes + bytes > GIVE_BYTES_PER_TXN);
            if full {
                txns.push(GiveTxn::default());
            }
            let txn = txns.last_mut().expect("pushed above when empty");
            txn.names.push(name.to_owned());
            if trim {
                txn.to_trim.push(name.to_owned());
            }
            txn.ops.extend(ops);
            txn.bytes += bytes;
        }
        Ok(txns)
    }

    /// Commits one of a pass's transactions, or when it is refused gives its machines their
    /// revision one by one. Returns the machines whose event history is to be trimmed.
    async fn commit_give(&self, txn: GiveTxn, pool: &MachinePool) -> Result<Vec<String>, ApiError> {
        match self.store.txn_urgent(txn.ops).await {
            Ok(_) => Ok(txn.to_trim),
            // One by one, each machine's events are appended (and trimmed) on their own.
            Err(StoreError::Conflict { .. }) => {
                futures_util::stream::iter(txn.names)
                    .map(|n| async move { self.give_revision(&n, pool).await })
                    .buffer_unordered(GIVE_IN_PARALLEL)
                    .try_collect::<()>()
                    .await?;
                Ok(Vec::new())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Gives one machine its pool's current template, as it is stored now.
    async fn give_revision(&self, name: &str, pool: &MachinePool) -> Result<(), ApiError> {
        let mut spec_changed = false;
        let result = self
            .update_machine(name, |machine| match take_revision(machine, pool) {
                Some(changed) => {
                    spec_changed = changed;
                    Ok(true)
                }
                None => Ok(false),
            })
            .await;
        match result {
            Ok(updated) if spec_changed => self.append_events(name, vec![spec_changed_event(&updated.object, pool)]).await,
            Ok(_) | Err(ApiError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn leave_pool(&self, name: &str) -> Result<(), ApiError> {
        let result = self
            .update_machine(name, |machine| {
                let changed = machine.status.pool.is_some() || machine.status.pool_revision.is_some();
                machine.status.pool = None;
                machine.status.pool_revision = None;
                Ok(changed)
            })
            .await;
        match result {
            Ok(_) | Err(ApiError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn record_pool_status(
        &self,
        pool: &MachinePool,
        stored_at: u64,
        d: &rollout::Decision,
        members: &[&Machine],
    ) -> Result<(), ApiError> {
        let mut status = pool.status.clone();
        status.etcd = pool.spec.template.spec.etcd.as_ref().map(|e| {
            PoolEtcdStatus::from_members(
                &e.cluster,
                members.iter().filter_map(|m| {
                    let mut member = m.status.etcd.clone()?;
                    // A machine that stopped reporting: its last report says nothing of now.
                    member.healthy &= m.status.phase != Some(Phase::Unreachable);
                    Some((m.metadata.name.clone()?, member))
                }),
            )
        });
        let c = d.counts;
        status.machines = c.machines;
        status.updated = c.updated;
        status.updating = c.updating;
        status.ready = c.ready;
        status.degraded = c.degraded;
        status.waiting = c.waiting;
        status.wave = d.wave.clone();
        status.message = d.message.clone();
        let now = meta::now();
        match &d.halted {
            Some(why) => set_condition(&mut status.conditions, condition::ROLLOUT_HALTED, ConditionStatus::True, "MaxFailures", why, now),
            None => set_condition(&mut status.conditions, condition::ROLLOUT_HALTED, ConditionStatus::False, "AsExpected", "", now),
        };
        let revision = pool.status.revision;
        if d.rolled_out {
            set_condition(
                &mut status.conditions,
                condition::ROLLED_OUT,
                ConditionStatus::True,
                "Complete",
                &format!("revision {revision}"),
                now,
            );
        } else {
            let message = format!("revision {revision}: {} of {} updated; {}", c.updated, c.machines, d.message);
            set_condition(&mut status.conditions, condition::ROLLED_OUT, ConditionStatus::False, "Progressing", &message, now);
        }
        if status == pool.status {
            return Ok(());
        }
        let mut updated = pool.clone();
        updated.status = status;
        let key = format!("{POOLS}{}", pool.metadata.name_str());
        match self.store.txn(vec![Op::Put { key, value: encode(&updated), precondition: Precondition::Revision(stored_at) }]).await {
            // Changed meanwhile (an apply): the next pass records the status.
            Ok(_) | Err(StoreError::Conflict { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::pki::Authority;
    use crate::store::sqlite::SqliteStore;
    use crate::store::{Store, StoreExt};

    fn machine(name: &str, created_secs: i64, marked: bool) -> Machine {
        let mut m = Machine::new(name.parse().unwrap_or_else(|e| panic!("{e:?}")));
        m.metadata.creation_timestamp = Some(time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(created_secs));
        m.metadata.uid = Some(format!("uid-{name}"));
        if marked {
            m.metadata.annotations.insert(annotation::DELETE_MACHINE.into(), "true".into());
        }
        m
    }

    fn names(ms: Vec<&Machine>) -> Vec<&str> {
        ms.into_iter().map(|m| m.metadata.name_str()).collect()
    }

    #[test]
    fn scale_in_takes_marked_machines_first_then_by_order_within_the_budget() {
        let ms = [machine("a", 1, false), machine("b", 2, false), machine("c", 3, true), machine("d", 4, false)];
        let live: Vec<&Machine> = ms.iter().collect();
        assert_eq!(names(pick_for_deletion(&live, 0, 2, DeletionOrder::Oldest, 5)), vec!["c", "a"]);
        assert_eq!(names(pick_for_deletion(&live, 0, 2, DeletionOrder::Newest, 5)), vec!["c", "d"]);
        // One slot of the budget, one machine already being reset: nothing more now.
        assert!(pick_for_deletion(&live, 1, 2, DeletionOrder::Newest, 1).is_empty());
        assert_eq!(names(pick_for_deletion(&live, 0, 2, DeletionOrder::Newest, 1)), vec!["c"]);
        assert!(pick_for_deletion(&live, 0, 4, DeletionOrder::Oldest, 5).is_empty());
        // Random is a fixed order: the same answer every pass.
        let once = names(pick_for_deletion(&live, 0, 1, DeletionOrder::Random, 5));
        assert_eq!(once.len(), 3);
        assert_eq!(once[0], "c");
        assert_eq!(names(pick_for_deletion(&live, 0, 1, DeletionOrder::Random, 5)), once);
    }

    /// A pass over more machines than a transaction holds, and than it makes transactions
    /// for at a time, gives each its revision, and then exactly one event saying so.
    #[tokio::test]
    async fn a_pass_gives_every_machine_its_revision_then_one_event() -> anyhow::Result<()> {
        const MACHINES_GIVEN: usize = GIVE_CHUNK + 250;
        let dir = tempfile::tempdir()?;
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir.path().join("keelson.db"))?);
        let (authority, _) = Authority::load_or_create(dir.path())?;
        let (_, leading) = tokio::sync::watch::channel(true);
        let registry = Registry::new(store.clone(), Arc::new(authority), leading);
        let pool = serde_json::json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool",
            "metadata": {"name": "web", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"selector": {"matchLabels": {"pool": "web"}}, "template": {"spec": {"roles": ["worker"]}},
                     "rollout": {"maxUnavailable": MACHINES_GIVEN}}});
        store.put("/pools/web", serde_json::to_vec(&pool)?, Precondition::Absent).await?;
        let names: Vec<String> = (0..MACHINES_GIVEN).map(|i| format!("m{i:04}")).collect();
        for name in &names {
            let machine = serde_json::json!({"apiVersion": "keelson.io/v1alpha1", "kind": "Machine",
                "metadata": {"name": name, "labels": {"pool": "web"}},
                "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
            store.put(&format!("{MACHINES}{name}"), serde_json::to_vec(&machine)?, Precondition::Absent).await?;
        }
        registry.reconcile_pools().await?;
        let pool = registry.pool("web").await?.object;
        let (template, revision) = (pool.spec.template.spec, pool.status.revision);
        for name in &names {
            let machine = registry.machine(name).await?.object;
            assert_eq!(machine.spec, template, "{name} was not given the template");
            let events: Vec<(String, String)> = registry.events(name).await?.into_iter().map(|e| (e.reason, e.message)).collect();
            let generation = machine.metadata.generation;
            assert_eq!(
                events,
                [("SpecChanged".to_owned(), format!("generation {generation} from pool web revision {revision}"))],
                "{name}"
            );
        }
        Ok(())
    }
}
