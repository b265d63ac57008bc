//! Each machine's history of events, kept in segments: `/events/<machine>/<segment>`, each a
//! list of at most `SEGMENT_EVENTS` events and `SEGMENT_BYTES`. An event rewrites only the
//! newest segment, a few KB, however long the history is, and no value can outgrow the
//! store's request limit (etcd's is 1.5 MiB; 200 events with messages of 8 KiB, the most an
//! agent may send, are more). Events fill a segment before the next one begins, so every
//! segment but the newest is full, and the newest `SEGMENTS_KEPT` segments hold the newest
//! `EVENTS_KEPT` events; when messages are long they hold fewer, and a history never holds
//! more than `SEGMENTS_KEPT` × `SEGMENT_BYTES`. A history outlives its machine.
//!
//! The stores do not keep these values in memory (`store::VALUES_NOT_IN_MEMORY`): at 10,000
//! machines full histories are about 400 MiB. What an append and a trim decide from is the
//! segments' keys, which are in memory; an append then reads the newest segment (a rollout
//! pass reads all its machines' in a few round trips), and a trim reads nothing.
//!
//! Segments rather than one key per event because every stored key is held in memory with its
//! own overhead: at 10,000 machines with full histories, one key per event took 950 MiB of RSS
//! where lists took 422 and segments 447, values included (docs/benchmarks.md).
//!
//! Earlier builds kept a history as one list, `/events/<machine>`, rewritten whole on every
//! event. Such a list is read as the oldest part of the history until the machine's next
//! event, which moves the list's newest events into segments.

use futures_util::{StreamExt, TryStreamExt};
use keelson_api::wire::Event;

use crate::error::ApiError;
use crate::registry::{CAS_ATTEMPTS, EVENTS, Registry, after_conflict, decode, encode, event};
use crate::store::{Entry, Op, Precondition, StoreError};

/// Events shown per machine.
const EVENTS_KEPT: usize = 200;
/// A segment takes events until it holds this many…
const SEGMENT_EVENTS: usize = 20;
/// …or this many bytes.
const SEGMENT_BYTES: usize = 64 * 1024;
/// Segments kept per machine: the newest `EVENTS_KEPT` events fill all but the newest.
const SEGMENTS_KEPT: usize = EVENTS_KEPT / SEGMENT_EVENTS + 1;
/// The most of an earlier build's list moved into segments, within etcd's request limit
/// beside the events that move it.
const LIST_MOVED_BYTES: usize = 512 * 1024;
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

/// The writes that append events to a history, and whether to trim the history after them.
pub(crate) struct Append {
    /// The newest segment rewritten at the revision it was read at, and new segments created:
    /// a concurrent append makes the transaction a conflict, to be tried again.
    pub ops: Vec<Op>,
    /// The history now has more than `SEGMENTS_KEPT` segments.
    pub trim: bool,
}

/// A segment being filled.
struct Filling {
    key: String,
    events: Vec<Event>,
    bytes: usize,
    precondition: Precondition,
    changed: bool,
}

impl Filling {
    fn has_room_for(&self, bytes: usize) -> bool {
        self.events.len() < SEGMENT_EVENTS && self.bytes + 1 + bytes <= SEGMENT_BYTES
    }
}

/// A history's newest part, read for an append (Registry::events_tails). An append decided
/// from it is refused if the history has changed since.
pub(crate) struct Tail {
    name: String,
    /// The history's segments' keys and revisions.
    held: Vec<Entry>,
    /// Its newest segment, or an earlier build's list when it has no segments.
    read: Option<Entry>,
}

