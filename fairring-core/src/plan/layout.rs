//! The layout of one staging buffer.

use core::ops::Range;

use super::{
    ALIGN_BYTES, Geometry, MOST_INTERVALS, MachineGroups, PlanError, Routing, ServerGroups, Span,
};

/// What the first area of a staging buffer holds: where a slice waits for the
/// intra-machine reduce-scatter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InputArea {
    /// One slot: the device's share of the slice. For an engine whose local step
    /// reads the caller's tensor in place (NCCL's in-place reduce-scatter, as the
    /// GPU path does when `D > 1`): it uses the slot range of the tensor, and this
    /// area holds the slot when the tensor cannot.
    Slot,
    /// The whole slice, every local device's slot at its offset in the slice: for
    /// an engine whose devices stage in each other's slots (the host's
    /// shared-memory step, where device `d` reads slot `d` of every other local
    /// device's buffer).
    Slice,
}

/// Where the pieces of one slice live in a staging buffer of one device.
///
/// ```text
/// offset 0            input bytes                                  total_bytes
/// | input area        | contribution 0 | contribution 1 | ... | contribution M-2 |
/// ```
///
/// - **input area** ([`slot`](StagingLayout::slot)): the device's slot of the slice
///   ([`InputArea::Slot`]), or the whole slice with the device's slot at its offset
///   in it ([`InputArea::Slice`]). After the intra-machine reduce-scatter the
///   device's slot holds the machine's partial sum. The device cuts it into shards
///   and sends them as contributions; the shard it serves is reduced *in place*
///   there (it already holds this machine's contribution), so the reduced shard is
///   that range of the slot, and results from the other servers land there too, at
///   their shard's offset. After the last result the slot is final and feeds the
///   intra-machine all-gather.
/// - **contributions**: one area per *other* machine, `shard_stride` bytes each,
///   receiving that machine's contribution to the shard this device serves. The
///   stride is an odd number of cache lines, so that the areas start in different
///   cache sets: the reduction reads all of them at the same offsets at once, and
///   with a power-of-two stride they evict each other (measured: the one-pass
///   reduction of 7 contributions of 8 MiB ran 0.55x to 1.6x as fast as pairwise
///   from run to run with a 2^k stride, 1.5x to 1.9x with one extra cache line).
///
/// Where cells travel through trees ([`Routing::Trees`]) there are two
/// contribution areas whatever `M`, one per child ([`StagingLayout::child`]):
/// a device receives contributions only from its children in the one tree in
/// which its machine is an inner node.
///
/// The buffer is large enough for any slice of any tensor under its
/// [`Geometry`]: its input area for a full slot (or slice), its contribution areas
/// for the largest cell any slice can have (a full slice's shard, or, for slices
/// small enough to use fewer shards, less than twice the minimum shard). Every
/// offset is a multiple of [`ALIGN_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StagingLayout {
    /// Bytes of the input area.
    slot_bytes: u64,
    shard_stride: u64,
    sources: u32,
    machines: u32,
    routing: Routing,
    input: InputArea,
}

impl StagingLayout {
    pub(crate) const fn for_geometry(geometry: &Geometry, input: InputArea) -> StagingLayout {
        let lines = geometry.max_shard_units();
        let odd_lines = lines | 1;
        StagingLayout {
            slot_bytes: match input {
                InputArea::Slot => geometry.full_slot_bytes(),
                InputArea::Slice => geometry.full_slice_bytes(),
            },
            shard_stride: odd_lines * ALIGN_BYTES,
            // Machines receive no contributions when dedicated servers serve,
            // through trees only from their children, and in groups into the
            // areas of a `TwoLevelLayout` instead.
            sources: match (geometry.servers(), geometry.routing()) {
                (Some(_), _) | (None, Routing::Groups) => 0,
                (None, Routing::Trees) => 2,
                (None, Routing::Flat) => geometry.topology().machines() - 1,
            },
            machines: geometry.topology().machines(),
            routing: geometry.routing(),
            input,
        }
    }

