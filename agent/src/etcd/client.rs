//! A small etcd v3 client over etcd's JSON gateway (`/v3/…` on every client URL, on by default
//! in 3.4 and 3.5): the membership, maintenance and health calls an etcd member's agent needs,
//! with mTLS when the cluster uses it. The gateway keeps the agent free of a gRPC stack; the
//! calls and their JSON are etcd's own (`etcdserverpb`), with 64-bit numbers as strings.

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use futures_util::StreamExt;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::io::AsyncWriteExt;

const REQUEST_TIMEOUT_SECS: u64 = 10;
const CONNECT_TIMEOUT_SECS: u64 = 3;
/// A snapshot of a large database takes a while to stream.
const SNAPSHOT_TIMEOUT_SECS: u64 = 600;

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd at {endpoint} unreachable: {message}")]
    Unreachable { endpoint: String, message: String },
    /// etcd answered with an error, e.g. `etcdserver: re-configuration failed due to not enough
    /// started members`.
    #[error("etcd at {endpoint}: {message}")]
    Refused { endpoint: String, message: String },
    #[error("etcd at {endpoint}: unexpected answer: {message}")]
    Protocol { endpoint: String, message: String },
    #[error("writing the snapshot {path}: {message}")]
    Snapshot { path: String, message: String },
    #[error("etcd TLS settings: {0}")]
    Tls(String),
}

impl EtcdError {
    /// The error text etcd gave, when it answered with one.
    pub fn etcd_message(&self) -> Option<&str> {
        match self {
            EtcdError::Refused { message, .. } => Some(message),
            _ => None,
        }
    }
}

/// A member as the member list reports it. A learner added but not yet started has no name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: u64,
    pub name: String,
    pub peer_urls: Vec<String>,
    pub client_urls: Vec<String>,
    pub is_learner: bool,
}

/// One endpoint's view of itself and of the cluster (`Maintenance.Status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointStatus {
    /// The member that answered.
    pub member_id: u64,
    pub version: String,
    pub db_size_bytes: u64,
    /// 0 while the cluster has no leader.
    pub leader: u64,
    pub raft_index: u64,
    pub raft_term: u64,
    pub raft_applied_index: u64,
    pub is_learner: bool,
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alarm {
    pub member_id: u64,
    /// `NOSPACE` or `CORRUPT`.
    pub alarm: String,
}

/// Client certificate, key and CA for a cluster that uses TLS, all PEM.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl EtcdTls {
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<Self, EtcdError> {
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| EtcdError::Tls(format!("{}: {e}", p.display())));
        Ok(EtcdTls { ca_pem: read(ca)?, cert_pem: read(cert)?, key_pem: read(key)? })
    }
}

#[derive(Debug, Clone)]
pub struct EtcdClient {
    http: reqwest::Client,
    endpoints: Vec<String>,
}

impl EtcdClient {
    /// A client for `endpoints` (client URLs); calls that any member can answer go to the first
    /// that does.
    pub fn new(endpoints: Vec<String>, tls: Option<&EtcdTls>) -> Result<Self, EtcdError> {
        let mut config = match tls {
            Some(t) => {
                keelson_api::tls::client_config(&t.ca_pem, Some((&t.cert_pem, &t.key_pem))).map_err(|e| EtcdError::Tls(e.to_string()))?
            }
            // Plain http endpoints; an https one fails closed, trusting nothing.
            None => rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| EtcdError::Tls(e.to_string()))?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
        };
        // etcd serves gRPC and the gateway on one port and sends HTTP/2 over TLS to gRPC.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(CONNECT_TIMEOUT_SECS))
            .use_preconfigured_tls(config)
            .build()
            .map_err(|e| EtcdError::Tls(keelson_api::error_chain(&e)))?;
        Ok(EtcdClient { http, endpoints })
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The same client (and TLS identity) aimed at other endpoints.
    pub fn with_endpoints(&self, endpoints: Vec<String>) -> Self {
        EtcdClient { http: self.http.clone(), endpoints }
    }

    async fn call_at<T: DeserializeOwned>(&self, endpoint: &str, path: &str, body: serde_json::Value) -> Result<T, EtcdError> {
        let url = format!("{}{path}", endpoint.trim_end_matches('/'));
        let unreachable =
            |e: reqwest::Error| EtcdError::Unreachable { endpoint: endpoint.to_string(), message: keelson_api::error_chain(&e) };
        let resp = self.http.post(url).json(&body).timeout(Duration::from_secs(REQUEST_TIMEOUT_SECS)).send().await.map_err(unreachable)?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(unreachable)?;
        if !status.is_success() {
            let message = serde_json::from_slice::<GatewayError>(&bytes)
                .map(|e| e.error)
                .unwrap_or_else(|_| format!("HTTP {status}: {}", String::from_utf8_lossy(&bytes).trim()));
            return Err(EtcdError::Refused { endpoint: endpoint.to_string(), message });
        }
        serde_json::from_slice(&bytes).map_err(|e| EtcdError::Protocol { endpoint: endpoint.to_string(), message: e.to_string() })
    }

