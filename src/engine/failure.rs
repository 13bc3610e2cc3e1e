//! Failure: how a rank that fails stops every other rank from waiting for it.
//!
//! # Propagation
//!
//! A failing rank writes a [`FailureRecord`] (64 bytes, the largest message a
//! fabric carries) into the machine's control area and sends it in a
//! `Kind::Abort` message to every rank it is linked to. A rank that reads one
//! fails with the error it describes and passes it on, so a failure floods the
//! job through the links the operations use, and no rank waits for a peer that has
//! given up.
//!
//! Within a machine a failing rank also closes its tensors to its local peers'
//! reads. A rank whose read is refused that way, or that fails naming a local
//! peer without a record, reports the machine's record when that peer is the
//! machine's first failure ([`Engine::recorded_failure_of`]): where rank 1 of
//! three is killed and rank 2 notices first, rank 0 names rank 1 (reported by
//! rank 2), not rank 2.
//!
//! # Inside the engine
//!
//! Every step of the driver returns a [`Fault`] when it fails: the error, and the
//! record to pass on when the failure came with one (a peer's report, a
//! mismatch). [`Engine::fail_locked`] then fails every operation in flight,
//! forgets every slice, tells the machine and the peers, and from then on the
//! engine takes no work. A panic inside a step is caught and fails the engine the
//! same way, as an [`Error::Internal`], so that no half-updated driver state is
//! ever used again.
//!
//! # Device programs
//!
//! A failing engine opens every gate of every device program
//! ([`MemorySpace::release`]: host writes, no CUDA call) and stops the
//! machine's collectives ([`LocalStep::release`]: NCCL's abort, which waits
//! for the device, on a thread of its own). Every stream then runs to its
//! end on whatever the staging buffers hold. Each operation on device tensors
//! is declared failed only once its own program has ended (its slices' ends,
//! its delivery), so nothing writes a caller's tensor after the caller's
//! stream has passed the operation; and it is declared failed as soon as it
//! has, whatever later operations wait for, since a later operation's
//! program may wait (through its caller's stream) for this one's
//! declaration.
//!
//! [`LocalStep::release`]: crate::local::LocalStep::release

use std::time::{Duration, Instant};

use fairring_rdma::fabric::Fabric;

use super::Driver;
use super::Engine;
use super::descriptor::{Descriptor, Words};
use super::operations::Record;
use super::outbox::send_control_until;
use super::planner::{Accepted, Program};
use super::tags::Kind;
use super::work_table::FAILED;
use crate::error::Error;
use crate::memory::MemorySpace;
use crate::memory::program::slice_end;
use crate::shm::segment::RECORD_WORDS;
use crate::sync::{AtomicBool, AtomicU32, Ordering};

/// Bytes of a failure record.
pub(crate) const FAILURE_BYTES: usize = 64;

/// A failure as it travels between ranks.
///
/// ```text
/// byte 0        1: a rank failed, 2: a mismatch
/// failed:       bytes 1..5 the rank the error names, 5..7 reason length,
///               7..64 the reason (UTF-8, cut at a character boundary)
/// mismatch:     bytes 8..16 sequence, 16..20 rank, 20..36 its words,
///               36..40 peer, 40..56 its words
/// ```
#[derive(Clone, Copy, Debug)]
pub(crate) struct FailureRecord(pub(crate) [u8; FAILURE_BYTES]);

fn u32_at(b: &[u8; FAILURE_BYTES], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8; FAILURE_BYTES], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

impl FailureRecord {
    /// The record of a mismatch at operation `sequence` between `rank`, which
    /// issued `words`, and `peer`, which issued `peer_words`; and its error.
    pub(crate) fn mismatch(
        sequence: u64,
        rank: u32,
        words: Words,
        peer: u32,
        peer_words: Words,
    ) -> (FailureRecord, Error) {
        let mut b = [0u8; FAILURE_BYTES];
        b[0] = 2;
        b[8..16].copy_from_slice(&sequence.to_le_bytes());
        b[16..20].copy_from_slice(&rank.to_le_bytes());
        b[20..28].copy_from_slice(&words[0].to_le_bytes());
        b[28..36].copy_from_slice(&words[1].to_le_bytes());
        b[36..40].copy_from_slice(&peer.to_le_bytes());
        b[40..48].copy_from_slice(&peer_words[0].to_le_bytes());
        b[48..56].copy_from_slice(&peer_words[1].to_le_bytes());
        let record = FailureRecord(b);
        let error = record.decode(rank, rank);
        (record, error)
    }

