//! `fr_call`, the C form of `fairring::Call`, and `fr_start`, the one export
//! that starts any described call (or a group of them under one work). The
//! per-collective exports (`fr_all_reduce`, ...) fill in a call and start it
//! through the same path ([`start_export!`]).

use std::ffi::c_void;

use fairring::{
    Algorithm, Call, Collective, Communicator, DataType, Options, ReduceOp, WireFormat,
};

use crate::comm::fr_comm;
use crate::status::{fr_status, invalid};
use crate::work_handles::fr_work;

/// An all-reduce. (`FR_COLLECTIVE_*` name the collectives of an `fr_call`.)
pub const FR_COLLECTIVE_ALL_REDUCE: i32 = 1;
/// A broadcast from `root`.
pub const FR_COLLECTIVE_BROADCAST: i32 = 2;
/// An all-gather of every rank's `count` input elements into the output.
pub const FR_COLLECTIVE_ALL_GATHER: i32 = 3;
/// A reduce-scatter: this rank's `count` elements of the reduced input.
pub const FR_COLLECTIVE_REDUCE_SCATTER: i32 = 4;
/// A barrier.
pub const FR_COLLECTIVE_BARRIER: i32 = 5;
/// A reduce to `root` (`output` is workspace on the other ranks).
pub const FR_COLLECTIVE_REDUCE: i32 = 6;
/// A gather to `root` of every rank's `count` input elements into the output
/// (`world_size * count`; workspace on the other ranks).
pub const FR_COLLECTIVE_GATHER: i32 = 7;
/// A scatter from `root`: part `r` of its input (`world_size * count`,
/// workspace everywhere) into rank `r`'s output.
pub const FR_COLLECTIVE_SCATTER: i32 = 8;

/// A send of `count` elements at `input` to rank `peer`, with `tag` (host
/// memory).
pub const FR_COLLECTIVE_SEND: i32 = 9;
/// A receive of `count` elements into `output` from rank `peer`, with `tag`
/// (host memory).
pub const FR_COLLECTIVE_RECV: i32 = 10;

/// Host memory of this process. (`FR_MEMORY_*` say where a call's memory is.)
pub const FR_MEMORY_HOST: i32 = 0;
/// CUDA device memory, ordered on the call's `stream` (only where
/// `fr_cuda_built()`).
pub const FR_MEMORY_DEVICE: i32 = 1;

/// The communicator's algorithm (`FAIRRING_ALGO`). (`FR_ALGO_*` name the
/// algorithm a call asks for.)
pub const FR_ALGO_DEFAULT: i32 = 0;
/// Per call, the algorithm measured fastest for it.
pub const FR_ALGO_AUTO: i32 = 1;
/// The reduction-server algorithm.
pub const FR_ALGO_HIERARCHICAL: i32 = 2;
/// The ring (the relay for broadcasts and all-gathers, the scatter algorithm
/// for reduce-scatters).
pub const FR_ALGO_RING: i32 = 3;
/// Recursive doubling.
pub const FR_ALGO_DOUBLING: i32 = 4;

/// The communicator's wire format (`FAIRRING_WIRE`). (`FR_WIRE_*` name the
/// format values cross between machines in.)
pub const FR_WIRE_DEFAULT: i32 = 0;
/// Every bit of every value.
pub const FR_WIRE_EXACT: i32 = 1;
/// bfloat16, for f32 values.
pub const FR_WIRE_BF16: i32 = 2;
/// IEEE binary16, for f32 values.
pub const FR_WIRE_F16: i32 = 3;

