//! Each machine's history of events, one key per event: `/events/<machine>/<sequence>`. An
//! event costs one small write however long the history is, and no history is one value that
//! could outgrow the store's request limit (etcd's is 1.5 MiB; 200 events with messages of
//! 8 KiB, the most an agent may send, are more). A history keeps the last `EVENTS_KEPT`
//! events and outlives its machine.
//!
//! Earlier builds kept a history as one list, `/events/<machine>`, rewritten whole on every
//! event. Such a list is read as the oldest part of the history, and deleted once newer events
//! alone fill it.

use keelson_api::meta;
use keelson_api::wire::Event;

use crate::error::ApiError;
use crate::registry::{CAS_ATTEMPTS, EVENTS, Registry, encode};
use crate::store::{Op, Precondition, StoreError};

/// Events kept per machine.
const EVENTS_KEPT: usize = 200;
/// A history is trimmed back to `EVENTS_KEPT` only once it holds this many more, so that a
/// machine at its limit does not pay for a delete with every event.
const EVENTS_SLACK: usize = 50;
/// Deletes per trimming transaction, within etcd's default limit of 128 operations.
const TRIM_OPS_PER_TXN: usize = 100;

fn history_prefix(name: &str) -> String {
    format!("{EVENTS}{name}/")
}

/// Where an earlier build kept the whole history.
fn list_key(name: &str) -> String {
    format!("{EVENTS}{name}")
}

/// The sequence number a key ends in: the writing controller's clock in nanoseconds since the
/// epoch, or one past the newest event that controller saw when its clock is behind, so a
/// history stays in order across replicas whose clocks differ.
fn sequence(key: &str) -> Option<u64> {
    key.rsplit('/').next()?.parse().ok()
}

/// The writes that append events to a history, and whether to trim it after them.
pub(crate) struct Append {
    /// One put per event, each creating its key: another writer's event at the same
    /// sequence number makes the transaction a conflict, to be tried again.
    pub ops: Vec<Op>,
    pub trim: bool,
}

impl Registry {
    pub async fn append_events(&self, name: &str, events: Vec<Event>) -> Result<(), ApiError> {
        for _ in 0..CAS_ATTEMPTS {
            let append = self.events_append(name, &events).await?;
            match self.store.txn(append.ops).await {
                Ok(_) if append.trim => return self.trim_events(name).await,
                Ok(_) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("events of {name} are changing too often; try again")))
    }

    /// What appending `events` to a machine's history takes, as the history is stored now.
    /// The caller commits `ops` (alone or within a larger transaction), then trims the
    /// history when asked to.
    pub(crate) async fn events_append(&self, name: &str, events: &[Event]) -> Result<Append, ApiError> {
        let prefix = history_prefix(name);
        let stored = self.store.list(&prefix).await?.entries;
        let now = u64::try_from(meta::now().unix_timestamp_nanos()).unwrap_or_default();
        let first = match stored.iter().rev().find_map(|e| sequence(&e.key)) {
            Some(newest) => now.max(newest + 1),
            None => now,
        };
        let ops = (first..)
            .zip(events)
            .map(|(n, event)| Op::Put { key: format!("{prefix}{n:020}"), value: encode(event), precondition: Precondition::Absent })
            .collect();
        let after = stored.len() + events.len();
        let has_list = after >= EVENTS_KEPT && self.store.get(&list_key(name)).await?.is_some();
        Ok(Append { ops, trim: after > EVENTS_KEPT + EVENTS_SLACK || has_list })
    }

    /// Deletes a history's events beyond the newest `EVENTS_KEPT`, and an earlier build's
    /// list once newer events fill the history. Trimming twice at once deletes nothing twice
    /// that matters: a delete of a key already gone changes nothing.
    pub(crate) async fn trim_events(&self, name: &str) -> Result<(), ApiError> {
        let stored = self.store.list(&history_prefix(name)).await?.entries;
        let older = stored.len().saturating_sub(EVENTS_KEPT);
        let mut deletes: Vec<Op> =
            stored[..older].iter().map(|e| Op::Delete { key: e.key.clone(), precondition: Precondition::None }).collect();
        if stored.len() >= EVENTS_KEPT && self.store.get(&list_key(name)).await?.is_some() {
            deletes.push(Op::Delete { key: list_key(name), precondition: Precondition::None });
        }
        for chunk in deletes.chunks(TRIM_OPS_PER_TXN) {
            self.store.txn(chunk.to_vec()).await?;
        }
        Ok(())
    }