    /// The record of any other `error`, found by rank `me`.
    pub(crate) fn encode(error: &Error, me: u32) -> FailureRecord {
        let (about, reason) = match error {
            Error::Peer { rank, reason } => (*rank, reason.clone()),
            Error::Failed { first } => return FailureRecord::encode(first, me),
            // What happened first: a record holds 57 bytes of reason.
            Error::Internal { invariant, detail } => {
                (me, format!("bug: {detail} (expected that {invariant})"))
            }
            other => (me, other.to_string()),
        };
        let mut b = [0u8; FAILURE_BYTES];
        b[0] = 1;
        b[1..5].copy_from_slice(&about.to_le_bytes());
        let mut cut = reason.len().min(FAILURE_BYTES - 7);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        #[expect(clippy::cast_possible_truncation, reason = "at most 57")]
        let len = cut as u16;
        b[5..7].copy_from_slice(&len.to_le_bytes());
        b[7..7 + cut].copy_from_slice(&reason.as_bytes()[..cut]);
        FailureRecord(b)
    }

    /// The error a record describes, as rank `from` reported it to rank `me`.
    /// A record that blames `me` itself (a peer lost its connection to `me`, and
    /// `me` heard of it from another rank before seeing it) names the reporter.
    pub(crate) fn decode(&self, from: u32, me: u32) -> Error {
        let b = &self.0;
        match b[0] {
            2 => {
                let words = [u64_at(b, 20), u64_at(b, 28)];
                let peer_words = [u64_at(b, 40), u64_at(b, 48)];
                Error::Mismatch {
                    sequence: u64_at(b, 8),
                    rank: u32_at(b, 16),
                    called: Descriptor::describe(words),
                    peer: u32_at(b, 36),
                    peer_called: Descriptor::describe(peer_words),
                }
            }
            1 => {
                let about = u32_at(b, 1);
                let len = usize::from(u16::from_le_bytes([b[5], b[6]])).min(FAILURE_BYTES - 7);
                let reason = String::from_utf8_lossy(&b[7..7 + len]);
                if about == me && from != me {
                    return Error::peer(
                        from,
                        format!("reports that a peer lost this rank: {reason}"),
                    );
                }
                let via = if about == from {
                    String::new()
                } else {
                    format!(" (reported by rank {from})")
                };
                Error::peer(about, format!("failed: {reason}{via}"))
            }
            _ => Error::peer(from, "failed, for a reason this rank cannot decode"),
        }
    }

    /// The record as the machine's control area stores it.
    pub(crate) fn words(&self) -> [u64; RECORD_WORDS] {
        let mut words = [0u64; RECORD_WORDS];
        for (w, chunk) in words.iter_mut().zip(self.0.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            *w = u64::from_le_bytes(b);
        }
        words
    }

    /// The record the machine's control area stored.
    pub(crate) fn from_words(words: [u64; RECORD_WORDS]) -> FailureRecord {
        let mut b = [0u8; FAILURE_BYTES];
        for (chunk, w) in b.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        FailureRecord(b)
    }
}

/// The fault rank `me` (local rank `own`) reports for local peer `peer`
/// (a global rank), given `failure`, its machine's first failure (the local
/// rank that failed and its record; `global` maps local ranks to global
/// ones): that record where `peer` is that rank and not this one, else
/// `None`.
fn recorded_failure(
    failure: Option<(u32, [u64; RECORD_WORDS])>,
    own: u32,
    global: impl Fn(u32) -> u32,
    peer: u32,
    me: u32,
) -> Option<Fault> {
    let (device, words) = failure?;
    let failed = global(device);
    if device == own || failed != peer {
        return None;
    }
    let record = FailureRecord::from_words(words);
    Some(Fault::with_record(record.decode(failed, me), record))
}

