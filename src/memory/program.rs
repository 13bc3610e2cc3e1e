//! What the device does for one operation on device tensors: its *program*,
//! enqueued whole on the caller's thread when the call is accepted, so that
//! the engine's progress thread never makes a CUDA call.
//!
//! # Shape
//!
//! Each slice of the operation runs on the stream of the staging buffer it
//! takes (slice `n` takes buffer `n % B` as generation `n / B`). Its program
//! is at most one of each [`Stage`], in stream order:
//!
//! ```text
//! [wait for the operation's start]                      (if any stage touches the tensor)
//! Begin:         wait gate >= v; copies in;             write end = v
//! ReduceScatter: wait gate >= v; collectives, copies;   write end = v
//! CopyIn:        wait gate >= v; copies in;             write end = v
//! CopyOut:       wait gate >= v; copies out;            write end = v
//! AllGather:     wait gate >= v; copies, collectives;   write end = v
//!                                                       (the last stage writes the slice's end)
//! ```
//!
//! with `v` = [`Stage::value`] of the slice's generation. A buffer's *gate*
//! and *end* are one word each in page-locked host memory: the engine raises
//! the gate when the bytes a stage needs are in place (a peer's write landed,
//! a local rank's slot is final), and reads the end to learn that the stage
//! is over. Values only grow along a buffer's stream, so one word per buffer
//! serves every slice it takes. A stage the slice does not need is not in its
//! program, and no word takes its value. A reduce-scatter's delivery of the
//! caller's share runs on a stream of its own, gated by a word of its
//! operation-table entry ([`ProgramItem::Deliver`]).
//!
//! One stage waits for no gate: a whole device all-reduce through NCCL (a
//! job of one machine, or the job's communicator), whose program is one
//! slice of one stage, one all-reduce in the tensor, without delivery
//! ([`ungated`]). Its stream also writes the operation's done word (the one
//! word a stream writes that the engine also raises: the operation holds
//! its entry until its end word is written, after it):
//!
//! ```text
//! [wait for the operation's start]; NCCL all-reduce; write done = seq + 1; write end
//! ```
//!
//! It runs as soon as the caller's stream reaches it, and the streams that
//! wait for the operation go on once it has ended, each without a hop
//! through the engine; the engine checks and watches it beside the device.
//!
//! From acceptance on, the operation's device work depends on nothing but
//! host words the engine writes and the network: a caller's stream may wait
//! for it, and any thread may make any CUDA call, without a cycle through
//! the engine.
//!
//! # Failure
//!
//! A failing engine raises every gate past every value ([`RELEASED`]): every
//! stage then runs, on whatever the staging buffers hold, and every stream
//! reaches its end. An operation is declared finished only once its slices'
//! ends have been written, so nothing touches a caller's tensor after the
//! caller's stream has passed the operation.

use std::ops::Range;

use fairring_core::{DataType, ReduceOp};

use crate::error::{Error, Result};
use crate::shm::segment::{OPERATIONS, operation_entry as slot_of};

/// The stages of a slice's device program, in stream order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Stage {
    /// The local step's begin: a staged machine's copies of every local
    /// rank's runs into this rank's buffer.
    Begin = 1,
    /// The local reduce-scatter's device part: this rank's slot into
    /// staging (alone, or after the machine's collectives), or a final
    /// slot back into the tensor (staged).
    ReduceScatter = 2,
    /// An algorithm's copies of the tensor into staging.
    CopyIn = 3,
    /// An algorithm's copies of results into the tensor.
    CopyOut = 4,
    /// The local all-gather's device part: final slots into the tensor,
    /// copied or broadcast by the machine's collectives.
    AllGather = 5,
}

/// Values a buffer's words take per generation: one per stage, and the
/// slice's end.
const VALUES_PER_GENERATION: u64 = 8;

/// A gate raised past every value: the engine failed, and every stage runs.
///
/// Not `u64::MAX`: a stream's wait compares cyclically (`cuStreamWaitValue64`
/// with `GEQ` passes once `(i64)(word - value) >= 0`), so the word must lie
/// less than 2^63 above every value waited for. 2^62 does, for values below
/// 2^62, which a buffer's stage values (8 per slice it takes) and an
/// operation's `seq + 1` never reach.
pub(crate) const RELEASED: u64 = 1 << 62;