    /// A machine's last `EVENTS_KEPT` events, oldest first.
    pub async fn events(&self, name: &str) -> Result<Vec<Event>, ApiError> {
        let mut history = self.get::<Vec<Event>>(&list_key(name)).await?.map(|v| v.object).unwrap_or_default();
        history.extend(self.list::<Event>(&history_prefix(name)).await?.0.into_iter().map(|v| v.object));
        let older = history.len().saturating_sub(EVENTS_KEPT);
        history.drain(..older);
        Ok(history)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::pki::Authority;
    use crate::registry::event;
    use crate::store::sqlite::SqliteStore;
    use crate::store::{Store, StoreExt};

    type R = anyhow::Result<()>;

    fn registry(dir: &tempfile::TempDir) -> anyhow::Result<(Registry, Arc<dyn Store>)> {
        let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir.path().join("keelson.db"))?);
        let (authority, _) = Authority::load_or_create(dir.path())?;
        let (_, leading) = tokio::sync::watch::channel(true);
        Ok((Registry::new(store.clone(), Arc::new(authority), leading), store))
    }

    fn numbered(from: usize, to: usize) -> Vec<Event> {
        (from..to).map(|i| event("Normal", "Step", format!("{i}"), "agent")).collect()
    }

    fn messages(events: &[Event]) -> Vec<usize> {
        events.iter().map(|e| e.message.parse().unwrap_or(usize::MAX)).collect()
    }

    #[tokio::test]
    async fn a_history_keeps_its_newest_events_in_order_and_is_trimmed_past_its_slack() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        for i in 0..EVENTS_KEPT + EVENTS_SLACK {
            registry.append_events("m1", numbered(i, i + 1)).await?;
        }
        // Within the slack nothing is deleted, but only the newest are shown.
        assert_eq!(store.list("/events/m1/").await?.entries.len(), EVENTS_KEPT + EVENTS_SLACK);
        assert_eq!(messages(&registry.events("m1").await?), (EVENTS_SLACK..EVENTS_KEPT + EVENTS_SLACK).collect::<Vec<_>>());
        // One more, in a batch of several, and the history is cut back to what is kept.
        registry.append_events("m1", numbered(EVENTS_KEPT + EVENTS_SLACK, EVENTS_KEPT + EVENTS_SLACK + 3)).await?;
        assert_eq!(store.list("/events/m1/").await?.entries.len(), EVENTS_KEPT);
        let shown = messages(&registry.events("m1").await?);
        assert_eq!(shown, (EVENTS_SLACK + 3..EVENTS_KEPT + EVENTS_SLACK + 3).collect::<Vec<_>>());
        // Another machine's history is its own, even when its name extends this one's.
        registry.append_events("m10", numbered(0, 1)).await?;
        assert_eq!(messages(&registry.events("m10").await?), [0]);
        assert_eq!(registry.events("m1").await?.len(), EVENTS_KEPT);
        Ok(())
    }

    #[tokio::test]
    async fn an_event_after_one_from_a_clock_ahead_of_ours_still_comes_after_it() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        // Another replica, its clock a day ahead, wrote the newest event.
        let ahead = u64::try_from(meta::now().unix_timestamp_nanos())? + 86_400 * 1_000_000_000;
        store.put(&format!("/events/m1/{ahead:020}"), encode(&numbered(0, 1)[0]), Precondition::Absent).await?;
        registry.append_events("m1", numbered(1, 3)).await?;
        assert_eq!(messages(&registry.events("m1").await?), [0, 1, 2]);
        Ok(())
    }

    #[tokio::test]
    async fn a_list_kept_by_an_earlier_build_is_the_oldest_part_until_newer_events_fill_the_history() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        store.put("/events/m1", encode(&numbered(0, 150)), Precondition::Absent).await?;
        registry.append_events("m1", numbered(150, 160)).await?;
        assert_eq!(messages(&registry.events("m1").await?), (0..160).collect::<Vec<_>>());
        assert!(store.get("/events/m1").await?.is_some(), "the list still holds kept events");
        registry.append_events("m1", numbered(160, 250)).await?;
        assert_eq!(messages(&registry.events("m1").await?), (50..250).collect::<Vec<_>>());
        for i in 250..350 {
            registry.append_events("m1", numbered(i, i + 1)).await?;
        }
        assert!(store.get("/events/m1").await?.is_none(), "newer events fill the history: the list is gone");
        assert_eq!(messages(&registry.events("m1").await?), (150..350).collect::<Vec<_>>());
        Ok(())
    }
}
