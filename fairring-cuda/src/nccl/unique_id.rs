//! The 128-byte id every rank of a communicator is created from.

use cudarc::nccl::sys::{self, ncclUniqueId};

use crate::error::{self, Library, Result};
use crate::probe;

/// An NCCL unique id: made by one rank ([`UniqueId::new`]), passed to the others
/// as 128 bytes through the job's rendezvous store, and given to
/// [`Communicator::new`](super::Communicator::new) by every rank.
///
/// ```no_run
/// # use fairring_cuda::nccl::UniqueId;
/// # fn set(_: &str, _: &[u8]) {} fn get(_: &str) -> Vec<u8> { vec![0; 128] }
/// # fn main() -> fairring_cuda::Result<()> {
/// # let local_rank = 0;
/// let id = if local_rank == 0 {
///     let id = UniqueId::new()?;
///     set("machine/0/nccl_id", id.as_bytes());
///     id
/// } else {
///     UniqueId::from_bytes(&get("machine/0/nccl_id"))?
/// };
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId([u8; UniqueId::BYTES]);

impl UniqueId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`): NCCL opens its bootstrap listener, whose
    /// address the id carries. Needs NCCL, not a device.
    pub fn new() -> Result<UniqueId> {
        probe::require(Library::Nccl)?;
        let mut raw = ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes one 128-byte id.
        let status = unsafe { sys::ncclGetUniqueId(&mut raw) };
        error::nccl("ncclGetUniqueId", status, None)?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// The id received from another rank; an error names the length when it is
    /// not 128 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let bytes: [u8; Self::BYTES] = bytes.try_into().map_err(|_| {
            error::invalid(
                "NCCL unique id",
                format!(
                    "it has {} bytes, and an id has {}",
                    bytes.len(),
                    Self::BYTES
                ),
            )
        })?;
        Ok(UniqueId(bytes))
    }

    /// The id's bytes, to send to the other ranks.
    pub fn as_bytes(&self) -> &[u8; Self::BYTES] {
        &self.0
    }

    pub(crate) fn raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The id holds a bootstrap address: show enough to tell ids apart.
        write!(f, "UniqueId({:02x?}..)", &self.0[..8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_travel_as_exactly_128_bytes() {
        let bytes: Vec<u8> = (0..128u8).map(|b| b.wrapping_mul(37)).collect();
        let id = UniqueId::from_bytes(&bytes).unwrap();
        assert_eq!(id.as_bytes().as_slice(), bytes.as_slice());
        let raw = id.raw();
        assert_eq!(raw.internal[5] as u8, bytes[5]);
        assert_eq!(raw.internal[127] as u8, bytes[127]);
        for len in [0, 127, 129] {
            let e = UniqueId::from_bytes(&vec![0; len]).unwrap_err().to_string();
            assert!(e.contains(&format!("{len} bytes")), "{e}");
        }
    }
}
