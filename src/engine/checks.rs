//! The descriptor checks: ranks confirm they issued the same operation before any
//! of its data is combined (the protocol is described in `descriptor`).
//!
//! - Local ranks publish their descriptors in the machine's control area; a slice
//!   of operation `s` starts only once every local rank's descriptor of `s` is
//!   there and equal ([`Checks::check_local`]).
//! - A rank sends its descriptor of `s` to every remote rank it writes to before
//!   any write of `s` ([`Checks::send`], [`Checks::may_send_data`]), and compares
//!   what its remote writers send as it arrives, or when it accepts `s` if they
//!   are ahead ([`Checks::on_descriptor`]).
//! - An operation completes only once all of that has happened
//!   ([`Checks::checked`]).
//! - The job's NCCL all-reduce (`algorithm/nccl.rs`), which combines every
//!   rank's bytes without a write of the engine's, starts only once every
//!   remote writer has confirmed it too ([`Checks::remotely_confirmed`]): the
//!   rails and the local ranks reach every rank.

use std::collections::VecDeque;

use fairring_rdma::fabric::{Fabric, RemoteRegion};

use super::departures::Departures;
use super::descriptor::{Words, encode_message};
use super::failure::{FailureRecord, Fault};
use super::links::Links;
use super::outbox::{Sent, send_control};
use super::tags::Kind;
use super::work_table::{WORK_CAPACITY, slot_of};
use crate::error::Error;
use crate::local::Machine;

/// Where the checks of every open operation stand.
pub(crate) struct Checks {
    /// This rank's descriptor words of operation `s`, at `slot_of(s)`.
    own: Vec<Words>,
    /// Who issued them: this rank, or on a dedicated server the worker whose
    /// descriptor the server took as its own (errors name that worker).
    owner: Vec<u32>,
    /// Operations below this have every local rank's descriptor checked.
    local_checked: u64,
    /// Per rank: operations below this have had their descriptor sent to it.
    sent: Vec<u64>,
    /// Per rank: operations below this it has confirmed (descriptor checked).
    confirmed: Vec<u64>,
    /// Per rank: descriptors that came before this rank accepted the operation.
    early: Vec<VecDeque<(u64, Words)>>,
    /// This rank's window for operation `s`, at `slot_of(s)`, sent with its
    /// descriptor (`engine/direct.rs`); `None`: the descriptor goes alone.
    own_window: Vec<Option<RemoteRegion>>,
    /// The last descriptor of operation `s` a peer sent, at `slot_of(s)`: the
    /// peer, `s`, and the window it carried.
    their_window: Vec<Option<(u32, u64, Option<RemoteRegion>)>>,
}

impl Checks {
    pub(crate) fn new(world: u32, remote_in: &[u32]) -> Checks {
        Checks {
            own: vec![[0; 2]; WORK_CAPACITY],
            own_window: vec![None; WORK_CAPACITY],
            their_window: vec![None; WORK_CAPACITY],
            owner: vec![0; WORK_CAPACITY],
            local_checked: 0,
            sent: vec![0; world as usize],
            confirmed: vec![0; world as usize],
            early: (0..world)
                .map(|p| {
                    if remote_in.contains(&p) {
                        VecDeque::with_capacity(WORK_CAPACITY)
                    } else {
                        VecDeque::new()
                    }
                })
                .collect(),
        }
    }

    /// This rank accepted operation `seq`, described by `words` (and with
    /// `window` to send beside them): tells the local ranks, and compares the
    /// remote descriptors of `seq` that came early.
    pub(crate) fn accepted<F: Fabric>(
        &mut self,
        seq: u64,
        words: Words,
        window: Option<RemoteRegion>,
        machine: &Machine,
        links: &Links<F>,
    ) -> Result<(), Fault> {
        self.own[slot_of(seq)] = words;
        self.own_window[slot_of(seq)] = window;
        self.owner[slot_of(seq)] = links.rank;
        machine.publish_operation(seq, words);
        for &peer in &links.remote_in {
            let p = peer as usize;
            if let Some(&(early_seq, theirs)) = self.early[p].front()
                && early_seq == seq
            {
                self.early[p].pop_front();
                self.compare(seq, peer, theirs)?;
                self.confirmed[p] = seq + 1;
            }
        }
        Ok(())
    }

    /// Checks accepted operations against every local rank's descriptor, in order,
    /// as far as the local ranks have published them; returns the operations
    /// checked now.
    pub(crate) fn check_local<F: Fabric>(
        &mut self,
        accepted: u64,
        machine: &Machine,
        links: &Links<F>,
    ) -> Result<std::ops::Range<u64>, Fault> {
        let first = self.local_checked;
        while self.local_checked < accepted {
            let seq = self.local_checked;
            for r in (0..machine.local_size()).filter(|&r| r != machine.local_rank()) {
                match machine.operation(r, seq) {
                    None => return Ok(first..self.local_checked),
                    Some(theirs) => {
                        self.compare(seq, links.local_to_global(r), theirs)?;
                    }
                }
            }
            self.local_checked += 1;
        }
        Ok(first..self.local_checked)
    }

