//! The I/O thread: one `epoll` loop (through mio) that accepts and admits
//! connections, reads frames into regions, writes queued frames, and watches every
//! peer for silence.
//!
//! One thread serves every peer, so 64 peers cost one thread, not 128. Reads are
//! bounded per connection per turn (`READ_BUDGET`), so one busy peer cannot starve
//! the others, and the admission of strangers (each a small non-blocking state
//! machine with a deadline) never blocks admitted traffic.

use crate::sync::unmodelled::{AtomicBool, AtomicU8, Ordering};
use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

mod admission;

use super::config::TcpConfig;
use super::handshake::{
    Acceptor, AcceptorStep, Failure, HandshakeParams, HelloReader, OutFrame, refusal_frame,
    welcome_frame,
};
use super::link::{Broken, Link, Queueing, Readable, write_failure};
use super::quiet::Quiet;
use super::receiver::Receiver;
use super::regions::RegionTable;
use super::sender::{SendOp, Sender};
use super::socket::{self, NoSigPipe, discard_incoming, unacknowledged};
use crate::fabric::{Completion, CompletionEvent, CompletionQueue, PeerFailure, Refusal};

/// Bytes read from one connection before the loop turns to the others.
const READ_BUDGET: usize = 8 << 20;
/// The longest a closing fabric waits for its peers to take what it wrote
/// (`EventLoop::linger`).
const LINGER: Duration = Duration::from_secs(1);
/// Bytes read in one turn that keep the loop awake: a large payload streaming
/// in, which it takes as it arrives.
const STREAMING_BYTES: usize = 64 << 10;
const WAKER: Token = Token(0);
const LISTENER: Token = Token(1);

pub(crate) const NOT_CONNECTED: u8 = 0;
pub(crate) const ADMITTED: u8 = 1;
pub(crate) const FAILED: u8 = 2;

/// A refused connection, as recorded for the log and for inspection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusalRecord {
    /// Where the connection came from.
    pub address: SocketAddr,
    /// The rank it claimed, once it claimed one.
    pub claimed_rank: Option<u32>,
    /// Why it was refused.
    pub refusal: Refusal,
    /// Whether the other side refused (its reason, as it sent it).
    pub by_peer: bool,
}

/// What the I/O thread shares with the threads that post work.
pub(crate) struct Shared {
    pub(crate) config: TcpConfig,
    pub(crate) params: HandshakeParams,
    pub(crate) peers: Vec<PeerSlot>,
    pub(crate) regions: Arc<RegionTable>,
    pub(crate) cq: CompletionQueue,
    pub(crate) waker: Waker,
    pub(crate) woken: AtomicBool,
    pub(crate) shutdown: AtomicBool,
    /// Sockets that `connect` dialed and admitted, for the loop to adopt.
    pub(crate) handoff: Mutex<Vec<(u32, std::net::TcpStream)>>,
    /// Signalled whenever a peer is admitted or fails.
    pub(crate) status: Mutex<()>,
    pub(crate) status_changed: Condvar,
    pub(crate) refusals: Mutex<VecDeque<RefusalRecord>>,
    /// The sockets of watched connections, for inline readers to ask which have
    /// bytes (see `link`).
    pub(crate) readable: Mutex<Readable>,
    /// Whether threads read inline, so that the loop naps (see `quiet`).
    pub(crate) quiet: Quiet,
}

/// One rank's state as the posting threads see it.
pub(crate) struct PeerSlot {
    /// `NOT_CONNECTED`, then `ADMITTED`, then perhaps `FAILED`; never back.
    pub(crate) state: AtomicU8,
    /// Set before `state` becomes `FAILED`.
    pub(crate) failure: Mutex<Option<PeerFailure>>,
    /// Frames posted and not yet taken by the loop; created on admission.
    pub(crate) queue: OnceLock<ArrayQueue<SendOp>>,
    /// The connection, once the loop watches it; gone again once it fails.
    pub(crate) link: Mutex<Option<Link>>,
    /// Whether the last flush of the connection stopped with frames still to
    /// write (the socket was full, or the flush's byte limit was reached): the
    /// frames a spinner carries on and a nap's end writes (see `link`).
    pub(crate) unsent: AtomicBool,
}

impl Shared {
    /// Wakes the loop, unless a wake-up is already pending, and ends its nap.
    pub(crate) fn wake(&self) {
        if !self.woken.swap(true, Ordering::SeqCst) {
            // A failed wake can only mean the loop is gone (shut down).
            let _ = self.waker.wake();
        }
        self.quiet.end_nap();
    }

