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
//!
//! **Sending from the tensor** ([`SliceInfo::direct`], `engine/direct.rs`): a
//! broadcast's root, relaying over ranks, stages nothing in; its chunks,
//! all it sends, leave from the tensor. **Landing in the tensor**: between two
//! such ranks the root writes them into the receiver's window
//! ([`SliceInfo::into_window`]) where the receiver opened one, marked
//! [`Kind::IntoTensor`]; the receiver then has nothing to copy out. An
//! operation's chunks land all in place or all in staging.
//!
//! # Over the machines
//!
//! Where a machine has several devices ([`over_machines`]) the chain's members
//! are the machines, one chain per rail, each over its device's slot of the
//! slice, and shared memory takes the hops inside a machine:
//!
//! 1. the machine's reduce-scatter sums its ranks' tensors into each device's
//!    slot: what starts on the machine, since the callers left zeros where
//!    their own bytes are not;
//! 2. the slot's pieces go around the machines as above, device `d` of machine
//!    `m` to device `d` of machine `m + 1`, landing in the receive area past
//!    the slice (at their offset within the slot), not in the slot, which the
//!    machine's reduce-scatter may still be writing; each landed chunk is
//!    summed into the slot (zeros there: the sum is the chunk) once the
//!    reduce-scatter has ended, and forwarded from where it landed;
//! 3. once every chunk is in, the slot is published and the machine's
//!    all-gather copies every slot into every tensor.
//!
//! So each byte crosses between machines once per hop, spread over the `D`
//! rails, and never crosses the fabric inside a machine. An all-gather does
//! this only where ranks are numbered machine by machine (machine `m`'s blocks
//! are then one range, its origin). A job with dedicated servers relays the
//! same way: its workers link their rails too.

use std::ops::Range;

use fairring_core::topology::{RankLayout, Topology};
use fairring_core::{DataType, ReduceOp, WireFormat};

use super::{
    Context, DeviceCopy, DeviceUse, Members, Resolved, SliceEvent, SliceInfo, Step, Write,
    stray_event, unexpected,
};
use crate::engine::descriptor::{Collective, Descriptor};
use crate::engine::tags::Kind;
use crate::error::{Error, Result};
use crate::memory::{Reduction, Sources};

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
        match d.collective.engine_form() {
            Collective::Broadcast => Some(Origins::Rank(d.root)),
            Collective::AllGather => block().map(Origins::Blocks),
            Collective::ReduceScatter if d.algorithm == Resolved::Scatter => {
                block().map(Origins::Blocks)
            }
            _ => None,
        }
    }
}

/// The chain a slice's bytes travel along: the ranks, or the machines.
#[derive(Clone, Copy, Debug)]
struct Line {
    /// The ranks, or the machines.
    members: Members,
    /// Where each byte starts, by member.
    origins: Origins,
    /// The bytes relayed, in the tensor, and where the slice starts there.
    span: (u64, u64),
    slice_start: u64,
    /// Where landings go, for the machine chain: the receive area (landing at
    /// `inbox + (offset - span start)`); `None`: at their own offset.
    inbox: Option<usize>,
}

impl Line {
    /// The member `step + 1` places before this one: the origin of the chunks
    /// that land `step`-th.
    fn origin(&self, step: u32) -> u32 {
        self.members.at(-i64::from(step % self.members.count) - 1)
    }

    /// Whether the next member is the last of the chain from `origin`.
    fn next_is_last_for(&self, origin: u32) -> bool {
        self.members.at(1) == origin
    }
}

/// How far the relay of one slice has come.
#[derive(Debug)]
pub(crate) struct Relay {
    line: Line,
    /// Bytes of a chunk (a piece's last may be shorter).
    chunk: u64,
    /// The own chunks are in the buffer (staged in, or reduced over the
    /// machine) and have been sent.
    staged: bool,
    /// Chunks expected from the previous member, and received so far.
    expected: u64,
    received: u64,
    /// The next chunk to land: the `step`-th origin before this member (0: the
    /// previous one), chunk `index` of its piece.
    step: u32,
    index: u64,
    /// Landings not processed yet (they wait for the own chunks to leave).
    held: u64,
    /// Writes posted and not completed; landed chunks not yet in place (copies
    /// into the tensor, or reductions into the slot).
    sends: u32,
    copies: u32,
    /// The own chunks leave from the tensor, unstaged
    /// ([`SliceInfo::direct`]: a broadcast's root).
    direct: bool,
    /// ... into the peer's window, where it opened one
    /// ([`SliceInfo::into_window`]).
    into_window: bool,
    /// Whether the chunks that landed here so far landed in the tensor
    /// ([`Kind::IntoTensor`]) or in staging; `None` before the first.
    in_tensor: Option<bool>,
    /// The slot has been published, and its local all-gather is running
    /// (machine chain).
    published: bool,
    gathering: bool,
    /// The buffer has been released.
    released: bool,
}