    /// Tries each endpoint in turn; an endpoint that cannot be reached is skipped, an answer
    /// (success or etcd's refusal) is returned.
    async fn call_any<T: DeserializeOwned>(&self, path: &str, body: serde_json::Value) -> Result<T, EtcdError> {
        let mut last = None;
        for endpoint in &self.endpoints {
            match self.call_at(endpoint, path, body.clone()).await {
                Err(e @ EtcdError::Unreachable { .. }) => last = Some(e),
                other => return other,
            }
        }
        Err(last.unwrap_or_else(|| EtcdError::Unreachable { endpoint: "-".into(), message: "no endpoint given".into() }))
    }

    pub async fn members(&self) -> Result<Vec<Member>, EtcdError> {
        let r: MembersResponse = self.call_any("/v3/cluster/member/list", json!({})).await?;
        r.members.into_iter().map(RawMember::parse).collect()
    }

    /// Adds a learner with these peer URLs; it must then be started with
    /// `initial-cluster-state=existing`.
    pub async fn add_learner(&self, peer_urls: &[String]) -> Result<Member, EtcdError> {
        let r: MemberAddResponse = self.call_any("/v3/cluster/member/add", json!({"peerURLs": peer_urls, "isLearner": true})).await?;
        r.member.parse()
    }

    /// Promotes a learner to a voting member. etcd refuses while the learner lags the leader.
    pub async fn promote(&self, id: u64) -> Result<(), EtcdError> {
        let _: serde_json::Value = self.call_any("/v3/cluster/member/promote", json!({"ID": id.to_string()})).await?;
        Ok(())
    }

    pub async fn remove(&self, id: u64) -> Result<(), EtcdError> {
        let _: serde_json::Value = self.call_any("/v3/cluster/member/remove", json!({"ID": id.to_string()})).await?;
        Ok(())
    }

    /// The status of the member serving `endpoint`.
    pub async fn status(&self, endpoint: &str) -> Result<EndpointStatus, EtcdError> {
        let r: RawStatus = self.call_at(endpoint, "/v3/maintenance/status", json!({})).await?;
        r.parse(endpoint)
    }

    /// Hands leadership to `target`; must be sent to the current leader's endpoint.
    pub async fn move_leader(&self, leader_endpoint: &str, target: u64) -> Result<(), EtcdError> {
        let _: serde_json::Value =
            self.call_at(leader_endpoint, "/v3/maintenance/transfer-leadership", json!({"targetID": target.to_string()})).await?;
        Ok(())
    }

    pub async fn alarms(&self) -> Result<Vec<Alarm>, EtcdError> {
        let r: AlarmResponse = self.call_any("/v3/maintenance/alarm", json!({"action": "GET"})).await?;
        r.alarms
            .into_iter()
            .map(|a| {
                Ok(Alarm {
                    member_id: parse_u64(a.member_id.as_deref(), "alarms.memberID")?,
                    alarm: a.alarm.unwrap_or_else(|| "NONE".into()),
                })
            })
            .collect::<Result<_, String>>()
            .map_err(|message| EtcdError::Protocol { endpoint: self.endpoints.join(","), message })
    }

