//! Frames: the fixed-size header every transport carries, and its validation.
//!
//! A frame is a [`FrameHeader`] ([`HEADER_LEN`] bytes, versioned, little-endian,
//! checksummed) followed by `payload_len` bytes. A receiver decodes the header
//! ([`FrameHeader::decode`]: magic, version, checksum, kind, flags, payload length
//! for the kind), then checks it against its plan ([`FrameCheck::check_data`]: job,
//! sender, rail, slice, shard, server, exact length), and only then reads the
//! payload, straight into the [`Placement`] it was given. A peer that lies about
//! any field is refused before a single payload byte is written, so it can never
//! write outside the cell the plan gives it.
//!
//! Nothing here allocates, and nothing panics on any input: every refusal is a
//! [`WireError`] that names the field and both values.

mod crc32c;
mod header;
mod region;
mod validate;

pub use crc32c::crc32c;
pub use header::{
    FrameHeader, FrameKind, HEADER_LEN, MAGIC, MAX_ABORT_PAYLOAD, MAX_DATA_PAYLOAD,
    MAX_HELLO_PAYLOAD, MAX_MESSAGE_PAYLOAD, MAX_WRITE_PAYLOAD, VERSION,
};
pub use region::RegionAddress;
pub use validate::{FrameCheck, Placement};

use core::fmt;