    /// Remote rank `peer`'s descriptor of operation `seq`; returns whether `seq`
    /// is now confirmed by it.
    pub(crate) fn on_descriptor<F: Fabric>(
        &mut self,
        peer: u32,
        seq: u64,
        theirs: Words,
        window: Option<RemoteRegion>,
        accepted: u64,
        links: &Links<F>,
    ) -> Result<bool, Fault> {
        let p = peer as usize;
        let expected = self.confirmed[p] + self.early[p].len() as u64;
        if !links.remote_in.contains(&peer) || seq != expected {
            return Err(Error::peer(
                peer,
                format!(
                    "sent the descriptor of operation #{seq} out of order (expected #{expected})"
                ),
            )
            .into());
        }
        self.their_window[slot_of(seq)] = Some((peer, seq, window));
        if seq < accepted {
            self.compare(seq, peer, theirs)?;
            self.confirmed[p] = seq + 1;
            return Ok(true);
        }
        if self.early[p].len() >= WORK_CAPACITY {
            return Err(Error::peer(
                peer,
                format!("is more than {WORK_CAPACITY} operations ahead of this rank"),
            )
            .into());
        }
        self.early[p].push_back((seq, theirs));
        Ok(false)
    }

    /// Sends the descriptors of accepted operations, in order, to every remote rank
    /// this rank writes to. One the fabric's queue has no room for goes on a later
    /// pass; a write of operation `s` to such a rank waits until the descriptor of
    /// `s` is out ([`Checks::may_send_data`]).
    pub(crate) fn send<F: Fabric>(
        &mut self,
        accepted: u64,
        links: &Links<F>,
        departures: &Departures,
    ) {
        for &peer in &links.remote_out {
            let p = peer as usize;
            while self.sent[p] < accepted {
                if departures.departed(peer) {
                    self.sent[p] = accepted;
                    break;
                }
                let seq = self.sent[p];
                let (message, len) =
                    encode_message(seq, self.own[slot_of(seq)], self.own_window[slot_of(seq)]);
                match send_control(&links.fabric, peer, Kind::Descriptor, &message[..len]) {
                    Sent::Posted => self.sent[p] += 1,
                    Sent::Full => break,
                    // A failed peer's failure arrives as its own completion.
                    Sent::Refused(e) => {
                        log::debug!(
                            "fairring rank {}: descriptor to rank {peer} not sent: {e}",
                            links.rank
                        );
                        self.sent[p] = accepted;
                    }
                }
            }
        }
    }

    /// What `peer`'s descriptor of operation `seq` said of its window: `None`
    /// until it has come; then the window, or `None` if it opened none
    /// (`engine/direct.rs`).
    pub(crate) fn peer_window(&self, peer: u32, seq: u64) -> Option<Option<RemoteRegion>> {
        match self.their_window[slot_of(seq)] {
            Some((p, s, window)) if p == peer && s == seq => Some(window.filter(|w| w.len > 0)),
            _ => None,
        }
    }

    /// Whether every local rank issued operation `seq` alike: its slices may start.
    pub(crate) fn locally_checked(&self, seq: u64) -> bool {
        self.local_checked > seq
    }

    /// Whether every remote rank that writes to this one has confirmed
    /// operation `seq` (its descriptor came and matched).
    pub(crate) fn remotely_confirmed<F: Fabric>(&self, seq: u64, links: &Links<F>) -> bool {
        links
            .remote_in
            .iter()
            .all(|&p| self.confirmed[p as usize] > seq)
    }

    /// Operations below this have every local rank's descriptor checked.
    pub(crate) fn local_checked(&self) -> u64 {
        self.local_checked
    }

    /// Whether data of operation `seq` may go to `peer`: a remote peer reads the
    /// operation's descriptor before its data.
    pub(crate) fn may_send_data<F: Fabric>(&self, peer: u32, seq: u64, links: &Links<F>) -> bool {
        !links.is_remote_out(peer) || self.sent[peer as usize] > seq
    }

    /// Whether every check of operation `seq` has passed.
    pub(crate) fn checked<F: Fabric>(&self, seq: u64, links: &Links<F>) -> bool {
        self.local_checked > seq
            && links
                .remote_in
                .iter()
                .all(|&p| self.confirmed[p as usize] > seq)
            && links
                .remote_out
                .iter()
                .all(|&p| self.sent[p as usize] > seq)
    }

    /// Ranks that have not issued operation `seq` as far as this rank knows.
    pub(crate) fn not_issued<F: Fabric>(
        &self,
        seq: u64,
        machine: &Machine,
        links: &Links<F>,
    ) -> Vec<u32> {
        let local = (0..machine.local_size())
            .filter(|&r| r != machine.local_rank() && machine.operation(r, seq).is_none())
            .map(|r| links.local_to_global(r));
        let remote = links
            .remote_in
            .iter()
            .copied()
            .filter(|&p| self.confirmed[p as usize] <= seq);
        local.chain(remote).collect()
    }

    /// Operation `seq`'s descriptor is `owner`'s (a dedicated server's, taken
    /// from that worker), for the errors that compare with it.
    pub(crate) fn described_by(&mut self, seq: u64, owner: u32) {
        self.owner[slot_of(seq)] = owner;
    }

    /// Checks operation `seq` against `peer`'s descriptor of it.
    fn compare(&self, seq: u64, peer: u32, theirs: Words) -> Result<(), Fault> {
        let ours = self.own[slot_of(seq)];
        let me = self.owner[slot_of(seq)];
        if ours == theirs {
            return Ok(());
        }
        let (record, error) = FailureRecord::mismatch(seq, me, ours, peer, theirs);
        Err(Fault::with_record(error, record))
    }
}
