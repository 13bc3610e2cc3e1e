//! The hierarchical all-reduce of one slice on one rank (DESIGN.md section 1).
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
//! With dedicated servers (`Context::servers > 0`) the machines serve nothing:
//! step 2 sends every shard of the slot to the server holding it (into the
//! server's area for this machine and device), steps 3 and 4 happen on the
//! servers (`serve`), and the results land here as above.
//!
//! The engine drives every buffer from one driver at a time, so the slice keeps
//! the word as a plain value and steps it with the core's transition function; the
//! atomic [`StagingState`](fairring_core::staging::StagingState) around the same
//! function is for runtimes that deliver events from several threads.

use std::ops::Range;

use fairring_core::ReduceOp;
use fairring_core::staging::{Actions, Event, StagingError, StagingErrorKind, Word};

use super::{Context, SliceEvent, SliceInfo, Step, Write, unexpected};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::Reduction;

/// The hierarchical state of one slice.
#[derive(Debug)]
pub(crate) struct Hierarchical {
    word: Word,
    /// Whether the local all-gather has been asked for.
    gathering: bool,
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
        steps.push(Step::LocalBegin);
        steps.push(Step::LocalReduceScatter {
            final_world: alone(ctx).then_some(ctx.world),
        });
        Ok(Hierarchical {
            word,
            gathering: false,
        })
    }

    /// Takes one event.
    pub(crate) fn on_event(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        event: SliceEvent,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let (core_event, from) = match event {
            SliceEvent::LocalReduceScatterDone => (Event::ReduceScatterDone, None),
            SliceEvent::Landed {
                kind: Kind::Contribution,
                peer,
            } => (Event::ContributionReceived, Some(peer)),
            SliceEvent::Landed {
                kind: Kind::Result,
                peer,
            } => (Event::ResultReceived, Some(peer)),
            SliceEvent::Landed { kind, peer } => {
                return Err(unexpected(kind, peer, s, "a hierarchical slice"));
            }
            SliceEvent::Sent {
                kind: Kind::Contribution,
            } => (Event::ContributionSent, None),
            SliceEvent::Sent { kind: Kind::Result } => (Event::ResultSent, None),
            SliceEvent::Reduced => (Event::Reduced, None),
            SliceEvent::LocalAllGatherDone => (Event::AllGatherDone, None),
            SliceEvent::Staged | SliceEvent::CopiedOut | SliceEvent::Sent { .. } => {
                return Err(Error::internal(
                    "a hierarchical slice gets only its own steps' events",
                    format!("{event:?} for slice {}", s.number),
                ));
            }
        };
        let (word, actions) = self
            .word
            .on_event(core_event, s.generation)
            .map_err(|e| refused(e, from, s))?;
        self.word = word;
        self.act(ctx, s, actions, steps)
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if !self.word.in_use() {
            "released"
        } else if !self.word.reduce_scatter_done() {
            "local reduce-scatter"
        } else if !self.gathering {
            "exchange"
        } else if !self.word.all_gather_done() {
            "local all-gather"
        } else {
            "draining its sends"
        }
    }

    fn act(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        actions: Actions,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        if actions.contains(Actions::START_CONTRIBUTIONS) {
            contributions(ctx, s, steps)?;
        }
        if actions.contains(Actions::START_REDUCE) {
            steps.push(Step::Reduce(reduction(ctx, s)?));
        }
        if actions.contains(Actions::START_SEND_BACK) {
            results(ctx, s, steps)?;
        }
        if actions.contains(Actions::START_ALL_GATHER) {
            self.gathering = true;
            steps.push(Step::PublishSlot);
            steps.push(Step::LocalAllGather {
                own_in_tensor: alone(ctx),
            });
        }
        if actions.contains(Actions::RELEASE) {
            steps.push(Step::Release);
        }
        Ok(())
    }
}

/// Whether the machine's reduce-scatter is the whole all-reduce: one machine and
/// no dedicated servers.
fn alone(ctx: &Context<'_>) -> bool {
    ctx.topology.machines() == 1 && ctx.servers == 0
}

/// A refused event: a peer's fault if a peer's write caused it, else the engine's.
fn refused(e: StagingError, from: Option<u32>, s: &SliceInfo<'_>) -> Error {
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
/// serving it.
fn contributions(ctx: &Context<'_>, s: &SliceInfo<'_>, steps: &mut Vec<Step>) -> Result<()> {
    let me = ctx.location.machine;
    for shard in 0..s.slice.shards() {
        let server = s
            .slice
            .server(shard)
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
        steps.push(Step::Write(Write {
            kind: Kind::Contribution,
            peer,
            source: cell_range(ctx, s, shard)?,
            target,
            needs_credit: true,
        }));
    }
    Ok(())
}

/// The served shard, reduced in place over every other machine's contribution.
fn reduction(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<Reduction> {
    let dst = cell_range(ctx, s, served_shard(ctx, s)?)?;
    let sources = ctx
        .layout
        .contributions_to(ctx.location.machine, dst.len())?;
    Ok(Reduction {
        dtype: s.dtype,
        op: s.op,
        dst,
        sources,
        average_over: (s.op == ReduceOp::Avg).then_some(ctx.world),
    })
}

/// The reduced shard to device `d` of every other machine, into the same range.
fn results(ctx: &Context<'_>, s: &SliceInfo<'_>, steps: &mut Vec<Step>) -> Result<()> {
    let range = cell_range(ctx, s, served_shard(ctx, s)?)?;
    for m in (0..ctx.topology.machines()).filter(|&m| m != ctx.location.machine) {
        steps.push(Step::Write(Write {
            kind: Kind::Result,
            peer: ctx.rail_peer(m)?,
            source: range.clone(),
            target: range.start,
            needs_credit: false,
        }));
    }
    Ok(())
}
