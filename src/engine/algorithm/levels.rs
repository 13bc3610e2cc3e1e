//! The staging words of a reduction in two levels, and its exchange across
//! the groups: what a machine of the co-located two levels
//! ([`TwoLevel`](super::TwoLevel)) and a dedicated server in groups
//! ([`ServeInGroups`](super::ServeInGroups)) share.
//!
//! A slice in two levels has one word within its group and one across the
//! groups for each interval of its range (fairring-core's `TwoLevelRoles`).
//! Across, every participant is a flat plan's server of its piece among the
//! interval's holders, one per group: it sends each nonempty piece of
//! another group to that group's holder (`Partial`), reduces its own over
//! the `Q - 1` partial sums it receives (the whole sum: an average divides
//! there) and sends the result back to every other holder (`Result`), over
//! the same units of theirs. What differs between the two users is where
//! things are: a holder's rank, where units lie in a buffer, which areas
//! receive the partial sums ([`Placement`]).
//!
//! **Parts.** A write's part (in its immediate and token, `engine/tags.rs`)
//! says which word it belongs to at both ends: 0 within the group; across,
//! `1 + 2 i + j` for the sender's interval `i` and the receiver's `j` (a
//! holder's intervals are those of its own range: the same units may be the
//! first interval of one holder and the second of another).

use std::ops::Range;

use fairring_core::plan::{MOST_INTERVALS, MachineGroups, TwoLevelRoles};
use fairring_core::staging::{Actions, Event, Role, Word};
use fairring_core::{ReduceOp, WireFormat};

use super::hierarchical::refused;
use super::{SliceEvent, SliceInfo, Step, Write};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::{Reduction, Sources};

/// Intervals a range has at most, as an index.
pub(super) const MOST: usize = MOST_INTERVALS as usize;

/// A word of the slice: within the group, or across for an interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Level {
    Within,
    Across(u32),
}

/// Where a participant's exchange across the groups finds what it needs.
pub(super) trait Placement {
    /// The rank of participant `member` of the groups (a machine's rail, or
    /// a server of the rail group).
    fn rank_of(&self, member: u32) -> Result<u32>;
    /// Units `units` of the slot, in bytes of this participant's buffer.
    fn bytes(&self, s: &SliceInfo<'_>, units: Range<u64>) -> Result<Range<usize>>;
    /// Where participant `holder`'s buffer receives this one's partial sum
    /// of `holder`'s `interval`-th interval.
    fn area_at(&self, interval: u32, holder: u32) -> Result<usize>;
    /// The first `len` bytes of the areas that receive the other groups'
    /// partial sums of this participant's piece of its `interval`-th
    /// interval, in group order.
    fn across_sources(&self, interval: u32, len: usize) -> Result<Sources>;
}

/// What the exchange across the groups is over: where things are for this
/// participant, the groups, a slot of `units` units, its roles in them, and
/// the ranks an average divides by.
#[derive(Clone, Copy)]
pub(super) struct Exchange<'a> {
    pub(super) placement: &'a dyn Placement,
    pub(super) groups: MachineGroups,
    pub(super) units: u64,
    pub(super) roles: &'a TwoLevelRoles,
    pub(super) world: u32,
}

/// A slice's words in two levels, and the order of its reductions.
#[derive(Debug)]
pub(super) struct Words {
    pub(super) within: Word,
    /// One word per interval of the range: the first `intervals`.
    across: [Word; MOST],
    pub(super) intervals: u32,
    /// Words across that handed out `START_ALL_GATHER`, and `RELEASE`.
    across_final: u32,
    across_released: u32,
    /// Levels in the order their reductions were asked for, and how many have
    /// ended: the engine reports the ends of a buffer's steps in order.
    reductions: [Level; 1 + MOST],
    reductions_asked: usize,
    reductions_ended: usize,
}

impl Words {
    /// Acquires the words of `roles` for generation `generation`, the word
    /// within with `within`'s counts.
    pub(super) fn acquire(generation: u64, within: Role, roles: &TwoLevelRoles) -> Result<Words> {
        let acquire = |role: Role| {
            Word::free(generation)
                .acquire(generation, role)
                .map_err(|e| Error::internal("a new slice's words are free", e.to_string()))
        };
        let within = acquire(within)?;
        let mut across = [within; MOST];
        let mut intervals = 0;
        for (word, a) in across.iter_mut().zip(roles.across()) {
            *word = acquire(a.role)?;
            intervals += 1;
        }
        Ok(Words {
            within,
            across,
            intervals,
            across_final: 0,
            across_released: 0,
            reductions: [Level::Within; 1 + MOST],
            reductions_asked: 0,
            reductions_ended: 0,
        })
    }

