//! The all-reduce of one slice in two levels (`Routing::Groups`): within
//! groups of machines, then across the groups, on one rank.
//!
//! Staging buffer of rank (machine `m`, device `d`): the slice, staged in,
//! then the areas of the core's
//! [`TwoLevelLayout`](fairring_core::plan::TwoLevelLayout) (`engine/layout.rs`):
//!
//! ```text
//! [0, full_slice)   the slice: slot d becomes the machine's partial sum,
//!                   then the group's over this machine's range, then final
//! within areas      one per other member of the largest group
//! across areas      one per other group, for each of two intervals
//! ```
//!
//! The core's `MachineGroups::roles` (`plan/two_level.rs`) gives this machine
//! a range of slot `d` (counted in units, `Slice::group_units`), a word
//! within its group and a word across the groups per interval of its range.
//! This type turns what those words hand out into steps:
//!
//! 1. the local reduce-scatter leaves the machine's partial sum of slot `d` in
//!    the buffer (the words' `ReduceScatterDone`);
//! 2. within, `START_CONTRIBUTIONS`: each group mate's range goes to device
//!    `d` of that machine, into its area for this one (`Contribution`);
//! 3. `START_REDUCE`: this machine's range is reduced in place over its group
//!    mates' contributions, the group's partial sum;
//! 4. `START_SEND_UP`: the words across begin. For each interval, each other
//!    group's piece of it goes to that group's holder of the interval, into
//!    its area for this group (`Partial`); this machine's piece is reduced
//!    over the other groups' partial sums (the whole sum: an average divides
//!    here) and sent back to every other holder, into the same units of its
//!    slot (`Result`), where the other pieces' results land too;
//! 5. once every word across has its results (`START_ALL_GATHER`, taken as
//!    done at once: nothing is gathered at that level), the range is final:
//!    within, `ParentResultReceived`, and `START_SEND_BACK` sends it to every
//!    group mate, into the same units of its slot, as their ranges land here;
//! 6. within, `START_ALL_GATHER`: the slot is final; the local all-gather
//!    copies every slot into the caller's tensor; the buffer is released once
//!    every word across has released (within, `PartialSent`) and every send
//!    has completed.
//!
//! A member whose range is empty (a slot of fewer units than its group has
//! members) only sends its contributions and receives the results. Every
//! word is acquired when the slice starts, so a partial sum of another
//! group, whose area is its own, may land before this machine's group is
//! done.
//!
//! **Parts.** A write's part (in its immediate and token, `engine/tags.rs`)
//! says which word it belongs to at both ends: 0 within the group; across,
//! `1 + 2 i + j` for the sender's interval `i` and the receiver's `j` (a
//! holder's intervals are those of its own range: the same units may be the
//! first interval of one holder and the second of another). The receiver
//! tells a result within from one across by the sender's group as well.
//!
//! Values cross exact, whatever the wire format asked for, as through the
//! trees: an `f16` or `bf16` partial sum is stored in its type, rounded once
//! per level.

use std::ops::Range;

use fairring_core::plan::{MOST_INTERVALS, MachineGroups, Membership, TwoLevelRoles};
use fairring_core::staging::{Actions, Event, Role, Word};
use fairring_core::{ReduceOp, WireFormat};

use super::hierarchical::refused;
use super::{Context, DeviceUse, SliceEvent, SliceInfo, Step, Write, stray_event, unexpected};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::Reduction;

/// Intervals a range has at most, as an index.
const MOST: usize = MOST_INTERVALS as usize;

/// A word of the slice: within the group, or across for an interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Level {
    Within,
    Across(u32),
}

