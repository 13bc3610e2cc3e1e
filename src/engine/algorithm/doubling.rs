//! Recursive doubling: the all-reduce of one slice in `log2 N` exchanges of the
//! whole slice, for sizes where hops cost more than bytes.
//!
//! With `p` the largest power of two at most `N`, rank `q < p` is a **core** rank
//! and rank `e >= p` an **extra** one, paired with core rank `e - p`:
//!
//! - **fold**: an extra rank writes its slice into its core partner's receive
//!   slot 0, and the partner reduces it in (`own op extra`);
//! - **round `k = 1..=log2 p`**: core rank `q` writes its partial into slot `k` of
//!   `q ^ 2^(k-1)` and reduces the one that lands from it. Both compute
//!   `lower op upper` (the partial of the group of lower ranks first), so after
//!   round `k` every rank of a group of `2^k` holds the same bits, whatever the
//!   operator does with its operands' order (a NaN's payload, say);
//! - **unfold**: a core rank with a partner writes the final slice into the
//!   partner's slot 0, which copies it out.
//!
//! The lower rank of a round reduces into its partial in place, once its own
//! write of it has left; the upper one reduces into the slot it received (the
//! lower rank's partial) and carries on from there, so it never waits for its
//! write. Each round is one hop where the hierarchical algorithm takes two
//! through one serving rank and the ring `2 (N - 1)`; each rank sends and
//! receives the whole slice per round, so the engine cuts doubling operations
//! into slices that fit its receive slots (`BufferLayout::doubling_slice_bytes`)
//! and `auto` picks it for small operations only.
//!
//! A peer writes into a rank at most once per slice, so the writer names the
//! slot: slot 0 for an extra rank's partner, `k` for round `k`'s partner.

use std::ops::Range;

use fairring_core::{ReduceOp, WireFormat};

use super::{Context, DeviceCopy, SliceEvent, SliceInfo, Step, Write, stray_event, unexpected};
use crate::engine::tags::Kind;
use crate::error::Result;
use crate::memory::{Reduction, Sources};

/// How far recursive doubling of one slice has come.
#[derive(Debug, Default)]
pub(crate) struct Doubling {
    /// Exchange rounds: `log2 p`.
    rounds: u32,
    /// The partner of this rank's fold or unfold, if any.
    partner: Option<u32>,
    /// This rank is an extra one (it only folds in and receives the result).
    extra: bool,
    /// Offset of this rank's partial in the staging buffer.
    at: usize,
    /// Where the partial moves when the running reduction ends.
    moving_to: Option<usize>,
    /// The input is in the staging buffer.
    staged: bool,
    /// The fold is reduced in (a core rank with a partner), or sent (an extra one).
    folded: bool,
    /// Rounds whose reduction has finished.
    done_rounds: u32,
    /// This round's write has been posted (the unfold's, after the last round).
    posted: bool,
    /// Landings not yet reduced, one bit per slot.
    landed: u64,
    /// Landings seen, one bit per slot (each slot takes one per slice).
    seen: u64,
    /// A reduction is running.
    reducing: bool,
    /// Writes posted and not yet completed.
    sends: u32,
    /// The copy into the tensor has been asked for.
    copying: bool,
}

