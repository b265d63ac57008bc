//! The controller's `Store` contract, checked the same way on both stores: SQLite in a
//! temporary directory and etcd (Debian's 3.4.23, members of the test's own on loopback).
//! Over TLS, etcd takes only a client certificate of its CA.
//! Then what only several replicas on one etcd show: compare-and-swap across replicas loses
//! no update, each replica's watch sees the others' writes, and a dead member changes nothing.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use keelson_controller::store::etcd::{DEFAULT_PREFIX, EtcdOptions, EtcdStore};
use keelson_controller::store::sqlite::SqliteStore;
use keelson_controller::store::{Op, Precondition, Store, StoreError, StoreExt};
use keelson_tests::etcd::{self, EtcdMember};

type R = anyhow::Result<()>;

/// A store under test and what keeps it alive.
struct Subject {
    store: Arc<dyn Store>,
    _dir: tempfile::TempDir,
    _members: Vec<EtcdMember>,
}

async fn sqlite() -> anyhow::Result<Subject> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(&dir.path().join("keelson.db"))?;
    Ok(Subject { store: Arc::new(store), _dir: dir, _members: Vec::new() })
}

async fn open_etcd(members: &[EtcdMember], prefix: &str) -> anyhow::Result<EtcdStore> {
    let options = EtcdOptions::parse(&etcd::store_url(members), None, prefix).map_err(|e| anyhow!(e))?;
    Ok(EtcdStore::open(&options).await?)
}

async fn etcd_store() -> anyhow::Result<Subject> {
    let dir = tempfile::tempdir()?;
    let members = etcd::start_cluster(dir.path(), etcd::STORE_VERSION, 1);
    etcd::wait_serving(&members).await?;
    let store = open_etcd(&members, DEFAULT_PREFIX).await?;
    Ok(Subject { store: Arc::new(store), _dir: dir, _members: members })
}

async fn next_change(watch: &mut keelson_controller::store::Watch) -> anyhow::Result<keelson_controller::store::Change> {
    let change = tokio::time::timeout(Duration::from_secs(10), watch.next()).await.context("no change within 10 s")?;
    Ok(change.ok_or_else(|| anyhow!("the watch ended"))??)
}

async fn compare_and_swap_and_revisions(store: &dyn Store) -> R {
    let r1 = store.put("/a/1", b"one".to_vec(), Precondition::Absent).await?;
    assert!(matches!(
        store.put("/a/1", b"x".to_vec(), Precondition::Absent).await,
        Err(StoreError::Conflict { ref key, found: Some(f), .. }) if key == "/a/1" && f == r1
    ));
    let r2 = store.put("/a/1", b"two".to_vec(), Precondition::Revision(r1)).await?;
    assert!(r2 > r1, "{r2} after {r1}");
    assert!(matches!(
        store.put("/a/1", b"x".to_vec(), Precondition::Revision(r1)).await,
        Err(StoreError::Conflict { found: Some(f), .. }) if f == r2
    ));
    let e = store.get("/a/1").await?.context("/a/1 missing")?;
    assert_eq!((&e.value[..], e.create_revision, e.mod_revision), (&b"two"[..], r1, r2));
    // Lists go by prefix: /ab/ is not under /a/.
    let r3 = store.put("/ab/1", b"b".to_vec(), Precondition::None).await?;
    let listing = store.list("/a/").await?;
    assert_eq!(listing.entries.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["/a/1"]);
    assert!(listing.revision >= r3, "listing at {} after a write at {r3}", listing.revision);
    assert_eq!(store.revision(), listing.revision);
    // Exists and Absent on deletes.
    assert!(matches!(store.delete("/a/none", Precondition::Exists).await, Err(StoreError::Conflict { found: None, .. })));
    store.delete("/a/1", Precondition::Revision(r2)).await?;
    assert!(store.get("/a/1").await?.is_none());
    Ok(())
}

