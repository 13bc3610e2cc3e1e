//! A study of a two-level plan the engine does not run: machines in groups,
//! reduction servers within a group and then across groups, along rails.
//!
//! This row answers whether the plan should change past the machines the
//! flat plan serves (issue: "two-level reduction servers"); it is not what
//! `hierarchical` (the engine's plan) does, and nothing in fairring-core
//! or the engine makes it yet.
//!
//! The `M` machines form `M / G` groups of `G` consecutive machines (`G`
//! divides `M`, `2 <= G <= M / 2`): the size of [`group_sizes`] whose
//! prediction is shortest, or the one the job asks for ([`Job::group`]). Member `j` of a group is machine
//! `g * G + j`. Per slice, on rail 0 of every machine (rails are symmetric,
//! as in [`super::hierarchical`]), with the slot of `S` bytes each rail holds
//! after the reduce-scatter within the machine:
//!
//! 1. **reduce-scatter** within the machine, as the engine does it;
//! 2. **within the group**: the slot is cut into `G` cells of `S / G`;
//!    member `j` receives cell `j` from the `G - 1` others and reduces them
//!    (the many-source kernel: `G + 1` cell-sized passes);
//! 3. **across the groups**: member `j`'s partial sum, the group's cell `j`,
//!    is cut into `H = M / G` pieces of `S / M`; member `j` of group `g`
//!    serves piece `g`, receiving it from member `j` of the `H - 1` other
//!    groups, reduces (`H + 1` passes) and sends the sum back to them;
//! 4. **back within the group**: member `j` sends its final cell to the
//!    `G - 1` others;
//! 5. **all-gather** within the machine.
//!
//! A rail sends `2(G - 1) + 2(H - 1)` messages a slice, against `2(M - 1)`
//! flat, and the same bytes within one piece: `S (1 - 1/M)` each way. Every
//! message occupies its sender for `max(o, bytes / rate)` and lands one
//! latency later, as everywhere in the model. A receive side takes a level's
//! bytes from its first sender's send on; a level's reduction waits for the
//! last sender plus one latency. Staging is charged as the flat plan's with
//! one shard per machine (the slot and `M - 1` cells of `S / M` hold the
//! same bytes as the slot, `G - 1` cells of `S / G` and `H - 1` of
//! `S / M`, within one cell): the slices and buffer count are the engine's
//! for that geometry under the job's budget, in the wide flat slices (32
//! MiB) for a tensor of at least four of them.

use fairring_core::plan::{PlanConfig, PlanError, Slice};

use super::events::{Schedule, TaskId};
use super::hierarchical::{Machine, report};
use super::stages::{self, Stages, f};
use super::{Algo, Hardware, Job, Link, ModelError, Prediction, Traffic};

/// The group sizes the study may use for `machines` machines: `requested`
/// where it divides `machines` into groups of 2 or more (0: every such
/// divisor). Empty where there is no split into two levels.
pub fn group_sizes(machines: u32, requested: u32) -> Vec<u32> {
    (2..=machines / 2)
        .filter(|g| machines.is_multiple_of(*g) && (requested == 0 || *g == requested))
        .collect()
}

/// The predicted time of `job`'s all-reduces under the two-level plan, in
/// the group size of [`group_sizes`] that gives the shortest.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    let mut best: Option<Prediction> = None;
    for g in group_sizes(job.machines, job.group) {
        let p = predict_with(hw, job, g)?;
        if best.is_none_or(|b| p.seconds < b.seconds) {
            best = Some(p);
        }
    }
    best.ok_or(ModelError::NotApplicable {
        algo: Algo::Groups,
        reason: "needs groups of 2 or more machines, at least two of them, that divide the job",
    })
}

