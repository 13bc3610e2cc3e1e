//! A deterministic simulation of the whole engine: every rank of an `M x D` job
//! in one thread, over an in-memory fabric ([`fabric`]) and the real shared-memory
//! local group on anonymous memory, with a seeded random schedule deciding which
//! rank drives, which link delivers its next post, and when each rank's caller
//! submits its next operation.
//!
//! Each seed picks the layout (`M` in 1..=4, `D` in 1..=3, ranks numbered
//! machine by machine or, for one seed in four, device by device), for three seeds in
//! seven 1 to 3 dedicated reduction servers (which then take the inter-machine
//! step), the number of staging buffers (1..=4), the slice size and, for one
//! seed in three, a minimum shard so large that slots hold fewer shards than
//! there are machines (the hierarchical all-reduce then goes through the
//! core's trees, every shape of up to four machines), a script of
//! integer all-reduces (empty to many slices, `i32`/`i64`/`u8`/`f32`,
//! sum/product/min/max, hierarchical, ring or recursive doubling; on device
//! tensors through the machine's collectives, also one NCCL all-reduce over
//! the workers: the job's, or one machine's beside servers),
//! reduce-scatters (by the scatter algorithm, or as any of those all-reduces),
//! and relayed broadcasts (from any root) and all-gathers, each rank starting
//! from its own values everywhere, whether all-reduces send from their tensors
//! (never, from any size or from 4 KiB; keeping 1, 2 or 64 registrations),
//! on one machine without servers, whether no host slice, the small ones or
//! every one is reduced whole on every rank (`local::shm_step`),
//! for half the seeds, a process (worker or server) to kill at a random step,
//! and, for two seeds in three, whether every operation or about half of them
//! run on device tensors of a simulated GPU per rank ([`device`]): streams
//! whose copies end at drawn steps, start events, and callers that submit
//! behind stream waits on earlier operations, as PyTorch does, and make their
//! streams wait on operations at drawn times; a lone rank of a machine takes
//! the communicator's lone device step, several (for half the seeds) the
//! machine's collectives, as through NCCL ([`simulated_nccl`]: calls that meet
//! across the machine's simulated GPUs in each communicator's order, ranks
//! issuing out of order failing the seed, a failing rank aborting its
//! communicators), or the staged one (`local::staged`); and for a third of
//! the device operations and an eighth of the host ones, a share of the
//! result delivered into a buffer of its own, as a reduce-scatter's; and for
//! half the seeds up to 16 point-to-point messages between drawn pairs, with
//! drawn tags and sizes, each rank posting its own in an order of its own
//! across tags ([`messages`]: through the machine's mailboxes where its
//! ranks copy between tensors, over the network otherwise, linked as the
//! communicator's linker links them). It then checks:
//!
//! - every operation a rank reports done holds exactly the expected values,
//!   and its delivered share, if any, the result's bytes;
//! - without a kill, every operation and message of every rank is done,
//!   and every message received holds exactly what its sender sent;
//! - with a kill, every surviving rank settles every operation and message
//!   (done or failed),
//!   never hangs, and a failed one's error names the killed rank.
//! - on the simulated device, every stream of a live rank runs to its end
//!   once its operations settled, and nothing writes an operation's tensor
//!   after the caller's stream has passed its wait for it.
//!
//! `FAIRRING_SIM_SEEDS` sets how many seeds run (default 1000; CI runs 10000 in
//! the test command's build), spread over the cores the process may use, each
//! seed on one thread; `FAIRRING_SIM_SEED` replays one. A failing seed is
//! printed with the command that replays it.
#![allow(
    clippy::cast_possible_truncation,
    reason = "test values wrap into their element types on purpose"
)]

mod focused;
mod job;
mod messages;
mod network;
mod reach;
mod scenario;
mod simulated_gpu;
mod simulated_nccl;

use std::sync::Arc;
use std::time::Duration;

use fairring_core::plan::{Geometry, PlanConfig};
use fairring_core::topology::{Location, RankLayout, Topology};
use fairring_core::{DataType, ReduceOp, WireFormat};
use fairring_rdma::fabric::{Fabric, LocalRegion};

