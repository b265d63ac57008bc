//! The pools' census for lease decisions: how many members each pool has, and which of them
//! are unavailable (not Ready, or unreachable) and so use up its disruption budget already.
//!
//! A rollout's lease requests come in waves as large as the fleet's budget allows, and
//! counting a pool afresh for each would cost the whole fleet per request. The census is
//! kept instead: each decision first applies the machines' changes since the previous one
//! (`Store::since`), and counts again from a listing only when the store no longer keeps
//! those changes, or when the pools' selectors (so their memberships) have changed.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use keelson_api::meta::{ConditionStatus, LabelSelector, Timestamp, condition};
use keelson_api::pool::MachinePool;
use serde::Deserialize;

use crate::registry::{MACHINES, Versioned, owning_pool};
use crate::store::{Entry, Since, Store};

/// One pool's members, as the census counts them.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub members: usize,
    /// The unavailable members, by name.
    pub down: BTreeSet<String>,
}

#[derive(Debug, Default)]
pub(crate) struct Census {
    /// The store revision counted up to; `None` before the first count.
    revision: Option<u64>,
    /// What decides membership: each pool's name, creation time and selector.
    selectors: Vec<(String, Option<Timestamp>, LabelSelector)>,
    machines: HashMap<String, Member>,
    pools: HashMap<String, Tally>,
}

#[derive(Debug)]
struct Member {
    labels: BTreeMap<String, String>,
    available: bool,
    pool: Option<String>,
}

/// What the census reads of a stored machine.
#[derive(Debug, Deserialize)]
struct Brief {
    metadata: BriefMeta,
    #[serde(default)]
    status: BriefStatus,
}

#[derive(Debug, Deserialize)]
struct BriefMeta {
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
struct BriefStatus {
    #[serde(default)]
    conditions: Vec<BriefCondition>,
}

#[derive(Debug, Deserialize)]
struct BriefCondition {
    #[serde(rename = "type")]
    type_: String,
    status: ConditionStatus,
}

impl Brief {
    /// Ready and reachable: not using the pool's disruption budget.
    fn available(&self) -> bool {
        let status = |t: &str| self.status.conditions.iter().find(|c| c.type_ == t).map(|c| c.status);
        status(condition::READY) == Some(ConditionStatus::True) && status(condition::REACHABLE) != Some(ConditionStatus::False)
    }
}

impl Census {
    /// Brings the census up to the store's newest revision, with `pools` as they are now.
    pub fn catch_up(&mut self, store: &dyn Store, pools: &[Versioned<MachinePool>]) {
        let selectors: Vec<_> = pools
            .iter()
            .map(|p| (p.object.metadata.name_str().to_owned(), p.object.metadata.creation_timestamp, p.object.spec.selector.clone()))
            .collect();
        if selectors != self.selectors {
            self.selectors = selectors;
            self.reassign(pools);
        }
        match store.since(MACHINES, self.revision) {
            Since::Changes { changes, revision } => {
                for change in changes {
                    let entry = &change.entry;
                    if change.deleted {
                        self.remove(&entry.key);
                    } else {
                        self.put(entry, pools);
                    }
                }
                self.revision = Some(revision);
            }
            Since::Listing(listing) => {
                self.machines.clear();
                self.pools.clear();
                for entry in &listing.entries {
                    self.put(entry, pools);
                }
                self.revision = Some(listing.revision);
            }
        }
    }

    /// The tally of `pool` (empty when it has no members).
    pub fn tally(&self, pool: &str) -> Option<&Tally> {
        self.pools.get(pool)
    }

    fn put(&mut self, entry: &Entry, pools: &[Versioned<MachinePool>]) {
        self.remove(&entry.key);
        let Some(name) = entry.key.strip_prefix(MACHINES) else { return };
        match serde_json::from_slice::<Brief>(&entry.value) {
            Ok(brief) => {
                let available = brief.available();
                let pool = owning_pool(pools, &brief.metadata.labels).map(|p| p.metadata.name_str().to_owned());
                let member = Member { labels: brief.metadata.labels, available, pool };
                self.count(name, &member, true);
                self.machines.insert(name.to_owned(), member);
            }
            Err(err) => tracing::warn!(machine = name, error = %err, "a stored machine does not decode; leaving it out of lease decisions"),
        }
    }

