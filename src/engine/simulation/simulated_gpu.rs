//! A simulated GPU behind the memory-space trait: what the simulation's ranks
//! run their device operations on, so that the ordering and failure logic of
//! the device path is checked on every seed, on machines without a GPU.
//!
//! It is the device side of the communicator (`crate::memory::device_side`) with
//! the CUDA driver replaced by a model:
//!
//! - **streams** are ordered queues of items that run one at a time, when the
//!   simulation's schedule picks them (so copies end at drawn times): the
//!   engine's streams (one per staging buffer, one for deliveries) and the
//!   caller's stream;
//! - an **event** is a stream position: recorded at the stream's end, passed
//!   once the stream has run that far (a step's fence, an operation's start);
//! - a **copy** moves its bytes when it runs, reading its source then, as a
//!   DMA engine does;
//! - a **wait on a done word** (`cuStreamWaitValue64`) holds its stream until
//!   the word reaches its value; the engine's completion raises the word;
//! - the caller **submits behind waits** as PyTorch does: its stream writes
//!   each input, records the operation's start, and may wait on the device
//!   for any operation it started;
//! - the device side is **made** at the first device operation, as the
//!   communicator makes it; operations that finished before wrote no word.
//!
//! [`Design`] selects how the engine meets the callers' streams. The shipped
//! design gates: a slice starts only once its operation's start has passed
//! ([`MemorySpace::started`]), so the engine's streams hold only copies, and a
//! caller waits only for an operation not yet finished. The other is the one
//! it replaced, kept to show what the simulation finds in it: the engine's
//! copies wait on the start event on the engine's streams, so a failing
//! engine, which declares its operations failed only once their copies have
//! ended, can wait for a copy that waits for a caller's stream that waits for
//! one of those operations: nothing settles.

use std::collections::VecDeque;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use super::super::work::{WORK_CAPACITY, slot_of};
use crate::error::{Error, Result};
use crate::memory::{Conversion, Host, HostTensor, MemorySpace, Reduction};

/// How the engine meets the callers' streams (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Design {
    /// The engine starts a slice once its operation's start has passed on the
    /// host; callers wait only for operations not yet finished.
    GateOnHost,
    /// The engine's copies wait on the start event on its own streams, and a
    /// caller's wait always waits on the word (the design before the gate).
    WaitOnStreams,
}

/// One item of a stream.
#[derive(Clone, Copy, Debug)]
pub(super) enum Item {
    /// `len` bytes from address `from` to address `to`.
    Copy { to: usize, from: usize, len: usize },
    /// Until stream `stream` has run `at` items (a wait on an event).
    WaitFor { stream: usize, at: u64 },
    /// Until done word `slot` is at least `value`.
    WaitWord { slot: usize, value: u64 },
    /// Call `id` of a collective among the machine's ranks, which its
    /// [`Meeting`] resolves.
    Collective(u64),
}

#[derive(Default)]
struct SimStream {
    items: VecDeque<Item>,
    /// Items ever enqueued, and run.
    enqueued: u64,
    run: u64,
}

/// One rank's GPU.
pub(super) struct Gpu {
    design: Design,
    /// The engine's streams (one per staging buffer, then the deliveries'),
    /// then the caller's.
    streams: Vec<SimStream>,
    /// Per operation-table entry: `seq + 1` once operation `seq` finished.
    words: Vec<u64>,
    /// Whether the device side exists (made at the first device operation).
    made: bool,
    /// Where this GPU's collective calls meet the other ranks' calls.
    meeting: Option<Box<dyn Meeting>>,
}

/// Where a GPU's collective calls meet those of the other ranks of its
/// machine (`super::collectives`), as NCCL's kernels meet.
pub(super) trait Meeting: Send {
    /// Whether call `id`, at the head of its stream, can move on: arrive, or
    /// end.
    fn can_run(&self, id: u64) -> bool;
    /// Moves call `id` on; returns whether it ended (leaves its stream).
    fn run(&self, id: u64) -> bool;
    /// What call `id` is, for a report of what waits.
    fn describe(&self, id: u64) -> String;
}

impl Gpu {
    fn caller(&self) -> usize {
        self.streams.len() - 1
    }

    fn deliveries(&self) -> usize {
        self.streams.len() - 2
    }

    fn push(&mut self, stream: usize, item: Item) -> u64 {
        let s = &mut self.streams[stream];
        s.items.push_back(item);
        s.enqueued += 1;
        s.enqueued
    }