use crate::engine::Wiring;
use crate::engine::algorithm::{Origins, Resolved, relay_over_machines};
use crate::engine::descriptor::{Collective, Descriptor};
use crate::engine::layout::{BufferLayout, colocated_geometry};
use crate::engine::work_table::{self as work, DONE, FAILED, Submission};
use crate::engine::{DirectSettings, Engine, EngineParts};
use crate::local::{LocalSlice, LocalStep, Machine, PeerCopy, ShmStep, Solo};
use crate::memory::program::ProgramItem;
use crate::memory::{Host, HostTensor, MemoryKind, MemorySpace};
use crate::shm::Segment;
use job::{Collectives, build_job, small_job};
use network::{Network, SimFabric};
use reach::SimStep;
use scenario::*;
use simulated_gpu::{Design, SimFence, SimMemory, SimTensor, Thread};
use simulated_nccl::{SimMachine, join};

/// Steps after which a seed that has not settled counts as hung.
const STEP_LIMIT: u64 = 2_000_000;

struct Rank {
    engine: Engine<SimFabric, SimMemory>,
    /// Per operation: the tensor (as 8-byte words, so every type is aligned).
    tensors: Vec<Vec<u64>>,
    /// Per device operation: the input the caller's stream writes into its
    /// tensor before the operation's start.
    inputs: Vec<Vec<u64>>,
    /// Per operation, where its result is also delivered: bytes `range` of
    /// it, into a buffer of their own (as a reduce-scatter's share).
    shares: Vec<Option<Share>>,
    submitted: usize,
    /// Per operation: `Some(true)` done, `Some(false)` failed.
    settled: Vec<Option<bool>>,
    dead: bool,
}

/// Bytes `range` of an operation's result, delivered into `into`.
struct Share {
    range: std::ops::Range<usize>,
    into: Vec<u64>,
}

impl Share {
    /// Whether rank `r` delivers a share of operation `k` of `bytes` bytes,
    /// and which: drawn from a side stream of the seed's (`seed`), so that
    /// its other draws and its schedule stay as they were. A third of the
    /// device operations; an eighth of the host ones, since a delivering
    /// operation takes no peer's writes into its tensor.
    fn draw(seed: &Rng, r: u32, k: usize, bytes: usize, device: bool) -> Option<Share> {
        let mut rng = seed.side(0x5eed_0000 ^ (u64::from(r) << 32) ^ k as u64);
        let bytes = bytes as u64;
        if bytes == 0 || rng.below(if device { 3 } else { 8 }) != 0 {
            return None;
        }
        let start = rng.below(bytes);
        let end = start + 1 + rng.below(bytes - start);
        Some(Share {
            range: start as usize..end as usize,
            into: vec![0x5a5a_5a5a_5a5a_5a5a; (end - start).div_ceil(8) as usize],
        })
    }

    /// Whether the share holds what the result holds at its range.
    fn check(&self, r: usize, k: usize, result: &[u64]) -> Result<(), String> {
        let got = &word_bytes(&self.into)[..self.range.len()];
        let all = word_bytes(result);
        if got != &all[self.range.clone()] {
            return Err(format!(
                "rank {r}, operation {k}: the delivery of bytes {:?} differs from the result",
                self.range
            ));
        }
        Ok(())
    }
}

/// What a seed did, for the summary line.
#[derive(Debug, Default)]
struct Outcome {
    steps: u64,
    /// Operations on device tensors done.
    device: usize,
    /// ... of them with several ranks per machine, through the machine's
    /// collectives.
    collective: usize,
    /// Slices a machine's collectives reduce-scattered in one call.
    scattered: u64,
    /// All-reduces that met on the job's communicator.
    across_job: u64,
    /// Ungated calls (whole all-reduces through NCCL) that met.
    ungated: usize,
    /// Operations done where the machines reduce in groups.
    in_groups: usize,
    /// Operations done where dedicated servers reduce in groups.
    servers_in_groups: usize,
    /// Workers' all-reduces done as one NCCL all-reduce beside dedicated
    /// servers: on their one machine's communicators, and on the job's
    /// across several machines.
    nccl_beside_servers: usize,
    nccl_across_beside_servers: usize,
    /// Relays and reduce-scatters done around the workers' rails beside
    /// dedicated servers (several machines of several ranks).
    rails_beside_servers: usize,
    /// Rank operations done where the machines served their own shards
    /// beside dedicated servers (`Resolved::Colocated`).
    colocated_beside_servers: usize,
    /// Rank operations done by a flat job's small tensors in groups
    /// (`Resolved::Grouped`).
    small_in_groups: usize,
    killed: Option<u32>,
    done: usize,
    failed: usize,
    /// Operations drawn as a reduce, a gather and a scatter.
    rooted: [usize; 3],
    /// Writes that landed in a receiver's tensor, through its window.
    in_windows: u64,
    /// Shares of results delivered, and checked.
    delivered: usize,
    /// Messages done (each end counted), of them through a machine's
    /// mailboxes.
    messages: usize,
    messages_local: usize,
}