    /// The input area, in bytes from the start of the buffer: room for a full slot
    /// or a full slice (see [`InputArea`]).
    pub const fn slot(&self) -> Span {
        Span::bytes(0, self.slot_bytes)
    }

    /// What the input area holds.
    pub const fn input(&self) -> InputArea {
        self.input
    }

    /// Bytes reserved for each contribution: no cell of any slice is larger.
    pub const fn shard_stride(&self) -> u64 {
        self.shard_stride
    }

    /// Number of contribution areas: `M - 1`, or 0 with dedicated servers or
    /// in groups (whose areas a [`TwoLevelLayout`] lays out), or 2 through
    /// trees.
    pub const fn contribution_areas(&self) -> u32 {
        self.sources
    }

    /// The area, in bytes from the start of the buffer, that receives machine
    /// `from`'s contribution at a device of machine `own`.
    ///
    /// Area `i` belongs to machine `(own + 1 + i) mod M`: the areas rotate with the
    /// receiving machine so that every pair of machines uses a fixed area.
    /// Through trees contributions land by child instead: [`StagingLayout::child`];
    /// this query is refused with [`PlanError::RoutedThroughTrees`]. In groups
    /// they land in a [`TwoLevelLayout`]'s areas: refused with
    /// [`PlanError::RoutedInGroups`].
    pub const fn contribution(&self, from: u32, own: u32) -> Result<Span, PlanError> {
        match self.routing {
            Routing::Trees => return Err(PlanError::RoutedThroughTrees),
            Routing::Groups => return Err(PlanError::RoutedInGroups),
            Routing::Flat => {}
        }
        let machines = self.machines;
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

    /// Through trees, the area that receives the contribution of a device's
    /// child `child` (0 for the left child, 1 for the right one, as
    /// [`DoubleTree::children`](super::DoubleTree::children) lists them).
    /// Refused with [`PlanError::ChildOutOfRange`] past the second child or
    /// where cells go straight to their server (no children).
    pub const fn child(&self, child: u32) -> Result<Span, PlanError> {
        let children = match self.routing {
            Routing::Trees => self.sources,
            Routing::Flat | Routing::Groups => 0,
        };
        if child >= children {
            return Err(PlanError::ChildOutOfRange { child, children });
        }
        Ok(Span::bytes(
            self.slot_bytes + child as u64 * self.shard_stride,
            self.shard_stride,
        ))
    }

    /// How the cells travel, as the geometry it was made for routes them.
    pub const fn routing(&self) -> Routing {
        self.routing
    }

    /// Total bytes of one staging buffer.
    pub const fn total_bytes(&self) -> u64 {
        self.slot_bytes + self.sources as u64 * self.shard_stride
    }
}

/// Where a dedicated server keeps one slice in a staging buffer: one area per cell
/// it receives. A server serves the slots of its rail group
/// ([`Geometry::server_rails`] `R`): slots `d` with `d mod R` its own, `D / R` of
/// them. Machine `m`'s cell of slot `d` lands at area `(d / R) * M + m`.
///
/// ```text
/// offset 0                                                              total_bytes
/// | (d/R 0, m 0) | ... | (d/R 0, m M-1) | (d/R 1, m 0) | ... | (d/R D/R-1, m M-1) |
/// ```
///
/// Each area is `shard_stride` bytes, the same odd number of cache lines as a
/// machine's contribution areas ([`StagingLayout`]): no cell of any slice is
/// larger. The server sums each slot's cells into machine 0's area, and sends the
/// sum back from there.
///
/// **The folds.** It takes the other machines' cells in machine order, in
/// [`ServerLayout::folds`] reductions of up to [`SERVER_FOLD_CELLS`] cells each
/// ([`ServerLayout::fold`]): a fold reads the accumulator once and writes it
/// once for all its cells, so a cell costs the server's memory its own read and
/// a share of one read and one write, not the two reads and a write of a cell
/// reduced alone. A fold
/// starts once its cells have all landed and the one before it has ended. Its
/// cells and boundaries do not depend on when anything lands, so the sum is taken
/// in the same order, with the same roundings, on every run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServerLayout {
    shard_stride: u64,
    machines: u32,
    devices: u32,
    /// Rail groups `R`, a divisor of `devices`.
    rails: u32,
}

