//! The reduce-scatter of one slice on one rank: the ring's reduce-scatter half,
//! each piece reduced on its way around the ring to the rank whose share it is.
//!
//! A reduce-scatter plans each rank's share (its `count` elements), not the
//! whole input: slice `[a, b)` of the plan stands for the same range of every
//! rank's share, `N` *pieces*. Piece `o` (bytes `o * share + [a, b)` of the
//! input) is staged at `o * len` of the buffer, `len` being the slice's bytes.
//! Rank `r` sends to `r + 1` and receives from `r - 1`, over the fabric,
//! whatever machine they are on:
//!
//! - step `k = 0..N-1` sends piece `r - 1 - k` into the next rank's receive
//!   slot `k`: step 0 the piece as staged, each later step the piece into which
//!   the landing of step `k - 1` (the previous rank's partial of that piece)
//!   has just been reduced;
//! - the landing of step `N - 2` is the last partial of piece `r`: reduced into
//!   the own piece (and averaged, for `avg`), it is this rank's share of the
//!   slice, copied into the tensor at the share's place, from where the
//!   operation delivers it.
//!
//! Each rank sends and receives `N - 1` pieces per slice, `(N-1)/N` of the
//! input, once; an all-reduce of the input moves twice that. Every piece's
//! partials fold in the same order in every slice (`x_o op (x_{o-1} op (...
//! op x_{o+1}))` for piece `o`). Receive slots are used once per slice, so every
//! write needs the slice's credit. Landings carry no step: one peer's writes
//! arrive in order, so the `k`-th landing is step `k`.
//!
//! Pieces are staged in the order the ring needs them (`r - 1` first), and a
//! landing is reduced only once its piece is staged; each reduction is one
//! step whose end the engine reports, and the piece goes on only then, so a
//! device memory space can run it asynchronously.

use std::ops::Range;

use fairring_core::ReduceOp;

use super::{
    Context, Origins, SliceEvent, SliceInfo, Step, Write, from_previous, stray_event, unexpected,
};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::{Reduction, Sources};

/// How far the reduce-scatter of one slice has come.
#[derive(Debug)]
pub(crate) struct Scatter {
    /// Bytes of each rank's share in the tensor.
    share: u64,
    /// Steps: `N - 1`.
    total: u32,
    /// Pieces staged in so far (in the order `r - 1`, `r - 2`, ..., `r`).
    staged: u32,
    /// Landings whose reduction has finished.
    reduced: u32,
    /// A reduction is running.
    reducing: bool,
    /// Landings not reduced yet.
    arrived: u32,
    /// Writes posted and not completed.
    sends: u32,
    /// The copy of the share into the tensor has been asked for, and has ended.
    copying: bool,
    copied: bool,
    /// The buffer has been released.
    released: bool,
}

