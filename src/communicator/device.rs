//! Collectives on device tensors (the `cuda` feature): the same operations as on
//! host memory (all-reduce, coalesced all-reduce, broadcast, all-gather,
//! reduce-scatter), ordered on the caller's CUDA stream.
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
//! Broadcast and all-gather run as they do on host memory, as byte-wise sums
//! to which a rank contributes zeros where it has nothing: the zeroing (and an
//! all-gather's copy of its input into place) is enqueued on the caller's
//! stream before the operation's start, so it too is ordered there without the
//! host waiting, and only once the call has passed every check ([`Prelude`]):
//! a refused call changes nothing. A reduce-scatter delivers its share device to device.
//!
//! The data path is the engine's algorithms with the staging buffers in
//! page-locked host memory, where the tcp fabric reads and writes them: each
//! slice is copied from the tensor to its staging buffer and the result back,
//! asynchronously, and the reduction runs on the host where the bytes land.
//! With several ranks per machine, the machine's reduce-scatter and all-gather
//! run as NCCL's collectives on the tensors (`local::nccl`), whose
//! communicators the first device operation makes, or through its shared
//! segment as for host tensors, each rank staging its slice in by copies and
//! the final slots out (`local::staged`), as `FAIRRING_DEVICE_LOCAL` chooses.

use fairring_core::{DataType, ReduceOp};
use fairring_cuda::{DeviceSlice, DeviceSliceMut, Stream, device_of_pointer, sys};

use super::{
    Communicator, DeviceCall, OwnedWork, Request, Scope, Work, WorkerEngine, byte_len, check_op,
    check_pointer, in_list, wait_range,
};
use crate::config::Algorithm;
use crate::error::{Error, Result};
use crate::memory::{DeviceSide, DeviceTensor, PlacedTensor};

/// A device call's checked GPU, whose device side exists.
struct OnDevice {
    call: DeviceCall,
}

/// One fill of a call's own device memory, enqueued on the caller's stream
/// before the operation's start.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// `bytes` zeroed at `at`.
    Zero { at: sys::CUdeviceptr, bytes: usize },
    /// `bytes` copied from `from` to `to`.
    Copy {
        to: sys::CUdeviceptr,
        from: sys::CUdeviceptr,
        bytes: usize,
    },
}

/// What a broadcast or all-gather on device memory writes into its output
/// before it starts (zeros where other ranks' data goes, an all-gather's input
/// into place). It is enqueued only once the call has passed every check
/// (`Communicator::submit`), so a refused call leaves the caller's stream and
/// memory as they were.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Prelude {
    fills: [Option<Fill>; 3],
}

impl Prelude {
    fn push(&mut self, fill: Fill) {
        let empty = match fill {
            Fill::Zero { bytes, .. } | Fill::Copy { bytes, .. } => bytes == 0,
        };
        if empty {
            return;
        }
        if let Some(free) = self.fills.iter_mut().find(|f| f.is_none()) {
            *free = Some(fill);
        }
    }

    /// Enqueues the fills on `stream`.
    ///
    /// # Safety
    ///
    /// Every range is device memory of `side`'s GPU that the call hands to the
    /// operation, and a copy's ranges do not overlap.
    pub(super) unsafe fn enqueue(&self, side: &DeviceSide, stream: &Stream) -> Result<()> {
        for fill in self.fills.iter().flatten() {
            match *fill {
                Fill::Zero { at, bytes } => {
                    // SAFETY: this function's contract.
                    let mut dst = unsafe { DeviceSliceMut::from_raw(at, bytes, side.device()) };
                    stream
                        .fill(&mut dst, 0)
                        .map_err(crate::memory::cuda_error)?;
                }
                Fill::Copy { to, from, bytes } => {
                    // SAFETY: this function's contract.
                    let src = unsafe { DeviceSlice::from_raw(from, bytes, side.device()) };
                    // SAFETY: this function's contract.
                    let mut dst = unsafe { DeviceSliceMut::from_raw(to, bytes, side.device()) };
                    stream
                        .copy(&mut dst, src)
                        .map_err(crate::memory::cuda_error)?;
                }
            }
        }
        Ok(())
    }
}

