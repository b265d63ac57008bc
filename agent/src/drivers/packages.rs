//! The machine's package manager, whichever it is: apt and dpkg on Debian and Ubuntu, dnf and
//! rpm on the RHEL family. The planner and the executor speak to this, not to either directly.

use std::collections::BTreeMap;
use std::path::Path;

use keelson_api::machine::MachineSpec;

use super::command::CommandError;
use super::{apt, dnf};
use crate::observe::{Installed, ObserveError};
use crate::plan::Pin;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Manager {
    #[default]
    Apt,
    Dnf,
}

#[derive(Debug, thiserror::Error)]
pub enum PackageError {
    /// The repositories lack a pinned version: retrying cannot help.
    #[error("{0}")]
    VersionNotFound(String),
    #[error(transparent)]
    Command(#[from] CommandError),
}

impl From<apt::AptError> for PackageError {
    fn from(e: apt::AptError) -> Self {
        match e {
            apt::AptError::VersionNotFound { .. } => PackageError::VersionNotFound(e.to_string()),
            apt::AptError::Command(c) => PackageError::Command(c),
        }
    }
}

impl From<dnf::DnfError> for PackageError {
    fn from(e: dnf::DnfError) -> Self {
        match e {
            dnf::DnfError::VersionNotFound { .. } => PackageError::VersionNotFound(e.to_string()),
            dnf::DnfError::Command(c) => PackageError::Command(c),
        }
    }
}

impl Manager {
    /// dpkg's database decides; a machine with only rpm's is of the RHEL family.
    pub fn detect(root: &Path) -> Option<Manager> {
        if root.join("var/lib/dpkg/status").exists() {
            Some(Manager::Apt)
        } else if root.join("var/lib/rpm").is_dir() {
            Some(Manager::Dnf)
        } else {
            None
        }
    }

    /// The file (relative to the root) holding the repositories keelson manages.
    pub fn sources_file(self) -> &'static str {
        match self {
            Manager::Apt => crate::observe::SOURCES_FILE,
            Manager::Dnf => dnf::REPO_FILE,
        }
    }

    /// The managed repositories in this manager's format; `None` when the spec names none.
    pub fn render_sources(self, spec: &MachineSpec) -> Option<String> {
        let repos = &spec.os.as_ref()?.repositories;
        if repos.is_empty() {
            return None;
        }
        Some(match self {
            Manager::Apt => crate::plan::render_sources(repos),
            Manager::Dnf => dnf::render_repo_file(repos),
        })
    }

    /// Whether an installed version is the one wanted, in this manager's version syntax.
    pub fn same_version(self, installed: &str, wanted: &str) -> bool {
        match self {
            Manager::Apt => {
                match (installed.parse::<keelson_api::version::DebVersion>(), wanted.parse::<keelson_api::version::DebVersion>()) {
                    (Ok(a), Ok(b)) => a == b,
                    _ => installed == wanted,
                }
            }
            Manager::Dnf => dnf::same_version(installed, wanted),
        }
    }

    /// Packages whose installation means a new kernel.
    pub fn is_kernel(self, name: &str) -> bool {
        match self {
            Manager::Apt => name.starts_with("linux-image"),
            Manager::Dnf => name == "kernel" || name.starts_with("kernel-core"),
        }
    }

    /// The installed packages under `root`, with their holds.
    pub fn installed(self, root: &Path) -> Result<BTreeMap<String, Installed>, ObserveError> {
        match self {
            Manager::Apt => {
                let path = root.join("var/lib/dpkg/status");
                let text = std::fs::read_to_string(&path).map_err(|e| ObserveError { path, message: e.to_string() })?;
                Ok(crate::observe::parse_dpkg_status(&text))
            }
            Manager::Dnf => {
                let db = root.join("var/lib/rpm");
                let out = std::process::Command::new("rpm")
                    .arg("--root")
                    .arg(root)
                    .args(["-qa", "--queryformat", dnf::QUERY_FORMAT])
                    .output()
                    .map_err(|e| ObserveError { path: db.clone(), message: format!("rpm -qa: {e}") })?;
                if !out.status.success() {
                    return Err(ObserveError { path: db, message: format!("rpm -qa: {}", String::from_utf8_lossy(&out.stderr).trim()) });
                }
                let locks = std::fs::read_to_string(root.join(dnf::VERSIONLOCK_LIST)).unwrap_or_default();
                Ok(dnf::installed(&String::from_utf8_lossy(&out.stdout), &locks))
            }
        }
    }

    /// Refreshes the package lists or metadata.
    pub async fn update(self) -> Result<(), PackageError> {
        match self {
            Manager::Apt => apt::update().await?,
            Manager::Dnf => dnf::makecache().await?,
        }
        Ok(())
    }

