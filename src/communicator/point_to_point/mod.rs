//! Point-to-point messages: a send on one rank matched by a receive on
//! another, and what is built of them (all-to-all; gathers, scatters and
//! reduces that move as messages).
//!
//! A message is an operation of the communicator's own engine
//! (`engine::messages`): between machines its bytes go from the sender's
//! tensor straight into the window the receiver opened in its own, and
//! between ranks of one machine that may read each other's memory the
//! receiver copies them from the sender's tensor into its own. Nothing is
//! held per peer but a connection (made when a message first names a peer
//! the communicator has none to, by one linker thread per communicator) and
//! a few queues: no thread, no staging.
//!
//! Ordering is NCCL's and MPI's: the messages from one rank to another
//! match that rank's receives from it in the order both were posted, per
//! tag (the safe forms use tag 0). Any number may be in flight with any
//! number of peers. Gathers, scatters and reduces that move as messages
//! ([`rooted`], [`chain`]) hand theirs to the engine later, once their
//! checks pass; a message issued after one of them waits at the gate behind
//! it, so the order holds for those too. A message whose match has another
//! size or type fails alone, on both ranks, naming both (but for a send of
//! at most 16 KiB over the fabric, which goes eagerly, done once its bytes
//! have left: only its receive fails; see [`Call::send`]); a gather's,
//! scatter's or reduce's failure, seen where its work is waited on or
//! tested, fails the communicator as any failed collective does
//! (`communicator::work`).
//!
//! Posting never blocks the caller on a peer: a message to a peer not yet
//! linked waits in the engine until the link is made, and the link is made
//! once both ranks have named each other, whatever order they do it in.
//! Links meet through the job's store. Where that is fairring's own (served
//! by rank 0's process), rank 0's communicator must outlive every link made:
//! one made after it is gone fails, naming the closed store. Under
//! torchrun's agent store, or a runtime's, the store outlives the ranks.

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

use crate::communicator::{Call, Communicator, Work, WorkerEngine};
use crate::config::Config;
use crate::engine::messages::Post;
use crate::error::{Error, Result};
use crate::store::Store;
use gate::Gate;
pub(crate) use message::Message;
use message::Pool;
pub(super) use message::Posted;