impl Communicator {
    /// Starts an all-reduce of `count` elements of `dtype` at device address
    /// `data`, in place, ordered on `stream`: it starts after everything
    /// already enqueued on `stream` (submitting never waits for the GPU), and
    /// [`Work::enqueue_wait`] makes a stream wait for its result on the
    /// device. `algorithm` overrides the communicator's.
    ///
    /// The staging buffers are in page-locked host memory, where the tcp
    /// fabric reads and writes them, and the reduction runs there (with
    /// several ranks per machine, the machine's reduction too, in its shared
    /// segment). A stream waiting for an operation blocks
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
        let on = self.on_device("data", data, count, dtype, stream)?;
        let mut r = Request::all_reduce(data as *mut u8, count, dtype, op, algorithm);
        r.device = Some(on.call);
        // SAFETY: the caller keeps the memory and the stream valid and
        // untouched until the operation finishes.
        unsafe { self.start(r) }
    }

    /// Starts a broadcast of `count` elements of `dtype` at device address
    /// `data` from rank `root`, ordered on `stream` (see
    /// [`Communicator::broadcast`] for the host form). On every rank but the
    /// root, `data` is zeroed on `stream` first.
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_device_raw`].
    pub unsafe fn broadcast_device_raw(
        &self,
        data: sys::CUdeviceptr,
        count: u64,
        dtype: DataType,
        root: u32,
        stream: sys::CUstream,
    ) -> Result<Work<'_>> {
        self.check_root(root)?;
        if count == 0 {
            // SAFETY: no memory is touched.
            return unsafe { self.broadcast_raw(std::ptr::null_mut(), 0, dtype, root) };
        }
        let mut on = self.on_device("data", data, count, dtype, stream)?;
        let bytes = byte_len(count, dtype)?;
        if root != self.rank() {
            on.call.prelude.push(Fill::Zero { at: data, bytes });
        }
        let mut r = Request::broadcast(data as *mut u8, bytes, dtype, count, root, None);
        r.device = Some(on.call);
        // SAFETY: the caller keeps the memory and the stream valid and
        // untouched until the operation finishes.
        unsafe { self.start(r) }
    }

    /// Starts an all-gather of every rank's `count` elements of `dtype` at
    /// device address `input` into `output`, which holds `world_size * count`,
    /// ordered on `stream` (see [`Communicator::all_gather`]). `input` is
    /// copied into this rank's place of `output` on `stream` (nothing is
    /// copied when it already lies there, as an in-place all-gather passes
    /// it); it may not otherwise overlap `output`.
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_device_raw`], for `output`; `input` must
    /// be device memory valid for reads of `count` elements that no stream
    /// writes until the operation completes.
    pub unsafe fn all_gather_device_raw(
        &self,
        input: sys::CUdeviceptr,
        output: sys::CUdeviceptr,
        count: u64,
        dtype: DataType,
        stream: sys::CUstream,
    ) -> Result<Work<'_>> {
        let total = self.times_world(count)?;
        if count == 0 {
            // SAFETY: no memory is touched.
            return unsafe {
                self.all_gather_raw(std::ptr::null(), std::ptr::null_mut(), 0, dtype)
            };
        }
        let mut on = self.on_device("output", output, total, dtype, stream)?;
        on_same_device(&on, "input", input, count, dtype)?;
        let n = byte_len(count, dtype)?;
        let bytes = byte_len(total, dtype)?;
        let at = self.rank() as usize * n;
        let place = output + at as u64;
        if input != place {
            if overlaps(input, n, output, bytes) {
                return Err(Error::invalid(
                    "input",
                    format!(
                        "{input:#x} overlaps the output ({output:#x}, {bytes} bytes) \
                         other than at this rank's place ({place:#x})"
                    ),
                ));
            }
            // The ranges lie on this GPU (checked) and apart (checked).
            on.call.prelude.push(Fill::Copy {
                to: place,
                from: input,
                bytes: n,
            });
        }
        on.call.prelude.push(Fill::Zero {
            at: output,
            bytes: at,
        });
        on.call.prelude.push(Fill::Zero {
            at: place + n as u64,
            bytes: bytes - at - n,
        });
        let mut r = Request::all_gather(output as *mut u8, bytes, dtype, count, None);
        r.device = Some(on.call);
        // SAFETY: the caller keeps the memory and the stream valid and
        // untouched until the operation finishes.
        unsafe { self.start(r) }
    }

    /// Starts a reduce-scatter ordered on `stream` (see
    /// [`Communicator::reduce_scatter`]): `input`, device memory holding
    /// `world_size * count` elements of `dtype`, is reduced across ranks, and
    /// this rank's `count` elements of the result are copied into `output` on
    /// the device. `input` is workspace (see [`Scope::reduce_scatter`]).
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_device_raw`], for `input` and for
    /// `output`, which must not overlap (refused, naming `output`).
    pub unsafe fn reduce_scatter_device_raw(
        &self,
        input: sys::CUdeviceptr,
        output: sys::CUdeviceptr,
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        stream: sys::CUstream,
    ) -> Result<Work<'_>> {
        let total = self.times_world(count)?;
        if count == 0 {
            // SAFETY: no memory is touched.
            return unsafe {
                self.reduce_scatter_raw(std::ptr::null_mut(), std::ptr::null_mut(), 0, dtype, op)
            };
        }
        let on = self.on_device("input", input, total, dtype, stream)?;
        on_same_device(&on, "output", output, count, dtype)?;
        let n = byte_len(count, dtype)?;
        let bytes = byte_len(total, dtype)?;
        if overlaps(output, n, input, bytes) {
            return Err(Error::invalid(
                "output",
                format!("{output:#x} overlaps the input ({input:#x}, {bytes} bytes)"),
            ));
        }
        // The operation's entry is filled in when it is queued.
        let to = PlacedTensor::Device(DeviceTensor::new(output, n, 0));
        let share = self.share(n);
        let mut r =
            Request::reduce_scatter(input as *mut u8, total, dtype, op, count, to, share, None);
        r.device = Some(on.call);
        // SAFETY: the caller keeps both tensors and the stream valid and
        // untouched until the operation finishes.
        unsafe { self.start(r) }
    }

    /// Starts an all-reduce of every `(data, count)` in `tensors`, device
    /// memory holding elements of `dtype`, one operation each and all in
    /// flight at once, ordered on `stream`; the returned [`Work`] covers them
    /// all. Every tensor is checked before any starts.
    ///
    /// # Safety
    ///
    /// As [`Communicator::all_reduce_device_raw`], for every tensor; no two
    /// may overlap.
    pub unsafe fn all_reduce_coalesced_device_raw(
        &self,
        tensors: &[(sys::CUdeviceptr, u64)],
        dtype: DataType,
        op: ReduceOp,
        stream: sys::CUstream,
    ) -> Result<Work<'_>> {
        check_op(op, dtype)?;
        for (i, &(data, count)) in tensors.iter().enumerate() {
            if count > 0 {
                self.on_device("tensors", data, count, dtype, stream)
                    .map_err(|e| in_list(i, e))?;
            }
        }
        self.group(tensors.len(), |i| {
            let (data, count) = tensors[i];
            // SAFETY: forwarded from the caller, per tensor.
            unsafe { self.all_reduce_device_raw(data, count, dtype, op, stream, None) }
        })
    }

    /// Checks `data` (`count` elements of `dtype`, named `argument`) is device
    /// memory, and readies the device side on its GPU.
    fn on_device(
        &self,
        argument: &'static str,
        data: sys::CUdeviceptr,
        count: u64,
        dtype: DataType,
        stream: sys::CUstream,
    ) -> Result<OnDevice> {
        let ordinal = device_tensor(argument, data, count, dtype)?;
        self.device_side(ordinal)?;
        Ok(OnDevice {
            call: DeviceCall {
                ordinal,
                stream,
                prelude: Prelude::default(),
            },
        })
    }

    /// The device side on GPU `ordinal`, made at the first device operation,
    /// with the machine's NCCL communicators where its ranks use them.
    pub(super) fn device_side(&self, ordinal: u32) -> Result<&DeviceSide> {
        let side = self.engine.memory.device_on(ordinal)?;
        self.nccl.connect(side.device(), &self.store)?;
        Ok(side)
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
        let count = elements("data", data.len(), data.device(), dtype, stream)?;
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

    /// Starts a broadcast of `data` (elements of `dtype`, device memory) from
    /// rank `root`, ordered on `stream`.
    pub fn broadcast_device(
        &'scope self,
        data: &'scope mut DeviceSliceMut<'_>,
        dtype: DataType,
        root: u32,
        stream: &'scope Stream,
    ) -> Result<Work<'scope>> {
        let count = elements("data", data.len(), data.device(), dtype, stream)?;
        // SAFETY: as in `all_reduce_device`.
        unsafe {
            self.comm
                .broadcast_device_raw(data.raw(), count, dtype, root, stream.raw())
        }
    }

    /// Starts an all-gather of every rank's `input` into `output` (device
    /// memory, elements of `dtype`), ordered on `stream`.
    pub fn all_gather_device(
        &'scope self,
        input: &'scope DeviceSlice<'_>,
        output: &'scope mut DeviceSliceMut<'_>,
        dtype: DataType,
        stream: &'scope Stream,
    ) -> Result<Work<'scope>> {
        let n = elements("input", input.len(), input.device(), dtype, stream)?;
        let total = elements("output", output.len(), output.device(), dtype, stream)?;
        let world = u64::from(self.comm.world_size());
        if n.checked_mul(world) != Some(total) {
            return Err(Error::invalid(
                "output",
                format!(
                    "holds {total} elements; {world} ranks x {n} input elements need {}",
                    n.saturating_mul(world)
                ),
            ));
        }
        // SAFETY: `input` is borrowed (so not written) and `output` borrowed
        // mutably (so apart from it) for 'scope, which outlasts the operation.
        unsafe {
            self.comm
                .all_gather_device_raw(input.raw(), output.raw(), n, dtype, stream.raw())
        }
    }

    /// Starts a reduce-scatter ordered on `stream`: `input` (device memory,
    /// elements of `dtype`) is all-reduced in place, and this rank's share is
    /// copied into `output` on the device.
    pub fn reduce_scatter_device(
        &'scope self,
        input: &'scope mut DeviceSliceMut<'_>,
        output: &'scope mut DeviceSliceMut<'_>,
        dtype: DataType,
        op: ReduceOp,
        stream: &'scope Stream,
    ) -> Result<Work<'scope>> {
        let total = elements("input", input.len(), input.device(), dtype, stream)?;
        let n = elements("output", output.len(), output.device(), dtype, stream)?;
        let world = u64::from(self.comm.world_size());
        if n.checked_mul(world) != Some(total) {
            return Err(Error::invalid(
                "input",
                format!(
                    "holds {total} elements; {world} ranks x {n} output elements need {}",
                    n.saturating_mul(world)
                ),
            ));
        }
        // SAFETY: both are borrowed mutably for 'scope (so apart), which
        // outlasts the operation.
        unsafe {
            self.comm.reduce_scatter_device_raw(
                input.raw(),
                output.raw(),
                n,
                dtype,
                op,
                stream.raw(),
            )
        }
    }

    /// Starts an all-reduce of every tensor in `tensors` (device memory,
    /// elements of `dtype`), one operation each, all in flight at once and
    /// ordered on `stream`; the returned [`Work`] covers them all.
    pub fn all_reduce_coalesced_device<'t: 'scope>(
        &'scope self,
        tensors: impl IntoIterator<Item = &'scope mut DeviceSliceMut<'t>>,
        dtype: DataType,
        op: ReduceOp,
        stream: &'scope Stream,
    ) -> Result<Work<'scope>> {
        let mut raw = Vec::new();
        for t in tensors {
            let count = elements("tensors", t.len(), t.device(), dtype, stream)?;
            raw.push((t.raw(), count));
        }
        // SAFETY: every tensor is borrowed mutably for 'scope (so none
        // overlap), which outlasts the operations.
        unsafe {
            self.comm
                .all_reduce_coalesced_device_raw(&raw, dtype, op, stream.raw())
        }
    }
}

/// The elements of `dtype` in `len` bytes of device memory on GPU `device`,
/// named `argument`: refused if they are not whole, or if `stream` belongs to
/// another GPU.
fn elements(
    argument: &'static str,
    len: usize,
    device: u32,
    dtype: DataType,
    stream: &Stream,
) -> Result<u64> {
    let size = usize::try_from(dtype.size_bytes()).unwrap_or(usize::MAX);
    if !len.is_multiple_of(size) {
        return Err(Error::invalid(
            argument,
            format!("{len} bytes are not whole elements of {dtype}"),
        ));
    }
    let on = stream.device().ordinal();
    if device != on {
        return Err(Error::invalid(
            "stream",
            format!("belongs to GPU {on} and the {argument} lies on GPU {device}"),
        ));
    }
    Ok((len / size) as u64)
}

impl Work<'_> {
    /// Makes `stream` wait, on the device, until the operation has finished:
    /// work enqueued on `stream` afterwards sees its result. The host does not
    /// wait. A failed operation releases the stream too (its result is then
    /// undefined; [`wait`](Work::wait) or [`test`](Work::test) report the
    /// error).
    pub fn enqueue_wait(&self, stream: &Stream) -> Result<()> {
        // SAFETY: a `Stream` is a live stream of its device's primary context.
        unsafe { enqueue_wait(self.engine, self.first, self.last, stream.raw()) }
    }

    /// [`enqueue_wait`](Work::enqueue_wait) on a runtime's raw stream.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of the primary context of the GPU the
    /// communicator's device operations run on (or null: the legacy default
    /// stream).
    pub unsafe fn enqueue_wait_raw(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { enqueue_wait(self.engine, self.first, self.last, stream) }
    }
}

impl OwnedWork {
    /// [`Work::enqueue_wait_raw`], for an owned work.
    ///
    /// # Safety
    ///
    /// As [`Work::enqueue_wait_raw`].
    pub unsafe fn enqueue_wait_raw(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { enqueue_wait(&self.comm.engine, self.first, self.last, stream) }
    }
}

/// Makes `stream` wait on the device for operations `first..=last`.
///
/// # Safety
///
/// As [`Work::enqueue_wait_raw`].
unsafe fn enqueue_wait(
    engine: &WorkerEngine,
    first: u64,
    last: u64,
    stream: sys::CUstream,
) -> Result<()> {
    let Some(side) = engine.memory.device() else {
        // No device operation ran on this communicator: a host operation has
        // nothing on the device to wait for; wait on the host.
        return wait_range(engine, first, last, engine.timeout);
    };
    // SAFETY: the caller vouches for the stream; the view lives only for this
    // call.
    let stream = unsafe { Stream::from_raw(side.device(), stream) };
    for seq in first..=last {
        // Only an operation not yet finished: one that finished before the
        // device side existed (a barrier, a host operation) never sets its
        // word.
        if engine.awaits_on_device(seq) {
            side.enqueue_wait(seq, &stream)?;
        }
    }
    Ok(())
}

/// The GPU `data` lies on, for `count` (at least one) elements of `dtype`;
/// refused, naming `argument`, if it is not device memory.
fn device_tensor(
    argument: &'static str,
    data: sys::CUdeviceptr,
    count: u64,
    dtype: DataType,
) -> Result<u32> {
    check_pointer(data as *mut u8, count, dtype).map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => Error::invalid(argument, reason),
        other => other,
    })?;
    match device_of_pointer(data).map_err(crate::memory::cuda_error)? {
        Some(ordinal) => Ok(ordinal),
        None => Err(Error::invalid(
            argument,
            format!("{data:#x} is not device memory (host tensors take the host calls)"),
        )),
    }
}

/// Refuses `data` (named `argument`) unless it is device memory on `on`'s GPU.
fn on_same_device(
    on: &OnDevice,
    argument: &'static str,
    data: sys::CUdeviceptr,
    count: u64,
    dtype: DataType,
) -> Result<()> {
    let ordinal = device_tensor(argument, data, count, dtype)?;
    if ordinal != on.call.ordinal {
        return Err(Error::invalid(
            argument,
            format!(
                "lies on GPU {ordinal}, and the operation's other tensor on GPU {}",
                on.call.ordinal
            ),
        ));
    }
    Ok(())
}

/// Whether `a..a + a_len` and `b..b + b_len` share a byte.
fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b.saturating_add(b_len as u64) && b < a.saturating_add(a_len as u64)
}
