//! The machine's shared memory: one segment per machine, mapped by every local
//! rank, holding each rank's staging buffers, progress counters, operation table
//! and doorbell, and the machine's first failure.
//!
//! This is the storage only. What the ranks do with it lives above: the host
//! memory space stages in its buffers (`crate::memory`), the shared-memory local
//! step and the machine's control plane use its counters, table and doorbells
//! (`crate::local`).

mod doorbell;
pub(crate) mod segment;

pub(crate) use doorbell::Doorbell;
pub(crate) use segment::Segment;