/// The two-level state of one slice.
#[derive(Debug)]
pub(crate) struct TwoLevel {
    groups: MachineGroups,
    /// Slot `d`'s units, as the two levels count them.
    units: u64,
    roles: TwoLevelRoles,
    within: Word,
    /// One word per interval of this machine's range: the first `intervals`.
    across: [Word; MOST],
    intervals: u32,
    /// Words across that handed out `START_ALL_GATHER`, and `RELEASE`.
    across_final: u32,
    across_released: u32,
    /// Levels in the order their reductions were asked for, and how many have
    /// ended: the engine reports the ends of a buffer's steps in order.
    reductions: [Level; 1 + MOST],
    reductions_asked: usize,
    reductions_ended: usize,
    /// Whether the local all-gather has been asked for.
    gathering: bool,
}

impl TwoLevel {
    /// Acquires the slice's words for this machine's roles and begins the
    /// local reduce-scatter.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<TwoLevel> {
        if s.direct || s.into_window || ctx.servers > 0 {
            return Err(Error::internal(
                "a slice in groups stages its slot and has no dedicated servers",
                format!(
                    "slice {} (direct {}, servers {})",
                    s.number, s.direct, ctx.servers
                ),
            ));
        }
        let groups = s.slice.machine_groups().ok_or_else(|| {
            Error::internal(
                "only a slice in groups runs in two levels",
                format!("slice {}", s.number),
            )
        })?;
        let units = s
            .slice
            .group_units(ctx.location.device)
            .map_err(|e| Error::internal("every device has a slot", e.to_string()))?;
        let roles = groups
            .roles(units, ctx.location.machine)
            .map_err(|e| Error::internal("every machine has roles in groups", e.to_string()))?;
        let acquire = |role: Role| {
            Word::free(s.generation)
                .acquire(s.generation, role)
                .map_err(|e| Error::internal("a new slice's words are free", e.to_string()))
        };
        let within = acquire(roles.within())?;
        let mut across = [within; MOST];
        let mut intervals = 0;
        for (word, a) in across.iter_mut().zip(roles.across()) {
            *word = acquire(a.role)?;
            intervals += 1;
        }
        steps.push(Step::LocalBegin);
        steps.push(Step::LocalReduceScatter { final_world: None });
        Ok(TwoLevel {
            groups,
            units,
            roles,
            within,
            across,
            intervals,
            across_final: 0,
            across_released: 0,
            reductions: [Level::Within; 1 + MOST],
            reductions_asked: 0,
            reductions_ended: 0,
            gathering: false,
        })
    }

    /// What a device tensor's slice asks of the device: the local step,
    /// whole, never final (there are always several machines).
    pub(crate) fn device_use() -> DeviceUse {
        DeviceUse::local(None, false)
    }

    /// Takes one event.
    pub(crate) fn on_event(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        event: SliceEvent,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let (level, core_event, from) = match event {
            SliceEvent::LocalReduceScatterDone => (Level::Within, Event::ReduceScatterDone, None),
            SliceEvent::LocalAllGatherDone => (Level::Within, Event::AllGatherDone, None),
            SliceEvent::Landed { kind, peer, part } => {
                let (level, event) = self.landed(ctx, s, kind, peer, part)?;
                (level, event, Some(peer))
            }
            SliceEvent::Sent { kind, part } => {
                let level = match (kind, part) {
                    (Kind::Contribution | Kind::Result, 0) => Level::Within,
                    (Kind::Partial | Kind::Result, 1..) => {
                        let (sender, _) = interval_pair(part);
                        self.across_level(sender)
                            .ok_or_else(|| stray_event(event, s, &self.phase()))?
                    }
                    _ => return Err(stray_event(event, s, &self.phase())),
                };
                let core_event = match kind {
                    Kind::Result => Event::ResultSent,
                    _ => Event::ContributionSent,
                };
                (level, core_event, None)
            }
            SliceEvent::Reduced if self.reductions_ended < self.reductions_asked => {
                let level = self.reductions[self.reductions_ended];
                self.reductions_ended += 1;
                (level, Event::Reduced, None)
            }
            SliceEvent::Staged
            | SliceEvent::Reduced
            | SliceEvent::CopiedOut
            | SliceEvent::Converted(_) => return Err(stray_event(event, s, &self.phase())),
        };
        self.run(ctx, s, level, core_event, from, steps)
    }

    /// The level and event of a peer's write of `kind` and `part`, refused
    /// unless it comes from where that level expects writes.
    fn landed(
        &self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        kind: Kind,
        peer: u32,
        part: u32,
    ) -> Result<(Level, Event)> {
        let me = self.roles.membership();
        let sender = ctx
            .topology
            .locate(peer)
            .ok()
            .filter(|l| l.device == ctx.location.device && l.machine != ctx.location.machine)
            .and_then(|l| self.groups.locate(l.machine).ok());
        let Some(Membership { group, .. }) = sender else {
            return Err(unexpected(kind, peer, s, "not a rail of another machine"));
        };
        let within = group == me.group;
        let level = match (kind, part, within) {
            (Kind::Contribution | Kind::Result, 0, true) => Level::Within,
            (Kind::Partial | Kind::Result, 1.., false) => {
                let (_, receiver) = interval_pair(part);
                self.across_level(receiver).ok_or_else(|| {
                    unexpected(
                        kind,
                        peer,
                        s,
                        "an interval this machine's range does not have",
                    )
                })?
            }
            _ => {
                return Err(unexpected(
                    kind,
                    peer,
                    s,
                    "a write of another level than its sender's group makes it",
                ));
            }
        };
        let event = match kind {
            Kind::Result => Event::ResultReceived,
            _ => Event::ContributionReceived,
        };
        Ok((level, event))
    }

    /// The word across for this machine's interval `interval`, if it has one.
    fn across_level(&self, interval: u32) -> Option<Level> {
        (interval < self.intervals).then_some(Level::Across(interval))
    }

    /// Steps `level`'s word with `event` (from `from`, if a peer's write),
    /// and every word the actions it hands out step in turn.
    fn run(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        level: Level,
        event: Event,
        from: Option<u32>,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let mut queue = Queue::default();
        queue.push(level, event, from)?;
        while let Some((level, event, from)) = queue.pop() {
            let word = match level {
                Level::Within => &mut self.within,
                Level::Across(i) => &mut self.across[i as usize],
            };
            let (stepped, actions) =
                word.on_event(event, s.generation).map_err(|e| match from {
                    // The engine delivers each write once, of this slice's
                    // generation: a write its word refuses (a duplicate, one for
                    // a word that has released, one before its word began) is
                    // the peer's.
                    Some(peer) => Error::peer(
                        peer,
                        format!(
                            "a write into slice {} that its word in groups refuses ({e}): the \
                         ranks' operations differ, or the peer broke the protocol",
                            s.number
                        ),
                    ),
                    None => refused(e, None, s),
                })?;
            *word = stepped;
            match level {
                Level::Within => self.act_within(ctx, s, actions, &mut queue, steps)?,
                Level::Across(i) => self.act_across(ctx, s, i, actions, &mut queue, steps)?,
            }
        }
        Ok(())
    }

    /// Acts on what the word within handed out.
    fn act_within(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        actions: Actions,
        queue: &mut Queue,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let me = self.roles.membership();
        let members = self
            .groups
            .size(me.group)
            .map_err(|e| Error::internal("a machine's group exists", e.to_string()))?;
        if actions.contains(Actions::START_CONTRIBUTIONS) {
            for member in (0..members).filter(|&j| j != me.member) {
                let range = self
                    .groups
                    .range(self.units, me.group, member)
                    .map_err(|e| Error::internal("every member has a range", e.to_string()))?;
                let machine = self.machine(me.group, member)?;
                let source = self.bytes(ctx, s, range)?;
                if source.is_empty() {
                    continue;
                }
                steps.push(Step::Write(Write {
                    kind: Kind::Contribution,
                    peer: ctx.rail_peer(machine)?,
                    source,
                    target: ctx.layout.within(ctx.location.machine, machine)?.start,
                    needs_credit: true,
                    part: 0,
                }));
            }
        }
        if actions.contains(Actions::START_REDUCE) {
            let dst = self.bytes(ctx, s, self.roles.range())?;
            let sources = ctx.layout.within_sources(ctx.location.machine, dst.len())?;
            self.ask_reduction(Level::Within, s, dst, sources, None, steps);
        }
        if actions.contains(Actions::START_SEND_UP) {
            for i in 0..self.intervals {
                queue.push(Level::Across(i), Event::ReduceScatterDone, None)?;
            }
        }
        if actions.contains(Actions::START_SEND_BACK) {
            let source = self.bytes(ctx, s, self.roles.range())?;
            for member in (0..members).filter(|&j| j != me.member) {
                steps.push(Step::Write(Write {
                    kind: Kind::Result,
                    peer: ctx.rail_peer(self.machine(me.group, member)?)?,
                    source: source.clone(),
                    target: source.start,
                    needs_credit: false,
                    part: 0,
                }));
            }
        }
        if actions.contains(Actions::START_ALL_GATHER) {
            self.gathering = true;
            steps.push(Step::PublishSlot);
            steps.push(Step::LocalAllGather {
                own_in_tensor: false,
            });
        }
        if actions.contains(Actions::RELEASE) {
            steps.push(Step::Release);
        }
        Ok(())
    }

    /// Acts on what the word across for interval `i` handed out.
    fn act_across(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        i: u32,
        actions: Actions,
        queue: &mut Queue,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let across = self
            .roles
            .across()
            .nth(i as usize)
            .ok_or_else(|| {
                Error::internal("a word across has its interval", format!("interval {i}"))
            })?
            .clone();
        let me = self.roles.membership();
        let sends = actions.contains(Actions::START_CONTRIBUTIONS);
        let results = actions.contains(Actions::START_SEND_BACK);
        if sends || results {
            let own_piece = self.bytes(ctx, s, across.piece.clone())?;
            for group in (0..self.groups.groups()).filter(|&g| g != me.group) {
                let (holder, j) = self.holder_of(group, across.interval.start)?;
                let part = 1 + MOST_INTERVALS * i + j;
                let peer = ctx.rail_peer(holder)?;
                if sends {
                    let piece = self
                        .groups
                        .piece(&across.interval, group)
                        .map_err(|e| Error::internal("every group has a piece", e.to_string()))?;
                    let source = self.bytes(ctx, s, piece)?;
                    if !source.is_empty() {
                        steps.push(Step::Write(Write {
                            kind: Kind::Partial,
                            peer,
                            source,
                            target: ctx.layout.across(j, ctx.location.machine, holder)?.start,
                            needs_credit: true,
                            part,
                        }));
                    }
                }
                if results {
                    steps.push(Step::Write(Write {
                        kind: Kind::Result,
                        peer,
                        source: own_piece.clone(),
                        target: own_piece.start,
                        needs_credit: false,
                        part,
                    }));
                }
            }
        }
        if actions.contains(Actions::START_REDUCE) {
            let dst = self.bytes(ctx, s, across.piece)?;
            let sources = ctx
                .layout
                .across_sources(i, ctx.location.machine, dst.len())?;
            self.ask_reduction(Level::Across(i), s, dst, sources, Some(ctx.world), steps);
        }
        if actions.contains(Actions::START_ALL_GATHER) {
            // Nothing to gather at this level; once every piece of the range
            // is final, the range is.
            queue.push(Level::Across(i), Event::AllGatherDone, None)?;
            self.across_final += 1;
            if self.across_final == self.intervals {
                queue.push(Level::Within, Event::ParentResultReceived, None)?;
            }
        }
        if actions.contains(Actions::RELEASE) {
            self.across_released += 1;
            if self.across_released == self.intervals {
                queue.push(Level::Within, Event::PartialSent, None)?;
            }
        }
        Ok(())
    }

    /// Asks for `dst` to be reduced in place over `sources`; `whole`: the
    /// sum is the job's, of this many ranks, which an average divides.
    fn ask_reduction(
        &mut self,
        level: Level,
        s: &SliceInfo<'_>,
        dst: Range<usize>,
        sources: crate::memory::Sources,
        whole: Option<u32>,
        steps: &mut Vec<Step>,
    ) {
        self.reductions[self.reductions_asked] = level;
        self.reductions_asked += 1;
        steps.push(Step::Reduce(Reduction {
            dtype: s.dtype,
            op: s.op,
            dst,
            sources,
            average_over: whole.filter(|_| s.op == ReduceOp::Avg),
            wire: WireFormat::Exact,
        }));
    }

    /// The machine of member `member` of group `group`.
    fn machine(&self, group: u32, member: u32) -> Result<u32> {
        self.groups
            .machine(group, member)
            .map_err(|e| Error::internal("every member is a machine", e.to_string()))
    }

    /// Group `group`'s holder of the interval that starts at unit `start`,
    /// and the index of that interval among the holder's.
    fn holder_of(&self, group: u32, start: u64) -> Result<(u32, u32)> {
        let internal = |e: fairring_core::plan::PlanError| {
            Error::internal("every group holds every unit of a slot", e.to_string())
        };
        let member = self
            .groups
            .holder(self.units, group, start)
            .map_err(internal)?;
        let range = self
            .groups
            .range(self.units, group, member)
            .map_err(internal)?;
        // A range's intervals: the first starts where it does.
        Ok((
            self.machine(group, member)?,
            u32::from(range.start != start),
        ))
    }

    /// Units `units` of slot `d`, in bytes of the staging buffer (the slice
    /// at its start).
    fn bytes(
        &self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        units: Range<u64>,
    ) -> Result<Range<usize>> {
        let span = s
            .slice
            .slot_units_span(ctx.location.device, units)
            .map_err(|e| Error::internal("every device has a slot", e.to_string()))?;
        span.byte_range_in(s.slice.span()).ok_or_else(|| {
            Error::internal(
                "a slot's units lie within its slice",
                format!("{span:?} in {:?}", s.slice.span()),
            )
        })
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        let across = &self.across[..self.intervals as usize];
        if !self.within.in_use() {
            "released"
        } else if !self.within.reduce_scatter_done() {
            "local reduce-scatter"
        } else if across.iter().any(|w| w.in_use() && w.reduce_scatter_done()) {
            "across the groups"
        } else if !self.gathering {
            "within the group"
        } else if !self.within.all_gather_done() {
            "local all-gather"
        } else {
            "draining its sends"
        }
    }
}

