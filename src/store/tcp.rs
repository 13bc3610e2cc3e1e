//! The default store: a server thread on rank 0, a client on every rank.

use crate::sync::unmodelled::{AtomicBool, AtomicUsize, Ordering};
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fairring_rdma::JobSecret;

use super::Store;
use super::protocol::{self as p, Mac, Request};
use crate::error::{Error, Result};

/// How long a connection may take to prove itself.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most bytes the server keeps (keys and values together).
const MAX_STORED_BYTES: usize = 256 << 20;

struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    bytes: AtomicUsize,
}

struct ServerShared {
    secret: JobSecret,
    job_tag: u64,
    table: Table,
    shutdown: AtomicBool,
    /// Open connections by id, to be shut down when the server stops.
    connections: Mutex<HashMap<u64, TcpStream>>,
    max_connections: usize,
    /// Set once the rank serving the store has failed: its rank and error.
    failure: Mutex<Option<(u32, String)>>,
}

/// The server side: a thread that accepts admitted clients and answers them.
/// Dropping it stops the server and closes every connection.
pub struct TcpStoreServer {
    address: SocketAddr,
    shared: Arc<ServerShared>,
    acceptor: Option<JoinHandle<()>>,
    workers: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl TcpStoreServer {
    /// Listens on `address` for the job of `secret` and `job_tag`, serving at most
    /// `max_connections` clients at once.
    pub fn bind(
        address: SocketAddr,
        secret: JobSecret,
        job_tag: u64,
        max_connections: usize,
    ) -> Result<TcpStoreServer> {
        Self::bind_with_starter(address, secret, job_tag, max_connections, start_worker)
    }

    /// [`TcpStoreServer::bind`], each connection served by what `start` starts.
    fn bind_with_starter(
        address: SocketAddr,
        secret: JobSecret,
        job_tag: u64,
        max_connections: usize,
        start: StartWorker,
    ) -> Result<TcpStoreServer> {
        let listener = TcpListener::bind(address)
            .map_err(|e| Error::io(format!("binding the rendezvous store to {address}"), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("configuring the store listener", e))?;
        let address = listener
            .local_addr()
            .map_err(|e| Error::io("reading the store's address", e))?;
        let shared = Arc::new(ServerShared {
            secret,
            job_tag,
            table: Table {
                map: Mutex::new(HashMap::new()),
                changed: Condvar::new(),
                bytes: AtomicUsize::new(0),
            },
            shutdown: AtomicBool::new(false),
            connections: Mutex::new(HashMap::new()),
            max_connections,
            failure: Mutex::new(None),
        });
        let workers = Arc::new(Mutex::new(Vec::new()));
        let acceptor = {
            let shared = Arc::clone(&shared);
            let workers = Arc::clone(&workers);
            std::thread::Builder::new()
                .name("fairring-store".into())
                .spawn(move || accept_loop(&listener, &shared, &workers, start))
                .map_err(|e| Error::io("starting the store thread", e))?
        };
        Ok(TcpStoreServer {
            address,
            shared,
            acceptor: Some(acceptor),
            workers,
        })
    }

    /// The address the server listens on.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Stops the server after `rank`, which serves it, failed with `reason`.
    ///
    /// Keys already set are still answered, so a peer that reads what it
    /// needs can reach its own verdict (every rank finds the same
    /// configuration error, say). A request for an absent key, which could
    /// only wait, is answered with `rank`'s failure and its connection
    /// closed; the client reports it as [`Error::Peer`], and so every later
    /// call on that client. Returns once every
    /// client has closed its connection or been answered so, or after
    /// `linger`, whichever comes first. The caller closes its own client
    /// first.
    pub fn close_failed(self, rank: u32, reason: &str, linger: Duration) {
        let mut reason = reason.to_string();
        if reason.len() > p::MAX_REASON_LEN {
            let mut cut = p::MAX_REASON_LEN;
            while !reason.is_char_boundary(cut) {
                cut -= 1;
            }
            reason.truncate(cut);
        }
        *lock(&self.shared.failure) = Some((rank, reason));
        // A waiter checks the failure under the table's lock and waits on it:
        // taking the lock here orders this notice after any check it missed.
        drop(lock(&self.shared.table.map));
        self.shared.table.changed.notify_all();
        let deadline = Instant::now() + linger;
        while !lock(&self.shared.connections).is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        self.shared.table.changed.notify_all();
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
        for (_, c) in lock(&self.shared.connections).drain() {
            let _ = c.shutdown(Shutdown::Both);
        }
        self.shared.table.changed.notify_all();
        for t in lock(&self.workers).drain(..) {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Starts the thread that serves one connection (a seam: a test's may fail).
type StartWorker = fn(Box<dyn FnOnce() + Send>) -> io::Result<JoinHandle<()>>;

fn start_worker(work: Box<dyn FnOnce() + Send>) -> io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("fairring-store-conn".into())
        .spawn(work)
}

fn accept_loop(
    listener: &TcpListener,
    shared: &Arc<ServerShared>,
    workers: &Arc<Mutex<Vec<JoinHandle<()>>>>,
    start: StartWorker,
) {
    let mut next_id = 0u64;
    // Clients connect again to a store that closed them, and a failing
    // accept fails again: one warning a second says so, not one a try.
    let mut quiet_until = Instant::now();
    let mut warn_throttled = |why: std::fmt::Arguments<'_>| {
        let now = Instant::now();
        if now >= quiet_until {
            quiet_until = now + Duration::from_secs(1);
            log::warn!("fairring store: {why}");
        }
    };
    while !shared.shutdown.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let mut conns = lock(&shared.connections);
                if conns.len() >= shared.max_connections {
                    warn_throttled(format_args!(
                        "closed {peer}: {} connections already open",
                        conns.len()
                    ));
                    continue;
                }
                let Ok(clone) = stream.try_clone() else {
                    continue;
                };
                let id = next_id;
                next_id += 1;
                conns.insert(id, clone);
                drop(conns);
                let worker_shared = Arc::clone(shared);
                let work = Box::new(move || {
                    if let Err(e) = serve(stream, &worker_shared)
                        && !worker_shared.shutdown.load(Ordering::Acquire)
                        && e.kind() != io::ErrorKind::UnexpectedEof
                    {
                        log::warn!("fairring store: connection from {peer} closed: {e}");
                    }
                    lock(&worker_shared.connections).remove(&id);
                });
                match start(work) {
                    Ok(t) => {
                        let mut w = lock(workers);
                        w.retain(|t| !t.is_finished());
                        w.push(t);
                    }
                    Err(e) => {
                        // The work (and its stream) is gone: closing the
                        // copy kept for shutdown too tells the client at
                        // once, which connects again, instead of leaving it
                        // waiting for an answer that cannot come.
                        lock(&shared.connections).remove(&id);
                        warn_throttled(format_args!("closed {peer}: no thread to serve it: {e}"));
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => {
                warn_throttled(format_args!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn admit(stream: &mut TcpStream, shared: &ServerShared) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT))?;
    let mut greeting = [0; 5];
    stream.read_exact(&mut greeting)?;
    if &greeting[..4] != p::MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a fairring store client (bad magic)",
        ));
    }
    if greeting[4] != p::VERSION {
        let _ = stream.write_all(&p::version_refusal());
        // Closing with the rest of its greeting unread would reset the
        // connection, which may drop the answer before the client reads it:
        // that greeting is read and dropped until the client closes.
        let _ = stream.shutdown(Shutdown::Write);
        let _ = io::copy(&mut (&*stream).take(4096), &mut io::sink());
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "a client of store protocol version {}, not {}",
                greeting[4],
                p::VERSION
            ),
        ));
    }
    let mut cn = [0; p::NONCE_LEN];
    stream.read_exact(&mut cn)?;
    let mut sn = [0; p::NONCE_LEN];
    getrandom::fill(&mut sn).map_err(io::Error::other)?;
    let secret = shared.secret.as_bytes();
    let mine = p::proof(secret, b"server", shared.job_tag, &cn, &sn)
        .finalize()
        .into_bytes();
    let mut reply = Vec::with_capacity(p::NONCE_LEN + p::PROOF_LEN);
    reply.extend_from_slice(&sn);
    reply.extend_from_slice(&mine);
    stream.write_all(&reply)?;
    let mut theirs = [0; p::PROOF_LEN];
    stream.read_exact(&mut theirs)?;
    if p::proof(secret, b"client", shared.job_tag, &cn, &sn)
        .verify_slice(&theirs)
        .is_err()
    {
        let _ = stream.write_all(&[p::STATUS_REFUSED]);
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "client failed the job-secret proof",
        ));
    }
    stream.write_all(&[p::STATUS_OK])?;
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok(())
}

