//! The tcp provider: real sockets, on loopback or across machines.
//!
//! - **One connection per peer**, dialed by the higher rank of the pair, admitted
//!   by the lower only after the mutual HMAC-SHA256 handshake of [`protocol`].
//! - **Frames** are a core [`wire`](fairring_core::wire) header (48 bytes,
//!   checksummed) plus payload: `Write` frames carry a region address, `Message`
//!   frames a control message, `Keepalive` frames nothing.
//! - **Receiving** checks each header against the target region before a payload
//!   byte is read, then reads the payload from the socket straight into the
//!   region. A peer that names an unknown region or a range outside one is
//!   dropped (and reported), and nothing is written.
//! - **One I/O thread** (epoll, through mio) serves every peer and the listener.
//!   Writes go out with vectored sends from registered memory, without a copy.
//! - **Inline I/O** (`link`): a posting thread writes its frame itself when no
//!   other thread uses the connection, and a caller about to spin for completions
//!   ([`Fabric::progress`]) reads what has arrived and writes what is left to
//!   write, so a small write's hop costs no thread wake-up, and while a thread
//!   spins the I/O thread naps and a large transfer takes no core of its own;
//!   the I/O thread takes whatever they leave. Inside a
//!   batch ([`Fabric::begin_batch`], `batch`) a thread's frames wait for its end,
//!   and then leave in one vectored write per peer. A write offers at most
//!   256 KiB (`sender`), so that what the peer sends meanwhile is taken
//!   between writes.
//! - **Listening** happens on one chosen address ([`BindTo`]), never on all
//!   interfaces.
//! - **Failure**: a closed or reset connection fails its peer at once; a peer from
//!   which nothing arrives (idle connections carry a keep-alive every
//!   `keepalive_interval`) fails after `silence_timeout`. Either way every frame
//!   still queued to it completes with `SendFailed` and one `PeerFailed` follows.
//! - **Shutdown**: dropping the fabric stops and joins the I/O thread and closes
//!   every socket.

mod batch;
mod config;
mod event_loop;
mod handshake;
mod interface;
mod link;
mod quiet;
mod receiver;
mod regions;
mod sender;
mod socket;

use crate::sync::unmodelled::{AtomicBool, AtomicU8, Ordering};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use fairring_core::wire::{FrameHeader, FrameKind, MAX_MESSAGE_PAYLOAD, RegionAddress};

pub use config::{BindTo, SOCKET_IFNAME_VAR, TcpConfig};
pub use event_loop::RefusalRecord;
pub use interface::host_address;
pub use regions::TcpRegion;

use self::event_loop::{ADMITTED, EventLoop, FAILED, NOT_CONNECTED, PeerSlot, Shared};
use self::handshake::{Dialer, DialerStep, HandshakeParams, HelloReader};
use self::link::Readable;
use self::regions::RegionTable;
use self::sender::{Payload, SendOp};
use self::socket::NoSigPipe;
use crate::fabric::{
    Completion, CompletionNotifier, CompletionQueue, Endpoint, Fabric, FabricError, WriteRequest,
};

/// The provider's wire protocol as sans-IO state machines: public so that it can be
/// fuzzed, tested byte by byte, and implemented elsewhere. Users want
/// [`TcpFabric`].
pub mod protocol {
    pub use super::handshake::{
        Acceptor, AcceptorStep, Dialer, DialerStep, Failure, HandshakeParams, HelloReader,
        MAX_HANDSHAKE_PAYLOAD, OutFrame, refusal_frame, welcome_frame,
    };
    pub use super::receiver::{Received, Receiver};
    pub use super::regions::RegionTable;
}

/// The tcp provider of [`Fabric`].
pub struct TcpFabric {
    shared: Arc<Shared>,
    local: SocketAddr,
    io_thread: Option<JoinHandle<()>>,
}

