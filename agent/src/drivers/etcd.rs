//! etcd on this machine: where keelson puts the member (its own unit, environment file, data
//! directory and TLS files), the binary from Debian's `etcd-server` package or from a release
//! tarball, and what `etcd --version` says.
//!
//! keelson runs the member as `keelson-etcd.service`. The package's own `etcd.service` is
//! masked before the package is installed, so that its post-install script never starts a
//! stray single-node etcd with the package's defaults.

use std::net::IpAddr;
use std::path::Path;

use super::containerd::{Staged, TarballError, stage, unpack_release};

pub const UNIT_NAME: &str = "keelson-etcd.service";
pub const UNIT: &str = "/etc/systemd/system/keelson-etcd.service";
/// The member's settings: name, URLs, data directory, TLS. Managed; drift is corrected.
pub const ENV_FILE: &str = "/etc/keelson/etcd/etcd.env";
/// How the member first started (new cluster, or joining an existing one). Written once by
/// the join; etcd ignores it as soon as the data directory holds a member.
pub const INITIAL_ENV_FILE: &str = "/etc/keelson/etcd/initial.env";
pub const PKI_DIR: &str = "/etc/keelson/etcd/pki";
pub const DATA_DIR: &str = "/var/lib/keelson-etcd";
/// Debian's unit for the package's etcd; masked while keelson runs the member.
pub const PACKAGE_UNIT: &str = "etcd.service";
pub const PACKAGE_BINARY: &str = "/usr/bin/etcd";
pub const TARBALL_BIN_DIR: &str = "/usr/local/bin";
pub const TARBALL_BINARY: &str = "/usr/local/bin/etcd";
pub const CLIENT_PORT: u16 = 2379;
pub const PEER_PORT: u16 = 2380;

/// The binary the unit runs for a spec whose source is a tarball or a package.
pub fn binary(tarball: bool) -> &'static str {
    if tarball { TARBALL_BINARY } else { PACKAGE_BINARY }
}

fn url(address: IpAddr, port: u16) -> String {
    match address {
        IpAddr::V4(a) => format!("https://{a}:{port}"),
        IpAddr::V6(a) => format!("https://[{a}]:{port}"),
    }
}

pub fn client_url(address: IpAddr) -> String {
    url(address, CLIENT_PORT)
}

pub fn peer_url(address: IpAddr) -> String {
    url(address, PEER_PORT)
}

/// The local client URL the agent itself talks to.
pub fn local_client_url() -> String {
    url(IpAddr::from([127, 0, 0, 1]), CLIENT_PORT)
}

pub fn unit_content(binary: &str) -> String {
    format!(
        "# Managed by keelson-agent: changes are overwritten.
[Unit]
Description=etcd member (keelson)
Documentation=https://etcd.io
After=network-online.target
Wants=network-online.target

[Service]
Type=notify
EnvironmentFile={ENV_FILE}
EnvironmentFile=-{INITIAL_ENV_FILE}
ExecStart={binary}
Restart=always
RestartSec=5
TimeoutStartSec=300
LimitNOFILE=65536

[Install]
WantedBy=multi-user.target
"
    )
}

/// The member's settings, in etcd's own environment variables. Clients and peers must present
/// a certificate from the cluster's CA; the member listens on its address and on loopback.
pub fn env_content(name: &str, address: IpAddr, cluster: &str) -> String {
    let client = client_url(address);
    let peer = peer_url(address);
    let local = local_client_url();
    format!(
        "# Managed by keelson-agent: changes are overwritten.
ETCD_NAME={name}
ETCD_DATA_DIR={DATA_DIR}
ETCD_LISTEN_CLIENT_URLS={client},{local}
ETCD_ADVERTISE_CLIENT_URLS={client}
ETCD_LISTEN_PEER_URLS={peer}
ETCD_INITIAL_ADVERTISE_PEER_URLS={peer}
ETCD_INITIAL_CLUSTER_TOKEN=keelson-{cluster}
ETCD_CLIENT_CERT_AUTH=true
ETCD_TRUSTED_CA_FILE={PKI_DIR}/ca.crt
ETCD_CERT_FILE={PKI_DIR}/member.crt
ETCD_KEY_FILE={PKI_DIR}/member.key
ETCD_PEER_CLIENT_CERT_AUTH=true
ETCD_PEER_TRUSTED_CA_FILE={PKI_DIR}/ca.crt
ETCD_PEER_CERT_FILE={PKI_DIR}/member.crt
ETCD_PEER_KEY_FILE={PKI_DIR}/member.key
"
    )
}

/// How the member starts the first time: `new` with only itself, or `existing` with the
/// members the join found.
pub fn initial_env_content(state: &str, initial_cluster: &str) -> String {
    format!(
        "# Written by keelson-agent when this member first started; etcd ignores it afterwards.
ETCD_INITIAL_CLUSTER_STATE={state}
ETCD_INITIAL_CLUSTER={initial_cluster}
"
    )
}

