//! The progress engine: turns submissions, fabric completions and local-group
//! progress into the next step of every slice in flight.
//!
//! # Threads and the driver
//!
//! All engine state lives in one [`Driver`] behind a mutex. Whoever holds it
//! *drives*: takes new submissions, polls the fabric, starts slices whose staging
//! buffer is free, and advances every slice as far as it can go, without ever
//! blocking inside a step. Two kinds of threads drive:
//!
//! - a **progress thread** per communicator, so that operations advance while the
//!   caller computes (overlap); when there is nothing to do it sleeps on this
//!   rank's doorbell, which local ranks ring when they publish progress and the
//!   fabric rings when it queues a completion (a fabric that cannot notify is
//!   waited on instead);
//! - a **waiting caller** (`Work::wait`), which drives itself instead of sleeping
//!   while the driver is free: a small all-reduce then runs start to finish on the
//!   caller's thread, with no thread hand-off. Meanwhile the progress thread
//!   parks (see [`Engine::run`]), so the two never compete for a core.
//!
//! Each slice owns one staging buffer. The core's [`StagingState`] word decides,
//! event by event, what the slice does next (see `hierarchical`); the ring keeps
//! its own step counters (see `ring`).
//!
//! # Flow control
//!
//! A peer may write slice `s` into this rank's buffer `s % B` only once this rank
//! has released slice `s - B` from it. Each rank tells the ranks that write into it
//! how far they may go with a **credit** message carrying `w + B`, where `w` is the
//! lowest slice it has not released; credits are sent only when that limit moves.
//! Writes that arrive before their slice starts here (the peer is ahead) are
//! counted and replayed when it starts.
//!
//! # Memory
//!
//! Nothing here allocates once a communicator is built: submissions go through a
//! fixed queue, operations through a fixed table, deferred writes through lists
//! sized at construction, and reductions take their sources from a fixed array.

pub(crate) mod descriptor;
mod hierarchical;
mod ring;
#[cfg(test)]
mod simulation;
pub(crate) mod tags;
pub(crate) mod work;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use fairring_core::plan::{Geometry, Plan, Slice};
use fairring_core::staging::{Actions, Event, StagingState};
use fairring_core::topology::{Location, Topology};
use fairring_rdma::fabric::{
    Completion, CompletionEvent, Fabric, FabricError, RemoteRegion, WriteRequest,
};

use crate::config::Algorithm;
use crate::error::{Error, Result};
use crate::local::{Doorbell, LocalGroup};
use descriptor::{FAILURE_BYTES, Failure, Words};
use tags::Kind;
use work::{DONE, FAILED, Submission, WORK_CAPACITY, WorkTable};

/// How long the progress thread spins before it sleeps.
const SPIN: Duration = Duration::from_micros(20);
/// How long a waiting caller spins before it sleeps: long enough to cover the
/// skew between ranks arriving at a small all-reduce, so that its latency is that
/// of shared memory and not of a wake-up.
const WAIT_SPIN: Duration = Duration::from_micros(100);
/// Pure spinning before a spinner starts yielding its core each round, on a
/// machine with fewer cores than local ranks, so that the ranks it waits for get
/// to run. With a core per local rank a spinner never yields: on the 2-core
/// development machine, 1x2 4 KiB all-reduces took 2-5 us spinning purely and
/// 2-100 us when yielding after 2 or 20 us.
const SPIN_ALONE: Duration = Duration::from_micros(2);
/// How long the progress thread stays parked before it looks again whether a
/// caller still drives. Timer wake-ups are costly on virtual machines: with
/// 200 us, 4 KiB all-reduces on two ranks took 10-50 us; with 5 ms, 2 us.
const PARK: Duration = Duration::from_millis(5);
/// A submission this long after the last wait returned wakes a parked progress
/// thread: the caller is not in a tight loop of blocking calls.
const UNATTENDED: Duration = Duration::from_micros(200);

/// One round of spinning, while less than `limit` has passed since `since`;
/// returns whether it spun. Yields the core after [`SPIN_ALONE`] if `crowded`.
fn spin_a_little(since: Instant, limit: Duration, crowded: bool) -> bool {
    let spent = since.elapsed();
    if spent >= limit {
        return false;
    }
    if crowded && spent >= SPIN_ALONE {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
    true
}

/// Completions taken per poll.
const POLL_BATCH: usize = 256;
/// Filler for completion buffers before a poll writes them.
const NO_COMPLETION: Completion = Completion {
    peer: 0,
    event: CompletionEvent::Sent { token: 0 },
};

/// Where the parts of one staging buffer are.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BufferLayout {
    /// Bytes of one staging buffer.
    pub(crate) buffer_bytes: usize,
    /// Contribution areas (hierarchical) or receive slots (ring) start here.
    pub(crate) inbox: usize,
    /// Bytes of one ring receive slot.
    pub(crate) ring_slot: usize,
}

impl BufferLayout {
    /// The layout for `geometry` over `world` ranks.
    pub(crate) fn new(geometry: &Geometry, world: u32) -> BufferLayout {
        let full_slice = usize::try_from(geometry.full_slice_bytes()).unwrap_or(usize::MAX);
        let staging = geometry.staging_layout();
        let contributions =
            usize::try_from(staging.shard_stride() * u64::from(staging.contribution_areas()))
                .unwrap_or(usize::MAX);
        let n = world as usize;
        // A ring chunk holds at most ceil(elements / N) elements of at most 8 bytes.
        let ring_slot = (full_slice / n + 8).next_multiple_of(64);
        let ring = ring_slot * (n - 1);
        BufferLayout {
            buffer_bytes: full_slice + contributions.max(ring),
            inbox: full_slice,
            ring_slot,
        }
    }
}

/// A write waiting for credit or for room in the fabric's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PendingWrite {
    pub(crate) peer: u32,
    /// Offset in this rank's staging area (all buffers).
    pub(crate) source: usize,
    pub(crate) len: usize,
    /// Offset in the peer's staging area.
    pub(crate) target: u64,
    pub(crate) immediate: u32,
    pub(crate) token: u64,
    /// The slice the peer must have credited, if the write lands in its inbox.
    pub(crate) credit_for: Option<u64>,
}

/// One operation, as the driver tracks it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Record {
    pub(crate) sub: Submission,
    pub(crate) plan: Plan,
    pub(crate) slices_done: u64,
    /// Every slice is done; completion waits for the descriptor checks.
    pub(crate) finished: bool,
}

/// What the slice holding a buffer is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Waiting for the local reduce-scatter.
    ReduceScatter,
    /// Exchanging with other machines (or walking the ring).
    Exchange,
    /// Waiting for the local all-gather.
    AllGather,
    /// All-gathered; waiting for its last sends to complete.
    Draining,
}

