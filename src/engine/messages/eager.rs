//! Eager sends between machines: a send of at most [`EAGER_BYTES`] whose
//! receive has not been announced yet goes at once, a header and its bytes,
//! into one of the slots its receiver opened to this rank, and is done when
//! that write has left; the receiver copies it into its tensor when the
//! receive is posted, or as it lands if the receive was posted first. A
//! small send then costs one fabric trip, not an announcement's and then
//! its data's.
//!
//! # Order
//!
//! The `k`-th send of a tag to a peer meets the `k`-th receive of that tag
//! from it, whichever way it travels. Both ranks count their posts per
//! (peer, tag), its *ordinal*; an eager send carries its own in its header,
//! and an announcement (`Ready`) its receive's. A receive whose eager send
//! has landed takes it when posted and announces nothing.
//!
//! A small receive (at most [`EAGER_BYTES`]) posted first, from a peer it
//! exchanged slots with (each opened its own to the other), announces
//! nothing either: it waits for its eager send, and takes it as it lands.
//! At most [`EAGER_SLOTS`] receives from a peer wait so: the next announces
//! itself (a burst of receives posted first has more sends than slots). A send that cannot go eagerly (it
//! is larger, or finds no slot free, or the peer's slots are not known yet)
//! and finds no announcement waiting asks for one (`Request`, its ordinal):
//! the receiver announces that receive then, or as it is posted if it is
//! not yet. A larger receive announces itself as it is posted, and a
//! request for it is dropped. So a small message posted in either order
//! costs one trip and no word back, and a send that waits always has an
//! announcement coming, whatever its receive's size.
//!
//! A sender that has sent an ordinal eagerly drops an announcement of it:
//! the receive, announced as it was posted (larger, past the bound, or
//! before a later receive of its tag that announced itself), takes the
//! eager bytes as they land, or fails on them if the two do not match.
//!
//! # Slots
//!
//! When a rank first starts a message with a peer over the fabric, it opens
//! [`EAGER_SLOTS`] slots of [`SLOT_BYTES`] to the peer (`Slots`; to its
//! first [`EAGER_PEERS`] peers only), and gives back those whose sends it
//! has taken (`Freed`) with the next message it starts with the peer (in
//! the same write), or alone once half of them are free or the peer may
//! have none left. A send that finds no slot free goes by announcement:
//! nothing ever waits for a slot.
//!
//! # A mismatch
//!
//! A receive that meets an eager send of another size or type fails naming
//! both; the send, done already, is not told (as with MPI's eager sends).
//! So that a program does not fail one way or the other by a race, a send
//! of at most [`EAGER_BYTES`] that went by announcement does not fail on a
//! mismatch either: only its receive does (`between_machines`).
//!
//! Slot layout:
//!
//! ```text
//! bytes  0..4   tag (u32 LE)
//! byte   4      element type (DataType as u8)
//! bytes  8..16  ordinal (u64 LE)
//! bytes 16..24  bytes that follow (u64 LE, at most EAGER_BYTES)
//! bytes 32..    the send's bytes
//! ```

use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;

use fairring_core::DataType;
use fairring_rdma::fabric::{Fabric, FabricError, LocalRegion, RemoteRegion, WriteRequest};

use super::Post;
use super::control::Control;
use super::transfers::{Active, Receiving, Transfers, mismatch, unexpected};
use crate::engine::Engine;
use crate::engine::failure::Fault;
use crate::engine::tags::{EAGER_SLOTS_MAX, eager_immediate, eager_token};
use crate::engine::work_table::{DONE, FAILED};
use crate::error::Error;
use crate::memory::MemorySpace;

/// Largest send that goes eagerly.
pub(crate) const EAGER_BYTES: u64 = 16 << 10;

/// Slots a rank opens to each peer.
pub(crate) const EAGER_SLOTS: u32 = 4;

