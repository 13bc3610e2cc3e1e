//! The send path of an admitted connection: frames queued by posting threads,
//! written by the I/O thread with vectored writes straight from registered memory.

use std::collections::VecDeque;
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
                // source range until its completion, or (a peer's write into a
                // window over it) until the peer has every byte, which comes
                // after the flush that reads the last of them here.
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

impl InFlight {
    fn total(&self) -> usize {
        HEADER_LEN + self.op.payload.len()
    }
}

/// Frames one vectored write gathers at most: a burst of small frames (a
/// descriptor, a credit, a write) leaves in one system call.
const GATHER_FRAMES: usize = 16;

/// Most bytes one vectored write offers the socket; a larger frame leaves in
/// several writes.
///
/// While a write runs, the kernel holds the socket, and what the peer sends
/// meanwhile (its data, and the acknowledgements that let this side's next
/// segments go) waits in the socket's backlog until the write returns. An
/// all-reduce sends and receives at once, so a write of a whole large frame
/// has the kernel send much of it from that backlog, at the pace of the
/// acknowledgements, and on loopback some segments then reach the peer out of
/// order and are sent again. Shorter writes pay a system call more often.
/// Measured on 2x1 tcp (two cores, medians of six alternating rounds, busbw in
/// GB/s at 256 KiB, 1, 4, 16 and 64 MiB): whole frames 2.87, 2.88, 3.05, 2.33,
/// 2.42; 512 KiB 2.74, 3.71, 3.48, 2.35, 2.43; 256 KiB 3.30, 4.21, 3.90, 2.26,
/// 2.36; 128 KiB 4.26, 4.03, 2.86, 2.13, 2.16.
const WRITE_MAX: usize = 256 << 10;

/// Bytes this side sends outside the queue (the last handshake frame, keep-alives).
struct Extra {
    bytes: [u8; 256],
    len: usize,
    sent: usize,
}