fn run(seed: u64, design: Design) -> Result<Outcome, String> {
    let mut rng = Rng::new(seed);
    let scenario = Scenario::draw(&mut rng);
    let script = messages::Script::draw(&rng, scenario.machines * scenario.devices);
    play(&scenario, &script, &mut rng, design, STEP_LIMIT)
}

/// Seed `seed` under `design`, counted as hung after `step_limit` steps,
/// without messages (the schedules the focused tests pin).
fn run_for(seed: u64, design: Design, step_limit: u64) -> Result<Outcome, String> {
    let mut rng = Rng::new(seed);
    let scenario = Scenario::draw(&mut rng);
    play(
        &scenario,
        &messages::Script::default(),
        &mut rng,
        design,
        step_limit,
    )
}

/// Plays `sc` on a schedule drawn from `rng`, and checks it (see the module docs).
#[expect(clippy::too_many_lines, reason = "one scenario, read top to bottom")]
fn play(
    sc: &Scenario,
    script: &messages::Script,
    rng: &mut Rng,
    design: Design,
    step_limit: u64,
) -> Result<Outcome, String> {
    let Scenario {
        machines: m,
        devices: d,
        layout: rank_layout,
        servers,
        buffers,
        slice_bytes,
        min_shard_bytes,
        window,
        kill,
        direct,
        ..
    } = *sc;
    let ops = &sc.ops;
    let world = m * d;
    let processes = world + servers;
    let topology = Topology::new(m, d, rank_layout).map_err(|e| e.to_string())?;
    let config = PlanConfig::new(slice_bytes, min_shard_bytes).map_err(|e| e.to_string())?;
    let geometry = match (servers, sc.group_size) {
        (0, None) => Geometry::new(topology, config),
        (0, Some(size)) => Geometry::with_groups(topology, config, size),
        (k, Some(size)) => Geometry::with_servers_in_groups(topology, config, k, size),
        (k, None) => Geometry::with_servers(topology, config, k),
    }
    .map_err(|e| e.to_string())?;
    let mut layout = BufferLayout::new(&geometry, world).ok_or("layout")?;
    // The buffers hold the job's second geometry too: beside servers the
    // machines' own plan, of the same minimum shard (as where one is
    // given); on the flat plan, where drawn, the machines in groups.
    let second = match sc.grouped {
        Some(size) => Some(
            Geometry::with_groups_in_its_slices(topology, config, size)
                .map_err(|e| e.to_string())?,
        ),
        None => colocated_geometry(&geometry, min_shard_bytes),
    };
    if let Some(second) = second {
        layout = layout.holding_second(second, world).ok_or("layout")?;
    }

    let net = Network::new(processes);
    let collectives = sc.collectives.then(|| Collectives {
        one_reduce_scatter_from: sc.one_reduce_scatter_from,
        scatters: Arc::default(),
        across_job: sc.across_job,
        job_all_reduces: Arc::default(),
        job_arrived_unfailed: Arc::default(),
    });
    let mut engines = build_job(
        &geometry,
        &layout,
        buffers,
        &net,
        direct,
        design,
        collectives.as_ref(),
        sc.whole_up_to,
        Duration::from_secs(3600),
        |_, step| Box::new(step),
    )?;
    let on_device = sc.device.iter().any(|&d| d);
    let mut server_engines: Vec<(Engine<SimFabric, SimMemory>, bool)> = engines
        .split_off(world as usize)
        .into_iter()
        .map(|e| (e, false))
        .collect();
    let mut ranks: Vec<Rank> = Vec::new();
    for (rank, engine) in (0..world).zip(engines) {
        let inputs: Vec<Vec<u64>> = ops
            .iter()
            .enumerate()
            .map(|(k, op)| {
                let n = usize::try_from(op.elements).unwrap_or(0);
                let mut words = vec![0u64; (n * 8).div_ceil(8)];
                let bytes: &mut [u8] = bytemuck_bytes(&mut words);
                // As the communicator leaves them: a relay over the machines sums
                // each machine's tensors, so a rank's bytes hold zeros where
                // other ranks' start.
                let summed = relay_over_machines(topology, op.descriptor().collective);
                for i in 0..n {
                    let theirs = summed && op.origin_of(i as u64) != Some(rank);
                    if !theirs {
                        write(op.dtype, bytes, i, input(op.dtype, rank, k, i as u64));
                    }
                }
                words
            })
            .collect();
        // A device tensor holds what the GPU's memory held before the
        // caller's stream writes the input: bytes no result has.
        let tensors = inputs
            .iter()
            .zip(&sc.device)
            .map(|(input, &device)| {
                if device {
                    vec![0xa5a5_a5a5_a5a5_a5a5; input.len()]
                } else {
                    input.clone()
                }
            })
            .collect();
        let shares = ops
            .iter()
            .enumerate()
            .map(|(k, op)| {
                Share::draw(
                    rng,
                    rank,
                    k,
                    op.elements as usize * op.dtype.size_bytes() as usize,
                    sc.device[k],
                )
            })
            .collect();
        ranks.push(Rank {
            engine,
            tensors,
            inputs,
            shares,
            submitted: 0,
            settled: vec![None; ops.len()],
            dead: false,
        });
    }

    let mut mail: Vec<messages::RankMessages> = (0..world)
        .map(|r| messages::RankMessages::new(script, r))
        .collect();
    let mut linker = messages::Linker::default();
    let mut wanted = Vec::new();
    let mut outcome = Outcome {
        killed: kill.map(|k| k.1),
        rooted: sc.rooted_counts(),
        ..Outcome::default()
    };
    loop {
        outcome.steps += 1;
        if outcome.steps > step_limit {
            return Err(format!(
                "{m}x{d} + {servers} servers, {buffers} buffers: not settled after {step_limit} \
                 steps; settled: {:?}; messages: {:?}; failures: {:?}; GPUs waiting: {:?}",
                ranks.iter().map(|r| r.settled.clone()).collect::<Vec<_>>(),
                (
                    mail.iter()
                        .map(|m| (m.posted, m.settled.clone()))
                        .collect::<Vec<_>>(),
                    script
                ),
                ranks
                    .iter()
                    .map(|r| r.engine.failure().map(|e| e.to_string()))
                    .collect::<Vec<_>>(),
                ranks
                    .iter()
                    .map(|r| r.engine.memory.gpu().waiting())
                    .collect::<Vec<_>>()
            ));
        }
        if let Some((at, victim)) = kill
            && at == outcome.steps
        {
            net.lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .kill(victim);
            match ranks.get_mut(victim as usize) {
                Some(rank) => rank.dead = true,
                None => server_engines[(victim - world) as usize].1 = true,
            }
        }
        // Settle what finished.
        for (r, rank) in ranks.iter_mut().enumerate().filter(|(_, r)| !r.dead) {
            for (k, op) in ops.iter().enumerate().take(rank.submitted) {
                if rank.settled[k].is_some() {
                    continue;
                }
                let seq = k as u64;
                match rank.engine.works.state(seq) {
                    Some(DONE) => {
                        check(op, k, world, r, &rank.tensors[k])?;
                        if let Some(share) = &rank.shares[k] {
                            share.check(r, k, &rank.tensors[k])?;
                            outcome.delivered += 1;
                        }
                        rank.settled[k] = Some(true);
                        rank.engine.works.give_back(seq);
                    }
                    Some(FAILED) => {
                        rank.settled[k] = Some(false);
                        rank.engine.works.give_back(seq);
                    }
                    _ => {}
                }
            }
        }
        if !script.messages.is_empty() {
            for (r, rank) in ranks.iter().enumerate().filter(|(_, r)| !r.dead) {
                let engine = &rank.engine;
                let (done, local) = mail[r].settle(
                    script,
                    r as u32,
                    |id| engine.test_message(id),
                    |id| engine.release_message(id),
                    |p| engine.messages_go_local(p),
                )?;
                outcome.messages += done;
                outcome.messages_local += local;
            }
            messages::link(&ranks, &mut linker, &mut wanted);
        }
        let live = ranks.iter().zip(&mail).filter(|(r, _)| !r.dead);
        if live
            .clone()
            .all(|(r, m)| r.settled.iter().all(Option::is_some) && m.all_settled())
        {
            break;
        }
        // A device-wide wait ends once the streams have run far enough; a
        // reaper runs the abort it was handed once no such wait holds the
        // device.
        for rank in ranks.iter().filter(|r| !r.dead) {
            let mut gpu = rank.engine.memory.gpu();
            gpu.settle_draining();
            gpu.reap();
        }
        // One scheduled action.
        let choice = rng.below(100);
        if on_device && (40..56).contains(&choice) {
            let r = rng.below(u64::from(world)) as usize;
            let pick = rng.next();
            let rank = &ranks[r];
            if rank.dead {
                continue;
            }
            if choice < 52 {
                // The GPU runs one item of one of its streams.
                #[expect(clippy::cast_possible_truncation, reason = "an index below n")]
                let chosen = |n: usize| (pick % n as u64) as usize;
                rank.engine.memory.gpu().run_any(chosen);
            } else if choice == 55 {
                // Another thread of the process makes a call that waits for
                // the whole device, as PyTorch's allocator and lazy module
                // loading do at times no one chooses.
                rank.engine.memory.gpu().start_draining();
            } else if rank.submitted > 0 && !rank.engine.memory.gpu().blocks(Thread::Caller) {
                // The caller makes its stream wait for an operation it started
                // (a `Work::wait` on a CUDA tensor's work, as late as it likes).
                let seq = pick % rank.submitted as u64;
                let engine = &rank.engine;
                engine.memory.gpu().on_thread(Thread::Caller);
                engine
                    .memory
                    .enqueue_wait(seq, || engine.awaits_on_device(seq));
                engine.memory.gpu().on_thread(Thread::Progress);
            }
            continue;
        }
        if choice < 40 {
            let busy = net
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .busy_links();
            if !busy.is_empty() {
                let (a, b) = rng.pick(&busy);
                net.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .deliver(a, b);
            }
        } else {
            let r = rng.below(u64::from(processes)) as usize;
            if let Some((server, dead)) = server_engines.get(r.wrapping_sub(world as usize)) {
                if !dead {
                    server.try_drive();
                }
                continue;
            }
            let rank = &mut ranks[r];
            if rank.dead {
                continue;
            }
            if !script.messages.is_empty() && choice < 62 {
                // The caller posts its next message, if it has one left.
                if let Some(post) = mail[r].next_post(script, r as u32) {
                    let engine = &rank.engine;
                    if !engine.messages_go_local(post.peer) {
                        engine.late_links.want(post.peer);
                    }
                    // SAFETY: the buffer lives, untouched, in `mail` until
                    // the message settles (or the seed ends).
                    let id = unsafe { engine.post_message(post) }.ok();
                    mail[r].posted(id);
                }
                continue;
            }
            let outstanding = (0..rank.submitted)
                .filter(|&k| rank.settled[k].is_none())
                .count();
            let caller_blocked = rank.engine.memory.gpu().blocks(Thread::Caller);
            if choice >= 85
                && rank.submitted < ops.len()
                && outstanding < window
                && !(sc.device[rank.submitted] && caller_blocked)
            {
                rank.engine.memory.gpu().on_thread(Thread::Caller);
                let k = rank.submitted;
                let op = ops[k];
                let seq = k as u64;
                if !rank.engine.works.try_take(seq) {
                    return Err(format!("rank {r}: the entry of operation {k} is taken"));
                }
                let bytes = op.elements as usize * op.dtype.size_bytes() as usize;
                let tensor = if sc.device[k] {
                    let Rank {
                        engine,
                        tensors,
                        inputs,
                        ..
                    } = &mut *rank;
                    let to = &mut bytemuck_bytes(&mut tensors[k])[..bytes];
                    let from = &bytemuck_bytes(&mut inputs[k])[..bytes];
                    engine.memory.submit_device(to, from, seq)
                } else {
                    SimTensor::Host(HostTensor::new(rank.tensors[k].as_mut_ptr().cast(), bytes))
                };
                let deliver = rank.shares[k].as_mut().map(|share| {
                    let len = share.range.len();
                    let into = &mut bytemuck_bytes(&mut share.into)[..len];
                    work::Delivery {
                        to: match tensor {
                            SimTensor::Device(_) => rank.engine.memory.device_share(into, &tensor),
                            SimTensor::Host(_) => {
                                SimTensor::Host(HostTensor::new(into.as_mut_ptr(), len))
                            }
                        },
                        range: share.range.clone(),
                    }
                });
                // The engine derives what it runs from the descriptor; the
                // simulation's own account of the operation must agree.
                let sub = Submission::new(seq, tensor, sc.descriptor(k), deliver, world)
                    .ok_or_else(|| format!("operation {k} overflows"))?;
                let derived = (
                    sub.elements(),
                    sub.dtype(),
                    sub.op(),
                    sub.algorithm(),
                    sub.wire(),
                );
                let drawn = (op.planned(), op.dtype, op.op, op.algorithm, op.wire);
                if derived != drawn {
                    return Err(format!(
                        "operation {k} runs as {derived:?} by its descriptor, drawn as {drawn:?}"
                    ));
                }
                rank.submitted += 1;
                if rank.engine.submit(sub).is_err() {
                    rank.engine.works.give_back(seq);
                    rank.settled[k] = Some(false);
                }
                // As PyTorch does: the caller's stream waits for the result
                // before the caller's next work on it.
                if sc.device[k] && rng.below(2) == 0 {
                    let engine = &rank.engine;
                    engine
                        .memory
                        .enqueue_wait(seq, || engine.awaits_on_device(seq));
                }
                rank.engine.memory.gpu().on_thread(Thread::Progress);
            } else if !rank.engine.memory.gpu().blocks(Thread::Progress) {
                rank.engine.try_drive();
            }
        }
    }
    for (r, rank) in ranks.iter().enumerate().filter(|(_, r)| !r.dead) {
        // Every stream of a live rank ends: no caller waits forever on the
        // device for an operation that has settled.
        if let Some(waits) = rank.engine.memory.gpu().run_out() {
            return Err(format!("rank {r}: a stream waits forever: {waits}"));
        }
        if let Some(v) = rank.engine.memory.gpu().violations().first() {
            return Err(format!("rank {r}: {v}"));
        }
        let failed = rank.settled.iter().filter(|s| **s == Some(false)).count();
        outcome.done += rank.settled.len() - failed;
        if sc.group_size.is_some() && sc.servers == 0 {
            outcome.in_groups += rank.settled.len() - failed;
        }
        outcome.small_in_groups += rank
            .settled
            .iter()
            .zip(&sc.ops)
            .filter(|&(s, op)| op.algorithm == Resolved::Grouped && *s == Some(true))
            .count();
        if sc.group_size.is_some() && sc.servers > 0 {
            outcome.servers_in_groups += rank.settled.len() - failed;
        }
        if sc.servers > 0 {
            let nccl = rank
                .settled
                .iter()
                .zip(&sc.ops)
                .filter(|&(s, op)| op.algorithm == Resolved::Nccl && *s == Some(true))
                .count();
            if sc.machines == 1 {
                outcome.nccl_beside_servers += nccl;
            } else {
                outcome.nccl_across_beside_servers += nccl;
            }
            outcome.colocated_beside_servers += rank
                .settled
                .iter()
                .zip(&sc.ops)
                .filter(|&(s, op)| op.algorithm == Resolved::Colocated && *s == Some(true))
                .count();
            if sc.machines > 1 && sc.devices > 1 {
                // Relays over the machines (an all-gather's only where its
                // ranks are numbered machine by machine) and reduce-scatters,
                // which several devices a machine scatter around the rails.
                let around_rails = |op: &Op| match op.algorithm {
                    Resolved::Relay => relay_over_machines(topology, op.descriptor().collective),
                    Resolved::Scatter => true,
                    _ => false,
                };
                outcome.rails_beside_servers += rank
                    .settled
                    .iter()
                    .zip(&sc.ops)
                    .filter(|&(s, op)| around_rails(op) && *s == Some(true))
                    .count();
            }
        }
        let device_done = rank
            .settled
            .iter()
            .zip(&sc.device)
            .filter(|&(s, &d)| d && *s == Some(true))
            .count();
        outcome.device += device_done;
        outcome.ungated += rank.engine.memory.gpu().ungated_met();
        if sc.collectives && d > 1 {
            outcome.collective += device_done;
        }
        outcome.failed += failed;
        if kill.is_none() && mail[r].settled.iter().any(|s| *s != Some(true)) {
            return Err(format!(
                "rank {r}: messages failed with no fault injected: {:?} ({:?}); {:?}; \
                 script {:?}",
                mail[r].settled,
                mail[r].failures,
                rank.engine.failure(),
                script
            ));
        }
        match (kill, rank.engine.failure()) {
            (None, Some(e)) => return Err(format!("rank {r} failed with no fault injected: {e}")),
            (Some((_, victim)), Some(e)) if !e.to_string().contains(&format!("rank {victim}")) => {
                return Err(format!(
                    "rank {r}: the error does not name killed rank {victim}: {e}"
                ));
            }
            _ => {}
        }
    }
    for (i, (server, dead)) in server_engines.iter().enumerate() {
        if let (None, false, Some(e)) = (kill, dead, server.failure()) {
            return Err(format!("server {i} failed with no fault injected: {e}"));
        }
    }
    outcome.in_windows = net
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .window_landings;
    outcome.scattered = collectives
        .as_ref()
        .map_or(0, |c| c.scatters.load(std::sync::atomic::Ordering::Relaxed));
    outcome.across_job = collectives.map_or(0, |c| {
        c.job_all_reduces.load(std::sync::atomic::Ordering::Relaxed)
    });
    Ok(outcome)
}

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("FAIRRING_SIM_SEED") {
        return vec![s.trim().parse().expect("FAIRRING_SIM_SEED: a seed number")];
    }
    let count = std::env::var("FAIRRING_SIM_SEEDS").map_or(1000, |s| {
        s.trim().parse().expect("FAIRRING_SIM_SEEDS: a count")
    });
    (1..=count).collect()
}

