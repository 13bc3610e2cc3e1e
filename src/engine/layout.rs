//! The one layout of a staging buffer: the core's
//! [`StagingLayout`](fairring_core::plan::StagingLayout) with the whole slice as
//! its input area, and the ring's receive slots over the same bytes as the
//! contribution areas (a buffer holds one slice of one algorithm at a time).
//!
//! ```text
//! [0, full_slice)                  the slice (hierarchical and ring)
//! [inbox, + (M-1) * shard_stride)  contribution areas (hierarchical)
//! [inbox, + (N-1) * ring_slot)     receive slots (ring)
//! [inbox, + S * doubling_slot)     receive slots (recursive doubling)
//!
//! [0, N * piece)                    a reduce-scatter's slice: N shares
//! [scatter_inbox, + (N-1) * piece)  its receive slots
//! ```
//!
//! A reduce-scatter slice holds the same range of every rank's share, one
//! *piece* each, so its pieces are cut to a line-aligned `N`th of the slice;
//! its receive slots follow the pieces (at the inbox, unless pieces of a
//! single line overrun it, where slices are tiny and the buffer grows). Where
//! machines have several devices the same `N` pieces are grouped by device
//! (`local::RailPieces`) and only `M - 1` receive slots are used.
//!
//! Recursive doubling receives a whole slice per round, in `S = 1 + log2 p`
//! slots (`p` the largest power of two at most `N`): its slices are cut to fit
//! them in the bytes past the inbox, so the buffer is no larger for it.
//!
//! In groups (`Routing::Groups`) the contribution areas are the core's
//! [`TwoLevelLayout`](fairring_core::plan::TwoLevelLayout)'s, past the slice:
//! one per other member of the largest group, then one per other group for
//! each of a range's two intervals (`algorithm/two_level.rs`).
//!
//! With dedicated servers a worker's buffer has no contribution areas (servers
//! receive them), and a server's buffer is the core's
//! [`ServerLayout`](fairring_core::plan::ServerLayout): one area per (slot,
//! machine) cell; where the servers are in groups, the core's
//! [`ServerGroupLayout`](fairring_core::plan::ServerGroupLayout): a whole-slot
//! accumulator, an area per other worker of the group, and the across areas
//! (`algorithm/serve_in_groups.rs`).
//!
//! A job may plan some operations with a second geometry, whose slices the
//! same buffers hold ([`BufferLayout::holding_second`]: its layout over the
//! same bytes, the buffer as large as the larger of the two):
//! - beside dedicated servers, the machines' own plan
//!   ([`Resolved::Colocated`](super::algorithm::Resolved)): the same job
//!   without servers ([`colocated_geometry`]);
//! - on the flat plan, its small tensors in groups
//!   ([`Resolved::Grouped`](super::algorithm::Resolved)): the same job in
//!   two levels ([`grouped_geometry`], [`takes_groups`]).

use std::ops::Range;

use fairring_core::DataType;
use fairring_core::plan::{
    Geometry, InputArea, MachineGroups, Membership, Plan, PlanConfig, Routing, ServerGroupLayout,
    Span, TwoLevelLayout,
};

use super::algorithm::doubling;
use crate::error::{Error, Result};
use crate::memory::Sources;

/// The geometry of the machines' own plan in a job of `geometry` with
/// dedicated servers: the geometry the same job has without them (the same
/// machines and slices, in one level if `geometry`'s configuration says so,
/// the machines serving shards of at least `min_shard_bytes`: the minimum
/// shard a job without servers takes, where none was given); `None`
/// without servers, or where the job cannot plan without them.
pub(crate) fn colocated_geometry(geometry: &Geometry, min_shard_bytes: u64) -> Option<Geometry> {
    geometry.servers()?;
    let config = geometry
        .config()
        .with_min_shard_bytes(min_shard_bytes)
        .ok()?;
    Geometry::new(geometry.topology(), config).ok()
}

/// The fewest machines whose flat plan takes groups for its small tensors
/// ([`grouped_geometry`]).
pub const GROUPED_FROM_MACHINES: u32 = 16;

