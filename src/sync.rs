//! The one place the `fairring` package names its atomics.
//!
//! Under `cfg(loom)` (`RUSTFLAGS="--cfg loom"`) the atomics of process memory come
//! from loom, so that the loom models (`engine/progress/loom_models.rs`,
//! `local/loom_models.rs`) explore every interleaving of the code that ships: the
//! park/wake protocol of the progress thread and the doorbell it sleeps on.
//! Otherwise they are `std`'s. No other module imports an atomic from `std`.
//!
//! [`unmodelled`] names the atomics that stay the hardware's under loom: those in
//! memory shared with other processes (the machine's segment: loom can neither
//! model another process nor place its atomics in a mapping), bytes the engine uses
//! as a tensor, and the rendezvous store's server (a network service outside the
//! models), and the progress thread's bound on pure spinning (a heuristic no
//! ordering rests on). The protocol over the segment's counters is modelled instead through
//! [`crate::local::protocol`], which reaches its counters through a trait that the
//! loom model implements with loom's atomics.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};

/// What a sleeping doorbell waits on under loom, in place of a futex.
#[cfg(loom)]
pub(crate) use loom::sync::{Condvar, Mutex};
/// Lets another thread run (loom's, under loom, so that the models see it).
#[cfg(loom)]
pub(crate) use loom::thread::yield_now;
#[cfg(not(loom))]
pub(crate) use std::thread::yield_now;

/// Atomics loom does not model (see the module docs).
pub(crate) mod unmodelled {
    pub(crate) use std::sync::atomic::{
        AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    };
}