/// Peers a rank opens slots to, at most (the first it starts messages
/// with): a rank holds at most `2 * EAGER_PEERS * EAGER_SLOTS * SLOT_BYTES`
/// bytes of slots (8.4 MB), however many peers it exchanges messages with.
/// Messages with the others go by announcement.
pub(crate) const EAGER_PEERS: u32 = 64;

const _: () = assert!(EAGER_SLOTS <= EAGER_SLOTS_MAX && EAGER_SLOTS <= 32);

/// Controls to a peer kept room for, waiting for the fabric.
const CONTROLS_KEPT: usize = 8;

/// Bytes of a slot's header.
const HEADER: usize = 32;

/// Bytes of one slot: its header and the largest eager send.
#[expect(clippy::cast_possible_truncation, reason = "16 KiB")]
pub(crate) const SLOT_BYTES: usize = HEADER + EAGER_BYTES as usize;

/// Every slot, a bit each.
const ALL_SLOTS: u32 = if EAGER_SLOTS == 32 {
    u32::MAX
} else {
    (1 << EAGER_SLOTS) - 1
};

/// Memory for [`EAGER_SLOTS`] slots, owned here.
struct Area {
    words: NonNull<[u64]>,
}

impl Area {
    fn new() -> Area {
        let words = vec![0u64; EAGER_SLOTS as usize * SLOT_BYTES / 8].into_boxed_slice();
        Area {
            words: NonNull::from(Box::leak(words)),
        }
    }

    fn base(&self) -> NonNull<u8> {
        self.words.cast()
    }

    fn len(&self) -> usize {
        self.words.len() * 8
    }

    /// Where slot `slot` starts.
    fn slot(&self, slot: u32) -> *mut u8 {
        self.base()
            .as_ptr()
            .wrapping_add(slot as usize * SLOT_BYTES)
    }

    /// Where slot `slot`'s bytes start, after its header.
    fn data(&self, slot: u32) -> *mut u8 {
        self.slot(slot).wrapping_add(HEADER)
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: `words` came from `Box::leak` in `new`, and is dropped once;
        // any registration of it was dropped before (`Slots`' field order).
        drop(unsafe { Box::from_raw(self.words.as_ptr()) });
    }
}

// SAFETY: plain memory, reached only under the transfers' lock, and by the
// fabric within the protocol (a slot is written by one side at a time).
unsafe impl Send for Area {}
// SAFETY: as above.
unsafe impl Sync for Area {}

/// An area and its registration; the registration drops first.
struct Slots<R> {
    region: R,
    area: Area,
}

/// A send that landed before its receive was posted.
#[derive(Clone, Copy, Debug)]
struct Arrival {
    ordinal: u64,
    slot: u32,
    bytes: u64,
    dtype: DataType,
}

/// One tag's posts with one peer.
#[derive(Default)]
struct TagState {
    /// Ordinals of the next send and the next receive.
    sends: u64,
    receives: u64,
    /// Eager sends landed whose receives are not posted, by ordinal.
    arrived: VecDeque<Arrival>,
    /// Receives posted that an eager send may meet, by ordinal.
    waiting: VecDeque<Waiting>,
    /// Ordinals of sends that asked for their receives' announcements
    /// before those receives were posted, oldest first.
    requested: VecDeque<u64>,
}

/// A receive posted, before its bytes came.
#[derive(Clone, Copy, Debug)]
struct Waiting {
    ordinal: u64,
    id: u64,
    /// Whether it announced itself (else it waits for its eager send, or
    /// for its sender's request).
    announced: bool,
}

/// Eager sends with one peer.
pub(crate) struct EagerPeer<R> {
    /// Whether this rank has tried opening its slots to the peer.
    opened: bool,
    /// Where the peer writes its eager sends to this rank.
    inbox: Option<Slots<R>>,
    /// What this rank writes its eager sends from.
    outbox: Option<Slots<R>>,
    /// The peer's slots for this rank, once it opened them.
    remote: Option<RemoteRegion>,
    /// The peer's slots free for this rank, a bit each.
    remote_free: u32,
    /// This rank's outbox slots with a write in flight.
    out_busy: u32,
    /// Inbox slots holding a send landed and not yet taken.
    held: u32,
    /// Inbox slots taken and not yet given back.
    freed: u32,
    /// Receives from the peer waiting unannounced, every tag.
    unannounced: u32,
    tags: HashMap<u32, TagState>,
}

