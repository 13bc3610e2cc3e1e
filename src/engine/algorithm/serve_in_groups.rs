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
//! servers) receives nothing and releases at once. The words and the
//! exchange across are the co-located two levels' (`algorithm/levels.rs`),
//! writes carrying their parts as there: 0 within (cells and results to
//! workers). Values cross exact whatever the wire format asked for; an
//! `f16` or `bf16` partial sum is rounded once per level.

use std::ops::Range;

use fairring_core::plan::{ServerGroups, TwoLevelRoles};
use fairring_core::staging::{Actions, Event, Role};
use fairring_core::topology::Location;

use super::levels::{Exchange, Level, Placement, Queue, Words, units_in_slice};
use super::{Context, SliceEvent, SliceInfo, Step, Write, stray_event, unexpected};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::Sources;

/// A server's state of one slice in groups.
#[derive(Debug)]
pub(crate) struct ServeInGroups {
    words: Words,
    within: Within,
    released: bool,
}

/// What the word within acts on: where the server is in its groups, and
/// its roles.
#[derive(Debug)]
struct Within {
    groups: ServerGroups,
    /// This server's index in its rail group, and the slot it serves.
    index: u32,
    device: u32,
    /// Slot `device`'s units, as the two levels count them.
    units: u64,
    roles: TwoLevelRoles,
    /// The worker machines of this server's group.
    workers: Range<u32>,
}

/// A server in the exchange across the groups: its range in a whole-slot
/// accumulator at the start of its buffer, the areas across past its
/// workers' (`ServerGroupLayout`).
struct Server<'a> {
    ctx: &'a Context<'a>,
    index: u32,
    device: u32,
}

impl Placement for Server<'_> {
    fn rank_of(&self, member: u32) -> Result<u32> {
        Ok(self.ctx.grouped_server_rank(member, self.device))
    }

    fn bytes(&self, s: &SliceInfo<'_>, units: Range<u64>) -> Result<Range<usize>> {
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
        self.ctx.layout.server_accumulator(bytes)
    }

    fn area_at(&self, interval: u32, holder: u32) -> Result<usize> {
        Ok(self
            .ctx
            .layout
            .server_across(interval, self.index, holder)?
            .start)
    }

    fn across_sources(&self, interval: u32, len: usize) -> Result<Sources> {
        self.ctx
            .layout
            .server_across_sources(interval, self.index, len)
    }
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
        let workers = groups.workers(roles.membership().group).map_err(internal)?;
        let w = workers.end - workers.start;
        // Within, a flat plan's server of its range over its workers, whose
        // sum goes on across the groups.
        #[expect(
            clippy::cast_possible_truncation,
            reason = "a group's workers, below 4096"
        )]
        let within = if roles.range().is_empty() {
            Role::IDLE
        } else {
            Role {
                contributions_to_send: 0,
                contributions_to_receive: w as u16,
                results_to_send: w as u16,
                results_to_receive: 0,
                reduces: true,
                forwards: true,
            }
        };
        let words = Words::acquire(s.generation, within, &roles)?;
        let mut serve = ServeInGroups {
            words,
            within: Within {
                groups,
                index,
                device,
                units,
                roles,
                workers,
            },
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
            // A server sends results within and partial sums and results
            // across, never cells.
            SliceEvent::Sent {
                kind: Kind::Contribution,
                part: 0,
            } => return Err(stray_event(event, s, &self.phase())),
            SliceEvent::Sent { .. } | SliceEvent::Reduced => {
                let (level, event) = self
                    .words
                    .sent_or_reduced(event)
                    .ok_or_else(|| stray_event(event, s, &self.phase()))?;
                (level, event, None)
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
            let from_worker = ctx.topology.locate(peer).ok().filter(|l| {
                l.device == self.within.device && self.within.workers.contains(&l.machine)
            });
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
        // The inverse of `Context::grouped_server_rank`.
        let devices = ctx.topology.devices_per_machine();
        let other = peer - ctx.world;
        let group = self.within.roles.membership().group;
        let across = other % devices == self.within.device
            && self
                .within
                .groups
                .servers()
                .locate(other / devices)
                .is_ok_and(|m| m.group != group);
        if !across {
            return Err(unexpected(
                kind,
                peer,
                s,
                "a server hears across only from its rail's servers of other groups",
            ));
        }
        self.words.landed_across(kind, part).ok_or_else(|| {
            unexpected(
                kind,
                peer,
                s,
                "not a partial sum or result across, or of an interval this server's range does \
                 not have",
            )
        })
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
        let within = &self.within;
        let server = Server {
            ctx,
            index: within.index,
            device: within.device,
        };
        let mut released = false;
        self.words.run(
            s,
            Exchange {
                placement: &server,
                groups: within.groups.servers(),
                units: within.units,
                roles: &within.roles,
                world: ctx.world,
            },
            (level, event, from),
            steps,
            |words, actions, queue, steps| {
                released |= within.act(&server, s, words, actions, queue, steps)?;
                Ok(())
            },
        )?;
        self.released |= released;
        Ok(())
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if self.released || !self.words.within.in_use() {
            "released"
        } else if self.words.across_running() {
            "across the groups"
        } else {
            "collecting and reducing its group's cells"
        }
    }
}

impl Within {
    /// Acts on what the word within handed out; whether it released the
    /// buffer.
    fn act(
        &self,
        server: &Server<'_>,
        s: &SliceInfo<'_>,
        words: &mut Words,
        actions: Actions,
        queue: &mut Queue,
        steps: &mut Vec<Step>,
    ) -> Result<bool> {
        let ctx = server.ctx;
        // A server sends no cells of its own (`START_CONTRIBUTIONS` finds
        // none to send).
        if actions.contains(Actions::START_REDUCE) {
            let dst = server.bytes(s, self.roles.range())?;
            let workers = self.workers.end - self.workers.start;
            let sources = if workers > 1 {
                ctx.layout.server_within_sources(workers, dst.len())?
            } else {
                Sources::none(dst.len())
            };
            words.ask_reduction(Level::Within, s, dst, sources, None, steps);
        }
        if actions.contains(Actions::START_SEND_UP) {
            for i in 0..words.intervals {
                queue.push(Level::Across(i), Event::ReduceScatterDone, None)?;
            }
        }
        if actions.contains(Actions::START_SEND_BACK) {
            let range = self.roles.range();
            let source = server.bytes(s, range.clone())?;
            let target = units_in_slice(s, self.device, range)?.start;
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
        let released = actions.contains(Actions::RELEASE);
        if released {
            steps.push(Step::Release);
        }
        Ok(released)
    }
}
