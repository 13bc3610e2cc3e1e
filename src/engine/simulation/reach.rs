//! The simulation's local step: the communicator's [`PlacedStep`] over the
//! simulated GPU ([`super::device`]) and the machine's collectives
//! ([`super::collectives`]).

use std::ops::Range;

use super::collectives::SimCollectives;
use super::simulated_gpu::{DeviceTensor, SimFence, SimGpu, SimMemory, SimTensor};
use crate::error::Result;
use crate::local::{DeviceReach, Place, PlacedStep, ShmStep};

/// How the simulation's local step reaches its device tensors: the
/// simulated GPU's copies, and the machine's collectives where its ranks
/// reduce through them. The step itself is the communicator's
/// ([`PlacedStep`]), so the simulation runs the path choice it ships.
pub(super) struct SimReach {
    gpu: SimGpu,
    collectives: Option<SimCollectives>,
}

/// The simulation's local step.
pub(super) type SimStep = PlacedStep<SimReach>;

/// The local step of a rank over `shm`, reaching its device tensors through
/// `memory`'s GPU and, where given, `collectives`.
pub(super) fn step(
    memory: &SimMemory,
    shm: ShmStep,
    collectives: Option<SimCollectives>,
) -> SimStep {
    PlacedStep::new(
        shm,
        SimReach {
            gpu: memory.sim_gpu(),
            collectives,
        },
    )
}

impl DeviceReach for SimReach {
    type Memory = SimMemory;
    type Tensor = DeviceTensor;
    type Fence = SimFence;
    type Collectives<'a> = SimCollectives;

    fn place(tensor: &SimTensor) -> Place<'_, DeviceTensor> {
        match tensor {
            SimTensor::Host(t) => Place::Host(t),
            SimTensor::Device(t) => Place::Device(t),
        }
    }

    fn fence(fence: Option<SimFence>) -> SimFence {
        fence.unwrap_or(SimFence::Passed)
    }

    fn poll(&self, fence: &SimFence) -> Result<bool> {
        Ok(match *fence {
            SimFence::Passed => true,
            SimFence::Device { stream, at } => self.gpu.passed(stream, at),
        })
    }

    unsafe fn copy_to_staging(
        &self,
        buffer: u32,
        staging: &mut [u8],
        tensor: &DeviceTensor,
        from: Range<usize>,
    ) -> Result<SimFence> {
        self.gpu.copy_to_staging(buffer, staging, tensor, from)
    }

    unsafe fn copy_from_staging(
        &self,
        buffer: u32,
        staging: &[u8],
        tensor: &DeviceTensor,
        to: Range<usize>,
    ) -> Result<SimFence> {
        self.gpu.copy_from_staging(buffer, staging, tensor, to)
    }

    fn collectives(&self) -> Result<Option<SimCollectives>> {
        Ok(self.collectives.clone())
    }

    fn abort_collectives(&self) {
        if let Some(collectives) = &self.collectives {
            collectives.abort();
        }
    }
}
