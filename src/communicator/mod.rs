//! [`Communicator`]: the user-facing all-reduce.

mod bootstrap;
#[cfg(feature = "cuda")]
mod device;
mod fabric;
mod fusion;
mod server;

pub use fabric::Traffic;
pub use fusion::Fusion;
pub use server::Server;

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fairring_core::reduce::Element;
use fairring_core::topology::{Location, Topology};
use fairring_core::{DataType, ReduceOp, WireFormat};

use crate::config::{Algorithm, Config, FabricChoice};
use crate::engine::descriptor::{Collective, Descriptor};
use crate::engine::work::{Delivery, Submission, WORK_CAPACITY, slot_of};
use crate::engine::{Engine, choice};
use crate::error::{Error, Result};
#[cfg(feature = "cuda")]
use crate::memory::DeviceTensor;
use crate::memory::{HostTensor, MemoryKind, MemorySpace, Placed, PlacedTensor};
use crate::store::{PrefixStore, Store, TcpStoreServer};
use crate::sync::unmodelled::AtomicU8;
use fabric::AnyFabric;

/// The engine a communicator runs: host (and, with the `cuda` feature, device)
/// memory, on the fabric chosen at run time.
type WorkerEngine = Engine<AnyFabric, Placed>;

/// A group of ranks that all-reduce together.
///
/// Every rank of the job builds one (collectively: construction rendezvouses) and
/// then issues the same operations in the same order.
///
/// ```no_run
/// use fairring::{Communicator, ReduceOp};
///
/// let comm = Communicator::from_env()?;
/// let mut grads = vec![1.0f32; 1 << 20];
/// let mut more = vec![2.0f32; 1 << 20];
/// comm.scope(|s| -> fairring::Result<()> {
///     let a = s.all_reduce(&mut grads, ReduceOp::Sum)?;
///     let b = s.all_reduce(&mut more, ReduceOp::Avg)?; // in flight with `a`
///     a.wait()?;
///     b.wait()
/// })?;
/// # Ok::<(), fairring::Error>(())
/// ```
pub struct Communicator {
    engine: Arc<WorkerEngine>,
    progress: Option<JoinHandle<()>>,
    /// The next operation's sequence number; held while submitting, so that one
    /// rank's operations are numbered in the order they are queued.
    next_seq: Mutex<u64>,
    topology: Topology,
    location: Location,
    algorithm: Algorithm,
    wire: WireFormat,
    servers: u32,
    timeout: Duration,
    /// The byte each barrier all-reduces, per operation-table entry.
    barrier_bytes: Box<[AtomicU8]>,
    /// Makes the machine's NCCL communicators at the first device operation.
    #[cfg(feature = "cuda")]
    nccl: crate::local::NcclSetup,
    // Dropped last: other ranks may still be reading the store while this one
    // tears down. The job's keys, scoped as the rendezvous scoped them.
    #[cfg_attr(
        not(feature = "cuda"),
        expect(dead_code, reason = "read by the NCCL set-up")
    )]
    store: PrefixStore<Arc<dyn Store>>,
    _server: Option<TcpStoreServer>,
}

impl Communicator {
    /// Joins the job torchrun's environment describes (see [`Config`]).
    pub fn from_env() -> Result<Communicator> {
        Communicator::new(Config::from_env()?)
    }

    /// Joins the job of `config`, meeting through the TCP store rank 0 serves, or,
    /// under torchrun's agent store, through PyTorch's TCPStore that torchrun
    /// serves at the same address.
    pub fn new(config: Config) -> Result<Communicator> {
        refuse_server(&config)?;
        let (store, server) = bootstrap::job_store(&config)?;
        Communicator::build(config, store, server)
    }

    /// Joins the job of `config`, meeting through `store` (for instance the host
    /// runtime's own store).
    pub fn with_store(config: Config, store: Arc<dyn Store>) -> Result<Communicator> {
        refuse_server(&config)?;
        Communicator::build(config, store, None)
    }

    fn build(
        config: Config,
        store: Arc<dyn Store>,
        server: Option<TcpStoreServer>,
    ) -> Result<Communicator> {
        let scoped = bootstrap::scoped(&config, &store);
        let built = bootstrap::build(&config, &scoped)?;
        #[cfg(feature = "cuda")]
        let nccl = crate::local::NcclSetup {
            cell: built.nccl,
            choice: config.device_local,
            machine: built.location.machine,
            local_rank: built.location.device,
            local_ranks: built.topology.devices_per_machine(),
            timeout: config.timeout,
            making: Mutex::new(()),
        };
        let engine = Arc::new(built.engine);
        let progress = start_progress(&engine, format!("fairring-progress-{}", config.rank))?;
        Ok(Communicator {
            engine,
            progress: Some(progress),
            next_seq: Mutex::new(0),
            topology: built.topology,
            location: built.location,
            algorithm: config.algorithm,
            wire: config.wire,
            servers: config.servers,
            timeout: config.timeout,
            barrier_bytes: (0..WORK_CAPACITY).map(|_| AtomicU8::new(0)).collect(),
            #[cfg(feature = "cuda")]
            nccl,
            store: scoped,
            _server: server,
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.engine.rank()
    }

    /// Ranks in the job.
    pub fn world_size(&self) -> u32 {
        self.engine.world()
    }

    /// Machines and devices per machine, as the rendezvous found them.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// Where this rank runs.
    pub fn location(&self) -> Location {
        self.location
    }

    /// Staging buffers: how many slices can be in flight at once.
    pub fn staging_buffers(&self) -> u32 {
        self.engine.buffers
    }

    /// The fabric this rank runs on: [`FabricChoice::Tcp`] or
    /// [`FabricChoice::Verbs`] (`auto` resolved).
    pub fn fabric(&self) -> FabricChoice {
        self.engine.links.fabric.choice()
    }

    /// The data bytes this rank's fabric has written into peers and received
    /// from them so far (see [`Traffic`]).
    pub fn traffic(&self) -> Traffic {
        self.engine.links.fabric.traffic()
    }

    /// Dedicated reduction servers in the job (0: the machines serve).
    pub fn servers(&self) -> u32 {
        self.servers
    }

    /// How `f32` all-reduces and reduce-scatters travel between machines
    /// unless a call says otherwise (`FAIRRING_WIRE`).
    pub fn wire(&self) -> WireFormat {
        self.wire
    }

    /// Largest slice, in bytes.
    pub fn slice_bytes(&self) -> u64 {
        self.engine.geometry.full_slice_bytes()
    }

    /// All-reduces `data` in place and waits for it.
    pub fn all_reduce<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.scope(|s| s.all_reduce(data, op)?.wait())
    }

    /// Copies `data` of rank `root` into `data` of every rank, and waits.
    pub fn broadcast<T: Element>(&self, data: &mut [T], root: u32) -> Result<()> {
        self.scope(|s| s.broadcast(data, root)?.wait())
    }

    /// Gathers every rank's `input` into `output` (rank `r`'s at
    /// `r * input.len()`), and waits. `output` holds `world_size` inputs.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.scope(|s| s.all_gather(input, output)?.wait())
    }

