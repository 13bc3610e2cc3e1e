//! The frame header: layout, encoding, decoding.

use super::WireError;
use super::crc32c::crc32c;
use crate::named_enum::named_enum;
use crate::plan::{Cell, PlanConfig};

/// Bytes in an encoded header.
pub const HEADER_LEN: usize = 48;

// A header carries a cell's part in one byte.
const _: () = assert!(crate::plan::TREE_PARTS <= 256);
/// The first four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"FRNG";
/// The protocol version this code writes and reads: a process of another
/// version is refused when it connects (the tcp handshake reads it from every
/// frame, the verbs endpoints bind it into their MAC). Version 2: dedicated
/// servers serve in rail groups (`Geometry::with_servers`), so cells go to
/// other servers and other areas than in version 1; and through the trees a
/// cell travels in up to [`TREE_PARTS`](crate::plan::TREE_PARTS) parts of at
/// least the minimum shard (`Slice::parts`), not in two. Version 3: where
/// no slice size is given, slices through the trees are 16 MiB, not 25
/// ([`PlanConfig::with_default_slices`](crate::plan::PlanConfig::with_default_slices)),
/// and on the flat plan a tensor of fewer than four full slices is cut in four
/// ([`Geometry::slice_bytes_for`](crate::plan::Geometry::slice_bytes_for)), so a
/// job's processes of versions 2 and 3 would cut its tensors differently.
/// Version 4: where no slice size is given and a 25 MiB slice's slot holds
/// fewer shards of the minimum than there are machines, slices are 32 MiB on
/// the flat plan where that slot holds enough
/// ([`PlanConfig::WIDE_FLAT_SLICE_BYTES`](crate::plan::PlanConfig::WIDE_FLAT_SLICE_BYTES)),
/// where version 3 went through the trees. Version 5: the GPUs of a machine
/// reduce-scatter a slice of equal slots of at least 20 MiB with one NCCL
/// call where version 4 made one per slot (`fairring`'s
/// `reduces_in_one_call`), so a machine's ranks of versions 4 and 5 would
/// issue different calls on their communicator; and where no slice size is
/// given, slices through the trees are 20 MiB, not 16, and a tensor of fewer
/// than four of them is cut in four, as on the flat plan. Version 6: on two
/// to seven machines whose GPUs reduce in their NVSwitch, a device all-reduce
/// of some sizes runs as one NCCL all-reduce over the whole job (a
/// descriptor's algorithm 6), where version 5 ran the plan.
pub const VERSION: u8 = 6;
/// Largest payload of a `Hello` frame (the handshake of the fabric).
pub const MAX_HELLO_PAYLOAD: u32 = 4096;
/// Largest payload of an `Abort` frame (a UTF-8 reason).
pub const MAX_ABORT_PAYLOAD: u32 = 1024;
/// Largest payload of a `Write` frame: 2 GiB, the largest message an RDMA write
/// may carry, so a fabric's writes mean the same on every provider.
pub const MAX_WRITE_PAYLOAD: u32 = 1 << 31;
/// Largest payload of a `Message` frame: a small control message (a credit, an
/// abort reason) that a completion carries inline.
pub const MAX_MESSAGE_PAYLOAD: u32 = 64;
/// Largest payload of a `Contribution` or `Result` frame: one cell, which is never
/// larger than a slice.
#[expect(clippy::cast_possible_truncation, reason = "1 GiB fits u32")]
pub const MAX_DATA_PAYLOAD: u32 = PlanConfig::MAX_SLICE_BYTES as u32;

named_enum! {
    /// What a frame carries.
    pub enum FrameKind {
        /// Connection set-up; the payload belongs to the fabric's handshake.
        Hello = 1 => "hello",
        /// A client's contribution to a shard: one cell, sent to the shard's server.
        Contribution = 2 => "contribution",
        /// A server's reduced shard: one cell, sent back to a client.
        Result = 3 => "result",
        /// Flow control: the sender's staging buffer for `(sequence, slice)` is acquired
        /// and may be written. No payload.
        Credit = 4 => "credit",
        /// The sender aborts the job; the payload is an optional UTF-8 reason.
        Abort = 5 => "abort",
        /// A fabric's one-sided write: the payload lands in the receiver's memory
        /// region at an offset, both named by the frame's [`RegionAddress`](super::RegionAddress).
        Write = 6 => "write",
        /// A fabric's small control message, delivered whole to the receiver with the
        /// immediate data of its [`RegionAddress`](super::RegionAddress).
        Message = 7 => "message",
        /// A fabric's keep-alive: proof that the sender is alive. No payload.
        Keepalive = 8 => "keepalive",
    }
}

impl FrameKind {
    /// The largest payload a frame of this kind may announce.
    pub const fn max_payload(self) -> u32 {
        match self {
            FrameKind::Hello => MAX_HELLO_PAYLOAD,
            FrameKind::Contribution | FrameKind::Result => MAX_DATA_PAYLOAD,
            FrameKind::Credit | FrameKind::Keepalive => 0,
            FrameKind::Abort => MAX_ABORT_PAYLOAD,
            FrameKind::Write => MAX_WRITE_PAYLOAD,
            FrameKind::Message => MAX_MESSAGE_PAYLOAD,
        }
    }

    /// Whether bytes 16..36 of the header hold a [`RegionAddress`](super::RegionAddress) (`Write` and
    /// `Message`) rather than an operation, slice and shard.
    pub const fn has_region_address(self) -> bool {
        matches!(self, FrameKind::Write | FrameKind::Message)
    }

    /// Whether the frame carries a cell of tensor data.
    pub const fn is_data(self) -> bool {
        matches!(self, FrameKind::Contribution | FrameKind::Result)
    }
}

