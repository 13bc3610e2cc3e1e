//! A dedicated reduction server's part of one slice (Herring's design; docs/DESIGN.md
//! section 1 with the servers in the machines' place).
//!
//! The workers run [`Hierarchical`](super::Hierarchical) with the server as the
//! holder of one shard `j` of every slot of its rail group (the slots `d` with
//! `d mod R` its own, `R = gcd(K, D)`: all of them where `R` is 1, one where
//! there is a server per NIC): device `d` of every machine `m` writes its cell
//! `(d, j)` into area `(m, d)` of the server's buffer
//! ([`ServerLayout`](fairring_core::plan::ServerLayout)). For each such slot
//! `d` the server then:
//!
//! 1. sums into machine 0's area, once its cell has landed;
//! 2. folds the other machines' cells into it in machine order, up to
//!    [`SERVER_FOLD_CELLS`](fairring_core::plan::SERVER_FOLD_CELLS) cells a reduction
//!    ([`ServerLayout::fold`](fairring_core::plan::ServerLayout::fold)): each
//!    fold starts once its cells have landed and the fold before it has ended,
//!    so the folds overlap the arrivals of later cells, and a fold's cells that
//!    land while an earlier fold runs are read together once it ends, with the
//!    accumulator read and written once for all of them. The last fold divides
//!    the sum, for an average;
//! 3. once every fold has ended, writes the sum back into the same range of
//!    device `d` of every machine (`Result`).
//!
//! The folds do not depend on when cells land, so every run sums in the same
//! order with the same roundings, and every machine gets the same values.
//!
//! On a compressed wire ([`WireFormat::Bf16`], [`WireFormat::F16`]: `f32` only)
//! each cell lands narrow, in the first half of its area. Machine 0's cell is
//! widened in place first, every later cell is widened as it is folded, so the
//! sum is taken in `f32` (and divided, for an average); the sum is then narrowed
//! in place and its narrow half sent back once that conversion has ended
//! ([`Converted::Results`]). Every machine gets the same rounded values. A
//! server's memory is host memory, whose steps end as they are taken, in order:
//! the widening is done before the first fold starts.
//!
//! The slice releases its buffer once every result has been sent. A slice in
//! which this server serves no shard (fewer shards than servers, a ring
//! operation, an empty slice) releases at once: the server still takes every
//! slice in turn, so that its buffers and generations stay those of the workers.

use std::collections::VecDeque;
use std::ops::Range;

use fairring_core::{DataType, ReduceOp, WireFormat};

use super::{Context, Converted, Resolved, SliceEvent, SliceInfo, Step, Write, unexpected};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::{Conversion, Direction, Reduction, Sources};

/// One slot's cell of the served shard.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Part {
    /// Whether the slot has bytes (a worker with an empty slot sends nothing).
    expected: bool,
    /// Bytes of the cell.
    len: usize,
    /// Folds ended: machine 0's area holds the sum of its own cell and the
    /// cells of folds `0..folds_ended`.
    folds_ended: u32,
    /// The reduction of this slot that is running, if one is.
    reducing: Option<Reducing>,
    /// Whether an average over one machine has been divided (with more, the
    /// last fold divides).
    divided: bool,
    /// Whether the sum is being sent back.
    summed: bool,
}

/// A reduction of one slot's sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reducing {
    /// The next fold.
    Fold,
    /// The division of an average over one machine, which folds nothing.
    Division,
}

/// What a server slice borrows from its buffer and gives back when it releases,
/// so that slices allocate nothing once every buffer has served one.
#[derive(Debug, Default)]
pub(crate) struct ServeScratch {
    parts: Vec<Part>,
    arrived: Vec<bool>,
    running: VecDeque<u32>,
    narrowing: VecDeque<u32>,
}

/// The server state of one slice.
#[derive(Debug)]
pub(crate) struct Serve {
    /// The shard this server serves.
    shard: u32,
    /// Per slot.
    parts: Vec<Part>,
    /// Per slot `d` and machine `m`, at `d * M + m`: whether the cell landed.
    arrived: Vec<bool>,
    /// The slots whose reductions are running, in the order they were started
    /// (their ends come back in that order).
    running: VecDeque<u32>,
    /// The slots whose sums are being narrowed for the wire, in the same way.
    narrowing: VecDeque<u32>,
    /// Slots whose sum is not yet being sent back.
    open: u32,
    /// Results posted and not yet sent.
    unsent: u32,
    released: bool,
}

