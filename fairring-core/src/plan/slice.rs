//! One slice of a plan, its slots and cells, and what each device does with it.

use super::split::EvenSplit;
use core::ops::Range;

use super::{
    ALIGN_BYTES, DoubleTree, MachineGroups, Plan, PlanError, Routing, ServerGroups, Span,
    TREE_PARTS, TREES,
};
use crate::dtype::DataType;
use crate::staging::Role;
use crate::topology::Location;

/// One slice of a tensor: an independent all-reduce of at most
/// [`Geometry::full_slice_bytes`](super::Geometry::full_slice_bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slice {
    index: u64,
    /// First element, from the start of the tensor.
    offset: u64,
    /// Whole units in the slice.
    units: u64,
    /// Elements after the whole units (less than one unit).
    tail: u64,
    unit_elements: u64,
    dtype: DataType,
    machines: u32,
    /// Machines, or the dedicated servers of a rail group: what serves the
    /// shards of one slot.
    serving: u32,
    /// The dedicated servers' rail groups (1 without).
    rails: u32,
    /// Whether dedicated servers serve (not the machines).
    dedicated: bool,
    devices: u32,
    shards: u32,
    /// Machine (or dedicated server) serving shard 0; through trees, the tree
    /// shard 0 travels through.
    first_server: u32,
    /// The trees the cells travel through, where they do ([`Routing::Trees`]).
    trees: Option<DoubleTree>,
    /// The machines' groups, where each slot is reduced in two levels
    /// ([`Routing::Groups`]).
    groups: Option<MachineGroups>,
    /// The dedicated servers' groups, where they reduce each slot in two
    /// levels ([`Routing::Groups`] with servers).
    server_groups: Option<ServerGroups>,
    /// The slice's units dealt to the `D` slots.
    slots: EvenSplit,
    /// The smallest shard, in units: the smallest part a cell travels in.
    min_shard_units: u64,
}

/// One cell: shard `shard` of slot `device` of a slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cell {
    slice: u64,
    dtype: DataType,
    device: u32,
    shard: u32,
    server: u32,
    span: Span,
    slot_offset: u64,
    /// The parts it travels in: its slice's [`Slice::parts`] (up to
    /// [`TREE_PARTS`] through trees, else 1).
    parts: u32,
}

impl Cell {
    /// The slice it belongs to.
    pub const fn slice(&self) -> u64 {
        self.slice
    }

    /// The slot (device index, rail) it belongs to.
    pub const fn device(&self) -> u32 {
        self.device
    }

    /// Its shard index within the slot.
    pub const fn shard(&self) -> u32 {
        self.shard
    }

    /// The machine that serves it (device [`Cell::device`] of this machine reduces
    /// it), or with dedicated servers the server's index; through trees, the
    /// root of its tree, which finishes its reduction; in groups, where every
    /// machine reduces a range of the cell (its slot), machine 0.
    pub const fn server(&self) -> u32 {
        self.server
    }

    /// Its range of the tensor, in elements from the start of the tensor.
    pub const fn span(&self) -> Span {
        self.span
    }

    /// Its range of the slot, in elements from the start of the slot: where it lies
    /// in the slot area of a staging buffer (byte offsets via [`Span::byte_offset`]).
    pub const fn slot_span(&self) -> Span {
        Span::elements(self.slot_offset, self.span.len(), self.dtype)
    }

    /// The parts it travels in, each its own message: its slice's
    /// [`Slice::parts`].
    pub const fn parts(&self) -> u32 {
        self.parts
    }

    /// Part `part` of it, in elements from the start of the tensor: its whole
    /// units dealt evenly to the parts, in order, and the elements after the
    /// last whole unit to the last part. Parts tile the cell, and none is
    /// empty unless the cell is.
    pub const fn part(&self, part: u32) -> Result<Span, PlanError> {
        if part >= self.parts {
            return Err(PlanError::PartOutOfRange {
                part,
                parts: self.parts,
            });
        }
        let unit_elements = ALIGN_BYTES / self.dtype.size_bytes();
        let len = self.span.len();
        let split = EvenSplit::new(len / unit_elements, self.parts as u64);
        let p = part as u64;
        let tail = if part + 1 == self.parts {
            len % unit_elements
        } else {
            0
        };
        Ok(Span::elements(
            self.span.offset() + split.start(p) * unit_elements,
            split.len(p) * unit_elements + tail,
            self.dtype,
        ))
    }
}

