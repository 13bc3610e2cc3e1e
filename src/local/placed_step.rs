//! The local step of a memory space whose operations take host or device
//! tensors ([`PlacedStep`]): host tensors run [`ShmStep`] as they always do;
//! device tensors run the same counter protocol, their bytes moved by the
//! stages of their slices' device programs:
//!
//! - alone on its machine (`D = 1`), a rank's reduce-scatter copies the
//!   tensor's slot into the staging buffer and its all-gather the landed
//!   result back (`alone`);
//! - with several ranks per machine, the machine's reduction runs as the GPUs'
//!   own collectives on the tensors (`collective_step`) where the machine's ranks
//!   have them and the operator allows, and otherwise on the host in the
//!   shared segment, staged in and out by copies (`staged`).
//!
//! Each path says what its stages do ([`LocalStep::device_items`]), which the
//! engine enqueues when the call is accepted; at run time the step only opens
//! them ([`DeviceReach::raise`]) and waits for their ends. How a step reaches
//! the device is a [`DeviceReach`]: the communicator's is a GPU's device side
//! and NCCL's communicators (`gpu`, the `cuda` feature), the simulation's its
//! simulated GPU; a build without a GPU reaches none (`HostOnly`). The choice
//! of path above is made here once, for all of them, so the simulation runs
//! the choice the communicator ships.

use fairring_core::{DataType, ReduceOp};

use super::shm_step::ShmStep;
use super::{LocalSlice, LocalStage, LocalStep, Waiting, alone, collective_step, staged};
use crate::error::{Error, Result};
use crate::memory::program::{ProgramItem, Stage, Stages, Unfinished};
use crate::memory::{Host, HostTensor, MemorySpace};

/// Where a tensor lives.
pub(crate) enum Place<'a, T> {
    /// In host memory.
    Host(&'a HostTensor),
    /// In a device's memory.
    #[cfg_attr(
        not(any(feature = "cuda", all(test, not(loom)))),
        expect(dead_code, reason = "a build without a GPU has host tensors only")
    )]
    Device(&'a T),
}

/// How a step reaches a memory space's device tensors: their programs, the
/// words that open and end their stages, and the machine's collectives.
pub(crate) trait DeviceReach: Send + Sync {
    /// The memory space.
    type Memory: MemorySpace;
    /// A device tensor.
    type Tensor;
    /// The end of a stage: its buffer's end word reaching its value.
    type Fence: Send;

    /// Where `tensor` lives.
    fn place(tensor: &<Self::Memory as MemorySpace>::Tensor) -> Place<'_, Self::Tensor>;

    /// The memory space's fence for `fence` (`None`: passed at once).
    fn fence(fence: Option<Self::Fence>) -> <Self::Memory as MemorySpace>::Fence;

    /// Whether `fence` has passed (a read of host memory, never a CUDA
    /// call).
    fn poll(&self, fence: &Self::Fence) -> Result<bool>;

    /// Opens `stage` of the slice of generation `generation` in staging
    /// buffer `buffer`, whose program holds `stages` (checked as
    /// [`raised`](crate::memory::program::raised) does); returns the fence
    /// of its end. A write of host memory, never a CUDA call.
    fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<Self::Fence>;

    /// Whether the machine's ranks reduce device tensors through
    /// collectives of their own (settled alike on every local rank before
    /// its first device operation).
    fn has_collectives(&self) -> bool;

    /// The smallest slice the machine's collectives reduce-scatter in one
    /// call where its slots are equal
    /// ([`collective_step::reduces_in_one_call`]); the same on every local
    /// rank.
    fn one_reduce_scatter_from(&self) -> u64 {
        collective_step::ONE_REDUCE_SCATTER_FROM_BYTES
    }

    /// Enqueues operation `seq`'s device program on `tensor`: everything
    /// the device will do for it, each stage behind its gate. On the
    /// caller's thread, as the call is accepted.
    fn enqueue(
        &self,
        tensor: &Self::Tensor,
        seq: u64,
        items: &[ProgramItem<<Self::Memory as MemorySpace>::Tensor>],
    ) -> std::result::Result<(), Unfinished>;

    /// The engine failed and released every gate: stops the machine's
    /// collectives, so that one waiting for a rank that is gone ends. Where
    /// stopping waits for the device (NCCL's abort), it does so on a thread
    /// of its own, never the caller's.
    fn release_collectives(&self);
}

