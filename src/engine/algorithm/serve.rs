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
//! 1. takes the area of the first machine whose cell landed as the accumulator;
//! 2. reduces every later cell into it **as it lands** (one two-source pass per
//!    cell, so the reduction overlaps the arrivals instead of waiting for the
//!    slowest worker); the reduction that completes the sum divides it, for an
//!    average;
//! 3. once every machine's cell is in, writes the sum back into the same range of
//!    device `d` of every machine (`Result`).
//!
//! On a compressed wire ([`WireFormat::Bf16`], [`WireFormat::F16`]: `f32` only)
//! each cell lands narrow, in the first half of its area. The accumulator is
//! widened in place first, every later cell is widened as it is reduced, so the
//! sum is taken in `f32` (and divided, for an average); the sum is then narrowed
//! in place and its narrow half sent back once that conversion has ended
//! ([`Converted::Results`]). Every machine gets the same rounded values. A
//! server's memory is host memory, whose steps end as they are taken, in order:
//! the widening is done before the reduction into the accumulator starts.
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
    /// The machine whose area accumulates the sum.
    accumulator: Option<u32>,
    /// Cells landed.
    landed: u32,
    /// Reductions finished.
    reduced: u32,
}

/// What a server slice borrows from its buffer and gives back when it releases,
/// so that slices allocate nothing once every buffer has served one.
#[derive(Debug, Default)]
pub(crate) struct ServeScratch {
    parts: Vec<Part>,
    running: VecDeque<u32>,
    narrowing: VecDeque<u32>,
}

/// The server state of one slice.
#[derive(Debug)]
pub(crate) struct Serve {
    algorithm: Resolved,
    /// The shard this server serves.
    shard: u32,
    /// Per slot.
    parts: Vec<Part>,
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
            algorithm,
            shard: 0,
            parts: std::mem::take(&mut scratch.parts),
            running: std::mem::take(&mut scratch.running),
            narrowing: std::mem::take(&mut scratch.narrowing),
            open: 0,
            unsent: 0,
            released: false,
        };
        serve.parts.clear();
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
            | Resolved::Nccl => None,
        };
        if let Some(shard) = shard {
            serve.shard = shard;
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
                part.reduced += 1;
                if part.reduced == reductions_needed(ctx, s) {
                    self.send_back(ctx, s, device, steps)?;
                }
                Ok(())
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

    /// The algorithm the workers run for the slice.
    pub(crate) fn resolved(&self) -> Resolved {
        self.algorithm
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
        scratch.running = self.running;
        scratch.narrowing = self.narrowing;
    }

    fn release(&mut self, steps: &mut Vec<Step>) {
        self.released = true;
        steps.push(Step::Release);
    }

    /// A worker's cell landed: the first of its slot becomes the accumulator, each
    /// later one is reduced into it.
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
        if !part.expected || part.landed == machines {
            return Err(unexpected(
                Kind::Contribution,
                peer,
                s,
                "its slot has no cell left to receive",
            ));
        }
        part.landed += 1;
        let complete = part.landed == machines;
        let len = part.len;
        let accumulator = *part.accumulator.get_or_insert(from.machine);
        let average_over = (complete && s.op == ReduceOp::Avg).then_some(ctx.world);
        let wire = compressed(s);
        if accumulator == from.machine && wire != WireFormat::Exact {
            let acc = area(ctx, accumulator, from.device, len)?;
            steps.push(Step::Convert {
                conversion: Conversion {
                    format: wire,
                    direction: Direction::Widen,
                    from: acc.start..acc.start + wire.wire_bytes(len),
                    to: acc.start,
                },
                then: None,
            });
        }
        let (sources, wire) = if accumulator == from.machine {
            // The first cell: nothing to reduce, unless it is also the last and
            // the sum must be divided.
            if average_over.is_none() {
                if complete {
                    self.send_back(ctx, s, from.device, steps)?;
                }
                return Ok(());
            }
            (Sources::none(len), WireFormat::Exact)
        } else {
            let cell = area(ctx, from.machine, from.device, len)?;
            let narrow = cell.start..cell.start + wire.wire_bytes(len);
            (Sources::one(narrow), wire)
        };
        steps.push(Step::Reduce(Reduction {
            dtype: s.dtype,
            op: s.op,
            dst: area(ctx, accumulator, from.device, len)?,
            sources,
            average_over,
            wire,
        }));
        self.running.push_back(from.device);
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
        let wire = compressed(s);
        if wire == WireFormat::Exact {
            return self.write_back(ctx, s, device, steps);
        }
        let sum = self.sum(ctx, s, device)?;
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

    /// The bytes of slot `device`'s sum: its accumulator's area.
    fn sum(&self, ctx: &Context<'_>, s: &SliceInfo<'_>, device: u32) -> Result<Range<usize>> {
        let part = self.parts[device as usize];
        let accumulator = part.accumulator.ok_or_else(|| {
            Error::internal(
                "a slot is sent back after its cells landed",
                format!("slice {}, slot {device}", s.number),
            )
        })?;
        area(ctx, accumulator, device, part.len)
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
        let mut source = self.sum(ctx, s, device)?;
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

/// Reductions a slot needs: one per machine after the first, or for an average
/// on a single machine the division alone.
fn reductions_needed(ctx: &Context<'_>, s: &SliceInfo<'_>) -> u32 {
    match ctx.topology.machines() {
        1 => u32::from(s.op == ReduceOp::Avg),
        m => m - 1,
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
