//! This machine's etcd member, in the order the cluster needs: TLS first, then either the
//! join (the first member starts the cluster; every other one is added as a learner through
//! the members, starts with state `existing`, and is promoted once caught up) or, for a
//! member that exists, a careful restart (every member healthy, a snapshot on the machine,
//! leadership handed over) and the wait until it serves again and has caught up.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use keelson_api::machine::EtcdMemberStatus;
use keelson_api::meta::Name;

use super::client::{EtcdClient, EtcdTls};
use super::membership::{self, ClusterView, MembershipError};
use super::pki;
use crate::client::Controller;
use crate::drivers::{etcd as host, files, systemd};

/// Joining, promotion and catching up after a restart each get this long.
const MEMBER_WAIT: Duration = Duration::from_secs(180);
/// A joining member waits this long for the first member to appear.
const FIRST_MEMBER_WAIT: Duration = Duration::from_secs(600);
const FIRST_MEMBER_POLL: Duration = Duration::from_secs(3);
/// Snapshots kept on the machine, newest first.
const SNAPSHOTS_KEPT: usize = 3;

#[derive(Debug, thiserror::Error)]
pub enum MemberError {
    /// Retrying will not help without a change (a refusal that would cost quorum).
    #[error("{0}")]
    Permanent(String),
    #[error("{0}")]
    Transient(String),
}

fn transient(e: impl std::fmt::Display) -> MemberError {
    MemberError::Transient(e.to_string())
}

impl From<MembershipError> for MemberError {
    fn from(e: MembershipError) -> Self {
        match e {
            MembershipError::WouldLoseQuorum { .. } | MembershipError::LastMember { .. } => MemberError::Permanent(e.to_string()),
            other => MemberError::Transient(other.to_string()),
        }
    }
}

/// What leaving the cluster came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Left {
    /// The member was removed; the others go on.
    Removed,
    /// The cluster had no member for this machine (it left before, or never joined).
    NotAMember,
    /// Forced on the last member: etcd cannot remove it, so the cluster ends with the reset.
    ClusterEnded,
}

/// This machine's member of `cluster`.
#[derive(Debug)]
pub struct LocalMember<'a> {
    pub name: &'a Name,
    pub cluster: &'a Name,
    pub address: IpAddr,
    pub state_dir: &'a Path,
    pub controller: &'a Controller,
}

