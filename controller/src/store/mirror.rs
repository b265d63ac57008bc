//! The committed state in memory, which both stores serve reads and watches from: every
//! entry, the newest revision, a bounded log of recent changes for watches to replay, and a
//! broadcast of new changes. A store publishes into it only what is durable (SQLite after its
//! commit, etcd as its watch reports it), so a reader never sees a write that could be lost.
//! Entries whose values are not held in memory (`VALUES_NOT_IN_MEMORY`) are kept with empty
//! values; their changes keep their values in the log, for watches.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Duration;

use tokio::sync::{broadcast, watch};

use async_trait::async_trait;

use super::{Change, Entry, Listing, Since, StoreError, VALUES_NOT_IN_MEMORY, Watch, value_in_memory};

/// Where a store reads the values the mirror does not hold.
#[async_trait]
pub(crate) trait Backend: Sync {
    /// Each key's entry, in order, as committed now.
    async fn read_keys(&self, keys: Vec<String>) -> Result<Vec<Option<Entry>>, StoreError>;
    /// Every entry under `prefix`, in key order, and the revision read at.
    async fn read_prefix(&self, prefix: &str) -> Result<Listing, StoreError>;
}

/// How many recent changes a watch can replay from…
const CHANGE_LOG_LEN: usize = 20_000;
/// …as long as their keys and values take no more than this (a change keeps the value it
/// wrote alive after the key has moved on).
const CHANGE_LOG_BYTES: usize = 32 << 20;
/// How many live changes a slow watcher may fall behind before it must replay them from the
/// log (the buffer keeps as many values alive).
const BROADCAST_CAPACITY: usize = 4_096;

/// What a watch replays from the log, and its subscription to the changes after those.
pub(super) type Replay = (VecDeque<Change>, broadcast::Receiver<Arc<Change>>);

#[derive(Debug, Default)]
pub(crate) struct Committed {
    pub entries: BTreeMap<String, Entry>,
    pub revision: u64,
    log: VecDeque<Arc<Change>>,
    /// The keys' and values' bytes in `log`.
    log_bytes: usize,
    /// The log holds every change after this revision. Revisions need not be consecutive
    /// (etcd's also count writes outside the prefix), so this, not the oldest change's
    /// revision, says how far back a watch can start.
    log_start: u64,
}

#[derive(Debug)]
pub(crate) struct Mirror {
    state: RwLock<Committed>,
    changes: broadcast::Sender<Arc<Change>>,
    /// The revision published last, for writers waiting until their write is visible.
    published: watch::Sender<u64>,
    /// The value of every entry whose value is not held (one allocation, shared).
    empty: Arc<[u8]>,
}

impl Committed {
    fn listing(&self, prefix: &str) -> Listing {
        let entries = self.under(prefix).cloned().collect();
        Listing { entries, revision: self.revision }
    }

    fn under<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a Entry> {
        self.entries.range(prefix.to_owned()..).take_while(move |(k, _)| k.starts_with(prefix)).map(|(_, e)| e)
    }
}

impl Mirror {
    pub fn new(mut entries: BTreeMap<String, Entry>, revision: u64) -> Self {
        let (changes, _) = broadcast::channel(BROADCAST_CAPACITY);
        let empty: Arc<[u8]> = Arc::from(&[][..]);
        for entry in entries.values_mut().filter(|e| !value_in_memory(&e.key)) {
            entry.value = empty.clone();
        }
        Mirror {
            state: RwLock::new(Committed { entries, revision, log: VecDeque::new(), log_bytes: 0, log_start: revision }),
            changes,
            published: watch::Sender::new(revision),
            empty,
        }
    }

    /// `entry` as the mirror keeps it: without its value when that is not held.
    fn kept(&self, entry: &Entry) -> Entry {
        if value_in_memory(&entry.key) { entry.clone() } else { self.without_value(entry) }
    }

