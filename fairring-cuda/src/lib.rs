//! The GPU half of a fairring machine.
//!
//! This crate binds [`fairring_core`] to CUDA through cudarc (driver, NCCL and
//! NVRTC), loading every library at run time, so that it builds, lints and runs its
//! host tests on a machine with no CUDA at all:
//!
//! - [`probe`]: whether the driver (with a device), NCCL and NVRTC can be used,
//!   asked without panicking; every entry point checks first and returns
//!   [`Error::Unavailable`] naming the missing library;
//! - [`Device`] (chosen by local rank), [`Stream`], [`Event`]: the primary
//!   context, ordered queues and the points between them;
//! - [`DeviceBuffer`], [`PinnedBuffer`], and the views [`DeviceSlice`] and
//!   [`DeviceSliceMut`], which also wrap raw pointers a host runtime owns;
//! - [`nccl`]: communicators from a 128-byte unique id passed through a
//!   rendezvous store, in-place reduce-scatter and all-gather, groups, and an
//!   abort that returns within a bound;
//! - [`ReductionKernels`]: the device reduction kernel `dst op= src` with the host
//!   kernels' semantics;
//! - [`StagingPool`]: staging buffers sized by the core's
//!   [`StagingLayout`](fairring_core::plan::StagingLayout), one stream per
//!   pipeline stage, events between them, and completion as an event.
//!
//! # Errors and panics
//!
//! Every fallible call returns [`Error`], naming the driver or NCCL call and the
//! library's own description, or the argument refused. Nothing panics on bad
//! input or a missing library; `Drop` implementations log failures (the `log`
//! crate) and never panic.

mod device;
mod error;
mod event;
pub mod kernel;
mod memory;
pub mod nccl;
pub mod probe;
pub mod staging;
mod stream;

pub use device::{Device, cuda_available};
pub use error::{Error, Library, Result};
pub use event::{Event, Timing};
pub use kernel::ReductionKernels;
pub use memory::{DeviceBuffer, DeviceSlice, DeviceSliceMut, PinnedBuffer};
pub use staging::{HostStaging, Stage, StagingParts, StagingPool};
pub use stream::Stream;