/// The geometry a job on the flat plan in its default slices
/// (`default_slices`: no `FAIRRING_SLICE_SIZE`, no `FAIRRING_GROUP_SIZE`, an
/// exact wire, not halved to fit the budget) plans its small tensors with
/// ([`takes_groups`]): the same machines in four to eight equal groups (the
/// fewest), else in four as even as can be, in the same default slices
/// ([`Geometry::with_groups_in_its_slices`], cut for small tensors, so that
/// on machines of several GPUs its buffers are no larger than the flat
/// plan's; with one rank a machine about a tenth larger), from
/// [`GROUPED_FROM_MACHINES`] machines on; `None` elsewhere (dedicated
/// servers, another routing, fewer machines). Under the default budget a
/// job of one rank a machine halves its slices to fit two buffers, and then
/// has none.
///
/// Flat, every machine serving a shard of a slice hears from every other,
/// so a machine sends up to `2(M - 1)` messages a slice, and a small
/// tensor's slices hold shards of the minimum for only some machines, which
/// then move `M / shards` times their share, or are too few to overlap
/// their stages. In `Q` groups of `G` a slice sends `2(G - 1) + 2(Q - 1)`
/// messages of a `G`th and an `M`th of the slot, every machine alike, and a
/// small tensor is cut in four. The scale model (`docs/scale-model.md`,
/// "Small tensors in groups") puts this at 1.01 to 2.0 times the flat
/// plan's busbw for 1 to 64 MiB tensors on 128 to 488 H100s where
/// [`takes_groups`] chooses it (0.98 at worst: 8 MiB on 176), and at 1.03
/// to 18 times on V100 and p3dn, nowhere lower.
pub fn grouped_geometry(geometry: &Geometry, default_slices: bool) -> Option<Geometry> {
    let machines = geometry.topology().machines();
    if !default_slices
        || geometry.servers().is_some()
        || geometry.routing() != Routing::Flat
        || machines < GROUPED_FROM_MACHINES
    {
        return None;
    }
    let config = PlanConfig::with_default_slices(geometry.min_shard_bytes()).ok()?;
    Geometry::with_groups_in_its_slices(
        geometry.topology(),
        config,
        small_tensor_group_size(machines),
    )
    .ok()
}

/// The largest group of [`grouped_geometry`] over `machines` machines: four
/// to eight equal groups where the machines make some (the fewest), else
/// four groups as even as can be.
fn small_tensor_group_size(machines: u32) -> u32 {
    (4..=8)
        .find(|&groups| machines.is_multiple_of(groups))
        .map_or(machines.div_ceil(4), |groups| machines / groups)
}

/// Whether a tensor of `elements` elements of `dtype` on `flat` (a flat
/// geometry of the default slices with a [`grouped_geometry`]) plans in
/// groups: where `flat` cuts it into fewer than
/// [`PlanConfig::MIN_SLICES_PER_TENSOR`] slices (too few to overlap their
/// stages), and either the slices are the wide flat ones (which no tensor
/// is cut into more of) or one of them gives fewer than three in four
/// machines a shard of the minimum (those that do then move `M / shards`
/// times their share). The same on every rank.
pub fn takes_groups(flat: &Geometry, dtype: DataType, elements: u64) -> bool {
    let Ok(plan) = Plan::new(flat, dtype, elements, 0) else {
        return false;
    };
    let count = plan.slice_count();
    let (Ok(first), Ok(last)) = (plan.slice(0), plan.slice(count.saturating_sub(1))) else {
        return false;
    };
    let machines = flat.topology().machines();
    let few_serve = |shards: u32| 4 * u64::from(shards) < 3 * u64::from(machines);
    count < PlanConfig::MIN_SLICES_PER_TENSOR
        && (!flat.config().slice_by_routing()
            || few_serve(first.shards())
            || few_serve(last.shards()))
}

/// Where everything of one slice lives in a staging buffer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BufferLayout {
    core: fairring_core::plan::StagingLayout,
    /// Where the contribution areas and the ring's receive slots start.
    inbox: usize,
    /// Bytes of one ring receive slot.
    ring_slot: usize,
    /// Ring receive slots: `N - 1`.
    ring_slots: u32,
    /// Bytes of one recursive-doubling receive slot, and of its largest slice.
    doubling_slot: usize,
    /// Recursive-doubling receive slots: indices `first..end` (see
    /// `doubling::slots`).
    doubling_first: u32,
    doubling_end: u32,
    /// Bytes of a reduce-scatter's piece (one rank's share of its slice), and
    /// of each of its `N - 1` receive slots.
    scatter_piece: usize,
    /// Where the reduce-scatter's receive slots start.
    scatter_inbox: usize,
    /// Bytes of one staging buffer.
    buffer_bytes: usize,
    /// A dedicated server's buffer, when the job has servers.
    server: Option<fairring_core::plan::ServerLayout>,
    /// Bytes of a dedicated server's staging buffer (0 without servers).
    server_bytes: usize,
    /// The two levels' areas, where the slots are reduced in groups.
    two_level: Option<TwoLevelLayout>,
    /// A dedicated server's areas, where the servers are in groups.
    server_groups: Option<ServerGroupLayout>,
    /// The job's second geometry (the machines' own plan beside dedicated
    /// servers, or a flat job's groups), whose slices the buffers also hold.
    second: Option<Geometry>,
}

