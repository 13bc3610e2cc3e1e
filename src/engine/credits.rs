//! The credit window: which slices a peer may write into this rank's staging
//! buffers, and which this rank may write into a peer's.
//!
//! A peer may write slice `s` into this rank's buffer `s % B` only once slice
//! `s - B` has **vacated** it: this rank released it, and every rank of this
//! machine is done with it (the shared-memory all-gather reads the other local
//! ranks' buffers, and a relay chunk of the next slice lands in the same bytes).
//! Each rank tells the ranks that write into it how far they may go with a
//! **credit** message carrying `w + B`, where `w` is the lowest slice that has not
//! vacated its buffer; credits are sent only when that limit moves,
//! and each says everything earlier ones did, so one the fabric had no room for is
//! simply sent on a later pass. Writes that arrive before their slice starts here
//! (the peer is ahead) are held as early landings by the slice table.
//!
//! # When a credit leaves
//!
//! A credit is a message of its own, and on tcp a message costs a system call;
//! sent as each slice vacates, it would sit between a small all-reduce's end
//! and the next one's start. So a new limit waits ([`Due::Short`]) while the peer
//! still has at least half the buffers' worth of slices, `max(1, B / 2)`, it may
//! write past this rank's lowest slice not vacated, and goes out with everything
//! else ([`Due::Any`]):
//!
//! - when this rank accepts an operation, beside the descriptors it sends then
//!   (one batch, so on tcp often in the same system call);
//! - on a pass that found nothing to do: this rank waits, so the message costs
//!   nothing it was doing.
//!
//! # Local ranks
//!
//! A peer on this machine that writes into this rank over the fabric (the ring
//! and recursive doubling cross it between local ranks) reads the limit from the
//! machine's shared segment instead ([`Machine::publish_credit`]): it is
//! published on every pass that moved it, at the cost of a store and a doorbell
//! ring, and no message leaves. Before, every vacated slice sent each local
//! writer a credit over loopback tcp, whose delivery woke that rank's I/O thread:
//! on 1x2 hierarchical all-reduces that needed no credit at all, that took a
//! 4 KiB all-reduce from about 3 to about 12 us.
//!
//! No peer waits on a withheld credit for long: a slice `s` this rank needs from a
//! peer is one it has started, which it does only once `s - B` has vacated the
//! buffer, so `s < w + B`; and while this rank waits for anything, its idle passes
//! send every limit it has. Every pass of the driver moves `w` past the slices
//! the other local ranks have finished with since the last (their progress rings
//! this rank's doorbell).

use fairring_rdma::fabric::Fabric;

use super::departures::Departures;
use super::links::Links;
use super::outbox::{Sent, send_control};
use super::tags::Kind;
use crate::local::Machine;

/// Which moved limits [`Credits::send`] sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Due {
    /// Only to peers short of slices they may write (see the module docs).
    Short,
    /// To every peer whose limit moved.
    Any,
}

/// Credits granted and received.
pub(crate) struct Credits {
    /// Staging buffers: the window's width.
    buffers: u64,
    /// Slices below this may be written into this rank (the limit last announced).
    granted: u64,
    /// Per rank: the limit last sent to it.
    sent: Vec<u64>,
    /// Per rank: slices below this may be written into it.
    received: Vec<u64>,
    /// Per rank: its index on this machine if it is another rank of it (its
    /// credits pass through the machine's segment).
    local: Vec<Option<u32>>,
    /// The limit last published in the machine's segment.
    published: u64,
}

impl Credits {
    /// Every rank starts with one slice per buffer; `local` gives each rank's
    /// index on this machine, for the other ranks of this machine.
    pub(crate) fn new(buffers: u32, local: Vec<Option<u32>>) -> Credits {
        let b = u64::from(buffers);
        let world = local.len();
        Credits {
            buffers: b,
            granted: b,
            sent: vec![b; world],
            received: vec![b; world],
            local,
            published: 0,
        }
    }

    /// Whether slice `slice` may be written into `peer`.
    pub(crate) fn allows(&self, peer: u32, slice: u64, machine: &Machine) -> bool {
        let p = peer as usize;
        let limit = match self.local[p] {
            Some(l) => self.received[p].max(machine.credit(l)),
            None => self.received[p],
        };
        limit > slice
    }

    /// `peer` says slices below `limit` may be written into it.
    pub(crate) fn on_credit(&mut self, peer: u32, limit: u64) {
        let c = &mut self.received[peer as usize];
        *c = (*c).max(limit);
    }