    /// The word across for interval `interval`, if the range has one.
    pub(super) fn across_level(&self, interval: u32) -> Option<Level> {
        (interval < self.intervals).then_some(Level::Across(interval))
    }

    /// The level of the reduction that ended, in the order they were asked
    /// for; `None` if none is running.
    pub(super) fn reduction_ended(&mut self) -> Option<Level> {
        if self.reductions_ended == self.reductions_asked {
            return None;
        }
        let level = self.reductions[self.reductions_ended];
        self.reductions_ended += 1;
        Some(level)
    }

    /// Steps `level`'s word with `event` (from `from`, if a peer's write):
    /// what it hands out.
    pub(super) fn step(
        &mut self,
        s: &SliceInfo<'_>,
        level: Level,
        event: Event,
        from: Option<u32>,
    ) -> Result<Actions> {
        let word = match level {
            Level::Within => &mut self.within,
            Level::Across(i) => &mut self.across[i as usize],
        };
        let (stepped, actions) = word.on_event(event, s.generation).map_err(|e| match from {
            // The engine delivers each write once, of this slice's
            // generation: a write its word refuses (a duplicate, one for a
            // word that has released, one before its word began) is the
            // peer's.
            Some(peer) => Error::peer(
                peer,
                format!(
                    "a write into slice {} that its word in two levels refuses ({e}): the \
                     ranks' operations differ, or the peer broke the protocol",
                    s.number
                ),
            ),
            None => refused(e, None, s),
        })?;
        *word = stepped;
        Ok(actions)
    }

