//! A GPU's memory (the `cuda` feature): callers' tensors in device memory,
//! staged through the machine's staging buffers in host memory, which are
//! page-locked so that every copy between the two is asynchronous.
//!
//! This is the path of a fabric that cannot reach device memory (the tcp
//! provider): the fabric reads and writes the host staging buffers as it does
//! for host tensors, so reductions and conversions run there, on the host, where
//! the bytes already are. The device side runs each operation's device program
//! ([`super::program`]): enqueued whole by the caller's thread when the call is
//! accepted ([`DeviceSide::enqueue`]), each stage behind a gate word the engine
//! raises ([`DeviceSide::raise`]), each stage's end written by its stream into
//! an end word the engine reads ([`DeviceSide::poll`]). The engine's progress
//! thread makes no CUDA call.
//!
//! # Ordering with the caller's stream
//!
//! - **Start.** When an operation is submitted, an event is recorded on the
//!   caller's stream, and the caller's stream writes the operation's start
//!   word after it ([`DeviceSide::record_start`]). Every slice's program
//!   waits for that event before it touches the tensor, so the collective
//!   sees everything the caller enqueued before it and nothing of the
//!   operation runs earlier, whatever the engine opens; the engine reads the
//!   start word to start the stall timer only once the caller's stream is
//!   there ([`DeviceSide::started`]).
//! - **End.** The engine completes an operation once every stage that writes
//!   its tensor has ended, and then sets the operation's done word to `seq +
//!   1`. A caller's stream waits for the operation with `cuStreamWaitValue64`
//!   on that word: work enqueued after the wait runs once the result is in the
//!   tensor, again without a host wait. A failed operation sets its word too,
//!   once its program has ended, so that no stream waits forever and nothing
//!   writes the tensor after the caller's stream goes on; its
//!   [`Work`](crate::Work) reports the error, and the tensor's contents are
//!   then undefined. A caller asks to wait only for an operation not yet
//!   finished (`Engine::awaits_on_device`), so no stream waits on the word of
//!   an operation that finished before this device side existed.
//! - **Drop.** Dropping the device side opens every gate, waits (a bounded
//!   time) until every stream it owns has run to its end and every caller's
//!   stream has passed its waits on the words, and only then unpins the
//!   staging and frees the words; where that does not happen in time, it
//!   leaves them allocated, since a stream may still read them.
//!
//! Why no CUDA call on the progress path: a call that waits for the whole
//! device (freeing memory, pinning it, a kernel's first launch under lazy
//! module loading, NCCL's abort) holds the context until every stream has
//! drained, callers' streams waiting for an operation included. If the
//! engine's next step needed a CUDA call, those streams would never drain.
//! Here every stream depends only on words the engine writes without one.

use std::mem::ManuallyDrop;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use fairring_cuda::{
    Device, DeviceSlice, DeviceSliceMut, Event, HostFlags, HostRegistration, Stream, Timing,
};

use super::host::Host;
use super::placed::PlacedTensor;
use super::program::{
    self, ProgramItem, RELEASED, Stage, Stages, StagingAt, Unfinished, WordLayout,
};
use crate::error::{Error, Result};
use crate::shm::segment::{OPERATIONS as WORK_CAPACITY, operation_entry as slot_of};

/// A caller's tensor in device memory: `len` bytes at device address `ptr`,
/// of operation `seq`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceTensor {
    ptr: u64,
    len: usize,
    seq: u64,
}