impl LocalMember<'_> {
    pub fn peer_url(&self) -> String {
        host::peer_url(self.address)
    }

    pub fn client_url(&self) -> String {
        host::client_url(self.address)
    }

    /// The member certificate, asked for when there is none, it nears its end, or it does not
    /// name this machine's address.
    pub async fn ensure_tls(&self) -> Result<EtcdTls, MemberError> {
        let dir = Path::new(host::PKI_DIR);
        let address = self.address.to_string();
        match pki::renewal_reason(dir, std::slice::from_ref(&address), time::OffsetDateTime::now_utc()) {
            Some(why) => {
                tracing::info!(%why, "asking the controller for an etcd member certificate");
                pki::obtain(self.controller, dir, self.name, std::slice::from_ref(&address)).await.map_err(transient)
            }
            None => EtcdTls::from_files(&dir.join(pki::CA_FILE), &dir.join(pki::CERT_FILE), &dir.join(pki::KEY_FILE)).map_err(transient),
        }
    }

    /// Before a restart of a running member: the whole cluster healthy, a snapshot of this
    /// member on the machine, leadership elsewhere. Returns the snapshot's path and size.
    pub async fn prepare_restart(&self, client: &EtcdClient) -> Result<(PathBuf, u64), MemberError> {
        let view = ClusterView::observe(client).await.map_err(transient)?;
        view.check_all_healthy()?;
        let me = view
            .find_by_peer_url(&self.peer_url())
            .ok_or_else(|| MemberError::Transient(format!("no member has this machine's peer URL {}", self.peer_url())))?
            .member
            .id;
        let dir = self.state_dir.join("etcd-snapshots");
        std::fs::create_dir_all(&dir).map_err(|e| transient(format!("{}: {e}", dir.display())))?;
        let stamp = time::OffsetDateTime::now_utc().unix_timestamp();
        let path = dir.join(format!("{}-{stamp}.db", self.cluster));
        let size = client.snapshot(&host::local_client_url(), &path).await.map_err(transient)?;
        prune_snapshots(&dir);
        if let Some(to) = membership::move_leader_away(client, me, MEMBER_WAIT).await? {
            tracing::info!(to = format!("{to:x}"), "handed etcd leadership over before the restart");
        }
        Ok((path, size))
    }

    /// Starts this machine's first member: alone when the controller says this machine starts
    /// the cluster, otherwise as a learner added through the members, promoted once caught up.
    pub async fn join(&self, tls: &EtcdTls) -> Result<(), MemberError> {
        let deadline = tokio::time::Instant::now() + FIRST_MEMBER_WAIT;
        let info = loop {
            let info = self.controller.etcd_cluster().await.map_err(transient)?;
            if info.initialize || !info.client_urls.is_empty() {
                break info;
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(MemberError::Transient(format!(
                    "no member of etcd cluster {} to join yet (waiting for {} to start it)",
                    self.cluster,
                    info.initializer.map(|n| n.to_string()).unwrap_or_else(|| "a first member".into())
                )));
            }
            tokio::time::sleep(FIRST_MEMBER_POLL).await;
        };
        let local = EtcdClient::new(vec![host::local_client_url()], Some(tls)).map_err(transient)?;
        if info.initialize {
            let initial = format!("{}={}", self.name, self.peer_url());
            files::write(host::INITIAL_ENV_FILE, &host::initial_env_content("new", &initial), 0o644, None).map_err(transient)?;
            systemd::restart(host::UNIT_NAME).await.map_err(transient)?;
            membership::wait_caught_up(&local, &host::local_client_url(), MEMBER_WAIT).await?;
            return Ok(());
        }
        let members = local.with_endpoints(info.client_urls.clone());
        // A started member with this machine's peer URL, while this machine has no member
        // data: its disk was replaced. The old member goes (if quorum allows), and this
        // machine joins anew.
        if let Some(stale) =
            members.members().await.map_err(transient)?.into_iter().find(|m| !m.name.is_empty() && m.peer_urls.contains(&self.peer_url()))
        {
            tracing::warn!(member = format!("{:x}", stale.id), "removing this machine's old member, whose data is gone");
            membership::remove_member(&members, stale.id, false).await?;
        }
        let (learner, initial) = membership::add_learner(&members, self.name.as_str(), &self.peer_url(), MEMBER_WAIT).await?;
        files::write(host::INITIAL_ENV_FILE, &host::initial_env_content("existing", &initial), 0o644, None).map_err(transient)?;
        systemd::restart(host::UNIT_NAME).await.map_err(transient)?;
        membership::promote_when_caught_up(&members, learner.id, MEMBER_WAIT).await?;
        membership::wait_caught_up(&local, &host::local_client_url(), MEMBER_WAIT).await?;
        Ok(())
    }

    /// Leaves the cluster (before a reset): refused when the rest would lose quorum, or when
    /// this is the last member, unless `force`.
    pub async fn leave(&self, tls: &EtcdTls, force: bool) -> Result<Left, MemberError> {
        let local = EtcdClient::new(vec![host::local_client_url()], Some(tls)).map_err(transient)?;
        let members = local.members().await.map_err(transient)?;
        let Some(me) = members.iter().find(|m| m.peer_urls.contains(&self.peer_url())) else {
            return Ok(Left::NotAMember);
        };
        if force && members.len() == 1 {
            // etcd never removes its only member; forcing means the cluster ends here.
            return Ok(Left::ClusterEnded);
        }
        let others: Vec<String> = members.iter().filter(|m| m.id != me.id).flat_map(|m| m.client_urls.iter().cloned()).collect();
        let client = local.with_endpoints([others, vec![host::local_client_url()]].concat());
        membership::remove_member(&client, me.id, force).await?;
        Ok(Left::Removed)
    }

    /// The member as its own endpoint and the member list see it, for the status.
    pub async fn status(&self, tls: &EtcdTls, last_snapshot: Option<String>) -> Option<EtcdMemberStatus> {
        let local = EtcdClient::new(vec![host::local_client_url()], Some(tls)).ok()?;
        let s = local.status(&host::local_client_url()).await.ok()?;
        let learner = local.members().await.ok()?.iter().any(|m| m.id == s.member_id && m.is_learner);
        let alarms = local.alarms().await.unwrap_or_default().into_iter().filter(|a| a.member_id == s.member_id).map(|a| a.alarm).collect();
        Some(EtcdMemberStatus {
            cluster: self.cluster.clone(),
            member_id: format!("{:x}", s.member_id),
            client_url: self.client_url(),
            peer_url: self.peer_url(),
            version: s.version.clone(),
            learner,
            leader: s.leader == s.member_id,
            raft_index: s.raft_index,
            db_size_bytes: s.db_size_bytes,
            alarms,
            healthy: s.leader != 0 && s.errors.is_empty(),
            last_snapshot,
        })
    }
}

fn prune_snapshots(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut snaps: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "db"))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    snaps.sort_by_key(|s| std::cmp::Reverse(s.0));
    for (_, old) in snaps.into_iter().skip(SNAPSHOTS_KEPT) {
        let _ = std::fs::remove_file(old);
    }
}
