//! Leaving the job: the goodbye a rank sends when its communicator is dropped,
//! and what the engine makes of a peer's.
//!
//! A goodbye carries the number of operations the rank issued. Its connection
//! closing afterwards is not a failure; but a rank that goes on to issue an
//! operation the departed peer never issued fails, naming the peer, instead of
//! waiting for it.
//!
//! Before it says goodbye, a rank finishes what it submitted
//! ([`Engine::finish_in_flight`]): a caller may have let go of an operation
//! whose result a stream still waits for (the stream ordered after it, the
//! host never waiting), and the device side it drops next must not run a
//! program's stages on staging that holds no result.

use std::time::{Duration, Instant};

use fairring_rdma::fabric::{Completion, CompletionEvent, Fabric};

use super::Engine;
use super::links::NO_COMPLETION;
use super::outbox::{Sent, send_control};
use super::tags::{self, Kind};
use super::work_table::{PENDING, WORK_CAPACITY};
use crate::error::Error;
use crate::memory::MemorySpace;
use crate::sync::Ordering;

/// How long a leaving rank waits for its last messages to go out, and for
/// the device programs of operations it fails on the way out to end.
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
    /// The communicator drops after submitting `submitted` operations: those
    /// still in flight finish first, driven here, each within `timeout`; any
    /// left then fail (and so does the engine), each once its device program
    /// has ended, waited for up to [`FLUSH`] more. An operation whose
    /// caller's stream never reaches its start stays pending: the device
    /// side's drop then leaves what its program touches allocated.
    pub(crate) fn finish_in_flight(&self, submitted: u64, timeout: Duration) {
        let first = submitted.saturating_sub(WORK_CAPACITY as u64);
        let pending = |seq: u64| self.works.state(seq) == Some(PENDING);
        if self.failure().is_none() {
            for seq in (first..submitted).filter(|&s| pending(s)) {
                if !matches!(self.wait(seq, Some(timeout)), Ok(true)) {
                    break;
                }
            }
        }
        let Some(seq) = (first..submitted).find(|&s| pending(s)) else {
            return;
        };
        self.fail(Error::peer(
            self.rank(),
            format!("dropped its communicator with operation {seq} still in flight"),
        ));
        let deadline = Instant::now() + FLUSH;
        while (first..submitted).any(pending) && Instant::now() < deadline {
            if !self.try_drive() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

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
        for p in self.every_linked() {
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
