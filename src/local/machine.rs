//! What the ranks of one machine tell each other outside the data path, through
//! the shared segment, whatever memory their tensors live in: a doorbell each, a
//! credit limit each (for the engine's credit window), the descriptor of every
//! operation (for the engine's checks), and the machine's first failure.

use std::sync::Arc;

use crate::shm::Doorbell;
use crate::shm::segment::{OPERATIONS, RECORD_WORDS, Segment};
use crate::sync::unmodelled::{Ordering, fence};

/// Descriptor words of one operation (see the engine's `descriptor`).
pub(crate) type Words = [u64; 2];

/// One local rank's view of the machine's control area.
pub(crate) struct Machine {
    segment: Arc<Segment>,
    rank: u32,
    size: u32,
}

impl Machine {
    /// Local rank `rank` of `size` on `segment`.
    pub(crate) fn new(segment: Arc<Segment>, rank: u32, size: u32) -> Machine {
        Machine {
            segment,
            rank,
            size,
        }
    }

    /// This rank's index on its machine.
    pub(crate) fn local_rank(&self) -> u32 {
        self.rank
    }

    /// Ranks on this machine.
    pub(crate) fn local_size(&self) -> u32 {
        self.size
    }

    /// The machine's shared segment.
    pub(crate) fn segment(&self) -> &Segment {
        &self.segment
    }

    /// This rank's doorbell: rung whenever another local rank publishes progress.
    pub(crate) fn doorbell(&self) -> &Doorbell {
        self.segment.doorbell(self.rank)
    }

    /// A handle that rings this rank's doorbell from any thread, and keeps it
    /// alive as long as the handle lives (for a fabric's completion notifier).
    pub(crate) fn waker(&self) -> Arc<dyn Fn() + Send + Sync> {
        let segment = Arc::clone(&self.segment);
        let rank = self.rank;
        Arc::new(move || segment.doorbell(rank).ring())
    }

    /// Publishes this rank's credit limit (slices below `limit` may be written
    /// into its staging buffers) and rings the doorbells of the local ranks in
    /// `writers`, which write into them.
    pub(crate) fn publish_credit(&self, limit: u64, writers: impl Iterator<Item = u32>) {
        // Release: the bytes of the slices the limit frees are no longer read
        // here before a writer that sees it writes them.
        self.segment
            .credit(self.rank)
            .store(limit, Ordering::Release);
        for r in writers {
            self.segment.doorbell(r).ring();
        }
    }

    /// Local rank `rank`'s credit limit as last published (0 before the first).
    pub(crate) fn credit(&self, rank: u32) -> u64 {
        self.segment.credit(rank).load(Ordering::Acquire)
    }

    /// Publishes this rank's descriptor words of operation `seq` to the local ranks.
    pub(crate) fn publish_operation(&self, seq: u64, words: Words) {
        let entry = self.segment.operation(self.rank, operation_index(seq));
        // A seqlock: readers check the sequence before and after the words.
        entry[0].store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        entry[1].store(words[0], Ordering::Relaxed);
        entry[2].store(words[1], Ordering::Relaxed);
        entry[0].store(seq + 1, Ordering::Release);
        self.wake_others();
    }

    /// Local rank `rank`'s descriptor words of operation `seq`, once published.
    pub(crate) fn operation(&self, rank: u32, seq: u64) -> Option<Words> {
        let entry = self.segment.operation(rank, operation_index(seq));
        if entry[0].load(Ordering::Acquire) != seq + 1 {
            return None;
        }
        let words = [
            entry[1].load(Ordering::Relaxed),
            entry[2].load(Ordering::Relaxed),
        ];
        fence(Ordering::Acquire);
        (entry[0].load(Ordering::Relaxed) == seq + 1).then_some(words)
    }

    /// Records the machine's failure (the first one wins) and wakes every local
    /// rank; `record` says why, in the engine's failure encoding.
    pub(crate) fn fail(&self, record: [u64; RECORD_WORDS]) {
        if self.segment.claim_failure(self.rank) {
            self.segment.publish_failure(record);
        }
        self.wake_others();
    }

    /// The local rank that failed first on this machine and its record, if one
    /// has.
    pub(crate) fn failure(&self) -> Option<(u32, [u64; RECORD_WORDS])> {
        self.segment.failure()
    }

    fn wake_others(&self) {
        for r in (0..self.size).filter(|&r| r != self.rank) {
            self.segment.doorbell(r).ring();
        }
    }
}

/// The operation-table entry of operation `seq`.
fn operation_index(seq: u64) -> usize {
    #[expect(clippy::cast_possible_truncation, reason = "below OPERATIONS")]
    let i = (seq % OPERATIONS as u64) as usize;
    i
}