fn serve(mut stream: TcpStream, shared: &ServerShared) -> io::Result<()> {
    if let Err(e) = admit(&mut stream, shared) {
        // A client that went away before its verdict (it tries again after
        // a wait of its own) is not refused.
        if !matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
        ) {
            log::warn!("fairring store: refused {:?}: {e}", stream.peer_addr().ok());
        }
        return Ok(());
    }
    let _ = stream.set_nodelay(true);
    let table = &shared.table;
    loop {
        let request = p::read_request(&mut stream)?;
        let mut out = Vec::new();
        match request {
            Request::Set { key, value } => {
                let add = key.len() + value.len();
                if table.bytes.fetch_add(add, Ordering::AcqRel) + add > MAX_STORED_BYTES {
                    table.bytes.fetch_sub(add, Ordering::AcqRel);
                    return Err(io::Error::other("the store is full"));
                }
                let mut map = lock(&table.map);
                if let Some(old) = map.insert(key.clone(), value) {
                    table
                        .bytes
                        .fetch_sub(key.len() + old.len(), Ordering::AcqRel);
                }
                drop(map);
                table.changed.notify_all();
                out.push(p::STATUS_OK);
            }
            Request::Get { key, timeout_ms } => {
                let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
                let mut map = lock(&table.map);
                loop {
                    if let Some(v) = map.get(&key) {
                        out.push(p::STATUS_OK);
                        p::put_bytes(&mut out, v);
                        break;
                    }
                    if let Some(failed) = host_failure(shared) {
                        drop(map);
                        return stream.write_all(&failed);
                    }
                    let now = Instant::now();
                    if now >= deadline || shared.shutdown.load(Ordering::Acquire) {
                        out.push(p::STATUS_TIMEOUT);
                        break;
                    }
                    let step = (deadline - now).min(Duration::from_millis(100));
                    map = table
                        .changed
                        .wait_timeout(map, step)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
            Request::Check { key } => {
                let present = lock(&table.map).contains_key(&key);
                if !present && let Some(failed) = host_failure(shared) {
                    return stream.write_all(&failed);
                }
                out.push(p::STATUS_OK);
                out.push(u8::from(present));
            }
        }
        stream.write_all(&out)?;
    }
}

/// The answer to a request that can only wait, once the serving rank has
/// failed ([`TcpStoreServer::close_failed`]).
fn host_failure(shared: &ServerShared) -> Option<Vec<u8>> {
    let failure = lock(&shared.failure);
    let (rank, reason) = failure.as_ref()?;
    let mut out = vec![p::STATUS_HOST_FAILED];
    out.extend_from_slice(&rank.to_le_bytes());
    p::put_bytes(&mut out, reason.as_bytes());
    Some(out)
}

/// A client of a [`TcpStoreServer`].
pub struct TcpStore {
    address: SocketAddr,
    stream: Mutex<TcpStream>,
    /// The serving rank's failure, once the server answered with it (and
    /// closed the connection): every later call returns it.
    host_failed: Mutex<Option<(u32, String)>>,
}

impl TcpStore {
    /// Connects to the server at `host:port` and proves knowledge of the job
    /// secret, within `timeout`: a server not up yet is waited for, and a
    /// connection the server closes or leaves unanswered before admitting it
    /// (too busy to serve it) is made again. A server of another job,
    /// secret or protocol version is refused at once.
    pub fn connect(
        host: &str,
        port: u16,
        secret: &JobSecret,
        job_tag: u64,
        timeout: Duration,
    ) -> Result<TcpStore> {
        let address = resolve(host, port)?;
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(20);
        // Why the last connection made was not admitted, once one was not.
        let mut last_try: Option<String> = None;
        let gave_up = |last: &str| {
            Error::timeout(
                format!("admission by the rendezvous store at {address} (last try: {last})"),
                timeout,
            )
        };
        loop {
            if let Some(last) = &last_try
                && Instant::now() >= deadline
            {
                return Err(gave_up(last));
            }
            let mut stream = match connect_by(address, deadline) {
                Ok(stream) => stream,
                Err(e) => match &last_try {
                    Some(last) => {
                        return Err(gave_up(&format!(
                            "{last}; then it could not be reached: {e}"
                        )));
                    }
                    None => {
                        return Err(Error::timeout(
                            format!("the rendezvous store at {address} (last error: {e})"),
                            timeout,
                        ));
                    }
                },
            };
            let this_try = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
            let e = match handshake(&mut stream, secret, job_tag, this_try) {
                Ok(()) => {
                    let _ = stream.set_nodelay(true);
                    return Ok(TcpStore {
                        address,
                        stream: Mutex::new(stream),
                        host_failed: Mutex::new(None),
                    });
                }
                Err(e) => e,
            };
            drop(stream);
            let why = match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                    "it did not answer".to_string()
                }
                io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::ConnectionAborted
                | io::ErrorKind::BrokenPipe => format!("it closed the connection ({e})"),
                _ => {
                    return Err(Error::store(
                        "admission",
                        format!("the store at {address} did not admit this rank: {e}"),
                    ));
                }
            };
            if last_try.is_none() && Instant::now() < deadline {
                log::warn!(
                    "fairring store: {address} did not admit this rank yet ({why}); \
                     trying again until the timeout"
                );
            }
            last_try = Some(why);
            std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }

    /// The server's address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    fn call(
        &self,
        op: u8,
        key: &str,
        value: Option<&[u8]>,
        timeout: Option<Duration>,
    ) -> Result<(u8, Vec<u8>)> {
        if key.len() > super::MAX_KEY_LEN {
            return Err(Error::invalid(
                "key",
                format!(
                    "{} bytes is over the {}-byte limit",
                    key.len(),
                    super::MAX_KEY_LEN
                ),
            ));
        }
        if let Some(v) = value
            && v.len() > super::MAX_VALUE_LEN
        {
            return Err(Error::invalid(
                "value",
                format!(
                    "{} bytes is over the {}-byte limit",
                    v.len(),
                    super::MAX_VALUE_LEN
                ),
            ));
        }
        let timeout_ms = timeout.map(|t| u32::try_from(t.as_millis()).unwrap_or(u32::MAX));
        let host_failed = |rank: u32, reason: &str| {
            Error::peer(
                rank,
                format!("failed while serving the rendezvous store: {reason}"),
            )
        };
        if let Some((rank, reason)) = &*lock(&self.host_failed) {
            return Err(host_failed(*rank, reason));
        }
        let mut stream = lock(&self.stream);
        let failed =
            |e: io::Error| Error::store("request", format!("the store at {}: {e}", self.address));
        p::write_request(&mut *stream, op, key, value, timeout_ms).map_err(failed)?;
        let status = p::read_u8(&mut *stream).map_err(failed)?;
        if status == p::STATUS_HOST_FAILED {
            let rank = p::read_u32(&mut *stream).map_err(failed)?;
            let reason =
                p::read_bounded(&mut *stream, p::MAX_REASON_LEN, "reason").map_err(failed)?;
            let reason = String::from_utf8_lossy(&reason).into_owned();
            let e = host_failed(rank, &reason);
            // The server closed this connection after its answer.
            *lock(&self.host_failed) = Some((rank, reason));
            return Err(e);
        }
        let body = match (op, status) {
            (p::OP_GET, p::STATUS_OK) => {
                p::read_bounded(&mut *stream, super::MAX_VALUE_LEN, "value").map_err(failed)?
            }
            (p::OP_CHECK, p::STATUS_OK) => vec![p::read_u8(&mut *stream).map_err(failed)?],
            _ => Vec::new(),
        };
        Ok((status, body))
    }
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::config("MASTER_ADDR", host, format!("cannot be resolved: {e}")))?
        .next()
        .ok_or_else(|| Error::config("MASTER_ADDR", host, "resolves to no address"))
}

