//! Costs shared by fairring's algorithms: the steps within a machine, memory
//! passes, stage hand-offs.

use fairring_core::plan::{Geometry, Plan, Slice};

use super::events::{ResourceId, Schedule, TaskId};
use super::nccl::{Collective, NcclAlgorithm, choose_collective};
use super::{Hardware, Job, ModelError};

/// Size-dependent costs of the stages every fairring algorithm has.
pub(super) struct Stages {
    devices: u32,
    hw: Hardware,
}

impl Stages {
    pub(super) fn new(hw: &Hardware, job: &Job) -> Stages {
        Stages {
            devices: job.devices,
            hw: hw.clone(),
        }
    }

    /// A stage hand-off (an event polled by the progress thread), seconds.
    pub(super) fn step(&self) -> f64 {
        self.hw.software.fairring_step_us * 1e-6
    }

    /// Submitting one operation, seconds.
    pub(super) fn submit(&self) -> f64 {
        self.hw.software.fairring_op_us * 1e-6
    }

    /// Passes of `bytes` bytes in all over device memory, seconds.
    pub(super) fn memory(&self, bytes: f64) -> f64 {
        bytes / (self.hw.memory.gbps * 1e9)
    }

    /// What the engine's NCCL calls within a machine take for a slice of
    /// `bytes`, as NCCL's tuner predicts them on the machine's own communicator
    /// (`D` ranks on one machine): its latency and the time its bytes hold
    /// NVLink.
    fn within_machine(
        &self,
        collective: Collective,
        bytes: f64,
    ) -> Result<MachineCall, ModelError> {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a slice's bytes, far below 2^52"
        )]
        let n_bytes = bytes as u64;
        let e = choose_collective(
            &self.hw.nccl,
            collective,
            1,
            self.devices,
            n_bytes,
            &NcclAlgorithm::ALL,
        )
        .ok_or(ModelError::InvalidJob(format!(
            "NCCL runs no {collective:?} on {} GPUs",
            self.devices
        )))?;
        // On one machine `ncclTopoGetAlgoTime` adds the latency as computed
        // (no plateau factor, no size correction but the tree's, which
        // scales the bandwidth term): the rest of its time is the bytes'.
        Ok(MachineCall {
            latency: e.latency_us * 1e-6,
            busy: (e.time_us - e.latency_us) * 1e-6,
        })
    }

    /// A copy of `bytes` between the tensor and staging on a machine's one
    /// GPU: its memory's time for reading and writing them.
    fn copy(&self, bytes: f64) -> MachineCall {
        MachineCall {
            latency: 0.0,
            busy: self.memory(2.0 * bytes),
        }
    }

    /// The reduce-scatter of `slice` within the machine, as the engine calls
    /// it ([`fairring::reduces_in_one_call`]): one `ncclReduceScatter` of the
    /// slice where its slots are equal and it holds at least
    /// [`fairring::ONE_REDUCE_SCATTER_FROM_BYTES`]; else the group of
    /// `ncclReduce`s, one per rank's slot, which NCCL times as one reduce of
    /// the whole slice (`ncclPrepareTasks` aggregates them, `src/enqueue.cc`
    /// 408-441). With one GPU per machine, the copy between the tensor and
    /// staging.
    pub(super) fn intra_reduce(&self, slice: &Slice) -> Result<MachineCall, ModelError> {
        let bytes = f(slice.span().byte_len());
        if self.devices == 1 {
            Ok(self.copy(bytes))
        } else if fairring::reduces_in_one_call(slice, fairring::ONE_REDUCE_SCATTER_FROM_BYTES) {
            self.within_machine(Collective::ReduceScatter, bytes)
        } else {
            self.within_machine(Collective::Reduce, bytes)
        }
    }

    /// The all-gather of a slice of `bytes` within the machine: the engine's
    /// group of `ncclBroadcast`s, one per slot, which NCCL runs as one ring
    /// all-gather of the slice; with one GPU per machine, the copy.
    pub(super) fn intra_gather(&self, bytes: f64) -> Result<MachineCall, ModelError> {
        if self.devices > 1 {
            self.within_machine(Collective::AllGather, bytes)
        } else {
            Ok(self.copy(bytes))
        }
    }
}

