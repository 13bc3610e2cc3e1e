//! The hierarchical all-reduce of one slice on one rank (docs/DESIGN.md section 1).
//!
//! Staging buffer of rank (machine `m`, device `d`), in the core's
//! [`StagingLayout`](fairring_core::plan::StagingLayout) with the whole slice as its
//! input area:
//!
//! ```text
//! [0, full_slice)          the slice: the rank's input, staged in; slot d of it
//!                          becomes the machine's partial sum, then the final value
//! [inbox, + (M-1) stride)  contribution areas, one per other machine
//! ```
//!
//! The core's staging word ([`Word`]) decides, event by event, what the slice does
//! next; this type turns its [`Actions`] into steps:
//!
//! 1. the local reduce-scatter leaves the machine's partial sum of slot `d` in the
//!    buffer (`ReduceScatterDone`);
//! 2. `START_CONTRIBUTIONS`: each shard of the slot goes to device `d` of the
//!    machine serving it, into that machine's contribution area for `m`;
//! 3. `START_REDUCE` (every contribution in): the served shard is reduced in place;
//! 4. `START_SEND_BACK`: the reduced shard is written into the same range of every
//!    other machine's device `d` buffer (`Result`);
//! 5. `START_ALL_GATHER` (every result in): the slot is final; the local all-gather
//!    copies all slots into the caller's tensor;
//! 6. `RELEASE` once every send has completed.
//!
//! With a compressed wire ([`WireFormat::Bf16`], [`WireFormat::F16`]: `f32`
//! only, machines serving), half the bytes cross between machines:
//!
//! - step 2 first narrows each cell it sends where it lies (its first half then
//!   holds it; the rest of the cell is overwritten by the result later), and
//!   sends that half;
//! - step 3 widens the contributions as it reduces them, in `f32`;
//! - step 4 narrows the reduced shard into the first contribution area (consumed
//!   by then), widens it back over the shard, so that this rank keeps exactly
//!   the rounded values every other machine receives, and sends the narrow copy;
//! - step 5 first widens every result that landed (narrow, at the start of its
//!   cell) where it lies, then publishes the slot.
//!
//! Each group of conversions ends in [`SliceEvent::Converted`], and only then do
//! its writes or the slot's publication follow, so a memory space that converts
//! asynchronously posts nothing it has not finished writing.
//!
//! **Sending from the tensor** ([`SliceInfo::direct`]: one device per machine,
//! the tensor registered with the fabric, `engine/direct.rs`): the slot is the
//! slice itself, so nothing is staged. Step 1 is done at once; step 2 sends
//! from the tensor; step 3 reduces the served shard into the tensor, from the
//! contributions in the inbox; step 4 sends it from there; step 5 copies in
//! only the shards other machines served, from where their results landed,
//! once every contribution has left the tensor (the copies overwrite what
//! they were sent from), and finishes the local step without an all-gather.
//!
//! **Through trees** ([`Routing::Trees`](fairring_core::plan::Routing::Trees):
//! more machines than shards of the minimum size) each shard of the slot
//! travels through one of the core's two trees instead, and the served shard is
//! the one whose tree has this machine as an inner node. The contribution areas
//! are two, one per child (the core's `StagingLayout::child`):
//!
//! 2. `START_CONTRIBUTIONS`: each shard whose tree has this machine as a leaf
//!    goes to device `d` of the parent, into its area for this child;
//! 3. `START_REDUCE` (both children's contributions in): the served shard is
//!    reduced in place over them (an average divides only at the root);
//! 4. below the root, `START_SEND_UP`: the partial sum goes to the parent the
//!    same way (`Partial`), and the parent's result lands over it
//!    (`ParentResultReceived`); then, or at once at the root,
//!    `START_SEND_BACK`: the shard goes down to each child, into the same range;
//! 5. and 6. as above.
//!
//! Through trees each cell travels in parts (the core's `Slice::parts` and
//! `Cell::part`: up to 16 of at least the minimum shard, or two where fewer
//! fit and every cell of the slice holds two units), each its own write, and
//! each part has its own word: steps 2 to 4 run part by part, so an inner node
//! reduces and sends up a part as soon as both children's copies of it are in,
//! and sends a part of its result down as soon as it has landed, while the
//! next part is still on its way. The local reduce-scatter and all-gather and
//! the release are the slice's: every part's word takes their events, the
//! all-gather waits for every part's `START_ALL_GATHER`, and the buffer is
//! released once every word has released. A write's part travels in its
//! immediate and its token (`engine/tags.rs`); reductions end in the order
//! they were asked for, as every step of a buffer does.
//!
//! Values cross exact through the trees, whatever the wire format asked for
//! (rounding at every level of a tree is not what a compressed wire promises:
//! one rounding of the sum), and a tree slice always stages its slot. An
//! `f16` or `bf16` partial sum is stored in its type at every inner node, so
//! its sum is rounded once per level (at most `log2 M` times below the root),
//! as NCCL's tree rounds at every hop; a flat plan's server rounds once.
//!
//! With dedicated servers (`Context::servers > 0`) the machines serve nothing:
//! step 2 sends every shard of the slot to the server holding it (into the
//! server's area for this machine and device), steps 3 and 4 happen on the
//! servers (`serve`), and the results land here as above. Where the servers
//! are in groups (`Slice::server_groups`), step 2 sends each server of this
//! machine's group its range of the slot instead (the group's first worker
//! into the server's accumulator, the others into their areas), and steps 3
//! and 4 happen in two levels on the servers (`serve_in_groups`). On a compressed wire
//! every cell of the slot is narrowed before it leaves, and every result
//! widened where it landed.
//!
//! The engine drives every buffer from one driver at a time, so the slice keeps
//! the word as a plain value and steps it with the core's transition function; the
//! atomic [`StagingState`](fairring_core::staging::StagingState) around the same
//! function is for runtimes that deliver events from several threads.