    fn without_value(&self, e: &Entry) -> Entry {
        Entry { key: e.key.clone(), value: self.empty.clone(), create_revision: e.create_revision, mod_revision: e.mod_revision }
    }

    pub fn read(&self) -> RwLockReadGuard<'_, Committed> {
        // A poisoned lock means a publisher panicked mid-update: the durable copy is still
        // consistent, but this process cannot go on serving from memory.
        self.state.read().unwrap_or_else(|e| panic!("store state poisoned: {e}"))
    }

    pub fn get(&self, key: &str) -> Option<Entry> {
        self.read().entries.get(key).cloned()
    }

    pub fn list(&self, prefix: &str) -> Listing {
        self.read().listing(prefix)
    }

    /// `Store::get`: from memory, or from `backend` for a value not held.
    pub async fn get_through(&self, key: &str, backend: &impl Backend) -> Result<Option<Entry>, StoreError> {
        if value_in_memory(key) {
            return Ok(self.get(key));
        }
        Ok(backend.read_keys(vec![key.to_owned()]).await?.pop().flatten())
    }

    /// `Store::get_many`: from memory, and in one call to `backend` for the values not held.
    pub async fn get_many_through(&self, keys: &[String], backend: &impl Backend) -> Result<Vec<Option<Entry>>, StoreError> {
        let mut found = Vec::with_capacity(keys.len());
        let mut elsewhere = Vec::new();
        {
            let state = self.read();
            for (i, key) in keys.iter().enumerate() {
                if value_in_memory(key) {
                    found.push(state.entries.get(key).cloned());
                } else {
                    found.push(None);
                    elsewhere.push(i);
                }
            }
        }
        if !elsewhere.is_empty() {
            let read = backend.read_keys(elsewhere.iter().map(|&i| keys[i].clone()).collect()).await?;
            for (i, entry) in elsewhere.into_iter().zip(read) {
                found[i] = entry;
            }
        }
        Ok(found)
    }

    /// `Store::list`: from memory, and from `backend` for the part whose values are not held.
    pub async fn list_through(&self, prefix: &str, backend: &impl Backend) -> Result<Listing, StoreError> {
        if prefix.starts_with(VALUES_NOT_IN_MEMORY) {
            return backend.read_prefix(prefix).await;
        }
        let mut listing = self.list(prefix);
        if VALUES_NOT_IN_MEMORY.starts_with(prefix) {
            listing.entries.retain(|e| value_in_memory(&e.key));
            listing.entries.extend(backend.read_prefix(VALUES_NOT_IN_MEMORY).await?.entries);
            listing.entries.sort_by(|a, b| a.key.cmp(&b.key));
        }
        Ok(listing)
    }

    /// The keys under `prefix` with their revisions, every value empty.
    pub fn list_keys(&self, prefix: &str) -> Listing {
        let state = self.read();
        let entries = state.under(prefix).map(|e| self.without_value(e)).collect();
        Listing { entries, revision: state.revision }
    }

    /// What changed under `prefix` after revision `after`: the changes, while the log still
    /// holds them all, else a whole listing. `None` asks for the listing.
    pub fn since(&self, prefix: &str, after: Option<u64>) -> Since {
        let state = self.read();
        match after {
            Some(after) if after >= state.log_start => {
                let first = state.log.partition_point(|c| c.entry.mod_revision <= after);
                let changes = state.log.range(first..).filter(|c| c.entry.key.starts_with(prefix)).cloned().collect();
                Since::Changes { changes, revision: state.revision }
            }
            _ => Since::Listing(state.listing(prefix)),
        }
    }

    pub fn revision(&self) -> u64 {
        self.read().revision
    }

    /// Every change under `prefix` after revision `after`, then live ones.
    pub fn watch(self: &Arc<Self>, prefix: &str, after: u64) -> Result<Watch, StoreError> {
        let (backlog, live) = self.replay(prefix, after, 0)?;
        Ok(Watch::new(prefix.to_owned(), backlog, live, after, Arc::downgrade(self)))
    }

    /// The changes under `prefix` after revision `after` that the log holds, less the first
    /// `skip` of them (delivered already), and a subscription to the changes published after
    /// them. `Compacted` when the log no longer holds them all.
    pub(super) fn replay(&self, prefix: &str, after: u64, skip: usize) -> Result<Replay, StoreError> {
        // Subscribe while holding the read lock: publishing takes the write lock, so no
        // change falls between the backlog and the live stream.
        let state = self.read();
        let live = self.changes.subscribe();
        if after < state.log_start {
            return Err(StoreError::Compacted { requested: after, oldest: state.log_start });
        }
        let first = state.log.partition_point(|c| c.entry.mod_revision <= after);
        let backlog = state.log.range(first..).filter(|c| c.entry.key.starts_with(prefix)).skip(skip).map(|c| (**c).clone()).collect();
        Ok((backlog, live))
    }

    /// Applies committed `changes` (in revision order) and moves the revision to `revision`.
    pub fn publish(&self, changes: impl IntoIterator<Item = Change>, revision: u64) {
        {
            let mut state = self.state.write().unwrap_or_else(|e| panic!("store state poisoned: {e}"));
            for change in changes {
                if change.deleted {
                    state.entries.remove(&change.entry.key);
                } else {
                    state.entries.insert(change.entry.key.clone(), self.kept(&change.entry));
                }
                let change = Arc::new(change);
                state.log_bytes += size(&change);
                state.log.push_back(change.clone());
                while state.log.len() > CHANGE_LOG_LEN || (state.log_bytes > CHANGE_LOG_BYTES && state.log.len() > 1) {
                    let Some(dropped) = state.log.pop_front() else { break };
                    state.log_bytes -= size(&dropped);
                    state.log_start = dropped.entry.mod_revision;
                }
                // No receivers is not an error.
                let _ = self.changes.send(change);
            }
            state.revision = state.revision.max(revision);
        }
        self.published.send_if_modified(|r| {
            let moved = revision > *r;
            *r = (*r).max(revision);
            moved
        });
    }

    /// Waits until everything up to `revision` is published, or `limit` passes; says which.
    pub async fn caught_up(&self, revision: u64, limit: Duration) -> bool {
        let mut published = self.published.subscribe();
        tokio::time::timeout(limit, published.wait_for(|r| *r >= revision)).await.is_ok_and(|r| r.is_ok())
    }
}