impl DeviceTensor {
    /// `len` bytes at `ptr` for operation `seq`.
    pub(crate) fn new(ptr: u64, len: usize, seq: u64) -> DeviceTensor {
        DeviceTensor { ptr, len, seq }
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

/// The end of a stage: word `word` of the device side reaching `value`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceFence {
    word: usize,
    value: u64,
}

/// How long dropping a device side waits for the streams that read its
/// memory before it leaves that memory allocated instead: the communicator
/// finished or failed its operations before, so its own streams are done or
/// wait for a caller's stream that has yet to reach an operation's start.
const DRAIN_BOUND: Duration = Duration::from_secs(2);

/// The device half of a communicator that takes device tensors.
pub(crate) struct DeviceSide {
    device: Arc<Device>,
    /// One per staging buffer: the programs of the slices it takes.
    streams: Box<[Stream]>,
    /// Deliveries (a reduce-scatter's share, tensor to tensor).
    deliver: Stream,
    /// Per operation-table entry: recorded on the caller's stream at
    /// submission; every slice's program waits for it.
    starts: Box<[Event]>,
    layout: WordLayout,
    /// Taken only by `Drop`.
    words: Option<HostFlags>,
    /// Events recorded after waits enqueued on the done words, not yet seen
    /// passed.
    waits: Mutex<Vec<Event>>,
    /// The machine's staging buffers, where copies go; kept mapped past the
    /// drop where a stream may still copy into them.
    staging: ManuallyDrop<Host>,
    /// The staging buffers, page-locked. Taken only by `Drop`.
    registration: Option<HostRegistration>,
}

impl DeviceSide {
    /// A device side on device `ordinal` over `staging` (this rank's staging
    /// buffers), which page-locks the machine's staging buffers (every local
    /// rank's: a staged all-gather reads the others').
    pub(crate) fn new(ordinal: u32, staging: Host) -> Result<DeviceSide> {
        let device = Device::open(ordinal).map_err(cuda)?;
        if !device.supports_64_bit_stream_memory_ops() {
            return Err(Error::Gpu(format!(
                "GPU {ordinal} ({}) does not take 64-bit stream memory operations \
                 (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS), which its device \
                 programs wait and signal with",
                device.name()
            )));
        }
        let buffers = staging.buffers();
        let streams = (0..buffers)
            .map(|_| Stream::new(&device, true))
            .collect::<fairring_cuda::Result<Vec<_>>>()
            .map_err(cuda)?;
        let starts = (0..WORK_CAPACITY)
            .map(|_| Event::new(&device, Timing::Disabled))
            .collect::<fairring_cuda::Result<Vec<_>>>()
            .map_err(cuda)?;
        let layout = WordLayout::new(buffers as usize);
        let (region, len) = staging.machine_staging();
        // SAFETY: the region is the staging buffers of the machine's segment,
        // mapped for as long as `staging` (held here) keeps it.
        let registration =
            unsafe { HostRegistration::new(&device, region.as_ptr(), len) }.map_err(cuda)?;
        Ok(DeviceSide {
            deliver: Stream::new(&device, true).map_err(cuda)?,
            words: Some(HostFlags::new(&device, layout.count()).map_err(cuda)?),
            waits: Mutex::new(Vec::new()),
            device,
            streams: streams.into_boxed_slice(),
            starts: starts.into_boxed_slice(),
            layout,
            staging: ManuallyDrop::new(staging),
            registration: Some(registration),
        })
    }

    /// The device.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    fn words(&self) -> Result<&HostFlags> {
        self.words
            .as_ref()
            .ok_or_else(|| Error::internal("a device side holds its words until it drops", "none"))
    }

    /// Records operation `seq`'s start on the caller's `stream`: the event
    /// its programs wait for, and the start word after it.
    pub(crate) fn record_start(&self, seq: u64, stream: &Stream) -> Result<()> {
        self.starts[slot_of(seq)].record(stream).map_err(cuda)?;
        self.words()?
            .enqueue_write(stream, self.layout.started(seq), seq + 1)
            .map_err(cuda)
    }

    /// Whether the caller's stream has passed the start of `tensor`'s
    /// operation.
    pub(crate) fn started(&self, tensor: &DeviceTensor) -> Result<bool> {
        let word = self
            .words()?
            .get(self.layout.started(tensor.seq))
            .map_err(cuda)?;
        Ok(word > tensor.seq)
    }

    /// Makes `stream` wait, on the device, for operation `seq` to finish (the
    /// caller asks only while it has not: `Engine::awaits_on_device`).
    pub(crate) fn enqueue_wait(&self, seq: u64, stream: &Stream) -> Result<()> {
        self.words()?
            .enqueue_wait(stream, self.layout.done(seq), seq + 1)
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
            .words()
            .and_then(|w| w.raise(self.layout.done(seq), seq + 1).map_err(cuda));
        if let Err(e) = raised {
            log::error!("fairring: releasing the streams waiting for operation {seq}: {e}");
        }
    }

    /// Opens `stage` of the slice of generation `generation` in buffer
    /// `buffer` (see [`program::raised`]); the fence of its end.
    pub(crate) fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<DeviceFence> {
        self.check_buffer(buffer)?;
        let words = self.words()?;
        let gate = self.layout.gate(buffer);
        if let Some(value) =
            program::raised(words.get(gate).map_err(cuda)?, generation, stage, stages)?
        {
            // Raised, not set: a release (every gate to `RELEASED`) between
            // the read and this write is never undone.
            words.raise(gate, value).map_err(cuda)?;
        }
        Ok(self.stage_end(buffer, stage.value(generation)))
    }

    /// The fence that passes once buffer `buffer`'s end word reaches `value`.
    pub(crate) fn stage_end(&self, buffer: u32, value: u64) -> DeviceFence {
        DeviceFence {
            word: self.layout.end(buffer),
            value,
        }
    }

