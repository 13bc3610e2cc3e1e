//! A GPU's memory (the `cuda` feature): callers' tensors in device memory,
//! staged through this rank's staging buffers in host memory, which are
//! page-locked so that every copy between the two is asynchronous.
//!
//! This is the path of a fabric that cannot reach device memory (the tcp
//! provider): the fabric reads and writes the host staging buffers as it does
//! for host tensors, so reductions and conversions run there, on the host, where
//! the bytes already are. The device side adds the copies between a tensor and
//! the staging buffers, each enqueued on the stream of the staging buffer it
//! touches and ended by an event the progress loop polls; nothing here waits
//! for the GPU.
//!
//! # Ordering with the caller's stream
//!
//! - **Start.** When an operation is submitted, an event is recorded on the
//!   caller's stream (`starts`, one per operation-table entry). The engine
//!   issues no copy of the operation before that event has passed, as the
//!   progress loop sees it ([`DeviceSide::started`], `cuEventQuery`). So the
//!   collective sees everything the caller enqueued before it, the caller's
//!   thread never waits, and the engine's streams never wait for a caller's:
//!   they hold only copies, which end whatever the callers' streams wait for
//!   (a caller's stream may wait for an operation the engine has yet to
//!   complete, and a copy waiting behind it would never end: a failing
//!   engine, which declares its operations failed only once their copies have
//!   ended, polling their fences, would never get there).
//! - **End.** The host completes an operation once every copy into its tensor
//!   has passed its event, and then sets the operation's word in `done` (pinned
//!   host memory the device can read) to `seq + 1`. A caller's stream waits for
//!   the operation with `cuStreamWaitValue64` on that word: work enqueued after
//!   the wait runs once the result is in the tensor, again without a host wait.
//!   A failed operation sets its word too, so that no stream waits forever; its
//!   [`Work`](crate::Work) reports the error, and the tensor's contents are
//!   then undefined. A caller asks to wait only for an operation not yet
//!   finished (`Engine::awaits_on_device`), so no stream waits on the word of
//!   an operation that finished before this device side existed.
//! - **Drop.** Dropping the device side raises every word past any value a
//!   stream can wait for, and frees the words only once every wait enqueued
//!   on them has been passed; otherwise it leaves them allocated (a page),
//!   since a stream may still read them.
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use fairring_cuda::{
    Device, DeviceSlice, DeviceSliceMut, Event, HostFlags, HostRegistration, Stream, Timing,
};

use crate::error::{Error, Result};
use crate::shm::segment::{OPERATIONS as WORK_CAPACITY, operation_entry as slot_of};

/// A caller's tensor in device memory: `len` bytes at device address `ptr`,
/// whose operation's start event is `starts[ready]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceTensor {
    ptr: u64,
    len: usize,
    ready: usize,
}

impl DeviceTensor {
    /// `len` bytes at `ptr` for the operation in table entry `ready`.
    pub(crate) fn new(ptr: u64, len: usize, ready: usize) -> DeviceTensor {
        DeviceTensor { ptr, len, ready }
    }

    /// The same memory, for the operation in table entry `ready`.
    pub(crate) fn for_operation(self, ready: usize) -> DeviceTensor {
        DeviceTensor { ready, ..self }
    }

    /// The device address of byte `range.start`, if `range` lies within.
    fn at(&self, range: &Range<usize>) -> Result<u64> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::internal(
                "tensor ranges lie within the tensor",
                format!("{range:?} of a device tensor of {} bytes", self.len),
            ));
        }
        Ok(self.ptr + range.start as u64)
    }
}

/// The end of copies enqueued on a stream: an event from the device side's
/// pool, given back when the fence drops.
pub(crate) struct DeviceFence {
    event: Option<Event>,
    pool: Arc<Mutex<Vec<Event>>>,
}

impl Drop for DeviceFence {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            self.pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(event);
        }
    }
}

/// Events a device side keeps ready for fences: enough for every step of
/// every buffer in flight without creating one.
const POOLED_FENCES: usize = 64;

