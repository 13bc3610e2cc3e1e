//! The local step of a rank alone on its machine (`D = 1`) whose tensor the host
//! does not read: a device tensor, reached through copies of its device
//! program.
//!
//! It runs the counter [`protocol`](super::protocol) of [`ShmStep`] with
//! nothing to stage for other ranks: its reduce-scatter copies the slice's slot
//! from the tensor into the staging buffer (from which the fabric sends it),
//! and its all-gather copies the landed result back. Each copy is a stage of
//! the slice's program ([`items`]), enqueued when the call was accepted; the
//! step opens it through the caller's `raise`, which returns the fence of its
//! end, and the engine waits for that fence before the slice's next step. The
//! communicator's device tensors ([`PlacedStep`](super::PlacedStep)) and the
//! simulation's simulated device both run through here.

use super::shm_step::{slice_range, slot_range};
use super::{LocalSlice, LocalStage, ShmStep};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::memory::program::{ProgramItem, StagingAt};

/// Calls `each` with the device items of `stage` of slice `s` of a rank
/// alone on its machine: its slot into staging for a reduce-scatter that is
/// not final (a one-rank job's tensor holds the result already), and back
/// for an all-gather whose slot is not in the tensor yet.
pub(crate) fn items<M: MemorySpace>(
    shm: &ShmStep,
    s: &LocalSlice<'_, M>,
    stage: LocalStage,
    each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
) -> Result<()> {
    let moves = match stage {
        LocalStage::Begin => false,
        LocalStage::ReduceScatter { final_world } => final_world.is_none(),
        LocalStage::AllGather { own_in_tensor, .. } => !own_in_tensor,
    };
    let slot = slot_range(s.slice, shm.rank())?;
    if !moves || slot.is_empty() {
        return Ok(());
    }
    let base = slice_range(s.slice)?.start;
    let tensor = base + slot.start..base + slot.end;
    let staging = StagingAt {
        rank: shm.rank(),
        buffer: s.buffer,
        offset: slot.start,
    };
    each(match stage {
        LocalStage::ReduceScatter { .. } => ProgramItem::ToStaging {
            tensor,
            to: staging,
        },
        _ => ProgramItem::FromStaging {
            from: staging,
            tensor,
        },
    })
}

impl ShmStep {
    /// The slice's begin: nothing to stage for other ranks.
    pub(crate) fn begin_alone(&self, buffer: u32, number: u64, step: &str) -> Result<()> {
        self.alone(step)?;
        self.protocol
            .stage_in(&*self.segment, buffer, number, || Ok(()))
    }

    /// The reduce-scatter: once the protocol lets it run, `raise` opens the
    /// slice's reduce-scatter stage (its slot into staging) and returns the
    /// fence of its end. Returns `None` if it cannot run yet, and
    /// `Some(None)` when the slice has no such stage (a one-rank job, whose
    /// tensor already holds the result).
    pub(crate) fn try_reduce_scatter_alone<F>(
        &self,
        buffer: u32,
        number: u64,
        raise: impl FnOnce() -> Result<Option<F>>,
    ) -> Result<Option<Option<F>>> {
        self.alone("reduce-scatter")?;
        let mut fence = None;
        let ran = self.protocol.try_reduce_scatter(
            &*self.segment,
            buffer,
            number,
            || -> Result<()> {
                fence = raise()?;
                Ok(())
            },
        )?;
        Ok(ran.then_some(fence))
    }

    /// The all-gather: once the protocol lets it run, `raise` opens the
    /// slice's all-gather stage (the result into the tensor, unless it is
    /// there already). Returns as
    /// [`try_reduce_scatter_alone`](Self::try_reduce_scatter_alone).
    pub(crate) fn try_all_gather_alone<F>(
        &self,
        buffer: u32,
        number: u64,
        raise: impl FnOnce() -> Result<Option<F>>,
    ) -> Result<Option<Option<F>>> {
        self.alone("all-gather")?;
        let mut fence = None;
        let ran =
            self.protocol
                .try_all_gather(&*self.segment, buffer, number, || -> Result<()> {
                    fence = raise()?;
                    Ok(())
                })?;
        Ok(ran.then_some(fence))
    }

    fn alone(&self, step: &str) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        Err(Error::internal(
            "a tensor reached through copies runs with one rank per machine (the \
             communicator refuses others)",
            format!("a {step} through copies among {} local ranks", self.size),
        ))
    }
}
