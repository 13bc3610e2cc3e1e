//! Dedicated reduction servers in two levels, as the engine runs them where
//! its geometry puts the servers in groups (fairring-core's `ServerGroups`,
//! `engine/algorithm/serve_in_groups.rs`): the servers of a rail group in
//! groups, each group serving a group of worker machines, and then the
//! groups' partial sums reduced across the groups, server to server.
//!
//! A flat server of a slice ([`super::servers`]) receives `M` cells and sends
//! `M` results, each `1/k` of a slot, so past a few hundred machines its cells
//! shrink to the minimum shard and its posts take as long as its memory's
//! passes. The `servers` row predicts the engine's own groups where it forms
//! them (`predict_engine`: past 200 server machines of 8 NICs at the 16 KiB
//! minimum shard, in groups of at most 64); the `server-groups` study
//! ([`predict`], asked for by name) tries group sizes of its own choice
//! (`FAIRRING_GROUP_SIZE`), each in the engine's geometry for that size.
//!
//! **The groups.** The `S = P / R` servers of rail 0's group (`P` server
//! processes, one per NIC of each server machine, in `R` rail groups, as
//! [`super::servers`] counts them) form `Q = ceil(S / G)` groups of
//! consecutive servers, as fairring-core's `MachineGroups` makes them for
//! machines (`G` from 2 to `S / 2`, no group of one): the size of
//! [`group_sizes`] whose prediction is shortest, or the one the job asks for
//! ([`Job::group`]). The `M` worker machines form as many groups of
//! consecutive machines, as even as can be (the first `M mod Q` one larger);
//! worker group `g` is served by server group `g`. Fewer machines than groups
//! is refused.
//!
//! **Per slice**, on rail 0 of every worker and on every server of its rail
//! group, with the slot of `B` bytes a rail holds after the reduce-scatter
//! within its machine, cut in each server group of `s` servers into `s`
//! ranges as `MachineGroups::range` cuts a slot (server `i` of the group
//! holds range `i`):
//!
//! 1. **reduce-scatter** within each worker machine, as the engine does it;
//! 2. **contributions**: each worker sends each server of its group that
//!    server's range of its slot (one message each, on the worker's rail);
//!    a server of a group of `W` workers receives `W` of them (one slot: in
//!    groups each server serves one rail); its memory takes the `W` cells as
//!    its NIC writes them, and once all are in, one reduction reads the
//!    `W - 1` areas and reads and writes the accumulator, as the engine
//!    asks for it: `W + 1` range-sized passes after the last cell lands;
//! 3. **across the groups**, as the co-located two-level plan does it
//!    ([`super::groups`]) with servers in the machines' place: the ranges of
//!    all server groups cut the slot into intervals, each held by one
//!    server of every group and cut into `Q` pieces; a server sends each
//!    other holder of an interval that holder's piece of its partial sum,
//!    reduces its own piece over the `Q - 1` partial sums it receives
//!    (`Q + 1` piece-sized passes) and sends the sum back; its memory also
//!    moves every piece its NIC reads or writes (the partial sums out and
//!    in, the sums out and in);
//! 4. **results**: once every piece of its range is final, a server sends the
//!    range to each of its `W` workers (its NIC reading it `W` times);
//! 5. **all-gather** within each worker machine, once every range of its
//!    slot has landed.
//!
//! Where `G` divides `S` and `Q` divides `M`, a worker sends `G` messages a
//! slot and receives `G`, each a `G`th of it; a server receives `M / Q`
//! cells and sends `M / Q` results a slot, plus `2(Q - 1)` pieces each way of
//! an `S`th of the slot (a flat server: `M` each way). A worker's rail moves
//! the slot once each way, as with flat servers.
//!
//! Every message occupies its sender for `max(o, bytes / rate)` (a worker's
//! rail, or a server's NIC) and lands one latency later. A receive side takes
//! a level's bytes from its first sender's start on; a step waits for the
//! last sender plus a latency. The cells' writes into a server's memory run
//! in chunks of `SERVER_FOLD_CELLS` cells, so that a reduction of an earlier
//! slice that becomes ready meanwhile waits for one chunk. Workers hold the
//! engine's staging buffers (`Job::staging`) and take its slices; servers
//! are not limited by buffers, as in [`super::servers`].
//!
//! [`Job::group`]: super::Job::group

use std::ops::Range;

use fairring_core::plan::{MachineGroups, SERVER_FOLD_CELLS, Slice};

use super::events::{ResourceId, Schedule};
use super::groups::{Pieces, group_sizes, land_on, pieces, send_on};
use super::hierarchical::{Machine, report};
use super::stages::{self, Stages, f};
use super::{Algo, Hardware, Job, Link, ModelError, Prediction, Traffic};

