//! Slices, slots, shards and cells: which device moves and reduces which bytes.
//!
//! A tensor of `n` elements is cut into **slices** of at most
//! [`PlanConfig::slice_bytes`]; each slice is an independent all-reduce that owns one
//! staging buffer while in flight. A slice is cut into `D` **slots**, one per device
//! of a machine (the output of the intra-machine reduce-scatter), and each slot into
//! `k` **shards** (`1 <= k <= M`), each served by one machine: shard `j` of slot `d`
//! is reduced by device `d` of its server machine, which receives that shard from
//! device `d` of every other machine and sends the sum back. A **cell** is one
//! (slot, shard) pair: the unit that travels.
//!
//! # The rules
//!
//! **Units.** Sizes are counted in units of [`ALIGN_BYTES`] (64 bytes: a cache line,
//! and the smallest message some RDMA drivers handle well). Every full slice is a
//! whole number of units, so every slice, slot and cell starts at a multiple of
//! 64 bytes from the start of the tensor.
//!
//! **Balance.** A slice of `U` whole units and a tail of `t` elements (less than one
//! unit) deals the units to the `D` slots as evenly as possible, earlier slots taking
//! the extra units, and then each slot's units to its `k` shards the same way. The
//! tail goes to the last cell of the last slot. Cells therefore appear in tensor
//! order (slot-major), tile the slice with no gap or overlap, and any two cells of a
//! slice differ by at most one unit (64 bytes); so do any two slots.
//!
//! **Adaptive sharding.** `k = clamp(floor(U / D) / min_shard_units, 1, M)`: as many
//! shards as fit at [`PlanConfig::min_shard_bytes`], at most one per machine. A
//! slice with `k > 1` never has a shard below the minimum. Small slices (small
//! tensors, or many machines) therefore use fewer, larger shards instead of `M` tiny
//! ones: this is what keeps small all-reduces fast and avoids the collapse of the
//! original past about 128 GPUs, where a fixed bucket was cut into ever smaller
//! shards.
//!
//! **Rotation.** Shard `j` of slice `s` is served by machine
//! `(rotation + s * k_full + j) mod M`, where `k_full` is the shard count of a full
//! slice and `rotation` is passed in by the caller (the engine keeps a running count
//! across tensors, [`Plan::next_rotation`]). Shards are thus dealt to machines round
//! robin, like tickets, over the whole job: when slices use fewer than `M` shards,
//! every machine still serves the same number of shards (within one) over time, and
//! since every full slice has equal cells, the same number of bytes within one full
//! shard plus one unit.
//!
//! **Dedicated servers.** A [`Geometry::with_servers`] has `K` reduction servers
//! outside the machines (Herring's design), in `R = gcd(K, D)` rail groups:
//! server `p` serves the slots `d` with `d mod R = p mod R`. Everything above
//! holds within a group, with its `K/R` servers in the machines' place:
//! `k <= K/R`, shard `j` of slot `d` is served by server
//! `((rotation + s * k_full + j) mod (K/R)) * R + d mod R`, and a machine
//! serves nothing: each device sends all `k` shards of its slot and receives
//! all `k` results. Each server receives cell `(d, j)` of its shard `j` from
//! every machine, for every slot `d` of its group (one slot where there is a
//! server per NIC, `R = D`): the same bytes of every full slice, within one unit
//! ([`ServerLayout`]).
//!
//! **Trees.** Where the machines serve and a full slot cut at the minimum shard
//! size has fewer shards than there are machines, the flat rule above would
//! have a few servers each receive `M - 1` contributions per slice while the
//! rest wait, and every machine's staging hold `M - 1` contribution areas. Such
//! a geometry routes its cells through the two trees of a [`DoubleTree`]
//! instead ([`Routing::Trees`]): each slot is cut into at most [`TREES`] shards
//! (by the same adaptive rule, with `TREES` in `M`'s place), shard `j` of slice
//! `s` travels through tree `(rotation + s * k_full + j) mod 2`, every inner
//! node reduces it over its children's contributions and sends the partial sum
//! up, and the root's result comes back down the same tree. Each cell travels
//! in parts of at least the minimum shard, at most [`TREE_PARTS`]
//! ([`Slice::parts`], [`Cell::part`]), each its own message, so that an inner
//! node forwards one part while the next is on its way. A device then receives
//! at most two contributions per slice, into two areas of one cell each
//! ([`StagingLayout::child`]), sends at most four cells (each in its parts),
//! and sends and receives at most two slots' bytes, whatever `M`: the staging
//! and the messages per slice are bounded independently of the number of
//! machines.
//!
//! **Groups** ([`MachineGroups`], [`Routing::Groups`]): a geometry made
//! [`Geometry::with_groups`] reduces each slot in two levels, within groups of
//! machines and then across them. A slot is one cell ([`Slice::shards`] is 1)
//! that every machine cuts the same way: its group's members each reduce a
//! range of it over the group, and the range's pieces are reduced over the
//! groups (`plan/two_level.rs`, [`MachineGroups::roles`]), in the areas of a
//! [`TwoLevelLayout`] ([`Geometry::two_level_layout`]). Ranges and pieces are
//! counted in units of the slot; a slot that ends in part of a unit counts it
//! whole, and the range or piece that holds it ends at the slot's end.
//!
//! **Servers in groups** ([`ServerGroups`], [`Routing::Groups`] with
//! dedicated servers): a geometry made [`Geometry::with_servers_in_groups`],
//! or made [`Geometry::with_servers`] where a full slot cannot give every
//! server of a rail group a cell of the minimum shard, puts the servers of
//! each rail group in groups, each serving a group of worker machines, and
//! then reducing across the groups, server to server
//! (`plan/server_groups.rs`). Each server serves one rail (the servers a
//! multiple of `D`). A slot is one cell that every worker cuts into its
//! group's servers' ranges; a server keeps what lands in a
//! [`ServerGroupLayout`] ([`Geometry::server_group_layout`]).
//!
//! **Zero elements** plan to zero slices: the all-reduce is complete at once.
//!
//! **One slice.** A job of one machine whose local step works in the tensor
//! and stages nothing (NCCL's all-reduce on device memory) needs no slicing:
//! [`Plan::whole`] plans the tensor as a single slice, of any size, cut into
//! slots as above. Its slice is not bounded by [`PlanConfig::slice_bytes`], so
//! it fits no staging buffer; it is refused where machines exchange cells.
//!
//! # Cost and panics
//!
//! Every query is O(1) arithmetic on a few integers: no tables, no allocation. All
//! arithmetic that could overflow is checked when the plan is made
//! ([`PlanError::TensorTooLarge`]); nothing here panics.

