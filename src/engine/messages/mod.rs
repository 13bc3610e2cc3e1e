//! Point-to-point messages as operations of the engine: a send to a peer,
//! matched by that peer's receive, in order per (peer, tag).
//!
//! A message is not a collective: only its two ranks know of it, so it takes
//! no operation number, no staging buffer and no descriptor check. It runs
//! on the engine's own fabric, progress thread, doorbell and failure, and
//! holds nothing per peer but a connection (made when a message first names
//! the peer, `peer_links`) and a few queues.
//!
//! # Between machines (`between_machines`, its control messages in `control`)
//!
//! Receiver-driven, so that every byte moves once, from the sender's tensor
//! straight into the receiver's:
//!
//! 1. a rank that posts a receive opens its tensor to the sender (a window
//!    where the fabric has them, a registration otherwise) and announces it:
//!    `Ready` (tag, its place among the tag's receives, its message id,
//!    size, type, where to write);
//! 2. the sender matches its `k`-th send of a tag with the `k`-th `Ready` of
//!    that tag (`matching`), in whichever order the two arrive. A send of
//!    another size or type fails, and tells the receiver (`Refused`), whose
//!    receive fails too, each naming both (a send of at most
//!    [`eager::EAGER_BYTES`] does not fail: see below); an empty send tells
//!    it `Empty`;
//! 3. the sender writes the tensor into the window in chunks of [`CHUNK`]
//!    bytes ([`CHUNKS_IN_FLIGHT`] at a time), each carrying the receiver's
//!    message id in its immediate; the send is done once every chunk has
//!    left its tensor, the receive once every byte has landed, and the
//!    window is closed then.
//!
//! A receive posted before the matching send (the common case in a
//! pipeline, or a ping-pong whose receives are posted early) costs one
//! fabric trip for the data; otherwise one more for the announcement (and,
//! where the receive waits unannounced, below, one more for the send's
//! request of it).
//!
//! Except for small messages (`eager`; on this path, so also between ranks
//! of one machine that may not read each other's memory): a send of at most
//! [`eager::EAGER_BYTES`] whose announcement has not arrived goes at once
//! into a slot the receiver opened to this rank, and is done when its bytes
//! have left; the receive copies it out. A receive of at most that many
//! bytes posted first mostly does not announce itself (`eager` says when
//! it does): it waits for its eager send, and a send that cannot go eagerly
//! asks for the announcement (`Request`). One trip, whichever rank posts
//! first, while a slot is free. Such a send does not learn of a mismatch:
//! its receive fails, naming both.
//!
//! # Waiting, failing
//!
//! Each message has an entry in the messages' own table ([`Board`]), waited
//! on as operations are ([`Engine::wait_message`]). A message fails alone
//! where only it is wrong (a size or type its match does not agree with,
//! a peer that never names this rank, a peer that left); the engine failing
//! fails every message, after the fabric has stopped reading and writing
//! their tensors (dropping a registration waits for that).

mod between_machines;
mod control;
mod eager;
mod mailbox;
mod matching;
mod peer_links;
mod transfers;
mod within_machine;

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use fairring_core::DataType;
use fairring_rdma::fabric::Fabric;

#[cfg(all(test, not(loom)))]
pub(crate) use eager::EAGER_SLOTS;
pub(crate) use peer_links::LateLinks;
pub(crate) use transfers::Transfers;

use super::Engine;
use super::progress::park::{self, Wake};
use super::work_table::{DONE, FAILED, PENDING, WorkTable};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::sync::{AtomicBool, AtomicU64, Ordering};

/// Messages a rank may have posted and not yet released: the table's size.
pub(crate) const MESSAGE_ENTRIES: usize = 4096;

// A chunk's immediate carries a receive's id mod 2^27, from which the
// receiver finds its entry: the table's size divides that.
const _: () = assert!(
    MESSAGE_ENTRIES.is_power_of_two()
        && MESSAGE_ENTRIES <= 1 << crate::engine::tags::MESSAGE_ID_BITS
);

/// Bytes of one data write of a message: large enough that a write's cost is
/// its bytes, small enough that a collective's writes to the same peer are
/// not held behind a whole large message.
pub(crate) const CHUNK: u64 = 1 << 20;

/// Chunks of one send posted and not yet sent, at most: enough to keep the
/// connection busy, few enough that the fabric's queue to the peer stays
/// short (on 2x1 tcp, 16 MiB messages ran about 10% faster than with every
/// chunk posted at once).
pub(crate) const CHUNKS_IN_FLIGHT: u32 = 4;

/// A message a caller posted, as the driver takes it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Post {
    /// Its id: its entry in the [`Board`].
    pub(crate) id: u64,
    pub(crate) peer: u32,
    pub(crate) tag: u32,
    /// A send (else a receive).
    pub(crate) sending: bool,
    /// The caller's tensor, as an address.
    pub(crate) data: usize,
    pub(crate) bytes: u64,
    pub(crate) dtype: DataType,
}

impl Post {
    /// "a send of 16 x f32 to rank 1 (tag 0)", for errors.
    pub(crate) fn describe(&self) -> String {
        let count = self.bytes / self.dtype.size_bytes().max(1);
        let (what, way) = if self.sending {
            ("send", "to")
        } else {
            ("receive", "from")
        };
        format!(
            "a {what} of {count} x {} {way} rank {} (tag {})",
            self.dtype, self.peer, self.tag
        )
    }
}