impl Relay {
    /// Starts the slice: stages this rank's own piece in, or over several
    /// devices per machine runs the machine's reduce-scatter (its chunks leave
    /// once it has).
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Relay> {
        let mut relay = Relay::new(ctx, s)?;
        let line = relay.line;
        let own = relay.piece(line.members.position)?;
        if line.inbox.is_some() {
            // On a single machine the machine's sums are the result: its
            // reduce-scatter writes each slot into the tensor as well.
            steps.push(Step::LocalBegin);
            steps.push(Step::LocalReduceScatter {
                final_world: (line.members.count == 1).then_some(ctx.world),
            });
        } else if own.is_empty() || line.members.count == 1 {
            relay.staged = true;
            relay.pump(steps)?;
        } else if s.direct {
            // The own piece is where it is sent from.
            relay.direct = true;
            relay.into_window = s.into_window;
            relay.own_in_place(steps)?;
            relay.pump(steps)?;
        } else {
            steps.push(Step::StageIn {
                to: own.start,
                from: own,
            });
        }
        Ok(relay)
    }

    /// What a device tensor's slice asks of the device: over the machines,
    /// the local step whole (final on one machine); over the ranks, nothing
    /// of it.
    pub(crate) fn device_use(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<DeviceUse> {
        let line = Relay::new(ctx, s)?.line;
        Ok(match line.inbox {
            Some(_) => {
                let alone = line.members.count == 1;
                DeviceUse::local(alone.then_some(ctx.world), alone)
            }
            None => DeviceUse::default(),
        })
    }

    /// A device tensor's copies over the ranks (over the machines the local
    /// step moves every byte): the own piece in, where it has one and someone
    /// to send it to, and every chunk this rank receives out, each where it
    /// landed, at its own offset.
    pub(crate) fn device_copies(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        each: &mut dyn FnMut(DeviceCopy) -> Result<()>,
    ) -> Result<()> {
        let relay = Relay::new(ctx, s)?;
        let line = relay.line;
        if line.inbox.is_some() {
            return Ok(());
        }
        let own = relay.piece(line.members.position)?;
        if !own.is_empty() && line.members.count > 1 {
            each(DeviceCopy::In {
                to: own.start,
                from: own,
            })?;
        }
        for step in 0..line.members.count - 1 {
            let piece = relay.piece(line.origin(step))?;
            for index in 0..relay.count(&piece) {
                let range = relay.chunk_range(piece.clone(), index);
                each(DeviceCopy::Out {
                    from: range.start,
                    to: range,
                })?;
            }
        }
        Ok(())
    }

    /// The slice's relay before its first step: its chain, its chunks and
    /// what it expects to receive.
    fn new(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<Relay> {
        let origins = s.origins.ok_or_else(|| {
            Error::internal(
                "a relayed slice knows where its bytes start",
                format!("slice {}", s.number),
            )
        })?;
        let line = line(ctx, s, origins)?;
        let len = line.span.1 - line.span.0;
        let largest = u64::try_from(ctx.layout.slice_bytes()).unwrap_or(u64::MAX);
        let least = MIN_CHUNK_BYTES.min(largest / CHUNKS).max(1);
        let mut relay = Relay {
            line,
            chunk: len.div_ceil(CHUNKS).max(least),
            staged: false,
            expected: 0,
            received: 0,
            step: 0,
            index: 0,
            held: 0,
            sends: 0,
            copies: 0,
            direct: false,
            into_window: false,
            in_tensor: None,
            published: false,
            gathering: false,
            released: false,
        };
        for step in 0..line.members.count - 1 {
            relay.expected += relay.chunks(line.origin(step))?;
        }
        relay.skip_empty()?;
        Ok(relay)
    }

    /// Takes one event.
    pub(crate) fn on_event(
        &mut self,
        _ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        event: SliceEvent,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        let machines = self.line.inbox.is_some();
        match event {
            SliceEvent::Staged if !self.staged && !machines => self.own_in_place(steps)?,
            SliceEvent::LocalReduceScatterDone if !self.staged && machines => {
                self.own_in_place(steps)?;
            }
            SliceEvent::Landed {
                kind: kind @ (Kind::Relay | Kind::IntoTensor),
                peer,
                part: 0,
            } => {
                let expected = self.received + self.held < self.expected;
                let why = "not the relay's next chunk";
                self.line
                    .members
                    .check_from_previous(s, kind, peer, expected, why)?;
                let in_tensor = kind == Kind::IntoTensor;
                if machines && in_tensor || self.in_tensor.is_some_and(|was| was != in_tensor) {
                    return Err(unexpected(
                        kind,
                        peer,
                        s,
                        "a relayed slice whose chunks land all in one place, in staging over machines",
                    ));
                }
                self.in_tensor = Some(in_tensor);
                self.held += 1;
            }
            SliceEvent::Landed { kind, peer, .. } => {
                return Err(unexpected(kind, peer, s, "a relayed slice"));
            }
            SliceEvent::Sent {
                kind: Kind::Relay,
                part: 0,
            } if self.sends > 0 => self.sends -= 1,
            SliceEvent::CopiedOut if self.copies > 0 && !machines => self.copies -= 1,
            SliceEvent::Reduced if self.copies > 0 && machines => self.copies -= 1,
            SliceEvent::LocalAllGatherDone if self.gathering && !self.released => {
                self.gathering = false;
            }
            _ => return Err(stray_event(event, s, self)),
        }
        self.pump(steps)
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if !self.staged {
            if self.line.inbox.is_some() {
                "local reduce-scatter"
            } else {
                "staging in"
            }
        } else if self.received < self.expected {
            "relaying"
        } else if self.copies > 0 {
            "copying out"
        } else if self.gathering {
            "local all-gather"
        } else {
            "draining its sends"
        }
    }

    /// The own piece is in the buffer: its chunks leave (if there is anyone
    /// to send them to).
    fn own_in_place(&mut self, steps: &mut Vec<Step>) -> Result<()> {
        self.staged = true;
        if self.line.members.count == 1 {
            return Ok(());
        }
        let own = self.piece(self.line.members.position)?;
        for index in 0..self.count(&own) {
            let range = self.chunk_range(own.clone(), index);
            self.send(range, false, steps);
        }
        Ok(())
    }

    /// Forwards and puts in place every landed chunk it may, and finishes the
    /// slice once nothing is left.
    fn pump(&mut self, steps: &mut Vec<Step>) -> Result<()> {
        if !self.staged {
            return Ok(());
        }
        while self.held > 0 {
            self.held -= 1;
            let from = self.line.origin(self.step);
            let piece = self.piece(from)?;
            let range = self.chunk_range(piece.clone(), self.index);
            self.received += 1;
            self.index += 1;
            if self.index == self.count(&piece) {
                self.step += 1;
                self.index = 0;
                self.skip_empty()?;
            }
            if self.in_tensor == Some(true) {
                // Written in place by the previous member; only the last
                // member of a chain opens a window, so nothing goes on.
                if !self.line.next_is_last_for(from) {
                    return Err(Error::internal(
                        "only the last member of a chain lands chunks in its tensor",
                        format!("slice of {:?}", self.line),
                    ));
                }
                continue;
            }
            if !self.line.next_is_last_for(from) {
                self.send(range.clone(), true, steps);
            }
            self.copies += 1;
            match self.landing(&range) {
                // Into the slot, whose bytes from other machines are zeros:
                // a wrapping byte sum of zero and the chunk is the chunk.
                Some(landed) => steps.push(Step::Reduce(Reduction {
                    dtype: DataType::U8,
                    op: ReduceOp::Sum,
                    sources: Sources::one(landed),
                    dst: range,
                    average_over: None,
                    wire: WireFormat::Exact,
                })),
                None => steps.push(Step::CopyOut {
                    from: range.start,
                    to: range,
                }),
            }
        }
        let done = self.received == self.expected && self.copies == 0;
        if !done || self.released {
            return Ok(());
        }
        if self.line.inbox.is_some() {
            // The slot is whole: the machine gathers every slot.
            if !self.published {
                self.published = true;
                self.gathering = true;
                steps.push(Step::PublishSlot);
                steps.push(Step::LocalAllGather {
                    own_in_tensor: self.line.members.count == 1,
                });
            }
            if !self.gathering && self.sends == 0 {
                self.released = true;
                steps.push(Step::Release);
            }
        } else if self.sends == 0 {
            self.released = true;
            steps.push(Step::LocalFinish);
            steps.push(Step::Release);
        }
        Ok(())
    }

    /// One chunk (bytes `range` of the slice) to the next member, into its
    /// receive area on the machine chain: an own chunk from its place, a
    /// forwarded one from where it landed.
    fn send(&mut self, range: Range<usize>, forwarded: bool, steps: &mut Vec<Step>) {
        self.sends += 1;
        let (source, target) = match self.landing(&range) {
            Some(landed) if forwarded => (landed.clone(), landed.start),
            Some(landed) => (range, landed.start),
            None => (range.clone(), range.start),
        };
        let write = Write {
            kind: Kind::Relay,
            peer: self.line.members.next,
            target,
            source,
            needs_credit: true,
            part: 0,
        };
        steps.push(match (self.direct && !forwarded, self.into_window) {
            (true, true) => Step::WriteIntoWindow(write),
            (true, false) => Step::WriteFromTensor(write),
            (false, _) => Step::Write(write),
        });
    }

    /// Where bytes `range` of the slice land on the machine chain: at their
    /// offset in the relayed span, in the receive area.
    fn landing(&self, range: &Range<usize>) -> Option<Range<usize>> {
        let inbox = self.line.inbox?;
        let span_start = usize::try_from(self.line.span.0 - self.line.slice_start).ok()?;
        let start = inbox + (range.start - span_start);
        Some(start..start + range.len())
    }

    /// Moves the next expected landing past origins with nothing in the span.
    fn skip_empty(&mut self) -> Result<()> {
        while self.step + 1 < self.line.members.count
            && self.chunks(self.line.origin(self.step))? == 0
        {
            self.step += 1;
        }
        Ok(())
    }

    /// Bytes of the span (from the slice's start) whose origin is `member`.
    fn piece(&self, member: u32) -> Result<Range<usize>> {
        let (start, end) = self.line.span;
        let (from, to) = match self.line.origins {
            Origins::Rank(root) if root == member => (start, end),
            Origins::Rank(_) => (start, start),
            Origins::Blocks(block) => {
                let first = block.saturating_mul(u64::from(member));
                let last = first.saturating_add(block);
                (first.clamp(start, end), last.clamp(start, end))
            }
        };
        let base = self.line.slice_start;
        let to_usize = |b: u64| {
            usize::try_from(b - base).map_err(|_| {
                Error::internal(
                    "a slice's bytes fit the address space",
                    format!("{:?}", self.line),
                )
            })
        };
        Ok(to_usize(from)?..to_usize(to)?)
    }

    /// Chunks in the piece of `member`.
    fn chunks(&self, member: u32) -> Result<u64> {
        Ok(self.count(&self.piece(member)?))
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

/// Whether a relayed `collective` runs over the machines on `topology`: where
/// a machine has several devices, their shared memory takes the hops inside
/// it, and the caller's tensors must hold zeros where the rank's own bytes are
/// not (the machine's reduce-scatter sums them). An all-gather does only where
/// ranks are numbered machine by machine, so that a machine's blocks are one
/// range. Every job links its rails, dedicated servers or not.
pub(crate) fn over_machines(topology: Topology, collective: Collective) -> bool {
    topology.devices_per_machine() > 1
        && match collective.engine_form() {
            Collective::Broadcast => true,
            Collective::AllGather => topology.layout() == RankLayout::Contiguous,
            _ => false,
        }
}

/// The chain of slice `s` on this rank. With one device per machine it is the
/// ring of ranks over the whole slice. Over the machines ([`over_machines`]) it
/// is this device's rail, over this device's slot: the machine's reduce-scatter
/// gathers what starts on the machine into the slot (zeros elsewhere), the slot
/// goes around the machines, and the machine's all-gather spreads the slots.
fn line(ctx: &Context<'_>, s: &SliceInfo<'_>, origins: Origins) -> Result<Line> {
    let span = s.slice.span();
    let slice_start = span.byte_offset();
    let devices = u64::from(ctx.topology.devices_per_machine());
    let collective = match origins {
        Origins::Rank(_) => Collective::Broadcast,
        Origins::Blocks(_) => Collective::AllGather,
    };
    let machine_origins = match origins {
        _ if !over_machines(ctx.topology, collective) => None,
        Origins::Rank(root) => ctx
            .topology
            .locate(root)
            .ok()
            .map(|l| Origins::Rank(l.machine)),
        // Machine `m`'s ranks hold `[m * D * block, (m + 1) * D * block)`.
        Origins::Blocks(block) => Some(Origins::Blocks(block.saturating_mul(devices))),
    };
    let Some(origins) = machine_origins else {
        return Ok(Line {
            members: Members::ranks(ctx),
            origins,
            span: (slice_start, span.byte_end()),
            slice_start,
            inbox: None,
        });
    };
    let slot = s
        .slice
        .slot(ctx.location.device)
        .map_err(|e| Error::internal("every device has a slot", e.to_string()))?;
    Ok(Line {
        members: Members::machines(ctx)?,
        origins,
        span: (slot.byte_offset(), slot.byte_end()),
        slice_start,
        inbox: Some(ctx.layout.relay_inbox(slot.byte_len())?),
    })
}

#[cfg(test)]
mod tests;
