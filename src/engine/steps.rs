//! Performing an algorithm's steps: where a slice's [`Step`]s meet the memory
//! space, the local step and the outbox, and where their ends come back as
//! [`SliceEvent`]s.
//!
//! A step that ends at once (every step on the host) queues its event right
//! away, and [`Engine::settle`] hands it to the algorithm in the same pass; a step
//! that ends later (a fence not yet passed, a local step other ranks are not
//! ready for) is remembered in its buffer's slot and polled by
//! [`Engine::advance`] on every pass.

use std::collections::VecDeque;
use std::ops::Range;

use fairring_rdma::fabric::Fabric;

use super::algorithm::{SliceEvent, SliceInfo, Step};
use super::failure::Fault;
use super::outbox::{PendingWrite, WindowTarget};
use super::slices::{ActiveSlice, LocalRequest};
use super::tags::{self, Kind};
use super::{Driver, Engine};
use crate::error::Error;
use crate::local::{LocalSlice, LocalStage, slice_range};
use crate::memory::MemorySpace;
use crate::memory::program::Stage;

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Hands `event` to the slice in buffer `b`, and settles what follows.
    pub(super) fn feed(&self, d: &mut Driver<M>, b: u32, event: SliceEvent) -> Result<(), Fault> {
        let mut steps = std::mem::take(&mut d.scratch.steps);
        steps.clear();
        d.scratch.events.push_back(event);
        let result = self.settle(d, b, &mut steps);
        d.scratch.steps = steps;
        result
    }

    /// Performs `steps`, then hands the events that ended at once to the slice in
    /// `b`, and performs what they return, until nothing is left.
    pub(super) fn settle(
        &self,
        d: &mut Driver<M>,
        b: u32,
        steps: &mut Vec<Step>,
    ) -> Result<(), Fault> {
        let mut events = std::mem::take(&mut d.scratch.events);
        let result = self.settle_with(d, b, steps, &mut events);
        events.clear();
        d.scratch.events = events;
        result
    }

    fn settle_with(
        &self,
        d: &mut Driver<M>,
        b: u32,
        steps: &mut Vec<Step>,
        events: &mut VecDeque<SliceEvent>,
    ) -> Result<(), Fault> {
        let mut wrote = false;
        loop {
            for step in steps.drain(..) {
                wrote |= matches!(
                    step,
                    Step::Write(_) | Step::WriteFromTensor(_) | Step::WriteIntoWindow(_)
                );
                self.perform(d, b, step, events)?;
            }
            let Some(event) = events.pop_front() else {
                break;
            };
            let active = d.slices.slots[b as usize].active.as_mut().ok_or_else(|| {
                Error::internal(
                    "events reach only a slice that holds its buffer",
                    format!("{event:?} for buffer {b}"),
                )
            })?;
            let ctx = self.context_for(active.resolved);
            if event == SliceEvent::LocalAllGatherDone {
                self.local.gathered(b, active.number)?;
            }
            let ActiveSlice {
                number,
                generation,
                slice,
                dtype,
                op,
                wire,
                origins,
                direct,
                into_window,
                algorithm,
                ..
            } = active;
            let info = SliceInfo {
                number: *number,
                generation: *generation,
                slice,
                dtype: *dtype,
                op: *op,
                wire: *wire,
                origins: *origins,
                direct: *direct,
                into_window: *into_window,
            };
            algorithm.on_event(&ctx, &info, event, steps)?;
        }
        if wrote {
            self.flush(d, b)?;
        }
        Ok(())
    }

    /// Performs one step of the slice in buffer `b`; events of steps that ended
    /// at once go into `events`.
    fn perform(
        &self,
        d: &mut Driver<M>,
        b: u32,
        step: Step,
        events: &mut VecDeque<SliceEvent>,
    ) -> Result<(), Fault> {
        let slot = &mut d.slices.slots[b as usize];
        let active = slot.active.as_ref().ok_or_else(|| {
            Error::internal(
                "steps come from a slice that holds its buffer",
                format!("{step:?} for buffer {b}"),
            )
        })?;
        let tensor_base = slice_range(&active.slice)?.start;
        let from_tensor = matches!(step, Step::WriteFromTensor(_) | Step::WriteIntoWindow(_));
        let into_window = matches!(step, Step::WriteIntoWindow(_));
        let ended = match step {
            Step::Write(w) | Step::WriteFromTensor(w) | Step::WriteIntoWindow(w) => {
                let base = if from_tensor {
                    tensor_base
                } else {
                    b as usize * self.memory.buffer_bytes()
                };
                let peer_base = b as usize * self.stride_of(w.peer);
                let immediate = tags::immediate(w.kind, b, active.generation, w.part);
                // In the peer's tensor, the bytes sit where they sit in this
                // rank's: at the slice's offset there.
                let window = into_window.then(|| WindowTarget {
                    offset: (tensor_base + w.target) as u64,
                    immediate: tags::with_kind(immediate, Kind::IntoTensor),
                });
                let write = PendingWrite {
                    peer: w.peer,
                    source: base + w.source.start,
                    from_tensor,
                    len: w.source.len(),
                    target: (peer_base + w.target) as u64,
                    immediate,
                    window,
                    token: tags::token(w.kind, b, active.generation, w.part),
                    seq: active.seq,
                    credit_for: w.needs_credit.then_some(active.number),
                };
                d.outbox.queue(b, write);
                None
            }
            Step::StageIn { to, from } => {
                let from = tensor_base + from.start..tensor_base + from.end;
                let fence = match active.device {
                    Some(_) => self.device_copy(d, b, Stage::CopyIn, to, &from)?,
                    None => self.memory.stage_in(b, to, &active.tensor, from)?,
                };
                Some((fence, Some(SliceEvent::Staged)))
            }
            Step::LocalBegin => {
                if let Some(held) = &active.device {
                    held.check_local(active.number, LocalStage::Begin)?;
                }
                self.local.begin(&local_slice(b, active))?;
                None
            }
            Step::LocalReduceScatter { final_world } => {
                if let Some(held) = &active.device {
                    let asked = LocalStage::ReduceScatter { final_world };
                    held.check_local(active.number, asked)?;
                }
                slot.local = Some(LocalRequest::ReduceScatter { final_world });
                return self.try_local(d, b, events).map(drop);
            }
            Step::PublishSlot => {
                self.local.publish_slot(&local_slice(b, active));
                None
            }
            Step::LocalAllGather { own_in_tensor } => {
                if let Some(held) = &active.device {
                    let asked = LocalStage::AllGather {
                        final_world: None,
                        own_in_tensor,
                    };
                    held.check_local(active.number, asked)?;
                }
                slot.local = Some(LocalRequest::AllGather { own_in_tensor });
                return self.try_local(d, b, events).map(drop);
            }
            Step::Reduce(reduction) => Some((
                self.memory.reduce(b, &active.tensor, &reduction)?,
                Some(SliceEvent::Reduced),
            )),
            Step::ReduceInTensor(mut reduction) => {
                reduction.dst = tensor_base + reduction.dst.start..tensor_base + reduction.dst.end;
                Some((
                    self.memory
                        .reduce_in_tensor(b, &active.tensor, &reduction)?,
                    Some(SliceEvent::Reduced),
                ))
            }
            Step::Convert { conversion, then } => Some((
                self.memory.convert(b, &active.tensor, &conversion)?,
                then.map(SliceEvent::Converted),
            )),
            Step::CopyOut { from, to } => {
                let to = tensor_base + to.start..tensor_base + to.end;
                let fence = match active.device {
                    Some(_) => self.device_copy(d, b, Stage::CopyOut, from, &to)?,
                    None => self.memory.copy_out(b, from, &active.tensor, to)?,
                };
                Some((fence, Some(SliceEvent::CopiedOut)))
            }
            Step::LocalFinish => {
                self.local.finish(b, active.number);
                None
            }
            Step::Release => return self.release(d, b),
        };
        if let Some((fence, event)) = ended {
            let fences = &d.slices.slots[b as usize].fences;
            // A fence that passed ends its step at once, unless an earlier step's
            // has not: events keep the order of their steps.
            if fences.is_empty() && self.memory.poll(&fence)? {
                events.extend(event);
            } else {
                d.slices.slots[b as usize].fences.push_back((fence, event));
            }
        }
        Ok(())
    }

    /// A copy of algorithm stage `stage` the device slice in buffer `b` asks
    /// for, between staging offset `staging` and bytes `tensor` of its
    /// tensor: counted against its program, and the stage opened once every
    /// copy of it has been asked for. Returns the fence of the stage's end.
    fn device_copy(
        &self,
        d: &mut Driver<M>,
        b: u32,
        stage: Stage,
        staging: usize,
        tensor: &Range<usize>,
    ) -> Result<M::Fence, Fault> {
        let active = d.slices.slots[b as usize].active.as_mut().ok_or_else(|| {
            Error::internal(
                "copies come from a slice that holds its buffer",
                format!("buffer {b}"),
            )
        })?;
        let (number, generation) = (active.number, active.generation);
        let held = active.device.as_mut().ok_or_else(|| {
            Error::internal(
                "only a device slice runs a program",
                format!("slice {number}"),
            )
        })?;
        if held.ask(number, stage, staging, tensor)? {
            return Ok(self.memory.raise(b, generation, stage, held.stages)?);
        }
        Ok(self.memory.stage_end(b, stage.value(generation)))
    }

    /// Runs the local step buffer `b` waits for, if the other local ranks are
    /// ready; returns whether it ran.
    fn try_local(
        &self,
        d: &mut Driver<M>,
        b: u32,
        events: &mut VecDeque<SliceEvent>,
    ) -> Result<bool, Fault> {
        let slot = &mut d.slices.slots[b as usize];
        let (Some(request), Some(active)) = (slot.local, slot.active.as_ref()) else {
            return Ok(false);
        };
        let s = local_slice(b, active);
        let (fence, event) = match request {
            LocalRequest::ReduceScatter { final_world } => (
                self.local.try_reduce_scatter(&s, final_world)?,
                SliceEvent::LocalReduceScatterDone,
            ),
            LocalRequest::AllGather { own_in_tensor } => (
                self.local.try_all_gather(&s, own_in_tensor)?,
                SliceEvent::LocalAllGatherDone,
            ),
        };
        let Some(fence) = fence else {
            return Ok(false);
        };
        slot.local = None;
        if slot.fences.is_empty() && self.memory.poll(&fence)? {
            events.push_back(event);
        } else {
            slot.fences.push_back((fence, Some(event)));
        }
        Ok(true)
    }

    /// Moves the slice in buffer `b` on where it waits: its queued writes, its
    /// local step, its running steps. Returns whether anything moved.
    pub(super) fn advance(&self, d: &mut Driver<M>, b: u32) -> Result<bool, Fault> {
        if d.slices.slots[b as usize].active.is_none() {
            return Ok(false);
        }
        let mut moved = self.flush(d, b)?;
        let mut events = std::mem::take(&mut d.scratch.events);
        let result = self.collect(d, b, &mut events);
        let ready = !events.is_empty();
        d.scratch.events = events;
        moved |= result?;
        if ready {
            let mut steps = std::mem::take(&mut d.scratch.steps);
            steps.clear();
            let result = self.settle(d, b, &mut steps);
            d.scratch.steps = steps;
            result?;
            moved = true;
        }
        Ok(moved)
    }

    /// Posts buffer `b`'s queued writes that the peers have credited and whose
    /// operation's descriptor they have.
    fn flush(&self, d: &mut Driver<M>, b: u32) -> Result<bool, Fault> {
        let (credits, checks, links, machine) = (&d.credits, &d.checks, &self.links, &self.machine);
        let may_go = |w: &PendingWrite| {
            w.credit_for
                .is_none_or(|s| credits.allows(w.peer, s, machine))
                && checks.may_send_data(w.peer, w.seq, links)
                && (w.window.is_none() || checks.peer_window(w.peer, w.seq).is_some())
        };
        let window_of = |w: &PendingWrite| checks.peer_window(w.peer, w.seq).flatten();
        // Every write queued on buffer `b` is its slice's.
        let direct = d.slices.slots[b as usize]
            .active
            .as_ref()
            .filter(|a| a.direct)
            .map(|a| a.seq);
        let Some(seq) = direct else {
            return Ok(d.outbox.flush(b, links, None, may_go, window_of)?);
        };
        let regions = self.lock_source_regions();
        Ok(d.outbox
            .flush(b, links, regions.get(seq), may_go, window_of)?)
    }

    /// The events of buffer `b`'s waits that have ended, into `events`.
    fn collect(
        &self,
        d: &mut Driver<M>,
        b: u32,
        events: &mut VecDeque<SliceEvent>,
    ) -> Result<bool, Fault> {
        let mut moved = self.try_local(d, b, events)?;
        let fences = &mut d.slices.slots[b as usize].fences;
        while let Some((fence, _)) = fences.front() {
            if !self.memory.poll(fence)? {
                break;
            }
            if let Some((_, event)) = fences.pop_front() {
                events.extend(event);
                moved = true;
            }
        }
        Ok(moved)
    }
}

/// The slice in buffer `b` as the local step sees it.
fn local_slice<M: MemorySpace>(b: u32, active: &ActiveSlice<M>) -> LocalSlice<'_, M> {
    LocalSlice {
        buffer: b,
        number: active.number,
        slice: &active.slice,
        tensor: &active.tensor,
        dtype: active.dtype,
        op: active.op,
        pieces: active.algorithm.local_pieces(),
        root: active.local_root,
        stages: active.device.map(|held| held.stages).unwrap_or_default(),
    }
}
