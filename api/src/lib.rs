//! keelson's resource model: Machine, MachinePool and BootstrapToken in the API group
//! `keelson.io/v1alpha1`, their validation, typed versions, and the agent protocol's messages.
//! No I/O happens here.

pub mod config;
pub mod decode;
pub mod machine;
pub mod meta;
pub mod pool;
pub mod tls;
pub mod token;
pub mod validate;
pub mod version;
pub mod wire;

pub use meta::API_VERSION;

pub const KIND_MACHINE: &str = "Machine";
pub const KIND_POOL: &str = "MachinePool";
pub const KIND_TOKEN: &str = "BootstrapToken";

/// Annotation that marks a machine to be removed first when its pool shrinks.
pub const ANNOTATION_DELETE_MACHINE: &str = "keelson.io/delete-machine";
