//! The messages the driver holds, and what every message goes through
//! whichever way it travels: taking posts (and holding those whose peer is
//! not linked yet), and failing one message, a peer's, or all of them. The
//! two ways are `between_machines` and `within_machine` (through the
//! machine's mailboxes).
//!
//! Everything here runs under the driver's lock (the transfers' own lock is
//! taken only by the driver, while it holds the driver's), and nothing
//! blocks.

use std::collections::VecDeque;

use fairring_rdma::fabric::{Fabric, RemoteRegion};

use super::control::{MOST_BYTES, Ready};
use super::eager::EagerPeer;
use super::mailbox::Offer;
use super::matching::Matcher;
use super::peer_links::LinkState;
use super::{MESSAGE_ENTRIES, Post};
use crate::engine::Engine;
use crate::engine::direct::{CACHED, KeptRegions};
use crate::engine::failure::Fault;
use crate::engine::tags::{MessageBits, message_bits};
use crate::engine::work_table::FAILED;
use crate::error::Error;
use crate::memory::MemorySpace;
use crate::shm::segment::BOUNCE_SLOTS;
use crate::sync::Ordering;

/// The messages the driver holds.
pub(crate) struct Transfers<R> {
    /// Per entry of the board.
    pub(super) active: Vec<Active<R>>,
    /// Per rank.
    pub(super) peers: Vec<PeerState>,
    /// Sends with chunks the fabric had no room for yet.
    pub(super) unposted: VecDeque<u64>,
    /// Peers with control messages waiting for room, in order.
    pub(super) controls_waiting: Vec<u32>,
    /// Per rank: its index on this machine, where messages with it go
    /// through the machine's mailboxes.
    pub(super) local: Vec<Option<u32>>,
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
    pub(super) sources: KeptRegions<R>,
    pub(super) windows: KeptRegions<R>,
    /// Per rank: eager sends with it, over the fabric.
    pub(super) eager: Vec<EagerPeer<R>>,
    /// Peers this rank opened eager slots to.
    pub(super) eager_peers: u32,
}

/// One peer's messages before they move.
#[derive(Default)]
pub(super) struct PeerState {
    /// Sends (left: ordinal, id) waiting for announcements (right), per tag.
    pub(super) matcher: Matcher<(u64, u64), Ready>,
    /// On the local path: receives (left) waiting for offers (right).
    pub(super) offers: Matcher<u64, Offer>,
    /// On the local path: the next offer's number, each way.
    pub(super) next_offer: u64,
    pub(super) next_expected: u64,
    /// On the local path: sends waiting for a free mailbox line, in order.
    pub(super) offering: VecDeque<u64>,
    /// Posts waiting for the peer to be linked.
    pub(super) unlinked: Vec<u64>,
    /// Control messages waiting for room, in order.
    pub(super) controls: VecDeque<([u8; MOST_BYTES], usize)>,
    /// Whether the peer said goodbye: a message posted with it since fails
    /// (but a receive of an eager send that landed before).
    pub(super) left: bool,
}

/// What an entry holds.
pub(super) enum Active<R> {
    Free,
    /// Posted; waiting for its peer's link, or for its match.
    Posted(Post),
    Sending(Sending<R>),
    Receiving(Receiving<R>),
    /// A send that went eagerly through this slot, waiting for its write
    /// to leave.
    Eager(Post, u32),
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
    pub(super) post: Post,
    /// The tensor, registered to send from, where the registration is this
    /// message's own (else it is kept in `Transfers::sources`).
    pub(super) own_source: Option<R>,
    /// Where it lands, and the receive it lands for.
    pub(super) landing: RemoteRegion,
    pub(super) receive: u64,
    /// Bytes posted so far, and chunks posted whose `Sent` has not come.
    pub(super) posted: u64,
    pub(super) in_flight: u32,
}

pub(super) struct Receiving<R> {
    pub(super) post: Post,
    /// The tensor, registered for the sender to write into, where the
    /// registration is this message's own (else it is a window kept in
    /// `Transfers::windows`, or the receive is empty). Held, not read: the
    /// registration lasts as long as the receive.
    #[expect(dead_code, reason = "held for its drop")]
    pub(super) own_landing: Option<R>,
    pub(super) landed: u64,
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
            active: (0..MESSAGE_ENTRIES).map(|_| Active::Free).collect(),
            peers: (0..world).map(|_| PeerState::default()).collect(),
            unposted: VecDeque::with_capacity(MESSAGE_ENTRIES),
            controls_waiting: Vec::with_capacity(world as usize),
            local,
            locals,
            offered: Vec::with_capacity(MESSAGE_ENTRIES),
            copying: Vec::with_capacity(MESSAGE_ENTRIES),
            bounce_free: (1 << BOUNCE_SLOTS) - 1,
            sources: KeptRegions::with_holders(CACHED, MESSAGE_ENTRIES),
            windows: KeptRegions::with_holders(CACHED, MESSAGE_ENTRIES),
            eager: (0..world).map(|_| EagerPeer::default()).collect(),
            eager_peers: 0,
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

    pub(super) fn slot(id: u64) -> usize {
        #[expect(clippy::cast_possible_truncation, reason = "below the table's length")]
        let i = (id % MESSAGE_ENTRIES as u64) as usize;
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
        Active::Posted(p)
        | Active::Eager(p, _)
        | Active::Offered(p, ..)
        | Active::Copying { post: p, .. } => Some(p.id),
        Active::Sending(s) => Some(s.post.id),
        Active::Receiving(r) => Some(r.post.id),
    }
}