/// Why a frame was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WireError {
    /// The first four bytes are not [`MAGIC`].
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// A version this code does not read.
    UnsupportedVersion {
        /// The version found.
        found: u8,
    },
    /// The header's checksum does not match its bytes.
    BadChecksum {
        /// The checksum in the header.
        stored: u32,
        /// The checksum of the bytes received.
        computed: u32,
    },
    /// An unknown frame kind.
    UnknownKind {
        /// The kind byte found.
        found: u8,
    },
    /// Flags set that this version does not define.
    ReservedFlags {
        /// The flags found.
        found: u16,
    },
    /// A payload longer than the kind allows.
    PayloadTooLarge {
        /// The frame kind.
        kind: FrameKind,
        /// The length announced.
        len: u32,
        /// The largest allowed.
        max: u32,
    },
    /// A data frame with no payload.
    EmptyPayload {
        /// The frame kind.
        kind: FrameKind,
    },
    /// A control frame where a data frame was expected.
    NotDataFrame {
        /// The kind found.
        kind: FrameKind,
    },
    /// A data frame where a control frame was expected.
    NotControlFrame {
        /// The kind found.
        kind: FrameKind,
    },
    /// A frame kind that carries no [`RegionAddress`] where one was expected.
    NoRegionAddress {
        /// The kind found.
        kind: FrameKind,
    },
    /// A region address whose reserved bits (header bytes 28..32) are not zero.
    ReservedAddressBits {
        /// The reserved bits found.
        found: u32,
    },
    /// A frame from another job.
    WrongJob {
        /// This job's tag.
        expected: u64,
        /// The frame's tag.
        found: u64,
    },
    /// A source rank outside the job.
    UnknownRank {
        /// The rank found.
        rank: u32,
        /// The job's world size.
        world_size: u32,
    },
    /// A frame claiming to come from the receiving rank itself.
    FromSelf {
        /// The rank.
        rank: u32,
    },
    /// A data frame from a device on another rail.
    WrongRail {
        /// The sender.
        source_rank: u32,
        /// The sender's rail.
        rail: u32,
        /// The receiver's rail.
        expected: u32,
    },
    /// A data frame from another device of the receiver's own machine (those go
    /// through the intra-machine step, never the fabric).
    FromOwnMachine {
        /// The sender.
        source_rank: u32,
    },
    /// A slice the operation does not have.
    SliceOutOfRange {
        /// The slice found.
        slice: u64,
        /// The operation's slice count.
        slices: u64,
    },
    /// A shard the slice does not have.
    ShardOutOfRange {
        /// The shard found.
        shard: u32,
        /// The slice's shard count.
        shards: u32,
    },
    /// A contribution to a shard this machine does not serve, or a result from a
    /// machine that does not serve it.
    NotServer {
        /// The shard.
        shard: u32,
        /// The machine that does serve it.
        server: u32,
    },
    /// Through trees: a contribution from a machine that is not a child of
    /// this one in the shard's tree, or a result from one that is not its
    /// parent.
    NotTreeNeighbour {
        /// The shard.
        shard: u32,
        /// The tree it travels through.
        tree: u32,
        /// The machine the frame came from.
        from: u32,
    },
    /// A part index past the parts its cell travels in
    /// ([`Cell::parts`](crate::plan::Cell::parts)).
    PartOutOfRange {
        /// The part named.
        part: u32,
        /// The cell's parts.
        parts: u32,
    },
    /// A payload length other than the cell's part's (the whole cell's where it
    /// travels whole).
    LengthMismatch {
        /// The cell's length in bytes.
        expected: u64,
        /// The length announced.
        found: u32,
    },
    /// The payload would not fit its area of the staging buffer (a plan and layout
    /// that disagree; never expected).
    OutsideBuffer {
        /// Offset in the buffer.
        offset: u64,
        /// Payload length.
        len: u64,
        /// The buffer's size.
        buffer: u64,
    },
    /// The plan was made under another geometry than the check.
    GeometryMismatch,
    /// The geometry reduces its slots in groups
    /// ([`Routing::Groups`](crate::plan::Routing::Groups)), whose writes a
    /// frame's slice, shard and part do not place (a piece of a range is
    /// neither a cell nor a part of one).
    RoutedInGroups,
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WireError::BadMagic { found } => {
                write!(f, "bad frame magic {found:02x?}, expected {MAGIC:02x?}")
            }
            WireError::UnsupportedVersion { found } => {
                write!(
                    f,
                    "frame version {found} is not supported (this is version {VERSION})"
                )
            }
            WireError::BadChecksum { stored, computed } => write!(
                f,
                "frame header checksum {stored:#010x} does not match its bytes ({computed:#010x})"
            ),
            WireError::UnknownKind { found } => write!(f, "unknown frame kind {found}"),
            WireError::ReservedFlags { found } => {
                write!(
                    f,
                    "frame flags {found:#06x} are reserved in version {VERSION}"
                )
            }
            WireError::PayloadTooLarge { kind, len, max } => {
                write!(
                    f,
                    "{kind:?} frame announces {len} payload bytes, more than {max}"
                )
            }
            WireError::EmptyPayload { kind } => write!(f, "{kind} frame has no payload"),
            WireError::NotDataFrame { kind } => {
                write!(
                    f,
                    "{kind:?} frame where a contribution or result was expected"
                )
            }
            WireError::NotControlFrame { kind } => {
                write!(f, "{kind} frame where a control frame was expected")
            }
            WireError::NoRegionAddress { kind } => {
                write!(
                    f,
                    "{kind} frame where a write or message frame was expected"
                )
            }
            WireError::ReservedAddressBits { found } => {
                write!(f, "reserved region-address bits set: {found:#x}")
            }
            WireError::WrongJob { expected, found } => {
                write!(f, "frame for job {found:#x}, this is job {expected:#x}")
            }
            WireError::UnknownRank { rank, world_size } => {
                write!(
                    f,
                    "frame from rank {rank}, outside the job's {world_size} ranks"
                )
            }
            WireError::FromSelf { rank } => {
                write!(f, "frame claims to come from rank {rank} itself")
            }
            WireError::WrongRail {
                source_rank,
                rail,
                expected,
            } => write!(
                f,
                "data frame from rank {source_rank} on rail {rail}; this device is on rail {expected}"
            ),
            WireError::FromOwnMachine { source_rank } => write!(
                f,
                "data frame from rank {source_rank}, on the receiver's own machine"
            ),
            WireError::SliceOutOfRange { slice, slices } => {
                write!(
                    f,
                    "frame for slice {slice}; the operation has {slices} slices"
                )
            }
            WireError::ShardOutOfRange { shard, shards } => {
                write!(f, "frame for shard {shard}; the slice has {shards} shards")
            }
            WireError::NotServer { shard, server } => write!(
                f,
                "frame for shard {shard} does not match its server, machine {server}"
            ),
            WireError::NotTreeNeighbour { shard, tree, from } => write!(
                f,
                "frame for shard {shard} from machine {from}, which is not this machine's \
                 child (for a contribution) or parent (for a result) in tree {tree}"
            ),
            WireError::PartOutOfRange { part, parts } => write!(
                f,
                "frame for part {part} of a cell that travels in {parts} parts"
            ),
            WireError::LengthMismatch { expected, found } => write!(
                f,
                "frame announces {found} payload bytes; the cell's part has {expected}"
            ),
            WireError::OutsideBuffer {
                offset,
                len,
                buffer,
            } => write!(
                f,
                "payload of {len} bytes at offset {offset} does not fit a staging buffer of {buffer} bytes"
            ),
            WireError::GeometryMismatch => {
                f.write_str("the plan was made under a different geometry than the frame check")
            }
            WireError::RoutedInGroups => f.write_str(
                "the geometry reduces its slots in groups, whose writes frames do not place",
            ),
        }
    }
}

impl core::error::Error for WireError {}
