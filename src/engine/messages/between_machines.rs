//! Messages between machines, over the fabric (the protocol is in the module
//! docs of `messages`): a receive opens its tensor and announces it, a send
//! matches its announcement and writes its chunks, and each finishes when its
//! bytes have left or landed.
//!
//! Everything here runs under the driver's lock, and nothing blocks: a write
//! or control message the fabric has no room for waits for the next pass, in
//! order.

use std::ptr::NonNull;

use fairring_rdma::fabric::{Fabric, FabricError, LocalRegion, RemoteRegion, WriteRequest};

use super::control::{self, Control, MOST_BYTES, NOWHERE, Ready, Reply};
use super::eager::EAGER_BYTES;
use super::transfers::{Active, Receiving, Sending, Transfers, mismatch, unexpected};
use super::{CHUNK, CHUNKS_IN_FLIGHT, Post};
use crate::engine::Engine;
use crate::engine::failure::Fault;
use crate::engine::outbox::{Sent, send_control};
use crate::engine::tags::{
    Kind, MESSAGE_ID_BITS, MessageBits, message_bits, message_immediate, message_token,
};
use crate::engine::work_table::{DONE, FAILED};
use crate::error::Error;
use crate::memory::MemorySpace;
use crate::sync::Ordering;

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Starts a post whose peer is linked: a small send goes eagerly where
    /// it may (`eager`), any other waits for its announcement; a receive
    /// takes its eager send if it has landed, and otherwise opens its tensor
    /// and announces it.
    pub(super) fn start_message(
        &self,
        t: &mut Transfers<F::Region>,
        post: Post,
    ) -> Result<(), Fault> {
        let peer = post.peer as usize;
        if t.peers[peer].left && post.sending {
            self.fail_after_goodbye(t, &post);
            return Ok(());
        }
        self.open_eager(t, post.peer);
        self.give_back_freed(t, post.peer);
        if post.sending {
            let ordinal = t.eager[peer].next_send(post.tag);
            t.put(post.id, Active::Posted(post));
            // An announcement waiting is this send's: it goes into the
            // receiver's tensor.
            if !t.peers[peer].matcher.right_waiting(post.tag)
                && self.try_send_eagerly(t, &post, ordinal)
            {
                return Ok(());
            }
            match t.peers[peer].matcher.left(post.tag, (ordinal, post.id)) {
                Some(((_, send), ready)) => {
                    if ready.ordinal != ordinal {
                        return Err(unexpected(post.peer, "a message announced out of order"));
                    }
                    self.begin_send(t, send, &ready)?;
                }
                // Its receive may wait for an eager send unannounced.
                None => {
                    let request = Control::Request {
                        tag: post.tag,
                        ordinal,
                    };
                    self.send_message_control(t, post.peer, &request);
                }
            }
            return Ok(());
        }
        let ordinal = t.eager[peer].next_receive(post.tag);
        if self.take_landed(t, &post, ordinal) {
            return Ok(());
        }
        if t.peers[peer].left {
            self.fail_after_goodbye(t, &post);
            return Ok(());
        }
        if !self.wait_unannounced(t, &post, ordinal) {
            self.announce_waiting_before(t, &post);
            self.announce(t, &post, ordinal);
            if matches!(t.get(post.id), Active::Receiving(r) if r.post.id == post.id) {
                Self::wait_for_bytes(t, &post, ordinal, true);
            }
        }
        Ok(())
    }

    /// Receive `post` (its `ordinal`) opens its tensor to its sender and
    /// announces itself; if it cannot, it fails, and tells the sender so in
    /// its announcement's place.
    pub(super) fn announce(&self, t: &mut Transfers<F::Region>, post: &Post, ordinal: u64) {
        let (own_landing, remote) = match self.open_landing(t, post) {
            Ok(l) => l,
            Err(e) => {
                self.settle_message(t, post.id, FAILED, Some(e));
                // Its send fails too, and takes its place in the count.
                let failed = Control::Ready(Ready {
                    tag: post.tag,
                    ordinal,
                    receive: post.id,
                    bytes: post.bytes,
                    dtype: post.dtype,
                    landing: NOWHERE,
                    failed: true,
                });
                self.send_message_control(t, post.peer, &failed);
                return;
            }
        };
        t.put(
            post.id,
            Active::Receiving(Receiving {
                post: *post,
                own_landing,
                landed: 0,
            }),
        );
        let ready = Control::Ready(Ready {
            tag: post.tag,
            ordinal,
            receive: post.id,
            bytes: post.bytes,
            dtype: post.dtype,
            landing: remote,
            failed: false,
        });
        self.send_message_control(t, post.peer, &ready);
    }

    /// Opens a receive's tensor to its sender: a window where the fabric has
    /// them (kept, and opened unless another receive in flight holds it open
    /// already; one of its own where every kept one is held), a registration
    /// of its own otherwise; nothing for an empty receive. Returns the
    /// registration it owns, and where the sender writes.
    fn open_landing(
        &self,
        t: &mut Transfers<F::Region>,
        post: &Post,
    ) -> Result<(Option<F::Region>, RemoteRegion), Error> {
        let fabric = &self.links.fabric;
        let empty = NOWHERE;
        let (Some(ptr), Ok(len)) = (
            NonNull::new(post.data as *mut u8),
            usize::try_from(post.bytes),
        ) else {
            return Ok((None, empty));
        };
        if len == 0 {
            return Ok((None, empty));
        }
        let refused = |e: FabricError| {
            Error::peer(
                post.peer,
                format!(
                    "{}: opening its tensor to the peer failed: {e}",
                    post.describe()
                ),
            )
        };
        if fabric.registers_windows() {
            let mut failed = None;
            let held = t.windows.take(post.id, (post.data, len), || {
                fabric
                    .register_window(ptr, len)
                    .map_err(|e| failed = Some(refused(e)))
                    .ok()
            });
            let window = match (held, t.windows.get(post.id), failed) {
                (true, Some(w), _) => w,
                (_, _, Some(e)) => return Err(e),
                // Every kept window is held by a receive in flight: one of
                // its own, dropped (which closes it) when it finishes.
                _ => {
                    let window = fabric.register_window(ptr, len).map_err(refused)?;
                    // SAFETY: closed when the receive finishes, which drops
                    // it first, with the caller leaving the tensor valid and
                    // alone until then (`post_message`).
                    unsafe { fabric.open_window(&window) }.map_err(refused)?;
                    let remote = window.remote();
                    return Ok((Some(window), remote));
                }
            };
            if t.windows.holders(post.id) == 1 {
                // The window is closed before the message finishes
                // (`close_landing`), or dropped, which closes it, when the
                // engine fails.
                // SAFETY: so, with the caller leaving the receive's tensor
                // valid and alone until then (`post_message`), it holds.
                if let Err(e) = unsafe { fabric.open_window(window) } {
                    t.windows.release(post.id);
                    return Err(refused(e));
                }
            }
            Ok((None, window.remote()))
        } else {
            // SAFETY: valid and alone until the message finishes, which
            // drops the registration first.
            let region = unsafe { fabric.register(ptr, len) }.map_err(refused)?;
            let remote = region.remote();
            Ok((Some(region), remote))
        }
    }

    /// Lets go of receive `id`'s landing: its own registration, or its hold
    /// on a kept window, which closes once no receive holds it (waiting for
    /// writes still landing, after a failure).
    pub(super) fn close_landing(&self, t: &mut Transfers<F::Region>, id: u64) {
        if t.windows.holders(id) == 1
            && let Some(window) = t.windows.get(id)
        {
            self.links.fabric.close_window(window);
        }
        t.windows.release(id);
    }

    /// A send met its announcement: checks it, and starts its writes.
    fn begin_send(
        &self,
        t: &mut Transfers<F::Region>,
        send: u64,
        ready: &Ready,
    ) -> Result<(), Fault> {
        let Active::Posted(post) = t.take(send) else {
            return Err(Error::internal(
                "a matched send is posted and not yet moving",
                format!("message {send}"),
            )
            .into());
        };
        if ready.failed {
            let e = Error::peer(
                post.peer,
                format!("{}: its receive failed on that rank", post.describe()),
            );
            self.settle_message(t, send, FAILED, Some(e));
            return Ok(());
        }
        if post.bytes != ready.bytes || post.dtype != ready.dtype {
            let reply = Control::Reply(Reply::Refused {
                receive: ready.receive,
                bytes: post.bytes,
                dtype: post.dtype,
            });
            self.send_message_control(t, post.peer, &reply);
            if post.bytes <= EAGER_BYTES {
                // As if it had gone eagerly: done, and only its receive
                // fails, whichever way it went.
                self.settle_message(t, send, DONE, None);
            } else {
                let error = mismatch(&post, ready.bytes, ready.dtype, self.links.rank);
                self.settle_message(t, send, FAILED, Some(error));
            }
            return Ok(());
        }
        if post.bytes == 0 {
            let reply = Control::Reply(Reply::Empty {
                receive: ready.receive,
            });
            self.send_message_control(t, post.peer, &reply);
            self.finish_message(send, DONE, None);
            return Ok(());
        }
        let own_source = match self.register_source(t, &post) {
            Ok(s) => s,
            Err(e) => {
                // The receiver hears nothing more of it, and fails when this
                // rank does (or the message is dropped).
                self.settle_message(t, send, FAILED, Some(e));
                return Ok(());
            }
        };
        t.put(
            send,
            Active::Sending(Sending {
                post,
                own_source,
                landing: ready.landing,
                receive: ready.receive,
                posted: 0,
                in_flight: 0,
            }),
        );
        t.unposted.push_back(send);
        Ok(())
    }

    /// Registers a send's tensor to send from: a kept source registration
    /// where the fabric has them (none returned), its own otherwise (or
    /// where every kept one is held).
    fn register_source(
        &self,
        t: &mut Transfers<F::Region>,
        post: &Post,
    ) -> Result<Option<F::Region>, Error> {
        let fabric = &self.links.fabric;
        let (Some(ptr), Ok(len)) = (
            NonNull::new(post.data as *mut u8),
            usize::try_from(post.bytes),
        ) else {
            return Err(Error::internal(
                "a send of bytes has a tensor",
                post.describe(),
            ));
        };
        let refused = |e: FabricError| {
            Error::peer(
                post.peer,
                format!("{}: registering its tensor failed: {e}", post.describe()),
            )
        };
        if fabric.registers_sources() {
            let mut failed = None;
            // The message finishes after every write from the tensor has
            // completed; dropping the region waits for those if the engine
            // fails first.
            // SAFETY: so the caller's tensor, valid and unwritten until the
            // message finishes (`post_message`), outlives every write.
            let register = || unsafe { fabric.register_source(ptr, len) };
            let held = t.sources.take(post.id, (post.data, len), || {
                register().map_err(|e| failed = Some(refused(e))).ok()
            });
            return match (held, failed) {
                (true, _) => Ok(None),
                (false, Some(e)) => Err(e),
                // Every kept registration is held by a send in flight: one
                // of its own, dropped before the message finishes.
                (false, None) => register().map_err(refused).map(Some),
            };
        }
        // SAFETY: as above; the registration is dropped before the message
        // finishes.
        unsafe { fabric.register(ptr, len) }
            .map_err(refused)
            .map(Some)
    }

    /// Posts the chunks and control messages that waited for room, in order.
    pub(super) fn post_waiting(&self, t: &mut Transfers<F::Region>) -> Result<bool, Fault> {
        let mut moved = false;
        let mut peers = std::mem::take(&mut t.controls_waiting);
        peers.retain(|&peer| {
            let queue = &mut t.peers[peer as usize].controls;
            while let Some((bytes, n)) = queue.front() {
                match send_control(&self.links.fabric, peer, Kind::MessageControl, &bytes[..*n]) {
                    Sent::Posted | Sent::Refused(_) => {
                        // A refused one: the peer failed, which its failure
                        // completion reports.
                        queue.pop_front();
                        moved = true;
                    }
                    Sent::Full => return true,
                }
            }
            false
        });
        self.messages
            .controls_waiting
            .store(!peers.is_empty(), Ordering::Release);
        t.controls_waiting = peers;
        let mut rounds = t.unposted.len();
        while rounds > 0 {
            rounds -= 1;
            let Some(id) = t.unposted.pop_front() else {
                break;
            };
            let slot = Transfers::<F::Region>::slot(id);
            let Transfers {
                active, sources, ..
            } = &mut *t;
            let Active::Sending(s) = &mut active[slot] else {
                continue;
            };
            let kept = sources.get(id);
            match post_chunks(&self.links, s, kept) {
                Ok(posted) => {
                    moved |= posted;
                    if s.posted < s.post.bytes {
                        t.unposted.push_back(id);
                    }
                }
                Err(e) => {
                    let e = Error::peer(s.post.peer, format!("{}: {e}", s.post.describe()));
                    self.settle_message(t, id, FAILED, Some(e));
                }
            }
        }
        Ok(moved)
    }

    /// Sends control message `c` to `peer`, after any waiting for room.
    pub(super) fn send_message_control(
        &self,
        t: &mut Transfers<F::Region>,
        peer: u32,
        c: &Control,
    ) {
        let mut bytes = [0; MOST_BYTES];
        let n = control::encode(c, &mut bytes);
        let queue = &mut t.peers[peer as usize].controls;
        if queue.is_empty() {
            match send_control(&self.links.fabric, peer, Kind::MessageControl, &bytes[..n]) {
                Sent::Posted | Sent::Refused(_) => return,
                Sent::Full => {}
            }
        }
        if queue.is_empty() {
            t.controls_waiting.push(peer);
        }
        queue.push_back((bytes, n));
        self.messages
            .controls_waiting
            .store(true, Ordering::Release);
    }

    /// A chunk of a message, or an eager send, landed here.
    pub(in crate::engine) fn on_message_landed(
        &self,
        peer: u32,
        immediate: u32,
        len: u64,
    ) -> Result<(), Fault> {
        let carried = match message_bits(u64::from(immediate)) {
            MessageBits::Chunk(carried) => carried,
            MessageBits::Eager { slot, .. } => return self.on_eager_landed(peer, slot, len),
        };
        let mut t = self.lock_transfers();
        let slot = Transfers::<F::Region>::slot(carried);
        let Active::Receiving(r) = &mut t.active[slot] else {
            return Err(unexpected(peer, "a message's bytes for no receive"));
        };
        if r.post.id & ((1 << MESSAGE_ID_BITS) - 1) != carried || r.post.peer != peer {
            return Err(unexpected(peer, "a message's bytes for another receive"));
        }
        r.landed += len;
        if r.landed > r.post.bytes {
            return Err(unexpected(peer, "more bytes than its receive holds"));
        }
        if r.landed == r.post.bytes {
            let id = r.post.id;
            self.settle_message(&mut t, id, DONE, None);
        }
        Ok(())
    }

    /// A chunk this rank wrote to `peer` has left its tensor, or an eager
    /// send its slot.
    pub(in crate::engine) fn on_message_sent(&self, peer: u32, token: u64) -> Result<(), Fault> {
        let id = match message_bits(token) {
            MessageBits::Chunk(id) => id,
            MessageBits::Eager { slot, send } => {
                self.on_eager_sent(peer, send, slot, true);
                return Ok(());
            }
        };
        let mut t = self.lock_transfers();
        let slot = Transfers::<F::Region>::slot(id);
        let Active::Sending(s) = &mut t.active[slot] else {
            // A send that failed alone (its peer left) with chunks in flight.
            return Ok(());
        };
        if s.post.id != id {
            return Ok(());
        }
        s.in_flight = s.in_flight.saturating_sub(1);
        if s.in_flight == 0 && s.posted == s.post.bytes {
            // Every write from the tensor is over: the registration goes first.
            self.settle_message(&mut t, id, DONE, None);
        }
        Ok(())
    }

    /// A control message of messages arrived from `peer`.
    pub(in crate::engine) fn on_message_control(
        &self,
        peer: u32,
        payload: &[u8],
    ) -> Result<(), Fault> {
        let Some(control) = control::decode(payload) else {
            return Err(unexpected(peer, "a malformed message announcement"));
        };
        let mut t = self.lock_transfers();
        match control {
            Control::Ready(ready) => {
                let sent = t.eager[peer as usize].sends_posted(ready.tag);
                let matcher = &mut t.peers[peer as usize].matcher;
                // A send posted already and not waiting for it went eagerly:
                // the receive takes those bytes. (Announcements come in
                // order, so one for a send waiting is the oldest's.)
                if ready.ordinal < sent
                    && matcher
                        .left_waiting(ready.tag)
                        .is_none_or(|&(ordinal, _)| ordinal != ready.ordinal)
                {
                    return Ok(());
                }
                if let Some(((ordinal, send), ready)) = matcher.right(ready.tag, ready) {
                    if ordinal != ready.ordinal {
                        return Err(unexpected(peer, "a message announced out of order"));
                    }
                    self.begin_send(&mut t, send, &ready)?;
                }
            }
            Control::Reply(Reply::Refused {
                receive,
                bytes,
                dtype,
            }) => {
                let post = match &t.active[Transfers::<F::Region>::slot(receive)] {
                    Active::Receiving(r) if r.post.id == receive && r.post.peer == peer => r.post,
                    _ => return Err(unexpected(peer, "a refusal of no receive")),
                };
                let error = mismatch(&post, bytes, dtype, self.links.rank);
                self.settle_message(&mut t, receive, FAILED, Some(error));
            }
            Control::Reply(Reply::Empty { receive }) => {
                match &t.active[Transfers::<F::Region>::slot(receive)] {
                    Active::Receiving(r)
                        if r.post.id == receive && r.post.peer == peer && r.post.bytes == 0 => {}
                    _ => return Err(unexpected(peer, "an empty send for no empty receive")),
                }
                self.settle_message(&mut t, receive, DONE, None);
            }
            Control::Slots(landing) => self.on_slots(&mut t, peer, landing),
            Control::Freed(slots) => self.on_freed(&mut t, peer, slots),
            Control::Request { tag, ordinal } => self.on_request(&mut t, peer, tag, ordinal)?,
        }
        Ok(())
    }
}