    /// Reduces `input` across ranks and leaves share `rank` of the result in
    /// `output`, and waits. `input` holds `world_size` shares of `output.len()`
    /// elements and is used as workspace: afterwards its share `rank` holds the
    /// result too, and the rest is unspecified.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &mut [T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.scope(|s| s.reduce_scatter(input, output, op)?.wait())
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.scope(|s| s.barrier()?.wait())
    }

    /// All-reduces every tensor of `tensors` in place, and waits.
    ///
    /// The tensors are packed, in list order, into fusion buffers of one full
    /// slice each ([`Fusion`]): many small tensors become few full all-reduces.
    pub fn all_reduce_coalesced<T: Element>(
        &self,
        tensors: &mut [&mut [T]],
        op: ReduceOp,
    ) -> Result<()> {
        check_op(op, T::DTYPE)?;
        let buffer_bytes = usize::try_from(self.slice_bytes()).unwrap_or(usize::MAX);
        fusion::all_reduce_list(self, tensors, op, buffer_bytes)
    }

    /// Runs `f` with a [`Scope`] in which operations run asynchronously; when `f`
    /// returns, every operation started in the scope has finished.
    pub fn scope<'env, R>(
        &'env self,
        f: impl for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> R,
    ) -> R {
        let first = *self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        let scope = Scope {
            comm: self,
            first,
            _scope: PhantomData,
        };
        let out = f(&scope);
        scope.finish();
        out
    }

    /// Starts an all-reduce of `count` elements of `dtype` at `data`.
    ///
    /// # Safety
    ///
    /// `data` must be valid for reads and writes of `count` elements of `dtype`
    /// and aligned for `dtype`, and nothing else may access that memory until the
    /// returned [`Work`] reports completion (or is dropped, which waits).
    pub unsafe fn all_reduce_raw(
        &self,
        data: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        check_pointer(data, count, dtype)?;
        let seq = self.submit(Request::all_reduce(data, count, dtype, op, algorithm))?;
        Ok(Work::new(&self.engine, seq, seq))
    }

    /// Starts a broadcast of `count` elements of `dtype` at `data` from rank
    /// `root` (see [`Scope::broadcast`]).
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_raw`], for `data`.
    pub unsafe fn broadcast_raw(
        &self,
        data: *mut u8,
        count: u64,
        dtype: DataType,
        root: u32,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.broadcast_raw_with(data, count, dtype, root, None) }
    }

    /// [`Communicator::broadcast_raw`] with `algorithm` (`None`: the
    /// communicator's).
    ///
    /// # Safety
    ///
    /// As [`Communicator::broadcast_raw`].
    unsafe fn broadcast_raw_with(
        &self,
        data: *mut u8,
        count: u64,
        dtype: DataType,
        root: u32,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        self.check_root(root)?;
        check_pointer(data, count, dtype)?;
        let bytes = byte_len(count, dtype)?;
        // The all-reduce a broadcast otherwise runs as sums the other ranks'
        // zeros into the root's bytes, as does a relay over the machines inside
        // each; the relay over the ranks overwrites them.
        let summed = self.zero_fills(Collective::Broadcast, algorithm, bytes)?;
        if root != self.rank() && bytes > 0 && summed {
            // SAFETY: the caller guarantees `data` is valid for `bytes` bytes.
            unsafe { std::ptr::write_bytes(data, 0, bytes) };
        }
        // SAFETY: the caller keeps `data` valid and untouched until it finishes.
        unsafe {
            self.start(Request::broadcast(
                data, bytes, dtype, count, root, algorithm,
            ))
        }
    }

    /// Starts an all-gather of every rank's `count` elements of `dtype` at
    /// `input` into `output`, which holds `world_size * count` (see
    /// [`Scope::all_gather`]). `input` may lie anywhere, inside `output` too
    /// (at this rank's place, as an in-place all-gather passes it).
    ///
    /// # Safety
    ///
    /// `input` must be valid for reads of `count` elements until this call
    /// returns; `output` as `data` in [`Communicator::all_reduce_raw`], for
    /// `world_size * count` elements.
    pub unsafe fn all_gather_raw(
        &self,
        input: *const u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.all_gather_raw_with(input, output, count, dtype, None) }
    }

    /// [`Communicator::all_gather_raw`] with `algorithm` (`None`: the
    /// communicator's).
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_gather_raw`].
    unsafe fn all_gather_raw_with(
        &self,
        input: *const u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        let total = self.times_world(count)?;
        check_pointer(input.cast_mut(), count, dtype)?;
        check_pointer(output, total, dtype)?;
        let n = byte_len(count, dtype)?;
        let bytes = byte_len(total, dtype)?;
        let at = self.rank() as usize * n;
        // As in a broadcast, only the sums need the zeros.
        let summed = self.zero_fills(Collective::AllGather, algorithm, bytes)?;
        if bytes > 0 {
            // SAFETY: the caller guarantees `output` spans `bytes` bytes, of
            // which this rank's place `at..at + n` is a part.
            let place = unsafe { output.add(at) };
            // SAFETY: `input` spans `n` readable bytes and `place` `n` writable
            // ones; `copy` allows them to overlap. The input is in place before
            // the rest of `output` (where it may also lie) is zeroed.
            unsafe { std::ptr::copy(input, place, n) };
            if summed {
                // SAFETY: `0..at` lies within `output`.
                unsafe { std::ptr::write_bytes(output, 0, at) };
                // SAFETY: `at + n <= bytes`: the end of this rank's place.
                let rest = unsafe { place.add(n) };
                // SAFETY: `at + n..bytes` lies within `output`; `rest` is its start.
                unsafe { std::ptr::write_bytes(rest, 0, bytes - at - n) };
            }
        }
        // SAFETY: the caller keeps `output` valid and untouched until it finishes.
        unsafe { self.start(Request::all_gather(output, bytes, dtype, count, algorithm)) }
    }

    /// Starts a reduce-scatter: `input` holds `world_size * count` elements of
    /// `dtype`, reduced across ranks; this rank's `count` of the result are
    /// copied into `output` when it finishes. `input` is workspace (see
    /// [`Scope::reduce_scatter`]).
    ///
    /// # Safety
    ///
    /// As `data` in [`Communicator::all_reduce_raw`], for `input` and for
    /// `output`, which must not overlap.
    pub unsafe fn reduce_scatter_raw(
        &self,
        input: *mut u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Work<'_>> {
        // SAFETY: forwarded.
        unsafe { self.reduce_scatter_raw_with(input, output, count, dtype, op, None) }
    }

    /// [`Communicator::reduce_scatter_raw`] with `algorithm` (`None`: the
    /// communicator's).
    ///
    /// # Safety
    ///
    /// As [`Communicator::reduce_scatter_raw`].
    unsafe fn reduce_scatter_raw_with(
        &self,
        input: *mut u8,
        output: *mut u8,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Option<Algorithm>,
    ) -> Result<Work<'_>> {
        let total = self.times_world(count)?;
        check_pointer(input, total, dtype)?;
        check_pointer(output, count, dtype)?;
        let n = byte_len(count, dtype)?;
        let share = self.share(n);
        let to = PlacedTensor::Host(HostTensor::new(output, n));
        let r = Request::reduce_scatter(input, total, dtype, op, count, to, share, algorithm);
        // SAFETY: the caller keeps `input` and `output` valid and untouched
        // until it finishes; the delivered range lies within `input`.
        unsafe { self.start(r) }
    }

    /// Whether the callers of a broadcast or an all-gather (`collective`) of
    /// `bytes` with `algorithm` zero their tensors where their own bytes are
    /// not (see `engine::choice`).
    fn zero_fills(
        &self,
        collective: Collective,
        algorithm: Option<Algorithm>,
        bytes: usize,
    ) -> Result<bool> {
        let call = choice::Call {
            collective,
            dtype: DataType::U8,
            bytes: bytes as u64,
            algorithm,
            wire: None,
        };
        Ok(choice::choose(call, &self.job())?.zero_fill)
    }

    /// The job, as the choice of what a call runs sees it.
    fn job(&self) -> choice::Job {
        choice::Job {
            topology: self.topology,
            servers: self.servers,
            algorithm: self.algorithm,
            wire: self.wire,
        }
    }

    /// Refuses a root outside the job.
    fn check_root(&self, root: u32) -> Result<()> {
        let world = self.world_size();
        if root >= world {
            return Err(Error::invalid(
                "root",
                format!("rank {root} is not in a job of {world} ranks"),
            ));
        }
        Ok(())
    }

    /// This rank's bytes of a reduce-scatter's input, of `n` bytes per rank.
    fn share(&self, n: usize) -> Range<usize> {
        let offset = self.rank() as usize * n;
        offset..offset + n
    }

    /// `count` elements per rank, for every rank.
    fn times_world(&self, count: u64) -> Result<u64> {
        let world = u64::from(self.world_size());
        count.checked_mul(world).ok_or_else(|| {
            Error::invalid(
                "count",
                format!("{count} elements x {world} ranks overflow"),
            )
        })
    }

    /// Starts an all-reduce of every `(data, count)` in `tensors`, all of
    /// `dtype`, one operation each and all in flight at once; the returned
    /// [`Work`] covers them all.
    ///
    /// # Safety
    ///
    /// As `data` in [`Communicator::all_reduce_raw`], for every tensor; no two
    /// may overlap.
    pub unsafe fn all_reduce_coalesced_raw(
        &self,
        tensors: &[(*mut u8, u64)],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Work<'_>> {
        check_op(op, dtype)?;
        for (i, &(data, count)) in tensors.iter().enumerate() {
            check_pointer(data, count, dtype).map_err(|e| in_list(i, e))?;
        }
        self.group(tensors.len(), |i| {
            let (data, count) = tensors[i];
            // SAFETY: forwarded from the caller, per tensor.
            unsafe { self.all_reduce_raw(data, count, dtype, op, None) }
        })
    }

    /// Starts `n` operations, the `i`th with `start(i)`, and returns one
    /// [`Work`] covering them all. If one is refused (only a failed engine
    /// refuses after validation), those started are waited for and the error
    /// returned.
    fn group<'c>(
        &'c self,
        n: usize,
        mut start: impl FnMut(usize) -> Result<Work<'c>>,
    ) -> Result<Work<'c>> {
        let mut range: Option<(u64, u64)> = None;
        for i in 0..n {
            match start(i) {
                Ok(w) => {
                    let seq = w.first;
                    // Its entry is given back by the group's `Work`.
                    std::mem::forget(w);
                    range = Some(range.map_or((seq, seq), |(a, _)| (a, seq)));
                }
                Err(e) => {
                    // Only a failed engine refuses here; the group started so
                    // far is waited for and its entries given back.
                    if let Some((first, last)) = range {
                        drop(Work::new(&self.engine, first, last));
                    }
                    return Err(e);
                }
            }
        }
        Ok(match range {
            Some((first, last)) => Work::new(&self.engine, first, last),
            None => Work::empty(&self.engine),
        })
    }

    /// Starts a barrier: its [`Work`] finishes once every rank has entered it.
    pub fn start_barrier(&self) -> Result<Work<'_>> {
        let mut r = Request::all_reduce(std::ptr::null_mut(), 1, DataType::U8, ReduceOp::Sum, None);
        r.collective = Collective::Barrier;
        // SAFETY: the engine substitutes the communicator's own barrier byte.
        unsafe { self.start(r) }
    }

    /// Turns `work`, started on this communicator, into an [`OwnedWork`] that
    /// keeps the communicator alive: for runtimes that track operations by
    /// handle (the C ABI). The memory contract of the call that started it
    /// stays the caller's.
    pub fn own(self: &Arc<Self>, work: Work<'_>) -> Result<OwnedWork> {
        if !std::ptr::eq(work.engine, Arc::as_ptr(&self.engine)) {
            return Err(Error::invalid(
                "work",
                "was started on another communicator",
            ));
        }
        let (first, last) = (work.first, work.last);
        std::mem::forget(work);
        Ok(OwnedWork {
            comm: Arc::clone(self),
            first,
            last,
        })
    }

    /// Queues `r`.
    ///
    /// # Safety
    ///
    /// `r`'s memory must stay valid and untouched by the caller until the
    /// operation finishes.
    unsafe fn start(&self, r: Request) -> Result<Work<'_>> {
        let seq = self.submit(r)?;
        Ok(Work::new(&self.engine, seq, seq))
    }

    /// Validates a request (with no side effects when it is refused), assigns
    /// its sequence number and queues it.
    fn submit(&self, r: Request) -> Result<u64> {
        check_op(r.op, r.dtype)?;
        let bytes = r
            .elements
            .checked_mul(r.dtype.size_bytes())
            .filter(|&b| b <= isize::MAX as u64)
            .ok_or_else(|| {
                Error::invalid(
                    "count",
                    format!("{} elements of {} overflow", r.elements, r.dtype),
                )
            })?;
        if let Some(e) = self.engine.failure() {
            return Err(Error::Failed { first: Box::new(e) });
        }
        let chosen = choice::choose(
            choice::Call {
                collective: r.collective,
                dtype: r.dtype,
                bytes,
                algorithm: r.algorithm,
                wire: r.wire,
            },
            &self.job(),
        )?;
        #[cfg(feature = "cuda")]
        let device = match r.device {
            Some(call) => Some((self.device_side(call.ordinal)?, call)),
            None => None,
        };
        let (algorithm, wire) = (chosen.algorithm, chosen.wire);
        let elements = if chosen.plans_shares() {
            r.caller_elements
        } else {
            r.elements
        };
        let len = usize::try_from(bytes).map_err(|_| {
            Error::invalid("count", format!("{bytes} bytes do not fit this machine"))
        })?;
        let mut next = self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = *next;
        let start = Instant::now();
        while !self.engine.works.try_take(seq) {
            if let Some(e) = self.engine.failure() {
                return Err(Error::Failed { first: Box::new(e) });
            }
            if start.elapsed() > self.timeout {
                return Err(Error::timeout(
                    format!(
                        "a free operation slot ({WORK_CAPACITY} operations are outstanding; \
                         wait on or drop earlier ones)"
                    ),
                    self.timeout,
                ));
            }
            if !self.engine.try_drive() {
                std::thread::yield_now();
            }
        }
        let data = if r.collective == Collective::Barrier {
            self.barrier_bytes[slot_of(seq)].as_ptr()
        } else {
            r.data
        };
        let descriptor = Descriptor {
            collective: r.collective,
            dtype: r.caller_dtype,
            op: r.caller_op,
            algorithm,
            wire,
            memory: r.memory(),
            root: r.root,
            elements: r.caller_elements,
        };
        // Dedicated servers plan the operation from its descriptor alone.
        if descriptor.runs_as(self.topology.world_size()) != Some((elements, r.dtype, r.op)) {
            self.engine.works.give_back(seq);
            return Err(Error::internal(
                "a descriptor says which all-reduce its call runs as",
                format!("{descriptor} runs as {elements} x {} ({})", r.dtype, r.op),
            ));
        }
        let tensor = PlacedTensor::Host(HostTensor::new(data, len));
        #[cfg(feature = "cuda")]
        let (tensor, deliver) = match device {
            Some((side, call)) => {
                // SAFETY: the caller vouches for the stream (the device
                // calls' contract); the view lives only for this call.
                let stream = unsafe { fairring_cuda::Stream::from_raw(side.device(), call.stream) };
                // Every check has passed: from here the call is not refused,
                // so what it enqueues on the caller's stream is its own.
                // SAFETY: the prelude's ranges are the call's own device
                // memory (the device calls' contract, checked when it was made).
                let prelude = unsafe { call.prelude.enqueue(side, &stream) };
                if let Err(e) = prelude.and_then(|()| side.record_start(seq, &stream)) {
                    self.engine.works.give_back(seq);
                    return Err(e);
                }
                let slot = slot_of(seq);
                // A device delivery is ordered after this operation's start.
                let deliver = r.deliver.map(|d| Delivery {
                    to: match d.to {
                        PlacedTensor::Device(t) => PlacedTensor::Device(t.for_operation(slot)),
                        host => host,
                    },
                    range: d.range,
                });
                let tensor = PlacedTensor::Device(DeviceTensor::new(data as u64, len, slot));
                (tensor, deliver)
            }
            None => (tensor, r.deliver),
        };
        #[cfg(not(feature = "cuda"))]
        let deliver = r.deliver;
        let sub = Submission {
            seq,
            tensor,
            elements,
            dtype: r.dtype,
            op: r.op,
            algorithm,
            wire,
            descriptor,
            deliver,
        };
        if let Err(e) = self.engine.submit(sub) {
            #[cfg(feature = "cuda")]
            if r.device.is_some() {
                // The prelude and the start are on the caller's stream: the
                // call was accepted, and fails as an operation, so that its
                // work reports the error and streams waiting for it go on.
                self.engine.fail_accepted(seq, e);
                *next += 1;
                return Ok(seq);
            }
            self.engine.works.give_back(seq);
            return Err(e);
        }
        *next += 1;
        Ok(seq)
    }

    /// Fails every operation in flight and every later one with [`Error::Aborted`],
    /// and wakes every waiter. Callable from any thread.
    pub fn abort(&self) {
        self.engine.fail(Error::Aborted);
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        stop_progress(&self.engine, &mut self.progress);
        let operations = *self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        self.engine.say_goodbye(operations);
    }
}

