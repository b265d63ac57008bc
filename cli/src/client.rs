//! The CLI's connection to the controller: mTLS from the credential file, each server URL
//! tried in turn until one answers, and server errors turned into one readable line.

use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use keelson_api::config::ClientConfig;
use keelson_api::wire::ErrorBody;
use reqwest::{Method, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;

const REQUEST_TIMEOUT_SECS: u64 = 30;
const CONNECT_TIMEOUT_SECS: u64 = 5;

#[derive(Debug)]
pub struct Client {
    http: reqwest::Client,
    servers: Vec<String>,
}

/// `--config`, then `KEELSON_CONFIG` (clap fills both into `explicit`), then
/// `~/.config/keelson/config`.
pub fn config_path(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p);
    }
    let home = std::env::var_os("HOME").ok_or_else(|| anyhow!("no config: pass --config FILE or set KEELSON_CONFIG"))?;
    let p = Path::new(&home).join(".config/keelson/config");
    if p.exists() {
        Ok(p)
    } else {
        bail!("no config: pass --config FILE, set KEELSON_CONFIG, or copy the controller's admin.conf to {}", p.display())
    }
}

impl Client {
    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        let config = ClientConfig::from_yaml(&text).map_err(|e| anyhow!("config {}: {e}", path.display()))?;
        let tls = keelson_api::tls::client_config(&config.certificate_authority, Some((&config.client_certificate, &config.client_key)))
            .with_context(|| format!("config {}", path.display()))?;
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(std::time::Duration::from_secs(CONNECT_TIMEOUT_SECS))
            .timeout(std::time::Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .build()
            .context("building the HTTP client")?;
        Ok(Client { http, servers: config.servers })
    }

    async fn send(&self, method: Method, path: &str, body: Option<&serde_json::Value>) -> anyhow::Result<(StatusCode, bytes::Bytes)> {
        let mut last_error = None;
        for server in &self.servers {
            let url = format!("{}{}", server.trim_end_matches('/'), path);
            let mut request = self.http.request(method.clone(), &url);
            if let Some(b) = body {
                request = request.json(b);
            }
            match request.send().await {
                Ok(response) => {
                    let status = response.status();
                    let bytes = response.bytes().await.with_context(|| format!("reading the answer from {server}"))?;
                    return Ok((status, bytes));
                }
                // Only failures to reach a server move on to the next one; an answer is final.
                Err(e) if e.is_connect() || e.is_timeout() => last_error = Some(anyhow!("{server}: {}", keelson_api::error_chain(&e))),
                Err(e) => return Err(anyhow!("{server}: {}", keelson_api::error_chain(&e))),
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("no controller URL configured")))
    }

    pub async fn call<T: DeserializeOwned>(&self, method: Method, path: &str, body: Option<&impl Serialize>) -> anyhow::Result<T> {
        let body = body.map(serde_json::to_value).transpose()?;
        let (status, bytes) = self.send(method, path, body.as_ref()).await?;
        if !status.is_success() {
            return Err(server_error(status, &bytes));
        }
        serde_json::from_slice(&bytes).with_context(|| format!("unexpected answer to {path}"))
    }

    /// A call whose answer needs no body; returns the status (204, or 202 for accepted).
    pub async fn call_empty(&self, method: Method, path: &str) -> anyhow::Result<StatusCode> {
        let (status, bytes) = self.send(method, path, None).await?;
        if !status.is_success() {
            return Err(server_error(status, &bytes));
        }
        Ok(status)
    }
}

fn server_error(status: StatusCode, body: &[u8]) -> anyhow::Error {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => anyhow!("{} ({}): {}", e.reason, status.as_u16(), e.message),
        Err(_) => anyhow!("server answered {status}: {}", String::from_utf8_lossy(body).trim()),
    }
}
