//! The store on an etcd cluster, for controllers that run as several replicas.
//!
//! Every key of the controller lives under one prefix (`/keelson` by default: the store key
//! `/machines/a` is etcd's `/keelson/machines/a`), so a cluster can be shared with other users.
//! Revisions are etcd's own: they grow with every write to the cluster, also outside the
//! prefix, and each key's create and modification revisions are etcd's.
//!
//! Writes are etcd transactions: a store precondition becomes a compare on the key's create or
//! modification revision, so compare-and-swap across replicas is etcd's, not ours. Writes that
//! queue while others are in flight leave together as one transaction (`batch_writes`):
//! urgent ones (the rollout pass's) first, yielding ones (agents' reports) last, after waiting
//! a little to leave together (`gather`). Reads and watches are served from the same
//! in-memory `Mirror` the SQLite store uses, fed by one etcd watch on the prefix; the values it
//! does not hold (event histories) are read from etcd, and such reads that queue together
//! leave as one transaction (`batch_reads`). A replica's mirror can trail etcd by the watch's
//! delay, so every write (and every refused one) waits until the mirror holds its revision
//! before it answers:
//! a caller that writes and then reads sees its write, and one that lost a compare-and-swap
//! re-reads at least what beat it.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, Identity, KeyValue, KvClient, TlsOptions, Txn, TxnOp,
    TxnOpResponse, WatchOptions, WatchResponse,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::mirror::{Backend, Mirror};
use super::{Change, Entry, Listing, Op, Precondition, Since, Store, StoreError, VALUES_NOT_IN_MEMORY, Watch, prefix_end};

/// The prefix when the operator names none.
pub const DEFAULT_PREFIX: &str = "/keelson";
/// How long a write waits for this replica's mirror to show it before asking etcd for the
/// watch's progress (a refused write's revision may lie beyond the prefix's newest change).
const MIRROR_QUICK_WAIT: Duration = Duration::from_millis(100);
/// How long a write waits, in all, for the mirror to catch up with it.
const MIRROR_WAIT: Duration = Duration::from_secs(30);
/// Pause before the mirror's watch is opened again after it broke.
const REWATCH_DELAY: Duration = Duration::from_millis(500);
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request that could not reach a working member is sent again (an election
/// takes about a second with etcd's defaults).
const REQUEST_RETRY_FOR: Duration = Duration::from_secs(15);
const RETRY_DELAY: Duration = Duration::from_millis(200);
/// How often history is compacted unless the operator says otherwise (kube-apiserver's
/// interval): etcd keeps every write as history until compacted, up to its 2 GiB quota, and a
/// 10,000-machine fleet writes 1,000 heartbeats a second.
pub const DEFAULT_COMPACT_EVERY: Duration = Duration::from_secs(300);
/// The largest answer taken from etcd: a page of a listing, or a watch response that catches
/// up on many revisions at once. gRPC's default of 4 MiB is less than the records of 4,000
/// machines, and a watch that could not take its next response would break again each time
/// it was opened.
const MAX_ANSWER_BYTES: usize = 256 << 20;
/// Keys per page of a listing (10,000 machines' records are about 12 MiB).
const LIST_PAGE_KEYS: i64 = 1_000;
/// Keys read in one transaction, within etcd's default limit of 128 operations (reads of
/// several callers leave together: `batch_reads`)…
const READS_PER_TXN: usize = 100;
/// …and such transactions in flight at once.
const READ_TXNS_IN_PARALLEL: usize = 4;

/// Client certificate files for an etcd that requires them.
#[derive(Debug, Clone)]
pub struct EtcdTlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// `http://HOST:PORT` or `https://HOST:PORT`, one per member.
    pub endpoints: Vec<String>,
    pub tls: Option<EtcdTlsFiles>,
    pub prefix: String,
    /// How often to compact etcd's history (`None`: never; etcd's own retention does).
    pub compact_every: Option<Duration>,
}

impl EtcdOptions {
    /// Reads `etcd://HOST:PORT[,HOST:PORT…]`; with `tls` the endpoints are https.
    pub fn parse(url: &str, tls: Option<EtcdTlsFiles>, prefix: &str) -> Result<Self, String> {
        let hosts = url.strip_prefix("etcd://").ok_or_else(|| format!("--store {url:?}: expected etcd://HOST:PORT[,HOST:PORT…]"))?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoints = Vec::new();
        for host in hosts.split(',') {
            let port = host.rsplit_once(':').map(|(h, p)| (h, p.parse::<u16>()));
            match port {
                Some((h, Ok(p))) if !h.is_empty() && p != 0 && !h.contains('/') => endpoints.push(format!("{scheme}://{host}")),
                _ => return Err(format!("--store {url:?}: {host:?} is not HOST:PORT")),
            }
        }
        if !prefix.starts_with('/') || prefix.ends_with('/') || prefix.len() < 2 {
            return Err(format!("--etcd-prefix {prefix:?}: must start with / and not end with one (as /keelson)"));
        }
        Ok(EtcdOptions { endpoints, tls, prefix: prefix.to_owned(), compact_every: Some(DEFAULT_COMPACT_EVERY) })
    }
}

