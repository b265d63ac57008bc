//! Drivers: the real operations that change this machine, each external tool in its own
//! module, run as argv (never through a shell) with a timeout, its stderr kept for the error.

pub mod apt;
pub mod artifact;
pub mod command;
pub mod containerd;
pub mod dnf;
pub mod etcd;
pub mod files;
pub mod kubeadm;
pub mod kubelet;
pub mod packages;
pub mod script;
pub mod systemd;
