//! fairring's hierarchical all-reduce with co-located servers, driven by the plan
//! fairring-core makes for the job.
//!
//! Each slice of each tensor passes, on every machine, through:
//!
//! 1. **reduce-scatter** within the machine (NCCL's ring over NVLink when `D > 1`;
//!    a copy into staging when `D = 1`), on the machine's NVLink (or GPU);
//! 2. **contributions out**: rail 0 sends one message per shard of its slot served
//!    by another machine ([`Role::contributions_to_send`]), on its send side;
//! 3. **contributions in**: a serving machine's rail receives `M - 1` copies of its
//!    cell on its receive side, no sooner than the last sender has sent;
//! 4. **reduction** of the `M - 1` contributions on the GPU by the many-source
//!    kernel: `M + 1` cell-sized passes over memory (`M - 1` contributions read,
//!    the destination read and written once);
//! 5. **results out** to the `M - 1` other machines, on the send side;
//! 6. **results in** from every other server of the slice, on the receive side;
//! 7. **all-gather** within the machine, on NVLink.
//!
//! Where the plan routes cells through its two trees (more machines than a
//! slot has shards of the minimum size), steps 2 to 6 follow each shard's
//! tree instead, from the leaves up and from the root down, one part of each
//! cell after another (the plan's `Cell::part`): a node's part (of a leaf's
//! cell, or of an inner node's partial sum) leaves on its send side once its
//! buffer holds it and its parent has taken a buffer, lands on the parent's
//! receive side, the parent reduces its children's copies of the part on the
//! GPU (`c + 2` part-sized passes for `c` children, and a hand-off) once all
//! are in, and the root's result goes down child by child the same way.
//!
//! A job of one machine of several GPUs does none of this: the engine plans
//! each tensor as one slice and runs it as one NCCL all-reduce in the tensor
//! over NVLink. Nor does an all-reduce the engine runs as one NCCL
//! all-reduce over the whole job (`fairring::nccl_across_job`: two to seven
//! machines whose GPUs reduce in their NVSwitch, at the sizes where NCCL's
//! all-reduce is ahead of the plan). Each such call waits for no gate and ends
//! without a hand-off, so it is charged as NCCL's tuner times it and nothing
//! more.
//!
//! Steps 1 and 7 are NCCL calls on two communicators of the machine, as the
//! engine issues them (`local::nccl`): each communicator's calls run one after
//! another, and a call's latency (NCCL's fixed cost, as its tuner predicts it)
//! and the hand-off after it hold no NVLink, so the next slice's reduce-scatter
//! pays its latency while the last slice's all-gather moves its bytes
//! (`stages::Direction`). A study the engine does not run gives each
//! direction two communicators, which a machine's slices take in turn
//! (`Job::comms_per_direction`).
//!
//! Every stage is a task of a discrete-event schedule (`events.rs`): it holds its
//! resource while it runs, starts once its inputs are in and its resource has run
//! every stage that became ready before it, so the stages of different slices
//! overlap exactly as far as the resources and the staging buffers allow: a slice takes a machine's buffer when the slice `buffers` before
//! it has released that machine's buffer (its all-gather done, its results sent),
//! and a server receives contributions only into a free buffer. A stage hand-off
//! costs the software's step time; each tensor costs the submission time.
//!
//! [`Role::contributions_to_send`]: fairring_core::staging::Role::contributions_to_send

use fairring_core::plan::{DoubleTree, Routing, Slice};
use fairring_core::staging::Role;
use fairring_core::topology::Location;

use super::events::{ResourceId, Schedule, TaskId};
use super::nccl::{self, NcclAlgorithm};
use super::stages::{self, Direction, Stages, f};
use super::{Algo, Busy, Hardware, Job, Link, ModelError, Prediction, Traffic};

/// One machine's resources (rail 0 stands for every rail) and what it did.
#[derive(Clone, Debug)]
pub(super) struct Machine {
    pub(super) nvlink: ResourceId,
    /// Its communicators of reduce-scatters and of all-gathers.
    pub(super) reduce: Direction,
    pub(super) gather: Direction,
    pub(super) gpu: ResourceId,
    pub(super) send: ResourceId,
    pub(super) receive: ResourceId,
    /// When each of its slices released its staging buffer, by slice.
    pub(super) released: Vec<TaskId>,
    pub(super) messages_sent: u64,
    pub(super) bytes_sent: u64,
    pub(super) bytes_received: u64,
}

