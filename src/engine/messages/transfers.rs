//! The driver's side of messages: taking posts, announcing receives,
//! matching sends, writing chunks, and finishing each message when its bytes
//! have left or landed (the protocol is in the module docs of `messages`).
//!
//! Everything here runs under the driver's lock (the transfers' own lock is
//! taken only by the driver, while it holds the driver's), and nothing
//! blocks: a write or control message the fabric has no room for waits for
//! the next pass, in order.

use std::collections::VecDeque;
use std::ptr::NonNull;

use fairring_rdma::fabric::{Fabric, FabricError, LocalRegion, RemoteRegion, WriteRequest};

use super::links::LinkState;
use super::mailbox::Offer;
use super::matching::Matcher;
use super::wire::{self, Control, MOST_BYTES, Ready, Reply};
use super::{CHUNK, CHUNKS_IN_FLIGHT, MESSAGE_CAPACITY, Post};
use crate::engine::Engine;
use crate::engine::direct::{CACHED, KeptRegions};
use crate::engine::failure::Fault;
use crate::engine::outbox::{Sent, send_control};
use crate::engine::tags::{Kind, message_immediate, message_token};
use crate::engine::work_table::{DONE, FAILED};
use crate::error::Error;
use crate::memory::MemorySpace;
use crate::shm::segment::BOUNCE_SLOTS;
use crate::sync::Ordering;

/// Bits of a receive's id its data's immediates carry.
pub(crate) const IMMEDIATE_ID_BITS: u32 = 28;
const IMMEDIATE_ID_MASK: u64 = (1 << IMMEDIATE_ID_BITS) - 1;

/// The messages the driver holds.
pub(crate) struct Transfers<R> {
    /// Per entry of the board.
    active: Vec<Active<R>>,
    /// Per rank.
    pub(super) peers: Vec<PeerState>,
    /// Sends with chunks the fabric had no room for yet.
    unposted: VecDeque<u64>,
    /// Peers with control messages waiting for room, in order.
    controls_waiting: Vec<u32>,
    /// Per rank: its index on this machine, where messages with it go
    /// through the machine's mailboxes.
    local: Vec<Option<u32>>,
    /// Those peers: (rank, local index).
    pub(super) locals: Vec<(u32, u32)>,
    /// Local sends offered, waiting for their receivers to settle them.
    pub(super) offered: Vec<u64>,
    /// Local receives copying their sends.
    pub(super) copying: Vec<u64>,
    /// This rank's bounce slots that no offer holds (a bit each).
    pub(super) bounce_free: u32,
    /// Tensors registered to send from, and windows: kept for the next
    /// message of the same memory, so that a warm engine registers nothing.
    sources: KeptRegions<R>,
    windows: KeptRegions<R>,
}

/// One peer's messages before they move.
#[derive(Default)]
pub(super) struct PeerState {
    /// Sends (left) waiting for announcements (right), per tag.
    matcher: Matcher<u64, Ready>,
    /// On the local path: receives (left) waiting for offers (right).
    pub(super) offers: Matcher<u64, Offer>,
    /// On the local path: the next offer's number, each way.
    pub(super) next_offer: u64,
    pub(super) next_expected: u64,
    /// On the local path: sends waiting for a free mailbox line, in order.
    pub(super) offering: VecDeque<u64>,
    /// Posts waiting for the peer to be linked.
    unlinked: Vec<u64>,
    /// Control messages waiting for room, in order.
    controls: VecDeque<([u8; MOST_BYTES], usize)>,
}

/// What an entry holds.
pub(super) enum Active<R> {
    Free,
    /// Posted; waiting for its peer's link, or for its match.
    Posted(Post),
    Sending(Sending<R>),
    Receiving(Receiving<R>),
    /// A local send: offer `k` to its peer, waiting for a line or settled;
    /// the bounce slot holding its bytes, once offered through one.
    Offered(Post, u64, Option<usize>),
    /// A local receive copying its offer's tensor: `copied` bytes so far.
    Copying {
        post: Post,
        offer: Offer,
        local: u32,
        copied: u64,
    },
}