/// The device half of a communicator that takes device tensors: made at its
/// first device operation, on the tensor's device.
pub(crate) struct DeviceSide {
    device: Arc<Device>,
    /// One per staging buffer: the copies of the slice it holds.
    streams: Box<[Stream]>,
    /// Deliveries (a reduce-scatter's share, tensor to tensor).
    deliver: Stream,
    /// Per operation-table entry: recorded on the caller's stream at submission.
    starts: Box<[Event]>,
    /// Per operation-table entry: `seq + 1` once operation `seq` finished.
    /// Taken only by `Drop`.
    done: Option<HostFlags>,
    /// Events recorded after waits enqueued on `done`, not yet seen passed.
    waits: Mutex<Vec<Event>>,
    fences: Arc<Mutex<Vec<Event>>>,
    /// The staging buffers, page-locked.
    _staging: HostRegistration,
}

impl DeviceSide {
    /// A device side on device `ordinal` for `buffers` staging buffers per
    /// rank, in `staging`: every local rank's staging buffers (this rank's
    /// and, for the all-gather of several ranks per machine, the others'),
    /// which it page-locks.
    pub(crate) fn new(
        ordinal: u32,
        buffers: u32,
        staging: (NonNull<u8>, usize),
    ) -> Result<DeviceSide> {
        let device = Device::open(ordinal).map_err(cuda)?;
        if !device.supports_64_bit_stream_memory_ops() {
            return Err(Error::Gpu(format!(
                "GPU {ordinal} ({}) does not take 64-bit stream memory operations \
                 (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS), which ordering \
                 streams after a collective needs",
                device.name()
            )));
        }
        let streams = (0..buffers)
            .map(|_| Stream::new(&device, true))
            .collect::<fairring_cuda::Result<Vec<_>>>()
            .map_err(cuda)?;
        let starts = (0..WORK_CAPACITY)
            .map(|_| Event::new(&device, Timing::Disabled))
            .collect::<fairring_cuda::Result<Vec<_>>>()
            .map_err(cuda)?;
        let fences = (0..POOLED_FENCES)
            .map(|_| Event::new(&device, Timing::Disabled))
            .collect::<fairring_cuda::Result<Vec<_>>>()
            .map_err(cuda)?;
        // SAFETY: the staging memory is the staging buffers of the machine's
        // segment, mapped for as long as the communicator (which drops this
        // device side first) lives.
        let registration = unsafe { HostRegistration::new(&device, staging.0.as_ptr(), staging.1) }
            .map_err(cuda)?;
        Ok(DeviceSide {
            deliver: Stream::new(&device, true).map_err(cuda)?,
            done: Some(HostFlags::new(&device, WORK_CAPACITY).map_err(cuda)?),
            waits: Mutex::new(Vec::new()),
            device,
            streams: streams.into_boxed_slice(),
            starts: starts.into_boxed_slice(),
            fences: Arc::new(Mutex::new(fences)),
            _staging: registration,
        })
    }

    /// The device.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Records operation `seq`'s start on the caller's `stream`.
    pub(crate) fn record_start(&self, seq: u64, stream: &Stream) -> Result<()> {
        self.starts[slot_of(seq)].record(stream).map_err(cuda)
    }

    fn done(&self) -> Result<&HostFlags> {
        self.done
            .as_ref()
            .ok_or_else(|| Error::internal("a device side holds its words until it drops", "none"))
    }

    /// Whether the caller's stream has passed the start of the operation
    /// `tensor` belongs to.
    pub(crate) fn started(&self, tensor: &DeviceTensor) -> Result<bool> {
        self.starts[tensor.ready].is_complete().map_err(cuda)
    }

