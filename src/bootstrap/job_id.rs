//! [`JobId`]: a small fixed-size id one process makes and hands to every
//! rank by any means (`MPI_Bcast`, a file, a key-value store), with which
//! each joins the job ([`Communicator::from_id`](crate::Communicator::from_id)),
//! as NCCL's unique id does.
//!
//! Making an id starts the job's rendezvous store in the making process, on
//! this machine's address (`FAIRRING_SOCKET_IFNAME`'s, else its first
//! address that is not loopback or a container bridge) at a free port; the
//! id holds that address and port, a fresh job secret (peers and store
//! clients are admitted by it) and a fresh nonce naming the run. The store
//! serves until the maker's process exits or, where the maker joins the job
//! itself, until its communicator is dropped.
//!
//! ```text
//! bytes  0..8    "fairring"
//!        8       version (1)
//!        9       address family (4 or 6)
//!       10..12   port, big-endian
//!       12..28   address (IPv4 in the first 4 bytes)
//!       28..60   job secret
//!       60..76   nonce
//!       76..120  zero
//!      120..128  the first 8 bytes of SHA-256 of bytes 0..120
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Mutex, PoisonError};

use fairring_rdma::JobSecret;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::store::TcpStoreServer;

/// Bytes of a [`JobId`].
pub const JOB_ID_BYTES: usize = 128;

const MAGIC: &[u8; 8] = b"fairring";
const VERSION: u8 = 1;
const SUMMED: usize = 120;

/// A job's id: where its rendezvous store serves, its secret, and its run's
/// nonce (see the module docs). Copy it to every rank as bytes
/// ([`JobId::as_bytes`], [`JobId::from_bytes`]).
#[derive(Clone, PartialEq, Eq)]
pub struct JobId {
    bytes: [u8; JOB_ID_BYTES],
}

/// The stores this process serves for the ids it made, by nonce, until a
/// communicator of this process joins with the id (and takes its store).
static SERVING: Mutex<Vec<([u8; 16], TcpStoreServer)>> = Mutex::new(Vec::new());

impl JobId {
    /// Makes a job's id and starts serving its rendezvous store in this
    /// process (see the module docs).
    pub fn new() -> Result<JobId> {
        let ip = fairring_rdma::tcp::host_address()?;
        let secret = JobSecret::generate()?;
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce)
            .map_err(|e| Error::io("reading the system random source", std::io::Error::other(e)))?;
        let parts = Parts {
            address: SocketAddr::new(ip, 0),
            secret,
            nonce,
        };
        // At most a few hundred clients at once; more wait to connect.
        let server =
            TcpStoreServer::bind(parts.address, parts.secret.clone(), parts.job_tag(), 1024)?;
        let parts = Parts {
            address: server.address(),
            ..parts
        };
        SERVING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((nonce, server));
        Ok(parts.encode())
    }

    /// The id's bytes, to hand to every rank.
    pub fn as_bytes(&self) -> &[u8; JOB_ID_BYTES] {
        &self.bytes
    }

    /// The id of `bytes`; refused, naming `id`, unless they are one (made by
    /// [`JobId::new`] of this version, unchanged).
    pub fn from_bytes(bytes: &[u8]) -> Result<JobId> {
        let bytes: [u8; JOB_ID_BYTES] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "id",
                format!("holds {} bytes; a job id holds {JOB_ID_BYTES}", bytes.len()),
            )
        })?;
        let id = JobId { bytes };
        id.parts()?;
        Ok(id)
    }

    /// What the id holds, checked.
    pub(crate) fn parts(&self) -> Result<Parts> {
        let b = &self.bytes;
        if &b[..8] != MAGIC {
            return Err(Error::invalid(
                "id",
                "not a fairring job id (its first bytes)",
            ));
        }
        if b[8] != VERSION {
            return Err(Error::invalid(
                "id",
                format!("of version {}; this library reads version {VERSION}", b[8]),
            ));
        }
        if b[120..] != checksum(&b[..SUMMED]) {
            return Err(Error::invalid(
                "id",
                "its checksum does not match: the bytes were changed or cut on the way",
            ));
        }
        let port = u16::from_be_bytes([b[10], b[11]]);
        let ip = match b[9] {
            4 => IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15])),
            6 => {
                let mut v6 = [0u8; 16];
                v6.copy_from_slice(&b[12..28]);
                IpAddr::V6(Ipv6Addr::from(v6))
            }
            other => {
                return Err(Error::invalid(
                    "id",
                    format!("names address family {other}"),
                ));
            }
        };
        let mut secret = [0u8; 32];
        secret.copy_from_slice(&b[28..60]);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[60..76]);
        Ok(Parts {
            address: SocketAddr::new(ip, port),
            secret: JobSecret::from_bytes(secret),
            nonce,
        })
    }
}

