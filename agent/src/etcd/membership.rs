//! Cluster membership, the careful way: what a member's agent does to the cluster around its
//! own member, and the checks that keep quorum. One change at a time (the controller's
//! disruption lease serialises changes across the pool); every step here is safe to repeat
//! after a crash, because each one first looks at the member list.
//!
//! - join: add as a learner (or find the learner a previous attempt added), start, then
//!   promote once etcd says the learner is in sync with the leader;
//! - restart (version change): every member healthy first, leadership moved away, and after
//!   the restart wait until the member is healthy and has applied what the leader had
//!   committed;
//! - leave: refused when the cluster would be left without quorum, or empty, unless forced.

use std::time::Duration;

use tokio::time::{Instant, sleep};

use super::client::{EndpointStatus, EtcdClient, EtcdError, Member};

const POLL_INTERVAL_MS: u64 = 200;
const LEADER_MOVE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    #[error(transparent)]
    Etcd(#[from] EtcdError),
    #[error("removing member {name} would leave {healthy} healthy voting members of {remaining}, below quorum {quorum}")]
    WouldLoseQuorum { name: String, healthy: usize, remaining: usize, quorum: usize },
    #[error("member {name} is the last member of the cluster; removing it ends the cluster")]
    LastMember { name: String },
    #[error("the cluster is not healthy: {0}")]
    Unhealthy(String),
    #[error("timed out after {seconds} s waiting for {what}")]
    Timeout { what: String, seconds: u64 },
    #[error("no member has peer URL {0}")]
    NoSuchMember(String),
}

/// A member and what its own endpoint says about it.
#[derive(Debug, Clone)]
pub struct MemberView {
    pub member: Member,
    pub status: Result<EndpointStatus, String>,
}

impl MemberView {
    pub fn label(&self) -> String {
        if self.member.name.is_empty() { format!("{:x} (not started)", self.member.id) } else { self.member.name.clone() }
    }

    fn healthy(&self) -> bool {
        self.status.as_ref().is_ok_and(|s| s.errors.is_empty() && s.leader != 0)
    }
}

/// The cluster as seen now: the member list and each member's status.
#[derive(Debug, Clone)]
pub struct ClusterView {
    pub members: Vec<MemberView>,
}

impl ClusterView {
    pub async fn observe(client: &EtcdClient) -> Result<Self, EtcdError> {
        let mut members = Vec::new();
        for member in client.members().await? {
            let status = match member.client_urls.first() {
                None => Err("not started".to_string()),
                Some(url) => client.status(url).await.map_err(|e| e.to_string()),
            };
            members.push(MemberView { member, status });
        }
        Ok(ClusterView { members })
    }

    pub fn leader(&self) -> Option<&MemberView> {
        let id = self.members.iter().find_map(|m| m.status.as_ref().ok().map(|s| s.leader).filter(|l| *l != 0))?;
        self.members.iter().find(|m| m.member.id == id)
    }

    pub fn find_by_peer_url(&self, peer_url: &str) -> Option<&MemberView> {
        self.members.iter().find(|m| m.member.peer_urls.iter().any(|u| u == peer_url))
    }

    fn voters(&self) -> impl Iterator<Item = &MemberView> {
        self.members.iter().filter(|m| !m.member.is_learner)
    }

    /// Every member answers, reports no errors and sees a leader.
    pub fn check_all_healthy(&self) -> Result<(), MembershipError> {
        let sick: Vec<String> = self
            .members
            .iter()
            .filter(|m| !m.healthy())
            .map(|m| match &m.status {
                Err(e) => format!("{}: {e}", m.label()),
                Ok(s) if s.leader == 0 => format!("{}: no leader", m.label()),
                Ok(s) => format!("{}: {}", m.label(), s.errors.join("; ")),
            })
            .collect();
        if sick.is_empty() { Ok(()) } else { Err(MembershipError::Unhealthy(sick.join(", "))) }
    }

    /// May member `id` leave? Not when it is the last one, and not when the voting members
    /// left would not have a healthy majority among them.
    pub fn check_removal(&self, id: u64) -> Result<(), MembershipError> {
        let Some(target) = self.members.iter().find(|m| m.member.id == id) else {
            return Ok(()); // already gone: nothing to check
        };
        if self.members.len() == 1 {
            return Err(MembershipError::LastMember { name: target.label() });
        }
        let remaining: Vec<&MemberView> = self.voters().filter(|m| m.member.id != id).collect();
        let quorum = remaining.len() / 2 + 1;
        let healthy = remaining.iter().filter(|m| m.healthy()).count();
        if healthy < quorum {
            return Err(MembershipError::WouldLoseQuorum { name: target.label(), healthy, remaining: remaining.len(), quorum });
        }
        Ok(())
    }
}

