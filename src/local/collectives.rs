//! The local step of several ranks on one machine whose tensors are on GPUs,
//! through the GPUs' own collectives (NCCL's, in `nccl`; the simulated GPU's
//! in the simulation): the machine's reduce-scatter and all-gather run on the
//! tensors, on the engine's streams, and only a rank's own slot crosses to
//! the host (where the fabric sends it from).
//!
//! Per slice, local rank `d` of `D`:
//!
//! 1. **begin**: announces `InputReady` at once (nothing is staged for the
//!    other ranks: the collectives read the tensors);
//! 2. **reduce-scatter**: once every local rank has begun the slice, one
//!    in-place reduce per rank's slot (or per piece of a reduce-scatter),
//!    rooted at that rank, grouped, so that slots of any length need no
//!    padding; then `d` copies its reduced slot from its tensor into its
//!    staging buffer on the same stream. In a job on one machine the result
//!    is final: a slice of an all-reduce is one in-place all-reduce and
//!    nothing is gathered; a reduce-scatter's pieces stay in the tensor, at
//!    the rank's own share.
//! 3. the inter-machine step, then `SlotFinal`, as on host memory;
//! 4. **all-gather**: once every slot is final, `d` copies its final slot from
//!    staging into its tensor, then one in-place broadcast per slot, rooted
//!    at its rank, grouped; `Done` follows the fence.
//!
//! Per slice of `S` bytes that is `S/D` over PCIe each way and the machine's
//! reduction on the GPUs, against the host-staged step's `S` down and up and a
//! reduction of `S/D` on the host.
//!
//! # Order
//!
//! NCCL requires every rank of a communicator to issue its collectives in the
//! same order. The engine may reach slices' steps in different orders on
//! different ranks (a buffer's turn, a peer's landing), so each rank holds
//! two communicators ([`Comm`]), one for reduce-scatters and one for
//! all-gathers, and issues on each in slice order ([`IssueOrder`]): a step
//! whose slice is not the oldest waiting for that communicator returns `None`
//! and is retried. Every rank begins the same slices in the same order, so
//! the orders agree. The two communicators' kernels may run at once, as
//! PyTorch's process groups' do.
//!
//! # Semantics
//!
//! Sums, products, and integer minima and maxima go through the collectives:
//! results are the same on every rank, and, for floats, reduced in NCCL's
//! order and precision (16-bit types accumulate hop by hop in their own
//! format, where the host step accumulates in `f32`). Float minima and maxima
//! take the host-staged step, which keeps fairring's NaN and signed-zero
//! rules ([`CollectiveStep::takes`]), as do the types and operators NCCL
//! lacks (`i16`, `bool`, the bitwise operators).

use std::ops::Range;
use std::sync::{Mutex, MutexGuard, PoisonError};

use fairring_core::{DataType, ReduceOp};

use super::issue_order::{GatherTurn, IssueOrder};
use super::shm_step::{ShmStep, for_each_run, slice_range, slot_range};
use super::staged::Announce;
use super::{LocalSlice, Waiting};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;

/// Which of a rank's two communicators a call goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Comm {
    /// Reduce-scatters (reduces), and a single machine's all-reduces.
    Reduce,
    /// All-gathers (broadcasts).
    Gather,
}

/// A machine's collectives among its ranks' tensors, as one rank issues
/// them: each call enqueued on the stream of a staging buffer, in place on
/// bytes of a tensor, in the same order on every rank of its [`Comm`].
///
/// # Safety
///
/// The `unsafe` methods are called only once the operation's start has
/// passed, on bytes of the slice (and, for the copies, this rank's own
/// page-locked staging bytes) that nothing else touches until the next
/// [`fence`](Collectives::fence) on that buffer has passed.
pub(crate) trait Collectives {
    /// A tensor.
    type Tensor;
    /// The end of what a buffer's stream holds.
    type Fence;

    /// Runs `enqueue`, whose calls go to `comm`, as one group.
    fn group(&self, comm: Comm, enqueue: &mut dyn FnMut() -> Result<()>) -> Result<()>;

