//! Observation: what is installed and running on this machine, read from the dpkg status
//! database, /proc, the kernel symlinks and the managed files. Everything is read under a
//! root directory so tests can observe a fake tree.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use keelson_api::machine::{MachineSpec, Versions};

use crate::drivers::packages::Manager;
use crate::ledger::Ledger;
use sha2::{Digest, Sha256};

/// Where the agent keeps the repositories it manages.
pub const SOURCES_FILE: &str = "etc/apt/sources.list.d/keelson.sources";
pub const CONTAINERD_CONFIG: &str = "etc/containerd/config.toml";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    pub version: String,
    pub held: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileState {
    pub sha256: String,
    pub mode: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    pub packages: BTreeMap<String, Installed>,
    /// `uname -r`.
    pub running_kernel: String,
    /// The kernel the boot loader starts next (`/vmlinuz`'s target), when known.
    pub boot_kernel: Option<String>,
    /// `/run/reboot-required` exists.
    pub reboot_required: bool,
    pub boot_id: String,
    /// Current content of the files the spec manages (including the sources and runtime
    /// configuration), by absolute path; absent files are missing from the map.
    pub files: BTreeMap<String, FileState>,
    /// What `kubelet --version` says, when the spec has a kubelet and one is installed.
    pub kubelet_version: Option<String>,
    /// What `kubeadm version` says, when the spec has kubeadm and it is installed.
    pub kubeadm_version: Option<String>,
    /// The version the node was last upgraded to with kubeadm, when it has joined a cluster
    /// (spec with kubeadm only): the ledger's record, or for a node keelson has not upgraded
    /// yet, the kubelet's version (the node is at the version it was set up with).
    pub kubeadm_node: Option<String>,
    /// Bootstrap scripts that have succeeded here (from the ledger).
    pub bootstrapped: BTreeSet<String>,
    /// The digest of the containerd release tarball whose binaries are in place, unchanged.
    pub runtime_artifact: Option<String>,
    /// What the etcd binary the spec's source implies says it is (role etcd only).
    pub etcd_version: Option<String>,
    /// etcd's data directory holds a member: it joined (or started) the cluster before.
    pub etcd_member: bool,
    /// Why the member's certificate must be renewed (near its end, missing, unreadable), when
    /// it must.
    pub etcd_certificate_due: Option<String>,
    pub package_manager: Manager,
}

#[derive(Debug, thiserror::Error)]
#[error("observing {path}: {message}")]
pub struct ObserveError {
    pub path: PathBuf,
    pub message: String,
}

