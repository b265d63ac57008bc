//! The embedded store: SQLite in WAL mode, one data file.
//!
//! One writer thread owns the connection. Requests queue to it; it takes every request that
//! is waiting, checks each one's preconditions against the committed state plus the requests
//! before it in the batch, writes the ones that pass in a single transaction and commits once
//! (one fsync for the whole batch, with `synchronous=FULL`). Only after the commit does it
//! publish the new state to readers and watchers and answer the callers, so an acknowledged
//! write is on disk and a reader never sees a write that could still be lost.
//!
//! Readers use SQLite only for values not held in memory (`VALUES_NOT_IN_MEMORY`), on a
//! connection of their own: in WAL mode it reads while the writer writes, and sees committed
//! transactions only. Everything else, and every key's revisions, is kept in memory (a fleet
//! of 10,000 machines is tens of MiB), in the `Mirror` both stores share, which the writer
//! checks preconditions against.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rusqlite::{Connection, OptionalExtension, Row, params};
use tokio::sync::{mpsc, oneshot};

use super::mirror::{Backend, Mirror};
use super::{Change, Entry, Listing, Op, Since, Store, StoreError, VALUES_NOT_IN_MEMORY, Watch, prefix_end};

/// The most requests committed in one transaction.
const MAX_BATCH: usize = 512;
const SCHEMA_VERSION: i64 = 1;

struct Request {
    ops: Vec<Op>,
    reply: oneshot::Sender<Result<u64, StoreError>>,
}

#[derive(Debug)]
pub struct SqliteStore {
    mirror: Arc<Mirror>,
    requests: mpsc::UnboundedSender<Request>,
    reader: Reader,
}

/// The connection that reads values not held in memory.
#[derive(Debug, Clone)]
struct Reader(Arc<Mutex<Connection>>);

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").field("ops", &self.ops.len()).finish()
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl SqliteStore {
    /// Opens (creating if needed) the database at `path` and loads it.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path).map_err(backend)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(backend)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(backend)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS kv (
                 key TEXT PRIMARY KEY,
                 value BLOB NOT NULL,
                 create_revision INTEGER NOT NULL,
                 mod_revision INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
             INSERT OR IGNORE INTO meta (name, value) VALUES ('revision', 0);",
        )
        .map_err(backend)?;
        let schema: Option<i64> = conn
            .query_row("SELECT value FROM meta WHERE name = 'schema'", [], |r| r.get(0))
            .map(Some)
            .or_else(|e| if matches!(e, rusqlite::Error::QueryReturnedNoRows) { Ok(None) } else { Err(e) })
            .map_err(backend)?;
        match schema {
            None => {
                conn.execute("INSERT INTO meta (name, value) VALUES ('schema', ?1)", params![SCHEMA_VERSION]).map_err(backend)?;
            }
            Some(SCHEMA_VERSION) => {}
            Some(other) => {
                return Err(StoreError::Backend(format!(
                    "{} has schema version {other}; this controller understands {SCHEMA_VERSION}",
                    path.display()
                )));
            }
        }
        let revision: i64 = conn.query_row("SELECT value FROM meta WHERE name = 'revision'", [], |r| r.get(0)).map_err(backend)?;
        let mut entries = BTreeMap::new();
        {
            // Values not held in memory are left in the file.
            let mut stmt = conn
                .prepare("SELECT key, CASE WHEN key >= ?1 AND key < ?2 THEN x'' ELSE value END, create_revision, mod_revision FROM kv")
                .map_err(backend)?;
            let rows = stmt.query_map(params![VALUES_NOT_IN_MEMORY, prefix_end(VALUES_NOT_IN_MEMORY)], row_entry).map_err(backend)?;
            for row in rows {
                let entry = row.map_err(backend)?;
                entries.insert(entry.key.clone(), entry);
            }
        }
        let reading = Connection::open(path).map_err(backend)?;
        reading.pragma_update(None, "query_only", true).map_err(backend)?;
        let mirror = Arc::new(Mirror::new(entries, revision as u64));
        let (requests, queue) = mpsc::unbounded_channel();
        let writer = Writer { conn, mirror: mirror.clone() };
        std::thread::Builder::new().name("store-writer".into()).spawn(move || writer.run(queue)).map_err(backend)?;
        Ok(SqliteStore { mirror, requests, reader: Reader(Arc::new(Mutex::new(reading))) })
    }
}

