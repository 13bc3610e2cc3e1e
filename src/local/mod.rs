//! The machine: the intra-machine step of the data path, and what local ranks tell
//! each other beside it.
//!
//! - [`LocalStep`] is the intra-machine reduce-scatter and all-gather of one slice,
//!   as the engine drives it, over a [`MemorySpace`]: [`ShmStep`] implements it for
//!   processes sharing host memory ([`shm`], over the counter [`protocol`]);
//!   [`PlacedStep`] for a memory space of host or device tensors, a device
//!   tensor's step moving its bytes by the stages of its slices' device
//!   programs (`alone` for a rank alone on its machine; for several,
//!   `collective_step`, the GPUs' own, or `staged`, through the shared segment, as
//!   `FAIRRING_DEVICE_LOCAL` chooses), each path saying what its stages do,
//!   through a reach: a GPU's (`gpu`, with NCCL's communicators in `nccl`) for
//!   the communicator, the simulated GPU's for the simulation;
//!   [`Solo`] is the step of a dedicated server, which has none.
//! - [`Machine`] is the control area every local rank shares whatever its memory:
//!   doorbells, the descriptors of operations, the first failure.
//!
//! Both live in the machine's shared segment (`crate::shm`).
//!
//! Every call is non-blocking: a `try_` call that cannot proceed yet returns
//! `None`, and the engine retries it when a doorbell rings, so one progress thread
//! can drive many slices at once and never waits inside a step. On a GPU, a step
//! that can proceed opens its stage of the slice's program (enqueued when the
//! call was accepted) and returns the fence that ends it: no step makes a CUDA
//! call.

mod alone;
mod collective_step;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(all(test, loom))]
mod loom_models;
mod machine;
#[cfg(feature = "cuda")]
mod nccl;
mod peer_copy;
mod pieces;
mod placed_step;
pub(crate) mod protocol;
pub(crate) mod shared_core;
mod shm_step;
mod solo;
mod staged;
pub(crate) mod tensor_copies;

use fairring_core::plan::Slice;
use fairring_core::{DataType, ReduceOp};

pub(crate) use collective_step::takes;
pub use collective_step::{ONE_REDUCE_SCATTER_FROM_BYTES, reduces_in_one_call};
#[cfg(feature = "cuda")]
pub(crate) use gpu::GpuReach;
pub(crate) use machine::{Machine, Words};
#[cfg(feature = "cuda")]
pub(crate) use nccl::{NcclCell, NcclSetup};
pub(crate) use peer_copy::PeerCopy;
pub(crate) use pieces::RailPieces;
#[cfg(not(feature = "cuda"))]
pub(crate) use placed_step::HostOnly;
pub(crate) use placed_step::PlacedStep;
#[cfg(all(test, not(loom)))]
pub(crate) use placed_step::{DeviceReach, Place};
pub(crate) use shm_step::{COPY_BETWEEN_TENSORS_FROM, REDUCE_WHOLE_UP_TO, ShmStep, slice_range};
pub(crate) use solo::Solo;
pub(crate) use staged::Waiting;

use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::memory::program::{ProgramItem, Stages, Unfinished};

/// One slice as the local step sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LocalSlice<'a, M: MemorySpace> {
    /// The staging buffer the slice holds.
    pub(crate) buffer: u32,
    /// The slice's number (global, across operations).
    pub(crate) number: u64,
    /// The slice of the operation's plan.
    pub(crate) slice: &'a Slice,
    /// The operation's tensor.
    pub(crate) tensor: &'a M::Tensor,
    /// The element type.
    pub(crate) dtype: DataType,
    /// The operator.
    pub(crate) op: ReduceOp,
    /// A reduce-scatter's pieces, grouped by device ([`RailPieces`]), where
    /// they take the place of the slice's slots.
    pub(crate) pieces: Option<RailPieces>,
    /// A broadcast on one machine: its root's local rank. The shared-memory
    /// step then copies the slice from the root's tensor into the others'
    /// where the ranks may ([`PeerCopy`]); every other step, and that one
    /// where they may not, sums it with their zeros, which is the same bytes.
    pub(crate) root: Option<u32>,
    /// The stages of a device tensor's slice's program (enqueued when its
    /// call was accepted): the step raises its own, and waits for their
    /// ends. Empty on host memory.
    pub(crate) stages: Stages,
}

/// A part of the local step, as a device tensor's slice asks for it: what
/// [`LocalStep::device_items`] describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LocalStage {
    /// [`LocalStep::begin`].
    Begin,
    /// [`LocalStep::try_reduce_scatter`], final where `final_world`.
    ReduceScatter { final_world: Option<u32> },
    /// [`LocalStep::try_all_gather`] after a reduce-scatter of
    /// `final_world`.
    AllGather {
        final_world: Option<u32>,
        own_in_tensor: bool,
    },
}

