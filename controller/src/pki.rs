//! The controller's certificate authority and the identities it issues.
//!
//! One CA per controller data directory signs the server certificate, the admin credential
//! and every machine's client certificate. An identity is the certificate's subject:
//! organisation `keelson:admins` for operators, `keelson:machines` with CN = machine name for
//! agents. Machine keys are made on the machines; the controller only ever sees their CSRs.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keelson_api::meta::Name;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use time::{Duration, OffsetDateTime};

pub const ORG_ADMINS: &str = "keelson:admins";
pub const ORG_MACHINES: &str = "keelson:machines";

const CA_VALIDITY_DAYS: i64 = 3650;
const SERVER_VALIDITY_DAYS: i64 = 365;
const ADMIN_VALIDITY_DAYS: i64 = 365;
/// Machine certificates are short-lived; agents rotate them well before they expire.
pub const MACHINE_CERT_VALIDITY_DAYS: i64 = 30;
/// Tolerates small clock differences between the controller and a new machine.
const BACKDATE_MINUTES: i64 = 5;

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("the CSR is not valid: {0}")]
    BadCsr(String),
    #[error("{0}")]
    Invalid(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io { path: path.to_owned(), source }
}

/// The CA: its certificate and the key that signs with it.
pub struct Authority {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

/// A signed certificate and the serial it was given (hex), which the controller records so
/// it can refuse certificates it has since replaced.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub serial: String,
    pub not_after: OffsetDateTime,
}

impl Authority {
    /// Loads the CA from `dir`, creating it on first start. Returns whether it was created.
    pub fn load_or_create(dir: &Path) -> Result<(Self, bool), PkiError> {
        Self::load_or_create_named(dir, "keelson CA")
    }

    /// The same for a CA with another common name (an etcd cluster's).
    pub fn load_or_create_named(dir: &Path, common_name: &str) -> Result<(Self, bool), PkiError> {
        let cert_path = dir.join("ca.crt");
        let key_path = dir.join("ca.key");
        if cert_path.exists() {
            let cert_pem = std::fs::read_to_string(&cert_path).map_err(io_err(&cert_path))?;
            let key_pem = std::fs::read_to_string(&key_path).map_err(io_err(&key_path))?;
            let key = KeyPair::from_pem(&key_pem)?;
            let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)?;
            return Ok((Authority { cert_pem, issuer }, false));
        }
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(common_name, None);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::minutes(BACKDATE_MINUTES);
        params.not_after = now + Duration::days(CA_VALIDITY_DAYS);
        let cert = params.self_signed(&key)?;
        write_private(&key_path, key.serialize_pem().as_bytes())?;
        write_public(&cert_path, cert.pem().as_bytes())?;
        let cert_pem = cert.pem();
        Ok((Authority { cert_pem, issuer: Issuer::new(params, key) }, true))
    }

    /// A server certificate for the listen address and the extra names.
    pub fn issue_server(&self, names: &[String]) -> Result<(Issued, KeyPair), PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn("keelson-controller", None);
        params.subject_alt_names = names
            .iter()
            .map(|n| match n.parse::<IpAddr>() {
                Ok(ip) => Ok(SanType::IpAddress(ip)),
                Err(_) => n.clone().try_into().map(SanType::DnsName).map_err(PkiError::from),
            })
            .collect::<Result<_, _>>()?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let issued = self.sign(params, &key, SERVER_VALIDITY_DAYS)?;
        Ok((issued, key))
    }

    /// An operator's client certificate.
    pub fn issue_admin(&self, who: &str) -> Result<(Issued, KeyPair), PkiError> {
        let key = KeyPair::generate()?;
        let issued = self.sign(client_params(who, ORG_ADMINS), &key, ADMIN_VALIDITY_DAYS)?;
        Ok((issued, key))
    }

    /// Signs a machine's CSR. Only the CSR's public key is used: the subject and extensions
    /// are the controller's, never the requester's.
    pub fn issue_machine(&self, name: &Name, csr_pem: &str) -> Result<Issued, PkiError> {
        let csr = parse_csr(csr_pem)?;
        self.sign(client_params(name.as_str(), ORG_MACHINES), &csr.public_key, MACHINE_CERT_VALIDITY_DAYS)
    }

    pub(crate) fn sign(&self, mut params: CertificateParams, key: &impl rcgen::PublicKeyData, days: i64) -> Result<Issued, PkiError> {
        let serial: [u8; 16] = rand::random();
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::minutes(BACKDATE_MINUTES);
        params.not_after = now + Duration::days(days);
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(key, &self.issuer)?;
        Ok(Issued { cert_pem: cert.pem(), serial: serial_hex(&serial), not_after: params.not_after })
    }
}