impl Machine {
    /// `count` machines, each with its resources in `schedule` and `comms`
    /// communicators a direction ([`Job::comms_per_direction`]).
    pub(super) fn many(schedule: &mut Schedule, count: u32, comms: u32) -> Vec<Machine> {
        (0..count)
            .map(|_| Machine {
                nvlink: schedule.resource(),
                reduce: Direction::new(comms),
                gather: Direction::new(comms),
                gpu: schedule.resource(),
                send: schedule.resource(),
                receive: schedule.resource(),
                released: Vec::new(),
                messages_sent: 0,
                bytes_sent: 0,
                bytes_received: 0,
            })
            .collect()
    }
}

/// What a run schedule says of `machines`: the last buffer released, and the
/// traffic and busy times of the machine that sent most (`traffic`'s counts
/// filled in from it).
pub(super) fn report(
    algo: Algo,
    job: &Job,
    schedule: &Schedule,
    machines: &[Machine],
    rail: Link,
    mut traffic: Traffic,
) -> Result<Prediction, ModelError> {
    let end = machines
        .iter()
        .flat_map(|m| m.released.iter().map(|&t| schedule.end(t)))
        .fold(0.0, f64::max);
    let busiest = machines
        .iter()
        .max_by_key(|m| (m.bytes_sent, m.messages_sent))
        .ok_or(ModelError::InvalidJob("a job has a machine".into()))?;
    traffic.messages_sent = busiest.messages_sent;
    traffic.bytes_sent = busiest.bytes_sent;
    traffic.bytes_received = busiest.bytes_received;
    let send = schedule.busy(busiest.send);
    let busy = Busy {
        send,
        send_alpha: (send - rail.wire(f(busiest.bytes_sent))).max(0.0),
        receive: schedule.busy(busiest.receive),
        gpu: schedule.busy(busiest.gpu),
        nvlink: schedule.busy(busiest.nvlink),
    };
    Ok(Prediction::with_busy(
        algo,
        job,
        end,
        Some(traffic),
        Some(busy),
    ))
}

/// The predicted time of the hierarchical all-reduce of `job`.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    // What the engine would refuse as the communicator is made, it refuses
    // whatever path an all-reduce then takes.
    let staging = job.staging(0)?;
    if let Some(p) = through_nccl(hw, job, &staging, Algo::Hierarchical)? {
        return Ok(p);
    }
    // A small tensor on the flat plan runs in groups, in the same buffers.
    if let Some(grouped) = staging.grouped
        && fairring::takes_groups(&staging.geometry, job.dtype, job.elements())
    {
        let in_groups = fairring::Staging {
            geometry: grouped,
            ..staging
        };
        return predict_plan(hw, job, &in_groups);
    }
    predict_plan(hw, job, &staging)
}

/// The predicted time of `job`'s all-reduces through the plan `staging`
/// makes, the machines serving (in one level or in groups): the
/// hierarchical row's, and the servers row's where the machines serve
/// beside them (`servers.rs`).
pub(super) fn predict_plan(
    hw: &Hardware,
    job: &Job,
    staging: &fairring::Staging,
) -> Result<Prediction, ModelError> {
    if staging.geometry.machine_groups().is_some() {
        return super::groups::predict_engine(hw, job, staging);
    }
    let geometry = staging.geometry;
    let buffers = staging.buffers;
    let costs = Costs {
        stages: Stages::new(hw, job),
        rail: hw.rail(job.devices),
        post: hw.post_seconds(),
        buffers: buffers as usize,
    };
    let mut schedule = Schedule::default();
    let mut machines = Machine::many(&mut schedule, job.machines, job.comms_per_direction);
    let mut pipeline = Pipeline {
        costs: &costs,
        machines: &mut machines,
        schedule: &mut schedule,
        scratch: Scratch::default(),
    };
    let slices = stages::slices(&geometry, job, &costs.stages)?;
    for (slice, submitted) in &slices {
        pipeline.add(slice, *submitted)?;
    }
    schedule.run();
    let traffic = Traffic {
        slices: slices.len() as u64,
        shards_per_full_slice: geometry.shards_per_full_slice(),
        through_trees: geometry.routing() == Routing::Trees,
        staging_buffers: buffers,
        ..Traffic::default()
    };
    report(
        Algo::Hierarchical,
        job,
        &schedule,
        &machines,
        costs.rail,
        traffic,
    )
}

