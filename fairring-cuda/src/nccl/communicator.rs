//! An NCCL communicator among the devices of one machine, non-blocking so that
//! no call can hang past its bound and `abort` always returns.

use crate::sync::{AtomicBool, AtomicUsize, Ordering};
use std::ffi::CStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::nccl::sys::{self, ncclComm_t, ncclConfig_t, ncclResult_t};
use fairring_core::{DataType, ReduceOp};

mod collectives;

use super::UniqueId;
use super::types::{data_type, reduce_op};
use crate::buffers::{DeviceSlice, DeviceSliceMut};
use crate::device::Device;
use crate::error::{self, Error, Library, Result};
use crate::probe;
use crate::stream::Stream;

/// How often a wait that may be given up asks whether it is.
pub const GIVE_UP_EVERY: Duration = Duration::from_millis(50);

/// NCCL's "not set" value for the integer fields of a config.
const UNDEF_INT: i32 = i32::MIN;

/// NCCL's config magic number.
const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// The NCCL version whose `ncclConfig_t` layout the bindings declare (2.30.0).
/// NCCL copies `min(size, its own size)` bytes of a config and resets the fields
/// newer than `version`, so an older or newer library reads it correctly.
const CONFIG_LAYOUT_VERSION: u32 = 23_000;

/// One rank's member of an NCCL communicator.
///
/// The communicator is created non-blocking: every NCCL call returns at once, and
/// this type waits for it by polling `ncclCommGetAsyncError`, up to the bound
/// given at creation, checking for [`abort`](Self::abort) between polls. So an
/// abort from any thread returns within about a millisecond plus the time
/// `ncclCommAbort` takes, and afterwards every call fails with
/// [`Error::Aborted`].
///
/// Calls on one communicator are serialised (NCCL requires it); collectives are
/// enqueued on the stream given, in the order they are called, which must be the
/// same on every rank.
#[derive(Debug)]
pub struct Communicator {
    device: Arc<Device>,
    rank: u32,
    size: u32,
    timeout: Duration,
    /// The handle; null once aborted or destroyed.
    comm: Mutex<CommHandle>,
    abort_requested: AtomicBool,
    /// Groups ([`group`]) this communicator is a member of that have not
    /// ended: an abort waits for them, since `ncclGroupEnd` uses the handle
    /// without holding the lock.
    groups_open: AtomicUsize,
}