impl Doubling {
    /// Stages the slice in.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Doubling> {
        let core = core_ranks(ctx.world);
        let extra = ctx.rank >= core;
        let partner = fold_partner(ctx.rank, ctx.world);
        steps.push(Step::StageIn {
            to: 0,
            from: 0..s.bytes()?,
        });
        Ok(Doubling {
            rounds: core.trailing_zeros(),
            partner,
            extra,
            ..Doubling::default()
        })
    }

    /// A device tensor's copies: the slice in, and the result out from
    /// where this rank's last reduction left it ([`result_at`]).
    pub(crate) fn device_copies(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        each: &mut dyn FnMut(DeviceCopy) -> Result<()>,
    ) -> Result<()> {
        let len = s.bytes()?;
        each(DeviceCopy::In {
            to: 0,
            from: 0..len,
        })?;
        each(DeviceCopy::Out {
            from: result_at(ctx)?,
            to: 0..len,
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
        match event {
            SliceEvent::Staged if !self.staged => self.staged = true,
            SliceEvent::Landed {
                kind: Kind::Doubling,
                peer,
                part: 0,
            } => {
                let slot = self.slot_of(ctx, peer).ok_or_else(|| {
                    unexpected(Kind::Doubling, peer, s, "not a partner of this rank")
                })?;
                let bit = 1u64 << slot;
                if self.seen & bit != 0 {
                    return Err(unexpected(Kind::Doubling, peer, s, "its second write"));
                }
                self.seen |= bit;
                self.landed |= bit;
            }
            SliceEvent::Landed { kind, peer, .. } => {
                return Err(unexpected(kind, peer, s, "a recursive-doubling slice"));
            }
            SliceEvent::Sent {
                kind: Kind::Doubling,
                part: 0,
            } if self.sends > 0 => self.sends -= 1,
            SliceEvent::Reduced if self.reducing => {
                self.reducing = false;
                if let Some(to) = self.moving_to.take() {
                    self.at = to;
                }
                if self.folded {
                    self.done_rounds += 1;
                    self.posted = false;
                } else {
                    self.folded = true;
                }
            }
            SliceEvent::CopiedOut if self.copying => {
                steps.push(Step::LocalFinish);
                steps.push(Step::Release);
                return Ok(());
            }
            _ => return Err(stray_event(event, s, self)),
        }
        self.pump(ctx, s, steps)
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if !self.staged {
            "staging in"
        } else if self.extra {
            if self.copying {
                "copying out"
            } else {
                "waiting for its partner's result"
            }
        } else if !self.folded {
            "folding in its extra rank"
        } else if self.done_rounds < self.rounds {
            "recursive-doubling exchange"
        } else if self.copying {
            "copying out"
        } else {
            "draining its sends"
        }
    }

    /// The receive slot a write from `peer` lands in, if `peer` writes to this
    /// rank at all.
    fn slot_of(&self, ctx: &Context<'_>, peer: u32) -> Option<u32> {
        if Some(peer) == self.partner {
            return Some(0);
        }
        if self.extra {
            return None;
        }
        let distance = ctx.rank ^ peer;
        (distance.is_power_of_two() && distance < core_ranks(ctx.world))
            .then(|| distance.trailing_zeros() + 1)
    }

    /// Takes every step that can be taken now.
    fn pump(&mut self, ctx: &Context<'_>, s: &SliceInfo<'_>, steps: &mut Vec<Step>) -> Result<()> {
        if !self.staged || self.reducing || self.copying {
            return Ok(());
        }
        let len = s.bytes()?;
        // Slot 0 exists only in a job with extra ranks.
        let slot0 = || ctx.layout.doubling_slot(0);
        if self.extra {
            if let Some(to) = self.partner
                && !self.folded
            {
                self.folded = true;
                self.send(to, 0..len, slot0()?, steps);
            }
            if self.landed & 1 != 0 && self.sends == 0 {
                self.copy_out(slot0()?, len, steps);
            }
            return Ok(());
        }
        if !self.folded && self.partner.is_none() {
            self.folded = true;
        }
        if !self.folded {
            if self.landed & 1 == 0 {
                return Ok(());
            }
            self.landed &= !1;
            self.reduce(ctx, s, self.at, slot0()?, len, 0, steps);
            return Ok(());
        }
        if self.done_rounds < self.rounds {
            let round = self.done_rounds + 1;
            let peer = ctx.rank ^ (1 << (round - 1));
            let slot = ctx.layout.doubling_slot(round)?;
            if !self.posted {
                self.posted = true;
                self.send(peer, self.at..self.at + len, slot, steps);
            }
            let bit = 1u64 << round;
            if self.landed & bit == 0 {
                return Ok(());
            }
            let lower = ctx.rank < peer;
            // In place: only once this rank's write of the partial has left.
            if lower && self.sends > 0 {
                return Ok(());
            }
            self.landed &= !bit;
            if lower {
                self.reduce(ctx, s, self.at, slot, len, round, steps);
            } else {
                let from = self.at;
                self.moving_to = Some(slot);
                self.reduce(ctx, s, slot, from, len, round, steps);
            }
            return Ok(());
        }
        if let Some(extra) = self.partner
            && !self.posted
        {
            self.posted = true;
            self.send(extra, self.at..self.at + len, slot0()?, steps);
        }
        if self.sends == 0 {
            self.copy_out(self.at, len, steps);
        }
        Ok(())
    }

    /// Reduces the `len` bytes at `from` into those at `dst` (in that operand
    /// order: `dst op from`), as step `round` (0: the fold); the last one
    /// averages.
    #[expect(clippy::too_many_arguments, reason = "one reduction, spelled out")]
    fn reduce(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        dst: usize,
        from: usize,
        len: usize,
        round: u32,
        steps: &mut Vec<Step>,
    ) {
        self.reducing = true;
        let last = round == self.rounds;
        steps.push(Step::Reduce(Reduction {
            dtype: s.dtype,
            op: s.op,
            sources: Sources::one(from..from + len),
            dst: dst..dst + len,
            average_over: (last && s.op == ReduceOp::Avg).then_some(ctx.world),
            wire: WireFormat::Exact,
        }));
    }

    /// Writes `source` into `peer`'s buffer at `target`.
    fn send(&mut self, peer: u32, source: Range<usize>, target: usize, steps: &mut Vec<Step>) {
        self.sends += 1;
        steps.push(Step::Write(Write {
            kind: Kind::Doubling,
            peer,
            source,
            target,
            needs_credit: true,
            part: 0,
        }));
    }

    fn copy_out(&mut self, from: usize, len: usize, steps: &mut Vec<Step>) {
        self.copying = true;
        steps.push(Step::CopyOut { from, to: 0..len });
    }
}

/// Where rank `ctx.rank`'s result lies in its staging buffer once its
/// rounds are over: an extra rank receives it in slot 0; a core rank's
/// partial stays in place as the lower rank of a round and moves into the
/// slot it received as the upper one, so it ends in the slot of the last
/// round where it was the upper rank (at 0 if none).
fn result_at(ctx: &Context<'_>) -> Result<usize> {
    let core = core_ranks(ctx.world);
    if ctx.rank >= core {
        return ctx.layout.doubling_slot(0);
    }
    let mut at = 0;
    for round in 1..=core.trailing_zeros() {
        if ctx.rank > ctx.rank ^ (1 << (round - 1)) {
            at = ctx.layout.doubling_slot(round)?;
        }
    }
    Ok(at)
}

/// The largest power of two at most `world`: the core ranks.
pub(crate) fn core_ranks(world: u32) -> u32 {
    if world == 0 {
        return 1;
    }
    1 << (31 - world.leading_zeros())
}

/// The ranks `rank` of `world` exchanges with (each both ways): its fold
/// partner, then its partner of each round.
pub(crate) fn partners(rank: u32, world: u32) -> impl Iterator<Item = u32> {
    let core = core_ranks(world);
    let rounds = if rank < core {
        core.trailing_zeros()
    } else {
        0
    };
    fold_partner(rank, world)
        .into_iter()
        .chain((0..rounds).map(move |k| rank ^ (1 << k)))
}

/// The rank `rank` folds into (an extra rank) or folds in (a core rank with an
/// extra partner).
fn fold_partner(rank: u32, world: u32) -> Option<u32> {
    let core = core_ranks(world);
    if rank >= core {
        Some(rank - core)
    } else {
        Some(rank + core).filter(|&e| e < world)
    }
}

/// The receive slots a rank of `world` uses: slot 0 for the fold and unfold (only
/// where some rank is extra), then one per round.
pub(crate) fn slots(world: u32) -> std::ops::Range<u32> {
    let core = core_ranks(world);
    let first = u32::from(core == world);
    first..1 + core.trailing_zeros()
}