use std::ops::Range;

use fairring_core::plan::{ServerGroups, TREE_PARTS};
use fairring_core::staging::{Actions, Counter, Event, StagingError, StagingErrorKind, Word};
use fairring_core::{ReduceOp, WireFormat};

mod compressed;
mod trees;

use super::{Context, Converted, DeviceUse, SliceEvent, SliceInfo, Step, Write, unexpected};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::Reduction;
use compressed::{
    compressed, narrow_contributions, narrow_result, result_area, sent_shards, widen_results,
};
use trees::{parent_of_served, send_up, tree_contributions, tree_neighbours};

/// Most parts a slice's cells travel in: one word each.
const MOST_PARTS: usize = TREE_PARTS as usize;

/// The hierarchical state of one slice.
#[derive(Debug)]
pub(crate) struct Hierarchical {
    /// One word per part of the slice's cells (fairring-core's `Slice::parts`):
    /// through the trees, each part of every cell goes up and down its tree on
    /// its own, so each has its own word; where cells travel whole, one. The
    /// local reduce-scatter and all-gather, and the release, are the slice's:
    /// every word takes their events, and the slice acts once all have asked.
    words: [Word; MOST_PARTS],
    /// Parts in use: the first `parts` words.
    parts: u32,
    /// Parts whose slot bytes are final (their word asked for the all-gather).
    final_parts: u32,
    /// Parts whose word asked for the release.
    released_parts: u32,
    /// Parts in the order their reductions were asked for, and how many of
    /// them have ended: the engine reports the ends of a buffer's steps in
    /// the order of the steps.
    reductions: [u32; MOST_PARTS],
    reductions_asked: usize,
    reductions_ended: usize,
    /// Whether the local all-gather has been asked for.
    gathering: bool,
    /// Sending from the tensor: the slot is final, and its copies in wait
    /// for the contributions to leave the tensor.
    copy_waits: bool,
    /// Sending from the tensor: copies in of other machines' shards not yet
    /// finished.
    copies: u32,
    /// Results landed in the tensor, through its window (`engine/direct.rs`),
    /// and in staging: a slice's land all in one place.
    results_in_tensor: u32,
    results_in_staging: u32,
}

