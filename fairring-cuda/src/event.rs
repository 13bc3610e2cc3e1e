//! Events: points in a stream that other streams and the host can wait for.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys::{self, CUevent, CUevent_flags};

use crate::device::Device;
use crate::error::{self, Result};
use crate::stream::Stream;

/// Whether an event records a timestamp (needed by [`Event::elapsed_since`]; an
/// event without one is cheaper to record and wait on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timing {
    /// Record timestamps.
    Enabled,
    /// Record none: for ordering only.
    Disabled,
}

/// A CUDA event of one device.
#[derive(Debug)]
pub struct Event {
    device: Arc<Device>,
    raw: CUevent,
}

// SAFETY: a CUevent is a handle the driver accepts from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; recording from two threads at once is allowed by the driver
// (the event then marks whichever record came last).
unsafe impl Sync for Event {}

impl Event {
    /// A new event of `device`.
    pub fn new(device: &Arc<Device>, timing: Timing) -> Result<Event> {
        let _bound = device.bind()?;
        let flags = match timing {
            Timing::Enabled => CUevent_flags::CU_EVENT_DEFAULT,
            Timing::Disabled => CUevent_flags::CU_EVENT_DISABLE_TIMING,
        };
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one event handle; destroyed in Drop.
        error::driver("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut raw, flags as u32)
        })?;
        Ok(Event {
            device: Arc::clone(device),
            raw,
        })
    }

    /// The device the event belongs to.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The raw handle, for interoperation.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// Records the event after the work enqueued on `stream` so far. A later
    /// record replaces an earlier one for every wait issued after it.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.device
            .check_same("stream", stream.device().ordinal())?;
        let _bound = self.device.bind()?;
        // SAFETY: both handles are alive and of the same device.
        error::driver("cuEventRecord", unsafe {
            sys::cuEventRecord(self.raw, stream.raw())
        })
    }

    /// Whether the work before the last record has finished (true for an event
    /// never recorded), without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        let _bound = self.device.bind()?;
        // SAFETY: the event is alive.
        let status = unsafe { sys::cuEventQuery(self.raw) };
        if status == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        error::driver("cuEventQuery", status).map(|()| true)
    }

    /// Blocks until the work before the last record has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _bound = self.device.bind()?;
        // SAFETY: the event is alive.
        error::driver("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.raw)
        })
    }

    /// Device time between `start` and `self`, both recorded with
    /// [`Timing::Enabled`] and both complete (about 0.5 µs resolution).
    pub fn elapsed_since(&self, start: &Event) -> Result<Duration> {
        self.device
            .check_same("start event", start.device.ordinal())?;
        let _bound = self.device.bind()?;
        let mut ms = 0f32;
        // SAFETY: writes one float; both events are alive.
        error::driver("cuEventElapsedTime", unsafe {
            sys::cuEventElapsedTime_v2(&mut ms, start.raw, self.raw)
        })?;
        Ok(Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _bound = match self.device.bind() {
            Ok(bound) => bound,
            Err(e) => {
                log::warn!("destroying an event: {e}");
                return;
            }
        };
        // SAFETY: created in `new`, destroyed once; a pending record completes
        // first (the driver defers the release).
        let status = unsafe { sys::cuEventDestroy_v2(self.raw) };
        if let Err(e) = error::driver("cuEventDestroy", status) {
            log::warn!("destroying an event: {e}");
        }
    }
}
