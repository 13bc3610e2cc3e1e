//! Completion dispatch: each completion the fabric reports goes to the part of the
//! engine it concerns.
//!
//! | completion | goes to |
//! |---|---|
//! | a peer's write landed | the slice holding that buffer at that generation, or, if its slice has not started yet, the buffer's early landings |
//! | one of this rank's writes was sent | the slice that posted it |
//! | a descriptor | the checks |
//! | a credit | the credit window |
//! | a goodbye | the departures |
//! | a failure report, a failed send, a failed peer | failure |
//!
//! Anything a peer sends that fits none of these fails the engine naming the
//! peer; anything the fabric reports that this rank never posted is an internal
//! error.

use fairring_rdma::fabric::{Completion, CompletionEvent, Fabric, MESSAGE_CAPACITY};

use super::algorithm::SliceEvent;
use super::descriptor::decode_message;
use super::failure::{FAILURE_BYTES, FailureRecord, Fault};
use super::tags::{self, Kind};
use super::{Driver, Engine};
use crate::error::Error;
use crate::memory::MemorySpace;

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Routes one completion.
    pub(super) fn on_completion(&self, d: &mut Driver<M>, c: Completion) -> Result<(), Fault> {
        match c.event {
            CompletionEvent::Landed { len, immediate }
                if tags::is_message_data(immediate.into()) =>
            {
                self.on_message_landed(c.peer, immediate, len)
            }
            CompletionEvent::Sent { token } if tags::is_message_data(token) => {
                self.on_message_sent(c.peer, token)
            }
            CompletionEvent::Landed { len, immediate } => {
                let (kind, b, g, part) = tags::parse_immediate(immediate)
                    // Only a hierarchical write carries a part of a cell.
                    .filter(|&(kind, b, _, part)| {
                        b < self.buffers && kind.is_data() && (part == 0 || kind.is_hierarchical())
                    })
                    .ok_or_else(|| {
                        Error::peer(
                            c.peer,
                            format!("a write with unknown immediate {immediate:#x}"),
                        )
                    })?;
                self.on_landed(d, c.peer, (kind, part), b, g, len)
            }
            CompletionEvent::Sent { token } => self.on_sent(d, token),
            CompletionEvent::Message(m) => self.on_message(d, c.peer, m.immediate, m.payload()),
            // It said goodbye first: everything it owed this rank arrived
            // before its connection closed. What this rank had not sent it
            // whole never will be.
            CompletionEvent::SendFailed { token, .. } if d.departures.departed(c.peer) => {
                if tags::is_message_data(token) {
                    self.on_message_send_failed(c.peer, token);
                }
                Ok(())
            }
            CompletionEvent::PeerFailed { .. } if d.departures.departed(c.peer) => {
                self.on_peer_closed(c.peer);
                Ok(())
            }
            // Its messages fail with the engine.
            CompletionEvent::SendFailed { failure, .. }
            | CompletionEvent::PeerFailed { failure } => {
                Err(Error::peer(c.peer, failure.to_string()).into())
            }
            _ => Ok(()),
        }
    }

    fn on_landed(
        &self,
        d: &mut Driver<M>,
        peer: u32,
        (kind, part): (Kind, u32),
        b: u32,
        g: u64,
        len: u64,
    ) -> Result<(), Fault> {
        let slot = &d.slices.slots[b as usize];
        match &slot.active {
            Some(a) if tags::same_generation(a.generation, g) => {
                self.feed(d, b, SliceEvent::Landed { kind, peer, part })
            }
            None if tags::same_generation(slot.next_generation, g) && kind.lands_early() => {
                self.land_early(d, b, kind, peer, part)
            }
            _ => Err(Error::peer(
                peer,
                format!(
                    "a {kind:?} write of {len} bytes for generation {g} of buffer {b} that no \
                     slice here expects (the ranks' operations differ, or the peer broke the \
                     protocol)"
                ),
            )
            .into()),
        }
    }

    fn on_sent(&self, d: &mut Driver<M>, token: u64) -> Result<(), Fault> {
        let (kind, b, g, part) = tags::parse_token(token).ok_or_else(|| {
            Error::internal(
                "the fabric reports the tokens the engine posted",
                format!("{token:#x}"),
            )
        })?;
        if !kind.is_data() {
            return Ok(());
        }
        let holds = d
            .slices
            .slots
            .get(b as usize)
            .and_then(|s| s.active.as_ref())
            .is_some_and(|a| tags::same_token_generation(a.generation, g));
        if !holds {
            return Err(Error::internal(
                "a write completes while its slice holds the buffer",
                format!("a {kind:?} write of generation {g} on buffer {b}"),
            )
            .into());
        }
        self.feed(d, b, SliceEvent::Sent { kind, part })
    }

    fn on_message(
        &self,
        d: &mut Driver<M>,
        peer: u32,
        immediate: u32,
        payload: &[u8],
    ) -> Result<(), Fault> {
        let kind = tags::parse_immediate(immediate).map(|t| t.0);
        match kind {
            Some(Kind::Descriptor) => {
                if let Some((seq, words, window)) = decode_message(payload) {
                    self.accept_described(d, peer, seq, words)?;
                    let accepted = d.operations.accepted();
                    if d.checks
                        .on_descriptor(peer, seq, words, window, accepted, &self.links)?
                        && d.operations.any_finished()
                    {
                        self.try_complete(d, seq)?;
                    }
                    return Ok(());
                }
            }
            Some(Kind::Abort) => {
                if let Ok(bytes) = <[u8; FAILURE_BYTES]>::try_from(payload) {
                    let record = FailureRecord(bytes);
                    return Err(Fault::with_record(record.decode(peer, self.rank()), record));
                }
            }
            Some(Kind::Credit) => {
                if let Ok(p) = <[u8; 8]>::try_from(payload) {
                    d.credits.on_credit(peer, u64::from_le_bytes(p));
                    return Ok(());
                }
            }
            Some(Kind::Bye) => {
                if let Ok(p) = <[u8; 8]>::try_from(payload) {
                    let accepted = d.operations.accepted();
                    self.on_peer_left(peer);
                    d.departures.on_bye(peer, u64::from_le_bytes(p), accepted)?;
                    return Ok(());
                }
            }
            Some(Kind::MessageControl) => return self.on_message_control(peer, payload),
            _ => {}
        }
        Err(Error::peer(
            peer,
            format!(
                "an unknown message (immediate {immediate:#x}, {} of at most {MESSAGE_CAPACITY} bytes)",
                payload.len()
            ),
        )
        .into())
    }
}
