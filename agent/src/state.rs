//! The agent's state directory: its key, certificate, the controller's CA and URL.
//! Every file is written atomically (temp file, fsync, rename, fsync of the directory).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

pub const KEY_FILE: &str = "machine.key";
pub const CERT_FILE: &str = "machine.crt";
pub const CA_FILE: &str = "ca.crt";
pub const IDENTITY_FILE: &str = "identity.json";

#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct StateError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), StateError> {
    let err = |p: &Path| {
        let p = p.to_owned();
        move |source| StateError { path: p, source }
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp).map_err(err(&tmp))?;
        f.write_all(contents).map_err(err(&tmp))?;
        f.sync_all().map_err(err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(err(path))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(err(dir))
}

/// Creates the state directory, readable by root only.
pub fn ensure_dir(dir: &Path) -> Result<(), StateError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|source| StateError { path: dir.to_owned(), source })?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(|source| StateError { path: dir.to_owned(), source })
}
