//! What can go wrong, and whom it concerns.

use core::fmt;
use std::io;
use std::time::Duration;

use fairring_core::wire::WireError;

/// Why a peer stopped being reachable. Carried by error completions, so it is
/// `Copy` and allocation-free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerFailure {
    /// The peer closed the connection (for a dead process the kernel does this).
    Closed,
    /// The peer closed the connection in the middle of a frame.
    ClosedMidFrame,
    /// A socket error, by kind.
    Io(io::ErrorKind),
    /// Nothing arrived from the peer, not even a keep-alive, for this long.
    Silent {
        /// The silence bound that passed, in milliseconds.
        after_ms: u64,
    },
    /// The peer sent something the protocol forbids; the connection was dropped.
    Protocol(ProtocolViolation),
    /// The peer sent an abort.
    Aborted,
    /// This fabric was shut down.
    ShutDown,
    /// The RDMA transport failed a work request with this `ibv_wc_status` (12 is
    /// "transport retry counter exceeded": the peer stopped acknowledging).
    Transport {
        /// The work completion's status.
        status: u32,
    },
}

impl fmt::Display for PeerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerFailure::Closed => f.write_str("closed the connection"),
            PeerFailure::ClosedMidFrame => f.write_str("closed the connection mid-frame"),
            PeerFailure::Io(kind) => write!(f, "socket error: {kind}"),
            PeerFailure::Silent { after_ms } => write!(f, "silent for {after_ms} ms"),
            PeerFailure::Protocol(violation) => write!(f, "protocol violation: {violation}"),
            PeerFailure::Aborted => f.write_str("aborted"),
            PeerFailure::ShutDown => f.write_str("the local fabric shut down"),
            PeerFailure::Transport { status } => {
                write!(f, "RDMA work request failed with ibv_wc_status {status}")
            }
        }
    }
}

/// A frame from an admitted peer that the receiver refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// The header did not decode, or a field was wrong for its kind.
    Wire(WireError),
    /// A frame kind that an admitted connection never carries (`Hello`, or an
    /// engine frame).
    UnexpectedKind {
        /// The kind byte.
        kind: u8,
    },
    /// A frame whose source rank is not the peer's.
    WrongSource {
        /// The connection's peer.
        expected: u32,
        /// The rank in the frame.
        found: u32,
    },
    /// A frame for another job.
    WrongJob {
        /// This job's tag.
        expected: u64,
        /// The frame's tag.
        found: u64,
    },
    /// A write into a region that is not registered.
    UnknownRegion {
        /// The region key named.
        region: u32,
    },
    /// A write that would end outside its region.
    OutsideRegion {
        /// The region key named.
        region: u32,
        /// The offset asked for.
        offset: u64,
        /// The length asked for.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
}

impl fmt::Display for ProtocolViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolViolation::Wire(e) => write!(f, "{e}"),
            ProtocolViolation::UnexpectedKind { kind } => {
                write!(f, "frame kind {kind} is not allowed after admission")
            }
            ProtocolViolation::WrongSource { expected, found } => {
                write!(
                    f,
                    "frame claims rank {found} on the connection of rank {expected}"
                )
            }
            ProtocolViolation::WrongJob { expected, found } => {
                write!(f, "frame for job {found:#x}, this is job {expected:#x}")
            }
            ProtocolViolation::UnknownRegion { region } => {
                write!(f, "write into unregistered region {region}")
            }
            ProtocolViolation::OutsideRegion {
                region,
                offset,
                len,
                region_len,
            } => write!(
                f,
                "write of {len} bytes at offset {offset} outside region {region} of {region_len} bytes"
            ),
        }
    }
}