impl Slice {
    pub(super) const fn new(plan: &Plan, index: u64) -> Slice {
        let geometry = plan.geometry();
        let topology = geometry.topology();
        let machines = topology.machines();
        let devices = topology.devices_per_machine();
        let dtype = plan.dtype();
        let offset = index * plan.slice_elements();
        let remaining = plan.elements() - offset;
        let len = if remaining < plan.slice_elements() {
            remaining
        } else {
            plan.slice_elements()
        };
        let unit_elements = ALIGN_BYTES / dtype.size_bytes();
        let units = len / unit_elements;
        let serving = geometry.serving();
        let m = geometry.rotation_period() as u64;
        let full_shards = geometry.shards_per_full_slice() as u64;
        // All factors are reduced mod M <= 4096 first: no overflow.
        let first_server = (plan.rotation() as u64 + (index % m) * (full_shards % m)) % m;
        Slice {
            index,
            offset,
            units,
            tail: len % unit_elements,
            unit_elements,
            dtype,
            machines,
            serving,
            rails: geometry.server_rails(),
            dedicated: geometry.servers().is_some(),
            devices,
            shards: geometry.shards_for_slice(units),
            #[expect(
                clippy::cast_possible_truncation,
                reason = "the value is below M <= 4096"
            )]
            first_server: first_server as u32,
            trees: match geometry.routing() {
                Routing::Trees => match DoubleTree::new(machines) {
                    Ok(t) => Some(t),
                    // A topology never has more than MAX_MACHINES machines.
                    Err(_) => None,
                },
                Routing::Flat | Routing::Groups => None,
            },
            groups: geometry.machine_groups(),
            server_groups: geometry.server_groups(),
            slots: EvenSplit::new(units, devices as u64),
            min_shard_units: geometry.min_shard_units(),
        }
    }

    /// The trees its cells travel through, or `None` where they go straight to
    /// their server ([`Routing`]).
    pub const fn double_tree(&self) -> Option<DoubleTree> {
        self.trees
    }

    /// The machines' groups, where each slot is reduced in two levels
    /// ([`Routing::Groups`]): then every slot is one cell, and
    /// [`MachineGroups::roles`] over [`Slice::group_units`] says what each
    /// machine does with it.
    pub const fn machine_groups(&self) -> Option<MachineGroups> {
        self.groups
    }

    /// The dedicated servers' groups, where they reduce each slot in two
    /// levels ([`Routing::Groups`] with servers): then every slot is one
    /// cell, which each worker cuts into its group's servers' ranges
    /// ([`ServerGroups::cell`] over [`Slice::group_units`]).
    pub const fn server_groups(&self) -> Option<ServerGroups> {
        self.server_groups
    }

    /// Slot `device`'s units as the two levels count them
    /// ([`Routing::Groups`]): its whole units, and one more where it ends in
    /// part of one.
    pub const fn group_units(&self, device: u32) -> Result<u64, PlanError> {
        if device >= self.devices {
            return Err(PlanError::DeviceOutOfRange {
                device,
                devices: self.devices,
            });
        }
        let len = self.slot_at(device).len();
        Ok(len.div_ceil(self.unit_elements))
    }

    /// Units `units` of slot `device` (as [`Slice::group_units`] counts them),
    /// in elements of the tensor: cut at the slot's end, so that the range
    /// that holds its last part of a unit ends there. An empty or reversed
    /// range is empty.
    pub const fn slot_units_span(&self, device: u32, units: Range<u64>) -> Result<Span, PlanError> {
        if device >= self.devices {
            return Err(PlanError::DeviceOutOfRange {
                device,
                devices: self.devices,
            });
        }
        let slot = self.slot_at(device);
        let len = slot.len();
        let start = clamp_units(units.start, self.unit_elements, len);
        let end = clamp_units(units.end, self.unit_elements, len);
        let end = if end < start { start } else { end };
        Ok(Span::elements(
            slot.offset() + start,
            end - start,
            self.dtype,
        ))
    }

    /// The parts each cell travels in ([`Cell::part`]): through trees, as many
    /// as the slice's smallest cell holds parts of at least the minimum shard,
    /// at most [`TREE_PARTS`]; where it holds fewer than two such parts, two
    /// (each at least a unit) if it has two units, else 1. Where cells go
    /// straight to their server, 1.
    pub const fn parts(&self) -> u32 {
        if self.trees.is_none() {
            return 1;
        }
        // Whole units of the smallest cell: of the smallest slot, evenly cut.
        let smallest_cell = self.units / self.devices as u64 / self.shards as u64;
        let fit = smallest_cell / self.min_shard_units;
        if fit >= TREE_PARTS as u64 {
            TREE_PARTS
        } else if fit >= 2 {
            #[expect(clippy::cast_possible_truncation, reason = "below TREE_PARTS")]
            let parts = fit as u32;
            parts
        } else if smallest_cell >= 2 {
            2
        } else {
            1
        }
    }

    /// The tree shard `shard` of every slot travels through, or `None` where
    /// cells go straight to their server.
    pub const fn tree_of(&self, shard: u32) -> Result<Option<u32>, PlanError> {
        if shard >= self.shards {
            return Err(PlanError::ShardOutOfRange {
                shard,
                shards: self.shards,
            });
        }
        Ok(match self.trees {
            Some(_) => Some(self.tree_at(shard)),
            None => None,
        })
    }

    /// The tree of shard `shard < k`, through trees.
    const fn tree_at(&self, shard: u32) -> u32 {
        (self.first_server + shard) % TREES
    }

    /// Its index in the plan.
    pub const fn index(&self) -> u64 {
        self.index
    }

    /// Its range of the tensor, in elements.
    pub const fn span(&self) -> Span {
        Span::elements(
            self.offset,
            self.units * self.unit_elements + self.tail,
            self.dtype,
        )
    }

    /// Shards per slot, `k`: the same for every slot of the slice.
    pub const fn shards(&self) -> u32 {
        self.shards
    }

    /// Slot `device`'s range of the tensor, in elements.
    pub const fn slot(&self, device: u32) -> Result<Span, PlanError> {
        if device >= self.devices {
            return Err(PlanError::DeviceOutOfRange {
                device,
                devices: self.devices,
            });
        }
        Ok(self.slot_at(device))
    }

    /// Whether its `D` slots hold the same number of elements: one slot, or
    /// whole units dealt evenly and no tail. Slots lie one after another in
    /// device order, so a slice of equal slots is `D` equal chunks, slot `d`
    /// the `d`th (what a machine's single reduce-scatter of the slice takes).
    pub const fn slots_equal(&self) -> bool {
        self.devices == 1 || (self.tail == 0 && self.units.is_multiple_of(self.devices as u64))
    }

    /// Slot `device`, for `device < D`.
    const fn slot_at(&self, device: u32) -> Span {
        let d = device as u64;
        let start = self.offset + self.slots.start(d) * self.unit_elements;
        let len = self.slots.len(d) * self.unit_elements + self.tail_of_slot(device);
        Span::elements(start, len, self.dtype)
    }

    /// Shard `shard` of slot `device`.
    pub const fn cell(&self, device: u32, shard: u32) -> Result<Cell, PlanError> {
        if device >= self.devices {
            return Err(PlanError::DeviceOutOfRange {
                device,
                devices: self.devices,
            });
        }
        if shard >= self.shards {
            return Err(PlanError::ShardOutOfRange {
                shard,
                shards: self.shards,
            });
        }
        Ok(self.cell_at(device, shard))
    }

    /// Shard `shard` of slot `device`, for `device < D` and `shard < k`.
    const fn cell_at(&self, device: u32, shard: u32) -> Cell {
        let d = device as u64;
        let j = shard as u64;
        let shard_split = EvenSplit::new(self.slots.len(d), self.shards as u64);
        let slot_offset = shard_split.start(j) * self.unit_elements;
        let tail = if shard + 1 == self.shards {
            self.tail_of_slot(device)
        } else {
            0
        };
        let len = shard_split.len(j) * self.unit_elements + tail;
        let slot_start = self.slot_at(device).offset();
        Cell {
            slice: self.index,
            dtype: self.dtype,
            device,
            shard,
            server: self.server_of(device, shard),
            span: Span::elements(slot_start + slot_offset, len, self.dtype),
            slot_offset,
            parts: self.parts(),
        }
    }

    /// What serves shard `shard` of slot `device`: a machine (the same for
    /// every slot), or with dedicated servers a server's index (one of the
    /// slot's rail group, [`Geometry::server_rails`]).
    ///
    /// [`Geometry::server_rails`]: super::Geometry::server_rails
    pub const fn server(&self, device: u32, shard: u32) -> Result<u32, PlanError> {
        if device >= self.devices {
            return Err(PlanError::DeviceOutOfRange {
                device,
                devices: self.devices,
            });
        }
        if shard >= self.shards {
            return Err(PlanError::ShardOutOfRange {
                shard,
                shards: self.shards,
            });
        }
        Ok(self.server_of(device, shard))
    }

    /// The shard machine `machine` serves in this slice, if any (at most one: `k <= M`;
    /// none with dedicated servers, nor in groups, where every machine
    /// reduces a range of each slot). Through trees, the shard whose tree has the
    /// machine as an inner node, which it reduces over its children's
    /// contributions (at most one: no machine is an inner node of both trees).
    pub const fn shard_served_by(&self, machine: u32) -> Result<Option<u32>, PlanError> {
        if machine >= self.machines {
            return Err(PlanError::MachineOutOfRange {
                machine,
                machines: self.machines,
            });
        }
        if self.dedicated || self.groups.is_some() {
            return Ok(None);
        }
        Ok(self.served_by(machine))
    }

    /// The shard dedicated server `server` serves in this slice, if any (at most
    /// one: `k <= K / R`), of every slot of its rail group.
    pub const fn shard_of_server(&self, server: u32) -> Result<Option<u32>, PlanError> {
        let servers = if self.dedicated {
            self.serving * self.rails
        } else {
            0
        };
        if server >= servers {
            return Err(PlanError::ServerOutOfRange { server, servers });
        }
        Ok(self.served_by(server / self.rails))
    }

    /// The shard that serving unit `unit` (a machine, or a dedicated server's
    /// index within its rail group) serves.
    const fn served_by(&self, unit: u32) -> Option<u32> {
        if let Some(trees) = self.trees {
            let mut j = 0;
            while j < self.shards {
                if let Ok(true) = trees.is_inner(self.tree_at(j), unit) {
                    return Some(j);
                }
                j += 1;
            }
            return None;
        }
        let j = (unit + self.serving - self.first_server) % self.serving;
        if j < self.shards { Some(j) } else { None }
    }

    /// What the device at `location` does in this slice: the counts its staging state
    /// machine waits for.
    ///
    /// A device whose slot is empty (a slice smaller than `D` units) has nothing to
    /// exchange: its role is [`Role::IDLE`] on every machine alike.
    ///
    /// In groups ([`Routing::Groups`]) a device has a word per level, which
    /// [`MachineGroups::roles`] gives: refused with [`PlanError::RoutedInGroups`].
    pub const fn role(&self, location: Location) -> Result<Role, PlanError> {
        if self.groups.is_some() {
            return Err(PlanError::RoutedInGroups);
        }
        if location.device >= self.devices {
            return Err(PlanError::DeviceOutOfRange {
                device: location.device,
                devices: self.devices,
            });
        }
        let served = match self.shard_served_by(location.machine) {
            Ok(s) => s.is_some(),
            Err(e) => return Err(e),
        };
        if self.slot_at(location.device).is_empty() {
            return Ok(Role::IDLE);
        }
        if let Some(groups) = self.server_groups {
            return self.role_in_server_groups(&groups, location);
        }
        if let Some(trees) = self.trees {
            return Ok(self.tree_role(&trees, location.machine));
        }
        let reduces = served && self.machines > 1;
        let others = if reduces { self.machines - 1 } else { 0 };
        let sends = self.shards - if served { 1 } else { 0 };
        #[expect(
            clippy::cast_possible_truncation,
            reason = "every count is below M <= 4096"
        )]
        Ok(Role {
            contributions_to_send: sends as u16,
            contributions_to_receive: others as u16,
            results_to_send: others as u16,
            results_to_receive: sends as u16,
            reduces,
            forwards: false,
        })
    }

    /// A worker's role where the dedicated servers are in groups, for a
    /// device whose slot is not empty: each nonempty range of its slot (one
    /// per server of its group) is a contribution out and a result back.
    const fn role_in_server_groups(
        &self,
        groups: &ServerGroups,
        location: Location,
    ) -> Result<Role, PlanError> {
        let units = match self.group_units(location.device) {
            Ok(units) => units,
            Err(e) => return Err(e),
        };
        let group = match groups.locate_worker(location.machine) {
            Ok(m) => m.group,
            Err(e) => return Err(e),
        };
        let members = match groups.servers().size(group) {
            Ok(members) => members,
            Err(e) => return Err(e),
        };
        // A range is empty only where the slot has fewer units than the
        // group has servers: then exactly `units` of them hold one.
        let cells = if units < members as u64 {
            units
        } else {
            members as u64
        };
        #[expect(
            clippy::cast_possible_truncation,
            reason = "at most a group's servers, below 4096"
        )]
        Ok(Role {
            contributions_to_send: cells as u16,
            contributions_to_receive: 0,
            results_to_send: 0,
            results_to_receive: cells as u16,
            reduces: false,
            forwards: false,
        })
    }

    /// A device's role through the trees, for machine `machine < M`: each cell
    /// of its slot whose tree has the machine as a leaf is a contribution to its
    /// parent and a result back; the one whose tree has it as an inner node is
    /// reduced over its children's contributions, sent up as a partial sum below
    /// the root, and sent down to the children once final.
    const fn tree_role(&self, trees: &DoubleTree, machine: u32) -> Role {
        let mut leaf_cells: u16 = 0;
        let mut children: u16 = 0;
        let mut has_parent = false;
        let mut j = 0;
        while j < self.shards {
            let tree = self.tree_at(j);
            let below = match trees.children(tree, machine) {
                Ok([left, right]) => left.is_some() as u16 + right.is_some() as u16,
                Err(_) => 0,
            };
            if below > 0 {
                children = below;
                has_parent = matches!(trees.parent(tree, machine), Ok(Some(_)));
            } else {
                leaf_cells += 1;
            }
            j += 1;
        }
        Role {
            contributions_to_send: leaf_cells,
            contributions_to_receive: children,
            results_to_send: children,
            results_to_receive: leaf_cells,
            reduces: children > 0,
            forwards: children > 0 && has_parent,
        }
    }

    /// The cells, in tensor order (slot by slot, shard by shard).
    pub const fn cells(&self) -> Cells {
        Cells {
            slice: *self,
            next: 0,
        }
    }

    /// The cell holding element `rel` of the slice (`rel` within its span).
    pub(super) const fn locate(&self, rel: u64) -> Cell {
        let unit = rel / self.unit_elements;
        if unit >= self.units {
            // The tail belongs to the last cell.
            return self.cell_at(self.devices - 1, self.shards - 1);
        }
        let d = self.slots.part_of(unit);
        let in_slot = unit - self.slots.start(d);
        let j = EvenSplit::new(self.slots.len(d), self.shards as u64).part_of(in_slot);
        #[expect(clippy::cast_possible_truncation, reason = "d < D and j < k fit u32")]
        self.cell_at(d as u32, j as u32)
    }

    /// The server of shard `shard` of slot `device`: the `(first + shard) mod
    /// serving`-th unit of the slot's rail group (every unit is its own group
    /// without dedicated servers, `rails` being 1).
    const fn server_of(&self, device: u32, shard: u32) -> u32 {
        if let Some(trees) = self.trees {
            return match trees.root(self.tree_at(shard)) {
                Ok(root) => root,
                // tree_at is below TREES.
                Err(_) => 0,
            };
        }
        (self.first_server + shard) % self.serving * self.rails + device % self.rails
    }

    const fn tail_of_slot(&self, device: u32) -> u64 {
        if device + 1 == self.devices {
            self.tail
        } else {
            0
        }
    }
}