impl Hierarchical {
    /// Acquires the slice's word for this device's role and begins the local
    /// reduce-scatter.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Hierarchical> {
        let role = s
            .slice
            .role(ctx.location)
            .map_err(|e| Error::internal("every device has a role in a slice", e.to_string()))?;
        let word = Word::free(s.generation)
            .acquire(s.generation, role)
            .map_err(|e| Error::internal("a new slice's word is free", e.to_string()))?;
        let parts = s.slice.parts();
        if parts == 0 || parts as usize > MOST_PARTS {
            return Err(Error::internal(
                "a slice's cells travel in one part, or in the trees' parts",
                format!("{parts} parts in slice {}", s.number),
            ));
        }
        let mut slice = Hierarchical {
            words: [word; MOST_PARTS],
            parts,
            final_parts: 0,
            released_parts: 0,
            reductions: [0; MOST_PARTS],
            reductions_asked: 0,
            reductions_ended: 0,
            gathering: false,
            results_in_tensor: 0,
            results_in_staging: 0,
            copy_waits: false,
            copies: 0,
        };
        if s.direct {
            // The slot is the slice, in the tensor: its machine's reduction is
            // the rank's own input.
            slice.step_all(Event::ReduceScatterDone, ctx, s, steps)?;
        } else {
            steps.push(Step::LocalBegin);
            steps.push(Step::LocalReduceScatter {
                final_world: alone(ctx).then_some(ctx.world),
            });
        }
        Ok(slice)
    }

    /// What a device tensor's slice asks of the device: the local step,
    /// whole (a device tensor is never sent from), final on one machine.
    pub(crate) fn device_use(ctx: &Context<'_>) -> DeviceUse {
        let alone = alone(ctx);
        DeviceUse::local(alone.then_some(ctx.world), alone)
    }

    /// Takes one event.
    pub(crate) fn on_event(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        event: SliceEvent,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let (core_event, from, part) = match event {
            SliceEvent::Converted(converted) => {
                return self.converted(ctx, s, converted, steps);
            }
            SliceEvent::LocalReduceScatterDone => {
                return self.step_all(Event::ReduceScatterDone, ctx, s, steps);
            }
            SliceEvent::LocalAllGatherDone => {
                return self.step_all(Event::AllGatherDone, ctx, s, steps);
            }
            SliceEvent::Landed { part, peer, .. } if part >= self.parts => {
                return Err(Error::peer(
                    peer,
                    format!(
                        "a write of part {part} into slice {}, whose cells travel in {} parts",
                        s.number, self.parts
                    ),
                ));
            }
            SliceEvent::Landed {
                kind: Kind::Contribution | Kind::Partial,
                peer,
                part,
            } => (Event::ContributionReceived, Some(peer), part),
            SliceEvent::Landed {
                kind: Kind::Result,
                peer,
                part,
            } if self.words[0].forwards() && Some(peer) == parent_of_served(ctx, s)? => {
                (Event::ParentResultReceived, Some(peer), part)
            }
            SliceEvent::Landed {
                kind: Kind::Result,
                peer,
                part,
            } => {
                self.results_in_staging += 1;
                (Event::ResultReceived, Some(peer), part)
            }
            // Only a slice sent from the tensor, whose cells travel whole,
            // opens its tensor to results.
            SliceEvent::Landed {
                kind: Kind::IntoTensor,
                peer,
                part: 0,
            } if s.direct && self.parts == 1 => {
                self.results_in_tensor += 1;
                (Event::ResultReceived, Some(peer), 0)
            }
            SliceEvent::Landed { kind, peer, .. } => {
                return Err(unexpected(kind, peer, s, "a hierarchical slice"));
            }
            SliceEvent::Sent { part, .. } if part >= self.parts => {
                return Err(Error::internal(
                    "a slice's writes carry its own parts",
                    format!("{event:?} for slice {}", s.number),
                ));
            }
            SliceEvent::Sent {
                kind: Kind::Contribution,
                part,
            } => (Event::ContributionSent, None, part),
            SliceEvent::Sent {
                kind: Kind::Result,
                part,
            } => (Event::ResultSent, None, part),
            SliceEvent::Sent {
                kind: Kind::Partial,
                part,
            } => (Event::PartialSent, None, part),
            SliceEvent::Reduced if self.reductions_ended < self.reductions_asked => {
                let part = self.reductions[self.reductions_ended];
                self.reductions_ended += 1;
                (Event::Reduced, None, part)
            }
            SliceEvent::CopiedOut if s.direct && self.copies > 0 => {
                self.copies -= 1;
                if self.copies > 0 {
                    return Ok(());
                }
                steps.push(Step::LocalFinish);
                return self.step_all(Event::AllGatherDone, ctx, s, steps);
            }
            SliceEvent::Staged
            | SliceEvent::CopiedOut
            | SliceEvent::Reduced
            | SliceEvent::Sent { .. } => {
                return Err(Error::internal(
                    "a hierarchical slice gets only its own steps' events",
                    format!("{event:?} for slice {}", s.number),
                ));
            }
        };
        self.step_word(part, core_event, from, ctx, s, steps)?;
        if self.copy_waits && self.words[0].remaining(Counter::ContributionsToSend) == 0 {
            self.copy_in(ctx, s, steps)?;
        }
        Ok(())
    }

    /// Steps every part's word with `event`, one of the slice's own (the
    /// local steps').
    fn step_all(
        &mut self,
        event: Event,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        for part in 0..self.parts {
            self.step_word(part, event, None, ctx, s, steps)?;
        }
        Ok(())
    }

    /// Steps part `part`'s word with `event` (from `from`, if a peer's write)
    /// and acts on what it hands out.
    fn step_word(
        &mut self,
        part: u32,
        event: Event,
        from: Option<u32>,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let word = &mut self.words[part as usize];
        let (next, actions) = word
            .on_event(event, s.generation)
            .map_err(|e| refused(e, from, s))?;
        *word = next;
        self.act(ctx, s, part, actions, steps)
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        let words = &self.words[..self.parts as usize];
        if words.iter().all(|w| !w.in_use()) {
            "released"
        } else if !words.iter().all(|w| w.reduce_scatter_done()) {
            "local reduce-scatter"
        } else if !self.gathering {
            "exchange"
        } else if !words.iter().all(|w| w.all_gather_done()) {
            "local all-gather"
        } else {
            "draining its sends"
        }
    }

    /// Acts on what part `part`'s word handed out.
    fn act(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        part: u32,
        actions: Actions,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let wire = compressed(ctx, s);
        if actions.contains(Actions::START_CONTRIBUTIONS) {
            match wire {
                Some(format) if narrow_contributions(ctx, s, format, steps)? => {}
                _ => contributions(ctx, s, part, steps)?,
            }
        }
        if actions.contains(Actions::START_REDUCE) {
            let reduction = reduction(ctx, s, part)?;
            self.reductions[self.reductions_asked] = part;
            self.reductions_asked += 1;
            steps.push(if s.direct {
                Step::ReduceInTensor(reduction)
            } else {
                Step::Reduce(reduction)
            });
        }
        if actions.contains(Actions::START_SEND_UP) {
            send_up(ctx, s, part, steps)?;
        }
        if actions.contains(Actions::START_SEND_BACK) {
            match wire {
                Some(format) => narrow_result(ctx, s, format, steps)?,
                None => results(ctx, s, part, steps)?,
            }
        }
        if actions.contains(Actions::START_ALL_GATHER) {
            self.final_parts += 1;
        }
        // The slot is final once every part of it is.
        if actions.contains(Actions::START_ALL_GATHER) && self.final_parts == self.parts {
            match wire {
                Some(format) if widen_results(ctx, s, format, steps)? => {}
                _ if s.direct => {
                    self.gathering = true;
                    self.copy_waits = true;
                    if self.words[0].remaining(Counter::ContributionsToSend) == 0 {
                        self.copy_in(ctx, s, steps)?;
                    }
                }
                _ => self.gather(ctx, steps),
            }
        }
        if actions.contains(Actions::RELEASE) {
            self.released_parts += 1;
            if self.released_parts == self.parts {
                steps.push(Step::Release);
            }
        }
        Ok(())
    }

    /// A group of conversions ended: what they prepared follows.
    fn converted(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        converted: Converted,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        if compressed(ctx, s).is_none() {
            return Err(Error::internal(
                "only a slice on a compressed wire converts",
                format!("{converted:?} for slice {}", s.number),
            ));
        }
        match converted {
            Converted::Contributions => contributions(ctx, s, 0, steps),
            Converted::Results => results(ctx, s, 0, steps),
            Converted::Slot => {
                self.gather(ctx, steps);
                Ok(())
            }
        }
    }

    /// Sending from the tensor, the slot final and every contribution gone:
    /// copies the shards other machines served into the tensor, from where
    /// their results landed (or, with none, or with the results landed in the
    /// tensor itself, ends the local step at once).
    fn copy_in(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        self.copy_waits = false;
        if self.results_in_tensor > 0 {
            if self.results_in_staging > 0 {
                return Err(Error::internal(
                    "a slice's results land all in the tensor or all in staging",
                    format!(
                        "{} in the tensor and {} in staging in slice {}",
                        self.results_in_tensor, self.results_in_staging, s.number
                    ),
                ));
            }
            // Every result is where it belongs already.
            steps.push(Step::LocalFinish);
            return self.step_all(Event::AllGatherDone, ctx, s, steps);
        }
        for shard in sent_shards(ctx, s) {
            let cell = cell_range(ctx, s, shard)?;
            if cell.is_empty() {
                continue;
            }
            steps.push(Step::CopyOut {
                from: cell.start,
                to: cell,
            });
            self.copies += 1;
        }
        if self.copies == 0 {
            steps.push(Step::LocalFinish);
            self.step_all(Event::AllGatherDone, ctx, s, steps)?;
        }
        Ok(())
    }

    /// The slot is final: publish it and gather every slot into the tensor.
    fn gather(&mut self, ctx: &Context<'_>, steps: &mut Vec<Step>) {
        self.gathering = true;
        steps.push(Step::PublishSlot);
        steps.push(Step::LocalAllGather {
            own_in_tensor: alone(ctx),
        });
    }
}

