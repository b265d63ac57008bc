//! Every machine, decoded, for the leader's rollout pass and reachability check.
//!
//! A pass looks at the whole fleet, and a rollout runs one pass after another as machines
//! report. Decoding 10,000 stored machines took most of each pass (100 to 500 ms on two
//! cores), while only the few that changed since the previous pass needed it. The copy is
//! therefore kept: each use first applies the machines' changes since the previous one
//! (`Store::since`, from the store's memory like a listing), and decodes afresh only when
//! the store no longer keeps those changes. The reachability check, every few seconds,
//! shares it rather than decoding a second copy of the fleet; a replica that stops leading
//! drops it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use keelson_api::machine::Machine;

use crate::error::ApiError;
use crate::registry::{MACHINES, Versioned, decode};
use crate::store::{Change, Entry, Since, Store};

#[derive(Debug, Default)]
pub(crate) struct DecodedMachines {
    /// The store revision decoded up to; `None` before the first listing, and after a
    /// stored machine failed to decode.
    revision: Option<u64>,
    /// By store key, so in the order a listing has.
    machines: BTreeMap<String, Versioned<Arc<Machine>>>,
}

impl DecodedMachines {
    /// Brings the copy up to the store's newest revision and returns every machine, in name
    /// order, with the revision of this view.
    pub async fn catch_up(&mut self, store: &dyn Store) -> Result<(Vec<Versioned<Arc<Machine>>>, u64), ApiError> {
        match self.apply(store.since(MACHINES, self.revision)).await {
            Ok(revision) => {
                self.revision = Some(revision);
                Ok((self.machines.values().cloned().collect(), revision))
            }
            Err(e) => {
                // Half applied: start again from a listing next time.
                self.revision = None;
                self.machines.clear();
                Err(e)
            }
        }
    }

    /// Applies the store's changes, or its listing, and returns the revision they reach.
    /// Each decode gives the runtime thread back every so often: the whole fleet's takes
    /// hundreds of milliseconds, after a fan-out as on a listing.
    async fn apply(&mut self, since: Since) -> Result<u64, ApiError> {
        match since {
            Since::Changes { changes, revision } => {
                // A machine that changed several times needs only its newest value.
                let newest: HashMap<&str, &Change> = changes.iter().map(|c| (c.entry.key.as_str(), &**c)).collect();
                for change in newest.into_values() {
                    if change.deleted {
                        self.machines.remove(&change.entry.key);
                    } else {
                        self.put(&change.entry)?;
                    }
                    tokio::task::coop::consume_budget().await;
                }
                Ok(revision)
            }
            Since::Listing(listing) => {
                self.machines.clear();
                for entry in &listing.entries {
                    self.put(entry)?;
                    tokio::task::coop::consume_budget().await;
                }
                Ok(listing.revision)
            }
        }
    }

    fn put(&mut self, entry: &Entry) -> Result<(), ApiError> {
        let machine: Machine = decode(&entry.key, &entry.value)?;
        self.machines.insert(entry.key.clone(), Versioned { object: Arc::new(machine), revision: entry.mod_revision });
        Ok(())
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

    fn machine(name: &str, tier: &str, generation: u64) -> Vec<u8> {
        serde_json::to_vec(&json!({"apiVersion": "keelson.io/v1alpha1", "kind": "Machine",
            "metadata": {"name": name, "labels": {"tier": tier}, "generation": generation}, "spec": {"roles": ["worker"]}}))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Each machine's name, revision and stored form.
    fn seen(machines: &[Versioned<Arc<Machine>>]) -> Vec<(String, u64, serde_json::Value)> {
        machines
            .iter()
            .map(|m| {
                let value = serde_json::to_value(&*m.object).unwrap_or_else(|e| panic!("{e}"));
                (m.object.metadata.name_str().to_owned(), m.revision, value)
            })
            .collect()
    }

    #[tokio::test]
    async fn a_copy_kept_from_changes_is_the_one_decoded_afresh() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(&dir.path().join("keelson.db"))?;
        let mut rng = StdRng::seed_from_u64(11);
        let mut kept = DecodedMachines::default();
        for step in 0..300 {
            let name = format!("m{:02}", rng.random_range(0..20));
            if rng.random_range(0..8) == 0 {
                let _ = store.delete(&format!("{MACHINES}{name}"), Precondition::Exists).await;
            } else {
                let tier = ["web", "db"][rng.random_range(0..2)];
                store.put(&format!("{MACHINES}{name}"), machine(&name, tier, step), Precondition::None).await?;
            }
            // Some passes come after several changes.
            if rng.random_bool(0.5) {
                let (machines, revision) = kept.catch_up(&store).await?;
                let (fresh, fresh_revision) = DecodedMachines::default().catch_up(&store).await?;
                assert_eq!(seen(&machines), seen(&fresh), "step {step}");
                assert_eq!((revision, fresh_revision), (store.revision(), store.revision()));
            }
        }
        Ok(())
    }

    #[tokio::test]
    async fn only_the_machines_that_changed_are_decoded_again() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(&dir.path().join("keelson.db"))?;
        for name in ["a", "b"] {
            store.put(&format!("{MACHINES}{name}"), machine(name, "web", 1), Precondition::None).await?;
        }
        let mut kept = DecodedMachines::default();
        let (before, _) = kept.catch_up(&store).await?;
        store.put(&format!("{MACHINES}b"), machine("b", "web", 2), Precondition::None).await?;
        let (after, _) = kept.catch_up(&store).await?;
        assert!(Arc::ptr_eq(&before[0].object, &after[0].object), "a did not change and was decoded again");
        assert_eq!((before[1].object.metadata.generation, after[1].object.metadata.generation), (1, 2));
        Ok(())
    }

    #[tokio::test]
    async fn a_machine_that_does_not_decode_fails_the_pass_until_it_is_gone() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(&dir.path().join("keelson.db"))?;
        store.put(&format!("{MACHINES}a"), machine("a", "web", 1), Precondition::None).await?;
        let mut kept = DecodedMachines::default();
        kept.catch_up(&store).await?;
        store.put(&format!("{MACHINES}b"), b"{not json".to_vec(), Precondition::None).await?;
        let err = kept.catch_up(&store).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("/machines/b"), "{err}");
        assert!(kept.catch_up(&store).await.is_err(), "the listing after the failure decoded b");
        store.delete(&format!("{MACHINES}b"), Precondition::Exists).await?;
        let (machines, _) = kept.catch_up(&store).await?;
        assert_eq!(seen(&machines).into_iter().map(|(name, ..)| name).collect::<Vec<_>>(), ["a"]);
        Ok(())
    }
}