impl ServerLayout {
    pub(crate) const fn for_geometry(geometry: &Geometry) -> ServerLayout {
        let lines = geometry.max_shard_units();
        ServerLayout {
            shard_stride: (lines | 1) * ALIGN_BYTES,
            machines: geometry.topology().machines(),
            devices: geometry.topology().devices_per_machine(),
            rails: geometry.server_rails(),
        }
    }

    /// Bytes reserved for each cell.
    pub const fn shard_stride(&self) -> u64 {
        self.shard_stride
    }

    /// The machines whose cells a server sums, `M`.
    pub const fn machines(&self) -> u32 {
        self.machines
    }

    /// The servers' rail groups, `R`.
    pub const fn rails(&self) -> u32 {
        self.rails
    }

    /// Whether server `server` receives cells of slot `device`: both in the same
    /// rail group (`device` in range).
    pub const fn receives_slot(&self, server: u32, device: u32) -> bool {
        device < self.devices && super::serves_rail(self.rails, server, device)
    }

    /// The area, in bytes from the start of the buffer, that receives machine
    /// `machine`'s cell of slot `device` (at a server of the slot's rail group:
    /// slots of one group have distinct areas, slots `d` and `d + R` none in
    /// common).
    pub const fn area(&self, machine: u32, device: u32) -> Result<Span, PlanError> {
        if machine >= self.machines {
            return Err(PlanError::MachineOutOfRange {
                machine,
                machines: self.machines,
            });
        }
        if device >= self.devices {
            return Err(PlanError::DeviceOutOfRange {
                device,
                devices: self.devices,
            });
        }
        let index = (device / self.rails) as u64 * self.machines as u64 + machine as u64;
        Ok(Span::bytes(index * self.shard_stride, self.shard_stride))
    }

    /// Total bytes of one staging buffer: `M * D / R` areas.
    pub const fn total_bytes(&self) -> u64 {
        self.machines as u64 * (self.devices / self.rails) as u64 * self.shard_stride
    }

    /// The reductions that fold a slot's cells into machine 0's: one per
    /// [`SERVER_FOLD_CELLS`] other machines, none on one machine.
    pub const fn folds(&self) -> u32 {
        (self.machines - 1).div_ceil(SERVER_FOLD_CELLS)
    }

    /// The machines whose cells fold `index` reduces into machine 0's, in
    /// order; `None` past the last fold.
    pub const fn fold(&self, index: u32) -> Option<Range<u32>> {
        if index >= self.folds() {
            return None;
        }
        let start = 1 + index * SERVER_FOLD_CELLS;
        let end = if self.machines - start > SERVER_FOLD_CELLS {
            start + SERVER_FOLD_CELLS
        } else {
            self.machines
        };
        Some(start..end)
    }
}

/// The most cells a dedicated server folds into a slot's sum in one reduction
/// ([`ServerLayout::fold`]).
pub const SERVER_FOLD_CELLS: u32 = 16;