    pub(crate) fn failure_of(&self, peer: u32) -> PeerFailure {
        self.peers[peer as usize]
            .failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .unwrap_or(PeerFailure::ShutDown)
    }

    fn notify_status(&self) {
        let _guard = self.status.lock().unwrap_or_else(PoisonError::into_inner);
        self.status_changed.notify_all();
    }

    /// Pushes a completion, holding the loop back while the queue is full.
    pub(crate) fn complete(&self, peer: u32, event: CompletionEvent) {
        let mut completion = Completion { peer, event };
        loop {
            match self.cq.push(completion) {
                Ok(()) => return,
                Err(back) if !self.shutdown.load(Ordering::Acquire) => {
                    completion = back;
                    std::thread::sleep(Duration::from_micros(50));
                }
                Err(_) => return,
            }
        }
    }

    pub(crate) fn record_refusal(&self, record: RefusalRecord) {
        log::warn!(
            "fairring tcp rank {}: refused connection from {}{}: {}{}",
            self.config.rank,
            record.address,
            record
                .claimed_rank
                .map(|r| format!(" (claims rank {r})"))
                .unwrap_or_default(),
            record.refusal,
            if record.by_peer {
                " (the peer's reason)"
            } else {
                ""
            },
        );
        let mut log = self.refusals.lock().unwrap_or_else(PoisonError::into_inner);
        if log.len() == 256 {
            log.pop_front();
        }
        log.push_back(record);
    }
}

/// A connection waiting for admission.
struct Pending {
    stream: TcpStream,
    address: SocketAddr,
    reader: HelloReader,
    acceptor: Acceptor,
    out: Option<(OutFrame, usize)>,
    deadline: Instant,
}

/// What the loop alone keeps of an admitted connection (the rest is its
/// [`Link`], which other threads use too).
struct Conn {
    last_keepalive: Instant,
}

pub(crate) struct EventLoop {
    shared: Arc<Shared>,
    poll: Poll,
    listener: TcpListener,
    pending: Vec<Option<Pending>>,
    conns: Vec<Option<Conn>>,
    any_failed: bool,
    /// The last turn read a stream's worth of bytes ([`STREAMING_BYTES`]) or
    /// took work from the posting threads: data is moving through this thread,
    /// so it does not nap (see `quiet`). A few small frames it happened to read
    /// first do not count, or it would stay awake on every race it wins.
    moved: bool,
    /// Peers with a connection, so a turn of the loop visits only them.
    connected: Vec<u32>,
    /// Scratch for iterating `connected` while it may change.
    visiting: Vec<u32>,
}

