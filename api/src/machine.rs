//! The Machine resource: what one machine should be (spec) and what it is (status).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use url::Url;

use crate::meta::{Condition, Name, ObjectMeta, Sha256Digest, Timestamp};
use crate::version::KubeVersion;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Machine {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: MachineSpec,
    #[serde(default)]
    pub status: MachineStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    ControlPlane,
    Worker,
    Etcd,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::ControlPlane => "control-plane",
            Role::Worker => "worker",
            Role::Etcd => "etcd",
        })
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub roles: Vec<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os: Option<OsSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_runtime: Option<ContainerRuntimeSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubelet: Option<KubeletSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeadm: Option<KubeadmSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<FileSpec>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scripts: Vec<ScriptSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkSpec>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OsSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repositories: Vec<Repository>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packages: Vec<PackagePin>,
    #[serde(default)]
    pub reboot: RebootPolicy,
}

/// An apt (deb822) or dnf repository the agent manages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Repository {
    pub name: Name,
    pub uris: Vec<Url>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub suites: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub components: Vec<String>,
    /// Path of the keyring that signs the repository; unsigned repositories need `trusted`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed_by: Option<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trusted: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PackagePin {
    pub name: PackageName,
    pub version: PackageVersion,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RebootPolicy {
    Never,
    #[default]
    IfRequired,
    Always,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerRuntimeSpec {
    pub name: RuntimeName,
    pub version: String,
    pub source: Source,
    #[serde(default)]
    pub config: RuntimeConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeName {
    Containerd,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RuntimeConfig {
    #[serde(default = "default_true")]
    pub systemd_cgroup: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig { systemd_cgroup: true }
    }
}

fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeletSpec {
    pub version: KubeVersion,
    pub source: Source,
}

/// kubeadm: installed at `version`, and on a node that has joined its cluster, the node
/// upgraded with it before the kubelet step (`kubeadm upgrade apply` on the control-plane
/// machine the controller chooses, `kubeadm upgrade node` everywhere else).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KubeadmSpec {
    pub version: KubeVersion,
    pub source: Source,
}

/// Which kubeadm upgrade a machine runs, as the controller says with its disruption lease:
/// the first control-plane machine of a cluster to reach a version upgrades the cluster
/// (`kubeadm upgrade apply vX.Y.Z`), every other machine then upgrades itself to it
/// (`kubeadm upgrade node`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KubeadmUpgrade {
    Apply,
    Node,
}

impl fmt::Display for KubeadmUpgrade {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KubeadmUpgrade::Apply => "apply",
            KubeadmUpgrade::Node => "node",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EtcdSpec {
    pub cluster: Name,
    pub version: String,
    pub source: Source,
}

/// Where a component comes from: a package from the managed repositories, or an artifact
/// pinned by its digest. Validation requires exactly one, and a digest with every URL.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Source {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub package: Option<PackageName>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<Url>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<Sha256Digest>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileSpec {
    pub path: String,
    pub content: String,
    #[serde(default)]
    pub mode: FileMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// A Unix permission mode written as an octal string ("0644"); YAML integers are refused
/// because YAML 1.1 and 1.2 read `0644` differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileMode(pub u32);

impl Default for FileMode {
    fn default() -> Self {
        FileMode(0o644)
    }
}

impl FromStr for FileMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u32::from_str_radix(s, 8)
            .ok()
            .filter(|m| !s.is_empty() && *m <= 0o7777)
            .map(FileMode)
            .ok_or_else(|| format!("{s:?} is not an octal file mode such as \"0644\""))
    }
}

impl Serialize for FileMode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:04o}", self.0))
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ScriptSpec {
    pub name: Name,
    pub when: ScriptWhen,
    pub run: Vec<String>,
    #[serde(default = "default_script_timeout")]
    pub timeout_seconds: u32,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

fn default_script_timeout() -> u32 {
    300
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ScriptWhen {
    PreUpgrade,
    PostUpgrade,
    Bootstrap,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ntp: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<InterfaceSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InterfaceSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dhcp: bool,
}

/// A package name as Debian and RPM allow them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PackageName(String);

impl PackageName {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for PackageName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = s.len() >= 2
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.' | b'_'));
        if ok { Ok(PackageName(s.to_owned())) } else { Err(format!("{s:?} is not a package name")) }
    }
}

impl fmt::Display for PackageName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for PackageName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for PackageName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A package version in the syntax of dpkg or rpm; which one applies is the machine's
/// package manager's business, so both syntaxes are accepted here.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PackageVersion(String);

impl PackageVersion {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for PackageVersion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.parse::<crate::version::DebVersion>().is_ok() || s.parse::<crate::version::RpmVersion>().is_ok() {
            Ok(PackageVersion(s.to_owned()))
        } else {
            Err(format!("{s:?} is not a package version"))
        }
    }
}

impl fmt::Display for PackageVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for PackageVersion {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for PackageVersion {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

// ---------------------------------------------------------------------------------------------
// Status

/// Informational only: decisions read conditions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    Pending,
    Enrolled,
    Converging,
    Ready,
    Degraded,
    Unreachable,
    Deleting,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MachineStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    #[serde(default)]
    pub observed_generation: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    #[serde(default)]
    pub versions: Versions,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<Facts>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step: Option<CurrentStep>,
    #[serde(default, skip_serializing_if = "Option::is_none", with = "time::serde::rfc3339::option")]
    pub last_heartbeat_time: Option<Timestamp>,
    /// The pool whose template is this machine's spec; set by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<Name>,
    /// The pool revision the spec came from; set by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_revision: Option<u64>,
    /// The machine's etcd member, as its agent last saw it (role etcd only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdMemberStatus>,
}

/// An etcd member as its machine's agent reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EtcdMemberStatus {
    pub cluster: Name,
    /// The member ID etcd gave it, in hex as etcdctl prints it.
    pub member_id: String,
    pub client_url: String,
    pub peer_url: String,
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub learner: bool,
    #[serde(default)]
    pub leader: bool,
    #[serde(default)]
    pub raft_index: u64,
    #[serde(default)]
    pub db_size_bytes: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub alarms: Vec<String>,
    /// The member answers and sees a leader.
    #[serde(default)]
    pub healthy: bool,
    /// The last snapshot taken on the machine before a change to the member.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_snapshot: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Versions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub os: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_runtime: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubelet: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeadm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd: Option<String>,
}

/// What a machine is, as a cluster autoscaler needs it to predict capacity.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Facts {
    #[serde(default)]
    pub cpus: u32,
    #[serde(default)]
    pub memory_bytes: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<Gpu>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<Disk>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os_release: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpu {
    pub vendor: String,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pci_address: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Disk {
    pub name: String,
    pub size_bytes: u64,
    #[serde(default)]
    pub rotational: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CurrentStep {
    pub index: u32,
    pub total: u32,
    pub description: String,
}

impl Machine {
    pub fn new(name: Name) -> Self {
        Machine {
            api_version: crate::API_VERSION.to_owned(),
            kind: crate::KIND_MACHINE.to_owned(),
            metadata: ObjectMeta::named(name),
            spec: MachineSpec::default(),
            status: MachineStatus::default(),
        }
    }

    /// Done means the agent has seen this generation and reports itself up to date and ready.
    pub fn is_converged(&self) -> bool {
        use crate::meta::{ConditionStatus, condition, find_condition};
        let is_true = |t| find_condition(&self.status.conditions, t).is_some_and(|c| c.status == ConditionStatus::True);
        self.status.observed_generation == self.metadata.generation && is_true(condition::UP_TO_DATE) && is_true(condition::READY)
    }
}
