//! The local step of a memory space whose operations take host or device
//! tensors ([`PlacedStep`]): host tensors run [`ShmStep`] as they always do;
//! device tensors run the same counter protocol with copies between the tensor
//! and the staging buffers on the device's streams:
//!
//! - alone on its machine (`D = 1`), a rank's reduce-scatter copies the
//!   tensor's slot into the staging buffer and its all-gather the landed
//!   result back (`alone`);
//! - with several ranks per machine, the machine's reduction runs as the GPUs'
//!   own collectives on the tensors (`collectives`) where the machine's ranks
//!   have them and the operator allows, and otherwise on the host in the
//!   shared segment, staged in and out by copies (`staged`).
//!
//! How a step reaches the device is a [`DeviceReach`]: the communicator's is
//! a GPU's device side and NCCL's communicators (`gpu`, the `cuda` feature),
//! the simulation's its simulated GPU; a build without a GPU reaches none
//! (`HostOnly`). The choice of path above is made here once, for all of
//! them, so the simulation runs the choice the communicator ships.

use std::ops::Range;

use fairring_core::{DataType, ReduceOp};

#[cfg(not(feature = "cuda"))]
use super::collectives::Comm;
use super::collectives::{CollectiveStep, Collectives};
use super::shm_step::ShmStep;
use super::{LocalSlice, LocalStep, Waiting};
use crate::error::Result;
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

/// How a step reaches a memory space's device tensors.
pub(crate) trait DeviceReach: Send + Sync {
    /// The memory space.
    type Memory: MemorySpace;
    /// A device tensor.
    type Tensor;
    /// The end of copies on a device stream.
    type Fence: Send;
    /// The machine's collectives among its ranks' device tensors.
    type Collectives<'a>: Collectives<Tensor = Self::Tensor, Fence = Self::Fence>
    where
        Self: 'a;

    /// Where `tensor` lives.
    fn place(tensor: &<Self::Memory as MemorySpace>::Tensor) -> Place<'_, Self::Tensor>;

    /// The memory space's fence for `fence` (`None`: passed at once).
    fn fence(fence: Option<Self::Fence>) -> <Self::Memory as MemorySpace>::Fence;

    /// Whether `fence` has passed.
    fn poll(&self, fence: &Self::Fence) -> Result<bool>;

    /// Enqueues a copy of bytes `from` of `tensor` into `staging`, on
    /// `buffer`'s stream.
    ///
    /// # Safety
    ///
    /// `staging` is this rank's page-locked staging memory, untouched until
    /// the returned fence passes; the operation's start has passed.
    unsafe fn copy_to_staging(
        &self,
        buffer: u32,
        staging: &mut [u8],
        tensor: &Self::Tensor,
        from: Range<usize>,
    ) -> Result<Self::Fence>;

    /// Enqueues a copy of `staging` into bytes `to` of `tensor`, on
    /// `buffer`'s stream.
    ///
    /// # Safety
    ///
    /// As for [`copy_to_staging`](DeviceReach::copy_to_staging), with
    /// `staging` unwritten until the fence passes.
    unsafe fn copy_from_staging(
        &self,
        buffer: u32,
        staging: &[u8],
        tensor: &Self::Tensor,
        to: Range<usize>,
    ) -> Result<Self::Fence>;

    /// The machine's collectives, if its ranks reduce device tensors
    /// through them.
    fn collectives(&self) -> Result<Option<Self::Collectives<'_>>>;

    /// The engine failed: stops the collectives, so that calls waiting for
    /// a rank that is gone end.
    fn abort_collectives(&self);
}

/// [`ShmStep`] for host tensors, and its device forms for device tensors.
pub(crate) struct PlacedStep<D: DeviceReach> {
    pub(crate) shm: ShmStep,
    reach: D,
    /// Announcements of the staged step waiting for their copies.
    waiting: Waiting<D::Fence>,
    /// The order this rank issues the machine's collectives in.
    collective: CollectiveStep,
}

