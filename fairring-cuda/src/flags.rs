//! Words in pinned host memory that the host and streams write and wait on:
//! how a stream waits for work the host completes, and tells the host that
//! its own work is done, without either waiting for the other and without a
//! CUDA call on the side that reads.
//!
//! A stream waits (`cuStreamWaitValue64`) until a word reaches a value, and
//! the host writes that value when what the stream needs is in place; a
//! stream writes a word (`cuStreamWriteValue64`, after its earlier work, with
//! a memory barrier before it) and the host reads it to learn that the work
//! before it has ended.

use crate::sync::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};

use crate::device::Device;
use crate::error::{self, Result};
use crate::stream::Stream;

/// `count` 64-bit words of pinned, device-mapped host memory, zeroed.
#[derive(Debug)]
pub struct HostFlags {
    device: Arc<Device>,
    words: *mut AtomicU64,
    count: usize,
    /// The address the device reaches the words at.
    device_ptr: CUdeviceptr,
}

// SAFETY: the words are atomics in memory owned by this value until it drops.
unsafe impl Send for HostFlags {}
// SAFETY: as above; every access is atomic.
unsafe impl Sync for HostFlags {}

impl HostFlags {
    /// `count` zeroed words (at least one).
    pub fn new(device: &Arc<Device>, count: usize) -> Result<HostFlags> {
        if count == 0 {
            return Err(error::invalid("flags", "at least one word"));
        }
        let bytes = count
            .checked_mul(8)
            .ok_or_else(|| error::invalid("flags", format!("{count} words overflow")))?;
        let _bound = device.bind()?;
        let mut raw = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: writes one host pointer to `bytes` bytes; freed in Drop.
        error::driver("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut raw, bytes, flags)
        })?;
        if raw.is_null() {
            return Err(error::invalid(
                "flags",
                "cuMemHostAlloc returned a null pointer",
            ));
        }
        let words = raw.cast::<AtomicU64>();
        // SAFETY: `bytes` freshly allocated bytes, page-aligned, nothing else
        // refers to them yet.
        unsafe { words.cast::<u8>().write_bytes(0, bytes) };
        let mut device_ptr = 0;
        // SAFETY: writes one device address for memory allocated with
        // DEVICEMAP just above.
        let mapped = error::driver("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, raw, 0)
        });
        let flags = HostFlags {
            device: Arc::clone(device),
            words,
            count,
            device_ptr,
        };
        mapped?;
        Ok(flags)
    }

    /// The number of words.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether there are no words (never: `new` refuses that).
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn word(&self, index: usize) -> Result<&AtomicU64> {
        if index >= self.count {
            return Err(error::invalid(
                "flag index",
                format!("{index} of {} words", self.count),
            ));
        }
        // SAFETY: in bounds (checked) of the allocation.
        let word = unsafe { self.words.add(index) };
        // SAFETY: an initialised atomic word that lives as long as `self`.
        Ok(unsafe { &*word })
    }

    /// Sets word `index` to `value` (release: the host's writes before it are
    /// visible to whoever sees the value).
    pub fn set(&self, index: usize, value: u64) -> Result<()> {
        self.word(index)?.store(value, Ordering::Release);
        Ok(())
    }

    /// Raises word `index` to `value` if it is lower (a word only grows, so
    /// a late release of an earlier wait never lowers it under a later one).
    pub fn raise(&self, index: usize, value: u64) -> Result<()> {
        self.word(index)?.fetch_max(value, Ordering::AcqRel);
        Ok(())
    }

    /// Word `index`.
    pub fn get(&self, index: usize) -> Result<u64> {
        Ok(self.word(index)?.load(Ordering::Acquire))
    }

    /// Enqueues on `stream` a write of `value` into word `index`, once the
    /// work enqueued before it has ended; the stream's memory barrier before
    /// the write makes that work's writes (a copy into pinned host memory)
    /// visible to a host that reads the value with acquire. The host never
    /// waits.
    pub fn enqueue_write(&self, stream: &Stream, index: usize, value: u64) -> Result<()> {
        self.word(index)?;
        self.device
            .check_same("stream", stream.device().ordinal())?;
        let _bound = self.device.bind()?;
        let addr = self.device_ptr + index as u64 * 8;
        let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
        // The owner keeps `self` alive while a stream may write it (it reads
        // the written values before dropping its flags).
        // SAFETY: `addr` is word `index` (checked) of this live mapped allocation.
        error::driver("cuStreamWriteValue64", unsafe {
            sys::cuStreamWriteValue64_v2(stream.raw(), addr, value, flags)
        })
    }

    /// Enqueues on `stream` a wait until word `index` is at least `value`:
    /// work enqueued on `stream` afterwards runs only then. The host never
    /// waits.
    pub fn enqueue_wait(&self, stream: &Stream, index: usize, value: u64) -> Result<()> {
        self.word(index)?;
        self.device
            .check_same("stream", stream.device().ordinal())?;
        let _bound = self.device.bind()?;
        let addr = self.device_ptr + index as u64 * 8;
        let flags = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // The owner keeps `self` alive while a stream may wait on it (the
        // engine sets every awaited word before dropping its flags).
        // SAFETY: `addr` is word `index` (checked) of this live mapped allocation.
        error::driver("cuStreamWaitValue64", unsafe {
            sys::cuStreamWaitValue64_v2(stream.raw(), addr, value, flags)
        })
    }
}

impl Drop for HostFlags {
    fn drop(&mut self) {
        let _bound = match self.device.bind() {
            Ok(bound) => bound,
            Err(e) => {
                log::warn!("freeing host flags: {e}");
                return;
            }
        };
        // SAFETY: allocated in `new`, freed once.
        let status = unsafe { sys::cuMemFreeHost(self.words.cast()) };
        if let Err(e) = error::driver("cuMemFreeHost", status) {
            log::warn!("freeing host flags: {e}");
        }
    }
}
