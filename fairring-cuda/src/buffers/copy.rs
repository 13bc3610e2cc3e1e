//! Copies and fills, enqueued on a stream.

use cudarc::driver::sys;

use super::{DeviceSlice, DeviceSliceMut};
use crate::error::{self, Result};
use crate::stream::Stream;

impl Stream {
    /// Enqueues a copy of `src` into `dst` (`cuMemcpyDtoDAsync`); the lengths must
    /// match.
    pub fn copy(&self, dst: &mut DeviceSliceMut<'_>, src: DeviceSlice<'_>) -> Result<()> {
        self.device().check_same("copy destination", dst.device())?;
        self.device().check_same("copy source", src.device())?;
        same_length(dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let _bound = self.device().bind()?;
        // SAFETY: both ranges are device memory of this stream's device, valid
        // until the copy completes (the views' contracts).
        error::driver("cuMemcpyDtoDAsync", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.raw(), src.raw(), src.len(), self.raw())
        })
    }

    /// Enqueues setting every byte of `dst` to `value`.
    pub fn fill(&self, dst: &mut DeviceSliceMut<'_>, value: u8) -> Result<()> {
        self.device().check_same("fill destination", dst.device())?;
        if dst.is_empty() {
            return Ok(());
        }
        let _bound = self.device().bind()?;
        // SAFETY: device memory of this stream's device, valid until the fill
        // completes (the view's contract).
        error::driver("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst.raw(), value, dst.len(), self.raw())
        })
    }

    /// Enqueues a copy of host memory `src` into `dst`. From pinned memory
    /// ([`PinnedBuffer`](super::PinnedBuffer)) the copy runs asynchronously; from
    /// pageable memory the driver stages it first.
    ///
    /// # Safety
    ///
    /// `src` must stay alive and unwritten until the stream has passed this copy
    /// (synchronize the stream, or an event recorded after it).
    pub unsafe fn copy_to_device(&self, dst: &mut DeviceSliceMut<'_>, src: &[u8]) -> Result<()> {
        self.device().check_same("copy destination", dst.device())?;
        same_length(dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let _bound = self.device().bind()?;
        // SAFETY: `dst` is device memory of this device (its contract); `src` is
        // valid and unwritten until the copy completes (this function's contract).
        error::driver("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst.raw(), src.as_ptr().cast(), src.len(), self.raw())
        })
    }

    /// Enqueues a copy of `src` into host memory `dst`.
    ///
    /// # Safety
    ///
    /// `dst` must stay alive and unaccessed (neither read nor written) until the
    /// stream has passed this copy.
    pub unsafe fn copy_to_host(&self, dst: &mut [u8], src: DeviceSlice<'_>) -> Result<()> {
        self.device().check_same("copy source", src.device())?;
        same_length(dst.len(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let _bound = self.device().bind()?;
        // SAFETY: `src` is device memory of this device (its contract); `dst` is
        // valid and untouched until the copy completes (this function's contract).
        error::driver("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), src.raw(), src.len(), self.raw())
        })
    }

    /// Copies host memory `src` into `dst` and waits for the stream to pass the
    /// copy (and everything enqueued on it before).
    pub fn upload_blocking(&self, dst: &mut DeviceSliceMut<'_>, src: &[u8]) -> Result<()> {
        // SAFETY: `src` is borrowed until the stream is synchronised below.
        unsafe { self.copy_to_device(dst, src)? };
        self.synchronize()
    }

    /// Copies `src` into host memory `dst` and waits for the stream to pass the
    /// copy (and everything enqueued on it before).
    pub fn download_blocking(&self, dst: &mut [u8], src: DeviceSlice<'_>) -> Result<()> {
        // SAFETY: `dst` is borrowed mutably until the stream is synchronised below.
        unsafe { self.copy_to_host(dst, src)? };
        self.synchronize()
    }
}

fn same_length(dst: usize, src: usize) -> Result<()> {
    if dst == src {
        Ok(())
    } else {
        Err(error::invalid(
            "copy",
            format!("the destination has {dst} bytes and the source {src}"),
        ))
    }
}
