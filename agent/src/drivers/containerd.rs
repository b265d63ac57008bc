//! containerd: its health as seen through its socket (`ctr version` answers for both client
//! and server only when the daemon serves).

use std::time::{Duration, Instant};

use super::command::{CommandError, run};

const HEALTH_WAIT_SECS: u64 = 60;

/// Waits until `ctr version` reaches the daemon; returns the server version it reports.
pub async fn wait_healthy() -> Result<String, CommandError> {
    let deadline = Instant::now() + Duration::from_secs(HEALTH_WAIT_SECS);
    loop {
        match run(&["ctr", "version"], &[], Duration::from_secs(10)).await {
            Ok(out) => {
                if let Some(v) = parse_server_version(&out) {
                    return Ok(v);
                }
            }
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {}
        }
        if Instant::now() >= deadline {
            return Err(CommandError::Timeout { command: "ctr version".into(), seconds: HEALTH_WAIT_SECS });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The `Version:` line of the `Server:` section.
pub fn parse_server_version(out: &str) -> Option<String> {
    let server = out.split("Server:").nth(1)?;
    server.lines().find_map(|l| l.trim().strip_prefix("Version:")).map(|v| v.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ctr_version() {
        let out = "Client:\n  Version:  1.6.20~ds1\n  Revision: 1.6.20~ds1-1+deb12u3\n  Go version: go1.19.8\n\nServer:\n  Version:  1.6.20~ds1\n  Revision: 1.6.20~ds1-1+deb12u3\n  UUID: 1b2\n";
        assert_eq!(parse_server_version(out).as_deref(), Some("1.6.20~ds1"));
        assert_eq!(parse_server_version("Client:\n  Version: 1\n"), None);
    }
}