pub struct EtcdStore {
    writer: Writer,
    /// Transactions waiting for the batcher (`batch_writes`) that leave first
    /// (`Store::txn_urgent`)…
    urgent: mpsc::UnboundedSender<Vec<Pending>>,
    /// …then the others…
    queue: mpsc::UnboundedSender<Vec<Pending>>,
    /// …and those that leave after them (`Store::txn_yielding`).
    yielding: mpsc::UnboundedSender<Pending>,
    reads: Reads,
    stop: CancellationToken,
}

/// What sends transactions to etcd and waits for the mirror to show them.
#[derive(Clone)]
struct Writer {
    client: Client,
    /// `prefix`: store keys are appended to it.
    prefix: String,
    mirror: Arc<Mirror>,
    /// Asks the mirror's watch to have etcd report its progress.
    progress: mpsc::Sender<()>,
}

/// A transaction's compares, writes, and reads of the keys it writes.
type TxnParts = (Vec<Compare>, Vec<TxnOp>, Vec<TxnOp>);

/// A transaction waiting to be sent, and where its answer goes.
struct Pending {
    ops: Vec<Op>,
    done: oneshot::Sender<Result<u64, StoreError>>,
    /// When its caller asked for it.
    asked: Instant,
}

impl Pending {
    fn new(ops: Vec<Op>) -> Result<(Pending, oneshot::Receiver<Result<u64, StoreError>>), StoreError> {
        let mut seen = HashSet::new();
        if let Some(op) = ops.iter().find(|op| !seen.insert(op.key())) {
            // etcd refuses a transaction that writes one key twice.
            return Err(StoreError::Backend(format!("{} is written twice in one transaction", op.key())));
        }
        let (done, answer) = oneshot::channel();
        Ok((Pending { ops, done, asked: Instant::now() }, answer))
    }
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("prefix", &self.writer.prefix)
            .field("revision", &self.writer.mirror.revision())
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdStore {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("etcd: {e}"))
}

fn revision_of(r: i64) -> u64 {
    u64::try_from(r).unwrap_or(0)
}

impl EtcdStore {
    /// Connects, reads everything under the prefix and starts following it.
    pub async fn open(options: &EtcdOptions) -> Result<Self, StoreError> {
        let mut connect = ConnectOptions::new()
            .with_connect_timeout(DIAL_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5))
            // A member cut off from the others ends our watch instead of going silent.
            .with_require_leader(true);
        if let Some(files) = &options.tls {
            let read = |p: &PathBuf| std::fs::read(p).map_err(|e| StoreError::Backend(format!("reading {}: {e}", p.display())));
            let tls = TlsOptions::new()
                .ca_certificate(Certificate::from_pem(read(&files.ca)?))
                .identity(Identity::from_pem(read(&files.cert)?, read(&files.key)?));
            connect = connect.with_tls(tls);
        }
        let client = Client::connect(&options.endpoints, Some(connect)).await.map_err(backend)?;
        let prefix = options.prefix.clone();
        let (entries, revision) = list_all(&client, &prefix).await?;
        let mirror = Arc::new(Mirror::new(entries, revision));
        let (progress, progress_requests) = mpsc::channel(1);
        let stop = CancellationToken::new();
        let follower = Follower { client: client.clone(), prefix: prefix.clone(), mirror: mirror.clone() };
        tokio::spawn(follower.run(progress_requests, stop.clone()));
        if let Some(every) = options.compact_every {
            tokio::spawn(compact_history(client.clone(), format!("{prefix}/"), every, stop.clone()));
        }
        let (read_queue, reads_queued) = mpsc::unbounded_channel();
        tokio::spawn(batch_reads(client.clone(), prefix.clone(), reads_queued, stop.clone()));
        let reads = Reads { client: client.clone(), prefix: prefix.clone(), queue: read_queue };
        let writer = Writer { client, prefix, mirror, progress };
        let (urgent, urgent_queued) = mpsc::unbounded_channel();
        let (queue, queued) = mpsc::unbounded_channel();
        let (yielding, gathering) = mpsc::unbounded_channel();
        let (gathered, yielded) = mpsc::unbounded_channel();
        tokio::spawn(gather(gathering, gathered, stop.clone()));
        tokio::spawn(batch_writes(writer.clone(), [urgent_queued, queued, yielded], stop.clone()));
        Ok(EtcdStore { writer, urgent, queue, yielding, reads, stop })
    }

    /// The client, for the leader election of the replicas sharing this store.
    pub fn client(&self) -> Client {
        self.writer.client.clone()
    }

    /// The etcd prefix of every store key.
    pub fn prefix(&self) -> &str {
        &self.writer.prefix
    }
}

impl Writer {
    fn etcd_key(&self, key: &str) -> Result<String, StoreError> {
        if !key.starts_with('/') {
            return Err(StoreError::Backend(format!("store key {key:?} does not start with /")));
        }
        Ok(format!("{}{key}", self.prefix))
    }

    /// Sends `txn` (`again`); says whether it was sent more than once.
    async fn send(&self, txn: Txn) -> Result<(etcd_client::TxnResponse, bool), StoreError> {
        let client = &self.client;
        again("transaction", || {
            let txn = txn.clone();
            async move { kv(client).txn(txn).await }
        })
        .await
        .map_err(refused)
    }