/// The peer of the message an entry holds, if any.
fn peer_of<R>(a: &Active<R>) -> Option<u32> {
    match a {
        Active::Free => None,
        Active::Posted(p)
        | Active::Eager(p, _)
        | Active::Offered(p, ..)
        | Active::Copying { post: p, .. } => Some(p.peer),
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
                LinkState::Failed(e) if !waiting => {
                    self.settle_message(&mut t, post.id, FAILED, Some(e))
                }
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

    /// Fails `post`, posted after its peer said goodbye.
    pub(super) fn fail_after_goodbye(&self, t: &mut Transfers<F::Region>, post: &Post) {
        let e = Error::peer(post.peer, "left the job before this message was posted");
        self.settle_message(t, post.id, FAILED, Some(e));
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
                    LinkState::Failed(e) => {
                        self.settle_message(t, post.id, FAILED, Some(e.clone()))
                    }
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

    /// Finishes message `id` (`state`, and `error` if it failed alone),
    /// first letting go of whatever its entry holds: its own registration,
    /// its hold on a kept window (closed once no receive holds it, which
    /// waits for writes still landing) or source registration, and its
    /// bounce slot (nobody reads it once its offer is settled, its receiver
    /// has left, or this engine has failed).
    pub(super) fn settle_message(
        &self,
        t: &mut Transfers<F::Region>,
        id: u64,
        state: u32,
        error: Option<Error>,
    ) {
        if let Active::Offered(_, _, Some(slot)) = t.take(id) {
            t.bounce_free |= 1 << slot;
        }
        self.close_landing(t, id);
        t.sources.release(id);
        self.finish_message(id, state, error);
    }

    /// `peer` said goodbye: what it had not received or sent by now never
    /// will be, and fails. Not what it received whole: a local send its
    /// receiver settled (the mailbox may say so before this pass looked),
    /// and a send whose every chunk is posted, which waits for its last
    /// writes' `Sent` (or their `SendFailed`, its connection closing) --
    /// the goodbye may be reported before them. Allocates nothing when no
    /// message is with `peer`: a goodbye at the end of a job of collectives
    /// costs no message.
    pub(in crate::engine) fn on_peer_left(&self, peer: u32) {
        let mut t = self.lock_transfers();
        // Messages are between workers: a dedicated server (which servers
        // in groups hear from) has none.
        let Some(state) = t.peers.get_mut(peer as usize) else {
            return;
        };
        state.left = true;
        if t.local_of(peer).is_some() {
            self.settle_offered(&mut t);
        }
        self.fail_messages_with(&mut t, peer, true, || {
            Error::peer(peer, "left the job before this message was matched")
        });
    }

    /// `peer`'s connection closed after its goodbye: nothing more comes
    /// from it or goes to it, and every message with it fails.
    pub(in crate::engine) fn on_peer_closed(&self, peer: u32) {
        let mut t = self.lock_transfers();
        if peer as usize >= t.peers.len() {
            // A dedicated server: no messages.
            return;
        }
        self.fail_messages_with(&mut t, peer, false, || {
            Error::peer(peer, "left the job before this message was sent whole")
        });
    }

    /// A write of a send to `peer`, which said goodbye, will never be sent:
    /// the send fails.
    pub(in crate::engine) fn on_message_send_failed(&self, peer: u32, token: u64) {
        let id = match message_bits(token) {
            MessageBits::Chunk(id) => id,
            MessageBits::Eager { slot, send } => {
                return self.on_eager_sent(peer, send, slot, false);
            }
        };
        let mut t = self.lock_transfers();
        if let Active::Sending(s) = t.get(id)
            && s.post.id == id
        {
            let e = Error::peer(peer, "left the job before this message was sent whole");
            self.settle_message(&mut t, id, FAILED, Some(e));
        }
    }

    /// Fails every message with `peer` (why: `error()`, made only if there
    /// is one), but with `sent_kept`, not a send whose chunks are all
    /// posted.
    fn fail_messages_with(
        &self,
        t: &mut Transfers<F::Region>,
        peer: u32,
        sent_kept: bool,
        error: impl Fn() -> Error,
    ) {
        for slot in 0..t.active.len() {
            let a = &t.active[slot];
            if peer_of(a) != Some(peer) {
                continue;
            }
            let sent_whole = matches!(a, Active::Sending(s) if s.posted == s.post.bytes)
                || matches!(a, Active::Eager(..));
            if sent_kept && sent_whole {
                continue;
            }
            if let Some(id) = id_of(a) {
                self.settle_message(t, id, FAILED, Some(error()));
            }
        }
        let p = &mut t.peers[peer as usize];
        p.matcher = Matcher::default();
        p.offers = Matcher::default();
        p.unlinked.clear();
        p.controls.clear();
        p.offering.clear();
        t.eager[peer as usize].forget_waiting();
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
            self.settle_message(&mut t, id, FAILED, None);
        }
        for e in &mut t.eager {
            e.forget_all();
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
pub(super) fn unexpected(peer: u32, what: &str) -> Fault {
    Error::peer(
        peer,
        format!("{what} (the peer broke the message protocol)"),
    )
    .into()
}