    /// The fence of operation `seq`'s delivery.
    pub(crate) fn delivery_end(&self, seq: u64) -> DeviceFence {
        DeviceFence {
            word: self.layout.delivery_end(seq),
            value: seq + 1,
        }
    }

    /// Opens operation `seq`'s delivery.
    pub(crate) fn raise_delivery(&self, seq: u64) -> Result<DeviceFence> {
        self.words()?
            .raise(self.layout.delivery_gate(seq), seq + 1)
            .map_err(cuda)?;
        Ok(self.delivery_end(seq))
    }

    /// Whether `fence` has passed: a read of host memory.
    pub(crate) fn poll(&self, fence: &DeviceFence) -> Result<bool> {
        Ok(self.words()?.get(fence.word).map_err(cuda)? >= fence.value)
    }

    /// Opens every gate: every stream runs to its end (the engine failed, or
    /// the device side drops).
    pub(crate) fn release(&self) {
        let Ok(words) = self.words() else {
            return;
        };
        let buffers = u32::try_from(self.streams.len()).unwrap_or(u32::MAX);
        let gates = (0..buffers)
            .map(|b| self.layout.gate(b))
            .chain((0..WORK_CAPACITY as u64).map(|s| self.layout.delivery_gate(s)));
        for gate in gates {
            if let Err(e) = words.set(gate, RELEASED) {
                log::error!("fairring: opening a device program's gate: {e}");
            }
        }
    }

    fn check_buffer(&self, buffer: u32) -> Result<()> {
        if (buffer as usize) < self.streams.len() {
            return Ok(());
        }
        Err(Error::internal(
            "every staging buffer has its stream",
            format!("buffer {buffer} of {}", self.streams.len()),
        ))
    }

    /// Enqueues operation `seq`'s program `items` on `tensor` (see
    /// [`program`]), its collectives through `collectives` (one call per
    /// stage's run of them, as one group on `stream`). On the caller's
    /// thread, as the call is accepted.
    pub(crate) fn enqueue(
        &self,
        tensor: &DeviceTensor,
        seq: u64,
        items: &[ProgramItem<PlacedTensor>],
        collectives: &EnqueueCollectives<'_>,
    ) -> std::result::Result<(), Unfinished> {
        let lost = |error: Error| Unfinished { error, ends: false };
        let words = self.words().map_err(lost)?;
        let mut left_out = None;
        let mut at: Option<(u32, u64)> = None;
        let mut stage = None;
        let mut staged = false;
        let mut i = 0;
        while i < items.len() {
            match &items[i] {
                &ProgramItem::Slice { buffer, generation } => {
                    self.check_buffer(buffer).map_err(lost)?;
                    at = Some((buffer, generation));
                    staged = false;
                }
                &ProgramItem::Stage { stage: s, gated } => {
                    let (b, g) = in_slice(at, seq).map_err(lost)?;
                    stage = Some(s);
                    if !staged {
                        // The slice's first stage touches the tensor: not
                        // before the caller's stream has reached the
                        // operation.
                        let start = &self.starts[slot_of(seq)];
                        self.streams[b as usize]
                            .wait(start)
                            .map_err(|e| lost(cuda(e)))?;
                    }
                    staged = true;
                    if gated {
                        words
                            .enqueue_wait(
                                &self.streams[b as usize],
                                self.layout.gate(b),
                                s.value(g),
                            )
                            .map_err(|e| lost(cuda(e)))?;
                    }
                }
                ProgramItem::ToStaging { tensor: range, to } => {
                    let (b, _) = in_slice(at, seq).map_err(lost)?;
                    // SAFETY: the slice's bytes of its operation's tensor (valid
                    // by the call's contract), and staging bytes nothing else
                    // touches while the stage runs (counters, the engine's gates).
                    unsafe { self.copy_in(b, tensor, range, *to) }.map_err(lost)?;
                }
                ProgramItem::FromStaging {
                    from,
                    tensor: range,
                } => {
                    let (b, _) = in_slice(at, seq).map_err(lost)?;
                    // SAFETY: as above.
                    unsafe { self.copy_out(b, *from, tensor, range) }.map_err(lost)?;
                }
                ProgramItem::Collective { .. } => {
                    let (b, _) = in_slice(at, seq).map_err(lost)?;
                    let run = items[i..]
                        .iter()
                        .take_while(|item| matches!(item, ProgramItem::Collective { .. }))
                        .count();
                    // A collective that cannot be enqueued (its communicator
                    // aborted) is left out: the stage still ends, and the
                    // operation fails.
                    if let Err(e) =
                        collectives(&self.streams[b as usize], tensor, &items[i..i + run])
                    {
                        left_out.get_or_insert(e);
                    }
                    i += run;
                    continue;
                }
                ProgramItem::StageEnd => {
                    let (b, g) = in_slice(at, seq).map_err(lost)?;
                    let s = stage.ok_or_else(|| lost(unordered(seq)))?;
                    // The slice's last stage writes the slice's end.
                    let value = match items.get(i + 1) {
                        Some(ProgramItem::SliceEnd) => program::slice_end(g),
                        _ => s.value(g),
                    };
                    words
                        .enqueue_write(&self.streams[b as usize], self.layout.end(b), value)
                        .map_err(|e| lost(cuda(e)))?;
                }
                ProgramItem::Done => {
                    let (b, _) = in_slice(at, seq).map_err(lost)?;
                    words
                        .enqueue_write(&self.streams[b as usize], self.layout.done(seq), seq + 1)
                        .map_err(|e| lost(cuda(e)))?;
                }
                ProgramItem::SliceEnd => {
                    let (b, g) = in_slice(at, seq).map_err(lost)?;
                    if !staged {
                        words
                            .enqueue_write(
                                &self.streams[b as usize],
                                self.layout.end(b),
                                program::slice_end(g),
                            )
                            .map_err(|e| lost(cuda(e)))?;
                    }
                    at = None;
                    stage = None;
                }
                ProgramItem::Deliver { from, to } => {
                    let PlacedTensor::Device(to) = to else {
                        return Err(lost(Error::internal(
                            "an operation's tensors all live in one kind of memory",
                            "a delivery from device memory to host memory",
                        )));
                    };
                    self.enqueue_delivery(seq, tensor, from.clone(), to)
                        .map_err(lost)?;
                }
            }
            i += 1;
        }
        match left_out {
            None => Ok(()),
            Some(error) => Err(Unfinished { error, ends: true }),
        }
    }