    fn passed(&self, stream: usize, at: u64) -> bool {
        self.streams[stream].run >= at
    }

    /// Whether the first item of `stream` can run.
    fn runnable(&self, stream: usize) -> bool {
        match self.streams[stream].items.front() {
            None => false,
            Some(Item::Copy { .. }) => true,
            Some(&Item::WaitFor { stream: s, at }) => self.passed(s, at),
            Some(&Item::WaitWord { slot, value }) => self.words[slot] >= value,
            Some(&Item::Collective(id)) => self.meeting.as_ref().is_some_and(|m| m.can_run(id)),
        }
    }

    /// Runs the first item of `stream` if it can; returns whether it did.
    fn run_one(&mut self, stream: usize) -> bool {
        if !self.runnable(stream) {
            return false;
        }
        if let (Some(&Item::Collective(id)), Some(meeting)) =
            (self.streams[stream].items.front(), &self.meeting)
            && !meeting.run(id)
        {
            // It arrived, and waits for the other ranks.
            return true;
        }
        let s = &mut self.streams[stream];
        if let Some(Item::Copy { to, from, len }) = s.items.pop_front() {
            // SAFETY: tensors or staging of the simulation, alive until it ends;
            // the engine (as CUDA's contract asks) touches neither until the
            // copy's fence has passed.
            unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) };
        }
        s.run += 1;
        true
    }

    /// Runs one runnable item of the stream `pick` chooses among those that
    /// have one; returns whether any ran.
    pub(super) fn run_any(&mut self, pick: impl FnOnce(usize) -> usize) -> bool {
        let ready: Vec<usize> = (0..self.streams.len())
            .filter(|&s| self.runnable(s))
            .collect();
        if ready.is_empty() {
            return false;
        }
        self.run_one(ready[pick(ready.len()) % ready.len()])
    }

    /// Runs every stream as far as it goes; returns what still waits, if
    /// anything does.
    pub(super) fn run_out(&mut self) -> Option<String> {
        while self.run_any(|_| 0) {}
        self.waiting()
    }

    /// What the first item of each stream that has one is, if any has.
    pub(super) fn waiting(&self) -> Option<String> {
        let caller = self.caller();
        let waits: Vec<String> = self
            .streams
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let name = if i == caller {
                    "the caller's stream".to_owned()
                } else {
                    format!("engine stream {i}")
                };
                s.items.front().map(|item| match (item, &self.meeting) {
                    (&Item::Collective(id), Some(m)) => format!("{name}: {}", m.describe(id)),
                    _ => format!("{name}: {item:?}"),
                })
            })
            .collect();
        (!waits.is_empty()).then(|| waits.join(", "))
    }
}

/// A device tensor: `len` bytes at `ptr` (host memory standing in for the
/// GPU's), for the operation whose start is the caller's stream's position
/// `start`.
#[derive(Clone, Copy, Debug)]
pub(super) struct DeviceTensor {
    ptr: usize,
    len: usize,
    start: u64,
}

impl DeviceTensor {
    pub(super) fn at(&self, range: &Range<usize>) -> Result<usize> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::internal(
                "tensor ranges lie within the tensor",
                format!("{range:?} of a device tensor of {} bytes", self.len),
            ));
        }
        Ok(self.ptr + range.start)
    }
}

/// A tensor of the simulation's memory space.
#[derive(Clone, Copy, Debug)]
pub(super) enum SimTensor {
    Host(HostTensor),
    Device(DeviceTensor),
}

/// The end of a step: passed, or a position of an engine stream.
pub(super) enum SimFence {
    Passed,
    Device { stream: usize, at: u64 },
}

/// Host memory, and a simulated GPU for device tensors: the simulation's
/// [`Placed`](crate::memory::Placed).
pub(super) struct SimMemory {
    host: Host,
    gpu: SimGpu,
}

/// A rank's simulated GPU, shared by its memory space and its local step.
#[derive(Clone)]
pub(super) struct SimGpu(Arc<Mutex<Gpu>>);

impl SimMemory {
    pub(super) fn new(host: Host, design: Design) -> SimMemory {
        let streams = (0..host.buffers() as usize + 2)
            .map(|_| SimStream::default())
            .collect();
        SimMemory {
            host,
            gpu: SimGpu(Arc::new(Mutex::new(Gpu {
                design,
                streams,
                words: vec![0; WORK_CAPACITY],
                made: false,
                meeting: None,
            }))),
        }
    }