/// The predicted time of `job`'s all-reduces with its dedicated servers in
/// two levels, in the group size of [`group_sizes`] that gives the shortest.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    let serving = server_processes(hw, job)? / job.devices.max(1);
    let mut best: Option<Prediction> = None;
    let mut tried = Vec::new();
    for g in group_sizes(serving, job.group) {
        // Sizes that make as many groups make the same groups.
        let count = serving.div_ceil(g);
        if tried.contains(&count) || count > job.machines {
            continue;
        }
        tried.push(count);
        let p = predict_with(hw, job, g)?;
        if best.is_none_or(|b| p.seconds < b.seconds) {
            best = Some(p);
        }
    }
    best.ok_or(ModelError::NotApplicable {
        algo: Algo::ServerGroups,
        reason: "needs a server per NIC of each rail (server processes a multiple of the GPUs \
                 a machine has), 4 or more a rail, in groups from 2 to half of them that leave \
                 no group of one, and at least as many worker machines as groups",
    })
}

/// The job's server processes: one per NIC of each server machine.
fn server_processes(hw: &Hardware, job: &Job) -> Result<u32, ModelError> {
    job.server_machines()
        .checked_mul(hw.server.nic_count)
        .ok_or_else(|| ModelError::InvalidJob("too many server processes".into()))
}

/// The predicted time of `job`'s all-reduces with its servers in groups of
/// at most `g` (`FAIRRING_GROUP_SIZE=g`): the engine's geometry, slices and
/// buffers for that size.
pub fn predict_with(hw: &Hardware, job: &Job, g: u32) -> Result<Prediction, ModelError> {
    let processes = server_processes(hw, job)?;
    let mut grouped = *job;
    grouped.grouping = fairring::Grouping::AtMost(g);
    let staging = match grouped.staging(processes) {
        Err(ModelError::Refused(_)) => {
            return Err(ModelError::NotApplicable {
                algo: Algo::ServerGroups,
                reason: "the engine forms no such groups of these servers",
            });
        }
        other => other?,
    };
    run(hw, job, Algo::ServerGroups, &staging)
}

/// The engine's own plan where its geometry puts the servers in groups: the
/// schedule of [`predict_with`] over the engine's slices, buffers and
/// groups, reported as [`Algo::Servers`].
pub(super) fn predict_engine(
    hw: &Hardware,
    job: &Job,
    staging: &fairring::Staging,
) -> Result<Prediction, ModelError> {
    run(hw, job, Algo::Servers, staging)
}

/// `job` on the engine's `staging`, whose servers are in groups, reported
/// as `algo`.
fn run(
    hw: &Hardware,
    job: &Job,
    algo: Algo,
    staging: &fairring::Staging,
) -> Result<Prediction, ModelError> {
    let groups = staging
        .geometry
        .server_groups()
        .ok_or_else(|| ModelError::InvalidJob("the engine's servers form no groups".into()))?;
    let serving = groups.servers().machines();
    let plan = groups.servers();
    let geometry = staging.geometry;
    let stages = Stages::new(hw, job);
    let slices = stages::slices(&geometry, job, &stages)?;
    let per_machine = hw.server.nic_count;
    let costs = Costs {
        rail: hw.rail(job.devices),
        server: hw.server_nic(),
        post: hw.post_seconds(),
        process_memory_gbps: hw.server.memory_gbps / f64::from(per_machine),
        buffers: staging.buffers.max(1) as usize,
        slots: u64::from(job.devices / geometry.server_rails()),
        workers: (0..groups.groups())
            .map(|group| {
                groups
                    .workers(group)
                    .map(|w| w.map(|m| m as usize).collect())
            })
            .collect::<Result<_, _>>()?,
        plan,
        stages,
    };
    let mut schedule = Schedule::default();
    let mut workers = Machine::many(&mut schedule, job.machines, job.comms_per_direction);
    let mut servers: Vec<Server> = (0..serving)
        .map(|_| Server {
            receive: schedule.resource(),
            cpu: schedule.resource(),
            send: schedule.resource(),
        })
        .collect();
    for (slice, submitted) in &slices {
        add(
            &costs,
            &mut schedule,
            &mut workers,
            &mut servers,
            slice,
            *submitted,
        )?;
    }
    schedule.run();
    let traffic = Traffic {
        slices: slices.len() as u64,
        shards_per_full_slice: costs.plan.largest(),
        staging_buffers: staging.buffers,
        in_groups: true,
        ..Traffic::default()
    };
    report(algo, job, &schedule, &workers, costs.rail, traffic)
}

