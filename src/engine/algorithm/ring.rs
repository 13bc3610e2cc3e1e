//! The ring all-reduce of one slice on one rank: the Horovod/Gloo/NCCL baseline.
//!
//! The slice is staged whole into the buffer and cut into `N` chunks (element
//! counts differing by at most one). Rank `r` sends to `r + 1` and receives from
//! `r - 1`, over the fabric, whatever machine they are on:
//!
//! - **reduce-scatter**, steps `k = 0..N-1`: step `k` sends chunk `r - k` into the
//!   next rank's receive slot `k`; receiving step `k` (chunk `r - k - 1`) reduces it
//!   into the buffer and sends it on as step `k + 1`. After `N - 1` steps chunk
//!   `r + 1` is fully reduced here (and averaged, for `avg`).
//! - **all-gather**, steps `k = 0..N-1`: step 0 sends chunk `r + 1` into the same
//!   range of the next rank's buffer; receiving step `k` (chunk `r - k`, final)
//!   forwards it as step `k + 1`.
//! - the buffer is copied into the caller's tensor, and released.
//!
//! Receive slots (`[inbox + k * ring_slot, ...)`) are used once per slice, so a
//! slice needs credit only for its reduce-scatter writes into a rank. All-gather
//! chunks overwrite a chunk the receiver finished with before the chunk's reduction
//! could end (its own reduce-scatter send of it is a cause of the final value).
//! Landings carry no step: one peer's writes arrive in order, so the `k`-th
//! reduce-scatter landing is step `k`, and every reduce-scatter landing precedes
//! every all-gather landing. Empty chunks (a slice of fewer than `N` elements) are
//! skipped by both sides alike.
//!
//! **Sending from the tensor** ([`SliceInfo::direct`], `engine/direct.rs`):
//! nothing is staged in. Reduce-scatter steps send from the tensor and reduce
//! each landing into the tensor's chunk; the final chunk leaves from the
//! tensor too; the chunks the all-gather brings land in the staging buffer as
//! above, are forwarded from there, and are copied into the tensor once every
//! send has completed (the copies overwrite chunks sent from the tensor):
//! `(N-1)/N` of the slice copied instead of twice the slice.
//!
//! Each reduction is one step whose end the engine reports ([`SliceEvent::Reduced`]);
//! the chunk it produced is sent on only then, so a device memory space can run it
//! asynchronously. All-gather chunks are forwarded once every reduction is done.

use std::ops::Range;

use fairring_core::ReduceOp;

use super::{
    Context, DeviceCopy, Members, SliceEvent, SliceInfo, Step, Write, stray_event, unexpected,
};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::{Reduction, Sources};

/// Why a ring landing is refused.
const NEXT_STEP: &str = "not the ring's next step";

/// How far the ring of one slice has come.
#[derive(Debug, Default)]
pub(crate) struct Ring {
    /// Steps of each half: `N - 1`.
    total: u32,
    /// The input is in the staging buffer.
    staged: bool,
    /// Reduce-scatter steps whose reduction has finished.
    reduced: u32,
    /// A reduction is running.
    reducing: bool,
    /// All-gather steps received and forwarded.
    gathered: u32,
    /// Reduce-scatter and all-gather landings not processed yet.
    reduce_arrived: u32,
    gather_arrived: u32,
    /// Writes posted and not yet completed.
    sends: u32,
    /// The copy into the tensor has been asked for.
    copying: bool,
    /// Copies into the tensor not yet finished.
    copies: u32,
}