async fn a_failed_precondition_writes_nothing_of_the_transaction(store: &dyn Store) -> R {
    let before = store.put("/k", b"v".to_vec(), Precondition::None).await?;
    let result = store
        .txn(vec![
            Op::Put { key: "/new".into(), value: b"x".to_vec(), precondition: Precondition::Absent },
            Op::Put { key: "/k".into(), value: b"y".to_vec(), precondition: Precondition::Revision(before + 1000) },
        ])
        .await;
    assert!(matches!(result, Err(StoreError::Conflict { ref key, found: Some(f), .. }) if key == "/k" && f == before), "{result:?}");
    assert!(store.get("/new").await?.is_none());
    assert_eq!(store.get("/k").await?.map(|e| e.mod_revision), Some(before));
    // Several writes that pass commit at one revision.
    let at = store
        .txn(vec![
            Op::Put { key: "/t/1".into(), value: b"1".to_vec(), precondition: Precondition::Absent },
            Op::Put { key: "/t/2".into(), value: b"2".to_vec(), precondition: Precondition::Absent },
            Op::Delete { key: "/k".into(), precondition: Precondition::Revision(before) },
        ])
        .await?;
    let listing = store.list("/t/").await?;
    assert!(listing.entries.iter().all(|e| e.mod_revision == at), "{listing:?}");
    assert!(store.get("/k").await?.is_none());
    Ok(())
}

async fn a_check_guards_a_transaction_and_writes_nothing_itself(store: &dyn Store) -> R {
    let guard = store.put("/guard", b"g".to_vec(), Precondition::None).await?;
    let check = |precondition| Op::Check { key: "/guard".into(), precondition };
    let put = |key: &str| Op::Put { key: key.to_owned(), value: b"c".to_vec(), precondition: Precondition::None };
    // A check that fails refuses the whole transaction, naming the key it checked.
    for precondition in [Precondition::Revision(guard + 1000), Precondition::Absent] {
        let result = store.txn(vec![put("/checked/1"), check(precondition)]).await;
        assert!(matches!(result, Err(StoreError::Conflict { ref key, found: Some(f), .. }) if key == "/guard" && f == guard), "{result:?}");
    }
    assert!(store.get("/checked/1").await?.is_none());
    // One that holds lets it commit, and leaves the checked key as it was.
    let at = store.txn(vec![put("/checked/1"), check(Precondition::Revision(guard))]).await?;
    assert_eq!(store.get("/checked/1").await?.map(|e| e.mod_revision), Some(at));
    assert_eq!(store.get("/guard").await?.map(|e| e.mod_revision), Some(guard));
    // A check on a missing key.
    let result = store.txn(vec![put("/checked/2"), Op::Check { key: "/none".into(), precondition: Precondition::Exists }]).await;
    assert!(matches!(result, Err(StoreError::Conflict { found: None, .. })), "{result:?}");
    store.txn(vec![put("/checked/2"), Op::Check { key: "/none".into(), precondition: Precondition::Absent }]).await?;
    assert!(store.get("/none").await?.is_none());
    Ok(())
}

async fn concurrent_writers_to_one_key_serialise(store: Arc<dyn Store>) -> R {
    let rev = store.put("/counter", b"0".to_vec(), Precondition::None).await?;
    // 20 writers race with the same expected revision: exactly one wins.
    let mut tasks = Vec::new();
    for i in 0..20 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move { store.put("/counter", format!("{i}").into_bytes(), Precondition::Revision(rev)).await }));
    }
    let mut wins = 0;
    for t in tasks {
        match t.await? {
            Ok(_) => wins += 1,
            Err(StoreError::Conflict { .. }) => {}
            Err(e) => bail!("a racing writer failed otherwise: {e}"),
        }
    }
    assert_eq!(wins, 1);
    Ok(())
}

