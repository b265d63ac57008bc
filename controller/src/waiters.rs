//! Wakes long-polling agents when their machine's generation changes, and the rollout pass
//! when a pool member's progress changes.
//!
//! A task follows the store's watch of `/machines/` and publishes each machine's generation
//! to the agents waiting on it. Following the store (rather than hooking the write paths)
//! catches every writer, including other controller replicas: a status that an agent reports
//! to one replica wakes the leader's rollout pass on another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::registry::MACHINES;
use crate::store::{Change, Entry, Store, StoreError};

#[derive(Debug, Default)]
pub struct SpecWaiters {
    senders: Mutex<HashMap<String, watch::Sender<u64>>>,
}

impl SpecWaiters {
    fn senders(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        self.senders.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Subscribe before reading the machine: a change committed after the read is then
    /// always delivered.
    pub fn subscribe(&self, name: &str) -> watch::Receiver<u64> {
        self.senders().entry(name.to_owned()).or_insert_with(|| watch::channel(0).0).subscribe()
    }

    fn publish(&self, name: &str, generation: u64) {
        if let Some(tx) = self.senders().get(name) {
            tx.send_if_modified(|current| {
                let newer = generation > *current;
                if newer {
                    *current = generation;
                }
                newer
            });
        }
    }

    fn sweep(&self) {
        self.senders().retain(|_, tx| tx.receiver_count() > 0);
    }
}

/// The parts of a stored machine this task reads.
#[derive(Deserialize)]
struct Watched {
    metadata: WatchedMeta,
    #[serde(default)]
    status: WatchedStatus,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WatchedMeta {
    #[serde(default)]
    generation: u64,
    #[serde(default)]
    deletion_timestamp: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct WatchedStatus {
    #[serde(default)]
    observed_generation: u64,
    #[serde(default)]
    pool: Option<String>,
    #[serde(default)]
    conditions: Vec<WatchedCondition>,
}

#[derive(Deserialize, PartialEq, Eq, Hash)]
struct WatchedCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
}

/// What the rollout pass decides on: a change of it is progress.
#[derive(PartialEq, Eq)]
struct Progress {
    /// Labels decide the pool.
    labels: std::collections::BTreeMap<String, String>,
    generation: u64,
    observed_generation: u64,
    deleting: bool,
    pool: Option<String>,
    conditions: Vec<WatchedCondition>,
}

/// Follows machine changes until cancelled, calling `progressed` when a machine appeared,
/// was relabelled, or a pool member's progress changed.
pub async fn follow_machines(
    store: Arc<dyn Store>,
    waiters: Arc<SpecWaiters>,
    progressed: impl Fn() + Send + 'static,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    const SWEEP_EVERY_CHANGES: u64 = 4096;
    let mut seen: u64 = 0;
    let mut progress: HashMap<String, Progress> = HashMap::new();
    follow(store, MACHINES, cancel, |seen_now| match seen_now {
        Seen::Listed(entries) => {
            progress.clear();
            for e in entries {
                observe(&waiters, &mut progress, &e.key, &e.value);
            }
            progressed();
        }
        Seen::Changed(change) => {
            let wake = if change.deleted {
                change.entry.key.strip_prefix(MACHINES).and_then(|name| progress.remove(name)).is_some_and(|p| p.pool.is_some())
            } else {
                observe(&waiters, &mut progress, &change.entry.key, &change.entry.value)
            };
            if wake {
                progressed();
            }
            seen += 1;
            if seen.is_multiple_of(SWEEP_EVERY_CHANGES) {
                waiters.sweep();
            }
        }
    })
    .await
}

/// Calls `changed` after each listing of `prefix` and on every change under it, until cancelled.
pub async fn follow_changes(
    store: Arc<dyn Store>,
    prefix: &'static str,
    changed: impl Fn() + Send + 'static,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    follow(store, prefix, cancel, |_| changed()).await
}

/// What `follow` saw: everything under the prefix (at the start, and again after falling
/// behind the store), or one change.
enum Seen<'a> {
    Listed(&'a [Entry]),
    Changed(&'a Change),
}

/// Lists `prefix`, then follows its changes until cancelled. When the watch falls behind,
/// lists again and watches on from there.
async fn follow(store: Arc<dyn Store>, prefix: &str, cancel: CancellationToken, mut handle: impl FnMut(Seen<'_>)) -> anyhow::Result<()> {
    'relist: loop {
        let listing = store.list(prefix).await?;
        handle(Seen::Listed(&listing.entries));
        let mut watch = store.watch(prefix, listing.revision).await?;
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                next = watch.next() => next,
            };
            match next {
                None => return Ok(()),
                Some(Err(StoreError::Compacted { .. })) => {
                    tracing::warn!(prefix, "fell behind the store's changes; listing again");
                    continue 'relist;
                }
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(change)) => handle(Seen::Changed(&change)),
            }
        }
    }
}

/// Publishes a machine's generation; says whether the rollout pass has something to look
/// at: a new machine (it may join a pool), new labels (it may change pools), or a pool
/// member's progress.
fn observe(waiters: &SpecWaiters, progress: &mut HashMap<String, Progress>, key: &str, value: &[u8]) -> bool {
    let Some(name) = key.strip_prefix(MACHINES) else { return false };
    let Ok(m) = serde_json::from_slice::<Watched>(value) else { return false };
    waiters.publish(name, m.metadata.generation);
    let now = Progress {
        labels: m.metadata.labels,
        generation: m.metadata.generation,
        observed_generation: m.status.observed_generation,
        deleting: m.metadata.deletion_timestamp.is_some(),
        pool: m.status.pool,
        conditions: m.status.conditions,
    };
    let relevant =
        |before: &Progress, now: &Progress| before.labels != now.labels || ((before.pool.is_some() || now.pool.is_some()) && before != now);
    let wake = progress.get(name).is_none_or(|before| relevant(before, &now));
    progress.insert(name.to_owned(), now);
    wake
}