/// One call (a collective, a send or a receive), described. In a zeroed
/// `fr_call` the options are the communicator's and the memory is the host's:
/// set `collective` and the fields it reads. `count` is one rank's part: the tensor of an all-reduce, a
/// broadcast or a reduce, the input of an all-gather or a gather (whose output
/// holds `world_size * count`), the output of a reduce-scatter or a scatter
/// (whose input holds `world_size * count`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fr_call {
    /// An `FR_COLLECTIVE_*` value.
    pub collective: i32,
    /// What the call reads: the tensor of an all-reduce or a broadcast (the
    /// same as `output`), else the input. An all-gather's input may be this
    /// rank's place in the output.
    pub input: *const c_void,
    /// What the call writes: the tensor of an all-reduce or a broadcast,
    /// else the output.
    pub output: *mut c_void,
    /// Elements per rank (see above).
    pub count: u64,
    /// An `FR_DTYPE_*` value.
    pub dtype: i32,
    /// An `FR_OP_*` value (all-reduce and reduce-scatter).
    pub op: i32,
    /// The rank a broadcast comes from.
    pub root: u32,
    /// An `FR_MEMORY_*` value.
    pub memory: i32,
    /// For device memory: the stream (`cudaStream_t`, null for the legacy
    /// default stream) of the device's primary context the call is ordered on.
    pub stream: *mut c_void,
    /// An `FR_ALGO_*` value.
    pub algorithm: i32,
    /// An `FR_WIRE_*` value.
    pub wire: i32,
    /// The other rank of a send or a receive.
    pub peer: u32,
    /// The tag of a send or a receive: a peer's sends of one tag match this
    /// rank's receives of that tag in the order both were posted.
    pub tag: u32,
}

/// A refused field: its name and why.
type Refusal = (&'static str, String);

fn parse_dtype(dtype: i32) -> Result<DataType, Refusal> {
    u8::try_from(dtype)
        .ok()
        .and_then(DataType::from_u8)
        .ok_or_else(|| bad("dtype", dtype, "FR_DTYPE_*"))
}

fn parse_op(op: i32) -> Result<ReduceOp, Refusal> {
    u8::try_from(op)
        .ok()
        .and_then(ReduceOp::from_u8)
        .ok_or_else(|| bad("op", op, "FR_OP_*"))
}

/// Parses a `FR_DTYPE_*` value.
pub(crate) fn dtype_of(dtype: i32) -> Result<DataType, fr_status> {
    parse_dtype(dtype).map_err(|(field, reason)| invalid(field, &reason))
}

/// Parses a `FR_OP_*` value.
pub(crate) fn op_of(op: i32) -> Result<ReduceOp, fr_status> {
    parse_op(op).map_err(|(field, reason)| invalid(field, &reason))
}

impl fr_call {
    /// The call this describes; the first bad field is named.
    pub(crate) fn parse(&self) -> Result<Call, Refusal> {
        let collective = u8::try_from(self.collective)
            .ok()
            .and_then(Collective::from_u8)
            .ok_or_else(|| bad("collective", self.collective, "FR_COLLECTIVE_*"))?;
        let takes_op = matches!(
            collective,
            Collective::AllReduce | Collective::ReduceScatter | Collective::Reduce
        );
        let dtype = if collective == Collective::Barrier {
            DataType::U8
        } else {
            parse_dtype(self.dtype)?
        };
        let op = if takes_op {
            parse_op(self.op)?
        } else {
            ReduceOp::Sum
        };
        let algorithm = match self.algorithm {
            FR_ALGO_DEFAULT => None,
            other => Some(
                u8::try_from(other)
                    .ok()
                    .and_then(Algorithm::from_u8)
                    .ok_or_else(|| bad("algorithm", other, "FR_ALGO_*"))?,
            ),
        };
        let wire = match self.wire {
            FR_WIRE_DEFAULT => None,
            FR_WIRE_EXACT => Some(WireFormat::Exact),
            FR_WIRE_BF16 => Some(WireFormat::Bf16),
            FR_WIRE_F16 => Some(WireFormat::F16),
            other => return Err(bad("wire", other, "FR_WIRE_*")),
        };
        let (input, output) = (self.input.cast::<u8>(), self.output.cast::<u8>());
        let call = match collective {
            Collective::AllReduce => Call::all_reduce(output, self.count, dtype, op),
            Collective::Broadcast => Call::broadcast(output, self.count, dtype, self.root),
            Collective::AllGather => Call::all_gather(input, output, self.count, dtype),
            Collective::ReduceScatter => {
                Call::reduce_scatter(input.cast_mut(), output, self.count, dtype, op)
            }
            Collective::Barrier => Call::barrier(),
            Collective::Reduce => Call::reduce(input, output, self.count, dtype, op, self.root),
            Collective::Gather => Call::gather(input, output, self.count, dtype, self.root),
            Collective::Scatter => {
                Call::scatter(input.cast_mut(), output, self.count, dtype, self.root)
            }
            Collective::Send => Call::send(self.peer, self.tag, input, self.count, dtype),
            Collective::Recv => Call::recv(self.peer, self.tag, output, self.count, dtype),
        };
        let call = call.with(Options { algorithm, wire });
        match self.memory {
            FR_MEMORY_HOST => Ok(call),
            #[cfg(feature = "cuda")]
            FR_MEMORY_DEVICE => Ok(call.on_stream(self.stream.cast())),
            #[cfg(not(feature = "cuda"))]
            FR_MEMORY_DEVICE => Err((
                "memory",
                "FR_MEMORY_DEVICE: this library was built without the cuda feature".into(),
            )),
            other => Err(bad("memory", other, "FR_MEMORY_*")),
        }
    }
}

fn bad(field: &'static str, value: i32, family: &str) -> Refusal {
    (field, format!("{value} is not an {family} value"))
}

/// What an export starts: one call, or a group under one work whose refusals
/// name the export's list argument `list`.
pub(crate) enum Calls {
    One(Call),
    Group(Vec<Call>, &'static str),
}

impl Calls {
    /// Starts the calls on `comm`.
    ///
    /// # Safety
    ///
    /// As `fairring::Communicator::start`, for every call.
    pub(crate) unsafe fn start<'c>(
        &self,
        comm: &'c Communicator,
    ) -> fairring::Result<fairring::Work<'c>> {
        match self {
            // SAFETY: forwarded.
            Calls::One(call) => unsafe { comm.start(call) },
            // SAFETY: forwarded.
            Calls::Group(calls, list) => unsafe { comm.start_group(calls) }.map_err(|e| match e {
                // The group names its `calls`; the export has its own list.
                fairring::Error::InvalidArgument { reason, .. } => {
                    fairring::Error::InvalidArgument {
                        argument: list,
                        reason: reason.replacen("call", "tensor", 1),
                    }
                }
                other => other,
            }),
        }
    }
}