/// `units` units of `unit_elements` each, in elements, at most `len`.
const fn clamp_units(units: u64, unit_elements: u64, len: u64) -> u64 {
    let elements = units.saturating_mul(unit_elements);
    if elements < len { elements } else { len }
}

/// The cells of a slice, in tensor order.
#[derive(Clone, Debug)]
pub struct Cells {
    slice: Slice,
    next: u64,
}

impl Iterator for Cells {
    type Item = Cell;

    fn next(&mut self) -> Option<Cell> {
        let k = self.slice.shards as u64;
        if self.next >= self.slice.devices as u64 * k {
            return None;
        }
        let d = u32::try_from(self.next / k).ok()?;
        let j = u32::try_from(self.next % k).ok()?;
        self.next += 1;
        Some(self.slice.cell_at(d, j))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let total = self.slice.devices as u64 * self.slice.shards as u64;
        let left = usize::try_from(total - self.next).unwrap_or(usize::MAX);
        (left, Some(left))
    }
}

/// The slices of a plan, in order.
#[derive(Clone, Debug)]
pub struct Slices {
    plan: Plan,
    next: u64,
}

impl Slices {
    pub(super) const fn new(plan: Plan) -> Slices {
        Slices { plan, next: 0 }
    }
}

impl Iterator for Slices {
    type Item = Slice;

    fn next(&mut self) -> Option<Slice> {
        let slice = self.plan.slice(self.next).ok()?;
        self.next += 1;
        Some(slice)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = usize::try_from(self.plan.slice_count() - self.next).unwrap_or(usize::MAX);
        (left, Some(left))
    }
}
