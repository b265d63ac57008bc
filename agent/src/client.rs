//! The agent's side of the controller protocol over mTLS: spec long-poll, status, events,
//! disruption leases and certificate rotation. Each server URL is tried in turn.

use std::path::Path;
use std::time::Duration;

use keelson_api::wire::{AgentEvents, AgentSpec, AgentStatus, EnrollResponse, ErrorBody, Event};
use reqwest::{Method, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::state::{CA_FILE, CERT_FILE, KEY_FILE};

const REQUEST_TIMEOUT_SECS: u64 = 30;
const CONNECT_TIMEOUT_SECS: u64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("reading the identity in {dir}: {message}")]
    Identity { dir: String, message: String },
    #[error("controller unreachable: {0}")]
    Unreachable(String),
    #[error("{reason} ({status}): {message}")]
    Refused { status: u16, reason: String, message: String },
    #[error("unexpected answer from the controller: {0}")]
    Protocol(String),
}

impl ClientError {
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    pub id: String,
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: time::OffsetDateTime,
    /// For a machine with kubeadm in its spec: which upgrade it runs under this lease.
    #[serde(default)]
    pub kubeadm: Option<keelson_api::machine::KubeadmUpgrade>,
}

/// The answer to a lease request.
#[derive(Debug)]
pub enum LeaseAnswer {
    Granted(Lease),
    /// The budget is used up; the message says by whom.
    Wait(String),
}

#[derive(Debug, Clone)]
pub struct Controller {
    http: reqwest::Client,
    servers: Vec<String>,
}