    pub(super) fn gpu(&self) -> std::sync::MutexGuard<'_, Gpu> {
        self.gpu.lock()
    }

    /// This memory's GPU, shared.
    pub(super) fn sim_gpu(&self) -> SimGpu {
        self.gpu.clone()
    }

    /// Where this GPU's collective calls meet the other ranks'.
    pub(super) fn meet_through(&self, meeting: Box<dyn Meeting>) {
        self.gpu().meeting = Some(meeting);
    }

    /// The caller's part of submitting a device operation on `words`: its
    /// stream writes the input from `input` (the caller's earlier work), then
    /// records the operation's start. Makes the device side if it is not yet.
    pub(super) fn submit_device(&self, tensor: &mut [u8], input: &[u8]) -> SimTensor {
        let mut gpu = self.gpu();
        gpu.made = true;
        let caller = gpu.caller();
        let start = gpu.push(
            caller,
            Item::Copy {
                to: tensor.as_mut_ptr() as usize,
                from: input.as_ptr() as usize,
                len: tensor.len().min(input.len()),
            },
        );
        SimTensor::Device(DeviceTensor {
            ptr: tensor.as_mut_ptr() as usize,
            len: tensor.len(),
            start,
        })
    }

    /// The caller's stream waits on the device for operation `seq`, if the
    /// device side exists (otherwise the caller waits on the host, which the
    /// simulation leaves out); `pending` asks the engine whether it must.
    pub(super) fn enqueue_wait(&self, seq: u64, pending: impl FnOnce() -> bool) {
        let mut gpu = self.gpu();
        if !gpu.made {
            return;
        }
        if gpu.design == Design::GateOnHost {
            drop(gpu);
            if !pending() {
                return;
            }
            gpu = self.gpu();
        }
        let caller = gpu.caller();
        gpu.push(
            caller,
            Item::WaitWord {
                slot: slot_of(seq),
                value: seq + 1,
            },
        );
    }
}

impl SimGpu {
    fn lock(&self) -> std::sync::MutexGuard<'_, Gpu> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enqueues `item` on stream `stream`.
    pub(super) fn push(&self, stream: usize, item: Item) {
        self.lock().push(stream, item);
    }

    /// Whether stream `stream` has run `at` items.
    pub(super) fn passed(&self, stream: usize, at: u64) -> bool {
        self.lock().passed(stream, at)
    }

    /// A fence at the end of stream `stream`.
    pub(super) fn end_of(&self, stream: usize) -> SimFence {
        let at = self.lock().streams[stream].enqueued;
        SimFence::Device { stream, at }
    }

    /// Enqueues a copy of `len` bytes on engine stream `stream`, after the
    /// start of `tensor`'s operation where the design waits for it there.
    fn copy(
        &self,
        stream: usize,
        tensor: &DeviceTensor,
        to: usize,
        from: usize,
        len: usize,
    ) -> SimFence {
        let mut gpu = self.lock();
        if gpu.design == Design::WaitOnStreams {
            let caller = gpu.caller();
            gpu.push(
                stream,
                Item::WaitFor {
                    stream: caller,
                    at: tensor.start,
                },
            );
        }
        let at = gpu.push(stream, Item::Copy { to, from, len });
        SimFence::Device { stream, at }
    }

    /// Copies bytes `from` of `tensor` into `staging` of buffer `buffer`.
    pub(super) fn copy_to_staging(
        &self,
        buffer: u32,
        staging: &mut [u8],
        tensor: &DeviceTensor,
        from: Range<usize>,
    ) -> Result<SimFence> {
        let src = tensor.at(&from)?;
        Ok(self.copy(
            buffer as usize,
            tensor,
            staging.as_mut_ptr() as usize,
            src,
            from.len(),
        ))
    }

    /// Copies `staging` of buffer `buffer` into bytes `to` of `tensor`.
    pub(super) fn copy_from_staging(
        &self,
        buffer: u32,
        staging: &[u8],
        tensor: &DeviceTensor,
        to: Range<usize>,
    ) -> Result<SimFence> {
        let dst = tensor.at(&to)?;
        Ok(self.copy(
            buffer as usize,
            tensor,
            dst,
            staging.as_ptr() as usize,
            to.len(),
        ))
    }
}

