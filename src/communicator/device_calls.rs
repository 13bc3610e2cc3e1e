//! Collectives on device tensors (the `cuda` feature): the same calls as on
//! host memory (a [`Call`] on a stream, or a scope's collective of a
//! [`TensorMut::device`](super::TensorMut::device)), ordered on the caller's
//! CUDA stream. Here: their memory checks, and [`Work::enqueue_wait`].
//!
//! The semantics are those of PyTorch's NCCL backend:
//!
//! - an operation starts only after everything already enqueued on the caller's
//!   stream (an event recorded there when it is submitted; its device program
//!   waits on it), and submitting never blocks the caller's thread on the GPU;
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
//! run as NCCL's collectives on the tensors (`local::nccl`), or through its
//! shared segment as for host tensors, each rank staging its slice in by copies
//! and the final slots out (`local::staged`), as `FAIRRING_DEVICE_LOCAL`
//! chooses.
//!
//! Everything the device does for an operation (its copies, NCCL's
//! collectives, a reduce-scatter's delivery) is enqueued by the call itself,
//! on the caller's thread, each step behind a gate word the engine opens by
//! writing host memory (`memory::program`); a whole all-reduce that is one
//! NCCL call (one machine of several GPUs, or the job's communicator) waits
//! for no gate, and writes its done word itself, so that nothing of the
//! engine lies between the caller's stream and NCCL, the engine checking the
//! call beside it (a mismatch fails every rank, the tensor's contents then
//! undefined). From then on the operation's
//! progress depends only on the engine writing host words and on the
//! network, never on a CUDA call still to be made: any stream may wait for
//! it, and any thread may meanwhile make any CUDA call, including one that
//! waits for the whole device (a kernel's first launch under lazy loading,
//! freeing or pinning memory). What cannot be enqueued (page-locking the
//! staging, NCCL's communicators and their warm-up) is done when the
//! communicator is made with a device ([`ConfigBuilder::device`],
//! `FAIRRING_DEVICE`), or else by the first device operation, before it
//! returns.
//!
//! [`ConfigBuilder::device`]: crate::ConfigBuilder::device

use fairring_core::DataType;
use fairring_cuda::{Stream, device_of_pointer, sys};

use super::start::{check_reduce_overlap, overlaps};
use super::{
    Call, Collective, Communicator, DeviceCall, OwnedWork, Work, WorkerEngine, byte_len,
    check_pointer, wait_range,
};
use crate::error::{Error, Result};
use crate::memory::DeviceSide;

impl Communicator {
    /// Checks the device memory of `call` (`input_len` and `output_len`
    /// elements, at least one in all): on one GPU, whose device side it
    /// readies, and, for an all-gather and a reduce-scatter, the input and the
    /// output apart (an all-gather's input may be its place in the output).
    pub(super) fn check_device_memory(
        &self,
        call: &Call,
        stream: sys::CUstream,
        input_len: u64,
        output_len: u64,
    ) -> Result<DeviceCall> {
        let (input, output) = (call.input as u64, call.output as u64);
        let dtype = call.dtype;
        let ordinal = match call.collective {
            Collective::AllGather | Collective::Gather => {
                let ordinal = device_tensor("output", output, output_len, dtype)?;
                on_same_device(ordinal, "input", input, input_len, dtype)?;
                let n = byte_len(input_len, dtype)?;
                let place = output + self.rank() as u64 * n as u64;
                let bytes = byte_len(output_len, dtype)?;
                if input != place && overlaps(input, n, output, bytes) {
                    return Err(Error::invalid(
                        "input",
                        format!(
                            "{input:#x} overlaps the output ({output:#x}, {bytes} bytes) \
                             other than at this rank's place ({place:#x})"
                        ),
                    ));
                }
                ordinal
            }
            Collective::ReduceScatter | Collective::Scatter => {
                let ordinal = device_tensor("input", input, input_len, dtype)?;
                on_same_device(ordinal, "output", output, output_len, dtype)?;
                let (n, bytes) = (byte_len(output_len, dtype)?, byte_len(input_len, dtype)?);
                if overlaps(output, n, input, bytes) {
                    return Err(Error::invalid(
                        "output",
                        format!("{output:#x} overlaps the input ({input:#x}, {bytes} bytes)"),
                    ));
                }
                ordinal
            }
            Collective::Reduce => {
                let ordinal = device_tensor("output", output, output_len, dtype)?;
                on_same_device(ordinal, "input", input, input_len, dtype)?;
                check_reduce_overlap(input, output, byte_len(output_len, dtype)?)?;
                ordinal
            }
            _ => device_tensor("data", output, output_len, dtype)?,
        };
        self.device_side(ordinal)?;
        Ok(DeviceCall { ordinal, stream })
    }

