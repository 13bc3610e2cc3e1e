//! The local step of several ranks on one machine whose tensors are on GPUs,
//! through the GPUs' own collectives (NCCL's; the simulated GPU's in the
//! simulation): the machine's reduce-scatter and all-gather run on the
//! tensors, on the engine's streams, and only a rank's own slot crosses to
//! the host (where the fabric sends it from).
//!
//! Per slice, local rank `d` of `D`:
//!
//! 1. **begin**: announces `InputReady` at once (nothing is staged for the
//!    other ranks: the collectives read the tensors);
//! 2. **reduce-scatter**: one in-place reduce-scatter of the slice where its
//!    slots are equal, it holds at least [`ONE_REDUCE_SCATTER_FROM_BYTES`] and
//!    it is not its tensor's first ([`reduces_in_one_call`]); else one
//!    in-place reduce per rank's slot (or
//!    per piece of a reduce-scatter), rooted at that rank, grouped, so that
//!    slots of any length need no padding; then `d`'s copy of its reduced slot from
//!    its tensor into its staging buffer on the same stream. In a job on one
//!    machine the result is final: a slice of an all-reduce is one in-place
//!    all-reduce and nothing is gathered; a reduce-scatter's pieces stay in
//!    the tensor, at the rank's own share;
//! 3. the inter-machine step, then `SlotFinal`, as on host memory;
//! 4. **all-gather**: once every slot is final, `d`'s copy of its final slot
//!    from staging into its tensor, then one in-place broadcast per slot,
//!    rooted at its rank, grouped; `Done` follows the stage's end.
//!
//! Per slice of `S` bytes that is `S/D` over PCIe each way and the machine's
//! reduction on the GPUs, against the host-staged step's `S` down and up and a
//! reduction of `S/D` on the host.
//!
//! # Order
//!
//! NCCL requires every rank of a communicator to issue its collectives in the
//! same order. Steps 2 and 4 are stages of the slices' device programs
//! ([`ProgramItem`]), enqueued when their calls are accepted: every rank
//! accepts the same operations in the same order, so each of a rank's two
//! communicators ([`Comm`]: reduce-scatters, all-gathers) receives its
//! collectives in slice order on every rank. The engine may open the stages
//! in another order (a buffer's turn, a peer's landing); NCCL runs a
//! communicator's kernels in the order they were enqueued whatever stream
//! they are on, so a kernel whose gate opened early waits for the one
//! before it. The two communicators' kernels may run at once, as PyTorch's
//! process groups' do.
//!
//! # Semantics
//!
//! Sums, products, and integer minima and maxima go through the collectives:
//! results are the same on every rank, and, for floats, reduced in NCCL's
//! order and precision (16-bit types accumulate hop by hop in their own
//! format, where the host step accumulates in `f32`). Float minima and maxima
//! take the host-staged step, which keeps fairring's NaN and signed-zero
//! rules ([`takes`]), as do the types and operators NCCL lacks (`i16`,
//! `bool`, the bitwise operators).

use std::ops::Range;

use fairring_core::plan::Slice;
use fairring_core::{DataType, ReduceOp};

use super::shm_step::{ShmStep, for_each_run, slice_range, slot_range};
use super::staged::Announce;
use super::{LocalSlice, LocalStage, Waiting};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::memory::program::{Comm, MachineCall, ProgramItem, StagingAt};

/// Whether slices of `dtype` reduced with `op` go through the collectives:
/// every type and operator NCCL has, but a float minimum or maximum (see
/// the module docs). NCCL has no `i16`, no `bool` and no bitwise operators:
/// those take the host-staged step too.
pub(crate) fn takes(dtype: DataType, op: ReduceOp) -> bool {
    let nccl_has = !matches!(dtype, DataType::I16 | DataType::Bool) && !op.is_bitwise();
    nccl_has && !(dtype.is_float() && matches!(op, ReduceOp::Min | ReduceOp::Max))
}

