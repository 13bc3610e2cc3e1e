//! NCCL's communicators among a machine's GPUs, for the local step of
//! several ranks per machine through the GPUs' own collectives
//! (`super::collectives`): how the machine's ranks make them (or settle on
//! the host-staged step), and how a device program's collectives are
//! enqueued on them.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use fairring_core::{DataType, ReduceOp};
use fairring_cuda::nccl::{Communicator, UniqueId, group};
use fairring_cuda::{Device, DeviceBuffer, DeviceSliceMut, Stream};

use crate::config::{DeviceLocal, NcclAcrossMachines};
use crate::error::{Error, Result};
use crate::memory::program::{Comm, MachineCall, ProgramItem};
use crate::memory::{DeviceSide, DeviceTensor, PlacedTensor, cuda_error};
use crate::store::Store;

/// A rank's two communicators of its machine: reduce-scatters, and
/// all-gathers, each issued in slice order; and, where the job's device
/// all-reduces may run as one NCCL all-reduce across the job, the job's.
pub(crate) struct NcclComms {
    reduce: Communicator,
    gather: Communicator,
    job: Option<Communicator>,
    /// Whether every rank of the job found its GPU reducing in its
    /// NVSwitch, its machine's communicators made (agreed where the job has
    /// dedicated servers, else false).
    gpus_in_switch: bool,
}

impl NcclComms {
    /// The engine failed: stops the communicators, so that kernels waiting
    /// for a rank that is gone end, and the copies behind them with them.
    /// All at once: a buffer's stream carries every communicator's kernels,
    /// so any one's abort can wait for a kernel of another. An abort waits
    /// for a group being enqueued on the caller's thread to end.
    pub(crate) fn abort(&self) {
        match &self.job {
            Some(job) => {
                Communicator::abort_all(&[&self.reduce, &self.gather, job]);
            }
            None => {
                Communicator::abort_all(&[&self.reduce, &self.gather]);
            }
        }
    }

    /// Whether the job's communicator was made (alike on every rank).
    pub(crate) fn across_job(&self) -> bool {
        self.job.is_some()
    }

    /// Whether every rank of the job has its GPU reduce in its NVSwitch and
    /// its machine's communicators made (alike on every rank; agreed only
    /// beside dedicated servers, read under `FAIRRING_MACHINES_SERVE=auto`).
    pub(crate) fn gpus_in_switch(&self) -> bool {
        self.gpus_in_switch
    }

