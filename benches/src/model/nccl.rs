//! NCCL's all-reduce as closed forms: the ring and the double binary tree.
//!
//! NCCL runs one collective at a time on its stream, so `tensors` tensors take
//! `tensors` times one.
//!
//! **Ring.** `N - 1` reduce-scatter steps and `N - 1` all-gather steps, pipelined
//! in chunks over several channels spread across the NICs. Every GPU sends
//! `2(N-1)/N * S` bytes; so does every machine through its NICs (each channel's
//! ring leaves the machine once), so the rate is the slower of a GPU's NVLink and
//! the machine's NICs together. The latency is that of the `2(N-1)` hops a chunk
//! makes: of every `N` hops, `M` cross machines (`alpha` of the NIC) and `N - M`
//! stay inside one (`alpha` of NVLink).
//!
//! **Double binary tree** (between machines; a chain within each). Each machine is
//! an inner node of one tree and a leaf of the other, so it sends and receives
//! `2S` bytes in all; the latency is `2 log2(M)` NIC hops and `2(D - 1)` NVLink
//! hops. NCCL does not use the tree within a single machine.

use super::stages::f;
use super::{Algo, Hardware, Job, ModelError, Prediction};

/// Bytes per second of NCCL's bottleneck: a GPU's NVLink, or the machine's NICs.
fn rate(hw: &Hardware, job: &Job) -> f64 {
    let nvlink = if job.devices > 1 {
        hw.nvlink.gbps
    } else {
        f64::INFINITY
    };
    let nics = if job.machines > 1 {
        hw.machine_nic_gbps()
    } else {
        f64::INFINITY
    };
    nvlink.min(nics) * 1e9
}

/// NCCL's ring.
pub fn ring(hw: &Hardware, job: &Job) -> Prediction {
    let n = f(job.gpus());
    let m = f64::from(job.machines);
    let s = f(job.bytes);
    let hops = 2.0 * (n - 1.0) / n * (m * hw.nic.latency_us + (n - m) * hw.nvlink.latency_us);
    let hops = if job.machines > 1 {
        hops
    } else {
        2.0 * (n - 1.0) * hw.nvlink.latency_us
    };
    let bytes = 2.0 * (n - 1.0) / n * s;
    let one =
        (hw.software.nccl_op_us + hops) * 1e-6 + if n > 1.0 { bytes / rate(hw, job) } else { 0.0 };
    Prediction::new(Algo::NcclRing, job, f64::from(job.tensors) * one, None)
}

/// NCCL's double binary tree.
pub fn tree(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    if job.machines < 2 {
        return Err(ModelError::NotApplicable {
            algo: Algo::NcclTree,
            reason: "NCCL's tree runs between machines; one machine uses the ring",
        });
    }
    let m = f64::from(job.machines);
    let d = f64::from(job.devices);
    let hops = 2.0 * (m.log2().ceil() * hw.nic.latency_us + (d - 1.0) * hw.nvlink.latency_us);
    let one = (hw.software.nccl_op_us + hops) * 1e-6 + 2.0 * f(job.bytes) / rate(hw, job);
    Ok(Prediction::new(
        Algo::NcclTree,
        job,
        f64::from(job.tensors) * one,
        None,
    ))
}