/// The fixed-size header that precedes every frame's payload.
///
/// Encoded little-endian, [`HEADER_LEN`] bytes:
///
/// ```text
/// offset size field
///  0      4   magic "FRNG"
///  4      1   version (`VERSION`)
///  5      1   kind (FrameKind)
///  6      1   part of the cell (`Contribution`, `Result`; zero in any
///             other frame, and where a cell travels whole)
///  7      1   flags (zero in versions 1 and 2)
///  8      8   job tag
/// 16      8   sequence: the collective operation's number, the same on every rank
/// 24      8   slice index within the operation
/// 32      4   shard index within the slice
/// 36      4   source rank
/// 40      4   payload length in bytes
/// 44      4   CRC-32C of bytes 0..44
/// ```
///
/// `Write` and `Message` frames, which a fabric sends on behalf of its user, read
/// bytes 16..36 as a [`RegionAddress`](super::RegionAddress) instead (see [`FrameHeader::for_region`]):
///
/// ```text
/// 16      8   offset within the region          (the `sequence` field)
/// 24      4   region key                         (the low half of `slice`)
/// 28      4   zero                               (the high half of `slice`)
/// 32      4   immediate data                     (the `shard` field)
/// ```
///
/// [`FrameHeader::decode`] refuses a header whose magic, version, checksum, kind,
/// flags or payload length (for its kind) is wrong. Whether a well-formed header fits
/// the receiver's plan is [`FrameCheck`](super::FrameCheck)'s job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrameHeader {
    /// What the frame carries.
    pub kind: FrameKind,
    /// The job the frame belongs to.
    pub job_tag: u64,
    /// The collective operation's sequence number.
    pub sequence: u64,
    /// The slice within the operation.
    pub slice: u64,
    /// The shard within the slice.
    pub shard: u32,
    /// The rank that sent the frame.
    pub source_rank: u32,
    /// Bytes of payload after the header.
    pub payload_len: u32,
    /// The part of the cell a `Contribution` or `Result` carries
    /// ([`Cell::part`]): 0 where cells travel whole, and in every other frame.
    pub part: u8,
}

impl FrameHeader {
    /// The header of a `Contribution` or `Result` frame carrying part `part`
    /// of `cell` (0, the whole cell, where it travels whole: [`Cell::parts`]).
    pub fn for_cell(
        kind: FrameKind,
        job_tag: u64,
        sequence: u64,
        cell: &Cell,
        part: u32,
        source_rank: u32,
    ) -> Result<FrameHeader, WireError> {
        if !kind.is_data() {
            return Err(WireError::NotDataFrame { kind });
        }
        let span = cell.part(part).map_err(|_| WireError::PartOutOfRange {
            part,
            parts: cell.parts(),
        })?;
        let payload_len =
            u32::try_from(span.byte_len()).map_err(|_| WireError::PayloadTooLarge {
                kind,
                len: u32::MAX,
                max: kind.max_payload(),
            })?;
        Ok(FrameHeader {
            kind,
            job_tag,
            sequence,
            slice: cell.slice(),
            shard: cell.shard(),
            source_rank,
            payload_len,
            // Below TREE_PARTS (checked above).
            #[expect(
                clippy::cast_possible_truncation,
                reason = "part < Cell::parts <= TREE_PARTS = 16"
            )]
            part: part as u8,
        })
    }

    /// Encodes the header, checksum included.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.kind as u8;
        out[6] = self.part;
        // out[7]: flags, zero.
        out[8..16].copy_from_slice(&self.job_tag.to_le_bytes());
        out[16..24].copy_from_slice(&self.sequence.to_le_bytes());
        out[24..32].copy_from_slice(&self.slice.to_le_bytes());
        out[32..36].copy_from_slice(&self.shard.to_le_bytes());
        out[36..40].copy_from_slice(&self.source_rank.to_le_bytes());
        out[40..44].copy_from_slice(&self.payload_len.to_le_bytes());
        let crc = crc32c(&out[..44]);
        out[44..48].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and checks a header. Refuses anything but a header this version
    /// writes: nothing about the payload may be trusted before this returns `Ok`.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<FrameHeader, WireError> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(WireError::BadMagic { found: magic });
        }
        if bytes[4] != VERSION {
            return Err(WireError::UnsupportedVersion { found: bytes[4] });
        }
        let stored = u32_at(bytes, 44);
        let computed = crc32c(&bytes[..44]);
        if stored != computed {
            return Err(WireError::BadChecksum { stored, computed });
        }
        let kind =
            FrameKind::from_u8(bytes[5]).ok_or(WireError::UnknownKind { found: bytes[5] })?;
        // Byte 6 is a data frame's part, and reserved in every other frame.
        let reserved = if kind.is_data() {
            [0, bytes[7]]
        } else {
            [bytes[6], bytes[7]]
        };
        let flags = u16::from_le_bytes(reserved);
        if flags != 0 {
            return Err(WireError::ReservedFlags { found: flags });
        }
        let payload_len = u32_at(bytes, 40);
        if payload_len > kind.max_payload() {
            return Err(WireError::PayloadTooLarge {
                kind,
                len: payload_len,
                max: kind.max_payload(),
            });
        }
        if kind.is_data() && payload_len == 0 {
            return Err(WireError::EmptyPayload { kind });
        }
        Ok(FrameHeader {
            kind,
            job_tag: u64_at(bytes, 8),
            sequence: u64_at(bytes, 16),
            slice: u64_at(bytes, 24),
            shard: u32_at(bytes, 32),
            source_rank: u32_at(bytes, 36),
            payload_len,
            part: if kind.is_data() { bytes[6] } else { 0 },
        })
    }
}

fn u32_at(bytes: &[u8; HEADER_LEN], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(bytes: &[u8; HEADER_LEN], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}
