//! Costs shared by fairring's algorithms: the steps within a machine, memory
//! passes, stage hand-offs.

use fairring_core::plan::{Geometry, Plan, Slice};

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

    /// NCCL's ring reduce-scatter (or all-gather) of a slice of `bytes` over the
    /// machine's NVLink; with one GPU per machine, the copy between the tensor and
    /// staging. Includes the hand-off to the next stage.
    pub(super) fn intra(&self, bytes: f64) -> f64 {
        if self.devices > 1 {
            let d = f64::from(self.devices);
            self.hw.software.nccl_op_us * 1e-6
                + self.hw.nvlink.seconds(d - 1.0, bytes * (d - 1.0) / d)
                + self.step()
        } else {
            self.memory(2.0 * bytes) + self.step()
        }
    }

    /// NCCL's all-reduce of a slice of `bytes` over the machine's NVLink, in
    /// the tensor: all a job of one machine of several GPUs does to a slice.
    /// Includes the hand-off to the next stage.
    pub(super) fn intra_all_reduce(&self, bytes: f64) -> f64 {
        let d = f64::from(self.devices);
        self.hw.software.nccl_op_us * 1e-6
            + self
                .hw
                .nvlink
                .seconds(2.0 * (d - 1.0), 2.0 * bytes * (d - 1.0) / d)
            + self.step()
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