impl TcpFabric {
    /// Validates `config`, binds the listener and starts the I/O thread.
    pub fn new(config: TcpConfig) -> Result<TcpFabric, FabricError> {
        config.validate()?;
        let address = config.bind.resolve()?;
        let listener = mio::net::TcpListener::bind(address)
            .map_err(|e| FabricError::io(format!("listening on {address}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| FabricError::io("reading the listening address", e))?;
        let poll =
            mio::Poll::new().map_err(|e| FabricError::io("creating an epoll instance", e))?;
        let waker = mio::Waker::new(poll.registry(), mio::Token(0))
            .map_err(|e| FabricError::io("creating an eventfd", e))?;
        let params = HandshakeParams {
            job_tag: config.job_tag,
            epoch: config.epoch,
            world_size: config.world_size,
            rank: config.rank,
            secret: config.secret.clone(),
        };
        let peers = (0..config.world_size)
            .map(|_| PeerSlot {
                state: AtomicU8::new(NOT_CONNECTED),
                failure: Mutex::new(None),
                queue: OnceLock::new(),
                link: Mutex::new(None),
                unsent: AtomicBool::new(false),
            })
            .collect();
        let shared = Arc::new(Shared {
            cq: CompletionQueue::new(config.completion_capacity),
            config,
            params,
            peers,
            regions: Arc::new(protocol::RegionTable::new()),
            waker,
            woken: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            handoff: Mutex::new(Vec::new()),
            status: Mutex::new(()),
            status_changed: Condvar::new(),
            refusals: Mutex::new(Default::default()),
            readable: Mutex::new(Readable::default()),
            quiet: quiet::Quiet::new(),
        });
        let event_loop = EventLoop::new(Arc::clone(&shared), poll, listener)
            .map_err(|e| FabricError::io("watching the listener", e))?;
        let io_thread = std::thread::Builder::new()
            .name(format!("fairring-tcp-{}", shared.config.rank))
            .spawn(move || event_loop.run())
            .map_err(|e| FabricError::io("starting the I/O thread", e))?;
        Ok(TcpFabric {
            shared,
            local,
            io_thread: Some(io_thread),
        })
    }

    /// The address this fabric listens on.
    pub fn local_address(&self) -> SocketAddr {
        self.local
    }

    /// The most recent refused connections (up to 256), oldest first.
    pub fn refusals(&self) -> Vec<RefusalRecord> {
        self.shared
            .refusals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .copied()
            .collect()
    }

    /// Whether `peer` is admitted and has not failed.
    pub fn is_connected(&self, peer: u32) -> bool {
        self.shared
            .peers
            .get(peer as usize)
            .is_some_and(|p| p.state.load(Ordering::Acquire) == ADMITTED)
    }

    /// The endpoint of a tcp fabric listening on `address`: a family byte (4 or 6),
    /// the IP address, and the port (little-endian).
    pub fn endpoint_of(address: SocketAddr) -> Endpoint {
        let port = address.port().to_le_bytes();
        let bytes: Vec<u8> = match address.ip() {
            IpAddr::V4(ip) => [&[4][..], &ip.octets(), &port].concat(),
            IpAddr::V6(ip) => [&[6][..], &ip.octets(), &port].concat(),
        };
        Endpoint::from_bytes(&bytes).expect("19 bytes at most")
    }

    /// The address in an endpoint made by [`TcpFabric::endpoint_of`].
    pub fn address_of(endpoint: &Endpoint) -> Option<SocketAddr> {
        let b = endpoint.as_bytes();
        let port = |at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        match (b.first(), b.len()) {
            (Some(4), 7) => Some(SocketAddr::new(
                IpAddr::V4(Ipv4Addr::new(b[1], b[2], b[3], b[4])),
                port(5),
            )),
            (Some(6), 19) => {
                let mut ip = [0; 16];
                ip.copy_from_slice(&b[1..17]);
                Some(SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port(17)))
            }
            _ => None,
        }
    }

    fn check_peer(&self, peer: u32, argument: &'static str) -> Result<(), FabricError> {
        let config = &self.shared.config;
        if peer >= config.world_size || peer == config.rank {
            return Err(FabricError::InvalidArgument {
                argument,
                reason: format!(
                    "rank {peer} is {} (this is rank {} of {})",
                    if peer == config.rank {
                        "this rank"
                    } else {
                        "outside the job"
                    },
                    config.rank,
                    config.world_size
                ),
            });
        }
        Ok(())
    }

    /// The send queue of an admitted peer.
    fn queue_of(&self, peer: u32) -> Result<&ArrayQueue<SendOp>, FabricError> {
        self.check_peer(peer, "peer")?;
        let slot = &self.shared.peers[peer as usize];
        match slot.state.load(Ordering::Acquire) {
            ADMITTED => slot.queue.get().ok_or(FabricError::NotConnected { peer }),
            FAILED => Err(FabricError::PeerFailed {
                peer,
                failure: self.shared.failure_of(peer),
            }),
            _ => Err(FabricError::NotConnected { peer }),
        }
    }

    fn post(&self, peer: u32, queue: &ArrayQueue<SendOp>, op: SendOp) -> Result<(), FabricError> {
        queue.push(op).map_err(|_| FabricError::QueueFull {
            peer,
            depth: self.shared.config.send_queue_depth,
        })?;
        if !batch::hold(&self.shared, peer) && self.shared.send_inline(peer) {
            self.shared.wake();
        }
        Ok(())
    }

    /// `Ok` once `peer` is admitted, its failure once it has failed, `None` before.
    fn settled(&self, peer: u32) -> Option<Result<(), FabricError>> {
        match self.shared.peers[peer as usize]
            .state
            .load(Ordering::Acquire)
        {
            ADMITTED => Some(Ok(())),
            FAILED => Some(Err(FabricError::PeerFailed {
                peer,
                failure: self.shared.failure_of(peer),
            })),
            _ => None,
        }
    }

    /// Waits until `peer` dials in and is admitted.
    fn await_dialer(&self, peer: u32) -> Result<(), FabricError> {
        let timeout = self.shared.config.connect_timeout;
        let deadline = Instant::now() + timeout;
        let mut guard = self
            .shared
            .status
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(settled) = self.settled(peer) {
                return settled;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(FabricError::Timeout {
                    what: "the peer to dial in and be admitted",
                    peer: Some(peer),
                    after: timeout,
                });
            }
            guard = self
                .shared
                .status_changed
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Dials `peer` at `address`, retrying until the connect deadline, and runs
    /// the dialer's side of the handshake.
    fn dial(&self, peer: u32, address: SocketAddr) -> Result<(), FabricError> {
        let config = &self.shared.config;
        let deadline = Instant::now() + config.connect_timeout;
        let mut backoff = Duration::from_millis(10);
        let stream = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FabricError::Timeout {
                    what: "dialing the peer",
                    peer: Some(peer),
                    after: config.connect_timeout,
                });
            }
            match std::net::TcpStream::connect_timeout(&address, left.min(Duration::from_secs(5))) {
                Ok(stream) => break stream,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused
                            | std::io::ErrorKind::TimedOut
                            | std::io::ErrorKind::ConnectionReset
                            | std::io::ErrorKind::Interrupted
                    ) =>
                {
                    std::thread::sleep(backoff.min(left));
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    return Err(FabricError::io(
                        format!("dialing rank {peer} at {address}"),
                        e,
                    ));
                }
            }
        };
        let io_error = |e: std::io::Error| {
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) {
                FabricError::Refused {
                    peer: Some(peer),
                    address: Some(address),
                    refusal: crate::fabric::Refusal::Deadline,
                    by_peer: false,
                }
            } else {
                FabricError::io(format!("handshake with rank {peer} at {address}"), e)
            }
        };
        let refused = |failure: handshake::Failure| FabricError::Refused {
            peer: Some(peer),
            address: Some(address),
            refusal: failure.refusal,
            by_peer: failure.by_peer,
        };
        stream.set_nodelay(true).map_err(io_error)?;
        socket::ask_receive_buffer(&stream, config.receive_buffer);
        let handshake_deadline = Instant::now() + config.handshake_timeout;
        let mut nonce = [0; 32];
        getrandom::fill(&mut nonce).map_err(|e| {
            FabricError::io("reading the system random source", std::io::Error::other(e))
        })?;
        let (mut dialer, hello) = Dialer::start(&self.shared.params, peer, nonce);
        NoSigPipe(&stream)
            .write_all(hello.as_bytes())
            .map_err(io_error)?;
        let mut reader = HelloReader::new();
        loop {
            let left = handshake_deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io_error(std::io::ErrorKind::TimedOut.into()));
            }
            stream.set_read_timeout(Some(left)).map_err(io_error)?;
            let n = (&stream).read(reader.buffer()).map_err(io_error)?;
            if n == 0 {
                return Err(FabricError::io(
                    format!("handshake with rank {peer} at {address}"),
                    std::io::ErrorKind::UnexpectedEof.into(),
                ));
            }
            let Some((header, payload)) = reader.filled(n).map_err(|r| refused(r.into()))? else {
                continue;
            };
            match dialer.on_frame(&self.shared.params, &header, payload) {
                Ok(DialerStep::Reply(frame)) => {
                    NoSigPipe(&stream)
                        .write_all(frame.as_bytes())
                        .map_err(io_error)?;
                }
                Ok(DialerStep::Admitted) => break,
                Err(failure) => {
                    if !failure.by_peer {
                        let frame = handshake::refusal_frame(&self.shared.params, failure.refusal);
                        let _ = NoSigPipe(&stream).write_all(frame.as_bytes());
                    }
                    return Err(refused(failure));
                }
            }
        }
        stream.set_read_timeout(None).map_err(io_error)?;
        stream.set_nonblocking(true).map_err(io_error)?;
        let slot = &self.shared.peers[peer as usize];
        let _ = slot.queue.set(ArrayQueue::new(config.send_queue_depth));
        if slot
            .state
            .compare_exchange(NOT_CONNECTED, ADMITTED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(FabricError::InvalidArgument {
                argument: "peer",
                reason: format!("rank {peer} was connected twice at once"),
            });
        }
        self.shared
            .handoff
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((peer, stream));
        self.shared.wake();
        log::info!(
            "fairring tcp rank {}: admitted by rank {peer} at {address}",
            config.rank
        );
        Ok(())
    }
}

