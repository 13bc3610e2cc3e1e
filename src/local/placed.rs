//! The local step of a communicator whose operations take host or device
//! tensors: host tensors run [`ShmStep`] as they always do; device tensors
//! (the `cuda` feature) run the same counter protocol with copies between the
//! tensor and the staging buffers on the GPU's streams: alone on its machine
//! (`D = 1`), a rank's reduce-scatter copies the tensor's slot into the
//! staging buffer and its all-gather the landed result back (`alone`); with
//! several ranks per machine, the machine's reduction runs as NCCL's
//! collectives on the tensors (`nccl`) where the machine's ranks made their
//! communicators and the operator allows, and otherwise on the host in the
//! shared segment, staged in and out by copies (`staged`).

#[cfg(feature = "cuda")]
use super::Waiting;
#[cfg(feature = "cuda")]
use super::collectives::CollectiveStep;
#[cfg(feature = "cuda")]
use super::nccl::{NcclCell, NcclComms, OnGpu};
use super::shm::ShmStep;
use super::{LocalSlice, LocalStep};
#[cfg(feature = "cuda")]
use crate::error::Error;
use crate::error::Result;
#[cfg(feature = "cuda")]
use crate::memory::{DeviceCell, DeviceFence};
use crate::memory::{Host, Placed, PlacedFence, PlacedTensor};

/// [`ShmStep`] for host tensors, and its device form for device tensors.
pub(crate) struct PlacedStep {
    shm: ShmStep,
    #[cfg(feature = "cuda")]
    device: DeviceCell,
    /// Announcements of the staged step waiting for their copies.
    #[cfg(feature = "cuda")]
    waiting: Waiting<DeviceFence>,
    /// The machine's NCCL communicators, made at the first device operation.
    #[cfg(feature = "cuda")]
    nccl: NcclCell,
    /// The order this rank issues NCCL's collectives in.
    #[cfg(feature = "cuda")]
    collective: CollectiveStep,
}

