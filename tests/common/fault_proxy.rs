//! A hostile network for tests: a TCP proxy between two ranks that forwards
//! their bytes, until, once armed, it blackholes a direction, closes or resets
//! the connection, delays, throttles, or reads slowly; and a rendezvous store
//! that routes every fabric connection of a job through a proxy of its own.
//!
//! The proxy sits on loopback: the rank that dials (the higher of the pair)
//! dials the proxy, which dials the other. Each direction is a pump of two
//! threads, a reader and a writer, with at most [`BUFFERED`] chunks between
//! them, so a slow writer holds the sender back as a slow network does.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use fairring::Store;
use fairring::rdma::fabric::Endpoint;
use fairring::rdma::tcp::TcpFabric;

/// Bytes one read of a pump takes at most.
const CHUNK: usize = 64 << 10;
/// Chunks read and not yet written, per direction.
const BUFFERED: usize = 16;

/// Which way bytes go through a proxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the rank that dialed to the rank that listened.
    ToListener,
    /// From the rank that listened to the rank that dialed.
    ToDialer,
}

/// What an armed proxy does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Reads what comes in one direction and forwards none of it; the
    /// connection stays open and the other direction flows.
    Blackhole(Direction),
    /// Closes both connections in order (FIN both ways).
    Close,
    /// Resets both connections (RST both ways), wherever in a frame the
    /// trigger falls.
    Reset,
    /// Forwards every chunk this long after it arrived, both ways.
    Delay(Duration),
    /// Forwards at most this many bytes a second, each way.
    Throttle(u64),
    /// Reads one direction in pieces of at most 4 KiB, pausing this long
    /// after each: a receiver that takes its time.
    SlowReader(Direction, Duration),
}

impl Fault {
    /// Whether the fault loses data or the connection (the job must fail),
    /// rather than slowing it (the job must succeed).
    pub fn loses(self) -> bool {
        matches!(self, Fault::Blackhole(_) | Fault::Close | Fault::Reset)
    }
}

/// A fault, and the bytes in its direction (both ways for those with none)
/// after which it strikes, counted from when it was armed.
#[derive(Clone, Copy, Debug)]
struct Armed {
    fault: Fault,
    after: u64,
}

struct Shared {
    target: SocketAddr,
    armed: Mutex<Option<Armed>>,
    /// Bytes forwarded since the fault was armed, per direction.
    forwarded: [AtomicU64; 2],
    /// Once set, everything stops.
    stop: AtomicBool,
    /// Every stream the proxy holds, to shut down when it stops.
    streams: Mutex<Vec<TcpStream>>,
    /// Connections accepted.
    accepted: AtomicU64,
}

/// A proxy listening on loopback, forwarding to one target.
pub struct FaultProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// A proxy to `target`, forwarding faithfully until armed.
    pub fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a proxy's listener");
        let address = listener.local_addr().expect("its address");
        let shared = Arc::new(Shared {
            target,
            armed: Mutex::new(None),
            forwarded: [AtomicU64::new(0), AtomicU64::new(0)],
            stop: AtomicBool::new(false),
            streams: Mutex::new(Vec::new()),
            accepted: AtomicU64::new(0),
        });
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let s = Arc::clone(&shared);
        std::thread::spawn(move || accept(&listener, &s));
        FaultProxy { address, shared }
    }

    /// Where ranks dial it.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Connections it has accepted.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Arms `fault`, to strike once `after` more bytes have gone through in
    /// its direction (either way for a fault with none).
    pub fn arm(&self, fault: Fault, after: u64) {
        for f in &self.shared.forwarded {
            f.store(0, Ordering::SeqCst);
        }
        *self.shared.armed.lock().unwrap() = Some(Armed { fault, after });
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for s in self.shared.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn accept(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((dialer, _)) => {
                let Ok(listener_side) = TcpStream::connect(shared.target) else {
                    continue;
                };
                shared.accepted.fetch_add(1, Ordering::SeqCst);
                dialer.set_nonblocking(false).expect("a blocking stream");
                for s in [&dialer, &listener_side] {
                    let _ = s.set_nodelay(true);
                }
                {
                    let mut streams = shared.streams.lock().unwrap();
                    streams.push(dialer.try_clone().expect("a clone"));
                    streams.push(listener_side.try_clone().expect("a clone"));
                }
                pump(shared, Direction::ToListener, &dialer, &listener_side);
                pump(shared, Direction::ToDialer, &listener_side, &dialer);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => return,
        }
    }
}