async fn concurrent_transactions_on_other_keys_commit_or_fail_each_on_its_own(store: Arc<dyn Store>) -> R {
    // 60 transactions at once, a quarter of them yielding and a quarter urgent (the etcd
    // store gathers waiting ones into one etcd transaction, on each of its three queues):
    // every third one's precondition fails, which must refuse it alone.
    let taken = store.put("/each/taken", b"x".to_vec(), Precondition::None).await?;
    let mut tasks = Vec::new();
    for i in 0..60 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let mut ops =
                vec![Op::Put { key: format!("/each/{i}"), value: format!("{i}").into_bytes(), precondition: Precondition::Absent }];
            if i % 3 == 0 {
                ops.push(Op::Check { key: "/each/taken".into(), precondition: Precondition::Revision(taken + 1000) });
            }
            match i % 4 {
                1 => store.txn_yielding(ops).await,
                2 => store.txn_urgent(ops).await,
                _ => store.txn(ops).await,
            }
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let result = task.await?;
        let stored = store.get(&format!("/each/{i}")).await?;
        if i % 3 == 0 {
            assert!(matches!(result, Err(StoreError::Conflict { ref key, .. }) if key == "/each/taken"), "{i}: {result:?}");
            assert!(stored.is_none(), "{i} was written though refused");
        } else {
            let at = result.with_context(|| format!("{i}"))?;
            assert_eq!(stored.map(|e| e.mod_revision), Some(at), "{i}: read after its write");
        }
    }
    Ok(())
}

async fn watch_replays_then_follows(store: &dyn Store) -> R {
    store.put("/m/a", b"1".to_vec(), Precondition::None).await?;
    let r = store.put("/m/b", b"2".to_vec(), Precondition::None).await?;
    store.put("/other", b"x".to_vec(), Precondition::None).await?;
    let mut watch = store.watch("/m/", r - 1).await?;
    let first = next_change(&mut watch).await?;
    assert_eq!((first.entry.key.as_str(), first.entry.mod_revision, first.deleted), ("/m/b", r, false));
    let deleted_at = store.delete("/m/a", Precondition::None).await?;
    let second = next_change(&mut watch).await?;
    assert!(second.deleted);
    // A delete carries the value the key had, at the revision of the delete.
    assert_eq!((second.entry.key.as_str(), &second.entry.value[..], second.entry.mod_revision), ("/m/a", &b"1"[..], deleted_at));

    // Every key of a transaction shares its revision; a watch delivers each of them, live
    // and replayed (a rollout pass gives 50 machines their spec in one transaction).
    let put = |key: &str| Op::Put { key: key.to_owned(), value: b"t".to_vec(), precondition: Precondition::None };
    let together = store.txn(vec![put("/m/t1"), put("/other2"), put("/m/t2"), put("/m/t3")]).await?;
    let mut replayed = store.watch("/m/", deleted_at).await?;
    for w in [&mut watch, &mut replayed] {
        let mut seen = Vec::new();
        for _ in 0..3 {
            let c = next_change(w).await?;
            seen.push((c.entry.key, c.entry.mod_revision));
        }
        let expected: Vec<(String, u64)> = ["/m/t1", "/m/t2", "/m/t3"].iter().map(|k| (k.to_string(), together)).collect();
        assert_eq!(seen, expected);
    }
    Ok(())
}