/// The slice holding a buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Active {
    pub(crate) number: u64,
    pub(crate) generation: u64,
    pub(crate) seq: u64,
    pub(crate) slice: Slice,
    pub(crate) algorithm: Algorithm,
    pub(crate) phase: Phase,
    /// Hierarchical: next shard whose contribution is still to be posted.
    pub(crate) next_contribution: u32,
    /// Hierarchical: whether contributions may be posted (START_CONTRIBUTIONS seen).
    pub(crate) contributing: bool,
    pub(crate) ring: ring::RingProgress,
}

/// One staging buffer, as the driver tracks it.
pub(crate) struct BufferSlot {
    pub(crate) state: StagingState,
    pub(crate) active: Option<Active>,
    /// Writes that landed for the next slice before it started: contributions
    /// (hierarchical) and ring reduce-scatter chunks.
    pub(crate) early_contributions: u32,
    pub(crate) early_ring: u32,
    /// Writes waiting, in posting order.
    pub(crate) pending: Vec<PendingWrite>,
}

/// Everything the driver mutates.
pub(crate) struct Driver {
    pub(crate) slots: Vec<BufferSlot>,
    records: Vec<Option<Record>>,
    /// Next operation to accept from the queue.
    accepted: u64,
    /// Operation whose slices are being started, and the next slice index in it.
    start_seq: u64,
    start_index: u64,
    /// Global number of the next slice to start.
    next_slice: u64,
    /// Lowest slice not yet released, and the credit limit last sent.
    released: u64,
    credited: u64,
    /// Per rank: the credit limit last sent to it.
    credit_sent: Vec<u64>,
    /// Per rank: slices below this may be written into it.
    pub(crate) credit: Vec<u64>,
    /// Per rank: the operation count it said goodbye after, if it did.
    departed: Vec<Option<u64>>,
    rotation: u64,
    completions: Vec<Completion>,
    last_progress: Instant,
    /// Own descriptor words of operation `s`, at `slot_of(s)`.
    own: Vec<Words>,
    /// Operations below this have every local rank's descriptor checked.
    local_checked: u64,
    /// Per rank: operations below this have had their descriptor sent to it.
    descriptors_sent: Vec<u64>,
    /// Per rank: operations below this it has confirmed (descriptor checked).
    confirmed: Vec<u64>,
    /// Per rank: descriptors that came before this rank accepted the operation.
    early_descriptors: Vec<VecDeque<(u64, Words)>>,
    /// Operations finished and waiting for their checks, and the oldest
    /// operation not completed.
    finished_waiting: u32,
    oldest_open: u64,
    /// The failure record to pass on, when the failure came with one.
    failure_record: Option<[u8; FAILURE_BYTES]>,
}

/// The engine of one communicator.
pub(crate) struct Engine<F: Fabric> {
    pub(crate) fabric: F,
    pub(crate) region: F::Region,
    /// Per rank: its staging area, for the peers this rank writes to.
    pub(crate) remote: Vec<Option<RemoteRegion>>,
    pub(crate) local: Box<dyn LocalGroup>,
    pub(crate) geometry: Geometry,
    pub(crate) topology: Topology,
    pub(crate) location: Location,
    pub(crate) rank: u32,
    pub(crate) world: u32,
    pub(crate) buffers: u32,
    pub(crate) layout: BufferLayout,
    /// Ranks that write into this rank's inbox: they need credits.
    inbound: Vec<u32>,
    /// Every rank this rank is connected to.
    pub(crate) linked: Vec<u32>,
    /// Ranks on other machines this rank writes to, and that write to it: the
    /// remote ends of descriptor checks.
    remote_out: Vec<u32>,
    remote_in: Vec<u32>,
    pub(crate) works: WorkTable,
    submissions: ArrayQueue<Submission>,
    driver: Mutex<Driver>,
    failed: AtomicBool,
    /// Failure messages posted to peers (see `say_goodbye`).
    aborts_posted: AtomicU32,
    first_error: Mutex<Option<Error>>,
    shutdown: AtomicBool,
    pub(crate) timeout: Duration,
    /// Whether any operation may use the fabric (more than one rank).
    uses_fabric: bool,
    /// Whether every event the engine waits for rings the local doorbell: local
    /// ranks' progress always does, and fabric completions do when the fabric
    /// takes a notifier. Otherwise the progress thread waits on the fabric.
    doorbell_wakes: bool,
    /// Whether this machine has fewer cores than local ranks: spinners yield.
    crowded: bool,
    /// Callers inside [`Engine::wait`], and how many times one entered it.
    waiters: AtomicU32,
    wait_entries: AtomicU64,
    /// Operations submitted and not finished.
    outstanding: AtomicU64,
    /// Whether the progress thread is parked (see [`Engine::run`]).
    parked: AtomicBool,
    /// When a wait last returned, in nanoseconds since `epoch`.
    last_wait_end: AtomicU64,
    epoch: Instant,
    /// Where it parks.
    park_bell: Doorbell,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Everything [`Engine::new`] needs.
pub(crate) struct EngineParts<F: Fabric> {
    pub(crate) fabric: F,
    pub(crate) region: F::Region,
    pub(crate) remote: Vec<Option<RemoteRegion>>,
    pub(crate) local: Box<dyn LocalGroup>,
    pub(crate) geometry: Geometry,
    pub(crate) location: Location,
    pub(crate) rank: u32,
    pub(crate) buffers: u32,
    pub(crate) layout: BufferLayout,
    pub(crate) inbound: Vec<u32>,
    pub(crate) linked: Vec<u32>,
    pub(crate) timeout: Duration,
}

impl<F: Fabric> Engine<F> {
    pub(crate) fn new(parts: EngineParts<F>) -> Engine<F> {
        let topology = parts.geometry.topology();
        let world = topology.world_size();
        let most_writes = 2 * (world.max(topology.machines()) as usize) + 4;
        let slots = (0..parts.buffers)
            .map(|_| BufferSlot {
                state: StagingState::new(),
                active: None,
                early_contributions: 0,
                early_ring: 0,
                pending: Vec::with_capacity(most_writes),
            })
            .collect();
        let b = u64::from(parts.buffers);
        let off_machine = |p: &u32| {
            topology
                .locate(*p)
                .is_ok_and(|l| l.machine != parts.location.machine)
        };
        let remote_out: Vec<u32> = (0..world)
            .filter(|&p| parts.remote[p as usize].is_some())
            .filter(off_machine)
            .collect();
        let remote_in: Vec<u32> = parts.inbound.iter().copied().filter(off_machine).collect();
        let early_descriptors = (0..world)
            .map(|p| {
                if remote_in.contains(&p) {
                    VecDeque::with_capacity(WORK_CAPACITY)
                } else {
                    VecDeque::new()
                }
            })
            .collect();
        let doorbell_wakes = world <= 1 || parts.fabric.notify_completions(parts.local.waker());
        Engine {
            fabric: parts.fabric,
            region: parts.region,
            remote: parts.remote,
            local: parts.local,
            geometry: parts.geometry,
            topology,
            location: parts.location,
            rank: parts.rank,
            world,
            buffers: parts.buffers,
            layout: parts.layout,
            inbound: parts.inbound,
            linked: parts.linked,
            remote_out,
            remote_in,
            works: WorkTable::new(),
            submissions: ArrayQueue::new(WORK_CAPACITY),
            driver: Mutex::new(Driver {
                slots,
                records: vec![None; WORK_CAPACITY],
                accepted: 0,
                start_seq: 0,
                start_index: 0,
                next_slice: 0,
                released: 0,
                credited: b,
                credit_sent: vec![b; world as usize],
                credit: vec![b; world as usize],
                departed: vec![None; world as usize],
                rotation: 0,
                completions: vec![NO_COMPLETION; POLL_BATCH],
                last_progress: Instant::now(),
                own: vec![[0; 2]; WORK_CAPACITY],
                local_checked: 0,
                descriptors_sent: vec![0; world as usize],
                confirmed: vec![0; world as usize],
                early_descriptors,
                finished_waiting: 0,
                oldest_open: 0,
                failure_record: None,
            }),
            failed: AtomicBool::new(false),
            aborts_posted: AtomicU32::new(0),
            first_error: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            timeout: parts.timeout,
            uses_fabric: world > 1,
            doorbell_wakes,
            crowded: std::thread::available_parallelism().map_or(true, |cores| {
                cores.get() < topology.devices_per_machine() as usize
            }),
            waiters: AtomicU32::new(0),
            wait_entries: AtomicU64::new(0),
            outstanding: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            last_wait_end: AtomicU64::new(0),
            epoch: Instant::now(),
            park_bell: Doorbell::new(),
        }
    }