/// Parses dpkg's status database: packages whose status is "installed", with their
/// version and whether they are held.
pub fn parse_dpkg_status(text: &str) -> BTreeMap<String, Installed> {
    let mut out = BTreeMap::new();
    for para in text.split("\n\n") {
        let (mut name, mut version, mut status) = (None, None, None);
        for line in para.lines() {
            if let Some(v) = line.strip_prefix("Package: ") {
                name = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Version: ") {
                version = Some(v.trim());
            } else if let Some(v) = line.strip_prefix("Status: ") {
                status = Some(v.trim());
            }
        }
        if let (Some(name), Some(version), Some(status)) = (name, version, status) {
            let words: Vec<&str> = status.split_whitespace().collect();
            if words.len() == 3 && words[2] == "installed" {
                out.insert(name.to_owned(), Installed { version: version.to_owned(), held: words[0] == "hold" });
            }
        }
    }
    out
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The kernel release in a `/vmlinuz` target such as `boot/vmlinuz-6.1.0-41-amd64`.
pub fn kernel_from_image_name(target: &str) -> Option<String> {
    target.rsplit('/').next()?.strip_prefix("vmlinuz-").map(str::to_owned)
}

/// Observes the machine rooted at `root` for `spec`; `ledger` says what keelson installed
/// outside the package database.
pub fn observe(root: &Path, ledger: &Ledger, spec: &MachineSpec) -> Result<Observed, ObserveError> {
    let at = |p: &str| root.join(p.trim_start_matches('/'));
    let manager = Manager::detect(root).ok_or_else(|| ObserveError {
        path: root.to_owned(),
        message: "neither dpkg's nor rpm's database is here: this agent manages Debian and RHEL family systems".into(),
    })?;
    let read = |p: &str| std::fs::read_to_string(at(p)).map(|s| s.trim().to_owned()).unwrap_or_default();
    let boot_kernel = std::fs::read_link(at("vmlinuz")).ok().and_then(|t| kernel_from_image_name(&t.to_string_lossy()));
    let mut paths: Vec<String> = spec.files.iter().map(|f| f.path.clone()).collect();
    paths.push(format!("/{}", manager.sources_file()));
    paths.push(format!("/{CONTAINERD_CONFIG}"));
    if spec.container_runtime.as_ref().is_some_and(|r| r.source.url.is_some()) {
        paths.push(crate::drivers::containerd::UNIT.to_owned());
    }
    if spec.kubelet.is_some() {
        paths.push(crate::drivers::kubelet::UNIT.to_owned());
        paths.push(crate::drivers::kubelet::DROPIN.to_owned());
    }
    if spec.etcd.is_some() {
        paths.push(crate::drivers::etcd::UNIT.to_owned());
        paths.push(crate::drivers::etcd::ENV_FILE.to_owned());
    }
    let mut files = BTreeMap::new();
    for p in paths {
        use std::os::unix::fs::PermissionsExt;
        let full = at(&p);
        if let (Ok(bytes), Ok(meta)) = (std::fs::read(&full), std::fs::metadata(&full)) {
            files.insert(p, FileState { sha256: sha256_hex(&bytes), mode: meta.permissions().mode() & 0o7777 });
        }
    }
    Ok(Observed {
        packages: manager.installed(root)?,
        running_kernel: read("proc/sys/kernel/osrelease"),
        boot_kernel,
        reboot_required: at("run/reboot-required").exists(),
        boot_id: read("proc/sys/kernel/random/boot_id"),
        files,
        kubelet_version: spec.kubelet.as_ref().and_then(|_| crate::drivers::kubelet::installed_version(root)),
        kubeadm_version: spec.kubeadm.as_ref().and_then(|_| crate::drivers::kubeadm::installed_version(root)),
        kubeadm_node: spec.kubeadm.as_ref().filter(|_| crate::drivers::kubeadm::node_joined(root)).map(|_| {
            ledger
                .kubeadm_upgraded
                .clone()
                .or_else(|| crate::drivers::kubelet::installed_version(root))
                .unwrap_or_else(|| "unknown".to_owned())
        }),
        bootstrapped: ledger.bootstrapped.clone(),
        runtime_artifact: ledger.intact_runtime_artifact(root).map(|a| a.sha256.clone()),
        etcd_version: spec
            .etcd
            .as_ref()
            .and_then(|e| crate::drivers::etcd::installed_version(root, crate::drivers::etcd::binary(e.source.url.is_some()))),
        etcd_member: spec.etcd.is_some() && crate::drivers::etcd::has_member_data(root),
        etcd_certificate_due: spec.etcd.as_ref().filter(|_| crate::drivers::etcd::has_member_data(root)).and_then(|_| {
            crate::etcd::pki::renewal_reason(
                &root.join(crate::drivers::etcd::PKI_DIR.trim_start_matches('/')),
                &[],
                time::OffsetDateTime::now_utc(),
            )
        }),
        package_manager: manager,
    })
}

/// The versions of what `spec` manages, for the status.
pub fn versions(o: &Observed, ledger: &Ledger, spec: &MachineSpec) -> Versions {
    let mut v = Versions {
        kernel: Some(o.running_kernel.clone()),
        kubelet: o.kubelet_version.clone(),
        kubeadm: o.kubeadm_version.clone(),
        ..Versions::default()
    };
    if let Some(os) = &spec.os {
        for p in &os.packages {
            if let Some(i) = o.packages.get(p.name.as_str()) {
                v.os.insert(p.name.to_string(), i.version.clone());
            }
        }
    }
    if spec.etcd.is_some() {
        v.etcd = o.etcd_version.clone();
    }
    if let Some(rt) = &spec.container_runtime {
        v.container_runtime = match &rt.source.package {
            Some(name) => o.packages.get(name.as_str()).map(|i| i.version.clone()),
            None => o.runtime_artifact.as_ref().and(ledger.runtime_artifact.as_ref()).map(|a| a.version.clone()),
        };
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Package: containerd\nStatus: hold ok installed\nPriority: optional\nVersion: 1.6.20~ds1-1+deb12u2\nDescription: daemon\n multi-line\n\nPackage: removed-one\nStatus: deinstall ok config-files\nVersion: 1.0\n\nPackage: openssl\nStatus: install ok installed\nVersion: 3.0.17-1~deb12u2\n";

    #[test]
    fn parses_dpkg_status() {
        let p = parse_dpkg_status(STATUS);
        assert_eq!(p.len(), 2, "config-files only packages are not installed");
        assert_eq!(p["containerd"], Installed { version: "1.6.20~ds1-1+deb12u2".into(), held: true });
        assert_eq!(p["openssl"], Installed { version: "3.0.17-1~deb12u2".into(), held: false });
    }

    #[test]
    fn reads_the_kernel_release_from_the_image_link() {
        assert_eq!(kernel_from_image_name("boot/vmlinuz-6.1.0-41-amd64").as_deref(), Some("6.1.0-41-amd64"));
        assert_eq!(kernel_from_image_name("boot/initrd.img-6.1.0-41-amd64"), None);
    }
}