/// Connects to `address`, retrying until `timeout` while nothing listens there
/// yet; the error names `what` and the last reason.
pub(crate) fn connect_retrying(
    address: SocketAddr,
    timeout: Duration,
    what: &str,
) -> Result<TcpStream> {
    connect_by(address, Instant::now() + timeout)
        .map_err(|e| Error::timeout(format!("{what} at {address} (last error: {e})"), timeout))
}

/// Connects to `address`, trying again until `deadline` while nothing
/// listens there yet; fails with the last try's error.
fn connect_by(address: SocketAddr, deadline: Instant) -> io::Result<TcpStream> {
    let mut last: Option<io::Error> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(last.unwrap_or_else(|| io::ErrorKind::TimedOut.into()));
        }
        match TcpStream::connect_timeout(&address, left.min(Duration::from_secs(2))) {
            Ok(stream) => return Ok(stream),
            Err(e) => {
                last = Some(e);
                let left = deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(left.min(Duration::from_millis(20)));
            }
        }
    }
}

pub(crate) fn resolve_master(host: &str, port: u16) -> Result<SocketAddr> {
    resolve(host, port)
}

/// Proves this client to the server on `stream`, each read and write
/// waiting at most until `deadline` (then failing as
/// [`io::ErrorKind::WouldBlock`] or [`io::ErrorKind::TimedOut`]).
fn handshake(
    stream: &mut TcpStream,
    secret: &JobSecret,
    job_tag: u64,
    deadline: Instant,
) -> io::Result<()> {
    let mut cn = [0; p::NONCE_LEN];
    getrandom::fill(&mut cn).map_err(io::Error::other)?;
    let mut hello = Vec::with_capacity(5 + p::NONCE_LEN);
    hello.extend_from_slice(p::MAGIC);
    hello.push(p::VERSION);
    hello.extend_from_slice(&cn);
    bound_by(stream, deadline)?;
    stream.write_all(&hello)?;
    let mut reply = [0; p::NONCE_LEN + p::PROOF_LEN];
    bound_by(stream, deadline)?;
    stream.read_exact(&mut reply)?;
    if let Some(version) = p::refused_version(&reply)
        && version != p::VERSION
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "it speaks store protocol version {version}, this rank {}: the job's \
                 processes run different fairring versions",
                p::VERSION
            ),
        ));
    }
    let (sn, theirs) = reply.split_at(p::NONCE_LEN);
    p::proof(secret.as_bytes(), b"server", job_tag, &cn, sn)
        .verify_slice(theirs)
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the server failed the job-secret proof (another job, or another secret)",
            )
        })?;
    let mine = p::proof(secret.as_bytes(), b"client", job_tag, &cn, sn)
        .finalize()
        .into_bytes();
    bound_by(stream, deadline)?;
    stream.write_all(&mine)?;
    bound_by(stream, deadline)?;
    match p::read_u8(stream)? {
        p::STATUS_OK => {}
        p::STATUS_REFUSED => {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "refused: this rank failed the job-secret proof",
            ));
        }
        other => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("an unknown answer to this rank's proof ({other})"),
            ));
        }
    }
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok(())
}

