//! Where every call ends: a checked [`Request`] numbered, described and
//! queued on the engine.

use super::prelude::Prelude;
use super::*;

impl Communicator {
    /// Queues a checked request: applies its prelude once nothing can refuse
    /// it any more, assigns its sequence number and hands it to the engine.
    /// Only a failed engine (or one whose operation table stays full past the
    /// timeout) refuses it here, with no side effect.
    ///
    /// # Safety
    ///
    /// `r`'s memory must stay valid and untouched by the caller until the
    /// operation finishes, and its prelude's ranges be the call's own.
    pub(super) unsafe fn submit(&self, r: Request) -> Result<u64> {
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
        #[cfg(feature = "cuda")]
        let device = match r.device {
            Some(call) => Some((self.device_side(call.ordinal)?, call)),
            None => None,
        };
        let (algorithm, wire) = (r.chosen.algorithm, r.chosen.wire);
        let elements = if r.chosen.plans_shares() {
            r.caller_elements
        } else {
            r.elements
        };
        let len = usize::try_from(bytes).map_err(|_| {
            Error::invalid("count", format!("{bytes} bytes do not fit this machine"))
        })?;
        let mut next = self.next_seq.lock().unwrap_or_else(PoisonError::into_inner);
        let seq = *next;
        self.engine.take_entry(&self.engine.works, seq, || {
            format!("a free operation slot ({WORK_CAPACITY} operations are outstanding)")
        })?;
        let data = if r.checks_only {
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
            by_messages: r.by_messages,
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
                // memory (this function's contract, checked when it was made).
                let prelude = unsafe { r.prelude.enqueue(side, &stream) };
                if let Err(e) = prelude.and_then(|()| side.record_start(seq, &stream)) {
                    self.engine.works.give_back(seq);
                    return Err(e);
                }
                // A device delivery is part of this operation's program.
                let deliver = r.deliver.map(|d| Delivery {
                    to: match d.to {
                        PlacedTensor::Device(t) => PlacedTensor::Device(t.for_operation(seq)),
                        host => host,
                    },
                    range: d.range,
                });
                let tensor = PlacedTensor::Device(DeviceTensor::new(data as u64, len, seq));
                (tensor, deliver)
            }
            None => {
                // SAFETY: this function's contract: the prelude's ranges are
                // the call's own host memory.
                unsafe { r.prelude.apply_on_host() };
                (tensor, r.deliver)
            }
        };
        #[cfg(not(feature = "cuda"))]
        let deliver = {
            // SAFETY: as above.
            unsafe { r.prelude.apply_on_host() };
            r.deliver
        };
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
}

/// A refusal of entry `i` of a list, named as the list's `argument`.
pub(super) fn in_list(argument: &'static str, i: usize, e: Error) -> Error {
    match e {
        Error::InvalidArgument { reason, .. } => {
            // "tensors" names tensor `i`, "calls" call `i`.
            let entry = argument.strip_suffix('s').unwrap_or(argument);
            Error::invalid(argument, format!("{entry} {i}: {reason}"))
        }
        other => other,
    }
}

/// The bytes of `count` elements of `dtype`, if they fit in memory.
pub(super) fn byte_len(count: u64, dtype: DataType) -> Result<usize> {
    count
        .checked_mul(dtype.size_bytes())
        .filter(|&b| b <= isize::MAX as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::invalid("count", format!("{count} elements of {dtype} overflow")))
}

/// Rejects an operator that is not defined on `dtype`, naming `op`.
pub(super) fn check_op(op: ReduceOp, dtype: DataType) -> Result<()> {
    if op.supports(dtype) {
        return Ok(());
    }
    Err(Error::invalid(
        "op",
        format!("{op} is not defined on {dtype}"),
    ))
}