impl<R> Default for EagerPeer<R> {
    fn default() -> Self {
        EagerPeer {
            opened: false,
            inbox: None,
            outbox: None,
            remote: None,
            remote_free: 0,
            out_busy: 0,
            held: 0,
            freed: 0,
            unannounced: 0,
            tags: HashMap::new(),
        }
    }
}

impl<R> EagerPeer<R> {
    fn tag(&mut self, tag: u32) -> &mut TagState {
        tag_state(&mut self.tags, tag)
    }

    /// Sends of `tag` posted to the peer so far.
    pub(super) fn sends_posted(&self, tag: u32) -> u64 {
        self.tags.get(&tag).map_or(0, |s| s.sends)
    }

    /// The ordinal of the next send of `tag` to the peer.
    pub(super) fn next_send(&mut self, tag: u32) -> u64 {
        let s = self.tag(tag);
        s.sends += 1;
        s.sends - 1
    }

    /// The ordinal of the next receive of `tag` from the peer.
    pub(super) fn next_receive(&mut self, tag: u32) -> u64 {
        let s = self.tag(tag);
        s.receives += 1;
        s.receives - 1
    }

    /// The peer left or failed: receives waiting fail elsewhere, and no
    /// request is answered. Sends landed stay, for receives posted later.
    pub(super) fn forget_waiting(&mut self) {
        self.unannounced = 0;
        for state in self.tags.values_mut() {
            state.waiting.clear();
            state.requested.clear();
        }
    }

    /// This rank failed: nothing more is taken.
    pub(super) fn forget_all(&mut self) {
        self.forget_waiting();
        for state in self.tags.values_mut() {
            state.arrived.clear();
        }
        self.held = 0;
    }
}

/// Tag `tag`'s state in `tags`, made on first use.
fn tag_state(tags: &mut HashMap<u32, TagState>, tag: u32) -> &mut TagState {
    tags.entry(tag).or_insert_with(|| TagState {
        arrived: VecDeque::with_capacity(EAGER_SLOTS as usize),
        waiting: VecDeque::with_capacity(16),
        requested: VecDeque::with_capacity(EAGER_SLOTS as usize),
        ..TagState::default()
    })
}