/// [`ShmStep`] for host tensors, and its device forms for device tensors.
pub(crate) struct PlacedStep<D: DeviceReach> {
    pub(crate) shm: ShmStep,
    reach: D,
    /// Announcements of the staged step waiting for their stages' ends.
    waiting: Waiting<D::Fence>,
}

/// How a device tensor's slice crosses the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// The rank is alone on its machine.
    Alone,
    /// Through the host, in the machine's shared segment.
    Staged,
    /// Through the machine's collectives.
    Collectives,
}

impl<D: DeviceReach> PlacedStep<D> {
    /// Over `shm`, reaching device tensors through `reach`.
    pub(crate) fn new(shm: ShmStep, reach: D) -> PlacedStep<D> {
        PlacedStep {
            waiting: Waiting::new(shm.protocol.buffers),
            shm,
            reach,
        }
    }

    /// The path of a device slice of `dtype` reduced with `op`.
    fn path(&self, dtype: DataType, op: ReduceOp) -> Path {
        if self.shm.size == 1 {
            Path::Alone
        } else if collective_step::takes(dtype, op) && self.reach.has_collectives() {
            Path::Collectives
        } else {
            Path::Staged
        }
    }

    /// Opens `stage` of device slice `s` if its program holds it; the
    /// fence of its end, or `None` where it holds none.
    fn raise(&self, s: &LocalSlice<'_, D::Memory>, stage: Stage) -> Result<Option<D::Fence>> {
        if !s.stages.has(stage) {
            return Ok(None);
        }
        let generation = s.number / u64::from(self.shm.protocol.buffers);
        self.reach
            .raise(s.buffer, generation, stage, s.stages)
            .map(Some)
    }
}

/// `s` with its host tensor.
fn host<'a, M: MemorySpace>(s: &LocalSlice<'a, M>, tensor: &'a HostTensor) -> LocalSlice<'a, Host> {
    LocalSlice {
        buffer: s.buffer,
        number: s.number,
        slice: s.slice,
        tensor,
        dtype: s.dtype,
        op: s.op,
        pieces: s.pieces,
        root: s.root,
        stages: s.stages,
    }
}

impl<D: DeviceReach> LocalStep<D::Memory> for PlacedStep<D> {
    fn buffer_free(&self, buffer: u32, number: u64) -> bool {
        LocalStep::<Host>::buffer_free(&self.shm, buffer, number)
    }

    fn works_in_tensor(
        &self,
        tensor: &<D::Memory as MemorySpace>::Tensor,
        dtype: DataType,
        op: ReduceOp,
    ) -> bool {
        // A final slice through the machine's collectives is one all-reduce
        // in the tensor (`collectives::items`); whether the machine has them
        // was settled alike on every local rank before its first device
        // operation.
        matches!(D::place(tensor), Place::Device(_)) && self.path(dtype, op) == Path::Collectives
    }