/// One server process: its NIC's two sides and its share of memory.
#[derive(Clone, Copy, Debug)]
struct Server {
    receive: ResourceId,
    cpu: ResourceId,
    send: ResourceId,
}

struct Costs {
    rail: Link,
    server: Link,
    post: f64,
    process_memory_gbps: f64,
    buffers: usize,
    /// Slots a server serves, `D / R`.
    slots: u64,
    /// Per worker group, its machines.
    workers: Vec<Vec<usize>>,
    plan: MachineGroups,
    stages: Stages,
}

impl Costs {
    fn memory(&self, bytes: f64) -> f64 {
        bytes / (self.process_memory_gbps * 1e9)
    }
}

/// Adds `slice`'s steps on every worker and server (steps 1 to 5 of the
/// module docs).
#[expect(
    clippy::too_many_lines,
    reason = "the five steps of one slice, in order, as the module docs list them"
)]
fn add(
    costs: &Costs,
    sched: &mut Schedule,
    workers: &mut [Machine],
    servers: &mut [Server],
    slice: &Slice,
    submitted: f64,
) -> Result<(), ModelError> {
    let plan = &costs.plan;
    let q = plan.groups() as usize;
    let step = costs.stages.step();
    let hop = costs.server.hop();
    let slots = costs.slots;
    let slot_span = slice.slot(0)?;
    let units = slice.group_units(0)?;
    let bytes_of = |r: Range<u64>| -> Result<Range<u64>, ModelError> {
        let span = slice.slot_units_span(0, r)?;
        let start = span.byte_offset() - slot_span.byte_offset();
        Ok(start..start + span.byte_len())
    };
    let len = |r: &Range<u64>| r.end - r.start;
    // Per server group, its servers and their ranges of the slot.
    let mut members: Vec<Vec<(usize, Range<u64>)>> = Vec::with_capacity(q);
    for group in 0..plan.groups() {
        let mut list = Vec::new();
        for member in 0..plan.size(group)? {
            let s = plan.machine(group, member)? as usize;
            list.push((s, bytes_of(plan.range(units, group, member)?)?));
        }
        members.push(list);
    }
    // 1. Every worker takes its buffer and reduce-scatters the slice.
    let local = costs.stages.intra_reduce(slice)?;
    let gather = costs.stages.intra_gather(f(slice.span().byte_len()))?;
    let mut take = Vec::with_capacity(workers.len());
    let mut scattered = Vec::with_capacity(workers.len());
    for worker in workers.iter_mut() {
        let t = sched.task(None, 0.0, submitted);
        let n = worker.released.len();
        if n >= costs.buffers {
            sched.after(t, worker.released[n - costs.buffers], 0.0);
        }
        take.push(t);
        let slice = worker.released.len();
        scattered.push(
            worker
                .reduce
                .call(slice, sched, worker.nvlink, local, t, step),
        );
    }
    // 2. Each worker's ranges to its group's servers, folded there.
    let mut messages = Vec::new();
    let mut up = vec![(scattered[0], scattered[0]); workers.len()];
    for (group, machines) in costs.workers.iter().enumerate() {
        messages.clear();
        messages.extend(
            members[group]
                .iter()
                .map(|(_, r)| len(r))
                .filter(|&b| b > 0),
        );
        for &m in machines {
            let worker = &mut workers[m];
            worker.messages_sent += messages.len() as u64;
            worker.bytes_sent += messages.iter().sum::<u64>();
            let sent = send_on(
                sched,
                worker.send,
                costs.rail,
                costs.post,
                &messages,
                scattered[m],
            );
            up[m] = (scattered[m], sent);
        }
    }
    let mut group_reduced = vec![scattered[0]; servers.len()];
    let mut peers = Vec::new();
    for (group, list) in members.iter().enumerate() {
        let machines = &costs.workers[group];
        let first = scattered[machines[0]];
        let w = machines.len() as u64;
        let cells = w * slots;
        // The NIC's writes of the cells, in chunks of a few cells, so that a
        // reduction of an earlier slice that becomes ready meanwhile waits
        // for one chunk, not for every cell of this slice.
        let chunks = cells.div_ceil(u64::from(SERVER_FOLD_CELLS)).max(1);
        for (s, range) in list {
            let bytes = len(range);
            if bytes == 0 {
                group_reduced[*s] = first;
                continue;
            }
            let server = servers[*s];
            peers.clear();
            peers.extend(machines.iter().map(|&m| up[m]));
            let landed = land_on(
                sched,
                server.receive,
                costs.server,
                hop,
                cells * bytes,
                &peers,
                None,
            );
            let mut written = first;
            for _ in 0..chunks {
                let chunk = sched.task(
                    Some(server.cpu),
                    costs.memory(f(cells * bytes)) / f(chunks),
                    0.0,
                );
                sched.after(chunk, written, 0.0);
                written = chunk;
            }
            // One reduction once every cell is in: the `W - 1` areas read,
            // the accumulator read and written.
            let reduced = sched.task(
                Some(server.cpu),
                costs.memory(f(cells + 1) * f(bytes)) + step,
                0.0,
            );
            sched.after(reduced, written, 0.0);
            sched.after(reduced, landed, 0.0);
            group_reduced[*s] = reduced;
        }
    }
    // 3. Across the groups, interval by interval: per server, the pieces it
    // sends and from whom it receives which.
    let n = servers.len();
    let Pieces {
        out,
        reduces,
        from,
        senders,
        back,
    } = pieces(plan, units, n, |r| Ok(len(&bytes_of(r)?) * slots))?;
    let mut across = vec![(scattered[0], scattered[0]); n];
    for (s, server) in servers.iter().enumerate() {
        let sent = send_on(
            sched,
            server.send,
            costs.server,
            costs.post,
            &out[s],
            group_reduced[s],
        );
        across[s] = (group_reduced[s], sent);
    }
    let mut owned = vec![(scattered[0], scattered[0]); n];
    for (r, server) in servers.iter().enumerate() {
        let received: u64 = from[r].iter().map(|&(_, b)| b).sum();
        peers.clear();
        peers.extend(senders[r].iter().map(|&h| across[h]));
        let landed = land_on(
            sched,
            server.receive,
            costs.server,
            hop,
            received,
            &peers,
            None,
        );
        // The reduction's passes, and every piece the NIC reads or writes:
        // the partial sums out and in, the sums out and in.
        let sent: u64 = out[r].iter().sum();
        let moved = f(q as u64 + 1) * f(reduces[r]) + 2.0 * f(sent + received);
        let reduced = sched.task(Some(server.cpu), costs.memory(moved) + step, 0.0);
        sched.after(reduced, landed, 0.0);
        sched.after(reduced, group_reduced[r], 0.0);
        messages.clear();
        messages.extend(from[r].iter().map(|&(_, b)| b));
        let back = send_on(
            sched,
            server.send,
            costs.server,
            costs.post,
            &messages,
            reduced,
        );
        owned[r] = (reduced, back);
    }
    let mut results = vec![(scattered[0], scattered[0]); n];
    for (s, server) in servers.iter().enumerate() {
        let bytes: u64 = out[s].iter().sum();
        peers.clear();
        peers.extend(back[s].iter().map(|&r| owned[r]));
        let landed = land_on(
            sched,
            server.receive,
            costs.server,
            hop,
            bytes,
            &peers,
            None,
        );
        sched.after(landed, owned[s].0, 0.0);
        sched.after(landed, group_reduced[s], 0.0);
        // 4. The final range to each of the group's workers, per slot.
        results[s] = (landed, landed);
    }
    for (group, list) in members.iter().enumerate() {
        let w = costs.workers[group].len() as u64;
        for (s, range) in list {
            let bytes = len(range);
            if bytes == 0 {
                continue;
            }
            messages.clear();
            messages.extend((0..w * slots).map(|_| bytes));
            let final_range = results[*s].0;
            // The NIC reads the range once for each worker as it sends.
            let read = sched.task(
                Some(servers[*s].cpu),
                costs.memory(f(w * slots * bytes)),
                0.0,
            );
            sched.after(read, final_range, 0.0);
            let sent = send_on(
                sched,
                servers[*s].send,
                costs.server,
                costs.post,
                &messages,
                final_range,
            );
            results[*s] = (final_range, sent);
        }
    }
    // 5. Each worker's slot lands from its group's servers; the all-gather;
    // the buffer is released once its sends are done too.
    for (group, machines) in costs.workers.iter().enumerate() {
        peers.clear();
        peers.extend(
            members[group]
                .iter()
                .filter(|(_, r)| !r.is_empty())
                .map(|(s, _)| results[*s]),
        );
        let bytes: u64 = members[group].iter().map(|(_, r)| len(r)).sum();
        for &m in machines {
            let worker = &mut workers[m];
            worker.bytes_received += bytes;
            let landed = land_on(sched, worker.receive, costs.rail, hop, bytes, &peers, None);
            sched.after(landed, take[m], 0.0);
            let slice = worker.released.len();
            let gathered = worker
                .gather
                .call(slice, sched, worker.nvlink, gather, landed, step);
            let released = sched.task(None, 0.0, 0.0);
            sched.after(released, gathered, 0.0);
            sched.after(released, up[m].1, 0.0);
            worker.released.push(released);
        }
    }
    Ok(())
}