    /// `ops` as the parts of an etcd transaction: the compares of their preconditions, their
    /// writes, and reads of their keys.
    fn parts<'a>(&self, ops: impl IntoIterator<Item = &'a Op>) -> Result<TxnParts, StoreError> {
        let (mut compares, mut writes, mut reads) = (Vec::new(), Vec::new(), Vec::new());
        for op in ops {
            let etcd_key = self.etcd_key(op.key())?;
            compares.extend(compare(&etcd_key, op.precondition()));
            reads.push(TxnOp::get(etcd_key.clone(), None));
            match op {
                Op::Put { value, .. } => writes.push(TxnOp::put(etcd_key, value.clone(), None)),
                Op::Delete { .. } => writes.push(TxnOp::delete(etcd_key, None)),
                Op::Check { .. } => {}
            }
        }
        Ok((compares, writes, reads))
    }

    /// Sends one transaction. `retried_before`: an earlier request carrying these writes may
    /// have been applied (then a refusal is checked against what etcd holds). Returns the
    /// answer and the revision the mirror must reach before it is given.
    async fn commit(&self, ops: &[Op], retried_before: bool) -> (Result<u64, StoreError>, u64) {
        let txn = match self.parts(ops) {
            // When refused, the transaction reads every key it would have written instead.
            Ok((compares, writes, reads)) => Txn::new().when(compares).and_then(writes).or_else(reads),
            Err(e) => return (Err(e), 0),
        };
        let (response, retried) = match self.send(txn).await {
            Ok((response, retried)) => (response, retried || retried_before),
            Err(e) => return (Err(e), 0),
        };
        let revision = revision_of(response.header().map_or(0, |h| h.revision()));
        if response.succeeded() {
            return (Ok(revision), revision);
        }
        let found: Vec<Option<KeyValue>> = response
            .op_responses()
            .into_iter()
            .map(|read| match read {
                TxnOpResponse::Get(get) => get.kvs().first().cloned(),
                _ => None,
            })
            .collect();
        // A try that etcd may have applied before its answer was lost leaves exactly what
        // this transaction writes: then the retry's refusal is that try's success.
        if retried && let Some(applied_at) = applied(ops, &found) {
            return (Ok(applied_at), applied_at);
        }
        // Refused: say which precondition failed, from what etcd read in the same transaction.
        let failed = ops.iter().zip(&found).find_map(|(op, kv)| {
            let found = kv.as_ref().map(|kv| revision_of(kv.mod_revision()));
            let expected = op.precondition();
            (!expected.holds(found)).then(|| StoreError::Conflict { key: op.key().to_owned(), expected, found })
        });
        (Err(failed.unwrap_or_else(|| StoreError::Backend("etcd refused the transaction but every precondition holds".into()))), revision)
    }

    /// `commit`, then the wait for the mirror (`permit` no longer held), then the answer.
    async fn commit_and_answer(&self, pending: Pending, retried_before: bool, permit: Option<OwnedSemaphorePermit>) {
        let (result, revision) = self.commit(&pending.ops, retried_before).await;
        drop(permit);
        self.catch_up(revision).await;
        // A caller that gave up waiting is not an error.
        let _ = pending.done.send(result);
    }

    /// Several callers' transactions, on distinct keys, as one etcd transaction: when every
    /// precondition holds, all commit at one revision. When one fails, each is sent again on
    /// its own, so that only the ones whose preconditions fail are refused.
    async fn commit_batch(&self, batch: Vec<Pending>, permit: OwnedSemaphorePermit) {
        let sent = match self.parts(batch.iter().flat_map(|p| &p.ops)) {
            Ok((compares, writes, _)) => self.send(Txn::new().when(compares).and_then(writes)).await,
            Err(e) => Err(e),
        };
        drop(permit);
        match sent {
            Ok((response, _)) if response.succeeded() => {
                let revision = revision_of(response.header().map_or(0, |h| h.revision()));
                self.catch_up(revision).await;
                for pending in batch {
                    let _ = pending.done.send(Ok(revision));
                }
            }
            Ok((_, retried)) => {
                futures_util::future::join_all(batch.into_iter().map(|p| self.commit_and_answer(p, retried, None))).await;
            }
            Err(e) => {
                for pending in batch {
                    let _ = pending.done.send(Err(e.clone()));
                }
            }
        }
    }

    /// Waits until this replica's mirror holds `revision`.
    async fn catch_up(&self, revision: u64) {
        if self.mirror.caught_up(revision, MIRROR_QUICK_WAIT).await {
            return;
        }
        // The revision may belong to a write outside the prefix: only a progress report
        // moves the mirror there. A request already queued does as well.
        let _ = self.progress.try_send(());
        if !self.mirror.caught_up(revision, MIRROR_WAIT).await {
            tracing::warn!(revision, seen = self.mirror.revision(), "the etcd watch has not caught up with a write; reads may trail it");
        }
    }
}

/// How many transactions (single or batched) one replica has in flight to etcd at once.
/// While they are, new ones queue and leave together.
const WRITES_IN_FLIGHT: usize = 4;
/// The most writes in one batch (etcd's `--max-txn-ops` is 128 by default)…
const BATCH_MAX_OPS: usize = 100;
/// …and the most bytes of values (its `--max-request-bytes` is 1.5 MiB).
const BATCH_MAX_BYTES: usize = 512 << 10;

/// How long a yielding write waits at most while others keep leaving first: writes that
/// never stop (an operator's script, say) must not starve agents' reports.
const YIELD_AT_MOST: Duration = Duration::from_millis(500);

