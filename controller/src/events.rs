//! Each machine's history of events, kept in segments: `/events/<machine>/<segment>`, each a
//! list of at most `SEGMENT_EVENTS` events and (unless one append brings more) `SEGMENT_BYTES`.
//! An event rewrites only the newest segment, a few KB, however long the history is, and no
//! value can outgrow the store's request limit (etcd's is 1.5 MiB; 200 events with messages
//! of 8 KiB, the most an agent may send, are more). A history shows its newest `EVENTS_KEPT`
//! events and outlives its machine.
//!
//! Segments rather than one key per event because every stored key is held in the
//! controller's memory with its own overhead: at 10,000 machines with full histories, one key
//! per event took 950 MiB of RSS where lists took 422 and segments 447 (docs/benchmarks.md).
//!
//! Earlier builds kept a history as one list, `/events/<machine>`, rewritten whole on every
//! event. Such a list is read as the oldest part of the history, and deleted once segments
//! alone hold `EVENTS_KEPT` events.

use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use keelson_api::wire::Event;

use crate::error::ApiError;
use crate::registry::{CAS_ATTEMPTS, EVENTS, Registry, decode, encode, event};
use crate::store::{Entry, Op, Precondition, StoreError};

/// Events shown per machine.
const EVENTS_KEPT: usize = 200;
/// A segment takes events until it holds this many…
const SEGMENT_EVENTS: usize = 20;
/// …or this many bytes.
const SEGMENT_BYTES: usize = 64 * 1024;
/// Deletes per trimming transaction, within etcd's default limit of 128 operations.
const TRIM_OPS_PER_TXN: usize = 100;
/// Trimming transactions in flight at once (a rollout pass trims many machines together).
const TRIMS_IN_PARALLEL: usize = 4;

fn history_prefix(name: &str) -> String {
    format!("{EVENTS}{name}/")
}

/// Where an earlier build kept the whole history.
fn list_key(name: &str) -> String {
    format!("{EVENTS}{name}")
}

/// The number a segment's key ends in.
fn segment_number(key: &str) -> Option<u64> {
    key.rsplit('/').next()?.parse().ok()
}

/// How many events a stored segment (or list) holds, without decoding them.
fn count(entry: &Entry) -> Result<usize, ApiError> {
    Ok(decode::<Vec<serde::de::IgnoredAny>>(&entry.key, &entry.value)?.len())
}

/// The write that appends events to a history, and whether to trim the history after it.
pub(crate) struct Append {
    /// The newest segment rewritten at the revision it was read at, or a new one created: a
    /// concurrent append makes the transaction a conflict, to be tried again.
    pub op: Op,
    /// A new segment was begun: older ones may no longer be needed.
    pub trim: bool,
}

impl Registry {
    pub async fn record_event(&self, name: &str, type_: &str, reason: &str, message: &str, source: &str) -> Result<(), ApiError> {
        self.append_events(name, vec![event(type_, reason, message.to_owned(), source)]).await
    }