pub(super) struct Sending<R> {
    post: Post,
    /// The tensor, registered to send from, where the registration is this
    /// message's own (else it is kept in `Transfers::sources`).
    own_source: Option<R>,
    /// Where it lands, and the receive it lands for.
    landing: RemoteRegion,
    receive: u64,
    /// Bytes posted so far, and chunks posted whose `Sent` has not come.
    posted: u64,
    in_flight: u32,
}

pub(super) struct Receiving<R> {
    post: Post,
    /// The tensor, registered for the sender to write into, where the
    /// registration is this message's own (else it is a window kept in
    /// `Transfers::windows`, or the receive is empty). Held, not read: the
    /// registration lasts as long as the receive.
    #[expect(dead_code, reason = "held for its drop")]
    own_landing: Option<R>,
    landed: u64,
}

impl<R> Transfers<R> {
    /// The transfers of a job of `world` ranks, `local[p]` the index on
    /// this machine of each peer messages with go through its mailboxes.
    pub(crate) fn new(world: u32, local: Vec<Option<u32>>) -> Transfers<R> {
        let locals = (0u32..)
            .zip(&local)
            .filter_map(|(p, l)| Some((p, (*l)?)))
            .collect();
        Transfers {
            active: (0..MESSAGE_CAPACITY).map(|_| Active::Free).collect(),
            peers: (0..world).map(|_| PeerState::default()).collect(),
            unposted: VecDeque::with_capacity(MESSAGE_CAPACITY),
            controls_waiting: Vec::with_capacity(world as usize),
            local,
            locals,
            offered: Vec::with_capacity(MESSAGE_CAPACITY),
            copying: Vec::with_capacity(MESSAGE_CAPACITY),
            bounce_free: (1 << BOUNCE_SLOTS) - 1,
            sources: KeptRegions::with_holders(CACHED, MESSAGE_CAPACITY),
            windows: KeptRegions::with_holders(CACHED, MESSAGE_CAPACITY),
        }
    }

    /// `peer`'s index on this machine, where messages with it go through
    /// the machine's mailboxes.
    pub(super) fn local_of(&self, peer: u32) -> Option<u32> {
        self.local.get(peer as usize).copied().flatten()
    }

    pub(super) fn get(&self, id: u64) -> &Active<R> {
        &self.active[Self::slot(id)]
    }

    fn slot(id: u64) -> usize {
        #[expect(clippy::cast_possible_truncation, reason = "below the table's length")]
        let i = (id % MESSAGE_CAPACITY as u64) as usize;
        i
    }

    pub(super) fn take(&mut self, id: u64) -> Active<R> {
        std::mem::replace(&mut self.active[Self::slot(id)], Active::Free)
    }

    pub(super) fn put(&mut self, id: u64, a: Active<R>) {
        self.active[Self::slot(id)] = a;
    }
}

/// The id a message's entry holds, if any.
fn id_of<R>(a: &Active<R>) -> Option<u64> {
    match a {
        Active::Free => None,
        Active::Posted(p) | Active::Offered(p, ..) | Active::Copying { post: p, .. } => Some(p.id),
        Active::Sending(s) => Some(s.post.id),
        Active::Receiving(r) => Some(r.post.id),
    }
}