#[derive(Debug)]
struct CommHandle(ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread, one call at a time;
// the mutex around it serialises the calls.
unsafe impl Send for CommHandle {}

impl Communicator {
    /// Rank `rank` of a `size`-rank communicator on `device`, from the `id` every
    /// rank was given. Waits up to `timeout` for every rank to join; on timeout
    /// the half-made communicator is aborted and the error says so.
    pub fn new(
        device: &Arc<Device>,
        rank: u32,
        size: u32,
        id: &UniqueId,
        timeout: Duration,
    ) -> Result<Communicator> {
        Communicator::new_unless(device, rank, size, id, timeout, &|| None)
    }

    /// [`Communicator::new`], giving up as soon as `give_up` (asked every
    /// [`GIVE_UP_EVERY`] while the ranks join) returns a reason: another
    /// rank said it cannot join, so waiting out the bound would only delay
    /// every rank's answer. The half-made communicator is aborted and the
    /// error ([`Error::GaveUp`]) carries the reason.
    pub fn new_unless(
        device: &Arc<Device>,
        rank: u32,
        size: u32,
        id: &UniqueId,
        timeout: Duration,
        give_up: &dyn Fn() -> Option<String>,
    ) -> Result<Communicator> {
        if size == 0 || rank >= size {
            return Err(error::invalid(
                "NCCL rank",
                format!("rank {rank} is not in a communicator of {size}"),
            ));
        }
        probe::require(Library::Nccl)?;
        probe::require(Library::Cuda)?;
        let _bound = device.bind()?;
        let mut config = config();
        let mut comm = std::ptr::null_mut();
        let (n, r) = (to_int(size, "NCCL size")?, to_int(rank, "NCCL rank")?);
        // SAFETY: writes one communicator handle; `config` is a complete config
        // of the layout the bindings declare, with NCCL's magic and size.
        let status = unsafe { sys::ncclCommInitRankConfig(&mut comm, n, id.raw(), r, &mut config) };
        if status != ncclResult_t::ncclSuccess && status != ncclResult_t::ncclInProgress {
            let last = if comm.is_null() {
                None
            } else {
                last_error(comm)
            };
            if !comm.is_null() {
                // SAFETY: a handle NCCL returned, not used again.
                unsafe { sys::ncclCommAbort(comm) };
            }
            return Err(error::nccl_error("ncclCommInitRankConfig", status, last));
        }
        let communicator = Communicator {
            device: Arc::clone(device),
            rank,
            size,
            timeout,
            comm: Mutex::new(CommHandle(comm)),
            abort_requested: AtomicBool::new(false),
            groups_open: AtomicUsize::new(0),
        };
        let waited = {
            let handle = communicator.lock()?;
            communicator.wait_unless(
                &handle,
                "ncclCommInitRankConfig",
                || format!("NCCL communicator set-up (rank {rank} of {size})"),
                give_up,
            )
        };
        if let Err(e) = waited {
            // Dropping aborts a communicator that never became ready.
            communicator.abort_now();
            return Err(e);
        }
        Ok(communicator)
    }

    /// This member's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The device this member drives.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Aborts the communicator: NCCL stops its kernels and frees it, waits in
    /// other threads end with [`Error::Aborted`], and every later call fails so.
    /// Returns how long the abort took. Idempotent.
    pub fn abort(&self) -> Duration {
        let started = Instant::now();
        self.abort_now();
        started.elapsed()
    }

    /// Aborts every one of `communicators` at once: each is asked to stop
    /// before any abort waits, and each is aborted on its own thread.
    ///
    /// `ncclCommAbort` waits for the communicator's kernels to leave the
    /// streams it was used on. Where two communicators share a stream, a
    /// kernel of one can be queued behind a kernel of the other that waits
    /// for a rank that is gone: aborted one after the other, the first abort
    /// would wait for a kernel only the second can end. Returns how long the
    /// aborts took.
    pub fn abort_all(communicators: &[&Communicator]) -> Duration {
        let started = Instant::now();
        for c in communicators {
            c.abort_requested.store(true, Ordering::SeqCst);
        }
        std::thread::scope(|s| {
            let mut inline = Vec::new();
            for &c in communicators {
                let spawned = std::thread::Builder::new()
                    .name("nccl-abort".into())
                    .spawn_scoped(s, move || c.abort_now());
                if let Err(e) = spawned {
                    log::warn!(
                        "starting a thread to abort NCCL rank {}: {e}; aborting it after the others",
                        c.rank
                    );
                    inline.push(c);
                }
            }
            for c in inline {
                c.abort_now();
            }
        });
        started.elapsed()
    }

    /// Whether NCCL has reported an asynchronous error (a peer gone, a network
    /// failure): a watchdog polls this.
    pub fn check(&self) -> Result<()> {
        let handle = self.lock()?;
        let mut state = ncclResult_t::ncclSuccess;
        // SAFETY: a live handle (not null: `lock` checks), one call at a time.
        let status = unsafe { sys::ncclCommGetAsyncError(handle.0, &mut state) };
        error::nccl("ncclCommGetAsyncError", status, None)?;
        error::nccl("an NCCL operation", state, last_error(handle.0))
    }

    /// Checks the stream and buffer lie on this communicator's device, and
    /// makes its context current while the guard lives.
    fn check_placement(&self, stream: &Stream, buffer_device: u32) -> Result<crate::Bound<'_>> {
        self.device
            .check_same("stream", stream.device().ordinal())?;
        self.device.check_same("buffer", buffer_device)?;
        self.device.bind()
    }

    /// Bytes per rank of a `total`-byte buffer split over the ranks.
    fn chunk_bytes(&self, total: usize, dtype: DataType, argument: &'static str) -> Result<usize> {
        let unit = elem_bytes(dtype) * self.size as usize;
        if !total.is_multiple_of(unit) {
            return Err(error::invalid(
                argument,
                format!(
                    "{total} bytes is not a whole number of {dtype} elements for each of {} ranks",
                    self.size
                ),
            ));
        }
        Ok(total / self.size as usize)
    }

    /// The handle, locked; [`Error::Aborted`] once aborted.
    fn lock(&self) -> Result<MutexGuard<'_, CommHandle>> {
        let handle = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if handle.0.is_null() || self.abort_requested.load(Ordering::Acquire) {
            return Err(Error::Aborted);
        }
        Ok(handle)
    }

    /// The outcome of an enqueueing call: waits while NCCL reports it in progress.
    fn finish(&self, handle: &CommHandle, call: &'static str, status: ncclResult_t) -> Result<()> {
        match status {
            ncclResult_t::ncclSuccess => Ok(()),
            ncclResult_t::ncclInProgress => self.wait(handle, call, || call.to_owned()),
            _ => Err(error::nccl_error(call, status, last_error(handle.0))),
        }
    }

    /// Polls until NCCL has finished the communicator's last call, it fails, the
    /// bound passes, or an abort is requested.
    fn wait(
        &self,
        handle: &CommHandle,
        call: &'static str,
        what: impl Fn() -> String,
    ) -> Result<()> {
        self.wait_unless(handle, call, what, &|| None)
    }

    /// [`wait`](Self::wait), also giving up once `give_up` (asked every
    /// [`GIVE_UP_EVERY`]) returns a reason.
    fn wait_unless(
        &self,
        handle: &CommHandle,
        call: &'static str,
        what: impl Fn() -> String,
        give_up: &dyn Fn() -> Option<String>,
    ) -> Result<()> {
        let started = Instant::now();
        let mut asked = started;
        let mut polls = 0u32;
        loop {
            let mut state = ncclResult_t::ncclInProgress;
            // SAFETY: a live handle, used by this thread only (the lock is held).
            let status = unsafe { sys::ncclCommGetAsyncError(handle.0, &mut state) };
            error::nccl("ncclCommGetAsyncError", status, None)?;
            match state {
                ncclResult_t::ncclSuccess => return Ok(()),
                ncclResult_t::ncclInProgress => {}
                failed => return Err(error::nccl_error(call, failed, last_error(handle.0))),
            }
            if self.abort_requested.load(Ordering::Acquire) {
                return Err(Error::Aborted);
            }
            if started.elapsed() >= self.timeout {
                return Err(Error::Timeout {
                    what: what(),
                    after: self.timeout,
                });
            }
            if asked.elapsed() >= GIVE_UP_EVERY {
                asked = Instant::now();
                if let Some(reason) = give_up() {
                    return Err(Error::GaveUp {
                        what: what(),
                        reason,
                    });
                }
            }
            polls = polls.saturating_add(1);
            if polls < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    fn abort_now(&self) {
        self.abort_requested.store(true, Ordering::SeqCst);
        // A group that counted itself in before the flag was set ends first
        // (its calls fail at once and its wait polls the flag); one counted
        // in after it sees the flag and enqueues nothing. SeqCst on both
        // sides: either this sees the count or the group sees the flag.
        let mut polls = 0u32;
        while self.groups_open.load(Ordering::SeqCst) > 0 {
            polls = polls.saturating_add(1);
            if polls < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        // Waits in other threads see the flag within one poll and release the lock.
        let mut handle = self.comm.lock().unwrap_or_else(|p| p.into_inner());
        if handle.0.is_null() {
            return;
        }
        let _bound = self.device.bind();
        if let Err(e) = &_bound {
            log::warn!("aborting NCCL rank {}: {e}", self.rank);
        }
        // SAFETY: a live handle, freed by this call and never used again (nulled
        // under the lock).
        let status = unsafe { sys::ncclCommAbort(handle.0) };
        handle.0 = std::ptr::null_mut();
        if let Err(e) = error::nccl("ncclCommAbort", status, None) {
            log::warn!("aborting NCCL rank {}: {e}", self.rank);
        }
    }
}

impl Drop for Communicator {
    /// Finalises (flushing enqueued operations) and destroys the communicator;
    /// if finalising does not finish within the bound, aborts instead. Failures
    /// are logged.
    fn drop(&mut self) {
        let finalized = match self.lock() {
            Err(_) => return,
            Ok(handle) => {
                // SAFETY: a live handle, used by this thread only.
                let status = unsafe { sys::ncclCommFinalize(handle.0) };
                self.finish(&handle, "ncclCommFinalize", status)
            }
        };
        match finalized {
            Ok(()) => {
                let mut handle = self.comm.lock().unwrap_or_else(|p| p.into_inner());
                // SAFETY: a finalised live handle, freed by this call and nulled.
                let status = unsafe { sys::ncclCommDestroy(handle.0) };
                handle.0 = std::ptr::null_mut();
                if let Err(e) = error::nccl("ncclCommDestroy", status, None) {
                    log::warn!("destroying NCCL rank {}: {e}", self.rank);
                }
            }
            Err(e) => {
                log::warn!("finalising NCCL rank {}: {e}; aborting it", self.rank);
                self.abort_now();
            }
        }
    }
}

/// Runs `enqueue` between `ncclGroupStart` and `ncclGroupEnd`, so that NCCL
/// launches the calls it makes together (the collect stage's sends and receives
/// to every peer, or one call on each of several communicators of a process),
/// then waits for every communicator in `members` to accept the group. The group
/// is ended even when `enqueue` fails.
///
/// `members` must name every communicator `enqueue` calls: an abort of one
/// ([`Communicator::abort`], from any thread) waits until the group has
/// ended, and a group begun after the abort was asked for fails with
/// [`Error::Aborted`] having enqueued nothing.
pub fn group<R>(members: &[&Communicator], enqueue: impl FnOnce() -> Result<R>) -> Result<R> {
    probe::require(Library::Nccl)?;
    let _open = OpenGroup::enter(members)?;
    // SAFETY: no arguments; groups nest.
    error::nccl("ncclGroupStart", unsafe { sys::ncclGroupStart() }, None)?;
    let result = enqueue();
    // SAFETY: ends the group started above.
    let ended = unsafe { sys::ncclGroupEnd() };
    let value = result?;
    if ended == ncclResult_t::ncclInProgress {
        for member in members {
            let handle = member.lock()?;
            member.wait(&handle, "ncclGroupEnd", || "an NCCL group".to_owned())?;
        }
        return Ok(value);
    }
    error::nccl("ncclGroupEnd", ended, None)?;
    Ok(value)
}

/// A group's place in its members' counts of open groups, from before its
/// first call to after its end; refused where a member is being aborted.
struct OpenGroup<'a> {
    members: &'a [&'a Communicator],
}