    fn of(&self, comm: Comm) -> Result<&Communicator> {
        match comm {
            Comm::Reduce => Ok(&self.reduce),
            Comm::Gather => Ok(&self.gather),
            Comm::Job => self.job.as_ref().ok_or_else(|| {
                Error::internal(
                    "the job's all-reduce is chosen only where the job's communicator was made",
                    "a program item on the job's communicator",
                )
            }),
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
        let communicator = self.of(*comm)?;
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
                        MachineCall::ReduceScatter { dtype, op } => {
                            communicator.reduce_scatter_in_place(stream, &mut view, dtype, op)
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
    /// This rank and the job's ranks, for the job's communicator.
    pub(crate) rank: u32,
    pub(crate) world: u32,
    /// Whether to make the job's communicator: `Off` where the job's
    /// machines are too few or too many for it (`engine/choice.rs`) or have
    /// one rank each (on one machine beside dedicated servers the machine's
    /// communicators take the workers' all-reduces instead); dedicated
    /// servers on several machines do not change it (the same on every
    /// rank).
    pub(crate) across_job: NcclAcrossMachines,
    /// Whether the job's ranks agree on whether every GPU reduces in its
    /// NVSwitch ([`NcclComms::gpus_in_switch`]): a job with dedicated
    /// servers, whose machines may serve beside them under
    /// `FAIRRING_MACHINES_SERVE=auto` (every worker agrees whatever it is
    /// set to, so that one set otherwise is not left waiting).
    pub(crate) agree_on_switches: bool,
    pub(crate) timeout: Duration,
    /// Serialises the making.
    pub(crate) making: Mutex<()>,
}

impl NcclSetup {
    /// Makes the machine's communicators on `device` once (every local rank
    /// when the communicator is made with a device, or at its first device
    /// operation), or settles on the host-staged step:
    /// - `host`, or one rank per machine: nothing to make;
    /// - `nccl`: every rank makes them, and an error names the rank that
    ///   could not and why;
    /// - `auto`: as `nccl`, but where a rank could not, or two local ranks
    ///   share one GPU, every rank settles on the host.
    ///
    /// The ranks agree at each round through the store (see [`agree`]), so
    /// within the timeout every local rank takes the same path, or every one
    /// fails naming the rank and the cause. An error is kept: later device
    /// operations get it again.
    ///
    /// [`agree`]: NcclSetup::agree
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

    /// The machine's communicators; then, beside dedicated servers, the
    /// job's ranks agree on whether
    /// every GPU reduces in its NVSwitch; then, where the job's all-reduces
    /// may run through NCCL, the job's (see [`NcclSetup::join_job`]).
    fn make(&self, device: &Arc<Device>, store: &dyn Store) -> Result<Option<NcclComms>> {
        let mut machine = self.make_machine(device, store);
        if self.agree_on_switches {
            // Every rank of the job says, even one that failed.
            let in_switch = match &machine {
                Ok(Some(_)) if device.supports_multicast() => Ok(Vec::new()),
                Ok(Some(_)) => Err("its GPU does not reduce in an NVSwitch (no multicast)".into()),
                Ok(None) => Err("its machine stages device tensors through the host".to_owned()),
                Err(e) => Err(e.to_string()),
            };
            let agreed = self.agree_job(store, "switch", in_switch)?;
            match (&agreed, &mut machine) {
                (Ok(_), Ok(Some(comms))) => comms.gpus_in_switch = true,
                (Err((r, why)), _) => log::info!(
                    "fairring: rank {r} does not reduce in an NVSwitch ({why}): the dedicated \
                     servers take every all-reduce they would"
                ),
                _ => {}
            }
        }
        if self.across_job == NcclAcrossMachines::Off {
            return machine;
        }
        // Every rank of the job says whether it can, even one that failed:
        // the others stop waiting for it then.
        let ready = match &machine {
            Ok(Some(_))
                if self.across_job == NcclAcrossMachines::Auto && !device.supports_multicast() =>
            {
                Err("its GPU does not reduce in an NVSwitch (no multicast)".to_owned())
            }
            Ok(Some(_)) => Ok(Vec::new()),
            Ok(None) => Err("its machine stages device tensors through the host".to_owned()),
            Err(e) => Err(e.to_string()),
        };
        let ready = self.agree_job(store, "ready", ready)?;
        let Some(mut comms) = machine? else {
            return Ok(None);
        };
        if let Err((r, why)) = ready {
            log::info!(
                "fairring: rank {r} cannot join an NCCL communicator of the whole job ({why}): \
                 every device all-reduce takes the plan"
            );
            return Ok(Some(comms));
        }
        comms.job = self.join_job(device, store)?;
        Ok(Some(comms))
    }

    /// Makes the job's communicator over every rank, from the id rank 0
    /// publishes, and warms it up; the ranks agree at each round. Where a
    /// rank could not, every rank goes on without it (`None`): the plan
    /// serves every device all-reduce.
    fn join_job(&self, device: &Arc<Device>, store: &dyn Store) -> Result<Option<Communicator>> {
        let key = "nccl/job/id";
        let id = if self.rank == 0 {
            let made = UniqueId::new();
            let value = match &made {
                Ok(id) => id.as_bytes().to_vec(),
                Err(e) => format!("!{e}").into_bytes(),
            };
            store.set(key, &value)?;
            made.map_err(|e| e.to_string())
        } else {
            let value = store.get(key, self.timeout)?;
            job_id_from(&value)
        };
        let refusal = || self.job_refusal(store, "joined");
        let joined = id.and_then(|id| {
            Communicator::new_unless(device, self.rank, self.world, &id, self.timeout, &refusal)
                .map_err(|e| e.to_string())
        });
        let said = joined.as_ref().map(|_| Vec::new()).map_err(Clone::clone);
        if let Err((r, why)) = self.agree_job(store, "joined", said)? {
            if let Ok(job) = &joined {
                Communicator::abort_all(&[job]);
            }
            return Ok(self.without_job(r, &why));
        }
        let job = joined.map_err(|e| Error::Gpu(e.to_string()))?;
        let warmed = warm_up_job(&job, device, self.timeout, &|| {
            self.job_refusal(store, "warmed")
        })
        .map(|()| Vec::new())
        .map_err(|e| format!("warming up the job's NCCL communicator: {e}"));
        if let Err((r, why)) = self.agree_job(store, "warmed", warmed)? {
            Communicator::abort_all(&[&job]);
            return Ok(self.without_job(r, &why));
        }
        Ok(Some(job))
    }

    /// Rank `r` could not make or run the job's communicator (`why`): every
    /// rank goes on with the plan alone.
    fn without_job(&self, r: u32, why: &str) -> Option<Communicator> {
        log::warn!(
            "fairring: rank {r} could not make the job's NCCL communicator ({why}): every \
             device all-reduce takes the plan"
        );
        None
    }

    /// [`NcclSetup::agree`] among every rank of the job.
    fn agree_job(
        &self,
        store: &dyn Store,
        round: &str,
        said: std::result::Result<Vec<u8>, String>,
    ) -> Result<Agreed> {
        let key = |r: u32| format!("nccl/job/{round}/{r}");
        agree_among(store, &key, self.rank, self.world, said, self.timeout).map_err(|e| {
            Error::Gpu(format!(
                "the job's ranks agreeing on an NCCL communicator of the job ({round}): {e}"
            ))
        })
    }

    /// [`NcclSetup::refusal`] among every rank of the job.
    fn job_refusal(&self, store: &dyn Store, round: &str) -> Option<String> {
        refusal_among(
            store,
            &|r| format!("nccl/job/{round}/{r}"),
            self.rank,
            self.world,
        )
        .map(|(r, why)| format!("rank {r} said: {why}"))
    }

    fn make_machine(&self, device: &Arc<Device>, store: &dyn Store) -> Result<Option<NcclComms>> {
        if self.local_ranks == 1 || self.choice == DeviceLocal::Host {
            return Ok(None);
        }
        // 1. Whether each rank can make communicators at all, and on which
        //    GPU.
        let ready = fairring_cuda::probe::require(fairring_cuda::Library::Nccl)
            .map(|()| device.uuid().to_vec())
            .map_err(|e| e.to_string());
        let uuids = match self.agree(store, "ready", ready)? {
            Ok(uuids) => uuids,
            Err((r, why)) => return self.refused(r, &why),
        };
        if let Some((a, b)) = shared_gpu(&uuids)
            && self.choice == DeviceLocal::Auto
        {
            log::warn!(
                "fairring: local ranks {a} and {b} of machine {} share one GPU: the machine's \
                 ranks stage device tensors through the host",
                self.machine
            );
            return Ok(None);
        }
        // 2. The communicators, from the ids local rank 0 makes.
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
        // A rank that cannot join says so at once; the others stop waiting
        // for it then, not at the bound.
        let refusal = || self.refusal(store, "joined");
        let joined = ids.and_then(|(a, b)| {
            let make = |id| {
                let (rank, size) = (self.local_rank, self.local_ranks);
                Communicator::new_unless(device, rank, size, &id, self.timeout, &refusal)
                    .map_err(|e| e.to_string())
            };
            Ok((make(a)?, make(b)?))
        });
        let said = joined.as_ref().map(|_| Vec::new()).map_err(Clone::clone);
        if let Err((r, why)) = self.agree(store, "joined", said)? {
            if let Ok((reduce, gather)) = &joined {
                // Another rank could not: these never run a collective.
                Communicator::abort_all(&[reduce, gather]);
            }
            return self.refused(r, &why);
        }
        let (reduce, gather) = joined.map_err(|e| Error::Gpu(e.to_string()))?;
        let comms = NcclComms {
            reduce,
            gather,
            job: None,
            gpus_in_switch: false,
        };
        // 3. The warm-up: each collective the engine issues, once per size
        //    class (which aborts the communicators where it fails).
        let warmed = warm_up(&comms, device, self.timeout, &|| {
            self.refusal(store, "warmed")
        })
        .map(|()| Vec::new())
        .map_err(|e| format!("warming up its NCCL communicators: {e}"));
        if let Err((r, why)) = self.agree(store, "warmed", warmed)? {
            comms.abort();
            return self.refused(r, &why);
        }
        Ok(Some(comms))
    }

    /// Says `said` under round `round` and reads every local rank's word of
    /// it: every rank's value, or the first refusal (its local rank and
    /// reason). A rank that says nothing within the timeout (gone, or its
    /// store failed) is an error naming it, on every rank that waits for it;
    /// a rank whose store fails fails the same way.
    fn agree(
        &self,
        store: &dyn Store,
        round: &str,
        said: std::result::Result<Vec<u8>, String>,
    ) -> Result<Agreed> {
        let key = |r: u32| format!("nccl/{}/{round}/{r}", self.machine);
        agree_among(
            store,
            &key,
            self.local_rank,
            self.local_ranks,
            said,
            self.timeout,
        )
        .map_err(|e| {
            Error::Gpu(format!(
                "machine {}'s local ranks agreeing on NCCL ({round}): {e}",
                self.machine
            ))
        })
    }

    /// The reason another local rank gave at round `round` for refusing, if
    /// one has (a read of the store that waits for nothing).
    fn refusal(&self, store: &dyn Store, round: &str) -> Option<String> {
        let key = |r: u32| format!("nccl/{}/{round}/{r}", self.machine);
        refusal_among(store, &key, self.local_rank, self.local_ranks)
            .map(|(r, why)| format!("local rank {r} said: {why}"))
    }

    /// Local rank `r` could not make or run NCCL's communicators (`why`):
    /// with `auto` every local rank stages through the host; with `nccl`
    /// every one fails naming it.
    fn refused(&self, r: u32, why: &str) -> Result<Option<NcclComms>> {
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

/// A round's outcome: every local rank's value, or the first refusal (the
/// local rank and its reason).
type Agreed = std::result::Result<Vec<Vec<u8>>, (u32, String)>;

/// What the answer of a rank that gave up on another says.
const GAVE_UP: &str = "gave up";

/// Two local ranks (by local rank) whose GPUs are one, if any.
fn shared_gpu(uuids: &[Vec<u8>]) -> Option<(u32, u32)> {
    (0u32..).zip(uuids).find_map(|(a, ua)| {
        (0u32..)
            .zip(uuids)
            .skip(a as usize + 1)
            .find(|(_, ub)| *ub == ua)
            .map(|(b, _)| (a, b))
    })
}

/// The sizes, in bytes, at which [`warm_up`] runs each collective: NCCL's
/// tuner gives each of its protocols (LL, LL128, Simple) and algorithms its
/// own range of sizes, and connects what a collective uses at its first use.
const WARM_UP_SIZES: [usize; 3] = [1 << 10, 256 << 10, 8 << 20];

/// Runs each collective the local step issues (all-reduce, reduce,
/// broadcast) once at each of [`WARM_UP_SIZES`] and waits for them, up to
/// `timeout`.
///
/// At its first use NCCL makes the collective's connections with every
/// local rank, allocates device memory (which waits for the whole device),
/// loads its kernels and may grow the context's stack. Done here, while the
/// machine's ranks agree on their path, a rank that cannot is found before
/// any operation depends on it, and no operation's enqueue (on its caller's
/// thread, holding the planner) waits for the other ranks to connect. None
/// of it could deadlock later either: the progress thread makes no CUDA
/// call, so a wait for the whole device returns.
fn warm_up(
    comms: &NcclComms,
    device: &Arc<Device>,
    timeout: Duration,
    give_up: &dyn Fn() -> Option<String>,
) -> Result<()> {
    let (f32, sum) = (DataType::F32, ReduceOp::Sum);
    let both = [&comms.reduce, &comms.gather];
    warm(device, &both, timeout, give_up, &|stream, view| {
        comms.reduce.all_reduce_in_place(stream, view, f32, sum)?;
        comms.reduce.reduce_in_place(stream, view, f32, sum, 0)?;
        comms
            .gather
            .broadcast_in_place(stream, view, DataType::U8, 0)
    })
}

/// [`warm_up`] for the job's communicator: its all-reduce, the one call
/// the engine makes on it.
fn warm_up_job(
    job: &Communicator,
    device: &Arc<Device>,
    timeout: Duration,
    give_up: &dyn Fn() -> Option<String>,
) -> Result<()> {
    warm(device, &[job], timeout, give_up, &|stream, view| {
        job.all_reduce_in_place(stream, view, DataType::F32, ReduceOp::Sum)
    })
}

/// Enqueues `run` on a stream of its own over each of [`WARM_UP_SIZES`] of
/// a buffer and waits for it up to `timeout`; where that fails, aborts
/// `comms`, whose kernels then end before the buffer they use is freed
/// (freeing device memory waits for them).
fn warm(
    device: &Arc<Device>,
    comms: &[&Communicator],
    timeout: Duration,
    give_up: &dyn Fn() -> Option<String>,
    run: &dyn Fn(&Stream, &mut DeviceSliceMut<'_>) -> fairring_cuda::Result<()>,
) -> Result<()> {
    let stream = Stream::new(device, false).map_err(cuda_error)?;
    let mut buffer = DeviceBuffer::zeroed(device, WARM_UP_SIZES[2]).map_err(cuda_error)?;
    let mut whole = buffer.slice_mut();
    let ran = WARM_UP_SIZES
        .iter()
        .try_for_each(|&bytes| {
            let mut view = whole.range(0..bytes).map_err(cuda_error)?;
            run(&stream, &mut view).map_err(cuda_error)
        })
        .and_then(|()| wait_idle(&stream, comms, timeout, give_up));
    if ran.is_err() {
        Communicator::abort_all(comms);
    }
    ran
}

/// Waits for `stream` to run out, polled, so that a rank that never joins
/// the kernels of `comms` (gone, or failed before its warm-up) is a timeout
/// or its refusal, not a hang.
fn wait_idle(
    stream: &Stream,
    comms: &[&Communicator],
    timeout: Duration,
    give_up: &dyn Fn() -> Option<String>,
) -> Result<()> {
    let started = std::time::Instant::now();
    let mut asked = started;
    while !stream.is_idle().map_err(cuda_error)? {
        for comm in comms {
            comm.check().map_err(cuda_error)?;
        }
        if started.elapsed() >= timeout {
            return Err(Error::timeout("NCCL's warm-up collectives", timeout));
        }
        if asked.elapsed() >= fairring_cuda::nccl::GIVE_UP_EVERY {
            asked = std::time::Instant::now();
            if let Some(why) = give_up() {
                return Err(Error::Gpu(format!("gave up NCCL's warm-up: {why}")));
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

/// Says `said` at key `key(me)` and reads the word of every one of `members`
/// (`key(r)`): every member's value, or the first refusal (the member and
/// its reason), preferring one that is not a member giving up on another.
/// A member that says nothing within `timeout` is an error naming it.
fn agree_among(
    store: &dyn Store,
    key: &dyn Fn(u32) -> String,
    me: u32,
    members: u32,
    said: std::result::Result<Vec<u8>, String>,
    timeout: Duration,
) -> Result<Agreed> {
    let value = match said {
        Ok(v) => [b"+".as_slice(), &v].concat(),
        Err(why) => format!("!{why}").into_bytes(),
    };
    store.set(&key(me), &value)?;
    let keys: Vec<String> = (0..members).map(key).collect();
    let values = crate::store::gather(store, &keys, timeout)?;
    let mut agreed = Vec::with_capacity(values.len());
    let mut refusals = Vec::new();
    for (r, v) in (0u32..).zip(values) {
        match v.split_first() {
            Some((b'+', rest)) => agreed.push(rest.to_vec()),
            Some((b'!', why)) => refusals.push((r, String::from_utf8_lossy(why).into_owned())),
            _ => refusals.push((r, "an unreadable answer".to_owned())),
        }
    }
    // The member that could not, rather than those that gave up on it.
    let cause = refusals
        .iter()
        .position(|(_, why)| !why.contains(GAVE_UP))
        .unwrap_or(0);
    match refusals.into_iter().nth(cause) {
        Some(refusal) => Ok(Err(refusal)),
        None => Ok(Ok(agreed)),
    }
}

/// The member other than `me` of `members` that has refused at `key`, and
/// its reason, if one has (a read of the store that waits for nothing).
fn refusal_among(
    store: &dyn Store,
    key: &dyn Fn(u32) -> String,
    me: u32,
    members: u32,
) -> Option<(u32, String)> {
    (0..members).filter(|&r| r != me).find_map(|r| {
        let key = key(r);
        if !store.check(&[key.as_str()]).ok()? {
            return None;
        }
        let said = store.get(&key, Duration::from_millis(10)).ok()?;
        let why = said.strip_prefix(b"!")?;
        Some((r, String::from_utf8_lossy(why).into_owned()))
    })
}

/// The job's id rank 0 published, or its reason for publishing none.
fn job_id_from(value: &[u8]) -> std::result::Result<UniqueId, String> {
    if let Some(why) = value.strip_prefix(b"!") {
        return Err(format!(
            "rank 0 could not make the job's NCCL id: {}",
            String::from_utf8_lossy(why)
        ));
    }
    UniqueId::from_bytes(value).map_err(|e| format!("rank 0's NCCL id of the job: {e}"))
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
    use crate::store::in_process::InProcessStore;

    /// Local rank `local_rank` of three on machine 7, choosing `choice`.
    fn setup(local_rank: u32, choice: DeviceLocal) -> NcclSetup {
        NcclSetup {
            cell: NcclCell::default(),
            choice,
            machine: 7,
            local_rank,
            local_ranks: 3,
            rank: 21 + local_rank,
            world: 30,
            across_job: NcclAcrossMachines::Off,
            agree_on_switches: false,
            timeout: Duration::from_secs(5),
            making: Mutex::new(()),
        }
    }

    /// Every local rank's outcome of one round, each saying what `said`
    /// gives it (`None`: it says nothing).
    fn round(
        said: impl Fn(u32) -> Option<std::result::Result<Vec<u8>, String>> + Sync,
        timeout: Duration,
    ) -> Vec<std::result::Result<Agreed, String>> {
        let store = InProcessStore::default();
        std::thread::scope(|s| {
            let ranks: Vec<_> = (0..3)
                .filter_map(|r| {
                    let answer = said(r)?;
                    let store = &store;
                    Some(s.spawn(move || {
                        let setup = NcclSetup {
                            timeout,
                            ..setup(r, DeviceLocal::Auto)
                        };
                        setup
                            .agree(store, "ready", answer)
                            .map_err(|e| e.to_string())
                    }))
                })
                .collect();
            ranks.into_iter().map(|t| t.join().unwrap()).collect()
        })
    }

    #[test]
    fn local_ranks_agree_on_one_outcome() {
        let all = round(
            |r| Some(Ok(r.to_le_bytes()[..1].to_vec())),
            Duration::from_secs(5),
        );
        for outcome in &all {
            assert_eq!(outcome, &Ok(Ok(vec![vec![0], vec![1], vec![2]])));
        }
        let one_cannot = round(
            |r| {
                Some(if r == 1 {
                    Err("no NCCL".into())
                } else {
                    Ok(vec![])
                })
            },
            Duration::from_secs(5),
        );
        for outcome in &one_cannot {
            assert_eq!(outcome, &Ok(Err((1, "no NCCL".to_owned()))));
        }
    }

    #[test]
    fn the_rank_that_could_not_is_named_rather_than_those_that_gave_up_on_it() {
        let all = round(
            |r| {
                Some(match r {
                    0 => Err(format!(
                        "{GAVE_UP} waiting for set-up: local rank 2 said: x"
                    )),
                    2 => Err("x".into()),
                    _ => Ok(vec![]),
                })
            },
            Duration::from_secs(5),
        );
        for outcome in &all {
            assert_eq!(outcome, &Ok(Err((2, "x".to_owned()))));
        }
    }

    #[test]
    fn a_rank_that_says_nothing_fails_every_other_naming_it() {
        let all = round(|r| (r != 2).then(|| Ok(vec![])), Duration::from_millis(200));
        assert_eq!(all.len(), 2);
        for outcome in &all {
            let e = outcome.as_ref().unwrap_err();
            assert!(
                e.contains("machine 7") && e.contains("nccl/7/ready/2"),
                "{e}"
            );
        }
    }

    #[test]
    fn another_ranks_refusal_is_read_without_waiting() {
        let store = InProcessStore::default();
        let me = setup(0, DeviceLocal::Auto);
        assert_eq!(me.refusal(&store, "joined"), None);
        store.set("nccl/7/joined/1", b"+").unwrap();
        assert_eq!(me.refusal(&store, "joined"), None);
        store.set("nccl/7/joined/2", b"!out of memory").unwrap();
        let why = me.refusal(&store, "joined").unwrap();
        assert!(
            why.contains("local rank 2") && why.contains("out of memory"),
            "{why}"
        );
    }

    #[test]
    fn auto_stages_through_the_host_where_nccl_fails_naming_the_rank() {
        assert!(matches!(
            setup(0, DeviceLocal::Auto).refused(2, "no NCCL"),
            Ok(None)
        ));
        let e = setup(0, DeviceLocal::Nccl)
            .refused(2, "no NCCL")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("local rank 2 of machine 7")
                && e.contains("no NCCL")
                && e.contains("FAIRRING_DEVICE_LOCAL=host"),
            "{e}"
        );
    }

    #[test]
    fn ranks_sharing_a_gpu_are_found() {
        let u = |b: u8| vec![b; 16];
        assert_eq!(shared_gpu(&[u(1), u(2), u(3)]), None);
        assert_eq!(shared_gpu(&[u(1), u(2), u(1)]), Some((0, 2)));
        assert_eq!(shared_gpu(&[u(4), u(5), u(5), u(4)]), Some((0, 3)));
        assert_eq!(shared_gpu(&[]), None);
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