/// This rank's point-to-point state: the pool of posts, the gate, and the
/// thread that connects to peers first named by a message.
pub(crate) struct PointToPoint {
    /// The communicator's configuration.
    config: Config,
    /// The job's store, scoped to the communicator: where late links meet.
    store: Arc<dyn Store>,
    rank: u32,
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

impl PointToPoint {
    pub(crate) fn new(config: &Config, store: Arc<dyn Store>) -> Arc<PointToPoint> {
        Arc::new(PointToPoint {
            config: config.clone(),
            store,
            rank: config.rank,
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
    /// As [`PointToPoint::start`].
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
}

impl Communicator {
    /// Sends `data` to rank `peer`, and waits until its bytes have left it
    /// (see [`Call::send`]).
    ///
    /// `data` is borrowed mutably, as the raw forms' contract asks; a send
    /// only reads it.
    pub fn send<T: Element>(&self, peer: u32, data: &mut [T]) -> Result<()> {
        let call = Call::send(peer, 0, data.as_ptr().cast(), data.len() as u64, T::DTYPE);
        // SAFETY: `data` is borrowed mutably until the message has finished:
        // `wait` returns then, or on failure, after which dropping the work
        // waits for it.
        unsafe { self.start(&call) }?.wait()
    }

    /// Receives into `data` the next message rank `peer` sends this rank,
    /// and waits. It must be of `data`'s length and type: another fails both
    /// ranks with a [`Error::Mismatch`] naming both (only this one, for a
    /// send of at most 16 KiB over the fabric: see [`Call::send`]).
    pub fn recv<T: Element>(&self, peer: u32, data: &mut [T]) -> Result<()> {
        let call = Call::recv(
            peer,
            0,
            data.as_mut_ptr().cast(),
            data.len() as u64,
            T::DTYPE,
        );
        // SAFETY: as in `send`.
        unsafe { self.start(&call) }?.wait()
    }

    /// Sends every `(peer, data)` of `sends` and receives into every
    /// `(peer, data)` of `receives`, all in flight at once, and waits for
    /// them all: a ring's exchange, or a pipeline stage's, in one call. A
    /// bad entry (a peer outside the job) is refused before anything is
    /// posted, naming its list and its index.
    pub fn send_recv<'a, T: Element>(
        &self,
        sends: &mut [(u32, &'a mut [T])],
        receives: &mut [(u32, &'a mut [T])],
    ) -> Result<()> {
        let calls: Vec<Call> = sends
            .iter()
            .map(|(peer, data)| {
                Call::send(*peer, 0, data.as_ptr().cast(), data.len() as u64, T::DTYPE)
            })
            .chain(receives.iter_mut().map(|(peer, data)| {
                Call::recv(
                    *peer,
                    0,
                    data.as_mut_ptr().cast(),
                    data.len() as u64,
                    T::DTYPE,
                )
            }))
            .collect();
        let sent = sends.len();
        let name = |i: usize| match i.checked_sub(sent) {
            None => ("sends", i),
            Some(j) => ("receives", j),
        };
        // SAFETY: every buffer is borrowed mutably by this call, which
        // returns only once every message has finished (waited, or dropped,
        // which waits).
        unsafe { self.start_list(&calls, name) }?.wait()
    }

    /// Posts a send of `count` elements of `dtype` at `data` to rank `peer`
    /// with tag `tag`, and returns at once, the message in flight (or
    /// waiting at the gate): [`Communicator::start`] of [`Call::send`].
    ///
    /// # Safety
    ///
    /// `data` must be valid for reads of `count` elements of `dtype`,
    /// aligned for it, and nothing else may write it until the [`Work`]
    /// reports completion (or is dropped, which waits).
    pub unsafe fn post_send(
        &self,
        peer: u32,
        tag: u32,
        data: *const u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.start(&Call::send(peer, tag, data, count, dtype)) }
    }

    /// Posts a receive of `count` elements of `dtype` into `data` from rank
    /// `peer` with tag `tag`, and returns at once:
    /// [`Communicator::start`] of [`Call::recv`].
    ///
    /// # Safety
    ///
    /// `data` must be valid for reads and writes of `count` elements of
    /// `dtype`, aligned for it, and nothing else may access it until the
    /// [`Work`] reports completion (or is dropped, which waits).
    pub unsafe fn post_recv(
        &self,
        peer: u32,
        tag: u32,
        data: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.start(&Call::recv(peer, tag, data, count, dtype)) }
    }

    /// Posts one message, checked by its caller: on the engine, or at the
    /// gate behind the calls it holds.
    ///
    /// # Safety
    ///
    /// As [`Communicator::post_send`] and [`Communicator::post_recv`]; `peer`
    /// is another rank of the job and `data` aligned, or null for no
    /// elements.
    pub(super) unsafe fn post_one(
        &self,
        peer: u32,
        sending: bool,
        tag: u32,
        data: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Arc<Posted>> {
        let p2p = &self.p2p;
        if let Some(e) = p2p.refused() {
            return Err(e);
        }
        let posted = p2p.pool.posted(peer, sending, tag, p2p.config.timeout);
        let call = if sending {
            Call::send(peer, tag, data, count, dtype)
        } else {
            Call::recv(peer, tag, data, count, dtype)
        };
        // SAFETY: the caller's contract covers the message until it reports
        // completion; `Message`'s drop waits for that.
        unsafe { p2p.gate.post_in_order(p2p, call, Arc::clone(&posted)) };
        Ok(posted)
    }

    /// An empty list of posted messages, from the pool, with room for `n`.
    pub(super) fn posted_list(&self, n: usize) -> Vec<Arc<Posted>> {
        self.p2p.pool.list(n)
    }

    /// The messages `first` and `more` (from [`Communicator::posted_list`],
    /// or empty), one work's.
    pub(super) fn messages_of(&self, first: Arc<Posted>, mut more: Vec<Arc<Posted>>) -> Message {
        if more.is_empty() {
            self.p2p.pool.give_back_list(more);
            return Message::one(first, &self.p2p.pool);
        }
        more.push(first);
        Message::many(more, &self.p2p.pool)
    }
}
