//! Streams: ordered queues of device work.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUstream};

use crate::device::Device;
use crate::error::{self, Result};
use crate::event::Event;

/// A stream on one device: either created here (and destroyed on drop) or
/// borrowed from a host runtime that owns it (PyTorch's current stream).
#[derive(Debug)]
pub struct Stream {
    device: Arc<Device>,
    raw: CUstream,
    owned: bool,
}

// SAFETY: a CUstream is a handle the driver accepts from any thread; work is
// ordered by the stream itself, not by the thread that enqueues it.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueueing from two threads at once is allowed by the driver
// (the order between the two threads' work is whatever they race to).
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream that does not synchronise with the legacy default stream, at
    /// the device's highest priority when `high_priority` (the pipeline's stages
    /// are latency-bound, as the original's were).
    pub fn new(device: &Arc<Device>, high_priority: bool) -> Result<Stream> {
        let _bound = device.bind()?;
        let mut priority = 0;
        if high_priority {
            let (mut least, mut greatest) = (0, 0);
            // SAFETY: writes two ints for the current context.
            error::driver("cuCtxGetStreamPriorityRange", unsafe {
                sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
            })?;
            priority = greatest;
        }
        let mut raw = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: writes one stream handle; destroyed in Drop.
        error::driver("cuStreamCreateWithPriority", unsafe {
            sys::cuStreamCreateWithPriority(&mut raw, flags, priority)
        })?;
        Ok(Stream {
            device: Arc::clone(device),
            raw,
            owned: true,
        })
    }

    /// A stream a host runtime owns. It is not destroyed on drop.
    ///
    /// # Safety
    ///
    /// `raw` must be a stream of `device`'s primary context (or the null stream),
    /// and stay valid for as long as the returned value and any work enqueued
    /// through it live.
    pub unsafe fn from_raw(device: &Arc<Device>, raw: CUstream) -> Stream {
        Stream {
            device: Arc::clone(device),
            raw,
            owned: false,
        }
    }

    /// The device the stream belongs to.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The raw handle, for interoperation.
    pub fn raw(&self) -> CUstream {
        self.raw
    }

    /// Makes all future work on this stream wait for the work `event` recorded
    /// (an event never recorded makes this a no-op, as in CUDA). The host does not
    /// wait.
    pub fn wait(&self, event: &Event) -> Result<()> {
        self.device.check_same("event", event.device().ordinal())?;
        let _bound = self.device.bind()?;
        // SAFETY: both handles are alive (borrowed) and of the same device.
        error::driver("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.raw, event.raw(), 0)
        })
    }

    /// Records `event` after the work enqueued so far.
    pub fn record(&self, event: &Event) -> Result<()> {
        event.record(self)
    }

    /// Blocks until all work enqueued so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _bound = self.device.bind()?;
        // SAFETY: the stream is alive.
        error::driver("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }

    /// Whether all work enqueued so far has finished, without blocking.
    pub fn is_idle(&self) -> Result<bool> {
        let _bound = self.device.bind()?;
        // SAFETY: the stream is alive.
        let status = unsafe { sys::cuStreamQuery(self.raw) };
        if status == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        error::driver("cuStreamQuery", status).map(|()| true)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _bound = match self.device.bind() {
            Ok(bound) => bound,
            Err(e) => {
                log::warn!("destroying a stream: {e}");
                return;
            }
        };
        // SAFETY: the stream was created in `new` and is destroyed once; work
        // still in it completes first (cuStreamDestroy does not cancel it).
        let status = unsafe { sys::cuStreamDestroy_v2(self.raw) };
        if let Err(e) = error::driver("cuStreamDestroy", status) {
            log::warn!("destroying a stream: {e}");
        }
    }
}