impl BufferLayout {
    /// The layout for `geometry` over `world` ranks; `None` if it does not fit
    /// this machine's address space.
    pub(crate) fn new(geometry: &Geometry, world: u32) -> Option<BufferLayout> {
        let core = geometry.staging_layout_with(InputArea::Slice);
        let inbox = usize::try_from(core.slot().byte_len()).ok()?;
        // A ring chunk holds at most ceil(elements / N) elements of at most 8 bytes.
        let ring_slot = (inbox / world as usize)
            .checked_add(8)?
            .checked_next_multiple_of(64)?;
        let ring_slots = world - 1;
        let ring_end = inbox.checked_add(ring_slot.checked_mul(ring_slots as usize)?)?;
        let mut buffer_bytes = usize::try_from(core.total_bytes()).ok()?.max(ring_end);
        let doubling_slots = doubling::slots(world);
        // Whole 64-byte lines, no larger than a slice (a whole one where no slot
        // is used: a single rank), and at least one line: the buffer grows for
        // that where slices are tiny.
        let doubling_slot = match doubling_slots.len() {
            0 => inbox,
            n => {
                let slot = ((buffer_bytes - inbox) / n / 64 * 64).clamp(64, inbox.max(64));
                buffer_bytes = buffer_bytes.max(inbox.checked_add(slot.checked_mul(n)?)?);
                slot
            }
        };
        let scatter_piece = (inbox / world as usize / 64 * 64).max(64);
        let scatter_inbox = inbox.max(scatter_piece.checked_mul(world as usize)?);
        buffer_bytes = buffer_bytes
            .max(scatter_inbox.checked_add(scatter_piece.checked_mul(world as usize - 1)?)?);
        let two_level = geometry.two_level_layout(InputArea::Slice);
        if let Some(t) = two_level {
            buffer_bytes = buffer_bytes.max(usize::try_from(t.total_bytes()).ok()?);
        }
        let server = geometry.server_layout();
        let server_groups = geometry.server_group_layout();
        let server_bytes = match (server, server_groups) {
            (Some(s), _) => usize::try_from(s.total_bytes()).ok()?,
            (None, Some(g)) => usize::try_from(g.total_bytes()).ok()?,
            (None, None) => 0,
        };
        Some(BufferLayout {
            core,
            inbox,
            ring_slot,
            ring_slots,
            doubling_slot,
            doubling_first: doubling_slots.start,
            doubling_end: doubling_slots.end,
            scatter_piece,
            scatter_inbox,
            buffer_bytes,
            server,
            server_bytes,
            two_level,
            server_groups,
            second: None,
        })
    }

    /// This layout, its buffers grown to hold the slices of the job's second
    /// geometry too (see the module docs), `second` over `world` workers;
    /// `None` if that does not fit this machine's address space.
    pub(crate) fn holding_second(self, second: Geometry, world: u32) -> Option<BufferLayout> {
        let own = BufferLayout::new(&second, world)?;
        Some(BufferLayout {
            buffer_bytes: self.buffer_bytes.max(own.buffer_bytes),
            second: Some(second),
            ..self
        })
    }

    /// The job's second geometry, and its layout in this layout's buffers,
    /// where they hold it ([`BufferLayout::holding_second`]).
    pub(crate) fn second(&self, world: u32) -> Option<(Geometry, BufferLayout)> {
        let geometry = self.second?;
        let own = BufferLayout::new(&geometry, world)?;
        let layout = BufferLayout {
            buffer_bytes: self.buffer_bytes,
            ..own
        };
        (own.buffer_bytes <= self.buffer_bytes).then_some((geometry, layout))
    }

    /// The job's second geometry, where the buffers hold one.
    pub(crate) fn second_geometry(&self) -> Option<Geometry> {
        self.second
    }

    /// Bytes of the largest slice (the input area at the buffer's start).
    pub(crate) fn slice_bytes(&self) -> usize {
        self.inbox
    }

    /// Bytes of the largest recursive-doubling slice: one receive slot.
    pub(crate) fn doubling_slice_bytes(&self) -> usize {
        self.doubling_slot
    }

    /// Offset of recursive doubling's receive slot `slot` (0: the fold and the
    /// unfold; `k`: round `k`).
    pub(crate) fn doubling_slot(&self, slot: u32) -> Result<usize> {
        if !(self.doubling_first..self.doubling_end).contains(&slot) {
            return Err(Error::internal(
                "a recursive-doubling round has a receive slot",
                format!(
                    "slot {slot} of {}..{}",
                    self.doubling_first, self.doubling_end
                ),
            ));
        }
        Ok(self.inbox + (slot - self.doubling_first) as usize * self.doubling_slot)
    }

    /// Bytes of the largest reduce-scatter piece: a reduce-scatter's slice is
    /// `N` of them.
    pub(crate) fn scatter_piece_bytes(&self) -> usize {
        self.scatter_piece
    }

    /// Offset of the reduce-scatter's receive slot for step `step` (`N - 1`
    /// steps).
    pub(crate) fn scatter_slot(&self, step: u32) -> Result<usize> {
        if step >= self.ring_slots {
            return Err(Error::internal(
                "a reduce-scatter step has a receive slot",
                format!("step {step} of {}", self.ring_slots),
            ));
        }
        Ok(self.scatter_inbox + step as usize * self.scatter_piece)
    }

    /// Where a relay over the machines lands a slot of `len` bytes: the
    /// receive area past the slice, which holds a slot wherever there are
    /// several devices per machine.
    pub(crate) fn relay_inbox(&self, len: u64) -> Result<usize> {
        let fits = usize::try_from(len)
            .ok()
            .and_then(|len| self.inbox.checked_add(len))
            .is_some_and(|end| end <= self.buffer_bytes);
        if !fits {
            return Err(Error::internal(
                "a machine relay's receive area holds its slot",
                format!("{len} bytes past {} in {}", self.inbox, self.buffer_bytes),
            ));
        }
        Ok(self.inbox)
    }