fn size(change: &Change) -> usize {
    change.entry.key.len() + change.entry.value.len()
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    fn put(key: &str, revision: u64) -> Change {
        Change {
            deleted: false,
            entry: Entry { key: key.into(), value: Arc::from(&b"v"[..]), create_revision: revision, mod_revision: revision },
        }
    }

    #[tokio::test]
    async fn a_watch_may_start_anywhere_the_log_covers_across_gaps_in_the_revisions() -> Result<(), StoreError> {
        // Loaded at 100; the next change here is at 105 (etcd counted writes elsewhere).
        let mirror = Arc::new(Mirror::new(BTreeMap::new(), 100));
        mirror.publish([put("/a", 105)], 105);
        let mut from_load = mirror.watch("/", 100)?;
        let first = from_load.next().await.ok_or(StoreError::Closed)??;
        assert_eq!((first.entry.key.as_str(), first.entry.mod_revision), ("/a", 105));
        assert!(mirror.watch("/", 102).is_ok());
        // Before the load, the changes are not known.
        assert!(matches!(mirror.watch("/", 99), Err(StoreError::Compacted { requested: 99, oldest: 100 })));
        Ok(())
    }

    #[tokio::test]
    async fn dropping_the_oldest_change_moves_where_watches_may_start() -> Result<(), StoreError> {
        let mirror = Arc::new(Mirror::new(BTreeMap::new(), 0));
        for r in 1..=(CHANGE_LOG_LEN as u64 + 2) {
            mirror.publish([put(&format!("/k/{r}"), r * 2)], r * 2);
        }
        // Changes at 2 and 4 were dropped: a watch from 4 on is whole, one from 3 is not.
        assert!(mirror.watch("/", 4).is_ok());
        assert!(matches!(mirror.watch("/", 3), Err(StoreError::Compacted { oldest: 4, .. })));
        Ok(())
    }

    #[tokio::test]
    async fn the_log_keeps_no_more_than_its_bytes_of_old_values() -> Result<(), StoreError> {
        let mirror = Arc::new(Mirror::new(BTreeMap::new(), 0));
        let big: Arc<[u8]> = vec![b'x'; 1 << 20].into();
        for r in 1..=40u64 {
            let entry = Entry { key: "/big".into(), value: big.clone(), create_revision: 1, mod_revision: r };
            mirror.publish([Change { deleted: false, entry }], r);
        }
        {
            let state = mirror.read();
            assert!(state.log_bytes <= CHANGE_LOG_BYTES, "{} bytes kept", state.log_bytes);
            assert_eq!(state.log.len(), CHANGE_LOG_BYTES / ((1 << 20) + 4));
        }
        // A watch from before the kept changes must list again; one within them replays.
        assert!(matches!(mirror.watch("/", 1), Err(StoreError::Compacted { .. })));
        let mut recent = mirror.watch("/", 39)?;
        assert_eq!(recent.next().await.ok_or(StoreError::Closed)??.entry.mod_revision, 40);
        Ok(())
    }

    #[tokio::test]
    async fn values_not_held_are_left_out_of_the_entries_and_kept_in_the_log() -> Result<(), StoreError> {
        let loaded = Entry { key: "/events/m1/0".into(), value: Arc::from(&b"old"[..]), create_revision: 1, mod_revision: 1 };
        let mirror = Arc::new(Mirror::new(BTreeMap::from([(loaded.key.clone(), loaded)]), 1));
        let entry = Entry { key: "/events/m1/1".into(), value: Arc::from(&b"new"[..]), create_revision: 2, mod_revision: 2 };
        mirror.publish([Change { deleted: false, entry }, put("/machines/m1", 2)], 2);
        let held = |key: &str| mirror.get(key).map(|e| (e.value.to_vec(), e.mod_revision));
        assert_eq!(held("/events/m1/0"), Some((Vec::new(), 1)));
        assert_eq!(held("/events/m1/1"), Some((Vec::new(), 2)));
        assert_eq!(held("/machines/m1"), Some((b"v".to_vec(), 2)));
        let mut watch = mirror.watch("/events/", 1)?;
        assert_eq!(watch.next().await.ok_or(StoreError::Closed)??.entry.value.to_vec(), b"new");
        Ok(())
    }

    /// Publishes `n` changes to `/k/…` from `revision` on, one a revision, each after a change
    /// outside the watched prefix.
    fn publish_many(mirror: &Mirror, revision: u64, n: u64) {
        for r in revision..revision + n {
            mirror.publish([put("/other", r), put(&format!("/k/{r:06}"), r)], r);
        }
    }

    async fn next_key(watch: &mut Watch) -> Result<String, StoreError> {
        Ok(watch.next().await.ok_or(StoreError::Closed)??.entry.key)
    }

    #[tokio::test]
    async fn a_watch_that_falls_behind_replays_from_the_log_without_a_gap_or_a_repeat() -> Result<(), StoreError> {
        let mirror = Arc::new(Mirror::new(BTreeMap::new(), 0));
        let mut watch = mirror.watch("/k/", 0)?;
        // One transaction of three changes, of which the watch takes one before it falls behind.
        mirror.publish([put("/k/a", 1), put("/other", 1), put("/k/b", 1), put("/k/c", 1)], 1);
        assert_eq!(next_key(&mut watch).await?, "/k/a");
        let behind = BROADCAST_CAPACITY as u64 + 10;
        publish_many(&mirror, 2, behind);
        // Everything is published already, so each change is there to take without waiting.
        let mut keys = Vec::new();
        while let Some(next) = watch.next().now_or_never() {
            keys.push(next.ok_or(StoreError::Closed)??.entry.key);
        }
        let expected: Vec<String> =
            ["/k/b".to_owned(), "/k/c".to_owned()].into_iter().chain((2..2 + behind).map(|r| format!("/k/{r:06}"))).collect();
        assert!(
            keys == expected,
            "{} changes delivered, starting {:?}, ending {:?}; {} expected",
            keys.len(),
            &keys[..keys.len().min(3)],
            keys.last(),
            expected.len()
        );
        // It follows live changes again.
        mirror.publish([put("/k/z", 5_000_000)], 5_000_000);
        assert_eq!(next_key(&mut watch).await?, "/k/z");
        Ok(())
    }

    #[tokio::test]
    async fn a_watch_that_falls_behind_further_than_the_log_must_list_again() -> Result<(), StoreError> {
        let mirror = Arc::new(Mirror::new(BTreeMap::new(), 0));
        let mut watch = mirror.watch("/k/", 0)?;
        publish_many(&mirror, 1, 1);
        assert_eq!(next_key(&mut watch).await?, "/k/000001");
        // Two changes a revision: the log drops revision 1. The watch cannot know it took all
        // of that revision's changes under its prefix, so it needs the whole revision.
        publish_many(&mirror, 2, CHANGE_LOG_LEN as u64 / 2);
        assert!(matches!(watch.next().await, Some(Err(StoreError::Compacted { requested: 0, oldest: 1 }))));
        Ok(())
    }

    #[tokio::test]
    async fn a_watch_ends_when_its_store_does_even_behind() -> Result<(), StoreError> {
        let mirror = Arc::new(Mirror::new(BTreeMap::new(), 0));
        let mut following = mirror.watch("/k/", 0)?;
        let mut behind = mirror.watch("/k/", 0)?;
        publish_many(&mirror, 1, 1);
        assert_eq!(next_key(&mut following).await?, "/k/000001");
        // As many changes as `following` can hold (two a revision); `behind` would have to hold
        // those of revision 1 as well, so it falls behind.
        publish_many(&mirror, 2, BROADCAST_CAPACITY as u64 / 2);
        drop(mirror);
        let mut delivered = 0;
        while let Some(change) = following.next().await {
            change?;
            delivered += 1;
        }
        assert_eq!(delivered, BROADCAST_CAPACITY / 2, "the changes still buffered, then the end");
        assert!(behind.next().await.is_none());
        Ok(())
    }

    #[tokio::test]
    async fn a_watch_with_nothing_to_deliver_replays_from_what_it_passed_over() -> Result<(), StoreError> {
        let mirror = Arc::new(Mirror::new(BTreeMap::new(), 0));
        let mut idle = mirror.watch("/idle/", 0)?;
        // More changes elsewhere than the log holds, taken as they come: none is the watch's.
        let mut revision = 1;
        while revision <= CHANGE_LOG_LEN as u64 {
            publish_many(&mirror, revision, BROADCAST_CAPACITY as u64 / 2);
            revision += BROADCAST_CAPACITY as u64 / 2;
            // Waited for, not polled once: tokio's budget stops a receive loop after 128.
            assert!(tokio::time::timeout(Duration::from_millis(20), idle.next()).await.is_err());
        }
        assert!(mirror.read().log_start > 0);
        // Then it falls behind: it replays from the last change it passed over, which the log
        // still holds, not from where it started.
        publish_many(&mirror, revision, BROADCAST_CAPACITY as u64);
        mirror.publish([put("/idle/x", 1_000_000)], 1_000_000);
        assert_eq!(next_key(&mut idle).await?, "/idle/x");
        Ok(())
    }
}
