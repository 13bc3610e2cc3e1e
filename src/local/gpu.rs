//! How the communicator's local step reaches a GPU ([`GpuReach`]): copies on
//! the device side's streams (made at the first device operation), and the
//! machine's NCCL communicators where its ranks made them.

use std::ops::Range;

use super::nccl::{NcclCell, OnGpu};
use super::placed_step::{DeviceReach, Place};
use crate::error::{Error, Result};
use crate::memory::{
    DeviceCell, DeviceFence, DeviceSide, DeviceTensor, Placed, PlacedFence, PlacedTensor,
};

/// The device side of a communicator's memory space, and its machine's NCCL
/// communicators.
pub(crate) struct GpuReach {
    device: DeviceCell,
    nccl: NcclCell,
}

impl GpuReach {
    /// Through the device side of `memory`, and the communicators in `nccl`
    /// once made.
    pub(crate) fn new(memory: &Placed, nccl: NcclCell) -> GpuReach {
        GpuReach {
            device: memory.device_cell(),
            nccl,
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
    type Collectives<'a> = OnGpu<'a>;

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

    unsafe fn copy_to_staging(
        &self,
        buffer: u32,
        staging: &mut [u8],
        tensor: &DeviceTensor,
        from: Range<usize>,
    ) -> Result<DeviceFence> {
        // SAFETY: forwarded.
        unsafe { self.side()?.copy_to_staging(buffer, staging, tensor, from) }
    }

    unsafe fn copy_from_staging(
        &self,
        buffer: u32,
        staging: &[u8],
        tensor: &DeviceTensor,
        to: Range<usize>,
    ) -> Result<DeviceFence> {
        // SAFETY: forwarded.
        unsafe { self.side()?.copy_from_staging(buffer, staging, tensor, to) }
    }

    fn collectives(&self) -> Result<Option<OnGpu<'_>>> {
        match self.nccl.get() {
            Some(Ok(Some(comms))) => Ok(Some(OnGpu {
                comms,
                side: self.side()?,
            })),
            _ => Ok(None),
        }
    }

    fn abort_collectives(&self) {
        if let Some(Ok(Some(comms))) = self.nccl.get() {
            comms.abort();
        }
    }
}