    /// Bytes of one dedicated server's staging buffer (0 without servers).
    pub(crate) fn server_buffer_bytes(&self) -> usize {
        self.server_bytes
    }

    /// Whether dedicated server `server` receives cells of slot `device` (its
    /// rail group's slots); false without servers.
    pub(crate) fn server_receives_slot(&self, server: u32, device: u32) -> bool {
        self.server
            .is_some_and(|layout| layout.receives_slot(server, device))
    }

    /// The area of a dedicated server's staging buffer that receives machine
    /// `machine`'s cell of slot `device`.
    pub(crate) fn server_area(&self, machine: u32, device: u32) -> Result<Range<usize>> {
        let server = self.server.ok_or_else(|| {
            Error::internal(
                "only a job with dedicated servers asks for their areas",
                format!("machine {machine}, device {device}"),
            )
        })?;
        let area = server
            .area(machine, device)
            .map_err(|e| Error::internal("every worker's cell has a server area", e.to_string()))?;
        area.byte_range().ok_or_else(|| {
            Error::internal("the layout fits the address space", format!("{area:?}"))
        })
    }

    /// A dedicated server's fold `index` of slot `device`
    /// ([`ServerLayout::fold`](fairring_core::plan::ServerLayout::fold)): the
    /// machines it folds, and their cells' first `len` bytes as one
    /// reduction's sources. `None` past the last fold.
    pub(crate) fn server_fold(
        &self,
        index: u32,
        device: u32,
        len: usize,
    ) -> Result<Option<(Range<u32>, Sources)>> {
        let server = self.server.ok_or_else(|| {
            Error::internal(
                "only a job with dedicated servers folds cells",
                format!("fold {index} of slot {device}"),
            )
        })?;
        let Some(machines) = server.fold(index) else {
            return Ok(None);
        };
        let first = self.server_area(machines.start, device)?;
        if len > first.len() {
            return Err(Error::internal(
                "a cell fits its server area",
                format!("{len} bytes in {first:?}"),
            ));
        }
        let stride = usize::try_from(server.shard_stride())
            .map_err(|e| Error::internal("the layout fits the address space", e.to_string()))?;
        let sources = Sources {
            first: first.start,
            stride,
            count: machines.end - machines.start,
            start: 0,
            len,
        };
        Ok(Some((machines, sources)))
    }

    /// Where the servers are in groups, their layout.
    fn server_groups(&self) -> Result<&ServerGroupLayout> {
        self.server_groups.as_ref().ok_or_else(|| {
            Error::internal(
                "only a job whose servers are in groups asks for their areas",
                format!("{:?}", self.core.routing()),
            )
        })
    }

    /// Where the servers are in groups, the bytes of units `units` of a
    /// server's accumulator: a whole slot, in which `units` lie at their
    /// offset in the slot (`units` given in bytes of the slot).
    pub(crate) fn server_accumulator(&self, units: Range<usize>) -> Result<Range<usize>> {
        let slot = self.server_groups()?.accumulator();
        let len = layout_bytes(slot.byte_len())?;
        if units.start > units.end || units.end > len {
            return Err(Error::internal(
                "a range of a slot lies within a server's accumulator",
                format!("{units:?} in {len} bytes"),
            ));
        }
        Ok(units)
    }

    /// Where the servers are in groups, the area of a server's buffer that
    /// receives its group's worker `member`'s cell (from 1; member 0's lands
    /// in the accumulator).
    pub(crate) fn server_within(&self, member: u32) -> Result<Range<usize>> {
        let area = self.server_groups()?.within(member);
        two_level_area(area, "a server's workers are of its group")
    }

    /// Where the servers are in groups, the first `len` bytes of the areas
    /// of workers `1..workers` of a server's group, in member order.
    pub(crate) fn server_within_sources(&self, workers: u32, len: usize) -> Result<Sources> {
        let layout = self.server_groups()?;
        let stride = layout_bytes(layout.within_stride())?;
        if workers < 2 || len > stride {
            return Err(Error::internal(
                "a server in groups reduces the cells of its other workers, of at most a stride",
                format!("{workers} workers, {len} of {stride} bytes"),
            ));
        }
        Ok(Sources {
            first: self.server_within(1)?.start,
            stride,
            count: workers - 1,
            start: 0,
            len,
        })
    }

    /// Where the servers are in groups, the area of server `own`'s buffer
    /// that receives server `from`'s partial sum of `own`'s piece of its
    /// `interval`-th interval (both indices within their rail group).
    pub(crate) fn server_across(&self, interval: u32, from: u32, own: u32) -> Result<Range<usize>> {
        let area = self.server_groups()?.across(interval, from, own);
        two_level_area(
            area,
            "partial sums across come from a server of another group",
        )
    }