/// The smallest slice of equal slots that a machine's GPUs reduce-scatter
/// with one in-place `ncclReduceScatter` of `D` equal chunks, not one
/// `ncclReduce` per slot, grouped: 20 MiB ([`reduces_in_one_call`]).
///
/// NCCL's tuner times the reduce-scatter's bytes at `D / (D - 1)` of the
/// ring's bus rate and the group of reduces' at the bus rate (`nsteps`
/// `D - 1` against `D`), so the one call holds NVLink for less; it puts the
/// reduce-scatter's latency at `D - 1` hops and the reduces' at one. The
/// scale model (`docs/scale-model.md`), which times the engine's calls with
/// that tuner, finds the single call ahead where NVLink's bytes bound the
/// pipeline and the call's latency passes while earlier slices' bytes hold
/// NVLink: in the default 25 MiB slices of large tensors (up to 7% more busbw
/// at 256 MiB and 1 GiB from 16 to 400 H100s; in the 32 MiB slices of 488 to
/// 512, 3% more at 1 GiB and 1.5% less at 256 MiB), and behind in slices of
/// 16 MiB and less (a 64 MiB tensor's four).
pub const ONE_REDUCE_SCATTER_FROM_BYTES: u64 = 20 << 20;

/// Whether a machine's GPUs reduce-scatter `slice` (of an operation that
/// reduces by the slice's slots) with one call: it is not its tensor's
/// first slice (which starts the tensor's pipeline: no earlier slice's bytes
/// hide the one call's longer latency), its slots are equal
/// ([`Slice::slots_equal`]: the slice is `D` equal chunks, slot `d` the
/// `d`th) and it holds at least `from_bytes`
/// ([`ONE_REDUCE_SCATTER_FROM_BYTES`] but in the simulation, which draws it
/// per seed). Else one reduce per slot, grouped.
pub fn reduces_in_one_call(slice: &Slice, from_bytes: u64) -> bool {
    slice.index() > 0 && slice.slots_equal() && slice.span().byte_len() >= from_bytes
}

/// Calls `each` with the device items of `stage` of slice `s` (see the
/// module docs); a slice of at least `one_call_from` bytes reduce-scatters
/// in one call where it may ([`reduces_in_one_call`]).
pub(crate) fn items<M: MemorySpace>(
    shm: &ShmStep,
    s: &LocalSlice<'_, M>,
    stage: LocalStage,
    one_call_from: u64,
    each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
) -> Result<()> {
    let base = slice_range(s.slice)?.start;
    let own = |buffer, offset| StagingAt {
        rank: shm.rank(),
        buffer,
        offset,
    };
    match stage {
        LocalStage::Begin => Ok(()),
        LocalStage::ReduceScatter { final_world } => {
            // A final result over more ranks than the machine's is the job's
            // all-reduce, on the job's communicator.
            let across_job = final_world.is_some_and(|world| world > shm.size);
            let members = final_world.filter(|_| across_job).unwrap_or(shm.size);
            let op = reduced_as(s.op, final_world, members)?;
            if final_world.is_some() && s.pieces.is_none() {
                return each(ProgramItem::Collective {
                    comm: if across_job { Comm::Job } else { Comm::Reduce },
                    call: MachineCall::AllReduce { dtype: s.dtype, op },
                    tensor: slice_range(s.slice)?,
                });
            }
            if across_job {
                return Err(Error::internal(
                    "the job's all-reduce is one call on the whole slice",
                    format!("slice {} in pieces", s.number),
                ));
            }
            if s.pieces.is_none() && shm.size > 1 && reduces_in_one_call(s.slice, one_call_from) {
                each(ProgramItem::Collective {
                    comm: Comm::Reduce,
                    call: MachineCall::ReduceScatter { dtype: s.dtype, op },
                    tensor: slice_range(s.slice)?,
                })?;
            } else {
                reduce_each_slot(shm, s, op, base, each)?;
            }
            if final_world.is_none() {
                for_each_run(s, shm.rank(), |in_slice, staged| {
                    if in_slice.is_empty() {
                        return Ok(());
                    }
                    each(ProgramItem::ToStaging {
                        tensor: in_tensor(base, &in_slice),
                        to: own(s.buffer, staged.start),
                    })
                })?;
            }
            Ok(())
        }
        LocalStage::AllGather {
            final_world,
            own_in_tensor,
        } => {
            if s.pieces.is_some() {
                return Err(Error::internal(
                    "a reduce-scatter's pieces are never gathered",
                    format!("slice {}", s.number),
                ));
            }
            if final_world.is_some() {
                // A single machine's all-reduce left the whole slice in the
                // tensor.
                return Ok(());
            }
            let mine = slot_range(s.slice, shm.rank())?;
            if !own_in_tensor && !mine.is_empty() {
                each(ProgramItem::FromStaging {
                    from: own(s.buffer, mine.start),
                    tensor: in_tensor(base, &mine),
                })?;
            }
            for r in 0..shm.size {
                let range = in_tensor(base, &slot_range(s.slice, r)?);
                if !range.is_empty() {
                    each(ProgramItem::Collective {
                        comm: Comm::Gather,
                        call: MachineCall::Broadcast { root: r },
                        tensor: range,
                    })?;
                }
            }
            Ok(())
        }
    }
}