/// Which waiting transactions leave next: the first non-empty queue's (urgent, others,
/// yielding), unless the yielding queue's oldest has waited for `YIELD_AT_MOST`. The middle
/// queue has no such bound: urgent writes are a rollout pass's, a bounded burst that
/// machines wait for, while agents' lease requests may queue for longer than 500 ms.
fn next_to_leave(waiting: &mut [VecDeque<Pending>; 3], now: Instant) -> Option<&mut VecDeque<Pending>> {
    let overdue = waiting[2].front().is_some_and(|p| now.duration_since(p.asked) >= YIELD_AT_MOST);
    let next = if overdue { 2 } else { waiting.iter().position(|w| !w.is_empty())? };
    Some(&mut waiting[next])
}

/// Sends queued transactions, gathering those that waited together into one etcd
/// transaction when their keys are distinct. `queues`: urgent, others, yielding, in the
/// order they leave (`next_to_leave`).
async fn batch_writes(writer: Writer, mut queues: [mpsc::UnboundedReceiver<Vec<Pending>>; 3], stop: CancellationToken) {
    let permits = Arc::new(Semaphore::new(WRITES_IN_FLIGHT));
    let mut waiting: [VecDeque<Pending>; 3] = Default::default();
    loop {
        if waiting.iter().all(VecDeque::is_empty) {
            let [urgent, others, yielding] = &mut queues;
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                Some(group) = urgent.recv() => waiting[0].extend(group),
                Some(group) = others.recv() => waiting[1].extend(group),
                Some(group) = yielding.recv() => waiting[2].extend(group),
                else => return,
            }
        }
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        for (queue, waiting) in queues.iter_mut().zip(&mut waiting) {
            while let Ok(group) = queue.try_recv() {
                waiting.extend(group);
            }
        }
        let Some(waiting) = next_to_leave(&mut waiting, Instant::now()) else { continue };
        let size = |p: &Pending| p.ops.iter().map(|op| if let Op::Put { value, .. } = op { value.len() } else { 0 }).sum::<usize>();
        let (mut keys, mut ops, mut bytes) = (HashSet::new(), 0, 0);
        let mut batch = Vec::new();
        while let Some(next) = waiting.front() {
            let fits = batch.is_empty() || (ops + next.ops.len() <= BATCH_MAX_OPS && bytes + size(next) <= BATCH_MAX_BYTES);
            if !fits || next.ops.iter().any(|op| keys.contains(op.key())) {
                break;
            }
            keys.extend(next.ops.iter().map(|op| op.key().to_owned()));
            ops += next.ops.len();
            bytes += size(next);
            batch.extend(waiting.pop_front());
        }
        let writer = writer.clone();
        tokio::spawn(async move {
            if batch.len() == 1 {
                writer.commit_and_answer(batch.remove(0), false, Some(permit)).await;
            } else {
                writer.commit_batch(batch, permit).await;
            }
        });
    }
}

/// How long a yielding write (`Store::txn_yielding`) waits for others to leave with. The
/// few in flight leave room for only a few heartbeats each otherwise: a 10,000-machine
/// fleet's 1,000 a second were about 600 raft rounds a second, and are about 75 with this.
const GATHER_FOR: Duration = Duration::from_millis(10);

/// Holds transactions for up to `GATHER_FOR` after the first of them, or until they fill a
/// batch, and queues them as one group.
async fn gather(mut gathering: mpsc::UnboundedReceiver<Pending>, queue: mpsc::UnboundedSender<Vec<Pending>>, stop: CancellationToken) {
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => return,
            next = gathering.recv() => match next {
                Some(p) => p,
                None => return,
            },
        };
        let until = Instant::now() + GATHER_FOR;
        let mut ops = first.ops.len();
        let mut group = vec![first];
        while ops < BATCH_MAX_OPS {
            match tokio::time::timeout_at(until, gathering.recv()).await {
                Ok(Some(p)) => {
                    ops += p.ops.len();
                    group.push(p);
                }
                Ok(None) | Err(_) => break,
            }
        }
        if queue.send(group).is_err() {
            return;
        }
    }
}

/// Whether etcd holds exactly what `ops` write (`found`: each op's key as read), and at
/// which revision.
fn applied(ops: &[Op], found: &[Option<KeyValue>]) -> Option<u64> {
    let mut at = None;
    for (op, kv) in ops.iter().zip(found) {
        match (op, kv) {
            (Op::Put { value, .. }, Some(kv)) if kv.value() == value.as_slice() => {
                at = at.max(Some(revision_of(kv.mod_revision())));
            }
            (Op::Delete { .. }, None) => {}
            // What a check compared may have changed since the try that was applied.
            (Op::Check { .. }, _) => {}
            _ => return None,
        }
    }
    at
}

/// Whether a request may be sent again: it did not reach a member that could answer (a
/// member gone, no leader, a timeout), or the member turned it away because it is behind
/// applying what it committed ("too many requests", before proposing anything). Whether a
/// first try was applied is then unknown to the caller, which checks.
fn retryable(e: &etcd_client::Error) -> bool {
    use tonic::Code;
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(status) => match status.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled => true,
            // etcd 3.4 sends its overload refusal as Unknown, later releases as
            // ResourceExhausted.
            Code::Unknown | Code::ResourceExhausted if status.message().contains("too many requests") => true,
            Code::Unknown => status.message().contains("transport error"),
            _ => false,
        },
        _ => false,
    }
}

