//! The etcd clusters' certificate authorities: one CA per etcd cluster (`spec.etcd.cluster`),
//! made on first use and kept in the data directory (`etcd-ca/<cluster>/ca.{crt,key}`), apart
//! from the controller's own CA, so that an etcd certificate never opens the controller and a
//! keelson identity never opens etcd.
//!
//! Members' keys are made on their machines and clients' keys on the operator's: the CA signs
//! CSRs, taking only the public key from them; names and usages are the controller's.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use keelson_api::meta::Name;
use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, KeyUsagePurpose, SanType};

use crate::pki::{Authority, Issued, PkiError, dn, parse_csr};

/// Members' and clients' certificates last a year; a member's agent asks for a new one well
/// before that.
pub const ETCD_CERT_VALIDITY_DAYS: i64 = 365;

#[derive(Debug)]
pub struct EtcdAuthorities {
    dir: PathBuf,
    loaded: Mutex<HashMap<Name, Arc<Authority>>>,
}

impl EtcdAuthorities {
    pub fn new(data_dir: &Path) -> Self {
        EtcdAuthorities { dir: data_dir.join("etcd-ca"), loaded: Mutex::new(HashMap::new()) }
    }

    /// Where the CA of `cluster` is kept.
    pub fn dir(&self, cluster: &Name) -> PathBuf {
        self.dir.join(cluster.as_str())
    }

    /// Drops the CA of `cluster` that this process just made and must not use (another
    /// replica's is the cluster's): from memory and from the data directory.
    pub fn discard(&self, cluster: &Name) {
        if let Ok(mut loaded) = self.loaded.lock() {
            loaded.remove(cluster);
        }
        for f in ["ca.key", "ca.crt"] {
            let _ = std::fs::remove_file(self.dir(cluster).join(f));
        }
    }

    /// The CA of `cluster`, created on first use.
    pub fn authority(&self, cluster: &Name) -> Result<Arc<Authority>, PkiError> {
        let mut loaded = self.loaded.lock().map_err(|_| PkiError::Invalid("etcd CA cache poisoned".into()))?;
        if let Some(a) = loaded.get(cluster) {
            return Ok(a.clone());
        }
        let dir = self.dir(cluster);
        std::fs::create_dir_all(&dir).map_err(|source| PkiError::Io { path: dir.clone(), source })?;
        let (authority, created) = Authority::load_or_create_named(&dir, &format!("keelson etcd CA {cluster}"))?;
        if created {
            tracing::info!(%cluster, path = %dir.display(), "created the etcd cluster's certificate authority");
        }
        let authority = Arc::new(authority);
        loaded.insert(cluster.clone(), authority.clone());
        Ok(authority)
    }

    /// A member's certificate, for both its peer and its client listener (etcd uses one
    /// certificate as server and as client towards its peers): CN = the machine's name, SANs
    /// = the name, `localhost`, loopback and the machine's addresses.
    pub fn issue_member(&self, cluster: &Name, machine: &Name, csr_pem: &str, addresses: &[String]) -> Result<Issued, PkiError> {
        let csr = parse_csr(csr_pem)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(machine.as_str(), None);
        let mut sans = vec![
            SanType::DnsName(machine.as_str().to_owned().try_into()?),
            SanType::DnsName("localhost".to_owned().try_into()?),
            SanType::IpAddress(IpAddr::from([127, 0, 0, 1])),
        ];
        for a in addresses {
            let ip: IpAddr = a.parse().map_err(|_| PkiError::Invalid(format!("address {a:?} is not an IP address")))?;
            if !sans.contains(&SanType::IpAddress(ip)) {
                sans.push(SanType::IpAddress(ip));
            }
        }
        params.subject_alt_names = sans;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        self.authority(cluster)?.sign(params, &csr.public_key, ETCD_CERT_VALIDITY_DAYS)
    }

    /// A client certificate (for kube-apiserver, or an operator's etcdctl): CN = `who`.
    pub fn issue_client(&self, cluster: &Name, who: &str, csr_pem: &str) -> Result<Issued, PkiError> {
        let csr = parse_csr(csr_pem)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(who, None);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        self.authority(cluster)?.sign(params, &csr.public_key, ETCD_CERT_VALIDITY_DAYS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::KeyPair;

    fn name(s: &str) -> Name {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn each_cluster_has_its_own_ca_kept_across_restarts() -> Result<(), PkiError> {
        let dir = tempfile::tempdir().map_err(|e| PkiError::Invalid(e.to_string()))?;
        let cas = EtcdAuthorities::new(dir.path());
        let main = cas.authority(&name("main"))?.cert_pem.clone();
        let other = cas.authority(&name("other"))?.cert_pem.clone();
        assert_ne!(main, other);
        // A new process loads the same CA.
        assert_eq!(EtcdAuthorities::new(dir.path()).authority(&name("main"))?.cert_pem, main);

        let key = KeyPair::generate()?;
        let csr = CertificateParams::new(vec![])?.serialize_request(&key)?.pem()?;
        let issued = cas.issue_member(&name("main"), &name("etcd-1"), &csr, &["10.0.0.7".into()])?;
        let der = rustls_pki_types::pem::PemObject::from_pem_slice(issued.cert_pem.as_bytes())
            .map_err(|e: rustls_pki_types::pem::Error| PkiError::Invalid(e.to_string()))?;
        let der: rustls_pki_types::CertificateDer = der;
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| PkiError::Invalid(e.to_string()))?;
        let san = cert.subject_alternative_name().ok().flatten().map(|s| format!("{:?}", s.value.general_names)).unwrap_or_default();
        assert!(san.contains("etcd-1") && san.contains("localhost"), "{san}");
        assert!(san.contains("[10, 0, 0, 7]") || san.contains("10.0.0.7"), "{san}");
        assert!(cas.issue_member(&name("main"), &name("etcd-1"), &csr, &["not-an-ip".into()]).is_err());
        assert!(matches!(cas.issue_client(&name("main"), "kube-apiserver", "garbage"), Err(PkiError::BadCsr(_))));
        Ok(())
    }
}
