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
//!   rendezvous store, in-place reduce-scatter, all-gather, reduce, broadcast and
//!   all-reduce, groups, and an
//!   abort that returns within a bound;
//! - [`ReductionKernels`]: the device reduction kernel `dst op= src` with the host
//!   kernels' semantics;
//! - [`StagingPool`]: staging buffers sized by the core's
//!   [`StagingLayout`](fairring_core::plan::StagingLayout), one stream per
//!   pipeline stage, events between them, and completion as an event.
//!
//! # Using it from an engine
//!
//! The `fairring` engine is generic over a memory space and drives an
//! intra-machine local step over it; both map onto this crate. The memory space's
//! tensor is a device pointer with the caller's stream, its fence an [`Event`]
//! polled with [`Event::is_complete`]; staging in is a copy ordered after the
//! caller's stream, and its reduction is [`ReductionKernels`] on the add stream. The
//! local step's begin is [`StagingPool::begin`] after the caller's stream; its
//! reduce-scatter enqueues
//! [`Communicator::reduce_scatter_in_place`](nccl::Communicator::reduce_scatter_in_place)
//! and returns the event that ends it; publishing the slot is
//! [`StagingPool::hand_over`] to the all-gather stage; its all-gather enqueues the
//! all-gather and [`StagingPool::complete`]; a buffer is free once its previous
//! completion event is. The descriptor, failure and doorbell parts stay in host
//! shared memory as they are.
//!
//! # What has run where
//!
//! The host-side code runs in CI on a machine without a GPU; the kernel source
//! also runs there as C++ on the CPU, thread by thread, against the host kernels
//! (`kernel/emulation.rs`); NVRTC compiles the kernels there
//! (`tests/kernel_compile.rs`) and NCCL makes unique ids
//! (`tests/nccl_library.rs`). The tests that need a device (`tests/gpu.rs`) and
//! `fairring-gpu-bench` passed on an H100 and an H200 (CUDA 13 driver, NCCL
//! from the `nvidia-nccl-cu13` wheel); `ci/gpu-build` and the kit's
//! `gpu-check` run them there.
//!
//! [`HostRegistration`] page-locks host memory another owner allocated (the
//! engine's staging buffers), and [`HostFlags`] are words in pinned memory a
//! stream waits on (`cuStreamWaitValue64`) until the host raises them, or
//! writes after its work (`cuStreamWriteValue64`): how the engine enqueues an
//! operation's whole GPU work when the call is accepted, behind gates its
//! progress thread opens with host stores, and how a caller's stream waits
//! for the operation.
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
mod flags;
pub mod kernel;
mod memory;
pub mod nccl;
pub mod probe;
pub mod staging;
mod stream;
mod sync;

pub use device::{Bound, Device, ModuleLoading, cuda_available, module_loading};

/// The raw driver handles that cross into and out of this crate's safe types
/// (what a host runtime such as PyTorch hands over).
pub mod sys {
    pub use cudarc::driver::sys::{CUdeviceptr, CUevent, CUstream};
}
pub use error::{Error, Library, Result};
pub use event::{Event, Timing};
pub use flags::HostFlags;
pub use kernel::ReductionKernels;
pub use memory::{
    DeviceBuffer, DeviceSlice, DeviceSliceMut, HostRegistration, PinnedBuffer, device_of_pointer,
};
pub use staging::{HostStaging, Stage, StagingParts, StagingPool};
pub use stream::Stream;