/// What a slice's stages cost on this job.
struct Costs {
    stages: Stages,
    rail: Link,
    /// Seconds a message's post costs its sender.
    post: f64,
    /// Staging buffers per GPU.
    buffers: usize,
}

impl Costs {
    /// Seconds a message of `bytes` occupies its sender.
    fn message(&self, bytes: u64) -> f64 {
        self.rail.occupies(self.post, f(bytes))
    }
}

/// Per-slice tasks of each machine, reused from slice to slice.
#[derive(Default)]
struct Scratch {
    take: Vec<TaskId>,
    scattered: Vec<TaskId>,
    sent: Vec<Option<TaskId>>,
    reduced: Vec<TaskId>,
    returned: Vec<TaskId>,
    cell: Vec<u64>,
    role: Vec<Role>,
    /// Through trees, per machine: the task after which its contribution to
    /// the shard's tree is at its parent, and after which its shard is final.
    arrived: Vec<Option<TaskId>>,
    final_at: Vec<Option<TaskId>>,
    /// Through trees, per machine: its slot final, and every send of the slice.
    slot_final: Vec<TaskId>,
    sends: Vec<Vec<TaskId>>,
    order: Vec<u32>,
}

struct Pipeline<'a> {
    costs: &'a Costs,
    machines: &'a mut [Machine],
    schedule: &'a mut Schedule,
    scratch: Scratch,
}

