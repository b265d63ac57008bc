//! The certificate authorities that controller replicas share.
//!
//! Each replica keeps its CA keys in its own data directory; the store records each CA's
//! certificate (public) the first time a replica uses it. A replica whose CA differs from the
//! recorded one refuses to use it, instead of issuing identities the other replicas reject:
//! the controller CA at start-up, an etcd cluster's CA before it signs. A replica that lacks
//! a CA the store already records refuses to make a new one; the operator copies the CA from
//! a replica that has it (docs/controller.md, "Several replicas").

use std::path::Path;

use crate::store::{Precondition, Store, StoreError, StoreExt};

/// The controller CA's certificate.
pub const CONTROLLER_CA: &str = "/controller/ca";
/// `/controller/etcd-ca/<cluster>`: each etcd cluster CA's certificate.
pub const ETCD_CAS: &str = "/controller/etcd-ca/";

#[derive(Debug, thiserror::Error)]
pub enum SharedCaError {
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("the store records another certificate at {key}")]
    Mismatch { key: String },
}

/// The certificate recorded at `key`, if any.
pub async fn recorded(store: &dyn Store, key: &str) -> Result<Option<String>, StoreError> {
    Ok(store.get(key).await?.map(|e| String::from_utf8_lossy(&e.value).into_owned()))
}

/// Records `cert_pem` at `key` unless a certificate is recorded there; then it must be the same.
pub async fn pin(store: &dyn Store, key: &str, cert_pem: &str) -> Result<(), SharedCaError> {
    let same = |found: &str| found.trim() == cert_pem.trim();
    if let Some(found) = recorded(store, key).await? {
        return if same(&found) { Ok(()) } else { Err(SharedCaError::Mismatch { key: key.to_owned() }) };
    }
    match store.put(key, cert_pem.as_bytes().to_vec(), Precondition::Absent).await {
        Ok(_) => Ok(()),
        // Another replica recorded one first.
        Err(StoreError::Conflict { .. }) => match recorded(store, key).await? {
            Some(found) if same(&found) => Ok(()),
            _ => Err(SharedCaError::Mismatch { key: key.to_owned() }),
        },
        Err(e) => Err(e.into()),
    }
}

/// Whether `dir` holds a CA (`ca.crt`).
pub fn present(dir: &Path) -> bool {
    dir.join("ca.crt").exists()
}
