//! Several controller replicas on one 3-member etcd cluster: they share one CA (and refuse
//! another), exactly one leads, a killed leader is replaced within 15 s while a rollout goes
//! on, and disruption leases asked of both replicas at once are never granted twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use keelson_tests::{ApiClient, Controller, TestStore, bin, status_report, wait_for_pool_web};
use serde_json::json;

type R = anyhow::Result<()>;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"))
}

fn copy_ca(from: &std::path::Path, to: &std::path::Path) -> anyhow::Result<()> {
    for f in ["ca.crt", "ca.key"] {
        std::fs::copy(from.join(f), to.join(f))?;
    }
    Ok(())
}

/// `serve` that is expected to refuse to start: its exit status and stderr.
fn refused_start(store: &TestStore, data_dir: &std::path::Path) -> anyhow::Result<(bool, String)> {
    let out = std::process::Command::new(bin("keelson-controller"))
        .args(["serve", "--data-dir"])
        .arg(data_dir)
        .args(["--listen", "127.0.0.1:0"])
        .args(store.args())
        .output()?;
    Ok((out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// A replica's admin client, holding the credential the first replica wrote.
fn admin_of(first: &Controller, replica: &Controller) -> anyhow::Result<ApiClient> {
    let mut admin = first.admin()?;
    admin.base = replica.url.clone();
    Ok(admin)
}

/// Whether the replica behind `admin` says it leads (its metrics).
async fn leads(admin: &ApiClient) -> Option<bool> {
    let text = admin.get("/metrics").await.ok()?.text;
    text.lines().find_map(|l| l.strip_prefix("keelson_controller_leader ")).map(|v| v.trim() == "1")
}

/// Waits until exactly one of `admins` leads; its index.
async fn one_leader(admins: &[&ApiClient], within: Duration) -> anyhow::Result<usize> {
    let deadline = Instant::now() + within;
    loop {
        let mut leaders = Vec::new();
        for (i, a) in admins.iter().enumerate() {
            if leads(a).await == Some(true) {
                leaders.push(i);
            }
        }
        if let [one] = leaders[..] {
            return Ok(one);
        }
        anyhow::ensure!(Instant::now() < deadline, "no single leader within {within:?}: leaders {leaders:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Two replicas on a fresh 3-member cluster, the second holding a copy of the first's CA.
/// Periodic rollout passes are a minute apart: a rollout moves only as changes wake it.
async fn two_replicas(dirs: &(tempfile::TempDir, tempfile::TempDir)) -> anyhow::Result<(TestStore, Controller, Controller)> {
    let store = TestStore::etcd(3).await?;
    let a = store.start(dirs.0.path(), &["--reconcile-interval-seconds", "60"])?;
    copy_ca(dirs.0.path(), dirs.1.path())?;
    let b = store.start(dirs.1.path(), &["--reconcile-interval-seconds", "60"])?;
    Ok((store, a, b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_ca_refuse_another_and_elect_one_leader() -> R {
    let store = TestStore::etcd(3).await?;
    let (first, second, foreign, other) = (tmp(), tmp(), tmp(), tmp());
    let a = store.start(first.path(), &[])?;

    // A second replica with an empty data directory must not make a CA of its own.
    let (ok, stderr) = refused_start(&store, second.path())?;
    assert!(!ok, "a replica without the fleet's CA started");
    assert!(stderr.contains("copy ca.crt, ca.key and etcd-ca/"), "{stderr}");
    assert!(!second.path().join("ca.crt").exists() && !second.path().join("ca.key").exists());

    // Nor with another CA (a SQLite controller's).
    drop(Controller::start(other.path(), &["--store", "sqlite"])?);
    copy_ca(other.path(), foreign.path())?;
    let (ok, stderr) = refused_start(&store, foreign.path())?;
    assert!(!ok, "a replica with another CA started");
    assert!(stderr.contains("is not the CA of the fleet this store holds"), "{stderr}");
    assert_eq!(std::fs::read(foreign.path().join("ca.crt"))?, std::fs::read(other.path().join("ca.crt"))?, "the operator's files are left");

    // With a copy of the first replica's CA it serves, and the first's admin works on it.
    copy_ca(first.path(), second.path())?;
    let b = store.start(second.path(), &[])?;
    let (admin_a, admin_b) = (a.admin()?, admin_of(&a, &b)?);
    assert_eq!(admin_b.get("/v1/machines").await?.status, 200);
    // A token made through one replica enrolls a machine through the other.
    let token = a.token(&["--usages", "1"])?;
    let states = tmp();
    let machine = b.enroll("m1", &token, &states.path().join("m1"))?;
    machine.put("/v1/agent/status", &status_report(1)).await?;
    assert_eq!(admin_a.get("/v1/machines/m1").await?.body["status"]["phase"], "Ready");

    // An etcd cluster's CA, made by the replica that first signs for it, is shared the same
    // way: the other replica refuses to sign with a CA of its own until it has a copy.
    let etcd_spec = json!({"roles": ["etcd"], "etcd": {"cluster": "main", "version": "3.4.23", "source": {"package": "etcd-server"}}});
    let declared = admin_a.put("/v1/machines/e1", &keelson_tests::machine_json("e1", json!({}), etcd_spec)).await?;
    assert_eq!(declared.status, 200, "{}", declared.text);
    let csr = || -> anyhow::Result<String> {
        let key = rcgen::KeyPair::generate()?;
        Ok(rcgen::CertificateParams::new(vec![])?.serialize_request(&key)?.pem()?)
    };
    let ask = json!({"csr": csr()?, "commonName": "etcdctl"});
    let via_a = admin_a.post("/v1/etcd/main/client-certificates", &ask).await?;
    assert_eq!(via_a.status, 200, "{}", via_a.text);
    let via_b = admin_b.post("/v1/etcd/main/client-certificates", &ask).await?;
    assert_eq!(via_b.status, 503, "{}", via_b.text);
    assert!(via_b.text.contains("etcd-ca/main"), "{}", via_b.text);
    assert!(!second.path().join("etcd-ca/main/ca.key").exists(), "b made a CA of its own");
    std::fs::create_dir_all(second.path().join("etcd-ca/main"))?;
    copy_ca(&first.path().join("etcd-ca/main"), &second.path().join("etcd-ca/main"))?;
    let via_b = admin_b.post("/v1/etcd/main/client-certificates", &ask).await?;
    assert_eq!(via_b.status, 200, "{}", via_b.text);
    assert_eq!(via_b.body["ca"], via_a.body["ca"]);

    let leader = one_leader(&[&admin_a, &admin_b], Duration::from_secs(15)).await?;
    // It stays one for a while (renewals, no flapping).
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(one_leader(&[&admin_a, &admin_b], Duration::from_secs(1)).await?, leader);
    }

    // A leader that shuts down (SIGTERM) gives up its lease: the other leads at once, not
    // after the lease's 6 s.
    let mut replicas = [a, b];
    let admins = [admin_a, admin_b];
    let stopped = std::process::Command::new("kill").args(["-TERM", &replicas[leader].child.id().to_string()]).status()?;
    assert!(stopped.success());
    let since = Instant::now();
    one_leader(&[&admins[1 - leader]], Duration::from_secs(15)).await?;
    let took = since.elapsed();
    assert!(took < Duration::from_secs(3), "the handover took {took:?}");
    replicas[leader].kill();
    Ok(())
}

/// A simulated agent (as in tests/rollout.rs) that knows both replicas and moves to the other
/// when one does not answer. `busy` counts machines between receiving a new generation and
/// reporting it; `most` keeps the highest count seen.
async fn agent(clients: Vec<ApiClient>, work: Duration, busy: Arc<AtomicUsize>, most: Arc<AtomicUsize>) -> anyhow::Result<()> {
    let mut at = 0;
    let mut after = 0u64;
    loop {
        let client = &clients[at % clients.len()];
        let answer = client.get(&format!("/v1/agent/spec?after={after}&timeoutSeconds=1")).await;
        let spec = match answer {
            Ok(a) if a.status == 200 => a.body,
            _ => {
                at += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let generation = spec["generation"].as_u64().unwrap_or(0);
        if generation != after {
            after = generation;
            let now = busy.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(work).await;
            busy.fetch_sub(1, Ordering::SeqCst);
        }
        // Reported on every round, as the heartbeat; a failed report is sent again next round.
        if !matches!(client.put("/v1/agent/status", &status_report(generation)).await, Ok(a) if a.status == 200) {
            at += 1;
        }
    }
}

fn pool(content: &str, rollout: serde_json::Value) -> serde_json::Value {
    json!({"apiVersion": "keelson.io/v1alpha1", "kind": "MachinePool", "metadata": {"name": "web"},
           "spec": {"selector": {"matchLabels": {"pool": "web"}}, "rollout": rollout,
                    "template": {"spec": {"roles": ["worker"], "files": [{"path": "/etc/motd", "content": content}]}}}})
}

fn rolled_out_to(p: &serde_json::Value, revision: u64, machines: u64) -> bool {
    let rolled = p["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "RolledOut" && c["status"] == "True" && c["message"] == format!("revision {revision}").as_str());
    rolled && p["status"]["revision"] == revision && p["status"]["updated"] == machines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_leader_is_replaced_within_15s_and_the_rollout_goes_on() -> R {
    const MACHINES: u64 = 8;
    let dirs = (tmp(), tmp());
    let (_store, a, b) = two_replicas(&dirs).await?;
    let admins = [a.admin()?, admin_of(&a, &b)?];
    let rollout = json!({"maxUnavailable": 2});
    assert_eq!(admins[0].put("/v1/pools/web", &pool("one\n", rollout.clone())).await?.status, 200);

    let token = a.token(&["--usages", "8", "--labels", "pool=web"])?;
    let states = tmp();
    let (busy, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut agents = tokio::task::JoinSet::new();
    let ca = a.ca_pem()?;
    for i in 0..MACHINES {
        let name = format!("m{i}");
        let state = states.path().join(&name);
        let via_a = a.enroll(&name, &token, &state)?;
        let (cert, key) = (std::fs::read_to_string(state.join("machine.crt"))?, std::fs::read_to_string(state.join("machine.key"))?);
        let via_b = ApiClient::new(&b.url, &ca, Some((&cert, &key)))?;
        // Half the machines talk to a first, half to b.
        let clients = if i % 2 == 0 { vec![via_a, via_b] } else { vec![via_b, via_a] };
        agents.spawn(agent(clients, Duration::from_millis(1500), busy.clone(), most.clone()));
    }
    wait_for_pool_web(&admins[0], "revision 1 on every machine", 90, |p| rolled_out_to(p, 1, MACHINES)).await?;
    // Enrolled machines all take their first spec at once; the budget applies from here.
    most.store(busy.load(Ordering::SeqCst), Ordering::SeqCst);

    let leader = one_leader(&[&admins[0], &admins[1]], Duration::from_secs(15)).await?;
    let follower = 1 - leader;
    // Revision 2, acknowledged by the replica about to die.
    assert_eq!(admins[leader].put("/v1/pools/web", &pool("two\n", rollout.clone())).await?.status, 200);
    wait_for_pool_web(&admins[follower], "the first machines to take revision 2", 30, |p| {
        p["status"]["revision"] == 2 && p["status"]["updated"].as_u64().is_some_and(|u| u >= 1)
    })
    .await?;
    let mut replicas = [a, b];
    replicas[leader].kill();
    let killed = Instant::now();
    one_leader(&[&admins[follower]], Duration::from_secs(15)).await?;
    let took = killed.elapsed();
    eprintln!("a new leader after {:.1}s", took.as_secs_f64());
    assert!(took <= Duration::from_secs(15), "took {took:?}");

    // The CLI and an agent given both URLs, the dead replica's first, move on to the live one.
    let (dead, live) = (replicas[leader].url.clone(), replicas[follower].url.clone());
    let conf_dir = tmp();
    let mut admin_conf = keelson_api::config::ClientConfig::from_yaml(&std::fs::read_to_string(replicas[0].admin_conf())?)
        .map_err(|e| anyhow::anyhow!(e))?;
    admin_conf.servers = vec![dead.clone(), live.clone()];
    std::fs::write(conf_dir.path().join("admin.conf"), admin_conf.to_yaml())?;
    let out = std::process::Command::new(bin("keelson"))
        .env("KEELSON_CONFIG", conf_dir.path().join("admin.conf"))
        .args(["get", "pools"])
        .output()?;
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("web"), "{}", String::from_utf8_lossy(&out.stderr));
    let agent_conf = conf_dir.path().join("agent.toml");
    std::fs::write(&agent_conf, format!("servers = [{dead:?}, {live:?}]\nca_file = {:?}\n", dirs.0.path().join("ca.crt")))?;
    // A dry run: it fetches the spec and only reads this host.
    let out = std::process::Command::new(bin("keelson-agent"))
        .arg("--config")
        .arg(&agent_conf)
        .arg("--state-dir")
        .arg(states.path().join("m0"))
        .arg("plan")
        .output()?;
    assert_eq!(out.status.code(), Some(2), "plan: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("/etc/motd"), "{}", String::from_utf8_lossy(&out.stdout));

    let done =
        wait_for_pool_web(&admins[follower], "revision 2 on every machine after the failover", 90, |p| rolled_out_to(p, 2, MACHINES))
            .await?;
    assert_eq!(done["spec"]["template"]["spec"]["files"][0]["content"], "two\n", "the acknowledged change survived");
    for i in 0..MACHINES {
        let m = admins[follower].get(&format!("/v1/machines/m{i}")).await?;
        assert_eq!(m.body["status"]["poolRevision"], 2, "m{i}: {}", m.body["status"]);
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 2, "{most} machines were upgrading at once; maxUnavailable is 2");
    agents.abort_all();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changes_made_through_a_follower_move_the_leaders_rollout() -> R {
    const MACHINES: u64 = 4;
    let dirs = (tmp(), tmp());
    let (_store, a, b) = two_replicas(&dirs).await?;
    let admins = [a.admin()?, admin_of(&a, &b)?];
    let leader = one_leader(&[&admins[0], &admins[1]], Duration::from_secs(15)).await?;
    let follower = [&a, &b][1 - leader];
    let admin = &admins[1 - leader];

    // The pool, the token, the enrollments and every report go through the follower only.
    let rollout = json!({"maxUnavailable": 1});
    assert_eq!(admin.put("/v1/pools/web", &pool("one\n", rollout.clone())).await?.status, 200);
    let token = follower.token(&["--usages", "4", "--labels", "pool=web"])?;
    let states = tmp();
    let (busy, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut agents = tokio::task::JoinSet::new();
    for i in 0..MACHINES {
        let name = format!("m{i}");
        let client = follower.enroll(&name, &token, &states.path().join(&name))?;
        agents.spawn(agent(vec![client], Duration::from_millis(300), busy.clone(), most.clone()));
    }
    // Without the leader hearing of them, each step would wait for its minute-long period.
    wait_for_pool_web(admin, "revision 1 on every machine", 20, |p| rolled_out_to(p, 1, MACHINES)).await?;
    most.store(busy.load(Ordering::SeqCst), Ordering::SeqCst);
    let started = Instant::now();
    assert_eq!(admin.put("/v1/pools/web", &pool("two\n", rollout)).await?.status, 200);
    wait_for_pool_web(admin, "revision 2, one machine at a time", 30, |p| rolled_out_to(p, 2, MACHINES)).await?;
    eprintln!("rolled out through the follower in {:.1}s", started.elapsed().as_secs_f64());
    assert_eq!(most.load(Ordering::SeqCst), 1, "maxUnavailable is 1");
    agents.abort_all();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_disruption_lease_asked_of_both_replicas_at_once_is_granted_once() -> R {
    let dirs = (tmp(), tmp());
    let (_store, a, b) = two_replicas(&dirs).await?;
    let admin = a.admin()?;
    assert_eq!(admin.put("/v1/pools/web", &pool("one\n", json!({"maxUnavailable": 1}))).await?.status, 200);
    let token = a.token(&["--usages", "4", "--labels", "pool=web"])?;
    let states = tmp();
    let ca = a.ca_pem()?;
    let mut machines = Vec::new();
    for i in 0..4 {
        let name = format!("m{i}");
        let state = states.path().join(&name);
        let via_a = a.enroll(&name, &token, &state)?;
        via_a.put("/v1/agent/status", &status_report(1)).await?;
        let (cert, key) = (std::fs::read_to_string(state.join("machine.crt"))?, std::fs::read_to_string(state.join("machine.key"))?);
        machines.push([via_a, ApiClient::new(&b.url, &ca, Some((&cert, &key)))?]);
    }

    // Every machine asks the replicas in turn, over and over, all machines at once; a holder
    // keeps its lease 200 ms. (A machine that asks again gets the lease it holds, so each
    // machine is one task.) The count of holders drops before the release is sent, so it can
    // only under-count.
    let holders = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + Duration::from_secs(8);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, clients) in machines.into_iter().enumerate() {
        let (holders, most, granted) = (holders.clone(), most.clone(), granted.clone());
        tasks.spawn(async move {
            let ask = json!({"reason": "restart containerd", "ttlSeconds": 60});
            let mut turn = i;
            while Instant::now() < until {
                turn += 1;
                let client = &clients[turn % 2];
                let answer = client.post("/v1/agent/disruptions", &ask).await?;
                match answer.status {
                    201 => {
                        let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        granted.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        holders.fetch_sub(1, Ordering::SeqCst);
                        let id = answer.body["id"].as_str().unwrap_or_default().to_owned();
                        let released = client.request(reqwest::Method::DELETE, &format!("/v1/agent/disruptions/{id}"), None).await?;
                        anyhow::ensure!(released.status == 204, "release: {}", released.text);
                    }
                    429 => tokio::time::sleep(Duration::from_millis(20)).await,
                    other => anyhow::bail!("lease request answered {other}: {}", answer.text),
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    let (most, granted) = (most.load(Ordering::SeqCst), granted.load(Ordering::SeqCst));
    eprintln!("{granted} leases granted, at most {most} held at once");
    assert!(granted >= 10, "only {granted} leases in 8 s: the replicas barely granted any");
    assert_eq!(most, 1, "two machines held a lease at once with maxUnavailable 1");
    assert_eq!(admin.get("/v1/leases").await?.body.as_array().map(Vec::len), Some(0), "every lease was released");
    Ok(())
}
