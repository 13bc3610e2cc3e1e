//! The one place `fairring-rdma` names its atomics and the locks its
//! completion queue sleeps on.
//!
//! Under `cfg(loom)` (`RUSTFLAGS="--cfg loom"`) they come from loom, so that the
//! loom models (`fabric/loom_models.rs`) explore every interleaving of the
//! completion queue's sleep-and-wake handshake as it ships. Otherwise they are
//! `std`'s. No other module imports an atomic from `std`.
//!
//! [`unmodelled`] names the atomics that stay the hardware's under loom: the
//! providers' connection and I/O-thread state (tcp's event loop, link slots
//! and regions; the verbs provider's counters), which the models do not
//! reach; real sockets and devices exercise them in the providers' tests.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicUsize, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicUsize, Ordering, fence};

#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex};
#[cfg(not(loom))]
pub(crate) use std::sync::{Condvar, Mutex};

/// Atomics loom does not model (see the module docs).
pub(crate) mod unmodelled {
    #[cfg(feature = "verbs")]
    pub(crate) use std::sync::atomic::AtomicUsize;
    #[cfg(any(feature = "tcp", feature = "verbs"))]
    pub(crate) use std::sync::atomic::Ordering;
    #[cfg(feature = "tcp")]
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64};
}