/// Where asynchronous all-reduces live: see [`Communicator::scope`]. Operations
/// may borrow data for `'scope`; the scope ends only when all have finished.
pub struct Scope<'scope, 'env: 'scope> {
    comm: &'env Communicator,
    first: u64,
    _scope: PhantomData<&'scope mut &'scope ()>,
}

impl<'scope> Scope<'scope, '_> {
    /// Starts an all-reduce of `data` in place with the communicator's algorithm.
    pub fn all_reduce<T: Element>(
        &'scope self,
        data: &'scope mut [T],
        op: ReduceOp,
    ) -> Result<Work<'scope>> {
        self.all_reduce_with(data, op, self.comm.algorithm)
    }

    /// Starts an all-reduce of `data` in place with `algorithm`.
    pub fn all_reduce_with<T: Element>(
        &'scope self,
        data: &'scope mut [T],
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> Result<Work<'scope>> {
        let count = data.len() as u64;
        // SAFETY: `data` is borrowed mutably for 'scope, and the scope does not
        // end before the operation finishes (`finish` waits), even if the `Work`
        // is leaked; it is valid, aligned for `T` and of `count` elements.
        unsafe {
            self.comm.all_reduce_raw(
                data.as_mut_ptr().cast(),
                count,
                T::DTYPE,
                op,
                Some(algorithm),
            )
        }
    }

    /// Starts a hierarchical all-reduce of `data` in place whose values cross
    /// between machines in `wire` (see [`Config`]'s compressed wire for the
    /// precision it keeps). A compressed wire carries `f32` only: for any
    /// other type it is refused, naming `wire`. Every rank must ask for the
    /// same wire; the descriptor check compares it.
    pub fn all_reduce_on_wire<T: Element>(
        &'scope self,
        data: &'scope mut [T],
        op: ReduceOp,
        wire: WireFormat,
    ) -> Result<Work<'scope>> {
        check_pointer(data.as_mut_ptr().cast(), data.len() as u64, T::DTYPE)?;
        let mut r = Request::all_reduce(
            data.as_mut_ptr().cast(),
            data.len() as u64,
            T::DTYPE,
            op,
            Some(Algorithm::Hierarchical),
        );
        r.wire = Some(wire);
        // SAFETY: as in `all_reduce_with`: `data` is borrowed mutably for
        // 'scope, which does not end before the operation finishes.
        unsafe { self.comm.start(r) }
    }

    /// Starts a broadcast of `data` from rank `root` (see
    /// [`Communicator::broadcast`]) with the communicator's algorithm.
    ///
    /// With [`Algorithm::Ring`] it is a pipelined chain from the root around the
    /// ring, each byte sent once per hop. With [`Algorithm::Hierarchical`] it
    /// runs as a byte-wise wrapping-sum all-reduce to which every rank but the
    /// root contributes zeros, at twice the bytes per rank. `auto` picks the
    /// chain where the job has one rank per machine. Both are exact for every
    /// type (NaN payloads and negative zeros included).
    pub fn broadcast<T: Element>(
        &'scope self,
        data: &'scope mut [T],
        root: u32,
    ) -> Result<Work<'scope>> {
        self.broadcast_with(data, root, self.comm.algorithm)
    }

    /// Starts a broadcast of `data` from rank `root` with `algorithm` (see
    /// [`Scope::broadcast`]). Every rank must choose alike.
    pub fn broadcast_with<T: Element>(
        &'scope self,
        data: &'scope mut [T],
        root: u32,
        algorithm: Algorithm,
    ) -> Result<Work<'scope>> {
        // SAFETY: `data` is borrowed mutably for 'scope, which outlasts the
        // operation (`finish` waits); it is valid and aligned for its length.
        unsafe {
            self.comm.broadcast_raw_with(
                data.as_mut_ptr().cast(),
                data.len() as u64,
                T::DTYPE,
                root,
                Some(algorithm),
            )
        }
    }

    /// Starts an all-gather of every rank's `input` into `output` (see
    /// [`Communicator::all_gather`]) with the communicator's algorithm.
    ///
    /// With [`Algorithm::Ring`] each rank's input goes around the ring, sent
    /// once per hop. With [`Algorithm::Hierarchical`] it is a byte-wise sum over
    /// `output` to which each rank contributes its input at its offset and
    /// zeros elsewhere, at twice the bytes per rank. `auto` picks the ring on
    /// two or three machines, and on more from 256 KiB (the README's
    /// `FAIRRING_ALGO` row). Both are exact for every type.
    pub fn all_gather<T: Element>(
        &'scope self,
        input: &[T],
        output: &'scope mut [T],
    ) -> Result<Work<'scope>> {
        self.all_gather_with(input, output, self.comm.algorithm)
    }

    /// Starts an all-gather with `algorithm` (see [`Scope::all_gather`]).
    /// Every rank must choose alike.
    pub fn all_gather_with<T: Element>(
        &'scope self,
        input: &[T],
        output: &'scope mut [T],
        algorithm: Algorithm,
    ) -> Result<Work<'scope>> {
        let world = self.comm.world_size() as usize;
        let n = input.len();
        if n.checked_mul(world) != Some(output.len()) {
            return Err(Error::invalid(
                "output",
                format!(
                    "holds {} elements; {world} ranks x {n} input elements need {}",
                    output.len(),
                    n.saturating_mul(world)
                ),
            ));
        }
        // SAFETY: `input` is read before this returns; `output` is borrowed
        // mutably for 'scope and spans `world * n` elements (checked above).
        unsafe {
            self.comm.all_gather_raw_with(
                input.as_ptr().cast(),
                output.as_mut_ptr().cast(),
                n as u64,
                T::DTYPE,
                Some(algorithm),
            )
        }
    }

    /// Starts a reduce-scatter (see [`Communicator::reduce_scatter`]): `input`
    /// reduced across ranks, this rank's share of it copied into `output` when
    /// it finishes. `input` is workspace: afterwards this rank's share of it
    /// holds the result too, and the rest is unspecified.
    ///
    /// With [`Algorithm::Ring`] each share goes around the ring once, reduced
    /// on the way to its rank: `(N-1)/N` of the input leaves each rank. With
    /// [`Algorithm::Hierarchical`] or [`Algorithm::Doubling`] it is an
    /// all-reduce of the whole input, twice the bytes. `auto` picks the ring
    /// on one machine of several ranks, on two or three machines, and on more
    /// from 256 KiB, unless the job has dedicated servers (the README's
    /// `FAIRRING_ALGO` row).
    pub fn reduce_scatter<T: Element>(
        &'scope self,
        input: &'scope mut [T],
        output: &'scope mut [T],
        op: ReduceOp,
    ) -> Result<Work<'scope>> {
        self.reduce_scatter_with(input, output, op, self.comm.algorithm)
    }

    /// Starts a reduce-scatter with `algorithm` (see [`Scope::reduce_scatter`]).
    /// Every rank must choose alike.
    pub fn reduce_scatter_with<T: Element>(
        &'scope self,
        input: &'scope mut [T],
        output: &'scope mut [T],
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> Result<Work<'scope>> {
        let world = self.comm.world_size() as usize;
        let n = output.len();
        if n.checked_mul(world) != Some(input.len()) {
            return Err(Error::invalid(
                "input",
                format!(
                    "holds {} elements; {world} ranks x {n} output elements need {}",
                    input.len(),
                    n.saturating_mul(world)
                ),
            ));
        }
        // SAFETY: both are borrowed mutably for 'scope (so they do not overlap)
        // and have the lengths checked above.
        unsafe {
            self.comm.reduce_scatter_raw_with(
                input.as_mut_ptr().cast(),
                output.as_mut_ptr().cast(),
                n as u64,
                T::DTYPE,
                op,
                Some(algorithm),
            )
        }
    }

    /// Starts a barrier: its [`Work`] finishes once every rank has entered it.
    pub fn barrier(&'scope self) -> Result<Work<'scope>> {
        self.comm.start_barrier()
    }

    /// Starts an all-reduce of every tensor in `tensors`, one operation each, all
    /// in flight at once; the returned [`Work`] covers them all.
    pub fn all_reduce_coalesced<T: Element>(
        &'scope self,
        tensors: impl IntoIterator<Item = &'scope mut [T]>,
        op: ReduceOp,
    ) -> Result<Work<'scope>> {
        let raw: Vec<(*mut u8, u64)> = tensors
            .into_iter()
            .map(|t| (t.as_mut_ptr().cast(), t.len() as u64))
            .collect();
        // SAFETY: every tensor is borrowed mutably for 'scope (so none overlap),
        // valid and aligned for its length.
        unsafe { self.comm.all_reduce_coalesced_raw(&raw, T::DTYPE, op) }
    }

    fn finish(&self) {
        let last = *self
            .comm
            .next_seq
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for seq in self.first..last {
            // Waits for every operation of the scope (and any other thread's in
            // between, which is harmless); errors belong to the `Work`s.
            while !matches!(
                self.comm.engine.wait(seq, Some(Duration::from_secs(1))),
                Ok(true) | Err(_)
            ) {}
        }
    }
}