fn mixed(what: &str) -> Error {
    Error::internal(
        "an operation's tensors all live in one kind of memory",
        what.to_owned(),
    )
}

impl MemorySpace for SimMemory {
    type Tensor = SimTensor;
    type Fence = SimFence;

    fn poll(&self, fence: &SimFence) -> Result<bool> {
        Ok(match *fence {
            SimFence::Passed => true,
            SimFence::Device { stream, at } => self.gpu().passed(stream, at),
        })
    }

    fn stage_in(
        &self,
        buffer: u32,
        to: usize,
        tensor: &SimTensor,
        from: Range<usize>,
    ) -> Result<SimFence> {
        match tensor {
            SimTensor::Host(t) => {
                self.host.stage_in(buffer, to, t, from)?;
                Ok(SimFence::Passed)
            }
            SimTensor::Device(t) => {
                let staging = self.host.staging(buffer, to..to + from.len())?;
                self.gpu.copy_to_staging(buffer, staging, t, from)
            }
        }
    }

    fn reduce(&self, buffer: u32, _tensor: &SimTensor, reduction: &Reduction) -> Result<SimFence> {
        let host = HostTensor::new(std::ptr::null_mut(), 0);
        self.host.reduce(buffer, &host, reduction)?;
        Ok(SimFence::Passed)
    }

    fn reduce_in_tensor(
        &self,
        buffer: u32,
        tensor: &SimTensor,
        reduction: &Reduction,
    ) -> Result<SimFence> {
        match tensor {
            SimTensor::Host(t) => {
                self.host.reduce_in_tensor(buffer, t, reduction)?;
                Ok(SimFence::Passed)
            }
            SimTensor::Device(_) => Err(mixed("a reduction into device memory")),
        }
    }

    fn host_bytes(&self, tensor: &SimTensor) -> Option<(NonNull<u8>, usize)> {
        match tensor {
            SimTensor::Host(t) => t.host_bytes(),
            SimTensor::Device(_) => None,
        }
    }

    fn convert(
        &self,
        buffer: u32,
        _tensor: &SimTensor,
        conversion: &Conversion,
    ) -> Result<SimFence> {
        let host = HostTensor::new(std::ptr::null_mut(), 0);
        self.host.convert(buffer, &host, conversion)?;
        Ok(SimFence::Passed)
    }

    fn copy_out(
        &self,
        buffer: u32,
        from: usize,
        tensor: &SimTensor,
        to: Range<usize>,
    ) -> Result<SimFence> {
        match tensor {
            SimTensor::Host(t) => {
                self.host.copy_out(buffer, from, t, to)?;
                Ok(SimFence::Passed)
            }
            SimTensor::Device(t) => {
                let staging = self.host.staging(buffer, from..from + to.len())?;
                self.gpu.copy_from_staging(buffer, staging, t, to)
            }
        }
    }

    fn deliver(&self, from: &SimTensor, range: Range<usize>, to: &SimTensor) -> Result<SimFence> {
        match (from, to) {
            (SimTensor::Host(f), SimTensor::Host(t)) => {
                self.host.deliver(f, range, t)?;
                Ok(SimFence::Passed)
            }
            (SimTensor::Device(f), SimTensor::Device(t)) => {
                let src = f.at(&range)?;
                let dst = t.at(&(0..range.len()))?;
                let stream = self.gpu().deliveries();
                Ok(self.gpu.copy(stream, f, dst, src, range.len()))
            }
            _ => Err(mixed("a delivery between host and device memory")),
        }
    }

    fn registered(&self) -> (NonNull<u8>, usize) {
        self.host.registered()
    }

    fn buffer_bytes(&self) -> usize {
        self.host.buffer_bytes()
    }

    fn no_tensor(&self) -> SimTensor {
        SimTensor::Host(self.host.no_tensor())
    }

    fn started(&self, tensor: &SimTensor) -> Result<bool> {
        let gpu = self.gpu();
        Ok(match tensor {
            SimTensor::Device(t) if gpu.design == Design::GateOnHost => {
                gpu.passed(gpu.caller(), t.start)
            }
            _ => true,
        })
    }

    fn completed(&self, seq: u64) {
        let mut gpu = self.gpu();
        if gpu.made {
            let word = &mut gpu.words[slot_of(seq)];
            *word = (*word).max(seq + 1);
        }
    }
}
