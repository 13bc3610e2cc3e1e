//! The local step of a communicator whose operations take host or device
//! tensors: host tensors run [`ShmStep`] as they always do; device tensors
//! (the `cuda` feature) run the same counter protocol with copies between the
//! tensor and the staging buffers on the GPU's streams.
//!
//! A device tensor's local step is built for one rank per machine (`D = 1`):
//! its reduce-scatter copies the tensor's slice into the staging buffer, from
//! which the fabric sends it, and its all-gather copies the landed result back.
//! With several ranks per machine the intra-machine step needs the GPUs'
//! collectives (NCCL); the communicator refuses such operations before they
//! start (see `Communicator::submit`).

use super::shm::ShmStep;
use super::{LocalSlice, LocalStep};
#[cfg(feature = "cuda")]
use crate::error::Error;
use crate::error::Result;
#[cfg(feature = "cuda")]
use crate::memory::DeviceCell;
use crate::memory::{Host, Placed, PlacedFence, PlacedTensor};

/// [`ShmStep`] for host tensors, and its device form for device tensors.
pub(crate) struct PlacedStep {
    shm: ShmStep,
    #[cfg(feature = "cuda")]
    device: DeviceCell,
}

impl PlacedStep {
    /// Over `shm`; device tensors use the device side in `memory`.
    pub(crate) fn new(shm: ShmStep, memory: &Placed) -> PlacedStep {
        #[cfg(not(feature = "cuda"))]
        let _ = memory;
        PlacedStep {
            shm,
            #[cfg(feature = "cuda")]
            device: memory.device_cell(),
        }
    }
}

/// `s` with its host tensor.
fn host<'a>(
    s: &LocalSlice<'a, Placed>,
    tensor: &'a crate::memory::HostTensor,
) -> LocalSlice<'a, Host> {
    LocalSlice {
        buffer: s.buffer,
        number: s.number,
        slice: s.slice,
        tensor,
        dtype: s.dtype,
        op: s.op,
        pieces: s.pieces,
    }
}

impl LocalStep<Placed> for PlacedStep {
    fn buffer_free(&self, buffer: u32, number: u64) -> bool {
        LocalStep::<Host>::buffer_free(&self.shm, buffer, number)
    }

    fn begin(&self, s: &LocalSlice<'_, Placed>) -> Result<()> {
        match s.tensor {
            PlacedTensor::Host(t) => self.shm.begin(&host(s, t)),
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(_) => {
                self.single("stage-in")?;
                // One rank: nothing to stage for others.
                self.shm
                    .protocol
                    .stage_in(&*self.shm.segment, s.buffer, s.number, || Ok(()))
            }
        }
    }

    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, Placed>,
        final_world: Option<u32>,
    ) -> Result<Option<PlacedFence>> {
        match s.tensor {
            PlacedTensor::Host(t) => Ok(self
                .shm
                .try_reduce_scatter(&host(s, t), final_world)?
                .map(|()| PlacedFence::Passed)),
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) => {
                self.single("reduce-scatter")?;
                let mut fence = PlacedFence::Passed;
                let ran = self.shm.protocol.try_reduce_scatter(
                    &*self.shm.segment,
                    s.buffer,
                    s.number,
                    || -> Result<()> {
                        // A single-machine job of one rank: the tensor already
                        // holds the result (an average over one rank is itself).
                        if final_world.is_some() {
                            return Ok(());
                        }
                        let (staging, in_tensor) = self.own_slot(s)?;
                        // SAFETY: the staging buffer is page-locked and this
                        // rank's own; nothing touches the slot until the fence
                        // passes (the engine waits for it before the next step).
                        let f = unsafe {
                            self.side()?
                                .copy_to_staging(s.buffer, staging, t, in_tensor)?
                        };
                        fence = PlacedFence::Device(f);
                        Ok(())
                    },
                )?;
                Ok(ran.then_some(fence))
            }
        }
    }

    fn publish_slot(&self, s: &LocalSlice<'_, Placed>) {
        self.shm
            .protocol
            .publish_slot(&*self.shm.segment, s.buffer, s.number);
    }

    fn try_all_gather(
        &self,
        s: &LocalSlice<'_, Placed>,
        own_in_tensor: bool,
    ) -> Result<Option<PlacedFence>> {
        match s.tensor {
            PlacedTensor::Host(t) => Ok(self
                .shm
                .try_all_gather(&host(s, t), own_in_tensor)?
                .map(|()| PlacedFence::Passed)),
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) => {
                self.single("all-gather")?;
                let mut fence = PlacedFence::Passed;
                let ran = self.shm.protocol.try_all_gather(
                    &*self.shm.segment,
                    s.buffer,
                    s.number,
                    || -> Result<()> {
                        if own_in_tensor {
                            return Ok(());
                        }
                        let (staging, in_tensor) = self.own_slot(s)?;
                        // SAFETY: as in the reduce-scatter; the engine releases
                        // the buffer only once this copy's fence has passed.
                        let f = unsafe {
                            self.side()?
                                .copy_from_staging(s.buffer, staging, t, in_tensor)?
                        };
                        fence = PlacedFence::Device(f);
                        Ok(())
                    },
                )?;
                Ok(ran.then_some(fence))
            }
        }
    }

    fn finish(&self, buffer: u32, number: u64) {
        LocalStep::<Host>::finish(&self.shm, buffer, number);
    }

    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        LocalStep::<Host>::laggards(&self.shm, buffer, number)
    }
}

#[cfg(feature = "cuda")]
impl PlacedStep {
    fn single(&self, step: &str) -> Result<()> {
        if self.shm.size == 1 {
            return Ok(());
        }
        Err(Error::internal(
            "device tensors run with one rank per machine (the communicator refuses others)",
            format!("a device {step} among {} local ranks", self.shm.size),
        ))
    }

    /// This rank's slot of the slice: its bytes in the staging buffer, and its
    /// byte range in the tensor.
    fn own_slot(&self, s: &LocalSlice<'_, Placed>) -> Result<(&mut [u8], std::ops::Range<usize>)> {
        let slot = super::shm::slot_range(s.slice, self.shm.rank())?;
        let base = super::shm::slice_range(s.slice)?.start;
        let staging = self.shm.own_bytes(s.buffer, slot.clone())?;
        Ok((staging, base + slot.start..base + slot.end))
    }

    fn side(&self) -> Result<&crate::memory::DeviceSide> {
        self.device.get().ok_or_else(|| {
            Error::internal(
                "a device tensor's operation made the device side at submission",
                "no device side",
            )
        })
    }
}
