//! The committed state in memory, which both stores serve reads and watches from: every
//! entry, the newest revision, a bounded log of recent changes for watches to replay, and a
//! broadcast of new changes. A store publishes into it only what is durable (SQLite after its
//! commit, etcd as its watch reports it), so a reader never sees a write that could be lost.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Duration;

use tokio::sync::{broadcast, watch};

use super::{Change, Entry, Listing, Since, StoreError, Watch};

/// How many recent changes a watch can replay from…
const CHANGE_LOG_LEN: usize = 20_000;
/// …as long as their keys and values take no more than this (a change keeps the value it
/// wrote alive after the key has moved on).
const CHANGE_LOG_BYTES: usize = 32 << 20;
/// How many live changes a slow watcher may fall behind before it must re-list (the buffer
/// keeps as many values alive).
const BROADCAST_CAPACITY: usize = 4_096;

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
}

impl Committed {
    fn listing(&self, prefix: &str) -> Listing {
        let entries = self.entries.range(prefix.to_owned()..).take_while(|(k, _)| k.starts_with(prefix)).map(|(_, e)| e.clone()).collect();
        Listing { entries, revision: self.revision }
    }
}

impl Mirror {
    pub fn new(entries: BTreeMap<String, Entry>, revision: u64) -> Self {
        let (changes, _) = broadcast::channel(BROADCAST_CAPACITY);
        Mirror {
            state: RwLock::new(Committed { entries, revision, log: VecDeque::new(), log_bytes: 0, log_start: revision }),
            changes,
            published: watch::Sender::new(revision),
        }
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

    pub fn watch(&self, prefix: &str, after: u64) -> Result<Watch, StoreError> {
        // Subscribe while holding the read lock: publishing takes the write lock, so no
        // change falls between the backlog and the live stream.
        let state = self.read();
        let live = self.changes.subscribe();
        if after < state.log_start {
            return Err(StoreError::Compacted { requested: after, oldest: state.log_start });
        }
        let backlog =
            state.log.iter().filter(|c| c.entry.mod_revision > after && c.entry.key.starts_with(prefix)).map(|c| (**c).clone()).collect();
        Ok(Watch::new(prefix.to_owned(), backlog, live, after))
    }

    /// Applies committed `changes` (in revision order) and moves the revision to `revision`.
    pub fn publish(&self, changes: impl IntoIterator<Item = Change>, revision: u64) {
        {
            let mut state = self.state.write().unwrap_or_else(|e| panic!("store state poisoned: {e}"));
            for change in changes {
                if change.deleted {
                    state.entries.remove(&change.entry.key);
                } else {
                    state.entries.insert(change.entry.key.clone(), change.entry.clone());
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
        let mirror = Mirror::new(BTreeMap::new(), 100);
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
        let mirror = Mirror::new(BTreeMap::new(), 0);
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
        let mirror = Mirror::new(BTreeMap::new(), 0);
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
}
