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
mod gate;
mod hand_over;
mod message;
mod rooted;

use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::thread::JoinHandle;

use fairring_core::DataType;
use fairring_core::reduce::Element;

use crate::communicator::{Call, Communicator, WorkerEngine};
use crate::config::Config;
use crate::engine::messages::Post;
use crate::error::{Error, Result};
use crate::store::Store;
use gate::Gate;
pub use message::Message;
use message::{Pool, Posted};

/// This rank's point-to-point state: the pool of posts, the gate, and the
/// thread that connects to peers first named by a message.
pub(crate) struct Channels {
    /// The communicator's configuration.
    config: Config,
    /// The job's store, scoped to the communicator: where late links meet.
    store: Arc<dyn Store>,
    rank: u32,
    world: u32,
    closed: Mutex<bool>,
    aborted: Mutex<bool>,
    /// Finished messages, for reuse.
    pool: Arc<Pool>,
    /// Where the messages of gathers and scatters wait for their checks.
    gate: Gate,
    /// The engine the messages run on, once it exists.
    engine: OnceLock<Weak<WorkerEngine>>,
    /// The thread that links peers first named by a message.
    linker: Mutex<Option<JoinHandle<()>>>,
}

impl Channels {
    pub(crate) fn new(config: &Config, store: Arc<dyn Store>) -> Arc<Channels> {
        Arc::new(Channels {
            config: config.clone(),
            store,
            rank: config.rank,
            world: config.world_size,
            closed: Mutex::new(false),
            aborted: Mutex::new(false),
            pool: Pool::new(),
            gate: Gate::new(),
            engine: OnceLock::new(),
            linker: Mutex::new(None),
        })
    }

    /// Lets messages run on `engine`, once it exists.
    pub(crate) fn attach(&self, engine: &Arc<WorkerEngine>) {
        let _ = self.engine.set(Arc::downgrade(engine));
    }

    /// Starts `call` (a message's memory: one tensor of `count` x `dtype`)
    /// as the message `posted` describes, on the engine, or fails `posted`
    /// if it cannot start.
    ///
    /// # Safety
    ///
    /// `call`'s memory must stay valid and unshared until `posted` reports
    /// completion.
    pub(super) unsafe fn start(&self, call: Call, posted: Arc<Posted>) {
        match self.refused() {
            Some(e) => posted.settle(Err(e)),
            None => {
                // SAFETY: forwarded.
                let started = unsafe { self.start_on_engine(call, &posted) };
                posted.settle(started);
            }
        }
    }

    /// Why a message cannot start now, if it cannot.
    fn refused(&self) -> Option<Error> {
        if *self.aborted.lock().unwrap_or_else(PoisonError::into_inner) {
            return Some(Error::Aborted);
        }
        if *self.closed.lock().unwrap_or_else(PoisonError::into_inner) {
            return Some(hand_over::closed());
        }
        None
    }

    /// # Safety
    ///
    /// As [`Channels::start`].
    unsafe fn start_on_engine(
        &self,
        call: Call,
        posted: &Posted,
    ) -> Result<(Arc<WorkerEngine>, u64)> {
        let engine = self
            .engine
            .get()
            .and_then(Weak::upgrade)
            .ok_or_else(hand_over::closed)?;
        let (peer, sending, tag) = posted.route();
        let bytes = call
            .count
            .checked_mul(call.dtype.size_bytes())
            .ok_or_else(|| Error::invalid("count", "the message's bytes overflow"))?;
        if !engine.messages_go_local(peer) && engine.late_links.want(peer) {
            self.start_linker(&engine)?;
        }
        let post = Post {
            id: 0,
            peer,
            tag,
            sending,
            data: call.output as usize,
            bytes,
            dtype: call.dtype,
        };
        // SAFETY: the caller keeps the memory valid and unshared until the
        // message reports completion, which is the engine's finishing it.
        let id = unsafe { engine.post_message(post) }?;
        Ok((engine, id))
    }

    /// Starts the linker thread (the first time a peer is wanted).
    fn start_linker(&self, engine: &Arc<WorkerEngine>) -> Result<()> {
        let mut linker = self.linker.lock().unwrap_or_else(PoisonError::into_inner);
        if linker.is_none() {
            *linker = Some(crate::bootstrap::start_linker(
                engine,
                Arc::clone(&self.store),
                self.config.timeout,
            )?);
        }
        Ok(())
    }

    /// Settles what waits at the gate, refuses later messages, and stops
    /// the linker: after this no thread of messages touches the job's store.
    pub(crate) fn close(&self) {
        // The gate first: what it still holds goes to the engine, or fails.
        self.gate.close();
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = true;
        if let Some(engine) = self.engine.get().and_then(Weak::upgrade) {
            engine.late_links.close();
        }
        let linker = self
            .linker
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = linker {
            let _ = t.join();
        }
        self.pool.close();
    }

    /// Refuses later messages; what is in flight fails with the engine's
    /// abort (the communicator's).
    pub(crate) fn abort(&self) {
        *self.aborted.lock().unwrap_or_else(PoisonError::into_inner) = true;
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
        // Refused before it is queued, so that a bad pointer is named here.
        crate::communicator::check_pointer(data, count, dtype)?;
        if let Some(e) = channels.refused() {
            return Err(e);
        }
        let posted = channels
            .pool
            .posted(peer, sending, 0, channels.config.timeout);
        let call = Call::broadcast(data, count, dtype, 0);
        // SAFETY: the caller's contract covers the message until it reports
        // completion; `Message`'s drop waits for that.
        unsafe {
            channels
                .gate
                .post_in_order(channels, call, Arc::clone(&posted))
        };
        Ok(posted)
    }
}
