//! Host memory someone else allocated, page-locked in place: the staging buffers a
//! fabric already registered (a machine's shared segment), made a target that
//! asynchronous copies overlap with.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys;

use crate::device::Device;
use crate::error::{self, Result};

/// `len` bytes of host memory at `ptr`, page-locked (`cuMemHostRegister`,
/// portable to every context) until this value drops.
///
/// It owns nothing but the registration: the memory stays its owner's, and
/// asynchronous copies into or out of it are the `unsafe`
/// [`Stream`](crate::Stream) copies, with their contracts.
#[derive(Debug)]
pub struct HostRegistration {
    device: Arc<Device>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the value holds a registration handle (the address); it reads or writes
// no memory itself.
unsafe impl Send for HostRegistration {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Page-locks `len` bytes at `ptr`. Refused, naming the argument, for a
    /// null pointer or no bytes; the driver's error otherwise (memory already
    /// registered, a range it cannot lock).
    ///
    /// # Safety
    ///
    /// `ptr` must point to `len` bytes of mapped host memory that stays mapped
    /// until this value is dropped.
    pub unsafe fn new(device: &Arc<Device>, ptr: *mut u8, len: usize) -> Result<HostRegistration> {
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| error::invalid("host memory", "a null pointer cannot be registered"))?;
        if len == 0 {
            return Err(error::invalid("host memory", "no bytes to register"));
        }
        let _bound = device.bind()?;
        // SAFETY: `len` mapped bytes at `ptr` (the caller's contract); the
        // registration is undone in Drop, before the memory may be unmapped.
        error::driver("cuMemHostRegister", unsafe {
            sys::cuMemHostRegister_v2(ptr.as_ptr().cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        })?;
        Ok(HostRegistration {
            device: Arc::clone(device),
            ptr,
            len,
        })
    }

    /// The registered bytes' address.
    pub fn as_ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    /// The registered bytes' length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no bytes are registered (never: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _bound = match self.device.bind() {
            Ok(bound) => bound,
            Err(e) => {
                log::warn!("unregistering {} bytes of host memory: {e}", self.len);
                return;
            }
        };
        // SAFETY: registered in `new`, unregistered once.
        let status = unsafe { sys::cuMemHostUnregister(self.ptr.as_ptr().cast()) };
        if let Err(e) = error::driver("cuMemHostUnregister", status) {
            log::warn!("unregistering {} bytes of host memory: {e}", self.len);
        }
    }
}