    /// Where the servers are in groups, the first `len` bytes of the areas
    /// that receive the other groups' partial sums of server `own`'s piece
    /// of its `interval`-th interval, in group order.
    pub(crate) fn server_across_sources(
        &self,
        interval: u32,
        own: u32,
        len: usize,
    ) -> Result<Sources> {
        let layout = self.server_groups()?;
        let servers = layout.groups().servers();
        let group = membership(servers, own)?.group;
        let count = servers.groups();
        let next = servers
            .first((group + 1) % count)
            .map_err(|e| Error::internal("every group has a first server", e.to_string()))?;
        let first = self.server_across(interval, next, own)?;
        let stride = layout_bytes(layout.across_stride())?;
        area_sources(first.start, stride, count - 1, group, len)
    }

    /// Bytes of one staging buffer.
    pub(crate) fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// The area that receives machine `from`'s contribution at a device of machine
    /// `own`.
    pub(crate) fn contribution(&self, from: u32, own: u32) -> Result<Range<usize>> {
        let area = self.core.contribution(from, own).map_err(|e| {
            Error::internal(
                "contributions come from another machine of the job",
                e.to_string(),
            )
        })?;
        area.byte_range().ok_or_else(|| {
            Error::internal("the layout fits the address space", format!("{area:?}"))
        })
    }

    /// The first `len` bytes of every other machine's contribution area at a device
    /// of machine `own`, in machine order.
    pub(crate) fn contributions_to(&self, own: u32, len: usize) -> Result<Sources> {
        let count = self.core.contribution_areas();
        let stride = usize::try_from(self.core.shard_stride()).map_err(|_| {
            Error::internal(
                "the layout fits the address space",
                format!("{:?}", self.core),
            )
        })?;
        if count == 0 || len > stride {
            return Err(Error::internal(
                "a machine that reduces has contributions of at most a stride",
                format!("{count} areas of {stride} bytes, {len} wanted"),
            ));
        }
        let machines = count + 1;
        // Area `i` holds machine `(own + 1 + i) mod M`: machine 0 is in area
        // `M - own - 1`, and machine order walks the areas from there.
        Ok(Sources {
            first: self.inbox,
            stride,
            count,
            start: (machines - own % machines - 1) % count,
            len,
        })
    }

    /// How the hierarchical all-reduce's cells travel between machines.
    pub(crate) fn routing(&self) -> Routing {
        self.core.routing()
    }

    /// Through trees, the area that receives child `child`'s contribution (0
    /// the left child, 1 the right one).
    pub(crate) fn child(&self, child: u32) -> Result<Range<usize>> {
        let area = self.core.child(child).map_err(|e| {
            Error::internal("a tree's contributions come from a child", e.to_string())
        })?;
        area.byte_range().ok_or_else(|| {
            Error::internal("the layout fits the address space", format!("{area:?}"))
        })
    }

    /// Through trees, bytes `within..within + len` of the areas of the first
    /// `count` children (one or two), in order: where a part of their cells
    /// lands.
    pub(crate) fn children(&self, count: u32, within: usize, len: usize) -> Result<Sources> {
        let first = self.child(0)?;
        let stride = usize::try_from(self.core.shard_stride()).map_err(|_| {
            Error::internal(
                "the layout fits the address space",
                format!("{:?}", self.core),
            )
        })?;
        if !(1..=2).contains(&count) || within.saturating_add(len) > stride {
            return Err(Error::internal(
                "an inner node of a tree reduces one or two children's cells of at most a stride",
                format!("{count} children, {len} bytes at {within} of {stride}"),
            ));
        }
        Ok(Sources {
            first: first.start + within,
            stride,
            count,
            start: 0,
            len,
        })
    }

    /// In groups, the area that receives machine `from`'s contribution to
    /// machine `own`'s range: the two of one group.
    pub(crate) fn within(&self, from: u32, own: u32) -> Result<Range<usize>> {
        let area = self.two_level()?.within(from, own);
        two_level_area(area, "contributions within a group come from a group mate")
    }

    /// In groups, the area that receives machine `from`'s partial sum of
    /// machine `own`'s piece of its `interval`-th interval: the two of
    /// different groups.
    pub(crate) fn across(&self, interval: u32, from: u32, own: u32) -> Result<Range<usize>> {
        let area = self.two_level()?.across(interval, from, own);
        two_level_area(
            area,
            "partial sums across the groups come from another group",
        )
    }

    /// In groups, the first `len` bytes of the areas that receive machine
    /// `own`'s group mates' contributions (one fewer than its group's
    /// members), in member order.
    pub(crate) fn within_sources(&self, own: u32, len: usize) -> Result<Sources> {
        let layout = self.two_level()?;
        let groups = layout.groups();
        let mine = membership(groups, own)?;
        let members = groups
            .size(mine.group)
            .map_err(|e| Error::internal("a machine's group exists", e.to_string()))?;
        let first_member = groups
            .machine(mine.group, (mine.member + 1) % members)
            .map_err(|e| Error::internal("a group's members are machines", e.to_string()))?;
        let first = self.within(first_member, own)?;
        let stride = layout_bytes(layout.within_stride())?;
        area_sources(first.start, stride, members - 1, mine.member, len)
    }