impl Fabric for TcpFabric {
    type Region = TcpRegion;

    fn rank(&self) -> u32 {
        self.shared.config.rank
    }

    fn world_size(&self) -> u32 {
        self.shared.config.world_size
    }

    fn endpoint(&self, peer: u32) -> Result<Endpoint, FabricError> {
        self.check_peer(peer, "peer")?;
        Ok(TcpFabric::endpoint_of(self.local))
    }

    fn connect(&self, peer: u32, endpoint: &Endpoint) -> Result<(), FabricError> {
        self.check_peer(peer, "peer")?;
        if let Some(settled) = self.settled(peer) {
            return settled;
        }
        if peer > self.shared.config.rank {
            return self.await_dialer(peer);
        }
        let address =
            TcpFabric::address_of(endpoint).ok_or_else(|| FabricError::InvalidArgument {
                argument: "endpoint",
                reason: format!("{endpoint:?} is not a tcp endpoint"),
            })?;
        self.dial(peer, address)
    }

    unsafe fn register(&self, memory: NonNull<u8>, len: usize) -> Result<TcpRegion, FabricError> {
        // SAFETY: the caller upholds `Fabric::register`'s contract, which is the
        // table's.
        unsafe { self.shared.regions.register(memory, len) }
    }

    /// A source region is a handle to memory: registering one takes no system
    /// call and pins nothing.
    fn registers_sources(&self) -> bool {
        true
    }

