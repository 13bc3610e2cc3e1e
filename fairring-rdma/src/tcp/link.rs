//! The I/O state of one admitted connection, shared by the I/O thread and the
//! threads that post and poll.
//!
//! The I/O thread serves every connection, but a hand-off to it costs a thread
//! wake-up per hop (on a virtual machine often tens of microseconds), which is most
//! of a small write's latency. So the other threads use a connection themselves
//! whenever nobody else does:
//!
//! - a **posting thread** that queued a frame writes what the socket takes at once
//!   ([`Shared::send_inline`]), up to [`INLINE_BYTES`], and leaves the rest to
//!   a spinner or the I/O thread;
//! - a **thread about to spin** for completions reads what has arrived, and
//!   writes what posters left unwritten ([`Shared::progress_inline`]), while
//!   the completion queue has room; one `poll(2)` over every socket tells it
//!   which to read and which take bytes.
//!
//! While a thread spins, the I/O thread naps (`quiet`) even with frames half
//! written: the spinner carries them on, and what it leaves when it stops, the
//! I/O thread writes when its nap ends. So on a machine with no core to spare
//! a large transfer is moved by the spinning thread alone (2x1 tcp, two cores,
//! 2,000 all-reduces of 1 MiB: 0.88 ms of CPU and 9.5 context switches each
//! with the I/O thread waking to carry on, 0.65 ms and 2.5 without).
//!
//! Whichever thread reads takes a burst of small frames in one `read`, through a
//! read-ahead buffer, and reads a large payload straight into its region. Whichever
//! thread writes sends every queued frame, up to 16, in one vectored write.
//!
//! Each connection's state sits behind one mutex. The I/O thread takes it with
//! `lock` (it may wait for a posting thread's write to finish); every other thread
//! only with `try_lock`, so none of them ever waits on the I/O thread, which may be
//! holding the lock while it waits for room in the completion queue. Completions
//! are queued under the lock, so a connection's completions keep the order of its
//! bytes, whichever thread moved them.
//!
//! A thread other than the I/O thread never blocks and never fails a peer itself:
//!
//! - a completion the queue has no room for is **held** in the link, and the I/O
//!   thread queues held completions (waiting for room) before it moves anything
//!   else; while any is held, other threads leave the link alone;
//! - a socket error is recorded as **broken**, and the I/O thread fails the peer
//!   exactly as if it had met the error itself;
//! - bytes left unread (the budget ran out, or the queue filled) set
//!   `more_to_read`, which the I/O thread reads on its next turn.
//!
//! Whenever one of these leaves work for the I/O thread, the caller wakes it,
//! unless the I/O thread naps: the end of a nap reads what is left to read and
//! writes what is left unsent. Edge-triggered readiness stays sound: a thread
//! that stops reading before the socket is drained always sets `more_to_read`
//! (a thread other than the I/O thread takes a short read as drained: what
//! it leaves keeps the edge it did not take),
//! a thread that stops writing before the socket is full sets `unsent`, and a
//! write that would block leaves the socket's next writable edge to the I/O
//! thread.

use std::collections::VecDeque;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::PoisonError;
use std::time::Instant;

use mio::net::TcpStream;

use super::event_loop::{ADMITTED, Shared};
use super::receiver::{Received, Receiver};
use super::sender::{Flushed, Sender};
use super::socket::NoSigPipe;
use crate::fabric::{Completion, CompletionEvent, PeerFailure};
use crate::sync::unmodelled::Ordering;

/// Bytes a thread other than the I/O thread writes to one connection per call
/// before it leaves the rest (to itself spinning, or to the I/O thread): about
/// what the kernel's largest send buffer holds, so that a large frame leaves
/// from the thread that posted it, and the poster (the engine's driver) is not
/// held past one buffer's worth. At 256 KiB every frame above it woke the I/O
/// thread, which on two cores took the poster's core: 2x1 tcp all-reduces of
/// 1 MiB and 4 MiB ran at 3.05 and 2.51 GB/s, against 3.74 and 3.23 with this
/// bound (medians of five alternating rounds).
pub(crate) const INLINE_BYTES: usize = 4 << 20;

/// Bytes a spinning thread reads from one connection per call: as much, for
/// the same reason.
const INLINE_READ_BUDGET: usize = 4 << 20;

/// Bytes read ahead from a socket at a time when the next frame part is small:
/// one `read` then takes a burst of small frames (a descriptor, a credit, a
/// small write), which are copied out of it. A payload part at least this long
/// is read straight into its region instead.
const READ_AHEAD: usize = 16 << 10;

