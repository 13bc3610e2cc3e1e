//! Leaving the job: the goodbye a rank sends when its communicator is dropped,
//! and what the engine makes of a peer's.
//!
//! A goodbye carries the number of operations the rank issued. Its connection
//! closing afterwards is not a failure; but a rank that goes on to issue an
//! operation the departed peer never issued fails, naming the peer, instead of
//! waiting for it.

use std::time::{Duration, Instant};

use fairring_rdma::fabric::{Completion, CompletionEvent, Fabric};

use super::Engine;
use super::links::NO_COMPLETION;
use super::outbox::{Sent, send_control};
use super::tags::{self, Kind};
use crate::error::Error;
use crate::memory::MemorySpace;
use crate::sync::Ordering;

/// How long a leaving rank waits for its last messages to go out.
const FLUSH: Duration = Duration::from_secs(2);

/// The peers that said goodbye.
pub(crate) struct Departures {
    /// Per rank: the operation count it said goodbye after, if it did.
    after: Vec<Option<u64>>,
}

impl Departures {
    pub(crate) fn new(world: u32) -> Departures {
        Departures {
            after: vec![None; world as usize],
        }
    }

    /// Whether `peer` said goodbye.
    pub(crate) fn departed(&self, peer: u32) -> bool {
        self.after.get(peer as usize).is_some_and(Option::is_some)
    }

    /// `peer` leaves after `operations` operations; an error if this rank has
    /// issued `accepted` operations, more than that.
    pub(crate) fn on_bye(
        &mut self,
        peer: u32,
        operations: u64,
        accepted: u64,
    ) -> Result<(), Error> {
        if let Some(slot) = self.after.get_mut(peer as usize) {
            *slot = Some(operations);
        }
        match self.before(accepted) {
            Some((peer, after)) if accepted > after => Err(Error::peer(
                peer,
                format!("left the job after {after} operations; this rank has issued {accepted}"),
            )),
            _ => Ok(()),
        }
    }

    /// A peer that left before operation `seq`, and after how many operations.
    pub(crate) fn before(&self, seq: u64) -> Option<(u32, u64)> {
        self.after.iter().enumerate().find_map(|(p, a)| {
            a.filter(|&after| after <= seq)
                .map(|after| (u32::try_from(p).unwrap_or(u32::MAX), after))
        })
    }
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Tells every linked peer this rank leaves after `operations` operations, and
    /// waits (briefly) until the goodbyes are out; after a failure, waits instead
    /// (as briefly) until the failure reports are out, so that peers learn why
    /// before they see the connections close. The progress thread must have
    /// stopped.
    pub(crate) fn say_goodbye(&self, operations: u64) {
        if self.failure.failed() {
            let posted = self.failure.reports_posted.load(Ordering::Acquire);
            self.await_sends(Kind::Abort, posted);
            return;
        }
        let payload = operations.to_le_bytes();
        let mut outstanding = 0;
        for &p in &self.links.linked {
            if let Sent::Posted = send_control(&self.links.fabric, p, Kind::Bye, &payload) {
                outstanding += 1;
            }
        }
        self.await_sends(Kind::Bye, outstanding);
    }

    /// Waits up to [`FLUSH`] for `outstanding` posts of `kind` to be sent (or to
    /// fail).
    fn await_sends(&self, kind: Kind, mut outstanding: u32) {
        let deadline = Instant::now() + FLUSH;
        let mut batch: [Completion; 16] = [NO_COMPLETION; 16];
        while outstanding > 0 && Instant::now() < deadline {
            let n = self
                .links
                .fabric
                .wait(&mut batch, Duration::from_millis(10));
            for c in &batch[..n] {
                match c.event {
                    CompletionEvent::Sent { token } | CompletionEvent::SendFailed { token, .. }
                        if tags::parse_token(token).is_some_and(|t| t.0 == kind) =>
                    {
                        outstanding -= 1;
                    }
                    _ => {}
                }
            }
        }
    }
}