/// The predicted time of `job`'s all-reduces under the two-level plan in
/// groups of `g` machines (`g` divides `M`, `2 <= g <= M / 2`).
pub fn predict_with(hw: &Hardware, job: &Job, g: u32) -> Result<Prediction, ModelError> {
    // The engine's slices and staging for one shard per machine of any size
    // (the floor as minimum shard keeps the plan flat, `k = M`): by default
    // the wide flat slices (32 MiB) for a tensor of at least
    // `MIN_SLICES_PER_TENSOR` of them, else the default slices and their cut.
    let mut flat = *job;
    let wide = PlanConfig::WIDE_FLAT_SLICE_BYTES;
    flat.slicing = if !job.slicing.slice_by_routing() {
        PlanConfig::new(job.slicing.slice_bytes(), PlanConfig::MIN_SHARD_FLOOR)
    } else if job.bytes >= PlanConfig::MIN_SLICES_PER_TENSOR * wide {
        PlanConfig::new(wide, PlanConfig::MIN_SHARD_FLOOR)
    } else {
        PlanConfig::with_default_slices(PlanConfig::MIN_SHARD_FLOOR)
    }
    .map_err(|e: PlanError| ModelError::Plan(e))?;
    let staging = flat.staging(0)?;
    let stages = Stages::new(hw, job);
    let slices = stages::slices(&staging.geometry, &flat, &stages)?;
    if g < 2 || !job.machines.is_multiple_of(g) || g > job.machines / 2 {
        return Err(ModelError::InvalidJob(format!(
            "groups of {g} machines do not split {} machines in two levels",
            job.machines
        )));
    }
    let rail = hw.rail(job.devices);
    let post = hw.post_seconds();
    let costs = Costs {
        stages,
        rail,
        post,
        buffers: staging.buffers.max(1) as usize,
        group: g as usize,
    };
    let mut schedule = Schedule::default();
    let mut machines = Machine::many(&mut schedule, job.machines);
    for (slice, submitted) in &slices {
        add(&costs, &mut schedule, &mut machines, slice, *submitted)?;
    }
    schedule.run();
    let traffic = Traffic {
        slices: slices.len() as u64,
        shards_per_full_slice: g,
        staging_buffers: staging.buffers,
        ..Traffic::default()
    };
    report(Algo::Groups, job, &schedule, &machines, costs.rail, traffic)
}

struct Costs {
    stages: Stages,
    rail: Link,
    post: f64,
    buffers: usize,
    group: usize,
}

impl Costs {
    fn message(&self, bytes: u64) -> f64 {
        self.rail.occupies(self.post, f(bytes))
    }
}

/// One exchange among a level's peers, per peer in the order given: the
/// task after which its part is done (its cell reduced, going up; every other
/// peer's cell landed on it, coming down), and its sends.
struct Level {
    done: Vec<TaskId>,
    sent: Vec<TaskId>,
}

/// Contributions out and in, and the reduction, among `peers` (machine
/// indices; `peers[i]` serves cell `i`, of `cell` bytes): each sends every
/// other peer its cell once `ready[i]` has ended, into the buffer it took
/// (`take`, by machine), and reduces the cells it receives.
fn gather_up(
    costs: &Costs,
    sched: &mut Schedule,
    machines: &mut [Machine],
    peers: &[usize],
    cell: u64,
    ready: &[TaskId],
    take: &[TaskId],
) -> Level {
    let others = peers.len() as u64 - 1;
    let mut sent = Vec::with_capacity(peers.len());
    for (i, &m) in peers.iter().enumerate() {
        let machine = &mut machines[m];
        machine.messages_sent += others;
        machine.bytes_sent += others * cell;
        let task = sched.task(Some(machine.send), f(others) * costs.message(cell), 0.0);
        sched.after(task, ready[i], 0.0);
        sent.push(task);
    }
    let first = sched.first_of(0.0);
    for &r in ready {
        sched.after(first, r, 0.0);
    }
    let mut reduced = Vec::with_capacity(peers.len());
    for (i, &m) in peers.iter().enumerate() {
        let machine = &mut machines[m];
        machine.bytes_received += others * cell;
        let paced = sched.task(
            Some(machine.receive),
            costs.rail.wire(f(others * cell)),
            0.0,
        );
        sched.after(paced, first, 0.0);
        sched.after(paced, take[m], 0.0);
        let task = sched.task(
            Some(machine.gpu),
            costs.stages.memory(f(others + 2) * f(cell)) + costs.stages.step(),
            0.0,
        );
        sched.after(task, paced, 0.0);
        sched.after(task, ready[i], 0.0);
        for (k, &s) in sent.iter().enumerate() {
            if k != i {
                sched.after(task, s, costs.rail.hop());
            }
        }
        reduced.push(task);
    }
    Level { done: reduced, sent }
}