    fn remove(&mut self, key: &str) {
        let Some(name) = key.strip_prefix(MACHINES) else { return };
        if let Some(member) = self.machines.remove(name) {
            self.count(name, &member, false);
        }
    }

    /// Adds a member to its pool's tally, or takes it away.
    fn count(&mut self, name: &str, member: &Member, add: bool) {
        let Some(pool) = &member.pool else { return };
        let tally = self.pools.entry(pool.clone()).or_default();
        if add {
            tally.members += 1;
            if !member.available {
                tally.down.insert(name.to_owned());
            }
        } else {
            tally.members -= 1;
            tally.down.remove(name);
            if tally.members == 0 {
                self.pools.remove(pool);
            }
        }
    }

    /// Every member's pool again, after the pools' selectors changed.
    fn reassign(&mut self, pools: &[Versioned<MachinePool>]) {
        self.pools.clear();
        let mut machines = std::mem::take(&mut self.machines);
        for (name, member) in &mut machines {
            member.pool = owning_pool(pools, &member.labels).map(|p| p.metadata.name_str().to_owned());
            self.count(name, member, true);
        }
        self.machines = machines;
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use serde_json::json;

    use super::*;
    use crate::store::sqlite::SqliteStore;
    use crate::store::{Precondition, StoreExt};

    fn pools(selectors: &[(&str, &str)]) -> Vec<Versioned<MachinePool>> {
        selectors
            .iter()
            .enumerate()
            .map(|(i, (name, tier))| {
                let pool = json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool",
                    "metadata": {"name": name, "creationTimestamp": format!("2026-01-01T00:00:0{i}Z")},
                    "spec": {"selector": {"matchLabels": {"tier": tier}}, "template": {"spec": {"roles": ["worker"]}}}});
                let object = serde_json::from_value(pool).unwrap_or_else(|e| panic!("{e}"));
                Versioned { object, revision: 1 }
            })
            .collect()
    }

    fn machine(name: &str, tier: &str, ready: bool) -> Vec<u8> {
        let status = if ready { "True" } else { "False" };
        serde_json::to_vec(&json!({"metadata": {"name": name, "labels": {"tier": tier}},
            "status": {"conditions": [{"type": "Ready", "status": status}]}}))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Every pool's members and the names of those down.
    fn counts(census: &Census) -> BTreeMap<String, (usize, Vec<String>)> {
        census.pools.iter().map(|(p, t)| (p.clone(), (t.members, t.down.iter().cloned().collect()))).collect()
    }

    #[tokio::test]
    async fn a_census_kept_from_changes_counts_as_one_taken_afresh() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(&dir.path().join("keelson.db"))?;
        let mut rng = StdRng::seed_from_u64(7);
        let selector_sets: [&[(&str, &str)]; 3] = [&[("web", "web"), ("db", "db")], &[("web", "web")], &[("all", "web"), ("db", "db")]];
        let mut selectors = selector_sets[0];
        let mut kept = Census::default();
        for step in 0..400 {
            let name = format!("m{}", rng.random_range(0..20));
            match rng.random_range(0..10) {
                0 => {
                    let _ = store.delete(&format!("{MACHINES}{name}"), Precondition::Exists).await;
                }
                1 => selectors = selector_sets[rng.random_range(0..3)],
                _ => {
                    let tier = ["web", "db", "none"][rng.random_range(0..3)];
                    store.put(&format!("{MACHINES}{name}"), machine(&name, tier, rng.random_bool(0.7)), Precondition::None).await?;
                }
            }
            // Some steps catch up after several changes, as lease requests do.
            if rng.random_bool(0.5) {
                kept.catch_up(&store, &pools(selectors));
                let mut fresh = Census::default();
                fresh.catch_up(&store, &pools(selectors));
                assert_eq!(counts(&kept), counts(&fresh), "step {step}");
                assert_eq!(kept.revision, Some(store.revision()));
            }
        }
        assert!(
            !kept.pools.is_empty() && kept.pools.values().any(|t| !t.down.is_empty()),
            "the steps never made a pool with a member down"
        );
        Ok(())
    }
}