/// Why a connection was refused admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The other side's proof does not match the job secret.
    WrongSecret,
    /// The other side belongs to another job.
    WrongJob {
        /// This job's tag.
        expected: u64,
        /// The tag offered.
        found: u64,
    },
    /// The other side is in another epoch of this job (a stale incarnation, or a
    /// newer one this process has not joined).
    WrongEpoch {
        /// This process's epoch.
        expected: u64,
        /// The epoch offered.
        found: u64,
    },
    /// The other side's world size differs.
    WrongWorldSize {
        /// This job's world size.
        expected: u32,
        /// The size offered.
        found: u32,
    },
    /// A rank outside the job, this process's own rank, or a rank that does not
    /// dial this one (the higher rank of a pair dials the lower).
    UnknownRank {
        /// The rank claimed.
        rank: u32,
    },
    /// The rank is already admitted.
    DuplicateRank {
        /// The rank claimed.
        rank: u32,
    },
    /// The dialer meant to reach another rank.
    WrongTarget {
        /// The rank the dialer wanted.
        wanted: u32,
        /// This process's rank.
        actual: u32,
    },
    /// Bytes that are not a handshake frame.
    Garbage(WireError),
    /// A handshake message of the wrong size or step.
    Malformed,
    /// The handshake did not finish before its deadline.
    Deadline,
    /// Too many connections were waiting for admission.
    TooManyPending,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::WrongSecret => f.write_str("wrong job secret"),
            Refusal::WrongJob { expected, found } => {
                write!(f, "job {found:#x} is not this job ({expected:#x})")
            }
            Refusal::WrongEpoch { expected, found } => {
                write!(f, "epoch {found} is not this job's epoch {expected}")
            }
            Refusal::WrongWorldSize { expected, found } => {
                write!(f, "world size {found} is not this job's {expected}")
            }
            Refusal::UnknownRank { rank } => write!(f, "rank {rank} may not dial this rank"),
            Refusal::DuplicateRank { rank } => write!(f, "rank {rank} is already admitted"),
            Refusal::WrongTarget { wanted, actual } => {
                write!(f, "dialed rank {wanted} but reached rank {actual}")
            }
            Refusal::Garbage(e) => write!(f, "not a handshake frame: {e}"),
            Refusal::Malformed => f.write_str("malformed handshake message"),
            Refusal::Deadline => f.write_str("handshake deadline passed"),
            Refusal::TooManyPending => f.write_str("too many unauthenticated connections"),
        }
    }
}

/// An error returned by a fabric call.
#[derive(Debug)]
#[non_exhaustive]
pub enum FabricError {
    /// An argument is invalid; nothing was done.
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A configuration value (an environment variable or a config field) is invalid.
    Config {
        /// The variable or field.
        variable: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A byte range outside its region.
    OutOfBounds {
        /// Which range: `"source"` (a local region) or `"target"` (a peer's region).
        range: &'static str,
        /// The range's offset.
        offset: u64,
        /// The range's length.
        len: u64,
        /// The region's length.
        region_len: u64,
    },
    /// The rank is not a peer of this fabric (out of range, this rank, or not
    /// connected yet).
    NotConnected {
        /// The rank.
        peer: u32,
    },
    /// The peer has failed; nothing more can be sent to it.
    PeerFailed {
        /// The rank.
        peer: u32,
        /// Why.
        failure: PeerFailure,
    },
    /// Too many operations are outstanding to the peer; poll completions and retry.
    QueueFull {
        /// The rank.
        peer: u32,
        /// The queue's depth.
        depth: usize,
    },
    /// Admission failed.
    Refused {
        /// The peer, when known.
        peer: Option<u32>,
        /// The address involved.
        address: Option<std::net::SocketAddr>,
        /// Why.
        refusal: Refusal,
        /// Whether the other side refused (`true`) or this side did.
        by_peer: bool,
    },
    /// Something did not happen in time.
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// The peer, when one is concerned.
        peer: Option<u32>,
        /// How long was waited.
        after: Duration,
    },
    /// An operating-system call failed.
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: io::Error,
    },
    /// The region was deregistered.
    RegionClosed,
    /// The fabric is shutting down.
    ShutDown,
}

impl fmt::Display for FabricError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricError::InvalidArgument { argument, reason } => {
                write!(f, "invalid argument `{argument}`: {reason}")
            }
            FabricError::Config { variable, reason } => write!(f, "invalid {variable}: {reason}"),
            FabricError::OutOfBounds {
                range,
                offset,
                len,
                region_len,
            } => write!(
                f,
                "{range} range of {len} bytes at offset {offset} is outside its region of {region_len} bytes"
            ),
            FabricError::NotConnected { peer } => write!(f, "rank {peer} is not connected"),
            FabricError::PeerFailed { peer, failure } => write!(f, "rank {peer} failed: {failure}"),
            FabricError::QueueFull { peer, depth } => write!(
                f,
                "{depth} operations already outstanding to rank {peer}; poll completions first"
            ),
            FabricError::Refused {
                peer,
                address,
                refusal,
                by_peer,
            } => {
                f.write_str(if *by_peer {
                    "admission refused by the peer"
                } else {
                    "admission refused"
                })?;
                if let Some(peer) = peer {
                    write!(f, " (rank {peer})")?;
                }
                if let Some(address) = address {
                    write!(f, " ({address})")?;
                }
                write!(f, ": {refusal}")
            }
            FabricError::Timeout { what, peer, after } => {
                write!(f, "timed out after {after:?} waiting for {what}")?;
                match peer {
                    Some(peer) => write!(f, " (rank {peer})"),
                    None => Ok(()),
                }
            }
            FabricError::Io { context, source } => write!(f, "{context}: {source}"),
            FabricError::RegionClosed => f.write_str("the region is deregistered"),
            FabricError::ShutDown => f.write_str("the fabric is shut down"),
        }
    }
}

impl std::error::Error for FabricError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FabricError::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl FabricError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> FabricError {
        FabricError::Io {
            context: context.into(),
            source,
        }
    }
}