/// Forwards `from` to `to` in `direction`: a reader and a writer thread.
fn pump(shared: &Arc<Shared>, direction: Direction, from: &TcpStream, to: &TcpStream) {
    let (tx, rx) = sync_channel::<(Instant, Vec<u8>)>(BUFFERED);
    let (mut from, to) = (from.try_clone().unwrap(), to.try_clone().unwrap());
    let s = Arc::clone(shared);
    std::thread::spawn(move || read_side(&s, direction, &mut from, &tx));
    let s = Arc::clone(shared);
    std::thread::spawn(move || write_side(&s, direction, to, &rx));
}

fn armed(shared: &Shared) -> Option<Armed> {
    *shared.armed.lock().unwrap()
}

fn read_side(
    shared: &Shared,
    direction: Direction,
    from: &mut TcpStream,
    tx: &SyncSender<(Instant, Vec<u8>)>,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        let slow = match armed(shared) {
            Some(Armed {
                fault: Fault::SlowReader(d, pause),
                ..
            }) if d == direction => Some(pause),
            _ => None,
        };
        let most = if slow.is_some() { 4096 } else { CHUNK };
        match from.read(&mut buf[..most]) {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                    return;
                }
            }
        }
        if let Some(pause) = slow {
            std::thread::sleep(pause);
        }
    }
}

fn write_side(
    shared: &Shared,
    direction: Direction,
    mut to: TcpStream,
    rx: &Receiver<(Instant, Vec<u8>)>,
) {
    let index = direction as usize;
    let mut throttled_since: Option<(Instant, u64)> = None;
    while let Ok((arrived, bytes)) = rx.recv() {
        let mut bytes = &bytes[..];
        if let Some(Armed { fault, after }) = armed(shared) {
            let done = shared.forwarded[index].load(Ordering::SeqCst);
            let strikes_here = match fault {
                Fault::Blackhole(d) | Fault::SlowReader(d, _) => d == direction,
                _ => true,
            };
            // The bytes before the trigger go through as they are.
            let before = if strikes_here {
                usize::try_from(after.saturating_sub(done)).unwrap_or(usize::MAX)
            } else {
                usize::MAX
            };
            if before < bytes.len() {
                let (head, _) = bytes.split_at(before);
                if to.write_all(head).is_err() {
                    return;
                }
                shared.forwarded[index].fetch_add(head.len() as u64, Ordering::SeqCst);
                bytes = &bytes[before..];
            }
            let struck = strikes_here && shared.forwarded[index].load(Ordering::SeqCst) >= after;
            match fault {
                Fault::Blackhole(_) if struck => continue,
                Fault::Close if struck => {
                    stop_all(shared, false);
                    return;
                }
                Fault::Reset if struck => {
                    stop_all(shared, true);
                    return;
                }
                Fault::Delay(d) if struck => {
                    let due = arrived + d;
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                }
                Fault::Throttle(rate) if struck => {
                    let (since, sent) = *throttled_since.get_or_insert((Instant::now(), 0));
                    #[expect(clippy::cast_precision_loss, reason = "test sizes")]
                    let due = since + Duration::from_secs_f64(sent as f64 / rate as f64);
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep(due - now);
                    }
                    throttled_since = Some((since, sent + bytes.len() as u64));
                }
                _ => {}
            }
        }
        if to.write_all(bytes).is_err() {
            return;
        }
        shared.forwarded[index].fetch_add(bytes.len() as u64, Ordering::SeqCst);
    }
    // The source closed: pass the close on, unless the proxy stopped (a
    // reset must not be preceded by a close).
    if !shared.stop.load(Ordering::SeqCst) {
        let _ = to.shutdown(Shutdown::Write);
    }
}

