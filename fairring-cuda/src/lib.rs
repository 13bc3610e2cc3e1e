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
//! intra-machine local step over it; with device tensors both map onto this
//! crate as follows. When a call is accepted, the engine enqueues the
//! operation's whole device program on the caller's thread: each stage on a
//! staging buffer's [`Stream`] waits on a [`HostFlags`] gate word, copies
//! between the tensor and page-locked staging ([`HostRegistration`]), or runs
//! the machine's collectives in place on the tensor
//! ([`Communicator::all_reduce_in_place`](nccl::Communicator::all_reduce_in_place),
//! `reduce_in_place`, `broadcast_in_place`, inside a
//! [`group`](nccl::group)), and ends by writing the buffer's end word. The
//! progress thread then opens gates with host stores and reads end words: it
//! makes no CUDA call. A caller's stream waits for an operation on its done
//! word. Reductions between machines run on the host, in staging.
//! [`StagingPool`] and [`ReductionKernels`] are the pieces of a device-resident
//! pipeline (staging in device memory, reductions on the GPU), which the
//! engine does not use yet.
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

mod buffers;
mod device;
mod error;
mod event;
mod flags;
pub mod kernel;
pub mod nccl;
pub mod probe;
pub mod staging_pool;
mod stream;
mod sync;

pub use device::{Bound, Device, ModuleLoading, cuda_available, module_loading};

/// The raw driver handles that cross into and out of this crate's safe types
/// (what a host runtime such as PyTorch hands over).
pub mod sys {
    pub use cudarc::driver::sys::{CUdeviceptr, CUevent, CUstream};
}
pub use buffers::{
    DeviceBuffer, DeviceSlice, DeviceSliceMut, HostRegistration, PinnedBuffer, device_of_pointer,
};
pub use error::{Error, Library, Result};
pub use event::{Event, Timing};
pub use flags::HostFlags;
pub use kernel::ReductionKernels;
pub use staging_pool::{HostStaging, Stage, StagingParts, StagingPool};
pub use stream::Stream;