/// Sends a request, and again on a transport failure, a member without a leader or an
/// overloaded one (`retryable`), for up to `REQUEST_RETRY_FOR`; gives the answer and whether
/// the request was sent more than once. Reads and writes alike: a read that fails during an
/// election would otherwise fail the agent's request or the rollout pass that made it.
async fn again<T, Request, Answer>(what: &str, mut request: Request) -> Result<(T, bool), etcd_client::Error>
where
    Request: FnMut() -> Answer,
    Answer: Future<Output = Result<T, etcd_client::Error>>,
{
    let deadline = Instant::now() + REQUEST_RETRY_FOR;
    let mut retried = false;
    loop {
        match request().await {
            Ok(answer) => return Ok((answer, retried)),
            Err(e) if retryable(&e) && Instant::now() < deadline => {
                tracing::debug!(error = %e, "etcd {what} failed; sending it again");
                retried = true;
                tokio::time::sleep(RETRY_DELAY).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// What a failed request means for its caller: a request that could not get through in
/// time, or a cluster out of space, is worth trying later (503); anything else is a fault.
fn refused(e: etcd_client::Error) -> StoreError {
    if retryable(&e) {
        return StoreError::Unavailable(format!("etcd: {e}"));
    }
    match &e {
        etcd_client::Error::GRpcStatus(status) if status.message().contains("database space exceeded") => StoreError::Unavailable(format!(
            "etcd is out of space (alarm NOSPACE) and takes no writes until its history is compacted, its members defragmented and the alarm disarmed: {e}"
        )),
        _ => backend(e),
    }
}

/// Every `every`, compacts etcd's history up to the revision that was the newest one `every`
/// before, so the history kept spans one to two intervals. Compaction is cluster-wide and
/// idempotent: every replica runs this, and one that finds the revision already compacted
/// (by another replica, etcd's own retention or kube-apiserver) has nothing to do. A watch
/// cut off longer than that lists again (`Follower`).
async fn compact_history(client: Client, probe: String, every: Duration, stop: CancellationToken) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut newest_before: Option<i64> = None;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let newest = match client.kv_client().get(probe.as_str(), Some(GetOptions::new().with_count_only())).await {
            Ok(r) => r.header().map(|h| h.revision()),
            Err(e) => {
                tracing::warn!(error = %e, "etcd history: could not read the newest revision; compacting later");
                continue;
            }
        };
        if let Some(revision) = newest_before.filter(|r| *r > 0) {
            match client.kv_client().compact(revision, None).await {
                Ok(_) => tracing::info!(revision, "etcd history compacted"),
                Err(e) if e.to_string().contains("required revision has been compacted") => {
                    tracing::debug!(revision, "etcd history already compacted past this revision");
                }
                Err(e) => tracing::warn!(revision, error = %e, "etcd history: compaction failed"),
            }
        }
        newest_before = newest;
    }
}

/// The KV service, taking answers of up to `MAX_ANSWER_BYTES`.
fn kv(client: &Client) -> KvClient {
    client.kv_client().max_decoding_message_size(MAX_ANSWER_BYTES)
}

/// Everything under `prefix` and the revision it was read at: a page at a time, every page at
/// the revision of the first, and without the values the mirror does not hold.
async fn list_all(client: &Client, prefix: &str) -> Result<(BTreeMap<String, Entry>, u64), StoreError> {
    let not_held = VALUES_NOT_IN_MEMORY;
    let (mut entries, revision) = list_range(client, prefix, "/", not_held, Read::Values, 0).await?;
    entries.extend(list_range(client, prefix, not_held, &prefix_end(not_held), Read::KeysOnly, revision).await?.0);
    entries.extend(list_range(client, prefix, &prefix_end(not_held), &prefix_end("/"), Read::Values, revision).await?.0);
    Ok((entries.into_iter().map(|e| (e.key.clone(), e)).collect(), revision))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Read {
    Values,
    KeysOnly,
}

/// The store keys from `from` up to (not including) `end`, in key order, at `revision` (0: the
/// newest), a page at a time; and the revision read at.
async fn list_range(
    client: &Client,
    prefix: &str,
    from: &str,
    end: &str,
    read: Read,
    revision: u64,
) -> Result<(Vec<Entry>, u64), StoreError> {
    let end = format!("{prefix}{end}");
    let mut from = format!("{prefix}{from}");
    let mut revision = revision;
    let mut entries = Vec::new();
    loop {
        let mut options = GetOptions::new().with_range(end.as_str()).with_limit(LIST_PAGE_KEYS);
        if revision > 0 {
            options = options.with_revision(i64::try_from(revision).unwrap_or(i64::MAX));
        }
        if read == Read::KeysOnly {
            options = options.with_keys_only();
        }
        let key = from.as_str();
        let (response, _) = again("listing", || {
            let options = options.clone();
            async move { kv(client).get(key, Some(options)).await }
        })
        .await
        .map_err(refused)?;
        if revision == 0 {
            revision = revision_of(response.header().map_or(0, |h| h.revision()));
        }
        for kv in response.kvs() {
            entries.push(entry(prefix, kv)?);
        }
        match response.kvs().last() {
            Some(last) if response.more() => {
                // The next page starts just after the last key of this one.
                from = format!("{}\0", last.key_str().map_err(backend)?);
            }
            _ => return Ok((entries, revision)),
        }
    }
}

/// Reads of the values the mirror does not hold, from etcd itself.
#[derive(Clone)]
struct Reads {
    client: Client,
    prefix: String,
    /// Reads of keys waiting for `batch_reads`.
    queue: mpsc::UnboundedSender<PendingRead>,
}

impl std::fmt::Debug for Reads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reads").field("prefix", &self.prefix).finish()
    }
}

/// Up to `READS_PER_TXN` keys to read from etcd, and where their entries go, in order.
struct PendingRead {
    keys: Vec<String>,
    answer: oneshot::Sender<Result<Vec<Option<Entry>>, StoreError>>,
}

/// Sends queued reads, gathering those that waited together into one etcd transaction of up
/// to `READS_PER_TXN` gets, with `READ_TXNS_IN_PARALLEL` in flight. When a wave of machines
/// asks for leases at once, each grant and release reads the machine's newest event segment:
/// thousands of single reads, which would otherwise each be a request to etcd.
async fn batch_reads(client: Client, prefix: String, mut queue: mpsc::UnboundedReceiver<PendingRead>, stop: CancellationToken) {
    let permits = Arc::new(Semaphore::new(READ_TXNS_IN_PARALLEL));
    let mut held_over = None;
    loop {
        let first = match held_over.take() {
            Some(first) => first,
            None => tokio::select! {
                _ = stop.cancelled() => return,
                next = queue.recv() => match next {
                    Some(read) => read,
                    None => return,
                },
            },
        };
        // Reads that arrive while every permit is taken wait here, and leave together.
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => return,
            },
        };
        let mut keys = first.keys.len();
        let mut batch = vec![first];
        while let Ok(next) = queue.try_recv() {
            if keys + next.keys.len() > READS_PER_TXN {
                held_over = Some(next);
                break;
            }
            keys += next.keys.len();
            batch.push(next);
        }
        let (client, prefix) = (client.clone(), prefix.clone());
        tokio::spawn(async move {
            let keys: Vec<&String> = batch.iter().flat_map(|r| &r.keys).collect();
            let mut read = read_txn(&client, &prefix, &keys).await;
            drop(permit);
            for pending in batch {
                let answer = match &mut read {
                    Ok(entries) => Ok(entries.drain(..pending.keys.len()).collect()),
                    Err(e) => Err(e.clone()),
                };
                // A caller that stopped waiting has nothing to be told.
                let _ = pending.answer.send(answer);
            }
        });
    }
}

