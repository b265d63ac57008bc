//! etcd members on etcd-only machines: a client for etcd's v3 API (`client`) and the
//! membership operations around one member that keep the cluster's quorum (`membership`),
//! and the member's TLS identity from the controller's per-cluster CA (`pki`).

pub mod client;
pub mod member;
pub mod membership;
pub mod pki;
