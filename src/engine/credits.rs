//! The credit window: which slices a peer may write into this rank's staging
//! buffers, and which this rank may write into a peer's.
//!
//! A peer may write slice `s` into this rank's buffer `s % B` only once this rank
//! has released slice `s - B` from it. Each rank tells the ranks that write into it
//! how far they may go with a **credit** message carrying `w + B`, where `w` is the
//! lowest slice it has not released; credits are sent only when that limit moves,
//! and each says everything earlier ones did, so one the fabric had no room for is
//! simply sent on a later pass. Writes that arrive before their slice starts here
//! (the peer is ahead) are held as early landings by the slice table.

use fairring_rdma::fabric::Fabric;

use super::departures::Departures;
use super::links::Links;
use super::outbox::{Sent, send_control};
use super::tags::Kind;

/// Credits granted and received.
pub(crate) struct Credits {
    /// Slices below this may be written into this rank (the limit last announced).
    granted: u64,
    /// Per rank: the limit last sent to it.
    sent: Vec<u64>,
    /// Per rank: slices below this may be written into it.
    received: Vec<u64>,
}

impl Credits {
    /// Every rank starts with one slice per buffer.
    pub(crate) fn new(buffers: u32, world: u32) -> Credits {
        let b = u64::from(buffers);
        Credits {
            granted: b,
            sent: vec![b; world as usize],
            received: vec![b; world as usize],
        }
    }

    /// Whether slice `slice` may be written into `peer`.
    pub(crate) fn allows(&self, peer: u32, slice: u64) -> bool {
        self.received[peer as usize] > slice
    }

    /// `peer` says slices below `limit` may be written into it.
    pub(crate) fn on_credit(&mut self, peer: u32, limit: u64) {
        let c = &mut self.received[peer as usize];
        *c = (*c).max(limit);
    }

    /// Slices below `released` have left this rank's buffers: `released + buffers`
    /// may be granted. Returns whether the limit moved.
    pub(crate) fn released(&mut self, released: u64, buffers: u32) -> bool {
        let limit = released + u64::from(buffers);
        if limit > self.granted {
            self.granted = limit;
            return true;
        }
        false
    }

    /// Sends the current limit to every inbound peer that has not had it.
    pub(crate) fn send<F: Fabric>(&mut self, links: &Links<F>, departures: &Departures) {
        let payload = self.granted.to_le_bytes();
        for &peer in &links.inbound {
            let p = peer as usize;
            if self.sent[p] >= self.granted {
                continue;
            }
            if departures.departed(peer) {
                self.sent[p] = self.granted;
                continue;
            }
            match send_control(&links.fabric, peer, Kind::Credit, &payload) {
                Sent::Posted => self.sent[p] = self.granted,
                Sent::Full => {}
                // A peer that cannot take a credit has left (its goodbye may not be
                // polled yet) or failed; a failure arrives as its own completion and
                // fails the engine there, with the peer's reason.
                Sent::Refused(e) => {
                    self.sent[p] = self.granted;
                    log::debug!(
                        "fairring rank {}: credit to rank {peer} not sent: {e}",
                        links.rank
                    );
                }
            }
        }
    }
}
