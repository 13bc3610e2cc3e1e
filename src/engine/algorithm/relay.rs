//! The relay of one slice on one rank: broadcast and all-gather moving each byte
//! once per hop, around the ring.
//!
//! Every byte of a broadcast or an all-gather starts at one rank, its *origin*
//! ([`Origins`]): the root's, for a broadcast; rank `o`'s input block, for an
//! all-gather. Nothing is reduced, so nothing needs to travel twice: each byte
//! goes around the ring from its origin, `r` to `r + 1`, until the rank before
//! its origin has it. A broadcast is then a pipelined chain from the root, and
//! an all-gather the all-gather half of the ring all-reduce. Each rank receives
//! every byte it lacks once and sends every byte once, except the last rank of
//! each chain; the all-reduce they ran as before sent and received each byte
//! twice, half of it zeros.
//!
//! The slice's bytes of each origin (its *piece*) travel in chunks of about a
//! [`CHUNKS`]th of the slice, so the chain is a pipeline within the slice as well
//! as across the staging buffers; but of at least [`MIN_CHUNK_BYTES`] (or a
//! [`CHUNKS`]th of the largest slice, if that is less), so a small operation
//! goes in few writes. Every write
//! lands at the same offset of the next rank's buffer as it has here, the slice
//! being staged at the start of the buffer; it needs the next rank's credit for
//! the slice (it lands where the buffer's previous slice may still be read).
//!
//! Landings carry no address. A rank sends its own chunks first, as soon as they
//! are staged in, and then forwards the chunks it receives in the order they
//! arrive; so by induction rank `r` receives the chunks of origin `r - 1`, then
//! `r - 2`, ... then `r + 1`, each origin's in order, and knows from the count
//! which chunk each landing is. Chunks that land before the own chunks have left
//! wait, so that the order holds. Each landed chunk is copied into the tensor
//! (and forwarded) at once; the buffer is released when every expected chunk
//! has landed and every copy and send has finished.

use std::ops::Range;

use super::{
    Context, Resolved, SliceEvent, SliceInfo, Step, Write, from_previous, stray_event, unexpected,
};
use crate::engine::descriptor::{Collective, Descriptor};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};

/// Chunks a slice is cut into, about: the depth of the pipeline within it.
pub(crate) const CHUNKS: u64 = CHUNK_COUNT as u64;
const CHUNK_COUNT: usize = 16;

/// Fewest bytes in a chunk (but a piece's last), where slices are large.
pub(crate) const MIN_CHUNK_BYTES: u64 = 64 * 1024;

/// The most writes a relayed slice queues to, or lands early in, one peer on
/// `world` ranks: every chunk of the slice, and one more per piece boundary.
pub(crate) fn most_writes(world: u32) -> usize {
    CHUNK_COUNT + world as usize + 1
}

/// Where a relayed operation's bytes start: each byte has one origin rank
/// (and, for a reduce-scatter, which rank's share each byte is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Origins {
    /// Every byte starts at this rank (a broadcast's root).
    Rank(u32),
    /// Rank `o`'s bytes are `[o * block, (o + 1) * block)` (an all-gather of
    /// `block` bytes per rank; a reduce-scatter's shares of `block` bytes).
    Blocks(u64),
}

impl Origins {
    /// The origins of the operation `d` describes, if it is one a relay or the
    /// scatter algorithm runs.
    pub(crate) fn of(d: &Descriptor) -> Option<Origins> {
        let block = || d.elements.checked_mul(d.dtype.size_bytes());
        match d.collective {
            Collective::Broadcast => Some(Origins::Rank(d.root)),
            Collective::AllGather => block().map(Origins::Blocks),
            Collective::ReduceScatter if d.algorithm == Resolved::Scatter => {
                block().map(Origins::Blocks)
            }
            Collective::AllReduce | Collective::ReduceScatter | Collective::Barrier => None,
        }
    }
}

