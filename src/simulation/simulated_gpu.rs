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
//! - **words** are the device side's page-locked words: gates and ends per
//!   buffer, deliveries', starts and done words per operation-table entry.
//!   Items wait on a word (`cuStreamWaitValue64`) or write one
//!   (`cuStreamWriteValue64`); the host reads and writes them directly,
//!   which is no CUDA call;
//! - an **event** is a stream position: recorded at the stream's end, passed
//!   once the stream has run that far (an operation's start);
//! - a **copy** moves its bytes when it runs, reading its source then, as a
//!   DMA engine does;
//! - the caller **submits behind waits** as PyTorch does: its stream writes
//!   each input, records the operation's start and writes its start word,
//!   and may wait on the device for any operation it started;
//! - the **driver's device-wide waits**: at drawn times another thread of
//!   the process makes a call that waits for the whole device (PyTorch's
//!   allocator freeing memory, a kernel's first launch under lazy loading):
//!   it holds the context until every stream has run what it held then, and
//!   every CUDA call of another thread meanwhile blocks until it returns
//!   ([`Gpu::start_draining`]). A thread blocked in a call does nothing more
//!   until the wait ends; what it enqueues or writes then takes effect in
//!   order. NCCL's abort waits the same way, for its kernels;
//! - a **reaper** thread aborts the machine's collectives once the engine
//!   hands it that job (the communicator's is a thread it starts);
//! - the device side is **made** at the first device operation, as the
//!   communicator makes it; operations that finished before wrote no word.
//!
//! It checks what the device path promises: no stream waits forever once
//! the operations have settled (the simulation runs every stream out), and
//! nothing writes an operation's tensor after the caller's stream has passed
//! its wait for the operation ([`Gpu::violations`]).
//!
//! [`Design`] selects how the engine meets the device. The shipped design
//! enqueues every device step when the call is accepted. The others are
//! mutations kept to show what the model finds in them: the progress thread
//! enqueueing each stage as it opens it (the design before, whose engine
//! made CUDA calls as traffic arrived), a failing engine aborting the
//! machine's collectives on its own thread before it opens their gates, and
//! the reaper aborting the two communicators one after the other.

use std::collections::VecDeque;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use super::simulated_nccl::SimCollectives;
use crate::engine::work_table::{WORK_CAPACITY, slot_of};
use crate::error::{Error, Result};
use crate::memory::program::{
    self, Comm, MachineCall, ProgramItem, RELEASED, Stage, Stages, Unfinished, WordLayout,
};
use crate::memory::{Conversion, Host, HostTensor, MemorySpace, Reduction};

/// The machine's two communicators and the job's.
const ALL: [Comm; 3] = [Comm::Reduce, Comm::Gather, Comm::Job];

/// How the engine meets the device (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Design {
    /// Every device step enqueued when the call is accepted, behind gates
    /// the engine opens by writing host words: the shipped design.
    Accepted,
    /// The progress thread enqueues each stage when it opens it: a CUDA call
    /// on the progress path, as the design before made.
    IssuedByEngine,
    /// A failing engine aborts the machine's collectives on its progress
    /// thread before it opens their gates.
    AbortFirst,
    /// The reaper aborts the reduce communicator, waits for the device,
    /// then aborts the gather communicator.
    AbortOneByOne,
}

/// A thread of a rank's process, as the device model tells its CUDA calls
/// apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Thread {
    /// The engine's progress thread (and callers driving it).
    Progress = 0,
    /// The caller's thread: submissions and waits on the device.
    Caller = 1,
    /// The thread a failing engine hands NCCL's abort to.
    Reaper = 2,
}

/// One item of a stream.
#[derive(Clone, Copy, Debug)]
pub(super) enum Item {
    /// `len` bytes from address `from` to address `to`.
    Copy { to: usize, from: usize, len: usize },
    /// Until stream `stream` has run `at` items (a wait on an event).
    WaitFor { stream: usize, at: u64 },
    /// Until word `word` is at least `value`.
    WaitWord { word: usize, value: u64 },
    /// Writes `value` into word `word`.
    WriteWord { word: usize, value: u64 },
    /// Call `id` of a collective among the machine's ranks, which its
    /// [`Meeting`] resolves; `ungated` where its stage waits for no gate
    /// ([`program::ungated`]).
    Collective { id: u64, ungated: bool },
}

