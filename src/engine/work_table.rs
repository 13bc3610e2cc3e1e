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
use crate::sync::{AtomicU32, AtomicU64, Ordering, fence};

/// Most operations outstanding at once, and the table index of operation
/// `seq`: one per entry of a rank's operation table in the machine's segment,
/// where both are defined (the memory space's device side uses them too).
pub(crate) use crate::shm::segment::{OPERATIONS as WORK_CAPACITY, operation_entry as slot_of};

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

/// What a submitter hands the driver: an operation, described, and the
/// all-reduce the engine runs for it, which is derived from its descriptor
/// ([`Descriptor::runs_as`]) alone, on workers and dedicated servers alike.
pub(crate) struct Submission<M: MemorySpace> {
    pub(crate) seq: u64,
    /// The tensor the engine all-reduces in place.
    pub(crate) tensor: M::Tensor,
    /// The call as the caller issued it, compared across ranks.
    pub(crate) descriptor: Descriptor,
    /// Bytes to copy out of the result once it is final (a reduce-scatter's
    /// share).
    pub(crate) deliver: Option<Delivery<M>>,
    /// What the engine runs: `runs_as` of the descriptor.
    elements: u64,
    dtype: DataType,
    op: ReduceOp,
}

impl<M: MemorySpace> Submission<M> {
    /// Operation `seq`, described by `descriptor`, on `tensor`, in a job of
    /// `world` ranks; `None` if the sizes it runs as overflow.
    pub(crate) fn new(
        seq: u64,
        tensor: M::Tensor,
        descriptor: Descriptor,
        deliver: Option<Delivery<M>>,
        world: u32,
    ) -> Option<Submission<M>> {
        let (elements, dtype, op) = descriptor.runs_as(world)?;
        elements.checked_mul(dtype.size_bytes())?;
        Some(Submission {
            seq,
            tensor,
            descriptor,
            deliver,
            elements,
            dtype,
            op,
        })
    }

    /// Elements of the all-reduce the engine runs.
    pub(crate) fn elements(&self) -> u64 {
        self.elements
    }

    /// Their type.
    pub(crate) fn dtype(&self) -> DataType {
        self.dtype
    }

    /// The operator that reduces them.
    pub(crate) fn op(&self) -> ReduceOp {
        self.op
    }

    /// The algorithm that runs it.
    pub(crate) fn algorithm(&self) -> Resolved {
        self.descriptor.algorithm
    }

    /// How its `f32` values travel between machines.
    pub(crate) fn wire(&self) -> fairring_core::WireFormat {
        self.descriptor.wire
    }
}

/// A copy out of an operation's result, made by the driver when it finishes:
/// bytes `range` of the result into `to`.
pub(crate) struct Delivery<M: MemorySpace> {
    pub(crate) to: M::Tensor,
    pub(crate) range: std::ops::Range<usize>,
}

impl WorkTable {
    pub(crate) fn new() -> WorkTable {
        WorkTable::with_capacity(WORK_CAPACITY)
    }

    /// A table of `capacity` entries: entry `seq % capacity` holds `seq`
    /// (the operations' table has [`WORK_CAPACITY`], as the segment's
    /// operation table; the messages' one of its own).
    pub(crate) fn with_capacity(capacity: usize) -> WorkTable {
        WorkTable {
            entries: (0..capacity.max(1))
                .map(|_| Entry {
                    occupant: AtomicU64::new(0),
                    state: AtomicU32::new(PENDING),
                })
                .collect(),
        }
    }

    fn entry(&self, seq: u64) -> &Entry {
        #[expect(clippy::cast_possible_truncation, reason = "below the table's length")]
        let i = (seq % self.entries.len() as u64) as usize;
        &self.entries[i]
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

    /// Marks `seq` finished (as [`finish`](WorkTable::finish)), then calls
    /// `release`, which releases the streams waiting on the device for `seq`
    /// where the words they wait on exist. Returns whether it was pending.
    ///
    /// Paired with [`pending_for_a_wait`](WorkTable::pending_for_a_wait):
    /// the state is published, then a `SeqCst` fence, then `release` looks
    /// for the words; a caller makes the words exist, then a `SeqCst` fence,
    /// then reads the state. So either `release` finds the words or the
    /// caller finds `seq` finished: no stream waits on a word never set.
    pub(crate) fn finish_then_release(&self, seq: u64, state: u32, release: impl FnOnce()) -> bool {
        let finished = self.finish(seq, state);
        fence(Ordering::SeqCst);
        release();
        finished
    }

    /// Whether a stream must wait on the device for `seq` (it has not
    /// finished), asked once the words streams wait on exist (see
    /// [`finish_then_release`](WorkTable::finish_then_release)).
    #[cfg(any(feature = "cuda", test))]
    pub(crate) fn pending_for_a_wait(&self, seq: u64) -> bool {
        fence(Ordering::SeqCst);
        self.state(seq) == Some(PENDING)
    }

    /// Gives back the entry of a finished `seq`.
    pub(crate) fn give_back(&self, seq: u64) {
        let e = self.entry(seq);
        let _ = e
            .occupant
            .compare_exchange(seq + 1, 0, Ordering::AcqRel, Ordering::Relaxed);
    }
}

/// A loom model of the handshake between a completion and a caller's wait on
/// the device: the shipped `finish_then_release` and `pending_for_a_wait`,
/// with the device side's existence and its word as loom atomics (the
/// `OnceLock` that holds the device side publishes with release and is read
/// with acquire, as here).
///
/// Run: `RUSTFLAGS="--cfg loom" cargo test -p fairring --lib --release loom_models`
#[cfg(all(test, loom))]
mod loom_models {
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicBool;
    use loom::thread;

    use super::*;

    #[test]
    fn no_stream_waits_on_a_word_never_set() {
        loom::model(|| {
            let table = Arc::new(WorkTable::new());
            let exists = Arc::new(AtomicBool::new(false));
            let word = Arc::new(AtomicU64::new(0));
            assert!(table.try_take(0));
            let completion = {
                let (table, exists, word) = (table.clone(), exists.clone(), word.clone());
                thread::spawn(move || {
                    table.finish_then_release(0, DONE, || {
                        if exists.load(Ordering::Acquire) {
                            word.store(1, Ordering::Release);
                        }
                    });
                })
            };
            // The caller makes the device side (its words), then asks.
            exists.store(true, Ordering::Release);
            let waits = table.pending_for_a_wait(0);
            completion.join().unwrap();
            if waits {
                assert_eq!(
                    word.load(Ordering::Acquire),
                    1,
                    "a wait on a word never set"
                );
            }
        });
    }
}
