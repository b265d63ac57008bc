//! keelson-agent: the node agent. It enrolls, pulls its Machine spec, observes the machine,
//! plans the difference, and carries the plan out step by step under a crash-safe journal,
//! taking a disruption lease before anything that interrupts workloads. See `reconcile` for
//! the state machine.

pub mod client;
pub mod config;
pub mod daemon;
pub mod drivers;
pub mod enroll;
pub mod etcd;
pub mod facts;
pub mod journal;
pub mod ledger;
pub mod observe;
pub mod plan;
pub mod reconcile;
pub mod reset;
pub mod state;
