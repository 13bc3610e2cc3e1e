//! The local step of a rank alone on its machine (`D = 1`) whose tensor the host
//! does not read: a device tensor, reached through copies the memory space
//! enqueues on its streams.
//!
//! It runs the counter [`protocol`](super::protocol) of [`ShmStep`] with
//! nothing to stage for other ranks: its reduce-scatter copies the slice's slot
//! from the tensor into the staging buffer (from which the fabric sends it),
//! and its all-gather copies the landed result back. Each copy is handed to the
//! caller's `copy`, which enqueues it and returns the fence that ends it; the
//! engine waits for that fence before the slice's next step. The communicator's
//! device tensors ([`PlacedStep`](super::PlacedStep)) and the simulation's
//! simulated device both run through here.

use std::ops::Range;

use fairring_core::plan::Slice;

use super::ShmStep;
use super::shm_step::{slice_range, slot_range};
use crate::error::{Error, Result};

impl ShmStep {
    /// The slice's begin: nothing to stage for other ranks.
    pub(crate) fn begin_alone(&self, buffer: u32, number: u64, step: &str) -> Result<()> {
        self.alone(step)?;
        self.protocol
            .stage_in(&*self.segment, buffer, number, || Ok(()))
    }

    /// The reduce-scatter: once the protocol lets it run, `copy(staging,
    /// in_tensor)` copies the rank's slot of `slice` from bytes `in_tensor` of
    /// the tensor into `staging`, its place in staging buffer `buffer`.
    /// Returns `None` if it cannot run yet, and `Some(None)` when there was
    /// nothing to copy (a one-rank job, whose tensor already holds the result).
    pub(crate) fn try_reduce_scatter_alone<F>(
        &self,
        buffer: u32,
        number: u64,
        slice: &Slice,
        final_world: Option<u32>,
        copy: impl FnOnce(&mut [u8], Range<usize>) -> Result<F>,
    ) -> Result<Option<Option<F>>> {
        self.alone("reduce-scatter")?;
        let mut fence = None;
        let ran = self.protocol.try_reduce_scatter(
            &*self.segment,
            buffer,
            number,
            || -> Result<()> {
                // A single-machine job of one rank: the tensor already holds the
                // result (an average over one rank is itself).
                if final_world.is_some() {
                    return Ok(());
                }
                let (staging, in_tensor) = self.own_slot(buffer, slice)?;
                fence = Some(copy(staging, in_tensor)?);
                Ok(())
            },
        )?;
        Ok(ran.then_some(fence))
    }

    /// The all-gather: once the protocol lets it run, `copy(staging,
    /// in_tensor)` copies the result from `staging` into bytes `in_tensor` of
    /// the tensor, unless it is there already (`own_in_tensor`). Returns as
    /// [`try_reduce_scatter_alone`](Self::try_reduce_scatter_alone).
    pub(crate) fn try_all_gather_alone<F>(
        &self,
        buffer: u32,
        number: u64,
        slice: &Slice,
        own_in_tensor: bool,
        copy: impl FnOnce(&mut [u8], Range<usize>) -> Result<F>,
    ) -> Result<Option<Option<F>>> {
        self.alone("all-gather")?;
        let mut fence = None;
        let ran =
            self.protocol
                .try_all_gather(&*self.segment, buffer, number, || -> Result<()> {
                    if own_in_tensor {
                        return Ok(());
                    }
                    let (staging, in_tensor) = self.own_slot(buffer, slice)?;
                    fence = Some(copy(staging, in_tensor)?);
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

    /// This rank's slot of `slice`: its bytes in staging buffer `buffer`, and
    /// its byte range in the tensor.
    fn own_slot(&self, buffer: u32, slice: &Slice) -> Result<(&mut [u8], Range<usize>)> {
        let slot = slot_range(slice, self.rank())?;
        let base = slice_range(slice)?.start;
        let staging = self.own_bytes(buffer, slot.clone())?;
        Ok((staging, base + slot.start..base + slot.end))
    }
}
