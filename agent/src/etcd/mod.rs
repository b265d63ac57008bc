//! etcd members on etcd-only machines: a client for etcd's v3 API (`client`) and the
//! membership operations around one member that keep the cluster's quorum (`membership`).

pub mod client;
pub mod membership;