/// How a collective call reaches its meeting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arrival {
    /// On a gate its rank's engine opened, past the engine's checks.
    Opened,
    /// Ungated: as soon as its stream reached it, the engine's checks
    /// running beside it.
    Ungated,
    /// On a gate its rank's failing engine released: it runs whatever the
    /// other ranks issued.
    Released,
}

#[derive(Default)]
struct SimStream {
    items: VecDeque<Item>,
    /// Items ever enqueued, and run.
    enqueued: u64,
    run: u64,
}

/// What a blocked thread's calls do once it goes on.
#[derive(Clone, Copy, Debug)]
enum Deferred {
    Push(usize, Item),
    Set(usize, u64),
}

/// Items held back until the engine opens them ([`Design::IssuedByEngine`]):
/// enqueued once the buffer's gate reaches `key` (0: with the group before).
struct Held {
    key: u64,
    items: Vec<Item>,
}

/// One rank's GPU.
pub(super) struct Gpu {
    design: Design,
    /// The engine's streams (one per staging buffer, then the deliveries'),
    /// then the caller's.
    streams: Vec<SimStream>,
    layout: WordLayout,
    words: Vec<u64>,
    /// Whether the device side exists (made at the first device operation).
    made: bool,
    /// Where this GPU's collective calls meet the other ranks' calls.
    meeting: Option<Box<dyn Meeting>>,
    /// The engine failed and released every gate.
    released: bool,
    /// A call that waits for the whole device: how far each stream must run
    /// before it returns. Meanwhile it holds the context, and every other
    /// CUDA call waits for it.
    draining: Option<Vec<u64>>,
    /// The thread whose calls come in now (the schedule sets it).
    on: Thread,
    /// Threads blocked in a call behind `draining`, and what their calls do
    /// once it ends, in order.
    blocked: [bool; 3],
    deferred: Vec<Deferred>,
    /// [`Design::IssuedByEngine`]: per engine stream, the items its programs
    /// hold back until opened; per operation-table entry, its delivery's.
    held: Vec<VecDeque<Held>>,
    held_deliveries: Vec<Vec<Item>>,
    /// The device operations' tensors (address, length), by sequence number.
    tensors: Vec<(usize, usize)>,
    /// Operations whose caller's stream has passed a wait for them.
    passed: Vec<u64>,
    /// Writes into a tensor after its caller's stream passed the operation.
    violations: Vec<String>,
    /// Ungated collectives that met the other ranks' on this GPU.
    ungated_met: usize,
    /// The aborts the engine handed the reaper, in turn: each aborts its
    /// communicators at once, then waits for the device to drain.
    reaping: VecDeque<Vec<Comm>>,
}

/// Where a GPU's collective calls meet those of the other ranks of its
/// machine (`super::collectives`), as NCCL's kernels meet.
pub(super) trait Meeting: Send {
    /// Whether call `id`, at the head of its stream, can move on: arrive, or
    /// end.
    fn can_run(&self, id: u64) -> bool;
    /// Moves call `id` on, which reached it as `arrival` says; returns
    /// whether it ended (leaves its stream).
    fn run(&self, id: u64, arrival: Arrival) -> bool;
    /// Whether call `id` met the other ranks' (not ended by an abort).
    fn met(&self, id: u64) -> bool;
    /// The bytes call `id` writes on this rank (address, length).
    fn writes(&self, id: u64) -> (usize, usize);
    /// What call `id` is, for a report of what waits.
    fn describe(&self, id: u64) -> String;
    /// This rank aborts its communicator `comm`: every call of it on `comm`
    /// ends at once.
    fn abort(&self, comm: Comm);
}

impl Gpu {
    fn caller(&self) -> usize {
        self.streams.len() - 1
    }

    fn deliveries(&self) -> usize {
        self.streams.len() - 2
    }

