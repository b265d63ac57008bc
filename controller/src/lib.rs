//! keelson-controller: the fleet's source of truth. It keeps Machines, MachinePools,
//! BootstrapTokens and KubernetesClusters in its store, enrolls machines with mTLS identities, serves each agent its
//! spec and records its status, and watches for machines that fall silent.

mod census;
pub mod clusters;
mod decoded;
pub mod drain;
pub mod error;
pub mod etcd_pki;
pub mod events;
pub mod http;
pub mod leader;
pub mod leases;
pub mod metrics;
pub mod pki;
pub mod pools;
pub mod registry;
pub mod rollout;
pub mod serve;
pub mod shared_ca;
pub mod store;
pub mod waiters;
