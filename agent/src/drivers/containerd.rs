//! containerd: installed from a package (see `apt`) or from a release tarball, whose `bin/`
//! binaries go to /usr/local/bin with a unit of keelson's; its health as seen through its
//! socket (`ctr version` answers for both client and server only when the daemon serves).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::command::{CommandError, run};
use super::files;
use crate::ledger::FileStamp;

const HEALTH_WAIT_SECS: u64 = 60;
/// Where binaries from a release tarball go; first on systemd's default PATH, so the shims
/// containerd starts are the tarball's too.
pub const BIN_DIR: &str = "/usr/local/bin";
pub const UNIT: &str = "/etc/systemd/system/containerd.service";
/// A tarball larger than this is not a containerd release.
const MAX_BINARY_BYTES: u64 = 512 << 20;

/// The unit for containerd from a tarball. It sits in /etc, so it wins over a package's unit
/// in /lib while it is there.
pub const UNIT_CONTENT: &str = "# Managed by keelson-agent: containerd from a release tarball.
[Unit]
Description=containerd container runtime
Documentation=https://containerd.io
After=network.target local-fs.target

[Service]
ExecStartPre=-/sbin/modprobe overlay
ExecStart=/usr/local/bin/containerd
Type=notify
Delegate=yes
KillMode=process
Restart=always
RestartSec=5
LimitNPROC=infinity
LimitCORE=infinity
TasksMax=infinity
OOMScoreAdjust=-999

[Install]
WantedBy=multi-user.target
";

#[derive(Debug, thiserror::Error)]
pub enum TarballError {
    #[error("{path}: not a release tarball of {what}: {message}")]
    Invalid { path: PathBuf, what: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Unpacks the regular files directly under `bin/` of a gzipped release tarball into
/// `staging`, returning their names. Nothing else in the tarball is written anywhere.
pub fn unpack_binaries(tarball: &Path, staging: &Path) -> Result<Vec<String>, TarballError> {
    unpack_release(tarball, staging, ("bin/", |dir: &str| dir == "bin"), &["containerd", "ctr"], "containerd")
}

/// Unpacks the regular files one directory deep whose directory `dir_matches` (a release's
/// `bin/`, or etcd's `etcd-vX.Y.Z-linux-amd64/`; the label names it in errors) into
/// `staging`; `required` must be among them. Returns their names, sorted.
pub fn unpack_release(
    tarball: &Path,
    staging: &Path,
    (dir_label, dir_matches): (&str, impl Fn(&str) -> bool),
    required: &[&str],
    what: &str,
) -> Result<Vec<String>, TarballError> {
    use std::os::unix::fs::PermissionsExt;
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| TarballError::Io { path, source }
    };
    let invalid = |message: String| TarballError::Invalid { path: tarball.to_owned(), what: what.to_owned(), message };
    std::fs::create_dir_all(staging).map_err(io(staging))?;
    let file = std::fs::File::open(tarball).map_err(io(tarball))?;
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(file));
    let mut names = Vec::new();
    for entry in archive.entries().map_err(|e| invalid(e.to_string()))? {
        let mut entry = entry.map_err(|e| invalid(e.to_string()))?;
        if entry.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let path = entry.path().map_err(|e| invalid(e.to_string()))?.into_owned();
        let parts: Vec<_> = path.components().filter(|c| !matches!(c, std::path::Component::CurDir)).collect();
        let [std::path::Component::Normal(dir), std::path::Component::Normal(name)] = parts.as_slice() else { continue };
        if !dir_matches(&dir.to_string_lossy()) {
            continue;
        }
        let name = name.to_string_lossy().into_owned();
        if entry.size() > MAX_BINARY_BYTES {
            return Err(invalid(format!("{} is {} bytes", path.display(), entry.size())));
        }
        let out = staging.join(&name);
        let mut bytes = Vec::with_capacity(entry.size() as usize);
        entry.read_to_end(&mut bytes).map_err(|e| invalid(format!("{}: {e}", path.display())))?;
        std::fs::write(&out, &bytes).map_err(io(&out))?;
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o755)).map_err(io(&out))?;
        names.push(name);
    }
    for r in required {
        if !names.iter().any(|n| n == r) {
            return Err(invalid(format!("it has no {dir_label}{r}")));
        }
    }
    names.sort();
    Ok(names)
}

/// Installs the tarball's binaries into `bin_dir`, each by rename with the previous kept;
/// returns what the ledger records for each.
pub fn install_tarball(tarball: &Path, bin_dir: &Path) -> Result<BTreeMap<String, FileStamp>, TarballError> {
    stage(bin_dir, |staging| unpack_binaries(tarball, staging))?.install()
}

/// Binaries unpacked into a staging directory beside where they go, not yet in place: the
/// slow part of an install (decompressing a release), done while the old binaries still
/// serve. Dropping it without `install` leaves `bin_dir` as it was.
#[derive(Debug)]
pub struct Staged {
    bin_dir: PathBuf,
    staging: PathBuf,
    names: Vec<String>,
}

/// Unpacks with `unpack` into a staging directory beside `bin_dir`.
pub fn stage(bin_dir: &Path, unpack: impl FnOnce(&Path) -> Result<Vec<String>, TarballError>) -> Result<Staged, TarballError> {
    let staging = bin_dir.join(".keelson-staging");
    let _ = std::fs::remove_dir_all(&staging);
    // From here on, dropping the Staged removes the directory, on error too.
    let mut staged = Staged { bin_dir: bin_dir.to_owned(), staging, names: Vec::new() };
    staged.names = unpack(&staged.staging)?;
    Ok(staged)
}