    /// Fails before anything changes when a pin is not offered by the repositories.
    pub async fn ensure_available(self, pins: &[Pin]) -> Result<(), PackageError> {
        match self {
            Manager::Apt => apt::ensure_available(pins).await?,
            Manager::Dnf => dnf::ensure_available(pins).await?,
        }
        Ok(())
    }

    pub async fn install(self, pins: &[Pin]) -> Result<(), PackageError> {
        match self {
            Manager::Apt => apt::install(pins).await?,
            Manager::Dnf => dnf::install(pins).await?,
        }
        Ok(())
    }

    /// Holds packages so that nothing but keelson moves them.
    pub async fn hold(self, names: &[String]) -> Result<(), PackageError> {
        match self {
            Manager::Apt => apt::hold(names).await?,
            Manager::Dnf => dnf::hold(names).await?,
        }
        Ok(())
    }

    pub async fn unhold(self, names: &[String]) -> Result<(), PackageError> {
        match self {
            Manager::Apt => apt::unhold(names).await?,
            Manager::Dnf => dnf::unhold(names).await?,
        }
        Ok(())
    }

    /// Removes packages (their configuration stays).
    pub async fn remove(self, names: &[String]) -> Result<(), PackageError> {
        match self {
            Manager::Apt => apt::remove(names).await?,
            Manager::Dnf => dnf::remove(names).await?,
        }
        Ok(())
    }

    /// The newest offered version of `name` whose upstream part is `release` (`v1.31.0` →
    /// `1.31.0-1.1` in Kubernetes' Debian repositories, `1.31.0-150500.1.1` in its RPM ones).
    pub async fn newest_of_release(self, name: &str, release: &str) -> Result<(Option<String>, Vec<String>), PackageError> {
        let offered = match self {
            Manager::Apt => apt::offered(name).await?,
            Manager::Dnf => dnf::offered(name).await?,
        };
        Ok((newest_of_release(self, &offered, release), offered))
    }
}

/// The newest of `offered` whose version (without epoch and release) is `release`.
pub fn newest_of_release(manager: Manager, offered: &[String], release: &str) -> Option<String> {
    let release = release.trim_start_matches('v');
    let upstream = |v: &str| {
        let v = v.split_once(':').map_or(v, |(_, rest)| rest);
        v.rsplit_once('-').map_or(v, |(up, _)| up).to_owned()
    };
    let mut matching: Vec<&String> = offered.iter().filter(|v| upstream(v) == release).collect();
    matching.sort_by(|a, b| match manager {
        Manager::Apt => match (a.parse::<keelson_api::version::DebVersion>(), b.parse::<keelson_api::version::DebVersion>()) {
            (Ok(a), Ok(b)) => a.cmp(&b),
            _ => a.cmp(b),
        },
        Manager::Dnf => dnf::compare(a, b),
    });
    matching.last().map(|v| (*v).clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_newest_package_of_a_release() {
        let deb: Vec<String> = ["1.31.0-1.1", "1.31.0-2.1", "1.31.1-1.1", "1.30.4-1.1"].map(String::from).to_vec();
        assert_eq!(newest_of_release(Manager::Apt, &deb, "v1.31.0").as_deref(), Some("1.31.0-2.1"));
        assert_eq!(newest_of_release(Manager::Apt, &deb, "1.30.4").as_deref(), Some("1.30.4-1.1"));
        assert_eq!(newest_of_release(Manager::Apt, &deb, "v1.29.0"), None);
        let rpm: Vec<String> = ["1.31.0-150500.1.1", "0:1.31.0-150500.2.1", "1.31.1-150500.1.1"].map(String::from).to_vec();
        assert_eq!(newest_of_release(Manager::Dnf, &rpm, "v1.31.0").as_deref(), Some("0:1.31.0-150500.2.1"));
    }

    #[test]
    fn detects_the_manager_from_its_database() -> anyhow::Result<()> {
        let root = tempfile::tempdir()?;
        assert_eq!(Manager::detect(root.path()), None);
        std::fs::create_dir_all(root.path().join("var/lib/rpm"))?;
        assert_eq!(Manager::detect(root.path()), Some(Manager::Dnf));
        std::fs::create_dir_all(root.path().join("var/lib/dpkg"))?;
        std::fs::write(root.path().join("var/lib/dpkg/status"), "")?;
        assert_eq!(Manager::detect(root.path()), Some(Manager::Apt));
        assert!(Manager::Dnf.is_kernel("kernel-core") && Manager::Apt.is_kernel("linux-image-amd64"));
        assert!(Manager::Dnf.same_version("0:1.6.28-3.1.el9", "1.6.28-3.1.el9"));
        Ok(())
    }
}