    /// Whether a CUDA call of the current thread goes through now: not
    /// while a device-wide wait holds the context (the thread then blocks
    /// until it ends) or the thread is blocked already.
    fn call(&mut self) -> bool {
        let t = self.on as usize;
        if self.draining.is_some() || self.blocked[t] {
            self.blocked[t] = true;
            return false;
        }
        true
    }

    /// Enqueues `item` on `stream` (a CUDA call: deferred while the calling
    /// thread is blocked); returns the stream position after it.
    fn push(&mut self, stream: usize, item: Item) -> u64 {
        let proceeds = self.call();
        let s = &mut self.streams[stream];
        s.enqueued += 1;
        if proceeds {
            s.items.push_back(item);
        } else {
            self.deferred.push(Deferred::Push(stream, item));
        }
        s.enqueued
    }

    /// Raises word `word` to `value` from the host (no CUDA call; deferred
    /// while the writing thread is blocked in one).
    fn set(&mut self, word: usize, value: u64) {
        if self.blocked[self.on as usize] {
            self.deferred.push(Deferred::Set(word, value));
            return;
        }
        self.words[word] = self.words[word].max(value);
    }

    fn passed(&self, stream: usize, at: u64) -> bool {
        self.streams[stream].run >= at
    }

    /// Another thread of the process makes a call that waits for the whole
    /// device, if none is waiting already: it returns once every stream has
    /// run what it holds now.
    pub(super) fn start_draining(&mut self) {
        if self.draining.is_none() {
            self.draining = Some(self.streams.iter().map(|s| s.enqueued).collect());
        }
    }

    /// Ends the device-wide wait if every stream has run far enough: the
    /// threads blocked behind it go on, their calls taking effect in order.
    pub(super) fn settle_draining(&mut self) {
        let Some(until) = &self.draining else {
            return;
        };
        if self.streams.iter().zip(until).any(|(s, &at)| s.run < at) {
            return;
        }
        self.draining = None;
        self.blocked = [false; 3];
        for deferred in std::mem::take(&mut self.deferred) {
            match deferred {
                Deferred::Push(stream, item) => self.streams[stream].items.push_back(item),
                Deferred::Set(word, value) => self.words[word] = self.words[word].max(value),
            }
        }
    }

    /// The reaper runs the next abort the engine handed it, once its last
    /// has returned: the communicators' calls end at once (NCCL's abort sets
    /// its kernels' abort flag, host memory, before anything else), and the
    /// reaper then waits for the device to drain (NCCL's abort waits for its
    /// kernels), behind any device-wide wait already running.
    pub(super) fn reap(&mut self) {
        if self.blocked[Thread::Reaper as usize] {
            return;
        }
        if let Some(comms) = self.reaping.pop_front() {
            self.abort_now(Thread::Reaper, &comms);
        }
    }

    /// `thread` aborts the machine's communicators `comms`: their calls
    /// end, and the thread waits for the device to drain.
    fn abort_now(&mut self, thread: Thread, comms: &[Comm]) {
        if let Some(meeting) = &self.meeting {
            for &comm in comms {
                meeting.abort(comm);
            }
            self.start_draining();
            self.blocked[thread as usize] = true;
        }
    }

    /// Whether `thread` is blocked in a call (its next action waits).
    pub(super) fn blocks(&self, thread: Thread) -> bool {
        self.blocked[thread as usize] || (thread == Thread::Caller && self.draining.is_some())
    }

    /// Sets the thread whose calls come in next.
    pub(super) fn on_thread(&mut self, thread: Thread) {
        self.on = thread;
    }

    /// Whether the first item of `stream` can run.
    fn runnable(&self, stream: usize) -> bool {
        match self.streams[stream].items.front() {
            None => false,
            Some(Item::Copy { .. } | Item::WriteWord { .. }) => true,
            Some(&Item::WaitFor { stream: s, at }) => self.passed(s, at),
            Some(&Item::WaitWord { word, value }) => program::wait_passes(self.words[word], value),
            Some(&Item::Collective { id, .. }) => {
                self.meeting.as_ref().is_some_and(|m| m.can_run(id))
            }
        }
    }