    unsafe fn register_source(
        &self,
        memory: NonNull<u8>,
        len: usize,
    ) -> Result<TcpRegion, FabricError> {
        // SAFETY: the caller upholds `Fabric::register_source`'s contract,
        // which is the table's.
        unsafe { self.shared.regions.register_source(memory, len) }
    }

    /// A window is a table entry too, closed to peers until opened.
    fn registers_windows(&self) -> bool {
        true
    }

    fn register_window(&self, memory: NonNull<u8>, len: usize) -> Result<TcpRegion, FabricError> {
        self.shared.regions.register_window(memory, len)
    }

    unsafe fn open_window(&self, window: &TcpRegion) -> Result<(), FabricError> {
        // SAFETY: the caller upholds `Fabric::open_window`'s contract, which
        // is the table's.
        unsafe { RegionTable::open(window) }
    }

    fn close_window(&self, window: &TcpRegion) {
        RegionTable::close(window);
    }

    fn write(&self, peer: u32, request: WriteRequest<'_, TcpRegion>) -> Result<(), FabricError> {
        let queue = self.queue_of(peer)?;
        let end = request.check()?;
        let len = request.len;
        let header = FrameHeader::for_region(
            FrameKind::Write,
            self.shared.config.job_tag,
            self.shared.config.rank,
            RegionAddress {
                region: request.target.key,
                offset: request.target_offset,
                immediate: request.immediate,
            },
            u32::try_from(len).unwrap_or(u32::MAX),
        )
        .map_err(|e| FabricError::InvalidArgument {
            argument: "len",
            reason: e.to_string(),
        })?;
        let op = SendOp {
            token: request.token,
            header: header.encode(),
            payload: Payload::Region {
                source: request.source.use_for_send()?,
                start: request.source_offset,
                end,
            },
        };
        self.post(peer, queue, op)
    }