/// The events one event leads to among a slice's words, in order, without
/// allocating: at most the event itself, a `ReduceScatterDone` and an
/// `AllGatherDone` per word across, and `ParentResultReceived` and
/// `PartialSent` within (and on a server in groups, whose all-gather is
/// done at once, an `AllGatherDone` within).
#[derive(Default)]
pub(super) struct Queue {
    events: [Option<(Level, Event, Option<u32>)>; QUEUED],
    pushed: usize,
    popped: usize,
}

/// Most events one event leads to ([`Queue`]).
const QUEUED: usize = 4 + 2 * MOST;

impl Queue {
    pub(super) fn push(&mut self, level: Level, event: Event, from: Option<u32>) -> Result<()> {
        let slot = self.events.get_mut(self.pushed).ok_or_else(|| {
            Error::internal(
                "one event of a slice in groups leads to a bounded number of others",
                format!("more than {QUEUED}"),
            )
        })?;
        *slot = Some((level, event, from));
        self.pushed += 1;
        Ok(())
    }

    pub(super) fn pop(&mut self) -> Option<(Level, Event, Option<u32>)> {
        let next = self.events.get_mut(self.popped)?.take()?;
        self.popped += 1;
        Some(next)
    }
}

/// The sender's and the receiver's interval a write across carries in its
/// part (`1 + 2 i + j`, see the module docs).
pub(super) fn interval_pair(part: u32) -> (u32, u32) {
    let p = part - 1;
    (p / MOST_INTERVALS, p % MOST_INTERVALS)
}