fn row_entry(r: &Row<'_>) -> rusqlite::Result<Entry> {
    Ok(Entry {
        key: r.get(0)?,
        value: Arc::from(r.get::<_, Vec<u8>>(1)?),
        create_revision: r.get::<_, i64>(2)? as u64,
        mod_revision: r.get::<_, i64>(3)? as u64,
    })
}

impl Reader {
    /// Runs `read` in one read transaction (one snapshot), off the async threads.
    async fn run<T: Send + 'static>(
        &self,
        read: impl FnOnce(&Connection) -> rusqlite::Result<T> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = self.0.clone();
        tokio::task::spawn_blocking(move || {
            // A panic while reading leaves nothing half-done on a read-only connection.
            let conn = conn.lock().unwrap_or_else(|e| e.into_inner());
            let tx = conn.unchecked_transaction()?;
            let result = read(&tx)?;
            tx.finish()?;
            Ok::<T, rusqlite::Error>(result)
        })
        .await
        .map_err(backend)?
        .map_err(backend)
    }
}

#[async_trait]
impl Backend for Reader {
    async fn read_keys(&self, keys: Vec<String>) -> Result<Vec<Option<Entry>>, StoreError> {
        self.run(move |conn| {
            let mut stmt = conn.prepare_cached("SELECT key, value, create_revision, mod_revision FROM kv WHERE key = ?1")?;
            keys.iter().map(|key| stmt.query_row(params![key], row_entry).optional()).collect()
        })
        .await
    }

    async fn read_prefix(&self, prefix: &str) -> Result<Listing, StoreError> {
        let prefix = prefix.to_owned();
        self.run(move |conn| {
            let entries = conn
                .prepare_cached("SELECT key, value, create_revision, mod_revision FROM kv WHERE key >= ?1 AND key < ?2 ORDER BY key")?
                .query_map(params![prefix, prefix_end(&prefix)], row_entry)?
                .collect::<rusqlite::Result<Vec<Entry>>>()?;
            let revision: i64 = conn.query_row("SELECT value FROM meta WHERE name = 'revision'", [], |r| r.get(0))?;
            Ok(Listing { entries, revision: revision as u64 })
        })
        .await
    }
}

#[async_trait]
impl Store for SqliteStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.mirror.get_through(key, &self.reader).await
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Entry>>, StoreError> {
        self.mirror.get_many_through(keys, &self.reader).await
    }

    async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.mirror.list_through(prefix, &self.reader).await
    }

    fn list_keys(&self, prefix: &str) -> Listing {
        self.mirror.list_keys(prefix)
    }

    async fn txn(&self, ops: Vec<Op>) -> Result<u64, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.requests.send(Request { ops, reply }).map_err(|_| StoreError::Closed)?;
        answer.await.map_err(|_| StoreError::Closed)?
    }

    async fn watch(&self, prefix: &str, after: u64) -> Result<Watch, StoreError> {
        self.mirror.watch(prefix, after)
    }

    fn revision(&self) -> u64 {
        self.mirror.revision()
    }

    fn since(&self, prefix: &str, after: Option<u64>) -> Since {
        self.mirror.since(prefix, after)
    }
}

struct Writer {
    conn: Connection,
    mirror: Arc<Mirror>,
}

impl Writer {
    fn run(mut self, mut queue: mpsc::UnboundedReceiver<Request>) {
        while let Some(first) = queue.blocking_recv() {
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH {
                match queue.try_recv() {
                    Ok(r) => batch.push(r),
                    Err(_) => break,
                }
            }
            self.commit_batch(batch);
        }
    }