mod geometry;
mod groups;
mod layout;
mod server_groups;
mod slice;
mod split;
mod tree;
mod two_level;

pub use geometry::{Geometry, PlanConfig, Routing, server_rails, serves_rail};
pub use groups::{Intervals, MachineGroups, Membership};
pub use layout::{
    InputArea, SERVER_FOLD_CELLS, ServerGroupLayout, ServerLayout, StagingLayout, TwoLevelLayout,
};
pub use server_groups::ServerGroups;
pub use slice::{Cell, Cells, Slice, Slices};
pub use tree::{DoubleTree, TREE_PARTS, TREES};
pub use two_level::{Across, MOST_INTERVALS, TwoLevelRoles};

use crate::dtype::DataType;
use core::fmt;
use core::ops::Range;

/// Alignment of every slice, slot and cell, in bytes from the start of the tensor.
pub const ALIGN_BYTES: u64 = 64;

/// A range of a tensor or a buffer.
///
/// For ranges of a tensor, `offset` and `len` count elements and the byte accessors
/// multiply by the element size; for ranges of a staging buffer both count bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    offset: u64,
    len: u64,
    elem_bytes: u64,
}

impl Span {
    pub(crate) const fn elements(offset: u64, len: u64, dtype: DataType) -> Span {
        Span {
            offset,
            len,
            elem_bytes: dtype.size_bytes(),
        }
    }

    pub(crate) const fn bytes(offset: u64, len: u64) -> Span {
        Span {
            offset,
            len,
            elem_bytes: 1,
        }
    }

    /// First element (or byte, for a buffer range).
    pub const fn offset(&self) -> u64 {
        self.offset
    }

