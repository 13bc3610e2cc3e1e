//! The GPUs' own collectives among a simulated machine's ranks (NCCL's, on a
//! real machine): what the simulation's ranks run the collective local step
//! ([`CollectiveStep`](crate::local::CollectiveStep)) on, so that its order
//! and its failure path are checked on every seed.
//!
//! - The job's communicator (the job's NCCL all-reduce,
//!   `engine/algorithm/nccl.rs`) is one more such machine, of every rank of
//!   the job, where the seed makes one.
//! - A call is an item of a device program on the engine stream of the
//!   staging buffer it serves, on the rank that enqueues it; its index on its
//!   communicator is the order the rank enqueued it in. It **arrives** when
//!   it reaches the head of its stream (the items before it have run: its
//!   gate is open, its bytes are in place), and **meets** once every rank of
//!   the machine has arrived at the call of the same index on the same
//!   communicator, as NCCL's kernels do. A rank's calls on one communicator
//!   run in the order it issued them, whatever their streams (NCCL orders a
//!   communicator's kernels through a stream of its own): a call arrives
//!   only once the one before it on its communicator has met.
//! - MachineCalls that meet must agree (what they do, how many bytes, which root):
//!   ranks that issue in different orders would hang or mix slices under
//!   NCCL, and here the seed fails naming the two calls. Only where a rank's
//!   engine failed (ranks that issued different operations, caught by the
//!   descriptor checks) may calls disagree: its released gates run what it
//!   enqueued, and the calls never meet, moving nothing, until every rank
//!   aborts them. So may ungated calls (a whole all-reduce through NCCL,
//!   `memory::program::ungated`) where no rank's call was opened past its
//!   engine's checks: they run before the checks end, and wait the same way
//!   until the checks fail the engines, whose failures abort them; a seed
//!   where none does fails, its streams left waiting.
//! - When the last rank arrives, the call moves every rank's bytes at once:
//!   an all-reduce, a reduce-scatter (chunk `r` of every rank's bytes
//!   onto rank `r`'s), a reduce onto its root, a broadcast from it, in
//!   place, with fairring-core's host kernels. A reduce-scatter whose bytes
//!   are not one equal chunk per rank fails the seed, as NCCL refuses it.
//! - A rank's calls on a communicator it aborted end without moving
//!   anything, as NCCL's kernels do after `ncclCommAbort` (which waits for
//!   them: the simulated GPU's abort holds the aborting thread until the
//!   device has drained); a killed rank's calls never arrive, so its peers'
//!   calls wait until they abort in turn.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use fairring_core::reduce::finish_avg_bytes;
use fairring_core::{DataType, ReduceOp};

use super::simulated_gpu::{Arrival, Meeting, SimMemory};
use crate::memory::program::Comm;
use crate::memory::reduce_into;

/// What a call does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    AllReduce {
        dtype: DataType,
        op: ReduceOp,
    },
    ReduceScatter {
        dtype: DataType,
        op: ReduceOp,
    },
    Reduce {
        dtype: DataType,
        op: ReduceOp,
        root: u32,
    },
    Broadcast {
        root: u32,
    },
}

/// One call of one rank: the `index`th on `comm`, over `len` bytes at `at`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Call {
    comm: Comm,
    index: u64,
    kind: Kind,
    at: usize,
    len: usize,
}

/// The calls of one index on one communicator, as the ranks arrive.
struct Rendezvous {
    /// Per local rank: where its bytes are, once it has arrived.
    arrived: Vec<Option<usize>>,
    /// What the first to arrive does, and over how many bytes.
    call: (Kind, usize),
    done: bool,
    /// Whether a rank arrived on released gates (its engine failed).
    released: bool,
    /// Whether a rank arrived on a gate its engine opened, past its checks
    /// (not ungated).
    opened: bool,
    /// Whether the calls disagree: they never meet, and end only as their
    /// ranks abort.
    disagree: bool,
}