impl PlacedStep {
    /// Over `shm`; device tensors use the device side in `memory`, and
    /// NCCL's communicators in `nccl` once made.
    pub(crate) fn new(
        shm: ShmStep,
        memory: &Placed,
        #[cfg(feature = "cuda")] nccl: NcclCell,
    ) -> PlacedStep {
        #[cfg(not(feature = "cuda"))]
        let _ = memory;
        PlacedStep {
            #[cfg(feature = "cuda")]
            nccl,
            #[cfg(feature = "cuda")]
            collective: CollectiveStep::new(),
            #[cfg(feature = "cuda")]
            waiting: Waiting::new(memory.buffers()),
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
            PlacedTensor::Device(_) if self.nccl(s).is_some() => {
                self.collective.begin(&self.shm, s)
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) if self.staged() => {
                self.shm
                    .begin_staged(s, &self.waiting, |in_tensor, staging| {
                        // SAFETY: the staging bytes are this rank's own, page-locked,
                        // and untouched until the copy's fence passes (the step
                        // announces them staged only then).
                        unsafe {
                            self.side()?
                                .copy_to_staging(s.buffer, staging, t, in_tensor)
                        }
                    })
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(_) => self.shm.begin_alone(s.buffer, s.number, "stage-in"),
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
            PlacedTensor::Device(t) if self.nccl(s).is_some() => Ok(self
                .collective
                .try_reduce_scatter(&self.shm, &self.on_gpu(s)?, s, t, final_world)?
                .map(PlacedFence::Device)),
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) if self.staged() => {
                let ran = self.shm.try_reduce_scatter_staged(
                    s,
                    final_world,
                    &self.waiting,
                    |f| self.side()?.poll(f),
                    |staging, in_tensor| {
                        // SAFETY: page-locked staging bytes of this rank's own
                        // slot, which nothing writes until the fence passes
                        // (the engine waits for it before the next step).
                        unsafe {
                            self.side()?
                                .copy_from_staging(s.buffer, staging, t, in_tensor)
                        }
                    },
                )?;
                Ok(ran.map(|f| f.map_or(PlacedFence::Passed, PlacedFence::Device)))
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) => {
                let ran = self.shm.try_reduce_scatter_alone(
                    s.buffer,
                    s.number,
                    s.slice,
                    final_world,
                    |staging, in_tensor| {
                        // SAFETY: the staging buffer is page-locked and this
                        // rank's own; nothing touches the slot until the fence
                        // passes (the engine waits for it before the next step).
                        unsafe {
                            self.side()?
                                .copy_to_staging(s.buffer, staging, t, in_tensor)
                        }
                    },
                )?;
                Ok(ran.map(|f| f.map_or(PlacedFence::Passed, PlacedFence::Device)))
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
            PlacedTensor::Device(t) if self.nccl(s).is_some() => {
                let ran = self.collective.try_all_gather(
                    &self.shm,
                    &self.on_gpu(s)?,
                    &self.waiting,
                    s,
                    t,
                    own_in_tensor,
                )?;
                Ok(ran.map(|f| f.map_or(PlacedFence::Passed, PlacedFence::Device)))
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) if self.staged() => {
                let ran = self.shm.try_all_gather_staged(
                    s,
                    own_in_tensor,
                    &self.waiting,
                    |staging, in_tensor| {
                        // SAFETY: a final slot of a local rank's page-locked
                        // buffer, not reused by its owner before this rank's
                        // `Done`, which follows the copy's fence.
                        unsafe {
                            self.side()?
                                .copy_from_staging(s.buffer, staging, t, in_tensor)
                        }
                    },
                )?;
                Ok(ran.map(|f| f.map_or(PlacedFence::Passed, PlacedFence::Device)))
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) => {
                let ran = self.shm.try_all_gather_alone(
                    s.buffer,
                    s.number,
                    s.slice,
                    own_in_tensor,
                    |staging, in_tensor| {
                        // SAFETY: as in the reduce-scatter; the engine releases
                        // the buffer only once this copy's fence has passed.
                        unsafe {
                            self.side()?
                                .copy_from_staging(s.buffer, staging, t, in_tensor)
                        }
                    },
                )?;
                Ok(ran.map(|f| f.map_or(PlacedFence::Passed, PlacedFence::Device)))
            }
        }
    }

    fn finish(&self, buffer: u32, number: u64) {
        LocalStep::<Host>::finish(&self.shm, buffer, number);
    }

    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        LocalStep::<Host>::laggards(&self.shm, buffer, number)
    }

    #[cfg(feature = "cuda")]
    fn gathered(&self, buffer: u32, _number: u64) -> Result<()> {
        self.shm.gathered(&self.waiting, buffer)
    }

    #[cfg(feature = "cuda")]
    fn awaits_fences(&self) -> bool {
        self.waiting.any() || self.collective.waiting()
    }

    #[cfg(feature = "cuda")]
    fn take_fences(&self) -> Vec<PlacedFence> {
        if let Some(nccl) = self.made_nccl() {
            nccl.abort();
        }
        self.waiting
            .take_fences()
            .into_iter()
            .map(PlacedFence::Device)
            .collect()
    }
}

#[cfg(feature = "cuda")]
impl PlacedStep {
    /// Whether device tensors take the staged step (several ranks on this
    /// machine) or the lone one.
    fn staged(&self) -> bool {
        self.shm.size > 1
    }

    /// The machine's NCCL communicators, if its ranks made them.
    fn made_nccl(&self) -> Option<&NcclComms> {
        match self.nccl.get() {
            Some(Ok(Some(comms))) => Some(comms),
            _ => None,
        }
    }

    /// The NCCL communicators, if slice `s` of a device tensor goes through
    /// them.
    fn nccl(&self, s: &LocalSlice<'_, Placed>) -> Option<&NcclComms> {
        self.made_nccl()
            .filter(|_| CollectiveStep::takes(s.dtype, s.op))
    }

    /// NCCL's collectives on the device side, for slice `s`.
    fn on_gpu(&self, s: &LocalSlice<'_, Placed>) -> Result<OnGpu<'_>> {
        let comms = self.nccl(s).ok_or_else(|| {
            Error::internal(
                "a slice goes through NCCL only where its communicators exist",
                format!("slice {}", s.number),
            )
        })?;
        Ok(OnGpu {
            comms,
            side: self.side()?,
        })
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