/// One call within a machine, as the schedule charges it: `latency` (NCCL's
/// fixed cost: the launch and each step's handshake) delays it without
/// holding NVLink, and its bytes then hold NVLink for `busy`.
#[derive(Clone, Copy, Debug)]
pub(super) struct MachineCall {
    pub(super) latency: f64,
    pub(super) busy: f64,
}

/// A machine's communicators of one direction, its reduce-scatters or its
/// all-gathers: the engine's one NCCL communicator (or its copy engine, with
/// one GPU), or two that the machine's slices take in turn
/// ([`Job::comms_per_direction`], a study the engine does not run), so that
/// one call's latency passes while the other's bytes hold NVLink. A
/// communicator's calls run one after another, each in its turn on the
/// machine's NVLink.
///
/// [`Job::comms_per_direction`]: super::Job::comms_per_direction
#[derive(Clone, Copy, Debug)]
pub(super) struct Direction {
    /// Each communicator's last call: its bytes' task.
    last: [Option<TaskId>; 2],
    count: usize,
}

impl Direction {
    /// `count` communicators: 2, or else 1 (`predict` refuses any other
    /// count).
    pub(super) fn new(count: u32) -> Direction {
        Direction {
            last: [None; 2],
            count: if count == 2 { 2 } else { 1 },
        }
    }

    /// Schedules `call` for the machine's slice `slice` (its slices numbered
    /// from 0 across the job's tensors) on the communicator whose turn it
    /// is, once `ready` has ended and that communicator's previous call is
    /// done, its bytes on `nvlink`; returns the task that ends with the
    /// hand-off to the next stage (`step` after the call).
    pub(super) fn call(
        &mut self,
        slice: usize,
        schedule: &mut Schedule,
        nvlink: ResourceId,
        call: MachineCall,
        ready: TaskId,
        step: f64,
    ) -> TaskId {
        let last = &mut self.last[slice % self.count];
        let bytes = schedule.task(Some(nvlink), call.busy, 0.0);
        schedule.after(bytes, ready, call.latency);
        if let Some(previous) = *last {
            schedule.after(bytes, previous, call.latency);
        }
        *last = Some(bytes);
        let handed_off = schedule.task(None, 0.0, 0.0);
        schedule.after(handed_off, bytes, step);
        handed_off
    }
}

/// A count or byte count as a float, for the arithmetic of time.
#[expect(clippy::cast_precision_loss, reason = "counts far below 2^52")]
pub(super) fn f(v: u64) -> f64 {
    v as f64
}

/// Every slice of the job's tensors in submission order, each with the time its
/// tensor was submitted. Each tensor's plan continues the rotation of the one
/// before, as the engine's plans do; on one machine of several GPUs (no
/// dedicated servers) a tensor is one slice, as the engine plans it where
/// NCCL reduces the tensor in place ([`Plan::whole`]).
pub(super) fn slices(
    geometry: &Geometry,
    job: &Job,
    stages: &Stages,
) -> Result<Vec<(Slice, f64)>, ModelError> {
    let mut out = Vec::new();
    let mut rotation = 0;
    let mut submitted = 0.0;
    for _ in 0..job.tensors {
        submitted += stages.submit();
        let topology = geometry.topology();
        let whole = topology.machines() == 1
            && topology.devices_per_machine() > 1
            && geometry.servers().is_none();
        let plan = if whole {
            Plan::whole(geometry, job.dtype, job.elements())?
        } else {
            Plan::new(geometry, job.dtype, job.elements(), rotation)?
        };
        rotation = plan.next_rotation();
        out.extend(plan.slices().map(|s| (s, submitted)));
    }
    Ok(out)
}
