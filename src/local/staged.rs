//! The local step of several ranks on one machine whose tensors the host does
//! not read (device tensors), staged through the machine's shared segment: the
//! host local step of [`ShmStep`], with every read and write of a tensor made
//! by a copy of the slice's device program ([`items`], enqueued when the call
//! was accepted, opened by the step), and each announcement of the counter
//! [`protocol`](super::protocol) made once the copies before it have ended.
//!
//! Per slice, rank `d`:
//!
//! 1. **begin**: copies the slice's runs of every local rank (its own too: the
//!    reduction reads it from staging, not from the tensor) from the tensor
//!    into its staging buffer; once the copies have ended (polled, by the
//!    reduce-scatter), announces `InputReady`;
//! 2. **reduce-scatter**: once every rank's input is ready, reduces slot `d` of
//!    every other rank's buffer into slot `d` of its own, on the host, in
//!    place; in a single-machine job the result is final and is copied into
//!    the tensor (the step's fence);
//! 3. the inter-machine step, then `SlotFinal`, as on host memory;
//! 4. **all-gather**: once every slot is final, copies the final slots from
//!    their ranks' buffers into the tensor; announces `Done` once those copies
//!    have ended (the engine tells it: [`LocalStep::gathered`]).
//!
//! Each step's copies are one stage of the slice's program, on its buffer's
//! stream: the stage's end ends the step. Per slice of `S` bytes that is `S` copied
//! down and `S` (or `S (D-1)/D` when the own slot is final in place) up, over
//! the PCIe link, and one reduction of `S/D` bytes on the host. It is the path
//! for machines where the GPUs' own collectives (NCCL) are not at hand.
//!
//! [`LocalStep::gathered`]: crate::local::LocalStep::gathered

use std::sync::{Mutex, PoisonError};

use crate::sync::unmodelled::{AtomicUsize, Ordering};

use fairring_core::ReduceOp;
use fairring_core::reduce::finish_avg_bytes;

use super::shm_step::{ShmStep, for_each_run, slice_range, slot_range};
use super::{LocalSlice, LocalStage};
use crate::error::{Error, Result};
use crate::memory::program::{ProgramItem, StagingAt};
use crate::memory::{MemorySpace, reduce_into};

/// Calls `each` with the device items of `stage` of slice `s` (see the
/// module docs): every rank's runs into this rank's buffer at the begin; a
/// final slot back into the tensor at the reduce-scatter; every final slot
/// from its rank's buffer into the tensor at the all-gather.
pub(crate) fn items<M: MemorySpace>(
    shm: &ShmStep,
    s: &LocalSlice<'_, M>,
    stage: LocalStage,
    each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
) -> Result<()> {
    let base = slice_range(s.slice)?.start;
    let at = |rank, offset| StagingAt {
        rank,
        buffer: s.buffer,
        offset,
    };
    let in_tensor = |within: &std::ops::Range<usize>| base + within.start..base + within.end;
    match stage {
        LocalStage::Begin => {
            for r in 0..shm.size {
                for_each_run(s, r, |in_slice, staged| {
                    if in_slice.is_empty() {
                        return Ok(());
                    }
                    each(ProgramItem::ToStaging {
                        tensor: in_tensor(&in_slice),
                        to: at(shm.rank(), staged.start),
                    })
                })?;
            }
            Ok(())
        }
        LocalStage::ReduceScatter { final_world: None } => Ok(()),
        LocalStage::ReduceScatter {
            final_world: Some(_),
        } => for_each_run(s, shm.rank(), |in_slice, staged| {
            if in_slice.is_empty() {
                return Ok(());
            }
            each(ProgramItem::FromStaging {
                from: at(shm.rank(), staged.start),
                tensor: in_tensor(&in_slice),
            })
        }),
        LocalStage::AllGather { own_in_tensor, .. } => {
            if s.pieces.is_some() {
                return Err(Error::internal(
                    "a reduce-scatter's pieces are never gathered",
                    format!("slice {}", s.number),
                ));
            }
            for r in (0..shm.size).filter(|&r| !(own_in_tensor && r == shm.rank())) {
                let slot = slot_range(s.slice, r)?;
                if !slot.is_empty() {
                    each(ProgramItem::FromStaging {
                        from: at(r, slot.start),
                        tensor: in_tensor(&slot),
                    })?;
                }
            }
            Ok(())
        }
    }
}

