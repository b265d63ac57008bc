//! Messages of the agent protocol and the API's error and watch envelopes.

use serde::{Deserialize, Serialize};

use crate::machine::{CurrentStep, EtcdMemberStatus, Facts, MachineSpec, Phase, Versions};
use crate::meta::{Condition, Name};

/// `POST /v1/enroll`: a bootstrap token, a CSR made on the machine, and its facts.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnrollRequest {
    pub token: String,
    /// PEM; its subject CN must be the machine name.
    pub csr: String,
    /// The machine name; the CSR's CN when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Name>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<Facts>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnrollResponse {
    pub name: Name,
    /// PEM client certificate, CN = machine name.
    pub certificate: String,
    /// PEM CA bundle that signs the controller and every identity.
    pub ca_bundle: String,
}

/// `POST /v1/agent/etcd/certificate` (a member's CSR; the controller names it) and
/// `POST /v1/etcd/{cluster}/client-certificates` (an operator's CSR and the client's name).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EtcdCertificateRequest {
    pub csr: String,
    /// Client certificates only: the common name, e.g. `kube-apiserver`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub common_name: Option<String>,
    /// Member certificates only: the addresses the member advertises (IP addresses), named
    /// in the certificate with the machine's reported ones.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
}

/// A certificate signed by an etcd cluster's CA, and that CA.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EtcdCertificate {
    pub cluster: Name,
    pub certificate: String,
    pub ca: String,
    #[serde(with = "time::serde::rfc3339")]
    pub not_after: time::OffsetDateTime,
}

/// `GET /v1/agent/etcd/cluster`: what a joining member needs from the controller.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EtcdClusterInfo {
    pub cluster: Name,
    /// This machine starts the cluster: no member exists, and it holds the claim to be first.
    pub initialize: bool,
    /// The machine holding the claim to start the cluster, when another one does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initializer: Option<Name>,
    /// Client URLs of the members the cluster's machines report, to join through.
    #[serde(default)]
    pub client_urls: Vec<String>,
}

/// `GET /v1/agent/spec?after=G`: the machine's spec at its current generation.
/// `changed` is false when the long-poll timed out with nothing newer than `after`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentSpec {
    pub name: Name,
    pub generation: u64,
    pub changed: bool,
    pub spec: MachineSpec,
    /// The machine is being deleted: reset it, then say so (`POST /v1/agent/reset`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleting: bool,
    /// The operator forced the deletion of an etcd member (`keelson delete machine NAME
    /// --force-etcd-leave`): leave the cluster even when that costs it its quorum, or when this
    /// is its last member.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub force_etcd_leave: bool,
}

/// `POST /v1/agent/reset`: the agent has reset the machine; the controller forgets it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResetDone {
    /// What the reset did, for the events.
    pub summary: String,
}

/// `PUT /v1/agent/status`: what the agent observed and did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub versions: Versions,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<Facts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step: Option<CurrentStep>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdMemberStatus>,
}

/// `POST /v1/tokens`: what the new token allows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenRequest {
    /// Lifetime in seconds; 24 hours when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage_limit: Option<u32>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_reenroll: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
}

/// The answer to `POST /v1/tokens`: the only time the secret is shown.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenCreated {
    pub token: String,
    pub resource: crate::token::BootstrapToken,
}

/// One event of a machine's history (`keelson events machine/NAME`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Event {
    #[serde(with = "time::serde::rfc3339")]
    pub time: crate::meta::Timestamp,
    /// Normal or Warning.
    #[serde(rename = "type")]
    pub type_: String,
    pub reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// Who reported it: "controller" or "agent".
    pub source: String,
}

/// `POST /v1/agent/events`: events the agent reports about its own machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentEvents {
    pub events: Vec<Event>,
}

/// One line of a watch stream (newline-delimited JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WatchEvent {
    /// ADDED, MODIFIED, DELETED; ERROR when the stream cannot go on (see `object`).
    #[serde(rename = "type")]
    pub type_: String,
    pub object: serde_json::Value,
}

/// The body of every error answer: a stable machine-readable `reason`, a message for people,
/// and the offending field when there is one.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ErrorBody {
    pub reason: String,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// A list answer: the items and the store revision they were read at (for a later watch).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct List<T> {
    pub items: Vec<T>,
    pub resource_version: String,
}
