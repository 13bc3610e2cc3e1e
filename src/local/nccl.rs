//! NCCL's communicators among a machine's GPUs, for the local step of
//! several ranks per machine through the GPUs' own collectives
//! (`super::collectives`): how the machine's ranks make them (or settle on
//! the host-staged step), and how a device program's collectives are
//! enqueued on them.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use fairring_core::{DataType, ReduceOp};
use fairring_cuda::nccl::{Communicator, UniqueId, group};
use fairring_cuda::{Device, DeviceBuffer, Stream};

use crate::config::DeviceLocal;
use crate::error::{Error, Result};
use crate::memory::program::{Comm, MachineCall, ProgramItem};
use crate::memory::{DeviceSide, DeviceTensor, PlacedTensor, cuda_error};
use crate::store::Store;

/// A rank's two communicators of its machine: reduce-scatters, and
/// all-gathers, each issued in slice order.
pub(crate) struct NcclComms {
    reduce: Communicator,
    gather: Communicator,
}

impl NcclComms {
    /// The engine failed: stops the communicators, so that kernels waiting
    /// for a rank that is gone end, and the copies behind them with them.
    pub(crate) fn abort(&self) {
        self.reduce.abort();
        self.gather.abort();
    }

    fn of(&self, comm: Comm) -> &Communicator {
        match comm {
            Comm::Reduce => &self.reduce,
            Comm::Gather => &self.gather,
        }
    }
}

/// Made at the first device operation: `Ok(None)` where the machine's
/// ranks stage through the host; `Err` (the reason) where NCCL was asked
/// for and could not be had.
pub(crate) type NcclCell = Arc<OnceLock<std::result::Result<Option<NcclComms>, String>>>;

impl NcclComms {
    /// Enqueues `calls` (a stage's run of [`ProgramItem::Collective`]s, on
    /// one communicator) on `stream` as one group, in place on bytes of
    /// `tensor`. On the caller's thread, as the call is accepted: every rank
    /// accepts the same operations in the same order, so every rank's
    /// communicator receives its calls in one order.
    pub(crate) fn enqueue_group(
        &self,
        side: &DeviceSide,
        stream: &Stream,
        tensor: &DeviceTensor,
        calls: &[ProgramItem<PlacedTensor>],
    ) -> Result<()> {
        let Some(ProgramItem::Collective { comm, .. }) = calls.first() else {
            return Ok(());
        };
        let communicator = self.of(*comm);
        let mut failed = None;
        let grouped = group(&[communicator], || {
            for item in calls {
                let ProgramItem::Collective {
                    comm: c,
                    call,
                    tensor: range,
                } = item
                else {
                    continue;
                };
                if c != comm {
                    failed = Some(Error::internal(
                        "a stage's collectives go to one communicator",
                        format!("{c:?} among {comm:?}'s"),
                    ));
                    break;
                }
                // SAFETY: a program's collective, enqueued behind its stage's
                // gate, on bytes of the slice in the operation's tensor.
                let view = unsafe { side.tensor_bytes(tensor, range.clone()) };
                let enqueued = view.and_then(|mut view| {
                    match *call {
                        MachineCall::AllReduce { dtype, op } => {
                            communicator.all_reduce_in_place(stream, &mut view, dtype, op)
                        }
                        MachineCall::Reduce { dtype, op, root } => {
                            communicator.reduce_in_place(stream, &mut view, dtype, op, root)
                        }
                        MachineCall::Broadcast { root } => {
                            communicator.broadcast_in_place(stream, &mut view, DataType::U8, root)
                        }
                    }
                    .map_err(cuda_error)
                });
                if let Err(e) = enqueued {
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

    fn make(&self, device: &Arc<Device>, store: &dyn Store) -> Result<Option<NcclComms>> {
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
            (None, Ok((reduce, gather))) => {
                let comms = NcclComms { reduce, gather };
                // Every local rank agreed, so every one runs the warm-up
                // (which aborts the communicators if it fails).
                warm_up(&comms, device, self.timeout).map_err(|e| {
                    Error::Gpu(format!(
                        "warming up the NCCL communicators of machine {} (local rank {}): {e}",
                        self.machine, self.local_rank
                    ))
                })?;
                Ok(Some(comms))
            }
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

/// The sizes, in bytes, at which [`warm_up`] runs each collective: NCCL's
/// tuner gives each of its protocols (LL, LL128, Simple) and algorithms its
/// own range of sizes, and connects what a collective uses at its first use.
const WARM_UP_SIZES: [usize; 3] = [1 << 10, 256 << 10, 8 << 20];

/// Runs each collective the local step issues (all-reduce, reduce,
/// broadcast) once at each of [`WARM_UP_SIZES`] and waits for them, up to
/// `timeout`.
///
/// At its first use NCCL makes the collective's connections, allocating
/// device memory (which waits for the whole device to drain), loads its
/// kernels and may grow the context's stack. Done here, at the
/// communicator's first device operation, before any stream has been made to
/// wait for its operations, none of this can happen while a caller's stream
/// waits for the engine ([`Work::enqueue_wait`](crate::Work::enqueue_wait)),
/// where it would deadlock the process: the device cannot drain before the
/// engine's NCCL call returns.
fn warm_up(comms: &NcclComms, device: &Arc<Device>, timeout: Duration) -> Result<()> {
    let stream = Stream::new(device, false).map_err(cuda_error)?;
    let mut buffer = DeviceBuffer::zeroed(device, WARM_UP_SIZES[2]).map_err(cuda_error)?;
    let ran = run_warm_up(comms, &stream, &mut buffer, timeout);
    if ran.is_err() {
        // NCCL's kernels end before the buffer they use is freed (freeing
        // device memory waits for them).
        comms.abort();
    }
    ran
}

/// [`warm_up`]'s collectives on `buffer`, enqueued on `stream` and waited for.
fn run_warm_up(
    comms: &NcclComms,
    stream: &Stream,
    buffer: &mut DeviceBuffer,
    timeout: Duration,
) -> Result<()> {
    let mut whole = buffer.slice_mut();
    for bytes in WARM_UP_SIZES {
        let mut view = whole.range(0..bytes).map_err(cuda_error)?;
        let (f32, sum) = (DataType::F32, ReduceOp::Sum);
        comms
            .reduce
            .all_reduce_in_place(stream, &mut view, f32, sum)
            .map_err(cuda_error)?;
        comms
            .reduce
            .reduce_in_place(stream, &mut view, f32, sum, 0)
            .map_err(cuda_error)?;
        comms
            .gather
            .broadcast_in_place(stream, &mut view, DataType::U8, 0)
            .map_err(cuda_error)?;
    }
    // Polled, so that a local rank that never joins the kernels (gone, or
    // failed before its warm-up) is a timeout, not a hang.
    let started = std::time::Instant::now();
    while !stream.is_idle().map_err(cuda_error)? {
        comms.reduce.check().map_err(cuda_error)?;
        comms.gather.check().map_err(cuda_error)?;
        if started.elapsed() >= timeout {
            return Err(Error::timeout("NCCL's warm-up collectives", timeout));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

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