    /// The first error, if the engine has failed.
    pub(crate) fn failure(&self) -> Option<Error> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.first_error).clone()
    }

    /// Queues an operation. The caller has taken its table entry.
    pub(crate) fn submit(&self, sub: Submission) -> Result<()> {
        if let Some(e) = self.failure() {
            return Err(Error::Failed { first: Box::new(e) });
        }
        self.outstanding.fetch_add(1, Ordering::AcqRel);
        if self.submissions.push(sub).is_err() {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
            // Cannot happen: the table bounds the operations outstanding.
            return Err(Error::invalid(
                "operation",
                "too many operations outstanding",
            ));
        }
        // Pairs with the fence in `run` after unparking: either the progress
        // thread sees this submission when it drives, or this sees it unparked.
        fence(Ordering::SeqCst);
        if !self.parked.load(Ordering::Relaxed) {
            self.local.doorbell().ring();
        } else if self.waiters.load(Ordering::Acquire) == 0
            && self
                .nanos()
                .saturating_sub(u128::from(self.last_wait_end.load(Ordering::Relaxed)))
                > UNATTENDED.as_nanos()
        {
            self.park_bell.ring();
        }
        Ok(())
    }

    /// Nanoseconds since the engine started.
    fn nanos(&self) -> u128 {
        self.epoch.elapsed().as_nanos()
    }

    /// Marks operation `seq` finished.
    fn complete(&self, seq: u64, state: u32) {
        if self.works.finish(seq, state) {
            self.outstanding.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Fails the engine: every pending operation fails with `error`, and nothing
    /// touches a caller's memory afterwards.
    pub(crate) fn fail(&self, error: Error) {
        let mut d = lock(&self.driver);
        self.fail_locked(&mut d, error);
    }

    fn fail_locked(&self, d: &mut Driver, error: Error) {
        let record = d
            .failure_record
            .take()
            .unwrap_or_else(|| Failure::encode(&error, self.rank));
        {
            let mut first = lock(&self.first_error);
            if first.is_none() {
                log::error!("fairring rank {}: {error}", self.rank);
                *first = Some(error);
            }
        }
        if !self.failed.swap(true, Ordering::AcqRel) {
            // The first failure: tell the local ranks and every linked peer, so
            // that none of them waits for this rank (see `descriptor`).
            let mut words = [0u64; FAILURE_BYTES / 8];
            for (w, chunk) in words.iter_mut().zip(record.chunks_exact(8)) {
                let mut b = [0u8; 8];
                b.copy_from_slice(chunk);
                *w = u64::from_le_bytes(b);
            }
            self.local.fail(words);
            // A queue full of the operation's data drains on its own (the
            // fabric's threads send it): retry briefly rather than leave a peer
            // to learn of the failure only from the connection closing.
            let deadline = Instant::now() + Duration::from_millis(500);
            for &p in &self.linked {
                let imm = tags::immediate(Kind::Abort, 0, 0);
                loop {
                    match self
                        .fabric
                        .send_message(p, imm, &record, tags::token(Kind::Abort, 0, 0))
                    {
                        Ok(()) => {
                            self.aborts_posted.fetch_add(1, Ordering::AcqRel);
                            break;
                        }
                        Err(FabricError::QueueFull { .. }) if Instant::now() < deadline => {
                            std::thread::yield_now();
                        }
                        Err(_) => break,
                    }
                }
            }
        }
        while let Some(sub) = self.submissions.pop() {
            self.complete(sub.seq, FAILED);
        }
        for r in d.records.iter_mut() {
            if let Some(rec) = r.take() {
                self.complete(rec.sub.seq, FAILED);
            }
        }
        for s in &mut d.slots {
            s.active = None;
            s.pending.clear();
        }
        self.local.doorbell().ring();
    }

    /// Drives if the driver is free; returns whether anything moved.
    pub(crate) fn try_drive(&self) -> bool {
        match self.driver.try_lock() {
            Ok(mut d) => self.drive_locked(&mut d),
            Err(std::sync::TryLockError::Poisoned(p)) => self.drive_locked(&mut p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => false,
        }
    }

    fn drive_locked(&self, d: &mut Driver) -> bool {
        if self.failed.load(Ordering::Acquire) {
            return false;
        }
        match self.drive(d) {
            Ok(true) => {
                d.last_progress = Instant::now();
                true
            }
            Ok(false) => {
                if self.in_flight(d) && d.last_progress.elapsed() > self.timeout {
                    let what = self.describe_stall(d);
                    self.fail_locked(d, Error::timeout(what, self.timeout));
                } else if !self.in_flight(d) {
                    d.last_progress = Instant::now();
                }
                false
            }
            Err(e) => {
                self.fail_locked(d, e);
                true
            }
        }
    }

    /// A linked peer that left before operation `seq`.
    fn departed_before(&self, d: &Driver, seq: u64) -> Option<(u32, u64)> {
        d.departed.iter().enumerate().find_map(|(p, a)| {
            a.filter(|&after| after <= seq)
                .map(|after| (u32::try_from(p).unwrap_or(u32::MAX), after))
        })
    }

    fn in_flight(&self, d: &Driver) -> bool {
        d.start_seq < d.accepted
            || d.finished_waiting > 0
            || d.slots.iter().any(|s| s.active.is_some())
    }

    /// The global rank of local rank `device` of this machine.
    fn local_to_global(&self, device: u32) -> u32 {
        self.topology
            .rank(Location {
                machine: self.location.machine,
                device,
            })
            .unwrap_or(u32::MAX)
    }

    fn list(ranks: &[u32]) -> String {
        ranks
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Ranks that have not issued operation `seq` as far as this rank knows.
    fn not_issued(&self, d: &Driver, seq: u64) -> Vec<u32> {
        let local = (0..self.local.local_size())
            .filter(|&r| r != self.location.device && self.local.operation(r, seq).is_none())
            .map(|r| self.local_to_global(r));
        let remote = self
            .remote_in
            .iter()
            .copied()
            .filter(|&p| d.confirmed[p as usize] <= seq);
        local.chain(remote).collect()
    }

    fn describe_stall(&self, d: &Driver) -> String {
        let oldest = d
            .slots
            .iter()
            .enumerate()
            .filter_map(|(b, s)| s.active.map(|a| (b, a)))
            .min_by_key(|(_, a)| a.number);
        if let Some((b, a)) = oldest {
            let lagging: Vec<u32> = match a.phase {
                Phase::ReduceScatter | Phase::AllGather => self
                    .local
                    .laggards(u32::try_from(b).unwrap_or(0), a.number)
                    .into_iter()
                    .filter(|&r| r != self.location.device)
                    .map(|r| self.local_to_global(r))
                    .collect(),
                _ => Vec::new(),
            };
            let waits = if lagging.is_empty() {
                format!(
                    "no data from the ranks it exchanges with (rank(s) {} write to this one)",
                    Self::list(&self.inbound)
                )
            } else {
                format!("local rank(s) {} to do their part", Self::list(&lagging))
            };
            return format!(
                "slice {} of operation #{} ({}) to leave phase {:?}: {waits}",
                a.number, a.seq, a.algorithm, a.phase
            );
        }
        let seq = if d.local_checked < d.accepted {
            d.local_checked
        } else {
            d.oldest_open
        };
        let missing = self.not_issued(d, seq);
        if missing.is_empty() {
            format!("a staging buffer for operation #{}", d.start_seq)
        } else {
            format!(
                "rank(s) {} to issue operation #{seq} (or a peer skipped a call)",
                Self::list(&missing)
            )
        }
    }

    fn drive(&self, d: &mut Driver) -> Result<bool> {
        if let Some((device, words)) = self.local.failure()
            && device != self.location.device
        {
            let mut record = [0u8; FAILURE_BYTES];
            for (chunk, w) in record.chunks_exact_mut(8).zip(words) {
                chunk.copy_from_slice(&w.to_le_bytes());
            }
            d.failure_record = Some(record);
            return Err(Failure::decode(&record, self.local_to_global(device)));
        }
        let mut progressed = false;
        while let Some(sub) = self.submissions.pop() {
            progressed = true;
            self.accept(d, sub)?;
        }
        progressed |= self.check_local(d)?;
        if self.uses_fabric {
            loop {
                let mut batch = std::mem::take(&mut d.completions);
                let n = self.fabric.poll(&mut batch);
                let result = batch[..n]
                    .iter()
                    .try_for_each(|c| self.on_completion(d, *c));
                d.completions = batch;
                result?;
                progressed |= n > 0;
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        self.send_credits(d);
        self.send_descriptors(d);
        if d.finished_waiting > 0 {
            self.complete_checked(d);
        }
        while self.try_start(d)? {
            progressed = true;
        }
        for b in 0..self.buffers {
            progressed |= self.advance(d, b)?;
        }
        Ok(progressed)
    }

    /// Handles completions the progress thread took while waiting.
    fn handle_locked(&self, d: &mut Driver, completions: &[Completion]) {
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        let result = completions
            .iter()
            .try_for_each(|c| self.on_completion(d, *c));
        if let Err(e) = result {
            self.fail_locked(d, e);
        } else {
            d.last_progress = Instant::now();
            self.drive_locked(d);
        }
    }

    fn accept(&self, d: &mut Driver, sub: Submission) -> Result<()> {
        if sub.seq != d.accepted {
            return Err(Error::invalid("operation", "submissions out of order"));
        }
        if let Some((peer, after)) = self.departed_before(d, sub.seq) {
            return Err(Error::peer(
                peer,
                format!(
                    "left the job after {after} operations; operation {} cannot run",
                    sub.seq
                ),
            ));
        }
        if sub.algorithm == Algorithm::Auto {
            return Err(Error::invalid(
                "algorithm",
                "auto reached the engine unresolved",
            ));
        }
        d.accepted += 1;
        let plan = Plan::new(&self.geometry, sub.dtype, sub.elements, d.rotation)
            .map_err(|e| Error::invalid("tensor", e.to_string()))?;
        if sub.algorithm == Algorithm::Hierarchical {
            d.rotation = plan.next_rotation();
        }
        let idx = work::slot_of(sub.seq);
        d.records[idx] = Some(Record {
            sub,
            plan,
            slices_done: 0,
            finished: false,
        });
        let words = sub.descriptor.words();
        d.own[idx] = words;
        self.local.publish_operation(sub.seq, words);
        for i in 0..self.remote_in.len() {
            let p = self.remote_in[i] as usize;
            if let Some(&(seq, theirs)) = d.early_descriptors[p].front()
                && seq == sub.seq
            {
                d.early_descriptors[p].pop_front();
                self.compare(d, seq, self.remote_in[i], theirs)?;
                d.confirmed[p] = seq + 1;
            }
        }
        self.send_descriptors(d);
        Ok(())
    }

    /// Checks operation `seq` against a peer's descriptor of it.
    fn compare(&self, d: &mut Driver, seq: u64, peer: u32, theirs: Words) -> Result<()> {
        let ours = d.own[work::slot_of(seq)];
        if ours == theirs {
            return Ok(());
        }
        let (record, error) = Failure::mismatch(seq, self.rank, ours, peer, theirs);
        d.failure_record = Some(record);
        Err(error)
    }

    /// Checks accepted operations against every local rank's descriptor, in
    /// order, as far as the local ranks have published them.
    fn check_local(&self, d: &mut Driver) -> Result<bool> {
        let mut progressed = false;
        while d.local_checked < d.accepted {
            let seq = d.local_checked;
            for r in (0..self.local.local_size()).filter(|&r| r != self.location.device) {
                match self.local.operation(r, seq) {
                    None => return Ok(progressed),
                    Some(theirs) => self.compare(d, seq, self.local_to_global(r), theirs)?,
                }
            }
            d.local_checked += 1;
            progressed = true;
            if d.finished_waiting > 0 {
                self.try_complete(d, seq);
            }
        }
        Ok(progressed)
    }

    /// A remote peer's descriptor of operation `seq`.
    fn on_descriptor(&self, d: &mut Driver, peer: u32, seq: u64, theirs: Words) -> Result<()> {
        let p = peer as usize;
        let expected = d.confirmed[p] + d.early_descriptors[p].len() as u64;
        if !self.remote_in.contains(&peer) || seq != expected {
            return Err(Error::peer(
                peer,
                format!(
                    "sent the descriptor of operation #{seq} out of order (expected #{expected})"
                ),
            ));
        }
        if seq < d.accepted {
            self.compare(d, seq, peer, theirs)?;
            d.confirmed[p] = seq + 1;
            if d.finished_waiting > 0 {
                self.try_complete(d, seq);
            }
        } else if d.early_descriptors[p].len() < WORK_CAPACITY {
            d.early_descriptors[p].push_back((seq, theirs));
        } else {
            return Err(Error::peer(
                peer,
                format!("is more than {WORK_CAPACITY} operations ahead of this rank"),
            ));
        }
        Ok(())
    }

    /// Sends the descriptors of accepted operations, in order, to every remote
    /// rank this rank writes to. A write of operation `s` to such a rank waits
    /// until the descriptor of `s` is out (see `flush`).
    fn send_descriptors(&self, d: &mut Driver) {
        for &peer in &self.remote_out {
            let p = peer as usize;
            while d.descriptors_sent[p] < d.accepted {
                if d.departed[p].is_some() {
                    d.descriptors_sent[p] = d.accepted;
                    break;
                }
                let seq = d.descriptors_sent[p];
                let w = d.own[work::slot_of(seq)];
                let mut payload = [0u8; 24];
                payload[..8].copy_from_slice(&seq.to_le_bytes());
                payload[8..16].copy_from_slice(&w[0].to_le_bytes());
                payload[16..].copy_from_slice(&w[1].to_le_bytes());
                let sent = self.fabric.send_message(
                    peer,
                    tags::immediate(Kind::Descriptor, 0, 0),
                    &payload,
                    tags::token(Kind::Descriptor, 0, 0),
                );
                match sent {
                    Ok(()) => d.descriptors_sent[p] += 1,
                    Err(FabricError::QueueFull { .. }) => break,
                    // As for credits: a failed peer's failure arrives as its own
                    // completion.
                    Err(e) => {
                        log::debug!(
                            "fairring rank {}: descriptor to rank {peer} not sent: {e}",
                            self.rank
                        );
                        d.descriptors_sent[p] = d.accepted;
                    }
                }
            }
        }
    }

    /// Whether every check of operation `seq` has passed.
    fn checked(&self, d: &Driver, seq: u64) -> bool {
        d.local_checked > seq
            && self
                .remote_in
                .iter()
                .all(|&p| d.confirmed[p as usize] > seq)
            && self
                .remote_out
                .iter()
                .all(|&p| d.descriptors_sent[p as usize] > seq)
    }

    /// Every slice of operation `seq` is done: complete it once it is checked.
    fn finish_operation(&self, d: &mut Driver, seq: u64) {
        if let Some(rec) = d.records[work::slot_of(seq)].as_mut()
            && rec.sub.seq == seq
            && !rec.finished
        {
            rec.finished = true;
            d.finished_waiting += 1;
            self.try_complete(d, seq);
        }
    }

    /// Completes operation `seq` if it is finished and checked.
    fn try_complete(&self, d: &mut Driver, seq: u64) {
        let idx = work::slot_of(seq);
        let Some(rec) = d.records[idx] else {
            return;
        };
        if rec.sub.seq != seq || !rec.finished || !self.checked(d, seq) {
            return;
        }
        if let Some(out) = rec.sub.deliver {
            // SAFETY: the submitting call's contract: `data` holds the result's
            // bytes and `out.to` is valid for `out.len` bytes, both untouched by
            // the caller until the operation completes; the range lies within
            // the result (checked at submission).
            let from = rec.sub.data.wrapping_add(out.offset);
            // SAFETY: (see above.)
            unsafe { std::ptr::copy_nonoverlapping(from, out.to, out.len) };
        }
        d.records[idx] = None;
        d.finished_waiting -= 1;
        self.complete(seq, DONE);
        self.local.doorbell().ring();
    }

    /// Completes every finished operation whose checks have passed since.
    fn complete_checked(&self, d: &mut Driver) {
        while d.oldest_open < d.accepted && d.records[work::slot_of(d.oldest_open)].is_none() {
            d.oldest_open += 1;
        }
        for seq in d.oldest_open..d.accepted {
            if d.finished_waiting == 0 {
                break;
            }
            self.try_complete(d, seq);
        }
    }

    /// Starts the next slice if its buffer is free here and on this machine.
    fn try_start(&self, d: &mut Driver) -> Result<bool> {
        // Skip finished (empty) operations.
        loop {
            if d.start_seq >= d.accepted {
                return Ok(false);
            }
            let idx = work::slot_of(d.start_seq);
            let Some(rec) = d.records[idx] else {
                d.start_seq += 1;
                continue;
            };
            if rec.plan.slice_count() == 0 {
                d.start_seq += 1;
                d.start_index = 0;
                self.finish_operation(d, rec.sub.seq);
                continue;
            }
            break;
        }
        let idx = work::slot_of(d.start_seq);
        let Some(rec) = d.records[idx] else {
            return Ok(false);
        };
        // No data of an operation is combined before every local rank has
        // issued the same one.
        if d.local_checked <= d.start_seq {
            return Ok(false);
        }
        let number = d.next_slice;
        let b = self.buffer_of(number);
        let generation = number / u64::from(self.buffers);
        let slot = &d.slots[b as usize];
        if slot.active.is_some() || !self.local.buffer_free(b, number) {
            return Ok(false);
        }
        // The ring runs one slice at a time for now. Corrupted chunks seen with
        // several ring slices in flight came from completions handled out of
        // order (the progress thread handled a batch it had taken after a waiting
        // caller handled later ones); that is fixed in `run`, but running ring
        // slices concurrently again waits for a stress run that shows it correct.
        if rec.sub.algorithm == Algorithm::Ring
            && d.slots
                .iter()
                .any(|s| s.active.is_some_and(|a| a.algorithm == Algorithm::Ring))
        {
            return Ok(false);
        }
        let slice = rec
            .plan
            .slice(d.start_index)
            .map_err(|e| Error::invalid("slice", e.to_string()))?;
        let algorithm = rec.sub.algorithm;
        let role = match algorithm {
            Algorithm::Ring => fairring_core::staging::Role::IDLE,
            Algorithm::Hierarchical | Algorithm::Auto => slice
                .role(self.location)
                .map_err(|e| Error::invalid("slice", e.to_string()))?,
        };
        d.slots[b as usize]
            .state
            .acquire(generation, role)
            .map_err(|e| Error::invalid("staging buffer", e.to_string()))?;
        // Stage the caller's bytes in.
        let range = self.tensor_range(&slice);
        let start = rec.sub.data.wrapping_add(range.start).cast_const();
        // SAFETY: the submitting call's contract: `data` is valid for the tensor's
        // bytes and untouched by the caller until the operation completes; `range`
        // lies within them (the plan's slices tile the tensor).
        let input = unsafe { std::slice::from_raw_parts(start, range.len()) };
        match algorithm {
            Algorithm::Ring => self.staging(b, 0..input.len()).copy_from_slice(input),
            Algorithm::Hierarchical | Algorithm::Auto => {
                self.local.stage_in(b, number, &slice, input)?;
            }
        }
        d.slots[b as usize].active = Some(Active {
            number,
            generation,
            seq: rec.sub.seq,
            slice,
            algorithm,
            phase: Phase::ReduceScatter,
            next_contribution: 0,
            contributing: false,
            ring: ring::RingProgress::default(),
        });
        d.next_slice += 1;
        d.start_index += 1;
        if d.start_index == rec.plan.slice_count() {
            d.start_seq += 1;
            d.start_index = 0;
        }
        match algorithm {
            Algorithm::Hierarchical | Algorithm::Auto => {
                let early = std::mem::take(&mut d.slots[b as usize].early_contributions);
                for _ in 0..early {
                    self.staging_event(d, b, Event::ContributionReceived)?;
                }
            }
            Algorithm::Ring => {
                let early = std::mem::take(&mut d.slots[b as usize].early_ring);
                if let Some(a) = d.slots[b as usize].active.as_mut() {
                    a.ring.arrived_early(early);
                }
                self.ring_start(d, b)?;
            }
        }
        Ok(true)
    }

    /// The staging buffer of slice `number`.
    fn buffer_of(&self, number: u64) -> u32 {
        #[expect(clippy::cast_possible_truncation, reason = "below the buffer count")]
        let b = (number % u64::from(self.buffers)) as u32;
        b
    }

    /// The operation a slice belongs to.
    pub(crate) fn record_of(&self, d: &Driver, a: &Active) -> Result<Record> {
        d.records[work::slot_of(a.seq)]
            .ok_or_else(|| Error::invalid("operation", "slice of a finished operation"))
    }

    /// The slice holding buffer `b`, and its operation.
    pub(crate) fn active_record(&self, d: &Driver, b: u32) -> Result<(Active, Record)> {
        let a = d.slots[b as usize]
            .active
            .ok_or_else(|| Error::invalid("staging buffer", format!("buffer {b} is idle")))?;
        Ok((a, self.record_of(d, &a)?))
    }

    /// The slice's byte range in the caller's tensor.
    pub(crate) fn tensor_range(&self, slice: &Slice) -> std::ops::Range<usize> {
        let span = slice.span();
        let start = usize::try_from(span.byte_offset()).unwrap_or(usize::MAX);
        let end = usize::try_from(span.byte_end()).unwrap_or(usize::MAX);
        start..end
    }

    /// The caller's bytes of the slice in buffer `b`.
    #[expect(clippy::mut_from_ref, reason = "exclusive by the submission contract")]
    pub(crate) fn output<'d>(&self, d: &'d Driver, b: u32) -> Option<&'d mut [u8]> {
        let a = d.slots[b as usize].active?;
        let rec = d.records[work::slot_of(a.seq)]?;
        let range = self.tensor_range(&a.slice);
        // SAFETY: as in `try_start`: the operation is pending, so its memory is
        // valid and the caller does not touch it; only the driver (whose lock the
        // caller holds) writes it, one slice range at a time.
        let start = rec.sub.data.wrapping_add(range.start);
        // SAFETY: (see above.)
        Some(unsafe { std::slice::from_raw_parts_mut(start, range.len()) })
    }

    /// This rank's staging buffer `b`, bytes `range`.
    #[expect(clippy::mut_from_ref, reason = "exclusive by the engine's protocol")]
    pub(crate) fn staging(&self, b: u32, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            range.end <= self.layout.buffer_bytes,
            "range outside the buffer"
        );
        // SAFETY: in bounds (asserted). The driver lock is held by the caller, and
        // by the engine's protocol no peer writes and no local rank reads these
        // bytes while the driver works on them (see `local` and the flow-control
        // section above).
        let start = self.local.staging(b).as_ptr().wrapping_add(range.start);
        // SAFETY: (see above.)
        unsafe { std::slice::from_raw_parts_mut(start, range.len()) }
    }

    /// Offset of buffer `b` in a rank's staging area.
    pub(crate) fn buffer_offset(&self, b: u32) -> usize {
        b as usize * self.local.buffer_bytes()
    }

    fn advance(&self, d: &mut Driver, b: u32) -> Result<bool> {
        let Some(a) = d.slots[b as usize].active else {
            return Ok(false);
        };
        let mut progressed = self.flush(d, b)?;
        match a.algorithm {
            Algorithm::Ring => progressed |= self.ring_advance(d, b)?,
            Algorithm::Hierarchical | Algorithm::Auto => {
                progressed |= self.hierarchical_advance(d, b, a)?;
            }
        }
        Ok(progressed)
    }

    /// Reports `event` on buffer `b` and performs the actions it hands out.
    pub(crate) fn staging_event(&self, d: &mut Driver, b: u32, event: Event) -> Result<()> {
        let Some(a) = d.slots[b as usize].active else {
            return Err(Error::invalid(
                "staging buffer",
                format!("{event} on an idle buffer {b}"),
            ));
        };
        let actions = d.slots[b as usize]
            .state
            .on_event(event, a.generation)
            .map_err(|e| Error::invalid("staging buffer", e.to_string()))?;
        self.perform(d, b, actions)
    }

    fn perform(&self, d: &mut Driver, b: u32, actions: Actions) -> Result<()> {
        if actions.contains(Actions::RELEASE) {
            return self.release(d, b);
        }
        if actions.is_empty() {
            return Ok(());
        }
        self.hierarchical_actions(d, b, actions)
    }

    /// The slice in `b` is finished: count it, free the buffer, send credits.
    pub(crate) fn release(&self, d: &mut Driver, b: u32) -> Result<()> {
        let Some(a) = d.slots[b as usize].active.take() else {
            return Ok(());
        };
        let idx = work::slot_of(a.seq);
        if let Some(rec) = d.records[idx].as_mut() {
            rec.slices_done += 1;
            if rec.slices_done == rec.plan.slice_count() {
                self.finish_operation(d, a.seq);
            }
        }
        // Advance the release watermark and credit the writers.
        while d.released < d.next_slice {
            let w = d.released;
            let held = d.slots[self.buffer_of(w) as usize]
                .active
                .is_some_and(|x| x.number == w);
            if held {
                break;
            }
            d.released += 1;
        }
        let limit = d.released + u64::from(self.buffers);
        if limit > d.credited {
            d.credited = limit;
            self.send_credits(d);
        }
        Ok(())
    }

    /// Sends the current credit limit to every inbound peer that has not had it.
    /// One the fabric's queue has no room for is sent on a later pass (credits are
    /// cumulative: the latest says everything the earlier ones did).
    fn send_credits(&self, d: &mut Driver) {
        let payload = d.credited.to_le_bytes();
        for &peer in &self.inbound {
            let p = peer as usize;
            if d.credit_sent[p] >= d.credited {
                continue;
            }
            if d.departed[p].is_some() {
                d.credit_sent[p] = d.credited;
                continue;
            }
            let sent = self.fabric.send_message(
                peer,
                tags::immediate(Kind::Credit, 0, 0),
                &payload,
                tags::token(Kind::Credit, 0, 0),
            );
            match sent {
                Ok(()) => d.credit_sent[p] = d.credited,
                Err(FabricError::QueueFull { .. }) => {}
                // A peer that cannot take a credit has left (its goodbye may not
                // be polled yet) or failed; a failure arrives as its own
                // completion and fails the engine there, with the peer's reason.
                Err(e) => {
                    d.credit_sent[p] = d.credited;
                    log::debug!(
                        "fairring rank {}: credit to rank {peer} not sent: {e}",
                        self.rank
                    );
                }
            }
        }
    }

    /// Posts `w` now if nothing waits before it and the peer has room; else queues it.
    pub(crate) fn post(&self, d: &mut Driver, b: u32, w: PendingWrite) -> Result<()> {
        d.slots[b as usize].pending.push(w);
        self.flush(d, b).map(drop)
    }

    /// Posts queued writes of buffer `b` in order while they can go.
    fn flush(&self, d: &mut Driver, b: u32) -> Result<bool> {
        let mut posted = 0;
        let slot = &d.slots[b as usize];
        let seq = slot.active.map_or(0, |a| a.seq);
        for w in &slot.pending {
            if let Some(s) = w.credit_for
                && d.credit[w.peer as usize] <= s
            {
                break;
            }
            // A remote peer reads this operation's descriptor before its data.
            if d.descriptors_sent[w.peer as usize] <= seq && self.remote_out.contains(&w.peer) {
                break;
            }
            let target = self.remote[w.peer as usize]
                .ok_or_else(|| Error::peer(w.peer, "no staging region known for this peer"))?;
            let request = WriteRequest {
                source: &self.region,
                source_offset: w.source,
                len: w.len,
                target,
                target_offset: w.target,
                immediate: w.immediate,
                token: w.token,
            };
            match self.fabric.write(w.peer, request) {
                Ok(()) => posted += 1,
                Err(FabricError::QueueFull { .. }) => break,
                // The peer's failure also arrives as a completion, after whatever
                // it sent before failing (a failure report, a goodbye): the engine
                // fails there, with the peer's reason, and not here first.
                Err(FabricError::PeerFailed { .. }) => break,
                Err(e) => return Err(Error::from(e)),
            }
        }
        d.slots[b as usize].pending.drain(..posted);
        Ok(posted > 0)
    }

    fn on_completion(&self, d: &mut Driver, c: Completion) -> Result<()> {
        match c.event {
            CompletionEvent::Landed { len, immediate } => {
                let (kind, b, g) = tags::parse_immediate(immediate)
                    .filter(|&(_, b, _)| b < self.buffers)
                    .ok_or_else(|| {
                        Error::peer(
                            c.peer,
                            format!("a write with unknown immediate {immediate:#x}"),
                        )
                    })?;
                self.on_landed(d, c.peer, kind, b, g, len)
            }
            CompletionEvent::Sent { token } => {
                let (kind, b, g) = tags::parse_token(token)
                    .ok_or_else(|| Error::invalid("token", format!("unknown token {token:#x}")))?;
                if matches!(
                    kind,
                    Kind::Credit | Kind::Bye | Kind::Descriptor | Kind::Abort
                ) {
                    return Ok(());
                }
                let Some(a) = d.slots.get(b as usize).and_then(|s| s.active) else {
                    return Err(Error::invalid(
                        "token",
                        format!("a send completed for idle buffer {b}"),
                    ));
                };
                if a.generation != g {
                    return Err(Error::invalid(
                        "token",
                        format!(
                            "a send of generation {g} completed on buffer {b} at generation {}",
                            a.generation
                        ),
                    ));
                }
                match kind {
                    Kind::Contribution => self.staging_event(d, b, Event::ContributionSent),
                    Kind::Result => self.staging_event(d, b, Event::ResultSent),
                    _ => self.ring_sent(d, b),
                }
            }
            CompletionEvent::Message(m) => {
                let kind = tags::parse_immediate(m.immediate).map(|t| t.0);
                if kind == Some(Kind::Descriptor)
                    && let Ok(p) = <[u8; 24]>::try_from(m.payload())
                {
                    let word = |i: usize| {
                        let mut w = [0u8; 8];
                        w.copy_from_slice(&p[i * 8..i * 8 + 8]);
                        u64::from_le_bytes(w)
                    };
                    return self.on_descriptor(d, c.peer, word(0), [word(1), word(2)]);
                }
                if kind == Some(Kind::Abort)
                    && let Ok(record) = <[u8; FAILURE_BYTES]>::try_from(m.payload())
                {
                    d.failure_record = Some(record);
                    return Err(Failure::decode(&record, c.peer));
                }
                let payload: Option<[u8; 8]> = m.payload().try_into().ok();
                match (kind, payload) {
                    (Some(Kind::Credit), Some(p)) => {
                        let limit = u64::from_le_bytes(p);
                        let c_ = &mut d.credit[c.peer as usize];
                        *c_ = (*c_).max(limit);
                        Ok(())
                    }
                    (Some(Kind::Bye), Some(p)) => {
                        let after = u64::from_le_bytes(p);
                        d.departed[c.peer as usize] = Some(after);
                        match self.departed_before(d, d.accepted) {
                            Some((peer, after)) if d.accepted > after => Err(Error::peer(
                                peer,
                                format!(
                                    "left the job after {after} operations; this rank has issued {}",
                                    d.accepted
                                ),
                            )),
                            _ => Ok(()),
                        }
                    }
                    _ => Err(Error::peer(
                        c.peer,
                        format!("an unknown message (immediate {:#x})", m.immediate),
                    )),
                }
            }
            CompletionEvent::SendFailed { failure, .. }
            | CompletionEvent::PeerFailed { failure } => {
                if d.departed[c.peer as usize].is_some() {
                    // It said goodbye first: everything it owed this rank arrived
                    // before its connection closed.
                    return Ok(());
                }
                Err(Error::peer(c.peer, failure.to_string()))
            }
            _ => Ok(()),
        }
    }

    fn on_landed(
        &self,
        d: &mut Driver,
        peer: u32,
        kind: Kind,
        b: u32,
        g: u64,
        len: u64,
    ) -> Result<()> {
        let slot = &mut d.slots[b as usize];
        let current = slot
            .active
            .filter(|a| tags::same_generation(a.generation, g));
        match (kind, current) {
            (Kind::Contribution, Some(a)) if a.algorithm == Algorithm::Hierarchical => {
                self.staging_event(d, b, Event::ContributionReceived)
            }
            (Kind::Result, Some(a)) if a.algorithm == Algorithm::Hierarchical => {
                self.staging_event(d, b, Event::ResultReceived)
            }
            (Kind::RingReduce, Some(a)) if a.algorithm == Algorithm::Ring => {
                self.ring_landed(d, b, false)
            }
            (Kind::RingGather, Some(a)) if a.algorithm == Algorithm::Ring => {
                self.ring_landed(d, b, true)
            }
            (Kind::Contribution | Kind::RingReduce, None)
                if slot.active.is_none()
                    && tags::same_generation(slot.state.load().generation(), g) =>
            {
                if kind == Kind::Contribution {
                    slot.early_contributions += 1;
                } else {
                    slot.early_ring += 1;
                }
                Ok(())
            }
            _ => Err(Error::peer(
                peer,
                format!(
                    "a {kind:?} write of {len} bytes for generation {g} of buffer {b} that no slice here expects \
                     (the ranks' operations differ, or the peer broke the protocol)"
                ),
            )),
        }
    }

    /// Tells every linked peer this rank leaves after `operations` operations,
    /// and waits (briefly) until the goodbyes are out; after a failure, waits
    /// instead (as briefly) until the failure messages are out, so that peers
    /// learn why before they see the connections close. The progress thread must
    /// have stopped.
    pub(crate) fn say_goodbye(&self, operations: u64, peers: &[u32]) {
        if self.failed.load(Ordering::Acquire) {
            self.await_sends(Kind::Abort, self.aborts_posted.load(Ordering::Acquire));
            return;
        }
        let payload = operations.to_le_bytes();
        let mut outstanding = 0;
        for &p in peers {
            let imm = tags::immediate(Kind::Bye, 0, 0);
            if self
                .fabric
                .send_message(p, imm, &payload, tags::token(Kind::Bye, 0, 0))
                .is_ok()
            {
                outstanding += 1;
            }
        }
        self.await_sends(Kind::Bye, outstanding);
    }

    /// Waits up to 2 s for `outstanding` posts of `kind` to be sent (or to fail).
    fn await_sends(&self, kind: Kind, mut outstanding: u32) {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut batch = [NO_COMPLETION; 16];
        while outstanding > 0 && Instant::now() < deadline {
            let n = self.fabric.wait(&mut batch, Duration::from_millis(10));
            for c in &batch[..n] {
                match c.event {
                    CompletionEvent::Sent { token } | CompletionEvent::SendFailed { token, .. }
                        if tags::parse_token(token).is_some_and(|t| t.0 == kind) =>
                    {
                        outstanding -= 1;
                    }
                    _ => {}
                }
            }
        }
    }

    /// Tells the progress thread to stop, and wakes it wherever it sleeps
    /// (parked, or on the doorbell), so that it returns at once.
    pub(crate) fn stop_progress(&self) {
        self.shutdown.store(true, Ordering::Release);
        self.park_bell.ring();
        self.local.doorbell().ring();
    }

    /// Parks the progress thread while callers drive; returns whether it was
    /// parked.
    fn park_if_callers_drive(&self) -> bool {
        if self.waiters.load(Ordering::Acquire) == 0 && !self.parked.load(Ordering::Relaxed) {
            return false;
        }
        self.parked.store(true, Ordering::Relaxed);
        let entries = self.wait_entries.load(Ordering::Acquire);
        let seen = self.park_bell.seen();
        self.park_bell.sleep(seen, PARK);
        let rung = self.park_bell.seen() != seen;
        if self.waiters.load(Ordering::Acquire) == 0
            && (rung || self.wait_entries.load(Ordering::Acquire) == entries)
        {
            self.parked.store(false, Ordering::Relaxed);
            // Pairs with the fence in `submit`.
            fence(Ordering::SeqCst);
        }
        true
    }

    /// The progress thread's loop.
    ///
    /// While callers wait (and so drive), the progress thread **parks**: it sleeps
    /// on a bell of its own, which no doorbell, submission or completion rings,
    /// so that a small blocking all-reduce runs on one thread per process and never
    /// competes with its own progress thread for a core. It looks again every
    /// [`PARK`], and unparks once no caller has entered [`Engine::wait`] since its
    /// last look, or at once when the last waiter leaves with work outstanding or
    /// a submission comes [`UNATTENDED`] after the last wait returned. A
    /// submission sooner than that (a caller in a loop of blocking calls) is
    /// driven by the caller's wait, or by the progress thread within `2 * PARK`.
    pub(crate) fn run(&self) {
        let mut batch = vec![NO_COMPLETION; POLL_BATCH];
        let mut idle_since: Option<Instant> = None;
        while !self.shutdown.load(Ordering::Acquire) {
            if self.doorbell_wakes && self.park_if_callers_drive() {
                idle_since = None;
                continue;
            }
            let seen = self.local.doorbell().seen();
            if self.try_drive() {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if spin_a_little(since, SPIN, self.crowded) {
                continue;
            }
            let busy = !self.failed.load(Ordering::Acquire) && {
                let d = lock(&self.driver);
                self.in_flight(&d)
            };
            if busy && !self.doorbell_wakes {
                // Completions are taken and handled under the driver lock, so that
                // no other driver handles later ones first: the ring counts one
                // peer's landings in the order they arrive.
                let mut d = lock(&self.driver);
                let n = self.fabric.wait(&mut batch, Duration::from_micros(200));
                if n > 0 {
                    self.handle_locked(&mut d, &batch[..n]);
                    idle_since = None;
                }
            } else {
                let nap = if busy {
                    Duration::from_millis(1)
                } else {
                    Duration::from_millis(50)
                };
                self.local.doorbell().sleep(seen, nap);
            }
        }
    }

    /// Waits for operation `seq` to finish, driving while the driver is free.
    pub(crate) fn wait(&self, seq: u64, timeout: Option<Duration>) -> Result<bool> {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        self.wait_entries.fetch_add(1, Ordering::AcqRel);
        let result = self.wait_driving(seq, timeout);
        self.last_wait_end.store(
            u64::try_from(self.nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if self.waiters.fetch_sub(1, Ordering::AcqRel) == 1
            && self.outstanding.load(Ordering::Acquire) > 0
        {
            // Work is left that nobody waits for: hand it to the progress thread.
            self.park_bell.ring();
        }
        result
    }

    /// Whether operation `seq` has finished; its error if it failed.
    pub(crate) fn test(&self, seq: u64) -> Result<bool> {
        match self.works.state(seq) {
            Some(DONE) | None => Ok(true),
            Some(FAILED) => Err(self.failure().unwrap_or(Error::Aborted)),
            _ => Ok(false),
        }
    }

    fn wait_driving(&self, seq: u64, timeout: Option<Duration>) -> Result<bool> {
        let start = Instant::now();
        let mut idle_since: Option<Instant> = None;
        loop {
            if self.test(seq)? {
                return Ok(true);
            }
            if timeout.is_some_and(|t| start.elapsed() >= t) {
                return Ok(false);
            }
            let seen = self.local.doorbell().seen();
            if self.try_drive() {
                idle_since = None;
                continue;
            }
            let since = *idle_since.get_or_insert_with(Instant::now);
            if spin_a_little(since, WAIT_SPIN, self.crowded) {
                continue;
            }
            self.local
                .doorbell()
                .sleep(seen, Duration::from_micros(200));
        }
    }
}
