//! Tensor -> slices: the staging buffers, the slice holding each, and starting
//! and releasing slices.
//!
//! Slice number `n` (counted across operations) takes staging buffer `n % B` as
//! generation `n / B`, once the buffer is free here and on every local rank, and
//! once every local rank has issued its operation alike. It starts its algorithm,
//! which stages it in. A slice whose operation is ordered on a caller's stream
//! starts only once that stream has passed the operation's start
//! ([`MemorySpace::started`]): until then the engine opens nothing of it, and
//! the stall timer does not run. A slice of a device tensor is held to its
//! device program from its start ([`SliceStages`]). Writes that landed for it
//! before it started (a peer was ahead) are handed to it then. When its
//! algorithm releases the buffer, the operation counts the slice, and the
//! credits this rank grants move on.

use std::collections::VecDeque;

use fairring_core::plan::Slice;
use fairring_core::{DataType, ReduceOp, WireFormat};
use fairring_rdma::fabric::Fabric;

use super::algorithm::{
    Context, Origins, Resolved, ServeScratch, SliceAlgorithm, SliceEvent, SliceInfo,
};
use super::credits::Due;
use super::device_program::SliceStages;
use super::direct;
use super::failure::Fault;
use super::tags::Kind;
use super::work_table::Submission;
use super::{Driver, Engine};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::memory::program::slice_end;

/// Steps a memory space may have running for one slice at once.
const FENCES: usize = 8;

/// The slice holding a buffer.
pub(crate) struct ActiveSlice<M: MemorySpace> {
    pub(crate) number: u64,
    pub(crate) generation: u64,
    pub(crate) seq: u64,
    pub(crate) slice: Slice,
    pub(crate) tensor: M::Tensor,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) wire: WireFormat,
    pub(crate) origins: Option<Origins>,
    /// A broadcast in a job of one machine: its root's local rank
    /// ([`LocalSlice::root`](crate::local::LocalSlice)).
    pub(crate) local_root: Option<u32>,
    /// The fabric sends from the tensor (`direct`).
    pub(crate) direct: bool,
    /// Its writes from the tensor go into the peer's window (`direct`).
    pub(crate) into_window: bool,
    /// What it runs (the algorithm's state is in `algorithm`).
    pub(crate) resolved: Resolved,
    pub(crate) algorithm: SliceAlgorithm,
    /// A device tensor's slice: its device program, as the running slice is
    /// held to it.
    pub(crate) device: Option<SliceStages>,
}

/// A local step the slice waits to run.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LocalRequest {
    ReduceScatter { final_world: Option<u32> },
    AllGather { own_in_tensor: bool },
}

/// One staging buffer.
pub(crate) struct BufferSlot<M: MemorySpace> {
    pub(crate) active: Option<ActiveSlice<M>>,
    /// The generation of the next slice to take the buffer.
    pub(crate) next_generation: u64,
    /// Writes that landed for the next slice before it started, with their
    /// writers.
    pub(crate) early: Vec<(Kind, u32, u32)>,
    /// The local step the slice waits to run, if any.
    pub(crate) local: Option<LocalRequest>,
    /// Steps running in the memory space, and the event each ends with (none
    /// for a conversion that is not the last of its group).
    pub(crate) fences: VecDeque<(M::Fence, Option<SliceEvent>)>,
    /// What a dedicated server's slice borrows while it holds the buffer.
    pub(crate) serve: ServeScratch,
}

/// Every staging buffer.
pub(crate) struct Slices<M: MemorySpace> {
    pub(crate) slots: Vec<BufferSlot<M>>,
    /// The number of the next slice to start.
    pub(crate) next_slice: u64,
    /// The lowest slice not yet vacated: released here, and no longer read by
    /// any local rank.
    vacated: u64,
    /// The next slice waits for its operation's start on a caller's stream
    /// (as of the last [`Engine::try_start`]).
    pub(crate) awaits_start: bool,
}