/// One operation (or a coalesced group of them) in flight.
///
/// Dropping it waits for it to finish; if it has not finished within the
/// communicator's timeout, the communicator is failed (every peer's operations
/// then fail too) so that the drop returns and nothing more touches the memory.
#[must_use = "an operation runs until waited on or dropped"]
pub struct Work<'a> {
    engine: &'a WorkerEngine,
    /// The operations covered: `first..=last`, or none if `first > last`.
    first: u64,
    last: u64,
    _data: PhantomData<&'a mut [u8]>,
}

impl<'a> Work<'a> {
    fn new(engine: &'a WorkerEngine, first: u64, last: u64) -> Work<'a> {
        Work {
            engine,
            first,
            last,
            _data: PhantomData,
        }
    }

    fn empty(engine: &'a WorkerEngine) -> Work<'a> {
        Work::new(engine, 1, 0)
    }

    /// Waits for the operation to finish.
    pub fn wait(self) -> Result<()> {
        let timeout = self.engine.timeout;
        self.wait_timeout(timeout)
    }

    /// Waits up to `timeout`: an error if it failed or is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        wait_range(self.engine, self.first, self.last, timeout)
    }

    /// Whether the operation has finished, without waiting or driving it (the
    /// progress thread does); its error if it failed.
    pub fn test(&self) -> Result<bool> {
        test_range(self.engine, self.first, self.last)
    }

    /// The operation's sequence number (the same on every rank); the first one
    /// of a coalesced group.
    pub fn sequence(&self) -> u64 {
        self.first
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        release_range(self.engine, self.first, self.last);
    }
}

/// An operation (or a coalesced group) in flight that owns a reference to its
/// communicator: made by [`Communicator::own`] from a [`Work`] of a raw form.
///
/// The communicator lives at least as long as its owned works. Dropping one
/// waits for it as dropping a [`Work`] does.
#[must_use = "an operation runs until waited on or dropped"]
pub struct OwnedWork {
    comm: Arc<Communicator>,
    first: u64,
    last: u64,
}

impl OwnedWork {
    /// Waits up to `timeout`: an error if it failed or is still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        wait_range(&self.comm.engine, self.first, self.last, timeout)
    }