/// Bytes read from a socket but not yet handed to the receiver.
struct ReadAhead {
    bytes: Box<[u8]>,
    start: usize,
    end: usize,
}

impl ReadAhead {
    fn new() -> ReadAhead {
        ReadAhead {
            bytes: vec![0; READ_AHEAD].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }
}

/// The sockets inline readers poll, and whose they are (same order).
#[derive(Default)]
pub(crate) struct Readable {
    fds: Vec<libc::pollfd>,
    peers: Vec<u32>,
}

/// How a socket failed, by the side that met the failure.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Broken {
    /// Reading failed, or the peer closed the connection.
    Read(PeerFailure),
    /// Writing failed: what the peer sent before may still wait to be read.
    Write(PeerFailure),
}

/// One admitted connection's socket and protocol state.
pub(crate) struct Link {
    pub(crate) stream: TcpStream,
    pub(crate) receiver: Receiver,
    pub(crate) sender: Sender,
    /// When bytes last arrived.
    pub(crate) last_rx: Instant,
    /// Whether the socket may hold bytes nobody has read yet.
    pub(crate) more_to_read: bool,
    /// A failure met by a thread other than the I/O thread.
    pub(crate) broken: Option<Broken>,
    /// Completions the queue had no room for, oldest first.
    held: VecDeque<Completion>,
    /// Bytes read ahead of the receiver.
    ahead: ReadAhead,
}

/// How a thread queues the completions it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Queueing {
    /// The I/O thread: waits for room.
    Wait,
    /// Any other thread: holds what does not fit, and stops.
    Hold,
}

impl Link {
    pub(crate) fn new(stream: TcpStream, receiver: Receiver, sender: Sender) -> Link {
        Link {
            stream,
            receiver,
            sender,
            last_rx: Instant::now(),
            // Bytes may have arrived before the socket was watched.
            more_to_read: true,
            broken: None,
            held: VecDeque::new(),
            ahead: ReadAhead::new(),
        }
    }

    /// Whether a thread other than the I/O thread may use the link.
    fn usable_inline(&self) -> bool {
        self.broken.is_none() && self.held.is_empty()
    }

    /// The I/O thread: queues every held completion, waiting for room.
    pub(crate) fn release_held(&mut self, shared: &Shared) {
        while let Some(completion) = self.held.pop_front() {
            shared.complete(completion.peer, completion.event);
        }
    }