/// The sending half of one admitted connection.
pub(crate) struct Sender {
    /// Frames taken from the queue and not yet completely out, oldest first;
    /// only the first may be partly out.
    current: VecDeque<InFlight>,
    extra: Option<Extra>,
    keepalive: [u8; HEADER_LEN],
    /// [`WRITE_MAX`], or less in tests.
    write_max: usize,
    /// Bytes written in all: whether a flush moved anything.
    written: u64,
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
            current: VecDeque::with_capacity(GATHER_FRAMES),
            extra: None,
            keepalive,
            write_max: WRITE_MAX,
            written: 0,
        }
    }

    /// Bytes written so far, in all.
    pub(crate) fn written(&self) -> u64 {
        self.written
    }

    /// Whether nothing taken from the queue is still to be written.
    pub(crate) fn is_idle(&self) -> bool {
        self.current.is_empty() && self.extra.is_none()
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
        if self.current.is_empty() && self.extra.is_none() {
            let keepalive = self.keepalive;
            self.push_extra(&keepalive);
        }
    }

    /// Writes as much as the socket takes, and about `limit` bytes at most (a
    /// write that crosses it still completes): pending extra bytes, the frames in
    /// flight, then frames from `queue`, up to [`GATHER_FRAMES`] per vectored
    /// write. Calls `sent(token)` for each frame that leaves completely.
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
                // Done exactly at the limit is done: nobody need come back.
                if self.is_idle() && queue.is_empty() {
                    return Ok(Flushed::Idle);
                }
                return Ok(Flushed::Limited);
            }
            if let Some(extra) = &mut self.extra {
                // Extra bytes go only between frames, never inside one.
                if self.current.is_empty() {
                    match socket.write(&extra.bytes[extra.sent..extra.len]) {
                        Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                        Ok(n) => {
                            extra.sent += n;
                            written += n;
                            self.written += n as u64;
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
            let mut gathered: usize = self.current.iter().map(|f| f.total() - f.sent).sum();
            while self.current.len() < GATHER_FRAMES && written + gathered < limit {
                let Some(op) = queue.pop() else { break };
                let flight = InFlight { op, sent: 0 };
                gathered += flight.total();
                self.current.push_back(flight);
            }
            if self.current.is_empty() {
                return Ok(Flushed::Idle);
            }
            let result = {
                let mut slices = [IoSlice::new(&[]); 2 * GATHER_FRAMES];
                let mut used = 0;
                let mut room = self.write_max;
                for flight in &self.current {
                    if room == 0 {
                        break;
                    }
                    let (header, payload) = if flight.sent < HEADER_LEN {
                        (&flight.op.header[flight.sent..], flight.op.payload.bytes(0))
                    } else {
                        (&[][..], flight.op.payload.bytes(flight.sent - HEADER_LEN))
                    };
                    if !header.is_empty() {
                        if header.len() > room {
                            break;
                        }
                        slices[used] = IoSlice::new(header);
                        used += 1;
                        room = room.saturating_sub(header.len());
                    }
                    let take = payload.len().min(room);
                    slices[used] = IoSlice::new(&payload[..take]);
                    used += 1;
                    room -= take;
                }
                socket.write_vectored(&slices[..used])
            };
            let mut n = match result {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Flushed::Blocked),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            written += n;
            self.written += n as u64;
            while n > 0 {
                let Some(flight) = self.current.front_mut() else {
                    return Err(io::Error::other("the socket took more bytes than offered"));
                };
                let taken = n.min(flight.total() - flight.sent);
                flight.sent += taken;
                n -= taken;
                if flight.sent == flight.total() {
                    let token = flight.op.token;
                    // Release the region before reporting, so a caller that drops
                    // the region on seeing the completion does not wait on us.
                    self.current.pop_front();
                    sent(token);
                }
            }
        }
    }

    /// Takes every frame not yet sent, the one in flight first, for failure
    /// reports. Calls `failed(token)` for each.
    pub(crate) fn fail_all(&mut self, queue: &ArrayQueue<SendOp>, mut failed: impl FnMut(u64)) {
        self.extra = None;
        for flight in self.current.drain(..) {
            failed(flight.op.token);
        }
        while let Some(op) = queue.pop() {
            let token = op.token;
            drop(op);
            failed(token);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fairring_core::wire::FrameKind;

    /// A socket that takes at most `per_call` bytes per write and records each.
    struct Socket {
        per_call: usize,
        calls: usize,
        bytes: Vec<u8>,
        /// The most bytes one write offered.
        largest: usize,
    }

    impl Write for Socket {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.write_vectored(&[IoSlice::new(buf)])
        }

        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            self.calls += 1;
            self.largest = self.largest.max(bufs.iter().map(|b| b.len()).sum());
            let mut taken = 0;
            for buf in bufs {
                let n = buf.len().min(self.per_call - taken);
                self.bytes.extend_from_slice(&buf[..n]);
                taken += n;
            }
            Ok(taken)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn message(token: u64, len: usize) -> SendOp {
        let header = FrameHeader::control(FrameKind::Message, 7, 1, 0).encode();
        let mut bytes = [0u8; MAX_MESSAGE_PAYLOAD as usize];
        for (b, i) in bytes.iter_mut().zip(0u64..).take(len) {
            *b = token.wrapping_mul(31).wrapping_add(i).to_le_bytes()[0];
        }
        SendOp {
            token,
            header,
            payload: Payload::Inline { bytes, len },
        }
    }

    fn expected(ops: &[SendOp]) -> Vec<u8> {
        let mut all = Vec::new();
        for op in ops {
            all.extend_from_slice(&op.header);
            all.extend_from_slice(op.payload.bytes(0));
        }
        all
    }

    /// No write offers more than the sender's bound: a frame longer than it
    /// leaves in several, and the bytes still leave whole and in order.
    #[test]
    fn no_write_offers_more_than_the_bound() {
        let lens = [24usize, 8, 0, 40, 1, 33, 24, 8];
        for write_max in [HEADER_LEN, HEADER_LEN + 1, 60, 100, 1000] {
            let queue = ArrayQueue::new(64);
            for (token, &len) in (0u64..).zip(&lens) {
                assert!(queue.push(message(token, len)).is_ok());
            }
            let want: Vec<SendOp> = (0u64..).zip(lens).map(|(t, l)| message(t, l)).collect();
            let mut socket = Socket {
                per_call: usize::MAX,
                calls: 0,
                bytes: Vec::new(),
                largest: 0,
            };
            let mut sender = Sender::new(7, 1);
            sender.write_max = write_max;
            let mut reported = Vec::new();
            let flushed = sender
                .flush(&mut socket, &queue, usize::MAX, |t| reported.push(t))
                .unwrap();
            assert!(matches!(flushed, Flushed::Idle), "write_max {write_max}");
            assert_eq!(socket.bytes, expected(&want), "write_max {write_max}");
            assert_eq!(reported, (0u64..).take(lens.len()).collect::<Vec<_>>());
            assert!(
                socket.largest <= write_max,
                "write_max {write_max}: a write offered {}",
                socket.largest
            );
            let total = socket.bytes.len();
            assert!(
                socket.calls >= total.div_ceil(write_max),
                "write_max {write_max}"
            );
        }
    }

    /// Every queued frame leaves in one vectored write when the socket takes it
    /// all; when it takes a few bytes at a time, the bytes still leave whole and
    /// in order, and each frame is reported once, in order.
    #[test]
    fn queued_frames_leave_together_and_in_order() {
        for per_call in [usize::MAX, 1, 7, HEADER_LEN + 3, 1000] {
            let lens = [24usize, 8, 0, 40, 1, 33, 24, 8];
            let queue = ArrayQueue::new(64);
            for (token, &len) in (0u64..).zip(&lens) {
                assert!(queue.push(message(token, len)).is_ok());
            }
            let want: Vec<SendOp> = (0u64..).zip(lens).map(|(t, l)| message(t, l)).collect();
            let mut socket = Socket {
                per_call,
                calls: 0,
                bytes: Vec::new(),
                largest: 0,
            };
            let mut sender = Sender::new(7, 1);
            let mut reported = Vec::new();
            let flushed = sender
                .flush(&mut socket, &queue, usize::MAX, |t| reported.push(t))
                .unwrap();
            assert!(matches!(flushed, Flushed::Idle), "per_call {per_call}");
            assert_eq!(socket.bytes, expected(&want), "per_call {per_call}");
            assert_eq!(reported, (0u64..).take(lens.len()).collect::<Vec<_>>());
            if per_call == usize::MAX {
                assert_eq!(socket.calls, 1, "one vectored write for every frame");
            }
        }
    }

    /// More frames than one write gathers take more writes, none lost.
    #[test]
    fn a_long_queue_is_gathered_in_turns() {
        let queue = ArrayQueue::new(64);
        let count = GATHER_FRAMES * 2 + 3;
        for token in (0u64..).take(count) {
            assert!(queue.push(message(token, 5)).is_ok());
        }
        let mut socket = Socket {
            per_call: usize::MAX,
            calls: 0,
            bytes: Vec::new(),
            largest: 0,
        };
        let mut reported = Vec::new();
        Sender::new(7, 1)
            .flush(&mut socket, &queue, usize::MAX, |t| reported.push(t))
            .unwrap();
        assert_eq!(socket.calls, 3);
        assert_eq!(reported.len(), count);
        assert_eq!(socket.bytes.len(), count * (HEADER_LEN + 5));
    }
}