    /// Number of elements (or bytes, for a buffer range).
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range is empty.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One past the last element (or byte).
    pub const fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// First byte.
    pub const fn byte_offset(&self) -> u64 {
        self.offset * self.elem_bytes
    }

    /// Length in bytes.
    pub const fn byte_len(&self) -> u64 {
        self.len * self.elem_bytes
    }

    /// One past the last byte.
    pub const fn byte_end(&self) -> u64 {
        self.end() * self.elem_bytes
    }

    /// The bytes of the span as a range of `usize`, for slicing memory; `None` if
    /// they do not fit this target's address space.
    pub fn byte_range(&self) -> Option<Range<usize>> {
        let start = usize::try_from(self.byte_offset()).ok()?;
        let end = usize::try_from(self.byte_end()).ok()?;
        Some(start..end)
    }

    /// The bytes of the span counted from the first byte of `outer`, which must
    /// contain it: a cell's range within its slice, say. `None` if `outer` does not
    /// contain the span or the range does not fit the address space.
    pub fn byte_range_in(&self, outer: Span) -> Option<Range<usize>> {
        if self.byte_offset() < outer.byte_offset() || self.byte_end() > outer.byte_end() {
            return None;
        }
        let start = usize::try_from(self.byte_offset() - outer.byte_offset()).ok()?;
        let len = usize::try_from(self.byte_len()).ok()?;
        Some(start..start.checked_add(len)?)
    }
}

/// The plan of one tensor: its slices under a [`Geometry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    geometry: Geometry,
    dtype: DataType,
    elements: u64,
    /// Elements per full slice.
    slice_elements: u64,
    slices: u64,
    /// The caller's rotation, reduced mod M.
    rotation: u32,
}

