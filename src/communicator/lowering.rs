//! [`lower`]: what the engine runs for a [`Call`], decided once, by a pure
//! function of the call and the job.
//!
//! A send or a receive is a message of the engine ([`MessagePost`]: its peer,
//! tag, direction and memory). The engine runs every collective as one all-reduce (`Descriptor::runs_as`
//! says which). Lowering a call checks its arithmetic (operator, root, sizes),
//! chooses its algorithm and wire format (`engine::choice`), and returns its
//! [`Descriptor`], the tensor the engine reduces in place, the share a
//! reduce-scatter or a scatter delivers, and what the call writes into its own
//! memory before it starts (its [`Prelude`]). The operation the engine plans
//! is derived from the descriptor by `Descriptor::runs_as`, the same function
//! a dedicated server plans with from the descriptor alone: one description
//! of the call, so nothing needs checking against another.
//!
//! Lowering touches nothing: the memory checks that need a device, the
//! operation's number and the prelude's writes come after it
//! (`Communicator::start`, `Communicator::submit`).

use std::ops::Range;

use fairring_core::{DataType, ReduceOp};

use super::call::{Call, Memory};
use super::prelude::{Fill, Prelude};
use crate::engine::choice;
use crate::engine::descriptor::{Collective, Descriptor};
use crate::error::{Error, Result};
use crate::memory::MemoryKind;

/// The job, as lowering sees it: what the choice sees, and which rank this
/// is.
#[derive(Clone, Copy, Debug)]
pub(super) struct Job {
    pub(super) choice: choice::Job,
    pub(super) rank: u32,
}

/// What the engine runs for one call.
#[derive(Debug)]
pub(super) enum Lowered {
    /// A collective: one operation of the engine.
    Operation(Operation),
    /// A send or a receive: one message of the engine.
    Message(MessagePost),
}

/// A send or a receive, as the engine posts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MessagePost {
    pub(super) peer: u32,
    pub(super) tag: u32,
    /// To the peer (a send), else from it.
    pub(super) sending: bool,
    /// `count` elements of `dtype`.
    pub(super) data: *mut u8,
    pub(super) count: u64,
    pub(super) dtype: DataType,
}

/// What the engine runs for a collective call.
#[derive(Debug)]
pub(super) struct Operation {
    /// The call as every rank compares it; the engine's operation is its
    /// `runs_as`.
    pub(super) descriptor: Descriptor,
    /// The tensor the engine reduces in place.
    pub(super) tensor: Tensor,
    /// Where the result's share of this rank goes once it is final (a
    /// reduce-scatter's or a scatter's output).
    pub(super) deliver: Option<Share>,
    /// What the call writes into its own memory before it starts.
    pub(super) prelude: Prelude,
}

/// The tensor of an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Tensor {
    /// `bytes` of the call's memory at `at`.
    Call { at: *mut u8, bytes: usize },
    /// The communicator's barrier byte: a barrier's, or the check's of a call
    /// whose data moves as messages.
    BarrierByte,
}

/// Bytes `range` of the result, copied to `to` (`range.len()` bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Share {
    pub(super) to: *mut u8,
    pub(super) range: Range<usize>,
}

/// What the engine runs for `call` in `job` (see the module docs); a clear
/// error naming the argument where the call cannot run (an operator not
/// defined on its type, a root outside the job, sizes that overflow, a wire
/// format it cannot carry).
pub(super) fn lower(call: &Call, job: &Job) -> Result<Lowered> {
    match call.collective {
        Collective::Send | Collective::Recv => lower_message(call, job).map(Lowered::Message),
        _ => lower_operation(call, job).map(Lowered::Operation),
    }
}

/// A send or a receive: to or from another rank of the job, on host memory,
/// of a size that fits in memory, at a pointer aligned for its type.
fn lower_message(call: &Call, job: &Job) -> Result<MessagePost> {
    let world = job.choice.topology.world_size();
    let peer = call.peer;
    if peer >= world || peer == job.rank {
        return Err(Error::invalid(
            "peer",
            format!(
                "rank {peer} is not another rank of this job of {world} (this is rank {})",
                job.rank
            ),
        ));
    }
    if call.memory != Memory::Host {
        return Err(Error::invalid(
            "memory",
            format!("a {} runs on host memory", call.collective.name()),
        ));
    }
    choice::check_moves_exactly(call.collective, call.options.wire)?;
    byte_len(call.count, call.dtype)?;
    check_pointer(call.output, call.count, call.dtype)?;
    Ok(MessagePost {
        peer,
        tag: call.tag,
        sending: call.collective == Collective::Send,
        data: call.output,
        count: call.count,
        dtype: call.dtype,
    })
}