impl Tail {
    /// The writes that append `events`.
    pub(crate) fn append(self, mut events: Vec<Event>) -> Result<Append, ApiError> {
        let prefix = history_prefix(&self.name);
        let next = self.held.last().and_then(|s| segment_number(&s.key)).map_or(0, |n| n + 1);
        let mut ops = Vec::new();
        let newest = match (self.held.last(), self.read) {
            (Some(_), newest) => newest,
            (None, Some(list)) => {
                ops.push(Op::Delete { key: list.key.clone(), precondition: Precondition::Revision(list.mod_revision) });
                let mut moved: Vec<Event> = decode(&list.key, &list.value)?;
                let mut bytes = 0;
                let keep = moved.iter().rev().take(EVENTS_KEPT).take_while(|e| {
                    bytes += encode(e).len();
                    bytes <= LIST_MOVED_BYTES
                });
                let from = moved.len() - keep.count();
                moved.drain(..from);
                moved.append(&mut events);
                events = moved;
                None
            }
            (None, None) => None,
        };
        let (writes, begun) = fill(&prefix, newest.as_ref(), next, events)?;
        ops.extend(writes);
        Ok(Append { ops, trim: self.held.len() + begun > SEGMENTS_KEPT })
    }
}

/// The writes that put `events` after `newest` (the newest segment, `None` when there is
/// none), filling it first, then segments numbered from `next`.
fn fill(prefix: &str, newest: Option<&Entry>, mut next: u64, events: Vec<Event>) -> Result<(Vec<Op>, usize), ApiError> {
    let first_new = format!("{prefix}{next:020}");
    let mut segments = Vec::new();
    if let Some(newest) = newest {
        let events: Vec<Event> = decode(&newest.key, &newest.value)?;
        let precondition = Precondition::Revision(newest.mod_revision);
        segments.push(Filling { key: newest.key.clone(), events, bytes: newest.value.len(), precondition, changed: false });
    }
    for event in events {
        let bytes = encode(&event).len();
        if segments.last().is_none_or(|s: &Filling| !s.has_room_for(bytes)) {
            let key = format!("{prefix}{next:020}");
            next += 1;
            segments.push(Filling { key, events: Vec::new(), bytes: 2, precondition: Precondition::Absent, changed: false });
        }
        let segment = segments.last_mut().expect("pushed above when none had room");
        segment.bytes += bytes + 1;
        segment.events.push(event);
        segment.changed = true;
    }
    let begun = segments.iter().filter(|s| s.precondition == Precondition::Absent).count();
    let mut ops: Vec<Op> = segments
        .into_iter()
        .filter(|s| s.changed)
        .map(|s| Op::Put { key: s.key, value: encode(&s.events), precondition: s.precondition })
        .collect();
    // Appending to the newest segment alone: not if another writer has begun the next one
    // meanwhile (another replica, whose key is not in this one's copy yet). These events
    // would then land before that writer's, though they came after.
    if begun == 0 && !ops.is_empty() {
        ops.push(Op::Check { key: first_new, precondition: Precondition::Absent });
    }
    Ok((ops, begun))
}

impl Registry {
    pub async fn record_event(&self, name: &str, type_: &str, reason: &str, message: &str, source: &str) -> Result<(), ApiError> {
        self.append_events(name, vec![event(type_, reason, message.to_owned(), source)]).await
    }

