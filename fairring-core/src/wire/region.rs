//! The address a fabric's `Write` and `Message` frames carry.

use super::WireError;
use super::header::{FrameHeader, FrameKind};

/// Where a `Write` frame's payload lands, and the immediate data delivered with it.
///
/// A `Message` frame carries one too; only its `immediate` means anything and the
/// other fields are zero. The address occupies bytes 16..36 of the header; the
/// layout is in [`FrameHeader`]'s documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegionAddress {
    /// The receiver's key for the memory region written.
    pub region: u32,
    /// Byte offset of the payload's first byte within the region.
    pub offset: u64,
    /// Immediate data, delivered to the receiver with the write's completion.
    pub immediate: u32,
}

impl FrameHeader {
    /// The header of a frame that addresses nothing (`Hello`, `Abort`,
    /// `Keepalive`): bytes 16..36 are zero.
    pub const fn control(
        kind: FrameKind,
        job_tag: u64,
        source_rank: u32,
        payload_len: u32,
    ) -> FrameHeader {
        FrameHeader {
            kind,
            job_tag,
            sequence: 0,
            slice: 0,
            shard: 0,
            source_rank,
            payload_len,
            part: 0,
        }
    }

    /// The header of a `Write` or `Message` frame.
    ///
    /// Refuses any other kind ([`WireError::NoRegionAddress`]) and a payload longer
    /// than the kind allows.
    pub fn for_region(
        kind: FrameKind,
        job_tag: u64,
        source_rank: u32,
        address: RegionAddress,
        payload_len: u32,
    ) -> Result<FrameHeader, WireError> {
        if !kind.has_region_address() {
            return Err(WireError::NoRegionAddress { kind });
        }
        if payload_len > kind.max_payload() {
            return Err(WireError::PayloadTooLarge {
                kind,
                len: payload_len,
                max: kind.max_payload(),
            });
        }
        Ok(FrameHeader {
            kind,
            job_tag,
            sequence: address.offset,
            slice: u64::from(address.region),
            shard: address.immediate,
            source_rank,
            payload_len,
            part: 0,
        })
    }

    /// Reads the region address of a `Write` or `Message` frame.
    ///
    /// Refuses other kinds and an address whose reserved bits (28..32) are set.
    pub fn region_address(&self) -> Result<RegionAddress, WireError> {
        if !self.kind.has_region_address() {
            return Err(WireError::NoRegionAddress { kind: self.kind });
        }
        let region = u32::try_from(self.slice).map_err(|_| WireError::ReservedAddressBits {
            found: (self.slice >> 32) as u32,
        })?;
        Ok(RegionAddress {
            region,
            offset: self.sequence,
            immediate: self.shard,
        })
    }
}