impl<M: MemorySpace> Slices<M> {
    /// `buffers` idle buffers; `early` bounds the writes one can hold for a slice
    /// that has not started.
    pub(crate) fn new(buffers: u32, early: usize) -> Slices<M> {
        Slices {
            slots: (0..buffers)
                .map(|_| BufferSlot {
                    active: None,
                    next_generation: 0,
                    early: Vec::with_capacity(early),
                    local: None,
                    fences: VecDeque::with_capacity(FENCES),
                    serve: ServeScratch::default(),
                })
                .collect(),
            next_slice: 0,
            vacated: 0,
            awaits_start: false,
        }
    }

    /// The buffer slice `number` takes.
    pub(crate) fn buffer_of(&self, number: u64) -> u32 {
        #[expect(clippy::cast_possible_truncation, reason = "below the buffer count")]
        let b = (number % self.slots.len() as u64) as u32;
        b
    }

    /// Whether a step of some slice waits for its fence (device copies, which
    /// ring no doorbell when they end), or the next slice for its operation's
    /// start on a caller's stream (nor does that).
    pub(crate) fn awaits_fences(&self) -> bool {
        self.awaits_start || self.slots.iter().any(|s| !s.fences.is_empty())
    }

    /// Whether any buffer holds a slice.
    pub(crate) fn any_active(&self) -> bool {
        self.slots.iter().any(|s| s.active.is_some())
    }

