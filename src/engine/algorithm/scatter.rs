//! The reduce-scatter of one slice on one rank: the ring's reduce-scatter half,
//! each piece reduced on its way around the ring to the rank whose share it is.
//!
//! A reduce-scatter plans each rank's share (its `count` elements), not the
//! whole input: slice `[a, b)` of the plan stands for the same range of every
//! rank's share, `N` *pieces*. The ring goes around a line of members:
//!
//! - **the ranks**, where every machine has one device: piece `o` (bytes
//!   `o * share + [a, b)` of the input) is staged at `o * len` of the buffer,
//!   `len` being the slice's bytes, and rank `r` sends to `r + 1` over the
//!   fabric;
//! - **the machines**, along this device's rail, where machines have several
//!   devices: the machine's reduce-scatter (the local step over
//!   [`RailPieces`]) leaves in device `d`'s slot the machine's partial sum of
//!   the piece of device `d` on every machine, and the ring goes around those
//!   `M` pieces; a machine's ranks never cross the fabric to each other. On
//!   one machine the local step's result is final and goes straight into the
//!   share.
//!
//! With `P` members, at position `p`:
//!
//! - step `k = 0..P-1` sends piece `p - 1 - k` into the next member's receive
//!   slot `k`: step 0 the piece as staged, each later step the piece into which
//!   the landing of step `k - 1` (the previous member's partial of that piece)
//!   has just been reduced;
//! - the landing of step `P - 2` is the last partial of piece `p`: reduced into
//!   the own piece (and averaged over every rank, for `avg`), it is this rank's
//!   share of the slice, copied into the tensor at the share's place, from
//!   where the operation delivers it.
//!
//! Over the ranks each rank sends and receives `N - 1` pieces per slice,
//! `(N-1)/N` of the input, once; over the machines each rank sends `(M-1)/M`
//! of its slot, `1/D` of that, and the machine's shared memory carries the
//! rest. An all-reduce of the input moves twice that. Every piece's partials
//! fold in the same order in every slice (`x_o op (x_{o-1} op (... op
//! x_{o+1}))` for piece `o`). Receive slots are used once per slice, so every
//! write needs the slice's credit. Landings carry no step: one peer's writes
//! arrive in order, so the `k`-th landing is step `k`.
//!
//! Over the ranks, pieces are staged in the order the ring needs them (`r - 1`
//! first), and a landing is reduced only once its piece is staged; each
//! reduction is one step whose end the engine reports, and the piece goes on
//! only then, so a device memory space can run it asynchronously.

use std::ops::Range;

use fairring_core::ReduceOp;

use super::{
    Context, DeviceCopy, DeviceUse, Members, Origins, SliceEvent, SliceInfo, Step, Write,
    stray_event, unexpected,
};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::local::RailPieces;
use crate::memory::{Reduction, Sources};

