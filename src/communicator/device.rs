//! Collectives on device tensors (the `cuda` feature): the same operations as on
//! host memory, ordered on the caller's CUDA stream.
//!
//! The semantics are those of PyTorch's NCCL backend:
//!
//! - an operation starts only after everything already enqueued on the caller's
//!   stream (an event recorded there when it is submitted; the engine's streams
//!   wait on it), and submitting never blocks the caller's thread on the GPU;
//! - its [`Work`] can make any stream wait for it on the device
//!   ([`Work::enqueue_wait`]), be waited on from the host, and be tested;
//! - the memory stays valid and unwritten by the caller until the operation
//!   completes, as for host tensors. One communicator serves host and device
//!   operations, and ranks that pass different kinds of memory to one operation
//!   fail with [`Error::Mismatch`].
//!
//! The data path is the engine's hierarchical algorithm (or the ring) with the
//! staging buffers in page-locked host memory, where the tcp fabric reads and
//! writes them: each slice is copied from the tensor to its staging buffer and
//! the result back, asynchronously, and the reduction runs on the host where
//! the bytes land. Device tensors take one rank per machine; with several, the
//! GPUs of a machine would reduce among themselves through NCCL, which the
//! engine does not drive yet.

use fairring_core::{DataType, ReduceOp};
use fairring_cuda::{DeviceSliceMut, Stream, device_of_pointer, sys};

use super::{Communicator, DeviceCall, Request, Scope, Work, check_pointer};
use crate::config::Algorithm;
use crate::error::{Error, Result};
use crate::memory::DeviceSide;

impl Communicator {
    /// Starts an all-reduce of `count` elements of `dtype` at device address
    /// `data`, in place, ordered on `stream`: it starts after everything
    /// already enqueued on `stream` (submitting never waits for the GPU), and
    /// [`Work::enqueue_wait`] makes a stream wait for its result on the
    /// device. `algorithm` overrides the communicator's.
    ///
    /// Device tensors take one rank per machine; the staging buffers are in
    /// page-locked host memory, where the tcp fabric reads and writes them,
    /// and the reduction runs there. A stream waiting for an operation blocks
    /// synchronising driver calls of its process (`cudaFree`,
    /// `cudaDeviceSynchronize`) until the operation finishes: as with NCCL,
    /// a thread must not make such a call while an operation it has yet to
    /// submit is awaited on the device.
    ///
    /// # Safety
    ///
    /// `data` must be device memory valid for reads and writes of `count`
    /// elements of `dtype`, aligned for `dtype`; `stream` a stream of the
    /// same device's primary context (or null: the legacy default stream).
    /// Neither the caller nor any stream may touch the memory, and the stream
    /// must stay alive, until the returned [`Work`] reports completion (a
    /// stream made to wait with [`Work::enqueue_wait`] may use it after).
    pub unsafe fn all_reduce_device_raw(
        &self,
        data: sys::CUdeviceptr,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        stream: sys::CUstream,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        if count == 0 {
            // No bytes: nothing to order on the stream, and every rank's call
            // (all pass no elements) runs as the same empty operation.
            // SAFETY: no memory is touched.
            return unsafe { self.all_reduce_raw(std::ptr::null_mut(), 0, dtype, op, algorithm) };
        }
        let ordinal = device_tensor(data, count, dtype)?;
        let mut r = Request::all_reduce(data as *mut u8, count, dtype, op, algorithm);
        r.device = Some(DeviceCall { ordinal, stream });
        // SAFETY: the caller keeps the memory and the stream valid and
        // untouched until the operation finishes.
        unsafe { self.start(r) }
    }

    /// The device side on GPU `ordinal`, made at the first device operation;
    /// refused for jobs with several ranks per machine.
    pub(super) fn device_side(&self, ordinal: u32) -> Result<&DeviceSide> {
        let d = self.topology.devices_per_machine();
        if d > 1 {
            return Err(Error::invalid(
                "data",
                format!(
                    "device tensors take one rank per machine, and this job has {d} on each: \
                     the GPUs of a machine would reduce among themselves through NCCL, which \
                     the engine does not drive yet (ranks sharing a machine can run as \
                     machines of their own: a distinct FAIRRING_HOST_ID each)"
                ),
            ));
        }
        self.engine.memory.device_on(ordinal)
    }
}

impl<'scope> Scope<'scope, '_> {
    /// Starts an all-reduce of `data`, device memory holding elements of
    /// `dtype`, in place, ordered on `stream`: it starts after the work
    /// already enqueued there, and [`Work::enqueue_wait`] orders later work
    /// after it.
    pub fn all_reduce_device(
        &'scope self,
        data: &'scope mut DeviceSliceMut<'_>,
        dtype: DataType,
        op: ReduceOp,
        stream: &'scope Stream,
    ) -> Result<Work<'scope>> {
        let size = usize::try_from(dtype.size_bytes()).unwrap_or(usize::MAX);
        if !data.len().is_multiple_of(size) {
            return Err(Error::invalid(
                "data",
                format!("{} bytes are not whole elements of {dtype}", data.len()),
            ));
        }
        if data.device() != stream.device().ordinal() {
            return Err(Error::invalid(
                "stream",
                format!(
                    "belongs to GPU {} and the data lies on GPU {}",
                    stream.device().ordinal(),
                    data.device()
                ),
            ));
        }
        let count = (data.len() / size) as u64;
        // SAFETY: `data` is borrowed mutably for 'scope, which does not end
        // before the operation finishes (the scope waits); `stream` is
        // borrowed as long.
        unsafe {
            self.comm.all_reduce_device_raw(
                data.raw(),
                count,
                dtype,
                op,
                stream.raw(),
                Some(self.comm.algorithm),
            )
        }
    }
}

impl Work<'_> {
    /// Makes `stream` wait, on the device, until the operation has finished:
    /// work enqueued on `stream` afterwards sees its result. The host does not
    /// wait. A failed operation releases the stream too (its result is then
    /// undefined; [`wait`](Work::wait) or [`test`](Work::test) report the
    /// error).
    pub fn enqueue_wait(&self, stream: &Stream) -> Result<()> {
        let Some(side) = self.engine.memory.device() else {
            // No device operation ran on this communicator: a host operation
            // has nothing on the device to wait for; wait on the host.
            return self.wait_timeout(self.engine.timeout);
        };
        for seq in self.first..=self.last {
            side.enqueue_wait(seq, stream)?;
        }
        Ok(())
    }
}

/// The GPU `data` lies on, for `count` (at least one) elements of `dtype`;
/// refused, naming `data`, if it is not device memory.
fn device_tensor(data: sys::CUdeviceptr, count: u64, dtype: DataType) -> Result<u32> {
    check_pointer(data as *mut u8, count, dtype)?;
    match device_of_pointer(data).map_err(crate::memory::cuda_error)? {
        Some(ordinal) => Ok(ordinal),
        None => Err(Error::invalid(
            "data",
            format!("{data:#x} is not device memory (host tensors take the host calls)"),
        )),
    }
}
