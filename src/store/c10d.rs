//! A client of PyTorch's TCPStore (`c10d::TCPStore`), the store torchrun's agent
//! serves on `MASTER_ADDR:MASTER_PORT` (`TORCHELASTIC_USE_AGENT_STORE=True`).
//!
//! The wire protocol, as PyTorch's client and both of its servers (the classic
//! one and the libuv one) speak it; every integer is little-endian, as on every
//! machine PyTorch runs on:
//!
//! ```text
//! request   query(u8) arguments...
//! string    length(u64) bytes
//! VALIDATE  magic(u32 = 0x3C85F7CE)                      no reply
//! PING      nonce(u32)                                   -> nonce(u32)
//! SET       key(string) value(string)                    no reply
//! GET       key(string)                                  -> value(string)
//! CHECK     count(u64) keys(string)*                     -> READY(0) | NOT_READY(1)
//! WAIT      count(u64) keys(string)*                     -> STOP_WAITING(0), once all are set
//! CANCEL_WAIT                                            -> WAIT_CANCELED(1) (after a
//!                                                           STOP_WAITING that crossed it)
//! ```
//!
//! A `GET` of a missing key is not an error on the server: it fails the
//! connection. So [`Store::get`] waits first (`WAIT`, bounded by the caller's
//! timeout, cancelled when it passes) and reads the value after.
//!
//! The store is not authenticated: anyone who reaches the port reads and writes
//! it. Nothing secret travels through it (the job secret never does), and the
//! fabric admits a peer only after the job secret's handshake, so a stranger who
//! writes into the store can stall or fail a rendezvous but not join the job or
//! read its data.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{MAX_KEY_LEN, MAX_VALUE_LEN, Store};
use crate::error::{Error, Result};

/// The queries of the protocol (`c10d::detail::QueryType`), by wire value.
mod query {
    pub(super) const VALIDATE: u8 = 0;
    pub(super) const SET: u8 = 1;
    pub(super) const GET: u8 = 3;
    pub(super) const CHECK: u8 = 5;
    pub(super) const WAIT: u8 = 6;
    pub(super) const CANCEL_WAIT: u8 = 12;
    pub(super) const PING: u8 = 13;
}

/// The magic number of `VALIDATE`.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
/// `CHECK`'s reply when every key is set.
const READY: u8 = 0;
/// `CHECK`'s reply when some key is missing.
const NOT_READY: u8 = 1;
/// `WAIT`'s reply once every key is set.
const STOP_WAITING: u8 = 0;
/// The reply to `CANCEL_WAIT`.
const WAIT_CANCELED: u8 = 1;
/// How long the server may take to answer anything but a `WAIT`.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// A connection to a PyTorch TCPStore.
pub struct C10dStore {
    address: SocketAddr,
    stream: Mutex<TcpStream>,
}

impl C10dStore {
    /// Connects to the TCPStore at `host:port`, retrying until `timeout` while it
    /// is not up yet, and checks that it answers as one (`VALIDATE`, then a
    /// `PING` whose nonce must come back).
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<C10dStore> {
        let address = super::tcp::resolve_master(host, port)?;
        let stream = super::tcp::connect_retrying(address, timeout, "PyTorch's TCPStore")?;
        let store = C10dStore {
            address,
            stream: Mutex::new(stream),
        };
        store.greet().map_err(|e| {
            Error::store(
                "connect",
                format!("{address} does not answer as PyTorch's TCPStore: {e}"),
            )
        })?;
        Ok(store)
    }