    /// Bytes `range` of `tensor` into the machine's staging at `to`, on
    /// buffer `buffer`'s stream.
    ///
    /// # Safety
    ///
    /// `tensor` is valid under its operation's contract, and nothing else
    /// touches the staging bytes while the copy runs.
    unsafe fn copy_in(
        &self,
        buffer: u32,
        tensor: &DeviceTensor,
        range: &Range<usize>,
        to: StagingAt,
    ) -> Result<()> {
        let at = tensor.at(range)?;
        let dst = self.staging.machine_bytes(to, range.len())?;
        // SAFETY: `at..at + len` lies within the tensor (checked), device
        // memory valid under its operation's contract.
        let src = unsafe { DeviceSlice::from_raw(at, range.len(), &self.device) };
        // SAFETY: page-locked staging bytes within the machine's buffers
        // (checked), untouched while the copy runs (this function's contract).
        let dst = unsafe { std::slice::from_raw_parts_mut(dst.as_ptr(), range.len()) };
        // SAFETY: as above.
        unsafe { self.streams[buffer as usize].copy_to_host(dst, src) }.map_err(cuda)
    }

    /// The machine's staging at `from` into bytes `range` of `tensor`, on
    /// buffer `buffer`'s stream.
    ///
    /// # Safety
    ///
    /// As for [`copy_in`](Self::copy_in), with the staging bytes
    /// unwritten while the copy runs.
    unsafe fn copy_out(
        &self,
        buffer: u32,
        from: StagingAt,
        tensor: &DeviceTensor,
        range: &Range<usize>,
    ) -> Result<()> {
        let at = tensor.at(range)?;
        let src: NonNull<u8> = self.staging.machine_bytes(from, range.len())?;
        // SAFETY: as in `copy_in`, for writes.
        let mut dst = unsafe { DeviceSliceMut::from_raw(at, range.len(), &self.device) };
        // SAFETY: as in `copy_in`.
        let src = unsafe { std::slice::from_raw_parts(src.as_ptr(), range.len()) };
        // SAFETY: as in `copy_in`.
        unsafe { self.streams[buffer as usize].copy_to_device(&mut dst, src) }.map_err(cuda)
    }