impl<D: DeviceReach> PlacedStep<D> {
    /// Over `shm`, reaching device tensors through `reach`.
    pub(crate) fn new(shm: ShmStep, reach: D) -> PlacedStep<D> {
        PlacedStep {
            waiting: Waiting::new(shm.protocol.buffers),
            shm,
            reach,
            collective: CollectiveStep::new(),
        }
    }

    /// The collectives slice `s` goes through, if it goes through them.
    fn collectives(&self, s: &LocalSlice<'_, D::Memory>) -> Result<Option<D::Collectives<'_>>> {
        self.collectives_for(s.dtype, s.op)
    }

    /// The collectives a slice of `dtype` and `op` goes through, if it goes
    /// through them (the machine has them, and they take the type and the
    /// operator).
    fn collectives_for(&self, dtype: DataType, op: ReduceOp) -> Result<Option<D::Collectives<'_>>> {
        if !CollectiveStep::takes(dtype, op) {
            return Ok(None);
        }
        self.reach.collectives()
    }

    /// Whether device tensors take the staged step (several ranks on this
    /// machine) or the lone one.
    fn staged(&self) -> bool {
        self.shm.size > 1
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
        // in the tensor (`CollectiveStep::try_reduce_scatter`); whether the
        // machine has them was settled alike on every local rank before its
        // first device operation.
        matches!(D::place(tensor), Place::Device(_))
            && self.staged()
            && self.collectives_for(dtype, op).is_ok_and(|c| c.is_some())
    }

    fn begin(&self, s: &LocalSlice<'_, D::Memory>) -> Result<()> {
        let t = match D::place(s.tensor) {
            Place::Host(t) => return self.shm.begin(&host(s, t)),
            Place::Device(t) => t,
        };
        if self.collectives(s)?.is_some() {
            self.collective.begin(&self.shm, s)
        } else if self.staged() {
            self.shm
                .begin_staged(s, &self.waiting, |in_tensor, staging| {
                    // SAFETY: the staging bytes are this rank's own, page-locked,
                    // and untouched until the copy's fence passes (the step
                    // announces them staged only then).
                    unsafe { self.reach.copy_to_staging(s.buffer, staging, t, in_tensor) }
                })
        } else {
            self.shm.begin_alone(s.buffer, s.number, "stage-in")
        }
    }

    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, D::Memory>,
        final_world: Option<u32>,
    ) -> Result<Option<<D::Memory as MemorySpace>::Fence>> {
        let t = match D::place(s.tensor) {
            Place::Host(t) => {
                let ran = self.shm.try_reduce_scatter(&host(s, t), final_world)?;
                return Ok(ran.map(|()| D::fence(None)));
            }
            Place::Device(t) => t,
        };
        let ran = if let Some(c) = self.collectives(s)? {
            self.collective
                .try_reduce_scatter(&self.shm, &c, s, t, final_world)?
                .map(Some)
        } else if self.staged() {
            self.shm.try_reduce_scatter_staged(
                s,
                final_world,
                &self.waiting,
                |f| self.reach.poll(f),
                |staging, in_tensor| {
                    // SAFETY: page-locked staging bytes of this rank's own
                    // slot, which nothing writes until the fence passes
                    // (the engine waits for it before the next step).
                    unsafe {
                        self.reach
                            .copy_from_staging(s.buffer, staging, t, in_tensor)
                    }
                },
            )?
        } else {
            self.shm.try_reduce_scatter_alone(
                s.buffer,
                s.number,
                s.slice,
                final_world,
                |staging, in_tensor| {
                    // SAFETY: the staging buffer is page-locked and this
                    // rank's own; nothing touches the slot until the fence
                    // passes (the engine waits for it before the next step).
                    unsafe { self.reach.copy_to_staging(s.buffer, staging, t, in_tensor) }
                },
            )?
        };
        Ok(ran.map(D::fence))
    }

    fn publish_slot(&self, s: &LocalSlice<'_, D::Memory>) {
        self.shm
            .protocol
            .publish_slot(&*self.shm.segment, s.buffer, s.number);
    }

    fn try_all_gather(
        &self,
        s: &LocalSlice<'_, D::Memory>,
        own_in_tensor: bool,
    ) -> Result<Option<<D::Memory as MemorySpace>::Fence>> {
        let t = match D::place(s.tensor) {
            Place::Host(t) => {
                let ran = self.shm.try_all_gather(&host(s, t), own_in_tensor)?;
                return Ok(ran.map(|()| D::fence(None)));
            }
            Place::Device(t) => t,
        };
        let ran = if let Some(c) = self.collectives(s)? {
            self.collective
                .try_all_gather(&self.shm, &c, &self.waiting, s, t, own_in_tensor)?
        } else if self.staged() {
            self.shm.try_all_gather_staged(
                s,
                own_in_tensor,
                &self.waiting,
                |staging, in_tensor| {
                    // SAFETY: a final slot of a local rank's page-locked
                    // buffer, not reused by its owner before this rank's
                    // `Done`, which follows the copy's fence.
                    unsafe {
                        self.reach
                            .copy_from_staging(s.buffer, staging, t, in_tensor)
                    }
                },
            )?
        } else {
            self.shm.try_all_gather_alone(
                s.buffer,
                s.number,
                s.slice,
                own_in_tensor,
                |staging, in_tensor| {
                    // SAFETY: as in the reduce-scatter; the engine releases
                    // the buffer only once this copy's fence has passed.
                    unsafe {
                        self.reach
                            .copy_from_staging(s.buffer, staging, t, in_tensor)
                    }
                },
            )?
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
        self.waiting.any() || self.collective.waiting()
    }

    fn take_fences(&self) -> Vec<<D::Memory as MemorySpace>::Fence> {
        self.reach.abort_collectives();
        self.waiting
            .take_fences()
            .into_iter()
            .map(|f| D::fence(Some(f)))
            .collect()
    }
}

