//! The send path of an admitted connection: frames queued by posting threads,
//! written by the I/O thread with vectored writes straight from registered memory.

use std::io::{self, IoSlice, Write};

use crossbeam_queue::ArrayQueue;
use fairring_core::wire::{FrameHeader, FrameKind, HEADER_LEN, MAX_MESSAGE_PAYLOAD};

use super::regions::RegionUse;

/// One queued frame.
pub(crate) struct SendOp {
    pub(crate) token: u64,
    pub(crate) header: [u8; HEADER_LEN],
    pub(crate) payload: Payload,
}

/// A queued frame's payload.
pub(crate) enum Payload {
    /// Bytes `start..end` of a registered region, held registered until sent.
    Region {
        source: RegionUse,
        start: usize,
        end: usize,
    },
    /// A control message's bytes.
    Inline {
        bytes: [u8; MAX_MESSAGE_PAYLOAD as usize],
        len: usize,
    },
}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::Region { start, end, .. } => end - start,
            Payload::Inline { len, .. } => *len,
        }
    }

    fn bytes(&self, from: usize) -> &[u8] {
        match self {
            Payload::Region { source, start, end } => {
                // SAFETY: `start..end` was checked against the region when the write
                // was posted, and the registration contract keeps writers off a
                // source range until its completion, which comes after this.
                unsafe { source.bytes(start + from, *end) }
            }
            Payload::Inline { bytes, len } => &bytes[from..*len],
        }
    }
}

/// Frame in flight: which op and how many of its bytes are out.
struct InFlight {
    op: SendOp,
    sent: usize,
}

/// Bytes this side sends outside the queue (the last handshake frame, keep-alives).
struct Extra {
    bytes: [u8; 256],
    len: usize,
    sent: usize,
}

/// The sending half of one admitted connection.
pub(crate) struct Sender {
    current: Option<InFlight>,
    extra: Option<Extra>,
    keepalive: [u8; HEADER_LEN],
}

/// How far a flush got.
pub(crate) enum Flushed {
    /// Everything queued is out.
    Idle,
    /// The socket is full; wait for it to be writable.
    Blocked,
    /// The byte limit was reached with frames still to write.
    Limited,
}

impl Sender {
    pub(crate) fn new(job_tag: u64, rank: u32) -> Sender {
        let keepalive = FrameHeader::control(FrameKind::Keepalive, job_tag, rank, 0).encode();
        Sender {
            current: None,
            extra: None,
            keepalive,
        }
    }

    /// Queues raw bytes ahead of everything not yet started (at most 256).
    pub(crate) fn push_extra(&mut self, bytes: &[u8]) {
        let mut extra = Extra {
            bytes: [0; 256],
            len: bytes.len(),
            sent: 0,
        };
        extra.bytes[..bytes.len()].copy_from_slice(bytes);
        self.extra = Some(extra);
    }

    /// Queues a keep-alive unless something is already being sent (which proves
    /// liveness just as well) or one is pending.
    pub(crate) fn keepalive(&mut self) {
        if self.current.is_none() && self.extra.is_none() {
            let keepalive = self.keepalive;
            self.push_extra(&keepalive);
        }
    }

    /// Writes as much as the socket takes, and about `limit` bytes at most (a
    /// write that crosses it still completes): pending extra bytes, the frame in
    /// flight, then frames from `queue`. Calls `sent(token)` for each frame that
    /// leaves completely.
    pub(crate) fn flush(
        &mut self,
        socket: &mut impl Write,
        queue: &ArrayQueue<SendOp>,
        limit: usize,
        mut sent: impl FnMut(u64),
    ) -> io::Result<Flushed> {
        let mut written = 0usize;
        loop {
            if written >= limit {
                return Ok(Flushed::Limited);
            }
            if let Some(extra) = &mut self.extra {
                // Extra bytes go only between frames, never inside one.
                if self.current.is_none() {
                    match socket.write(&extra.bytes[extra.sent..extra.len]) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(n) => {
                            extra.sent += n;
                            written += n;
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            return Ok(Flushed::Blocked);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(e),
                    }
                    if extra.sent == extra.len {
                        self.extra = None;
                    }
                    continue;
                }
            }
            let Some(flight) = &mut self.current else {
                match queue.pop() {
                    Some(op) => {
                        self.current = Some(InFlight { op, sent: 0 });
                        continue;
                    }
                    None => return Ok(Flushed::Idle),
                }
            };
            let total = HEADER_LEN + flight.op.payload.len();
            let result = if flight.sent < HEADER_LEN {
                let slices = [
                    IoSlice::new(&flight.op.header[flight.sent..]),
                    IoSlice::new(flight.op.payload.bytes(0)),
                ];
                socket.write_vectored(&slices)
            } else {
                socket.write(flight.op.payload.bytes(flight.sent - HEADER_LEN))
            };
            match result {
                Ok(0) if total > flight.sent => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    flight.sent += n;
                    written += n;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Flushed::Blocked),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
            if flight.sent == total {
                let token = flight.op.token;
                // Release the region before reporting, so a caller that drops the
                // region on seeing the completion does not wait on us.
                self.current = None;
                sent(token);
            }
        }
    }

    /// Takes every frame not yet sent, the one in flight first, for failure
    /// reports. Calls `failed(token)` for each.
    pub(crate) fn fail_all(&mut self, queue: &ArrayQueue<SendOp>, mut failed: impl FnMut(u64)) {
        self.extra = None;
        if let Some(flight) = self.current.take() {
            failed(flight.op.token);
        }
        while let Some(op) = queue.pop() {
            let token = op.token;
            drop(op);
            failed(token);
        }
    }
}