impl Scatter {
    /// Stages every piece in, the one sent first first.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Scatter> {
        let share = match s.origins {
            Some(Origins::Blocks(share)) => share,
            other => {
                return Err(Error::internal(
                    "a reduce-scatter slice knows its shares' size",
                    format!("slice {}: {other:?}", s.number),
                ));
            }
        };
        let scatter = Scatter {
            share,
            total: ctx.world - 1,
            staged: 0,
            reduced: 0,
            reducing: false,
            arrived: 0,
            sends: 0,
            copying: false,
            copied: false,
            released: false,
        };
        for j in 0..ctx.world {
            let o = ctx.around(-i64::from(j) - 1);
            steps.push(Step::StageIn {
                to: scatter.piece(s, o)?.start,
                from: scatter.in_tensor(s, o)?,
            });
        }
        Ok(scatter)
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
            SliceEvent::Staged if self.staged < ctx.world => {
                self.staged += 1;
                if self.staged == 1 && self.total > 0 {
                    self.send(ctx, s, 0, ctx.around(-1), steps)?;
                }
            }
            SliceEvent::Landed {
                kind: Kind::Scatter,
                peer,
            } => {
                let seen = self.reduced + u32::from(self.reducing) + self.arrived;
                let expected = seen < self.total;
                from_previous(ctx, s, Kind::Scatter, peer, expected, "not the next step")?;
                self.arrived += 1;
            }
            SliceEvent::Landed { kind, peer } => {
                return Err(unexpected(kind, peer, s, "a reduce-scatter slice"));
            }
            SliceEvent::Sent {
                kind: Kind::Scatter,
            } if self.sends > 0 => self.sends -= 1,
            SliceEvent::Reduced if self.reducing => {
                self.reducing = false;
                let k = self.reduced;
                self.reduced += 1;
                if k + 1 < self.total {
                    self.send(ctx, s, k + 1, landing(ctx, k), steps)?;
                }
            }
            SliceEvent::CopiedOut if self.copying && !self.copied => self.copied = true,
            _ => return Err(stray_event(event, s, self)),
        }
        self.pump(ctx, s, steps)
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if self.staged == 0 {
            "staging in"
        } else if self.reduced < self.total {
            "ring reduce-scatter"
        } else if !self.copied {
            "copying out"
        } else {
            "draining its sends"
        }
    }

    /// Takes every step that can be taken now.
    fn pump(&mut self, ctx: &Context<'_>, s: &SliceInfo<'_>, steps: &mut Vec<Step>) -> Result<()> {
        if self.reducing {
            return Ok(());
        }
        if self.reduced < self.total {
            // Landing `k` reduces into the `k + 2`-th piece staged.
            let k = self.reduced;
            if self.arrived > 0 && self.staged >= k + 2 {
                self.arrived -= 1;
                self.reducing = true;
                let dst = self.piece(s, landing(ctx, k))?;
                let slot = ctx.layout.scatter_slot(k)?;
                steps.push(Step::Reduce(Reduction {
                    dtype: s.dtype,
                    op: s.op,
                    sources: Sources::one(slot..slot + dst.len()),
                    dst,
                    average_over: (k + 1 == self.total && s.op == ReduceOp::Avg)
                        .then_some(ctx.world),
                    wire: fairring_core::WireFormat::Exact,
                }));
            }
            return Ok(());
        }
        if self.staged == ctx.world && !self.copying {
            self.copying = true;
            steps.push(Step::CopyOut {
                from: self.piece(s, ctx.rank)?.start,
                to: self.in_tensor(s, ctx.rank)?,
            });
        }
        if self.copied && self.sends == 0 && !self.released {
            self.released = true;
            steps.push(Step::LocalFinish);
            steps.push(Step::Release);
        }
        Ok(())
    }

    /// Step `step` (piece `o`) to the next rank's receive slot `step`.
    fn send(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        step: u32,
        o: u32,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        self.sends += 1;
        steps.push(Step::Write(Write {
            kind: Kind::Scatter,
            peer: ctx.around(1),
            source: self.piece(s, o)?,
            target: ctx.layout.scatter_slot(step)?,
            needs_credit: true,
        }));
        Ok(())
    }

    /// Piece `o` in the staging buffer.
    fn piece(&self, s: &SliceInfo<'_>, o: u32) -> Result<Range<usize>> {
        let len = s.bytes()?;
        let start = len.checked_mul(o as usize).ok_or_else(|| overflow(s))?;
        Ok(start..start + len)
    }

    /// Piece `o` in the tensor, from the slice's start (which is in share 0).
    fn in_tensor(&self, s: &SliceInfo<'_>, o: u32) -> Result<Range<usize>> {
        let start = self
            .share
            .checked_mul(u64::from(o))
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| overflow(s))?;
        Ok(start..start + s.bytes()?)
    }
}

/// The piece whose partial lands at step `k`: `r - 2 - k`.
fn landing(ctx: &Context<'_>, k: u32) -> u32 {
    ctx.around(-i64::from(k) - 2)
}

fn overflow(s: &SliceInfo<'_>) -> Error {
    Error::internal(
        "a reduce-scatter's pieces fit the address space",
        format!("{:?}", s.slice),
    )
}
