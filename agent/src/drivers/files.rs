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
