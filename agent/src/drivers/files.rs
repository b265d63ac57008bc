//! Managed files: written atomically with the spec's mode and owner.

use std::path::Path;

use crate::state::{StateError, write_atomic};

#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error(transparent)]
    Write(#[from] StateError),
    #[error("{path}: owner {owner:?}: {message}")]
    Owner { path: String, owner: String, message: String },
}

/// `user` or `user:group`, by name (from /etc/passwd and /etc/group) or number.
fn resolve_owner(owner: &str) -> Result<(u32, Option<u32>), String> {
    let lookup = |file: &str, name: &str| -> Result<u32, String> {
        if let Ok(n) = name.parse() {
            return Ok(n);
        }
        let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
        text.lines()
            .find_map(|l| {
                let mut f = l.split(':');
                (f.next() == Some(name)).then(|| f.nth(1).and_then(|id| id.parse().ok())).flatten()
            })
            .ok_or_else(|| format!("{name} is not in {file}"))
    };
    let (user, group) = owner.split_once(':').map_or((owner, None), |(u, g)| (u, Some(g)));
    Ok((lookup("/etc/passwd", user)?, group.map(|g| lookup("/etc/group", g)).transpose()?))
}

pub fn write(path: &str, content: &str, mode: u32, owner: Option<&str>) -> Result<(), FileError> {
    let p = Path::new(path);
    if let Some(dir) = p.parent() {
        std::fs::create_dir_all(dir).map_err(|source| StateError { path: dir.to_owned(), source })?;
    }
    let ids = owner.map(resolve_owner).transpose().map_err(|message| FileError::Owner {
        path: path.into(),
        owner: owner.unwrap_or_default().into(),
        message,
    })?;
    write_atomic(p, content.as_bytes(), mode)?;
    // The umask may have narrowed the mode at creation.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(|source| StateError { path: p.to_owned(), source })?;
    if let Some((uid, gid)) = ids {
        std::os::unix::fs::chown(p, Some(uid), gid).map_err(|e| FileError::Owner {
            path: path.into(),
            owner: owner.unwrap_or_default().into(),
            message: e.to_string(),
        })?;
    }
    Ok(())
}

/// Where the binary a replacement displaced is kept, for a rollback.
pub fn previous_path(target: &Path) -> std::path::PathBuf {
    let mut p = target.as_os_str().to_owned();
    p.push(".keelson-previous");
    p.into()
}

fn same_bytes(a: &Path, b: &Path) -> std::io::Result<bool> {
    if std::fs::metadata(a)?.len() != std::fs::metadata(b)?.len() {
        return Ok(false);
    }
    Ok(std::fs::read(a)? == std::fs::read(b)?)
}

/// Puts the `staged` file (on the same file system) in place of `target`, keeping the
/// current one as the previous. A step re-run after a crash finds `target` already equal to
/// `staged` and leaves the previous binary alone.
pub fn replace_keeping_previous(staged: &Path, target: &Path) -> std::io::Result<()> {
    std::fs::File::open(staged)?.sync_all()?;
    if target.exists() {
        if same_bytes(staged, target)? {
            return std::fs::remove_file(staged);
        }
        std::fs::rename(target, previous_path(target))?;
    }
    std::fs::rename(staged, target)?;
    std::fs::File::open(target.parent().unwrap_or(Path::new("/")))?.sync_all()
}

/// Installs a copy of `artifact` as the executable `target` (mode 0755), keeping the current
/// one as the previous.
pub fn install_executable(artifact: &Path, target: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mut staged = target.as_os_str().to_owned();
    staged.push(".keelson-new");
    let staged = std::path::PathBuf::from(staged);
    std::fs::copy(artifact, &staged)?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755))?;
    replace_keeping_previous(&staged, target)
}

/// Puts the previous binary back; `false` when there was none.
pub fn restore_previous(target: &Path) -> std::io::Result<bool> {
    let previous = previous_path(target);
    if !previous.exists() {
        return Ok(false);
    }
    std::fs::rename(previous, target)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replacing_keeps_the_previous_and_a_rerun_keeps_it_too() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let target = dir.path().join("tool");
        std::fs::write(&target, b"old")?;
        let stage = |bytes: &[u8]| -> std::io::Result<std::path::PathBuf> {
            let s = dir.path().join("tool.keelson-new");
            std::fs::write(&s, bytes)?;
            Ok(s)
        };
        replace_keeping_previous(&stage(b"new")?, &target)?;
        // The same step again, as after a crash between the rename and the journal write.
        replace_keeping_previous(&stage(b"new")?, &target)?;
        assert_eq!(std::fs::read(&target)?, b"new");
        assert_eq!(std::fs::read(previous_path(&target))?, b"old");
        assert!(restore_previous(&target)?);
        assert_eq!(std::fs::read(&target)?, b"old");
        assert!(!restore_previous(&target)?);
        Ok(())
    }
}
