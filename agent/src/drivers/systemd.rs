//! systemd through systemctl: restart a unit, ask whether it is active, reboot.

use std::time::Duration;

use super::command::{CommandError, run};

const SYSTEMCTL_TIMEOUT_SECS: u64 = 300;

pub async fn restart(unit: &str) -> Result<(), CommandError> {
    run(&["systemctl", "restart", unit], &[], Duration::from_secs(SYSTEMCTL_TIMEOUT_SECS)).await.map(|_| ())
}

pub async fn is_active(unit: &str) -> bool {
    run(&["systemctl", "is-active", "--quiet", unit], &[], Duration::from_secs(30)).await.is_ok()
}

/// Asks systemd to reboot; returns once the request is queued (the agent is stopped soon).
pub async fn reboot() -> Result<(), CommandError> {
    run(&["systemctl", "reboot"], &[], Duration::from_secs(60)).await.map(|_| ())
}

/// Makes systemd read changed unit files and start `unit` at boot.
pub async fn daemon_reload_enable(unit: &str) -> Result<(), CommandError> {
    daemon_reload().await?;
    run(&["systemctl", "enable", unit], &[], Duration::from_secs(60)).await.map(|_| ())
}

/// Stops a unit and keeps it from starting at boot.
pub async fn disable_now(unit: &str) -> Result<(), CommandError> {
    run(&["systemctl", "disable", "--now", unit], &[], Duration::from_secs(SYSTEMCTL_TIMEOUT_SECS)).await.map(|_| ())
}

/// Keeps a unit from ever starting (a package's own unit that keelson replaces).
pub async fn mask(unit: &str) -> Result<(), CommandError> {
    run(&["systemctl", "mask", unit], &[], Duration::from_secs(60)).await.map(|_| ())
}

pub async fn unmask(unit: &str) -> Result<(), CommandError> {
    run(&["systemctl", "unmask", unit], &[], Duration::from_secs(60)).await.map(|_| ())
}

pub async fn stop(unit: &str) -> Result<(), CommandError> {
    run(&["systemctl", "stop", unit], &[], Duration::from_secs(SYSTEMCTL_TIMEOUT_SECS)).await.map(|_| ())
}

pub async fn daemon_reload() -> Result<(), CommandError> {
    run(&["systemctl", "daemon-reload"], &[], Duration::from_secs(60)).await.map(|_| ())
}

/// Keeps a unit from starting at boot, leaving it running (for the agent itself, which then
/// exits on its own).
pub async fn disable(unit: &str) -> Result<(), CommandError> {
    run(&["systemctl", "disable", unit], &[], Duration::from_secs(60)).await.map(|_| ())
}
