//! The rustls client configuration every keelson client uses: trust exactly the keelson CA
//! (never the system roots), and present a client certificate when there is one. Only ring
//! is used for cryptography.

use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what}: {message}")]
    Pem { what: &'static str, message: String },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

fn pem_err(what: &'static str) -> impl Fn(rustls_pki_types::pem::Error) -> TlsError {
    move |e| TlsError::Pem { what, message: e.to_string() }
}

/// A client configuration trusting `ca_pem`, with an optional client identity
/// (certificate chain PEM, private key PEM).
pub fn client_config(ca_pem: &str, identity: Option<(&str, &str)>) -> Result<rustls::ClientConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    let mut found = false;
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.map_err(pem_err("CA certificate"))?)?;
        found = true;
    }
    if !found {
        return Err(TlsError::Pem { what: "CA certificate", message: "no certificate found".into() });
    }
    let builder =
        rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions()?.with_root_certificates(roots);
    let mut config = match identity {
        Some((cert_pem, key_pem)) => {
            let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(pem_err("client certificate"))?;
            let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(pem_err("client key"))?;
            builder.with_client_auth_cert(chain, key)?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}
