//! Point-to-point messages: a send on one rank matched by a receive on another.
//!
//! Every ordered pair of ranks that exchanges messages gets a **channel**: a
//! communicator of two ranks of its own, whose rank 0 is the sender and rank 1
//! the receiver, met through the job's store the first time either rank
//! names the pair. A message is the channel's broadcast from its rank 0, so it
//! runs on the same engine, fabric and checks as every collective: the
//! receiver's buffer is written by the fabric or the shared-memory step, and
//! the descriptor check compares the message's size and type with the
//! receive's (a receive of another size or type fails both ranks, naming
//! both). A channel between ranks of one machine runs over shared memory, and
//! a message of 64 KiB or more goes from the sender's tensor into the
//! receiver's in one copy where the two may copy between each other's memory
//! (`local::peer_copy`).
//!
//! Ordering is NCCL's: the messages from one rank to another match that rank's
//! receives from it in the order both were posted. Any number may be in
//! flight on a channel and on many channels at once. Gathers, scatters and
//! reduces that move as messages ([`rooted`], [`chain`]) hand theirs to the
//! channels later, once their checks pass; a message issued after one of them
//! waits at the gate behind it, so the order holds for those too. A failed
//! channel fails only its own messages, but a gather's, scatter's or reduce's
//! failure, seen where its work is waited on or tested, fails the communicator
//! as any failed collective does (`communicator::work`).
//!
//! Meeting a channel never blocks the caller: a channel is met on a thread of
//! its own once both its ranks have named it (by posting a message on it), and
//! a message posted before its channel is met waits in the channel's queue
//! and starts, in order, once it is. A rank therefore never waits for a peer
//! to reach its own first message (a ring of first sends would otherwise
//! wait in a circle).
//!
//! Channels meet through the job's store. Where that is fairring's own
//! (served by rank 0's process), rank 0's communicator must outlive every
//! meeting: a channel that meets after it is gone fails, naming the closed
//! store. Under torchrun's agent store, or a runtime's, the store outlives
//! the ranks.
//!
//! A channel stages messages through buffers of its own: at most
//! [`CHANNEL_MEMORY`] (or the communicator's budget, if smaller) per channel.

mod all_to_all;
mod chain;
mod channel;
mod gate;
mod hand_over;
mod message;
mod rooted;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use fairring_core::DataType;
use fairring_core::reduce::Element;

use crate::communicator::{Call, Communicator};
use crate::config::Config;
use crate::engine::links::Traffic;
use crate::error::{Error, Result};
use crate::store::Store;
use channel::Channel;
use gate::Gate;
pub use message::Message;
use message::{Pool, Posted};

/// The most staging memory one channel takes (the communicator's budget, if
/// smaller): a rank with channels to many peers (an all-to-all) holds one
/// per direction and peer.
pub const CHANNEL_MEMORY: u64 = 4 << 20;

/// This rank's channels, made as messages name them.
pub(crate) struct Channels {
    /// The communicator's configuration, from which each channel's is made.
    config: Config,
    /// The job's store (unscoped: a channel scopes it as any communicator does).
    store: Arc<dyn Store>,
    rank: u32,
    world: u32,
    /// By (sender, receiver).
    open: Mutex<HashMap<(u32, u32), Arc<Channel>>>,
    closed: Mutex<bool>,
    aborted: Mutex<bool>,
    /// Finished messages, for reuse.
    pool: Arc<Pool>,
    /// Where the messages of gathers and scatters wait for their checks.
    gate: Gate,
    /// The communicator's failure, if it has failed: a channel still meeting
    /// stops with it rather than wait for a peer that failed or was aborted
    /// until the timeout.
    parent: OnceLock<ParentFailure>,
}

/// Asks the communicator whether it has failed (and why).
pub(crate) type ParentFailure = Arc<dyn Fn() -> Option<Error> + Send + Sync>;