    /// Every rank's bytes `range` of its tensor, reduced with `op`, into each
    /// rank's (on [`Comm::Reduce`]).
    ///
    /// # Safety
    ///
    /// See the trait.
    unsafe fn all_reduce(
        &self,
        buffer: u32,
        tensor: &Self::Tensor,
        range: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()>;

    /// Every rank's bytes `range`, reduced with `op`, into rank `root`'s (on
    /// [`Comm::Reduce`]).
    ///
    /// # Safety
    ///
    /// See the trait.
    unsafe fn reduce(
        &self,
        buffer: u32,
        tensor: &Self::Tensor,
        range: Range<usize>,
        dtype: DataType,
        op: ReduceOp,
        root: u32,
    ) -> Result<()>;

    /// Rank `root`'s bytes `range` into every rank's (on [`Comm::Gather`]).
    ///
    /// # Safety
    ///
    /// See the trait.
    unsafe fn broadcast(
        &self,
        buffer: u32,
        tensor: &Self::Tensor,
        range: Range<usize>,
        root: u32,
    ) -> Result<()>;

    /// Bytes `range` of `tensor` into `staging`.
    ///
    /// # Safety
    ///
    /// See the trait.
    unsafe fn copy_to_staging(
        &self,
        buffer: u32,
        staging: &mut [u8],
        tensor: &Self::Tensor,
        range: Range<usize>,
    ) -> Result<()>;

    /// `staging` into bytes `range` of `tensor`.
    ///
    /// # Safety
    ///
    /// See the trait.
    unsafe fn copy_from_staging(
        &self,
        buffer: u32,
        staging: &[u8],
        tensor: &Self::Tensor,
        range: Range<usize>,
    ) -> Result<()>;

    /// A fence after everything enqueued so far on `buffer`'s stream.
    fn fence(&self, buffer: u32) -> Result<Self::Fence>;
}

/// One rank's side of the step: the order it issues in.
pub(crate) struct CollectiveStep {
    order: Mutex<IssueOrder>,
}

/// Slices a communicator's order holds at most without growing: more than
/// the staging buffers any job has.
const ORDER_CAPACITY: usize = 64;

impl CollectiveStep {
    pub(crate) fn new() -> CollectiveStep {
        CollectiveStep {
            order: Mutex::new(IssueOrder::with_capacity(ORDER_CAPACITY)),
        }
    }

    /// Whether slices of `dtype` reduced with `op` go through the
    /// collectives: every type and operator NCCL has, but a float minimum or
    /// maximum (see the module docs). NCCL has no `i16`, no `bool` and no
    /// bitwise operators: those take the host-staged step too.
    pub(crate) fn takes(dtype: DataType, op: ReduceOp) -> bool {
        let nccl_has = !matches!(dtype, DataType::I16 | DataType::Bool) && !op.is_bitwise();
        nccl_has && !(dtype.is_float() && matches!(op, ReduceOp::Min | ReduceOp::Max))
    }

    fn lock(&self) -> MutexGuard<'_, IssueOrder> {
        self.order.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a slice waits for its turn on a communicator: nothing rings a
    /// doorbell when its turn comes, so the progress thread naps short.
    pub(crate) fn waiting(&self) -> bool {
        self.lock().waiting()
    }

    /// Step 1.
    pub(crate) fn begin<M: MemorySpace>(&self, shm: &ShmStep, s: &LocalSlice<'_, M>) -> Result<()> {
        self.lock().begun(s.number);
        shm.protocol
            .stage_in(&*shm.segment, s.buffer, s.number, || Ok(()))
    }

    /// Step 2; `None` while another rank has not begun the slice or an
    /// older slice has yet to reduce. Returns the fence of the last work
    /// enqueued.
    pub(crate) fn try_reduce_scatter<M: MemorySpace, C: Collectives>(
        &self,
        shm: &ShmStep,
        c: &C,
        s: &LocalSlice<'_, M>,
        tensor: &C::Tensor,
        final_world: Option<u32>,
    ) -> Result<Option<C::Fence>> {
        let mut order = self.lock();
        if !order.reduce_turn(s.number) {
            return Ok(None);
        }
        let base = slice_range(s.slice)?.start;
        let op = reduced_as(s.op, final_world, shm.size)?;
        let mut fence = None;
        let ran = shm.protocol.try_reduce_scatter(
            &*shm.segment,
            s.buffer,
            s.number,
            || -> Result<()> {
                if final_world.is_some() && s.pieces.is_none() {
                    // SAFETY: the slice's bytes, which only this step touches
                    // until its fence passes.
                    unsafe { c.all_reduce(s.buffer, tensor, slice_range(s.slice)?, s.dtype, op)? };
                } else {
                    c.group(Comm::Reduce, &mut || {
                        for r in 0..shm.size {
                            for_each_run(s, r, |in_slice, _| {
                                if in_slice.is_empty() {
                                    return Ok(());
                                }
                                let range = in_tensor(base, &in_slice);
                                // SAFETY: a run of the slice, which only this
                                // step touches until its fence passes.
                                unsafe { c.reduce(s.buffer, tensor, range, s.dtype, op, r) }
                            })?;
                        }
                        Ok(())
                    })?;
                    if final_world.is_none() {
                        for_each_run(s, shm.rank(), |in_slice, staged| {
                            if in_slice.is_empty() {
                                return Ok(());
                            }
                            let staging = shm.own_bytes(s.buffer, staged)?;
                            let range = in_tensor(base, &in_slice);
                            // SAFETY: this rank's own staging bytes and its
                            // reduced run, untouched until the fence passes
                            // (the engine waits for it).
                            unsafe { c.copy_to_staging(s.buffer, staging, tensor, range) }
                        })?;
                    }
                }
                fence = Some(c.fence(s.buffer)?);
                Ok(())
            },
        )?;
        if !ran {
            return Ok(None);
        }
        order.reduced(final_world.is_none() && s.pieces.is_none());
        Ok(fence)
    }