    /// Makes `stream` wait, on the device, for operation `seq` to finish (the
    /// caller asks only while it has not: `Engine::awaits_on_device`).
    pub(crate) fn enqueue_wait(&self, seq: u64, stream: &Stream) -> Result<()> {
        self.done()?
            .enqueue_wait(stream, slot_of(seq), seq + 1)
            .map_err(cuda)?;
        // An event after the wait tells `Drop` when the stream no longer reads
        // the word. One already passed is recorded again, and the others
        // passed are dropped, so the list stays as long as the waits in
        // flight and a warm wait allocates nothing.
        let mut waits = self.waits.lock().unwrap_or_else(PoisonError::into_inner);
        let passed = |e: &Event| e.is_complete().unwrap_or(false);
        let after = match waits.iter().position(passed) {
            Some(i) => waits.swap_remove(i),
            None => Event::new(&self.device, Timing::Disabled).map_err(cuda)?,
        };
        waits.retain(|e| !passed(e));
        after.record(stream).map_err(cuda)?;
        waits.push(after);
        Ok(())
    }

    /// Operation `seq` finished: streams waiting for it go on.
    pub(crate) fn completed(&self, seq: u64) {
        let raised = self
            .done()
            .and_then(|done| done.raise(slot_of(seq), seq + 1).map_err(cuda));
        if let Err(e) = raised {
            log::error!("fairring: releasing the streams waiting for operation {seq}: {e}");
        }
    }

    /// Waits for every copy enqueued so far (the device side drops). The
    /// engine's streams hold only copies, issued once their operation's start
    /// had passed, so this waits for the copy engines alone, never for a
    /// caller's stream.
    fn drain(&self) {
        for stream in self.streams.iter().chain([&self.deliver]) {
            if let Err(e) = stream.synchronize() {
                log::error!("fairring: draining a device stream: {e}");
            }
        }
    }

    /// The stream of staging buffer `buffer`: its slice's copies, and the
    /// machine's collectives (NCCL) of that slice.
    pub(crate) fn stream(&self, buffer: u32) -> Result<&Stream> {
        self.streams.get(buffer as usize).ok_or_else(|| {
            Error::internal(
                "every staging buffer has its stream",
                format!("buffer {buffer} of {}", self.streams.len()),
            )
        })
    }

    /// An event recorded on `stream` now.
    fn fence(&self, stream: &Stream) -> Result<DeviceFence> {
        let pooled = self
            .fences
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let event = match pooled {
            Some(e) => e,
            None => Event::new(&self.device, Timing::Disabled).map_err(cuda)?,
        };
        event.record(stream).map_err(cuda)?;
        Ok(DeviceFence {
            event: Some(event),
            pool: Arc::clone(&self.fences),
        })
    }

    /// A fence after everything enqueued so far on buffer `buffer`'s stream.
    pub(crate) fn fence_on(&self, buffer: u32) -> Result<DeviceFence> {
        self.fence(self.stream(buffer)?)
    }