/// The body of an export that starts calls, inside the panic boundary:
/// evaluates `$calls` (which parses the export's arguments with `?`, naming
/// the first bad one, into a [`Calls`]), checks the handle `$comm` and
/// `$out`, starts the calls and hands out their work. The export's contract must make
/// `$comm` null or a live handle, `$out` null or valid for a write, and the
/// calls' memory what `fairring::Communicator::start` asks.
macro_rules! start_export {
    ($comm:expr, $out:expr, $calls:expr) => {
        $crate::status::boundary(|| {
            #[allow(
                clippy::redundant_closure_call,
                reason = "the closure is the scope that `?` returns from"
            )]
            let calls: Result<$crate::call::Calls, $crate::status::fr_status> = (|| $calls)();
            let calls = match calls {
                Ok(calls) => calls,
                Err(status) => return status,
            };
            // SAFETY: the export's contract: `comm` is null or a live handle,
            // `out` null or valid for a write.
            let handle = match unsafe { $crate::comm::begin($comm, $out) } {
                Ok(handle) => handle,
                Err(status) => return status,
            };
            // SAFETY: the export's contract covers the calls' memory.
            let work = unsafe { calls.start(&handle.comm) };
            // SAFETY: `out` was checked non-null; valid for a write.
            unsafe { $crate::comm::hand_out(handle, $out, work) }
        })
    };
}
pub(crate) use start_export;

/// Starts the `n` described `calls` and stores their work handle in `*out`:
/// one call alone, or several (or none), in order and all in flight at once,
/// under one work (a refusal then names `calls` and the call's index; every
/// call is checked before any starts).
///
/// # Safety
///
/// `comm` is a live handle; `calls` holds `n` calls, read during this call;
/// each call's memory is valid as its collective's export documents
/// (`fr_all_reduce`, ..., or their `_device` forms for device memory), and no
/// two calls' memory overlaps; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_start(
    comm: *const fr_comm,
    calls: *const fr_call,
    n: usize,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let list = match n {
            0 => &[][..],
            _ if calls.is_null() => return Err(invalid("calls", "null list")),
            // SAFETY: `calls` holds `n` entries (the contract; non-null, checked).
            _ => unsafe { std::slice::from_raw_parts(calls, n) },
        };
        let parsed = list
            .iter()
            .enumerate()
            .map(|(i, c)| match c.parse() {
                Ok(call) => Ok(call),
                Err((field, reason)) if n == 1 => Err(invalid(field, &reason)),
                Err((field, reason)) => {
                    Err(invalid("calls", &format!("call {i}: {field}: {reason}")))
                }
            })
            .collect::<Result<Vec<Call>, fr_status>>()?;
        Ok(match parsed.as_slice() {
            [one] => Calls::One(*one),
            _ => Calls::Group(parsed, "calls"),
        })
    })
}

