//! The kubelet: its binary installed by rename with the previous one kept, a systemd unit and
//! keelson's drop-in, a restart, and health at http://127.0.0.1:10248/healthz; when the new
//! binary is not healthy the previous one is put back.

use std::path::Path;
use std::time::{Duration, Instant};

use super::command::CommandError;
use super::{files, systemd};

pub const BINARY: &str = "/usr/bin/kubelet";
pub const UNIT: &str = "/etc/systemd/system/kubelet.service";
pub const DROPIN: &str = "/etc/systemd/system/kubelet.service.d/10-keelson.conf";
const HEALTH_URL: &str = "http://127.0.0.1:10248/healthz";
const HEALTH_WAIT_SECS: u64 = 60;

pub const UNIT_CONTENT: &str = "# Managed by keelson-agent: changes are overwritten.
[Unit]
Description=kubelet: the Kubernetes node agent
Wants=network-online.target
After=network-online.target containerd.service

[Service]
ExecStart=/usr/bin/kubelet $KEELSON_KUBELET_ARGS
Restart=always
RestartSec=2

[Install]
WantedBy=multi-user.target
";

/// keelson's settings for the kubelet: the cgroup driver must match containerd's.
pub fn dropin_content(systemd_cgroup: bool) -> String {
    let driver = if systemd_cgroup { "systemd" } else { "cgroupfs" };
    format!(
        "# Managed by keelson-agent: changes are overwritten.\n[Service]\nEnvironment=\"KEELSON_KUBELET_ARGS=--cgroup-driver={driver} --container-runtime-endpoint=unix:///run/containerd/containerd.sock\"\n"
    )
}

/// `kubelet --version` prints `Kubernetes v1.30.4`.
pub fn parse_version(out: &str) -> Option<String> {
    out.split_whitespace().find(|w| w.starts_with('v') && w[1..].starts_with(|c: char| c.is_ascii_digit())).map(str::to_owned)
}

/// The installed kubelet's version, when there is one.
pub fn installed_version(root: &Path) -> Option<String> {
    let binary = root.join(BINARY.trim_start_matches('/'));
    let out = std::process::Command::new(binary).arg("--version").output().ok()?;
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

pub async fn healthy() -> Result<(), String> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(HEALTH_WAIT_SECS);
    let mut last = String::new();
    while Instant::now() < deadline {
        match client.get(HEALTH_URL).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => last = format!("{HEALTH_URL} answered {}", r.status()),
            Err(e) => last = format!("{HEALTH_URL}: {}", keelson_api::error_chain(&e)),
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Err(format!("not healthy after {HEALTH_WAIT_SECS}s: {last}"))
}

/// Puts `artifact` in place as the kubelet, keeping the current binary as the previous one.
pub fn install_binary(artifact: &Path) -> std::io::Result<()> {
    files::install_executable(artifact, Path::new(BINARY))
}

/// Puts the previous binary back.
pub fn restore_previous() -> std::io::Result<bool> {
    files::restore_previous(Path::new(BINARY))
}

pub async fn restart() -> Result<(), CommandError> {
    systemd::daemon_reload_enable("kubelet").await?;
    systemd::restart("kubelet").await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kubelet_version() {
        assert_eq!(parse_version("Kubernetes v1.30.4\n").as_deref(), Some("v1.30.4"));
        assert_eq!(parse_version("garbage"), None);
    }
}