    /// Asks for `dst` to be reduced in place over `sources` at `level`;
    /// `whole`: the sum is the job's, of this many ranks, which an average
    /// divides.
    pub(super) fn ask_reduction(
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

    /// Steps the words from `first` (a level, an event, and the peer whose
    /// write it was) and every event the actions lead to: what a word
    /// within hands out through `within`, what a word across hands out
    /// through the exchange across the groups ([`Words::act_across`]).
    pub(super) fn run(
        &mut self,
        s: &SliceInfo<'_>,
        exchange: Exchange<'_>,
        first: (Level, Event, Option<u32>),
        steps: &mut Vec<Step>,
        mut within: impl FnMut(&mut Words, Actions, &mut Queue, &mut Vec<Step>) -> Result<()>,
    ) -> Result<()> {
        let mut queue = Queue::default();
        queue.push(first.0, first.1, first.2)?;
        while let Some((level, event, from)) = queue.pop() {
            let actions = self.step(s, level, event, from)?;
            match level {
                Level::Within => within(self, actions, &mut queue, steps)?,
                Level::Across(i) => {
                    self.act_across(s, exchange, i, actions, &mut queue, steps)?;
                }
            }
        }
        Ok(())
    }

    /// The word and event of one of this slice's writes of `kind` and `part`
    /// that has left: within for part 0, else the sender's interval's word
    /// across.
    pub(super) fn sent(&self, kind: Kind, part: u32) -> Option<(Level, Event)> {
        let level = match (kind, part) {
            (Kind::Contribution | Kind::Result, 0) => Level::Within,
            (Kind::Partial | Kind::Result, 1..) => self.across_level(interval_pair(part).0)?,
            _ => return None,
        };
        let event = match kind {
            Kind::Result => Event::ResultSent,
            _ => Event::ContributionSent,
        };
        Some((level, event))
    }

    /// The word and event of one of this slice's writes that has left
    /// ([`Words::sent`]) or of its reduction that ended
    /// ([`Words::reduction_ended`]); `None` for any other event, or one the
    /// words do not expect.
    pub(super) fn sent_or_reduced(&mut self, event: SliceEvent) -> Option<(Level, Event)> {
        match event {
            SliceEvent::Sent { kind, part } => self.sent(kind, part),
            SliceEvent::Reduced => self.reduction_ended().map(|level| (level, Event::Reduced)),
            _ => None,
        }
    }

    /// The word across and event of another group's write of `kind` and
    /// `part` (a partial sum or a result): the receiver's interval's word,
    /// if this range has that interval.
    pub(super) fn landed_across(&self, kind: Kind, part: u32) -> Option<(Level, Event)> {
        let level = match (kind, part) {
            (Kind::Partial | Kind::Result, 1..) => self.across_level(interval_pair(part).1)?,
            _ => return None,
        };
        Some((level, received(kind)))
    }

    /// Acts on what the word across for interval `i` handed out, for the
    /// participant `exchange` places: its partial sums to the
    /// other groups' holders, its piece reduced over theirs and sent back,
    /// and the words within that its ends lead to, into `queue`.
    fn act_across(
        &mut self,
        s: &SliceInfo<'_>,
        exchange: Exchange<'_>,
        i: u32,
        actions: Actions,
        queue: &mut Queue,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let Exchange {
            placement,
            groups,
            units,
            roles,
            world,
        } = exchange;
        let across = roles
            .across()
            .nth(i as usize)
            .ok_or_else(|| {
                Error::internal("a word across has its interval", format!("interval {i}"))
            })?
            .clone();
        let group = roles.membership().group;
        let sends = actions.contains(Actions::START_CONTRIBUTIONS);
        let results = actions.contains(Actions::START_SEND_BACK);
        if sends || results {
            let own_piece = placement.bytes(s, across.piece.clone())?;
            for other in (0..groups.groups()).filter(|&g| g != group) {
                let (holder, j) = holder_of(groups, units, other, across.interval.start)?;
                let part = 1 + MOST_INTERVALS * i + j;
                let peer = placement.rank_of(holder)?;
                if sends {
                    let piece = groups
                        .piece(&across.interval, other)
                        .map_err(|e| Error::internal("every group has a piece", e.to_string()))?;
                    let source = placement.bytes(s, piece)?;
                    if !source.is_empty() {
                        steps.push(Step::Write(Write {
                            kind: Kind::Partial,
                            peer,
                            source,
                            target: placement.area_at(j, holder)?,
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
            let dst = placement.bytes(s, across.piece)?;
            let sources = placement.across_sources(i, dst.len())?;
            self.ask_reduction(Level::Across(i), s, dst, sources, Some(world), steps);
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

    /// Whether the exchange across the groups has begun and not released.
    pub(super) fn across_running(&self) -> bool {
        self.across[..self.intervals as usize]
            .iter()
            .any(|w| w.in_use() && w.reduce_scatter_done())
    }
}

/// Units `units` of slot `device` of the slice, in bytes from the slice's
/// start: where they lie in a worker's staging buffer.
pub(super) fn units_in_slice(
    s: &SliceInfo<'_>,
    device: u32,
    units: Range<u64>,
) -> Result<Range<usize>> {
    let span = s
        .slice
        .slot_units_span(device, units)
        .map_err(|e| Error::internal("every device has a slot", e.to_string()))?;
    span.byte_range_in(s.slice.span()).ok_or_else(|| {
        Error::internal(
            "a slot's units lie within its slice",
            format!("{span:?} in {:?}", s.slice.span()),
        )
    })
}

/// The event a peer's write of `kind` raises where it lands.
pub(super) fn received(kind: Kind) -> Event {
    match kind {
        Kind::Result => Event::ResultReceived,
        _ => Event::ContributionReceived,
    }
}

/// Group `group`'s holder of the interval that starts at unit `start` of a
/// slot of `units` (a member of `groups`), and the index of that interval
/// among the holder's.
pub(super) fn holder_of(
    groups: MachineGroups,
    units: u64,
    group: u32,
    start: u64,
) -> Result<(u32, u32)> {
    let internal = |e: fairring_core::plan::PlanError| {
        Error::internal("every group holds every unit of a slot", e.to_string())
    };
    let member = groups.holder(units, group, start).map_err(internal)?;
    let range = groups.range(units, group, member).map_err(internal)?;
    // A range's intervals: the first starts where it does.
    Ok((
        groups.machine(group, member).map_err(internal)?,
        u32::from(range.start != start),
    ))
}

/// The events one event leads to among a slice's words, in order, without
/// allocating: at most the event itself, a `ReduceScatterDone` and an
/// `AllGatherDone` per word across, and `ParentResultReceived`,
/// `PartialSent` and (on a server, whose all-gather is done at once)
/// `AllGatherDone` within.
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
fn interval_pair(part: u32) -> (u32, u32) {
    let p = part - 1;
    (p / MOST_INTERVALS, p % MOST_INTERVALS)
}
