//! The `Store`: a key-value store with etcd's semantics, which is all the controller asks of
//! its storage. Every write gets a new store-wide revision; each key carries the revision that
//! created it and the one that last changed it; writes can be made conditional on those
//! (compare-and-swap); several writes can commit atomically; lists go by key prefix; a watch
//! replays every change after a revision, then follows new ones.
//!
//! Both stores keep every key's revisions in memory, and every value except those under
//! `VALUES_NOT_IN_MEMORY`, so most reads, every precondition and every watch cost no round
//! trip to SQLite's file or to etcd.

pub mod etcd;
mod mirror;
pub mod sqlite;

use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::broadcast;

/// Keys whose values the stores do not hold in memory: machines' event histories. At their
/// full length they are most of a fleet's bytes (about 400 MiB at 10,000 machines,
/// docs/benchmarks.md), and they are read only when an operator asks for them or an event is
/// added. Their keys and revisions are in memory like any other's (for preconditions,
/// `list_keys` and watches); `get`, `get_many` and `list` read their values from the backend.
pub const VALUES_NOT_IN_MEMORY: &str = "/events/";

/// Whether the stores hold `key`'s value in memory.
pub fn value_in_memory(key: &str) -> bool {
    !key.starts_with(VALUES_NOT_IN_MEMORY)
}

/// The first key after every key that starts with `prefix`, for range reads.
fn prefix_end(prefix: &str) -> String {
    let mut end: Vec<char> = prefix.chars().collect();
    while let Some(last) = end.pop() {
        // The next character, past the surrogates; after char::MAX, carry to the one before.
        if let Some(next) = (last as u32 + 1..=char::MAX as u32).find_map(char::from_u32) {
            end.push(next);
            return end.into_iter().collect();
        }
    }
    // Only a prefix of char::MAX alone gets here; no key follows it.
    String::from(char::MAX)
}

/// One stored key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: String,
    pub value: Arc<[u8]>,
    pub create_revision: u64,
    pub mod_revision: u64,
}

/// What must hold for a write to go ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precondition {
    /// Write whatever is there.
    None,
    /// The key must not exist (create).
    Absent,
    /// The key must exist at exactly this modification revision (compare-and-swap).
    Revision(u64),
    /// The key must exist, at any revision.
    Exists,
}

impl Precondition {
    /// Whether it holds for a key at modification revision `found` (`None`: no such key).
    pub fn holds(self, found: Option<u64>) -> bool {
        match self {
            Precondition::None => true,
            Precondition::Absent => found.is_none(),
            Precondition::Exists => found.is_some(),
            Precondition::Revision(r) => found == Some(r),
        }
    }
}

#[derive(Debug, Clone)]
pub enum Op {
    Put {
        key: String,
        value: Vec<u8>,
        precondition: Precondition,
    },
    Delete {
        key: String,
        precondition: Precondition,
    },
    /// Writes nothing: the transaction goes ahead only if `precondition` holds for `key`
    /// (a write that depends on a key it does not change).
    Check {
        key: String,
        precondition: Precondition,
    },
}

impl Op {
    pub fn key(&self) -> &str {
        match self {
            Op::Put { key, .. } | Op::Delete { key, .. } | Op::Check { key, .. } => key,
        }
    }

    pub fn precondition(&self) -> Precondition {
        match self {
            Op::Put { precondition, .. } | Op::Delete { precondition, .. } | Op::Check { precondition, .. } => *precondition,
        }
    }
}

/// One committed change, as a watch delivers it. For a delete, `entry` holds the value the
/// key had before (empty for a key whose value is not in memory) and `mod_revision` the
/// revision of the delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub deleted: bool,
    pub entry: Entry,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("{key} was changed concurrently (expected {expected:?}, found revision {found:?})")]
    Conflict { key: String, expected: Precondition, found: Option<u64> },
    #[error("revision {requested} has been compacted; the oldest revision still watchable is {oldest}")]
    Compacted { requested: u64, oldest: u64 },
    #[error("storage failure: {0}")]
    Backend(String),
    /// The store cannot take the request now: out of reach, or refusing writes (out of space);
    /// the same request may succeed later.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    #[error("the store is shut down")]
    Closed,
}

/// A watch: the changes after the requested revision, then live ones. `next` returns `None`
/// when the store shuts down. A watch that falls behind the live changes replays them from
/// the store's log of recent changes; `next` returns `Err(Compacted)` only when it fell further
/// behind than the log reaches (the caller lists again and watches from there).
#[derive(Debug)]
pub struct Watch {
    prefix: String,
    backlog: std::collections::VecDeque<Change>,
    live: broadcast::Receiver<Arc<Change>>,
    /// The revision watched from.
    after: u64,
    /// Where to replay from after falling behind: the changes under the prefix after this
    /// revision…
    replay_after: u64,
    /// …less the first this many (delivered already: a transaction's changes share one
    /// revision, and a watch may fall behind between them).
    replay_skip: usize,
    /// The revision of the last change seen, delivered or passed over as outside the prefix
    /// (so that a watch with nothing to deliver keeps up with the log too).
    seen_revision: u64,
    /// Where to replay from; gone when the store is.
    mirror: std::sync::Weak<mirror::Mirror>,
}