/// Keys whose values are not held in memory keep the same contract: their values are read
/// from the backend, alone, many at once or by prefix, and their revisions guard writes.
async fn values_not_in_memory_are_read_from_the_store(store: &dyn Store) -> R {
    let r1 = store.put("/events/a/1", b"one".to_vec(), Precondition::Absent).await?;
    let r2 = store.put("/events/a/2", b"two".to_vec(), Precondition::Absent).await?;
    let r_b = store.put("/events/b", b"b".to_vec(), Precondition::Absent).await?;
    let mut watch = store.watch("/events/", r_b).await?;
    let e = store.get("/events/a/1").await?.context("/events/a/1 missing")?;
    assert_eq!((&e.value[..], e.create_revision, e.mod_revision), (&b"one"[..], r1, r1));
    let listed = store.list("/events/a/").await?;
    let pairs: Vec<(&str, &[u8])> = listed.entries.iter().map(|e| (e.key.as_str(), &e.value[..])).collect();
    assert_eq!(pairs, [("/events/a/1", &b"one"[..]), ("/events/a/2", &b"two"[..])]);
    // Keys and revisions come from memory, without values.
    let keys = store.list_keys("/events/a/");
    assert_eq!(
        keys.entries.iter().map(|e| (e.key.as_str(), e.mod_revision, e.value.len())).collect::<Vec<_>>(),
        [("/events/a/1", r1, 0), ("/events/a/2", r2, 0)]
    );
    // Preconditions hold against the stored revisions.
    assert!(matches!(
        store.put("/events/a/1", b"x".to_vec(), Precondition::Revision(r2)).await,
        Err(StoreError::Conflict { found: Some(f), .. }) if f == r1
    ));
    let r3 = store.put("/events/a/1", b"uno".to_vec(), Precondition::Revision(r1)).await?;
    let changed = next_change(&mut watch).await?;
    assert_eq!((changed.entry.key.as_str(), &changed.entry.value[..], changed.entry.mod_revision), ("/events/a/1", &b"uno"[..], r3));
    // Many at once, in order, beside keys held in memory and keys that do not exist; more
    // than one of etcd's transactions holds.
    for chunk in (0..250).collect::<Vec<_>>().chunks(100) {
        let put =
            |i: &i32| Op::Put { key: format!("/events/many/{i:03}"), value: i.to_string().into_bytes(), precondition: Precondition::None };
        store.txn(chunk.iter().map(put).collect()).await?;
    }
    store.put("/held", b"held".to_vec(), Precondition::None).await?;
    let mut keys: Vec<String> = (0..250).map(|i| format!("/events/many/{i:03}")).collect();
    keys.extend(["/held".to_owned(), "/events/none".to_owned(), "/events/a/1".to_owned()]);
    let found = store.get_many(&keys).await?;
    let values: Vec<Option<String>> = found.iter().map(|e| e.as_ref().map(|e| String::from_utf8_lossy(&e.value).into_owned())).collect();
    let mut expected: Vec<Option<String>> = (0..250).map(|i| Some(i.to_string())).collect();
    expected.extend([Some("held".into()), None, Some("uno".into())]);
    assert_eq!(values, expected);
    // Many small reads at once (etcd: gathered into shared transactions), each answered
    // with its own keys' entries, in its order.
    let readers = (0..300).map(|i| async move {
        let keys = [format!("/events/many/{:03}", i % 250), format!("/events/none-{i}"), format!("/events/many/{:03}", (i * 7) % 250)];
        let found = store.get_many(&keys[..1 + i % 3]).await?;
        let values: Vec<Option<String>> =
            found.iter().map(|e| e.as_ref().map(|e| String::from_utf8_lossy(&e.value).into_owned())).collect();
        let expected = [Some((i % 250).to_string()), None, Some(((i * 7) % 250).to_string())];
        anyhow::ensure!(values == expected[..1 + i % 3], "reader {i}: {values:?}");
        Ok(())
    });
    futures_util::future::try_join_all(readers).await?;
    // A listing of everything holds both kinds, in key order.
    let all = store.list("/").await?.entries;
    assert!(all.windows(2).all(|w| w[0].key < w[1].key));
    let value_of = |key: &str| all.iter().find(|e| e.key == key).map(|e| e.value.to_vec());
    assert_eq!((value_of("/events/b"), value_of("/held")), (Some(b"b".to_vec()), Some(b"held".to_vec())));
    store.delete("/events/a/2", Precondition::Revision(r2)).await?;
    assert!(store.get("/events/a/2").await?.is_none());
    Ok(())
}

