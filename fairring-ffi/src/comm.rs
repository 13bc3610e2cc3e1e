//! Communicators: made, queried, aborted, destroyed; and the per-collective
//! exports on host memory, each a call described and started as `fr_start`
//! starts it.

use std::ffi::c_void;
use std::sync::Arc;

use fairring::{Call, Communicator, Config, Work};

use crate::call::{Calls, dtype_of, lists, op_of, start_export};
use crate::status::{FR_OK, boundary, fail, fr_status, invalid};
use crate::store::{CallbackStore, fr_store};
use crate::work_handles::{Completions, fr_work};

/// A communicator: one rank's membership of a job. Opaque.
pub struct fr_comm {
    pub(crate) comm: Arc<Communicator>,
    completions: Arc<Completions>,
}

impl fr_comm {
    pub(crate) fn new(comm: Communicator) -> Result<fr_comm, fr_status> {
        let completions = Completions::start(comm.rank()).map_err(|e| {
            fail(&fairring::Error::Io {
                context: "starting the completion thread".into(),
                source: Arc::new(e),
            })
        })?;
        Ok(fr_comm {
            comm: Arc::new(comm),
            completions,
        })
    }
}

/// Borrows the communicator behind a handle, or reports the null.
///
/// # Safety
///
/// `comm` is null or a live handle from this library.
unsafe fn handle<'a>(comm: *const fr_comm) -> Result<&'a fr_comm, fr_status> {
    // SAFETY: per the contract, a non-null `comm` is a live handle.
    unsafe { comm.as_ref() }.ok_or_else(|| invalid("comm", "null"))
}

/// Stores a new handle in `*out`.
///
/// # Safety
///
/// `out` is null or valid for a write.
pub(crate) unsafe fn give<T>(out: *mut *mut T, value: T) -> fr_status {
    if out.is_null() {
        return invalid("out", "null");
    }
    // SAFETY: non-null and valid for a write per the contract.
    unsafe { out.write(Box::into_raw(Box::new(value))) };
    FR_OK
}

/// Joins the job its launcher's environment describes: torchrun's (`RANK`,
/// `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, its agent store), or that of
/// OpenMPI's `mpirun`, an MPICH-style `mpiexec` or Slurm's `srun`, with the
/// `FAIRRING_*` knobs. Collective: every rank of the job calls it. On success `*out` holds
/// the communicator.
///
/// # Safety
///
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_comm_from_env(out: *mut *mut fr_comm) -> fr_status {
    boundary(|| {
        if out.is_null() {
            return invalid("out", "null");
        }
        match Communicator::from_env()
            .map_err(|e| fail(&e))
            .and_then(fr_comm::new)
        {
            // SAFETY: checked non-null; valid for a write per the contract.
            Ok(c) => unsafe { give(out, c) },
            Err(s) => s,
        }
    })
}

/// Joins a job as rank `rank` of `world_size`, meeting through the host
/// runtime's `store` (copied; its `release` is called when the communicator no
/// longer needs it, also when this call fails). `timeout_ms`, unless 0,
/// replaces `FAIRRING_TIMEOUT` (the rendezvous and peer-silence bound). The
/// other knobs come from the environment; `MASTER_ADDR` only picks the
/// interface the fabric listens on (loopback without it: one machine). The
/// job's `LOCAL_RANK`, `LOCAL_WORLD_SIZE` and dedicated servers are read only
/// where `rank` and `world_size` are the job's `RANK` and `WORLD_SIZE`: a
/// subgroup finds its machines through the store. Collective.
///
/// # Safety
///
/// `store` points to a valid `fr_store` whose callbacks honour its contract;
/// `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_comm_with_store(
    rank: u32,
    world_size: u32,
    store: *const fr_store,
    timeout_ms: u64,
    out: *mut *mut fr_comm,
) -> fr_status {
    boundary(|| {
        // SAFETY: per the contract, a non-null `store` is valid for a read.
        let Some(callbacks) = (unsafe { store.as_ref() }).copied() else {
            return invalid("store", "null");
        };
        let store = match CallbackStore::new(callbacks) {
            Ok(s) => Arc::new(s),
            Err(reason) => {
                if let Some(release) = callbacks.release {
                    // SAFETY: the store is let go of here, once, as documented.
                    unsafe { release(callbacks.user) };
                }
                return invalid("store", reason);
            }
        };
        if out.is_null() {
            return invalid("out", "null");
        }
        let timeout = (timeout_ms > 0).then(|| std::time::Duration::from_millis(timeout_ms));
        let built = Config::from_env_with(rank, world_size, timeout)
            .and_then(|config| Communicator::with_store(config, store))
            .map_err(|e| fail(&e))
            .and_then(fr_comm::new);
        match built {
            // SAFETY: checked non-null; valid for a write per the contract.
            Ok(c) => unsafe { give(out, c) },
            Err(s) => s,
        }
    })
}