impl Pipeline<'_> {
    /// Each machine's staging buffer for the next slice, taken once the
    /// slice `buffers` before it released it (and no sooner than `submitted`).
    fn take_buffers(&mut self, submitted: f64) {
        let buffers = self.costs.buffers.max(1);
        self.scratch.take.clear();
        for machine in self.machines.iter() {
            let take = self.schedule.task(None, 0.0, submitted);
            let n = machine.released.len();
            if n >= buffers {
                self.schedule
                    .after(take, machine.released[n - buffers], 0.0);
            }
            self.scratch.take.push(take);
        }
    }

    /// The reduce-scatter within each machine (or its one all-reduce).
    fn scatter(&mut self, slice: &Slice) -> Result<(), ModelError> {
        let costs = self.costs;
        self.scratch.scattered.clear();
        let local = costs.stages.intra_reduce(slice)?;
        let step = costs.stages.step();
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let scattered = machine.reduce.call(
                machine.released.len(),
                self.schedule,
                machine.nvlink,
                local,
                self.scratch.take[m],
                step,
            );
            self.scratch.scattered.push(scattered);
        }
        Ok(())
    }

    fn add(&mut self, slice: &Slice, submitted: f64) -> Result<(), ModelError> {
        self.take_buffers(submitted);
        let slice_bytes = f(slice.span().byte_len());
        self.scatter(slice)?;
        if let Some(trees) = slice.double_tree() {
            return self.add_trees(slice, &trees, slice_bytes);
        }
        let m_count = self.machines.len();
        let costs = self.costs;
        let gather = costs.stages.intra_gather(slice_bytes)?;
        let sched = &mut *self.schedule;
        let s = &mut self.scratch;
        s.cell.clear();
        s.cell.resize(m_count, 0);
        s.role.clear();
        for m in 0..m_count {
            s.role.push(slice.role(location(m))?);
        }
        let slot_bytes = slice.slot(0)?.byte_len();
        // Which machine serves which cell of rail 0, from the plan; a machine
        // sends a contribution to every other server, each message occupying
        // its send side for its post or its bytes, the longer.
        let mut posting = 0.0;
        for j in 0..slice.shards() {
            let server = slice.server(0, j)? as usize;
            let cell = slice.cell(0, j)?.span().byte_len();
            s.cell[server] = cell;
            posting += costs.message(cell);
        }
        // 2. Contributions out.
        s.sent.clear();
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let sends = u64::from(s.role[m].contributions_to_send);
            if sends == 0 {
                s.sent.push(None);
                continue;
            }
            machine.messages_sent += sends;
            machine.bytes_sent += slot_bytes - s.cell[m];
            let own = if s.cell[m] > 0 {
                costs.message(s.cell[m])
            } else {
                0.0
            };
            let sent = sched.task(Some(machine.send), posting - own, 0.0);
            sched.after(sent, s.scattered[m], 0.0);
            s.sent.push(Some(sent));
        }
        // 3-5. Contributions in, reduction, results out, on every serving machine.
        // A receive side takes the bytes from the first sender on.
        let first_scattered = sched.first_of(0.0);
        for &scattered in &s.scattered {
            sched.after(first_scattered, scattered, 0.0);
        }
        s.reduced.clear();
        s.returned.clear();
        for (v, machine) in self.machines.iter_mut().enumerate() {
            let role = s.role[v];
            if !role.reduces {
                s.reduced.push(s.scattered[v]);
                s.returned.push(s.scattered[v]);
                continue;
            }
            let others = f64::from(role.contributions_to_receive);
            let cell = s.cell[v];
            let bytes_in = u64::from(role.contributions_to_receive) * cell;
            machine.bytes_received += bytes_in;
            // Into a buffer of its own.
            let paced = sched.task(Some(machine.receive), costs.rail.wire(f(bytes_in)), 0.0);
            sched.after(paced, first_scattered, 0.0);
            sched.after(paced, s.take[v], 0.0);
            let reduced = sched.task(
                Some(machine.gpu),
                costs.stages.memory((others + 2.0) * f(cell)) + costs.stages.step(),
                0.0,
            );
            sched.after(reduced, paced, 0.0);
            sched.after(reduced, s.scattered[v], 0.0);
            for (m, sent) in s.sent.iter().enumerate() {
                if let Some(sent) = *sent
                    && m != v
                {
                    sched.after(reduced, sent, costs.rail.hop());
                }
            }
            let results = u64::from(role.results_to_send);
            machine.messages_sent += results;
            machine.bytes_sent += results * cell;
            let returned = sched.task(Some(machine.send), f(results) * costs.message(cell), 0.0);
            sched.after(returned, reduced, 0.0);
            s.reduced.push(reduced);
            s.returned.push(returned);
        }
        // 6-7. Results in (from the first server's on), all-gather within the
        // machine; the buffer is released.
        let first_reduced = sched.first_of(0.0);
        for v in (0..m_count).filter(|&v| s.cell[v] > 0) {
            sched.after(first_reduced, s.reduced[v], 0.0);
        }
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let ready = sched.task(None, 0.0, 0.0);
            sched.after(ready, s.reduced[m], 0.0);
            if s.role[m].results_to_receive > 0 {
                let bytes = slot_bytes - s.cell[m];
                machine.bytes_received += bytes;
                let paced = sched.task(Some(machine.receive), costs.rail.wire(f(bytes)), 0.0);
                sched.after(paced, first_reduced, 0.0);
                sched.after(ready, paced, 0.0);
                for v in (0..m_count).filter(|&v| v != m && s.cell[v] > 0) {
                    sched.after(ready, s.returned[v], costs.rail.hop());
                }
            }
            let gathered = machine.gather.call(
                machine.released.len(),
                sched,
                machine.nvlink,
                gather,
                ready,
                costs.stages.step(),
            );
            let released = sched.task(None, 0.0, 0.0);
            sched.after(released, gathered, 0.0);
            sched.after(released, s.returned[m], 0.0);
            machine.released.push(released);
        }
        Ok(())
    }

    /// A slice whose shards go through the trees (see the module docs).
    fn add_trees(
        &mut self,
        slice: &Slice,
        trees: &DoubleTree,
        slice_bytes: f64,
    ) -> Result<(), ModelError> {
        let m_count = self.machines.len();
        let costs = self.costs;
        let latency = costs.rail.hop();
        let gather = costs.stages.intra_gather(slice_bytes)?;
        let sched = &mut *self.schedule;
        let s = &mut self.scratch;
        s.slot_final.clear();
        s.slot_final
            .extend(s.scattered.iter().map(|_| sched.task(None, 0.0, 0.0)));
        for (&done, &scattered) in s.slot_final.iter().zip(&s.scattered) {
            sched.after(done, scattered, 0.0);
        }
        s.sends.clear();
        s.sends.resize(m_count, Vec::new());
        for j in 0..slice.shards() {
            let Some(tree) = slice.tree_of(j)? else {
                continue;
            };
            let cell_of_shard = slice.cell(0, j)?;
            let root = trees.root(tree)?;
            post_order(trees, tree, root, &mut s.order)?;
            // Each part of the cell goes up and down on its own (the plan's
            // `Cell::part`).
            for part in 0..cell_of_shard.parts() {
                let cell = cell_of_shard.part(part)?.byte_len();
                s.arrived.clear();
                s.arrived.resize(m_count, None);
                s.final_at.clear();
                s.final_at.resize(m_count, None);
                // 2-4. Up the tree: children before their parent.
                for &x in &s.order {
                    let xi = x as usize;
                    let children = trees.children(tree, x)?;
                    let count = children.iter().flatten().count() as u64;
                    let up_ready = if count > 0 {
                        let machine = &mut self.machines[xi];
                        machine.bytes_received += count * cell;
                        let reduced = sched.task(
                            Some(machine.gpu),
                            costs.stages.memory(f(count + 2) * f(cell)) + costs.stages.step(),
                            0.0,
                        );
                        sched.after(reduced, s.scattered[xi], 0.0);
                        for c in children.iter().flatten() {
                            if let Some(arrived) = s.arrived[*c as usize] {
                                sched.after(reduced, arrived, 0.0);
                            }
                        }
                        reduced
                    } else {
                        s.scattered[xi]
                    };
                    match trees.parent(tree, x)? {
                        Some(p) => {
                            let p = p as usize;
                            let machine = &mut self.machines[xi];
                            machine.messages_sent += 1;
                            machine.bytes_sent += cell;
                            let sent = sched.task(Some(machine.send), costs.message(cell), 0.0);
                            let landed = sched.task(
                                Some(self.machines[p].receive),
                                costs.rail.wire(f(cell)),
                                0.0,
                            );
                            for t in [sent, landed] {
                                sched.after(t, up_ready, 0.0);
                                sched.after(t, s.take[p], 0.0);
                            }
                            s.sends[xi].push(sent);
                            let arrived = sched.task(None, 0.0, 0.0);
                            sched.after(arrived, sent, latency);
                            sched.after(arrived, landed, latency);
                            s.arrived[xi] = Some(arrived);
                        }
                        None => s.final_at[xi] = Some(up_ready),
                    }
                }
                // 5-6. Down the tree: parents before their children.
                for &x in s.order.iter().rev() {
                    let xi = x as usize;
                    let Some(done) = s.final_at[xi] else {
                        continue;
                    };
                    sched.after(s.slot_final[xi], done, 0.0);
                    for c in trees.children(tree, x)?.into_iter().flatten() {
                        let ci = c as usize;
                        let machine = &mut self.machines[xi];
                        machine.messages_sent += 1;
                        machine.bytes_sent += cell;
                        let sent = sched.task(Some(machine.send), costs.message(cell), 0.0);
                        sched.after(sent, done, 0.0);
                        s.sends[xi].push(sent);
                        let child = &mut self.machines[ci];
                        child.bytes_received += cell;
                        let landed = sched.task(Some(child.receive), costs.rail.wire(f(cell)), 0.0);
                        sched.after(landed, done, 0.0);
                        let final_at = sched.task(None, 0.0, 0.0);
                        sched.after(final_at, sent, latency);
                        sched.after(final_at, landed, latency);
                        s.final_at[ci] = Some(final_at);
                    }
                }
            }
        }
        // 7. All-gather within the machine; the buffer is released.
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let gathered = machine.gather.call(
                machine.released.len(),
                sched,
                machine.nvlink,
                gather,
                s.slot_final[m],
                costs.stages.step(),
            );
            let released = sched.task(None, 0.0, 0.0);
            sched.after(released, gathered, 0.0);
            for &sent in &s.sends[m] {
                sched.after(released, sent, 0.0);
            }
            machine.released.push(released);
        }
        Ok(())
    }
}