/// How far the relay of one slice has come.
#[derive(Debug)]
pub(crate) struct Relay {
    origins: Origins,
    /// Bytes of a chunk (a piece's last may be shorter).
    chunk: u64,
    /// The own chunks have been staged in and sent.
    staged: bool,
    /// Chunks expected from the previous rank, and received so far.
    expected: u64,
    received: u64,
    /// The next chunk to land: the `step`-th origin before this rank (0: the
    /// previous rank), chunk `index` of its piece.
    step: u32,
    index: u64,
    /// Landings not processed yet (they wait for the own chunks to leave).
    held: u64,
    /// Writes posted and not completed; copies into the tensor not finished.
    sends: u32,
    copies: u32,
    /// The buffer has been released.
    released: bool,
}

impl Relay {
    /// Stages this rank's own piece in (its chunks leave once it is).
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Relay> {
        let origins = s.origins.ok_or_else(|| {
            Error::internal(
                "a relayed slice knows where its bytes start",
                format!("slice {}", s.number),
            )
        })?;
        let len = s.slice.span().byte_len();
        let largest = u64::try_from(ctx.layout.slice_bytes()).unwrap_or(u64::MAX);
        let least = MIN_CHUNK_BYTES.min(largest / CHUNKS).max(1);
        let mut relay = Relay {
            origins,
            chunk: len.div_ceil(CHUNKS).max(least),
            staged: false,
            expected: 0,
            received: 0,
            step: 0,
            index: 0,
            held: 0,
            sends: 0,
            copies: 0,
            released: false,
        };
        for step in 0..ctx.world - 1 {
            relay.expected += relay.chunks(s, origin(ctx, step))?;
        }
        relay.skip_empty(ctx, s)?;
        let own = relay.piece(s, ctx.rank)?;
        if own.is_empty() || ctx.world == 1 {
            relay.staged = true;
            relay.pump(ctx, s, steps)?;
        } else {
            steps.push(Step::StageIn {
                to: own.start,
                from: own,
            });
        }
        Ok(relay)
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
                let own = self.piece(s, ctx.rank)?;
                self.send_chunks(ctx, own, steps);
            }
            SliceEvent::Landed {
                kind: Kind::Relay,
                peer,
            } => {
                let expected = self.received + self.held < self.expected;
                let why = "not the relay's next chunk";
                from_previous(ctx, s, Kind::Relay, peer, expected, why)?;
                self.held += 1;
            }
            SliceEvent::Landed { kind, peer } => {
                return Err(unexpected(kind, peer, s, "a relayed slice"));
            }
            SliceEvent::Sent { kind: Kind::Relay } if self.sends > 0 => self.sends -= 1,
            SliceEvent::CopiedOut if self.copies > 0 => self.copies -= 1,
            _ => return Err(stray_event(event, s, self)),
        }
        self.pump(ctx, s, steps)
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if !self.staged {
            "staging in"
        } else if self.received < self.expected {
            "relaying"
        } else if self.copies > 0 {
            "copying out"
        } else {
            "draining its sends"
        }
    }

    /// Forwards and copies out every landed chunk it may, and releases the
    /// buffer once nothing is left.
    fn pump(&mut self, ctx: &Context<'_>, s: &SliceInfo<'_>, steps: &mut Vec<Step>) -> Result<()> {
        if !self.staged {
            return Ok(());
        }
        while self.held > 0 {
            self.held -= 1;
            let from = origin(ctx, self.step);
            let piece = self.piece(s, from)?;
            let range = self.chunk_range(piece.clone(), self.index);
            self.received += 1;
            self.index += 1;
            if self.index == self.count(&piece) {
                self.step += 1;
                self.index = 0;
                self.skip_empty(ctx, s)?;
            }
            // The rank after this one is the last of the chain from `from`
            // when its own bytes are next.
            if ctx.around(1) != from {
                self.send(ctx, range.clone(), steps);
            }
            self.copies += 1;
            steps.push(Step::CopyOut {
                from: range.start,
                to: range,
            });
        }
        if self.received == self.expected && self.sends == 0 && self.copies == 0 && !self.released {
            self.released = true;
            steps.push(Step::LocalFinish);
            steps.push(Step::Release);
        }
        Ok(())
    }

    /// Sends every chunk of `piece` to the next rank.
    fn send_chunks(&mut self, ctx: &Context<'_>, piece: Range<usize>, steps: &mut Vec<Step>) {
        for index in 0..self.count(&piece) {
            let range = self.chunk_range(piece.clone(), index);
            self.send(ctx, range, steps);
        }
    }

    /// One chunk to the next rank, at the same offset of its buffer.
    fn send(&mut self, ctx: &Context<'_>, range: Range<usize>, steps: &mut Vec<Step>) {
        self.sends += 1;
        steps.push(Step::Write(Write {
            kind: Kind::Relay,
            peer: ctx.around(1),
            target: range.start,
            source: range,
            needs_credit: true,
        }));
    }

    /// Moves the next expected landing past origins with nothing in the slice.
    fn skip_empty(&mut self, ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<()> {
        while self.step + 1 < ctx.world && self.chunks(s, origin(ctx, self.step))? == 0 {
            self.step += 1;
        }
        Ok(())
    }

    /// Bytes of the slice (from its start) whose origin is `rank`.
    fn piece(&self, s: &SliceInfo<'_>, rank: u32) -> Result<Range<usize>> {
        let span = s.slice.span();
        let (start, end) = (span.byte_offset(), span.byte_end());
        let (from, to) = match self.origins {
            Origins::Rank(root) if root == rank => (start, end),
            Origins::Rank(_) => (start, start),
            Origins::Blocks(block) => {
                let first = block.saturating_mul(u64::from(rank));
                let last = first.saturating_add(block);
                (first.clamp(start, end), last.clamp(start, end))
            }
        };
        let to_usize = |b: u64| {
            usize::try_from(b - start).map_err(|_| {
                Error::internal("a slice's bytes fit the address space", format!("{span:?}"))
            })
        };
        Ok(to_usize(from)?..to_usize(to)?)
    }

    /// Chunks in the piece of `rank`.
    fn chunks(&self, s: &SliceInfo<'_>, rank: u32) -> Result<u64> {
        Ok(self.count(&self.piece(s, rank)?))
    }

    /// Chunks in `piece`.
    fn count(&self, piece: &Range<usize>) -> u64 {
        u64::try_from(piece.len())
            .unwrap_or(u64::MAX)
            .div_ceil(self.chunk)
    }

    /// Chunk `index` of `piece`.
    fn chunk_range(&self, piece: Range<usize>, index: u64) -> Range<usize> {
        let chunk = usize::try_from(self.chunk).unwrap_or(usize::MAX);
        let index = usize::try_from(index).unwrap_or(usize::MAX);
        let start = piece
            .start
            .saturating_add(chunk.saturating_mul(index))
            .min(piece.end);
        start..start.saturating_add(chunk).min(piece.end)
    }
}

