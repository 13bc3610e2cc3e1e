//! The simulation's local step: the communicator's [`PlacedStep`] over the
//! simulated GPU ([`super::simulated_gpu`]) and the machine's collectives
//! ([`super::collectives`]).

use super::simulated_gpu::{DeviceTensor, SimFence, SimGpu, SimMemory, SimTensor};
use super::simulated_nccl::SimCollectives;
use crate::error::Result;
use crate::local::{DeviceReach, Place, PlacedStep, ShmStep};
use crate::memory::Host;
use crate::memory::program::{ProgramItem, Stage, Stages, Unfinished};

/// How the simulation's local step reaches its device tensors: the
/// simulated GPU's programs and words, and the machine's collectives where
/// its ranks reduce through them. The step itself is the communicator's
/// ([`PlacedStep`]), so the simulation runs the path choice it ships.
pub(super) struct SimReach {
    gpu: SimGpu,
    host: Host,
    collectives: Option<SimCollectives>,
    /// The smallest slice the machine's collectives reduce-scatter in one
    /// call (drawn per seed; the same on every local rank).
    one_reduce_scatter_from: u64,
}

/// The simulation's local step.
pub(super) type SimStep = PlacedStep<SimReach>;

/// The local step of a rank over `shm`, reaching its device tensors through
/// `memory`'s GPU and, where given, `collectives`, which reduce-scatter
/// slices of equal slots of at least `one_reduce_scatter_from` bytes in one
/// call.
pub(super) fn step(
    memory: &SimMemory,
    shm: ShmStep,
    collectives: Option<SimCollectives>,
    one_reduce_scatter_from: u64,
) -> SimStep {
    PlacedStep::new(
        shm,
        SimReach {
            gpu: memory.sim_gpu(),
            host: memory.host().clone(),
            collectives,
            one_reduce_scatter_from,
        },
    )
}

impl DeviceReach for SimReach {
    type Memory = SimMemory;
    type Tensor = DeviceTensor;
    type Fence = SimFence;

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
        Ok(self.gpu.poll(fence))
    }

    fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<SimFence> {
        self.gpu.raise(buffer, generation, stage, stages)
    }

    fn has_collectives(&self) -> bool {
        self.collectives.is_some()
    }

    fn one_reduce_scatter_from(&self) -> u64 {
        self.one_reduce_scatter_from
    }

    fn enqueue(
        &self,
        tensor: &DeviceTensor,
        seq: u64,
        items: &[ProgramItem<SimTensor>],
    ) -> std::result::Result<(), Unfinished> {
        self.gpu
            .enqueue(tensor, seq, items, &self.host, self.collectives.as_ref())
    }

    fn release_collectives(&self) {
        self.gpu.release_collectives();
    }
}
