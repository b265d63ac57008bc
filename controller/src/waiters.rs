//! Wakes long-polling agents when their machine's generation changes.
//!
//! A task follows the store's watch of `/machines/` and publishes each machine's generation
//! to the agents waiting on it. Following the store (rather than hooking the write paths)
//! catches every writer, including other controller replicas.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::registry::MACHINES;
use crate::store::{Store, StoreError};

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

#[derive(Deserialize)]
struct GenerationOnly {
    metadata: MetaGeneration,
}

#[derive(Deserialize)]
struct MetaGeneration {
    #[serde(default)]
    generation: u64,
}

/// Follows machine changes until cancelled. When the watch falls behind, re-lists and
/// publishes every machine's generation, then watches on from there.
pub async fn follow_machines(store: Arc<dyn Store>, waiters: Arc<SpecWaiters>, cancel: CancellationToken) -> anyhow::Result<()> {
    const SWEEP_EVERY_CHANGES: u64 = 4096;
    let mut seen: u64 = 0;
    'relist: loop {
        let listing = store.list(MACHINES).await?;
        for e in &listing.entries {
            publish_entry(&waiters, &e.key, &e.value);
        }
        let mut watch = store.watch(MACHINES, listing.revision).await?;
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                next = watch.next() => next,
            };
            match next {
                None => return Ok(()),
                Some(Err(StoreError::Compacted { .. })) => {
                    tracing::warn!("spec waiters fell behind the store; re-listing machines");
                    continue 'relist;
                }
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(change)) if !change.deleted => publish_entry(&waiters, &change.entry.key, &change.entry.value),
                Some(Ok(_)) => {}
            }
            seen += 1;
            if seen.is_multiple_of(SWEEP_EVERY_CHANGES) {
                waiters.sweep();
            }
        }
    }
}

fn publish_entry(waiters: &SpecWaiters, key: &str, value: &[u8]) {
    let Some(name) = key.strip_prefix(MACHINES) else { return };
    if let Ok(m) = serde_json::from_slice::<GenerationOnly>(value) {
        waiters.publish(name, m.metadata.generation);
    }
}