/// The origin of the chunks that land `step`-th: the rank `step + 1` places
/// before this one.
fn origin(ctx: &Context<'_>, step: u32) -> u32 {
    ctx.around(-i64::from(step) - 1)
}

#[cfg(test)]
mod tests {
    use fairring_core::plan::{Geometry, Plan, PlanConfig};
    use fairring_core::topology::{Location, RankLayout, Topology};
    use fairring_core::{DataType, ReduceOp, WireFormat};

    use super::*;
    use crate::engine::layout::StagingLayout;

    /// Runs `f` on rank `rank` of a 3x1 job, on the first slice of a relayed
    /// `u8` operation of `bytes` with `origins` (slices of 4 KiB: chunks of 256).
    fn on_rank(
        rank: u32,
        bytes: u64,
        origins: Origins,
        f: impl FnOnce(&Context<'_>, &SliceInfo<'_>),
    ) {
        let topology = Topology::new(3, 1, RankLayout::Contiguous).unwrap();
        let geometry = Geometry::new(topology, PlanConfig::new(4096, 64).unwrap()).unwrap();
        let layout = StagingLayout::new(&geometry, 3).unwrap();
        let plan = Plan::new(&geometry, DataType::U8, bytes, 0).unwrap();
        let slice = plan.slice(0).unwrap();
        let ctx = Context {
            topology,
            location: Location {
                machine: rank,
                device: 0,
            },
            rank,
            world: 3,
            layout: &layout,
            servers: 0,
            server: None,
        };
        let s = SliceInfo {
            number: 0,
            generation: 0,
            slice: &slice,
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            wire: WireFormat::Exact,
            origins: Some(origins),
        };
        f(&ctx, &s);
    }