impl EventLoop {
    pub(crate) fn new(
        shared: Arc<Shared>,
        poll: Poll,
        mut listener: TcpListener,
    ) -> io::Result<EventLoop> {
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)?;
        let pending = (0..shared.config.max_pending_handshakes)
            .map(|_| None)
            .collect();
        let conns = (0..shared.config.world_size).map(|_| None).collect();
        Ok(EventLoop {
            shared,
            poll,
            listener,
            pending,
            conns,
            any_failed: false,
            moved: false,
            connected: Vec::new(),
            visiting: Vec::new(),
        })
    }

    fn pending_token(i: usize) -> Token {
        Token(2 + i)
    }

    fn conn_token(&self, peer: u32) -> Token {
        Token(2 + self.pending.len() + peer as usize)
    }

    pub(crate) fn run(mut self) {
        self.shared.quiet.register_io_thread();
        let config = &self.shared.config;
        let tick = [
            config.keepalive_interval,
            config.silence_timeout / 4,
            config.handshake_timeout / 4,
            Duration::from_millis(250),
        ]
        .into_iter()
        .min()
        .unwrap_or(Duration::from_millis(250))
        .max(Duration::from_millis(1));
        let mut events = Events::with_capacity(1024);
        let mut ready: Vec<(Token, bool, bool)> = Vec::with_capacity(1024);
        let mut next_timers = Instant::now() + tick;
        while !self.shared.shutdown.load(Ordering::Acquire) {
            let busy = self.connected.iter().any(|&p| self.more_to_read(p));
            let napped = !busy && !self.moved && self.may_nap();
            self.moved = false;
            if napped {
                self.shared.quiet.nap(&self.shared.woken, tick);
            }
            let timeout = if busy || napped { Duration::ZERO } else { tick };
            if let Err(e) = self.poll.poll(&mut events, Some(timeout)) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                log::error!("fairring tcp: epoll failed, stopping the fabric: {e}");
                break;
            }
            ready.clear();
            ready.extend(events.iter().map(|e| {
                let readable = e.is_readable() || e.is_read_closed() || e.is_error();
                let writable = e.is_writable() || e.is_write_closed();
                (e.token(), readable, writable)
            }));
            for &(token, readable, writable) in &ready {
                self.dispatch(token, readable, writable);
            }
            if napped {
                // What spinners or posters left unsent: a thread that stopped at
                // its byte limit while the loop napped woke nobody (its store of
                // `unsent` and its look at `napping`, against the loop's store of
                // `napping` and its look at `unsent` here, are Dekker's).
                let peers = self.visit_connected();
                for &peer in &peers {
                    if self.shared.peers[peer as usize]
                        .unsent
                        .load(Ordering::SeqCst)
                    {
                        self.write(peer);
                    }
                }
                self.visiting = peers;
            }
            if self.shared.woken.swap(false, Ordering::AcqRel) {
                self.moved = true;
                self.adopt_dialed();
                let peers = self.visit_connected();
                for &peer in &peers {
                    self.write(peer);
                }
                self.visiting = peers;
                if self.any_failed {
                    self.drain_failed();
                }
            }
            if busy {
                let peers = self.visit_connected();
                for &peer in &peers {
                    if self.more_to_read(peer) {
                        self.read(peer);
                    }
                }
                self.visiting = peers;
            }
            let now = Instant::now();
            if now >= next_timers {
                self.timers(now);
                next_timers = now + tick;
            }
        }
        self.linger();
    }

    /// Before the sockets close, waits until each peer's kernel has
    /// acknowledged every byte written to it, or the peer closed its end, for
    /// at most [`LINGER`] in all; what the peer sends meanwhile is dropped.
    ///
    /// A socket closed while bytes from its peer wait unread in it is reset,
    /// and a reset throws away whatever this side had not sent yet. A peer that
    /// still sends while this one closes (a credit, a keepalive, a goodbye of
    /// its own) would then lose the end of what this one wrote, goodbye
    /// included, and fail on a connection closed mid-frame. Once the peer's
    /// kernel holds those bytes a reset no longer takes them: the peer reads
    /// them first, then the reset.
    fn linger(&self) {
        let deadline = Instant::now() + LINGER;
        for &peer in &self.connected {
            while Instant::now() < deadline {
                let waiting = self.shared.lock_link(peer).as_ref().is_some_and(|link| {
                    discard_incoming(&link.stream)
                        && unacknowledged(&link.stream).is_some_and(|n| n > 0)
                });
                if !waiting {
                    break;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Whether the loop may nap instead of waiting on the sockets: threads read
    /// inline, and the loop has nothing of its own to do (see `quiet`). Frames
    /// half written do not keep it awake: spinners carry them on, and the nap's
    /// end writes what they leave.
    fn may_nap(&self) -> bool {
        self.shared.quiet.someone_spins()
            && self.pending.iter().all(Option::is_none)
            && !self.shared.woken.load(Ordering::SeqCst)
            && self.connected.iter().all(|&p| {
                self.shared
                    .lock_link(p)
                    .as_ref()
                    .is_none_or(|l| !l.more_to_read)
            })
    }

    /// Whether `peer`'s socket may hold bytes nobody has read.
    fn more_to_read(&self, peer: u32) -> bool {
        self.shared
            .lock_link(peer)
            .as_ref()
            .is_some_and(|l| l.more_to_read)
    }

    /// The connected peers, copied into the scratch list (give it back to
    /// `self.visiting` after use, so no turn allocates).
    fn visit_connected(&mut self) -> Vec<u32> {
        let mut peers = std::mem::take(&mut self.visiting);
        peers.clear();
        peers.extend_from_slice(&self.connected);
        peers
    }

    fn dispatch(&mut self, token: Token, readable: bool, writable: bool) {
        match token {
            WAKER => {}
            LISTENER => self.accept(),
            Token(t) if t >= 2 && t < 2 + self.pending.len() => self.drive_pending(t - 2),
            Token(t) => {
                let Ok(peer) = u32::try_from(t - 2 - self.pending.len()) else {
                    return;
                };
                if readable {
                    self.read(peer);
                }
                if writable {
                    self.write(peer);
                }
            }
        }
    }

    /// Runs `f` on `peer`'s link once its held completions are queued; `None` if
    /// the connection is gone.
    fn with_link<T>(&self, peer: u32, f: impl FnOnce(&mut Link) -> T) -> Option<T> {
        let mut guard = self.shared.lock_link(peer);
        let link = guard.as_mut()?;
        link.release_held(&self.shared);
        Some(f(link))
    }

    fn read(&mut self, peer: u32) {
        let shared = &*self.shared;
        let outcome = self.with_link(peer, |link| match link.broken {
            Some(Broken::Read(failure)) => Err(failure),
            // Settled by `write`, which reads what is left first.
            Some(Broken::Write(_)) => Ok(0),
            None => link.read(shared, peer, READ_BUDGET, Queueing::Wait),
        });
        match outcome {
            Some(Err(failure)) => self.fail(peer, failure),
            Some(Ok(bytes)) if bytes >= STREAMING_BYTES => self.moved = true,
            _ => {}
        }
    }

    fn write(&mut self, peer: u32) {
        let shared = &*self.shared;
        let Some(outcome) = self.with_link(peer, |link| match link.broken {
            Some(Broken::Read(failure)) => Err((failure, false)),
            Some(Broken::Write(failure)) => Err((failure, true)),
            None => link
                .flush(shared, peer, usize::MAX, Queueing::Wait)
                .map(|_| ())
                .map_err(|e| (write_failure(&e), true)),
        }) else {
            return;
        };
        match outcome {
            Ok(()) => {}
            Err((failure, false)) => self.fail(peer, failure),
            Err((failure, true)) => {
                // What the peer sent before it closed may still wait in the socket
                // (its last message, often a goodbye): deliver it before the
                // failure, so completions keep the order in which the peer acted.
                loop {
                    // The write failure is settled here: let `read` read again.
                    self.with_link(peer, |link| link.broken = None);
                    self.read(peer);
                    if !self.more_to_read(peer) {
                        break;
                    }
                }
                self.fail(peer, failure);
            }
        }
    }

    /// Ends a peer: its socket closes, everything queued to it fails, and one
    /// `PeerFailed` completion reports it.
    fn fail(&mut self, peer: u32, failure: PeerFailure) {
        let slot = &self.shared.peers[peer as usize];
        if slot.state.load(Ordering::Acquire) == FAILED {
            return;
        }
        *slot.failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(failure);
        slot.state.store(FAILED, Ordering::Release);
        self.any_failed = true;
        let shared = &*self.shared;
        self.connected.retain(|&p| p != peer);
        self.conns[peer as usize] = None;
        // Before the socket closes, so no inline reader polls a reused descriptor.
        shared.unwatch(peer);
        let link = shared.lock_link(peer).take();
        if let Some(mut link) = link {
            link.release_held(shared);
            let _ = self.poll.registry().deregister(&mut link.stream);
            if let Some(queue) = slot.queue.get() {
                link.sender.fail_all(queue, |token| {
                    shared.complete(peer, CompletionEvent::SendFailed { token, failure });
                });
            }
        }
        log::warn!(
            "fairring tcp rank {}: rank {peer} failed: {failure}",
            shared.config.rank
        );
        shared.complete(peer, CompletionEvent::PeerFailed { failure });
        shared.notify_status();
    }

    /// Fails frames posted to failed peers after they failed.
    fn drain_failed(&mut self) {
        let shared = &*self.shared;
        for (peer, slot) in (0..shared.config.world_size).zip(&shared.peers) {
            if slot.state.load(Ordering::Acquire) != FAILED {
                continue;
            }
            let failure = shared.failure_of(peer);
            if let Some(queue) = slot.queue.get() {
                while let Some(op) = queue.pop() {
                    let token = op.token;
                    drop(op);
                    shared.complete(peer, CompletionEvent::SendFailed { token, failure });
                }
            }
        }
    }

    fn timers(&mut self, now: Instant) {
        for slot in 0..self.pending.len() {
            if self.pending[slot]
                .as_ref()
                .is_some_and(|p| now >= p.deadline)
            {
                self.refuse(slot, Refusal::Deadline.into());
            }
        }
        let silence = self.shared.config.silence_timeout;
        let keepalive = self.shared.config.keepalive_interval;
        let peers = self.visit_connected();
        for &peer in &peers {
            let Some(conn) = self.conns[peer as usize].as_mut() else {
                continue;
            };
            let due = now.duration_since(conn.last_keepalive) >= keepalive;
            if due {
                conn.last_keepalive = now;
            }
            let silent = {
                let mut guard = self.shared.lock_link(peer);
                let Some(link) = guard.as_mut() else {
                    continue;
                };
                let silent = now.saturating_duration_since(link.last_rx) >= silence;
                if !silent && due {
                    link.sender.keepalive();
                }
                silent
            };
            if silent {
                let after_ms = u64::try_from(silence.as_millis()).unwrap_or(u64::MAX);
                self.fail(peer, PeerFailure::Silent { after_ms });
            } else if due {
                self.write(peer);
            }
        }
        self.visiting = peers;
    }
}
