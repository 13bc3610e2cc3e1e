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

use fairring_core::plan::Geometry;
use fairring_core::topology::{RankLayout, Topology};

use super::stages::{self, Buffers, Stages, f};
use super::timeline::Timeline;
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
    let topology = Topology::new(job.machines, job.devices, RankLayout::Contiguous)?;
    let geometry = Geometry::new(topology, job.slicing)?;
    let mut buffers = Buffers::new(geometry.staging_buffers(job.budget_bytes)?);
    let edge = edge(hw, job);
    let n = f(job.gpus());
    let stages = Stages::new(hw, job);
    let step = stages.step();
    let memory = |bytes: f64| stages.memory(bytes);
    let mut links = Timeline::default();
    let mut gpu = Timeline::default();
    for (slice, submitted) in stages::slices(&geometry, job, &stages)? {
        let ready = buffers.take(submitted);
        let bytes = f(slice.span().byte_len());
        let staged = gpu.run(ready, memory(2.0 * bytes) + step);
        let end = if n > 1.0 {
            let chunk = bytes / n;
            let on_links = edge.seconds(2.0 * (n - 1.0), 2.0 * (n - 1.0) * chunk);
            let on_gpu = (n - 1.0) * (memory(3.0 * chunk) + step);
            let linked = links.run(staged, on_links);
            let reduced = gpu.run(staged, on_gpu);
            linked.max(reduced).max(staged + on_links + on_gpu)
        } else {
            staged
        };
        buffers.release(gpu.run(end, memory(2.0 * bytes) + step));
    }
    Ok(Prediction::new(Algo::Ring, job, buffers.finished(), None))
}