    fn begin(&self, s: &LocalSlice<'_, D::Memory>) -> Result<()> {
        if let Place::Host(t) = D::place(s.tensor) {
            return self.shm.begin(&host(s, t));
        }
        match self.path(s.dtype, s.op) {
            Path::Collectives => self.shm.begin_collective(s),
            Path::Staged => self
                .shm
                .begin_staged(s, &self.waiting, || self.raise(s, Stage::Begin)),
            Path::Alone => self.shm.begin_alone(s.buffer, s.number, "stage-in"),
        }
    }

    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, D::Memory>,
        final_world: Option<u32>,
    ) -> Result<Option<<D::Memory as MemorySpace>::Fence>> {
        if let Place::Host(t) = D::place(s.tensor) {
            let ran = self.shm.try_reduce_scatter(&host(s, t), final_world)?;
            return Ok(ran.map(|()| D::fence(None)));
        }
        let raise = || self.raise(s, Stage::ReduceScatter);
        let ran = match self.path(s.dtype, s.op) {
            Path::Collectives => self.shm.try_reduce_scatter_collective(s, raise)?,
            Path::Staged => self.shm.try_reduce_scatter_staged(
                s,
                final_world,
                &self.waiting,
                |f| self.reach.poll(f),
                raise,
            )?,
            Path::Alone => self
                .shm
                .try_reduce_scatter_alone(s.buffer, s.number, raise)?,
        };
        Ok(ran.map(D::fence))
    }

    fn publish_slot(&self, s: &LocalSlice<'_, D::Memory>) {
        if let Place::Host(t) = D::place(s.tensor) {
            // A host slice reduced whole published its slot with the reduction.
            return LocalStep::<Host>::publish_slot(&self.shm, &host(s, t));
        }
        self.shm
            .protocol
            .publish_slot(&*self.shm.segment, s.buffer, s.number);
    }

    fn try_all_gather(
        &self,
        s: &LocalSlice<'_, D::Memory>,
        own_in_tensor: bool,
    ) -> Result<Option<<D::Memory as MemorySpace>::Fence>> {
        if let Place::Host(t) = D::place(s.tensor) {
            let ran = self.shm.try_all_gather(&host(s, t), own_in_tensor)?;
            return Ok(ran.map(|()| D::fence(None)));
        }
        let raise = || self.raise(s, Stage::AllGather);
        let ran = match self.path(s.dtype, s.op) {
            Path::Collectives => self
                .shm
                .try_all_gather_collective(s, &self.waiting, raise)?,
            Path::Staged => self.shm.try_all_gather_staged(s, &self.waiting, raise)?,
            Path::Alone => self.shm.try_all_gather_alone(s.buffer, s.number, raise)?,
        };
        Ok(ran.map(D::fence))
    }

    fn finish(&self, buffer: u32, number: u64) {
        LocalStep::<Host>::finish(&self.shm, buffer, number);
    }

    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        LocalStep::<Host>::laggards(&self.shm, buffer, number)
    }

    fn close_tensors(&self) {
        LocalStep::<Host>::close_tensors(&self.shm);
    }

    fn gathered(&self, buffer: u32, _number: u64) -> Result<()> {
        self.shm.gathered(&self.waiting, buffer)
    }

    fn awaits_fences(&self) -> bool {
        self.waiting.any()
    }

    fn device_items(
        &self,
        s: &LocalSlice<'_, D::Memory>,
        stage: LocalStage,
        each: &mut dyn FnMut(ProgramItem<<D::Memory as MemorySpace>::Tensor>) -> Result<()>,
    ) -> Result<()> {
        if let Place::Host(_) = D::place(s.tensor) {
            return Ok(());
        }
        match self.path(s.dtype, s.op) {
            Path::Alone => alone::items(&self.shm, s, stage, each),
            Path::Staged => staged::items(&self.shm, s, stage, each),
            Path::Collectives => collective_step::items(
                &self.shm,
                s,
                stage,
                self.reach.one_reduce_scatter_from(),
                each,
            ),
        }
    }

    fn enqueue(
        &self,
        tensor: &<D::Memory as MemorySpace>::Tensor,
        seq: u64,
        items: &[ProgramItem<<D::Memory as MemorySpace>::Tensor>],
    ) -> std::result::Result<(), Unfinished> {
        match D::place(tensor) {
            Place::Device(t) => self.reach.enqueue(t, seq, items),
            Place::Host(_) => Err(Unfinished {
                error: Error::internal(
                    "only device tensors have device programs",
                    format!("operation {seq} on host memory"),
                ),
                ends: false,
            }),
        }
    }

    fn release(&self) {
        self.waiting.clear();
        self.reach.release_collectives();
    }
}

/// A device tensor or fence of a build without a GPU: none exists.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum NoDevice {}

/// The reach of a build without a GPU: its memory space holds host tensors
/// only.
#[cfg(not(feature = "cuda"))]
pub(crate) struct HostOnly;

#[cfg(not(feature = "cuda"))]
impl DeviceReach for HostOnly {
    type Memory = crate::memory::Placed;
    type Tensor = NoDevice;
    type Fence = NoDevice;

    fn place(tensor: &crate::memory::PlacedTensor) -> Place<'_, NoDevice> {
        match tensor {
            crate::memory::PlacedTensor::Host(t) => Place::Host(t),
        }
    }

    fn fence(fence: Option<NoDevice>) -> crate::memory::PlacedFence {
        match fence {
            None => crate::memory::PlacedFence::Passed,
            Some(never) => match never {},
        }
    }

    fn poll(&self, fence: &NoDevice) -> Result<bool> {
        match *fence {}
    }

    fn raise(&self, buffer: u32, generation: u64, stage: Stage, _: Stages) -> Result<NoDevice> {
        Err(Error::internal(
            "a build without a GPU runs no device program",
            format!(
                "{} of generation {generation} in buffer {buffer}",
                stage.name()
            ),
        ))
    }

    fn has_collectives(&self) -> bool {
        false
    }

    fn enqueue(
        &self,
        tensor: &NoDevice,
        _: u64,
        _: &[ProgramItem<crate::memory::PlacedTensor>],
    ) -> std::result::Result<(), Unfinished> {
        match *tensor {}
    }

    fn release_collectives(&self) {}
}