/// Where one machine keeps what lands in a slot's reduction in two levels
/// ([`MachineGroups`]; `plan/two_level.rs` says what goes where), after the
/// input area, which receives the results:
///
/// ```text
/// offset 0        input bytes                                                  total_bytes
/// | input area | within 0 | ... | within S-2 | across (0, 0) | ... | across (1, Q-2) |
/// ```
///
/// - **within**: one area per other member of the largest group (`S - 1`),
///   each receiving that member's contribution to this machine's range.
///   Area `i` belongs to the member `(own + 1 + i) mod s` of a group of `s`:
///   the areas rotate with the receiver, as a flat plan's do.
/// - **across**: for each of the at most two intervals of this machine's
///   range, one area per other group (`Q - 1`), each receiving that group's
///   partial sum of this machine's piece. Area `(k, i)` belongs to group
///   `(own + 1 + i) mod Q` for the `k`-th interval.
///
/// Every area is an odd number of cache lines, as a [`StagingLayout`]'s, of
/// the largest range (within) or the largest piece (across) of a full slot;
/// a smaller slot's ranges and pieces are no larger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TwoLevelLayout {
    groups: MachineGroups,
    input_bytes: u64,
    within_stride: u64,
    across_stride: u64,
}

impl TwoLevelLayout {
    /// The layout for slots of at most `full_slot_units` units of
    /// [`ALIGN_BYTES`], after an input area of `input_units` units (a slot or
    /// a whole slice, see [`InputArea`]). Either larger than the largest
    /// slice ([`PlanConfig::MAX_SLICE_BYTES`](super::PlanConfig::MAX_SLICE_BYTES))
    /// is refused with [`PlanError::InvalidSliceBytes`].
    pub const fn new(
        groups: MachineGroups,
        full_slot_units: u64,
        input_units: u64,
    ) -> Result<TwoLevelLayout, PlanError> {
        let most = super::PlanConfig::MAX_SLICE_BYTES / ALIGN_BYTES;
        if full_slot_units > most || input_units > most {
            let units = if full_slot_units > input_units {
                full_slot_units
            } else {
                input_units
            };
            return Err(PlanError::InvalidSliceBytes {
                slice_bytes: units.saturating_mul(ALIGN_BYTES),
            });
        }
        // The largest range: a slot cut in the smallest group's members.
        let smallest = groups.small_size() as u64;
        let range = full_slot_units.div_ceil(smallest);
        // An interval lies within a range; its largest piece is a `Q`-th.
        let piece = range.div_ceil(groups.groups() as u64);
        Ok(TwoLevelLayout {
            groups,
            input_bytes: input_units * ALIGN_BYTES,
            within_stride: (range | 1) * ALIGN_BYTES,
            across_stride: (piece | 1) * ALIGN_BYTES,
        })
    }

    /// The input area, in bytes from the start of the buffer.
    pub const fn input(&self) -> Span {
        Span::bytes(0, self.input_bytes)
    }

    /// The groups it lays out areas for.
    pub const fn groups(&self) -> MachineGroups {
        self.groups
    }

    /// Bytes of each area within the group.
    pub const fn within_stride(&self) -> u64 {
        self.within_stride
    }

    /// Bytes of each area across the groups.
    pub const fn across_stride(&self) -> u64 {
        self.across_stride
    }

    /// Areas within the group: one fewer than the largest group's members.
    pub const fn within_areas(&self) -> u32 {
        self.groups.largest() - 1
    }

    /// Areas across the groups: [`MOST_INTERVALS`] times one fewer than the
    /// groups.
    pub const fn across_areas(&self) -> u32 {
        MOST_INTERVALS * (self.groups.groups() - 1)
    }

    /// The area, in bytes from the start of the buffer, that receives machine
    /// `from`'s contribution to machine `own`'s range: both of one group, and
    /// not the same machine.
    pub const fn within(&self, from: u32, own: u32) -> Result<Span, PlanError> {
        let (sender, receiver) = match self.members(from, own) {
            Ok(pair) => pair,
            Err(e) => return Err(e),
        };
        if sender.group != receiver.group {
            return Err(PlanError::WrongGroup {
                from,
                to: own,
                within: true,
            });
        }
        let members = match self.groups.size(receiver.group) {
            Ok(members) => members,
            Err(e) => return Err(e),
        };
        // (from - own - 1) mod s, in 0..s-1.
        let index = (sender.member + members - receiver.member - 1) % members;
        Ok(Span::bytes(
            self.input_bytes + index as u64 * self.within_stride,
            self.within_stride,
        ))
    }