    fn writes(steps: &[Step]) -> Vec<Range<usize>> {
        steps
            .iter()
            .filter_map(|s| match s {
                Step::Write(w) => Some(w.source.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_chunk_that_lands_before_the_own_piece_is_staged_waits_for_it() {
        // All-gather of 3 x 1000 bytes: rank 1 owns 1000..2000 (4 chunks of
        // 256, the last short) and first receives rank 0's 0..1000.
        on_rank(1, 3000, Origins::Blocks(1000), |ctx, s| {
            let mut steps = Vec::new();
            let mut relay = Relay::start(ctx, s, &mut steps).unwrap();
            assert_eq!(
                steps,
                [Step::StageIn {
                    to: 1000,
                    from: 1000..2000
                }]
            );
            steps.clear();
            let landed = SliceEvent::Landed {
                kind: Kind::Relay,
                peer: 0,
            };
            relay.on_event(ctx, s, landed, &mut steps).unwrap();
            assert!(steps.is_empty(), "{steps:?}");
            relay
                .on_event(ctx, s, SliceEvent::Staged, &mut steps)
                .unwrap();
            // A sixteenth of the largest slice (4 KiB, rounded to the layout).
            let c = usize::try_from(relay.chunk).unwrap();
            assert!((240..=256).contains(&c), "{c}");
            // The own chunks leave first, then the landed chunk of rank 0 goes on
            // (rank 2 is not its origin's predecessor) and into the tensor.
            assert_eq!(
                writes(&steps),
                [
                    1000..1000 + c,
                    1000 + c..1000 + 2 * c,
                    1000 + 2 * c..1000 + 3 * c,
                    1000 + 3 * c..2000,
                    0..c
                ]
            );
            assert!(steps.contains(&Step::CopyOut { from: 0, to: 0..c }));
            assert_eq!(relay.expected, 8);
        });
    }

    #[test]
    fn the_last_rank_of_a_chain_keeps_what_lands() {
        // A broadcast from rank 1: rank 0 is the last of the chain 1 -> 2 -> 0.
        on_rank(0, 600, Origins::Rank(1), |ctx, s| {
            let mut steps = Vec::new();
            let mut relay = Relay::start(ctx, s, &mut steps).unwrap();
            assert!(steps.is_empty(), "{steps:?}");
            for _ in 0..3 {
                let landed = SliceEvent::Landed {
                    kind: Kind::Relay,
                    peer: 2,
                };
                relay.on_event(ctx, s, landed, &mut steps).unwrap();
            }
            assert!(writes(&steps).is_empty(), "{steps:?}");
            let copies = steps
                .iter()
                .filter(|s| matches!(s, Step::CopyOut { .. }))
                .count();
            assert_eq!(copies, 3);
            // A fourth chunk is one too many, and a chunk from rank 1 comes from
            // the wrong side.
            for peer in [2, 1] {
                let landed = SliceEvent::Landed {
                    kind: Kind::Relay,
                    peer,
                };
                assert!(relay.on_event(ctx, s, landed, &mut steps).is_err());
            }
            steps.clear();
            for _ in 0..3 {
                relay
                    .on_event(ctx, s, SliceEvent::CopiedOut, &mut steps)
                    .unwrap();
            }
            assert_eq!(steps, [Step::LocalFinish, Step::Release]);
        });
    }
}