    /// Writes `key` = `value` (the tests' and the health check's write).
    pub async fn put(&self, key: &str, value: &str) -> Result<u64, EtcdError> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let r: PutResponse = self.call_any("/v3/kv/put", json!({"key": b64.encode(key), "value": b64.encode(value)})).await?;
        parse_u64(r.header.and_then(|h| h.revision).as_deref(), "header.revision")
            .map_err(|message| EtcdError::Protocol { endpoint: self.endpoints.join(","), message })
    }

    /// Every key under `prefix` with its value, read linearizably.
    pub async fn get_prefix(&self, prefix: &str) -> Result<Vec<(String, String)>, EtcdError> {
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let r: RangeResponse = self.call_any("/v3/kv/range", json!({"key": b64.encode(prefix), "range_end": b64.encode(&end)})).await?;
        let decode = |s: Option<String>| -> Result<String, String> {
            let raw = b64.decode(s.unwrap_or_default()).map_err(|e| e.to_string())?;
            String::from_utf8(raw).map_err(|e| e.to_string())
        };
        r.kvs
            .into_iter()
            .map(|kv| Ok((decode(kv.key)?, decode(kv.value)?)))
            .collect::<Result<_, String>>()
            .map_err(|message| EtcdError::Protocol { endpoint: self.endpoints.join(","), message })
    }

    /// `GET /health` on one endpoint: true when the member is part of a cluster with a leader
    /// that serves reads.
    pub async fn healthy(&self, endpoint: &str) -> bool {
        let url = format!("{}/health", endpoint.trim_end_matches('/'));
        let Ok(resp) = self.http.get(url).timeout(Duration::from_secs(REQUEST_TIMEOUT_SECS)).send().await else {
            return false;
        };
        resp.json::<Health>().await.is_ok_and(|h| h.health == "true")
    }

    /// Streams a snapshot of the member at `endpoint` to `path` (written to a temporary file
    /// then renamed, so `path` is either absent or whole). Returns its size in bytes. The data
    /// ends with etcd's own sha256, which `etcdutl snapshot restore` checks.
    pub async fn snapshot(&self, endpoint: &str, path: &Path) -> Result<u64, EtcdError> {
        let fail = |message: String| EtcdError::Snapshot { path: path.display().to_string(), message };
        let url = format!("{}/v3/maintenance/snapshot", endpoint.trim_end_matches('/'));
        let resp = self
            .http
            .post(url)
            .json(&json!({}))
            .timeout(Duration::from_secs(SNAPSHOT_TIMEOUT_SECS))
            .send()
            .await
            .map_err(|e| EtcdError::Unreachable { endpoint: endpoint.into(), message: keelson_api::error_chain(&e) })?;
        if !resp.status().is_success() {
            return Err(EtcdError::Refused { endpoint: endpoint.into(), message: format!("snapshot: HTTP {}", resp.status()) });
        }
        let tmp = path.with_extension("part");
        let result = async {
            let mut file = tokio::fs::File::create(&tmp).await.map_err(|e| fail(e.to_string()))?;
            let mut written = 0u64;
            let mut pending = Vec::new();
            let mut body = resp.bytes_stream();
            while let Some(chunk) = body.next().await {
                pending.extend_from_slice(&chunk.map_err(|e| fail(keelson_api::error_chain(&e)))?);
                // The gateway streams one JSON object per line.
                while let Some(nl) = pending.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=nl).collect();
                    written += write_snapshot_line(&mut file, &line).await.map_err(fail)?;
                }
            }
            written += write_snapshot_line(&mut file, &pending).await.map_err(fail)?;
            if written == 0 {
                return Err(fail("etcd sent no data".into()));
            }
            file.sync_all().await.map_err(|e| fail(e.to_string()))?;
            tokio::fs::rename(&tmp, path).await.map_err(|e| fail(e.to_string()))?;
            Ok(written)
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result
    }
}

async fn write_snapshot_line(file: &mut tokio::fs::File, line: &[u8]) -> Result<u64, String> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(0);
    }
    let chunk: SnapshotChunk = serde_json::from_slice(line).map_err(|e| format!("snapshot stream: {e}"))?;
    if let Some(err) = chunk.error {
        return Err(format!("etcd: {}", err.message.unwrap_or_default()));
    }
    let blob = chunk.result.and_then(|r| r.blob).unwrap_or_default();
    let data = base64::engine::general_purpose::STANDARD.decode(blob).map_err(|e| format!("snapshot stream: {e}"))?;
    file.write_all(&data).await.map_err(|e| e.to_string())?;
    Ok(data.len() as u64)
}

fn parse_u64(s: Option<&str>, field: &str) -> Result<u64, String> {
    match s {
        None => Ok(0),
        Some(s) => s.parse().map_err(|_| format!("{field}: {s:?} is not a number")),
    }
}

// The gateway's JSON, as etcd writes it.

#[derive(Deserialize)]
struct GatewayError {
    error: String,
}

#[derive(Deserialize)]
struct Header {
    member_id: Option<String>,
    revision: Option<String>,
}

#[derive(Deserialize)]
struct RawMember {
    #[serde(rename = "ID")]
    id: Option<String>,
    #[serde(default)]
    name: String,
    #[serde(rename = "peerURLs", default)]
    peer_urls: Vec<String>,
    #[serde(rename = "clientURLs", default)]
    client_urls: Vec<String>,
    #[serde(rename = "isLearner", default)]
    is_learner: bool,
}

impl RawMember {
    fn parse(self) -> Result<Member, EtcdError> {
        let id = parse_u64(self.id.as_deref(), "member.ID").map_err(|message| EtcdError::Protocol { endpoint: "-".into(), message })?;
        Ok(Member { id, name: self.name, peer_urls: self.peer_urls, client_urls: self.client_urls, is_learner: self.is_learner })
    }
}