/// One in-place reduce per run of each rank's slot (or pieces), rooted at
/// that rank: the group that serves slots of any length.
fn reduce_each_slot<M: MemorySpace>(
    shm: &ShmStep,
    s: &LocalSlice<'_, M>,
    op: ReduceOp,
    base: usize,
    each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
) -> Result<()> {
    for r in 0..shm.size {
        for_each_run(s, r, |in_slice, _| {
            if in_slice.is_empty() {
                return Ok(());
            }
            each(ProgramItem::Collective {
                comm: Comm::Reduce,
                call: MachineCall::Reduce {
                    dtype: s.dtype,
                    op,
                    root: r,
                },
                tensor: in_tensor(base, &in_slice),
            })
        })?;
    }
    Ok(())
}

impl ShmStep {
    /// Step 1 of the collectives' path.
    pub(crate) fn begin_collective<M: MemorySpace>(&self, s: &LocalSlice<'_, M>) -> Result<()> {
        self.protocol
            .stage_in(&*self.segment, s.buffer, s.number, || Ok(()))
    }

    /// Step 2: once every rank has begun the slice, `raise` opens its
    /// reduce-scatter stage; returns the stage's end. `None` while a rank
    /// has not begun it.
    pub(crate) fn try_reduce_scatter_collective<M: MemorySpace, F>(
        &self,
        s: &LocalSlice<'_, M>,
        raise: impl FnOnce() -> Result<Option<F>>,
    ) -> Result<Option<Option<F>>> {
        let mut fence = None;
        let ran = self.protocol.try_reduce_scatter(
            &*self.segment,
            s.buffer,
            s.number,
            || -> Result<()> {
                fence = raise()?;
                Ok(())
            },
        )?;
        Ok(ran.then_some(fence))
    }

    /// Step 4: once every slot is final, `raise` opens the slice's
    /// all-gather stage, whose end the engine waits for before `Done` is
    /// announced ([`ShmStep::gathered`]); a slice with none (a single
    /// machine's all-reduce) is done at once. `None` while a slot is not
    /// final.
    pub(crate) fn try_all_gather_collective<M: MemorySpace, F>(
        &self,
        s: &LocalSlice<'_, M>,
        waiting: &Waiting<F>,
        raise: impl FnOnce() -> Result<Option<F>>,
    ) -> Result<Option<Option<F>>> {
        let mut fence = None;
        let ran = self.protocol.try_all_gather_started(
            &*self.segment,
            s.buffer,
            s.number,
            || -> Result<()> {
                fence = raise()?;
                Ok(())
            },
        )?;
        if !ran {
            return Ok(None);
        }
        let held = fence.as_ref().map(|_| None);
        self.announce_after(waiting, s.buffer, s.number, Announce::Done, held)?;
        Ok(Some(fence))
    }
}

/// Bytes `within` of the slice, in the tensor.
fn in_tensor(base: usize, within: &Range<usize>) -> Range<usize> {
    base + within.start..base + within.end
}

