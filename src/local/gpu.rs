//! How the communicator's local step reaches a GPU ([`GpuReach`]): device
//! programs on the device side's streams, opened through its words, and the
//! machine's NCCL communicators where its ranks made them.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use super::nccl::NcclCell;
use super::placed_step::{DeviceReach, Place};
use crate::error::{Error, Result};
use crate::memory::program::{ProgramItem, Stage, Stages, Unfinished};
use crate::memory::{
    DeviceCell, DeviceFence, DeviceSide, DeviceTensor, Placed, PlacedFence, PlacedTensor,
};

/// The device side of a communicator's memory space, and its machine's NCCL
/// communicators.
pub(crate) struct GpuReach {
    device: DeviceCell,
    nccl: NcclCell,
    /// The thread aborting the NCCL communicators after a failure, joined
    /// when the reach is dropped: a process that ends while NCCL is
    /// aborting (its proxy threads still running) can crash in its exit.
    aborting: Mutex<Option<JoinHandle<()>>>,
}

impl GpuReach {
    /// Through the device side of `memory`, and the communicators in `nccl`
    /// once made.
    pub(crate) fn new(memory: &Placed, nccl: NcclCell) -> GpuReach {
        GpuReach {
            device: memory.device_cell(),
            nccl,
            aborting: Mutex::new(None),
        }
    }

    fn side(&self) -> Result<&DeviceSide> {
        self.device.get().ok_or_else(|| {
            Error::internal(
                "a device tensor's operation made the device side at submission",
                "no device side",
            )
        })
    }
}

impl DeviceReach for GpuReach {
    type Memory = Placed;
    type Tensor = DeviceTensor;
    type Fence = DeviceFence;

    fn place(tensor: &PlacedTensor) -> Place<'_, DeviceTensor> {
        match tensor {
            PlacedTensor::Host(t) => Place::Host(t),
            PlacedTensor::Device(t) => Place::Device(t),
        }
    }

    fn fence(fence: Option<DeviceFence>) -> PlacedFence {
        fence.map_or(PlacedFence::Passed, PlacedFence::Device)
    }

    fn poll(&self, fence: &DeviceFence) -> Result<bool> {
        self.side()?.poll(fence)
    }

    fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<DeviceFence> {
        self.side()?.raise(buffer, generation, stage, stages)
    }

    fn has_collectives(&self) -> bool {
        matches!(self.nccl.get(), Some(Ok(Some(_))))
    }

    fn enqueue(
        &self,
        tensor: &DeviceTensor,
        seq: u64,
        items: &[ProgramItem<PlacedTensor>],
    ) -> std::result::Result<(), Unfinished> {
        let side = self
            .side()
            .map_err(|error| Unfinished { error, ends: false })?;
        let comms = match self.nccl.get() {
            Some(Ok(Some(comms))) => Some(comms),
            _ => None,
        };
        side.enqueue(tensor, seq, items, &|stream, tensor, calls| {
            let comms = comms.ok_or_else(|| {
                Error::internal(
                    "a device program holds collectives only where the machine has them",
                    format!("operation {seq}"),
                )
            })?;
            comms.enqueue_group(side, stream, tensor, calls)
        })
    }

    fn release_collectives(&self) {
        let Some(Ok(Some(_))) = self.nccl.get() else {
            return;
        };
        let mut aborting = self.aborting.lock().unwrap_or_else(PoisonError::into_inner);
        if aborting.is_some() {
            return; // asked already
        }
        // NCCL's abort waits until every kernel of the communicators has
        // run, on whatever stream: the gates are open, so they will, but not
        // on the caller's thread (the engine's progress thread), which must
        // make no call that waits for the device.
        let nccl = Arc::clone(&self.nccl);
        let spawned = std::thread::Builder::new()
            .name("fairring-nccl-abort".into())
            .spawn(move || {
                if let Some(Ok(Some(comms))) = nccl.get() {
                    comms.abort();
                }
            });
        match spawned {
            Ok(thread) => *aborting = Some(thread),
            Err(e) => log::error!(
                "fairring: starting the thread that aborts NCCL after a failure: {e}; NCCL's \
                 kernels waiting for a rank that is gone are left running"
            ),
        }
    }
}

impl Drop for GpuReach {
    /// Waits for the abort that a failure started: every gate is open by
    /// then, so NCCL's kernels run to their end and the abort returns.
    fn drop(&mut self) {
        let aborting = self
            .aborting
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(thread) = aborting.take()
            && thread.join().is_err()
        {
            log::error!("fairring: the thread aborting NCCL after a failure panicked");
        }
    }
}