/// `etcd --version` prints `etcd Version: 3.5.1` first.
pub fn parse_version(out: &str) -> Option<String> {
    out.lines().find_map(|l| l.strip_prefix("etcd Version:")).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// What the binary at `binary` (under `root`) says it is.
pub fn installed_version(root: &Path, binary: &str) -> Option<String> {
    let out = std::process::Command::new(root.join(binary.trim_start_matches('/'))).arg("--version").output().ok()?;
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

/// The data directory holds a member (etcd's `member/` directory).
pub fn has_member_data(root: &Path) -> bool {
    root.join(DATA_DIR.trim_start_matches('/')).join("member").is_dir()
}

/// The etcd release tarball's `etcd`, `etcdctl` and `etcdutl` (3.5 and later; 3.4 has no
/// etcdutl) unpacked beside `bin_dir` (`TARBALL_BIN_DIR`), to be moved in by rename with the
/// previous binaries kept.
pub fn stage_tarball(tarball: &Path, bin_dir: &Path) -> Result<Staged, TarballError> {
    stage(bin_dir, |staging| {
        let names = unpack_release(tarball, staging, ("etcd-v*/", |dir: &str| dir.starts_with("etcd-v")), &["etcd", "etcdctl"], "etcd")?;
        // Only etcd's own binaries go to /usr/local/bin, whatever else the tarball carries.
        for n in names.iter().filter(|n| !["etcd", "etcdctl", "etcdutl"].contains(&n.as_str())) {
            let _ = std::fs::remove_file(staging.join(n));
        }
        Ok(names.into_iter().filter(|n| ["etcd", "etcdctl", "etcdutl"].contains(&n.as_str())).collect())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_etcds_own_binaries_are_installed_from_its_tarball() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let t = crate::drivers::containerd::tests::tarball(
            dir.path(),
            &[
                ("etcd-v3.5.1-linux-amd64/etcd", b"new etcd"),
                ("etcd-v3.5.1-linux-amd64/etcdctl", b"new etcdctl"),
                ("etcd-v3.5.1-linux-amd64/README.md", b"docs"),
                ("etcd-v3.5.1-linux-amd64/Documentation/dev-guide.md", b"docs"),
            ],
        )?;
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin)?;
        std::fs::write(bin.join("etcd"), b"old etcd")?;
        let stamps = stage_tarball(&t, &bin)?.install()?;
        let mut names: Vec<String> = std::fs::read_dir(&bin)?.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, ["etcd", "etcd.keelson-previous", "etcdctl"]);
        assert_eq!(std::fs::read(bin.join("etcd"))?, b"new etcd");
        assert_eq!(stamps.len(), 2);
        // The previous binary comes back on a rollback; a binary that replaced none goes.
        crate::drivers::containerd::restore_binaries(&stamps)?;
        assert_eq!(std::fs::read(bin.join("etcd"))?, b"old etcd");
        assert!(!bin.join("etcdctl").exists());
        let no_etcd = crate::drivers::containerd::tests::tarball(dir.path(), &[("etcd-v3.5.1-linux-amd64/etcdctl", b"x")])?;
        let err = stage_tarball(&no_etcd, &bin).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.ends_with("not a release tarball of etcd: it has no etcd-v*/etcd"), "{err}");
        Ok(())
    }

    #[test]
    fn parses_etcd_version() {
        let out = "etcd Version: 3.4.23\nGit SHA: Not provided (use ./build instead of go build)\nGo Version: go1.19.8\n";
        assert_eq!(parse_version(out).as_deref(), Some("3.4.23"));
        assert_eq!(parse_version("garbage"), None);
    }

    #[test]
    fn settings_name_the_member_and_require_certificates() {
        let env = env_content("etcd-1", "192.168.77.11".parse().expect("an address"), "main");
        for line in [
            "ETCD_NAME=etcd-1",
            "ETCD_LISTEN_CLIENT_URLS=https://192.168.77.11:2379,https://127.0.0.1:2379",
            "ETCD_ADVERTISE_CLIENT_URLS=https://192.168.77.11:2379",
            "ETCD_INITIAL_ADVERTISE_PEER_URLS=https://192.168.77.11:2380",
            "ETCD_CLIENT_CERT_AUTH=true",
            "ETCD_PEER_CLIENT_CERT_AUTH=true",
        ] {
            assert!(env.lines().any(|l| l == line), "{line} missing from\n{env}");
        }
        assert_eq!(peer_url("fd00::7".parse().expect("an address")), "https://[fd00::7]:2380");
        assert!(unit_content(TARBALL_BINARY).contains("ExecStart=/usr/local/bin/etcd\n"));
    }
}