/// The operator the collectives apply: the slice's, but an average that is
/// not final reduces as a sum (the division comes once the machines' sums
/// are in); a final one divides by the collective's ranks (`ranks`: the
/// machine's, or the job's on its communicator), which must be the world.
fn reduced_as(op: ReduceOp, final_world: Option<u32>, ranks: u32) -> Result<ReduceOp> {
    match (op, final_world) {
        (ReduceOp::Avg, None) => Ok(ReduceOp::Sum),
        (ReduceOp::Avg, Some(world)) if world != ranks => Err(Error::internal(
            "a final result averages over its collective's ranks, the world",
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

    /// The slices of an all-reduce of `bytes` of `f32` on `m` machines of
    /// `d` GPUs in slices of at most `slice_bytes`.
    fn slices(m: u32, d: u32, slice_bytes: u64, bytes: u64) -> Vec<Slice> {
        use fairring_core::plan::{Geometry, Plan, PlanConfig};
        use fairring_core::topology::{RankLayout, Topology};
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let config = PlanConfig::new(slice_bytes, PlanConfig::DEFAULT_MIN_SHARD_BYTES).unwrap();
        let geometry = Geometry::new(topology, config).unwrap();
        let plan = Plan::new(&geometry, DataType::F32, bytes / 4, 0).unwrap();
        plan.slices().collect()
    }

    #[test]
    fn large_slices_of_equal_slots_reduce_scatter_in_one_call() {
        let from = ONE_REDUCE_SCATTER_FROM_BYTES;
        // 85 MiB in 25 MiB slices on 2x8: three full slices of eight equal
        // slots, and a 10 MiB tail, below the size. The first starts the
        // tensor's pipeline, slot by slot.
        let s = slices(2, 8, 25 << 20, 85 << 20);
        let one_call: Vec<bool> = s.iter().map(|s| reduces_in_one_call(s, from)).collect();
        assert_eq!(one_call, [false, true, true, false]);
        assert!(s[..3].iter().all(|s| s.span().byte_len() == 25 << 20));
        assert!(s[0].slots_equal());
        // The tail reduce-scatters in one call where the size allows it.
        assert!(reduces_in_one_call(&s[3], 10 << 20));
        // 16 MiB slices (a 64 MiB tensor's four) reduce slot by slot.
        let s = slices(2, 8, 16 << 20, 64 << 20);
        assert!(s.iter().all(|s| !reduces_in_one_call(s, from)));
        assert!(s[1..].iter().all(|s| reduces_in_one_call(s, 16 << 20)));
    }

    #[test]
    fn unequal_slots_reduce_slot_by_slot_at_any_size() {
        // 3 GPUs: after a full slice of 999 64-byte units, a slice of 100,
        // which three does not divide. (Second slices: a tensor's first
        // reduces slot by slot anyway.)
        let s = slices(2, 3, 64 * 999, 64 * 1099);
        assert_eq!(s[1].span().byte_len(), 64 * 100);
        let lens: Vec<u64> = (0..3).map(|d| s[1].slot(d).unwrap().byte_len()).collect();
        assert_ne!(lens[0], lens[2], "{lens:?}");
        assert!(!reduces_in_one_call(&s[1], 0));
        // A tail of less than a unit: the last slot holds it.
        let s = slices(2, 2, 128, 128 + 128 + 4);
        assert_eq!(s[2].span().byte_len(), 4);
        assert!(reduces_in_one_call(&s[1], 0));
        assert!(!reduces_in_one_call(&s[2], 0));
    }

    #[test]
    fn float_minima_and_maxima_and_what_nccl_lacks_stay_on_the_host() {
        assert!(takes(DataType::F32, ReduceOp::Sum));
        assert!(takes(DataType::I32, ReduceOp::Max));
        assert!(!takes(DataType::BF16, ReduceOp::Min));
        assert!(!takes(DataType::F64, ReduceOp::Max));
        assert!(!takes(DataType::I16, ReduceOp::Sum));
        assert!(!takes(DataType::Bool, ReduceOp::Max));
        assert!(!takes(DataType::I64, ReduceOp::BitXor));
    }
}