/// The `n` entries of the lists `data` and `counts`, read during an export.
///
/// # Safety
///
/// Each list is null or holds `n` entries valid for reads during the call.
pub(crate) unsafe fn lists<'a, T>(
    data: *const T,
    counts: *const u64,
    n: usize,
) -> Result<(&'a [T], &'a [u64]), fr_status> {
    if n == 0 {
        return Ok((&[], &[]));
    }
    if data.is_null() || counts.is_null() {
        return Err(invalid("data", "null list"));
    }
    // SAFETY: both lists hold `n` entries (the contract; non-null, checked).
    let data = unsafe { std::slice::from_raw_parts(data, n) };
    // SAFETY: as for `data`.
    let counts = unsafe { std::slice::from_raw_parts(counts, n) };
    Ok((data, counts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_c_values_are_the_rust_discriminants() {
        let collectives = [
            (FR_COLLECTIVE_ALL_REDUCE, Collective::AllReduce),
            (FR_COLLECTIVE_BROADCAST, Collective::Broadcast),
            (FR_COLLECTIVE_ALL_GATHER, Collective::AllGather),
            (FR_COLLECTIVE_REDUCE_SCATTER, Collective::ReduceScatter),
            (FR_COLLECTIVE_BARRIER, Collective::Barrier),
            (FR_COLLECTIVE_REDUCE, Collective::Reduce),
            (FR_COLLECTIVE_GATHER, Collective::Gather),
            (FR_COLLECTIVE_SCATTER, Collective::Scatter),
            (FR_COLLECTIVE_SEND, Collective::Send),
            (FR_COLLECTIVE_RECV, Collective::Recv),
        ];
        assert_eq!(collectives.len(), Collective::ALL.len());
        for (c, rust) in collectives {
            assert_eq!(c, rust as i32, "{rust}");
        }
        let algorithms = [
            (FR_ALGO_AUTO, Algorithm::Auto),
            (FR_ALGO_HIERARCHICAL, Algorithm::Hierarchical),
            (FR_ALGO_RING, Algorithm::Ring),
            (FR_ALGO_DOUBLING, Algorithm::Doubling),
        ];
        assert_eq!(algorithms.len(), Algorithm::ALL.len());
        for (c, rust) in algorithms {
            assert_eq!(c, rust as i32, "{rust}");
        }
        assert!(Algorithm::from_u8(u8::try_from(FR_ALGO_DEFAULT).unwrap()).is_none());
    }

    #[test]
    fn a_zeroed_call_is_refused_naming_its_collective_and_bad_fields_are_named() {
        // SAFETY: all-zero is a valid `fr_call` (null pointers, zero numbers).
        let zeroed: fr_call = unsafe { std::mem::zeroed() };
        assert_eq!(zeroed.parse().err().map(|e| e.0), Some("collective"));
        let barrier = fr_call {
            collective: FR_COLLECTIVE_BARRIER,
            ..zeroed
        };
        assert!(barrier.parse().is_ok());
        for (call, field) in [
            (
                fr_call {
                    algorithm: 9,
                    ..barrier
                },
                "algorithm",
            ),
            (
                fr_call {
                    wire: -1,
                    ..barrier
                },
                "wire",
            ),
            (
                fr_call {
                    memory: 7,
                    ..barrier
                },
                "memory",
            ),
            (
                fr_call {
                    collective: FR_COLLECTIVE_ALL_REDUCE,
                    dtype: 99,
                    ..barrier
                },
                "dtype",
            ),
            (
                fr_call {
                    collective: FR_COLLECTIVE_REDUCE_SCATTER,
                    op: 42,
                    ..barrier
                },
                "op",
            ),
        ] {
            assert_eq!(call.parse().err().map(|e| e.0), Some(field));
        }
        let ring = fr_call {
            algorithm: FR_ALGO_RING,
            wire: FR_WIRE_BF16,
            ..barrier
        }
        .parse()
        .unwrap();
        assert_eq!(ring.options.algorithm, Some(Algorithm::Ring));
        assert_eq!(ring.options.wire, Some(WireFormat::Bf16));
    }
}