async fn the_contract(subject: Subject) -> R {
    let store = subject.store.clone();
    compare_and_swap_and_revisions(&*store).await.context("compare-and-swap and revisions")?;
    a_failed_precondition_writes_nothing_of_the_transaction(&*store).await.context("transactions")?;
    a_check_guards_a_transaction_and_writes_nothing_itself(&*store).await.context("checks")?;
    concurrent_writers_to_one_key_serialise(store.clone()).await.context("racing writers")?;
    concurrent_transactions_on_other_keys_commit_or_fail_each_on_its_own(store.clone()).await.context("independent writers")?;
    watch_replays_then_follows(&*store).await.context("watch")?;
    values_not_in_memory_are_read_from_the_store(&*store).await.context("values not in memory")?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_store_keeps_the_contract() -> R {
    the_contract(sqlite().await?).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_store_keeps_the_contract() -> R {
    the_contract(etcd_store().await?).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_on_one_etcd_lose_no_update_and_see_each_others_writes() -> R {
    let dir = tempfile::tempdir()?;
    let mut members = etcd::start_cluster(dir.path(), etcd::STORE_VERSION, 3);
    etcd::wait_serving(&members).await?;
    let a: Arc<dyn Store> = Arc::new(open_etcd(&members, "/fleet").await?);
    let b: Arc<dyn Store> = Arc::new(open_etcd(&members, "/fleet").await?);
    // Another controller's keys under another prefix stay out of sight.
    let stranger = open_etcd(&members, "/fleet-2").await?;
    stranger.put("/machines/x", b"x".to_vec(), Precondition::None).await?;

    let mut watch_b = b.watch("/counter", b.revision()).await?;
    // Two replicas, 4 writers each, 25 increments per writer through compare-and-swap.
    a.put("/counter", b"0".to_vec(), Precondition::Absent).await?;
    // Replica b sees a's write once its watch delivers it.
    let seen = next_change(&mut watch_b).await?;
    assert_eq!((seen.entry.key.as_str(), &seen.entry.value[..]), ("/counter", &b"0"[..]));
    let mut writers = Vec::new();
    for replica in [a.clone(), b.clone()] {
        for _ in 0..4 {
            let store = replica.clone();
            writers.push(tokio::spawn(async move {
                let mut conflicts = 0u32;
                for _ in 0..25 {
                    loop {
                        let current = store.get("/counter").await?.context("counter missing")?;
                        let n: u64 = std::str::from_utf8(&current.value)?.parse()?;
                        match store.put("/counter", (n + 1).to_string().into_bytes(), Precondition::Revision(current.mod_revision)).await {
                            Ok(_) => break,
                            Err(StoreError::Conflict { .. }) => conflicts += 1,
                            Err(e) => return Err(anyhow!(e)),
                        }
                    }
                }
                anyhow::Ok(conflicts)
            }));
        }
    }
    let mut conflicts = 0;
    for w in writers {
        conflicts += w.await??;
    }
    // Each replica reads from its own watch-fed copy, which may trail the other replica's
    // last write by the watch's delay, but never settles anywhere short of every increment.
    for (name, store) in [("a", &a), ("b", &b)] {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let value = store.get("/counter").await?.context("counter missing")?;
            if &value.value[..] == b"200" {
                break;
            }
            let shown = String::from_utf8_lossy(&value.value).into_owned();
            assert!(tokio::time::Instant::now() < deadline, "replica {name} shows {shown} after {conflicts} conflicts");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert!(conflicts > 0, "the writers never raced");
    // Replica b's watch saw every one of the 200 increments, in order.
    let mut last = seen.entry.mod_revision;
    for i in 0..200 {
        let change = next_change(&mut watch_b).await?;
        assert!(change.entry.mod_revision > last, "change {i} at {} after {last}", change.entry.mod_revision);
        last = change.entry.mod_revision;
    }
    assert!(a.list("/machines/").await?.entries.is_empty());

    // One member dies: both replicas go on writing and reading each other's writes.
    members[0].kill();
    let mut seen_by_b = b.watch("/after-kill/", b.revision()).await?;
    for i in 0..10 {
        a.put(&format!("/after-kill/{i}"), b"v".to_vec(), Precondition::Absent)
            .await
            .with_context(|| format!("write {i} after the kill"))?;
    }
    for _ in 0..10 {
        next_change(&mut seen_by_b).await?;
    }
    assert_eq!(b.list("/after-kill/").await?.entries.len(), 10);
    Ok(())
}

/// Values not held in memory are read from etcd. A read made while the cluster has lost its
/// quorum is sent again until a leader answers, as writes are, instead of failing the agent's
/// request or the rollout pass that made it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_from_etcd_wait_out_a_lost_quorum() -> R {
    let dir = tempfile::tempdir()?;
    let mut members = etcd::start_cluster(dir.path(), etcd::STORE_VERSION, 3);
    etcd::wait_serving(&members).await?;
    let store = Arc::new(open_etcd(&members, "/fleet").await?);
    store.put("/events/m/1", b"one".to_vec(), Precondition::Absent).await?;
    let initial = members.iter().map(EtcdMember::initial_cluster_entry).collect::<Vec<_>>().join(",");
    members[1].kill();
    members[2].kill();
    let key = "/events/m/1".to_owned();
    let reads = tokio::spawn({
        let store = store.clone();
        async move {
            let (one, many, listed) = tokio::join!(store.get(&key), store.get_many(std::slice::from_ref(&key)), store.list("/events/m/"));
            anyhow::Ok((one?, many?, listed?))
        }
    });
    // Longer than the surviving member waits for a leader to confirm a read before it
    // answers that the read timed out (5 s and two election timeouts: 6 s here).
    tokio::time::sleep(Duration::from_secs(8)).await;
    if reads.is_finished() {
        bail!("the reads ended while the cluster had no leader: {:?}", reads.await?.map(|_| ()));
    }
    members[1].start("existing", &initial);
    let (one, many, listed) =
        tokio::time::timeout(Duration::from_secs(20), reads).await.context("reads still waiting 20 s after the quorum came back")???;
    let value = |e: Option<&keelson_controller::store::Entry>| e.map(|e| e.value.to_vec());
    assert_eq!(value(one.as_ref()), Some(b"one".to_vec()));
    assert_eq!(value(many[0].as_ref()), Some(b"one".to_vec()));
    assert_eq!(value(listed.entries.first()), Some(b"one".to_vec()));
    Ok(())
}

/// Whether etcd still holds `key` as it was at `revision`.
async fn history_holds(client: &etcd_client::Client, key: &str, revision: i64) -> anyhow::Result<bool> {
    match client.kv_client().get(key, Some(etcd_client::GetOptions::new().with_revision(revision))).await {
        Ok(r) => Ok(r.kvs().first().is_some_and(|kv| kv.mod_revision() == revision)),
        Err(e) if e.to_string().contains("required revision has been compacted") => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_store_compacts_the_history_it_no_longer_needs_unless_told_not_to() -> R {
    let dir = tempfile::tempdir()?;
    let members = etcd::start_cluster(dir.path(), etcd::STORE_VERSION, 1);
    etcd::wait_serving(&members).await?;
    let open = |prefix: &str, compact_every: Option<Duration>| {
        let options = EtcdOptions::parse(&etcd::store_url(&members), None, prefix).map(|o| EtcdOptions { compact_every, ..o });
        async move { anyhow::Ok(EtcdStore::open(&options.map_err(|e| anyhow!(e))?).await?) }
    };
    // First a store that leaves history alone: an old revision stays readable.
    let keeping = open("/keeping", None).await?;
    let kept = keeping.put("/h", b"1".to_vec(), Precondition::None).await?;
    keeping.put("/h", b"2".to_vec(), Precondition::None).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let client = keeping.client();
    let kept = i64::try_from(kept)?;
    assert!(history_holds(&client, "/keeping/h", kept).await?, "revision {kept} is gone without compaction");

    // Then one that compacts every second: within a few intervals the old revision is gone,
    // and the store still reads, writes and watches.
    let compacting = open("/compacting", Some(Duration::from_secs(1))).await?;
    let old = compacting.put("/h", b"1".to_vec(), Precondition::None).await?;
    let newer = compacting.put("/h", b"2".to_vec(), Precondition::None).await?;
    let old = i64::try_from(old)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while history_holds(&client, "/compacting/h", old).await? {
        assert!(tokio::time::Instant::now() < deadline, "revision {old} still held after 15 s of compaction every second");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(compacting.get("/h").await?.map(|e| e.mod_revision), Some(newer));
    let mut watch = compacting.watch("/", compacting.revision()).await?;
    let latest = compacting.put("/h", b"3".to_vec(), Precondition::Revision(newer)).await?;
    assert_eq!(next_change(&mut watch).await?.entry.mod_revision, latest);
    Ok(())
}

#[tokio::test]
async fn bad_etcd_store_urls_are_refused_with_the_flag_named() {
    for (url, prefix, says) in [
        ("etcd://", DEFAULT_PREFIX, "is not HOST:PORT"),
        ("etcd://127.0.0.1", DEFAULT_PREFIX, "is not HOST:PORT"),
        ("etcd://127.0.0.1:0", DEFAULT_PREFIX, "is not HOST:PORT"),
        ("etcd://127.0.0.1:2379,", DEFAULT_PREFIX, "is not HOST:PORT"),
        ("etcd://127.0.0.1:2379", "keelson", "--etcd-prefix"),
        ("etcd://127.0.0.1:2379", "/keelson/", "--etcd-prefix"),
        ("http://127.0.0.1:2379", DEFAULT_PREFIX, "expected etcd://"),
    ] {
        let e = EtcdOptions::parse(url, None, prefix).err().unwrap_or_else(|| panic!("{url} {prefix} accepted"));
        assert!(e.contains(says), "{url} {prefix}: {e}");
    }
    let ok = EtcdOptions::parse("etcd://10.0.0.1:2379,etcd-2.example:2379", None, DEFAULT_PREFIX).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ok.endpoints, ["http://10.0.0.1:2379", "http://etcd-2.example:2379"]);
}

/// Writes a new key as `dir/NAME.key` and the certificate `sign` makes for its CSR as
/// `dir/NAME.crt`.
fn issue(dir: &std::path::Path, name: &str, sign: impl FnOnce(&str) -> anyhow::Result<String>) -> anyhow::Result<(PathBuf, PathBuf)> {
    let key = rcgen::KeyPair::generate()?;
    let csr = rcgen::CertificateParams::new(vec![])?.serialize_request(&key)?.pem()?;
    let (cert_path, key_path) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
    std::fs::write(&cert_path, sign(&csr)?)?;
    std::fs::write(&key_path, key.serialize_pem())?;
    Ok((cert_path, key_path))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_store_over_tls_keeps_the_contract_and_needs_a_certificate_of_the_clusters_ca() -> R {
    use keelson_controller::etcd_pki::EtcdAuthorities;
    use keelson_controller::store::etcd::EtcdTlsFiles;

    let dir = tempfile::tempdir()?;
    let cluster = "store".parse()?;
    let cas = EtcdAuthorities::new(&dir.path().join("pki"));
    let other_cas = EtcdAuthorities::new(&dir.path().join("other-pki"));
    let ca = dir.path().join("pki/etcd-ca/store/ca.crt");
    let (member_cert, member_key) = issue(dir.path(), "m0", |csr| Ok(cas.issue_member(&cluster, &"m0".parse()?, csr, &[])?.cert_pem))?;
    let (client_cert, client_key) =
        issue(dir.path(), "controller", |csr| Ok(cas.issue_client(&cluster, "keelson-controller", csr)?.cert_pem))?;
    let (stranger_cert, stranger_key) =
        issue(dir.path(), "stranger", |csr| Ok(other_cas.issue_client(&cluster, "keelson-controller", csr)?.cert_pem))?;

    let mut member = EtcdMember::new(dir.path(), "m0", etcd::STORE_VERSION).with_tls(&ca, &member_cert, &member_key);
    let initial = member.initial_cluster_entry();
    member.start("new", &initial);
    let url = etcd::store_url(std::slice::from_ref(&member));
    let tls = |cert: &PathBuf, key: &PathBuf| Some(EtcdTlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() });
    let options = EtcdOptions::parse(&url, tls(&client_cert, &client_key), DEFAULT_PREFIX).map_err(|e| anyhow!(e))?;
    assert!(options.endpoints.iter().all(|e| e.starts_with("https://")), "{:?}", options.endpoints);
    // The member takes a moment to serve.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let store = loop {
        match EtcdStore::open(&options).await {
            Ok(store) => break store,
            Err(_) if tokio::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => bail!("the store over TLS did not open: {e}"),
        }
    };
    the_contract(Subject { store: Arc::new(store), _dir: tempfile::tempdir()?, _members: Vec::new() }).await?;

    // A client certificate from another CA opens nothing.
    let refused = EtcdOptions::parse(&url, tls(&stranger_cert, &stranger_key), DEFAULT_PREFIX).map_err(|e| anyhow!(e))?;
    assert!(EtcdStore::open(&refused).await.is_err(), "etcd accepted a certificate of another CA");
    drop(member);
    Ok(())
}

/// A replica that starts (or lists again) on a large store reads it whole: more than gRPC's
/// default of 4 MiB to a message, as 10,000 machines' records are, and more keys than one
/// page of its listing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_store_larger_than_one_grpc_message_opens() -> R {
    let dir = tempfile::tempdir()?;
    let members = etcd::start_cluster(dir.path(), etcd::STORE_VERSION, 1);
    etcd::wait_serving(&members).await?;
    let first = open_etcd(&members, DEFAULT_PREFIX).await?;
    // 6 MiB in 96 values of 64 KiB, a few to a transaction.
    let value = vec![b'x'; 64 << 10];
    for chunk in (0..96).collect::<Vec<_>>().chunks(8) {
        let ops =
            chunk.iter().map(|i| Op::Put { key: format!("/big/{i:03}"), value: value.clone(), precondition: Precondition::None }).collect();
        first.txn(ops).await?;
    }
    for chunk in (0..2_500).collect::<Vec<_>>().chunks(100) {
        let ops = chunk
            .iter()
            .map(|i| Op::Put { key: format!("/small/{i:04}"), value: b"s".to_vec(), precondition: Precondition::None })
            .collect();
        first.txn(ops).await?;
    }
    first.put("/events/m1/00000000000000000000", b"history".to_vec(), Precondition::Absent).await?;
    let second = open_etcd(&members, DEFAULT_PREFIX).await?;
    let history = second.get("/events/m1/00000000000000000000").await?.map(|e| e.value.to_vec());
    assert_eq!(history.as_deref(), Some(&b"history"[..]), "a value not held is read from etcd");
    let listing = second.list("/big/").await?;
    assert_eq!(listing.entries.len(), 96);
    assert!(listing.entries.iter().all(|e| e.value.len() == value.len()));
    let small = second.list("/small/").await?.entries;
    assert_eq!(small.len(), 2_500);
    assert!(small.windows(2).all(|w| w[0].key < w[1].key));
    assert_eq!(second.revision(), first.revision());
    Ok(())
}
