//! The one place fairring-core names its atomics.
//!
//! Under `cfg(loom)` (set with `RUSTFLAGS="--cfg loom"`) the atomics come from loom, so
//! that the loom models in `tests/loom_staging.rs` explore every interleaving of the
//! code that ships; otherwise they are `core`'s. No other module imports an atomic.

#[cfg(all(loom, target_has_atomic = "64"))]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering};

#[cfg(all(not(loom), target_has_atomic = "64"))]
pub(crate) use core::sync::atomic::{AtomicU64, Ordering};
