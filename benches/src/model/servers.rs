//! The hierarchical all-reduce with dedicated CPU reduction servers (Herring): each
//! GPU rail sends its slot once and receives it back once, instead of serving a
//! shard itself.
//!
//! On one machine of several GPUs none of this runs: the engine runs the
//! workers' all-reduce as one NCCL all-reduce on the machine's
//! communicator, NCCL's time (`hierarchical::through_nccl`); nor on two to
//! seven machines whose GPUs reduce in their NVSwitch, at the sizes where
//! the engine runs it as one NCCL all-reduce on the job's communicator
//! (`fairring::nccl_across_job`).
//!
//! Each of the `K` server machines runs one server process per NIC (`N` of
//! them), as each GPU machine runs one worker per GPU: `P = K * N` servers, each
//! with one NIC and `1/N` of the machine's memory bandwidth.
//!
//! The shares come from fairring-core's plan for the job with `P` dedicated
//! servers (`Geometry::with_servers`, as the engine makes it): the same slices and
//! slots (they depend only on `D` and the slicing); the servers form
//! `R = gcd(P, D)` rail groups, each slot is cut into `k = min(P / R, slot / min
//! shard)` cells dealt round robin to the servers of its group, straight to them
//! however many servers there are. So every server receives the same bytes of
//! every full slice, and the adaptive minimum shard still applies.
//!
//! Per slice, on every worker (all workers do the same work, so one stands for
//! all): reduce-scatter on NVLink; rail 0 sends its `k` cells (one message each);
//! receives the `k` results once every server of the slice has sent them;
//! all-gather. On a server serving cell `c` of its group's `D / R` slots (one
//! where there is a server per rail): `M * D / R` contributions of `c` bytes
//! arrive over its NIC; each slot's are summed into machine 0's as the engine
//! does (`engine/algorithm/serve.rs`), in folds of up to 16 cells in machine
//! order (`ServerLayout::fold`), each fold reading and writing the accumulator
//! once, so the folds overlap the arrivals and the sums end once every slot's
//! last fold has run after the last cell lands (the NIC takes every slot's
//! cells together, so the slots' last cells land at the end together, and
//! each of the server's `D / R` slots has its last fold left then); then
//! `M * D / R` results go back. The server's memory moves, per slot and cell,
//! the `M` cells the NIC writes, the `M - 1` cells the folds read, the
//! accumulator twice a fold, and the `M` copies of the sum the NIC reads
//! ([`slot_memory_cells`]): a little over three passes per contribution byte.
//! Servers are not limited by staging buffers (their memory is the host's);
//! workers are, as in the co-located mode. Every rail group does the
//! same work, so the servers of rail 0's group stand for all.

use super::events::{ResourceId, Schedule, TaskId};
use super::stages::{self, Direction, Stages, f};
use super::{Algo, Busy, Hardware, Job, ModelError, Prediction, Traffic};
use fairring_core::plan::ServerLayout;

/// Cells a server's memory moves for one slot's cells of one served shard (see
/// the module docs): `2M` for the NIC, `M - 1` read by the folds, and two per
/// fold for the accumulator.
pub fn slot_memory_cells(layout: &ServerLayout) -> f64 {
    let machines = f64::from(layout.machines());
    2.0 * machines + (machines - 1.0) + 2.0 * f64::from(layout.folds())
}

/// Cells the memory moves in a slot's last fold (its cells and the accumulator
/// twice), which runs once the last cell has landed; 0 on one machine, where
/// nothing is folded.
pub fn last_fold_cells(layout: &ServerLayout) -> f64 {
    match layout
        .folds()
        .checked_sub(1)
        .and_then(|last| layout.fold(last))
    {
        Some(fold) => f64::from(fold.end - fold.start) + 2.0,
        None => 0.0,
    }
}

/// Whether the engine's `auto` lets the machines of `job` serve their own
/// shards beside its servers (`FAIRRING_MACHINES_SERVE`): device tensors on
/// machines of several GPUs that reduce in their NVSwitch, which the model
/// reads as the preset's NCCL topology having NVLS between machines; not
/// for the servers' plan alone ([`Job::machines_serve`]).
pub fn machines_serve(hw: &Hardware, job: &Job) -> bool {
    job.machines_serve && job.devices > 1 && hw.nccl.machines.nvls.is_some()
}

#[derive(Clone, Copy, Debug)]
struct ServerMachine {
    receive: ResourceId,
    cpu: ResourceId,
    send: ResourceId,
}