    pub async fn append_events(&self, name: &str, events: Vec<Event>) -> Result<(), ApiError> {
        for attempt in 0..CAS_ATTEMPTS {
            let Append { ops, trim } = self.events_tail(name).await?.append(events.clone())?;
            match self.store.txn(ops).await {
                Ok(_) => return self.trim_after_append(name, trim).await,
                // Writers that met on the newest segment try again at different times, or
                // the same one would lose to the others every round.
                Err(StoreError::Conflict { .. }) => after_conflict(attempt).await,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::Conflict(format!("events of {name} are changing too often; try again")))
    }

    /// What appending each machine's events to its history takes, as the histories are
    /// stored now, in order: the newest segments are read together. The caller commits each
    /// append's ops (alone or within a larger transaction), then trims the histories it is
    /// asked to.
    pub(crate) async fn events_appends(&self, wanted: Vec<(String, Vec<Event>)>) -> Result<Vec<Append>, ApiError> {
        let names: Vec<&str> = wanted.iter().map(|(name, _)| name.as_str()).collect();
        let tails = self.events_tails(&names).await?;
        tails.into_iter().zip(wanted).map(|(tail, (_, events))| tail.append(events)).collect()
    }

    /// The newest part of each history as stored now, for appends whose events are decided
    /// later: each history's segments from memory, then its newest segment (or an earlier
    /// build's list when it has none), all read from the store in one request.
    pub(crate) async fn events_tails(&self, names: &[&str]) -> Result<Vec<Tail>, ApiError> {
        let segments: Vec<Vec<Entry>> = names.iter().map(|name| self.store.list_keys(&history_prefix(name)).entries).collect();
        let reads: Vec<String> =
            names.iter().zip(&segments).map(|(name, held)| held.last().map_or_else(|| list_key(name), |s| s.key.clone())).collect();
        let read = self.store.get_many(&reads).await?;
        Ok(names.iter().zip(segments).zip(read).map(|((name, held), read)| Tail { name: (*name).to_owned(), held, read }).collect())
    }

    /// One history's newest part (Registry::events_tails).
    pub(crate) async fn events_tail(&self, name: &str) -> Result<Tail, ApiError> {
        let tail = self.events_tails(&[name]).await?.pop();
        tail.ok_or_else(|| ApiError::Internal(format!("the store answered no read for the events of {name}")))
    }

    /// Once an append has committed: trims the history if the append asked for it
    /// (`Append::trim`).
    pub(crate) async fn trim_after_append(&self, name: &str, trim: bool) -> Result<(), ApiError> {
        if trim { self.delete_in_chunks(self.events_trim(name)).await } else { Ok(()) }
    }

    /// The deletes that trim a machine's history to its newest `SEGMENTS_KEPT` segments, as
    /// it is stored now, with any list an earlier build kept beside segments. Trimming twice
    /// at once does no harm: a delete of a key already gone changes nothing.
    pub(crate) fn events_trim(&self, name: &str) -> Vec<Op> {
        let segments = self.store.list_keys(&history_prefix(name)).entries;
        let older = segments.len().saturating_sub(SEGMENTS_KEPT);
        if older == 0 {
            return Vec::new();
        }
        let delete = |key: String| Op::Delete { key, precondition: Precondition::None };
        segments[..older].iter().map(|e| delete(e.key.clone())).chain([delete(list_key(name))]).collect()
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

    /// How many events each stored segment of `m1` holds, oldest first.
    async fn segment_sizes(store: &Arc<dyn Store>) -> anyhow::Result<Vec<usize>> {
        let segments = store.list("/events/m1/").await?.entries;
        segments.iter().map(|s| Ok(decode::<Vec<Event>>(&s.key, &s.value)?.len())).collect()
    }

    #[tokio::test]
    async fn a_history_shows_its_newest_events_in_order_from_full_segments_it_trims() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        for i in 0..300 {
            registry.append_events("m1", numbered(i, i + 1)).await?;
        }
        // A batch fills the newest segment before it begins the next.
        registry.append_events("m1", numbered(300, 305)).await?;
        registry.append_events("m1", numbered(305, 322)).await?;
        assert_eq!(messages(&registry.events("m1").await?), (122..322).collect::<Vec<_>>());
        let sizes = segment_sizes(&store).await?;
        assert_eq!(sizes.len(), SEGMENTS_KEPT, "{sizes:?}");
        assert!(sizes[..sizes.len() - 1].iter().all(|&n| n == SEGMENT_EVENTS), "all but the newest full: {sizes:?}");
        // Another machine's history is its own, even when its name extends this one's.
        registry.append_events("m10", numbered(0, 1)).await?;
        assert_eq!(messages(&registry.events("m10").await?), [0]);
        assert_eq!(registry.events("m1").await?.len(), EVENTS_KEPT);
        Ok(())
    }

    #[tokio::test]
    async fn segments_of_long_events_stay_small_concurrent_appends_lose_none_and_the_history_is_bounded() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        let long = |n: usize| event("Normal", "Step", format!("{n} {}", "x".repeat(8_000)), "agent");
        let numbers =
            |events: Vec<Event>| -> Vec<usize> { events.iter().filter_map(|e| e.message.split(' ').next()?.parse().ok()).collect() };
        let writers = (0..4).map(|w| {
            let registry = &registry;
            async move {
                for i in 0..10 {
                    registry.append_events("m1", vec![long(w * 10 + i)]).await?;
                }
                anyhow::Ok(())
            }
        });
        futures_util::future::try_join_all(writers).await?;
        let mut seen = numbers(registry.events("m1").await?);
        seen.sort();
        assert_eq!(seen, (0..40).collect::<Vec<_>>(), "every event once");
        // One batch of a hundred more: the history keeps the newest that its segments hold.
        registry.append_events("m1", (40..140).map(long).collect()).await?;
        let kept = numbers(registry.events("m1").await?);
        let sizes = segment_sizes(&store).await?;
        assert_eq!(sizes.len(), SEGMENTS_KEPT, "{sizes:?}");
        assert_eq!(kept.len(), sizes.iter().sum::<usize>());
        assert_eq!(kept, (140 - kept.len()..140).collect::<Vec<_>>());
        for segment in store.list("/events/m1/").await?.entries {
            assert!(segment.value.len() <= SEGMENT_BYTES, "{} holds {} bytes", segment.key, segment.value.len());
        }
        Ok(())
    }