/// Reads `keys` in one etcd transaction: one round trip, at one revision.
async fn read_txn(client: &Client, prefix: &str, keys: &[&String]) -> Result<Vec<Option<Entry>>, StoreError> {
    let gets: Vec<TxnOp> = keys.iter().map(|k| TxnOp::get(format!("{prefix}{k}"), None)).collect();
    let (response, _) = again("read", || {
        let gets = gets.clone();
        async move { kv(client).txn(Txn::new().and_then(gets)).await }
    })
    .await
    .map_err(refused)?;
    let answers = response.op_responses();
    // Each caller takes its share of the answers by count (`batch_reads`).
    if answers.len() != keys.len() {
        return Err(backend(format!("answered {} reads for {} keys", answers.len(), keys.len())));
    }
    answers
        .into_iter()
        .map(|r| match r {
            TxnOpResponse::Get(got) => got.kvs().first().map(|kv| entry(prefix, kv)).transpose(),
            _ => Err(backend("a read in etcd answered as a write")),
        })
        .collect()
}

#[async_trait]
impl Backend for Reads {
    async fn read_keys(&self, keys: Vec<String>) -> Result<Vec<Option<Entry>>, StoreError> {
        let mut answers = Vec::new();
        for chunk in keys.chunks(READS_PER_TXN) {
            let (answer, answered) = oneshot::channel();
            self.queue.send(PendingRead { keys: chunk.to_vec(), answer }).map_err(|_| StoreError::Closed)?;
            answers.push(answered);
        }
        let mut found = Vec::with_capacity(keys.len());
        for answered in answers {
            found.extend(answered.await.map_err(|_| StoreError::Closed)??);
        }
        Ok(found)
    }

    async fn read_prefix(&self, prefix: &str) -> Result<Listing, StoreError> {
        let (entries, revision) = list_range(&self.client, &self.prefix, prefix, &prefix_end(prefix), Read::Values, 0).await?;
        Ok(Listing { entries, revision })
    }
}

fn entry(prefix: &str, kv: &KeyValue) -> Result<Entry, StoreError> {
    let key = kv.key_str().map_err(backend)?;
    let key = key.strip_prefix(prefix).ok_or_else(|| StoreError::Backend(format!("etcd key {key:?} is not under {prefix}")))?;
    Ok(Entry {
        key: key.to_owned(),
        value: Arc::from(kv.value()),
        create_revision: revision_of(kv.create_revision()),
        mod_revision: revision_of(kv.mod_revision()),
    })
}