/// This rank, in `*rank`, and the number of ranks, in `*world_size` (either
/// may be null).
///
/// # Safety
///
/// `comm` is a live handle; `rank` and `world_size` are null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_comm_rank(
    comm: *const fr_comm,
    rank: *mut u32,
    world_size: *mut u32,
) -> fr_status {
    boundary(|| {
        // SAFETY: forwarded.
        let c = match unsafe { handle(comm) } {
            Ok(c) => c,
            Err(s) => return s,
        };
        // SAFETY: null or valid for a write.
        if let Some(r) = unsafe { rank.as_mut() } {
            *r = c.comm.rank();
        }
        // SAFETY: null or valid for a write.
        if let Some(w) = unsafe { world_size.as_mut() } {
            *w = c.comm.world_size();
        }
        FR_OK
    })
}

/// Fails every operation in flight and every later one with `FR_ABORTED`, and
/// wakes every waiter. Callable from any thread, any number of times.
///
/// # Safety
///
/// `comm` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_comm_abort(comm: *const fr_comm) -> fr_status {
    boundary(|| {
        // SAFETY: forwarded.
        match unsafe { handle(comm) } {
            Ok(c) => {
                c.comm.abort();
                FR_OK
            }
            Err(s) => s,
        }
    })
}

/// Destroys the handle. Operations whose work handles were freed or have a
/// callback are waited for first (callbacks have all returned when this
/// returns, unless called from one); the communicator itself is torn down
/// once the last work handle is freed too. Null is ignored. Must not be
/// called from a completion callback.
///
/// # Safety
///
/// `comm` is null or a live handle, not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_comm_destroy(comm: *mut fr_comm) {
    let _ = boundary(|| {
        if !comm.is_null() {
            // SAFETY: a live handle made by `Box::into_raw`, given up by the caller.
            let c = unsafe { Box::from_raw(comm) };
            c.completions.close();
        }
        FR_OK
    });
}

/// The communicator behind `comm`, once `out` is known to be writable: checked
/// before an operation starts, so that a started one always gets its handle.
///
/// # Safety
///
/// `comm` is null or a live handle.
pub(crate) unsafe fn begin<'a>(
    comm: *const fr_comm,
    out: *mut *mut fr_work,
) -> Result<&'a fr_comm, fr_status> {
    // SAFETY: forwarded.
    let c = unsafe { handle(comm) }?;
    if out.is_null() {
        return Err(invalid("out", "null"));
    }
    Ok(c)
}

/// Stores the handle of `work`, started on `c`, in `*out`; or returns its error.
///
/// # Safety
///
/// `out` is non-null and valid for a write.
pub(crate) unsafe fn hand_out(
    c: &fr_comm,
    out: *mut *mut fr_work,
    work: fairring::Result<Work<'_>>,
) -> fr_status {
    match work.and_then(|w| c.comm.own(w)) {
        // SAFETY: valid for a write per the contract.
        Ok(work) => unsafe {
            give(
                out,
                fr_work {
                    work: Arc::new(work),
                    completions: Arc::clone(&c.completions),
                },
            )
        },
        Err(e) => fail(&e),
    }
}

/// Starts an all-reduce of `count` elements of `dtype` at `data`, in place,
/// with `op`. `*out` receives the work handle.
///
/// # Safety
///
/// `comm` is a live handle; `data` is valid for reads and writes of `count`
/// elements, aligned for `dtype`, and neither read nor written by the caller
/// until the work finishes (freeing the handle does not end that); `out` is
/// valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_all_reduce(
    comm: *const fr_comm,
    data: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::all_reduce(data.cast(), count, dtype_of(dtype)?, op_of(op)?);
        Ok(Calls::One(call))
    })
}

/// Starts an all-reduce of each of the `n` tensors `data[i]` of `counts[i]`
/// elements, all of `dtype`; one work covers them all.
///
/// # Safety
///
/// As `fr_all_reduce`, for every tensor; `data` and `counts` hold `n` entries
/// each (read during the call); no two tensors overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_all_reduce_coalesced(
    comm: *const fr_comm,
    data: *const *mut c_void,
    counts: *const u64,
    n: usize,
    dtype: i32,
    op: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        // SAFETY: the lists' contract is the caller's, as documented.
        let (data, counts) = unsafe { lists(data, counts, n) }?;
        let calls = data.iter().zip(counts);
        let calls = calls.map(|(&d, &c)| Call::all_reduce(d.cast(), c, dtype, op));
        Ok(Calls::Group(calls.collect(), "data"))
    })
}