/// Rejects a null or misaligned pointer for `count` elements of `dtype`.
pub(crate) fn check_pointer(data: *mut u8, count: u64, dtype: DataType) -> Result<()> {
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
/// all-reduce of `elements` of `dtype` at `data`), what the caller called,
/// what [`choice::choose`] chose for it, and what it writes before it starts.
pub(super) struct Request {
    pub(super) data: *mut u8,
    pub(super) elements: u64,
    pub(super) dtype: DataType,
    pub(super) op: ReduceOp,
    pub(super) chosen: choice::Choice,
    pub(super) collective: Collective,
    pub(super) caller_dtype: DataType,
    pub(super) caller_op: ReduceOp,
    pub(super) caller_elements: u64,
    pub(super) root: u32,
    pub(super) deliver: Option<Delivery<Placed>>,
    pub(super) prelude: Prelude,
    /// The engine all-reduces the communicator's barrier byte: a barrier,
    /// or the check of a call that moves its data as messages.
    pub(super) checks_only: bool,
    /// The call's data moves as messages once the check has passed (a
    /// gather or a scatter on host memory).
    pub(super) by_messages: bool,
    /// `data` is a device address on this GPU, ordered on this stream.
    #[cfg(feature = "cuda")]
    pub(super) device: Option<DeviceCall>,
}

/// Where a device operation's tensor lives and which stream orders it.
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
pub(super) struct DeviceCall {
    pub(super) ordinal: u32,
    pub(super) stream: fairring_cuda::sys::CUstream,
}

/// No device calls without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[derive(Clone, Copy)]
pub(super) enum DeviceCall {}

impl Request {
    pub(super) fn all_reduce(
        data: *mut u8,
        elements: u64,
        dtype: DataType,
        op: ReduceOp,
        chosen: choice::Choice,
    ) -> Request {
        Request {
            data,
            elements,
            dtype,
            op,
            chosen,
            collective: Collective::AllReduce,
            caller_dtype: dtype,
            caller_op: op,
            caller_elements: elements,
            root: 0,
            deliver: None,
            prelude: Prelude::default(),
            checks_only: false,
            by_messages: false,
            #[cfg(feature = "cuda")]
            device: None,
        }
    }

    /// A barrier: a one-byte all-reduce of the communicator's barrier byte.
    pub(super) fn barrier(chosen: choice::Choice) -> Request {
        let mut r =
            Request::all_reduce(std::ptr::null_mut(), 1, DataType::U8, ReduceOp::Sum, chosen);
        r.collective = Collective::Barrier;
        r.checks_only = true;
        r
    }

    /// The check of a call of `count` elements of `dtype` with `op` that
    /// moves its data as messages: a barrier whose descriptor is the call's
    /// (its collective and root are set by the caller).
    pub(super) fn check(
        dtype: DataType,
        count: u64,
        op: ReduceOp,
        chosen: choice::Choice,
    ) -> Request {
        let mut r = Request::barrier(chosen);
        r.caller_dtype = dtype;
        r.caller_op = op;
        r.caller_elements = count;
        r.by_messages = true;
        r
    }

    /// A broadcast from `root` of `count` elements of `dtype` (`bytes` bytes):
    /// relayed from the root, or a byte-wise wrapping-sum all-reduce to which
    /// every rank but the root contributes zeros.
    pub(super) fn broadcast(
        data: *mut u8,
        bytes: usize,
        dtype: DataType,
        count: u64,
        root: u32,
        chosen: choice::Choice,
    ) -> Request {
        let mut r = Request::all_reduce(data, bytes as u64, DataType::U8, ReduceOp::Sum, chosen);
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
    pub(super) fn all_gather(
        output: *mut u8,
        bytes: usize,
        dtype: DataType,
        count: u64,
        chosen: choice::Choice,
    ) -> Request {
        let mut r = Request::all_reduce(output, bytes as u64, DataType::U8, ReduceOp::Sum, chosen);
        r.collective = Collective::AllGather;
        r.caller_dtype = dtype;
        r.caller_elements = count;
        r
    }

    /// A reduce-scatter of `total` elements of `input`, `count` per rank, whose
    /// bytes `share` of `input` are delivered to `to`.
    #[expect(clippy::too_many_arguments, reason = "the parts of one call")]
    pub(super) fn reduce_scatter(
        input: *mut u8,
        total: u64,
        dtype: DataType,
        op: ReduceOp,
        count: u64,
        to: PlacedTensor,
        share: Range<usize>,
        chosen: choice::Choice,
    ) -> Request {
        let mut r = Request::all_reduce(input, total, dtype, op, chosen);
        r.collective = Collective::ReduceScatter;
        r.caller_elements = count;
        r.deliver = Some(Delivery { to, range: share });
        r
    }

    /// Where the tensor lives.
    pub(super) fn memory(&self) -> MemoryKind {
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            return MemoryKind::Device;
        }
        MemoryKind::Host
    }
}