    /// Records a write of `len` bytes at `to` that lands in the tensor of an
    /// operation whose caller's stream has passed it.
    fn check_write(&mut self, to: usize, len: usize, what: &str) {
        for &seq in &self.passed {
            let (at, bytes) = self.tensors[seq as usize];
            if len > 0 && to < at + bytes && at < to + len {
                self.violations.push(format!(
                    "{what} wrote operation {seq}'s tensor after its caller's stream passed it"
                ));
            }
        }
    }

    /// Runs the first item of `stream` if it can; returns whether it did.
    fn run_one(&mut self, stream: usize) -> bool {
        if !self.runnable(stream) {
            return false;
        }
        if let Some(&Item::Collective { id, ungated }) = self.streams[stream].items.front()
            && let Some(meeting) = &self.meeting
        {
            let (at, len) = meeting.writes(id);
            let arrival = match (self.released, ungated) {
                (true, _) => Arrival::Released,
                (false, true) => Arrival::Ungated,
                (false, false) => Arrival::Opened,
            };
            if !meeting.run(id, arrival) {
                // It arrived, and waits for the other ranks.
                return true;
            }
            self.ungated_met += usize::from(ungated && meeting.met(id));
            self.check_write(at, len, "a collective");
        }
        let caller = self.caller();
        let Some(item) = self.streams[stream].items.pop_front() else {
            return false;
        };
        match item {
            Item::Copy { to, from, len } => {
                self.check_write(to, len, &format!("a copy on stream {stream}"));
                // SAFETY: tensors or staging of the simulation, alive until
                // it ends; the engine (as CUDA's contract asks) touches
                // neither until the copy's stage has ended.
                unsafe { std::ptr::copy(from as *const u8, to as *mut u8, len) };
            }
            Item::WriteWord { word, value } => self.words[word] = value,
            Item::WaitWord { word, value } if stream == caller => {
                // The caller's stream goes on past operation `value - 1`.
                let seq = value - 1;
                if word == self.layout.done(seq) && (seq as usize) < self.tensors.len() {
                    self.passed.push(seq);
                }
            }
            _ => {}
        }
        self.streams[stream].run += 1;
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

    /// Runs every stream as far as it goes (device-wide waits ending, the
    /// reaper aborting, as they come); returns what still waits, if anything
    /// does.
    pub(super) fn run_out(&mut self) -> Option<String> {
        loop {
            self.settle_draining();
            self.reap();
            if self.run_any(|_| 0) {
                continue;
            }
            self.settle_draining();
            self.reap();
            if !(0..self.streams.len()).any(|s| self.runnable(s)) {
                break;
            }
        }
        self.waiting()
    }

    /// Writes into tensors after their callers' streams passed them.
    pub(super) fn violations(&self) -> &[String] {
        &self.violations
    }

    /// Whether operation `seq`'s done word lets a stream waiting for it go
    /// on.
    pub(super) fn done_written(&self, seq: u64) -> bool {
        self.words
            .get(self.layout.done(seq))
            .is_some_and(|&word| program::wait_passes(word, seq + 1))
    }

    /// How many ungated collectives met the other ranks' on this GPU (not
    /// ended by an abort).
    pub(super) fn ungated_met(&self) -> usize {
        self.ungated_met
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
                    (&Item::Collective { id, .. }, Some(m)) => {
                        format!("{name}: {}", m.describe(id))
                    }
                    _ => format!("{name}: {item:?}"),
                })
            })
            .collect();
        let draining = self.draining.as_ref().map(|until| {
            let at: Vec<u64> = self.streams.iter().map(|s| s.run).collect();
            format!(
                "a device-wide wait for stream positions {until:?} (at {at:?}; blocked \
                     threads {:?}, {} calls deferred)",
                self.blocked,
                self.deferred.len()
            )
        });
        let waits: Vec<String> = waits.into_iter().chain(draining).collect();
        (!waits.is_empty()).then(|| waits.join(", "))
    }

    /// Opens `stage` of the slice of generation `generation` in `buffer` (a
    /// host write; under [`Design::IssuedByEngine`] the stage's items are
    /// enqueued now, by the opening thread).
    fn raise(
        &mut self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<SimFence> {
        let gate = self.layout.gate(buffer);
        if let Some(value) = program::raised(self.words[gate], generation, stage, stages)? {
            self.set(gate, value);
            self.release_held(buffer as usize, value);
        }
        Ok(self.stage_end(buffer, stage.value(generation)))
    }

    /// [`Design::IssuedByEngine`]: enqueues the held items of `stream` its
    /// gate at `value` opens.
    fn release_held(&mut self, stream: usize, value: u64) {
        if self.design != Design::IssuedByEngine {
            return;
        }
        while self.held[stream].front().is_some_and(|h| h.key <= value) {
            if let Some(held) = self.held[stream].pop_front() {
                for item in held.items {
                    self.push(stream, item);
                }
            }
        }
    }

    fn stage_end(&self, buffer: u32, value: u64) -> SimFence {
        SimFence::Word {
            word: self.layout.end(buffer),
            value,
        }
    }
}

