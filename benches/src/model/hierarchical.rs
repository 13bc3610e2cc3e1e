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
//! over NVLink.
//!
//! Every stage holds its resource (a timeline of busy intervals) while it runs, so the stages of
//! different slices overlap exactly as far as the resources and the staging
//! buffers allow: a slice takes a machine's buffer when the slice `buffers` before
//! it has released that machine's buffer (its all-gather done, its results sent),
//! and a server receives contributions only into a free buffer. A stage hand-off
//! costs the software's step time; each tensor costs the submission time.
//!
//! [`Role::contributions_to_send`]: fairring_core::staging::Role::contributions_to_send

use fairring_core::plan::{DoubleTree, Geometry, Routing, Slice};
use fairring_core::staging::Role;
use fairring_core::topology::{Location, RankLayout, Topology};

use super::stages::{self, Buffers, Stages, f};
use super::timeline::{Timeline, TopTwo};
use super::{Algo, Busy, Hardware, Job, Link, ModelError, Prediction, Traffic};

/// One machine's resources (rail 0 stands for every rail) and what it did.
#[derive(Clone, Debug, Default)]
struct Machine {
    nvlink: Timeline,
    gpu: Timeline,
    send: Timeline,
    receive: Timeline,
    buffers: Buffers,
    messages_sent: u64,
    bytes_sent: u64,
    bytes_received: u64,
}

/// The predicted time of the hierarchical all-reduce of `job`.
pub fn predict(hw: &Hardware, job: &Job) -> Result<Prediction, ModelError> {
    let topology = Topology::new(job.machines, job.devices, RankLayout::Contiguous)?;
    let geometry = Geometry::new(topology, job.slicing)?;
    let buffers = geometry.staging_buffers(job.budget_bytes)?;
    let costs = Costs {
        stages: Stages::new(hw, job),
        rail: hw.rail(job.devices),
        alone: job.machines == 1 && job.devices > 1,
    };
    let machine = Machine {
        buffers: Buffers::new(buffers),
        ..Machine::default()
    };
    let mut machines = vec![machine; job.machines as usize];
    let mut pipeline = Pipeline {
        costs: &costs,
        machines: &mut machines,
        scratch: Scratch::default(),
    };
    let slices = stages::slices(&geometry, job, &costs.stages)?;
    for (slice, submitted) in &slices {
        pipeline.run(slice, *submitted)?;
    }
    let end = machines
        .iter()
        .map(|m| m.buffers.finished())
        .fold(0.0, f64::max);
    let busiest = machines
        .iter()
        .max_by_key(|m| (m.bytes_sent, m.messages_sent))
        .cloned()
        .unwrap_or_default();
    let traffic = Traffic {
        slices: slices.len() as u64,
        shards_per_full_slice: geometry.shards_per_full_slice(),
        through_trees: geometry.routing() == Routing::Trees,
        staging_buffers: buffers,
        messages_sent: busiest.messages_sent,
        bytes_sent: busiest.bytes_sent,
        bytes_received: busiest.bytes_received,
    };
    let busy = Busy {
        send: busiest.send.busy(),
        send_alpha: f(busiest.messages_sent) * costs.rail.latency_us * 1e-6,
        receive: busiest.receive.busy(),
        gpu: busiest.gpu.busy(),
        nvlink: busiest.nvlink.busy(),
    };
    Ok(Prediction::with_busy(
        Algo::Hierarchical,
        job,
        end,
        Some(traffic),
        Some(busy),
    ))
}

/// What a slice's stages cost on this job.
struct Costs {
    stages: Stages,
    rail: Link,
    /// One machine of several GPUs: a slice is one NCCL all-reduce.
    alone: bool,
}

/// Per-slice times of each machine, reused from slice to slice.
#[derive(Default)]
struct Scratch {
    ready: Vec<f64>,
    scattered: Vec<f64>,
    sent: Vec<f64>,
    reduced: Vec<f64>,
    returned: Vec<f64>,
    cell: Vec<u64>,
    role: Vec<Role>,
    /// Through trees, per machine: when its contribution to the shard's tree
    /// reached its parent, and when its shard was final.
    arrived: Vec<f64>,
    final_at: Vec<f64>,
    /// Through trees, per machine: when its slot was final, and when its last
    /// send of the slice ended.
    slot_final: Vec<f64>,
    last_sent: Vec<f64>,
    order: Vec<u32>,
}

