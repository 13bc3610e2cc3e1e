//! The receive path of an admitted connection, as a sans-IO state machine.
//!
//! Bytes arrive in whatever pieces the socket gives. The receiver first fills a
//! header buffer; once the header decodes and checks out (kind, job, source rank,
//! region registered, `offset + len` inside the region) it hands out the target
//! range of the region itself as the next buffer, so the payload goes from the
//! socket straight into registered memory with no copy in between, and a lying
//! peer cannot reach a byte outside the region it named.

use fairring_core::wire::{FrameHeader, FrameKind, HEADER_LEN};

use super::regions::{RegionTable, RegionUse};
use crate::fabric::{Message, ProtocolViolation, RegionKey};

/// What a completed frame was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Received {
    /// Nothing complete yet.
    Nothing,
    /// A write landed whole.
    Landed {
        /// The region written.
        region: RegionKey,
        /// Offset of its first byte.
        offset: u64,
        /// Bytes written.
        len: u64,
        /// Its immediate data.
        immediate: u32,
    },
    /// A control message arrived.
    Message(Message),
    /// A keep-alive arrived.
    Keepalive,
    /// The peer aborted.
    Aborted,
}

enum State {
    Header {
        bytes: [u8; HEADER_LEN],
        have: usize,
    },
    Write {
        target: RegionUse,
        offset: usize,
        len: usize,
        have: usize,
        immediate: u32,
    },
    Message {
        immediate: u32,
        bytes: [u8; fairring_core::wire::MAX_MESSAGE_PAYLOAD as usize],
        len: usize,
        have: usize,
    },
    Discard {
        left: usize,
        then: Received,
    },
}

/// The receiving half of one admitted connection.
pub struct Receiver {
    peer: u32,
    job_tag: u64,
    state: State,
    scratch: [u8; 256],
}

impl Receiver {
    /// A receiver for frames from `peer` in job `job_tag`.
    pub fn new(peer: u32, job_tag: u64) -> Receiver {
        Receiver {
            peer,
            job_tag,
            state: State::Header {
                bytes: [0; HEADER_LEN],
                have: 0,
            },
            scratch: [0; 256],
        }
    }

    /// Whether a frame is partly received (a close now would cut it).
    pub fn mid_frame(&self) -> bool {
        !matches!(self.state, State::Header { have: 0, .. })
    }

    /// Where the next bytes from the connection go. Never empty.
    pub fn buffer(&mut self) -> &mut [u8] {
        match &mut self.state {
            State::Header { bytes, have } => &mut bytes[*have..],
            State::Write {
                target,
                offset,
                len,
                have,
                ..
            } => {
                // Checked when the header was accepted: `offset + len <= target.len()`;
                // and `have < len` while in this state.
                // SAFETY: the range is in the region; this receiver is its only
                // writer while it holds the use, and hands out one slice at a time.
                unsafe { target.bytes_mut(*offset + *have, *offset + *len) }
            }
            State::Message {
                bytes, len, have, ..
            } => &mut bytes[*have..*len],
            State::Discard { left, .. } => {
                let n = (*left).min(self.scratch.len());
                &mut self.scratch[..n]
            }
        }
    }

    /// Records that `n` bytes (at most the length of the last [`Receiver::buffer`])
    /// were read into the last buffer, and advances.
    ///
    /// After an error the connection must be dropped: the receiver's state is not
    /// meant to continue.
    pub fn filled(
        &mut self,
        n: usize,
        regions: &RegionTable,
    ) -> Result<Received, ProtocolViolation> {
        match &mut self.state {
            State::Header { bytes, have } => {
                *have += n;
                if *have < HEADER_LEN {
                    return Ok(Received::Nothing);
                }
                let header = FrameHeader::decode(bytes).map_err(ProtocolViolation::Wire)?;
                self.state = self.start_frame(&header, regions)?;
                Ok(self.finish_if_complete())
            }
            State::Write { have, .. } | State::Message { have, .. } => {
                *have += n;
                Ok(self.finish_if_complete())
            }
            State::Discard { left, .. } => {
                *left -= n;
                Ok(self.finish_if_complete())
            }
        }
    }

    fn start_frame(
        &self,
        header: &FrameHeader,
        regions: &RegionTable,
    ) -> Result<State, ProtocolViolation> {
        if header.job_tag != self.job_tag {
            return Err(ProtocolViolation::WrongJob {
                expected: self.job_tag,
                found: header.job_tag,
            });
        }
        if header.source_rank != self.peer {
            return Err(ProtocolViolation::WrongSource {
                expected: self.peer,
                found: header.source_rank,
            });
        }
        let len = header.payload_len as usize;
        match header.kind {
            FrameKind::Write => {
                let address = header.region_address().map_err(ProtocolViolation::Wire)?;
                let target =
                    regions
                        .acquire(address.region)
                        .ok_or(ProtocolViolation::UnknownRegion {
                            region: address.region,
                        })?;
                let region_len = target.len() as u64;
                let fits = address
                    .offset
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= region_len);
                if !fits {
                    return Err(ProtocolViolation::OutsideRegion {
                        region: address.region,
                        offset: address.offset,
                        len: len as u64,
                        region_len,
                    });
                }
                #[expect(
                    clippy::cast_possible_truncation,
                    reason = "at most the region's length, a usize"
                )]
                let offset = address.offset as usize;
                Ok(State::Write {
                    target,
                    offset,
                    len,
                    have: 0,
                    immediate: address.immediate,
                })
            }
            FrameKind::Message => {
                let address = header.region_address().map_err(ProtocolViolation::Wire)?;
                Ok(State::Message {
                    immediate: address.immediate,
                    bytes: [0; fairring_core::wire::MAX_MESSAGE_PAYLOAD as usize],
                    len,
                    have: 0,
                })
            }
            FrameKind::Keepalive => Ok(State::Discard {
                left: 0,
                then: Received::Keepalive,
            }),
            FrameKind::Abort => Ok(State::Discard {
                left: len,
                then: Received::Aborted,
            }),
            kind => Err(ProtocolViolation::UnexpectedKind { kind: kind as u8 }),
        }
    }

    fn finish_if_complete(&mut self) -> Received {
        let done = match &self.state {
            State::Header { .. } => false,
            State::Write { len, have, .. } | State::Message { len, have, .. } => have == len,
            State::Discard { left, .. } => *left == 0,
        };
        if !done {
            return Received::Nothing;
        }
        let next = State::Header {
            bytes: [0; HEADER_LEN],
            have: 0,
        };
        match core::mem::replace(&mut self.state, next) {
            State::Write {
                target,
                offset,
                len,
                immediate,
                ..
            } => Received::Landed {
                region: RegionKey(target.key()),
                offset: offset as u64,
                len: len as u64,
                immediate,
            },
            State::Message {
                immediate,
                bytes,
                len,
                ..
            } => Received::Message(
                Message::new(immediate, &bytes[..len]).expect("length checked by the header"),
            ),
            State::Discard { then, .. } => then,
            State::Header { .. } => unreachable!("a header alone completes no frame"),
        }
    }
}
