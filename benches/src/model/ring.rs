//! fairring's own ring (`src/engine/algorithm/ring.rs`): one ring over every rank,
//! slice by slice, over the fabric.
//!
//! A slice is copied into staging, cut into `N` chunks and passed round: `N - 1`
//! reduce-scatter steps, each a message to the next rank followed by the reduction
//! of the chunk it carried (three passes over memory, and a stage hand-off: the
//! chunk is sent on only once reduced), then `N - 1` all-gather steps, then the
//! copy out. The ring moves in lock step, so each step costs the slowest edge:
//! between machines one NIC (a single flow), within a machine PCIe (the fabric
//! reaches other local GPUs through the NIC or the host).
//!
//! Slices in different staging buffers overlap: a slice's steps hold the ring's
//! links and the GPU in turn, so two slices in flight can interleave; the model
//! charges each slice its links' time and its GPU's time on separate resources,
//! and never less than their sum.

use super::events::{Schedule, TaskId};
use super::stages::{self, Stages, f};
use super::{Algo, Hardware, Job, Link, ModelError, Prediction};

/// The slowest edge of the ring.
fn edge(hw: &Hardware, job: &Job) -> Link {
    let nic = hw.one_nic();
    match (job.machines > 1, job.devices > 1) {
        (true, true) => Link {
            latency_us: nic.latency_us.max(hw.pcie.latency_us),
            gbps: nic.gbps.min(hw.pcie.gbps),
        },
        (true, false) => nic,
        (false, _) => hw.pcie,
    }
}

/// The predicted time of fairring's ring on `job`.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    let staging = job.staging(0)?;
    let geometry = staging.geometry;
    let buffers = staging.buffers.max(1) as usize;
    let edge = edge(hw, job);
    let post = hw.post_seconds();
    let n = f(job.gpus());
    let stages = Stages::new(hw, job);
    let step = stages.step();
    let memory = |bytes: f64| stages.memory(bytes);
    let mut sched = Schedule::default();
    let links = sched.resource();
    let gpu = sched.resource();
    let mut released: Vec<TaskId> = Vec::new();
    for (slice, submitted) in stages::slices(&geometry, job, &stages)? {
        let take = sched.task(None, 0.0, submitted);
        if released.len() >= buffers {
            sched.after(take, released[released.len() - buffers], 0.0);
        }
        let bytes = f(slice.span().byte_len());
        let staged = sched.task(Some(gpu), memory(2.0 * bytes) + step, 0.0);
        sched.after(staged, take, 0.0);
        let end = if n > 1.0 {
            let chunk = bytes / n;
            // Each step's message leaves once the one before it landed.
            let on_links = 2.0 * (n - 1.0) * (edge.occupies(post, chunk) + edge.hop());
            let on_gpu = (n - 1.0) * (memory(3.0 * chunk) + step);
            let linked = sched.task(Some(links), on_links, 0.0);
            sched.after(linked, staged, 0.0);
            let reduced = sched.task(Some(gpu), on_gpu, 0.0);
            sched.after(reduced, staged, 0.0);
            // The ring moves in lock step: never less than both in turn.
            let end = sched.task(None, 0.0, 0.0);
            sched.after(end, linked, 0.0);
            sched.after(end, reduced, 0.0);
            sched.after(end, staged, on_links + on_gpu);
            end
        } else {
            staged
        };
        let out = sched.task(Some(gpu), memory(2.0 * bytes) + step, 0.0);
        sched.after(out, end, 0.0);
        released.push(out);
    }
    sched.run();
    let end = released.iter().map(|&t| sched.end(t)).fold(0.0, f64::max);
    Ok(Prediction::new(Algo::Ring, job, end, None))
}
