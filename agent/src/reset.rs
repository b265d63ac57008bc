//! Reset: what the agent does to its machine when the machine is deleted from the fleet (and
//! what `keelson-agent reset` does by hand). It stops and removes the components keelson
//! installed (the kubelet, kubeadm, containerd), takes away keelson's holds, repositories, runtime
//! configuration and managed files, and forgets the machine's identity. OS packages it pinned
//! (the kernel among them) stay installed, unheld: removing them could leave the machine
//! unbootable.
//!
//! Every action is attempted even when one fails, and each outcome is reported: a reset that
//! could not remove something says what is left.

use std::path::Path;

use crate::drivers::packages::Manager;
use crate::drivers::{containerd, files, kubeadm, kubelet, systemd};
use crate::ledger::Ledger;
use crate::observe::CONTAINERD_CONFIG;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reset {
    pub done: Vec<String>,
    pub failed: Vec<String>,
}

impl Reset {
    fn record<E: std::fmt::Display>(&mut self, what: impl Into<String>, result: Result<(), E>) {
        match result {
            Ok(()) => self.done.push(what.into()),
            Err(e) => self.failed.push(format!("{}: {e}", what.into())),
        }
    }

    /// Removes a file keelson wrote, when it is there.
    fn remove(&mut self, path: &str) {
        match std::fs::remove_file(path) {
            Ok(()) => self.done.push(format!("removed {path}")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => self.failed.push(format!("removing {path}: {e}")),
        }
    }

    /// Removes a directory keelson made (an etcd member's data once it has left, its TLS).
    fn remove_dir(&mut self, path: &str) {
        match std::fs::remove_dir_all(path) {
            Ok(()) => self.done.push(format!("removed {path}")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => self.failed.push(format!("removing {path}: {e}")),
        }
    }

    /// Unholds and removes a package keelson installed.
    async fn uninstall(&mut self, pm: Option<Manager>, name: String) {
        let Some(pm) = pm else {
            self.failed.push(format!("removing {name}: no package manager found"));
            return;
        };
        let names = [name];
        self.record(format!("unheld {}", names[0]), pm.unhold(&names).await);
        self.record(format!("removed package {}", names[0]), pm.remove(&names).await);
    }

    pub fn summary(&self) -> String {
        let mut out = format!("reset: {}", if self.done.is_empty() { "nothing to undo".to_owned() } else { self.done.join("; ") });
        if !self.failed.is_empty() {
            out.push_str(&format!(". Left behind: {}", self.failed.join("; ")));
        }
        out
    }
}

/// Undoes what keelson put on this machine, as the ledger records it.
pub async fn reset_machine(state_dir: &Path) -> Reset {
    let mut r = Reset::default();
    let ledger = Ledger::load(state_dir).unwrap_or_default();
    let spec = ledger.spec.clone().unwrap_or_default();
    let pm = Manager::detect(Path::new("/"));

    if let Some(e) = &spec.etcd {
        use crate::drivers::etcd as host;
        r.record("stopped and disabled the etcd member", systemd::disable_now(host::UNIT_NAME).await);
        match &e.source.package {
            Some(p) => r.uninstall(pm, p.to_string()).await,
            None => {
                for b in ["etcd", "etcdctl", "etcdutl"] {
                    let path = format!("{}/{b}", host::TARBALL_BIN_DIR);
                    r.remove(&path);
                    r.remove(&files::previous_path(Path::new(&path)).to_string_lossy());
                }
            }
        }
        // A package from an earlier spec (the pool moved to a tarball) is still there: its own
        // unit, enabled by its installation, would start a stray single-node etcd once unmasked.
        if Path::new(host::PACKAGE_BINARY).exists() {
            r.failed.push(format!("{} (a package still provides it: {} stays masked)", host::PACKAGE_BINARY, host::PACKAGE_UNIT));
        } else {
            r.record("unmasked etcd.service", systemd::unmask(host::PACKAGE_UNIT).await);
        }
        for path in [host::UNIT, host::ENV_FILE, host::INITIAL_ENV_FILE] {
            r.remove(path);
        }
        r.remove_dir(host::PKI_DIR);
        r.remove_dir(host::DATA_DIR);
    }
    if let Some(k) = &spec.kubelet {
        r.record("stopped and disabled kubelet", systemd::disable_now("kubelet").await);
        match &k.source.package {
            Some(p) => r.uninstall(pm, p.to_string()).await,
            None => {
                r.remove(kubelet::BINARY);
                r.remove(&files::previous_path(Path::new(kubelet::BINARY)).to_string_lossy());
            }
        }
        r.remove(kubelet::UNIT);
        r.remove(kubelet::DROPIN);
    }
    // kubeadm itself only: what it set up on the node (/etc/kubernetes) is the cluster's, which
    // `kubeadm reset` (the operator's) takes away.
    if let Some(k) = &spec.kubeadm {
        match &k.source.package {
            Some(p) => r.uninstall(pm, p.to_string()).await,
            None => {
                r.remove(kubeadm::BINARY);
                r.remove(&files::previous_path(Path::new(kubeadm::BINARY)).to_string_lossy());
            }
        }
    }
    if let Some(rt) = &spec.container_runtime {
        r.record("stopped and disabled containerd", systemd::disable_now("containerd").await);
        match (&ledger.runtime_artifact, &rt.source.package) {
            (Some(installed), _) => {
                for path in installed.binaries.keys() {
                    r.remove(path);
                    r.remove(&files::previous_path(Path::new(path)).to_string_lossy());
                }
                r.remove(containerd::UNIT);
            }
            (None, Some(p)) => r.uninstall(pm, p.to_string()).await,
            (None, None) => {}
        }
        r.remove(&format!("/{CONTAINERD_CONFIG}"));
    }
    for f in &spec.files {
        r.remove(&f.path);
    }
    if let Some(os) = &spec.os
        && !os.packages.is_empty()
    {
        let names: Vec<String> = os.packages.iter().map(|p| p.name.to_string()).collect();
        match pm {
            Some(pm) => r.record(format!("unheld {} (left installed)", names.join(" ")), pm.unhold(&names).await),
            None => r.failed.push(format!("unholding {}: no package manager found", names.join(" "))),
        }
    }
    if let Some(pm) = pm {
        r.remove(&format!("/{}", pm.sources_file()));
    }
    if let Err(e) = systemd::daemon_reload().await {
        r.failed.push(format!("systemctl daemon-reload: {e}"));
    }
    r
}

/// Forgets the machine: its key, certificate, the controller's CA, the journal, the ledger
/// and the artifact cache. The agent cannot act for the machine again until it is enrolled.
pub fn forget_identity(state_dir: &Path) -> std::io::Result<()> {
    use crate::state::{CA_FILE, CERT_FILE, IDENTITY_FILE, KEY_FILE};
    for name in [KEY_FILE, CERT_FILE, CA_FILE, IDENTITY_FILE, crate::journal::JOURNAL_FILE, crate::ledger::LEDGER_FILE] {
        match std::fs::remove_file(state_dir.join(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    match std::fs::remove_dir_all(crate::drivers::artifact::cache_dir(state_dir)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_what_was_done_and_what_is_left() {
        let mut r = Reset::default();
        r.record::<String>("stopped and disabled kubelet", Ok(()));
        r.record("removed package containerd", Err("apt-get remove: exit status 100: E: locked"));
        assert_eq!(
            r.summary(),
            "reset: stopped and disabled kubelet. Left behind: removed package containerd: apt-get remove: exit status 100: E: locked"
        );
        assert_eq!(Reset::default().summary(), "reset: nothing to undo");
    }

    #[test]
    fn forgetting_removes_the_identity_and_keeps_the_directory() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        for f in ["machine.key", "machine.crt", "ca.crt", "identity.json", "journal.json", "ledger.json", "unrelated"] {
            std::fs::write(dir.path().join(f), b"x")?;
        }
        std::fs::create_dir_all(dir.path().join("artifacts"))?;
        std::fs::write(dir.path().join("artifacts/abc"), b"x")?;
        forget_identity(dir.path())?;
        let left: Vec<String> =
            std::fs::read_dir(dir.path())?.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect::<Result<_, _>>()?;
        assert_eq!(left, vec!["unrelated"]);
        forget_identity(dir.path())?;
        Ok(())
    }
}