/// How far the reduce-scatter of one slice has come.
#[derive(Debug)]
pub(crate) struct Scatter {
    /// The ranks, or the machines along this device's rail.
    around: Members,
    /// This rank's device (its slot of the machine's pieces).
    device: u32,
    /// Over the machines: the pieces as the machine stages them.
    rail: Option<RailPieces>,
    /// Bytes of each rank's share in the tensor.
    share: u64,
    /// Steps: `P - 1`.
    total: u32,
    /// Pieces staged so far (over the ranks in the order `r - 1`, `r - 2`,
    /// ..., `r`; over the machines all at once, by the local step).
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
    /// Stages every piece in, the one sent first first; over the machines,
    /// begins the machine's reduce-scatter.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Scatter> {
        let scatter = Scatter::new(ctx, s)?;
        if scatter.rail.is_some() {
            steps.push(Step::LocalBegin);
            steps.push(Step::LocalReduceScatter {
                final_world: (scatter.around.count == 1).then_some(ctx.world),
            });
            return Ok(scatter);
        }
        for j in 0..scatter.around.count {
            let o = scatter.around.at(-i64::from(j) - 1);
            steps.push(Step::StageIn {
                to: scatter.piece(s, o)?.start,
                from: scatter.in_tensor(s, o)?,
            });
        }
        Ok(scatter)
    }

    /// What a device tensor's slice asks of the device: over the machines,
    /// the local step's begin and reduce-scatter over the rail's pieces
    /// (final on one machine); no all-gather follows.
    pub(crate) fn device_use(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<DeviceUse> {
        let scatter = Scatter::new(ctx, s)?;
        Ok(match scatter.rail {
            Some(pieces) => DeviceUse {
                begin: true,
                reduce_scatter: Some((scatter.around.count == 1).then_some(ctx.world)),
                all_gather: None,
                pieces: Some(pieces),
            },
            None => DeviceUse::default(),
        })
    }

    /// A device tensor's copies: over the ranks every piece in, each to its
    /// place in the buffer; this rank's share of the result out, unless the
    /// machine's reduce-scatter wrote it (one machine).
    pub(crate) fn device_copies(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        each: &mut dyn FnMut(DeviceCopy) -> Result<()>,
    ) -> Result<()> {
        let scatter = Scatter::new(ctx, s)?;
        let members = scatter.around.count;
        if scatter.rail.is_none() {
            for j in 0..members {
                let o = scatter.around.at(-i64::from(j) - 1);
                each(DeviceCopy::In {
                    to: scatter.piece(s, o)?.start,
                    from: scatter.in_tensor(s, o)?,
                })?;
            }
        } else if members == 1 {
            return Ok(());
        }
        each(DeviceCopy::Out {
            from: scatter.piece(s, scatter.around.position)?.start,
            to: scatter.in_tensor(s, ctx.rank)?,
        })
    }

    /// The slice's reduce-scatter before its first step.
    fn new(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<Scatter> {
        let share = match s.origins {
            Some(Origins::Blocks(share)) => share,
            other => {
                return Err(Error::internal(
                    "a reduce-scatter slice knows its shares' size",
                    format!("slice {}: {other:?}", s.number),
                ));
            }
        };
        // This device's rail over the machines where machines have several
        // devices (every job links its rails), else the ranks.
        let (around, rail) = if ctx.topology.devices_per_machine() == 1 {
            (Members::ranks(ctx), None)
        } else {
            let pieces = RailPieces::new(ctx.topology, share, s.bytes()?);
            (Members::machines(ctx)?, Some(pieces))
        };
        let scatter = Scatter {
            around,
            device: ctx.location.device,
            rail,
            share,
            total: around.count - 1,
            staged: 0,
            reduced: 0,
            reducing: false,
            arrived: 0,
            sends: 0,
            copying: false,
            copied: false,
            released: false,
        };
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
        let members = self.around.count;
        match event {
            SliceEvent::Staged if self.rail.is_none() && self.staged < members => {
                self.staged += 1;
                if self.staged == 1 && self.total > 0 {
                    self.send(ctx, s, 0, self.around.at(-1), steps)?;
                }
            }
            SliceEvent::LocalReduceScatterDone if self.rail.is_some() && self.staged == 0 => {
                self.staged = members;
                if self.total > 0 {
                    self.send(ctx, s, 0, self.around.at(-1), steps)?;
                }
            }
            SliceEvent::Landed {
                kind: Kind::Scatter,
                peer,
                part: 0,
            } => {
                let seen = self.reduced + u32::from(self.reducing) + self.arrived;
                let expected = seen < self.total;
                let why = "not the next step";
                self.around
                    .check_from_previous(s, Kind::Scatter, peer, expected, why)?;
                self.arrived += 1;
            }
            SliceEvent::Landed { kind, peer, .. } => {
                return Err(unexpected(kind, peer, s, "a reduce-scatter slice"));
            }
            SliceEvent::Sent {
                kind: Kind::Scatter,
                part: 0,
            } if self.sends > 0 => self.sends -= 1,
            SliceEvent::Reduced if self.reducing => {
                self.reducing = false;
                let k = self.reduced;
                self.reduced += 1;
                if k + 1 < self.total {
                    self.send(ctx, s, k + 1, self.landing(k), steps)?;
                }
            }
            SliceEvent::CopiedOut if self.copying && !self.copied => self.copied = true,
            _ => return Err(stray_event(event, s, self)),
        }
        self.pump(ctx, s, steps)
    }

    /// The pieces as the machine's local step stages them, over the machines.
    pub(crate) fn local_pieces(&self) -> Option<RailPieces> {
        self.rail
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if self.staged == 0 && self.rail.is_some() {
            "local reduce-scatter"
        } else if self.staged == 0 {
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
                let dst = self.piece(s, self.landing(k))?;
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
        if self.staged == self.around.count && !self.copying {
            self.copying = true;
            if self.rail.is_some() && self.around.count == 1 {
                // The machine's reduce-scatter wrote the final share.
                self.copied = true;
            } else {
                steps.push(Step::CopyOut {
                    from: self.piece(s, self.around.position)?.start,
                    to: self.in_tensor(s, ctx.rank)?,
                });
            }
        }
        if self.copied && self.sends == 0 && !self.released {
            self.released = true;
            steps.push(Step::LocalFinish);
            steps.push(Step::Release);
        }
        Ok(())
    }

    /// Step `step` (piece `o`) to the next member's receive slot `step`.
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
            peer: self.around.next,
            source: self.piece(s, o)?,
            target: ctx.layout.scatter_slot(step)?,
            needs_credit: true,
            part: 0,
        }));
        Ok(())
    }

    /// The piece whose partial lands at step `k`: `p - 2 - k`.
    fn landing(&self, k: u32) -> u32 {
        self.around.at(-i64::from(k) - 2)
    }

    /// Piece `o` (of member `o`) in the staging buffer.
    fn piece(&self, s: &SliceInfo<'_>, o: u32) -> Result<Range<usize>> {
        if let Some(rail) = self.rail {
            return rail.staged(self.device, o);
        }
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

fn overflow(s: &SliceInfo<'_>) -> Error {
    Error::internal(
        "a reduce-scatter's pieces fit the address space",
        format!("{:?}", s.slice),
    )
}