    /// The oldest slice in flight and its buffer.
    pub(crate) fn oldest(&self) -> Option<(u32, &BufferSlot<M>, &ActiveSlice<M>)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(b, s)| s.active.as_ref().map(|a| (b, s, a)))
            .min_by_key(|(_, _, a)| a.number)
            .map(|(b, s, a)| (u32::try_from(b).unwrap_or(u32::MAX), s, a))
    }

    /// Moves the vacated watermark past every slice no rank of this machine reads
    /// any more from this rank's buffers: released here, and `local_done(buffer,
    /// slice)` (every local rank is done with it: a local all-gather reads its
    /// peers' buffers). Returns the watermark.
    fn advance_vacated(&mut self, local_done: impl Fn(u32, u64) -> bool) -> u64 {
        while self.vacated < self.next_slice {
            let w = self.vacated;
            let b = self.buffer_of(w);
            let held = self.slots[b as usize]
                .active
                .as_ref()
                .is_some_and(|a| a.number == w);
            if held || !local_done(b, w) {
                break;
            }
            self.vacated += 1;
        }
        self.vacated
    }

    /// Forgets every slice (the engine failed).
    pub(crate) fn clear(&mut self) {
        for s in &mut self.slots {
            s.active = None;
            s.local = None;
            s.early.clear();
            s.fences.clear();
        }
        self.awaits_start = false;
    }
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// What every slice's algorithm shares.
    pub(super) fn context(&self) -> Context<'_> {
        Context {
            topology: self.links.topology,
            location: self.links.location,
            rank: self.links.rank,
            world: self.links.topology.world_size(),
            layout: &self.layout,
            servers: self.servers,
            server: self.server,
        }
    }

    /// What the slices of `algorithm` share: on a worker, the algorithms of
    /// the job's second geometry ([`Resolved::on_second_geometry`]) run in
    /// its layout of the buffers, the machines' own plan beside dedicated
    /// servers ([`Resolved::Colocated`]) as in a job without them;
    /// everything else (and a server's part of anything) runs in the job's
    /// [`Engine::context`].
    pub(super) fn context_for(&self, algorithm: Resolved) -> Context<'_> {
        if algorithm.on_second_geometry() && self.server.is_none() {
            Context {
                layout: &self.second_layout,
                servers: 0,
                ..self.context()
            }
        } else {
            self.context()
        }
    }

    /// Starts the next slice if its buffer is free here and on this machine;
    /// returns whether it did.
    pub(super) fn try_start(&self, d: &mut Driver<M>) -> Result<bool, Fault> {
        d.slices.awaits_start = false;
        let Some(next) = d.operations.next_slice()? else {
            return Ok(false);
        };
        // No data of an operation is combined before every local rank has issued
        // the same one.
        if !d.checks.locally_checked(next.seq) {
            return Ok(false);
        }
        // NCCL combines every rank's bytes at once: not before the local
        // ranks and every remote writer have issued the same operation (the
        // local step opens the call only once every local rank has begun,
        // each past this check: every rank is some local rank's rail).
        if next.algorithm == Resolved::Nccl && !d.checks.remotely_confirmed(next.seq, &self.links) {
            return Ok(false);
        }
        let number = d.slices.next_slice;
        if next.number != number {
            return Err(Error::internal(
                "slices start in the order their operations numbered them",
                format!(
                    "slice {} of #{} is next, slice {number} expected",
                    next.number, next.seq
                ),
            )
            .into());
        }
        let b = d.slices.buffer_of(number);
        if d.slices.slots[b as usize].active.is_some() || !self.local.buffer_free(b, number) {
            return Ok(false);
        }
        let rec = d.operations.get(next.seq).ok_or_else(|| {
            Error::internal(
                "a slice starts from an open operation",
                format!("#{}", next.seq),
            )
        })?;
        // Nothing of an operation ordered on a caller's stream is opened
        // before that stream reaches its start: the time before is the
        // caller's, not a stall.
        if !self.memory.started(&rec.sub.tensor)? {
            d.slices.awaits_start = true;
            return Ok(false);
        }
        let device = match rec.device {
            Some(_) => Some(self.slice_stages(&rec.sub, &next.slice, number)?),
            None => None,
        };
        let generation = number / self.buffers as u64;
        let origins = Origins::of(&rec.sub.descriptor);
        let direct = self.sends_from_tensor(&rec.sub, next.algorithm);
        let into_window = direct
            && self.links.fabric.registers_windows()
            && direct::writes_into_window(
                &self.context_for(next.algorithm),
                &rec.sub,
                next.algorithm,
                self.direct_from,
            );
        let info = SliceInfo {
            number,
            generation,
            slice: &next.slice,
            dtype: rec.sub.dtype(),
            op: rec.sub.op(),
            wire: rec.sub.wire(),
            origins,
            direct,
            into_window,
        };
        let mut steps = std::mem::take(&mut d.scratch.steps);
        steps.clear();
        let algorithm = SliceAlgorithm::start(
            next.algorithm,
            &self.context_for(next.algorithm),
            &info,
            &mut d.slices.slots[b as usize].serve,
            &mut steps,
        );
        let algorithm = match algorithm {
            Ok(a) => a,
            Err(e) => {
                d.scratch.steps = steps;
                return Err(e.into());
            }
        };
        if let Some(held) = &device
            && held.device_use.pieces != algorithm.local_pieces()
        {
            d.scratch.steps = steps;
            return Err(Error::internal(
                "a device slice lies in staging as its program says",
                format!("slice {number}"),
            )
            .into());
        }
        let slot = &mut d.slices.slots[b as usize];
        slot.active = Some(ActiveSlice {
            number,
            generation,
            seq: next.seq,
            slice: next.slice,
            tensor: rec.sub.tensor,
            dtype: rec.sub.dtype(),
            op: rec.sub.op(),
            wire: rec.sub.wire(),
            origins,
            local_root: self.local_root(origins),
            direct,
            into_window,
            resolved: next.algorithm,
            algorithm,
            device,
        });
        slot.next_generation = generation + 1;
        d.slices.next_slice += 1;
        d.operations.started();
        let result = self.settle(d, b, &mut steps);
        d.scratch.steps = steps;
        result?;
        // Writes that landed before the slice started.
        let mut early = std::mem::take(&mut d.slices.slots[b as usize].early);
        let mut replayed = Ok(());
        for &(kind, peer, part) in &early {
            replayed = self.feed(d, b, SliceEvent::Landed { kind, peer, part });
            if replayed.is_err() {
                break;
            }
        }
        early.clear();
        d.slices.slots[b as usize].early = early;
        replayed?;
        Ok(true)
    }

    /// The local rank of the root of a broadcast (`origins`) in a job of one
    /// machine without servers, whose local step is the whole broadcast.
    pub(super) fn local_root(&self, origins: Option<Origins>) -> Option<u32> {
        let ctx = self.context();
        match origins {
            Some(Origins::Rank(root)) if ctx.topology.machines() == 1 && ctx.servers == 0 => {
                ctx.topology.locate(root).ok().map(|l| l.device)
            }
            _ => None,
        }
    }

    /// Whether operation `sub`'s slices send from its tensor: it may
    /// (`direct::eligible`) and its tensor is registered, by its first slice.
    pub(super) fn sends_from_tensor(&self, sub: &Submission<M>, algorithm: Resolved) -> bool {
        let fabric = &self.links.fabric;
        if !fabric.registers_sources()
            || !direct::eligible(
                &self.context_for(algorithm),
                sub,
                algorithm,
                self.direct_from,
            )
        {
            return false;
        }
        let Some((ptr, len)) = self.memory.host_bytes(&sub.tensor) else {
            return false;
        };
        self.lock_source_regions()
            .take(sub.seq, (ptr.as_ptr() as usize, len), || {
                direct::register(fabric, ptr, len, sub.seq)
            })
    }

    /// Holds a write of `kind` (part `part`) from `peer` for generation `g` of
    /// idle buffer `b`, until its slice starts.
    pub(super) fn land_early(
        &self,
        d: &mut Driver<M>,
        b: u32,
        kind: Kind,
        peer: u32,
        part: u32,
    ) -> Result<(), Fault> {
        let early = &mut d.slices.slots[b as usize].early;
        if early.len() == early.capacity() {
            return Err(Error::peer(
                peer,
                format!(
                    "wrote more into staging buffer {b} ahead of its slice than the protocol allows"
                ),
            )
            .into());
        }
        early.push((kind, peer, part));
        Ok(())
    }

    /// The slice in `b` is finished: count it, free the buffer, credit writers.
    pub(super) fn release(&self, d: &mut Driver<M>, b: u32) -> Result<(), Fault> {
        let slot = &mut d.slices.slots[b as usize];
        let Some(active) = slot.active.take() else {
            return Err(Error::internal(
                "only a slice that holds its buffer releases it",
                format!("buffer {b}"),
            )
            .into());
        };
        if slot.local.is_some() || !slot.fences.is_empty() || d.outbox.waiting(b) {
            return Err(Error::internal(
                "a slice releases its buffer after its last step",
                format!("slice {} ({})", active.number, active.algorithm.phase()),
            )
            .into());
        }
        // A device slice's program is over (every stage opened in order,
        // and the last ended): the next slice's may reuse the buffer.
        if let Some(held) = &active.device
            && let Some(last) = held.stages.last()
            && !self
                .memory
                .poll(&self.memory.stage_end(b, slice_end(active.generation)))?
        {
            return Err(Error::internal(
                "a device slice releases its buffer once its program has ended",
                format!("slice {} (its {} has not)", active.number, last.name()),
            )
            .into());
        }
        active.algorithm.recycle(&mut slot.serve);
        if d.operations.slice_done(active.seq)? {
            self.try_complete(d, active.seq)?;
        }
        if self.advance_vacated(d) {
            d.credits
                .send(&self.links, &d.departures, Due::Short, &self.machine);
        }
        Ok(())
    }

    /// Moves the credit window past every vacated slice; returns whether the limit
    /// moved.
    ///
    /// A slice is vacated once this rank released it *and* every local rank is
    /// done with it: until then a local rank's all-gather may still read this
    /// rank's buffer, and a peer's write of the buffer's next slice (a relay
    /// chunk, into the slice area) would change the bytes under it.
    pub(super) fn advance_vacated(&self, d: &mut Driver<M>) -> bool {
        let buffers = u64::from(self.buffers);
        let vacated = d
            .slices
            .advance_vacated(|b, w| self.local.buffer_free(b, w + buffers));
        d.credits.vacated(vacated, self.buffers)
    }
}