    /// The area, in bytes from the start of the buffer, that receives machine
    /// `from`'s partial sum of machine `own`'s piece of `own`'s
    /// `interval`-th interval ([`TwoLevelRoles::across_at`](super::TwoLevelRoles::across_at)):
    /// the two of different groups. The layout knows no slot: whether `own`'s
    /// range of a given slot has an `interval`-th interval is for its roles
    /// to say.
    pub const fn across(&self, interval: u32, from: u32, own: u32) -> Result<Span, PlanError> {
        if interval >= MOST_INTERVALS {
            return Err(PlanError::IntervalOutOfRange { interval });
        }
        let (sender, receiver) = match self.members(from, own) {
            Ok(pair) => pair,
            Err(e) => return Err(e),
        };
        if sender.group == receiver.group {
            return Err(PlanError::WrongGroup {
                from,
                to: own,
                within: false,
            });
        }
        let groups = self.groups.groups();
        // (from - own - 1) mod Q, in 0..Q-1, after the first interval's areas.
        let index = interval * (groups - 1) + (sender.group + groups - receiver.group - 1) % groups;
        Ok(Span::bytes(
            self.input_bytes
                + self.within_areas() as u64 * self.within_stride
                + index as u64 * self.across_stride,
            self.across_stride,
        ))
    }

    /// Total bytes of one staging buffer.
    pub const fn total_bytes(&self) -> u64 {
        self.input_bytes
            + self.within_areas() as u64 * self.within_stride
            + self.across_areas() as u64 * self.across_stride
    }

    const fn members(
        &self,
        from: u32,
        own: u32,
    ) -> Result<(super::Membership, super::Membership), PlanError> {
        match (self.groups.locate(from), self.groups.locate(own)) {
            (Ok(_), Ok(_)) if from == own => Err(PlanError::OwnContribution { machine: own }),
            (Ok(sender), Ok(receiver)) => Ok((sender, receiver)),
            (Err(e), _) | (_, Err(e)) => Err(e),
        }
    }
}

/// Where a dedicated server in groups ([`ServerGroups`]) keeps what lands in
/// the reduction of the one slot it serves (`plan/server_groups.rs` says what
/// goes where):
///
/// ```text
/// offset 0         slot bytes                                                       total_bytes
/// | accumulator | worker 1 | ... | worker W-1 | across (0, 0) | ... | across (1, Q-2) |
/// ```
///
/// - **accumulator**: room for a full slot, in which the server's range lies
///   at its own offset in the slot. The cell of its group's first worker
///   (member 0) lands there, the range's sum is reduced there, and the other
///   groups' results of its pieces land over it, so that every offset a
///   server sends from or writes to is the same slot offset on every server.
/// - **worker `i`**: one area per other worker of the largest group (`W - 1`
///   for `W = ceil(M / Q)`), receiving worker member `i`'s cell.
/// - **across**: for each of the at most two intervals of the server's range,
///   one area per other group (`Q - 1`), receiving that group's partial sum
///   of the server's piece, laid out as a [`TwoLevelLayout`]'s: area `(k,
///   i)` belongs to group `(own + 1 + i) mod Q` for the `k`-th interval.
///
/// Every area is an odd number of cache lines, of the largest range (worker
/// areas) or the largest piece (across) of a full slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServerGroupLayout {
    groups: ServerGroups,
    slot_bytes: u64,
    within_stride: u64,
    across_stride: u64,
}