/// Ends every connection of the proxy: closes them, or resets them (a zero
/// linger makes `close` send RST).
fn stop_all(shared: &Shared, reset: bool) {
    shared.stop.store(true, Ordering::SeqCst);
    let streams: Vec<TcpStream> = shared.streams.lock().unwrap().drain(..).collect();
    for s in &streams {
        if reset {
            let linger = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            // SAFETY: a valid socket descriptor, owned by `s` for the call, and
            // a `linger` of the size given.
            let rc = unsafe {
                libc::setsockopt(
                    s.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    std::ptr::from_ref(&linger).cast(),
                    libc::socklen_t::try_from(std::mem::size_of::<libc::linger>()).unwrap(),
                )
            };
            assert_eq!(rc, 0, "SO_LINGER");
        } else {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
    // Closing every descriptor of a socket (the pumps' clones end as their
    // reads and writes fail) sends the reset.
    for s in &streams {
        let _ = s.shutdown(Shutdown::Read);
    }
    drop(streams);
}

/// A rendezvous store in this process that routes every tcp fabric
/// connection of a job through a [`FaultProxy`] of its own: the endpoint a
/// connection is dialed at (`.../ep/A/B`, `.../late-link/A/B`, published by
/// the lower rank `A`) is read back as the proxy's.
#[derive(Default)]
pub struct ProxiedStore {
    table: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// The proxy of each pair of ranks (lower rank first).
    proxies: Mutex<HashMap<(u32, u32), Arc<FaultProxy>>>,
    proxy_added: Condvar,
}

impl ProxiedStore {
    pub fn new() -> Arc<ProxiedStore> {
        Arc::new(ProxiedStore::default())
    }

    /// The proxy between ranks `a` and `b`, once either has published an
    /// endpoint for the other; waits up to `within`.
    pub fn proxy(&self, a: u32, b: u32, within: Duration) -> Arc<FaultProxy> {
        let pair = (a.min(b), a.max(b));
        let deadline = Instant::now() + within;
        let mut proxies = self.proxies.lock().unwrap();
        loop {
            if let Some(p) = proxies.get(&pair) {
                return Arc::clone(p);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no connection between ranks {a} and {b}");
            proxies = self.proxy_added.wait_timeout(proxies, left).unwrap().0;
        }
    }

    /// The value to keep for `key`: an endpoint replaced by its proxy's.
    fn route(&self, key: &str, value: &[u8]) -> Vec<u8> {
        let mut parts = key.rsplit('/');
        let (Some(b), Some(a), Some(kind)) = (parts.next(), parts.next(), parts.next()) else {
            return value.to_vec();
        };
        let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) else {
            return value.to_vec();
        };
        // The lower rank of a pair listens: only its endpoint is dialed.
        if (kind != "ep" && kind != "late-link") || a > b {
            return value.to_vec();
        }
        let Some(target) = Endpoint::from_bytes(value).and_then(|e| TcpFabric::address_of(&e))
        else {
            return value.to_vec();
        };
        let proxy = Arc::new(FaultProxy::start(target));
        let routed = TcpFabric::endpoint_of(proxy.address());
        self.proxies.lock().unwrap().insert((a, b), proxy);
        self.proxy_added.notify_all();
        routed.as_bytes().to_vec()
    }
}

impl Store for ProxiedStore {
    fn set(&self, key: &str, value: &[u8]) -> fairring::Result<()> {
        let value = self.route(key, value);
        self.table.lock().unwrap().insert(key.to_owned(), value);
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> fairring::Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut table = self.table.lock().unwrap();
        loop {
            if let Some(v) = table.get(key) {
                return Ok(v.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(fairring::Error::Timeout {
                    what: format!("rendezvous key {key}"),
                    after: timeout,
                });
            }
            table = self.changed.wait_timeout(table, left).unwrap().0;
        }
    }

    fn check(&self, keys: &[&str]) -> fairring::Result<bool> {
        let table = self.table.lock().unwrap();
        Ok(keys.iter().all(|k| table.contains_key(*k)))
    }
}