fn compare(etcd_key: &str, precondition: Precondition) -> Option<Compare> {
    match precondition {
        Precondition::None => None,
        Precondition::Absent => Some(Compare::create_revision(etcd_key, CompareOp::Equal, 0)),
        Precondition::Exists => Some(Compare::create_revision(etcd_key, CompareOp::Greater, 0)),
        Precondition::Revision(r) => Some(Compare::mod_revision(etcd_key, CompareOp::Equal, i64::try_from(r).unwrap_or(i64::MAX))),
    }
}

#[async_trait]
impl Store for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<Entry>, StoreError> {
        self.writer.mirror.get_through(key, &self.reads).await
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Entry>>, StoreError> {
        self.writer.mirror.get_many_through(keys, &self.reads).await
    }

    async fn list(&self, prefix: &str) -> Result<Listing, StoreError> {
        self.writer.mirror.list_through(prefix, &self.reads).await
    }

    fn list_keys(&self, prefix: &str) -> Listing {
        self.writer.mirror.list_keys(prefix)
    }

    async fn txn(&self, ops: Vec<Op>) -> Result<u64, StoreError> {
        let (pending, answer) = Pending::new(ops)?;
        self.queue.send(vec![pending]).map_err(|_| StoreError::Closed)?;
        answer.await.map_err(|_| StoreError::Closed)?
    }

    async fn txn_urgent(&self, ops: Vec<Op>) -> Result<u64, StoreError> {
        let (pending, answer) = Pending::new(ops)?;
        self.urgent.send(vec![pending]).map_err(|_| StoreError::Closed)?;
        answer.await.map_err(|_| StoreError::Closed)?
    }

    async fn txn_yielding(&self, ops: Vec<Op>) -> Result<u64, StoreError> {
        let (pending, answer) = Pending::new(ops)?;
        self.yielding.send(pending).map_err(|_| StoreError::Closed)?;
        answer.await.map_err(|_| StoreError::Closed)?
    }

    async fn watch(&self, prefix: &str, after: u64) -> Result<Watch, StoreError> {
        self.writer.mirror.watch(prefix, after)
    }

    fn revision(&self) -> u64 {
        self.writer.mirror.revision()
    }

    fn since(&self, prefix: &str, after: Option<u64>) -> Since {
        self.writer.mirror.since(prefix, after)
    }
}

/// Keeps the mirror up to date with one etcd watch on the prefix, opened again from the
/// mirror's revision whenever it breaks.
struct Follower {
    client: Client,
    prefix: String,
    mirror: Arc<Mirror>,
}

/// Why a watch ended.
enum Ended {
    Stopped,
    /// etcd no longer has the revisions after ours: list again.
    Compacted,
    Broken(String),
}

impl Follower {
    async fn run(self, mut progress: mpsc::Receiver<()>, stop: CancellationToken) {
        loop {
            match self.follow(&mut progress, &stop).await {
                Ended::Stopped => return,
                Ended::Compacted => {
                    if let Err(e) = self.relist().await {
                        tracing::warn!(error = %e, "listing the etcd store again failed");
                    }
                }
                Ended::Broken(e) => tracing::warn!(error = %e, revision = self.mirror.revision(), "the etcd watch broke; opening it again"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(REWATCH_DELAY) => {}
            }
        }
    }

    async fn follow(&self, progress: &mut mpsc::Receiver<()>, stop: &CancellationToken) -> Ended {
        let from = self.mirror.revision() + 1;
        let options = WatchOptions::new().with_prefix().with_start_revision(i64::try_from(from).unwrap_or(i64::MAX));
        let mut stream = match self
            .client
            .watch_client()
            .max_decoding_message_size(MAX_ANSWER_BYTES)
            .watch(format!("{}/", self.prefix), Some(options))
            .await
        {
            Ok(s) => s,
            Err(e) => return Ended::Broken(e.to_string()),
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => return Ended::Stopped,
                Some(()) = progress.recv() => {
                    if let Err(e) = stream.request_progress().await {
                        return Ended::Broken(e.to_string());
                    }
                }
                message = stream.message() => match message {
                    Ok(Some(response)) => {
                        if response.compact_revision() > 0 {
                            return Ended::Compacted;
                        }
                        if response.canceled() {
                            return Ended::Broken(format!("etcd cancelled the watch: {}", response.cancel_reason()));
                        }
                        if let Err(e) = self.apply(&response) {
                            return Ended::Broken(e.to_string());
                        }
                    }
                    Ok(None) => return Ended::Broken("the watch stream ended".into()),
                    Err(e) => return Ended::Broken(e.to_string()),
                },
            }
        }
    }

    fn apply(&self, response: &WatchResponse) -> Result<(), StoreError> {
        let events = response.events();
        if events.is_empty() {
            // A progress report: every change up to its revision has been delivered.
            if !response.created()
                && let Some(header) = response.header()
            {
                self.mirror.publish([], revision_of(header.revision()));
            }
            return Ok(());
        }
        let mut changes = Vec::with_capacity(events.len());
        let mut revision = 0;
        for event in events {
            let kv = event.kv().ok_or_else(|| backend("a watch event without a key"))?;
            let change = match event.event_type() {
                EventType::Put => Change { deleted: false, entry: entry(&self.prefix, kv)? },
                EventType::Delete => {
                    // The value deleted is the mirror's, or an earlier put in this response:
                    // the mirror holds every change before the watch's start, so the watch
                    // does not ask etcd for previous values (a read in etcd for every event).
                    let key = entry(&self.prefix, kv)?.key;
                    let mut before = changes
                        .iter()
                        .rev()
                        .find(|c: &&Change| c.entry.key == key)
                        .map(|c| c.entry.clone())
                        .or_else(|| self.mirror.get(&key))
                        .unwrap_or(Entry { key, value: Arc::from(&[][..]), create_revision: 0, mod_revision: 0 });
                    before.mod_revision = revision_of(kv.mod_revision());
                    Change { deleted: true, entry: before }
                }
            };
            revision = revision.max(change.entry.mod_revision);
            changes.push(change);
        }
        self.mirror.publish(changes, revision);
        Ok(())
    }

