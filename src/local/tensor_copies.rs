//! The handshake that keeps a local rank's reads of another's tensor from
//! completing with bytes its owner's caller wrote after a failure.
//!
//! Where the machine's ranks read each other's tensors
//! ([`PeerCopy`](super::PeerCopy)), one process reads memory that another
//! process's caller owns. On success the step's counters order every read
//! before the owner's operation finishes. A failing engine, though, declares
//! its operations finished without waiting for its peers, and its caller may
//! then reuse the tensor: a peer still reading it would complete with
//! whatever the caller wrote since.
//!
//! So every rank has one word ([`Segment::tensor_copies`](crate::shm::Segment)):
//! a closed bit, and a bit per local rank reading its tensors.
//!
//! - A reader sets its bit, and reads only if the word was not closed; it
//!   clears its bit once the read is over (`Release`), and keeps what it read
//!   only if the word was still not closed then.
//! - A failing owner sets the closed bit (`Acquire`) and declares its
//!   operations finished at once: it waits for no reader.
//!
//! Every change of the word is a read-modify-write, so a reader's clear and
//! the owner's close are ordered in its modification order. If the clear
//! comes first, the close reads a value in the release sequence the clear
//! heads, so the read happens before the close, and before anything the
//! owner's caller does next. If the close comes first, the reader sees it and
//! throws the read away: its operation fails, naming the owner. So a reader
//! stopped in the middle of a read (a process stopped by a signal, a debugger)
//! holds its owner up for no time at all, and never completes with torn bytes
//! when it resumes. No rank ever writes into another's memory, which could
//! not be undone this way.
//!
//! The loom models (`loom_models.rs`) run these functions over loom's
//! atomics.

use crate::sync::unmodelled::Ordering;

/// The closed bit of a tensor-copy word.
pub(crate) const CLOSED: u64 = 1 << 63;

/// Local ranks a machine may have for its ranks to read each other's
/// tensors: one bit of the word each.
pub(crate) const MAX_READERS: u32 = 63;

/// Where the tensor-copy words of a machine's local ranks are.
pub(crate) trait CopyWords {
    /// `fetch_or` on local rank `owner`'s word.
    fn fetch_or(&self, owner: u32, bits: u64, order: Ordering) -> u64;
    /// `fetch_and` on local rank `owner`'s word.
    fn fetch_and(&self, owner: u32, bits: u64, order: Ordering) -> u64;
}

/// Runs `read`, a read by local rank `me` of a tensor of local rank `owner`,
/// and returns what it returned, unless `owner` has closed its tensors: `None`
/// then, and either nothing ran or what ran is to be thrown away (it may have
/// read bytes the owner's caller wrote after the close).
pub(crate) fn read_with<W: CopyWords, T>(
    words: &W,
    me: u32,
    owner: u32,
    read: impl FnOnce() -> T,
) -> Option<T> {
    debug_assert!(me < MAX_READERS, "local rank {me} has no reader bit");
    let bit = 1u64 << me;
    // Acquire: the owner's tensor, as published, is what the read sees.
    let before = words.fetch_or(owner, bit, Ordering::Acquire);
    /// Clears the reader's bit however the read ends; says whether the
    /// owner had closed its tensors by then.
    struct Leave<'a, W: CopyWords> {
        words: &'a W,
        owner: u32,
        bit: u64,
    }
    impl<W: CopyWords> Leave<'_, W> {
        fn closed(self) -> bool {
            let me = std::mem::ManuallyDrop::new(self);
            me.clear() & CLOSED != 0
        }

        fn clear(&self) -> u64 {
            // Release: the read is over before an owner that closes later
            // reads this value (or a later one of its release sequence).
            // Acquire: where the owner had closed, what it did before (its
            // failure record published) is visible to the refused reader.
            self.words
                .fetch_and(self.owner, !self.bit, Ordering::AcqRel)
        }
    }
    impl<W: CopyWords> Drop for Leave<'_, W> {
        fn drop(&mut self) {
            self.clear();
        }
    }
    let leave = Leave { words, owner, bit };
    if before & CLOSED != 0 {
        drop(leave);
        return None;
    }
    let out = read();
    if leave.closed() {
        return None;
    }
    Some(out)
}

/// Closes local rank `me`'s tensors to reads (its engine failed): a read
/// that starts later reads nothing, and one still running throws what it
/// read away. Reads that ended before are ordered before this call, and
/// what the owner did before it (its failure record, published in the
/// machine's control area) is visible to every read it refuses.
pub(crate) fn close<W: CopyWords>(words: &W, me: u32) {
    // Acquire: a reader's clear that this reads (or precedes in the word's
    // modification order) orders its read before whatever the owner's caller
    // does next. Release: a reader that sees CLOSED (its start's Acquire, or
    // its clear's) sees what this rank wrote before closing.
    words.fetch_or(me, CLOSED, Ordering::AcqRel);
}
