//! The member's TLS identity: its key is made here and never leaves the machine; its
//! certificate (peer and client, CN = the machine's name, SANs = its addresses) comes from the
//! controller's CA for the member's cluster. The key is kept across renewals, so etcd never
//! sees a certificate that does not match the key on disk.

use std::path::{Path, PathBuf};

use keelson_api::meta::Name;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use super::client::EtcdTls;
use crate::client::{ClientError, Controller};
use crate::state::write_atomic;

pub const CA_FILE: &str = "ca.crt";
pub const CERT_FILE: &str = "member.crt";
pub const KEY_FILE: &str = "member.key";
/// A certificate this close to its end is renewed.
pub const RENEW_BEFORE_DAYS: i64 = 30;

#[derive(Debug, thiserror::Error)]
pub enum EtcdPkiError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("making the member key and CSR: {0}")]
    Key(#[from] rcgen::Error),
    #[error("the controller refused the etcd member certificate: {0}")]
    Controller(#[from] ClientError),
}

fn file_err(path: &Path) -> impl Fn(String) -> EtcdPkiError + '_ {
    move |message| EtcdPkiError::File { path: path.to_owned(), message }
}

/// Why the member needs a (new) certificate, or `None` when the one on disk will do: it
/// exists, is not near its end, and names every address in `addresses`.
pub fn renewal_reason(dir: &Path, addresses: &[String], now: time::OffsetDateTime) -> Option<String> {
    let path = dir.join(CERT_FILE);
    if !dir.join(KEY_FILE).exists() {
        return Some("no member key".into());
    }
    let Ok(pem) = std::fs::read(&path) else {
        return Some("no member certificate".into());
    };
    let Ok(der) = CertificateDer::from_pem_slice(&pem) else {
        return Some(format!("{} is not a PEM certificate", path.display()));
    };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(der.as_ref()) else {
        return Some(format!("{} does not parse", path.display()));
    };
    let not_after = cert.validity().not_after.to_datetime();
    if not_after - now < time::Duration::days(RENEW_BEFORE_DAYS) {
        return Some(format!("the member certificate ends {}", not_after.date()));
    }
    let names: Vec<std::net::IpAddr> = cert
        .subject_alternative_name()
        .ok()
        .flatten()
        .map(|san| {
            san.value
                .general_names
                .iter()
                .filter_map(|g| match g {
                    x509_parser::extensions::GeneralName::IPAddress(b) => match b.len() {
                        4 => <[u8; 4]>::try_from(*b).ok().map(std::net::IpAddr::from),
                        16 => <[u8; 16]>::try_from(*b).ok().map(std::net::IpAddr::from),
                        _ => None,
                    },
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default();
    let missing: Vec<&String> = addresses.iter().filter(|a| a.parse::<std::net::IpAddr>().is_ok_and(|ip| !names.contains(&ip))).collect();
    if !missing.is_empty() {
        return Some(format!("the member certificate does not name {}", missing.iter().map(|a| a.as_str()).collect::<Vec<_>>().join(", ")));
    }
    None
}

/// Gets a member certificate from the controller for `name` and the `addresses` it advertises
/// (making the key first if there is none) and writes `ca.crt`, `member.crt` and `member.key`
/// (0600) into `dir`.
pub async fn obtain(controller: &Controller, dir: &Path, name: &Name, addresses: &[String]) -> Result<EtcdTls, EtcdPkiError> {
    std::fs::create_dir_all(dir).map_err(|e| file_err(dir)(e.to_string()))?;
    let key_path = dir.join(KEY_FILE);
    let key = match std::fs::read_to_string(&key_path) {
        Ok(pem) => KeyPair::from_pem(&pem).map_err(|e| file_err(&key_path)(e.to_string()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = KeyPair::generate()?;
            write_atomic(&key_path, key.serialize_pem().as_bytes(), 0o600).map_err(|e| file_err(&key_path)(e.to_string()))?;
            key
        }
        Err(e) => return Err(file_err(&key_path)(e.to_string())),
    };
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name.as_str());
    params.distinguished_name = dn;
    let csr = params.serialize_request(&key)?.pem()?;
    let issued = controller.etcd_certificate(&csr, addresses).await?;
    for (file, content) in [(CA_FILE, &issued.ca), (CERT_FILE, &issued.certificate)] {
        let path = dir.join(file);
        write_atomic(&path, content.as_bytes(), 0o644).map_err(|e| file_err(&path)(e.to_string()))?;
    }
    Ok(EtcdTls { ca_pem: issued.ca, cert_pem: issued.certificate, key_pem: key.serialize_pem() })
}