    /// After a compaction took the revisions the watch needed: the differences between the
    /// mirror and a fresh listing become changes, so watchers still see every key's end state
    /// (without the values the mirror does not hold, which the listing leaves out).
    async fn relist(&self) -> Result<(), StoreError> {
        let (entries, revision) = list_all(&self.client, &self.prefix).await?;
        let mut changes = Vec::new();
        {
            let state = self.mirror.read();
            for (key, old) in &state.entries {
                if !entries.contains_key(key) {
                    changes.push(Change { deleted: true, entry: Entry { mod_revision: revision, ..old.clone() } });
                }
            }
            for (key, new) in &entries {
                if state.entries.get(key) != Some(new) {
                    changes.push(Change { deleted: false, entry: new.clone() });
                }
            }
        }
        changes.sort_by_key(|c| c.entry.mod_revision);
        self.mirror.publish(changes, revision);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tonic::{Code, Status};

    use std::collections::VecDeque;

    use tokio::time::Instant;

    use super::{Op, Pending, Precondition, StoreError, YIELD_AT_MOST, next_to_leave, refused, retryable};

    fn status(code: Code, message: &str) -> etcd_client::Error {
        etcd_client::Error::GRpcStatus(Status::new(code, message))
    }

    #[test]
    fn an_overloaded_member_is_asked_again_and_a_refusal_is_not() {
        assert!(retryable(&status(Code::Unknown, "etcdserver: too many requests")));
        assert!(retryable(&status(Code::ResourceExhausted, "etcdserver: too many requests")));
        assert!(retryable(&status(Code::Unavailable, "etcdserver: no leader")));
        // Answers that sending again cannot change.
        assert!(!retryable(&status(Code::InvalidArgument, "etcdserver: duplicate key given in txn request")));
        assert!(!retryable(&status(Code::ResourceExhausted, "etcdserver: mvcc: database space exceeded")));
        assert!(!retryable(&status(Code::Unknown, "etcdserver: request is too large")));
    }

    #[test]
    fn a_full_or_unreachable_cluster_is_unavailable_and_a_bad_request_is_a_fault() {
        let unavailable = |e| matches!(refused(e), StoreError::Unavailable(_));
        assert!(unavailable(status(Code::ResourceExhausted, "etcdserver: mvcc: database space exceeded")));
        assert!(unavailable(status(Code::Unavailable, "etcdserver: no leader")));
        assert!(unavailable(status(Code::Unknown, "etcdserver: too many requests")));
        assert!(matches!(refused(status(Code::InvalidArgument, "etcdserver: duplicate key given in txn request")), StoreError::Backend(_)));
    }

    fn waiting(key: &str, asked: Instant) -> VecDeque<Pending> {
        let (mut pending, _) =
            Pending::new(vec![Op::Check { key: key.into(), precondition: Precondition::None }]).expect("one op on one key");
        pending.asked = asked;
        VecDeque::from([pending])
    }

    fn leaves(waiting: &mut [VecDeque<Pending>; 3], now: Instant) -> Option<String> {
        next_to_leave(waiting, now).and_then(|w| w.front()).map(|p| p.ops[0].key().to_owned())
    }

    #[test]
    fn a_yielding_write_leaves_after_the_others_unless_it_waited_too_long() {
        let now = Instant::now() + 2 * YIELD_AT_MOST;
        let mut both = [VecDeque::new(), waiting("/first", now), waiting("/report", now - YIELD_AT_MOST / 2)];
        assert_eq!(leaves(&mut both, now).as_deref(), Some("/first"));
        let mut overdue = [waiting("/pass", now), waiting("/first", now), waiting("/report", now - YIELD_AT_MOST)];
        assert_eq!(leaves(&mut overdue, now).as_deref(), Some("/report"));
        let mut alone = [VecDeque::new(), VecDeque::new(), waiting("/report", now)];
        assert_eq!(leaves(&mut alone, now).as_deref(), Some("/report"));
        assert!(leaves(&mut Default::default(), now).is_none());
    }

    #[test]
    fn an_urgent_write_leaves_before_the_others_however_long_they_waited() {
        let now = Instant::now() + 2 * YIELD_AT_MOST;
        let long_ago = now - 2 * YIELD_AT_MOST;
        let mut all = [waiting("/pass", now), waiting("/lease", long_ago), waiting("/report", now)];
        assert_eq!(leaves(&mut all, now).as_deref(), Some("/pass"));
        let mut no_urgent = [VecDeque::new(), waiting("/lease", long_ago), waiting("/report", now)];
        assert_eq!(leaves(&mut no_urgent, now).as_deref(), Some("/lease"));
    }
}