impl Ring {
    /// Stages the slice in.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Ring> {
        let mut ring = Ring {
            total: ctx.world - 1,
            ..Ring::default()
        };
        if s.direct {
            // The input is where it is sent from.
            ring.on_event(ctx, s, SliceEvent::Staged, steps)?;
        } else {
            steps.push(Step::StageIn {
                to: 0,
                from: 0..s.bytes()?,
            });
        }
        Ok(ring)
    }

    /// A device tensor's copies (it is never sent from): the whole slice in,
    /// and the whole result out.
    pub(crate) fn device_copies(
        s: &SliceInfo<'_>,
        each: &mut dyn FnMut(DeviceCopy) -> Result<()>,
    ) -> Result<()> {
        let bytes = s.bytes()?;
        each(DeviceCopy::In {
            to: 0,
            from: 0..bytes,
        })?;
        each(DeviceCopy::Out {
            from: 0,
            to: 0..bytes,
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
            SliceEvent::Staged if !self.staged => {
                self.staged = true;
                if ctx.world > 1 {
                    let c = ctx.around(0);
                    self.send(ctx, s, Kind::RingReduce, 0, c, steps)?;
                }
            }
            SliceEvent::Landed {
                kind: Kind::RingReduce,
                peer,
                part: 0,
            } => {
                let seen = self.reduced + u32::from(self.reducing) + self.reduce_arrived;
                let expected = seen < self.total;
                Members::ranks(ctx).check_from_previous(
                    s,
                    Kind::RingReduce,
                    peer,
                    expected,
                    NEXT_STEP,
                )?;
                self.reduce_arrived += 1;
            }
            SliceEvent::Landed {
                kind: Kind::RingGather,
                peer,
                part: 0,
            } => {
                let expected = self.gathered + self.gather_arrived < self.total;
                Members::ranks(ctx).check_from_previous(
                    s,
                    Kind::RingGather,
                    peer,
                    expected,
                    NEXT_STEP,
                )?;
                self.gather_arrived += 1;
            }
            SliceEvent::Landed { kind, peer, .. } => {
                return Err(unexpected(kind, peer, s, "a ring slice"));
            }
            SliceEvent::Sent {
                kind: Kind::RingReduce | Kind::RingGather,
                part: 0,
            } if self.sends > 0 => self.sends -= 1,
            SliceEvent::Reduced if self.reducing => {
                self.reducing = false;
                let k = self.reduced;
                self.reduced += 1;
                self.after_reduce(ctx, s, k, steps)?;
            }
            SliceEvent::CopiedOut if self.copies > 0 => {
                self.copies -= 1;
                if self.copies == 0 {
                    steps.push(Step::LocalFinish);
                    steps.push(Step::Release);
                }
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
        } else if self.reduced < self.total {
            "ring reduce-scatter"
        } else if self.gathered < self.total {
            "ring all-gather"
        } else if self.copying {
            "copying out"
        } else {
            "draining its sends"
        }
    }

    /// Takes every step that can be taken now.
    fn pump(&mut self, ctx: &Context<'_>, s: &SliceInfo<'_>, steps: &mut Vec<Step>) -> Result<()> {
        if !self.staged || self.reducing {
            return Ok(());
        }
        let total = self.total;
        while self.reduced < total {
            let k = self.reduced;
            let range = chunk(ctx, s, ctx.around(-i64::from(k) - 1))?;
            if range.is_empty() {
                self.reduced += 1;
                self.after_reduce(ctx, s, k, steps)?;
                continue;
            }
            if self.reduce_arrived == 0 {
                return Ok(());
            }
            self.reduce_arrived -= 1;
            self.reducing = true;
            let slot = ctx.layout.ring_slot(k)?;
            let reduction = Reduction {
                dtype: s.dtype,
                op: s.op,
                sources: Sources::one(slot..slot + range.len()),
                dst: range,
                average_over: (k + 1 == total && s.op == ReduceOp::Avg).then_some(ctx.world),
                wire: fairring_core::WireFormat::Exact,
            };
            steps.push(if s.direct {
                Step::ReduceInTensor(reduction)
            } else {
                Step::Reduce(reduction)
            });
            return Ok(());
        }
        while self.gathered < total {
            let k = self.gathered;
            let c = ctx.around(-i64::from(k));
            let empty = chunk(ctx, s, c)?.is_empty();
            if !empty && self.gather_arrived == 0 {
                return Ok(());
            }
            if !empty {
                self.gather_arrived -= 1;
            }
            self.gathered += 1;
            if k + 1 < total {
                self.send(ctx, s, Kind::RingGather, k + 1, c, steps)?;
            }
        }
        if self.sends == 0 && !self.copying {
            self.copying = true;
            self.copy_out(ctx, s, steps)?;
        }
        Ok(())
    }

    /// Copies the result into the tensor: the whole slice, or, sending from
    /// the tensor, the chunks the all-gather brought (every chunk but the one
    /// this rank finished, which is there already). Ends the slice at once if
    /// there is nothing to copy.
    fn copy_out(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        if !s.direct {
            self.copies = 1;
            steps.push(Step::CopyOut {
                from: 0,
                to: 0..s.bytes()?,
            });
            return Ok(());
        }
        let own = ctx.around(1);
        for c in (0..ctx.world).filter(|&c| c != own) {
            let range = chunk(ctx, s, c)?;
            if !range.is_empty() {
                self.copies += 1;
                steps.push(Step::CopyOut {
                    from: range.start,
                    to: range,
                });
            }
        }
        if self.copies == 0 {
            steps.push(Step::LocalFinish);
            steps.push(Step::Release);
        }
        Ok(())
    }

    /// After reduce-scatter step `k`: pass its chunk on, or, at the last step, start
    /// the all-gather with it (final, and averaged for `avg`).
    fn after_reduce(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        k: u32,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let c = ctx.around(-i64::from(k) - 1);
        if k + 1 < self.total {
            self.send(ctx, s, Kind::RingReduce, k + 1, c, steps)
        } else {
            self.send(ctx, s, Kind::RingGather, 0, c, steps)
        }
    }

    /// Step `step` of `kind`, chunk `c`, to the next rank (nothing for an empty
    /// chunk).
    fn send(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        kind: Kind,
        step: u32,
        c: u32,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let range = chunk(ctx, s, c)?;
        if range.is_empty() {
            return Ok(());
        }
        let (target, needs_credit) = if kind == Kind::RingReduce {
            (ctx.layout.ring_slot(step)?, true)
        } else {
            (range.start, false)
        };
        self.sends += 1;
        let write = Write {
            kind,
            peer: ctx.around(1),
            source: range,
            target,
            needs_credit,
            part: 0,
        };
        // Sending from the tensor, a chunk this rank reduced leaves from there;
        // one the all-gather brought, from where it landed.
        let reduced_here = kind == Kind::RingReduce || step == 0;
        steps.push(if s.direct && reduced_here {
            Step::WriteFromTensor(write)
        } else {
            Step::Write(write)
        });
        Ok(())
    }
}

/// Bytes of chunk `c` of the slice, from its start.
fn chunk(ctx: &Context<'_>, s: &SliceInfo<'_>, c: u32) -> Result<Range<usize>> {
    let n = u64::from(ctx.world);
    let span = s.slice.span();
    let elements = span.len();
    let esize = s.dtype.size_bytes();
    let (q, rem) = (elements / n, elements % n);
    let c = u64::from(c);
    let start = c * q + c.min(rem);
    let len = q + u64::from(c < rem);
    let to = |e: u64| {
        usize::try_from(e * esize).map_err(|_| {
            Error::internal("a slice's bytes fit the address space", format!("{span:?}"))
        })
    };
    Ok(to(start)?..to(start + len)?)
}
