//! The local step of several ranks on one machine whose tensors are on GPUs,
//! through NCCL: the machine's reduce-scatter and all-gather run as the GPUs'
//! own collectives on the tensors, on the engine's streams, and only a rank's
//! own slot crosses to the host (where the fabric sends it from).
//!
//! Per slice, local rank `d` of `D`:
//!
//! 1. **begin**: announces `InputReady` at once (nothing is staged for the
//!    other ranks: NCCL reads the tensors);
//! 2. **reduce-scatter**: once every local rank has begun the slice, one
//!    in-place `ncclReduce` per rank's slot (or per piece of a
//!    reduce-scatter), rooted at that rank, grouped, so that slots of any
//!    length need no padding; then `d` copies its reduced slot from its
//!    tensor into its staging buffer on the same stream. In a job on one
//!    machine the result is final: a slice of an all-reduce is one in-place
//!    `ncclAllReduce` and nothing is gathered; a reduce-scatter's pieces stay
//!    in the tensor, at the rank's own share.
//! 3. the inter-machine step, then `SlotFinal`, as on host memory;
//! 4. **all-gather**: once every slot is final, `d` copies its final slot from
//!    staging into its tensor, then one in-place `ncclBroadcast` per slot,
//!    rooted at its rank, grouped; `Done` follows the fence.
//!
//! Per slice of `S` bytes that is `S/D` over PCIe each way and the machine's
//! reduction on the GPUs, against the host-staged step's `S` down and up and a
//! reduction of `S/D` on the host.
//!
//! # Order
//!
//! NCCL requires every rank of a communicator to issue its collectives in the
//! same order. The engine may reach slices' steps in different orders on
//! different ranks (a buffer's turn, a peer's landing), so the step keeps two
//! communicators, one for reduce-scatters and one for all-gathers, and issues
//! on each in slice order ([`IssueOrder`]): a step whose slice is not the
//! oldest waiting for that communicator returns `None` and is retried. Every
//! rank begins the same slices in the same order, so the orders agree. The
//! two communicators' kernels may run at once, as PyTorch's process groups'
//! do.
//!
//! # Semantics
//!
//! Sums, products, and integer minima and maxima go through NCCL: results are
//! the same on every rank, and, for floats, reduced in NCCL's order and
//! precision (16-bit types accumulate hop by hop in their own format, where
//! the host step accumulates in `f32`). Float minima and maxima take the
//! host-staged step, which keeps fairring's NaN and signed-zero rules.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use fairring_core::{DataType, ReduceOp};
use fairring_cuda::Device;
use fairring_cuda::nccl::{Communicator, UniqueId, group};

use super::LocalSlice;
use super::Waiting;
use super::issue_order::{GatherTurn, IssueOrder};
use super::shm::{ShmStep, for_each_run, slice_range, slot_range};
use super::staged::Announce;
use crate::config::DeviceLocal;
use crate::error::{Error, Result};
use crate::memory::{DeviceFence, DeviceSide, DeviceTensor, Placed, cuda_error};
use crate::store::Store;

/// A machine's NCCL communicators, as one local rank holds them, and the
/// order it issues on them.
pub(crate) struct NcclStep {
    /// Reduce-scatters (and a single machine's all-reduces), in slice order.
    reduce: Communicator,
    /// All-gathers, in slice order.
    gather: Communicator,
    order: Mutex<IssueOrder>,
}

/// Made at the first device operation: `Ok(None)` where the machine's
/// ranks stage through the host; `Err` (the reason) where NCCL was asked
/// for and could not be had.
pub(crate) type NcclCell = Arc<OnceLock<std::result::Result<Option<NcclStep>, String>>>;

impl NcclStep {
    /// Whether slice `s` goes through NCCL: every operator but a float
    /// minimum or maximum (see the module docs).
    pub(crate) fn takes(s: &LocalSlice<'_, Placed>) -> bool {
        !(s.dtype.is_float() && matches!(s.op, ReduceOp::Min | ReduceOp::Max))
    }

    fn lock(&self) -> MutexGuard<'_, IssueOrder> {
        self.order.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a slice waits for its turn on a communicator: nothing rings a
    /// doorbell when its turn comes, so the progress thread naps short.
    pub(crate) fn waiting(&self) -> bool {
        self.lock().waiting()
    }

