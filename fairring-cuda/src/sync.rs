//! The one place `fairring-cuda` names its atomics.
//!
//! The crate has no loom models: its atomics are either words in page-locked
//! memory that a GPU's streams also read and write (`flags.rs`), which no
//! model can place, or an NCCL communicator's abort and group state
//! (`nccl/communicator.rs`), exercised against real NCCL on a GPU
//! (`tests/gpu.rs`). Naming them here keeps the choice in one place, as the
//! engine's and the fabric's `sync` modules do, should a model be added.

pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