    /// Step 4; `None` while a slot is not final or an older slice has yet to
    /// gather. `Done` is announced once the engine has seen the returned
    /// fence pass ([`ShmStep::gathered`]).
    pub(crate) fn try_all_gather<M: MemorySpace, C: Collectives>(
        &self,
        shm: &ShmStep,
        c: &C,
        waiting: &Waiting<C::Fence>,
        s: &LocalSlice<'_, M>,
        tensor: &C::Tensor,
        own_in_tensor: bool,
    ) -> Result<Option<Option<C::Fence>>> {
        if s.pieces.is_some() {
            return Err(Error::internal(
                "a reduce-scatter's pieces are never gathered",
                format!("slice {}", s.number),
            ));
        }
        let mut order = self.lock();
        match order.gather_turn(s.number) {
            GatherTurn::Now => {}
            GatherTurn::Later => return Ok(None),
            GatherTurn::Nothing => {
                // A single machine's all-reduce left the whole slice in the
                // tensor.
                let ran = shm
                    .protocol
                    .try_all_gather(&*shm.segment, s.buffer, s.number, || Ok::<_, Error>(()))?;
                return Ok(ran.then_some(None));
            }
        }
        let base = slice_range(s.slice)?.start;
        let mut fence = None;
        let ran = shm.protocol.try_all_gather_started(
            &*shm.segment,
            s.buffer,
            s.number,
            || -> Result<()> {
                let own = slot_range(s.slice, shm.rank())?;
                if !own_in_tensor && !own.is_empty() {
                    let staging = shm.own_bytes(s.buffer, own.clone())?;
                    // SAFETY: this rank's final slot, which nothing writes
                    // before this rank's `Done`, after the fence.
                    unsafe {
                        c.copy_from_staging(s.buffer, staging, tensor, in_tensor(base, &own))?
                    };
                }
                c.group(Comm::Gather, &mut || {
                    for r in 0..shm.size {
                        let range = in_tensor(base, &slot_range(s.slice, r)?);
                        if !range.is_empty() {
                            // SAFETY: a slot of the slice, which only this
                            // step touches until its fence passes.
                            unsafe { c.broadcast(s.buffer, tensor, range, r)? };
                        }
                    }
                    Ok(())
                })?;
                fence = Some(c.fence(s.buffer)?);
                Ok(())
            },
        )?;
        if !ran {
            return Ok(None);
        }
        order.gathered();
        shm.announce_after(waiting, s.buffer, s.number, Announce::Done, Some(None))?;
        Ok(Some(fence))
    }
}

/// Bytes `within` of the slice, in the tensor.
fn in_tensor(base: usize, within: &Range<usize>) -> Range<usize> {
    base + within.start..base + within.end
}

/// The operator the collectives apply: the slice's, but an average that is
/// not final reduces as a sum (the division comes once the machines' sums
/// are in); a final one divides by the machine's ranks, which must be the
/// world.
fn reduced_as(op: ReduceOp, final_world: Option<u32>, ranks: u32) -> Result<ReduceOp> {
    match (op, final_world) {
        (ReduceOp::Avg, None) => Ok(ReduceOp::Sum),
        (ReduceOp::Avg, Some(world)) if world != ranks => Err(Error::internal(
            "a final result on one machine averages over its ranks, the world",
            format!("{ranks} local ranks in a world of {world}"),
        )),
        (op, _) => Ok(op),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_average_reduces_as_a_sum_until_it_is_final() {
        assert_eq!(reduced_as(ReduceOp::Avg, None, 2).unwrap(), ReduceOp::Sum);
        assert_eq!(
            reduced_as(ReduceOp::Avg, Some(2), 2).unwrap(),
            ReduceOp::Avg
        );
        assert_eq!(reduced_as(ReduceOp::Max, None, 2).unwrap(), ReduceOp::Max);
        let e = reduced_as(ReduceOp::Avg, Some(4), 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 local ranks in a world of 4"), "{e}");
    }

    #[test]
    fn float_minima_and_maxima_and_what_nccl_lacks_stay_on_the_host() {
        assert!(CollectiveStep::takes(DataType::F32, ReduceOp::Sum));
        assert!(CollectiveStep::takes(DataType::I32, ReduceOp::Max));
        assert!(!CollectiveStep::takes(DataType::BF16, ReduceOp::Min));
        assert!(!CollectiveStep::takes(DataType::F64, ReduceOp::Max));
        assert!(!CollectiveStep::takes(DataType::I16, ReduceOp::Sum));
        assert!(!CollectiveStep::takes(DataType::Bool, ReduceOp::Max));
        assert!(!CollectiveStep::takes(DataType::I64, ReduceOp::BitXor));
    }
}