/// The machines of tree `tree` below `root`, each after its children.
fn post_order(
    trees: &DoubleTree,
    tree: u32,
    root: u32,
    out: &mut Vec<u32>,
) -> Result<(), ModelError> {
    out.clear();
    // Each machine is pushed once, and visited a second time once its
    // children are out.
    let mut stack = vec![(root, false)];
    while let Some((x, expanded)) = stack.pop() {
        if expanded {
            out.push(x);
            continue;
        }
        stack.push((x, true));
        for c in trees.children(tree, x)?.into_iter().flatten() {
            stack.push((c, false));
        }
    }
    Ok(())
}

fn location(machine: usize) -> Location {
    Location {
        machine: u32::try_from(machine).unwrap_or(u32::MAX),
        device: 0,
    }
}

/// Where the engine runs `job`'s all-reduces as one NCCL all-reduce over the
/// whole job, their time as NCCL's tuner picks and times it, one after
/// another on one communicator: on one machine of several GPUs (the
/// machine's communicator), and over the job's communicator
/// (`fairring::nccl_across_job`, on two to seven machines whose GPUs reduce
/// in their NVSwitch: the preset's NCCL topology has NVLS between machines).
/// Such a call's device program waits for no gate and ends without a
/// hand-off (`memory::program::ungated`): the device starts it as soon as
/// the caller's stream reaches it, and streams waiting for it go on once it
/// has ended, while the engine checks it on the host. So it costs NCCL's
/// time and nothing more, as PyTorch's NCCL backend's call does. No byte
/// crosses fairring's rails. The same holds beside dedicated servers, which
/// serve none of it (`servers.rs`). `None` where the engine runs the plan;
/// else the prediction as `algo`.
pub(super) fn through_nccl(
    hw: &Hardware,
    job: &Job,
    staging: &fairring::Staging,
    algo: Algo,
) -> Result<Option<Prediction>, ModelError> {
    let one_machine = job.machines == 1 && job.devices > 1;
    let across_job = hw.nccl.machines.nvls.is_some()
        && job.nccl_across_machines
        && job.devices > 1
        && (2..=fairring::NCCL_ACROSS_UP_TO_MACHINES).contains(&job.machines)
        && fairring::nccl_across_job(job.machines, job.bytes);
    if !one_machine && !across_job {
        return Ok(None);
    }
    nccl_all_reduce(hw, job, staging, algo).map(Some)
}

