//! The agent's configuration: `/etc/keelson/agent.toml`, then every `*.toml` in
//! `/etc/keelson/agent.d/` in name order, each overriding the keys it sets. Parsed into a
//! permissive table, then validated into `AgentConfig`, naming the file and key at fault.

use std::path::{Path, PathBuf};
use std::time::Duration;

use keelson_api::meta::Name;
use serde::Deserialize;

pub const DEFAULT_CONFIG: &str = "/etc/keelson/agent.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/keelson";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{key}: {message}")]
    Invalid { key: &'static str, message: String },
}

/// What the files may say; everything optional so drop-ins can set one key each.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    servers: Option<Vec<String>>,
    ca_file: Option<PathBuf>,
    token: Option<String>,
    name: Option<String>,
    state_dir: Option<PathBuf>,
    heartbeat_interval_seconds: Option<u64>,
    drift_interval_seconds: Option<u64>,
    lease_ttl_seconds: Option<u64>,
    log_level: Option<String>,
    etcd_advertise_address: Option<String>,
}

impl RawConfig {
    fn overlay(&mut self, other: RawConfig) {
        macro_rules! take {
            ($($f:ident),*) => { $( if other.$f.is_some() { self.$f = other.$f; } )* };
        }
        take!(
            servers,
            ca_file,
            token,
            name,
            state_dir,
            heartbeat_interval_seconds,
            drift_interval_seconds,
            lease_ttl_seconds,
            log_level,
            etcd_advertise_address
        );
    }
}

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub servers: Vec<String>,
    pub ca_file: PathBuf,
    /// Used to enroll when the state directory holds no identity yet.
    pub token: Option<String>,
    pub name: Option<Name>,
    pub state_dir: PathBuf,
    pub heartbeat_interval: Duration,
    pub drift_interval: Duration,
    pub lease_ttl: Duration,
    pub log_level: String,
    /// The address an etcd member on this machine advertises; the machine's first address
    /// when unset.
    pub etcd_advertise_address: Option<std::net::IpAddr>,
}

fn read_layer(path: &Path) -> Result<RawConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File { path: path.to_owned(), message: e.to_string() })?;
    toml::from_str(&text).map_err(|e| ConfigError::File { path: path.to_owned(), message: e.to_string().trim().replace('\n', " ") })
}

/// Loads `file` and the drop-ins next to it (`agent.d/*.toml` beside `agent.toml`).
/// `state_dir_override` (the `--state-dir` flag) wins over the files.
pub fn load(file: &Path, state_dir_override: Option<&Path>) -> Result<AgentConfig, ConfigError> {
    let mut raw = read_layer(file)?;
    let dropins = file.parent().unwrap_or(Path::new("/")).join("agent.d");
    if let Ok(entries) = std::fs::read_dir(&dropins) {
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "toml")).collect();
        paths.sort();
        for p in paths {
            raw.overlay(read_layer(&p)?);
        }
    }
    if let Some(dir) = state_dir_override {
        raw.state_dir = Some(dir.to_owned());
    }
    validate(raw)
}

fn seconds(key: &'static str, value: Option<u64>, default: u64, min: u64, max: u64) -> Result<Duration, ConfigError> {
    let v = value.unwrap_or(default);
    if !(min..=max).contains(&v) {
        return Err(ConfigError::Invalid { key, message: format!("{v} is not between {min} and {max} seconds") });
    }
    Ok(Duration::from_secs(v))
}

fn validate(raw: RawConfig) -> Result<AgentConfig, ConfigError> {
    let servers = raw.servers.unwrap_or_default();
    if servers.is_empty() {
        return Err(ConfigError::Invalid { key: "servers", message: "needs at least one controller URL".into() });
    }
    for s in &servers {
        if !s.starts_with("https://") {
            return Err(ConfigError::Invalid { key: "servers", message: format!("{s:?} is not an https:// URL") });
        }
    }
    let ca_file = raw.ca_file.ok_or(ConfigError::Invalid { key: "ca_file", message: "is required".into() })?;
    if let Some(t) = &raw.token {
        t.parse::<keelson_api::token::TokenString>().map_err(|e| ConfigError::Invalid { key: "token", message: e })?;
    }
    let name = raw.name.map(|n| n.parse::<Name>().map_err(|e| ConfigError::Invalid { key: "name", message: e.to_string() })).transpose()?;
    Ok(AgentConfig {
        servers,
        ca_file,
        token: raw.token,
        name,
        state_dir: raw.state_dir.unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
        heartbeat_interval: seconds("heartbeat_interval_seconds", raw.heartbeat_interval_seconds, 10, 1, 3600)?,
        drift_interval: seconds("drift_interval_seconds", raw.drift_interval_seconds, 600, 5, 86_400)?,
        lease_ttl: seconds("lease_ttl_seconds", raw.lease_ttl_seconds, 120, 10, 3600)?,
        log_level: raw.log_level.unwrap_or_else(|| "info".into()),
        etcd_advertise_address: raw
            .etcd_advertise_address
            .map(|a| {
                a.parse::<std::net::IpAddr>()
                    .map_err(|_| ConfigError::Invalid { key: "etcd_advertise_address", message: format!("{a:?} is not an IP address") })
            })
            .transpose()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_ins_override_in_name_order_and_errors_name_the_key() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let main = dir.path().join("agent.toml");
        std::fs::write(&main, "servers = [\"https://a:9443\"]\nca_file = \"/etc/keelson/ca.crt\"\nheartbeat_interval_seconds = 10\n")?;
        std::fs::create_dir(dir.path().join("agent.d"))?;
        std::fs::write(dir.path().join("agent.d/20-late.toml"), "heartbeat_interval_seconds = 30\n")?;
        std::fs::write(dir.path().join("agent.d/10-early.toml"), "heartbeat_interval_seconds = 20\nname = \"w1\"\n")?;
        let c = load(&main, None)?;
        assert_eq!(c.heartbeat_interval, Duration::from_secs(30));
        assert_eq!(c.name.map(|n| n.to_string()).as_deref(), Some("w1"));
        std::fs::write(dir.path().join("agent.d/30-bad.toml"), "heartbeat_interval_seconds = 0\n")?;
        let err = load(&main, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "heartbeat_interval_seconds: 0 is not between 1 and 3600 seconds");
        std::fs::write(dir.path().join("agent.d/30-bad.toml"), "heartbeat = 5\n")?;
        let err = load(&main, None).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("30-bad.toml") && err.contains("unknown field"), "{err}");
        Ok(())
    }
}
