//! The MachinePool resource: a selector, a template, and how changes roll out.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::machine::{EtcdMemberStatus, MachineSpec};
use crate::meta::{Condition, LabelSelector, Name, ObjectMeta};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachinePool {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: PoolSpec,
    #[serde(default)]
    pub status: PoolStatus,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSpec {
    pub selector: LabelSelector,
    pub template: MachineTemplate,
    #[serde(default)]
    pub rollout: RolloutSpec,
    #[serde(default)]
    pub deletion: DeletionSpec,
    /// How many machines the pool keeps: members beyond it are deleted (reset by their
    /// agents), picked by `deletion.order`. Unset: every matching machine stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// The Kubernetes cluster whose nodes the pool's machines are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<PoolKubernetes>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolKubernetes {
    /// A registered KubernetesCluster.
    pub cluster: Name,
    /// When set, the controller drains a machine's node before its agent disrupts it and
    /// brings the node back after. Unset: nodes are not touched (for operators who drain
    /// by other means, or run workloads that tolerate a restart in place).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<DrainSpec>,
}

/// How a pool's nodes are drained (DESIGN.md, "Kubernetes nodes").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DrainSpec {
    /// How long evictions may take before the drain gives up: the node is uncordoned, the
    /// disruption is not granted, and the machine's `Drained` condition names what stayed.
    #[serde(default = "default_drain_timeout")]
    pub timeout_seconds: u64,
    /// How long a machine whose drain gave up waits before its node is drained again.
    #[serde(default = "default_drain_retry")]
    pub retry_after_seconds: u64,
}

pub const MIN_DRAIN_SECONDS: u64 = 10;
pub const MAX_DRAIN_SECONDS: u64 = 24 * 3600;

fn default_drain_timeout() -> u64 {
    600
}

fn default_drain_retry() -> u64 {
    300
}

impl Default for DrainSpec {
    fn default() -> Self {
        DrainSpec { timeout_seconds: default_drain_timeout(), retry_after_seconds: default_drain_retry() }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineTemplate {
    #[serde(default)]
    pub spec: MachineSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutSpec {
    #[serde(default = "default_max_unavailable")]
    pub max_unavailable: IntOrPercent,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<Name>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanarySpec>,
    #[serde(default = "default_max_failures")]
    pub max_failures: u32,
    #[serde(default)]
    pub paused: bool,
    /// Machines with the same value of this label form a wave; a wave starts only when the
    /// one before it is done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave_label: Option<String>,
    /// When the rollout halts, roll back to the previous revision by itself.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_undo: bool,
    /// How many earlier revisions are kept for `rollout undo`.
    #[serde(default = "default_history")]
    pub revision_history_limit: u32,
    /// When disruptive steps may start; always when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub maintenance_windows: Vec<crate::window::MaintenanceWindow>,
}

impl Default for RolloutSpec {
    fn default() -> Self {
        RolloutSpec {
            max_unavailable: default_max_unavailable(),
            after: Vec::new(),
            canary: None,
            max_failures: default_max_failures(),
            paused: false,
            wave_label: None,
            auto_undo: false,
            revision_history_limit: default_history(),
            maintenance_windows: Vec::new(),
        }
    }
}

fn default_history() -> u32 {
    10
}

fn default_max_unavailable() -> IntOrPercent {
    IntOrPercent::Int(1)
}

fn default_max_failures() -> u32 {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CanarySpec {
    pub machines: u32,
    #[serde(default)]
    pub soak_seconds: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeletionSpec {
    #[serde(default)]
    pub order: DeletionOrder,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeletionOrder {
    Random,
    Newest,
    #[default]
    Oldest,
}

/// A count of machines, or a percentage of the pool ("10%"), rounded down and at least 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntOrPercent {
    Int(u32),
    Percent(u32),
}

impl IntOrPercent {
    /// The number of machines this allows out of `total`: rounded down, never below one.
    pub fn resolve(self, total: usize) -> usize {
        let n = match self {
            IntOrPercent::Int(n) => n as usize,
            IntOrPercent::Percent(p) => total * p as usize / 100,
        };
        n.max(1)
    }
}

impl fmt::Display for IntOrPercent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IntOrPercent::Int(n) => write!(f, "{n}"),
            IntOrPercent::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl Serialize for IntOrPercent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            IntOrPercent::Int(n) => s.serialize_u32(*n),
            IntOrPercent::Percent(_) => s.collect_str(self),
        }
    }
}

impl<'de> Deserialize<'de> for IntOrPercent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u32),
            Text(String),
        }
        let bad = |s: &str| serde::de::Error::custom(format!("{s:?} is not a count or a percentage such as \"10%\""));
        match Raw::deserialize(d)? {
            Raw::Int(n) if n > 0 => Ok(IntOrPercent::Int(n)),
            Raw::Int(n) => Err(bad(&n.to_string())),
            Raw::Text(s) => match s.strip_suffix('%').map(str::parse::<u32>) {
                Some(Ok(p)) if (1..=100).contains(&p) => Ok(IntOrPercent::Percent(p)),
                _ => Err(bad(&s)),
            },
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolStatus {
    #[serde(default)]
    pub revision: u64,
    #[serde(default)]
    pub machines: u32,
    #[serde(default)]
    pub updated: u32,
    #[serde(default)]
    pub updating: u32,
    #[serde(default)]
    pub ready: u32,
    #[serde(default)]
    pub degraded: u32,
    /// Members not yet given the current revision.
    #[serde(default)]
    pub waiting: u32,
    /// The wave being rolled out (the value of `waveLabel`), when waves are used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wave: Option<String>,
    /// Why the rollout is not moving, when it is not.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The etcd cluster of a pool whose template has `etcd`, as its members report it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<PoolEtcdStatus>,
}

/// An etcd pool's cluster: every member its machines report, and where clients connect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolEtcdStatus {
    pub cluster: Name,
    /// Voting members (learners excluded).
    #[serde(default)]
    pub voters: u32,
    /// Voting members that answer and see a leader.
    #[serde(default)]
    pub healthy_voters: u32,
    /// Voters the cluster needs to make progress: a majority of `voters`.
    #[serde(default)]
    pub quorum: u32,
    /// The machine whose member leads, when one reports leading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<Name>,
    /// Client URLs of the voting members, for kube-apiserver's `--etcd-servers`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub client_endpoints: Vec<String>,
    /// One entry per machine reporting a member of this cluster, by machine name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<PoolEtcdMember>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolEtcdMember {
    pub machine: Name,
    pub member: EtcdMemberStatus,
}