    #[tokio::test]
    async fn an_append_to_the_newest_segment_is_refused_once_another_writer_has_begun_the_next() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        store.put("/events/m1/00000000000000000000", encode(&numbered(0, 5)), Precondition::Absent).await?;
        let append = registry.events_appends(vec![("m1".into(), numbered(5, 6))]).await?.remove(0);
        // Meanwhile another replica, which found the segment too full for its event, begins
        // the next one.
        store.put("/events/m1/00000000000000000001", encode(&numbered(6, 7)), Precondition::Absent).await?;
        let refused = store.txn(append.ops).await;
        assert!(matches!(refused, Err(StoreError::Conflict { .. })), "{refused:?}");
        // Tried again, event 5 goes after event 6, which was written before it.
        registry.append_events("m1", numbered(5, 6)).await?;
        assert_eq!(messages(&registry.events("m1").await?), [0, 1, 2, 3, 4, 6, 5]);
        assert_eq!(segment_sizes(&store).await?, [5, 2]);
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
    async fn a_list_kept_by_an_earlier_build_is_the_oldest_part_until_the_next_event_moves_it_into_segments() -> R {
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        store.put("/events/m1", encode(&numbered(0, 250)), Precondition::Absent).await?;
        store.put("/events/m2", encode(&numbered(0, 30)), Precondition::Absent).await?;
        assert_eq!(messages(&registry.events("m1").await?), (50..250).collect::<Vec<_>>());
        registry.append_events("m1", numbered(250, 260)).await?;
        assert!(store.get("/events/m1").await?.is_none(), "the list is moved");
        assert_eq!(messages(&registry.events("m1").await?), (60..260).collect::<Vec<_>>());
        assert_eq!(segment_sizes(&store).await?.len(), SEGMENTS_KEPT);
        // m2's list is untouched by m1's events.
        assert_eq!(messages(&registry.events("m2").await?), (0..30).collect::<Vec<_>>());
        Ok(())
    }

    #[tokio::test]
    async fn a_list_beside_segments_goes_when_the_history_is_trimmed() -> R {
        // The builds of 851f86e kept writing segments beside a list.
        let dir = tempfile::tempdir()?;
        let (registry, store) = registry(&dir)?;
        store.put("/events/m1", encode(&numbered(0, 150)), Precondition::Absent).await?;
        for s in 0..3 {
            store.put(&format!("/events/m1/{s:020}"), encode(&numbered(150 + s * 20, 170 + s * 20)), Precondition::Absent).await?;
        }
        registry.append_events("m1", numbered(210, 215)).await?;
        assert_eq!(messages(&registry.events("m1").await?), (15..215).collect::<Vec<_>>());
        registry.append_events("m1", numbered(215, 375)).await?;
        assert!(store.get("/events/m1").await?.is_none(), "segments hold the newest 200: the list is gone");
        assert_eq!(messages(&registry.events("m1").await?), (175..375).collect::<Vec<_>>());
        Ok(())
    }
}