#[derive(Deserialize)]
struct MembersResponse {
    #[serde(default)]
    members: Vec<RawMember>,
}

#[derive(Deserialize)]
struct MemberAddResponse {
    member: RawMember,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawStatus {
    header: Option<Header>,
    #[serde(default)]
    version: String,
    db_size: Option<String>,
    leader: Option<String>,
    raft_index: Option<String>,
    raft_term: Option<String>,
    raft_applied_index: Option<String>,
    #[serde(default)]
    is_learner: bool,
    #[serde(default)]
    errors: Vec<String>,
}

impl RawStatus {
    fn parse(self, endpoint: &str) -> Result<EndpointStatus, EtcdError> {
        let p = |s: &Option<String>, f: &str| {
            parse_u64(s.as_deref(), f).map_err(|message| EtcdError::Protocol { endpoint: endpoint.into(), message })
        };
        Ok(EndpointStatus {
            member_id: p(&self.header.as_ref().and_then(|h| h.member_id.clone()), "header.member_id")?,
            version: self.version,
            db_size_bytes: p(&self.db_size, "dbSize")?,
            leader: p(&self.leader, "leader")?,
            raft_index: p(&self.raft_index, "raftIndex")?,
            raft_term: p(&self.raft_term, "raftTerm")?,
            raft_applied_index: p(&self.raft_applied_index, "raftAppliedIndex")?,
            is_learner: self.is_learner,
            errors: self.errors,
        })
    }
}

#[derive(Deserialize)]
struct RawAlarm {
    #[serde(rename = "memberID")]
    member_id: Option<String>,
    alarm: Option<String>,
}

#[derive(Deserialize)]
struct AlarmResponse {
    #[serde(default)]
    alarms: Vec<RawAlarm>,
}

#[derive(Deserialize)]
struct PutResponse {
    header: Option<Header>,
}

#[derive(Deserialize)]
struct RawKv {
    key: Option<String>,
    value: Option<String>,
}

#[derive(Deserialize)]
struct RangeResponse {
    #[serde(default)]
    kvs: Vec<RawKv>,
}

#[derive(Deserialize)]
struct Health {
    health: String,
}

#[derive(Deserialize)]
struct SnapshotChunk {
    result: Option<SnapshotBlob>,
    error: Option<StreamError>,
}

#[derive(Deserialize)]
struct SnapshotBlob {
    blob: Option<String>,
}

#[derive(Deserialize)]
struct StreamError {
    message: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_list_as_etcd_3_4_writes_it() {
        // Captured from etcd 3.4.23's gateway: a voter and a learner that has not started.
        let raw = r#"{"header":{"cluster_id":"324952591200643719","member_id":"3319814642761637952","raft_term":"2"},
            "members":[{"ID":"3319814642761637952","name":"a","peerURLs":["http://127.0.0.1:23800"],"clientURLs":["http://127.0.0.1:23790"]},
                       {"ID":"17524230943308166531","peerURLs":["http://127.0.0.1:23801"],"isLearner":true}]}"#;
        let r: MembersResponse = serde_json::from_str(raw).expect("parses");
        let members: Vec<Member> = r.members.into_iter().map(|m| m.parse().expect("parses")).collect();
        assert_eq!(members[0].id, 3319814642761637952);
        assert_eq!((members[0].name.as_str(), members[0].is_learner), ("a", false));
        assert_eq!((members[1].id, members[1].name.as_str(), members[1].is_learner), (17524230943308166531, "", true));
    }

    #[test]
    fn status_as_etcd_writes_it() {
        let raw = r#"{"header":{"cluster_id":"3","member_id":"3319814642761637952","revision":"1","raft_term":"2"},
            "version":"3.4.23","dbSize":"24576","leader":"3319814642761637952","raftIndex":"4","raftTerm":"2",
            "raftAppliedIndex":"4","dbSizeInUse":"16384"}"#;
        let s = serde_json::from_str::<RawStatus>(raw).expect("parses").parse("e").expect("parses");
        assert_eq!(s.member_id, s.leader);
        assert_eq!((s.version.as_str(), s.db_size_bytes, s.raft_index, s.raft_applied_index), ("3.4.23", 24576, 4, 4));
        let bad = r#"{"version":"3.5.1","leader":"x"}"#;
        let err = serde_json::from_str::<RawStatus>(bad).expect("parses").parse("e").expect_err("an error").to_string();
        assert!(err.contains("leader: \"x\" is not a number"), "{err}");
    }
}