/// A machine's calls.
struct MachineCalls {
    ranks: u32,
    meetings: HashMap<(Comm, u64), Rendezvous>,
    /// Per local rank, per communicator: aborted.
    aborted: Vec<[bool; 3]>,
    /// Reduce-scatters that met, counted for the job.
    scatters: Arc<AtomicU64>,
    /// Every call that met, where counted.
    met: Option<Arc<AtomicU64>>,
    /// Calls that arrived while their rank's engine had not failed (on a
    /// gate it opened, or ungated; not on one its failure released), where
    /// counted.
    arrived_unfailed: Option<Arc<AtomicU64>>,
}

/// The collectives of one simulated machine, shared by its ranks' GPUs.
#[derive(Clone)]
pub(super) struct SimMachine(Arc<Mutex<MachineCalls>>);

impl SimMachine {
    /// A machine of `ranks` ranks, counting the reduce-scatters that meet
    /// in `scatters`.
    pub(super) fn new(ranks: u32, scatters: Arc<AtomicU64>) -> SimMachine {
        SimMachine(Arc::new(Mutex::new(MachineCalls {
            ranks,
            meetings: HashMap::new(),
            aborted: vec![[false; 3]; ranks as usize],
            scatters,
            met: None,
            arrived_unfailed: None,
        })))
    }