/// Whether a stream waiting until a word reaches `value` passes when the
/// word holds `word`: the driver's cyclic comparison (see [`RELEASED`]).
#[cfg_attr(
    not(test),
    expect(dead_code, reason = "the driver compares; the simulation models it")
)]
pub(crate) fn wait_passes(word: u64, value: u64) -> bool {
    word.wrapping_sub(value).cast_signed() >= 0
}

/// Where each word lies among a device side's page-locked words (the real
/// one's and the simulation's): per staging buffer its gate and its end; per
/// operation-table entry its delivery's gate and end, its start and its done
/// word.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WordLayout {
    buffers: usize,
}

#[cfg_attr(
    not(any(feature = "cuda", all(test, not(loom)))),
    expect(dead_code, reason = "words are a device's, or the simulation's")
)]
impl WordLayout {
    /// The words of a device side of `buffers` staging buffers.
    pub(crate) fn new(buffers: usize) -> WordLayout {
        WordLayout { buffers }
    }
    pub(crate) fn gate(self, buffer: u32) -> usize {
        buffer as usize
    }
    pub(crate) fn end(self, buffer: u32) -> usize {
        self.buffers + buffer as usize
    }
    pub(crate) fn delivery_gate(self, seq: u64) -> usize {
        2 * self.buffers + slot_of(seq)
    }
    pub(crate) fn delivery_end(self, seq: u64) -> usize {
        2 * self.buffers + OPERATIONS + slot_of(seq)
    }
    pub(crate) fn started(self, seq: u64) -> usize {
        2 * self.buffers + 2 * OPERATIONS + slot_of(seq)
    }
    pub(crate) fn done(self, seq: u64) -> usize {
        2 * self.buffers + 3 * OPERATIONS + slot_of(seq)
    }
    /// How many words there are.
    pub(crate) fn count(self) -> usize {
        2 * self.buffers + 4 * OPERATIONS
    }
    /// How many staging buffers have a gate and an end.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn buffers(self) -> usize {
        self.buffers
    }
}

impl Stage {
    /// Every stage, in stream order.
    pub(crate) const ALL: [Stage; 5] = [
        Stage::Begin,
        Stage::ReduceScatter,
        Stage::CopyIn,
        Stage::CopyOut,
        Stage::AllGather,
    ];

    /// The value of this stage of the slice of generation `generation`:
    /// its gate's, and its end's.
    pub(crate) fn value(self, generation: u64) -> u64 {
        generation * VALUES_PER_GENERATION + self as u64
    }

    /// The stage's name, for errors and stall reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Stage::Begin => "begin",
            Stage::ReduceScatter => "local reduce-scatter",
            Stage::CopyIn => "copy-in",
            Stage::CopyOut => "copy-out",
            Stage::AllGather => "local all-gather",
        }
    }
}

/// The end a buffer's word takes once the slice of generation `generation`
/// is over on the device: past every stage of it.
pub(crate) fn slice_end(generation: u64) -> u64 {
    generation * VALUES_PER_GENERATION + VALUES_PER_GENERATION - 1
}

/// The stages a slice's program holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Stages(u8);

impl Stages {
    /// With `stage` too.
    pub(crate) fn with(self, stage: Stage) -> Stages {
        Stages(self.0 | 1 << stage as u8)
    }

    /// Whether `stage` is in the program.
    pub(crate) fn has(self, stage: Stage) -> bool {
        self.0 & 1 << stage as u8 != 0
    }

    /// Whether the program holds no stage.
    #[cfg(test)]
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The last stage, if any.
    pub(crate) fn last(self) -> Option<Stage> {
        Stage::ALL.into_iter().rev().find(|&s| self.has(s))
    }
}