    fn commit_batch(&mut self, batch: Vec<Request>) {
        let base_revision = self.mirror.revision();
        // What each request changes, decided against the committed state and the earlier
        // requests of this batch.
        let mut overlay: HashMap<String, Option<Entry>> = HashMap::new();
        let mut outcomes: Vec<Result<(u64, Vec<Change>), StoreError>> = Vec::with_capacity(batch.len());
        let mut revision = base_revision;
        {
            let state = self.mirror.read();
            for request in &batch {
                let current = |key: &str, overlay: &HashMap<String, Option<Entry>>| -> Option<Entry> {
                    match overlay.get(key) {
                        Some(e) => e.clone(),
                        None => state.entries.get(key).cloned(),
                    }
                };
                let failed = request.ops.iter().find_map(|op| {
                    let found = current(op.key(), &overlay).map(|e| e.mod_revision);
                    let expected = op.precondition();
                    (!expected.holds(found)).then(|| StoreError::Conflict { key: op.key().to_owned(), expected, found })
                });
                if let Some(e) = failed {
                    outcomes.push(Err(e));
                    continue;
                }
                let changes: Vec<Change> = {
                    let next = revision + 1;
                    let mut changes = Vec::new();
                    for op in &request.ops {
                        match op {
                            Op::Put { key, value, .. } => {
                                let create_revision = current(key, &overlay).map_or(next, |e| e.create_revision);
                                let entry =
                                    Entry { key: key.clone(), value: Arc::from(value.as_slice()), create_revision, mod_revision: next };
                                overlay.insert(key.clone(), Some(entry.clone()));
                                changes.push(Change { deleted: false, entry });
                            }
                            Op::Delete { key, .. } => {
                                if let Some(mut old) = current(key, &overlay) {
                                    old.mod_revision = next;
                                    overlay.insert(key.clone(), None);
                                    changes.push(Change { deleted: true, entry: old });
                                }
                            }
                            Op::Check { .. } => {}
                        }
                    }
                    changes
                };
                if changes.is_empty() {
                    outcomes.push(Ok((revision, changes)));
                } else {
                    revision += 1;
                    outcomes.push(Ok((revision, changes)));
                }
            }
        }
        if revision != base_revision
            && let Err(e) = self.write(&outcomes, revision)
        {
            tracing::error!(error = %e, "store commit failed");
            for request in batch {
                let _ = request.reply.send(Err(e.clone()));
            }
            return;
        }
        self.mirror.publish(outcomes.iter().flatten().flat_map(|(_, changes)| changes.iter().cloned()), revision);
        for (request, outcome) in batch.into_iter().zip(outcomes) {
            let _ = request.reply.send(outcome.map(|(rev, _)| rev));
        }
    }

    fn write(&mut self, outcomes: &[Result<(u64, Vec<Change>), StoreError>], revision: u64) -> Result<(), StoreError> {
        let tx = self.conn.transaction().map_err(backend)?;
        {
            let mut put = tx
                .prepare_cached("INSERT OR REPLACE INTO kv (key, value, create_revision, mod_revision) VALUES (?1, ?2, ?3, ?4)")
                .map_err(backend)?;
            let mut delete = tx.prepare_cached("DELETE FROM kv WHERE key = ?1").map_err(backend)?;
            for (_, changes) in outcomes.iter().flatten() {
                for c in changes {
                    if c.deleted {
                        delete.execute(params![c.entry.key]).map_err(backend)?;
                    } else {
                        put.execute(params![c.entry.key, &c.entry.value[..], c.entry.create_revision as i64, c.entry.mod_revision as i64])
                            .map_err(backend)?;
                    }
                }
            }
            tx.execute("UPDATE meta SET value = ?1 WHERE name = 'revision'", params![revision as i64]).map_err(backend)?;
        }
        tx.commit().map_err(backend)
    }
}

#[cfg(test)]
mod tests {
    //! What only SQLite does; the store contract both stores keep is checked in
    //! `tests/tests/store.rs`.
    use super::*;
    use crate::store::{Precondition, StoreExt};

    fn open(dir: &tempfile::TempDir) -> SqliteStore {
        SqliteStore::open(&dir.path().join("keelson.db")).unwrap_or_else(|e| panic!("{e}"))
    }

    #[tokio::test]
    async fn state_survives_reopen() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        {
            let store = open(&dir);
            store.put("/x", b"1".to_vec(), Precondition::None).await?;
            store.put("/y", b"2".to_vec(), Precondition::None).await?;
            store.delete("/x", Precondition::Exists).await?;
            store.put("/events/m1/0", b"history".to_vec(), Precondition::None).await?;
        }
        let store = open(&dir);
        assert_eq!(store.revision(), 4);
        assert!(store.get("/x").await?.is_none());
        assert_eq!(store.get("/y").await?.map(|e| e.mod_revision), Some(2));
        // Loaded without the values not held in memory, which are read from the file.
        assert_eq!(store.mirror.get("/events/m1/0").map(|e| (e.value.len(), e.mod_revision)), Some((0, 4)));
        assert_eq!(store.get("/events/m1/0").await?.map(|e| e.value.to_vec()), Some(b"history".to_vec()));
        Ok(())
    }
}