/// Starts a broadcast of `count` elements of `dtype` at `data` from rank
/// `root` (bit-exact for every type).
///
/// # Safety
///
/// As `fr_all_reduce`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_broadcast(
    comm: *const fr_comm,
    data: *mut c_void,
    count: u64,
    dtype: i32,
    root: u32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::broadcast(data.cast(), count, dtype_of(dtype)?, root);
        Ok(Calls::One(call))
    })
}

/// Starts an all-gather: every rank's `count` elements at `input` land, in
/// rank order, in `output` (`world_size * count` elements). `input` may be
/// this rank's place in `output`.
///
/// # Safety
///
/// `input` is valid for reads of `count` elements during the call; `output` as
/// `data` in `fr_all_reduce`, for `world_size * count` elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_all_gather(
    comm: *const fr_comm,
    input: *const c_void,
    output: *mut c_void,
    count: u64,
    dtype: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::all_gather(input.cast(), output.cast(), count, dtype_of(dtype)?);
        Ok(Calls::One(call))
    })
}

/// Starts a reduce-scatter: `input` (`world_size * count` elements) is reduced
/// with `op` across ranks, and this rank's `count` elements of the result are
/// copied into `output`. `input` is workspace: afterwards its share of this
/// rank holds the result too, and the rest is unspecified.
///
/// # Safety
///
/// As `data` in `fr_all_reduce`, for `input` and for `output`, which do not
/// overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_reduce_scatter(
    comm: *const fr_comm,
    input: *mut c_void,
    output: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let call = Call::reduce_scatter(input.cast(), output.cast(), count, dtype, op);
        Ok(Calls::One(call))
    })
}

/// Starts a reduce with `op` to rank `root`: every rank's `count` elements
/// of `dtype` at `input` are reduced into the root's `output`. On the other
/// ranks `output` is workspace. `input` may be `output` (in place). On host
/// memory, of 2 MiB or more, in a job of up to 32 machines of one rank each,
/// it runs as a chain of messages ending at the root (each contribution
/// crossing one link once; not for f16 and bf16); otherwise as an
/// all-reduce.
///
/// # Safety
///
/// `input` is valid for reads of `count` elements until the work finishes;
/// `output` as `data` in `fr_all_reduce`; they are the same or do not overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_reduce(
    comm: *const fr_comm,
    input: *const c_void,
    output: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    root: u32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let call = Call::reduce(input.cast(), output.cast(), count, dtype, op, root);
        Ok(Calls::One(call))
    })
}

/// Starts a gather to rank `root`: every rank's `count` elements at `input`
/// land, in rank order, in the root's `output` (`world_size * count`
/// elements; workspace on the other ranks). `input` may be this rank's place
/// in `output`. On host memory, in a job of up to 32 ranks, each rank's part
/// moves once, as a message to the root (sent from the rank's place in its
/// own `output`); otherwise it runs as an all-gather into every `output`.
///
/// # Safety
///
/// As `fr_all_gather`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_gather(
    comm: *const fr_comm,
    input: *const c_void,
    output: *mut c_void,
    count: u64,
    dtype: i32,
    root: u32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::gather(input.cast(), output.cast(), count, dtype_of(dtype)?, root);
        Ok(Calls::One(call))
    })
}

/// Starts a scatter from rank `root`: part `r` (`count` elements of `dtype`)
/// of the root's `input` (`world_size * count` elements) lands in rank `r`'s
/// `output`, bit for bit. `input` is workspace on every rank. On host
/// memory, in a job of up to 32 ranks, each part moves once, as a message
/// from the root; otherwise it runs as a broadcast of the root's whole input
/// (which every rank's `input` then holds).
///
/// # Safety
///
/// As `fr_reduce_scatter`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_scatter(
    comm: *const fr_comm,
    input: *mut c_void,
    output: *mut c_void,
    count: u64,
    dtype: i32,
    root: u32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::scatter(input.cast(), output.cast(), count, dtype_of(dtype)?, root);
        Ok(Calls::One(call))
    })
}

/// Starts a barrier: its work finishes once every rank has entered it.
///
/// # Safety
///
/// `comm` is a live handle; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_barrier(comm: *const fr_comm, out: *mut *mut fr_work) -> fr_status {
    start_export!(comm, out, Ok(Calls::One(Call::barrier())))
}