impl Channels {
    pub(crate) fn new(config: &Config, store: Arc<dyn Store>) -> Arc<Channels> {
        Arc::new(Channels {
            config: config.clone(),
            store,
            rank: config.rank,
            world: config.world_size,
            open: Mutex::new(HashMap::new()),
            closed: Mutex::new(false),
            aborted: Mutex::new(false),
            pool: Pool::new(),
            gate: Gate::new(),
            parent: OnceLock::new(),
        })
    }

    /// Lets the channels' meetings see the communicator fail (`failure`),
    /// once its engine exists.
    pub(crate) fn watch(&self, failure: ParentFailure) {
        let _ = self.parent.set(failure);
    }

    /// The channel from `src` to `dst` (one of them this rank), met when
    /// first named. Its reverse is met only when named too: a channel one
    /// side never uses would still be meeting when the communicator closes,
    /// and its peer would wait for it until the timeout.
    fn get(&self, src: u32, dst: u32) -> Result<Arc<Channel>> {
        if *self.closed.lock().unwrap_or_else(PoisonError::into_inner) {
            return Err(Error::invalid("comm", "the communicator is closing"));
        }
        if *self.aborted.lock().unwrap_or_else(PoisonError::into_inner) {
            return Err(Error::Aborted);
        }
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = open.get(&(src, dst)) {
            return Ok(Arc::clone(c));
        }
        let channel = Channel::meet(
            &self.config,
            &self.store,
            src,
            dst,
            src == self.rank,
            self.parent.get().cloned(),
        )?;
        open.insert((src, dst), Arc::clone(&channel));
        Ok(channel)
    }

    /// Settles what waits at the gate, fails every message still waiting for
    /// its channel, stops every meeting (joining its thread), and lets go of
    /// the store: after this no thread of a channel touches the job's store.
    pub(crate) fn close(&self) {
        // The gate first: what it still holds goes to the channels, or fails.
        self.gate.close();
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = true;
        let open: Vec<Arc<Channel>> = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, c)| c)
            .collect();
        for c in &open {
            c.close();
        }
        self.pool.close();
    }

    /// Aborts every channel (each met one's communicator; a meeting stops
    /// and fails what waits for it), and refuses later messages: what is in
    /// flight fails with [`Error::Aborted`]. What waits at the gate fails
    /// with the communicator's own abort.
    pub(crate) fn abort(&self) {
        *self.aborted.lock().unwrap_or_else(PoisonError::into_inner) = true;
        let open: Vec<Arc<Channel>> = self
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        for c in &open {
            c.abort();
        }
    }

    /// What the channels met so far have moved (see [`Traffic`]).
    pub(crate) fn traffic(&self) -> Traffic {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.values()
            .filter_map(|c| c.traffic())
            .fold(Traffic::default(), Traffic::plus)
    }

    /// Refuses a peer that is not another rank of the job.
    fn check_peer(&self, peer: u32) -> Result<()> {
        if peer >= self.world || peer == self.rank {
            return Err(Error::invalid(
                "peer",
                format!(
                    "rank {peer} is not another rank of this job of {} (this is rank {})",
                    self.world, self.rank
                ),
            ));
        }
        Ok(())
    }
}

impl Communicator {
    /// Sends `data` to rank `peer`, and waits until the peer has it (see
    /// [`Communicator::post_send`]).
    ///
    /// `data` is borrowed mutably because a message runs as its channel's
    /// broadcast, which may write the sender's own bytes back where they
    /// were; its contents are unchanged afterwards.
    pub fn send<T: Element>(&self, peer: u32, data: &mut [T]) -> Result<()> {
        // SAFETY: `data` is borrowed mutably until the message has finished:
        // `wait` returns then, or on failure, after which dropping the
        // message waits for it.
        unsafe { self.post_send(peer, data.as_mut_ptr().cast(), data.len() as u64, T::DTYPE) }?
            .wait()
    }

    /// Receives into `data` the next message rank `peer` sends this rank,
    /// and waits. It must be of `data`'s length and type: another fails both
    /// ranks with a [`Error::Mismatch`] naming both.
    pub fn recv<T: Element>(&self, peer: u32, data: &mut [T]) -> Result<()> {
        // SAFETY: as in `send`.
        unsafe { self.post_recv(peer, data.as_mut_ptr().cast(), data.len() as u64, T::DTYPE) }?
            .wait()
    }