/// Runs `seeds` on every core, each seed whole on one thread, and returns
/// their outcomes; the first seed to fail (the lowest, among those run
/// when it was found) is reported with its replay command.
fn run_seeds(seeds: &[u64]) -> Result<Vec<Outcome>, String> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let workers = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(seeds.len().max(1));
    let stop = AtomicBool::new(false);
    let results: Vec<Result<Vec<Outcome>, (u64, String)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|worker| {
                let stop = &stop;
                scope.spawn(move || {
                    let mut outcomes = Vec::new();
                    for &seed in seeds.iter().skip(worker).step_by(workers) {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        match std::panic::catch_unwind(|| run(seed, Design::Accepted)) {
                            Ok(Ok(o)) => outcomes.push(o),
                            Ok(Err(e)) => {
                                stop.store(true, Ordering::Relaxed);
                                return Err((seed, e));
                            }
                            Err(_) => {
                                stop.store(true, Ordering::Relaxed);
                                return Err((seed, "panicked".to_owned()));
                            }
                        }
                    }
                    Ok(outcomes)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .expect("a simulation worker catches its seeds' panics")
            })
            .collect()
    });
    let mut all = Vec::with_capacity(seeds.len());
    let mut first_failure: Option<(u64, String)> = None;
    for result in results {
        match result {
            Ok(outcomes) => all.extend(outcomes),
            Err((seed, e)) if first_failure.as_ref().is_none_or(|(s, _)| seed < *s) => {
                first_failure = Some((seed, e));
            }
            Err(_) => {}
        }
    }
    match first_failure {
        Some((seed, e)) => Err(format!(
            "simulation seed {seed}: {e}\nreplay: FAIRRING_SIM_SEED={seed} cargo test -p fairring --lib simulation"
        )),
        None => Ok(all),
    }
}

