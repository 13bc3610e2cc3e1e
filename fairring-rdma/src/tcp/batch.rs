//! Batches ([`Fabric::begin_batch`](crate::fabric::Fabric::begin_batch)): frames a
//! thread posts inside one stay queued, and leave together when it ends.
//!
//! A posting thread normally writes its frame at once (`link`), which costs a
//! system call, and on loopback the receiver's wake-up, per frame. An engine
//! pass that posts a descriptor, a credit and a data write to the same peer
//! then pays three; inside a batch it pays one, since the sender writes every
//! queued frame with one vectored write.
//!
//! The state is the calling thread's own, so another thread never finds its
//! posts held by a batch it knows nothing of. A thread batches one fabric at a
//! time: a batch begun on a second fabric inside the first holds nothing.

use std::cell::RefCell;

use super::event_loop::Shared;

/// The calling thread's batch.
struct Batching {
    /// The fabric it holds posts for (its shared state's address); meaningful
    /// while `depth > 0`.
    fabric: usize,
    /// Nesting depth; 0 outside a batch.
    depth: u32,
    /// Peers with frames held, in the order first held.
    held: Vec<u32>,
}

thread_local! {
    static BATCHING: RefCell<Batching> = const {
        RefCell::new(Batching { fabric: 0, depth: 0, held: Vec::new() })
    };
}

fn key(shared: &Shared) -> usize {
    std::ptr::from_ref(shared) as usize
}

/// Begins (or nests) the calling thread's batch on `shared`'s fabric.
pub(crate) fn begin(shared: &Shared) {
    BATCHING.with_borrow_mut(|b| {
        if b.depth == 0 {
            b.fabric = key(shared);
            b.depth = 1;
            // Room for every peer from the thread's first batch on, so a thread
            // that first holds a frame long after it began driving (a caller
            // that only waited until then) allocates nothing in steady state.
            b.held.reserve(shared.peers.len());
        } else if b.fabric == key(shared) {
            b.depth += 1;
        }
    });
}

/// Whether a frame just queued to `peer` stays held, because the calling thread
/// batches `shared`'s fabric; records the peer if so.
pub(crate) fn hold(shared: &Shared, peer: u32) -> bool {
    BATCHING.with_borrow_mut(|b| {
        let holding = b.depth > 0 && b.fabric == key(shared);
        if holding && !b.held.contains(&peer) {
            b.held.push(peer);
        }
        holding
    })
}

/// Ends one level of the calling thread's batch on `shared`'s fabric; at the
/// outermost, calls `send` for each peer whose held frames must now go out (the
/// list keeps its room, so a steady stream of batches allocates nothing).
pub(crate) fn end(shared: &Shared, mut send: impl FnMut(u32)) {
    BATCHING.with_borrow_mut(|b| {
        if b.depth == 0 || b.fabric != key(shared) {
            return;
        }
        b.depth -= 1;
        if b.depth == 0 {
            b.held.iter().for_each(|&peer| send(peer));
            b.held.clear();
        }
    });
}