/// A device tensor: `len` bytes at `ptr` (host memory standing in for the
/// GPU's), of operation `seq`, whose start is the caller's stream's position
/// `start`.
#[derive(Clone, Copy, Debug)]
pub(super) struct DeviceTensor {
    ptr: usize,
    len: usize,
    start: u64,
    seq: u64,
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

/// The end of a step: passed, or a word reaching a value.
pub(super) enum SimFence {
    Passed,
    Word { word: usize, value: u64 },
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
        let buffers = host.buffers() as usize;
        let layout = WordLayout::new(buffers);
        let streams = (0..buffers + 2).map(|_| SimStream::default()).collect();
        SimMemory {
            host,
            gpu: SimGpu(Arc::new(Mutex::new(Gpu {
                design,
                streams,
                layout,
                words: vec![0; layout.count()],
                made: false,
                released: false,
                meeting: None,
                draining: None,
                on: Thread::Progress,
                blocked: [false; 3],
                deferred: Vec::new(),
                held: (0..buffers + 1).map(|_| VecDeque::new()).collect(),
                held_deliveries: vec![Vec::new(); WORK_CAPACITY],
                tensors: Vec::new(),
                passed: Vec::new(),
                violations: Vec::new(),
                ungated_met: 0,
                reaping: VecDeque::new(),
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

    /// The staging buffers, as the device side reaches them.
    pub(super) fn host(&self) -> &Host {
        &self.host
    }

    /// Where this GPU's collective calls meet the other ranks'.
    pub(super) fn meet_through(&self, meeting: Box<dyn Meeting>) {
        self.gpu().meeting = Some(meeting);
    }

    /// The caller's part of submitting device operation `seq` on `tensor`:
    /// its stream writes the input from `input` (the caller's earlier work),
    /// then records the operation's start and writes its start word. Makes
    /// the device side if it is not yet.
    pub(super) fn submit_device(&self, tensor: &mut [u8], input: &[u8], seq: u64) -> SimTensor {
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
        let word = gpu.layout.started(seq);
        gpu.push(
            caller,
            Item::WriteWord {
                word,
                value: seq + 1,
            },
        );
        let at = (tensor.as_mut_ptr() as usize, tensor.len());
        let index = seq as usize;
        if gpu.tensors.len() <= index {
            gpu.tensors.resize(index + 1, (0, 0));
        }
        gpu.tensors[index] = at;
        SimTensor::Device(DeviceTensor {
            ptr: at.0,
            len: at.1,
            start,
            seq,
        })
    }

    /// A device tensor of `into`, where operation `of`'s result delivers a
    /// share: written, as `of` is, only after its start.
    pub(super) fn device_share(&self, into: &mut [u8], of: &SimTensor) -> SimTensor {
        let SimTensor::Device(of) = of else {
            return SimTensor::Host(HostTensor::new(into.as_mut_ptr(), into.len()));
        };
        SimTensor::Device(DeviceTensor {
            ptr: into.as_mut_ptr() as usize,
            len: into.len(),
            ..*of
        })
    }

    /// The caller's stream waits on the device for operation `seq`, if the
    /// device side exists (otherwise the caller waits on the host, which the
    /// simulation leaves out); `pending` asks the engine whether it must.
    pub(super) fn enqueue_wait(&self, seq: u64, pending: impl FnOnce() -> bool) {
        if !self.gpu().made || !pending() {
            return;
        }
        let mut gpu = self.gpu();
        let caller = gpu.caller();
        let word = gpu.layout.done(seq);
        gpu.push(
            caller,
            Item::WaitWord {
                word,
                value: seq + 1,
            },
        );
    }
}

impl SimGpu {
    fn lock(&self) -> std::sync::MutexGuard<'_, Gpu> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `fence` has passed: a read of host memory.
    pub(super) fn poll(&self, fence: &SimFence) -> bool {
        match *fence {
            SimFence::Passed => true,
            SimFence::Word { word, value } => self.lock().words[word] >= value,
        }
    }

    /// Opens a stage (see [`Gpu::raise`]).
    pub(super) fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<SimFence> {
        self.lock().raise(buffer, generation, stage, stages)
    }

    /// The engine failed and opens every gate; under [`Design::AbortFirst`]
    /// its progress thread aborts the machine's collectives first, which
    /// waits for the device with the gates still closed.
    fn release(&self) {
        let mut gpu = self.lock();
        gpu.released = true;
        if gpu.design == Design::AbortFirst {
            let on = gpu.on;
            gpu.abort_now(on, &ALL);
        }
        let gates = (0..gpu.layout.buffers() as u32)
            .map(|b| gpu.layout.gate(b))
            .chain((0..WORK_CAPACITY as u64).map(|s| gpu.layout.delivery_gate(s)))
            .collect::<Vec<_>>();
        for gate in gates {
            gpu.set(gate, RELEASED);
        }
        let streams = gpu.held.len();
        for stream in 0..streams {
            gpu.release_held(stream, RELEASED);
        }
        if gpu.design == Design::IssuedByEngine {
            let deliveries = gpu.deliveries();
            for held in std::mem::take(&mut gpu.held_deliveries) {
                for item in held {
                    gpu.push(deliveries, item);
                }
            }
            gpu.held_deliveries = vec![Vec::new(); WORK_CAPACITY];
        }
    }

    /// The engine failed: the machine's collectives' abort goes to the
    /// reaper, both communicators at once (under [`Design::AbortFirst`] the
    /// progress thread did it; under [`Design::AbortOneByOne`] it aborts
    /// them in turn).
    pub(super) fn release_collectives(&self) {
        let mut gpu = self.lock();
        if gpu.meeting.is_none() {
            return;
        }
        match gpu.design {
            Design::AbortFirst => {}
            Design::AbortOneByOne => gpu
                .reaping
                .extend([vec![Comm::Reduce], vec![Comm::Gather, Comm::Job]]),
            Design::Accepted | Design::IssuedByEngine => gpu.reaping.push_back(ALL.to_vec()),
        }
    }

    /// Enqueues operation `seq`'s program on `tensor` (on the caller's
    /// thread, as the call is accepted): its copies between the tensor and
    /// `host`'s staging, its collectives through `collectives`.
    pub(super) fn enqueue(
        &self,
        tensor: &DeviceTensor,
        seq: u64,
        items: &[ProgramItem<SimTensor>],
        host: &Host,
        collectives: Option<&SimCollectives>,
    ) -> std::result::Result<(), Unfinished> {
        let lost = |error: Error| Unfinished { error, ends: false };
        let mut gpu = self.lock();
        let layout = gpu.layout;
        let caller = gpu.caller();
        // Built as held groups (one per stage, keyed by its gate value),
        // then enqueued at once or held, as the design says.
        let mut groups: Vec<(usize, Held)> = Vec::new();
        let mut at: Option<(u32, u64)> = None;
        let mut stage = None;
        let mut staged = false;
        let mut ungated = false;
        let bytes = |s: program::StagingAt, len| host.machine_bytes(s, len).map(NonNull::as_ptr);
        for (i, item) in items.iter().enumerate() {
            let (b, g) = at.unwrap_or((0, 0));
            let stream = b as usize;
            match item {
                &ProgramItem::Slice { buffer, generation } => {
                    if buffer as usize >= layout.buffers() {
                        return Err(lost(Error::internal(
                            "every staging buffer has its stream",
                            format!("buffer {buffer}"),
                        )));
                    }
                    at = Some((buffer, generation));
                    staged = false;
                }
                &ProgramItem::Stage { stage: s, gated } => {
                    stage = Some(s);
                    ungated = !gated;
                    let mut items = Vec::new();
                    if !staged {
                        // The slice's first stage touches the tensor.
                        items.push(Item::WaitFor {
                            stream: caller,
                            at: tensor.start,
                        });
                    }
                    staged = true;
                    if gated {
                        items.push(Item::WaitWord {
                            word: layout.gate(b),
                            value: s.value(g),
                        });
                    }
                    groups.push((
                        stream,
                        Held {
                            key: s.value(g),
                            items,
                        },
                    ));
                }
                ProgramItem::ToStaging { tensor: range, to } => {
                    let from = tensor.at(range).map_err(lost)?;
                    let to = bytes(*to, range.len()).map_err(lost)? as usize;
                    let len = range.len();
                    push_into(&mut groups, Item::Copy { to, from, len }, seq)?;
                }
                ProgramItem::FromStaging {
                    from,
                    tensor: range,
                } => {
                    let to = tensor.at(range).map_err(lost)?;
                    let from = bytes(*from, range.len()).map_err(lost)? as usize;
                    let len = range.len();
                    push_into(&mut groups, Item::Copy { to, from, len }, seq)?;
                }
                ProgramItem::Collective {
                    comm,
                    call,
                    tensor: range,
                } => {
                    let c = collectives.ok_or_else(|| {
                        lost(Error::internal(
                            "a device program holds collectives only where the machine has them",
                            format!("operation {seq}"),
                        ))
                    })?;
                    let at = tensor.at(range).map_err(lost)?;
                    let id = c.call(*comm, kind_of(*call), at, range.len());
                    push_into(&mut groups, Item::Collective { id, ungated }, seq)?;
                }
                ProgramItem::Done => {
                    let item = Item::WriteWord {
                        word: layout.done(seq),
                        value: seq + 1,
                    };
                    push_into(&mut groups, item, seq)?;
                }
                ProgramItem::StageEnd => {
                    let s = stage.ok_or_else(|| lost(unordered(seq)))?;
                    let value = match items.get(i + 1) {
                        Some(ProgramItem::SliceEnd) => program::slice_end(g),
                        _ => s.value(g),
                    };
                    let word = layout.end(b);
                    push_into(&mut groups, Item::WriteWord { word, value }, seq)?;
                }
                ProgramItem::SliceEnd => {
                    if !staged {
                        let item = Item::WriteWord {
                            word: layout.end(b),
                            value: program::slice_end(g),
                        };
                        groups.push((
                            stream,
                            Held {
                                key: 0,
                                items: vec![item],
                            },
                        ));
                    }
                    at = None;
                    stage = None;
                }
                ProgramItem::Deliver { from, to } => {
                    let SimTensor::Device(to) = to else {
                        return Err(lost(Error::internal(
                            "an operation's tensors all live in one kind of memory",
                            "a delivery from device memory to host memory",
                        )));
                    };
                    let src = tensor.at(from).map_err(lost)?;
                    let dst = to.at(&(0..from.len())).map_err(lost)?;
                    let items = vec![
                        // Never before the caller's stream reaches the
                        // operation, even where a failure opens the gate.
                        Item::WaitFor {
                            stream: caller,
                            at: tensor.start,
                        },
                        Item::WaitWord {
                            word: layout.delivery_gate(seq),
                            value: seq + 1,
                        },
                        Item::Copy {
                            to: dst,
                            from: src,
                            len: from.len(),
                        },
                        Item::WriteWord {
                            word: layout.delivery_end(seq),
                            value: seq + 1,
                        },
                    ];
                    let deliveries = gpu.deliveries();
                    groups.push((
                        deliveries,
                        Held {
                            key: u64::MAX,
                            items,
                        },
                    ));
                }
            }
        }
        let deliveries = gpu.deliveries();
        for (stream, held) in groups {
            if gpu.design != Design::IssuedByEngine {
                for item in held.items {
                    gpu.push(stream, item);
                }
            } else if stream == deliveries {
                gpu.held_deliveries[slot_of(seq)] = held.items;
            } else {
                gpu.held[stream].push_back(held);
                // Held groups behind an opened gate go now.
                let gate = gpu.words[layout.gate(stream as u32)];
                gpu.release_held(stream, gate);
            }
        }
        Ok(())
    }
}

/// Appends `item` to the last group.
fn push_into(
    groups: &mut [(usize, Held)],
    item: Item,
    seq: u64,
) -> std::result::Result<(), Unfinished> {
    match groups.last_mut() {
        Some((_, held)) => {
            held.items.push(item);
            Ok(())
        }
        None => Err(Unfinished {
            error: unordered(seq),
            ends: false,
        }),
    }
}

fn unordered(seq: u64) -> Error {
    Error::internal(
        "a device program's items come slice by slice, stage by stage",
        format!("operation {seq}"),
    )
}

/// What a machine's collective does, as the model's machine moves it.
fn kind_of(call: MachineCall) -> super::simulated_nccl::Kind {
    use super::simulated_nccl::Kind;
    match call {
        MachineCall::AllReduce { dtype, op } => Kind::AllReduce { dtype, op },
        MachineCall::ReduceScatter { dtype, op } => Kind::ReduceScatter { dtype, op },
        MachineCall::Reduce { dtype, op, root } => Kind::Reduce { dtype, op, root },
        MachineCall::Broadcast { root } => Kind::Broadcast { root },
    }
}

fn mixed(what: &str) -> Error {
    Error::internal(
        "an operation's tensors all live in one kind of memory",
        what.to_owned(),
    )
}

fn programmed(what: &str) -> Error {
    Error::internal(
        "a device tensor's copies are stages of its program",
        format!("{what} asked of the memory space"),
    )
}

impl MemorySpace for SimMemory {
    type Tensor = SimTensor;
    type Fence = SimFence;

    fn poll(&self, fence: &SimFence) -> Result<bool> {
        Ok(self.gpu.poll(fence))
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
            SimTensor::Device(_) => Err(programmed("a stage-in")),
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
            SimTensor::Device(_) => Err(programmed("a copy-out")),
        }
    }

    fn deliver(&self, from: &SimTensor, range: Range<usize>, to: &SimTensor) -> Result<SimFence> {
        match (from, to) {
            (SimTensor::Host(f), SimTensor::Host(t)) => {
                self.host.deliver(f, range, t)?;
                Ok(SimFence::Passed)
            }
            (SimTensor::Device(_), SimTensor::Device(_)) => Err(programmed("a delivery")),
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
            SimTensor::Device(t) => gpu.words[gpu.layout.started(t.seq)] > t.seq,
            SimTensor::Host(_) => true,
        })
    }

    fn completed(&self, seq: u64) {
        let mut gpu = self.gpu();
        if gpu.made {
            let word = gpu.layout.done(seq);
            gpu.set(word, seq + 1);
        }
    }

    fn on_device(&self, tensor: &SimTensor) -> bool {
        matches!(tensor, SimTensor::Device(_))
    }

    fn stage_end(&self, buffer: u32, value: u64) -> SimFence {
        self.gpu().stage_end(buffer, value)
    }

    fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: Stage,
        stages: Stages,
    ) -> Result<SimFence> {
        self.gpu.raise(buffer, generation, stage, stages)
    }

    fn delivery_end(&self, seq: u64) -> SimFence {
        let gpu = self.gpu();
        SimFence::Word {
            word: gpu.layout.delivery_end(seq),
            value: seq + 1,
        }
    }

    fn raise_delivery(&self, seq: u64) -> Result<SimFence> {
        let mut gpu = self.gpu();
        let word = gpu.layout.delivery_gate(seq);
        gpu.set(word, seq + 1);
        if gpu.design == Design::IssuedByEngine {
            let deliveries = gpu.deliveries();
            for item in std::mem::take(&mut gpu.held_deliveries[slot_of(seq)]) {
                gpu.push(deliveries, item);
            }
        }
        drop(gpu);
        Ok(self.delivery_end(seq))
    }

    fn release(&self) {
        self.gpu.release();
    }
}
