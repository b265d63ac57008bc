//! Artifacts pinned by digest: streamed from https://, http:// or file://, hashed while they
//! stream, kept in a bounded cache under the state directory, and only ever used once their
//! SHA-256 matches. A mismatch or a failed write removes the partial file and says so.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

/// Artifacts kept in the cache; the oldest go first.
const CACHE_KEEP: usize = 8;
const DOWNLOAD_TIMEOUT_SECS: u64 = 1800;

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("artifact {url}: sha256 mismatch: expected {expected}, got {actual}; nothing was installed")]
    Mismatch { url: String, expected: String, actual: String },
    #[error("artifact {url}: {message}")]
    Fetch { url: String, message: String },
    #[error("artifact cache {path}: {message}")]
    Cache { path: PathBuf, message: String },
}

pub fn cache_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("artifacts")
}

/// The cached path of an artifact with this digest.
pub fn cached(state_dir: &Path, sha256: &str) -> PathBuf {
    cache_dir(state_dir).join(sha256)
}

fn http_client(ca_pem: Option<&str>) -> Result<reqwest::Client, String> {
    // The controller's CA and the system's roots.
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(pem) = ca_pem {
        use rustls_pki_types::pem::PemObject;
        for cert in rustls_pki_types::CertificateDer::pem_slice_iter(pem.as_bytes()).flatten() {
            let _ = roots.add(cert);
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .timeout(std::time::Duration::from_secs(DOWNLOAD_TIMEOUT_SECS))
        .build()
        .map_err(|e| e.to_string())
}

/// Makes sure the artifact is in the cache with the right digest; returns its path.
pub async fn fetch(state_dir: &Path, url: &url::Url, sha256: &str, ca_pem: Option<&str>) -> Result<PathBuf, ArtifactError> {
    let dir = cache_dir(state_dir);
    let target = cached(state_dir, sha256);
    let cache_err = |message: String| ArtifactError::Cache { path: dir.clone(), message };
    if target.exists() {
        let bytes = tokio::fs::read(&target).await.map_err(|e| cache_err(e.to_string()))?;
        // Off the agent's one runtime thread: hashing a large release must not hold up its
        // heartbeats and watchdog.
        let digest = tokio::task::spawn_blocking(move || hex::encode(Sha256::digest(&bytes)))
            .await
            .map_err(|e| cache_err(format!("hashing the cached file: {e}")))?;
        if digest == sha256 {
            return Ok(target);
        }
        // A cached file that no longer matches is not trusted.
        let _ = tokio::fs::remove_file(&target).await;
    }
    tokio::fs::create_dir_all(&dir).await.map_err(|e| cache_err(e.to_string()))?;
    let partial = dir.join(format!(".partial-{sha256}"));
    let result = download(url, &partial, ca_pem).await;
    let actual = match result {
        Ok(digest) => digest,
        Err(e) => {
            let _ = tokio::fs::remove_file(&partial).await;
            return Err(e);
        }
    };
    if actual != sha256 {
        let _ = tokio::fs::remove_file(&partial).await;
        return Err(ArtifactError::Mismatch { url: url.to_string(), expected: sha256.to_owned(), actual });
    }
    tokio::fs::rename(&partial, &target).await.map_err(|e| cache_err(e.to_string()))?;
    prune(&dir).await;
    Ok(target)
}

/// Streams `url` into `path`, returning the SHA-256 of what was written.
async fn download(url: &url::Url, path: &Path, ca_pem: Option<&str>) -> Result<String, ArtifactError> {
    let fetch_err = |message: String| ArtifactError::Fetch { url: url.to_string(), message };
    let mut file = tokio::fs::File::create(path).await.map_err(|e| fetch_err(format!("{}: {e}", path.display())))?;
    let mut hasher = Sha256::new();
    if url.scheme() == "file" {
        let source = url.to_file_path().map_err(|_| fetch_err("not a local path".into()))?;
        let mut reader = tokio::fs::File::open(&source).await.map_err(|e| fetch_err(e.to_string()))?;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            use tokio::io::AsyncReadExt;
            let n = reader.read(&mut buf).await.map_err(|e| fetch_err(e.to_string()))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            file.write_all(&buf[..n]).await.map_err(|e| fetch_err(format!("writing: {e}")))?;
        }
    } else {
        let client = http_client(ca_pem).map_err(fetch_err)?;
        let response = client.get(url.clone()).send().await.map_err(|e| fetch_err(keelson_api::error_chain(&e)))?;
        if !response.status().is_success() {
            return Err(fetch_err(format!("server answered {}", response.status())));
        }
        let mut stream = response.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| fetch_err(keelson_api::error_chain(&e)))?;
            hasher.update(&chunk);
            // A full disk ends here, and the caller removes the partial file.
            file.write_all(&chunk).await.map_err(|e| fetch_err(format!("writing: {e}")))?;
        }
    }
    file.sync_all().await.map_err(|e| fetch_err(format!("writing: {e}")))?;
    Ok(hex::encode(hasher.finalize()))
}

/// Keeps the newest `CACHE_KEEP` artifacts.
async fn prune(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    files.sort();
    let excess = files.len().saturating_sub(CACHE_KEEP);
    for (_, p) in files.into_iter().take(excess) {
        let _ = std::fs::remove_file(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn file_artifacts_are_checked_and_a_mismatch_leaves_nothing() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let source = dir.path().join("kubelet");
        std::fs::write(&source, b"binary contents")?;
        let url = url::Url::from_file_path(&source).map_err(|_| anyhow::anyhow!("url"))?;
        let good = hex::encode(Sha256::digest(b"binary contents"));
        let path = fetch(dir.path(), &url, &good, None).await?;
        assert_eq!(std::fs::read(&path)?, b"binary contents");
        let bad = "0".repeat(64);
        let err = fetch(dir.path(), &url, &bad, None).await.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("sha256 mismatch") && err.contains(&good), "{err}");
        assert!(!cached(dir.path(), &bad).exists());
        let leftovers: Vec<_> = std::fs::read_dir(cache_dir(dir.path()))?.flatten().map(|e| e.file_name()).collect();
        assert_eq!(leftovers.len(), 1, "only the good artifact is cached: {leftovers:?}");
        Ok(())
    }
}