/// A serial number as the controller records it: hex of its value without leading zero bytes.
/// DER drops leading zeros (and adds one before a high bit), so the bytes we chose and the
/// bytes in the certificate can differ while the number is the same.
pub fn serial_hex(bytes: &[u8]) -> String {
    let first = bytes.iter().position(|b| *b != 0).unwrap_or(bytes.len());
    hex::encode(&bytes[first..])
}

pub(crate) fn dn(cn: &str, org: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    if let Some(o) = org {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

fn client_params(cn: &str, org: &str) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = dn(cn, Some(org));
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params
}

/// Parses a CSR and checks its signature (proof that the requester holds the key).
pub fn parse_csr(csr_pem: &str) -> Result<CertificateSigningRequestParams, PkiError> {
    CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| PkiError::BadCsr(e.to_string()))
}

/// The subject common name a CSR asks for.
pub fn csr_common_name(csr: &CertificateSigningRequestParams) -> Option<String> {
    csr.params.distinguished_name.get(&DnType::CommonName).and_then(|v| match v {
        rcgen::DnValue::Utf8String(s) => Some(s.clone()),
        rcgen::DnValue::PrintableString(s) => Some(s.as_str().to_owned()),
        rcgen::DnValue::Ia5String(s) => Some(s.as_str().to_owned()),
        _ => None,
    })
}

/// Who is on the other end of a TLS connection, from the client certificate that the TLS
/// layer already verified against the CA.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// No client certificate (allowed only for enrollment and health checks).
    Anonymous,
    Admin {
        name: String,
    },
    Machine {
        name: Name,
        serial: String,
    },
    /// A certificate from this CA that names no known role.
    Unrecognised {
        subject: String,
    },
}

impl Peer {
    pub fn from_certificate(der: &CertificateDer<'_>) -> Peer {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
            return Peer::Unrecognised { subject: "<unparseable>".into() };
        };
        let subject = cert.subject();
        let cn = subject.iter_common_name().next().and_then(|a| a.as_str().ok()).unwrap_or("");
        let org = subject.iter_organization().next().and_then(|a| a.as_str().ok()).unwrap_or("");
        match org {
            ORG_ADMINS => Peer::Admin { name: cn.to_owned() },
            ORG_MACHINES => match cn.parse::<Name>() {
                Ok(name) => Peer::Machine { name, serial: serial_hex(cert.raw_serial()) },
                Err(_) => Peer::Unrecognised { subject: subject.to_string() },
            },
            _ => Peer::Unrecognised { subject: subject.to_string() },
        }
    }
}

/// The TLS server configuration: the controller's certificate, and client certificates
/// verified against the CA when a client offers one.
pub fn server_tls_config(ca_pem: &str, cert_pem: &str, key: &KeyPair) -> Result<rustls::ServerConfig, PkiError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        let cert = cert.map_err(|e| PkiError::Invalid(format!("CA certificate: {e}")))?;
        roots.add(cert).map_err(|e| PkiError::Invalid(format!("CA certificate: {e}")))?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .allow_unauthenticated()
        .build()
        .map_err(|e| PkiError::Invalid(format!("client verifier: {e}")))?;
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PkiError::Invalid(format!("server certificate: {e}")))?;
    let key = PrivateKeyDer::from_pem_slice(key.serialize_pem().as_bytes()).map_err(|e| PkiError::Invalid(format!("server key: {e}")))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PkiError::Invalid(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| PkiError::Invalid(format!("server certificate: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Writes a secret (a key, a credential file): created 0600, synced, renamed into place.
pub fn write_private(path: &Path, contents: &[u8]) -> Result<(), PkiError> {
    write_atomic(path, contents, 0o600)
}

fn write_public(path: &Path, contents: &[u8]) -> Result<(), PkiError> {
    write_atomic(path, contents, 0o644)
}

fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp).map_err(io_err(&tmp))?;
        f.write_all(contents).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_read_back_from_certificates_match_the_recorded_ones() -> Result<(), PkiError> {
        let dir = tempfile::tempdir().map_err(|e| PkiError::Invalid(e.to_string()))?;
        let (ca, _) = Authority::load_or_create(dir.path())?;
        let name: Name = "m1".parse().map_err(|e: keelson_api::meta::NameError| PkiError::Invalid(e.to_string()))?;
        // Enough certificates that some serials start with a zero byte or a high bit.
        for _ in 0..600 {
            let key = KeyPair::generate()?;
            let csr = CertificateParams::new(vec![])?.serialize_request(&key)?.pem()?;
            let issued = ca.issue_machine(&name, &csr)?;
            let der = CertificateDer::from_pem_slice(issued.cert_pem.as_bytes()).map_err(|e| PkiError::Invalid(e.to_string()))?;
            match Peer::from_certificate(&der) {
                Peer::Machine { serial, .. } => assert_eq!(serial, issued.serial),
                other => panic!("not a machine: {other:?}"),
            }
        }
        assert_eq!(serial_hex(&[0, 0, 0x12, 0x00]), "1200");
        Ok(())
    }
}
