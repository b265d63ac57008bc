//! apt and dpkg: refresh package lists, check that the repositories have every pinned
//! version before changing anything, install exact versions non-interactively (keeping
//! existing configuration files), and hold them.

use std::time::Duration;

use super::command::{CommandError, run};
use crate::plan::Pin;

const UPDATE_TIMEOUT_SECS: u64 = 600;
const INSTALL_TIMEOUT_SECS: u64 = 1800;
const QUERY_TIMEOUT_SECS: u64 = 120;
/// Wait for the dpkg lock instead of failing: after the agent is killed mid-install, the
/// apt it started may still be finishing when the restarted agent resumes.
const LOCK_WAIT: &str = "DPkg::Lock::Timeout=600";
/// KEELSON_AGENT_APT tells keelson-agent's own maintainer scripts that the agent started this
/// run, so they must not restart it mid-step (it restarts itself afterwards).
const ENV: &[(&str, &str)] =
    &[("DEBIAN_FRONTEND", "noninteractive"), ("APT_LISTCHANGES_FRONTEND", "none"), ("NEEDRESTART_MODE", "l"), ("KEELSON_AGENT_APT", "1")];

#[derive(Debug, thiserror::Error)]
pub enum AptError {
    #[error("apt: version {version} of {name} not found (the repositories offer: {offered})")]
    VersionNotFound { name: String, version: String, offered: String },
    #[error(transparent)]
    Command(#[from] CommandError),
}

pub async fn update() -> Result<(), AptError> {
    run(&["apt-get", "update", "-q", "-o", "APT::Update::Error-Mode=any", "-o", LOCK_WAIT], ENV, Duration::from_secs(UPDATE_TIMEOUT_SECS))
        .await?;
    Ok(())
}

/// The versions of `name` the repositories offer, from `apt-cache madison`.
pub fn parse_madison(output: &str) -> Vec<String> {
    output.lines().filter_map(|l| l.split('|').nth(1)).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()).collect()
}

/// The versions of `name` the repositories offer.
pub async fn offered(name: &str) -> Result<Vec<String>, AptError> {
    let out = run(&["apt-cache", "madison", name], ENV, Duration::from_secs(QUERY_TIMEOUT_SECS)).await?;
    Ok(parse_madison(&out))
}

/// Fails before anything changes when a pin is not offered by the repositories.
pub async fn ensure_available(pins: &[Pin]) -> Result<(), AptError> {
    for p in pins {
        let offered = offered(&p.name).await?;
        if !offered.iter().any(|v| v == &p.version) {
            let offered = if offered.is_empty() { "none".to_owned() } else { offered.join(", ") };
            return Err(AptError::VersionNotFound { name: p.name.clone(), version: p.version.clone(), offered });
        }
    }
    Ok(())
}

pub async fn install(pins: &[Pin]) -> Result<(), AptError> {
    let specs: Vec<String> = pins.iter().map(|p| format!("{}={}", p.name, p.version)).collect();
    let mut argv = vec![
        "apt-get",
        "install",
        "-y",
        "-q",
        "--no-install-recommends",
        "--allow-downgrades",
        "--allow-change-held-packages",
        "-o",
        LOCK_WAIT,
        "-o",
        "Dpkg::Options::=--force-confdef",
        "-o",
        "Dpkg::Options::=--force-confold",
    ];
    argv.extend(specs.iter().map(String::as_str));
    run(&argv, ENV, Duration::from_secs(INSTALL_TIMEOUT_SECS)).await?;
    Ok(())
}

/// Runs `command` with the package names appended; nothing to do for none.
async fn for_packages(command: &[&str], names: &[String], timeout_secs: u64) -> Result<(), AptError> {
    if names.is_empty() {
        return Ok(());
    }
    let mut argv = command.to_vec();
    argv.extend(names.iter().map(String::as_str));
    run(&argv, ENV, Duration::from_secs(timeout_secs)).await?;
    Ok(())
}

pub async fn hold(names: &[String]) -> Result<(), AptError> {
    for_packages(&["apt-mark", "hold"], names, QUERY_TIMEOUT_SECS).await
}

/// Lets other tools move these packages again.
pub async fn unhold(names: &[String]) -> Result<(), AptError> {
    for_packages(&["apt-mark", "unhold"], names, QUERY_TIMEOUT_SECS).await
}

/// Removes packages, keeping their configuration files (not a purge).
pub async fn remove(names: &[String]) -> Result<(), AptError> {
    for_packages(&["apt-get", "remove", "-y", "-q", "--allow-change-held-packages", "-o", LOCK_WAIT], names, INSTALL_TIMEOUT_SECS).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_madison() {
        let out = "containerd | 1.6.20~ds1-1+deb12u3 | http://10.0.2.2:8080 ./ Packages\ncontainerd | 1.6.20~ds1-1+deb12u2 | http://10.0.2.2:8080 ./ Packages\n";
        assert_eq!(parse_madison(out), vec!["1.6.20~ds1-1+deb12u3", "1.6.20~ds1-1+deb12u2"]);
        assert!(parse_madison("").is_empty());
    }
}
