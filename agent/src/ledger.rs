//! The ledger: what keelson itself put on the machine that no package database records —
//! bootstrap scripts that have run, the version kubeadm last upgraded the node to, and containerd binaries installed from a release tarball
//! (with the size, modification time and inode of each, so that a binary replaced by hand is
//! seen as drift without hashing tens of megabytes on every observation).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::state::{self, StateError};

pub const LEDGER_FILE: &str = "ledger.json";

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ledger {
    /// Names of the bootstrap scripts that have succeeded on this machine.
    #[serde(default)]
    pub bootstrapped: BTreeSet<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_artifact: Option<InstalledArtifact>,
    /// The version `kubeadm upgrade` last brought this node to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeadm_upgraded: Option<String>,
    /// The spec last carried out, so that a reset knows what keelson put here even when the
    /// controller cannot be asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<keelson_api::machine::MachineSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstalledArtifact {
    /// The digest of the tarball the binaries came from.
    pub sha256: String,
    pub version: String,
    pub binaries: BTreeMap<String, FileStamp>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    pub len: u64,
    pub mtime_ns: i128,
    pub ino: u64,
}

impl FileStamp {
    pub fn of(path: &Path) -> std::io::Result<FileStamp> {
        let m = std::fs::metadata(path)?;
        Ok(FileStamp { len: m.len(), mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()), ino: m.ino() })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("{path}: cannot read keelson's ledger ({message}); move it aside and the agent will redo what it lists")]
    Corrupt { path: PathBuf, message: String },
    #[error(transparent)]
    Write(#[from] StateError),
}

impl Ledger {
    pub fn path(dir: &Path) -> PathBuf {
        dir.join(LEDGER_FILE)
    }

    pub fn load(dir: &Path) -> Result<Ledger, LedgerError> {
        let path = Self::path(dir);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| LedgerError::Corrupt { path, message: e.to_string() }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Ledger::default()),
            Err(e) => Err(LedgerError::Corrupt { path, message: e.to_string() }),
        }
    }

    pub fn save(&self, dir: &Path) -> Result<(), LedgerError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| LedgerError::Corrupt { path: Self::path(dir), message: e.to_string() })?;
        state::write_atomic(&Self::path(dir), &bytes, 0o600)?;
        Ok(())
    }

    /// Changes the ledger on disk under `f`.
    pub fn update(dir: &Path, f: impl FnOnce(&mut Ledger)) -> Result<(), LedgerError> {
        let mut ledger = Self::load(dir)?;
        f(&mut ledger);
        ledger.save(dir)
    }

    /// The tarball digest whose binaries are still in place, unchanged, under `root`.
    pub fn intact_runtime_artifact(&self, root: &Path) -> Option<&InstalledArtifact> {
        let a = self.runtime_artifact.as_ref()?;
        let intact = a.binaries.iter().all(|(path, stamp)| FileStamp::of(&root.join(path.trim_start_matches('/'))).ok() == Some(*stamp));
        intact.then_some(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_binary_is_no_longer_intact() -> anyhow::Result<()> {
        let root = tempfile::tempdir()?;
        let bin = root.path().join("usr/local/bin");
        std::fs::create_dir_all(&bin)?;
        std::fs::write(bin.join("containerd"), b"v1")?;
        let stamp = FileStamp::of(&bin.join("containerd"))?;
        let ledger = Ledger {
            bootstrapped: BTreeSet::from(["once".to_owned()]),
            runtime_artifact: Some(InstalledArtifact {
                sha256: "ab".repeat(32),
                version: "1.7.22".into(),
                binaries: BTreeMap::from([("/usr/local/bin/containerd".to_owned(), stamp)]),
            }),
            kubeadm_upgraded: Some("v1.31.2".into()),
            spec: None,
        };
        ledger.save(root.path())?;
        let loaded = Ledger::load(root.path())?;
        assert_eq!(loaded, ledger);
        assert!(loaded.intact_runtime_artifact(root.path()).is_some());
        // Replaced by hand, the way an operator would: a new file renamed over the old one.
        std::fs::write(bin.join("containerd.new"), b"v2")?;
        std::fs::rename(bin.join("containerd.new"), bin.join("containerd"))?;
        assert!(loaded.intact_runtime_artifact(root.path()).is_none());
        std::fs::write(Ledger::path(root.path()), b"{")?;
        assert!(matches!(Ledger::load(root.path()), Err(LedgerError::Corrupt { .. })));
        Ok(())
    }
}
