//! The handshake that keeps a local rank's copies between tensors out of a
//! failed rank's memory.
//!
//! Where the machine's ranks copy between each other's tensors
//! ([`PeerCopy`](super::PeerCopy)), one process reads or writes memory that
//! another process's caller owns. On success the step's counters order every
//! copy before the owner's operation finishes. A failing engine, though,
//! declares its operations finished without waiting for its peers, and its
//! caller may then free or reuse the tensor: a peer still copying into it
//! would corrupt that process's memory, and one still reading it would
//! complete with whatever the caller wrote since.
//!
//! So every rank has one word ([`Segment::tensor_copies`](crate::shm::Segment)):
//! a bit per local rank copying to or from its tensors, and a closed bit.
//!
//! - A copier sets its bit in the owner's word and copies only if the value it
//!   replaced was not closed; it clears its bit once the copy is over (also
//!   when the copy fails or panics) and wakes the owner.
//! - A failed owner sets the closed bit, then declares its operations finished
//!   only once no live copier's bit is set ([`close`], again until none is).
//!
//! Both sides are read-modify-writes of one word, so they are ordered in its
//! modification order: either the copier's `fetch_or` comes first, and the
//! owner's sees its bit and waits for the `Release` clear (which its next
//! `close`, reading it, orders before anything the caller does next), or the
//! owner's comes first, and the copier sees it closed and copies nothing.
//! The loom models (`loom_models.rs`) run these functions over loom's atomics.
//!
//! A copier that dies with its bit set copies no more: the owner skips the
//! bits of processes that are gone (the step checks their liveness).

use crate::sync::unmodelled::Ordering;

/// The closed bit of a tensor-copy word.
pub(crate) const CLOSED: u64 = 1 << 63;

/// Local ranks a machine may have for its ranks to copy between tensors: one
/// bit of the word each.
pub(crate) const MAX_COPIERS: u32 = 63;

/// Where the tensor-copy words of a machine's local ranks are.
pub(crate) trait CopyWords {
    /// `fetch_or` on local rank `owner`'s word.
    fn fetch_or(&self, owner: u32, bits: u64, order: Ordering) -> u64;
    /// `fetch_and` on local rank `owner`'s word.
    fn fetch_and(&self, owner: u32, bits: u64, order: Ordering) -> u64;
    /// Wakes local rank `owner` (rings its doorbell).
    fn wake(&self, owner: u32);
}

/// Runs `copy`, a copy by local rank `me` to or from a tensor of local rank
/// `owner`, unless `owner` has closed its tensors: `None` then, and nothing
/// ran.
pub(crate) fn copy_with<W: CopyWords, T>(
    words: &W,
    me: u32,
    owner: u32,
    copy: impl FnOnce() -> T,
) -> Option<T> {
    debug_assert!(me < MAX_COPIERS, "local rank {me} has no copier bit");
    let bit = 1u64 << me;
    // Acquire: the owner's tensor, as published, is what the copy touches.
    let before = words.fetch_or(owner, bit, Ordering::AcqRel);
    /// Clears the copier's bit however the copy ends.
    struct Leave<'a, W: CopyWords> {
        words: &'a W,
        owner: u32,
        bit: u64,
    }
    impl<W: CopyWords> Drop for Leave<'_, W> {
        fn drop(&mut self) {
            // Release: the copy is over before the owner sees the bit clear.
            self.words
                .fetch_and(self.owner, !self.bit, Ordering::Release);
            self.words.wake(self.owner);
        }
    }
    let leave = Leave { words, owner, bit };
    if before & CLOSED != 0 {
        drop(leave);
        return None;
    }
    let out = copy();
    drop(leave);
    Some(out)
}

/// Closes local rank `me`'s tensors to copies (its engine failed), if they
/// are not yet, and returns the local ranks still copying, as a mask of bits:
/// the owner calls it until that is empty (or holds only processes that are
/// gone).
pub(crate) fn close<W: CopyWords>(words: &W, me: u32) -> u64 {
    // AcqRel: a copier whose bit this reads set is waited for; one that comes
    // later sees the closed bit. Reading a copier's Release clear orders its
    // copy before whatever the owner's caller does next.
    words.fetch_or(me, CLOSED, Ordering::AcqRel) & !CLOSED
}