    pub async fn append_events(&self, name: &str, events: Vec<Event>) -> Result<(), ApiError> {
        for attempt in 0..CAS_ATTEMPTS {
            let append = self.events_append(name, &events).await?;
            match self.store.txn(vec![append.op]).await {
                Ok(_) if append.trim => return self.trim_events(name).await,
                Ok(_) => return Ok(()),
                // Writers that met on the newest segment try again at different times, or
                // the same one would lose to the others every round.
                Err(StoreError::Conflict { .. }) => {
                    let most = 2u64 << attempt.min(5);
                    tokio::time::sleep(Duration::from_millis(rand::random_range(0..=most))).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("events of {name} are changing too often; try again")))
    }

    /// What appending `events` to a machine's history takes, as the history is stored now.
    /// The caller commits `op` (alone or within a larger transaction), then trims the history
    /// when asked to.
    pub(crate) async fn events_append(&self, name: &str, events: &[Event]) -> Result<Append, ApiError> {
        let prefix = history_prefix(name);
        let newest = self.store.list(&prefix).await?.entries.pop();
        if let Some(segment) = &newest {
            let mut held: Vec<Event> = decode(&segment.key, &segment.value)?;
            let added = encode(&events).len();
            if held.len() + events.len() <= SEGMENT_EVENTS && segment.value.len() + added <= SEGMENT_BYTES {
                held.extend_from_slice(events);
                let op =
                    Op::Put { key: segment.key.clone(), value: encode(&held), precondition: Precondition::Revision(segment.mod_revision) };
                return Ok(Append { op, trim: false });
            }
        }
        let number = newest.as_ref().and_then(|s| segment_number(&s.key)).map_or(0, |n| n + 1);
        let op = Op::Put { key: format!("{prefix}{number:020}"), value: encode(&events), precondition: Precondition::Absent };
        Ok(Append { op, trim: newest.is_some() })
    }

    /// Deletes the oldest segments that the newest `EVENTS_KEPT` events do not need, and an
    /// earlier build's list once segments alone hold that many.
    pub(crate) async fn trim_events(&self, name: &str) -> Result<(), ApiError> {
        let deletes = self.events_trim(name).await?;
        self.delete_in_chunks(deletes).await
    }

    /// The deletes that trim a machine's history, as it is stored now. Trimming twice at once
    /// does no harm: a delete of a key already gone changes nothing.
    pub(crate) async fn events_trim(&self, name: &str) -> Result<Vec<Op>, ApiError> {
        let segments = self.store.list(&history_prefix(name)).await?.entries;
        let mut newer = 0;
        let mut needed = segments.len();
        for (i, segment) in segments.iter().enumerate().rev() {
            if newer >= EVENTS_KEPT {
                break;
            }
            newer += count(segment)?;
            needed = i;
        }
        let mut deletes: Vec<Op> =
            segments[..needed].iter().map(|e| Op::Delete { key: e.key.clone(), precondition: Precondition::None }).collect();
        if newer >= EVENTS_KEPT && self.store.get(&list_key(name)).await?.is_some() {
            deletes.push(Op::Delete { key: list_key(name), precondition: Precondition::None });
        }
        Ok(deletes)
    }

    /// Commits unconditional deletes, `TRIM_OPS_PER_TXN` to a transaction, a few at once.
    pub(crate) async fn delete_in_chunks(&self, deletes: Vec<Op>) -> Result<(), ApiError> {
        let chunks: Vec<Vec<Op>> = deletes.chunks(TRIM_OPS_PER_TXN).map(<[Op]>::to_vec).collect();
        futures_util::stream::iter(chunks)
            .map(|chunk| async move { self.store.txn(chunk).await })
            .buffer_unordered(TRIMS_IN_PARALLEL)
            .try_collect::<Vec<u64>>()
            .await?;
        Ok(())
    }

    /// A machine's newest `EVENTS_KEPT` events, oldest first.
    pub async fn events(&self, name: &str) -> Result<Vec<Event>, ApiError> {
        let mut history = self.get::<Vec<Event>>(&list_key(name)).await?.map(|v| v.object).unwrap_or_default();
        for segment in self.list::<Vec<Event>>(&history_prefix(name)).await?.0 {
            history.extend(segment.object);
        }
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
    async fn a_history_shows_its_newest_events_in_order_from_segments_it_trims() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        for i in 0..300 {
            registry.append_events("m1", numbered(i, i + 1)).await?;
        }
        registry.append_events("m1", numbered(300, 305)).await?;
        assert_eq!(messages(&registry.events("m1").await?), (105..305).collect::<Vec<_>>());
        // Only the segments the newest 200 need, and the one being filled, are kept.
        let segments = store.list("/events/m1/").await?.entries;
        assert!(segments.len() <= EVENTS_KEPT / SEGMENT_EVENTS + 1, "{} segments", segments.len());
        assert!(segments.iter().all(|s| count(s).is_ok_and(|n| n <= SEGMENT_EVENTS)));
        // Another machine's history is its own, even when its name extends this one's.
        registry.append_events("m10", numbered(0, 1)).await?;
        assert_eq!(messages(&registry.events("m10").await?), [0]);
        assert_eq!(registry.events("m1").await?.len(), EVENTS_KEPT);
        Ok(())
    }

    #[tokio::test]
    async fn segments_of_large_events_stay_small_and_concurrent_appends_lose_none() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        let writers = (0..4).map(|w| {
            let registry = &registry;
            async move {
                for i in 0..25 {
                    let n = w * 25 + i;
                    registry.append_events("m1", vec![event("Normal", "Step", format!("{n} {}", "x".repeat(8_000)), "agent")]).await?;
                }
                anyhow::Ok(())
            }
        });
        futures_util::future::try_join_all(writers).await?;
        let mut seen: Vec<usize> = registry.events("m1").await?.iter().filter_map(|e| e.message.split(' ').next()?.parse().ok()).collect();
        seen.sort();
        assert_eq!(seen, (0..100).collect::<Vec<_>>(), "every event once");
        for segment in store.list("/events/m1/").await?.entries {
            assert!(segment.value.len() <= SEGMENT_BYTES, "{} holds {} bytes", segment.key, segment.value.len());
        }
        Ok(())
    }