impl Serve {
    /// Takes the slice: finds the shard this server serves, and releases at once
    /// if there is none.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        algorithm: Resolved,
        scratch: &mut ServeScratch,
        steps: &mut Vec<Step>,
    ) -> Result<Serve> {
        let mut serve = Serve {
            shard: 0,
            parts: std::mem::take(&mut scratch.parts),
            arrived: std::mem::take(&mut scratch.arrived),
            running: std::mem::take(&mut scratch.running),
            narrowing: std::mem::take(&mut scratch.narrowing),
            open: 0,
            unsent: 0,
            released: false,
        };
        serve.parts.clear();
        serve.arrived.clear();
        serve.running.clear();
        serve.narrowing.clear();
        let server = ctx.server.ok_or_else(|| {
            Error::internal(
                "only a dedicated server serves",
                format!("rank {}", ctx.rank),
            )
        })?;
        let shard = match algorithm {
            Resolved::Hierarchical => s
                .slice
                .shard_of_server(server)
                .map_err(|e| Error::internal("this server is in the job", e.to_string()))?,
            Resolved::Ring
            | Resolved::Relay
            | Resolved::Doubling
            | Resolved::Scatter
            | Resolved::Nccl
            | Resolved::Colocated
            | Resolved::Grouped => None,
        };
        if let Some(shard) = shard {
            serve.shard = shard;
            let cells =
                ctx.topology.machines() as usize * ctx.topology.devices_per_machine() as usize;
            serve.arrived.resize(cells, false);
            for device in 0..ctx.topology.devices_per_machine() {
                let len = s.cell_range(device, shard)?.len();
                // Only the slots of this server's rail group send it cells.
                let expected = ctx.layout.server_receives_slot(server, device)
                    && !s.slice.slot(device).is_ok_and(|slot| slot.is_empty());
                serve.open += u32::from(expected);
                serve.parts.push(Part {
                    expected,
                    len,
                    ..Part::default()
                });
            }
        }
        if serve.open == 0 {
            serve.release(steps);
        }
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
        match event {
            SliceEvent::Landed {
                kind: Kind::Contribution,
                peer,
                part: 0,
            } => self.landed(ctx, s, peer, steps),
            SliceEvent::Reduced => {
                let device = self.running.pop_front().ok_or_else(|| {
                    Error::internal(
                        "a reduction ends only after it started",
                        format!("slice {}", s.number),
                    )
                })?;
                let part = &mut self.parts[device as usize];
                match part.reducing.take() {
                    Some(Reducing::Fold) => part.folds_ended += 1,
                    Some(Reducing::Division) => part.divided = true,
                    None => {
                        return Err(Error::internal(
                            "a slot's reduction ends while it runs",
                            format!("slice {}, slot {device}", s.number),
                        ));
                    }
                }
                self.advance(ctx, s, device, steps)
            }
            SliceEvent::Converted(Converted::Results) => {
                let device = self.narrowing.pop_front().ok_or_else(|| {
                    Error::internal(
                        "a conversion ends only after it started",
                        format!("slice {}", s.number),
                    )
                })?;
                self.write_back(ctx, s, device, steps)
            }
            SliceEvent::Sent {
                kind: Kind::Result,
                part: 0,
            } if self.unsent > 0 => {
                self.unsent -= 1;
                if self.open == 0 && self.unsent == 0 {
                    self.release(steps);
                }
                Ok(())
            }
            SliceEvent::Landed { kind, peer, .. } => {
                Err(unexpected(kind, peer, s, "a dedicated server's slice"))
            }
            _ => Err(Error::internal(
                "a server slice gets only its own steps' events",
                format!("{event:?} for slice {}", s.number),
            )),
        }
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if self.released {
            "released"
        } else if self.open > 0 {
            "collecting and reducing the workers' cells"
        } else {
            "sending the sums back"
        }
    }

    /// Gives the slice's vectors back to its buffer.
    pub(crate) fn recycle(self, scratch: &mut ServeScratch) {
        scratch.parts = self.parts;
        scratch.arrived = self.arrived;
        scratch.running = self.running;
        scratch.narrowing = self.narrowing;
    }

    fn release(&mut self, steps: &mut Vec<Step>) {
        self.released = true;
        steps.push(Step::Release);
    }

    /// A worker's cell landed: machine 0's is widened where the wire is
    /// compressed; then the slot's next fold starts if it can.
    fn landed(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        peer: u32,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let from = ctx.topology.locate(peer).map_err(|_| {
            unexpected(
                Kind::Contribution,
                peer,
                s,
                "only workers send contributions",
            )
        })?;
        if let Some(server) = ctx.server
            && !ctx.layout.server_receives_slot(server, from.device)
        {
            return Err(unexpected(
                Kind::Contribution,
                peer,
                s,
                "its device is not of this server's rail group",
            ));
        }
        let machines = ctx.topology.machines();
        let Some(part) = self.parts.get_mut(from.device as usize) else {
            return Err(unexpected(
                Kind::Contribution,
                peer,
                s,
                "this server serves no shard of the slice",
            ));
        };
        let arrived = &mut self.arrived[(from.device * machines + from.machine) as usize];
        if !part.expected || *arrived {
            return Err(unexpected(
                Kind::Contribution,
                peer,
                s,
                "its slot has no cell left to receive from it",
            ));
        }
        *arrived = true;
        let wire = compressed(s);
        if from.machine == 0 && wire != WireFormat::Exact {
            let acc = area(ctx, 0, from.device, part.len)?;
            steps.push(Step::Convert {
                conversion: Conversion {
                    format: wire,
                    direction: Direction::Widen,
                    from: acc.start..acc.start + wire.wire_bytes(acc.len()),
                    to: acc.start,
                },
                then: None,
            });
        }
        self.advance(ctx, s, from.device, steps)
    }

    /// Starts slot `device`'s next reduction if nothing of it runs and its
    /// cells are in: the next fold, or on one machine the division of an
    /// average; once there is none left, sends the sum back.
    fn advance(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        device: u32,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let machines = ctx.topology.machines();
        let row = (device * machines) as usize;
        let part = self.parts[device as usize];
        if part.summed || part.reducing.is_some() || !self.arrived[row] {
            return Ok(());
        }
        let wire = compressed(s);
        let (reducing, sources, wire, last) =
            match ctx
                .layout
                .server_fold(part.folds_ended, device, wire.wire_bytes(part.len))?
            {
                Some((folded, sources)) => {
                    let cells =
                        &self.arrived[row + folded.start as usize..row + folded.end as usize];
                    if !cells.iter().all(|&a| a) {
                        return Ok(());
                    }
                    (Reducing::Fold, sources, wire, folded.end == machines)
                }
                None if machines == 1 && s.op == ReduceOp::Avg && !part.divided => (
                    Reducing::Division,
                    Sources::none(part.len),
                    WireFormat::Exact,
                    true,
                ),
                None => return self.send_back(ctx, s, device, steps),
            };
        steps.push(Step::Reduce(Reduction {
            dtype: s.dtype,
            op: s.op,
            dst: area(ctx, 0, device, part.len)?,
            sources,
            average_over: (last && s.op == ReduceOp::Avg).then_some(ctx.world),
            wire,
        }));
        self.parts[device as usize].reducing = Some(reducing);
        self.running.push_back(device);
        Ok(())
    }

    /// Slot `device`'s sum is complete: sends it back, or on a compressed wire
    /// narrows it first.
    fn send_back(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        device: u32,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        self.parts[device as usize].summed = true;
        let wire = compressed(s);
        if wire == WireFormat::Exact {
            return self.write_back(ctx, s, device, steps);
        }
        let sum = self.sum(ctx, device)?;
        steps.push(Step::Convert {
            conversion: Conversion {
                format: wire,
                direction: Direction::Narrow,
                from: sum.clone(),
                to: sum.start,
            },
            then: Some(Converted::Results),
        });
        self.narrowing.push_back(device);
        Ok(())
    }

    /// The bytes of slot `device`'s sum: machine 0's area.
    fn sum(&self, ctx: &Context<'_>, device: u32) -> Result<Range<usize>> {
        area(ctx, 0, device, self.parts[device as usize].len)
    }

    /// Slot `device`'s sum (narrow, on a compressed wire) to device `device` of
    /// every machine, into the cell's range of its slice.
    fn write_back(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        device: u32,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let mut source = self.sum(ctx, device)?;
        source.end = source.start + compressed(s).wire_bytes(source.len());
        let target = s.cell_range(device, self.shard)?.start;
        for machine in 0..ctx.topology.machines() {
            let peer = ctx
                .topology
                .rank(fairring_core::topology::Location { machine, device })
                .map_err(|e| Error::internal("every machine has every rail", e.to_string()))?;
            steps.push(Step::Write(Write {
                kind: Kind::Result,
                peer,
                source: source.clone(),
                target,
                needs_credit: false,
                part: 0,
            }));
            self.unsent += 1;
        }
        self.open -= 1;
        Ok(())
    }
}

/// The format the slice's cells and sums travel in: the slice's wire for `f32`
/// values, exact otherwise.
fn compressed(s: &SliceInfo<'_>) -> WireFormat {
    if s.dtype == DataType::F32 {
        s.wire
    } else {
        WireFormat::Exact
    }
}

/// The first `len` bytes of machine `machine`'s area for slot `device`.
fn area(ctx: &Context<'_>, machine: u32, device: u32, len: usize) -> Result<Range<usize>> {
    let a = ctx.layout.server_area(machine, device)?;
    if len > a.len() {
        return Err(Error::internal(
            "a cell fits its server area",
            format!("{len} bytes in {a:?}"),
        ));
    }
    Ok(a.start..a.start + len)
}