    /// The server's address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    fn greet(&self) -> io::Result<()> {
        let mut stream = self.lock();
        let _ = stream.set_nodelay(true);
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        stream.set_write_timeout(Some(REPLY_TIMEOUT))?;
        let mut hello = Vec::with_capacity(10);
        hello.push(query::VALIDATE);
        hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        let mut nonce = [0u8; 4];
        getrandom::fill(&mut nonce).map_err(io::Error::other)?;
        hello.push(query::PING);
        hello.extend_from_slice(&nonce);
        stream.write_all(&hello)?;
        let mut echo = [0u8; 4];
        stream.read_exact(&mut echo)?;
        if echo != nonce {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "its reply to PING is not the nonce sent",
            ));
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TcpStream> {
        self.stream.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn failed(&self, operation: &'static str, e: io::Error) -> Error {
        Error::store(
            operation,
            format!("PyTorch's TCPStore at {}: {e}", self.address),
        )
    }

    /// Waits until every key in `keys` is set, or `timeout` passes (`Ok(false)`,
    /// with the wait cancelled on the server).
    fn wait(&self, stream: &mut TcpStream, keys: &[&str], timeout: Duration) -> io::Result<bool> {
        let mut request = vec![query::WAIT];
        put_keys(&mut request, keys);
        stream.write_all(&request)?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            // A read timeout of zero means none: the remaining time is at least
            // one microsecond here.
            stream.set_read_timeout(Some(left.max(Duration::from_micros(1))))?;
            match read_u8(stream) {
                Ok(STOP_WAITING) => {
                    stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
                    return Ok(true);
                }
                Ok(other) => return Err(unexpected("WAIT", other)),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        stream.set_read_timeout(Some(REPLY_TIMEOUT))?;
        stream.write_all(&[query::CANCEL_WAIT])?;
        // The keys may have been set while the cancel crossed the wire: then a
        // STOP_WAITING comes first, and the key is there after all.
        match read_u8(stream)? {
            WAIT_CANCELED => Ok(false),
            STOP_WAITING => match read_u8(stream)? {
                WAIT_CANCELED => Ok(true),
                other => Err(unexpected("CANCEL_WAIT", other)),
            },
            other => Err(unexpected("CANCEL_WAIT", other)),
        }
    }
}

impl Store for C10dStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        let mut request = Vec::with_capacity(17 + key.len() + value.len());
        request.push(query::SET);
        put_bytes(&mut request, key.as_bytes());
        put_bytes(&mut request, value);
        self.lock()
            .write_all(&request)
            .map_err(|e| self.failed("set", e))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let mut stream = self.lock();
        if !self
            .wait(&mut stream, &[key], timeout)
            .map_err(|e| self.failed("wait", e))?
        {
            return Err(Error::timeout(format!("rendezvous key {key}"), timeout));
        }
        let mut request = vec![query::GET];
        put_bytes(&mut request, key.as_bytes());
        stream
            .write_all(&request)
            .map_err(|e| self.failed("get", e))?;
        read_bytes(&mut *stream, MAX_VALUE_LEN).map_err(|e| self.failed("get", e))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        for key in keys {
            check_key(key)?;
        }
        let mut request = vec![query::CHECK];
        put_keys(&mut request, keys);
        let mut stream = self.lock();
        stream
            .write_all(&request)
            .map_err(|e| self.failed("check", e))?;
        match read_u8(&mut *stream).map_err(|e| self.failed("check", e))? {
            READY => Ok(true),
            NOT_READY => Ok(false),
            other => Err(self.failed("check", unexpected("CHECK", other))),
        }
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::invalid(
            "key",
            format!("{} bytes is over the {MAX_KEY_LEN}-byte limit", key.len()),
        ));
    }
    Ok(())
}

fn check_value(value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::invalid(
            "value",
            format!(
                "{} bytes is over the {MAX_VALUE_LEN}-byte limit",
                value.len()
            ),
        ));
    }
    Ok(())
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn put_keys(out: &mut Vec<u8>, keys: &[&str]) {
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for key in keys {
        put_bytes(out, key.as_bytes());
    }
}

fn read_u8(stream: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    stream.read_exact(&mut b)?;
    Ok(b[0])
}

/// A length-prefixed string of at most `limit` bytes.
fn read_bytes(stream: &mut impl Read, limit: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    stream.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    let len = usize::try_from(len)
        .ok()
        .filter(|&l| l <= limit)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("a value of {len} bytes is over the {limit}-byte limit"),
            )
        })?;
    let mut value = vec![0u8; len];
    stream.read_exact(&mut value)?;
    Ok(value)
}

fn unexpected(query: &str, reply: u8) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("unexpected reply {reply} to {query}"),
    )
}

#[cfg(test)]
mod tests {
    //! Against a small server written from the protocol above; the real one is
    //! exercised under torchrun by the Python tests.
    use super::*;
    use std::collections::HashMap;
    use std::net::TcpListener;
    use std::sync::{Arc, Condvar};

    #[derive(Default)]
    struct Table {
        map: Mutex<HashMap<Vec<u8>, Vec<u8>>>,
        changed: Condvar,
    }

    fn read_string(s: &mut TcpStream) -> io::Result<Vec<u8>> {
        read_bytes(s, usize::MAX)
    }

    fn read_count(s: &mut TcpStream) -> io::Result<u64> {
        let mut n = [0u8; 8];
        s.read_exact(&mut n)?;
        Ok(u64::from_le_bytes(n))
    }