/// The gate value that raising `stage` of the slice of generation
/// `generation` writes, checked against the gate's value now (`gate`) and
/// the stages the slice holds: a stage raised twice, out of order, or while
/// an earlier one of the slice is still closed would open stages the engine
/// has not asked for, so each is refused. `None`: the gate is released (the
/// engine failed) and stays so.
#[cfg_attr(
    not(any(feature = "cuda", test)),
    expect(dead_code, reason = "gates are a device's, or the simulation's")
)]
pub(crate) fn raised(
    gate: u64,
    generation: u64,
    stage: Stage,
    stages: Stages,
) -> Result<Option<u64>> {
    if gate == RELEASED {
        return Ok(None);
    }
    let value = stage.value(generation);
    if !stages.has(stage) {
        return Err(Error::internal(
            "a slice raises only the stages its program holds",
            format!("{} of generation {generation}", stage.name()),
        ));
    }
    if gate >= value {
        return Err(Error::internal(
            "each stage of a slice is raised once, in stream order",
            format!(
                "{} of generation {generation}: its gate is at {gate} already",
                stage.name()
            ),
        ));
    }
    if let Some(skipped) = Stage::ALL
        .into_iter()
        .find(|&s| s < stage && stages.has(s) && gate < s.value(generation))
    {
        return Err(Error::internal(
            "a slice raises its stages in stream order",
            format!(
                "{} of generation {generation} before its {}",
                stage.name(),
                skipped.name()
            ),
        ));
    }
    Ok(Some(value))
}

/// Whether the reduce-scatter stage of an operation's only slice (no
/// delivery following), whose only item is `item`, runs without waiting for
/// its gate: one all-reduce of the machine's collectives, in place in the
/// tensor.
///
/// Such a stage is a whole device all-reduce through NCCL (one machine, or
/// the job's communicator), and it starts as soon as the caller's stream
/// reaches the operation, as PyTorch's NCCL backend starts one: no hop
/// through the engine lies between the caller and NCCL. (NCCL runs a
/// communicator's calls in the order they were issued, so it still follows
/// an earlier call on the same communicator, gated or not; every rank issues
/// them in its operations' order.) It reads and writes nothing but the
/// tensor, which the caller gave to the operation. The engine still checks
/// the operation's descriptor with every rank it depends on and watches for
/// a rank that fails or stalls: a rank that issued another operation, or
/// none, fails the engine, whose failure aborts NCCL's communicators, so the
/// call ends, and every rank's call fails naming the mismatch or the rank.
/// Unlike a gated stage, which runs only once the checks pass (or once a
/// failure has released it, as NCCL is aborted), the call may run on
/// mismatched operations before the checks end; NCCL may even complete
/// calls of equal byte counts that differ in type or operator, and a stream
/// waiting for the result then goes on: the tensor's contents are
/// undefined, as after any failed operation, and the failure is reported
/// by the operation's `wait` and `test`.
pub(crate) fn ungated<T>(item: &ProgramItem<T>) -> bool {
    matches!(
        item,
        ProgramItem::Collective {
            call: MachineCall::AllReduce { .. },
            ..
        }
    )
}

/// Which communicator a collective goes to: one of a machine's two, or the
/// job's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Comm {
    /// Reduce-scatters (reduces), and a single machine's all-reduces.
    Reduce,
    /// All-gathers (broadcasts).
    Gather,
    /// Every rank of the job: the job's NCCL all-reduces
    /// (`engine/algorithm/nccl.rs`).
    Job,
}

/// A collective among the machine's ranks, in place on bytes of each
/// rank's tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MachineCall {
    /// Every rank's bytes, reduced, into every rank's.
    AllReduce { dtype: DataType, op: ReduceOp },
    /// `D` equal chunks of every rank's bytes, reduced chunk by chunk: chunk
    /// `r` into rank `r`'s chunk `r`, in place (the rest of each rank's
    /// bytes is left as it was).
    ReduceScatter { dtype: DataType, op: ReduceOp },
    /// Every rank's bytes, reduced, into rank `root`'s.
    Reduce {
        dtype: DataType,
        op: ReduceOp,
        root: u32,
    },
    /// Rank `root`'s bytes into every rank's.
    Broadcast { root: u32 },
}

/// Bytes of the machine's staging memory: local rank `rank`'s staging
/// buffer `buffer`, from byte `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StagingAt {
    pub(crate) rank: u32,
    pub(crate) buffer: u32,
    pub(crate) offset: usize,
}

/// Why an operation's program was not enqueued whole.
#[derive(Debug)]
pub(crate) struct Unfinished {
    /// What failed.
    pub(crate) error: Error,
    /// Whether every slice's end and the delivery were still enqueued (only
    /// a collective was left out, its communicator aborted): once its gates
    /// open, the program still runs to its end.
    pub(crate) ends: bool,
}