/// A collective: the operation the engine runs for it.
fn lower_operation(call: &Call, job: &Job) -> Result<Operation> {
    let Call {
        collective,
        count,
        dtype,
        op,
        root,
        ..
    } = *call;
    let topology = job.choice.topology;
    let world = topology.world_size();
    // A reduce runs as an all-reduce; a gather and a scatter (on device
    // memory) as an all-gather and a broadcast (`Collective::engine_form`).
    let form = collective.engine_form();
    let reduces = matches!(form, Collective::AllReduce | Collective::ReduceScatter);
    if reduces {
        check_op(op, dtype)?;
    }
    if collective.has_root() && root >= world {
        return Err(Error::invalid(
            "root",
            format!("rank {root} is not in a job of {world} ranks"),
        ));
    }
    let total = elements_in_all(collective, count, world)?;
    let n = byte_len(count, dtype)?;
    let bytes = byte_len(total, dtype)?;
    let memory = if runs_on_device(call, total) {
        MemoryKind::Device
    } else {
        MemoryKind::Host
    };
    // A gather, a scatter or a reduce on host memory (of 2 MiB or more, in a
    // job of up to 32 ranks: `choice::rooted_by_messages`) moves as messages
    // (`point_to_point::rooted`, `point_to_point::chain`), after a check the
    // engine runs as a barrier: the check compares the call across ranks, and
    // its messages start only once it has passed.
    let wire = call.options.wire.unwrap_or(job.choice.wire);
    let by_messages =
        choice::rooted_by_messages(collective, dtype, memory, wire, topology, bytes as u64);
    if by_messages {
        choice::check_moves_exactly(collective, call.options.wire)?;
    }
    let runs = if by_messages {
        Collective::Barrier
    } else {
        form
    };
    // What the engine runs: a byte-wise all-reduce for the collectives that
    // spread bytes, one byte for a barrier or a check.
    let (runs_dtype, runs_bytes) = match runs {
        Collective::Broadcast | Collective::AllGather => (DataType::U8, bytes),
        Collective::Barrier => (DataType::U8, 1),
        _ => (dtype, bytes),
    };
    let chosen = choice::choose(
        choice::Call {
            collective: if by_messages { runs } else { collective },
            dtype: runs_dtype,
            bytes: runs_bytes as u64,
            algorithm: call.options.algorithm,
            wire: call.options.wire,
            op: if reduces { op } else { ReduceOp::Sum },
            memory,
        },
        &job.choice,
    )?;
    let barrier = collective == Collective::Barrier;
    let descriptor = Descriptor {
        collective,
        dtype: if barrier { DataType::U8 } else { dtype },
        // Only a reducing call's operator is its own (others ignore theirs).
        op: if reduces { op } else { ReduceOp::Sum },
        algorithm: chosen.algorithm,
        wire: chosen.wire,
        memory,
        by_messages,
        root: if collective.has_root() { root } else { 0 },
        elements: if barrier { 1 } else { count },
    };
    let (input, output) = (call.input.cast_mut(), call.output);
    let share = || {
        let offset = job.rank as usize * n;
        offset..offset + n
    };
    let (tensor, deliver) = match runs {
        Collective::Barrier => (Tensor::BarrierByte, None),
        Collective::AllReduce | Collective::Broadcast | Collective::AllGather
            if collective != Collective::Scatter =>
        {
            (Tensor::Call { at: output, bytes }, None)
        }
        // A scatter's whole input is broadcast, a reduce-scatter's reduced;
        // each delivers this rank's share of the result.
        _ => (
            Tensor::Call { at: input, bytes },
            Some(Share {
                to: output,
                range: share(),
            }),
        ),
    };
    let prelude = prelude(
        call,
        runs,
        by_messages,
        // Device calls zero in any case: on the caller's stream, the zeros
        // cost the host nothing.
        chosen.zero_fill || memory == MemoryKind::Device,
        job.rank,
        tensor,
        n,
    );
    Ok(Operation {
        descriptor,
        tensor,
        deliver,
        prelude,
    })
}