/// What a staged step announces once a buffer's copies have ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Announce {
    InputReady,
    Done,
}

/// Per staging buffer: the announcement waiting for its copies, with the
/// fence of the last (none where the engine holds it and says when it has
/// passed: the all-gather's).
pub(crate) struct Waiting<F> {
    buffers: Mutex<Vec<Option<Waiter<F>>>>,
    /// How many buffers hold one: read without the lock, so that steps of
    /// host tensors, which never wait, never take it.
    held: AtomicUsize,
}

type Waiter<F> = (Option<F>, Announce, u64);

impl<F> Waiting<F> {
    /// Nothing waiting, for `buffers` staging buffers.
    pub(crate) fn new(buffers: u32) -> Waiting<F> {
        Waiting {
            buffers: Mutex::new((0..buffers).map(|_| None).collect()),
            held: AtomicUsize::new(0),
        }
    }

    /// Whether an announcement waits for copies (their ends ring no doorbell).
    pub(crate) fn any(&self) -> bool {
        self.held.load(Ordering::Acquire) > 0
    }

    /// Forgets every announcement waiting (the engine failed: it waits
    /// for its operations' device programs, not for these).
    pub(crate) fn clear(&self) {
        if !self.any() {
            return;
        }
        let mut buffers = self.lock();
        for slot in buffers.iter_mut() {
            self.take(slot);
        }
    }

