//! Page-locked host memory: staging for fabrics that cannot reach device memory,
//! and the only host memory asynchronous copies overlap with.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys;

use crate::device::Device;
use crate::error::{self, Result};

/// Pinned host memory (`cuMemHostAlloc`, portable to every context), zeroed.
///
/// The host reads and writes it through [`as_slice`](Self::as_slice) and
/// [`as_mut_slice`](Self::as_mut_slice); asynchronous copies to or from it are
/// `unsafe` because the host must not touch the range until they complete.
#[derive(Debug)]
pub struct PinnedBuffer {
    device: Arc<Device>,
    ptr: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; access goes
// through `&`/`&mut` like a `Box<[u8]>`.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `bytes` bytes of zeroed pinned memory. A zero-byte buffer allocates nothing.
    pub fn zeroed(device: &Arc<Device>, bytes: usize) -> Result<PinnedBuffer> {
        let _bound = device.bind()?;
        let mut ptr = NonNull::<u8>::dangling();
        if bytes > 0 {
            let mut raw = std::ptr::null_mut();
            // SAFETY: writes one host pointer to `bytes` bytes; freed in Drop.
            error::driver("cuMemHostAlloc", unsafe {
                sys::cuMemHostAlloc(&mut raw, bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
            })?;
            ptr = NonNull::new(raw.cast::<u8>()).ok_or_else(|| {
                error::invalid(
                    "pinned allocation",
                    "cuMemHostAlloc returned a null pointer",
                )
            })?;
            // SAFETY: `bytes` bytes were just allocated at `ptr`, and nothing
            // else refers to them yet.
            unsafe { ptr.as_ptr().write_bytes(0, bytes) };
        }
        Ok(PinnedBuffer {
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

    /// The bytes, for the host.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `bytes` initialised bytes at `ptr` (dangling but aligned when
        // empty), owned by `self`; no asynchronous copy may be in flight on them
        // (the copies' contracts).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    /// The bytes, for the host to write.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }

    /// The host address, for interoperation (a fabric registering the buffer).
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        let _bound = match self.device.bind() {
            Ok(bound) => bound,
            Err(e) => {
                log::warn!("freeing {} bytes of pinned memory: {e}", self.bytes);
                return;
            }
        };
        // SAFETY: allocated in `zeroed`, freed once.
        let status = unsafe { sys::cuMemFreeHost(self.ptr.as_ptr().cast()) };
        if let Err(e) = error::driver("cuMemFreeHost", status) {
            log::warn!("freeing {} bytes of pinned memory: {e}", self.bytes);
        }
    }
}