    fn send_message(
        &self,
        peer: u32,
        immediate: u32,
        payload: &[u8],
        token: u64,
    ) -> Result<(), FabricError> {
        let queue = self.queue_of(peer)?;
        crate::fabric::check_message(payload)?;
        let header = FrameHeader::for_region(
            FrameKind::Message,
            self.shared.config.job_tag,
            self.shared.config.rank,
            RegionAddress {
                region: 0,
                offset: 0,
                immediate,
            },
            u32::try_from(payload.len()).unwrap_or(u32::MAX),
        )
        .map_err(|e| FabricError::InvalidArgument {
            argument: "payload",
            reason: e.to_string(),
        })?;
        let mut bytes = [0; MAX_MESSAGE_PAYLOAD as usize];
        bytes[..payload.len()].copy_from_slice(payload);
        let op = SendOp {
            token,
            header: header.encode(),
            payload: Payload::Inline {
                bytes,
                len: payload.len(),
            },
        };
        self.post(peer, queue, op)
    }

    fn poll(&self, out: &mut [Completion]) -> usize {
        self.shared.cq.poll(out)
    }

    fn wait(&self, out: &mut [Completion], timeout: Duration) -> usize {
        self.shared.cq.wait(out, timeout)
    }

    fn notify_completions(&self, notify: CompletionNotifier) -> bool {
        self.shared.cq.set_notifier(notify)
    }

    fn progress(&self) -> bool {
        self.shared.progress_inline()
    }

    fn spin_ends(&self) {
        self.shared.quiet.spin_ends();
    }

    fn spinner_leaves(&self) {
        self.shared.spinner_leaves();
    }

    fn begin_batch(&self) {
        batch::begin(&self.shared);
    }

    fn end_batch(&self) {
        let mut wake = false;
        batch::end(&self.shared, |peer| wake |= self.shared.send_inline(peer));
        if wake {
            self.shared.wake();
        }
    }
}

impl Drop for TcpFabric {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.wake();
        if let Some(thread) = self.io_thread.take()
            && thread.join().is_err()
        {
            log::error!("fairring tcp: the I/O thread panicked");
        }
    }
}

impl core::fmt::Debug for TcpFabric {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("TcpFabric")
            .field("rank", &self.shared.config.rank)
            .field("world_size", &self.shared.config.world_size)
            .field("listening", &self.local)
            .finish()
    }
}