    /// Empties `slot`, counting it.
    fn take(&self, slot: &mut Option<Waiter<F>>) -> Option<Waiter<F>> {
        let taken = slot.take();
        if taken.is_some() {
            self.held.fetch_sub(1, Ordering::AcqRel);
        }
        taken
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Option<Waiter<F>>>> {
        self.buffers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ShmStep {
    /// Makes whatever waits on `buffer` that `poll` says has ended; returns
    /// whether nothing waits any more.
    pub(crate) fn settle_staged<F>(
        &self,
        waiting: &Waiting<F>,
        buffer: u32,
        poll: impl Fn(&F) -> Result<bool>,
    ) -> Result<bool> {
        let mut buffers = waiting.lock();
        let slot = buffers.get_mut(buffer as usize).ok_or_else(|| {
            Error::internal(
                "every staging buffer has its waiting announcement",
                format!("buffer {buffer}"),
            )
        })?;
        let Some((fence, announce, number)) = slot.as_ref() else {
            return Ok(true);
        };
        let passed = match fence {
            Some(fence) => poll(fence)?,
            None => false,
        };
        if !passed {
            return Ok(false);
        }
        let (announce, number) = (*announce, *number);
        waiting.take(slot);
        drop(buffers);
        self.announce(buffer, number, announce);
        Ok(true)
    }

    fn announce(&self, buffer: u32, number: u64, announce: Announce) {
        match announce {
            Announce::InputReady => self.protocol.staged_in(&*self.segment, buffer, number),
            Announce::Done => self.protocol.finish(&*self.segment, buffer, number),
        }
    }

    /// Holds `announce` of slice `number` in `buffer` until `fence` ends, or
    /// makes it now if no copy was needed.
    pub(super) fn announce_after<F>(
        &self,
        waiting: &Waiting<F>,
        buffer: u32,
        number: u64,
        announce: Announce,
        fence: Option<Option<F>>,
    ) -> Result<()> {
        let Some(fence) = fence else {
            self.announce(buffer, number, announce);
            return Ok(());
        };
        let mut buffers = waiting.lock();
        match buffers.get_mut(buffer as usize) {
            Some(slot @ None) => {
                *slot = Some((fence, announce, number));
                waiting.held.fetch_add(1, Ordering::AcqRel);
                Ok(())
            }
            _ => Err(Error::internal(
                "a buffer's announcement is made before its next one waits",
                format!("{announce:?} of slice {number} in buffer {buffer}"),
            )),
        }
    }

    /// Step 1: `raise` opens the slice's begin stage (each run of every
    /// rank's slot from the tensor into this rank's buffer), whose end
    /// `InputReady` follows; with no such stage, `InputReady` now.
    pub(crate) fn begin_staged<M: MemorySpace, F>(
        &self,
        s: &LocalSlice<'_, M>,
        waiting: &Waiting<F>,
        raise: impl FnOnce() -> Result<Option<F>>,
    ) -> Result<()> {
        let fence = raise()?;
        self.announce_after(
            waiting,
            s.buffer,
            s.number,
            Announce::InputReady,
            fence.map(Some),
        )
    }

    /// Step 2: once this rank's copies in have ended (`poll`) and every
    /// rank's input is ready, reduces; a final result goes into the tensor
    /// through the slice's reduce-scatter stage, which `raise` opens and
    /// whose end this returns. `None` while it cannot run.
    pub(crate) fn try_reduce_scatter_staged<M: MemorySpace, F>(
        &self,
        s: &LocalSlice<'_, M>,
        final_world: Option<u32>,
        waiting: &Waiting<F>,
        poll: impl Fn(&F) -> Result<bool>,
        raise: impl FnOnce() -> Result<Option<F>>,
    ) -> Result<Option<Option<F>>> {
        if !self.settle_staged(waiting, s.buffer, poll)? {
            return Ok(None);
        }
        let mut last = None;
        let ran = self
            .protocol
            .try_reduce_scatter(&*self.segment, s.buffer, s.number, || {
                for_each_run(s, self.rank(), |_, range| {
                    let staged = self.own_bytes(s.buffer, range.clone())?;
                    let mut peers = (0..self.size)
                        .filter(|&r| r != self.rank())
                        .map(|r| self.peer_bytes(r, s.buffer, range.clone()));
                    reduce_into(s.dtype, s.op, staged, &mut peers)?;
                    if let Some(world) = final_world
                        && s.op == ReduceOp::Avg
                    {
                        finish_avg_bytes(s.dtype, staged, world).map_err(|e| {
                            Error::internal("averages divide a whole sum", e.to_string())
                        })?;
                    }
                    Ok(())
                })?;
                last = raise()?;
                Ok::<(), Error>(())
            })?;
        Ok(ran.then_some(last))
    }

    /// Step 4: once every slot is final, `raise` opens the slice's
    /// all-gather stage (each final slot from its rank's buffer into the
    /// tensor, this rank's own too unless it is there); `Done` follows its
    /// end ([`gathered`](ShmStep::gathered)). Returns the stage's fence;
    /// `None` while a slot is not final.
    pub(crate) fn try_all_gather_staged<M: MemorySpace, F>(
        &self,
        s: &LocalSlice<'_, M>,
        waiting: &Waiting<F>,
        raise: impl FnOnce() -> Result<Option<F>>,
    ) -> Result<Option<Option<F>>> {
        if s.pieces.is_some() {
            return Err(Error::internal(
                "a reduce-scatter's pieces are never gathered",
                format!("slice {}", s.number),
            ));
        }
        let mut last = None;
        let ran = self.protocol.try_all_gather_started(
            &*self.segment,
            s.buffer,
            s.number,
            || -> Result<()> {
                last = raise()?;
                Ok(())
            },
        )?;
        if !ran {
            return Ok(None);
        }
        // The engine holds the fence and says when it has passed.
        let held = last.as_ref().map(|_| None);
        self.announce_after(waiting, s.buffer, s.number, Announce::Done, held)?;
        Ok(Some(last))
    }

    /// The all-gather's copies of `buffer` have ended (the engine saw its
    /// fence pass): `Done` is announced.
    pub(crate) fn gathered<F>(&self, waiting: &Waiting<F>, buffer: u32) -> Result<()> {
        if !waiting.any() {
            return Ok(());
        }
        let mut buffers = waiting.lock();
        let Some(slot) = buffers.get_mut(buffer as usize) else {
            return Ok(());
        };
        if let Some((None, Announce::Done, number)) = slot.as_ref() {
            let number = *number;
            waiting.take(slot);
            drop(buffers);
            self.announce(buffer, number, Announce::Done);
        }
        Ok(())
    }
}
