//! Device memory, pinned host memory, and views of either that name a byte range
//! and the device it lives on.
//!
//! Owned buffers ([`DeviceBuffer`], [`PinnedBuffer`]) are allocated once and freed
//! on drop. Kernels, copies and collectives take views ([`DeviceSlice`],
//! [`DeviceSliceMut`]), made from an owned buffer (borrowing it) or, unsafely,
//! from a raw pointer a host runtime owns (PyTorch hands over `data_ptr()`).
//!
//! Work enqueued on a stream outlives the borrow that enqueued it. Freeing device
//! memory waits for the device's outstanding work (`cuMemFree` synchronises), so
//! an owned buffer cannot be freed under a running kernel; memory a host runtime
//! owns is the host runtime's to keep alive (PyTorch's `record_stream`).

mod copy;
mod pinned;
mod registered;

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};

pub use pinned::PinnedBuffer;
pub use registered::HostRegistration;

use crate::device::Device;
use crate::error::{self, Result};

/// Device memory allocated with `cuMemAlloc`, zeroed once at allocation.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: Arc<Device>,
    ptr: CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    /// `bytes` bytes of zeroed device memory (at least 256-byte aligned, as
    /// `cuMemAlloc` guarantees). A zero-byte buffer allocates nothing.
    pub fn zeroed(device: &Arc<Device>, bytes: usize) -> Result<DeviceBuffer> {
        let _bound = device.bind()?;
        let mut ptr = 0;
        if bytes > 0 {
            // SAFETY: writes one device pointer; freed in Drop.
            error::driver("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) })?;
            // The memset runs on the legacy default stream, which a stream
            // made with `CU_STREAM_NON_BLOCKING` (every `Stream::new`, and
            // PyTorch's side streams) is not ordered after: without waiting
            // for it here, its zeros could land on top of a copy enqueued on
            // such a stream right after this returns.
            // SAFETY: the range was just allocated.
            let set = unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes) };
            let zeroed = error::driver("cuMemsetD8", set).and_then(|()| {
                // SAFETY: the null stream is the legacy default stream (these
                // are the driver's plain entry points, not the per-thread
                // `_ptsz` ones); waiting for it waits for the memset.
                let waited = unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) };
                error::driver("cuStreamSynchronize", waited)
            });
            if let Err(e) = zeroed {
                // SAFETY: allocated above and not yet handed out.
                unsafe { sys::cuMemFree_v2(ptr) };
                return Err(e);
            }
        }
        Ok(DeviceBuffer {
            device: Arc::clone(device),
            ptr,
            bytes,
        })
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device the buffer lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The raw device address, for interoperation.
    pub fn raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// A read view of the whole buffer.
    pub fn slice(&self) -> DeviceSlice<'_> {
        DeviceSlice {
            ptr: self.ptr,
            bytes: self.bytes,
            device: self.device.ordinal(),
            _borrow: PhantomData,
        }
    }

    /// A write view of the whole buffer.
    pub fn slice_mut(&mut self) -> DeviceSliceMut<'_> {
        DeviceSliceMut {
            ptr: self.ptr,
            bytes: self.bytes,
            device: self.device.ordinal(),
            _borrow: PhantomData,
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let _bound = match self.device.bind() {
            Ok(bound) => bound,
            Err(e) => {
                log::warn!("freeing {} bytes of device memory: {e}", self.bytes);
                return;
            }
        };
        // SAFETY: allocated in `zeroed`, freed once; cuMemFree waits for work
        // that may still use it.
        let status = unsafe { sys::cuMemFree_v2(self.ptr) };
        if let Err(e) = error::driver("cuMemFree", status) {
            log::warn!("freeing {} bytes of device memory: {e}", self.bytes);
        }
    }
}

/// A read-only byte range of device memory.
#[derive(Clone, Copy, Debug)]
pub struct DeviceSlice<'a> {
    ptr: CUdeviceptr,
    bytes: usize,
    device: u32,
    _borrow: PhantomData<&'a [u8]>,
}