    /// The job's communicator of `ranks` ranks, counting its calls that met
    /// in `met`, and in `arrived_unfailed` the calls that arrived while
    /// their rank's engine had not failed.
    pub(super) fn job(
        ranks: u32,
        met: Arc<AtomicU64>,
        arrived_unfailed: Arc<AtomicU64>,
    ) -> SimMachine {
        let job = SimMachine::new(ranks, Arc::default());
        {
            let mut calls = job.lock();
            calls.met = Some(met);
            calls.arrived_unfailed = Some(arrived_unfailed);
        }
        job
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MachineCalls> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `rank`'s `call`, at the head of its stream, can move: arrive
    /// (the call before it on its communicator has met), or end (it met, or
    /// the rank aborted its communicator).
    pub(super) fn can_run(&self, rank: u32, call: &Call) -> bool {
        let calls = self.lock();
        if calls.aborted[rank as usize][call.comm as usize] {
            return true;
        }
        let before_met = call.index == 0
            || calls
                .meetings
                .get(&(call.comm, call.index - 1))
                .is_some_and(|m| m.done);
        if !before_met {
            return false;
        }
        match calls.meetings.get(&(call.comm, call.index)) {
            None => true,
            Some(m) => m.done || m.arrived[rank as usize].is_none(),
        }
    }

    /// Moves `rank`'s `call` on: it arrives (and meets, if it is the last),
    /// or ends. Returns whether it ended (leaves its stream).
    ///
    /// # Panics
    ///
    /// If the call disagrees with those it meets: the ranks issued out of
    /// order (the model's finding, which fails the seed).
    pub(super) fn run(&self, rank: u32, call: &Call, arrival: Arrival) -> bool {
        let mut calls = self.lock();
        if calls.aborted[rank as usize][call.comm as usize] {
            return true;
        }
        let ranks = calls.ranks as usize;
        let arrived_unfailed = calls.arrived_unfailed.clone();
        let meeting = calls
            .meetings
            .entry((call.comm, call.index))
            .or_insert_with(|| Rendezvous {
                arrived: vec![None; ranks],
                call: (call.kind, call.len),
                done: false,
                released: false,
                opened: false,
                disagree: false,
            });
        if meeting.done {
            return true;
        }
        meeting.released |= arrival == Arrival::Released;
        meeting.opened |= arrival == Arrival::Opened;
        if arrival != Arrival::Released
            && let Some(counter) = &arrived_unfailed
        {
            counter.fetch_add(1, Ordering::Relaxed);
        }
        if meeting.call != (call.kind, call.len) {
            // Ranks whose engines failed (a mismatch of their calls among
            // them) run what they enqueued, and so do ungated calls, whose
            // engines check them meanwhile: NCCL's kernels then exchange
            // nothing meaningful, within each rank's own bytes, until the
            // ranks abort (a meeting never aborted leaves its streams
            // waiting, which fails the seed). Calls that disagree where no
            // rank's engine failed and one opened its call past its checks
            // are issued out of order: the model's finding.
            assert!(
                meeting.released || !meeting.opened,
                "collective mismatch: rank {rank}'s call {} on {:?} is {:?} over {} bytes, \
                 and another rank's is {:?} over {} bytes",
                call.index,
                call.comm,
                call.kind,
                call.len,
                meeting.call.0,
                meeting.call.1,
            );
            meeting.disagree = true;
        }
        meeting.arrived[rank as usize] = Some(call.at);
        if meeting.disagree {
            return false;
        }
        if meeting.arrived.iter().all(Option::is_some) {
            let at: Vec<usize> = meeting.arrived.iter().flatten().copied().collect();
            // SAFETY: the ranks' bytes are tensors of the simulation, alive
            // until it ends, untouched while the call heads their streams
            // (the engine's contract for a collective's bytes).
            unsafe { meet(call.kind, &at, call.len) };
            meeting.done = true;
            if matches!(call.kind, Kind::ReduceScatter { .. }) {
                calls.scatters.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(met) = &calls.met {
                met.fetch_add(1, Ordering::Relaxed);
            }
        }
        false
    }

    /// `rank` aborted its communicator `comm`: its calls on it end.
    pub(super) fn abort(&self, rank: u32, comm: Comm) {
        self.lock().aborted[rank as usize][comm as usize] = true;
    }
}

/// Moves the bytes of a call every rank has arrived at: `len` bytes at each
/// of `at` (by local rank).
///
/// # Safety
///
/// Each `at[r]..at[r] + len` is memory of the simulation that nothing else
/// reads or writes meanwhile; they do not overlap.
unsafe fn meet(kind: Kind, at: &[usize], len: usize) {
    // SAFETY: forwarded.
    let bytes = |r: usize| unsafe { std::slice::from_raw_parts_mut(at[r] as *mut u8, len) };
    // Every rank's bytes `within`, reduced.
    let reduced = |dtype: DataType, op: ReduceOp, within: std::ops::Range<usize>| {
        let mut sum = bytes(0)[within.clone()].to_vec();
        let mut others = (1..at.len()).map(|r| Ok(&bytes(r)[within.clone()]));
        reduce_into(dtype, op, &mut sum, &mut others).expect("the engine reduces what it may");
        if op == ReduceOp::Avg {
            finish_avg_bytes(dtype, &mut sum, at.len() as u32).expect("averages divide floats");
        }
        sum
    };
    match kind {
        Kind::AllReduce { dtype, op } => {
            let sum = reduced(dtype, op, 0..len);
            for r in 0..at.len() {
                bytes(r).copy_from_slice(&sum);
            }
        }
        Kind::ReduceScatter { dtype, op } => {
            let chunk = scatter_chunk(len, at.len(), dtype);
            for r in 0..at.len() {
                let own = r * chunk..(r + 1) * chunk;
                let sum = reduced(dtype, op, own.clone());
                bytes(r)[own].copy_from_slice(&sum);
            }
        }
        Kind::Reduce { dtype, op, root } => {
            let sum = reduced(dtype, op, 0..len);
            bytes(root as usize).copy_from_slice(&sum);
        }
        Kind::Broadcast { root } => {
            let from = bytes(root as usize).to_vec();
            for r in 0..at.len() {
                bytes(r).copy_from_slice(&from);
            }
        }
    }
}

/// The bytes of each rank's chunk of a reduce-scatter over `len` bytes
/// among `ranks`.
///
/// # Panics
///
/// Where `len` is not `ranks` equal chunks of whole elements, which NCCL's
/// `ncclReduceScatter` cannot express: the engine asked for what it may not.
fn scatter_chunk(len: usize, ranks: usize, dtype: DataType) -> usize {
    let element = usize::try_from(dtype.size_bytes()).expect("an element's bytes fit");
    assert!(
        ranks > 0 && len.is_multiple_of(ranks) && (len / ranks).is_multiple_of(element),
        "a reduce-scatter of {len} bytes of {dtype:?} is not {ranks} equal chunks"
    );
    len / ranks
}

/// One rank's collectives on its simulated GPU (a handle: clones share it).
#[derive(Clone)]
pub(super) struct SimCollectives {
    calls: RankCalls,
}

/// One rank's calls, by id (the order it issued them), and how many it
/// issued per communicator (the next one's index).
#[derive(Clone, Default)]
struct RankCalls(Arc<Mutex<(Vec<Call>, [u64; 3])>>);

impl RankCalls {
    fn get(&self, id: u64) -> Call {
        let calls = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        calls.0[usize::try_from(id).expect("a call id indexes the calls")]
    }
}

/// Where one rank's calls meet: the machine, as its GPU sees it, and the
/// job's ranks on the job's communicator where it has one.
struct RankMeeting {
    machine: SimMachine,
    rank: u32,
    /// The job's calls and this rank's place among them (its global rank).
    job: Option<(SimMachine, u32)>,
    calls: RankCalls,
}

impl RankMeeting {
    /// Where calls on `comm` meet, and this rank's place there.
    ///
    /// # Panics
    ///
    /// A call on the job's communicator where the rank has none: the engine
    /// chose the job's all-reduce where it may not.
    fn on(&self, comm: Comm) -> (&SimMachine, u32) {
        match (comm, &self.job) {
            (Comm::Job, Some((job, rank))) => (job, *rank),
            (Comm::Job, None) => panic!("a call on the job's communicator, which was not made"),
            _ => (&self.machine, self.rank),
        }
    }
}

impl Meeting for RankMeeting {
    fn can_run(&self, id: u64) -> bool {
        let call = self.calls.get(id);
        let (at, rank) = self.on(call.comm);
        at.can_run(rank, &call)
    }

    fn run(&self, id: u64, arrival: Arrival) -> bool {
        let call = self.calls.get(id);
        let (at, rank) = self.on(call.comm);
        at.run(rank, &call, arrival)
    }

    fn met(&self, id: u64) -> bool {
        let call = self.calls.get(id);
        let (at, _) = self.on(call.comm);
        at.lock()
            .meetings
            .get(&(call.comm, call.index))
            .is_some_and(|m| m.done)
    }

    fn writes(&self, id: u64) -> (usize, usize) {
        let call = self.calls.get(id);
        match call.kind {
            // A reduce writes its root's bytes only.
            Kind::Reduce { root, .. } if root != self.rank => (call.at, 0),
            // A reduce-scatter writes each rank's own chunk only.
            Kind::ReduceScatter { dtype, .. } => {
                let ranks = self.machine.lock().ranks as usize;
                let chunk = scatter_chunk(call.len, ranks, dtype);
                (call.at + self.rank as usize * chunk, chunk)
            }
            _ => (call.at, call.len),
        }
    }

    fn describe(&self, id: u64) -> String {
        format!("{:?}", self.calls.get(id))
    }

    fn abort(&self, comm: Comm) {
        if comm != Comm::Job || self.job.is_some() {
            let (at, rank) = self.on(comm);
            at.abort(rank, comm);
        }
    }
}

/// Local rank `rank`'s collectives among `machine`'s GPUs, the GPU of
/// `memory` joining them; and, where given, the job's (`job`: every rank's
/// calls, and this rank's global rank among them).
pub(super) fn join(
    memory: &SimMemory,
    machine: &SimMachine,
    rank: u32,
    job: Option<(&SimMachine, u32)>,
) -> SimCollectives {
    let calls = RankCalls::default();
    memory.meet_through(Box::new(RankMeeting {
        machine: machine.clone(),
        rank,
        job: job.map(|(job, rank)| (job.clone(), rank)),
        calls: calls.clone(),
    }));
    SimCollectives { calls }
}

impl SimCollectives {
    /// Registers a call on `comm` over `len` bytes at `at`, the next of
    /// this rank's on it; returns its id, for its stream's item.
    pub(super) fn call(&self, comm: Comm, kind: Kind, at: usize, len: usize) -> u64 {
        let mut calls = self.calls.0.lock().unwrap_or_else(PoisonError::into_inner);
        let (issued, next) = &mut *calls;
        let index = next[comm as usize];
        next[comm as usize] += 1;
        issued.push(Call {
            comm,
            index,
            kind,
            at,
            len,
        });
        issued.len() as u64 - 1
    }
}