struct Pipeline<'a> {
    costs: &'a Costs,
    machines: &'a mut [Machine],
    scratch: Scratch,
}

impl Pipeline<'_> {
    fn run(&mut self, slice: &Slice, submitted: f64) -> Result<(), ModelError> {
        if let Some(trees) = slice.double_tree() {
            return self.run_trees(slice, &trees, submitted);
        }
        let m_count = self.machines.len();
        let costs = self.costs;
        let s = &mut self.scratch;
        for v in [
            &mut s.ready,
            &mut s.scattered,
            &mut s.sent,
            &mut s.reduced,
            &mut s.returned,
        ] {
            v.clear();
            v.resize(m_count, f64::NEG_INFINITY);
        }
        s.cell.clear();
        s.cell.resize(m_count, 0);
        s.role.clear();
        for m in 0..m_count {
            s.role.push(slice.role(location(m))?);
        }
        let slice_bytes = f(slice.span().byte_len());
        let slot_bytes = slice.slot(0)?.byte_len();
        // Which machine serves which cell of rail 0, from the plan.
        for j in 0..slice.shards() {
            let server = slice.server(j)? as usize;
            s.cell[server] = slice.cell(0, j)?.span().byte_len();
        }
        // 1-2. Reduce-scatter within the machine, then contributions out.
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let ready = machine.buffers.take(submitted);
            s.ready[m] = ready;
            let local = if costs.alone {
                costs.stages.intra_all_reduce(slice_bytes)
            } else {
                costs.stages.intra(slice_bytes)
            };
            s.scattered[m] = machine.nvlink.run(ready, local);
            let sends = u64::from(s.role[m].contributions_to_send);
            let bytes = slot_bytes - s.cell[m];
            s.sent[m] = if sends > 0 {
                machine.messages_sent += sends;
                machine.bytes_sent += bytes;
                machine
                    .send
                    .run(s.scattered[m], costs.rail.seconds(f(sends), f(bytes)))
            } else {
                s.scattered[m]
            };
        }
        let last_sent = TopTwo::of(s.sent.iter().copied().enumerate());
        let first_scattered = s.scattered.iter().copied().fold(f64::INFINITY, f64::min);
        // 3-5. Contributions in, reduction, results out, on every serving machine.
        for (v, machine) in self.machines.iter_mut().enumerate() {
            let role = s.role[v];
            if !role.reduces {
                s.reduced[v] = s.scattered[v];
                s.returned[v] = s.scattered[v];
                continue;
            }
            let others = f64::from(role.contributions_to_receive);
            let cell = s.cell[v];
            let bytes_in = u64::from(role.contributions_to_receive) * cell;
            machine.bytes_received += bytes_in;
            let paced = machine.receive.run(
                first_scattered.max(s.ready[v]),
                costs.rail.seconds(0.0, f(bytes_in)),
            );
            let arrived = paced.max(last_sent.max_except(v) + costs.rail.latency_us * 1e-6);
            s.reduced[v] = machine.gpu.run(
                arrived.max(s.scattered[v]),
                costs.stages.memory((others + 2.0) * f(cell)) + costs.stages.step(),
            );
            let results = u64::from(role.results_to_send);
            machine.messages_sent += results;
            machine.bytes_sent += results * cell;
            s.returned[v] = machine.send.run(
                s.reduced[v],
                costs.rail.seconds(f(results), f(results * cell)),
            );
        }
        let last_returned = TopTwo::of(
            s.returned
                .iter()
                .copied()
                .enumerate()
                .filter(|&(v, _)| s.cell[v] > 0),
        );
        let first_reduced = s
            .reduced
            .iter()
            .zip(&s.cell)
            .filter(|&(_, &c)| c > 0)
            .map(|(&t, _)| t)
            .fold(f64::INFINITY, f64::min);
        // 6-7. Results in, all-gather within the machine; the buffer is released.
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let mut ready = s.reduced[m];
            if s.role[m].results_to_receive > 0 {
                let bytes = slot_bytes - s.cell[m];
                machine.bytes_received += bytes;
                let paced = machine
                    .receive
                    .run(first_reduced, costs.rail.seconds(0.0, f(bytes)));
                ready = ready
                    .max(paced)
                    .max(last_returned.max_except(m) + costs.rail.latency_us * 1e-6);
            }
            let gathered = if costs.alone {
                // The all-reduce left the whole slice final in the tensor.
                ready
            } else {
                machine.nvlink.run(ready, costs.stages.intra(slice_bytes))
            };
            machine.buffers.release(gathered.max(s.returned[m]));
        }
        Ok(())
    }
}