/// What callers and the driver share of messages: the table of their states,
/// why each failed, and the queue of posts not yet taken by the driver.
pub(crate) struct Board {
    table: WorkTable,
    /// Per entry: why its message failed, where only it did.
    errors: Box<[Mutex<Option<Error>>]>,
    queue: ArrayQueue<Post>,
    /// The next message's id; held while posting, so that posts reach the
    /// driver in id order.
    next: Mutex<u64>,
    /// Messages posted and not yet finished.
    pending: AtomicU64,
    /// Whether control messages wait for room (a finished send's reply to
    /// its receiver among them): the driver's pass posts them even with no
    /// message pending.
    controls_waiting: AtomicBool,
}

impl Board {
    pub(crate) fn new() -> Board {
        Board {
            table: WorkTable::with_capacity(MESSAGE_ENTRIES),
            errors: (0..MESSAGE_ENTRIES).map(|_| Mutex::new(None)).collect(),
            queue: ArrayQueue::new(MESSAGE_ENTRIES),
            next: Mutex::new(0),
            pending: AtomicU64::new(0),
            controls_waiting: AtomicBool::new(false),
        }
    }

    fn error_slot(&self, id: u64) -> &Mutex<Option<Error>> {
        #[expect(clippy::cast_possible_truncation, reason = "below the table's length")]
        let i = (id % MESSAGE_ENTRIES as u64) as usize;
        &self.errors[i]
    }

    /// Whether a message is in flight.
    pub(crate) fn any_pending(&self) -> bool {
        self.pending.load(Ordering::Acquire) > 0
    }

    /// Whether the driver has anything of messages to do: one in flight,
    /// or a control message waiting for room.
    fn any_work(&self) -> bool {
        self.any_pending() || self.controls_waiting.load(Ordering::Acquire)
    }
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Posts a message (`post.id` is assigned here) and returns its id at
    /// once: the driver takes it on its next pass. Waits for a free entry of
    /// the table (driving meanwhile) up to the timeout.
    ///
    /// # Safety
    ///
    /// `post.data` must be valid for reads and writes of `post.bytes` bytes
    /// and left alone by the caller until the message has finished (its
    /// state is not pending), or the engine has failed.
    pub(crate) unsafe fn post_message(&self, mut post: Post) -> Result<u64> {
        if let Some(e) = self.failure() {
            return Err(Error::Failed { first: Box::new(e) });
        }
        let board = &self.messages;
        let mut next = board.next.lock().unwrap_or_else(PoisonError::into_inner);
        let id = *next;
        self.take_entry(&board.table, id, || {
            format!("a free message entry ({MESSAGE_ENTRIES} messages are outstanding)")
        })?;
        *board
            .error_slot(id)
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        post.id = id;
        self.parking.submitting();
        board.pending.fetch_add(1, Ordering::AcqRel);
        if board.queue.push(post).is_err() {
            // The table bounds the queue: never full.
            board.pending.fetch_sub(1, Ordering::AcqRel);
            self.parking.finished();
            board.table.give_back(id);
            return Err(Error::internal(
                "the message table bounds the posts queued",
                format!("more than {MESSAGE_ENTRIES} queued"),
            ));
        }
        *next = id + 1;
        drop(next);
        if self.parking.submitted(self.nanos()) == Wake::Doorbell {
            self.machine.doorbell().ring();
        }
        Ok(id)
    }

    /// Waits for message `id` to finish, driving while the driver is free;
    /// `Ok(false)` if it is still running at the timeout.
    pub(crate) fn wait_message(&self, id: u64, timeout: Option<Duration>) -> Result<bool> {
        park::wait_driving(self, || self.test_message(id), timeout)
    }

    /// Whether message `id` has finished; its error if it failed.
    pub(crate) fn test_message(&self, id: u64) -> Result<bool> {
        match self.messages.table.state(id) {
            Some(DONE) | None => Ok(true),
            Some(FAILED) => {
                let own = self
                    .messages
                    .error_slot(id)
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                Err(own.or_else(|| self.failure()).unwrap_or(Error::Aborted))
            }
            _ => Ok(false),
        }
    }

    /// Whether message `id` is still running.
    pub(crate) fn message_pending(&self, id: u64) -> bool {
        self.messages.table.state(id) == Some(PENDING)
    }

    /// Gives back the entry of message `id`, which has finished.
    pub(crate) fn release_message(&self, id: u64) {
        self.messages.table.give_back(id);
    }

    /// Marks message `id` finished (`DONE`, or `FAILED` for the reason
    /// `error`, if only it failed) and wakes its waiters. Driver only.
    fn finish_message(&self, id: u64, state: u32, error: Option<Error>) {
        if let Some(e) = error {
            *self
                .messages
                .error_slot(id)
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(e);
        }
        if self.messages.table.finish(id, state) {
            self.messages.pending.fetch_sub(1, Ordering::AcqRel);
            self.parking.finished();
        }
        self.machine.doorbell().ring();
    }
}