/// The intra-machine step as the engine drives it.
pub(crate) trait LocalStep<M: MemorySpace>: Send + Sync {
    /// Whether staging buffer `buffer` may take slice `number`: every local rank is
    /// done with the slice it held before.
    fn buffer_free(&self, buffer: u32, number: u64) -> bool;

    /// Whether a slice of `tensor` whose result is final on this machine (a
    /// job of one machine) runs in the tensor itself and stages nothing, for
    /// `dtype` and `op`: then the engine plans the operation's whole tensor as
    /// one slice ([`Plan::whole`](fairring_core::plan::Plan::whole)), one
    /// NCCL all-reduce instead of one per slice. Every local rank answers
    /// alike for the same call.
    fn works_in_tensor(&self, tensor: &M::Tensor, dtype: DataType, op: ReduceOp) -> bool {
        let _ = (tensor, dtype, op);
        false
    }

    /// Makes the slice's input ready for the reduce-scatter and announces it
    /// (host: copies what the other local ranks reduce into the staging buffer;
    /// GPU: orders the reduce-scatter after the caller's stream).
    fn begin(&self, s: &LocalSlice<'_, M>) -> Result<()>;

    /// Reduces this rank's slot of the slice across the machine once every local
    /// rank has begun it; `None` while one has not. The result goes into this
    /// rank's slot of its staging buffer. `final_world` is `Some(world size)` when
    /// that result is final (a single-machine job): it then goes into the slot of
    /// the tensor too, already divided by the world size for [`ReduceOp::Avg`];
    /// for a reduce-scatter's pieces, into the tensor only (its own share), since
    /// no all-gather follows.
    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, M>,
        final_world: Option<u32>,
    ) -> Result<Option<M::Fence>>;

    /// Announces that this rank's slot of the slice is final.
    fn publish_slot(&self, s: &LocalSlice<'_, M>);

    /// Copies the final slots into the tensor once every local rank's slot is
    /// final (this rank's own slot too, unless the reduce-scatter wrote it there
    /// already: `own_in_tensor`), and announces that this rank is done with the
    /// buffer; `None` while a slot is not final.
    fn try_all_gather(
        &self,
        s: &LocalSlice<'_, M>,
        own_in_tensor: bool,
    ) -> Result<Option<M::Fence>>;

    /// Announces, without an all-gather, that this rank is done with the buffer
    /// for the slice (algorithms that do not use the local step).
    fn finish(&self, buffer: u32, number: u64);

    /// The local ranks that have not yet done their part of slice `number` in
    /// buffer `buffer`, at the first step some rank has not finished: what a
    /// stalled slice waits for.
    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32>;

    /// The fence [`try_all_gather`](LocalStep::try_all_gather) returned for
    /// slice `number` in `buffer` has passed: a step whose all-gather reads
    /// the other ranks' buffers with copies that end later announces it is
    /// done with the buffer now.
    fn gathered(&self, buffer: u32, number: u64) -> Result<()> {
        let _ = (buffer, number);
        Ok(())
    }

    /// Whether an announcement waits for copies to end: nothing rings the
    /// doorbell when they do, so the progress thread naps short.
    fn awaits_fences(&self) -> bool {
        false
    }

    /// Calls `each` with what `stage` of device slice `s` asks of the
    /// device: its part of the slice's program ([`ProgramItem`]: copies,
    /// the machine's collectives), known from the call alone so that it is
    /// enqueued when the call is accepted. A step with no device has none.
    fn device_items(
        &self,
        s: &LocalSlice<'_, M>,
        stage: LocalStage,
        each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
    ) -> Result<()> {
        let _ = (s, stage, each);
        Ok(())
    }

    /// Enqueues operation `seq`'s device program on `tensor` (on the
    /// caller's thread, as the call is accepted).
    fn enqueue(
        &self,
        tensor: &M::Tensor,
        seq: u64,
        items: &[ProgramItem<M::Tensor>],
    ) -> std::result::Result<(), Unfinished> {
        let _ = (tensor, items);
        Err(Unfinished {
            error: Error::internal(
                "only a step that reaches a device takes device programs",
                format!("operation {seq}"),
            ),
            ends: false,
        })
    }

    /// The engine failed, and every gate of its programs is released: the
    /// machine's collectives are stopped (NCCL aborted, which waits for the
    /// device, on a thread of its own), so that a collective waiting for a
    /// rank that is gone ends, and its stream with it.
    fn release(&self) {}

    /// The engine failed: closes this rank's tensors to the machine's reads
    /// between tensors before it declares its operations finished. A peer's
    /// read that is not over by then throws what it read away (see
    /// [`tensor_copies`]), so nothing is waited for.
    fn close_tensors(&self) {}
}