    /// In groups, the first `len` bytes of the areas that receive the other
    /// groups' partial sums of machine `own`'s piece of its `interval`-th
    /// interval (one fewer than the groups), in group order.
    pub(crate) fn across_sources(&self, interval: u32, own: u32, len: usize) -> Result<Sources> {
        let layout = self.two_level()?;
        let groups = layout.groups();
        let group = membership(groups, own)?.group;
        let count = groups.groups();
        // Any machine of the next group: the area is the group's.
        let next = groups
            .first((group + 1) % count)
            .map_err(|e| Error::internal("every group has a first machine", e.to_string()))?;
        let first = self.across(interval, next, own)?;
        let stride = layout_bytes(layout.across_stride())?;
        area_sources(first.start, stride, count - 1, group, len)
    }

    /// The two levels' areas, where the job reduces its slots in groups.
    fn two_level(&self) -> Result<&TwoLevelLayout> {
        self.two_level.as_ref().ok_or_else(|| {
            Error::internal(
                "only a job that reduces its slots in groups asks for the two levels' areas",
                format!("{:?}", self.core.routing()),
            )
        })
    }

    /// Offset of the ring's receive slot for step `step`.
    pub(crate) fn ring_slot(&self, step: u32) -> Result<usize> {
        if step >= self.ring_slots {
            return Err(Error::internal(
                "a ring step has a receive slot",
                format!("step {step} of {}", self.ring_slots),
            ));
        }
        Ok(self.inbox + step as usize * self.ring_slot)
    }
}

/// A two-level area's bytes, or the engine's error `why` it was refused.
fn two_level_area(
    area: std::result::Result<Span, fairring_core::plan::PlanError>,
    why: &'static str,
) -> Result<Range<usize>> {
    let area = area.map_err(|e| Error::internal(why, e.to_string()))?;
    area.byte_range()
        .ok_or_else(|| Error::internal("the layout fits the address space", format!("{area:?}")))
}

/// Bytes of a layout's stride, in the address space.
fn layout_bytes(bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| {
        Error::internal(
            "the layout fits the address space",
            format!("{bytes} bytes"),
        )
    })
}

/// Machine `own`'s group and index in it.
fn membership(groups: MachineGroups, own: u32) -> Result<Membership> {
    groups
        .locate(own)
        .map_err(|e| Error::internal("this machine is in the job", e.to_string()))
}