impl Pipeline<'_> {
    /// A slice whose shards go through the trees (see the module docs).
    fn run_trees(
        &mut self,
        slice: &Slice,
        trees: &DoubleTree,
        submitted: f64,
    ) -> Result<(), ModelError> {
        let m_count = self.machines.len();
        let costs = self.costs;
        let latency = costs.rail.latency_us * 1e-6;
        let s = &mut self.scratch;
        for v in [
            &mut s.ready,
            &mut s.scattered,
            &mut s.arrived,
            &mut s.final_at,
            &mut s.slot_final,
            &mut s.last_sent,
        ] {
            v.clear();
            v.resize(m_count, f64::NEG_INFINITY);
        }
        let slice_bytes = f(slice.span().byte_len());
        // 1. Reduce-scatter within the machine.
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let ready = machine.buffers.take(submitted);
            s.ready[m] = ready;
            s.scattered[m] = machine.nvlink.run(ready, costs.stages.intra(slice_bytes));
            s.slot_final[m] = s.scattered[m];
        }
        for j in 0..slice.shards() {
            let Some(tree) = slice.tree_of(j)? else {
                continue;
            };
            let cell_of_shard = slice.cell(0, j)?;
            let root = trees.root(tree)?;
            post_order(trees, tree, root, &mut s.order)?;
            // Each part of the cell goes up and down on its own (the plan's
            // `Cell::part`), one after the other on every link.
            for part in 0..cell_of_shard.parts() {
                let cell = cell_of_shard.part(part)?.byte_len();
                // 2-4. Up the tree: children before their parent.
                for &x in &s.order {
                    let xi = x as usize;
                    let children = trees.children(tree, x)?;
                    let count = children.iter().flatten().count() as u64;
                    let mut have = s.scattered[xi];
                    for c in children.iter().flatten() {
                        have = have.max(s.arrived[*c as usize]);
                    }
                    let up_ready = if count > 0 {
                        let machine = &mut self.machines[xi];
                        machine.bytes_received += count * cell;
                        machine.gpu.run(
                            have,
                            costs.stages.memory(f(count + 2) * f(cell)) + costs.stages.step(),
                        )
                    } else {
                        have
                    };
                    match trees.parent(tree, x)? {
                        Some(p) => {
                            let start = up_ready.max(s.ready[p as usize]);
                            let machine = &mut self.machines[xi];
                            machine.messages_sent += 1;
                            machine.bytes_sent += cell;
                            let sent = machine.send.run(start, costs.rail.seconds(1.0, f(cell)));
                            s.last_sent[xi] = s.last_sent[xi].max(sent);
                            let landed = self.machines[p as usize]
                                .receive
                                .run(start, costs.rail.seconds(0.0, f(cell)));
                            s.arrived[xi] = sent.max(landed) + latency;
                        }
                        None => s.final_at[xi] = up_ready,
                    }
                }
                // 5-6. Down the tree: parents before their children.
                for &x in s.order.iter().rev() {
                    let xi = x as usize;
                    let done = s.final_at[xi];
                    s.slot_final[xi] = s.slot_final[xi].max(done);
                    for c in trees.children(tree, x)?.into_iter().flatten() {
                        let machine = &mut self.machines[xi];
                        machine.messages_sent += 1;
                        machine.bytes_sent += cell;
                        let sent = machine.send.run(done, costs.rail.seconds(1.0, f(cell)));
                        s.last_sent[xi] = s.last_sent[xi].max(sent);
                        let child = &mut self.machines[c as usize];
                        child.bytes_received += cell;
                        let landed = child.receive.run(done, costs.rail.seconds(0.0, f(cell)));
                        s.final_at[c as usize] = sent.max(landed) + latency;
                    }
                }
            }
        }
        // 7. All-gather within the machine; the buffer is released.
        for (m, machine) in self.machines.iter_mut().enumerate() {
            let gathered = machine
                .nvlink
                .run(s.slot_final[m], costs.stages.intra(slice_bytes));
            machine.buffers.release(gathered.max(s.last_sent[m]));
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
