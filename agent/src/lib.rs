//! keelson-agent: the node agent. This release carries enrollment (identity) and the
//! observation of the machine's facts; the reconcile daemon builds on them.

pub mod enroll;
pub mod facts;
pub mod state;