/// The sums back among `peers`: each sends its final cell (final after
/// `done[i]`) to every other.
fn scatter_down(
    costs: &Costs,
    sched: &mut Schedule,
    machines: &mut [Machine],
    peers: &[usize],
    cell: u64,
    done: &[TaskId],
) -> Level {
    let others = peers.len() as u64 - 1;
    let mut sent = Vec::with_capacity(peers.len());
    for (i, &m) in peers.iter().enumerate() {
        let machine = &mut machines[m];
        machine.messages_sent += others;
        machine.bytes_sent += others * cell;
        let task = sched.task(Some(machine.send), f(others) * costs.message(cell), 0.0);
        sched.after(task, done[i], 0.0);
        sent.push(task);
    }
    let first = sched.first_of(0.0);
    for &d in done {
        sched.after(first, d, 0.0);
    }
    let mut landed = Vec::with_capacity(peers.len());
    for (i, &m) in peers.iter().enumerate() {
        let machine = &mut machines[m];
        machine.bytes_received += others * cell;
        let paced = sched.task(
            Some(machine.receive),
            costs.rail.wire(f(others * cell)),
            0.0,
        );
        sched.after(paced, first, 0.0);
        let ready = sched.task(None, 0.0, 0.0);
        sched.after(ready, paced, 0.0);
        sched.after(ready, done[i], 0.0);
        for (k, &s) in sent.iter().enumerate() {
            if k != i {
                sched.after(ready, s, costs.rail.hop());
            }
        }
        landed.push(ready);
    }
    Level { done: landed, sent }
}

fn add(
    costs: &Costs,
    sched: &mut Schedule,
    machines: &mut [Machine],
    slice: &Slice,
    submitted: f64,
) -> Result<(), ModelError> {
    let m_count = machines.len();
    let g = costs.group;
    let h = m_count / g;
    // Each machine's buffer, once the slice `buffers` before it released it.
    let mut take = Vec::with_capacity(m_count);
    for machine in machines.iter() {
        let t = sched.task(None, 0.0, submitted);
        let n = machine.released.len();
        if n >= costs.buffers {
            sched.after(t, machine.released[n - costs.buffers], 0.0);
        }
        take.push(t);
    }
    let local = costs.stages.intra_reduce(slice)?;
    let gather = costs.stages.intra_gather(f(slice.span().byte_len()))?;
    let step = costs.stages.step();
    let scattered: Vec<TaskId> = machines
        .iter_mut()
        .enumerate()
        .map(|(m, machine)| {
            machine
                .reduce
                .call(sched, machine.nvlink, local, take[m], step)
        })
        .collect();
    let slot = slice.slot(0)?.byte_len();
    let cell = slot.div_ceil(g as u64);
    let piece = cell.div_ceil(h as u64);
    let mut sends: Vec<Vec<TaskId>> = vec![Vec::new(); m_count];
    // 2. Within each group.
    let mut group_reduced = vec![scattered[0]; m_count];
    for group in 0..h {
        let peers: Vec<usize> = (group * g..(group + 1) * g).collect();
        let ready: Vec<TaskId> = peers.iter().map(|&m| scattered[m]).collect();
        let level = gather_up(costs, sched, machines, &peers, cell, &ready, &take);
        for (i, &m) in peers.iter().enumerate() {
            group_reduced[m] = level.done[i];
            sends[m].push(level.sent[i]);
        }
    }
    // 3. Across the groups, member by member.
    let mut cell_final = vec![scattered[0]; m_count];
    for member in 0..g {
        let peers: Vec<usize> = (0..h).map(|group| group * g + member).collect();
        let ready: Vec<TaskId> = peers.iter().map(|&m| group_reduced[m]).collect();
        let up = gather_up(costs, sched, machines, &peers, piece, &ready, &take);
        let down = scatter_down(costs, sched, machines, &peers, piece, &up.done);
        for (i, &m) in peers.iter().enumerate() {
            cell_final[m] = down.done[i];
            sends[m].push(up.sent[i]);
            sends[m].push(down.sent[i]);
        }
    }
    // 4. Back within each group; 5. the all-gather; the buffer is released.
    for group in 0..h {
        let peers: Vec<usize> = (group * g..(group + 1) * g).collect();
        let done: Vec<TaskId> = peers.iter().map(|&m| cell_final[m]).collect();
        let down = scatter_down(costs, sched, machines, &peers, cell, &done);
        for (i, &m) in peers.iter().enumerate() {
            sends[m].push(down.sent[i]);
            let machine = &mut machines[m];
            let gathered =
                machine
                    .gather
                    .call(sched, machine.nvlink, gather, down.done[i], step);
            let released = sched.task(None, 0.0, 0.0);
            sched.after(released, gathered, 0.0);
            for &s in &sends[m] {
                sched.after(released, s, 0.0);
            }
            machine.released.push(released);
        }
    }
    Ok(())
}