impl ServerGroupLayout {
    /// The layout for slots of at most `full_slot_units` units of
    /// [`ALIGN_BYTES`]; larger than the largest slice
    /// ([`PlanConfig::MAX_SLICE_BYTES`](super::PlanConfig::MAX_SLICE_BYTES))
    /// is refused with [`PlanError::InvalidSliceBytes`].
    pub const fn new(
        groups: ServerGroups,
        full_slot_units: u64,
    ) -> Result<ServerGroupLayout, PlanError> {
        if full_slot_units > super::PlanConfig::MAX_SLICE_BYTES / ALIGN_BYTES {
            return Err(PlanError::InvalidSliceBytes {
                slice_bytes: full_slot_units.saturating_mul(ALIGN_BYTES),
            });
        }
        let servers = groups.servers();
        // The largest range: a slot cut in the smallest group's servers.
        let range = full_slot_units.div_ceil(servers.small_size() as u64);
        // An interval lies within a range; its largest piece is a `Q`-th.
        let piece = range.div_ceil(servers.groups() as u64);
        Ok(ServerGroupLayout {
            groups,
            slot_bytes: full_slot_units * ALIGN_BYTES,
            within_stride: (range | 1) * ALIGN_BYTES,
            across_stride: (piece | 1) * ALIGN_BYTES,
        })
    }

    /// The groups it lays out areas for.
    pub const fn groups(&self) -> ServerGroups {
        self.groups
    }

    /// The accumulator: a full slot, from the start of the buffer.
    pub const fn accumulator(&self) -> Span {
        Span::bytes(0, self.slot_bytes)
    }

    /// Bytes of each worker's area.
    pub const fn within_stride(&self) -> u64 {
        self.within_stride
    }

    /// Bytes of each area across the groups.
    pub const fn across_stride(&self) -> u64 {
        self.across_stride
    }

    /// Areas for workers' cells: one fewer than the largest group's workers.
    pub const fn within_areas(&self) -> u32 {
        self.groups.most_workers() - 1
    }

    /// Areas across the groups: [`MOST_INTERVALS`] times one fewer than the
    /// groups.
    pub const fn across_areas(&self) -> u32 {
        MOST_INTERVALS * (self.groups.groups() - 1)
    }

    /// The area that receives the cell of worker member `member` of the
    /// server's group, from 1 ([`ServerGroups::locate_worker`]): member 0's
    /// lands in the accumulator, and a member past the largest group's is
    /// [`PlanError::MemberOutOfRange`].
    pub const fn within(&self, member: u32) -> Result<Span, PlanError> {
        if member == 0 || member >= self.groups.most_workers() {
            return Err(PlanError::MemberOutOfRange {
                member,
                members: self.groups.most_workers(),
            });
        }
        Ok(Span::bytes(
            self.slot_bytes + (member - 1) as u64 * self.within_stride,
            self.within_stride,
        ))
    }

    /// The area that receives server `from`'s partial sum of server `own`'s
    /// piece of `own`'s `interval`-th interval (both servers of one rail
    /// group, as [`ServerGroups::servers`] numbers them, in different
    /// groups).
    pub const fn across(&self, interval: u32, from: u32, own: u32) -> Result<Span, PlanError> {
        if interval >= MOST_INTERVALS {
            return Err(PlanError::IntervalOutOfRange { interval });
        }
        let servers = self.groups.servers();
        let (sender, receiver) = match (servers.locate(from), servers.locate(own)) {
            (Ok(sender), Ok(receiver)) => (sender, receiver),
            (Err(e), _) | (_, Err(e)) => return Err(e),
        };
        if sender.group == receiver.group {
            return Err(PlanError::WrongGroup {
                from,
                to: own,
                within: false,
            });
        }
        let groups = servers.groups();
        // (from - own - 1) mod Q, in 0..Q-1, after the first interval's areas.
        let index = interval * (groups - 1) + (sender.group + groups - receiver.group - 1) % groups;
        Ok(Span::bytes(
            self.slot_bytes
                + self.within_areas() as u64 * self.within_stride
                + index as u64 * self.across_stride,
            self.across_stride,
        ))
    }

    /// Total bytes of one staging buffer.
    pub const fn total_bytes(&self) -> u64 {
        self.slot_bytes
            + self.within_areas() as u64 * self.within_stride
            + self.across_areas() as u64 * self.across_stride
    }
}
