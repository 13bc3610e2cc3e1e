//! The layout of one staging buffer.

use super::{ALIGN_BYTES, Geometry, PlanError, Span};

/// Where the pieces of one slice live in a staging buffer of one device.
///
/// ```text
/// offset 0            slot_bytes                                   total_bytes
/// | slot              | contribution 0 | contribution 1 | ... | contribution M-2 |
/// ```
///
/// - **slot**: the device's slot of the slice after the intra-machine reduce-scatter.
///   The device cuts it into shards and sends them as contributions; the shard it
///   serves is reduced *in place* here (it already holds this machine's
///   contribution), so the reduced shard is this range of the slot, and results from
///   the other servers land here too, at their shard's offset. After the last result
///   the slot is final and feeds the intra-machine all-gather. An engine that stages
///   in the caller's tensor (as the GPU path does when `D > 1`) uses the slot range of
///   the tensor instead and leaves this range unused.
/// - **contributions**: one area per *other* machine, `shard_stride` bytes each,
///   receiving that machine's contribution to the shard this device serves. The
///   stride is an odd number of cache lines, so that the areas start in different
///   cache sets: the reduction reads all of them at the same offsets at once, and
///   with a power-of-two stride they evict each other (measured: the one-pass
///   reduction of 7 contributions of 8 MiB ran 0.55x to 1.6x as fast as pairwise
///   from run to run with a 2^k stride, 1.5x to 1.9x with one extra cache line).
///
/// The buffer is large enough for any slice of any tensor under its
/// [`Geometry`]: its slot area for a full slice, its contribution areas for the
/// largest cell any slice can have (a full slice's shard, or, for slices small enough
/// to use fewer shards, less than twice the minimum shard). Every offset is a
/// multiple of [`ALIGN_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StagingLayout {
    slot_bytes: u64,
    shard_stride: u64,
    sources: u32,
}

impl StagingLayout {
    pub(crate) const fn for_geometry(geometry: &Geometry) -> StagingLayout {
        let lines = geometry.max_shard_units();
        let odd_lines = lines | 1;
        StagingLayout {
            slot_bytes: geometry.slot_units() * ALIGN_BYTES,
            shard_stride: odd_lines * ALIGN_BYTES,
            sources: geometry.topology().machines() - 1,
        }
    }

    /// The slot area, in bytes from the start of the buffer.
    pub const fn slot(&self) -> Span {
        Span::bytes(0, self.slot_bytes)
    }

    /// Bytes reserved for each contribution: no cell of any slice is larger.
    pub const fn shard_stride(&self) -> u64 {
        self.shard_stride
    }

    /// Number of contribution areas: `M - 1`.
    pub const fn contribution_areas(&self) -> u32 {
        self.sources
    }

    /// The area, in bytes from the start of the buffer, that receives machine
    /// `from`'s contribution at a device of machine `own`.
    ///
    /// Area `i` belongs to machine `(own + 1 + i) mod M`: the areas rotate with the
    /// receiving machine so that every pair of machines uses a fixed area.
    pub const fn contribution(&self, from: u32, own: u32) -> Result<Span, PlanError> {
        let machines = self.sources + 1;
        if from >= machines {
            return Err(PlanError::MachineOutOfRange {
                machine: from,
                machines,
            });
        }
        if own >= machines {
            return Err(PlanError::MachineOutOfRange {
                machine: own,
                machines,
            });
        }
        if from == own {
            return Err(PlanError::OwnContribution { machine: own });
        }
        // (from - own - 1) mod M, in 0..M-1.
        let index = (from + machines - own - 1) % machines;
        Ok(Span::bytes(
            self.slot_bytes + index as u64 * self.shard_stride,
            self.shard_stride,
        ))
    }

    /// Total bytes of one staging buffer.
    pub const fn total_bytes(&self) -> u64 {
        self.slot_bytes + self.sources as u64 * self.shard_stride
    }
}
