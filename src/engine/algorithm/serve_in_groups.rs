//! A dedicated server's part of one slice where the servers are in groups
//! (fairring-core's `ServerGroups`, `Routing::Groups` with servers): within
//! its group, the workers' cells of its range; across the groups, the pieces
//! of that range, server to server.
//!
//! The workers run [`Hierarchical`](super::Hierarchical), each sending every
//! server of its group that server's range of its slot. Server `p` of the job
//! is server `p / D` of rail group `p mod D` (servers in groups serve one rail
//! each) and serves slot `d = p mod D`. Its staging buffer is the core's
//! [`ServerGroupLayout`](fairring_core::plan::ServerGroupLayout): a whole-slot
//! accumulator in which its range lies at its own offset in the slot, an area
//! per other worker of its group, and the across areas. This type turns what
//! its staging words hand out into steps, as [`TwoLevel`](super::TwoLevel)
//! does for a machine of the co-located two levels, with the workers in the
//! group mates' place:
//!
//! 1. the slice starts with its word within past the reduce-scatter: a server
//!    has no local step;
//! 2. within, each of its `W` workers' cells lands (`Contribution`): member
//!    0's in the accumulator over the range, the others in their areas;
//! 3. `START_REDUCE`: the range is reduced in place over the other `W - 1`
//!    cells, the group's partial sum;
//! 4. `START_SEND_UP`: the words across begin. For each interval of its range,
//!    each other group's piece of it goes to that group's holder of the
//!    interval, into its area for this server (`Partial`); this server's
//!    piece is reduced over the other groups' partial sums (the whole sum: an
//!    average divides here) and sent back to every other holder, over the
//!    same offsets of its accumulator (`Result`), where the other pieces'
//!    results land too;
//! 5. once every word across has its results, the range is final: within,
//!    `ParentResultReceived`, and `START_SEND_BACK` sends it to each of the
//!    `W` workers, into the same bytes of its slot (`Result`);
//! 6. within, `START_ALL_GATHER` is taken as done at once (nothing to
//!    gather), and the buffer is released once every word across has
//!    released (within, `PartialSent`) and every send has completed.
//!
//! A server whose range is empty (a slot of fewer units than its group has
//! servers) receives nothing and releases at once. Writes carry their part
//! as the co-located two levels' do: 0 within (cells and results to
//! workers); across, `1 + 2 i + j` for the sender's interval `i` and the
//! receiver's `j`. Values cross exact whatever the wire format asked for;
//! an `f16` or `bf16` partial sum is rounded once per level.

use std::ops::Range;

use fairring_core::ReduceOp;
use fairring_core::WireFormat;
use fairring_core::plan::{MOST_INTERVALS, ServerGroups, TwoLevelRoles};
use fairring_core::staging::{Actions, Event, Role, Word};
use fairring_core::topology::Location;

use super::hierarchical::refused;
use super::two_level::{Level, Queue, interval_pair};
use super::{Context, SliceEvent, SliceInfo, Step, Write, stray_event, unexpected};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::{Reduction, Sources};

/// Intervals a range has at most, as an index.
const MOST: usize = MOST_INTERVALS as usize;

/// A server's state of one slice in groups.
#[derive(Debug)]
pub(crate) struct ServeInGroups {
    groups: ServerGroups,
    /// This server's index in its rail group, and the slot it serves.
    index: u32,
    device: u32,
    /// Slot `device`'s units, as the two levels count them.
    units: u64,
    roles: TwoLevelRoles,
    /// The worker machines of this server's group.
    workers: Range<u32>,
    within: Word,
    /// One word per interval of this server's range: the first `intervals`.
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
    released: bool,
}