/// An error on its way to failing the engine, with the record to pass on when
/// the failure came with one.
#[derive(Debug)]
pub(crate) struct Fault {
    pub(crate) error: Error,
    /// Boxed: a fault is rare, and every step's result carries room for one.
    pub(crate) record: Option<Box<FailureRecord>>,
}

impl Fault {
    /// `error`, described by `record`.
    pub(crate) fn with_record(error: Error, record: FailureRecord) -> Fault {
        Fault {
            error,
            record: Some(Box::new(record)),
        }
    }
}

impl From<Error> for Fault {
    fn from(error: Error) -> Fault {
        Fault {
            error,
            record: None,
        }
    }
}

/// Whether, and why, the engine failed.
pub(crate) struct FailureState {
    failed: AtomicBool,
    first: std::sync::Mutex<Option<Error>>,
    /// Failure reports posted to peers (see `departures`).
    pub(crate) reports_posted: AtomicU32,
}

impl FailureState {
    pub(crate) fn new() -> FailureState {
        FailureState {
            failed: AtomicBool::new(false),
            first: std::sync::Mutex::new(None),
            reports_posted: AtomicU32::new(0),
        }
    }

    /// Whether the engine has failed.
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The first error, if the engine has failed.
    pub(crate) fn first(&self) -> Option<Error> {
        if !self.failed() {
            return None;
        }
        self.first
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// How long a failing rank retries its reports to peers whose queues are full of
/// the operation's data (the fabric's threads drain them on their own).
const REPORT_RETRY: Duration = Duration::from_millis(500);

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Fails the engine: every pending operation fails with `error`, and nothing
    /// touches a caller's memory afterwards.
    pub(crate) fn fail(&self, error: Error) {
        let mut d = self.lock_driver();
        self.fail_locked(&mut d, error.into());
    }

    /// Fails operation `seq`, which the engine refused before enqueueing
    /// anything of it after its caller had committed to it (a device call's
    /// prelude and start are on the caller's stream): the engine fails with
    /// `error` unless it already has, and `seq` completes as failed.
    #[cfg(feature = "cuda")]
    pub(crate) fn fail_accepted(&self, seq: u64, error: Error) {
        let mut d = self.lock_driver();
        if !self.failure.failed() {
            self.fail_locked(&mut d, error.into());
        }
        self.complete(seq, FAILED);
        self.machine.doorbell().ring();
    }

    /// Fails the engine with `error` and, with it, `accepted`, whose device
    /// program is enqueued but which could not be queued for the driver.
    pub(super) fn fail_with(&self, accepted: Accepted<M>, error: Error) {
        let mut d = self.lock_driver();
        self.fail_locked(&mut d, error.into());
        if let Some(failing) = d.failing.as_mut() {
            failing.settling.push(Settling::accepted(&accepted));
        }
        self.settle_failure(&mut d);
    }

    /// Keeps `accepted`, which the driver could not record, to be declared
    /// failed with the operations in flight when the engine fails (at once:
    /// the driver's refusal is the failure).
    pub(super) fn settle_refused(&self, d: &mut Driver<M>, accepted: &Accepted<M>) {
        let failing = d.failing.get_or_insert_with(Failing::default);
        failing.settling.push(Settling::accepted(accepted));
    }

    /// Why local rank `peer` (a global rank) failed, as its machine recorded
    /// it: where `peer` is the machine's first failure, its record (naming
    /// the rank it lost, say), else `None`. A read of a local peer's tensor
    /// refused because that peer failed is reported this way, so that a rank
    /// killed beside both names the killed rank, not the one that noticed
    /// first.
    pub(super) fn recorded_failure_of(&self, peer: u32) -> Option<Fault> {
        recorded_failure(
            self.machine.failure(),
            self.machine.local_rank(),
            |device| self.links.local_to_global(device),
            peer,
            self.rank(),
        )
    }

    pub(super) fn fail_locked(&self, d: &mut Driver<M>, fault: Fault) {
        // A local peer's failure, as it recorded it.
        let fault = match (&fault.record, &fault.error) {
            (None, Error::Peer { rank, .. }) => self.recorded_failure_of(*rank).unwrap_or(fault),
            _ => fault,
        };
        let rank = self.links.rank;
        let record = fault
            .record
            .map_or_else(|| FailureRecord::encode(&fault.error, rank), |r| *r);
        {
            let mut first = self
                .failure
                .first
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if first.is_none() {
                log::error!("fairring rank {rank}: {}", fault.error);
                *first = Some(fault.error);
            }
        }
        if !self.failure.failed.swap(true, Ordering::AcqRel) {
            // The first failure: tell the local ranks and every linked peer, so
            // that none of them waits for this rank.
            self.machine.fail(record.words());
            let deadline = Instant::now() + REPORT_RETRY;
            for p in self.every_linked() {
                if send_control_until(&self.links.fabric, p, Kind::Abort, &record.0, deadline) {
                    self.failure.reports_posted.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
        // Nothing may write a caller's tensor once its operation is declared
        // finished, nor read one: dropping a tensor's registration waits until
        // the fabric's writes from it are over.
        self.lock_source_regions().clear();
        // And nothing writes one: dropping a window closes it, waiting for
        // the writes landing in it. The machine's ranks copying between
        // tensors are shut out, and waited for, in `settle_failure`.
        self.lock_windows().clear();
        // Messages alike: each finishes once the fabric has let go of it.
        self.fail_all_messages();
        // Every device program runs to its end (see the module docs); each
        // operation is declared failed once its own has (`settle_failure`).
        self.memory.release();
        self.local.release();
        let failing = d.failing.get_or_insert_with(Failing::default);
        while let Some(accepted) = self.submissions.pop() {
            failing.settling.push(Settling::accepted(&accepted));
        }
        failing
            .settling
            .extend(d.operations.drain().map(|rec| Settling::record(&rec)));
        let _ = d.operations.take_deliveries();
        d.slices.clear();
        d.outbox.clear();
        self.settle_failure(d);
        self.machine.doorbell().ring();
    }

    /// Completes, as failed, the operations of a failed engine whose device
    /// programs have ended; returns whether it completed any. Never blocks.
    pub(super) fn settle_failure(&self, d: &mut Driver<M>) -> bool {
        let Some(failing) = d.failing.as_mut() else {
            return false;
        };
        // A submission that raced with the failure.
        while let Some(accepted) = self.submissions.pop() {
            failing.settling.push(Settling::accepted(&accepted));
        }
        // A local peer's read of the tensors of the operations declared
        // failed that is not over by now is thrown away.
        self.local.close_tensors();
        let before = failing.settling.len();
        failing.settling.retain(|s| {
            if !self.program_ended(s) {
                return true;
            }
            self.complete(s.seq, FAILED);
            false
        });
        let completed = failing.settling.len() < before;
        if completed {
            self.machine.doorbell().ring();
        }
        completed
    }

    /// Whether operation `s`'s device program, if it has one, has ended: the
    /// end of each of its last slices on their buffers (an earlier slice on
    /// a buffer ends before a later one), and its delivery.
    fn program_ended(&self, s: &Settling) -> bool {
        let Some(program) = s.program else {
            return true;
        };
        if !program.ends {
            log::warn!(
                "fairring: operation {} fails without its device program whole on the device; \
                 its stream may still touch its tensor",
                s.seq
            );
            return true;
        }
        let buffers = u64::from(self.buffers);
        let end = s.first_slice + s.slices;
        let from = end.saturating_sub(buffers).max(s.first_slice);
        // A poll that fails will not pass either: the device failed.
        let ended = |fence: M::Fence| self.memory.poll(&fence).unwrap_or(true);
        let slices = (from..end).all(|n| {
            let b = u32::try_from(n % buffers).unwrap_or(u32::MAX);
            ended(self.memory.stage_end(b, slice_end(n / buffers)))
        });
        slices && (!s.delivery || ended(self.memory.delivery_end(s.seq)))
    }
}

/// An operation a failed engine has yet to declare failed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settling {
    seq: u64,
    /// Its device program, if it has one, and where it ends.
    program: Option<Program>,
    first_slice: u64,
    slices: u64,
    delivery: bool,
}

impl Settling {
    fn accepted<M: MemorySpace>(a: &Accepted<M>) -> Settling {
        Settling {
            seq: a.sub.seq,
            program: a.device,
            first_slice: a.first_slice,
            slices: a.plan.slice_count(),
            delivery: a.sub.deliver.is_some(),
        }
    }

    fn record<M: MemorySpace>(r: &Record<M>) -> Settling {
        Settling {
            seq: r.sub.seq,
            program: r.device,
            first_slice: r.first_slice,
            slices: r.plan.slice_count(),
            delivery: r.sub.deliver.is_some(),
        }
    }
}

/// What a failed engine has yet to settle: operations declared failed once
/// their device programs have ended.
#[derive(Default)]
pub(crate) struct Failing {
    settling: Vec<Settling>,
}

impl Failing {
    /// Whether an operation waits for its device program to end (nothing
    /// rings the doorbell when it does).
    pub(crate) fn awaits_fences(&self) -> bool {
        self.settling.iter().any(|s| s.program.is_some())
    }
}

#[cfg(test)]
mod tests {
    use fairring_core::{DataType, ReduceOp};

    /// Ranks 4, 5 and 6 share a machine (local ranks 0, 1, 2); rank 6 failed
    /// first, having lost rank 5. Rank 4 reports rank 5, reported by rank 6,
    /// for rank 6's failure; nothing for another peer or for its own.
    #[test]
    fn a_local_peers_failure_names_the_rank_it_lost() {
        let lost = Error::peer(5, "closed the connection mid-frame");
        let record = FailureRecord::encode(&lost, 6);
        let failure = Some((2, record.words()));
        let global = |local: u32| local + 4;
        let fault = recorded_failure(failure, 0, global, 6, 4).expect("rank 6 failed first");
        assert_eq!(
            fault.error.to_string(),
            "rank 5: failed: closed the connection mid-frame (reported by rank 6)"
        );
        assert!(fault.record.is_some());
        assert!(recorded_failure(failure, 0, global, 5, 4).is_none());
        assert!(recorded_failure(failure, 2, global, 6, 6).is_none());
        assert!(recorded_failure(None, 0, global, 6, 4).is_none());
    }

    use super::*;
    use crate::engine::algorithm::Resolved;
    use crate::engine::descriptor::{Collective, Descriptor};

    #[test]
    fn failures_round_trip() {
        let a = Descriptor {
            collective: Collective::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: fairring_core::WireFormat::Exact,
            memory: crate::memory::MemoryKind::Host,
            by_messages: false,
            root: 0,
            elements: 100,
        };
        let b = Descriptor { elements: 200, ..a };
        let (record, error) = FailureRecord::mismatch(5, 1, a.words(), 3, b.words());
        let text = record.decode(9, 0).to_string();
        assert_eq!(text, error.to_string());
        assert!(text.contains("#5") && text.contains("rank 1 called all_reduce of 100 x f32"));
        assert!(
            text.contains("rank 3 called all_reduce of 200 x f32"),
            "{text}"
        );

        let long = Error::peer(4, "é".repeat(60));
        let decoded = FailureRecord::encode(&long, 2).decode(2, 0);
        let Error::Peer { rank, reason } = decoded else {
            panic!("not a peer error");
        };
        assert_eq!(rank, 4);
        assert!(reason.starts_with("failed: é") && reason.ends_with("(reported by rank 2)"));
        let own = FailureRecord::encode(&Error::Aborted, 6).decode(6, 0);
        assert_eq!(
            own.to_string(),
            "rank 6: failed: the communicator was aborted"
        );
        // Rank 2 lost its connection to rank 0, and rank 1 tells rank 0.
        let lost = FailureRecord::encode(&Error::peer(0, "closed the connection"), 2);
        assert_eq!(
            lost.decode(1, 0).to_string(),
            "rank 1: reports that a peer lost this rank: closed the connection"
        );
        assert_eq!(
            lost.decode(1, 3).to_string(),
            "rank 0: failed: closed the connection (reported by rank 1)"
        );
        let again = FailureRecord::from_words(record.words());
        assert_eq!(again.0, record.0);
    }
}