    /// Bytes `range` of `tensor`, as a view the GPU layer's calls take.
    ///
    /// # Safety
    ///
    /// The engine calls it only once the operation's start has passed, for
    /// bytes no other call of the engine writes until the work it enqueues
    /// with the view has ended; `tensor` is valid under its operation's
    /// contract.
    pub(crate) unsafe fn tensor_bytes(
        &self,
        tensor: &DeviceTensor,
        range: Range<usize>,
    ) -> Result<DeviceSliceMut<'_>> {
        let at = tensor.at(&range)?;
        // SAFETY: `at..at + len` lies within the tensor (checked), device
        // memory valid and not written elsewhere (this function's contract).
        Ok(unsafe { DeviceSliceMut::from_raw(at, range.len(), &self.device) })
    }

    /// Whether `fence` has passed.
    pub(crate) fn poll(&self, fence: &DeviceFence) -> Result<bool> {
        match &fence.event {
            Some(e) => e.is_complete().map_err(cuda),
            None => Ok(true),
        }
    }

    /// Copies bytes `from` of `tensor` into `staging` (host memory of staging
    /// buffer `buffer`), on that buffer's stream. The engine calls it only once
    /// the operation's start has passed ([`started`](Self::started)).
    ///
    /// # Safety
    ///
    /// `staging` is page-locked staging memory that nothing reads or writes
    /// until the returned fence has passed; `tensor` is valid under its
    /// operation's contract.
    pub(crate) unsafe fn copy_to_staging(
        &self,
        buffer: u32,
        staging: &mut [u8],
        tensor: &DeviceTensor,
        from: Range<usize>,
    ) -> Result<DeviceFence> {
        let stream = self.stream(buffer)?;
        let at = tensor.at(&from)?;
        // SAFETY: `at..at + len` lies within the tensor (checked), device memory
        // valid under its operation's contract.
        let src = unsafe { DeviceSlice::from_raw(at, from.len(), &self.device) };
        // SAFETY: nothing touches `staging` until the fence passes (this
        // function's contract).
        unsafe { stream.copy_to_host(staging, src) }.map_err(cuda)?;
        self.fence(stream)
    }

    /// Copies `staging` (host memory of staging buffer `buffer`) into bytes
    /// `to` of `tensor`, on that buffer's stream, once the operation's start
    /// has passed.
    ///
    /// # Safety
    ///
    /// As for [`copy_to_staging`](Self::copy_to_staging).
    pub(crate) unsafe fn copy_from_staging(
        &self,
        buffer: u32,
        staging: &[u8],
        tensor: &DeviceTensor,
        to: Range<usize>,
    ) -> Result<DeviceFence> {
        let stream = self.stream(buffer)?;
        let at = tensor.at(&to)?;
        // SAFETY: as in `copy_to_staging`, for writes.
        let mut dst = unsafe { DeviceSliceMut::from_raw(at, to.len(), &self.device) };
        // SAFETY: as in `copy_to_staging`.
        unsafe { stream.copy_to_device(&mut dst, staging) }.map_err(cuda)?;
        self.fence(stream)
    }

    /// Copies bytes `range` of `from` into `to`, from its start.
    pub(crate) fn deliver(
        &self,
        from: &DeviceTensor,
        range: Range<usize>,
        to: &DeviceTensor,
    ) -> Result<DeviceFence> {
        let src_at = from.at(&range)?;
        let dst_at = to.at(&(0..range.len()))?;
        // SAFETY: both ranges lie within their tensors (checked), valid under
        // the operation's contract, which also keeps them apart.
        let src = unsafe { DeviceSlice::from_raw(src_at, range.len(), &self.device) };
        // SAFETY: as above.
        let mut dst = unsafe { DeviceSliceMut::from_raw(dst_at, range.len(), &self.device) };
        self.deliver.copy(&mut dst, src).map_err(cuda)?;
        self.fence(&self.deliver)
    }
}

impl Drop for DeviceSide {
    fn drop(&mut self) {
        // No copy of the engine's writes a tensor once streams waiting for
        // its operations go on.
        self.drain();
        let Some(done) = self.done.take() else {
            return;
        };
        // No stream waits for anything any more: every word past every value.
        for slot in 0..done.len() {
            if let Err(e) = done.raise(slot, u64::MAX) {
                log::error!("fairring: releasing the streams waiting on a device side: {e}");
            }
        }
        let waits = std::mem::take(self.waits.get_mut().unwrap_or_else(PoisonError::into_inner));
        let read_by_a_stream = waits.iter().any(|e| !e.is_complete().unwrap_or(false));
        if read_by_a_stream {
            // A caller's stream has yet to pass a wait on these words, and it
            // reads them when it does: freeing them now would let it read
            // freed memory. They stay allocated, as do the events.
            log::warn!(
                "fairring: a stream still waits on a dropped communicator's operations; \
                 leaving its {} words allocated",
                done.len()
            );
            std::mem::forget(done);
            std::mem::forget(waits);
        }
    }
}

/// A GPU layer error as the engine reports it.
pub(crate) fn cuda(e: fairring_cuda::Error) -> Error {
    Error::Gpu(e.to_string())
}