/// Why a plan, a configuration or a plan query was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    /// The slice size is below [`ALIGN_BYTES`] or above [`PlanConfig::MAX_SLICE_BYTES`].
    InvalidSliceBytes {
        /// The value given.
        slice_bytes: u64,
    },
    /// The minimum shard size is below [`PlanConfig::MIN_SHARD_FLOOR`] or above
    /// [`PlanConfig::MAX_SLICE_BYTES`].
    InvalidMinShardBytes {
        /// The value given.
        min_shard_bytes: u64,
    },
    /// The slice size gives less than one unit to each device of a machine.
    SliceTooSmall {
        /// The slice size given.
        slice_bytes: u64,
        /// Devices per machine.
        devices: u32,
    },
    /// The tensor's size in bytes does not fit in 64 bits.
    TensorTooLarge {
        /// Elements.
        elements: u64,
        /// The element type.
        dtype: DataType,
    },
    /// The staging budget does not hold a single staging buffer.
    BudgetTooSmall {
        /// The budget given.
        budget_bytes: u64,
        /// Bytes of one staging buffer.
        buffer_bytes: u64,
    },
    /// A slice index at or past the slice count.
    SliceOutOfRange {
        /// The index given.
        slice: u64,
        /// The slice count.
        slices: u64,
    },
    /// An element index at or past the tensor's length.
    ElementOutOfRange {
        /// The index given.
        element: u64,
        /// The tensor's length.
        elements: u64,
    },
    /// A device index at or past `D`.
    DeviceOutOfRange {
        /// The index given.
        device: u32,
        /// `D`.
        devices: u32,
    },
    /// A shard index at or past the slice's shard count.
    ShardOutOfRange {
        /// The index given.
        shard: u32,
        /// The slice's shard count.
        shards: u32,
    },
    /// A machine index at or past `M`.
    MachineOutOfRange {
        /// The index given.
        machine: u32,
        /// `M`.
        machines: u32,
    },
    /// A machine asked for the contribution area of its own contribution, which is
    /// never received (it is already in the slot).
    OwnContribution {
        /// The machine.
        machine: u32,
    },
    /// A count of dedicated servers outside `1..=MAX_MACHINES`.
    InvalidServers {
        /// The count given.
        servers: u32,
    },
    /// A server index at or past the number of dedicated servers (or a query
    /// about servers of a geometry without them).
    ServerOutOfRange {
        /// The index given.
        server: u32,
        /// The number of dedicated servers (0 without).
        servers: u32,
    },
    /// A plan of the whole tensor as one slice ([`Plan::whole`]) for a job whose
    /// cells travel: more than one machine, or dedicated servers.
    WholeTensorAcrossMachines {
        /// `M`.
        machines: u32,
        /// Dedicated servers (0 without).
        servers: u32,
    },
    /// A tree index at or past [`TREES`].
    TreeOutOfRange {
        /// The index given.
        tree: u32,
    },
    /// A query about cells going straight to their server, of a layout whose
    /// cells travel through trees ([`Routing::Trees`]).
    RoutedThroughTrees,
    /// A query about cells going straight to their server, of a layout whose
    /// slots are reduced in two levels ([`Routing::Groups`]).
    RoutedInGroups,
    /// A child's contribution area past the device's children: past the second,
    /// or any where cells go straight to their server.
    ChildOutOfRange {
        /// The index given.
        child: u32,
        /// Contribution areas by child (2 through trees, else 0).
        children: u32,
    },
    /// A part of a cell past the parts it travels in ([`Cell::parts`]).
    PartOutOfRange {
        /// The index given.
        part: u32,
        /// The cell's parts.
        parts: u32,
    },
    /// A group size that does not split the machines in two levels
    /// ([`MachineGroups::new`]: 2 to `M / 2`).
    InvalidGroupSize {
        /// The size given.
        size: u32,
        /// `M`.
        machines: u32,
    },
    /// Dedicated servers in groups ([`Geometry::with_servers_in_groups`])
    /// whose count is not a multiple of the devices a machine has: in groups,
    /// each server serves one rail.
    ServersNotPerRail {
        /// The servers given.
        servers: u32,
        /// Devices per machine.
        devices: u32,
    },
    /// Fewer worker machines than groups of dedicated servers
    /// ([`ServerGroups::new`]): a group of servers would serve no worker.
    TooFewWorkers {
        /// `M`.
        machines: u32,
        /// The number of groups.
        groups: u32,
    },
    /// A group index at or past the number of groups.
    GroupOutOfRange {
        /// The index given.
        group: u32,
        /// The number of groups.
        groups: u32,
    },
    /// A member index at or past its group's size.
    MemberOutOfRange {
        /// The index given.
        member: u32,
        /// The group's size.
        members: u32,
    },
    /// A unit at or past the end of a slot.
    UnitOutOfRange {
        /// The index given.
        unit: u64,
        /// The slot's units.
        units: u64,
    },
    /// In two levels, an interval index at or past the most intervals a
    /// range meets ([`MOST_INTERVALS`]).
    IntervalOutOfRange {
        /// The index given.
        interval: u32,
    },
    /// In two levels, a machine that sends within its group naming one of
    /// another group, or one that sends across the groups naming one of its
    /// own.
    WrongGroup {
        /// The sender.
        from: u32,
        /// The receiver.
        to: u32,
        /// Whether the two were taken to share a group.
        within: bool,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            PlanError::InvalidSliceBytes { slice_bytes } => write!(
                f,
                "slice size {slice_bytes} bytes is outside {ALIGN_BYTES}..={} bytes",
                PlanConfig::MAX_SLICE_BYTES
            ),
            PlanError::InvalidMinShardBytes { min_shard_bytes } => write!(
                f,
                "minimum shard size {min_shard_bytes} bytes is outside {}..={} bytes",
                PlanConfig::MIN_SHARD_FLOOR,
                PlanConfig::MAX_SLICE_BYTES
            ),
            PlanError::SliceTooSmall {
                slice_bytes,
                devices,
            } => write!(
                f,
                "slice size {slice_bytes} bytes is below {} bytes ({ALIGN_BYTES} per device \
                 for {devices} devices per machine)",
                ALIGN_BYTES * devices as u64
            ),
            PlanError::TensorTooLarge { elements, dtype } => write!(
                f,
                "a tensor of {elements} {dtype} elements does not fit in 2^64 bytes"
            ),
            PlanError::BudgetTooSmall {
                budget_bytes,
                buffer_bytes,
            } => write!(
                f,
                "staging budget {budget_bytes} bytes does not hold one staging buffer \
                 of {buffer_bytes} bytes"
            ),
            PlanError::SliceOutOfRange { slice, slices } => {
                write!(f, "slice {slice} is out of range for {slices} slices")
            }
            PlanError::ElementOutOfRange { element, elements } => {
                write!(
                    f,
                    "element {element} is out of range for {elements} elements"
                )
            }
            PlanError::DeviceOutOfRange { device, devices } => {
                write!(
                    f,
                    "device {device} is out of range for {devices} devices per machine"
                )
            }
            PlanError::ShardOutOfRange { shard, shards } => {
                write!(f, "shard {shard} is out of range for {shards} shards")
            }
            PlanError::MachineOutOfRange { machine, machines } => {
                write!(
                    f,
                    "machine {machine} is out of range for {machines} machines"
                )
            }
            PlanError::OwnContribution { machine } => write!(
                f,
                "machine {machine} never receives its own contribution: it is in the slot"
            ),
            PlanError::InvalidServers { servers } => write!(
                f,
                "{servers} dedicated servers is outside 1..={}",
                crate::topology::MAX_MACHINES
            ),
            PlanError::ServerOutOfRange { server, servers } => {
                write!(f, "server {server} is out of range for {servers} servers")
            }
            PlanError::RoutedThroughTrees => f.write_str(
                "cells of this layout travel through trees: contributions land by child, \
                 not by machine",
            ),
            PlanError::RoutedInGroups => f.write_str(
                "slots of this layout are reduced in groups: contributions land in the two \
                 levels' areas, not by machine",
            ),
            PlanError::ChildOutOfRange { child, children } => write!(
                f,
                "child {child} is out of range for {children} contribution areas by child"
            ),
            PlanError::PartOutOfRange { part, parts } => {
                write!(f, "part {part} is out of range for a cell of {parts} parts")
            }
            PlanError::InvalidGroupSize { size, machines } => write!(
                f,
                "groups of {size} machines do not split {machines} machines in two levels: \
                 the size must be from 2 to half the machines, and leave no group of one"
            ),
            PlanError::ServersNotPerRail { servers, devices } => write!(
                f,
                "{servers} dedicated servers cannot form groups beside machines of {devices} \
                 devices: in groups each server serves one rail, so the count must be a \
                 multiple of {devices}"
            ),
            PlanError::TooFewWorkers { machines, groups } => write!(
                f,
                "{machines} worker machines cannot be split among {groups} groups of servers: \
                 each group needs a worker"
            ),
            PlanError::GroupOutOfRange { group, groups } => {
                write!(f, "group {group} is out of range for {groups} groups")
            }
            PlanError::MemberOutOfRange { member, members } => write!(
                f,
                "member {member} is out of range for a group of {members} machines"
            ),
            PlanError::UnitOutOfRange { unit, units } => {
                write!(f, "unit {unit} is out of range for a slot of {units} units")
            }
            PlanError::IntervalOutOfRange { interval } => write!(
                f,
                "interval {interval} is out of range: a range meets at most {MOST_INTERVALS}"
            ),
            PlanError::WrongGroup {
                from,
                to,
                within: true,
            } => write!(
                f,
                "machine {from} is not in machine {to}'s group: it sends there across the groups"
            ),
            PlanError::WrongGroup {
                from,
                to,
                within: false,
            } => write!(
                f,
                "machine {from} is in machine {to}'s group: it sends there within the group"
            ),
            PlanError::TreeOutOfRange { tree } => {
                write!(f, "tree {tree} is out of range for {TREES} trees")
            }
            PlanError::WholeTensorAcrossMachines { machines, servers } => write!(
                f,
                "a tensor planned as one slice fits no staging buffer, so its cells \
                 cannot travel: it needs one machine and no dedicated servers, not \
                 {machines} machines and {servers} servers"
            ),
        }
    }
}

