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
//! **Parts.** A write's part says which word it belongs to at both ends
//! (`algorithm/levels.rs`, whose words and exchange across a dedicated
//! server in groups shares). The receiver tells a result within from one
//! across by the sender's group as well.
//!
//! Values cross exact, whatever the wire format asked for, as through the
//! trees: an `f16` or `bf16` partial sum is stored in its type, rounded once
//! per level.

use std::ops::Range;

use fairring_core::plan::{MachineGroups, Membership, TwoLevelRoles};
use fairring_core::staging::{Actions, Event};

use super::levels::{Exchange, Level, Placement, Queue, Words, received, units_in_slice};
use super::{Context, DeviceUse, SliceEvent, SliceInfo, Step, Write, stray_event, unexpected};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::Sources;

/// The two-level state of one slice.
#[derive(Debug)]
pub(crate) struct TwoLevel {
    words: Words,
    within: Within,
}

/// What the word within acts on: the groups, the slot's units and this
/// machine's roles, and whether the local all-gather has been asked for.
#[derive(Debug)]
struct Within {
    groups: MachineGroups,
    /// Slot `d`'s units, as the two levels count them.
    units: u64,
    roles: TwoLevelRoles,
    gathering: bool,
}

/// A machine's rail in the exchange across the groups: its slot at the
/// start of its buffer, the two levels' areas past it.
struct Rail<'a> {
    ctx: &'a Context<'a>,
}

impl Placement for Rail<'_> {
    fn rank_of(&self, member: u32) -> Result<u32> {
        self.ctx.rail_peer(member)
    }

    fn bytes(&self, s: &SliceInfo<'_>, units: Range<u64>) -> Result<Range<usize>> {
        units_in_slice(s, self.ctx.location.device, units)
    }

    fn area_at(&self, interval: u32, holder: u32) -> Result<usize> {
        Ok(self
            .ctx
            .layout
            .across(interval, self.ctx.location.machine, holder)?
            .start)
    }

    fn across_sources(&self, interval: u32, len: usize) -> Result<Sources> {
        self.ctx
            .layout
            .across_sources(interval, self.ctx.location.machine, len)
    }
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
        let words = Words::acquire(s.generation, roles.within(), &roles)?;
        steps.push(Step::LocalBegin);
        steps.push(Step::LocalReduceScatter { final_world: None });
        Ok(TwoLevel {
            words,
            within: Within {
                groups,
                units,
                roles,
                gathering: false,
            },
        })
    }

    /// What a device tensor's slice asks of the device: the local step,
    /// whole, never final (there are always several machines).
    pub(crate) fn device_use() -> DeviceUse {
        DeviceUse::local(None, false)
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        let within = &self.words.within;
        if !within.in_use() {
            "released"
        } else if !within.reduce_scatter_done() {
            "local reduce-scatter"
        } else if self.words.across_running() {
            "across the groups"
        } else if !self.within.gathering {
            "within the group"
        } else if !within.all_gather_done() {
            "local all-gather"
        } else {
            "draining its sends"
        }
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
            SliceEvent::Sent { .. } | SliceEvent::Reduced => {
                let (level, event) = self
                    .words
                    .sent_or_reduced(event)
                    .ok_or_else(|| stray_event(event, s, &self.phase()))?;
                (level, event, None)
            }
            SliceEvent::Staged | SliceEvent::CopiedOut | SliceEvent::Converted(_) => {
                return Err(stray_event(event, s, &self.phase()));
            }
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
        let me = self.within.roles.membership();
        let sender = ctx
            .topology
            .locate(peer)
            .ok()
            .filter(|l| l.device == ctx.location.device && l.machine != ctx.location.machine)
            .and_then(|l| self.within.groups.locate(l.machine).ok());
        let Some(Membership { group, .. }) = sender else {
            return Err(unexpected(kind, peer, s, "not a rail of another machine"));
        };
        if group != me.group {
            return self.words.landed_across(kind, part).ok_or_else(|| {
                unexpected(
                    kind,
                    peer,
                    s,
                    "not a partial sum or result across, or of an interval this machine's range \
                     does not have",
                )
            });
        }
        match (kind, part) {
            (Kind::Contribution | Kind::Result, 0) => Ok((Level::Within, received(kind))),
            _ => Err(unexpected(
                kind,
                peer,
                s,
                "a write of another level than its sender's group makes it",
            )),
        }
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
        let mut gathering = false;
        self.words.run(
            s,
            Exchange {
                placement: &Rail { ctx },
                groups: within.groups,
                units: within.units,
                roles: &within.roles,
                world: ctx.world,
            },
            (level, event, from),
            steps,
            |words, actions, queue, steps| {
                gathering |= within.act(ctx, s, words, actions, queue, steps)?;
                Ok(())
            },
        )?;
        self.within.gathering |= gathering;
        Ok(())
    }
}

impl Within {
    /// Acts on what the word within handed out; whether it asked for the
    /// local all-gather.
    fn act(
        &self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        words: &mut Words,
        actions: Actions,
        queue: &mut Queue,
        steps: &mut Vec<Step>,
    ) -> Result<bool> {
        let me = self.roles.membership();
        let members = self
            .groups
            .size(me.group)
            .map_err(|e| Error::internal("a machine's group exists", e.to_string()))?;
        let rail = Rail { ctx };
        if actions.contains(Actions::START_CONTRIBUTIONS) {
            for member in (0..members).filter(|&j| j != me.member) {
                let range = self
                    .groups
                    .range(self.units, me.group, member)
                    .map_err(|e| Error::internal("every member has a range", e.to_string()))?;
                let machine = self.machine(me.group, member)?;
                let source = rail.bytes(s, range)?;
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
            let dst = rail.bytes(s, self.roles.range())?;
            let sources = ctx.layout.within_sources(ctx.location.machine, dst.len())?;
            words.ask_reduction(Level::Within, s, dst, sources, None, steps);
        }
        if actions.contains(Actions::START_SEND_UP) {
            for i in 0..words.intervals {
                queue.push(Level::Across(i), Event::ReduceScatterDone, None)?;
            }
        }
        if actions.contains(Actions::START_SEND_BACK) {
            let source = rail.bytes(s, self.roles.range())?;
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
        let gathering = actions.contains(Actions::START_ALL_GATHER);
        if gathering {
            steps.push(Step::PublishSlot);
            steps.push(Step::LocalAllGather {
                own_in_tensor: false,
            });
        }
        if actions.contains(Actions::RELEASE) {
            steps.push(Step::Release);
        }
        Ok(gathering)
    }

    /// The machine of member `member` of group `group`.
    fn machine(&self, group: u32, member: u32) -> Result<u32> {
        self.groups
            .machine(group, member)
            .map_err(|e| Error::internal("every member is a machine", e.to_string()))
    }
}