/// A writable byte range of device memory.
#[derive(Debug)]
pub struct DeviceSliceMut<'a> {
    ptr: CUdeviceptr,
    bytes: usize,
    device: u32,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> DeviceSlice<'a> {
    /// A view of memory a host runtime owns.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + bytes` must be device memory of device `device` (or memory
    /// mapped into its address space), valid for reads for `'a` and until every
    /// operation enqueued through the view has completed, and not written
    /// meanwhile except through operations ordered with those reads.
    pub unsafe fn from_raw(ptr: CUdeviceptr, bytes: usize, device: &Device) -> DeviceSlice<'a> {
        DeviceSlice {
            ptr,
            bytes,
            device: device.ordinal(),
            _borrow: PhantomData,
        }
    }

    /// The view's length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device address of the first byte.
    pub fn raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The ordinal of the device the memory lives on.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The bytes `range` of this view; an error names the range when it does not
    /// fit.
    pub fn range(&self, range: Range<usize>) -> Result<DeviceSlice<'a>> {
        let (ptr, bytes) = subrange(self.ptr, self.bytes, range)?;
        Ok(DeviceSlice {
            ptr,
            bytes,
            device: self.device,
            _borrow: PhantomData,
        })
    }
}

impl<'a> DeviceSliceMut<'a> {
    /// A writable view of memory a host runtime owns.
    ///
    /// # Safety
    ///
    /// As [`DeviceSlice::from_raw`], valid for writes too, and not accessed
    /// meanwhile except through operations ordered with the ones enqueued through
    /// this view.
    pub unsafe fn from_raw(ptr: CUdeviceptr, bytes: usize, device: &Device) -> DeviceSliceMut<'a> {
        DeviceSliceMut {
            ptr,
            bytes,
            device: device.ordinal(),
            _borrow: PhantomData,
        }
    }

    /// The view's length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The device address of the first byte.
    pub fn raw(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The ordinal of the device the memory lives on.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// A read view of the same bytes, for as long as this one is borrowed.
    pub fn as_slice(&self) -> DeviceSlice<'_> {
        DeviceSlice {
            ptr: self.ptr,
            bytes: self.bytes,
            device: self.device,
            _borrow: PhantomData,
        }
    }

    /// The bytes `range` of this view, reborrowed.
    pub fn range(&mut self, range: Range<usize>) -> Result<DeviceSliceMut<'_>> {
        let (ptr, bytes) = subrange(self.ptr, self.bytes, range)?;
        Ok(DeviceSliceMut {
            ptr,
            bytes,
            device: self.device,
            _borrow: PhantomData,
        })
    }

    /// Splits the view in two at byte `mid`.
    pub fn split_at(self, mid: usize) -> Result<(DeviceSliceMut<'a>, DeviceSliceMut<'a>)> {
        if mid > self.bytes {
            return Err(error::invalid(
                "split point",
                format!("byte {mid} is past the end of a {}-byte view", self.bytes),
            ));
        }
        let part = |ptr, bytes| DeviceSliceMut {
            ptr,
            bytes,
            device: self.device,
            _borrow: PhantomData,
        };
        Ok((
            part(self.ptr, mid),
            part(self.ptr + mid as u64, self.bytes - mid),
        ))
    }
}

fn subrange(ptr: CUdeviceptr, len: usize, range: Range<usize>) -> Result<(CUdeviceptr, usize)> {
    if range.start > range.end || range.end > len {
        return Err(error::invalid(
            "range",
            format!("bytes {range:?} do not fit in a {len}-byte view"),
        ));
    }
    Ok((ptr + range.start as u64, range.end - range.start))
}

/// The device whose memory `ptr` points into, as the driver sees it: `None` for
/// host memory (pageable or pinned) and for addresses the driver does not know.
pub fn device_of_pointer(ptr: CUdeviceptr) -> Result<Option<u32>> {
    crate::probe::require(crate::Library::Cuda)?;
    let mut kind: u32 = 0;
    // SAFETY: writes one `CUmemorytype` (an unsigned int) for any address; an
    // address the driver does not know is an error, not undefined behaviour.
    let status = unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut kind).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        )
    };
    if status == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    error::driver("cuPointerGetAttribute", status)?;
    if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Ok(None);
    }
    let mut ordinal: i32 = -1;
    // SAFETY: writes one int for an address the driver knows (above).
    error::driver("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute(
            (&raw mut ordinal).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    })?;
    Ok(u32::try_from(ordinal).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subranges_are_checked_against_the_view() {
        assert_eq!(subrange(0x1000, 64, 16..48).unwrap(), (0x1010, 32));
        assert_eq!(subrange(0x1000, 64, 64..64).unwrap(), (0x1040, 0));
        let e = subrange(0x1000, 64, 60..65).unwrap_err().to_string();
        assert!(e.contains("60..65") && e.contains("64-byte"), "{e}");
        #[expect(clippy::reversed_empty_ranges, reason = "the case under test")]
        let reversed = 8..4;
        assert!(subrange(0x1000, 64, reversed).is_err());
    }
}
