//! The on-disk journal: the plan for a generation and how far it got, written atomically
//! (temp file, fsync, rename, fsync of the directory) before each step, so that after a kill,
//! a crash or a reboot the agent resumes at the right step. A journal it cannot read, or one
//! written by a newer agent, is an error to report, never a guess.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::plan::Step;
use crate::state::{self, StateError};

pub const JOURNAL_FILE: &str = "journal.json";
pub const JOURNAL_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Journal {
    pub version: u32,
    pub generation: u64,
    pub steps: Vec<Step>,
    /// Index of the step to run next; `steps.len()` when done.
    pub next: usize,
    /// Failed attempts at the step `next`.
    pub attempts: u32,
    /// A disruption lease held across steps (and across the reboot).
    pub lease: Option<String>,
    /// The kubeadm upgrade the lease's grant said this machine runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeadm_upgrade: Option<keelson_api::machine::KubeadmUpgrade>,
    /// Set when the reboot step has asked the machine to reboot.
    pub reboot: Option<RebootRecord>,
    /// The generation a `reboot: Always` reboot was last done for.
    pub rebooted_for_generation: Option<u64>,
    /// Why this generation stopped (Degraded) — it is not retried until a new generation.
    pub failed: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RebootRecord {
    pub boot_id_before: String,
    /// The kernel release the boot loader was to start, when known.
    pub expected_kernel: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{path}: cannot read the journal ({message}); move it aside to start over")]
    Corrupt { path: PathBuf, message: String },
    #[error("{path}: journal version {found} was written by a newer agent (this one understands {JOURNAL_VERSION})")]
    FutureVersion { path: PathBuf, found: u32 },
    #[error(transparent)]
    Write(#[from] StateError),
}

impl Journal {
    pub fn new(generation: u64, steps: Vec<Step>, rebooted_for_generation: Option<u64>) -> Self {
        Journal {
            version: JOURNAL_VERSION,
            generation,
            steps,
            next: 0,
            attempts: 0,
            lease: None,
            kubeadm_upgrade: None,
            reboot: None,
            rebooted_for_generation,
            failed: None,
        }
    }

    pub fn is_done(&self) -> bool {
        self.next >= self.steps.len()
    }

    pub fn path(dir: &Path) -> PathBuf {
        dir.join(JOURNAL_FILE)
    }

    pub fn load(dir: &Path) -> Result<Option<Journal>, JournalError> {
        let path = Self::path(dir);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(JournalError::Corrupt { path, message: e.to_string() }),
        };
        let value: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| JournalError::Corrupt { path: path.clone(), message: e.to_string() })?;
        let version = value.get("version").and_then(|v| v.as_u64()).unwrap_or(0) as u32;
        if version > JOURNAL_VERSION {
            return Err(JournalError::FutureVersion { path, found: version });
        }
        let journal: Journal =
            serde_json::from_value(value).map_err(|e| JournalError::Corrupt { path: path.clone(), message: e.to_string() })?;
        if journal.version != JOURNAL_VERSION || journal.next > journal.steps.len() {
            return Err(JournalError::Corrupt {
                path,
                message: format!("version {} with step {} of {}", journal.version, journal.next, journal.steps.len()),
            });
        }
        Ok(Some(journal))
    }

    pub fn save(&self, dir: &Path) -> Result<(), JournalError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| JournalError::Corrupt { path: Self::path(dir), message: e.to_string() })?;
        state::write_atomic(&Self::path(dir), &bytes, 0o600)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Action, Step};

    #[test]
    fn round_trips_and_refuses_corrupt_or_future_journals() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        assert!(Journal::load(dir.path())?.is_none());
        let mut j = Journal::new(
            3,
            vec![Step { action: Action::Hold { names: vec!["a".into()] }, description: "hold a".into(), disruptive: false }],
            None,
        );
        j.next = 1;
        j.save(dir.path())?;
        assert_eq!(Journal::load(dir.path())?, Some(j));
        std::fs::write(Journal::path(dir.path()), b"{\"version\": 1, \"generation\": ")?;
        assert!(matches!(Journal::load(dir.path()), Err(JournalError::Corrupt { .. })));
        std::fs::write(Journal::path(dir.path()), b"{\"version\": 9}")?;
        let err = Journal::load(dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("journal version 9 was written by a newer agent"), "{err}");
        Ok(())
    }
}