impl Controller {
    /// A client holding the machine identity kept in `state_dir`.
    pub fn from_state(state_dir: &Path, servers: &[String]) -> Result<Self, ClientError> {
        let read = |f: &str| {
            std::fs::read_to_string(state_dir.join(f))
                .map_err(|e| ClientError::Identity { dir: state_dir.display().to_string(), message: format!("{f}: {e}") })
        };
        let (ca, cert, key) = (read(CA_FILE)?, read(CERT_FILE)?, read(KEY_FILE)?);
        let tls = keelson_api::tls::client_config(&ca, Some((&cert, &key)))
            .map_err(|e| ClientError::Identity { dir: state_dir.display().to_string(), message: e.to_string() })?;
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(Duration::from_secs(CONNECT_TIMEOUT_SECS))
            .build()
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        Ok(Controller { http, servers: servers.to_vec() })
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<(StatusCode, bytes::Bytes), ClientError> {
        let mut last = None;
        for server in &self.servers {
            let mut r = self.http.request(method.clone(), format!("{}{}", server.trim_end_matches('/'), path)).timeout(timeout);
            if let Some(b) = &body {
                r = r.json(b);
            }
            match r.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    let bytes = resp.bytes().await.map_err(|e| ClientError::Unreachable(keelson_api::error_chain(&e)))?;
                    return Ok((status, bytes));
                }
                Err(e) => last = Some(format!("{server}: {}", keelson_api::error_chain(&e))),
            }
        }
        Err(ClientError::Unreachable(last.unwrap_or_else(|| "no server configured".into())))
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<serde_json::Value>,
        timeout: Duration,
    ) -> Result<Option<T>, ClientError> {
        let (status, bytes) = self.send(method, path, body, timeout).await?;
        if !status.is_success() {
            return Err(refused(status, &bytes));
        }
        if status == StatusCode::NO_CONTENT || bytes.is_empty() {
            return Ok(None);
        }
        serde_json::from_slice(&bytes).map(Some).map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// Waits up to `wait` for a generation newer than `after`.
    pub async fn spec(&self, after: u64, wait: Duration) -> Result<AgentSpec, ClientError> {
        let path = format!("/v1/agent/spec?after={after}&timeoutSeconds={}", wait.as_secs().max(1));
        self.call(Method::GET, &path, None, wait + Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .await?
            .ok_or_else(|| ClientError::Protocol("empty spec answer".into()))
    }

    pub async fn status(&self, status: &AgentStatus) -> Result<(), ClientError> {
        let body = serde_json::to_value(status).map_err(|e| ClientError::Protocol(e.to_string()))?;
        self.call::<serde_json::Value>(Method::PUT, "/v1/agent/status", Some(body), Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .await
            .map(|_| ())
    }

    pub async fn events(&self, events: Vec<Event>) -> Result<(), ClientError> {
        let body = serde_json::to_value(AgentEvents { events }).map_err(|e| ClientError::Protocol(e.to_string()))?;
        self.call::<serde_json::Value>(Method::POST, "/v1/agent/events", Some(body), Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .await
            .map(|_| ())
    }

    /// Tells the controller the machine is reset; it then forgets the machine.
    pub async fn reset_done(&self, summary: &str) -> Result<(), ClientError> {
        let body = serde_json::json!({"summary": summary});
        self.call::<serde_json::Value>(Method::POST, "/v1/agent/reset", Some(body), Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .await
            .map(|_| ())
    }

    pub async fn acquire_lease(&self, reason: &str, ttl: Duration) -> Result<LeaseAnswer, ClientError> {
        let body = serde_json::json!({"reason": reason, "ttlSeconds": ttl.as_secs()});
        let (status, bytes) =
            self.send(Method::POST, "/v1/agent/disruptions", Some(body), Duration::from_secs(REQUEST_TIMEOUT_SECS)).await?;
        match status {
            StatusCode::CREATED | StatusCode::OK => {
                serde_json::from_slice(&bytes).map(LeaseAnswer::Granted).map_err(|e| ClientError::Protocol(e.to_string()))
            }
            StatusCode::TOO_MANY_REQUESTS => {
                let message = serde_json::from_slice::<ErrorBody>(&bytes).map(|e| e.message).unwrap_or_default();
                Ok(LeaseAnswer::Wait(message))
            }
            _ => Err(refused(status, &bytes)),
        }
    }

    pub async fn renew_lease(&self, id: &str, ttl: Duration) -> Result<(), ClientError> {
        let body = serde_json::json!({"ttlSeconds": ttl.as_secs()});
        self.call::<serde_json::Value>(
            Method::PUT,
            &format!("/v1/agent/disruptions/{id}"),
            Some(body),
            Duration::from_secs(REQUEST_TIMEOUT_SECS),
        )
        .await
        .map(|_| ())
    }

    pub async fn release_lease(&self, id: &str) -> Result<(), ClientError> {
        self.call::<serde_json::Value>(
            Method::DELETE,
            &format!("/v1/agent/disruptions/{id}"),
            None,
            Duration::from_secs(REQUEST_TIMEOUT_SECS),
        )
        .await
        .map(|_| ())
    }

    /// What joining the etcd cluster needs: whether this machine starts it, or where the
    /// members are.
    pub async fn etcd_cluster(&self) -> Result<keelson_api::wire::EtcdClusterInfo, ClientError> {
        self.call(Method::GET, "/v1/agent/etcd/cluster", None, Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .await?
            .ok_or_else(|| ClientError::Protocol("empty answer".into()))
    }

    /// This machine's etcd member certificate, for the cluster its spec names.
    pub async fn etcd_certificate(&self, csr: &str, addresses: &[String]) -> Result<keelson_api::wire::EtcdCertificate, ClientError> {
        let body = serde_json::json!({"csr": csr, "addresses": addresses});
        self.call(Method::POST, "/v1/agent/etcd/certificate", Some(body), Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .await?
            .ok_or_else(|| ClientError::Protocol("empty answer".into()))
    }

    pub async fn rotate_certificate(&self, csr: &str) -> Result<EnrollResponse, ClientError> {
        let body = serde_json::json!({"csr": csr});
        self.call(Method::POST, "/v1/agent/certificate", Some(body), Duration::from_secs(REQUEST_TIMEOUT_SECS))
            .await?
            .ok_or_else(|| ClientError::Protocol("empty answer".into()))
    }
}

fn refused(status: StatusCode, body: &[u8]) -> ClientError {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => ClientError::Refused { status: status.as_u16(), reason: e.reason, message: e.message },
        Err(_) => {
            ClientError::Refused { status: status.as_u16(), reason: "Unknown".into(), message: String::from_utf8_lossy(body).into_owned() }
        }
    }
}