impl<'a> OpenGroup<'a> {
    fn enter(members: &'a [&'a Communicator]) -> Result<Self> {
        for m in members {
            m.groups_open.fetch_add(1, Ordering::SeqCst);
        }
        let open = OpenGroup { members };
        if members
            .iter()
            .any(|m| m.abort_requested.load(Ordering::SeqCst))
        {
            // Dropping `open` lets the abort go on.
            return Err(Error::Aborted);
        }
        Ok(open)
    }
}

impl Drop for OpenGroup<'_> {
    fn drop(&mut self) {
        for m in self.members {
            m.groups_open.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// NCCL's config with every field unset except non-blocking mode.
fn config() -> ncclConfig_t {
    ncclConfig_t {
        size: size_of::<ncclConfig_t>(),
        magic: CONFIG_MAGIC,
        version: CONFIG_LAYOUT_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// NCCL's last error message for `comm`, if it left one.
fn last_error(comm: ncclComm_t) -> Option<String> {
    // SAFETY: returns a NUL-terminated string NCCL owns (or null); `comm` is a
    // handle NCCL returned.
    let text = unsafe { sys::ncclGetLastError(comm) };
    if text.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated (above); copied before the next call.
    Some(
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// An element's size: 1 to 8 bytes.
fn elem_bytes(dtype: DataType) -> usize {
    match dtype.size_bytes() {
        1 => 1,
        2 => 2,
        4 => 4,
        _ => 8,
    }
}

/// Elements in a `bytes`-byte buffer of `dtype`.
fn count_of(bytes: usize, dtype: DataType, argument: &'static str) -> Result<usize> {
    let unit = elem_bytes(dtype);
    if !bytes.is_multiple_of(unit) {
        return Err(error::invalid(
            argument,
            format!("{bytes} bytes is not a whole number of {dtype} elements"),
        ));
    }
    Ok(bytes / unit)
}

/// `root` as NCCL takes it, if it is a rank of a communicator of `size`.
fn root_of(root: u32, size: u32) -> Result<i32> {
    if root >= size {
        return Err(error::invalid(
            "root",
            format!("rank {root} is not in a communicator of {size}"),
        ));
    }
    to_int(root, "root")
}

fn to_int(value: u32, argument: &'static str) -> Result<i32> {
    i32::try_from(value).map_err(|_| error::invalid(argument, format!("{value} is too large")))
}

fn check_length(argument: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(error::invalid(
            argument,
            format!("it has {got} bytes, and one chunk is {want}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_asks_for_non_blocking_and_leaves_the_rest_to_nccl() {
        let c = config();
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.size, size_of::<ncclConfig_t>());
        assert_eq!(c.version, 23_000);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.minCTAs, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn chunk_lengths_are_checked() {
        assert!(check_length("x", 64, 64).is_ok());
        let e = check_length("all-gather input", 60, 64)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("all-gather input") && e.contains("60 bytes"),
            "{e}"
        );
        assert!(to_int(u32::MAX, "NCCL size").is_err());
    }

    #[test]
    fn counts_and_roots_are_checked_and_named() {
        assert_eq!(count_of(64, DataType::F32, "x").unwrap(), 16);
        let e = count_of(6, DataType::F32, "reduce buffer")
            .unwrap_err()
            .to_string();
        assert!(e.contains("reduce buffer") && e.contains("6 bytes"), "{e}");
        assert_eq!(root_of(1, 2).unwrap(), 1);
        let e = root_of(2, 2).unwrap_err().to_string();
        assert!(e.contains("root") && e.contains("rank 2"), "{e}");
    }
}