impl Watch {
    fn new(
        prefix: String,
        backlog: std::collections::VecDeque<Change>,
        live: broadcast::Receiver<Arc<Change>>,
        after: u64,
        mirror: std::sync::Weak<mirror::Mirror>,
    ) -> Self {
        Watch { prefix, backlog, live, after, replay_after: after, replay_skip: 0, seen_revision: after, mirror }
    }

    pub async fn next(&mut self) -> Option<Result<Change, StoreError>> {
        loop {
            if let Some(change) = self.backlog.pop_front() {
                return Some(Ok(self.delivered(change)));
            }
            match self.live.recv().await {
                // The backlog and the live stream never overlap (the mirror takes both under
                // one lock). A transaction's changes share one revision: compare with the
                // revision watched from, not with the last change delivered.
                Ok(change) if change.entry.mod_revision <= self.after => {}
                Ok(change) if !change.entry.key.starts_with(&self.prefix) => self.saw(change.entry.mod_revision),
                Ok(change) => return Some(Ok(self.delivered((*change).clone()))),
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let mirror = self.mirror.upgrade()?;
                    match mirror.replay(&self.prefix, self.replay_after, self.replay_skip) {
                        Ok((backlog, live)) => (self.backlog, self.live) = (backlog, live),
                        Err(e) => return Some(Err(e)),
                    }
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }

    fn saw(&mut self, revision: u64) {
        if revision != self.seen_revision {
            (self.seen_revision, self.replay_after, self.replay_skip) = (revision, revision - 1, 0);
        }
    }

    fn delivered(&mut self, change: Change) -> Change {
        self.saw(change.entry.mod_revision);
        self.replay_skip += 1;
        change
    }
}

/// A listing and the revision it was read at.
#[derive(Debug, Clone)]
pub struct Listing {
    pub entries: Vec<Entry>,
    pub revision: u64,
}

/// What changed under a prefix since a revision (`Store::since`).
#[derive(Debug)]
pub enum Since {
    /// Every change after the revision asked for, in order, and the revision they bring the
    /// reader to.
    Changes { changes: Vec<Arc<Change>>, revision: u64 },
    /// The changes are no longer all kept: everything under the prefix now.
    Listing(Listing),
}

#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug + 'static {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError>;
    /// `get` of each key, in order, with as few reads of the backend as it can.
    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Entry>>, StoreError>;
    async fn list(&self, prefix: &str) -> Result<Listing, StoreError>;
    /// The keys under `prefix` and their revisions, with empty values, from memory.
    fn list_keys(&self, prefix: &str) -> Listing;
    /// Applies every op atomically at one new revision, or none of them when any
    /// precondition fails. Returns the revision.
    async fn txn(&self, ops: Vec<Op>) -> Result<u64, StoreError>;
    /// `txn` for a write that machines are waiting for (the rollout pass's, which gives them
    /// a new spec): it leaves before other writes that are waiting, except a yielding one
    /// that has waited too long.
    async fn txn_urgent(&self, ops: Vec<Op>) -> Result<u64, StoreError> {
        self.txn(ops).await
    }
    /// `txn` for a write that can wait a few milliseconds: it may be held to leave with
    /// others of its kind, and leaves after other writes that are waiting (an agent's status
    /// report, behind the writes that give machines a new spec).
    async fn txn_yielding(&self, ops: Vec<Op>) -> Result<u64, StoreError> {
        self.txn(ops).await
    }
    /// Every change under `prefix` after revision `after`.
    async fn watch(&self, prefix: &str, after: u64) -> Result<Watch, StoreError>;
    /// The newest committed revision.
    fn revision(&self) -> u64;
    /// What changed under `prefix` after revision `after` (`None`: a listing), from memory:
    /// for a cache that keeps up with the store without listing it each time. A listing
    /// holds empty values for keys whose values are not in memory.
    fn since(&self, prefix: &str, after: Option<u64>) -> Since;
}

/// Conveniences over `txn` for the common single-key writes.
#[async_trait]
pub trait StoreExt: Store {
    async fn put(&self, key: &str, value: Vec<u8>, precondition: Precondition) -> Result<u64, StoreError> {
        self.txn(vec![Op::Put { key: key.to_owned(), value, precondition }]).await
    }
    async fn delete(&self, key: &str, precondition: Precondition) -> Result<u64, StoreError> {
        self.txn(vec![Op::Delete { key: key.to_owned(), precondition }]).await
    }
}

impl<S: Store + ?Sized> StoreExt for S {}

#[cfg(test)]
mod tests {
    #[test]
    fn a_prefix_ends_just_after_its_last_key() {
        assert_eq!(super::prefix_end("/events/"), "/events0");
        assert_eq!(super::prefix_end("/"), "0");
        assert_eq!(super::prefix_end("a\u{D7FF}"), "a\u{E000}");
    }
}
