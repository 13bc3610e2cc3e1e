//! The hierarchical all-reduce with dedicated CPU reduction servers (Herring): each
//! GPU rail sends its slot once and receives it back once, instead of serving a
//! shard itself.
//!
//! The shares come from fairring-core's plan with the `K` server machines in the
//! place of the serving machines: the same slices and slots (they depend only on
//! `D` and the slicing), each slot cut into `k = min(K, slot / min shard)` cells
//! dealt to the servers round robin. So every server receives the same bytes of
//! every full slice, and the adaptive minimum shard still applies.
//!
//! Per slice, on every worker (all workers do the same work, so one stands for
//! all): reduce-scatter on NVLink; rail 0 sends its `k` cells (one message each);
//! receives the `k` results once every server of the slice has sent them;
//! all-gather. On a server serving cell `c` of each rail: `M * D` contributions of
//! `c` bytes arrive over the server machine's NICs and are accumulated **as they
//! land** (Herring's pipelined server: the reduction overlaps the reception); then
//! `M * D` results go back. Every contribution byte costs the server's memory five
//! passes: the NIC writes it, the accumulation reads it and reads and writes the
//! accumulator, and the NIC reads the result once for each destination. Servers are not
//! limited by staging buffers (their memory is the host's); workers are, as in the
//! co-located mode.

use fairring_core::plan::Geometry;
use fairring_core::topology::{RankLayout, Topology};

use super::stages::{self, Buffers, Stages, f};
use super::timeline::Timeline;
use super::{Algo, Busy, Hardware, Job, ModelError, Prediction, Traffic};

/// Passes over a server's memory per contribution byte (see the module docs).
pub const SERVER_PASSES: f64 = 5.0;

#[derive(Clone, Debug, Default)]
struct ServerMachine {
    receive: Timeline,
    cpu: Timeline,
    send: Timeline,
}

/// The predicted time of the all-reduce of `job` with dedicated servers.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    let k_servers = job.server_machines();
    // Workers slice as the co-located mode does; the servers take the machines'
    // place in the sharding.
    let workers = Topology::new(job.machines, job.devices, RankLayout::Contiguous)?;
    let worker_geometry = Geometry::new(workers, job.slicing)?;
    let buffers = worker_geometry.staging_buffers(job.budget_bytes)?;
    let serving = Topology::new(k_servers, job.devices, RankLayout::Contiguous)?;
    let geometry = Geometry::new(serving, job.slicing)?;

    let rail = hw.rail(job.devices);
    let server_link = hw.server_link();
    let stages = Stages::new(hw, job);
    // Every rail of every worker sends each server of a slice one contribution.
    let contributions = f64::from(job.devices) * f64::from(job.machines);

    let mut nvlink = Timeline::default();
    let mut send = Timeline::default();
    let mut receive = Timeline::default();
    let mut worker_buffers = Buffers::new(buffers);
    let mut servers = vec![ServerMachine::default(); k_servers as usize];
    let mut traffic = Traffic {
        shards_per_full_slice: geometry.shards_per_full_slice(),
        staging_buffers: buffers,
        ..Traffic::default()
    };
    for (slice, submitted) in stages::slices(&geometry, job, &stages)? {
        traffic.slices += 1;
        let ready = worker_buffers.take(submitted);
        let slice_bytes = f(slice.span().byte_len());
        let slot = slice.slot(0)?.byte_len();
        let k = slice.shards();
        let scattered = nvlink.run(ready, stages.intra(slice_bytes));
        traffic.messages_sent += u64::from(k);
        traffic.bytes_sent += slot;
        traffic.bytes_received += slot;
        let sent = send.run(scattered, rail.seconds(f64::from(k), f(slot)));
        let mut first_returned = f64::INFINITY;
        let mut last_returned = f64::NEG_INFINITY;
        for j in 0..k {
            let v = slice.server(j)? as usize;
            let cell = f(slice.cell(0, j)?.span().byte_len());
            let server = &mut servers[v];
            let landed = server
                .receive
                .run(scattered, server_link.seconds(0.0, contributions * cell))
                .max(sent + server_link.latency_us * 1e-6);
            // Accumulated as they land: the reduction ends one contribution
            // after the last lands, or when memory has done every pass.
            let passes = SERVER_PASSES * contributions * cell / (hw.server.memory_gbps * 1e9);
            let reduced = server
                .cpu
                .run(scattered, passes)
                .max(landed + SERVER_PASSES * cell / (hw.server.memory_gbps * 1e9))
                + stages.step();
            let returned = server.send.run(
                reduced,
                server_link.seconds(contributions, contributions * cell),
            );
            first_returned = first_returned.min(reduced);
            last_returned = last_returned.max(returned);
        }
        let results_in = receive
            .run(first_returned, rail.seconds(0.0, f(slot)))
            .max(last_returned + server_link.latency_us * 1e-6);
        worker_buffers.release(nvlink.run(results_in, stages.intra(slice_bytes)));
    }
    // Every worker machine does the same: rail 0 of any of them.
    let busy = Busy {
        send: send.busy(),
        send_alpha: f(traffic.messages_sent) * rail.latency_us * 1e-6,
        receive: receive.busy(),
        gpu: 0.0,
        nvlink: nvlink.busy(),
    };
    Ok(Prediction::with_busy(
        Algo::Servers,
        job,
        worker_buffers.finished(),
        Some(traffic),
        Some(busy),
    ))
}
