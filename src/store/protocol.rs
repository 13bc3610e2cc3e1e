//! The TCP store's wire protocol.
//!
//! **Admission** (mutual, before any request):
//!
//! ```text
//! client -> server  "FRST" version(1) client_nonce(32)
//! server -> client  server_nonce(32) HMAC(secret, P | "server" | job_tag | cn | sn)(32)
//!                   or, to a client of another version: "FRST" version(1) zeros(59)
//! client -> server  HMAC(secret, P | "client" | job_tag | cn | sn)(32)
//! server -> client  0 (admitted), or 3 (refused: the client failed the proof)
//! ```
//!
//! `P` is `"fairring store v1 "` and `job_tag` 8 bytes, little-endian. Both
//! proofs are HMAC-SHA256 keyed with the job secret and compared in constant
//! time; a side that fails the other's proof closes the connection, the server
//! after saying so. The server reads a client's magic and version before its
//! nonce, so that a client of any version is answered with the server's. A
//! refusal is final; a connection the server closes or leaves unanswered before
//! its verdict (too many open, or no thread to serve it) is made again by the
//! client, within its timeout.
//!
//! **Requests** (little-endian): `op(1) key_len(4) key`, then for `SET`
//! `value_len(4) value`, for `GET` `timeout_ms(4)`, for `CHECK` nothing. Keys are at
//! most [`MAX_KEY_LEN`] bytes and values at most [`MAX_VALUE_LEN`]; a longer length
//! field closes the connection before anything is allocated.
//!
//! **Responses**: `status(1)`, then for a `GET` that found its key
//! `value_len(4) value`, for `CHECK` `present(1)`. Once the rank that serves the
//! store has failed (`TcpStoreServer::close_failed`), a `GET` or `CHECK` of a key
//! that is absent is answered `HOST_FAILED rank(4) reason_len(4) reason` and the
//! connection closed: the client reports that rank's own error rather than a
//! wait that can only time out.

use std::io::{self, Read, Write};

pub(super) use hmac::{KeyInit, Mac};
use sha2::Sha256;

use super::{MAX_KEY_LEN, MAX_VALUE_LEN};

type HmacSha256 = hmac::Hmac<Sha256>;

pub(super) const MAGIC: &[u8; 4] = b"FRST";
pub(super) const VERSION: u8 = 2;
pub(super) const NONCE_LEN: usize = 32;
pub(super) const PROOF_LEN: usize = 32;

pub(super) const OP_SET: u8 = 1;
pub(super) const OP_GET: u8 = 2;
pub(super) const OP_CHECK: u8 = 3;

pub(super) const STATUS_OK: u8 = 0;
pub(super) const STATUS_TIMEOUT: u8 = 1;
pub(super) const STATUS_HOST_FAILED: u8 = 2;
pub(super) const STATUS_REFUSED: u8 = 3;

/// The server's first answer, where a client's version is not its own.
pub(super) const fn version_refusal() -> [u8; NONCE_LEN + PROOF_LEN] {
    let mut reply = [0; NONCE_LEN + PROOF_LEN];
    let mut i = 0;
    while i < MAGIC.len() {
        reply[i] = MAGIC[i];
        i += 1;
    }
    reply[MAGIC.len()] = VERSION;
    reply
}

/// The version a server's first answer says it speaks, where that answer is
/// a [`version_refusal`] (a real nonce and proof look like one by a chance
/// of 2^-504).
pub(super) fn refused_version(reply: &[u8; NONCE_LEN + PROOF_LEN]) -> Option<u8> {
    let (head, zeros) = reply.split_at(MAGIC.len() + 1);
    (&head[..MAGIC.len()] == MAGIC && zeros.iter().all(|&b| b == 0)).then_some(head[MAGIC.len()])
}

/// Longest reason a failed host sends, in bytes (a longer one is cut).
pub(super) const MAX_REASON_LEN: usize = 4096;

/// A request as the server reads it.
pub(super) enum Request {
    Set { key: String, value: Vec<u8> },
    Get { key: String, timeout_ms: u32 },
    Check { key: String },
}

pub(super) fn proof(
    secret: &[u8; 32],
    label: &[u8],
    job_tag: u64,
    cn: &[u8],
    sn: &[u8],
) -> HmacSha256 {
    // An HMAC key may have any length: this cannot fail.
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
    mac.update(b"fairring store v1 ");
    mac.update(label);
    mac.update(&job_tag.to_le_bytes());
    mac.update(cn);
    mac.update(sn);
    mac
}

pub(super) fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub(super) fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

/// Reads `len` bytes after checking `len <= max`.
pub(super) fn read_bounded(r: &mut impl Read, max: usize, what: &str) -> io::Result<Vec<u8>> {
    let len = read_u32(r)? as usize;
    if len > max {
        return Err(invalid(format!(
            "{what} of {len} bytes is over the {max}-byte limit"
        )));
    }
    let mut v = vec![0; len];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn read_key(r: &mut impl Read) -> io::Result<String> {
    let key = read_bounded(r, MAX_KEY_LEN, "key")?;
    String::from_utf8(key).map_err(|_| invalid("key is not UTF-8".into()))
}

pub(super) fn read_request(r: &mut impl Read) -> io::Result<Request> {
    let op = read_u8(r)?;
    match op {
        OP_SET => {
            let key = read_key(r)?;
            let value = read_bounded(r, MAX_VALUE_LEN, "value")?;
            Ok(Request::Set { key, value })
        }
        OP_GET => {
            let key = read_key(r)?;
            let timeout_ms = read_u32(r)?;
            Ok(Request::Get { key, timeout_ms })
        }
        OP_CHECK => Ok(Request::Check { key: read_key(r)? }),
        _ => Err(invalid(format!("unknown request {op}"))),
    }
}

pub(super) fn write_request(
    w: &mut impl Write,
    op: u8,
    key: &str,
    value: Option<&[u8]>,
    timeout_ms: Option<u32>,
) -> io::Result<()> {
    let mut buf = Vec::with_capacity(16 + key.len() + value.map_or(0, <[u8]>::len));
    buf.push(op);
    put_bytes(&mut buf, key.as_bytes());
    if let Some(v) = value {
        put_bytes(&mut buf, v);
    }
    if let Some(t) = timeout_ms {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    w.write_all(&buf)
}

pub(super) fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(bytes);
}