    /// Slices below `vacated` have left this rank's buffers (see the module
    /// docs): `vacated + buffers` may be granted. Returns whether the limit moved.
    pub(crate) fn vacated(&mut self, vacated: u64, buffers: u32) -> bool {
        let limit = vacated + u64::from(buffers);
        if limit > self.granted {
            self.granted = limit;
            return true;
        }
        false
    }

    /// Whether `peer`'s new limit must go now, by `due`.
    fn due(&self, peer: usize, due: Due) -> bool {
        let sent = self.sent[peer];
        if sent >= self.granted {
            return false;
        }
        // Slices past the lowest one not vacated that the peer may write.
        let lowest = self.granted - self.buffers;
        let room = sent.saturating_sub(lowest);
        due == Due::Any || room < (self.buffers / 2).max(1)
    }

    /// Publishes the current limit to the local ranks if it moved, and sends it
    /// to each other inbound peer that has not had it and is `due` it.
    pub(crate) fn send<F: Fabric>(
        &mut self,
        links: &Links<F>,
        departures: &Departures,
        due: Due,
        machine: &Machine,
    ) {
        self.publish_local(machine, links.inbound.iter().copied());
        let payload = self.granted.to_le_bytes();
        for &peer in &links.inbound {
            let p = peer as usize;
            if self.local[p].is_some() || !self.due(p, due) {
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

    /// Publishes the limit in the machine's segment if it moved, ringing the
    /// doorbells of the local ranks among `inbound`.
    fn publish_local(&mut self, machine: &Machine, inbound: impl Iterator<Item = u32>) {
        if self.granted <= self.published {
            return;
        }
        self.published = self.granted;
        let local = &self.local;
        machine.publish_credit(
            self.granted,
            inbound.filter_map(|p| local.get(p as usize).copied().flatten()),
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::shm::Segment;

    /// A local writer reads the limit its reader published in the segment, and
    /// the reader's publication wakes it.
    #[test]
    fn local_ranks_read_credits_from_the_machine() {
        let segment = Arc::new(Segment::anonymous(2, 2, 4096).unwrap());
        let (m0, m1) = (
            Machine::new(Arc::clone(&segment), 0, 2),
            Machine::new(segment, 1, 2),
        );
        let writer = Credits::new(2, vec![None, Some(1)]);
        let mut reader = Credits::new(2, vec![Some(0), None]);
        // One slice per buffer before any credit.
        assert!(writer.allows(1, 1, &m0));
        assert!(!writer.allows(1, 2, &m0));
        let rings = m0.doorbell().seen();
        assert!(reader.vacated(1, 2));
        reader.publish_local(&m1, [0].into_iter());
        assert!(writer.allows(1, 2, &m0));
        assert!(!writer.allows(1, 3, &m0));
        assert_ne!(m0.doorbell().seen(), rings, "the writer's doorbell rang");
        // Nothing moved: nothing published, nobody woken.
        let rings = m0.doorbell().seen();
        reader.publish_local(&m1, [0].into_iter());
        assert_eq!(m0.doorbell().seen(), rings);
        // A remote peer's limit comes only from its messages.
        let remote = Credits::new(2, vec![None, None]);
        assert!(!remote.allows(1, 2, &m0));
    }

    /// Vacates slices one at a time from a window of `buffers`, sending with
    /// `Short` after each, as the slice table does; returns the releases after
    /// which a credit went to peer 1.
    fn short_sends(buffers: u32, releases: u64) -> Vec<u64> {
        let mut c = Credits::new(buffers, vec![None; 2]);
        let mut sent_after = Vec::new();
        for vacated in 1..=releases {
            assert!(c.vacated(vacated, buffers));
            if c.due(1, Due::Short) {
                c.sent[1] = c.granted;
                sent_after.push(vacated);
            }
            // The invariant the module docs rely on: the peer may always write
            // this rank's lowest slice not vacated.
            assert!(c.sent[1] > vacated, "peer 1 cannot write slice {vacated}");
        }
        sent_after
    }

    /// A new limit waits while the peer still has half the window; with two
    /// buffers every other release sends, with four every third.
    #[test]
    fn short_credits_go_when_half_the_window_is_used() {
        assert_eq!(short_sends(2, 6), [2, 4, 6]);
        assert_eq!(short_sends(4, 8), [3, 6]);
        assert_eq!(short_sends(1, 3), [1, 2, 3]);
    }

    /// `Any` sends every moved limit, and nothing that did not move.
    #[test]
    fn any_sends_every_moved_limit() {
        let mut c = Credits::new(4, vec![None; 2]);
        assert!(!c.due(1, Due::Any));
        assert!(c.vacated(1, 4));
        assert!(c.due(1, Due::Any));
        assert!(!c.due(1, Due::Short));
        c.sent[1] = c.granted;
        assert!(!c.due(1, Due::Any));
    }
}