/// Posts a send's chunks while the fabric has room; returns whether it
/// posted any.
fn post_chunks<F: Fabric>(
    links: &crate::engine::links::Links<F>,
    s: &mut Sending<F::Region>,
    kept: Option<&F::Region>,
) -> Result<bool, FabricError> {
    let Some(source) = kept.or(s.own_source.as_ref()) else {
        return Err(FabricError::InvalidArgument {
            argument: "source",
            reason: "a send of bytes holds a registration".into(),
        });
    };
    let mut posted = false;
    while s.posted < s.post.bytes && s.in_flight < CHUNKS_IN_FLIGHT {
        let len = (s.post.bytes - s.posted).min(CHUNK);
        #[expect(
            clippy::cast_possible_truncation,
            reason = "a chunk of a tensor in memory"
        )]
        let (offset, n) = (s.posted as usize, len as usize);
        let request = WriteRequest {
            source,
            source_offset: offset,
            len: n,
            target: s.landing,
            target_offset: s.posted,
            immediate: message_immediate(s.receive),
            token: message_token(s.post.id),
        };
        match links.write(s.post.peer, request) {
            Ok(()) => {
                s.posted += len;
                s.in_flight += 1;
                posted = true;
            }
            Err(FabricError::QueueFull { .. }) => break,
            Err(e) => return Err(e),
        }
    }
    Ok(posted)
}