    /// Waits up to the communicator's timeout.
    pub fn wait(&self) -> Result<()> {
        self.wait_timeout(self.comm.timeout)
    }

    /// Whether the operation has finished; its error if it failed.
    pub fn test(&self) -> Result<bool> {
        test_range(&self.comm.engine, self.first, self.last)
    }

    /// The operation's sequence number; the first one of a coalesced group.
    pub fn sequence(&self) -> u64 {
        self.first
    }

    /// The communicator that runs it.
    pub fn communicator(&self) -> &Arc<Communicator> {
        &self.comm
    }
}

impl Drop for OwnedWork {
    fn drop(&mut self) {
        release_range(&self.comm.engine, self.first, self.last);
    }
}

/// Waits for operations `first..=last`, up to `timeout` in all.
fn wait_range(engine: &WorkerEngine, first: u64, last: u64, timeout: Duration) -> Result<()> {
    let start = Instant::now();
    for seq in first..=last {
        let left = timeout.saturating_sub(start.elapsed());
        if !engine.wait(seq, Some(left))? {
            return Err(Error::timeout(format!("operation #{seq}"), timeout));
        }
    }
    Ok(())
}

/// Whether operations `first..=last` have all finished.
fn test_range(engine: &WorkerEngine, first: u64, last: u64) -> Result<bool> {
    for seq in first..=last {
        if !engine.test(seq)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Waits for operations `first..=last` and gives their table entries back; one
/// still running after the timeout fails the communicator, so that nothing
/// touches its memory after this returns.
fn release_range(engine: &WorkerEngine, first: u64, last: u64) {
    for seq in first..=last {
        if !matches!(engine.wait(seq, Some(engine.timeout)), Ok(true) | Err(_)) {
            engine.fail(Error::timeout(
                format!("operation #{seq} (dropped while running)"),
                engine.timeout,
            ));
        }
        engine.works.give_back(seq);
    }
}

/// Starts `engine`'s progress thread, named `name`.
fn start_progress<M: MemorySpace>(
    engine: &Arc<Engine<AnyFabric, M>>,
    name: String,
) -> Result<JoinHandle<()>> {
    let engine = Arc::clone(engine);
    std::thread::Builder::new()
        .name(name)
        .spawn(move || engine.run())
        .map_err(|e| Error::io("starting the progress thread", e))
}

/// Stops `engine`'s progress thread and waits for it (once).
fn stop_progress<M: MemorySpace>(
    engine: &Engine<AnyFabric, M>,
    thread: &mut Option<JoinHandle<()>>,
) {
    engine.stop_progress();
    if let Some(t) = thread.take()
        && t.join().is_err()
    {
        log::error!(
            "fairring: the progress thread of rank {} panicked",
            engine.rank()
        );
    }
}

/// A communicator is a worker; a server's configuration runs a [`Server`].
fn refuse_server(config: &Config) -> Result<()> {
    match config.role {
        crate::config::Role::Worker => Ok(()),
        crate::config::Role::Server(i) => Err(Error::config(
            "FAIRRING_ROLE",
            format!("server (FAIRRING_SERVER_RANK={i})"),
            "a dedicated server runs as fairring::Server (the fairring-server binary), not \
             as a Communicator",
        )),
    }
}

/// A refusal of tensor `i` of a list, named as the `tensors` argument.
fn in_list(i: usize, e: Error) -> Error {
    match e {
        Error::InvalidArgument { reason, .. } => {
            Error::invalid("tensors", format!("tensor {i}: {reason}"))
        }
        other => other,
    }
}

/// The bytes of `count` elements of `dtype`, if they fit in memory.
fn byte_len(count: u64, dtype: DataType) -> Result<usize> {
    count
        .checked_mul(dtype.size_bytes())
        .filter(|&b| b <= isize::MAX as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::invalid("count", format!("{count} elements of {dtype} overflow")))
}

/// Rejects an operator that is not defined on `dtype`, naming `op`.
fn check_op(op: ReduceOp, dtype: DataType) -> Result<()> {
    if op.supports(dtype) {
        return Ok(());
    }
    Err(Error::invalid(
        "op",
        format!("{op} is not defined on {dtype}"),
    ))
}

/// Rejects a null or misaligned pointer for `count` elements of `dtype`.
fn check_pointer(data: *mut u8, count: u64, dtype: DataType) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    if data.is_null() {
        return Err(Error::invalid("data", "null pointer"));
    }
    let align = usize::try_from(dtype.size_bytes()).unwrap_or(usize::MAX);
    if !(data as usize).is_multiple_of(align) {
        return Err(Error::invalid(
            "data",
            format!("{data:p} is not aligned to {align} bytes for {dtype}"),
        ));
    }
    Ok(())
}

/// An operation as the communicator queues it: what the engine runs (an
/// all-reduce of `elements` of `dtype` at `data`) and what the caller called.
struct Request {
    data: *mut u8,
    elements: u64,
    dtype: DataType,
    op: ReduceOp,
    algorithm: Option<Algorithm>,
    /// The wire asked for by the call; `None`: the communicator's.
    wire: Option<WireFormat>,
    collective: Collective,
    caller_dtype: DataType,
    caller_op: ReduceOp,
    caller_elements: u64,
    root: u32,
    deliver: Option<Delivery<Placed>>,
    /// `data` is a device address on this GPU, ordered on this stream.
    #[cfg(feature = "cuda")]
    device: Option<DeviceCall>,
}

/// Where a device operation's tensor lives, which stream orders it, and what
/// the operation enqueues there before its start once it is accepted.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
struct DeviceCall {
    ordinal: u32,
    stream: fairring_cuda::sys::CUstream,
    prelude: device::Prelude,
}

impl Request {
    fn all_reduce(
        data: *mut u8,
        elements: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Option<Algorithm>,
    ) -> Request {
        Request {
            data,
            elements,
            dtype,
            op,
            algorithm,
            wire: None,
            collective: Collective::AllReduce,
            caller_dtype: dtype,
            caller_op: op,
            caller_elements: elements,
            root: 0,
            deliver: None,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// A broadcast from `root` of `count` elements of `dtype` (`bytes` bytes):
    /// relayed from the root, or a byte-wise wrapping-sum all-reduce to which
    /// every rank but the root contributes zeros.
    fn broadcast(
        data: *mut u8,
        bytes: usize,
        dtype: DataType,
        count: u64,
        root: u32,
        algorithm: Option<Algorithm>,
    ) -> Request {
        let mut r = Request::all_reduce(data, bytes as u64, DataType::U8, ReduceOp::Sum, algorithm);
        r.collective = Collective::Broadcast;
        r.caller_dtype = dtype;
        r.caller_elements = count;
        r.root = root;
        r
    }

    /// An all-gather of `count` elements of `dtype` per rank into `output`
    /// (`bytes` bytes for every rank), each rank's input at its place: relayed
    /// from each rank, or a byte-wise wrapping-sum all-reduce to which each
    /// rank contributes zeros elsewhere.
    fn all_gather(
        output: *mut u8,
        bytes: usize,
        dtype: DataType,
        count: u64,
        algorithm: Option<Algorithm>,
    ) -> Request {
        let mut r =
            Request::all_reduce(output, bytes as u64, DataType::U8, ReduceOp::Sum, algorithm);
        r.collective = Collective::AllGather;
        r.caller_dtype = dtype;
        r.caller_elements = count;
        r
    }

    /// A reduce-scatter of `total` elements of `input`, `count` per rank, whose
    /// bytes `share` of `input` are delivered to `to` (with `algorithm`; `None`:
    /// the communicator's).
    #[expect(clippy::too_many_arguments, reason = "the parts of one call")]
    fn reduce_scatter(
        input: *mut u8,
        total: u64,
        dtype: DataType,
        op: ReduceOp,
        count: u64,
        to: PlacedTensor,
        share: Range<usize>,
        algorithm: Option<Algorithm>,
    ) -> Request {
        let mut r = Request::all_reduce(input, total, dtype, op, algorithm);
        r.collective = Collective::ReduceScatter;
        r.caller_elements = count;
        r.deliver = Some(Delivery { to, range: share });
        r
    }

    /// Where the tensor lives.
    fn memory(&self) -> MemoryKind {
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            return MemoryKind::Device;
        }
        MemoryKind::Host
    }
}