/// Whether the machine's reduce-scatter is the whole all-reduce: one machine and
/// no dedicated servers.
fn alone(ctx: &Context<'_>) -> bool {
    ctx.topology.machines() == 1 && ctx.servers == 0
}

/// A refused event: a peer's fault if a peer's write caused it, else the engine's.
pub(super) fn refused(e: StagingError, from: Option<u32>, s: &SliceInfo<'_>) -> Error {
    match (from, e.kind()) {
        (Some(peer), StagingErrorKind::NotInRole | StagingErrorKind::Duplicate) => Error::peer(
            peer,
            format!(
                "a write into slice {} that its role does not expect ({e}): the ranks' \
                 operations differ, or the peer broke the protocol",
                s.number
            ),
        ),
        _ => Error::internal(
            "the engine reports each event of a slice once, in an order its word allows",
            format!("slice {}: {e}", s.number),
        ),
    }
}

/// The byte range of cell (this device, `shard`) from the start of the slice.
fn cell_range(ctx: &Context<'_>, s: &SliceInfo<'_>, shard: u32) -> Result<Range<usize>> {
    s.cell_range(ctx.location.device, shard)
}

/// The shard this machine serves in the slice.
fn served_shard(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<u32> {
    s.slice
        .shard_served_by(ctx.location.machine)
        .map_err(|e| Error::internal("this machine is in the job", e.to_string()))?
        .ok_or_else(|| {
            Error::internal(
                "only a machine that serves a shard reduces and sends back",
                format!("machine {} in slice {}", ctx.location.machine, s.number),
            )
        })
}

/// Each shard of this device's slot to the machine (or dedicated server)
/// serving it; through trees, part `part` of each.
fn contributions(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    part: u32,
    steps: &mut Vec<Step>,
) -> Result<()> {
    if s.slice.double_tree().is_some() {
        return tree_contributions(ctx, s, part, steps);
    }
    if let Some(groups) = s.slice.server_groups() {
        return grouped_contributions(ctx, s, &groups, steps);
    }
    let me = ctx.location.machine;
    for shard in 0..s.slice.shards() {
        let server = s
            .slice
            .server(ctx.location.device, shard)
            .map_err(|e| Error::internal("every shard has a server", e.to_string()))?;
        let (peer, target) = if ctx.servers > 0 {
            (
                ctx.world + server,
                ctx.layout.server_area(me, ctx.location.device)?.start,
            )
        } else if server == me {
            continue;
        } else {
            (
                ctx.rail_peer(server)?,
                ctx.layout.contribution(me, server)?.start,
            )
        };
        let mut source = cell_range(ctx, s, shard)?;
        if let Some(format) = compressed(ctx, s) {
            source.end = source.start + format.wire_bytes(source.len());
        }
        let write = Write {
            kind: Kind::Contribution,
            peer,
            source,
            target,
            needs_credit: true,
            part: 0,
        };
        steps.push(if s.direct {
            Step::WriteFromTensor(write)
        } else {
            Step::Write(write)
        });
    }
    Ok(())
}

/// Where the dedicated servers are in groups: each nonempty range of this
/// device's slot to the server of this machine's group that holds it (the
/// group's first worker into the server's accumulator, at the range's offset
/// in the slot; the others into their areas).
fn grouped_contributions(
    ctx: &Context<'_>,
    s: &SliceInfo<'_>,
    groups: &ServerGroups,
    steps: &mut Vec<Step>,
) -> Result<()> {
    let internal = |e: fairring_core::plan::PlanError| {
        Error::internal("every worker has its group's servers", e.to_string())
    };
    let (machine, device) = (ctx.location.machine, ctx.location.device);
    let units = s.slice.group_units(device).map_err(internal)?;
    let member = groups.locate_worker(machine).map_err(internal)?.member;
    let slot = s.slice.slot(device).map_err(internal)?;
    for (i, server) in (0u32..).zip(groups.servers_of(machine).map_err(internal)?) {
        let range = groups.cell(units, machine, i).map_err(internal)?;
        let span = s.slice.slot_units_span(device, range).map_err(internal)?;
        let (Some(source), Some(in_slot)) =
            (span.byte_range_in(s.slice.span()), span.byte_range_in(slot))
        else {
            return Err(Error::internal(
                "a range of a slot lies within its slot and its slice",
                format!("{span:?}"),
            ));
        };
        if source.is_empty() {
            continue;
        }
        let target = if member == 0 {
            ctx.layout.server_accumulator(in_slot)?.start
        } else {
            ctx.layout.server_within(member)?.start
        };
        steps.push(Step::Write(Write {
            kind: Kind::Contribution,
            peer: ctx.grouped_server_rank(server, device),
            source,
            target,
            needs_credit: true,
            part: 0,
        }));
    }
    Ok(())
}

/// The served shard (through trees, its part `part`), reduced in place over
/// every other machine's contribution (through trees, its children's).
fn reduction(ctx: &Context<'_>, s: &SliceInfo<'_>, part: u32) -> Result<Reduction> {
    let shard = served_shard(ctx, s)?;
    let cell = cell_range(ctx, s, shard)?;
    let dst = s.part_range(ctx.location.device, shard, part)?;
    let wire = compressed(ctx, s).unwrap_or(WireFormat::Exact);
    let (sources, whole) = if s.slice.double_tree().is_some() {
        let (parent, children) = tree_neighbours(ctx, s, shard)?;
        let count = u32::from(children[0].is_some()) + u32::from(children[1].is_some());
        // The part lands at the same place of each child's area; the sum is
        // whole only at the root.
        let within = dst.start - cell.start;
        (
            ctx.layout.children(count, within, dst.len())?,
            parent.is_none(),
        )
    } else {
        (
            ctx.layout
                .contributions_to(ctx.location.machine, wire.wire_bytes(dst.len()))?,
            true,
        )
    };
    Ok(Reduction {
        dtype: s.dtype,
        op: s.op,
        dst,
        sources,
        average_over: (s.op == ReduceOp::Avg && whole).then_some(ctx.world),
        wire,
    })
}

/// The reduced shard to device `d` of every other machine, into the same range
/// (narrow, from the send area, on a compressed wire); through trees, its part
/// `part` to each child.
fn results(ctx: &Context<'_>, s: &SliceInfo<'_>, part: u32, steps: &mut Vec<Step>) -> Result<()> {
    let shard = served_shard(ctx, s)?;
    if s.slice.double_tree().is_some() {
        let range = s.part_range(ctx.location.device, shard, part)?;
        for child in tree_neighbours(ctx, s, shard)?.1.into_iter().flatten() {
            steps.push(Step::Write(Write {
                kind: Kind::Result,
                peer: ctx.rail_peer(child)?,
                source: range.clone(),
                target: range.start,
                needs_credit: false,
                part,
            }));
        }
        return Ok(());
    }
    let range = cell_range(ctx, s, shard)?;
    let source = match compressed(ctx, s) {
        Some(format) => result_area(ctx, &range, format)?,
        None => range.clone(),
    };
    for m in (0..ctx.topology.machines()).filter(|&m| m != ctx.location.machine) {
        let write = Write {
            kind: Kind::Result,
            peer: ctx.rail_peer(m)?,
            source: source.clone(),
            target: range.start,
            needs_credit: false,
            part: 0,
        };
        steps.push(if s.into_window {
            // Into the peer's tensor where it opened it, else its staging.
            Step::WriteIntoWindow(write)
        } else if s.direct {
            Step::WriteFromTensor(write)
        } else {
            Step::Write(write)
        });
    }
    Ok(())
}
