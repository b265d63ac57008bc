//! keelson's resource model: Machine, MachinePool, BootstrapToken and KubernetesCluster in the API group
//! `keelson.io/v1alpha1`, their validation, typed versions, and the agent protocol's messages.
//! No I/O happens here.

pub mod cluster;
pub mod config;
pub mod decode;
pub mod machine;
pub mod meta;
pub mod pool;
pub mod tls;
pub mod token;
pub mod validate;
pub mod version;
pub mod window;
pub mod wire;

pub use meta::API_VERSION;

pub const KIND_MACHINE: &str = "Machine";
pub const KIND_POOL: &str = "MachinePool";
pub const KIND_TOKEN: &str = "BootstrapToken";
pub const KIND_CLUSTER: &str = "KubernetesCluster";

/// An error with all its causes, for one-line messages: reqwest's and rustls's own Display
/// hides the part that tells an operator what happened ("connection refused", "unknown CA").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