impl ServeInGroups {
    /// Takes the slice: acquires its words for this server's roles, past the
    /// reduce-scatter it does not have; releases at once if its range is
    /// empty.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<ServeInGroups> {
        let (groups, server) = match (s.slice.server_groups(), ctx.server) {
            (Some(groups), Some(server)) => (groups, server),
            _ => {
                return Err(Error::internal(
                    "only a dedicated server in groups serves a slice in groups",
                    format!("slice {} on rank {}", s.number, ctx.rank),
                ));
            }
        };
        let devices = ctx.topology.devices_per_machine();
        let (index, device) = (server / devices, server % devices);
        let internal = |e: fairring_core::plan::PlanError| {
            Error::internal("every server has roles in its groups", e.to_string())
        };
        let units = s.slice.group_units(device).map_err(internal)?;
        let roles = groups.servers().roles(units, index).map_err(internal)?;
        let group = roles.membership().group;
        let workers = groups.workers(group).map_err(internal)?;
        let w = workers.end - workers.start;
        let holds = !roles.range().is_empty();
        #[expect(
            clippy::cast_possible_truncation,
            reason = "a group's workers, below 4096"
        )]
        let within_role = if holds {
            Role {
                contributions_to_send: 0,
                contributions_to_receive: w as u16,
                results_to_send: w as u16,
                results_to_receive: 0,
                reduces: true,
                forwards: true,
            }
        } else {
            Role::IDLE
        };
        let acquire = |role: Role| {
            Word::free(s.generation)
                .acquire(s.generation, role)
                .map_err(|e| Error::internal("a new slice's words are free", e.to_string()))
        };
        let within = acquire(within_role)?;
        let mut across = [within; MOST];
        let mut intervals = 0;
        for (word, a) in across.iter_mut().zip(roles.across()) {
            *word = acquire(a.role)?;
            intervals += 1;
        }
        let mut serve = ServeInGroups {
            groups,
            index,
            device,
            units,
            roles,
            workers,
            within,
            across,
            intervals,
            across_final: 0,
            across_released: 0,
            reductions: [Level::Within; 1 + MOST],
            reductions_asked: 0,
            reductions_ended: 0,
            released: false,
        };
        serve.run(ctx, s, Level::Within, Event::ReduceScatterDone, None, steps)?;
        Ok(serve)
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
            SliceEvent::Landed { kind, peer, part } => {
                let (level, event) = self.landed(ctx, s, kind, peer, part)?;
                (level, event, Some(peer))
            }
            SliceEvent::Sent { kind, part } => {
                let level = match (kind, part) {
                    (Kind::Result, 0) => Level::Within,
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
            _ => return Err(stray_event(event, s, &self.phase())),
        };
        self.run(ctx, s, level, core_event, from, steps)
    }

    /// The level and event of a peer's write of `kind` and `part`, refused
    /// unless it comes from where that level expects writes: a worker of
    /// this server's group on its rail within, a server of its rail group
    /// in another group across.
    fn landed(
        &self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        kind: Kind,
        peer: u32,
        part: u32,
    ) -> Result<(Level, Event)> {
        if peer < ctx.world {
            let from_worker = ctx
                .topology
                .locate(peer)
                .ok()
                .filter(|l| l.device == self.device && self.workers.contains(&l.machine));
            return match (kind, part, from_worker) {
                (Kind::Contribution, 0, Some(_)) => {
                    Ok((Level::Within, Event::ContributionReceived))
                }
                _ => Err(unexpected(
                    kind,
                    peer,
                    s,
                    "a server in groups hears only cells from its group's workers on its rail",
                )),
            };
        }
        let devices = ctx.topology.devices_per_machine();
        let other = peer - ctx.world;
        let group = self.roles.membership().group;
        let across = other % devices == self.device
            && self
                .groups
                .servers()
                .locate(other / devices)
                .is_ok_and(|m| m.group != group);
        let level = match (kind, part, across) {
            (Kind::Partial | Kind::Result, 1.., true) => {
                let (_, receiver) = interval_pair(part);
                self.across_level(receiver).ok_or_else(|| {
                    unexpected(
                        kind,
                        peer,
                        s,
                        "an interval this server's range does not have",
                    )
                })?
            }
            _ => {
                return Err(unexpected(
                    kind,
                    peer,
                    s,
                    "a server hears across only from its rail's servers of other groups",
                ));
            }
        };
        let event = match kind {
            Kind::Result => Event::ResultReceived,
            _ => Event::ContributionReceived,
        };
        Ok((level, event))
    }

    /// The word across for this server's interval `interval`, if it has one.
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
                    Some(peer) => Error::peer(
                        peer,
                        format!(
                            "a write into slice {} that a server's word in groups refuses \
                             ({e}): the ranks' operations differ, or the peer broke the \
                             protocol",
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
        // A server sends no cells of its own (`START_CONTRIBUTIONS` finds
        // none to send).
        if actions.contains(Actions::START_REDUCE) {
            let dst = self.accumulator(ctx, s, self.roles.range())?;
            let workers = self.workers.end - self.workers.start;
            let sources = if workers > 1 {
                ctx.layout.server_within_sources(workers, dst.len())?
            } else {
                Sources::none(dst.len())
            };
            self.ask_reduction(Level::Within, s, dst, sources, None, steps);
        }
        if actions.contains(Actions::START_SEND_UP) {
            for i in 0..self.intervals {
                queue.push(Level::Across(i), Event::ReduceScatterDone, None)?;
            }
        }
        if actions.contains(Actions::START_SEND_BACK) {
            let range = self.roles.range();
            let source = self.accumulator(ctx, s, range.clone())?;
            let target = self.in_slice(s, range)?.start;
            for machine in self.workers.clone() {
                let peer = ctx
                    .topology
                    .rank(Location {
                        machine,
                        device: self.device,
                    })
                    .map_err(|e| Error::internal("every worker has every rail", e.to_string()))?;
                steps.push(Step::Write(Write {
                    kind: Kind::Result,
                    peer,
                    source: source.clone(),
                    target,
                    needs_credit: false,
                    part: 0,
                }));
            }
        }
        if actions.contains(Actions::START_ALL_GATHER) {
            // Nothing to gather on a server.
            queue.push(Level::Within, Event::AllGatherDone, None)?;
        }
        if actions.contains(Actions::RELEASE) {
            self.released = true;
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
        let group = self.roles.membership().group;
        let servers = self.groups.servers();
        let sends = actions.contains(Actions::START_CONTRIBUTIONS);
        let results = actions.contains(Actions::START_SEND_BACK);
        if sends || results {
            let own_piece = self.accumulator(ctx, s, across.piece.clone())?;
            for other in (0..servers.groups()).filter(|&g| g != group) {
                let (holder, j) = self.holder_of(other, across.interval.start)?;
                let part = 1 + MOST_INTERVALS * i + j;
                let peer = self.server_rank(ctx, holder);
                if sends {
                    let piece = servers
                        .piece(&across.interval, other)
                        .map_err(|e| Error::internal("every group has a piece", e.to_string()))?;
                    let source = self.accumulator(ctx, s, piece)?;
                    if !source.is_empty() {
                        steps.push(Step::Write(Write {
                            kind: Kind::Partial,
                            peer,
                            source,
                            target: ctx.layout.server_across(j, self.index, holder)?.start,
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
            let dst = self.accumulator(ctx, s, across.piece)?;
            let sources = ctx.layout.server_across_sources(i, self.index, dst.len())?;
            self.ask_reduction(Level::Across(i), s, dst, sources, Some(ctx.world), steps);
        }
        if actions.contains(Actions::START_ALL_GATHER) {
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
        sources: Sources,
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

    /// The process rank of server `index` of this server's rail group.
    fn server_rank(&self, ctx: &Context<'_>, index: u32) -> u32 {
        ctx.world + index * ctx.topology.devices_per_machine() + self.device
    }

    /// Group `group`'s holder of the interval that starts at unit `start`
    /// (its index in the rail group), and the index of that interval among
    /// the holder's.
    fn holder_of(&self, group: u32, start: u64) -> Result<(u32, u32)> {
        let internal = |e: fairring_core::plan::PlanError| {
            Error::internal("every group holds every unit of a slot", e.to_string())
        };
        let servers = self.groups.servers();
        let member = servers.holder(self.units, group, start).map_err(internal)?;
        let range = servers.range(self.units, group, member).map_err(internal)?;
        Ok((
            servers.machine(group, member).map_err(internal)?,
            u32::from(range.start != start),
        ))
    }

    /// Units `units` of slot `d`, in bytes from the slot's start: where they
    /// lie in a server's accumulator.
    fn accumulator(
        &self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        units: Range<u64>,
    ) -> Result<Range<usize>> {
        let internal =
            |e: fairring_core::plan::PlanError| Error::internal("the slot exists", e.to_string());
        let slot = s.slice.slot(self.device).map_err(internal)?;
        let span = s
            .slice
            .slot_units_span(self.device, units)
            .map_err(internal)?;
        let bytes = span.byte_range_in(slot).ok_or_else(|| {
            Error::internal(
                "a slot's units lie within it",
                format!("{span:?} in {slot:?}"),
            )
        })?;
        ctx.layout.server_accumulator(bytes)
    }

    /// Units `units` of slot `d`, in bytes from the slice's start: where they
    /// lie in a worker's staging buffer.
    fn in_slice(&self, s: &SliceInfo<'_>, units: Range<u64>) -> Result<Range<usize>> {
        let span = s
            .slice
            .slot_units_span(self.device, units)
            .map_err(|e| Error::internal("the slot exists", e.to_string()))?;
        span.byte_range_in(s.slice.span()).ok_or_else(|| {
            Error::internal(
                "a slot's units lie within its slice",
                format!("{span:?} in {:?}", s.slice.span()),
            )
        })
    }

    /// The algorithm the workers run for the slice.
    pub(crate) fn resolved(&self) -> super::Resolved {
        super::Resolved::Hierarchical
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        let across = &self.across[..self.intervals as usize];
        if self.released || !self.within.in_use() {
            "released"
        } else if across.iter().any(|w| w.in_use() && w.reduce_scatter_done()) {
            "across the groups"
        } else {
            "collecting and reducing its group's cells"
        }
    }
}