    /// The engine failed: stops the communicators, so that kernels waiting
    /// for a rank that is gone end, and the copies behind them with them.
    pub(crate) fn abort(&self) {
        self.reduce.abort();
        self.gather.abort();
    }

    /// Step 1.
    pub(crate) fn begin(&self, shm: &ShmStep, s: &LocalSlice<'_, Placed>) -> Result<()> {
        self.lock().begun(s.number);
        shm.protocol
            .stage_in(&*shm.segment, s.buffer, s.number, || Ok(()))
    }

    /// Step 2; `None` while another rank has not begun the slice or an
    /// older slice has yet to reduce. Returns the fence of the last work
    /// enqueued.
    pub(crate) fn try_reduce_scatter(
        &self,
        shm: &ShmStep,
        side: &DeviceSide,
        s: &LocalSlice<'_, Placed>,
        tensor: &DeviceTensor,
        final_world: Option<u32>,
    ) -> Result<Option<DeviceFence>> {
        let mut order = self.lock();
        if !order.reduce_turn(s.number) {
            return Ok(None);
        }
        let base = slice_range(s.slice)?.start;
        let op = nccl_op(s.op, final_world, shm.size)?;
        let mut fence = None;
        let ran = shm.protocol.try_reduce_scatter(
            &*shm.segment,
            s.buffer,
            s.number,
            || -> Result<()> {
                let stream = side.stream(s.buffer)?;
                if final_world.is_some() && s.pieces.is_none() {
                    let whole = slice_range(s.slice)?;
                    // SAFETY: the slice's bytes, which only this step
                    // touches until its fence passes.
                    let mut view = unsafe { side.tensor_bytes(tensor, whole)? };
                    self.reduce
                        .all_reduce_in_place(stream, &mut view, s.dtype, op)
                        .map_err(cuda_error)?;
                } else {
                    grouped(
                        &self.reduce,
                        shm.size,
                        |r, enqueue| {
                            for_each_run(s, r, |in_slice, _| enqueue(in_tensor(base, &in_slice), r))
                        },
                        |range, root| {
                            // SAFETY: a run of the slice, which only this step
                            // touches until its fence passes.
                            let mut view = unsafe { side.tensor_bytes(tensor, range)? };
                            self.reduce
                                .reduce_in_place(stream, &mut view, s.dtype, op, root)
                                .map_err(cuda_error)
                        },
                    )?;
                    if final_world.is_none() {
                        for_each_run(s, shm.rank(), |in_slice, staged| {
                            if in_slice.is_empty() {
                                return Ok(());
                            }
                            let staging = shm.own_bytes(s.buffer, staged)?;
                            // SAFETY: this rank's own page-locked staging
                            // bytes, which nothing touches until the fence
                            // passes (the engine waits for it).
                            unsafe {
                                side.copy_to_staging(
                                    s.buffer,
                                    staging,
                                    tensor,
                                    in_tensor(base, &in_slice),
                                )?
                            };
                            Ok(())
                        })?;
                    }
                }
                fence = Some(side.fence_on(s.buffer)?);
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
    pub(crate) fn try_all_gather(
        &self,
        shm: &ShmStep,
        side: &DeviceSide,
        waiting: &Waiting<DeviceFence>,
        s: &LocalSlice<'_, Placed>,
        tensor: &DeviceTensor,
        own_in_tensor: bool,
    ) -> Result<Option<Option<DeviceFence>>> {
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
                let stream = side.stream(s.buffer)?;
                let own = slot_range(s.slice, shm.rank())?;
                if !own_in_tensor && !own.is_empty() {
                    let staging = shm.own_bytes(s.buffer, own.clone())?;
                    // SAFETY: this rank's final slot, page-locked, which
                    // nothing writes before this rank's `Done`, after the
                    // fence.
                    unsafe {
                        side.copy_from_staging(s.buffer, staging, tensor, in_tensor(base, &own))?
                    };
                }
                grouped(
                    &self.gather,
                    shm.size,
                    |r, enqueue| enqueue(in_tensor(base, &slot_range(s.slice, r)?), r),
                    |range, root| {
                        // SAFETY: a slot of the slice, which only this step
                        // touches until its fence passes.
                        let mut view = unsafe { side.tensor_bytes(tensor, range)? };
                        self.gather
                            .broadcast_in_place(stream, &mut view, DataType::U8, root)
                            .map_err(cuda_error)
                    },
                )?;
                fence = Some(side.fence_on(s.buffer)?);
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

/// Enqueues, in one NCCL group on `comm`, `call(range, root)` for every
/// non-empty range `each(r, enqueue)` hands to `enqueue` for each rank `r`
/// of `ranks`.
fn grouped(
    comm: &Communicator,
    ranks: u32,
    each: impl Fn(u32, &mut dyn FnMut(Range<usize>, u32) -> Result<()>) -> Result<()>,
    call: impl Fn(Range<usize>, u32) -> Result<()>,
) -> Result<()> {
    let mut failed = None;
    let mut enqueue = |range: Range<usize>, root: u32| -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        call(range, root)
    };
    let grouped = group(&[comm], || {
        for r in 0..ranks {
            if let Err(e) = each(r, &mut enqueue) {
                failed = Some(e);
                break;
            }
        }
        Ok(())
    });
    if let Some(e) = failed {
        return Err(e);
    }
    grouped.map_err(cuda_error)
}

/// Bytes `within` of the slice, in the tensor.
fn in_tensor(base: usize, within: &Range<usize>) -> Range<usize> {
    base + within.start..base + within.end
}

/// The operator NCCL applies: the slice's, but an average that is not final
/// reduces as a sum (the division comes once the machines' sums are in); a
/// final one divides by the machine's ranks, which must be the world.
fn nccl_op(op: ReduceOp, final_world: Option<u32>, ranks: u32) -> Result<ReduceOp> {
    match (op, final_world) {
        (ReduceOp::Avg, None) => Ok(ReduceOp::Sum),
        (ReduceOp::Avg, Some(world)) if world != ranks => Err(Error::internal(
            "a final result on one machine averages over its ranks, the world",
            format!("{ranks} local ranks in a world of {world}"),
        )),
        (op, _) => Ok(op),
    }
}

/// What making a machine's NCCL communicators needs, held by the
/// communicator until its first device operation.
pub(crate) struct NcclSetup {
    pub(crate) cell: NcclCell,
    pub(crate) choice: DeviceLocal,
    pub(crate) machine: u32,
    pub(crate) local_rank: u32,
    pub(crate) local_ranks: u32,
    pub(crate) timeout: Duration,
    /// Serialises the making.
    pub(crate) making: Mutex<()>,
}

impl NcclSetup {
    /// Makes the machine's communicators on `device` once (every local rank
    /// at its first device operation), or settles on the host-staged step:
    /// - `host`, or one rank per machine: nothing to make;
    /// - `nccl`: every rank makes them, and an error names the rank that
    ///   could not and why;
    /// - `auto`: as `nccl`, but where a rank could not, every rank settles
    ///   on the host (each says how it fared through the store, so they
    ///   agree).
    ///
    /// An error is kept: later device operations get it again.
    pub(crate) fn connect(&self, device: &Arc<Device>, store: &dyn Store) -> Result<()> {
        let outcome = match self.cell.get() {
            Some(outcome) => outcome,
            None => {
                let _making = self.making.lock().unwrap_or_else(PoisonError::into_inner);
                match self.cell.get() {
                    Some(outcome) => outcome,
                    None => {
                        let made = self.make(device, store).map_err(|e| e.to_string());
                        self.cell.get_or_init(|| made)
                    }
                }
            }
        };
        match outcome {
            Ok(_) => Ok(()),
            Err(reason) => Err(Error::Gpu(reason.clone())),
        }
    }

    fn make(&self, device: &Arc<Device>, store: &dyn Store) -> Result<Option<NcclStep>> {
        if self.local_ranks == 1 || self.choice == DeviceLocal::Host {
            return Ok(None);
        }
        let key = |what: &str| format!("nccl/{}/{what}", self.machine);
        let ids = if self.local_rank == 0 {
            let made = UniqueId::new().and_then(|a| Ok((a, UniqueId::new()?)));
            let value = match &made {
                Ok((a, b)) => [&a.as_bytes()[..], &b.as_bytes()[..]].concat(),
                Err(e) => format!("!{e}").into_bytes(),
            };
            store.set(&key("ids"), &value)?;
            made.map_err(|e| e.to_string())
        } else {
            let value = store.get(&key("ids"), self.timeout)?;
            ids_from(&value)
        };
        let joined = ids.and_then(|(a, b)| {
            let make = |id| {
                Communicator::new(device, self.local_rank, self.local_ranks, &id, self.timeout)
                    .map_err(|e| e.to_string())
            };
            Ok((make(a)?, make(b)?))
        });
        let said = match &joined {
            Ok(_) => b"ok".to_vec(),
            Err(e) => format!("!{e}").into_bytes(),
        };
        store.set(&key(&format!("joined/{}", self.local_rank)), &said)?;
        let keys: Vec<String> = (0..self.local_ranks)
            .map(|r| key(&format!("joined/{r}")))
            .collect();
        let outcomes = crate::store::gather(store, &keys, self.timeout)?;
        let refusal = outcomes.iter().enumerate().find_map(|(r, said)| {
            said.strip_prefix(b"!")
                .map(|why| (r, String::from_utf8_lossy(why).into_owned()))
        });
        match (refusal, joined) {
            (None, Ok((reduce, gathers))) => Ok(Some(NcclStep {
                reduce,
                gather: gathers,
                order: Mutex::new(IssueOrder::with_capacity(ORDER_CAPACITY)),
            })),
            (refusal, joined) => {
                if let Ok((reduce, gathers)) = &joined {
                    // Another rank could not: these never run a collective.
                    reduce.abort();
                    gathers.abort();
                }
                let (r, why) = refusal
                    .unwrap_or_else(|| (self.local_rank as usize, "no reason given".to_owned()));
                let reason = format!(
                    "local rank {r} of machine {} could not make its NCCL communicators: {why}",
                    self.machine
                );
                if self.choice == DeviceLocal::Nccl {
                    return Err(Error::Gpu(format!(
                        "FAIRRING_DEVICE_LOCAL=nccl: {reason} (set FAIRRING_DEVICE_LOCAL=host \
                         to stage through the host instead)"
                    )));
                }
                log::warn!("fairring: {reason}; the machine's ranks stage through the host");
                Ok(None)
            }
        }
    }
}

/// Slices a communicator's order holds at most without growing: more than
/// the staging buffers any job has.
const ORDER_CAPACITY: usize = 64;

/// The two ids local rank 0 published, or its reason for publishing none.
fn ids_from(value: &[u8]) -> std::result::Result<(UniqueId, UniqueId), String> {
    if let Some(why) = value.strip_prefix(b"!") {
        return Err(format!(
            "local rank 0 could not make NCCL ids: {}",
            String::from_utf8_lossy(why)
        ));
    }
    if value.len() != 2 * UniqueId::BYTES {
        return Err(format!(
            "local rank 0 published {} bytes of NCCL ids, not {}",
            value.len(),
            2 * UniqueId::BYTES
        ));
    }
    let (a, b) = value.split_at(UniqueId::BYTES);
    let id = |bytes| UniqueId::from_bytes(bytes).map_err(|e| e.to_string());
    Ok((id(a)?, id(b)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_average_reduces_as_a_sum_until_it_is_final() {
        assert_eq!(nccl_op(ReduceOp::Avg, None, 2).unwrap(), ReduceOp::Sum);
        assert_eq!(nccl_op(ReduceOp::Avg, Some(2), 2).unwrap(), ReduceOp::Avg);
        assert_eq!(nccl_op(ReduceOp::Max, None, 2).unwrap(), ReduceOp::Max);
        let e = nccl_op(ReduceOp::Avg, Some(4), 2).unwrap_err().to_string();
        assert!(e.contains("2 local ranks in a world of 4"), "{e}");
    }

    #[test]
    fn ids_arrive_whole_or_with_local_rank_0s_reason() {
        let bytes: Vec<u8> = (0..=255).collect();
        let (a, b) = ids_from(&bytes).unwrap();
        assert_eq!(a.as_bytes(), &bytes[..128]);
        assert_eq!(b.as_bytes(), &bytes[128..]);
        let e = ids_from(b"!NCCL is not loaded").unwrap_err();
        assert!(
            e.contains("local rank 0") && e.contains("NCCL is not loaded"),
            "{e}"
        );
        let e = ids_from(&bytes[..130]).unwrap_err();
        assert!(e.contains("130 bytes"), "{e}");
    }
}
