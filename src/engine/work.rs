//! The table of operations in flight, shared by submitters, the driver and waiters.
//!
//! Operation `seq` lives in entry `seq % WORK_CAPACITY`. An entry is taken by a
//! submission, completed by the driver, and given back by the operation's handle
//! (or by the scope that owns it) once it has seen the completion. A submission
//! that finds its entry still taken waits: so at most `WORK_CAPACITY` operations
//! are outstanding, and the table never grows.

use fairring_core::{DataType, ReduceOp};

use super::algorithm::Resolved;
use super::descriptor::Descriptor;
use crate::memory::MemorySpace;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// Most operations outstanding at once: one per entry of a rank's operation table
/// in the machine's segment.
pub(crate) const WORK_CAPACITY: usize = crate::shm::segment::OPERATIONS;

/// The table index of operation `seq`.
pub(crate) fn slot_of(seq: u64) -> usize {
    #[expect(clippy::cast_possible_truncation, reason = "below WORK_CAPACITY")]
    let i = (seq % WORK_CAPACITY as u64) as usize;
    i
}

pub(crate) const PENDING: u32 = 0;
pub(crate) const DONE: u32 = 1;
pub(crate) const FAILED: u32 = 2;

/// One entry's shared words.
pub(crate) struct Entry {
    /// `seq + 1` of the operation holding the entry; 0 when free.
    occupant: AtomicU64,
    /// `PENDING`, `DONE` or `FAILED`.
    state: AtomicU32,
}

pub(crate) struct WorkTable {
    entries: Box<[Entry]>,
}

/// What a submitter hands the driver.
pub(crate) struct Submission<M: MemorySpace> {
    pub(crate) seq: u64,
    /// The tensor the engine all-reduces in place.
    pub(crate) tensor: M::Tensor,
    pub(crate) elements: u64,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) algorithm: Resolved,
    /// How its `f32` values travel between machines.
    pub(crate) wire: fairring_core::WireFormat,
    /// The call as the caller issued it, compared across ranks.
    pub(crate) descriptor: Descriptor,
    /// Bytes to copy out of the result once it is final (a reduce-scatter's
    /// share).
    pub(crate) deliver: Option<Delivery<M>>,
}

/// A copy out of an operation's result, made by the driver when it finishes:
/// bytes `range` of the result into `to`.
pub(crate) struct Delivery<M: MemorySpace> {
    pub(crate) to: M::Tensor,
    pub(crate) range: std::ops::Range<usize>,
}

impl WorkTable {
    pub(crate) fn new() -> WorkTable {
        WorkTable {
            entries: (0..WORK_CAPACITY)
                .map(|_| Entry {
                    occupant: AtomicU64::new(0),
                    state: AtomicU32::new(PENDING),
                })
                .collect(),
        }
    }

    fn entry(&self, seq: u64) -> &Entry {
        &self.entries[slot_of(seq)]
    }

    /// Takes the entry of `seq` if it is free.
    pub(crate) fn try_take(&self, seq: u64) -> bool {
        let e = self.entry(seq);
        if e.occupant.load(Ordering::Acquire) != 0 {
            return false;
        }
        e.state.store(PENDING, Ordering::Relaxed);
        e.occupant.store(seq + 1, Ordering::Release);
        true
    }

    /// The state of `seq`, or `None` if the entry was given back already.
    pub(crate) fn state(&self, seq: u64) -> Option<u32> {
        let e = self.entry(seq);
        let s = e.state.load(Ordering::Acquire);
        (e.occupant.load(Ordering::Acquire) == seq + 1).then_some(s)
    }

    /// Marks `seq` finished (driver only); returns whether it was pending.
    pub(crate) fn finish(&self, seq: u64, state: u32) -> bool {
        let e = self.entry(seq);
        e.occupant.load(Ordering::Acquire) == seq + 1
            && e.state
                .compare_exchange(PENDING, state, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// Gives back the entry of a finished `seq`.
    pub(crate) fn give_back(&self, seq: u64) {
        let e = self.entry(seq);
        let _ = e
            .occupant
            .compare_exchange(seq + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}