/// What `call` writes into its own memory before it starts, where it runs as
/// `runs` (`n` bytes per rank, the engine's tensor `tensor`), zeroing where
/// other ranks' bytes go if `zeros`.
fn prelude(
    call: &Call,
    runs: Collective,
    by_messages: bool,
    zeros: bool,
    rank: u32,
    tensor: Tensor,
    n: usize,
) -> Prelude {
    let mut prelude = Prelude::default();
    let address = |p: *const u8| p as usize as u64;
    let (input, output) = (address(call.input), address(call.output));
    // This rank's own part: a gather's place in the output, a scatter's part
    // of the root's input.
    let own = rank as usize * n;
    if by_messages {
        match call.collective {
            // Copied with the check, to its place in the output, from where
            // a rank other than the root sends it.
            Collective::Gather if input != output + own as u64 => prelude.push(Fill::Copy {
                to: output + own as u64,
                from: input,
                bytes: n,
            }),
            // A chained reduce reduces into its output, which holds its
            // input.
            Collective::Reduce if input != output => prelude.push(Fill::Copy {
                to: output,
                from: input,
                bytes: n,
            }),
            Collective::Scatter if call.root == rank => prelude.push(Fill::Copy {
                to: output,
                from: input + own as u64,
                bytes: n,
            }),
            _ => {}
        }
        return prelude;
    }
    let Tensor::Call { at, bytes } = tensor else {
        return prelude;
    };
    match runs {
        // The all-reduce a broadcast otherwise runs as sums the other ranks'
        // zeros into each rank's bytes, as does a relay over the machines
        // inside each; the relay over the ranks overwrites them.
        Collective::Broadcast if call.root != rank && zeros => prelude.push(Fill::Zero {
            at: address(at),
            bytes,
        }),
        Collective::AllGather => {
            let place = output + own as u64;
            if input != place {
                prelude.push(Fill::Copy {
                    to: place,
                    from: input,
                    bytes: n,
                });
            }
            if zeros {
                prelude.push(Fill::Zero {
                    at: output,
                    bytes: own,
                });
                prelude.push(Fill::Zero {
                    at: place + n as u64,
                    bytes: bytes - own - n,
                });
            }
        }
        // A reduce's input, unless in place, is copied into the output it
        // reduces in.
        Collective::AllReduce if input != output => prelude.push(Fill::Copy {
            to: output,
            from: input,
            bytes: n,
        }),
        _ => {}
    }
    prelude
}

/// Whether `call`, of `total` elements in all, runs on device memory: a
/// device call of no elements, or a barrier, runs on the host, having nothing
/// to order.
#[cfg_attr(
    not(feature = "cuda"),
    expect(unused_variables, reason = "no device memory")
)]
pub(super) fn runs_on_device(call: &Call, total: u64) -> bool {
    match call.memory {
        Memory::Host => false,
        #[cfg(feature = "cuda")]
        Memory::Device { .. } => total > 0 && call.collective != Collective::Barrier,
    }
}

/// The elements of `collective`'s whole tensor, of `count` per rank in a job
/// of `world` ranks: `count` times `world` for the collectives whose input or
/// output holds every rank's part.
pub(super) fn elements_in_all(collective: Collective, count: u64, world: u32) -> Result<u64> {
    let per_rank = matches!(
        collective,
        Collective::AllGather
            | Collective::ReduceScatter
            | Collective::Gather
            | Collective::Scatter
    );
    if !per_rank {
        return Ok(count);
    }
    let world = u64::from(world);
    count.checked_mul(world).ok_or_else(|| {
        Error::invalid(
            "count",
            format!("{count} elements x {world} ranks overflow"),
        )
    })
}

/// The bytes of `count` elements of `dtype`, if they fit in memory.
pub(super) fn byte_len(count: u64, dtype: DataType) -> Result<usize> {
    count
        .checked_mul(dtype.size_bytes())
        .filter(|&b| b <= isize::MAX as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| Error::invalid("count", format!("{count} elements of {dtype} overflow")))
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

#[cfg(test)]
mod tests;
