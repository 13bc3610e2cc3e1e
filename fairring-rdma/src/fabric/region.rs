//! Names for memory: a region's key, the descriptor a peer writes through, and the
//! endpoint a peer connects to.

use core::fmt;

/// The key of a registered memory region, unique within its fabric for the
/// fabric's lifetime (keys are never reused, so a late write meant for a
/// deregistered region can never land in a newer one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionKey(pub u32);

impl fmt::Display for RegionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "region {}", self.0)
    }
}

/// What a peer needs to write into a region: its key, the base address the
/// provider writes relative to (zero for tcp, the virtual address for verbs), and
/// its length. Exchanged between ranks as [`RemoteRegion::BYTES`] bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// The region's key (the rkey for verbs).
    pub key: u32,
    /// The base address writes are relative to.
    pub address: u64,
    /// The region's length in bytes.
    pub len: u64,
}

impl RemoteRegion {
    /// Bytes in the encoded form.
    pub const BYTES: usize = 24;

    /// Encodes the descriptor, little-endian: address, length, key, four zero bytes.
    pub fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0; Self::BYTES];
        out[0..8].copy_from_slice(&self.address.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..20].copy_from_slice(&self.key.to_le_bytes());
        out
    }

    /// Decodes a descriptor; `None` unless `bytes` is exactly one with zero padding.
    pub fn from_bytes(bytes: &[u8]) -> Option<RemoteRegion> {
        let bytes: &[u8; Self::BYTES] = bytes.try_into().ok()?;
        if bytes[20..24] != [0; 4] {
            return None;
        }
        let word = |at: usize| {
            let mut b = [0; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let mut key = [0; 4];
        key.copy_from_slice(&bytes[16..20]);
        Some(RemoteRegion {
            address: word(0),
            len: word(8),
            key: u32::from_le_bytes(key),
        })
    }

    /// Checks that `len` bytes at `offset` lie inside the region.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }
}

/// How a peer reaches this process: provider-specific bytes (a socket address for
/// tcp; a queue pair's number, LID and GID for verbs), small enough for any
/// rendezvous store.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    len: u8,
    bytes: [u8; Endpoint::CAPACITY],
}

impl Endpoint {
    /// The largest endpoint, in bytes.
    pub const CAPACITY: usize = 64;

    /// An endpoint of `bytes`, or `None` if longer than [`Endpoint::CAPACITY`].
    pub fn from_bytes(bytes: &[u8]) -> Option<Endpoint> {
        let len = u8::try_from(bytes.len())
            .ok()
            .filter(|&l| usize::from(l) <= Self::CAPACITY)?;
        let mut out = [0; Self::CAPACITY];
        out[..bytes.len()].copy_from_slice(bytes);
        Some(Endpoint { len, bytes: out })
    }

    /// The endpoint's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Endpoint({:02x?})", self.as_bytes())
    }
}