    /// The device side on GPU `ordinal`, made at the first device operation,
    /// with the machine's NCCL communicators where its ranks use them.
    pub(super) fn device_side(&self, ordinal: u32) -> Result<&DeviceSide> {
        let side = self.engine.memory.device_on(ordinal)?;
        self.nccl.connect(side.device(), &self.store)?;
        Ok(side)
    }
}

impl Work<'_> {
    /// Makes `stream` wait, on the device, until the operation has finished:
    /// work enqueued on `stream` afterwards sees its result. The host does not
    /// wait. A failed operation releases the stream too, once nothing of it
    /// touches its tensors any more (its result is then undefined;
    /// [`wait`](Work::wait) or [`test`](Work::test) report the error).
    ///
    /// The operation's device work was enqueued whole when it was started,
    /// so the stream drains without any CUDA call still to be made: any
    /// thread may make any CUDA call meanwhile, one that waits for the whole
    /// device included.
    ///
    /// Messages (sends, receives, a gather's or a scatter's on host memory)
    /// have nothing on the device: they are waited for here, by the host.
    pub fn enqueue_wait(&self, stream: &Stream) -> Result<()> {
        // SAFETY: a `Stream` is a live stream of its device's primary context.
        unsafe { self.enqueue_wait_raw(stream.raw()) }
    }

    /// [`enqueue_wait`](Work::enqueue_wait) on a runtime's raw stream.
    ///
    /// # Safety
    ///
    /// `stream` is a live stream of the primary context of the GPU the
    /// communicator's device operations run on (or null: the legacy default
    /// stream).
    pub unsafe fn enqueue_wait_raw(&self, stream: sys::CUstream) -> Result<()> {
        // Messages have nothing on the device: they are waited for here.
        self.covers.wait_on_host(self.engine)?;
        // SAFETY: forwarded.
        unsafe { enqueue_wait(self.engine, self.covers.first, self.covers.last, stream) }
    }
}

impl OwnedWork {
    /// [`Work::enqueue_wait_raw`], for an owned work.
    ///
    /// # Safety
    ///
    /// As [`Work::enqueue_wait_raw`].
    pub unsafe fn enqueue_wait_raw(&self, stream: sys::CUstream) -> Result<()> {
        self.covers.wait_on_host(&self.comm.engine)?;
        // SAFETY: forwarded.
        unsafe {
            enqueue_wait(
                &self.comm.engine,
                self.covers.first,
                self.covers.last,
                stream,
            )
        }
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

/// Refuses `data` (named `argument`) unless it is device memory on GPU
/// `ordinal`, where the operation's other tensor lies.
fn on_same_device(
    on: u32,
    argument: &'static str,
    data: sys::CUdeviceptr,
    count: u64,
    dtype: DataType,
) -> Result<()> {
    let ordinal = device_tensor(argument, data, count, dtype)?;
    if ordinal != on {
        return Err(Error::invalid(
            argument,
            format!("lies on GPU {ordinal}, and the operation's other tensor on GPU {on}"),
        ));
    }
    Ok(())
}