#[test]
fn seeded_schedules_settle_with_exact_results() {
    let seeds = seeds();
    let outcomes = run_seeds(&seeds).unwrap_or_else(|e| panic!("{e}"));
    let (mut killed, mut steps, mut done, mut failed) = (0, 0, 0, 0);
    let (mut device, mut collective, mut scattered, mut across_job) = (0, 0, 0, 0);
    let mut ungated = 0;
    let mut rooted = [0usize; 3];
    let (mut in_windows, mut delivered) = (0, 0);
    let (mut messages, mut messages_local, mut in_groups) = (0, 0, 0);
    let (mut servers_in_groups, mut nccl_beside_servers) = (0, 0);
    let (mut nccl_across_beside_servers, mut rails_beside_servers) = (0, 0);
    let (mut colocated_beside_servers, mut small_in_groups) = (0, 0);
    for outcome in &outcomes {
        small_in_groups += outcome.small_in_groups;
        colocated_beside_servers += outcome.colocated_beside_servers;
        rails_beside_servers += outcome.rails_beside_servers;
        in_groups += outcome.in_groups;
        servers_in_groups += outcome.servers_in_groups;
        nccl_beside_servers += outcome.nccl_beside_servers;
        nccl_across_beside_servers += outcome.nccl_across_beside_servers;
        killed += usize::from(outcome.killed.is_some());
        steps += outcome.steps;
        done += outcome.done;
        failed += outcome.failed;
        device += outcome.device;
        collective += outcome.collective;
        scattered += outcome.scattered;
        across_job += outcome.across_job;
        ungated += outcome.ungated;
        in_windows += outcome.in_windows;
        delivered += outcome.delivered;
        messages += outcome.messages;
        messages_local += outcome.messages_local;
        for (sum, n) in rooted.iter_mut().zip(outcome.rooted) {
            *sum += n;
        }
    }
    let [reduces, gathers, scatters] = rooted;
    eprintln!(
        "simulation: {} seeds ({killed} with a killed rank), {steps} steps, {done} operations \
         done ({device} on the simulated device, {collective} of them through a machine's \
         collectives, which reduce-scattered {scattered} slices in one call; {across_job} \
         all-reduces met on the job's NCCL communicator, {nccl_beside_servers} rank \
         operations done on one machine's beside dedicated servers and \
         {nccl_across_beside_servers} on the job's, {rails_beside_servers} relayed or \
         reduce-scattered around the rails beside them, {colocated_beside_servers} all-reduced \
         by the machines beside them; {ungated} ungated calls of whole \
         all-reduces through NCCL met; {in_groups} where the machines reduce \
         in groups, {servers_in_groups} where dedicated servers do, {small_in_groups} small \
         tensors in groups on the flat plan), {failed} failed; \
         drawn as rooted forms: {reduces} reduces, {gathers} \
         gathers, {scatters} scatters; {in_windows} writes landed in a receiver's tensor; \
         {delivered} shares of results delivered; {messages} message ends done \
         ({messages_local} through a machine's mailboxes)",
        seeds.len()
    );
    assert!(
        seeds.len() < 100 || messages_local > 0 && messages > messages_local,
        "the seeds run messages, within machines and between them"
    );
    assert!(
        seeds.len() < 100 || in_windows > 0,
        "the seeds land chunks in receivers' tensors"
    );
    assert!(
        seeds.len() < 100 || rooted.iter().all(|&n| n > 0),
        "the seeds draw every rooted form"
    );
    assert!(done > 0);
    assert!(
        seeds.len() < 100 || delivered > 0,
        "the seeds deliver shares of results"
    );
    assert!(
        seeds.len() < 100 || device > 0,
        "the seeds run device operations"
    );
    assert!(
        seeds.len() < 100 || collective > 0,
        "the seeds run device operations through a machine's collectives"
    );
    assert!(
        seeds.len() < 100 || scattered > 0,
        "the seeds reduce-scatter slices in one call"
    );
    assert!(
        seeds.len() < 100 || across_job > 0,
        "the seeds run all-reduces on the job's NCCL communicator"
    );
    // About one seed in thirty is one machine of several ranks with servers
    // and collectives, and fewer draw such all-reduces: a thousand seeds
    // draw some.
    assert!(
        seeds.len() < 1000 || nccl_beside_servers > 0,
        "the seeds run workers' NCCL all-reduces on one machine beside dedicated servers"
    );
    assert!(
        seeds.len() < 1000 || rails_beside_servers > 0,
        "the seeds relay and reduce-scatter around the rails beside dedicated servers"
    );
    assert!(
        seeds.len() < 1000 || nccl_across_beside_servers > 0,
        "the seeds run workers' NCCL all-reduces across machines beside dedicated servers"
    );
    assert!(
        seeds.len() < 100 || colocated_beside_servers > 0,
        "the seeds run all-reduces the machines serve beside dedicated servers"
    );
    assert!(
        seeds.len() < 1000 || small_in_groups > 0,
        "the seeds run a flat job's all-reduces in its groups"
    );
    assert!(
        seeds.len() < 100 || in_groups > 0,
        "the seeds run operations where the machines reduce in groups"
    );
    assert!(
        seeds.len() < 100 || servers_in_groups > 0,
        "the seeds run operations where dedicated servers reduce in groups"
    );
    assert!(
        seeds.len() < 100 || ungated > 0,
        "the seeds run whole all-reduces through NCCL ungated"
    );
}