impl std::fmt::Debug for JobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret stays out of logs.
        match self.parts() {
            Ok(p) => write!(f, "JobId({}, run {})", p.address, p.run_id()),
            Err(_) => f.write_str("JobId(invalid)"),
        }
    }
}

/// What an id holds.
pub(crate) struct Parts {
    pub(crate) address: SocketAddr,
    pub(crate) secret: JobSecret,
    pub(crate) nonce: [u8; 16],
}

impl Parts {
    /// The run's name: the nonce in hex.
    pub(crate) fn run_id(&self) -> String {
        self.nonce.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The job's tag, as the configuration derives it from the secret and
    /// the run.
    fn job_tag(&self) -> u64 {
        crate::config::job_tag(&self.secret, &self.run_id())
    }

    fn encode(&self) -> JobId {
        let mut b = [0u8; JOB_ID_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8] = VERSION;
        b[10..12].copy_from_slice(&self.address.port().to_be_bytes());
        match self.address.ip() {
            IpAddr::V4(v4) => {
                b[9] = 4;
                b[12..16].copy_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                b[9] = 6;
                b[12..28].copy_from_slice(&v6.octets());
            }
        }
        b[28..60].copy_from_slice(self.secret.as_bytes());
        b[60..76].copy_from_slice(&self.nonce);
        let sum = checksum(&b[..SUMMED]);
        b[SUMMED..].copy_from_slice(&sum);
        JobId { bytes: b }
    }
}

/// The store this process serves for the id of `nonce`, if it made that id
/// and no communicator has taken the store yet.
pub(crate) fn take_served(nonce: &[u8; 16]) -> Option<TcpStoreServer> {
    let mut serving = SERVING.lock().unwrap_or_else(PoisonError::into_inner);
    let at = serving.iter().position(|(n, _)| n == nonce)?;
    Some(serving.swap_remove(at).1)
}

fn checksum(bytes: &[u8]) -> [u8; 8] {
    let digest = Sha256::digest(bytes);
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&digest[..8]);
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_round_trips_and_a_changed_one_is_refused_naming_it() {
        let parts = Parts {
            address: "10.1.2.3:4567".parse().unwrap(),
            secret: JobSecret::from_bytes([7; 32]),
            nonce: [9; 16],
        };
        let id = parts.encode();
        let back = JobId::from_bytes(id.as_bytes()).unwrap().parts().unwrap();
        assert_eq!(back.address, parts.address);
        assert_eq!(back.secret.as_bytes(), parts.secret.as_bytes());
        assert_eq!(back.nonce, parts.nonce);
        assert_eq!(
            format!("{id:?}"),
            "JobId(10.1.2.3:4567, run 09090909090909090909090909090909)"
        );
        let v6 = Parts {
            address: "[fd00::2]:80".parse().unwrap(),
            ..parts
        };
        assert_eq!(v6.encode().parts().unwrap().address, v6.address);
        let refused = |bytes: &[u8]| match JobId::from_bytes(bytes) {
            Err(Error::InvalidArgument { argument, reason }) => {
                assert_eq!(argument, "id");
                reason
            }
            other => panic!("{other:?}"),
        };
        for at in [0, 9, 11, 40, 70, 100, 127] {
            let mut changed = *id.as_bytes();
            changed[at] ^= 1;
            let reason = refused(&changed);
            assert!(
                reason.contains("checksum") || reason.contains("first bytes"),
                "byte {at}: {reason}"
            );
        }
        assert!(refused(&id.as_bytes()[..100]).contains("holds 100 bytes"));
    }
}