impl PoolEtcdStatus {
    /// Sums up the members that `machines` (name, reported member) report for `cluster`.
    pub fn from_members(cluster: &Name, machines: impl IntoIterator<Item = (Name, EtcdMemberStatus)>) -> Self {
        let mut members: Vec<PoolEtcdMember> = machines
            .into_iter()
            .filter(|(_, m)| &m.cluster == cluster)
            .map(|(machine, member)| PoolEtcdMember { machine, member })
            .collect();
        members.sort_by(|a, b| a.machine.cmp(&b.machine));
        let voters: Vec<&PoolEtcdMember> = members.iter().filter(|m| !m.member.learner).collect();
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        Self {
            cluster: cluster.clone(),
            voters: count(voters.len()),
            healthy_voters: count(voters.iter().filter(|m| m.member.healthy).count()),
            quorum: count(voters.len() / 2 + 1),
            leader: members.iter().find(|m| m.member.leader).map(|m| m.machine.clone()),
            client_endpoints: voters.iter().map(|m| m.member.client_url.clone()).collect(),
            members,
        }
    }
}

/// One revision of a pool's template, kept for history and undo.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolRevision {
    pub revision: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub created: crate::meta::Timestamp,
    /// What made it: an apply, or an undo to an earlier revision.
    pub cause: String,
    pub template: MachineTemplate,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn etcd_status_sums_up_the_reported_members_of_its_cluster() {
        let name = |s: &str| s.parse::<Name>().unwrap_or_else(|e| panic!("{e:?}"));
        let member = |cluster: &str, id: &str, leader: bool, learner: bool, healthy: bool| EtcdMemberStatus {
            cluster: name(cluster),
            member_id: id.into(),
            client_url: format!("https://{id}:2379"),
            peer_url: format!("https://{id}:2380"),
            version: "3.5.1".into(),
            learner,
            leader,
            raft_index: 7,
            db_size_bytes: 1,
            alarms: vec![],
            healthy,
            last_snapshot: None,
        };
        let reported = [
            (name("m3"), member("main", "c", false, true, true)),
            (name("m1"), member("main", "a", false, false, false)),
            (name("m2"), member("main", "b", true, false, true)),
            (name("x1"), member("other", "d", true, false, true)),
        ];
        let s = PoolEtcdStatus::from_members(&name("main"), reported);
        assert_eq!((s.voters, s.healthy_voters, s.quorum), (2, 1, 2));
        assert_eq!(s.leader, Some(name("m2")));
        assert_eq!(s.client_endpoints, ["https://a:2379", "https://b:2379"], "voters only");
        let machines: Vec<&str> = s.members.iter().map(|m| m.machine.as_str()).collect();
        assert_eq!(machines, ["m1", "m2", "m3"], "by machine name, the other cluster left out");
    }

    #[test]
    fn max_unavailable_rounds_down_and_is_at_least_one() {
        assert_eq!(IntOrPercent::Percent(10).resolve(40), 4);
        assert_eq!(IntOrPercent::Percent(10).resolve(19), 1);
        assert_eq!(IntOrPercent::Percent(10).resolve(5), 1);
        assert_eq!(IntOrPercent::Int(3).resolve(2), 3);
    }

    #[test]
    fn int_or_percent_parses_both_forms() {
        let v: IntOrPercent = serde_json::from_str("\"25%\"").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v, IntOrPercent::Percent(25));
        let v: IntOrPercent = serde_json::from_str("2").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(v, IntOrPercent::Int(2));
        assert!(serde_json::from_str::<IntOrPercent>("\"0%\"").is_err());
        assert!(serde_json::from_str::<IntOrPercent>("0").is_err());
        assert!(serde_json::from_str::<IntOrPercent>("\"ten\"").is_err());
    }
}