/// Bounds `stream`'s reads and writes by what is left until `deadline`.
fn bound_by(stream: &TcpStream, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::ErrorKind::TimedOut.into());
    }
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(p::OP_SET, key, Some(value), None).map(drop)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let (status, body) = self.call(p::OP_GET, key, None, Some(timeout))?;
        if status == p::STATUS_OK {
            Ok(body)
        } else {
            Err(Error::timeout(format!("rendezvous key {key}"), timeout))
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        for k in keys {
            let (_, body) = self.call(p::OP_CHECK, k, None, None)?;
            if body.first() != Some(&1) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server on a free port of this host, and `N` clients it admitted.
    fn served<const N: usize>() -> (TcpStoreServer, [TcpStore; N]) {
        let secret = JobSecret::generate().unwrap();
        let server =
            TcpStoreServer::bind("127.0.0.1:0".parse().unwrap(), secret.clone(), 7, 8).unwrap();
        let port = server.address().port();
        let clients = std::array::from_fn(|_| {
            TcpStore::connect("127.0.0.1", port, &secret, 7, Duration::from_secs(5)).unwrap()
        });
        (server, clients)
    }

    /// A connection the server could start no thread for is closed, and the
    /// client connects again rather than waiting out its timeout.
    #[test]
    fn a_connection_the_server_cannot_serve_is_made_again() {
        static STARTS: AtomicUsize = AtomicUsize::new(0);
        fn first_fails(work: Box<dyn FnOnce() + Send>) -> io::Result<JoinHandle<()>> {
            if STARTS.fetch_add(1, Ordering::AcqRel) == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            start_worker(work)
        }
        let secret = JobSecret::generate().unwrap();
        let server = TcpStoreServer::bind_with_starter(
            "127.0.0.1:0".parse().unwrap(),
            secret.clone(),
            7,
            8,
            first_fails,
        )
        .unwrap();
        let port = server.address().port();
        // Shorter than a try's own wait for an answer: a connection left open
        // unserved would time the client out.
        let timeout = HANDSHAKE_TIMEOUT / 2;
        let client = TcpStore::connect("127.0.0.1", port, &secret, 7, timeout).unwrap();
        assert_eq!(STARTS.load(Ordering::Acquire), 2);
        client.set("k", b"v").unwrap();
        assert_eq!(client.get("k", timeout).unwrap(), b"v");
    }

    /// Runs `client` against a listener on a free port whose connections are
    /// each answered by `answer` and then held open, until `client` returns;
    /// returns its outcome and how many connections were accepted.
    fn against_fake_store<R>(
        answer: impl Fn(&mut TcpStream) + Sync,
        client: impl FnOnce(u16) -> R,
    ) -> (R, usize) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        listener.set_nonblocking(true).unwrap();
        /// Tells the accepting thread to end, even where `client` panics.
        struct GiveUp<'a>(&'a AtomicBool);
        impl Drop for GiveUp<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let given_up = AtomicBool::new(false);
        std::thread::scope(|s| {
            let accepting = s.spawn(|| {
                let mut held = Vec::new();
                while !given_up.load(Ordering::Acquire) {
                    match listener.accept() {
                        Ok((mut stream, _)) => {
                            stream.set_nonblocking(false).unwrap();
                            answer(&mut stream);
                            held.push(stream);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
                held.len()
            });
            let outcome = {
                let _give_up = GiveUp(&given_up);
                client(port)
            };
            (outcome, accepting.join().unwrap())
        })
    }

    /// A server that accepts and never answers fails the client within its
    /// timeout, saying so, and not after a fixed wait of its own.
    #[test]
    fn a_store_that_never_answers_fails_within_the_timeout() {
        let secret = JobSecret::generate().unwrap();
        let timeout = Duration::from_millis(600);
        let started = Instant::now();
        let (outcome, _) = against_fake_store(
            |_| {},
            |port| TcpStore::connect("127.0.0.1", port, &secret, 7, timeout),
        );
        let Err(Error::Timeout { what, after }) = outcome else {
            panic!("a silent store: {:?}", outcome.err());
        };
        assert_eq!(after, timeout);
        assert!(
            what.contains("admission") && what.contains("did not answer"),
            "{what}"
        );
        // Not after a try's own wait for an answer.
        assert!(
            started.elapsed() < HANDSHAKE_TIMEOUT,
            "{:?}",
            started.elapsed()
        );
    }

    /// A store that closes every connection before admitting it is tried
    /// again until the timeout, which names what it did.
    #[test]
    fn a_store_that_closes_every_connection_is_tried_until_the_timeout() {
        let secret = JobSecret::generate().unwrap();
        let timeout = Duration::from_millis(800);
        let (outcome, accepted) = against_fake_store(
            |stream| {
                let mut hello = [0; 5 + p::NONCE_LEN];
                let _ = stream.read_exact(&mut hello);
                let _ = stream.shutdown(Shutdown::Both);
            },
            |port| TcpStore::connect("127.0.0.1", port, &secret, 7, timeout),
        );
        let Err(Error::Timeout { what, after }) = outcome else {
            panic!("a store that closes: {:?}", outcome.err());
        };
        assert_eq!(after, timeout);
        assert!(what.contains("closed the connection"), "{what}");
        assert!(accepted >= 2, "{accepted} connections");
    }

    /// The reason a client of `secret` is refused by a fake store that
    /// answers as `answer` does, checking that it was refused on its first
    /// connection, not tried again.
    fn refused_at_once(secret: &JobSecret, answer: impl Fn(&mut TcpStream) + Sync) -> String {
        let (outcome, accepted) = against_fake_store(answer, |port| {
            TcpStore::connect("127.0.0.1", port, secret, 7, Duration::from_secs(20))
        });
        let Err(Error::Store {
            operation: "admission",
            reason,
        }) = outcome
        else {
            panic!("a refusing store: {:?}", outcome.err());
        };
        assert_eq!(accepted, 1, "{reason}");
        reason
    }

    /// A store that refuses this rank's proof is not tried again.
    #[test]
    fn a_client_refused_by_the_store_is_not_tried_again() {
        let secret = JobSecret::generate().unwrap();
        let reason = refused_at_once(&secret, |stream| {
            let mut hello = [0; 5 + p::NONCE_LEN];
            stream.read_exact(&mut hello).unwrap();
            let sn = [2; p::NONCE_LEN];
            let proof = p::proof(secret.as_bytes(), b"server", 7, &hello[5..], &sn)
                .finalize()
                .into_bytes();
            stream.write_all(&sn).unwrap();
            stream.write_all(&proof).unwrap();
            let mut theirs = [0; p::PROOF_LEN];
            stream.read_exact(&mut theirs).unwrap();
            stream.write_all(&[p::STATUS_REFUSED]).unwrap();
        });
        assert!(reason.contains("refused"), "{reason}");
    }

    /// A store of another protocol version is named and not tried again.
    #[test]
    fn a_store_of_another_version_is_refused_at_once() {
        let mut other_version = p::version_refusal();
        other_version[4] = p::VERSION + 1;
        let reason = refused_at_once(&JobSecret::generate().unwrap(), |stream| {
            let mut hello = [0; 5 + p::NONCE_LEN];
            stream.read_exact(&mut hello).unwrap();
            stream.write_all(&other_version).unwrap();
        });
        let expected = format!("version {}, this rank {}", p::VERSION + 1, p::VERSION);
        assert!(reason.contains(&expected), "{reason}");
    }

    /// A client of another protocol version is answered with the store's
    /// version, whether it waits after its magic and version or sends more.
    #[test]
    fn a_client_of_another_version_is_told_the_stores() {
        let (server, []) = served::<0>();
        for rest in [0, p::NONCE_LEN, 200] {
            let mut raw = TcpStream::connect(server.address()).unwrap();
            raw.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut greeting = p::MAGIC.to_vec();
            greeting.push(p::VERSION + 1);
            greeting.resize(greeting.len() + rest, 9);
            raw.write_all(&greeting).unwrap();
            let mut reply = [0; p::NONCE_LEN + p::PROOF_LEN];
            raw.read_exact(&mut reply).unwrap();
            assert_eq!(p::refused_version(&reply), Some(p::VERSION), "{rest}");
        }
    }

    /// A store of another job (another secret) is refused on the first
    /// connection, not tried again until the timeout.
    #[test]
    fn a_store_of_another_job_is_refused_at_once() {
        static STARTS: AtomicUsize = AtomicUsize::new(0);
        fn counted(work: Box<dyn FnOnce() + Send>) -> io::Result<JoinHandle<()>> {
            STARTS.fetch_add(1, Ordering::AcqRel);
            start_worker(work)
        }
        let server = TcpStoreServer::bind_with_starter(
            "127.0.0.1:0".parse().unwrap(),
            JobSecret::generate().unwrap(),
            7,
            8,
            counted,
        )
        .unwrap();
        let port = server.address().port();
        let other = JobSecret::generate().unwrap();
        let outcome = TcpStore::connect("127.0.0.1", port, &other, 7, Duration::from_secs(20));
        let Err(Error::Store {
            operation: "admission",
            reason,
        }) = outcome
        else {
            panic!("another job's store: {:?}", outcome.err());
        };
        assert!(reason.contains("job-secret proof"), "{reason}");
        assert_eq!(STARTS.load(Ordering::Acquire), 1);
    }

    /// A client that fails its proof is told so before the server closes.
    #[test]
    fn a_client_that_fails_the_proof_is_told_so() {
        let (server, []) = served::<0>();
        let mut raw = TcpStream::connect(server.address()).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut hello = p::MAGIC.to_vec();
        hello.push(p::VERSION);
        hello.extend_from_slice(&[1; p::NONCE_LEN]);
        raw.write_all(&hello).unwrap();
        let mut reply = [0; p::NONCE_LEN + p::PROOF_LEN];
        raw.read_exact(&mut reply).unwrap();
        raw.write_all(&[0; p::PROOF_LEN]).unwrap();
        assert_eq!(p::read_u8(&mut raw).unwrap(), p::STATUS_REFUSED);
    }

    /// A rank that fails while serving the store lets its peers read what is
    /// set, answers what they wait for with its own error, and stops once
    /// they are gone rather than after the linger.
    #[test]
    fn a_failed_host_answers_waiters_with_its_error() {
        let (server, [reader, waiter]) = served();
        reader.set("host/1", b"machine-1").unwrap();
        let linger = Duration::from_secs(30);
        let started = Instant::now();
        std::thread::scope(|s| {
            let waited = s.spawn(move || waiter.get("ep/0/1", linger));
            let closing = s.spawn(move || server.close_failed(0, "slices of 7 bytes", linger));
            // Until the failure is set, the absent key is simply absent.
            let told = loop {
                match reader.check(&["ep/0/1"]) {
                    Ok(false) => std::thread::sleep(Duration::from_millis(1)),
                    other => break other,
                }
            };
            let Err(Error::Peer { rank: 0, reason }) = told else {
                panic!("a check of an absent key after the failure: {told:?}");
            };
            assert!(reason.contains("slices of 7 bytes"), "{reason}");
            // The server closed that connection: a later call still says why.
            let again = reader.get("host/1", Duration::from_secs(1));
            assert!(
                matches!(&again, Err(Error::Peer { rank: 0, reason }) if reason.contains("slices of 7 bytes")),
                "{again:?}"
            );
            let Err(Error::Peer { rank: 0, reason }) = waited.join().unwrap() else {
                panic!("a waiter was not told of the failure");
            };
            assert!(reason.contains("slices of 7 bytes"), "{reason}");
            closing.join().unwrap();
        });
        assert!(started.elapsed() < linger / 2, "{:?}", started.elapsed());
    }

    /// What was set before the failure is still read after it, for a peer
    /// to reach its own verdict.
    #[test]
    fn a_failed_host_still_serves_keys_already_set() {
        let (server, [reader, probe]) = served();
        reader.set("host/0", b"machine-0").unwrap();
        let linger = Duration::from_secs(30);
        let started = Instant::now();
        std::thread::scope(|s| {
            let closing = s.spawn(move || server.close_failed(3, "bad", linger));
            // The failure is set once the probe's absent key is answered with it.
            loop {
                match probe.check(&["absent"]) {
                    Ok(false) => std::thread::sleep(Duration::from_millis(1)),
                    Err(Error::Peer { rank: 3, .. }) => break,
                    other => panic!("the probe: {other:?}"),
                }
            }
            assert_eq!(
                reader.get("host/0", Duration::from_secs(5)).unwrap(),
                b"machine-0"
            );
            assert!(reader.check(&["host/0"]).unwrap());
            drop((reader, probe));
            closing.join().unwrap();
        });
        // Once its clients are gone, not after the linger.
        assert!(started.elapsed() < linger / 2, "{:?}", started.elapsed());
    }
}
