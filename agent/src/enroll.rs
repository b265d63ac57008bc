//! Enrollment: make a key on this machine, send a CSR with a bootstrap token, keep the
//! certificate. The private key never leaves the machine.

use std::path::{Path, PathBuf};

use keelson_api::meta::Name;
use keelson_api::wire::{EnrollRequest, EnrollResponse, ErrorBody};
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};

use crate::state::{self, CA_FILE, CERT_FILE, IDENTITY_FILE, KEY_FILE};

const ENROLL_TIMEOUT_SECS: u64 = 30;

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error("{0}")]
    Invalid(String),
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    State(#[from] state::StateError),
    #[error("making the key or CSR: {0}")]
    Key(#[from] rcgen::Error),
    #[error("TLS: {0}")]
    Tls(#[from] keelson_api::tls::TlsError),
    #[error("contacting {server}: {message}")]
    Transport { server: String, message: String },
    #[error("the controller refused enrollment: {reason} ({status}): {message}")]
    Refused { status: u16, reason: String, message: String },
}

#[derive(Debug, Clone)]
pub struct EnrollOptions {
    pub server: String,
    pub ca_file: PathBuf,
    pub token: String,
    pub name: Name,
    pub state_dir: PathBuf,
}

/// What the agent keeps about its identity besides the PEM files.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdentityRecord {
    pub name: Name,
    pub server: String,
}

/// The machine name when none is given: the host name, if it is a valid name.
pub fn default_name() -> Result<Name, EnrollError> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_err(|source| EnrollError::Read { path: "/proc/sys/kernel/hostname".into(), source })?;
    let host = host.trim();
    let short = host.split('.').next().unwrap_or(host).to_ascii_lowercase();
    short.parse().map_err(|e: keelson_api::meta::NameError| {
        EnrollError::Invalid(format!("the host name cannot be the machine name ({e}); pass --name"))
    })
}

/// A new key pair and a CSR for it with CN = `name`.
pub fn make_key_and_csr(name: &Name) -> Result<(KeyPair, String), EnrollError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name.as_str());
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key)?;
    Ok((key, csr.pem()?))
}

pub async fn enroll(opts: &EnrollOptions) -> Result<EnrollResponse, EnrollError> {
    let ca_pem = std::fs::read_to_string(&opts.ca_file).map_err(|source| EnrollError::Read { path: opts.ca_file.clone(), source })?;
    opts.token.parse::<keelson_api::token::TokenString>().map_err(|e| EnrollError::Invalid(format!("--token: {e}")))?;
    let tls = keelson_api::tls::client_config(&ca_pem, None)?;
    let http = reqwest::Client::builder()
        .use_preconfigured_tls(tls)
        .timeout(std::time::Duration::from_secs(ENROLL_TIMEOUT_SECS))
        .build()
        .map_err(|e| EnrollError::Transport { server: opts.server.clone(), message: e.to_string() })?;
    let (key, csr) = make_key_and_csr(&opts.name)?;
    let request = EnrollRequest { token: opts.token.clone(), csr, name: Some(opts.name.clone()), facts: Some(crate::facts::collect()) };
    let url = format!("{}/v1/enroll", opts.server.trim_end_matches('/'));
    let transport = |e: reqwest::Error| EnrollError::Transport { server: opts.server.clone(), message: keelson_api::error_chain(&e) };
    let response = http.post(&url).json(&request).send().await.map_err(transport)?;
    let status = response.status();
    let body = response.bytes().await.map_err(transport)?;
    if !status.is_success() {
        let (reason, message) = match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(e) => (e.reason, e.message),
            Err(_) => ("Unknown".into(), String::from_utf8_lossy(&body).into_owned()),
        };
        return Err(EnrollError::Refused { status: status.as_u16(), reason, message });
    }
    let answer: EnrollResponse = serde_json::from_slice(&body)
        .map_err(|e| EnrollError::Transport { server: opts.server.clone(), message: format!("unexpected answer: {e}") })?;
    save(&opts.state_dir, &key, &answer, &opts.server)?;
    Ok(answer)
}

fn save(dir: &Path, key: &KeyPair, answer: &EnrollResponse, server: &str) -> Result<(), EnrollError> {
    state::ensure_dir(dir)?;
    state::write_atomic(&dir.join(KEY_FILE), key.serialize_pem().as_bytes(), 0o600)?;
    state::write_atomic(&dir.join(CERT_FILE), answer.certificate.as_bytes(), 0o644)?;
    state::write_atomic(&dir.join(CA_FILE), answer.ca_bundle.as_bytes(), 0o644)?;
    let record = IdentityRecord { name: answer.name.clone(), server: server.to_owned() };
    let json = serde_json::to_vec_pretty(&record).map_err(|e| EnrollError::Invalid(e.to_string()))?;
    state::write_atomic(&dir.join(IDENTITY_FILE), &json, 0o644)?;
    Ok(())
}

/// When the machine certificate in `state_dir` expires, from its notAfter.
pub fn certificate_expiry(state_dir: &Path) -> Result<time::OffsetDateTime, EnrollError> {
    let path = state_dir.join(CERT_FILE);
    let pem = std::fs::read(&path).map_err(|source| EnrollError::Read { path: path.clone(), source })?;
    let (_, parsed) = x509_parser::pem::parse_x509_pem(&pem).map_err(|e| EnrollError::Invalid(format!("{}: {e}", path.display())))?;
    let cert = parsed.parse_x509().map_err(|e| EnrollError::Invalid(format!("{}: {e}", path.display())))?;
    time::OffsetDateTime::from_unix_timestamp(cert.validity().not_after.timestamp()).map_err(|e| EnrollError::Invalid(e.to_string()))
}

/// Replaces the machine's key and certificate with new ones signed by the controller (the
/// current certificate authenticates the request). The new key, like the first, never leaves
/// the machine.
pub async fn rotate(state_dir: &Path, controller: &crate::client::Controller, name: &Name) -> Result<(), EnrollError> {
    let (key, csr) = make_key_and_csr(name)?;
    let answer = controller
        .rotate_certificate(&csr)
        .await
        .map_err(|e| EnrollError::Transport { server: "controller".into(), message: e.to_string() })?;
    // Key first, then certificate: a crash in between leaves a pair the controller still
    // accepts (the old certificate stays valid until the new one is used) or a new key with
    // an old certificate, which the next start detects as unusable and reports.
    state::write_atomic(&state_dir.join(KEY_FILE), key.serialize_pem().as_bytes(), 0o600)?;
    state::write_atomic(&state_dir.join(CERT_FILE), answer.certificate.as_bytes(), 0o644)?;
    state::write_atomic(&state_dir.join(CA_FILE), answer.ca_bundle.as_bytes(), 0o644)?;
    Ok(())
}