    /// Sends every `(peer, data)` of `sends` and receives into every
    /// `(peer, data)` of `receives`, all in flight at once, and waits for
    /// them all: a ring's exchange, or a pipeline stage's, in one call.
    pub fn send_recv<'a, T: Element>(
        &self,
        sends: &mut [(u32, &'a mut [T])],
        receives: &mut [(u32, &'a mut [T])],
    ) -> Result<()> {
        // Every peer is checked before anything is posted: a bad one must not
        // leave the good ones waiting for their matches.
        for (peer, _) in sends.iter().chain(receives.iter()) {
            self.channels.check_peer(*peer)?;
        }
        let mut messages = Vec::with_capacity(sends.len() + receives.len());
        let mut first_error = None;
        for (sending, list) in [(true, sends), (false, receives)] {
            for (peer, data) in list.iter_mut() {
                let (ptr, count) = (data.as_mut_ptr().cast(), data.len() as u64);
                // SAFETY: every buffer is borrowed mutably by this call, which
                // returns only once every message has finished (waited, or
                // dropped below, which waits).
                let posted = unsafe { self.post(*peer, sending, ptr, count, T::DTYPE) };
                match posted {
                    Ok(m) => messages.push(m),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        for m in &messages {
            if let Err(e) = m.wait() {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Posts a send of `count` elements of `dtype` at `data` to rank `peer`
    /// and returns at once, the message in flight (or waiting for its
    /// channel to be met). Sends to one peer arrive in the order they were
    /// posted.
    ///
    /// # Safety
    ///
    /// `data` must be valid for reads and writes of `count` elements of
    /// `dtype`, aligned for it, and nothing else may write it until the
    /// [`Message`] reports completion (or is dropped, which waits). The
    /// message may write the sender's own bytes back where they were.
    pub unsafe fn post_send(
        &self,
        peer: u32,
        data: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Message> {
        // SAFETY: forwarded.
        unsafe { self.post(peer, true, data, count, dtype) }
    }

    /// Posts a receive of `count` elements of `dtype` into `data` from rank
    /// `peer` and returns at once. Receives from one peer match its sends in
    /// the order both were posted.
    ///
    /// # Safety
    ///
    /// `data` must be valid for reads and writes of `count` elements of
    /// `dtype`, aligned for it, and nothing else may access it until the
    /// [`Message`] reports completion (or is dropped, which waits).
    pub unsafe fn post_recv(
        &self,
        peer: u32,
        data: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Message> {
        // SAFETY: forwarded.
        unsafe { self.post(peer, false, data, count, dtype) }
    }

    /// # Safety
    ///
    /// As [`Communicator::post_send`] and [`Communicator::post_recv`].
    unsafe fn post(
        &self,
        peer: u32,
        sending: bool,
        data: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Message> {
        // SAFETY: forwarded.
        let posted = unsafe { self.post_one(peer, sending, data, count, dtype) }?;
        Ok(Message::one(posted, &self.channels.pool))
    }

    /// Posts one message on its channel.
    ///
    /// # Safety
    ///
    /// As [`Communicator::post_send`] and [`Communicator::post_recv`].
    pub(super) unsafe fn post_one(
        &self,
        peer: u32,
        sending: bool,
        data: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Arc<Posted>> {
        let channels = &self.channels;
        channels.check_peer(peer)?;
        let me = self.rank();
        let (src, dst) = if sending { (me, peer) } else { (peer, me) };
        // Refused before it is queued, so that a bad pointer is named here.
        crate::communicator::check_pointer(data, count, dtype)?;
        let channel = channels.get(src, dst)?;
        let posted = channels
            .pool
            .posted(peer, sending, src, dst, channel.timeout());
        let call = Call::broadcast(data, count, dtype, 0);
        // SAFETY: the caller's contract covers the message until it reports
        // completion; `Message`'s drop waits for that.
        unsafe {
            channels
                .gate
                .post_in_order(&channel, call, Arc::clone(&posted))
        };
        Ok(posted)
    }
}