impl Staged {
    /// Moves each binary into place by rename (same file system: no copy), keeping the
    /// previous; returns what the ledger records for each.
    pub fn install(self) -> Result<BTreeMap<String, FileStamp>, TarballError> {
        let mut stamps = BTreeMap::new();
        for name in &self.names {
            let target = self.bin_dir.join(name);
            files::replace_keeping_previous(&self.staging.join(name), &target)
                .map_err(|source| TarballError::Io { path: target.clone(), source })?;
            let stamp = FileStamp::of(&target).map_err(|source| TarballError::Io { path: target.clone(), source })?;
            stamps.insert(target.to_string_lossy().into_owned(), stamp);
        }
        Ok(stamps)
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.staging);
    }
}

/// Puts back the binaries an install displaced (and removes the ones that displaced none).
pub fn restore_binaries(installed: &BTreeMap<String, FileStamp>) -> std::io::Result<()> {
    for path in installed.keys() {
        let path = Path::new(path);
        if !files::restore_previous(path)? {
            std::fs::remove_file(path)?;
        }
    }
    Ok(())
}

/// Whether the daemon's reported version is the release the spec names: `v1.7.22` is
/// `1.7.22`, and a distribution's build of it (`1.6.20~ds1`, `1.7.22-1`) is that release too.
pub fn same_release(serving: &str, wanted: &str) -> bool {
    let (s, w) = (serving.trim_start_matches('v'), wanted.trim_start_matches('v'));
    s == w || s.strip_prefix(w).is_some_and(|rest| rest.starts_with(['~', '-', '+']))
}

/// Waits until `ctr version` reaches the daemon; returns the server version it reports.
pub async fn wait_healthy(ctr: &str) -> Result<String, CommandError> {
    let deadline = Instant::now() + Duration::from_secs(HEALTH_WAIT_SECS);
    loop {
        match run(&[ctr, "version"], &[], Duration::from_secs(10)).await {
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
pub(crate) mod tests {
    use super::*;

    #[test]
    fn parses_ctr_version() {
        let out = "Client:\n  Version:  1.6.20~ds1\n  Revision: 1.6.20~ds1-1+deb12u3\n  Go version: go1.19.8\n\nServer:\n  Version:  1.6.20~ds1\n  Revision: 1.6.20~ds1-1+deb12u3\n  UUID: 1b2\n";
        assert_eq!(parse_server_version(out).as_deref(), Some("1.6.20~ds1"));
        assert_eq!(parse_server_version("Client:\n  Version: 1\n"), None);
    }

    pub(crate) fn tarball(dir: &Path, entries: &[(&str, &[u8])]) -> anyhow::Result<PathBuf> {
        let path = dir.join("containerd.tar.gz");
        let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(std::fs::File::create(&path)?, flate2::Compression::fast()));
        for (name, bytes) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o755);
            header.set_cksum();
            builder.append_data(&mut header, name, *bytes)?;
        }
        builder.into_inner()?.finish()?;
        Ok(path)
    }

    #[test]
    fn release_versions_match_with_or_without_v_and_build_suffixes() {
        assert!(same_release("v1.7.22", "1.7.22"));
        assert!(same_release("1.6.20~ds1", "1.6.20"));
        assert!(!same_release("1.6.201", "1.6.20"));
        assert!(!same_release("1.6.19", "1.6.20"));
    }

    #[test]
    fn a_staged_release_changes_nothing_until_installed() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let bin = dir.path().join("bin-dir");
        std::fs::create_dir_all(&bin)?;
        std::fs::write(bin.join("containerd"), b"old daemon")?;
        let t = tarball(dir.path(), &[("bin/containerd", b"new daemon"), ("bin/ctr", b"new ctr")])?;
        let staged = stage(&bin, |staging| unpack_binaries(&t, staging))?;
        assert_eq!(std::fs::read(bin.join("containerd"))?, b"old daemon");
        assert!(!bin.join("ctr").exists());
        drop(staged);
        let names: Vec<_> = std::fs::read_dir(&bin)?.map(|e| e.map(|e| e.file_name())).collect::<Result<_, _>>()?;
        assert_eq!(names, ["containerd"], "an abandoned staging directory is removed");
        Ok(())
    }

    #[test]
    fn installs_only_bin_files_and_rolls_back() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let bin = dir.path().join("bin-dir");
        std::fs::create_dir_all(&bin)?;
        std::fs::write(bin.join("containerd"), b"old daemon")?;
        let t = tarball(
            dir.path(),
            &[("bin/containerd", b"new daemon"), ("./bin/ctr", b"new ctr"), ("etc/evil", b"no"), ("bin/sub/x", b"no")],
        )?;
        let stamps = install_tarball(&t, &bin)?;
        let mut names: Vec<_> =
            std::fs::read_dir(&bin)?.map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned())).collect::<Result<_, _>>()?;
        names.sort();
        assert_eq!(names, vec!["containerd", "containerd.keelson-previous", "ctr"]);
        assert_eq!(std::fs::read(bin.join("containerd"))?, b"new daemon");
        assert_eq!(stamps.len(), 2);
        restore_binaries(&stamps)?;
        assert_eq!(std::fs::read(bin.join("containerd"))?, b"old daemon");
        assert!(!bin.join("ctr").exists(), "a binary with nothing before it is removed on rollback");
        Ok(())
    }

    #[test]
    fn a_tarball_without_containerd_is_refused() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let t = tarball(dir.path(), &[("bin/ctr", b"x")])?;
        let err = install_tarball(&t, dir.path()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.ends_with("not a release tarball of containerd: it has no bin/containerd"), "{err}");
        std::fs::write(dir.path().join("junk.tar.gz"), b"not gzip")?;
        assert!(install_tarball(&dir.path().join("junk.tar.gz"), dir.path()).is_err());
        Ok(())
    }
}