/// The header of slot `slot` of `area`.
fn read_header(area: &Area, slot: u32) -> (u32, u8, u64, u64) {
    let mut h = [0u8; HEADER];
    // SAFETY: the slot lies within the area; its write has landed whole (a
    // landing is reported once every byte is in place), and the peer writes
    // it again only once this rank has given it back.
    unsafe { std::ptr::copy_nonoverlapping(area.slot(slot), h.as_mut_ptr(), HEADER) };
    let word = |at: usize| u64::from_le_bytes(h[at..at + 8].try_into().unwrap_or([0; 8]));
    (
        u32::from_le_bytes([h[0], h[1], h[2], h[3]]),
        h[4],
        word(8),
        word(16),
    )
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Opens this rank's slots to `peer`, once: registers them, tells the
    /// peer where they are, and registers the outbox it sends from. Where
    /// the fabric refuses, messages with the peer go by announcement only.
    pub(super) fn open_eager(&self, t: &mut Transfers<F::Region>, peer: u32) {
        if t.eager[peer as usize].opened {
            return;
        }
        t.eager[peer as usize].opened = true;
        // Room for the controls that wait for the fabric (a request, an
        // announcement, slots given back), taken with the pair's first
        // message: a warm message allocates nothing, whichever of them the
        // fabric's queue first has no room for.
        t.peers[peer as usize].controls.reserve(CONTROLS_KEPT);
        if t.eager_peers == EAGER_PEERS {
            return;
        }
        let e = &mut t.eager[peer as usize];
        let fabric = &self.links.fabric;
        let inbox = Area::new();
        let (ptr, len) = (inbox.base(), inbox.len());
        let registered = if fabric.registers_windows() {
            fabric.register_window(ptr, len).and_then(|w| {
                // SAFETY: the area lives as long as the window, which is
                // dropped (closing it) first; this rank reads a slot only
                // after its write landed and before giving it back.
                unsafe { fabric.open_window(&w) }.map(|()| w)
            })
        } else {
            // SAFETY: as above, for the registration.
            unsafe { fabric.register(ptr, len) }
        };
        let outbox = Area::new();
        let (out_ptr, out_len) = (outbox.base(), outbox.len());
        let out_registered = if fabric.registers_sources() {
            // SAFETY: the area outlives the registration (dropped first), and
            // this rank writes a slot only while no write from it is in flight.
            unsafe { fabric.register_source(out_ptr, out_len) }
        } else {
            // SAFETY: as above.
            unsafe { fabric.register(out_ptr, out_len) }
        };
        match (registered, out_registered) {
            (Ok(region), Ok(out_region)) => {
                let remote = region.remote();
                e.inbox = Some(Slots {
                    region,
                    area: inbox,
                });
                e.outbox = Some(Slots {
                    region: out_region,
                    area: outbox,
                });
                t.eager_peers += 1;
                self.send_message_control(t, peer, &Control::Slots(remote));
            }
            (Err(e), _) | (_, Err(e)) => log::warn!(
                "fairring rank {}: messages with rank {peer} go without eager sends: \
                 registering their slots failed: {e}",
                self.links.rank
            ),
        }
    }

    /// Sends `post` (its `ordinal`) eagerly if it is small, the peer has
    /// opened its slots and one is free; returns whether it went.
    pub(super) fn try_send_eagerly(
        &self,
        t: &mut Transfers<F::Region>,
        post: &Post,
        ordinal: u64,
    ) -> bool {
        let e = &mut t.eager[post.peer as usize];
        let (Some(remote), Some(outbox)) = (e.remote, e.outbox.as_ref()) else {
            return false;
        };
        let free = e.remote_free & !e.out_busy;
        if post.bytes > EAGER_BYTES || free == 0 {
            return false;
        }
        let slot = free.trailing_zeros();
        #[expect(clippy::cast_possible_truncation, reason = "at most EAGER_BYTES")]
        let n = post.bytes as usize;
        let mut header = [0u8; HEADER];
        header[..4].copy_from_slice(&post.tag.to_le_bytes());
        header[4] = post.dtype as u8;
        header[8..16].copy_from_slice(&ordinal.to_le_bytes());
        header[16..24].copy_from_slice(&post.bytes.to_le_bytes());
        // SAFETY: the slot lies within the outbox, and no write from it is
        // in flight (`out_busy`).
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), outbox.area.slot(slot), HEADER) };
        if n > 0 {
            // SAFETY: as above, for the slot's bytes; the caller's tensor
            // holds `n` bytes, valid until the send finishes
            // (`post_message`), and is not the outbox.
            unsafe {
                std::ptr::copy_nonoverlapping(post.data as *const u8, outbox.area.data(slot), n);
            }
        }
        let offset = slot as usize * SLOT_BYTES;
        let request = WriteRequest {
            source: &outbox.region,
            source_offset: offset,
            len: HEADER + n,
            target: remote,
            target_offset: offset as u64,
            immediate: eager_immediate(slot),
            token: eager_token(post.id, slot),
        };
        match self.links.write(post.peer, request) {
            Ok(()) => {
                let e = &mut t.eager[post.peer as usize];
                e.remote_free &= !(1 << slot);
                e.out_busy |= 1 << slot;
                t.put(post.id, Active::Eager(*post, slot));
                true
            }
            // No room, or the peer failed (which its completion reports):
            // the send goes by announcement (and fails with the peer).
            Err(FabricError::QueueFull { .. } | FabricError::PeerFailed { .. }) => false,
            // The write refused (the peer's slots are not what it said):
            // this send and the later ones go by announcement.
            Err(e) => {
                log::warn!(
                    "fairring rank {}: sends to rank {} go without eager sends: {e}",
                    self.links.rank,
                    post.peer
                );
                t.eager[post.peer as usize].remote = None;
                false
            }
        }
    }

    /// Eager send `send` through `slot` to `peer` has left (or, `sent`
    /// false, never will: its peer left).
    pub(super) fn on_eager_sent(&self, peer: u32, send: u64, slot: u32, sent: bool) {
        let mut t = self.lock_transfers();
        if let Some(e) = t.eager.get_mut(peer as usize) {
            e.out_busy &= !(1 << slot);
        }
        if let Active::Eager(post, s) = t.get(send)
            && post.id == send
            && *s == slot
        {
            if sent {
                self.settle_message(&mut t, send, DONE, None);
            } else {
                let e = Error::peer(peer, "left the job before this message was sent whole");
                self.settle_message(&mut t, send, FAILED, Some(e));
            }
        }
    }

    /// Receive `post` (its `ordinal`): takes its eager send if it has landed;
    /// returns whether it did.
    pub(super) fn take_landed(
        &self,
        t: &mut Transfers<F::Region>,
        post: &Post,
        ordinal: u64,
    ) -> bool {
        let s = t.eager[post.peer as usize].tag(post.tag);
        if s.arrived.front().is_none_or(|a| a.ordinal != ordinal) {
            return false;
        }
        let Some(a) = s.arrived.pop_front() else {
            return false;
        };
        self.take_eager(t, post, a);
        true
    }

    /// Receive `post` (its `ordinal`), posted before its bytes came: an
    /// eager send landing finds it. `announced`: whether it announced
    /// itself.
    pub(super) fn wait_for_bytes(
        t: &mut Transfers<F::Region>,
        post: &Post,
        ordinal: u64,
        announced: bool,
    ) {
        let Transfers { eager, active, .. } = t;
        let s = eager[post.peer as usize].tag(post.tag);
        if s.waiting.len() == s.waiting.capacity() {
            // Those finished by their chunks go.
            s.waiting.retain(|w| {
                matches!(&active[Transfers::<F::Region>::slot(w.id)],
                    Active::Receiving(r) if r.post.id == w.id)
            });
        }
        s.waiting.push_back(Waiting {
            ordinal,
            id: post.id,
            announced,
        });
    }

    /// Receive `post` (its `ordinal`), whose eager send has not landed:
    /// waits for it unannounced if it may come (the receive is small, both
    /// ranks opened their slots to each other, fewer receives from the peer
    /// than it has slots wait so, and the send has not asked for an
    /// announcement); returns whether it does. Past the slots, a burst of
    /// receives posted first announces itself, as its sends could not all
    /// go eagerly: they find their announcements instead of asking.
    pub(super) fn wait_unannounced(
        &self,
        t: &mut Transfers<F::Region>,
        post: &Post,
        ordinal: u64,
    ) -> bool {
        let e = &mut t.eager[post.peer as usize];
        // The peer sends eagerly to this rank only once both opened their
        // slots to each other (its own `Slots` came).
        let may_come = e.inbox.is_some() && e.remote.is_some() && e.unannounced < EAGER_SLOTS;
        let s = e.tag(post.tag);
        if let Some(at) = s.requested.iter().position(|&o| o == ordinal) {
            s.requested.remove(at);
            return false;
        }
        if post.bytes > EAGER_BYTES || !may_come {
            return false;
        }
        e.unannounced += 1;
        t.put(
            post.id,
            Active::Receiving(Receiving {
                post: *post,
                own_landing: None,
                landed: 0,
            }),
        );
        Self::wait_for_bytes(t, post, ordinal, false);
        true
    }

    /// Receive `post` is about to announce itself as it is posted: the
    /// receives of its tag from its peer waiting unannounced before it
    /// announce themselves first, so that the sender meets announcements in
    /// order (it pairs them with its sends waiting by order, and drops those
    /// of sends that went eagerly).
    pub(super) fn announce_waiting_before(&self, t: &mut Transfers<F::Region>, post: &Post) {
        let (peer, tag) = (post.peer as usize, post.tag);
        // By place, not by a list of them: a warm pass allocates nothing
        // (announcing touches no waiting list).
        let mut at = 0;
        while at < t.eager[peer].tag(tag).waiting.len() {
            self.announce_waiting(t, peer, tag, at);
            at += 1;
        }
    }

    /// The receive at place `at` of `tag`'s waiting list from `peer`, if it
    /// waits unannounced, announces itself (unless it failed since: its
    /// peer's failure fails it too).
    fn announce_waiting(&self, t: &mut Transfers<F::Region>, peer: usize, tag: u32, at: usize) {
        let e = &mut t.eager[peer];
        let Some(w) = tag_state(&mut e.tags, tag).waiting.get_mut(at) else {
            return;
        };
        if w.announced {
            return;
        }
        w.announced = true;
        let (ordinal, id) = (w.ordinal, w.id);
        e.unannounced = e.unannounced.saturating_sub(1);
        if let Active::Receiving(r) = t.get(id)
            && r.post.id == id
        {
            let post = r.post;
            self.announce(t, &post, ordinal);
        }
    }

    /// `peer`'s send `ordinal` of `tag` waits for its receive's
    /// announcement: a receive waiting unannounced announces itself now; one
    /// not posted yet will as it is posted; one announced already (a larger
    /// receive, or one posted before this rank's slots opened) needs nothing.
    pub(super) fn on_request(
        &self,
        t: &mut Transfers<F::Region>,
        peer: u32,
        tag: u32,
        ordinal: u64,
    ) -> Result<(), Fault> {
        let s = t.eager[peer as usize].tag(tag);
        let Some(at) = s.waiting.iter().position(|w| w.ordinal == ordinal) else {
            if ordinal >= s.receives {
                if s.requested.back().is_some_and(|&b| b >= ordinal) {
                    return Err(unexpected(peer, "requests out of order"));
                }
                s.requested.push_back(ordinal);
            }
            return Ok(());
        };
        self.announce_waiting(t, peer as usize, tag, at);
        Ok(())
    }

    /// An eager send landed here from `peer` in slot `slot`, `len` bytes.
    pub(super) fn on_eager_landed(&self, peer: u32, slot: u32, len: u64) -> Result<(), Fault> {
        let mut t = self.lock_transfers();
        let e = &mut t.eager[peer as usize];
        if slot >= EAGER_SLOTS {
            return Err(unexpected(peer, "an eager send into no slot"));
        }
        if (e.held | e.freed) & (1 << slot) != 0 {
            return Err(unexpected(peer, "an eager send into a slot not given back"));
        }
        let Some(inbox) = e.inbox.as_ref() else {
            return Err(unexpected(
                peer,
                "an eager send into slots never opened to it",
            ));
        };
        let (tag, dtype, ordinal, bytes) = read_header(&inbox.area, slot);
        e.held |= 1 << slot;
        let dtype = DataType::from_u8(dtype);
        let Some(dtype) = dtype.filter(|_| bytes <= EAGER_BYTES && len == HEADER as u64 + bytes)
        else {
            return Err(unexpected(peer, "an eager send with a malformed header"));
        };
        let arrival = Arrival {
            ordinal,
            slot,
            bytes,
            dtype,
        };
        let Transfers { eager, active, .. } = &mut *t;
        let e = &mut eager[peer as usize];
        let s = tag_state(&mut e.tags, tag);
        let at = s.waiting.iter().position(|w| w.ordinal == ordinal);
        let waited = at.and_then(|i| s.waiting.remove(i));
        if waited.is_some_and(|w| !w.announced) {
            e.unannounced = e.unannounced.saturating_sub(1);
        }
        let receive = waited.map(|w| w.id);
        match receive.map(|id| &active[Transfers::<F::Region>::slot(id)]) {
            Some(Active::Receiving(r)) if Some(r.post.id) == receive => {
                let post = r.post;
                self.take_eager(&mut t, &post, arrival);
            }
            // Its receive failed already: the slot goes back.
            Some(_) => self.give_back_slot(&mut t, peer, slot),
            None if ordinal < s.receives => self.give_back_slot(&mut t, peer, slot),
            None => {
                if s.arrived.back().is_some_and(|b| b.ordinal >= ordinal) {
                    return Err(unexpected(peer, "eager sends out of order"));
                }
                s.arrived.push_back(arrival);
            }
        }
        Ok(())
    }

    /// Receive `post` meets eager send `a`: copies it into the tensor, or
    /// fails if the two disagree; the slot goes back either way.
    fn take_eager(&self, t: &mut Transfers<F::Region>, post: &Post, a: Arrival) {
        if post.bytes != a.bytes || post.dtype != a.dtype {
            let e = mismatch(post, a.bytes, a.dtype, self.links.rank);
            self.settle_message(t, post.id, FAILED, Some(e));
        } else {
            if let Some(inbox) = t.eager[post.peer as usize].inbox.as_ref()
                && a.bytes > 0
            {
                #[expect(clippy::cast_possible_truncation, reason = "at most EAGER_BYTES")]
                let n = a.bytes as usize;
                // SAFETY: the slot's bytes landed whole and stay until it is
                // given back, below; the tensor holds `n` bytes, valid and
                // alone until the receive finishes (`post_message`).
                unsafe {
                    std::ptr::copy_nonoverlapping(inbox.area.data(a.slot), post.data as *mut u8, n);
                }
            }
            self.settle_message(t, post.id, DONE, None);
        }
        self.give_back_slot(t, post.peer, a.slot);
    }

    /// Slot `slot` of `peer`'s is free again: it rides with the next
    /// message posted with the peer ([`Self::give_back_freed`]), or goes
    /// back with others once half of them are free, or once the peer may
    /// have none left (the others holding sends whose receives are not
    /// posted).
    fn give_back_slot(&self, t: &mut Transfers<F::Region>, peer: u32, slot: u32) {
        let e = &mut t.eager[peer as usize];
        e.held &= !(1 << slot);
        e.freed |= 1 << slot;
        if e.freed.count_ones() >= EAGER_SLOTS / 2 || (e.held | e.freed) == ALL_SLOTS {
            self.give_back_freed(t, peer);
        }
    }

    /// Gives back to `peer` the slots taken since the last `Freed`, if any.
    /// Called as a message with the peer starts, whose writes and controls
    /// leave with it in the pass's one batch: a taker that answers at once
    /// (a ping-pong) returns its slot without a write of its own, which on
    /// tcp is a system call on the path of its reply.
    pub(super) fn give_back_freed(&self, t: &mut Transfers<F::Region>, peer: u32) {
        let e = &mut t.eager[peer as usize];
        if e.freed != 0 {
            let freed = std::mem::take(&mut e.freed);
            self.send_message_control(t, peer, &Control::Freed(freed));
        }
    }

    /// `peer` opened its slots to this rank.
    pub(super) fn on_slots(&self, t: &mut Transfers<F::Region>, peer: u32, landing: RemoteRegion) {
        let e = &mut t.eager[peer as usize];
        if landing.len >= u64::from(EAGER_SLOTS) * SLOT_BYTES as u64 && e.remote.is_none() {
            e.remote = Some(landing);
            e.remote_free = ALL_SLOTS;
        }
    }

    /// `peer` gave back slots.
    pub(super) fn on_freed(&self, t: &mut Transfers<F::Region>, peer: u32, slots: u32) {
        t.eager[peer as usize].remote_free |= slots & ALL_SLOTS;
    }
}