/// The predicted time of the all-reduce of `job` with dedicated servers.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    // One server process per NIC of each server machine.
    let per_machine = hw.server.nic_count;
    let k_servers = job
        .server_machines()
        .checked_mul(per_machine)
        .ok_or_else(|| ModelError::InvalidJob("too many server processes".into()))?;
    // The engine's geometry with dedicated servers: the servers take the
    // machines' place in the sharding, and the cells always go straight to them.
    let staging = job.staging(k_servers)?;
    // On one machine of several GPUs the engine runs the workers'
    // all-reduce as one NCCL all-reduce on the machine's communicator, and
    // on two to seven whose GPUs reduce in their NVSwitch as one on the
    // job's at the sizes of its windows; the servers serve none of it
    // (`fairring`'s choice).
    if let Some(p) = super::hierarchical::through_nccl(hw, job, &staging, Algo::Servers)? {
        return Ok(p);
    }
    // Elsewhere, where every GPU reduces in its NVSwitch (the preset's NCCL
    // topology has NVLS between machines), the engine's `auto` lets the
    // machines serve their own shards beside the servers
    // (`FAIRRING_MACHINES_SERVE`): the plan of the same job without
    // servers, from the servers' slices and minimum shard, in their
    // buffers; the servers serve none of it.
    if let Some(colocated) = staging.colocated
        && machines_serve(hw, job)
    {
        let own = fairring::Staging {
            geometry: colocated,
            ..staging
        };
        let mut p = super::hierarchical::predict_plan(hw, job, &own)?;
        p.algo = Algo::Servers;
        return Ok(p);
    }
    if staging.geometry.server_groups().is_some() {
        return super::server_groups::predict_engine(hw, job, &staging);
    }
    let geometry = staging.geometry;
    let buffers = staging.buffers as usize;

    let rail = hw.rail(job.devices);
    let server_link = hw.server_nic();
    let post = hw.post_seconds();
    let stages = Stages::new(hw, job);
    // Every rail of the server's group on every worker sends each server of a
    // slice one contribution.
    let slots = f64::from(job.devices / geometry.server_rails());
    let contributions = slots * f64::from(job.machines);
    let layout = geometry
        .server_layout()
        .ok_or_else(|| ModelError::InvalidJob("a job with servers has a server layout".into()))?;
    let slot_cells = slot_memory_cells(&layout);
    let last_fold = last_fold_cells(&layout);
    let memory = |bytes: f64| bytes / (hw.server.memory_gbps / f64::from(per_machine) * 1e9);

    let mut sched = Schedule::default();
    let nvlink = sched.resource();
    let mut reduce = Direction::new(job.comms_per_direction);
    let mut gather = Direction::new(job.comms_per_direction);
    let send = sched.resource();
    let receive = sched.resource();
    let servers: Vec<ServerMachine> = (0..k_servers)
        .map(|_| ServerMachine {
            receive: sched.resource(),
            cpu: sched.resource(),
            send: sched.resource(),
        })
        .collect();
    let mut released: Vec<TaskId> = Vec::new();
    let mut traffic = Traffic {
        shards_per_full_slice: geometry.shards_per_full_slice(),
        staging_buffers: u32::try_from(buffers).unwrap_or(u32::MAX),
        ..Traffic::default()
    };
    for (slice, submitted) in stages::slices(&geometry, job, &stages)? {
        traffic.slices += 1;
        let take = sched.task(None, 0.0, submitted);
        if released.len() >= buffers.max(1) {
            sched.after(take, released[released.len() - buffers.max(1)], 0.0);
        }
        let slice_bytes = f(slice.span().byte_len());
        let slot = slice.slot(0)?.byte_len();
        let k = slice.shards();
        let scattered = reduce.call(
            released.len(),
            &mut sched,
            nvlink,
            stages.intra_reduce(&slice)?,
            take,
            stages.step(),
        );
        traffic.messages_sent += u64::from(k);
        traffic.bytes_sent += slot;
        traffic.bytes_received += slot;
        let mut posting = 0.0;
        for j in 0..k {
            posting += rail.occupies(post, f(slice.cell(0, j)?.span().byte_len()));
        }
        let sent = sched.task(Some(send), posting, 0.0);
        sched.after(sent, scattered, 0.0);
        // The results land from the first server's on, all of them one hop
        // after the last server sent.
        let first_returned = sched.first_of(0.0);
        let paced = sched.task(Some(receive), rail.wire(f(slot)), 0.0);
        sched.after(paced, first_returned, 0.0);
        let results_in = sched.task(None, 0.0, 0.0);
        sched.after(results_in, paced, 0.0);
        for j in 0..k {
            let v = slice.server(0, j)? as usize;
            let cell = f(slice.cell(0, j)?.span().byte_len());
            let server = servers[v];
            let paced = sched.task(
                Some(server.receive),
                server_link.wire(contributions * cell),
                0.0,
            );
            sched.after(paced, scattered, 0.0);
            let landed = sched.task(None, 0.0, 0.0);
            sched.after(landed, paced, 0.0);
            sched.after(landed, sent, server_link.hop());
            // Folded as the cells land: the sums are complete once each of
            // the server's slots has run its last fold after the last cell
            // landed, or once memory has moved every byte.
            let passes = sched.task(Some(server.cpu), memory(slots * slot_cells * cell), 0.0);
            sched.after(passes, scattered, 0.0);
            let reduced = sched.task(None, stages.step(), 0.0);
            sched.after(reduced, passes, 0.0);
            sched.after(reduced, landed, memory(slots * last_fold * cell));
            let returned = sched.task(
                Some(server.send),
                contributions * server_link.occupies(post, cell),
                0.0,
            );
            sched.after(returned, reduced, 0.0);
            sched.after(first_returned, reduced, 0.0);
            sched.after(results_in, returned, server_link.hop());
        }
        let gathered = gather.call(
            released.len(),
            &mut sched,
            nvlink,
            stages.intra_gather(slice_bytes)?,
            results_in,
            stages.step(),
        );
        released.push(gathered);
    }
    sched.run();
    // Every worker machine does the same: rail 0 of any of them.
    let sent = sched.busy(send);
    let busy = Busy {
        send: sent,
        send_alpha: (sent - rail.wire(f(traffic.bytes_sent))).max(0.0),
        receive: sched.busy(receive),
        gpu: 0.0,
        nvlink: sched.busy(nvlink),
    };
    let end = released.iter().map(|&t| sched.end(t)).fold(0.0, f64::max);
    Ok(Prediction::with_busy(
        Algo::Servers,
        job,
        end,
        Some(traffic),
        Some(busy),
    ))
}