    /// Operation `seq`'s delivery: bytes `range` of `from` into `to`, from
    /// its start, on the deliveries' stream behind the operation's delivery
    /// gate.
    fn enqueue_delivery(
        &self,
        seq: u64,
        from: &DeviceTensor,
        range: Range<usize>,
        to: &DeviceTensor,
    ) -> Result<()> {
        let words = self.words()?;
        let src_at = from.at(&range)?;
        let dst_at = to.at(&(0..range.len()))?;
        // Never before the caller's stream reaches the operation, even where
        // a failure opens the gate early: its earlier work may use `to`.
        self.deliver
            .wait(&self.starts[slot_of(seq)])
            .map_err(cuda)?;
        words
            .enqueue_wait(&self.deliver, self.layout.delivery_gate(seq), seq + 1)
            .map_err(cuda)?;
        // SAFETY: both ranges lie within their tensors (checked), valid under
        // the operation's contract, which also keeps them apart.
        let src = unsafe { DeviceSlice::from_raw(src_at, range.len(), &self.device) };
        // SAFETY: as above.
        let mut dst = unsafe { DeviceSliceMut::from_raw(dst_at, range.len(), &self.device) };
        self.deliver.copy(&mut dst, src).map_err(cuda)?;
        words
            .enqueue_write(&self.deliver, self.layout.delivery_end(seq), seq + 1)
            .map_err(cuda)
    }

    /// Bytes `range` of `tensor`, as a view NCCL's calls take.
    ///
    /// # Safety
    ///
    /// Only for a program's collective, enqueued behind its stage's gate on
    /// bytes of the slice the operation's contract keeps valid.
    pub(crate) unsafe fn tensor_bytes(
        &self,
        tensor: &DeviceTensor,
        range: Range<usize>,
    ) -> Result<DeviceSliceMut<'_>> {
        let at = tensor.at(&range)?;
        // SAFETY: `at..at + len` lies within the tensor (checked), device
        // memory valid (this function's contract).
        Ok(unsafe { DeviceSliceMut::from_raw(at, range.len(), &self.device) })
    }

    /// Whether every stream this side owns has run what it holds, and every
    /// caller's stream has passed its waits on the words, within
    /// [`DRAIN_BOUND`].
    fn drained(&self) -> bool {
        let deadline = Instant::now() + DRAIN_BOUND;
        loop {
            let idle = self
                .streams
                .iter()
                .chain([&self.deliver])
                .all(|s| s.is_idle().unwrap_or(true));
            let waits = self.waits.lock().unwrap_or_else(PoisonError::into_inner);
            let passed = waits.iter().all(|e| e.is_complete().unwrap_or(true));
            drop(waits);
            if idle && passed {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// How a device side enqueues a stage's run of collectives: on the stream,
/// in place on bytes of the tensor, as one group.
pub(crate) type EnqueueCollectives<'a> =
    dyn Fn(&Stream, &DeviceTensor, &[ProgramItem<PlacedTensor>]) -> Result<()> + 'a;

/// The slice an item belongs to.
fn in_slice(at: Option<(u32, u64)>, seq: u64) -> Result<(u32, u64)> {
    at.ok_or_else(|| unordered(seq))
}

fn unordered(seq: u64) -> Error {
    Error::internal(
        "a device program's items come slice by slice, stage by stage",
        format!("operation {seq}"),
    )
}

impl Drop for DeviceSide {
    fn drop(&mut self) {
        // Every stream this side owns runs to its end, on whatever the
        // staging holds: no operation of it is open any more (the
        // communicator fails those it drops in flight first).
        self.release();
        let Some(words) = self.words.take() else {
            return;
        };
        // No caller's stream waits for anything any more.
        for seq in 0..WORK_CAPACITY as u64 {
            if let Err(e) = words.set(self.layout.done(seq), RELEASED) {
                log::error!("fairring: releasing the streams waiting on a device side: {e}");
            }
        }
        self.words = Some(words);
        if self.drained() {
            // Unpinned while still mapped, then let go.
            drop(self.registration.take());
            // SAFETY: dropped once, here, and never used again; no stream
            // copies into the buffers any more (drained).
            unsafe { ManuallyDrop::drop(&mut self.staging) };
            return;
        }
        // A stream still reads (or writes) the words or the staging: freeing
        // them now would let it touch freed memory. They stay allocated, as
        // do the events.
        log::warn!(
            "fairring: a stream still waits on a dropped communicator's device programs after \
             {DRAIN_BOUND:?}; leaving its staging mapped and page-locked and its {} words \
             allocated",
            self.layout.count()
        );
        std::mem::forget(self.words.take());
        std::mem::forget(self.registration.take());
        std::mem::forget(std::mem::take(
            self.waits.get_mut().unwrap_or_else(PoisonError::into_inner),
        ));
    }
}

/// A GPU layer error as the engine reports it.
pub(crate) fn cuda(e: fairring_cuda::Error) -> Error {
    Error::Gpu(e.to_string())
}