/// Adds the member with `peer_url` as a learner, or returns the member a previous attempt
/// added. The caller then starts etcd with `initial-cluster-state=existing` and the initial
/// cluster this returns (`name=peer,…` of the started members plus this one).
///
/// etcd refuses membership changes for a few seconds after a member (re)connects
/// (`unhealthy cluster`) and while another learner is joining; those are retried until
/// `timeout`.
pub async fn add_learner(client: &EtcdClient, name: &str, peer_url: &str, timeout: Duration) -> Result<(Member, String), MembershipError> {
    let deadline = Instant::now() + timeout;
    let me = loop {
        let members = client.members().await?;
        if let Some(m) = members.iter().find(|m| m.peer_urls.iter().any(|u| u == peer_url)) {
            break m.clone();
        }
        match client.add_learner(&[peer_url.to_string()]).await {
            Ok(m) => break m,
            // Another member is joining (etcd allows one learner at a time).
            Err(e)
                if e.etcd_message().is_some_and(|m| m.contains("unhealthy cluster") || m.contains("too many learner"))
                    && Instant::now() < deadline =>
            {
                sleep(Duration::from_millis(POLL_INTERVAL_MS)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    let members = client.members().await?;
    let initial_cluster = members
        .iter()
        .filter_map(|m| {
            let own = m.id == me.id;
            let n = if own { name } else { m.name.as_str() };
            // Learners added for someone else and never started have no name yet.
            (!n.is_empty()).then(|| m.peer_urls.iter().map(|u| format!("{n}={u}")).collect::<Vec<_>>().join(","))
        })
        .collect::<Vec<_>>()
        .join(",");
    Ok((me, initial_cluster))
}

/// Promotes learner `id` once etcd considers it in sync with the leader (etcd refuses before),
/// retrying until `timeout`. A member that is already a voter is left as it is.
pub async fn promote_when_caught_up(client: &EtcdClient, id: u64, timeout: Duration) -> Result<(), MembershipError> {
    let deadline = Instant::now() + timeout;
    loop {
        let members = client.members().await?;
        match members.iter().find(|m| m.id == id) {
            None => return Err(MembershipError::NoSuchMember(format!("{id:x}"))),
            Some(m) if !m.is_learner => return Ok(()),
            Some(_) => {}
        }
        match client.promote(id).await {
            Ok(()) => return Ok(()),
            Err(e) if e.etcd_message().is_some_and(|m| m.contains("in sync with leader") || m.contains("not ready")) => {}
            Err(e) => return Err(e.into()),
        }
        if Instant::now() >= deadline {
            return Err(MembershipError::Timeout {
                what: format!("learner {id:x} to catch up with the leader"),
                seconds: timeout.as_secs(),
            });
        }
        sleep(Duration::from_millis(POLL_INTERVAL_MS)).await;
    }
}

/// If member `id` leads, hands leadership to the healthy voter that is furthest along.
/// Returns the new leader's id when leadership moved.
pub async fn move_leader_away(client: &EtcdClient, id: u64, timeout: Duration) -> Result<Option<u64>, MembershipError> {
    let view = ClusterView::observe(client).await?;
    let Some(leader) = view.leader() else {
        return Err(MembershipError::Unhealthy("the cluster has no leader".into()));
    };
    if leader.member.id != id {
        return Ok(None);
    }
    if !leader.healthy() {
        return Err(MembershipError::Unhealthy(format!("the leader {} does not answer", leader.label())));
    }
    let Some(target) = view
        .voters()
        .filter(|m| m.member.id != id && m.healthy())
        .max_by_key(|m| m.status.as_ref().map(|s| s.raft_applied_index).unwrap_or(0))
    else {
        return Ok(None); // a single voter: nobody to hand over to
    };
    let target_id = target.member.id;
    let leader_url = leader.member.client_urls.first().cloned().unwrap_or_default();
    client.move_leader(&leader_url, target_id).await?;
    let deadline = Instant::now() + timeout;
    loop {
        if client.status(&leader_url).await.is_ok_and(|s| s.leader == target_id) {
            return Ok(Some(target_id));
        }
        if Instant::now() >= deadline {
            return Err(MembershipError::Timeout { what: format!("leadership to move to {}", target.label()), seconds: timeout.as_secs() });
        }
        sleep(Duration::from_millis(POLL_INTERVAL_MS)).await;
    }
}

/// Waits until the member serving `endpoint` is healthy, sees a leader, and has applied
/// everything the leader had committed when the wait began.
pub async fn wait_caught_up(client: &EtcdClient, endpoint: &str, timeout: Duration) -> Result<EndpointStatus, MembershipError> {
    let deadline = Instant::now() + timeout;
    let mut target: Option<u64> = None;
    loop {
        let last = match client.status(endpoint).await {
            Ok(s) if s.leader != 0 && s.errors.is_empty() => {
                if target.is_none() {
                    target = leader_index(client, s.leader).await;
                }
                match target {
                    Some(t) if s.raft_applied_index >= t && client.healthy(endpoint).await => return Ok(s),
                    Some(t) => format!("applied index {} of {t}", s.raft_applied_index),
                    None => "the leader does not answer".into(),
                }
            }
            Ok(s) if s.leader == 0 => "no leader".into(),
            Ok(s) => s.errors.join("; "),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(MembershipError::Timeout {
                what: format!("{endpoint} to be healthy and caught up ({last})"),
                seconds: timeout.as_secs(),
            });
        }
        sleep(Duration::from_millis(POLL_INTERVAL_MS)).await;
    }
}

async fn leader_index(client: &EtcdClient, leader: u64) -> Option<u64> {
    let members = client.members().await.ok()?;
    let url = members.iter().find(|m| m.id == leader)?.client_urls.first()?.clone();
    client.status(&url).await.ok().map(|s| s.raft_index)
}

/// Removes member `id` unless that would cost the cluster its quorum or its last member;
/// `force` skips those checks. A leader hands over first. Removing a member that is already
/// gone succeeds.
pub async fn remove_member(client: &EtcdClient, id: u64, force: bool) -> Result<(), MembershipError> {
    let view = ClusterView::observe(client).await?;
    if !view.members.iter().any(|m| m.member.id == id) {
        return Ok(());
    }
    if !force {
        view.check_removal(id)?;
    }
    // A leader that removes itself leaves the others without one until an election ends;
    // hand over first so the cluster keeps serving throughout.
    if view.leader().is_some_and(|l| l.member.id == id && l.healthy()) {
        move_leader_away(client, id, LEADER_MOVE_TIMEOUT).await?;
    }
    match client.remove(id).await {
        Err(e) if e.etcd_message().is_some_and(|m| m.contains("member not found")) => Ok(()),
        other => Ok(other?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(members: &[(&str, bool, bool)]) -> ClusterView {
        // (name, learner, healthy); member ids 1, 2, 3…; member 1 leads.
        ClusterView {
            members: members
                .iter()
                .enumerate()
                .map(|(i, (name, learner, healthy))| MemberView {
                    member: Member {
                        id: i as u64 + 1,
                        name: name.to_string(),
                        peer_urls: vec![format!("https://10.0.0.{i}:2380")],
                        client_urls: vec![format!("https://10.0.0.{i}:2379")],
                        is_learner: *learner,
                    },
                    status: if *healthy {
                        Ok(EndpointStatus {
                            member_id: i as u64 + 1,
                            version: "3.5.1".into(),
                            db_size_bytes: 1,
                            leader: 1,
                            raft_index: 10,
                            raft_term: 2,
                            raft_applied_index: 10,
                            is_learner: *learner,
                            errors: vec![],
                        })
                    } else {
                        Err("connection refused".into())
                    },
                })
                .collect(),
        }
    }

    #[test]
    fn removal_keeps_quorum() {
        // Three healthy voters: any one may leave.
        let v = view(&[("a", false, true), ("b", false, true), ("c", false, true)]);
        assert!(v.check_removal(2).is_ok());
        // One of three down: removing a healthy one leaves 1 healthy of 2, quorum 2.
        let v = view(&[("a", false, true), ("b", false, true), ("c", false, false)]);
        let err = v.check_removal(2).expect_err("an error").to_string();
        assert_eq!(err, "removing member b would leave 1 healthy voting members of 2, below quorum 2");
        // …but the dead one may go: 2 healthy of 2.
        assert!(v.check_removal(3).is_ok());
        // A learner's removal never changes the quorum.
        let v = view(&[("a", false, true), ("b", false, true), ("c", true, false)]);
        assert!(v.check_removal(3).is_ok());
        // The last member.
        let v = view(&[("a", false, true)]);
        assert!(matches!(v.check_removal(1), Err(MembershipError::LastMember { .. })));
        // A member already gone.
        assert!(view(&[("a", false, true), ("b", false, true)]).check_removal(9).is_ok());
    }

    #[test]
    fn health_names_the_sick_members() {
        let v = view(&[("a", false, true), ("b", false, false)]);
        assert_eq!(v.check_all_healthy().expect_err("an error").to_string(), "the cluster is not healthy: b: connection refused");
        assert_eq!(v.leader().map(|m| m.member.name.as_str()), Some("a"));
    }
}