impl core::error::Error for PlanError {}

impl Plan {
    /// The plan of a tensor of `elements` elements of `dtype`.
    ///
    /// `rotation` shifts which machines serve the shards (see the module docs); every
    /// rank must pass the same value for the same tensor.
    pub const fn new(
        geometry: &Geometry,
        dtype: DataType,
        elements: u64,
        rotation: u64,
    ) -> Result<Plan, PlanError> {
        if elements.checked_mul(dtype.size_bytes()).is_none() {
            return Err(PlanError::TensorTooLarge { elements, dtype });
        }
        let bytes = elements * dtype.size_bytes();
        let slice_elements = geometry.slice_bytes_for(bytes) / dtype.size_bytes();
        let machines = geometry.rotation_period() as u64;
        Ok(Plan {
            geometry: *geometry,
            dtype,
            elements,
            slice_elements,
            slices: elements.div_ceil(slice_elements),
            #[expect(
                clippy::cast_possible_truncation,
                reason = "the value is below M <= 4096"
            )]
            rotation: (rotation % machines) as u32,
        })
    }

    /// The plan of a tensor of `elements` elements of `dtype` as a single
    /// slice, for a job of one machine whose local step works in the tensor
    /// (see the module docs); refused with
    /// [`PlanError::WholeTensorAcrossMachines`] for a job of several machines
    /// or with dedicated servers, whose cells land in staging buffers. (A job
    /// whose workers are one machine beside servers that serve none of a
    /// tensor plans it on the geometry of that machine alone, without them.)
    pub const fn whole(
        geometry: &Geometry,
        dtype: DataType,
        elements: u64,
    ) -> Result<Plan, PlanError> {
        let machines = geometry.topology().machines();
        if machines > 1 || geometry.servers().is_some() {
            return Err(PlanError::WholeTensorAcrossMachines {
                machines,
                servers: match geometry.servers() {
                    Some(k) => k,
                    None => 0,
                },
            });
        }
        if elements.checked_mul(dtype.size_bytes()).is_none() {
            return Err(PlanError::TensorTooLarge { elements, dtype });
        }
        Ok(Plan {
            geometry: *geometry,
            dtype,
            elements,
            // At least one element, so that an empty tensor still divides.
            slice_elements: if elements > 0 { elements } else { 1 },
            slices: if elements > 0 { 1 } else { 0 },
            rotation: 0,
        })
    }

    /// The geometry the plan was made under.
    pub const fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The element type.
    pub const fn dtype(&self) -> DataType {
        self.dtype
    }

    /// Elements in the tensor.
    pub const fn elements(&self) -> u64 {
        self.elements
    }

    /// Bytes in the tensor.
    pub const fn bytes(&self) -> u64 {
        self.elements * self.dtype.size_bytes()
    }

    /// Elements in a full slice (every slice but the last; a [`Plan::whole`]'s
    /// one slice holds every element).
    pub const fn slice_elements(&self) -> u64 {
        self.slice_elements
    }

    /// Number of slices: `ceil(elements / slice_elements)`, zero for an empty tensor.
    pub const fn slice_count(&self) -> u64 {
        self.slices
    }

    /// Slice `index`.
    pub const fn slice(&self, index: u64) -> Result<Slice, PlanError> {
        if index >= self.slices {
            return Err(PlanError::SliceOutOfRange {
                slice: index,
                slices: self.slices,
            });
        }
        Ok(Slice::new(self, index))
    }

    /// The slices, in order.
    pub const fn slices(&self) -> Slices {
        Slices::new(*self)
    }

    /// The cell that holds element `element` of the tensor.
    pub const fn locate(&self, element: u64) -> Result<Cell, PlanError> {
        if element >= self.elements {
            return Err(PlanError::ElementOutOfRange {
                element,
                elements: self.elements,
            });
        }
        let slice = Slice::new(self, element / self.slice_elements);
        Ok(slice.locate(element - slice.span().offset()))
    }

    /// The rotation to pass to the next tensor's plan so that shards keep going
    /// round robin over the machines (or the trees): this plan's rotation plus the
    /// shards it used, mod `M` (or [`TREES`]).
    pub const fn next_rotation(&self) -> u64 {
        if self.slices == 0 {
            return self.rotation as u64;
        }
        let machines = self.geometry.rotation_period() as u64;
        let full = self.geometry.shards_per_full_slice() as u64;
        let last = match self.slice(self.slices - 1) {
            Ok(s) => s.shards() as u64,
            Err(_) => 0,
        };
        // Everything is reduced mod M <= 4096 before multiplying: no overflow.
        (self.rotation as u64 + ((self.slices - 1) % machines) * full + last) % machines
    }

    /// The caller's rotation, mod `M` (or the dedicated servers of a rail group, or
    /// [`TREES`]).
    pub(crate) const fn rotation(&self) -> u32 {
        self.rotation
    }
}
