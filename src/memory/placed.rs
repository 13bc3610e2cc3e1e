//! The memory space of a communicator: each operation's tensors in host memory
//! or, with the `cuda` feature, in a GPU's, through one engine.
//!
//! Both kinds share the staging buffers (this rank's part of the machine's
//! segment, which the fabric registers), so one sequence of operations, one set
//! of checks and one flow control serve both. Host tensors go through [`Host`]
//! unchanged; device tensors through the device side (`device`), made at the
//! first device operation on that tensor's device.

use std::ops::Range;
use std::ptr::NonNull;
#[cfg(feature = "cuda")]
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

#[cfg(feature = "cuda")]
use super::device_side::{DeviceFence, DeviceSide, DeviceTensor};
use super::program::{Stage, Stages};
use super::{Conversion, Host, HostTensor, MemorySpace, Reduction};
use crate::error::{Error, Result};

/// A caller's tensor, wherever it lives.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PlacedTensor {
    /// In host memory.
    Host(HostTensor),
    /// In a GPU's memory.
    #[cfg(feature = "cuda")]
    Device(DeviceTensor),
}

/// The end of a step: passed at once (host memory), or a stage of a device
/// program.
pub(crate) enum PlacedFence {
    /// The step ended when its method returned.
    Passed,
    /// A stage that ends when its stream writes its end word.
    #[cfg(feature = "cuda")]
    Device(DeviceFence),
}

/// The device side, made once, shared with the local step.
#[cfg(feature = "cuda")]
pub(crate) type DeviceCell = Arc<OnceLock<DeviceSide>>;

/// Host memory, and a GPU's once a device tensor comes.
pub(crate) struct Placed {
    /// Dropped first: it waits for its streams, then unpins the staging.
    #[cfg(feature = "cuda")]
    device: DeviceCell,
    host: Host,
    /// Serialises making the device side.
    #[cfg(feature = "cuda")]
    making: Mutex<()>,
}

impl Placed {
    /// Over `host`'s staging buffers.
    pub(crate) fn new(host: Host) -> Placed {
        Placed {
            host,
            #[cfg(feature = "cuda")]
            device: Arc::new(OnceLock::new()),
            #[cfg(feature = "cuda")]
            making: Mutex::new(()),
        }
    }

    /// The device side, shared with the local step.
    #[cfg(feature = "cuda")]
    pub(crate) fn device_cell(&self) -> DeviceCell {
        Arc::clone(&self.device)
    }

    /// The device side, if a device operation has made it.
    #[cfg(feature = "cuda")]
    pub(crate) fn device(&self) -> Option<&DeviceSide> {
        self.device.get()
    }

    /// The device side on device `ordinal`, made now if it is not yet; an
    /// error if it exists on another device (one communicator drives one GPU).
    #[cfg(feature = "cuda")]
    pub(crate) fn device_on(&self, ordinal: u32) -> Result<&DeviceSide> {
        let side = match self.device.get() {
            Some(side) => side,
            None => {
                let _making = self.making.lock().unwrap_or_else(PoisonError::into_inner);
                match self.device.get() {
                    Some(side) => side,
                    None => {
                        let side = DeviceSide::new(ordinal, self.host.clone())?;
                        self.device.get_or_init(|| side)
                    }
                }
            }
        };
        let on = side.device().ordinal();
        if on != ordinal {
            return Err(Error::invalid(
                "data",
                format!(
                    "lies on GPU {ordinal}, and this communicator drives GPU {on} (the \
                     device of its first device tensor): one communicator per GPU"
                ),
            ));
        }
        Ok(side)
    }

    #[cfg(feature = "cuda")]
    fn side(&self) -> Result<&DeviceSide> {
        self.device.get().ok_or_else(|| {
            Error::internal(
                "a device tensor's operation made the device side at submission",
                "no device side",
            )
        })
    }
}

/// Both tensors of a delivery live in the same kind of memory.
#[cfg(feature = "cuda")]
fn mixed(what: &str) -> Error {
    Error::internal(
        "an operation's tensors all live in one kind of memory",
        what.to_owned(),
    )
}

impl MemorySpace for Placed {
    type Tensor = PlacedTensor;
    type Fence = PlacedFence;

    fn poll(&self, fence: &PlacedFence) -> Result<bool> {
        match fence {
            PlacedFence::Passed => Ok(true),
            #[cfg(feature = "cuda")]
            PlacedFence::Device(f) => self.side()?.poll(f),
        }
    }