    /// Serves one client until it hangs up; `validated` records, per VALIDATE,
    /// whether it came first and carried the magic number.
    fn serve(mut s: TcpStream, table: Arc<Table>, validated: Arc<Mutex<Vec<bool>>>) {
        let mut first = true;
        while let Ok(q) = read_u8(&mut s) {
            let ok = match q {
                query::VALIDATE => {
                    let mut m = [0u8; 4];
                    let good = s.read_exact(&mut m).is_ok()
                        && first
                        && u32::from_le_bytes(m) == VALIDATION_MAGIC;
                    validated.lock().unwrap().push(good);
                    good
                }
                query::PING => {
                    let mut n = [0u8; 4];
                    s.read_exact(&mut n).is_ok() && s.write_all(&n).is_ok()
                }
                query::SET => {
                    let (Ok(k), Ok(v)) = (read_string(&mut s), read_string(&mut s)) else {
                        return;
                    };
                    table.map.lock().unwrap().insert(k, v);
                    table.changed.notify_all();
                    true
                }
                query::GET => {
                    let Ok(k) = read_string(&mut s) else { return };
                    let Some(v) = table.map.lock().unwrap().get(&k).cloned() else {
                        return; // as PyTorch's server: a missing key ends the connection
                    };
                    let mut out = Vec::new();
                    put_bytes(&mut out, &v);
                    s.write_all(&out).is_ok()
                }
                query::CHECK | query::WAIT => {
                    let Ok(n) = read_count(&mut s) else { return };
                    let keys: Vec<Vec<u8>> =
                        (0..n).filter_map(|_| read_string(&mut s).ok()).collect();
                    let all =
                        |m: &HashMap<Vec<u8>, Vec<u8>>| keys.iter().all(|k| m.contains_key(k));
                    if q == query::CHECK {
                        let ready = all(&table.map.lock().unwrap());
                        s.write_all(&[if ready { READY } else { NOT_READY }])
                            .is_ok()
                    } else {
                        // Waits up to 100 ms, then expects the client's cancel.
                        let m = table.map.lock().unwrap();
                        let (m, _) = table
                            .changed
                            .wait_timeout_while(m, Duration::from_millis(100), |m| !all(m))
                            .unwrap();
                        if all(&m) {
                            drop(m);
                            s.write_all(&[STOP_WAITING]).is_ok()
                        } else {
                            drop(m);
                            read_u8(&mut s).ok() == Some(query::CANCEL_WAIT)
                                && s.write_all(&[WAIT_CANCELED]).is_ok()
                        }
                    }
                }
                _ => false,
            };
            first = false;
            if !ok {
                return;
            }
        }
    }

    fn server() -> (u16, Arc<Table>, Arc<Mutex<Vec<bool>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let table = Arc::new(Table::default());
        let validated = Arc::new(Mutex::new(Vec::new()));
        let (t, v) = (Arc::clone(&table), Arc::clone(&validated));
        std::thread::spawn(move || {
            for s in listener.incoming().flatten() {
                let (t, v) = (Arc::clone(&t), Arc::clone(&v));
                std::thread::spawn(move || serve(s, t, v));
            }
        });
        (port, table, validated)
    }

    #[test]
    fn set_get_check_and_a_validated_greeting() {
        let (port, table, validated) = server();
        let store = C10dStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        assert_eq!(*validated.lock().unwrap(), [true]);
        assert!(!store.check(&["a"]).unwrap());
        store.set("a", b"one").unwrap();
        store.set("b", &[]).unwrap();
        assert!(store.check(&["a", "b"]).unwrap());
        assert!(!store.check(&["a", "c"]).unwrap());
        assert_eq!(store.get("a", Duration::from_secs(1)).unwrap(), b"one");
        assert_eq!(store.get("b", Duration::from_secs(1)).unwrap(), b"");
        // What the client wrote is what the server stored, under the exact key.
        let m = table.map.lock().unwrap();
        assert_eq!(m.get(b"a".as_slice()).map(Vec::as_slice), Some(&b"one"[..]));
    }

    #[test]
    fn a_missing_key_times_out_naming_it_and_the_connection_stays_usable() {
        let (port, _, _) = server();
        let store = C10dStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let start = Instant::now();
        let err = store
            .get("missing", Duration::from_millis(300))
            .unwrap_err();
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        assert!(err.to_string().contains("missing"), "{err}");
        assert!(start.elapsed() >= Duration::from_millis(300));
        store.set("later", b"x").unwrap();
        assert_eq!(store.get("later", Duration::from_secs(1)).unwrap(), b"x");
    }

    #[test]
    fn a_key_set_by_another_client_ends_a_wait() {
        let (port, _, _) = server();
        let a = C10dStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let b = C10dStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            b.set("k", b"v").unwrap();
        });
        assert_eq!(a.get("k", Duration::from_secs(5)).unwrap(), b"v");
        setter.join().unwrap();
    }

    #[test]
    fn a_server_that_does_not_speak_the_protocol_is_named() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = listener.accept() {
                let _ = s.write_all(b"HTTP");
            }
        });
        let err = C10dStore::connect("127.0.0.1", port, Duration::from_secs(5))
            .err()
            .unwrap();
        assert!(
            err.to_string()
                .contains("does not answer as PyTorch's TCPStore"),
            "{err}"
        );
    }

    #[test]
    fn oversized_keys_are_refused_before_sending() {
        let (port, _, _) = server();
        let store = C10dStore::connect("127.0.0.1", port, Duration::from_secs(5)).unwrap();
        let long = "k".repeat(MAX_KEY_LEN + 1);
        let err = store.set(&long, b"").unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert!(store.check(&["x"]).is_ok());
    }
}