/// One item of an operation's program, in the order it is enqueued.
/// Tensor ranges count from the start of the operation's tensor; `T` is a
/// memory space's device tensor (a delivery's destination).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ProgramItem<T> {
    /// The program of slice `generation` of staging buffer `buffer` starts,
    /// on that buffer's stream; its stages follow, then [`SliceEnd`].
    ///
    /// [`SliceEnd`]: ProgramItem::SliceEnd
    Slice { buffer: u32, generation: u64 },
    /// A stage of the slice starts: at the slice's first stage, a wait for
    /// the operation's start on the caller's stream (every stage reads or
    /// writes the tensor), then, if `gated`, a wait for its gate. A stage
    /// that is one all-reduce of the machine's collectives in the tensor
    /// (a job's whole device all-reduce through NCCL: one machine, or the
    /// job's communicator) is not gated ([`ungated`]).
    Stage { stage: Stage, gated: bool },
    /// Bytes `tensor` of the tensor into staging.
    ToStaging { tensor: Range<usize>, to: StagingAt },
    /// Staging into bytes `tensor` of the tensor.
    FromStaging {
        from: StagingAt,
        tensor: Range<usize>,
    },
    /// A collective of the machine's on bytes `tensor`, on `comm`; a
    /// stage's collectives go to one communicator as one group.
    Collective {
        comm: Comm,
        call: MachineCall,
        tensor: Range<usize>,
    },
    /// The stage ends: the stream writes its value into the buffer's end
    /// word (the slice's end, if it is the slice's last stage).
    StageEnd,
    /// The slice's program ends; with no stage, the stream writes the
    /// slice's end here.
    SliceEnd,
    /// The operation is over on the device: the stream writes its done
    /// word, before the slice's end, so that streams waiting for it go on
    /// without the engine. Only after the ungated stage of an operation of
    /// one slice without delivery, its program's last.
    Done,
    /// Once every slice is done and the engine raises the operation's
    /// delivery gate, bytes `from` of the tensor into `to` (a
    /// reduce-scatter's share), on the deliveries' stream.
    Deliver { from: Range<usize>, to: T },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_gate_passes_every_wait_the_driver_makes() {
        for value in [1, 7, 8 * 1_000_000_007 + 5, (1 << 62) - 1] {
            assert!(wait_passes(RELEASED, value), "{value}");
            assert!(wait_passes(value, value) && !wait_passes(value - 1, value));
        }
        // Why not u64::MAX: the driver's comparison reads it as below.
        assert!(!wait_passes(u64::MAX, 5));
    }

    #[test]
    fn values_grow_along_a_buffers_stream() {
        let mut last = 0;
        for generation in 0..3 {
            for stage in Stage::ALL {
                let v = stage.value(generation);
                assert!(v > last, "{stage:?} of {generation}");
                last = v;
            }
            assert!(slice_end(generation) > last);
            last = slice_end(generation);
        }
        assert!(Stage::Begin.value(0) > 0, "a fresh word opens nothing");
    }

    #[test]
    fn stages_are_raised_once_in_order_and_only_when_held() {
        let held = Stages::default()
            .with(Stage::ReduceScatter)
            .with(Stage::AllGather);
        assert_eq!(held.last(), Some(Stage::AllGather));
        let g = 4;
        let gate = slice_end(g - 1);
        let rs = raised(gate, g, Stage::ReduceScatter, held).unwrap();
        assert_eq!(rs, Some(Stage::ReduceScatter.value(g)));
        let e = raised(gate, g, Stage::AllGather, held).unwrap_err();
        assert!(
            e.to_string().contains("before its local reduce-scatter"),
            "{e}"
        );
        let e = raised(gate, g, Stage::Begin, held).unwrap_err();
        assert!(e.to_string().contains("holds"), "{e}");
        let after = Stage::ReduceScatter.value(g);
        assert!(raised(after, g, Stage::ReduceScatter, held).is_err());
        assert_eq!(
            raised(after, g, Stage::AllGather, held).unwrap(),
            Some(Stage::AllGather.value(g))
        );
        assert_eq!(raised(RELEASED, g, Stage::AllGather, held).unwrap(), None);
        assert!(Stages::default().is_empty() && Stages::default().last().is_none());
    }
}