/// `count` areas `stride` apart from `first`, area `i` holding party
/// `(own + 1 + i) mod (count + 1)`, read in party order.
fn area_sources(first: usize, stride: usize, count: u32, own: u32, len: usize) -> Result<Sources> {
    if count == 0 || len > stride {
        return Err(Error::internal(
            "a machine that reduces in groups has contributions of at most a stride",
            format!("{count} areas of {stride} bytes, {len} wanted"),
        ));
    }
    let parties = count + 1;
    // Party 0 is in area `parties - own - 1` (none where it is `own`).
    Ok(Sources {
        first,
        stride,
        count,
        start: (parties - own % parties - 1) % count,
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fairring_core::plan::PlanConfig;
    use fairring_core::topology::{RankLayout, Topology};

    fn default_flat(m: u32, d: u32) -> Geometry {
        let t = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let config = PlanConfig::with_default_slices(PlanConfig::DEFAULT_MIN_SHARD_BYTES).unwrap();
        Geometry::new(t, config).unwrap()
    }

    /// A flat job of the default slices from 16 machines gets four to eight
    /// equal groups (the fewest), else four groups as even as can be; none
    /// with slices given, beside servers, in groups already, or on fewer
    /// machines.
    #[test]
    fn a_flat_job_of_sixteen_machines_or_more_groups_its_small_tensors() {
        for (m, largest, groups) in [(16, 4, 4), (50, 10, 5), (42, 7, 6), (49, 7, 7), (53, 14, 4)] {
            let flat = default_flat(m, 8);
            assert_eq!(flat.routing(), Routing::Flat, "{m} machines");
            let grouped = grouped_geometry(&flat, true).unwrap();
            let g = grouped.machine_groups().unwrap();
            assert_eq!((g.largest(), g.groups()), (largest, groups), "{m} machines");
            assert_eq!(grouped.topology(), flat.topology());
            assert_eq!(grouped.min_shard_bytes(), flat.min_shard_bytes());
            assert!(!takes_groups(&flat, DataType::F32, 1 << 30), "{m}: 4 GiB");
        }
        assert!(grouped_geometry(&default_flat(15, 8), true).is_none());
        assert!(grouped_geometry(&default_flat(16, 8), false).is_none());
        // 56 machines of 8 make equal groups in the wide slices themselves.
        assert_eq!(default_flat(56, 8).routing(), Routing::Groups);
        assert!(grouped_geometry(&default_flat(56, 8), true).is_none());
        let t = Topology::new(16, 1, RankLayout::Contiguous).unwrap();
        let config = PlanConfig::with_default_slices(PlanConfig::DEFAULT_MIN_SHARD_BYTES).unwrap();
        let servers = Geometry::with_servers(t, config, 2).unwrap();
        assert!(grouped_geometry(&servers, true).is_none());
    }

    /// The groups for small tensors take buffers no larger than the flat
    /// plan's on machines of 8 GPUs, and about a tenth larger with one rank a
    /// machine (its slot the whole slice, the first level's areas most of a
    /// slice).
    #[test]
    fn the_groups_for_small_tensors_fit_the_flat_plans_buffers() {
        for (m, d, most) in [
            (16, 8, 1.0),
            (32, 8, 1.0),
            (50, 8, 1.0),
            (61, 8, 1.0),
            (16, 1, 1.11),
        ] {
            let flat = default_flat(m, d);
            let grouped = grouped_geometry(&flat, true).unwrap();
            let (of_flat, of_groups) = (
                BufferLayout::new(&flat, m * d).unwrap().buffer_bytes(),
                BufferLayout::new(&grouped, m * d).unwrap().buffer_bytes(),
            );
            assert!(
                of_groups as f64 <= most * of_flat as f64,
                "{m}x{d}: {of_groups} bytes in groups, {of_flat} flat"
            );
            let held = BufferLayout::new(&flat, m * d)
                .unwrap()
                .holding_second(grouped, m * d)
                .unwrap();
            assert_eq!(held.buffer_bytes(), of_flat.max(of_groups));
            assert_eq!(held.second(m * d).map(|(g, _)| g), Some(grouped));
        }
    }

    /// Worked by hand on machines of 8 GPUs at the 64 KiB minimum shard (a
    /// slot is an eighth of its slice).
    #[test]
    fn small_tensors_take_groups_where_their_flat_slices_are_few_and_some_short() {
        let f32_mib = |mib: u64| (mib << 20) / 4;
        // (machines of 8, MiB, whether it takes groups)
        for (m, mib, takes) in [
            // One slice, a 128 KiB slot, 2 shards of 16.
            (16, 1, true),
            // One slice, a 2 MiB slot of 32 shards, 16 kept.
            (16, 16, false),
            // 32 shards of 44 machines, below three in four.
            (44, 16, true),
            // 32 of 40 is four in five.
            (40, 16, false),
            // Cut 25, 25 and 14 MiB (a shard each for 50 in a slot of 25
            // MiB / 8), the last slot's 28 shards of 50.
            (50, 64, true),
            // Four slices (16.5 MiB each but the last).
            (33, 64, false),
            // 16 and 9 MiB, 18 shards of 20 in the last.
            (20, 25, false),
            // 18 and 7 MiB, 14 shards of 36 in the last.
            (36, 25, true),
        ] {
            assert_eq!(
                takes_groups(&default_flat(m, 8), DataType::F32, f32_mib(mib)),
                takes,
                "{m} machines, {mib} MiB"
            );
        }
        // 53 machines: the wide flat slices, never cut; 64 MiB is two of
        // them, 128 MiB four.
        let wide = default_flat(53, 8);
        assert_eq!(
            wide.config().slice_bytes(),
            PlanConfig::WIDE_FLAT_SLICE_BYTES
        );
        assert!(!wide.config().slice_by_routing());
        assert!(takes_groups(&wide, DataType::F32, f32_mib(64)));
        assert!(!takes_groups(&wide, DataType::F32, f32_mib(128)));
        // The rule counts bytes, whatever their type.
        assert!(takes_groups(&default_flat(50, 8), DataType::U8, 64 << 20));
        assert!(!takes_groups(&default_flat(50, 8), DataType::F64, 0));
    }

    #[test]
    fn contribution_sources_walk_the_machines_in_order() {
        for (m, d) in [(2, 1), (3, 2), (5, 1), (8, 4)] {
            let t = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let g = Geometry::new(t, PlanConfig::new(1 << 20, 4096).unwrap()).unwrap();
            let layout = BufferLayout::new(&g, m * d).unwrap();
            for own in 0..m {
                let by_machine: Vec<_> = (0..m)
                    .filter(|&from| from != own)
                    .map(|from| {
                        let a = layout.contribution(from, own).unwrap();
                        a.start..a.start + 100
                    })
                    .collect();
                let sources: Vec<_> = layout
                    .contributions_to(own, 100)
                    .unwrap()
                    .ranges()
                    .collect();
                assert_eq!(sources, by_machine, "{m}x{d}, machine {own}");
                assert!(sources.iter().all(|r| r.end <= layout.buffer_bytes()));
            }
        }
    }

    /// In groups, the sources of a machine's reductions are its group
    /// mates' areas in member order, and the other groups' areas of each
    /// interval in group order, all within the buffer; a flat job has none.
    #[test]
    fn two_level_sources_walk_the_members_and_the_groups_in_order() {
        for (m, d, size) in [(4, 1, 2), (7, 2, 3), (10, 1, 4), (16, 3, 6)] {
            let t = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let g = Geometry::with_groups(t, PlanConfig::new(1 << 20, 64).unwrap(), size).unwrap();
            let groups = g.machine_groups().unwrap();
            let layout = BufferLayout::new(&g, m * d).unwrap();
            for own in 0..m {
                let mine = groups.locate(own).unwrap();
                let by_member: Vec<_> = (0..groups.size(mine.group).unwrap())
                    .map(|j| groups.machine(mine.group, j).unwrap())
                    .filter(|&from| from != own)
                    .map(|from| {
                        let a = layout.within(from, own).unwrap();
                        a.start..a.start + 100
                    })
                    .collect();
                let sources: Vec<_> = layout.within_sources(own, 100).unwrap().ranges().collect();
                assert_eq!(
                    sources, by_member,
                    "{m}x{d} in groups of {size}, machine {own}"
                );
                for interval in 0..2 {
                    let by_group: Vec<_> = (0..groups.groups())
                        .filter(|&h| h != mine.group)
                        .map(|h| {
                            let from = groups.first(h).unwrap();
                            let a = layout.across(interval, from, own).unwrap();
                            a.start..a.start + 100
                        })
                        .collect();
                    let sources: Vec<_> = layout
                        .across_sources(interval, own, 100)
                        .unwrap()
                        .ranges()
                        .collect();
                    assert_eq!(sources, by_group, "{m}x{d}, machine {own}, {interval}");
                    assert!(sources.iter().all(|r| r.end <= layout.buffer_bytes()));
                }
            }
        }
        let t = Topology::new(4, 1, RankLayout::Contiguous).unwrap();
        let flat = Geometry::new(t, PlanConfig::new(1 << 20, 64).unwrap()).unwrap();
        assert!(BufferLayout::new(&flat, 4).unwrap().within(0, 1).is_err());
    }

    #[test]
    fn ring_slots_follow_the_slice_and_fit() {
        let t = Topology::new(2, 2, RankLayout::Contiguous).unwrap();
        let g = Geometry::new(t, PlanConfig::new(1 << 20, 4096).unwrap()).unwrap();
        let layout = BufferLayout::new(&g, 4).unwrap();
        let full = usize::try_from(g.full_slice_bytes()).unwrap();
        assert_eq!(layout.ring_slot(0).unwrap(), full);
        let last = layout.ring_slot(2).unwrap();
        assert!(last + full / 4 <= layout.buffer_bytes());
        assert!(layout.ring_slot(3).is_err());
    }

    #[test]
    fn scatter_pieces_and_slots_fit_beside_every_slice_size() {
        for (m, d, slice) in [
            (1, 1, 1 << 20),
            (2, 1, 64),
            (3, 1, 192),
            (2, 2, 4096),
            (8, 1, 1 << 20),
            (5, 3, 1000),
        ] {
            let t = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let g = Geometry::new(t, PlanConfig::new(slice, 64).unwrap()).unwrap();
            let world = m * d;
            let layout = BufferLayout::new(&g, world).unwrap();
            let piece = layout.scatter_piece_bytes();
            assert!(piece >= 64 && piece.is_multiple_of(64), "{m}x{d}: {piece}");
            let pieces = piece * world as usize;
            assert!(
                pieces <= layout.slice_bytes().max(64 * world as usize),
                "{m}x{d}"
            );
            let mut end = pieces;
            for step in 0..world - 1 {
                let slot = layout.scatter_slot(step).unwrap();
                assert!(
                    slot >= end,
                    "{m}x{d}: slot {step} overlaps what precedes it"
                );
                end = slot + piece;
            }
            assert!(end <= layout.buffer_bytes(), "{m}x{d}");
            assert!(layout.scatter_slot(world - 1).is_err());
        }
    }

    #[test]
    fn doubling_has_a_slot_of_a_line_even_beside_the_smallest_slice() {
        let t = Topology::new(2, 1, RankLayout::Contiguous).unwrap();
        let g = Geometry::new(t, PlanConfig::new(64, 64).unwrap()).unwrap();
        let layout = BufferLayout::new(&g, 2).unwrap();
        assert_eq!(layout.doubling_slice_bytes(), 64);
        let slot = layout.doubling_slot(1).unwrap();
        assert!(slot + 64 <= layout.buffer_bytes());
    }

    #[test]
    fn doubling_slots_hold_a_doubling_slice_and_fit() {
        for (m, d) in [(1, 1), (2, 1), (3, 1), (2, 2), (5, 1), (8, 8), (1000, 1)] {
            let t = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let g = Geometry::new(t, PlanConfig::new(1 << 20, 4096).unwrap()).unwrap();
            let world = m * d;
            let layout = BufferLayout::new(&g, world).unwrap();
            let bytes = layout.doubling_slice_bytes();
            let slots = doubling::slots(world);
            assert!(
                bytes >= 4096 && bytes.is_multiple_of(64),
                "{m}x{d}: {bytes}"
            );
            assert!(bytes <= layout.slice_bytes());
            assert!(layout.doubling_slot(slots.end).is_err());
            if slots.is_empty() {
                continue;
            }
            let first = layout.doubling_slot(slots.start).unwrap();
            assert_eq!(first, layout.slice_bytes(), "slots start past the slice");
            let last = layout.doubling_slot(slots.end - 1).unwrap();
            assert!(last + bytes <= layout.buffer_bytes(), "{m}x{d}");
            // Slot 0 exists only where some rank is extra.
            assert_eq!(layout.doubling_slot(0).is_ok(), !world.is_power_of_two());
        }
    }
}