/// A device tensor, fence or collective of a build without a GPU: none
/// exists.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum NoDevice {}

#[cfg(not(feature = "cuda"))]
impl Collectives for NoDevice {
    type Tensor = NoDevice;
    type Fence = NoDevice;

    fn group(&self, _comm: Comm, _enqueue: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        match *self {}
    }

    unsafe fn all_reduce(
        &self,
        _: u32,
        _: &NoDevice,
        _: Range<usize>,
        _: fairring_core::DataType,
        _: fairring_core::ReduceOp,
    ) -> Result<()> {
        match *self {}
    }

    unsafe fn reduce(
        &self,
        _: u32,
        _: &NoDevice,
        _: Range<usize>,
        _: fairring_core::DataType,
        _: fairring_core::ReduceOp,
        _: u32,
    ) -> Result<()> {
        match *self {}
    }

    unsafe fn broadcast(&self, _: u32, _: &NoDevice, _: Range<usize>, _: u32) -> Result<()> {
        match *self {}
    }

    unsafe fn copy_to_staging(
        &self,
        _: u32,
        _: &mut [u8],
        _: &NoDevice,
        _: Range<usize>,
    ) -> Result<()> {
        match *self {}
    }

    unsafe fn copy_from_staging(
        &self,
        _: u32,
        _: &[u8],
        _: &NoDevice,
        _: Range<usize>,
    ) -> Result<()> {
        match *self {}
    }

    fn fence(&self, _: u32) -> Result<NoDevice> {
        match *self {}
    }
}

/// The reach of a build without a GPU: its memory space holds host tensors
/// only.
#[cfg(not(feature = "cuda"))]
pub(crate) struct HostOnly;

#[cfg(not(feature = "cuda"))]
impl DeviceReach for HostOnly {
    type Memory = crate::memory::Placed;
    type Tensor = NoDevice;
    type Fence = NoDevice;
    type Collectives<'a> = NoDevice;

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

    unsafe fn copy_to_staging(
        &self,
        _: u32,
        _: &mut [u8],
        tensor: &NoDevice,
        _: Range<usize>,
    ) -> Result<NoDevice> {
        match *tensor {}
    }

    unsafe fn copy_from_staging(
        &self,
        _: u32,
        _: &[u8],
        tensor: &NoDevice,
        _: Range<usize>,
    ) -> Result<NoDevice> {
        match *tensor {}
    }

    fn collectives(&self) -> Result<Option<NoDevice>> {
        Ok(None)
    }

    fn abort_collectives(&self) {}
}
