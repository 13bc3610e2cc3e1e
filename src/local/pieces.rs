//! How a reduce-scatter's slice lies in the machine's staging buffers when the
//! machine's ranks reduce it together before it goes around the machines.
//!
//! A reduce-scatter plans each rank's share: slice `[a, b)` stands for that
//! range of every rank's share, one *piece* per rank. For the local step the
//! pieces are grouped by device: slot `d` of the staging buffer holds the
//! pieces of device `d` on every machine, machine by machine,
//!
//! ```text
//! [(d * M + m) * len, + len)   the piece of the rank at (machine m, device d)
//! ```
//!
//! so that, after the machine's reduce-scatter, device `d` holds the machine's
//! partial sum of every piece its rail reduces, in the order the rail's ring
//! walks them. Slots are whole runs of `M` pieces; a piece is read from the
//! tensor at its rank's share.

use std::ops::Range;

use fairring_core::topology::{Location, Topology};

use crate::error::{Error, Result};

/// The pieces of one reduce-scatter slice, staged slot by slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RailPieces {
    topology: Topology,
    /// Bytes of one rank's share in the tensor.
    share: u64,
    /// Bytes of one piece (the slice's).
    len: usize,
}

impl RailPieces {
    /// The pieces of a slice of `len` bytes of shares of `share` bytes.
    pub(crate) fn new(topology: Topology, share: u64, len: usize) -> RailPieces {
        RailPieces {
            topology,
            share,
            len,
        }
    }

    /// Where the piece of the rank at (`machine`, `device`) is staged.
    pub(crate) fn staged(&self, device: u32, machine: u32) -> Result<Range<usize>> {
        let machines = self.topology.machines() as usize;
        let start = (device as usize)
            .checked_mul(machines)
            .and_then(|i| i.checked_add(machine as usize))
            .and_then(|i| i.checked_mul(self.len))
            .filter(|_| machine < self.topology.machines())
            .ok_or_else(|| self.beyond(device, machine))?;
        Ok(start..start + self.len)
    }

    /// Where that piece is in the tensor, from the slice's start (which is in
    /// share 0).
    pub(crate) fn in_tensor(&self, device: u32, machine: u32) -> Result<Range<usize>> {
        let rank = self
            .topology
            .rank(Location { machine, device })
            .map_err(|e| Error::internal("every piece belongs to a rank", e.to_string()))?;
        let start = self
            .share
            .checked_mul(u64::from(rank))
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| self.beyond(device, machine))?;
        Ok(start..start + self.len)
    }

    /// Calls `each(in_tensor, staged)` for every piece of slot `device`, machine
    /// by machine.
    pub(crate) fn for_each_in_slot(
        &self,
        device: u32,
        mut each: impl FnMut(Range<usize>, Range<usize>) -> Result<()>,
    ) -> Result<()> {
        for machine in 0..self.topology.machines() {
            each(
                self.in_tensor(device, machine)?,
                self.staged(device, machine)?,
            )?;
        }
        Ok(())
    }

    fn beyond(&self, device: u32, machine: u32) -> Error {
        Error::internal(
            "a reduce-scatter's pieces fit the address space",
            format!("piece of machine {machine}, device {device} in {self:?}"),
        )
    }
}

#[cfg(test)]
mod tests {
    use fairring_core::topology::RankLayout;

    use super::*;

    #[test]
    fn slots_hold_each_devices_pieces_machine_by_machine_without_overlap() {
        for layout in [RankLayout::Contiguous, RankLayout::Interleaved] {
            let t = Topology::new(3, 2, layout).unwrap();
            let pieces = RailPieces::new(t, 1000, 40);
            let mut staged = Vec::new();
            let mut shares = Vec::new();
            for device in 0..2 {
                let mut at = Vec::new();
                pieces
                    .for_each_in_slot(device, |tensor, buffer| {
                        assert_eq!(tensor.len(), 40);
                        assert_eq!(buffer.len(), 40);
                        at.push(buffer.start);
                        shares.push(tensor.start / 1000);
                        staged.push(buffer);
                        Ok(())
                    })
                    .unwrap();
                // One slot is M pieces side by side, slot d after slot d - 1.
                let first = usize::try_from(device).unwrap() * 3 * 40;
                assert_eq!(at, [first, first + 40, first + 80], "{layout:?}");
            }
            staged.sort_by_key(|r| r.start);
            assert!(staged.windows(2).all(|w| w[0].end <= w[1].start));
            // Every rank's share is read exactly once, at its rank's place.
            shares.sort_unstable();
            assert_eq!(shares, [0, 1, 2, 3, 4, 5], "{layout:?}");
            for machine in 0..3 {
                for device in 0..2 {
                    let rank = t.rank(Location { machine, device }).unwrap() as usize;
                    let r = pieces.in_tensor(device, machine).unwrap();
                    assert_eq!(r, rank * 1000..rank * 1000 + 40);
                }
            }
        }
    }

    #[test]
    fn a_piece_outside_the_job_is_an_error() {
        let t = Topology::new(2, 2, RankLayout::Contiguous).unwrap();
        let pieces = RailPieces::new(t, 64, 64);
        assert!(pieces.staged(0, 2).is_err());
        assert!(pieces.in_tensor(2, 0).is_err());
        let huge = RailPieces::new(t, u64::MAX / 2, usize::MAX / 2);
        assert!(huge.staged(1, 1).is_err());
        assert!(huge.in_tensor(1, 1).is_err());
    }
}