    /// Reads and handles frames from `peer` until the socket has nothing more,
    /// `budget` bytes were read, or (with [`Queueing::Hold`]) a completion found
    /// no room. Returns how many bytes arrived.
    ///
    /// A small next part is read through the read-ahead buffer, a large one
    /// straight into its region; bytes read ahead are handed on before the socket
    /// is read again, so the receiver sees the connection's bytes in order.
    pub(crate) fn read(
        &mut self,
        shared: &Shared,
        peer: u32,
        budget: usize,
        queueing: Queueing,
    ) -> Result<usize, PeerFailure> {
        let mut left = budget;
        let mut arrived = 0;
        // A read that returned less than it asked for emptied the socket's
        // queue up to its end, if the peer closed it (TCP fills a read from
        // everything queued, and stops at a close). A thread other than the
        // I/O thread then reads no more, not even to hear `WouldBlock`: what
        // it leaves (a close, or bytes arriving since) keeps the socket
        // readable, so the I/O thread's edge for it, which a `poll` does not
        // take, still reports it. The I/O thread reads on to `WouldBlock`, a
        // close or an error: its read may have spent the edge of a close.
        let mut drained = false;
        loop {
            if drained && self.ahead.is_empty() {
                self.more_to_read = false;
                return Ok(arrived);
            }
            let n = if self.ahead.is_empty() {
                let buffer = self.receiver.buffer();
                let direct = buffer.len() >= READ_AHEAD;
                let into = if direct {
                    buffer
                } else {
                    &mut self.ahead.bytes[..]
                };
                let asked = into.len();
                let n = match io::Read::read(&mut &self.stream, into) {
                    Ok(0) if self.receiver.mid_frame() => {
                        return Err(PeerFailure::ClosedMidFrame);
                    }
                    Ok(0) => return Err(PeerFailure::Closed),
                    Ok(n) => {
                        drained = n < asked && queueing == Queueing::Hold;
                        n
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.more_to_read = false;
                        return Ok(arrived);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(PeerFailure::Io(e.kind())),
                };
                arrived += n;
                self.last_rx = Instant::now();
                left = left.saturating_sub(n);
                if direct {
                    n
                } else {
                    self.ahead.start = 0;
                    self.ahead.end = n;
                    self.hand_on()
                }
            } else {
                self.hand_on()
            };
            let event = match self.receiver.filled(n, &shared.regions) {
                Ok(Received::Nothing | Received::Keepalive) => None,
                Ok(Received::Landed { len, immediate, .. }) => {
                    Some(CompletionEvent::Landed { len, immediate })
                }
                Ok(Received::Message(message)) => Some(CompletionEvent::Message(message)),
                Ok(Received::Aborted) => return Err(PeerFailure::Aborted),
                Err(violation) => return Err(PeerFailure::Protocol(violation)),
            };
            let queued = event.is_none_or(|event| {
                queue_completion(shared, &mut self.held, Completion { peer, event }, queueing)
            });
            if !queued || left == 0 {
                self.more_to_read = true;
                return Ok(arrived);
            }
        }
    }

    /// Copies what the receiver takes next out of the read-ahead buffer (which
    /// holds something); returns how many bytes.
    fn hand_on(&mut self) -> usize {
        let buffer = self.receiver.buffer();
        let ahead = &self.ahead.bytes[self.ahead.start..self.ahead.end];
        let n = buffer.len().min(ahead.len());
        buffer[..n].copy_from_slice(&ahead[..n]);
        self.ahead.start += n;
        n
    }

    /// Writes what the socket takes of the frames queued to `peer`, up to `limit`
    /// bytes.
    pub(crate) fn flush(
        &mut self,
        shared: &Shared,
        peer: u32,
        limit: usize,
        queueing: Queueing,
    ) -> io::Result<Flushed> {
        let Some(queue) = shared.peers[peer as usize].queue.get() else {
            return Ok(Flushed::Idle);
        };
        let Link {
            stream,
            sender,
            held,
            ..
        } = self;
        let flushed = sender.flush(&mut NoSigPipe(&*stream), queue, limit, |token| {
            let event = CompletionEvent::Sent { token };
            queue_completion(shared, held, Completion { peer, event }, queueing);
        });
        // Under the link's lock, so the flag follows the sender's state. A
        // failed write leaves the frames to the I/O thread's failing of the
        // peer, which a broken link wakes it for.
        let unsent = matches!(flushed, Ok(Flushed::Blocked | Flushed::Limited));
        shared.peers[peer as usize]
            .unsent
            .store(unsent, Ordering::SeqCst);
        flushed
    }
}

impl Shared {
    /// A posting thread queued a frame to `peer`: writes it now if no other thread
    /// uses the connection. Returns whether the I/O thread must be woken (for
    /// the rest of the frames, a held completion, or a failure).
    ///
    /// Frames left because the socket is full need no wake-up: the socket's
    /// writable edge brings the I/O thread back (or a spinner takes them
    /// first). Frames left at the byte limit need one unless the I/O thread
    /// naps: the nap's end writes them.
    pub(crate) fn send_inline(&self, peer: u32) -> bool {
        let slot = &self.peers[peer as usize];
        let mut guard = match slot.link.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return true,
        };
        let Some(link) = guard.as_mut().filter(|l| l.usable_inline()) else {
            return true;
        };
        match link.flush(self, peer, INLINE_BYTES, Queueing::Hold) {
            Ok(Flushed::Idle | Flushed::Blocked) => !link.held.is_empty(),
            Ok(Flushed::Limited) => !link.held.is_empty() || !self.quiet.napping(),
            Err(e) => {
                link.broken = Some(Broken::Write(write_failure(&e)));
                true
            }
        }
    }