    #[tokio::test]
    async fn a_rollout_pass_that_begins_a_segment_trims_the_history() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        let pool = serde_json::json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool",
            "metadata": {"name": "web", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"selector": {"matchLabels": {"pool": "web"}}, "template": {"spec": {"roles": ["worker"]}},
                     "rollout": {"maxUnavailable": 1}}});
        store.put("/pools/web", serde_json::to_vec(&pool)?, Precondition::Absent).await?;
        let machine = serde_json::json!({"apiVersion": "keelson.io/v1alpha1", "kind": "Machine",
            "metadata": {"name": "m1", "labels": {"pool": "web"}},
            "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
        store.put("/machines/m1", serde_json::to_vec(&machine)?, Precondition::Absent).await?;
        // Eleven full segments: the newest 200 events after the pass's need ten of them.
        for s in 0..11 {
            store.put(&format!("/events/m1/{s:020}"), encode(&numbered(s * 20, s * 20 + 20)), Precondition::Absent).await?;
        }
        registry.reconcile_pools().await?;
        let history = registry.events("m1").await?;
        assert_eq!(history.last().map(|e| e.reason.as_str()), Some("SpecChanged"), "{history:?}");
        assert_eq!(history.len(), EVENTS_KEPT);
        let keys: Vec<String> = store.list("/events/m1/").await?.entries.into_iter().map(|e| e.key).collect();
        assert_eq!(keys.first().map(String::as_str), Some("/events/m1/00000000000000000001"), "segment 0 trimmed: {keys:?}");
        assert_eq!(keys.len(), 11, "{keys:?}");
        Ok(())
    }

    #[tokio::test]
    async fn a_list_kept_by_an_earlier_build_is_the_oldest_part_until_segments_hold_the_history() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        store.put("/events/m1", encode(&numbered(0, 150)), Precondition::Absent).await?;
        registry.append_events("m1", numbered(150, 160)).await?;
        assert_eq!(messages(&registry.events("m1").await?), (0..160).collect::<Vec<_>>());
        registry.append_events("m1", numbered(160, 250)).await?;
        assert_eq!(messages(&registry.events("m1").await?), (50..250).collect::<Vec<_>>());
        for i in 250..351 {
            registry.append_events("m1", numbered(i, i + 1)).await?;
        }
        assert!(store.get("/events/m1").await?.is_none(), "segments hold the newest 200: the list is gone");
        assert_eq!(messages(&registry.events("m1").await?), (151..351).collect::<Vec<_>>());
        Ok(())
    }
}