/// `job`'s all-reduces as the engine runs them where it runs each as one
/// NCCL all-reduce over the workers ([`through_nccl`] says when), predicted
/// as `algo`: NCCL's time, one call after another, and nothing more.
fn nccl_all_reduce(
    hw: &Hardware,
    job: &Job,
    staging: &fairring::Staging,
    algo: Algo,
) -> Result<Prediction, ModelError> {
    let e = nccl::choose(
        &hw.nccl,
        job.machines,
        job.devices,
        job.bytes,
        &NcclAlgorithm::ALL,
    )
    .ok_or_else(|| ModelError::InvalidJob("NCCL runs an all-reduce of several GPUs".into()))?;
    let end = f(u64::from(job.tensors)) * e.time_us * 1e-6;
    // One slice a tensor, and no message or byte on fairring's rails; the
    // engine's staging is made all the same. NCCL holds NVLink throughout
    // (its bytes between machines cross its own connections).
    let traffic = Traffic {
        slices: u64::from(job.tensors),
        shards_per_full_slice: staging.geometry.shards_per_full_slice(),
        staging_buffers: staging.buffers,
        ..Traffic::default()
    };
    let busy = Busy {
        nvlink: end,
        ..Busy::default()
    };
    let mut p = Prediction::with_busy(algo, job, end, Some(traffic), Some(busy));
    p.nccl = Some(e);
    Ok(p)
}