/// The peer of the message an entry holds, if any.
fn peer_of<R>(a: &Active<R>) -> Option<u32> {
    match a {
        Active::Free => None,
        Active::Posted(p) | Active::Offered(p, ..) | Active::Copying { post: p, .. } => {
            Some(p.peer)
        }
        Active::Sending(s) => Some(s.post.peer),
        Active::Receiving(r) => Some(r.post.peer),
    }
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Takes the posts queued since the last pass, starts what may start,
    /// and posts what waited for room. Returns whether anything moved.
    pub(in crate::engine) fn drive_messages(&self) -> Result<bool, Fault> {
        // Nothing posted and not finished, and no control message waiting
        // for room: nothing to do. A peer's offer waits in the machine's
        // mailbox until a receive here wants it.
        if !self.messages.any_work() {
            return Ok(false);
        }
        let mut t = self.lock_transfers();
        // Posts that waited for their peer's link start before later ones
        // to the same peer, which keeps each tag's order.
        let mut moved = self.linked_since(&mut t)?;
        while let Some(post) = self.messages.queue.pop() {
            moved = true;
            if let Some(local) = t.local_of(post.peer) {
                self.start_local(&mut t, post, local)?;
                continue;
            }
            let waiting = !t.peers[post.peer as usize].unlinked.is_empty();
            match self.late_links.state(post.peer) {
                LinkState::Linked if !waiting => self.start_message(&mut t, post)?,
                LinkState::Failed(e) if !waiting => self.fail_message(&mut t, post.id, Some(e)),
                _ => {
                    t.peers[post.peer as usize].unlinked.push(post.id);
                    t.put(post.id, Active::Posted(post));
                }
            }
        }
        moved |= self.linked_since(&mut t)?;
        moved |= self.post_waiting(&mut t)?;
        if !t.locals.is_empty() {
            moved |= self.drive_local(&mut t)?;
        }
        Ok(moved)
    }

    /// Starts the posts of peers whose link settled since the last pass.
    fn linked_since(&self, t: &mut Transfers<F::Region>) -> Result<bool, Fault> {
        let mut moved = false;
        for peer in 0..t.peers.len() {
            if t.peers[peer].unlinked.is_empty() {
                continue;
            }
            #[expect(clippy::cast_possible_truncation, reason = "a rank")]
            let state = self.late_links.state(peer as u32);
            if matches!(state, LinkState::Pending) {
                continue;
            }
            moved = true;
            let ids = std::mem::take(&mut t.peers[peer].unlinked);
            for id in &ids {
                let Active::Posted(post) = t.take(*id) else {
                    continue;
                };
                match &state {
                    LinkState::Linked => self.start_message(t, post)?,
                    LinkState::Failed(e) => self.fail_message(t, post.id, Some(e.clone())),
                    LinkState::Pending => {}
                }
            }
            // The list's capacity goes back for the next.
            let mut ids = ids;
            ids.clear();
            t.peers[peer].unlinked = ids;
        }
        Ok(moved)
    }

    /// Starts a post whose peer is linked: a receive opens its tensor and
    /// announces it; a send waits for its announcement.
    fn start_message(&self, t: &mut Transfers<F::Region>, post: Post) -> Result<(), Fault> {
        if post.sending {
            let peer = post.peer as usize;
            t.put(post.id, Active::Posted(post));
            if let Some((send, ready)) = t.peers[peer].matcher.left(post.tag, post.id) {
                self.begin_send(t, send, &ready)?;
            }
            return Ok(());
        }
        let (own_landing, remote) = match self.open_landing(t, &post) {
            Ok(l) => l,
            Err(e) => {
                self.fail_message(t, post.id, Some(e));
                return Ok(());
            }
        };
        t.put(
            post.id,
            Active::Receiving(Receiving {
                post,
                own_landing,
                landed: 0,
            }),
        );
        let ready = Control::Ready(Ready {
            tag: post.tag,
            receive: post.id,
            bytes: post.bytes,
            dtype: post.dtype,
            landing: remote,
        });
        self.send_message_control(t, post.peer, &ready);
        Ok(())
    }

    /// Opens a receive's tensor to its sender: a window where the fabric has
    /// them (kept, and opened unless another receive in flight holds it open
    /// already), a registration of its own otherwise; nothing for an empty
    /// receive. Returns the registration it owns, and where the sender writes.
    fn open_landing(
        &self,
        t: &mut Transfers<F::Region>,
        post: &Post,
    ) -> Result<(Option<F::Region>, RemoteRegion), Error> {
        let fabric = &self.links.fabric;
        let empty = RemoteRegion {
            key: 0,
            address: 0,
            len: 0,
        };
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
            let window = match (held, t.windows.get(post.id)) {
                (true, Some(w)) => w,
                _ => {
                    return Err(failed.unwrap_or_else(|| {
                        refused(FabricError::InvalidArgument {
                            argument: "window",
                            reason: "every kept window is held by a message in flight".into(),
                        })
                    }));
                }
            };
            if t.windows.holders(post.id) == 1 {
                // SAFETY: the caller leaves the receive's tensor valid and
                // alone until the message finishes (`post_message`'s
                // contract); the window is closed before it does
                // (`close_landing`), or dropped, which closes it, when the
                // engine fails.
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
    fn close_landing(&self, t: &mut Transfers<F::Region>, id: u64) {
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
        if post.bytes != ready.bytes || post.dtype != ready.dtype {
            let reply = Control::Reply(Reply::Refused {
                receive: ready.receive,
                bytes: post.bytes,
                dtype: post.dtype,
            });
            self.send_message_control(t, post.peer, &reply);
            let error = mismatch(&post, ready.bytes, ready.dtype, self.links.rank);
            self.fail_message(t, send, Some(error));
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
                self.fail_message(t, send, Some(e));
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
    /// where the fabric has them (none returned), its own otherwise.
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
            // SAFETY: the caller leaves the tensor valid and unwritten until
            // the message finishes, which is after every write from it has
            // completed; dropping the region waits for those when the engine
            // fails first.
            let register = || unsafe { fabric.register_source(ptr, len) };
            let held = t.sources.take(post.id, (post.data, len), || {
                register().map_err(|e| failed = Some(refused(e))).ok()
            });
            if held {
                return Ok(None);
            }
            return Err(failed.unwrap_or_else(|| {
                refused(FabricError::InvalidArgument {
                    argument: "source",
                    reason: "every kept registration is held by a message in flight".into(),
                })
            }));
        }
        // SAFETY: as above; the registration is dropped before the message
        // finishes.
        unsafe { fabric.register(ptr, len) }
            .map_err(refused)
            .map(Some)
    }

    /// Posts the chunks and control messages that waited for room, in order.
    fn post_waiting(&self, t: &mut Transfers<F::Region>) -> Result<bool, Fault> {
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
                    self.fail_message(t, id, Some(e));
                }
            }
        }
        Ok(moved)
    }

    /// Sends control message `c` to `peer`, after any waiting for room.
    fn send_message_control(&self, t: &mut Transfers<F::Region>, peer: u32, c: &Control) {
        let mut bytes = [0; MOST_BYTES];
        let n = wire::encode(c, &mut bytes);
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

    /// A chunk of a message landed here.
    pub(in crate::engine) fn on_message_landed(
        &self,
        peer: u32,
        immediate: u32,
        len: u64,
    ) -> Result<(), Fault> {
        let carried = u64::from(immediate >> 4);
        let mut t = self.lock_transfers();
        let slot = Transfers::<F::Region>::slot(carried);
        let Active::Receiving(r) = &mut t.active[slot] else {
            return Err(unexpected(peer, "a message's bytes for no receive"));
        };
        if r.post.id & IMMEDIATE_ID_MASK != carried || r.post.peer != peer {
            return Err(unexpected(peer, "a message's bytes for another receive"));
        }
        r.landed += len;
        if r.landed > r.post.bytes {
            return Err(unexpected(peer, "more bytes than its receive holds"));
        }
        if r.landed == r.post.bytes {
            let id = r.post.id;
            self.finish_receive(&mut t, id, DONE, None);
        }
        Ok(())
    }

    /// A chunk this rank wrote has left its tensor.
    pub(in crate::engine) fn on_message_sent(&self, token: u64) -> Result<(), Fault> {
        let id = token >> 4;
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
            drop(t.take(id));
            t.sources.release(id);
            self.finish_message(id, DONE, None);
        }
        Ok(())
    }

    /// A control message of messages arrived from `peer`.
    pub(in crate::engine) fn on_message_control(
        &self,
        peer: u32,
        payload: &[u8],
    ) -> Result<(), Fault> {
        let Some(control) = wire::decode(payload) else {
            return Err(unexpected(peer, "a malformed message announcement"));
        };
        let mut t = self.lock_transfers();
        match control {
            Control::Ready(ready) => {
                if let Some((send, ready)) = t.peers[peer as usize].matcher.right(ready.tag, ready)
                {
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
                self.finish_receive(&mut t, receive, FAILED, Some(error));
            }
            Control::Reply(Reply::Empty { receive }) => {
                match &t.active[Transfers::<F::Region>::slot(receive)] {
                    Active::Receiving(r)
                        if r.post.id == receive && r.post.peer == peer && r.post.bytes == 0 => {}
                    _ => return Err(unexpected(peer, "an empty send for no empty receive")),
                }
                self.finish_receive(&mut t, receive, DONE, None);
            }
        }
        Ok(())
    }

    /// Finishes receive `id`: closes its window and lets go of its tensor.
    fn finish_receive(
        &self,
        t: &mut Transfers<F::Region>,
        id: u64,
        state: u32,
        error: Option<Error>,
    ) {
        drop(t.take(id));
        self.close_landing(t, id);
        self.finish_message(id, state, error);
    }

    /// Fails message `id` alone (its error `error`), letting go of whatever
    /// it holds: dropping a window or registration waits until the fabric
    /// has stopped using it.
    fn fail_message(&self, t: &mut Transfers<F::Region>, id: u64, error: Option<Error>) {
        if let Active::Offered(_, _, Some(slot)) = t.take(id) {
            // Its receiver left or this engine failed: nobody reads it now.
            t.bounce_free |= 1 << slot;
        }
        self.close_landing(t, id);
        t.sources.release(id);
        self.finish_message(id, FAILED, error);
    }

    /// Fails every message with `peer`, which left or failed (why:
    /// `error()`, made only if there is one). Allocates nothing otherwise: a
    /// peer's goodbye at the end of a job of collectives costs no message.
    pub(in crate::engine) fn fail_messages_with(&self, peer: u32, error: impl Fn() -> Error) {
        let mut t = self.lock_transfers();
        for slot in 0..t.active.len() {
            if peer_of(&t.active[slot]) != Some(peer) {
                continue;
            }
            if let Some(id) = id_of(&t.active[slot]) {
                self.fail_message(&mut t, id, Some(error()));
            }
        }
        let p = &mut t.peers[peer as usize];
        p.matcher = Matcher::default();
        p.offers = Matcher::default();
        p.unlinked.clear();
        p.controls.clear();
        p.offering.clear();
    }

    /// Fails every message, the engine having failed: each finishes once
    /// the fabric has let go of its tensor, and the posts still queued fail
    /// too.
    pub(in crate::engine) fn fail_all_messages(&self) {
        // Local readers of this rank's tensors are shut out first: a read
        // that overtook the close is thrown away, so no receiver keeps bytes
        // a caller writes after its send is declared failed.
        self.local.close_tensors();
        let mut t = self.lock_transfers();
        while let Some(post) = self.messages.queue.pop() {
            self.finish_message(post.id, FAILED, None);
        }
        let ids: Vec<u64> = t.active.iter().filter_map(id_of).collect();
        // Dropping the kept registrations waits until the fabric has let go
        // of every tensor: only then do the messages fail.
        t.sources.clear();
        t.windows.clear();
        for id in ids {
            self.fail_message(&mut t, id, None);
        }
        for p in &mut t.peers {
            p.matcher = Matcher::default();
            p.offers = Matcher::default();
            p.unlinked.clear();
            p.controls.clear();
            p.offering.clear();
        }
        t.unposted.clear();
        t.controls_waiting.clear();
        self.messages
            .controls_waiting
            .store(false, Ordering::Release);
        t.offered.clear();
        t.copying.clear();
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
            immediate: message_immediate(s.receive & IMMEDIATE_ID_MASK),
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

/// The mismatch of `post` with its match of `bytes` of `dtype` on the peer.
pub(super) fn mismatch(post: &Post, bytes: u64, dtype: fairring_core::DataType, me: u32) -> Error {
    let theirs = Post {
        id: 0,
        peer: me,
        tag: post.tag,
        sending: !post.sending,
        data: 0,
        bytes,
        dtype,
    };
    Error::Mismatch {
        sequence: post.id,
        rank: me,
        called: post.describe(),
        peer: post.peer,
        peer_called: theirs.describe(),
    }
}

/// A peer's message that this rank expects in no state.
fn unexpected(peer: u32, what: &str) -> Fault {
    Error::peer(
        peer,
        format!("{what} (the peer broke the message protocol)"),
    )
    .into()
}
