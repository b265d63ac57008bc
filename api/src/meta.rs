//! Object metadata, conditions and the small strict scalar types shared by every resource.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use time::OffsetDateTime;

/// The API group and version of every keelson resource.
pub const API_VERSION: &str = "keelson.io/v1alpha1";

/// Timestamps on the wire are RFC 3339.
pub type Timestamp = OffsetDateTime;

pub fn now() -> Timestamp {
    OffsetDateTime::now_utc()
}

/// A DNS-1123 label: at most 63 lowercase letters, digits and '-', starting and ending with
/// a letter or digit. Machine, pool and token names are labels.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Name(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a valid name (a DNS-1123 label: at most 63 characters of a-z, 0-9 and '-', starting and ending with a letter or digit)"
)]
pub struct NameError(pub String);

impl Name {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Name {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let b = s.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= 63
            && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-';
        if ok { Ok(Name(s.to_owned())) } else { Err(NameError(s.to_owned())) }
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Name {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Name {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

impl std::borrow::Borrow<str> for Name {
    fn borrow(&self) -> &str {
        &self.0
    }
}

/// A lowercase hex SHA-256 digest (64 characters).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sha256Digest(String);

impl Sha256Digest {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Sha256Digest {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b.to_ascii_lowercase())) {
            Ok(Sha256Digest(s.to_ascii_lowercase()))
        } else {
            Err(format!("{s:?} is not a sha256 digest (64 hex characters)"))
        }
    }
}

impl fmt::Display for Sha256Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for Sha256Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Sha256Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Kubernetes-style object metadata. `generation`, `resourceVersion`, `creationTimestamp`
/// and `uid` are set by the controller; what a client sends for them is ignored, except
/// `resourceVersion`, which makes an update conditional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ObjectMeta {
    pub name: Option<Name>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub generation: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    pub creation_timestamp: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Set by the controller when deletion was asked for and waits on the machine's agent.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    pub deletion_timestamp: Option<Timestamp>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl ObjectMeta {
    pub fn named(name: Name) -> Self {
        ObjectMeta { name: Some(name), ..ObjectMeta::default() }
    }

    /// The name, or "" for an object that has none yet (validation rejects those).
    pub fn name_str(&self) -> &str {
        self.name.as_ref().map(Name::as_str).unwrap_or("")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

impl fmt::Display for ConditionStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConditionStatus::True => "True",
            ConditionStatus::False => "False",
            ConditionStatus::Unknown => "Unknown",
        })
    }
}

/// One observation about an object, as in Kubernetes: decisions read conditions, never phases.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Condition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: ConditionStatus,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    #[serde(with = "time::serde::rfc3339")]
    pub last_transition_time: Timestamp,
}

/// Condition types with a fixed meaning.
pub mod condition {
    pub const READY: &str = "Ready";
    pub const UP_TO_DATE: &str = "UpToDate";
    pub const UPDATING: &str = "Updating";
    pub const DEGRADED: &str = "Degraded";
    pub const REACHABLE: &str = "Reachable";
    /// Machine, set by the controller: whether the machine's Kubernetes node is cordoned and
    /// emptied of the pods a drain moves, and while it is not, what is still in the way.
    pub const DRAINED: &str = "Drained";
    /// The conditions the controller sets on a machine; an agent's report never changes them.
    pub const SET_BY_CONTROLLER: &[&str] = &[REACHABLE, DRAINED];
    /// Pool: the rollout stopped because too many machines of the current revision failed.
    pub const ROLLOUT_HALTED: &str = "RolloutHalted";
    /// Pool: every member runs the current revision, converged.
    pub const ROLLED_OUT: &str = "RolledOut";
}

/// Annotations with a fixed meaning.
pub mod annotation {
    /// On a machine: its place in a rollout; higher goes first (default 0).
    pub const ROLLOUT_PRIORITY: &str = "keelson.io/rollout-priority";
    /// On a machine: pick it first when a pool shrinks.
    pub const DELETE_MACHINE: &str = "keelson.io/delete-machine";
    /// On a machine, `"true"`: when it is deleted, its etcd member leaves the cluster even if
    /// that costs the cluster its quorum or its last member. Set by `keelson delete machine
    /// NAME --force-etcd-leave`.
    pub const FORCE_ETCD_LEAVE: &str = "keelson.io/force-etcd-leave";
    /// On a machine: the name of its Kubernetes node, when it is not the machine's hostname
    /// (`kubelet --hostname-override`).
    pub const NODE_NAME: &str = "keelson.io/node-name";
    /// On a Kubernetes pod, `"true"`: a drain leaves the pod where it is (it goes down with
    /// its node), as it leaves DaemonSet and mirror pods.
    pub const EXCLUDE_FROM_DRAIN: &str = "keelson.io/exclude-from-drain";
}

/// Finds a condition by type.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Sets a condition, keeping its transition time when the status does not change.
/// Returns whether anything changed.
pub fn set_condition(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: ConditionStatus,
    reason: &str,
    message: &str,
    at: Timestamp,
) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(c) => {
            let changed = c.status != status || c.reason != reason || c.message != message;
            if c.status != status {
                c.last_transition_time = at;
            }
            c.status = status;
            c.reason = reason.to_owned();
            c.message = message.to_owned();
            changed
        }
        None => {
            conditions.push(Condition {
                type_: type_.to_owned(),
                status,
                reason: reason.to_owned(),
                message: message.to_owned(),
                last_transition_time: at,
            });
            true
        }
    }
}

/// A label selector: every listed label must match.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LabelSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

impl LabelSelector {
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_dns_labels() {
        for good in ["a", "worker-07", "0abc", &"a".repeat(63)] {
            assert!(good.parse::<Name>().is_ok(), "{good}");
        }
        for bad in ["", "-a", "a-", "Worker", "a_b", "a.b", &"a".repeat(64)] {
            assert!(bad.parse::<Name>().is_err(), "{bad}");
        }
    }

    #[test]
    fn set_condition_keeps_transition_time_when_status_holds() {
        let t0 = now();
        let t1 = t0 + time::Duration::seconds(5);
        let mut conds = Vec::new();
        assert!(set_condition(&mut conds, "Ready", ConditionStatus::True, "A", "", t0));
        assert!(set_condition(&mut conds, "Ready", ConditionStatus::True, "B", "", t1));
        assert_eq!(conds[0].last_transition_time, t0);
        assert!(!set_condition(&mut conds, "Ready", ConditionStatus::True, "B", "", t1));
        assert!(set_condition(&mut conds, "Ready", ConditionStatus::False, "B", "", t1));
        assert_eq!(conds[0].last_transition_time, t1);
    }
}