    /// A thread about to spin: reads what has arrived from every peer whose
    /// socket has bytes, and writes frames left unsent to every peer whose
    /// socket takes bytes, where no other thread uses the connection. Returns
    /// whether anything moved.
    ///
    /// One `poll(2)` over every watched socket finds the ones with bytes (and,
    /// for connections with frames to write, the ones with room), so the call
    /// costs one system call however many peers the job has, plus a read or a
    /// write per socket that has something. If another thread is polling, this
    /// one returns at once.
    pub(crate) fn progress_inline(&self) -> bool {
        self.quiet.spinning();
        let Ok(mut readable) = self.readable.try_lock() else {
            return false;
        };
        let Readable { fds, peers } = &mut *readable;
        if fds.is_empty() {
            return false;
        }
        for (fd, &peer) in fds.iter_mut().zip(peers.iter()) {
            let slot = &self.peers[peer as usize];
            // Frames a poster left: not those a batch holds (its end writes
            // them together), nor those queued while another thread had the
            // link (that thread wakes the I/O thread).
            fd.events = if slot.unsent.load(Ordering::SeqCst) {
                libc::POLLIN | libc::POLLOUT
            } else {
                libc::POLLIN
            };
        }
        let count = libc::nfds_t::try_from(fds.len()).unwrap_or(libc::nfds_t::MAX);
        // SAFETY: `fds` is a live exclusive array of `count` pollfds; with a zero
        // timeout the kernel only writes `revents`. The descriptors stay open (a
        // socket is unwatched, under this lock, before its connection closes).
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), count, 0) };
        if ready <= 0 {
            return false;
        }
        let mut moved = false;
        let mut wake = false;
        for (fd, &peer) in fds.iter().zip(peers.iter()) {
            if fd.revents == 0 {
                continue;
            }
            let slot = &self.peers[peer as usize];
            if slot.state.load(Ordering::Acquire) != ADMITTED {
                continue;
            }
            let Ok(mut guard) = slot.link.try_lock() else {
                continue;
            };
            let Some(link) = guard.as_mut().filter(|l| l.usable_inline()) else {
                continue;
            };
            if fd.revents & libc::POLLOUT != 0 {
                let before = link.sender.written();
                match link.flush(self, peer, INLINE_BYTES, Queueing::Hold) {
                    Ok(Flushed::Idle | Flushed::Blocked) => {}
                    Ok(Flushed::Limited) => wake |= !self.quiet.napping(),
                    Err(e) => {
                        link.broken = Some(Broken::Write(write_failure(&e)));
                        moved = true;
                    }
                }
                // Room the socket then refused (memory pressure) is no move:
                // the spinner may sleep.
                moved |= link.sender.written() > before;
            }
            // Anything but room to write (bytes, a hang-up, an error) is the
            // reader's to find out.
            if fd.revents & !libc::POLLOUT != 0 && link.usable_inline() {
                match link.read(self, peer, INLINE_READ_BUDGET, Queueing::Hold) {
                    Ok(bytes) => moved |= bytes > 0,
                    Err(failure) => {
                        link.broken = Some(Broken::Read(failure));
                        moved = true;
                    }
                }
                wake |= link.more_to_read && !self.quiet.napping();
            }
            wake |= !link.usable_inline();
        }
        if wake {
            self.wake();
        }
        moved
    }

    /// A thread that read inline returns to its caller: the I/O thread's nap
    /// ends if frames were left unsent, which no spinner writes now
    /// ([`Quiet::spinner_leaves`](super::quiet::Quiet::spinner_leaves)).
    pub(crate) fn spinner_leaves(&self) {
        self.quiet.spinner_leaves(|| {
            self.peers
                .iter()
                .any(|slot| slot.unsent.load(Ordering::SeqCst))
        });
    }

    /// Watches `peer`'s socket for inline readers (the I/O thread, on admission).
    pub(crate) fn watch(&self, peer: u32, stream: &TcpStream) {
        let mut readable = self.readable.lock().unwrap_or_else(PoisonError::into_inner);
        readable.fds.push(libc::pollfd {
            fd: stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        readable.peers.push(peer);
    }

    /// Stops watching `peer`'s socket (the I/O thread, before it closes it).
    pub(crate) fn unwatch(&self, peer: u32) {
        let mut readable = self.readable.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(at) = readable.peers.iter().position(|&p| p == peer) {
            readable.peers.swap_remove(at);
            readable.fds.swap_remove(at);
        }
    }

    /// Locks `peer`'s link, for the I/O thread.
    pub(crate) fn lock_link(&self, peer: u32) -> std::sync::MutexGuard<'_, Option<Link>> {
        self.peers[peer as usize]
            .link
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Queues `completion` behind those `held` for its connection; returns whether it
/// went into the queue. With [`Queueing::Wait`] it always does (the I/O thread
/// waits for room); with [`Queueing::Hold`] a completion the queue has no room
/// for, or that would overtake a held one, is held instead.
fn queue_completion(
    shared: &Shared,
    held: &mut VecDeque<Completion>,
    completion: Completion,
    queueing: Queueing,
) -> bool {
    match queueing {
        Queueing::Wait => {
            shared.complete(completion.peer, completion.event);
            true
        }
        Queueing::Hold if !held.is_empty() => {
            held.push_back(completion);
            false
        }
        Queueing::Hold => match shared.cq.push(completion) {
            Ok(()) => true,
            Err(back) => {
                held.push_back(back);
                false
            }
        },
    }
}

/// The peer failure a write error means.
pub(crate) fn write_failure(e: &io::Error) -> PeerFailure {
    if e.kind() == io::ErrorKind::BrokenPipe {
        PeerFailure::Closed
    } else {
        PeerFailure::Io(e.kind())
    }
}