    fn stage_in(
        &self,
        buffer: u32,
        to: usize,
        tensor: &PlacedTensor,
        from: Range<usize>,
    ) -> Result<PlacedFence> {
        match tensor {
            PlacedTensor::Host(t) => {
                self.host.stage_in(buffer, to, t, from)?;
                Ok(PlacedFence::Passed)
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(_) => Err(programmed("a stage-in", buffer, to, &from)),
        }
    }

    fn reduce(
        &self,
        buffer: u32,
        _tensor: &PlacedTensor,
        reduction: &Reduction,
    ) -> Result<PlacedFence> {
        // Staging buffers are host memory whatever the tensor's kind: the
        // reduction runs where the fabric put the bytes.
        let host = HostTensor::new(std::ptr::null_mut(), 0);
        self.host.reduce(buffer, &host, reduction)?;
        Ok(PlacedFence::Passed)
    }

    fn reduce_in_tensor(
        &self,
        buffer: u32,
        tensor: &PlacedTensor,
        reduction: &Reduction,
    ) -> Result<PlacedFence> {
        match tensor {
            PlacedTensor::Host(t) => {
                self.host.reduce_in_tensor(buffer, t, reduction)?;
                Ok(PlacedFence::Passed)
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(_) => Err(mixed("a reduction into device memory")),
        }
    }

    fn host_bytes(&self, tensor: &PlacedTensor) -> Option<(NonNull<u8>, usize)> {
        match tensor {
            PlacedTensor::Host(t) => t.host_bytes(),
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(_) => None,
        }
    }

    fn convert(
        &self,
        buffer: u32,
        _tensor: &PlacedTensor,
        conversion: &Conversion,
    ) -> Result<PlacedFence> {
        let host = HostTensor::new(std::ptr::null_mut(), 0);
        self.host.convert(buffer, &host, conversion)?;
        Ok(PlacedFence::Passed)
    }

    fn copy_out(
        &self,
        buffer: u32,
        from: usize,
        tensor: &PlacedTensor,
        to: Range<usize>,
    ) -> Result<PlacedFence> {
        match tensor {
            PlacedTensor::Host(t) => {
                self.host.copy_out(buffer, from, t, to)?;
                Ok(PlacedFence::Passed)
            }
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(_) => Err(programmed("a copy-out", buffer, from, &to)),
        }
    }

    fn deliver(
        &self,
        from: &PlacedTensor,
        range: Range<usize>,
        to: &PlacedTensor,
    ) -> Result<PlacedFence> {
        match (from, to) {
            (PlacedTensor::Host(f), PlacedTensor::Host(t)) => {
                self.host.deliver(f, range, t)?;
                Ok(PlacedFence::Passed)
            }
            #[cfg(feature = "cuda")]
            (PlacedTensor::Device(_), PlacedTensor::Device(_)) => Err(Error::internal(
                "a device tensor's delivery is a stage of its program",
                format!("a delivery of {range:?} asked of the memory space"),
            )),
            #[cfg(feature = "cuda")]
            _ => Err(mixed("a delivery between host and device memory")),
        }
    }

    fn registered(&self) -> (NonNull<u8>, usize) {
        self.host.registered()
    }

    fn buffer_bytes(&self) -> usize {
        self.host.buffer_bytes()
    }

    fn no_tensor(&self) -> PlacedTensor {
        PlacedTensor::Host(self.host.no_tensor())
    }

    fn started(&self, tensor: &PlacedTensor) -> Result<bool> {
        match tensor {
            PlacedTensor::Host(_) => Ok(true),
            #[cfg(feature = "cuda")]
            PlacedTensor::Device(t) => self.side()?.started(t),
        }
    }

    fn completed(&self, seq: u64) {
        #[cfg(feature = "cuda")]
        if let Some(side) = self.device.get() {
            side.completed(seq);
        }
        let _ = seq;
    }

    fn on_device(&self, tensor: &PlacedTensor) -> bool {
        !matches!(tensor, PlacedTensor::Host(_))
    }

    fn stage_end(&self, buffer: u32, value: u64) -> PlacedFence {
        #[cfg(feature = "cuda")]
        if let Some(side) = self.device.get() {
            return PlacedFence::Device(side.stage_end(buffer, value));
        }
        let _ = (buffer, value);
        PlacedFence::Passed
    }

    fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<PlacedFence> {
        #[cfg(feature = "cuda")]
        return Ok(PlacedFence::Device(
            self.side()?.raise(buffer, generation, stage, stages)?,
        ));
        #[cfg(not(feature = "cuda"))]
        {
            let _ = stages;
            Err(Error::internal(
                "a build without a GPU runs no device program",
                format!(
                    "{} of generation {generation} in buffer {buffer}",
                    stage.name()
                ),
            ))
        }
    }

    fn delivery_end(&self, seq: u64) -> PlacedFence {
        #[cfg(feature = "cuda")]
        if let Some(side) = self.device.get() {
            return PlacedFence::Device(side.delivery_end(seq));
        }
        let _ = seq;
        PlacedFence::Passed
    }

    fn raise_delivery(&self, seq: u64) -> Result<PlacedFence> {
        #[cfg(feature = "cuda")]
        return Ok(PlacedFence::Device(self.side()?.raise_delivery(seq)?));
        #[cfg(not(feature = "cuda"))]
        Err(Error::internal(
            "a build without a GPU runs no device program",
            format!("the delivery of operation {seq}"),
        ))
    }

    fn release(&self) {
        #[cfg(feature = "cuda")]
        if let Some(side) = self.device.get() {
            side.release();
        }
    }
}

/// A copy of a device tensor asked of the memory space: the engine opens its
/// program's stage instead (`engine::device_program`).
#[cfg(feature = "cuda")]
fn programmed(what: &str, buffer: u32, offset: usize, range: &Range<usize>) -> Error {
    Error::internal(
        "a device tensor's copies are stages of its program",
        format!("{what} of {range:?} at {offset} of buffer {buffer} asked of the memory space"),
    )
}
