//! Disruption leases: before an agent does anything that interrupts workloads (restarting
//! the runtime or kubelet, rebooting, restarting an etcd member) it asks for a lease. The
//! controller grants it while the machine's pool has fewer unexpired leases than its
//! `maxUnavailable` allows. A lease has a TTL the holder renews, so a dead holder never
//! blocks the pool for longer than that.
//!
//! All leases of one pool live in one key (`/leases/<pool>`, or `/leases/-<machine>` for a
//! machine in no pool), so counting and granting is one compare-and-swap: two controllers
//! (or two requests) can never both take the last slot.

use std::collections::HashSet;

use keelson_api::meta::{self, Name, Timestamp};
use keelson_api::pool::MachinePool;
use keelson_api::window::MaintenanceWindow;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::registry::{CAS_ATTEMPTS, POOLS, Registry, Versioned, owning_pool};
use crate::store::{Op, Precondition, StoreError};

pub const LEASES: &str = "/leases/";
pub const MIN_TTL_SECS: u64 = 10;
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
}

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

/// Why no lease can be granted now, when the holders and the other unavailable members
/// (counted once when a holder is also down) fill the budget.
fn over_budget(leases: &[Lease], down: &[Name], budget: usize) -> Option<String> {
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

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_else(|e| panic!("serialising leases: {e}"))
}

impl Registry {
    /// The lease key and budget of a machine: its pool's `maxUnavailable` over the pool's
    /// member count, and the other members that are unavailable already (not Ready, or
    /// unreachable), which use up the budget as leases do. A machine in no pool disrupts
    /// only itself.
    async fn lease_scope(&self, name: &Name) -> Result<(String, usize, Vec<Name>, Vec<MaintenanceWindow>), ApiError> {
        let machine = self.machine(name.as_str()).await?;
        let (pools, _) = self.list::<MachinePool>(POOLS).await?;
        let Some(pool) = owning_pool(&pools, &machine.object.metadata.labels) else {
            return Ok((format!("{LEASES}-{name}"), 1, Vec::new(), Vec::new()));
        };
        let (members, down) = {
            let mut census = self.census.lock().unwrap_or_else(|e| e.into_inner());
            census.catch_up(&*self.store, &pools);
            match census.tally(pool.metadata.name_str()) {
                Some(t) => (t.members, t.down.iter().filter(|n| n.as_str() != name.as_str()).filter_map(|n| n.parse().ok()).collect()),
                None => (0, Vec::new()),
            }
        };
        let budget = pool.spec.rollout.max_unavailable.resolve(members);
        Ok((format!("{LEASES}{}", pool.metadata.name_str()), budget, down, pool.spec.rollout.maintenance_windows.clone()))
    }

    pub async fn acquire_lease(&self, name: &Name, reason: &str, ttl_secs: u64) -> Result<Decision, ApiError> {
        if !(MIN_TTL_SECS..=MAX_TTL_SECS).contains(&ttl_secs) {
            return Err(ApiError::invalid("ttlSeconds", format!("must be between {MIN_TTL_SECS} and {MAX_TTL_SECS}")));
        }
        let (key, budget, down, windows) = self.lease_scope(name).await?;
        // Every lease of a pool is one key: taking requests one at a time in this process
        // spares them a storm of compare-and-swap retries when a wave starts. The
        // compare-and-swap still guards against other replicas.
        let one_at_a_time = self.lease_lock.lock().await;
        for _ in 0..CAS_ATTEMPTS {
            let current: Option<Versioned<PoolLeases>> = self.get(&key).await?;
            let now = meta::now();
            let (mut set, precondition) = match current {
                Some(v) => (v.object, Precondition::Revision(v.revision)),
                None => (PoolLeases::default(), Precondition::Absent),
            };
            set.leases.retain(|l| l.expires_at > now);
            let expires_at = now + time::Duration::seconds(ttl_secs as i64);
            // A machine asking again while it holds a lease gets the same one, renewed.
            let lease = if let Some(l) = set.leases.iter_mut().find(|l| &l.machine == name) {
                l.expires_at = expires_at;
                l.clone()
            } else if !keelson_api::window::any_open(&windows, now) {
                let message = format!("outside the maintenance windows ({})", keelson_api::window::describe(&windows));
                return Ok(Decision::Wait { message });
            } else if let Some(message) = over_budget(&set.leases, &down, budget) {
                return Ok(Decision::Wait { message });
            } else {
                let id: [u8; 8] = rand::random();
                let l = Lease { id: hex::encode(id), machine: name.clone(), reason: reason.to_owned(), granted_at: now, expires_at };
                set.leases.push(l.clone());
                l
            };
            match self.store.txn(vec![Op::Put { key: key.clone(), value: encode(&set), precondition }]).await {
                Ok(_) => {
                    drop(one_at_a_time);
                    self.record_event(
                        name.as_str(),
                        "Normal",
                        "DisruptionGranted",
                        &format!("lease {} for {reason}", lease.id),
                        "controller",
                    )
                    .await?;
                    return Ok(Decision::Granted(lease));
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict("leases are changing too often; try again".into()))
    }

    /// Renews (`ttl_secs` Some) or releases (None) a machine's lease.
    pub async fn update_lease(&self, name: &Name, id: &str, ttl_secs: Option<u64>) -> Result<Option<Lease>, ApiError> {
        if let Some(t) = ttl_secs
            && !(MIN_TTL_SECS..=MAX_TTL_SECS).contains(&t)
        {
            return Err(ApiError::invalid("ttlSeconds", format!("must be between {MIN_TTL_SECS} and {MAX_TTL_SECS}")));
        }
        let (key, ..) = self.lease_scope(name).await?;
        // Every lease of a pool is one key: taking requests one at a time in this process
        // spares them a storm of compare-and-swap retries when a wave starts. The
        // compare-and-swap still guards against other replicas.
        let one_at_a_time = self.lease_lock.lock().await;
        for _ in 0..CAS_ATTEMPTS {
            let Some(current) = self.get::<PoolLeases>(&key).await? else {
                return Err(ApiError::NotFound(format!("lease {id} not found")));
            };
            let mut set = current.object;
            let now = meta::now();
            set.leases.retain(|l| l.expires_at > now);
            let Some(pos) = set.leases.iter().position(|l| l.id == id && &l.machine == name) else {
                return Err(ApiError::NotFound(format!("lease {id} of {name} not found (expired or released)")));
            };
            let result = match ttl_secs {
                Some(t) => {
                    set.leases[pos].expires_at = now + time::Duration::seconds(t as i64);
                    Some(set.leases[pos].clone())
                }
                None => {
                    set.leases.remove(pos);
                    None
                }
            };
            match self
                .store
                .txn(vec![Op::Put { key: key.clone(), value: encode(&set), precondition: Precondition::Revision(current.revision) }])
                .await
            {
                Ok(_) => {
                    drop(one_at_a_time);
                    if result.is_none() {
                        self.record_event(name.as_str(), "Normal", "DisruptionReleased", &format!("lease {id}"), "controller").await?;
                    }
                    return Ok(result);
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict("leases are changing too often; try again".into()))
    }

    /// Every unexpired lease, for operators and tests.
    pub async fn leases(&self) -> Result<Vec<Lease>, ApiError> {
        let (sets, _) = self.list::<PoolLeases>(LEASES).await?;
        let now = meta::now();
        Ok(sets.into_iter().flat_map(|s| s.object.leases).filter(|l| l.expires_at > now).collect())
    }
}
