//! A deterministic simulation of the whole engine: every rank of an `M x D` job
//! in one thread, over an in-memory fabric ([`fabric`]) and the real shared-memory
//! local group on anonymous memory, with a seeded random schedule deciding which
//! rank drives, which link delivers its next post, and when each rank's caller
//! submits its next operation.
//!
//! Each seed picks the layout (`M` in 1..=4, `D` in 1..=3, ranks numbered
//! machine by machine or, for one seed in four, device by device), for three seeds in
//! seven 1 to 3 dedicated reduction servers (which then take the inter-machine
//! step), the number of staging buffers (1..=4), the slice size, a script of
//! integer all-reduces (empty to many slices, `i32`/`i64`/`u8`/`f32`,
//! sum/product/min/max, hierarchical, ring or recursive doubling),
//! reduce-scatters (by the scatter algorithm, or as any of those all-reduces),
//! and relayed broadcasts (from any root) and all-gathers, each rank starting
//! from its own values everywhere, whether all-reduces send from their tensors
//! (never, from any size or from 4 KiB; keeping 1, 2 or 64 registrations),
//! for half the seeds, a process (worker or server) to kill at a random step,
//! and, for two seeds in three, whether every operation or about half of them
//! run on device tensors of a simulated GPU per rank ([`device`]): streams
//! whose copies end at drawn steps, start events, and callers that submit
//! behind stream waits on earlier operations, as PyTorch does, and make their
//! streams wait on operations at drawn times; a lone rank of a machine takes
//! the communicator's lone device step, several (for half the seeds) the
//! machine's collectives, as through NCCL ([`collectives`]: calls that meet
//! across the machine's simulated GPUs, ranks issuing out of order failing
//! the seed, a failing rank aborting its calls), or the staged one
//! (`local::staged`). It then checks:
//!
//! - every operation a rank reports done holds exactly the expected values;
//! - without a kill, every operation of every rank is done;
//! - with a kill, every surviving rank settles every operation (done or failed),
//!   never hangs, and a failed one's error names the killed rank.
//! - on the simulated device, every stream of a live rank runs to its end
//!   once its operations settled.
//!
//! `FAIRRING_SIM_SEEDS` sets how many seeds run (default 1000; CI runs 10000 in
//! release); `FAIRRING_SIM_SEED` replays one. A failing seed is printed with the command
//! that replays it.
#![allow(
    clippy::cast_possible_truncation,
    reason = "test values wrap into their element types on purpose"
)]

mod collectives;
mod device;
mod fabric;
mod reach;

use std::sync::Arc;
use std::time::Duration;

use fairring_core::plan::{Geometry, PlanConfig};
use fairring_core::topology::{Location, RankLayout, Topology};
use fairring_core::{DataType, ReduceOp, WireFormat};
use fairring_rdma::fabric::{Fabric, LocalRegion};

use super::algorithm::{Origins, Resolved, relay_over_machines};
use super::descriptor::{Collective, Descriptor};
use super::layout::StagingLayout;
use super::links::{linked, peers, server_peers};
use super::work::{self, DONE, FAILED, Submission};
use super::{DirectSettings, Engine, EngineParts, Strides};
use crate::local::{LocalSlice, LocalStep, Machine, ShmStep, Solo};
use crate::memory::{Host, HostTensor, MemoryKind, MemorySpace};
use crate::shm::Segment;
use collectives::{SimMachine, join};
use device::{Design, SimFence, SimMemory, SimTensor};
use fabric::{Network, SimFabric};
use reach::SimStep;

/// Steps after which a seed that has not settled counts as hung.
const STEP_LIMIT: u64 = 2_000_000;

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[usize::try_from(self.below(items.len() as u64)).unwrap_or(0)]
    }
}

#[derive(Clone, Copy, Debug)]
struct Op {
    elements: u64,
    dtype: DataType,
    op: ReduceOp,
    algorithm: Resolved,
    wire: WireFormat,
    /// A relayed broadcast's or all-gather's origins (`u8` elements, every rank
    /// starting from its own values everywhere).
    origins: Option<Origins>,
    /// A reduce-scatter's elements per rank (`elements` is the whole input).
    share: Option<u64>,
}

impl Op {
    /// The descriptor the communicator would make for it.
    fn descriptor(&self) -> Descriptor {
        let (collective, root, elements) = match (self.origins, self.share) {
            (None, Some(share)) => (Collective::ReduceScatter, 0, share),
            (None, None) => (Collective::AllReduce, 0, self.elements),
            (Some(Origins::Rank(root)), _) => (Collective::Broadcast, root, self.elements),
            (Some(Origins::Blocks(block)), _) => (Collective::AllGather, 0, block),
        };
        Descriptor {
            collective,
            dtype: self.dtype,
            op: self.op,
            algorithm: self.algorithm,
            wire: self.wire,
            memory: crate::memory::MemoryKind::Host,
            root,
            elements,
        }
    }

    /// The elements the engine plans: a reduce-scatter under the scatter
    /// algorithm plans one share.
    fn planned(&self) -> u64 {
        match self.share {
            Some(share) if self.algorithm == Resolved::Scatter => share,
            _ => self.elements,
        }
    }

    /// Whether rank `r`'s element `i` has a defined result: every element of an
    /// all-reduce, broadcast or all-gather; the rank's own share of a
    /// reduce-scatter.
    fn defined(&self, r: usize, i: u64) -> bool {
        self.share.is_none_or(|share| i / share.max(1) == r as u64)
    }

    /// The rank whose input element `i` of the result is, for a relay.
    fn origin_of(&self, i: u64) -> Option<u32> {
        match self.origins? {
            Origins::Rank(root) => Some(root),
            Origins::Blocks(block) => u32::try_from(i / block.max(1)).ok(),
        }
    }
}

/// Rank `rank`'s element `i` of operation `k` as it is written into a tensor of
/// `dtype`: for `f32`, small integers, whose sums over every rank every wire
/// format carries exactly, so that a compressed wire's result is checked bit for
/// bit like the others'.
fn input(dtype: DataType, rank: u32, k: usize, i: u64) -> i64 {
    match dtype {
        DataType::F32 => value(rank, k, i).rem_euclid(16) - 8,
        _ => value(rank, k, i),
    }
}

/// Rank `rank`'s element `i` of operation `k`, before truncation to the type.
fn value(rank: u32, k: usize, i: u64) -> i64 {
    let x = (u64::from(rank) + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) ^ (k as u64) << 32 ^ i;
    (x.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as i64 - (1 << 23)
}

fn fold(op: ReduceOp, a: i64, b: i64) -> i64 {
    match op {
        ReduceOp::Product => a.wrapping_mul(b),
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        _ => a.wrapping_add(b),
    }
}

/// Element `i` of a tensor of `dtype`, as an i64.
fn read(dtype: DataType, bytes: &[u8], i: usize) -> i64 {
    match dtype {
        DataType::U8 => i64::from(bytes[i]),
        DataType::I32 => i64::from(i32::from_le_bytes(
            bytes[i * 4..i * 4 + 4].try_into().unwrap_or([0; 4]),
        )),
        DataType::F32 => {
            let x = f32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap_or([0; 4]));
            // Only whole numbers are expected; anything else reads as a value no
            // input sums to.
            if x.fract() == 0.0 { x as i64 } else { i64::MIN }
        }
        _ => i64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8])),
    }
}

/// The bytes of `v` as one element of `dtype` (truncated, as the type wraps).
fn write(dtype: DataType, bytes: &mut [u8], i: usize, v: i64) {
    match dtype {
        DataType::U8 => bytes[i] = v as u8,
        DataType::I32 => bytes[i * 4..i * 4 + 4].copy_from_slice(&(v as i32).to_le_bytes()),
        DataType::F32 => bytes[i * 4..i * 4 + 4].copy_from_slice(&(v as f32).to_le_bytes()),
        _ => bytes[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes()),
    }
}

/// `v` as the type holds it (u8 and i32 wrap; min and max compare within the type).
fn narrow(dtype: DataType, v: i64) -> i64 {
    match dtype {
        DataType::U8 => i64::from(v as u8),
        DataType::I32 => i64::from(v as i32),
        _ => v,
    }
}

struct Rank {
    engine: Engine<SimFabric, SimMemory>,
    /// Per operation: the tensor (as 8-byte words, so every type is aligned).
    tensors: Vec<Vec<u64>>,
    /// Per device operation: the input the caller's stream writes into its
    /// tensor before the operation's start.
    inputs: Vec<Vec<u64>>,
    submitted: usize,
    /// Per operation: `Some(true)` done, `Some(false)` failed.
    settled: Vec<Option<bool>>,
    dead: bool,
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
    killed: Option<u32>,
    done: usize,
    failed: usize,
}

/// The engines of every rank of `geometry`'s job over `net` (the workers, then
/// its dedicated servers), each worker's local step passed through `wrap` (to
/// inject faults).
#[expect(clippy::too_many_arguments, reason = "a job's every setting, once")]
fn build_job(
    geometry: &Geometry,
    layout: &StagingLayout,
    buffers: u32,
    net: &Arc<std::sync::Mutex<Network>>,
    direct: DirectSettings,
    design: Design,
    collectives: bool,
    timeout: Duration,
    wrap: impl Fn(u32, SimStep) -> Box<dyn LocalStep<SimMemory>>,
) -> Result<Vec<Engine<SimFabric, SimMemory>>, String> {
    let topology = geometry.topology();
    let (m, d, world) = (
        topology.machines(),
        topology.devices_per_machine(),
        topology.world_size(),
    );
    let servers = geometry.servers().unwrap_or(0);
    let processes = world + servers;
    let strides = Strides {
        worker: Segment::buffer_stride(layout.buffer_bytes()),
        server: Segment::buffer_stride(layout.server_buffer_bytes()),
    };
    let segments: Vec<Arc<Segment>> = (0..m)
        .map(|_| Segment::anonymous(d, buffers, layout.buffer_bytes()).map(Arc::new))
        .collect::<crate::Result<_>>()
        .map_err(|e| e.to_string())?;
    // Device tensors of several ranks per machine go through the machine's
    // collectives where `collectives`, through the host otherwise.
    let machines: Vec<SimMachine> = (0..m).map(|_| SimMachine::new(d)).collect();
    let mut parts = Vec::new();
    for rank in 0..world {
        let location = topology.locate(rank).map_err(|e| e.to_string())?;
        let segment = &segments[location.machine as usize];
        let memory = SimMemory::new(
            Host::new(Arc::clone(segment), location.device, buffers),
            design,
        );
        let joined = (collectives && d > 1).then(|| {
            join(
                &memory,
                &machines[location.machine as usize],
                location.device,
            )
        });
        let shm = ShmStep::new(Arc::clone(segment), location.device, d, buffers);
        let local = wrap(rank, reach::step(&memory, shm, joined));
        let machine = Machine::new(Arc::clone(segment), location.device, d);
        let fabric = SimFabric {
            rank,
            net: Arc::clone(net),
        };
        let (area, len) = memory.registered();
        // SAFETY: the area is this rank's part of a segment the memory space keeps
        // mapped for as long as the engine lives.
        let region = unsafe { fabric.register(area, len) }.map_err(|e| e.to_string())?;
        parts.push((location, memory, local, machine, fabric, region, None));
    }
    for index in 0..servers {
        let segment = Arc::new(
            Segment::anonymous(1, buffers, layout.server_buffer_bytes())
                .map_err(|e| e.to_string())?,
        );
        let memory = SimMemory::new(Host::new(Arc::clone(&segment), 0, buffers), design);
        let machine = Machine::new(segment, 0, 1);
        let fabric = SimFabric {
            rank: world + index,
            net: Arc::clone(net),
        };
        let (area, len) = memory.registered();
        // SAFETY: as for the workers' areas.
        let region = unsafe { fabric.register(area, len) }.map_err(|e| e.to_string())?;
        let location = Location {
            machine: u32::MAX,
            device: 0,
        };
        let local: Box<dyn LocalStep<SimMemory>> = Box::new(Solo);
        parts.push((
            location,
            memory,
            local,
            machine,
            fabric,
            region,
            Some(index),
        ));
    }
    let regions: Vec<_> = parts.iter().map(|p| p.5.remote()).collect();
    let mut engines = Vec::new();
    for (rank, (location, memory, local, machine, fabric, region, server)) in
        (0..processes).zip(parts)
    {
        let (out, inbound) = match server {
            Some(_) => server_peers(topology),
            None => peers(topology, location, rank, servers),
        };
        let linked = linked(&out, &inbound);
        for &p in &linked {
            let ep = fabric.endpoint(p).map_err(|e| e.to_string())?;
            fabric.connect(p, &ep).map_err(|e| e.to_string())?;
        }
        let mut remote = vec![None; processes as usize];
        for &p in &out {
            remote[p as usize] = Some(regions[p as usize]);
        }
        engines.push(Engine::new(EngineParts {
            fabric,
            region,
            remote,
            memory,
            local,
            machine,
            geometry: *geometry,
            layout: *layout,
            location,
            rank,
            world: processes,
            servers,
            server,
            strides,
            buffers,
            inbound,
            linked,
            timeout,
            direct,
        }));
    }
    Ok(engines)
}

/// What one seed runs: the job, and what its ranks do.
#[derive(Clone, Debug)]
struct Scenario {
    machines: u32,
    devices: u32,
    /// How ranks are numbered.
    layout: RankLayout,
    servers: u32,
    buffers: u32,
    slice_bytes: u64,
    ops: Vec<Op>,
    /// Operations a rank may have outstanding.
    window: usize,
    /// The step at which a process is killed, and which.
    kill: Option<(u64, u32)>,
    /// Whether, and from which size, all-reduces send from their tensors
    /// where they may, and how many registrations each rank keeps.
    direct: DirectSettings,
    /// Per operation: whether its tensors are device memory, on the
    /// simulated GPU (one rank per machine, as the communicator takes them).
    device: Vec<bool>,
    /// Whether several ranks per machine reduce device tensors through the
    /// machine's collectives (as through NCCL) rather than the host.
    collectives: bool,
}

impl Scenario {
    /// A scenario drawn from `rng` (see the module docs).
    fn draw(rng: &mut Rng) -> Scenario {
        let (m, d) = (1 + rng.below(4) as u32, 1 + rng.below(3) as u32);
        let world = m * d;
        let servers = rng.pick(&[0, 0, 0, 0, 1, 2, 3]);
        let processes = world + servers;
        let buffers = 1 + rng.below(4) as u32;
        let slice_bytes = rng.pick(&[1024, 4096, 16_384]);
        let ops: Vec<Op> = (0..2 + rng.below(7))
            .map(|_| {
                let elements = match rng.below(5) {
                    0 => 0,
                    1 => 1 + rng.below(8),
                    2 => rng.below(300),
                    _ => rng.below(6000),
                };
                let dtype = rng.pick(&[DataType::I32, DataType::I64, DataType::U8, DataType::F32]);
                let op = rng.pick(&[
                    ReduceOp::Sum,
                    ReduceOp::Product,
                    ReduceOp::Min,
                    ReduceOp::Max,
                ]);
                let algorithm = rng.pick(&[
                    Resolved::Hierarchical,
                    Resolved::Ring,
                    Resolved::Relay,
                    Resolved::Doubling,
                    Resolved::Scatter,
                ]);
                if algorithm == Resolved::Relay {
                    // A broadcast from any root, or an all-gather of whole blocks.
                    let origins = if rng.below(2) == 0 {
                        Origins::Rank(rng.below(u64::from(world)) as u32)
                    } else {
                        Origins::Blocks(elements / u64::from(world))
                    };
                    let elements = match origins {
                        Origins::Blocks(block) => block * u64::from(world),
                        Origins::Rank(_) => elements,
                    };
                    return Op {
                        elements,
                        dtype: DataType::U8,
                        op: ReduceOp::Sum,
                        algorithm,
                        wire: WireFormat::Exact,
                        origins: Some(origins),
                        share: None,
                    };
                }
                // A reduce-scatter of whole shares (the others run as
                // all-reduces; the scatter algorithm reduces each share on its
                // way to its rank).
                let share = (algorithm == Resolved::Scatter || rng.below(8) == 0)
                    .then(|| elements / u64::from(world));
                let elements = share.map_or(elements, |s| s * u64::from(world));
                // As the communicator submits them: compressed only where f32 values
                // cross between machines, or to dedicated servers.
                let wire = if dtype == DataType::F32
                    && algorithm == Resolved::Hierarchical
                    && (m > 1 || servers > 0)
                {
                    rng.pick(&[WireFormat::Exact, WireFormat::Bf16, WireFormat::F16])
                } else {
                    WireFormat::Exact
                };
                Op {
                    elements,
                    dtype,
                    // Products of whole f32 numbers outgrow what f32 holds exactly.
                    op: if dtype == DataType::F32 && op == ReduceOp::Product {
                        ReduceOp::Sum
                    } else {
                        op
                    },
                    algorithm,
                    wire,
                    origins: None,
                    share,
                }
            })
            .collect();
        let window = 1 + rng.below(4) as usize;
        let kill = (processes > 1 && rng.below(2) == 1)
            .then(|| (1 + rng.below(4000), rng.below(u64::from(processes)) as u32));
        // Drawn last, so that every other draw of a seed stays as it was.
        let layout = if rng.below(4) == 0 {
            RankLayout::Interleaved
        } else {
            RankLayout::Contiguous
        };
        let direct = DirectSettings {
            from_bytes: rng.pick(&[None, None, Some(0), Some(4096)]),
            cached: rng.pick(&[1, 2, 64]),
        };
        // No device operations, every one, or about half (a host barrier
        // among device all-reduces): drawn last, as above.
        let device = match rng.below(3) {
            1 => vec![true; ops.len()],
            2 => ops.iter().map(|_| rng.below(2) == 0).collect(),
            _ => vec![false; ops.len()],
        };
        // Drawn last, as above.
        let collectives = rng.below(2) == 0;
        Scenario {
            machines: m,
            devices: d,
            layout,
            servers,
            buffers,
            slice_bytes,
            ops,
            window,
            kill,
            direct,
            device,
            collectives,
        }
    }

    /// The descriptor of operation `k`.
    fn descriptor(&self, k: usize) -> Descriptor {
        let memory = if self.device[k] {
            MemoryKind::Device
        } else {
            MemoryKind::Host
        };
        Descriptor {
            memory,
            ..self.ops[k].descriptor()
        }
    }
}

fn run(seed: u64, design: Design) -> Result<Outcome, String> {
    run_for(seed, design, STEP_LIMIT)
}

/// Seed `seed` under `design`, counted as hung after `step_limit` steps.
fn run_for(seed: u64, design: Design, step_limit: u64) -> Result<Outcome, String> {
    let mut rng = Rng::new(seed);
    let scenario = Scenario::draw(&mut rng);
    play(&scenario, &mut rng, design, step_limit)
}

/// Plays `sc` on a schedule drawn from `rng`, and checks it (see the module docs).
#[expect(clippy::too_many_lines, reason = "one scenario, read top to bottom")]
fn play(sc: &Scenario, rng: &mut Rng, design: Design, step_limit: u64) -> Result<Outcome, String> {
    let Scenario {
        machines: m,
        devices: d,
        layout: rank_layout,
        servers,
        buffers,
        slice_bytes,
        window,
        kill,
        direct,
        ..
    } = *sc;
    let ops = &sc.ops;
    let world = m * d;
    let processes = world + servers;
    let topology = Topology::new(m, d, rank_layout).map_err(|e| e.to_string())?;
    let config = PlanConfig::new(slice_bytes, 64).map_err(|e| e.to_string())?;
    let geometry = match servers {
        0 => Geometry::new(topology, config),
        k => Geometry::with_servers(topology, config, k),
    }
    .map_err(|e| e.to_string())?;
    let layout = StagingLayout::new(&geometry, world).ok_or("layout")?;

    let net = Network::new(processes);
    let mut engines = build_job(
        &geometry,
        &layout,
        buffers,
        &net,
        direct,
        design,
        sc.collectives,
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
                let summed = relay_over_machines(topology, servers, op.descriptor().collective);
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
        ranks.push(Rank {
            engine,
            tensors,
            inputs,
            submitted: 0,
            settled: vec![None; ops.len()],
            dead: false,
        });
    }

    let mut outcome = Outcome {
        killed: kill.map(|k| k.1),
        ..Outcome::default()
    };
    loop {
        outcome.steps += 1;
        if outcome.steps > step_limit {
            return Err(format!(
                "{m}x{d} + {servers} servers, {buffers} buffers: not settled after {step_limit} \
                 steps; settled: {:?}; failures: {:?}; GPUs waiting: {:?}",
                ranks.iter().map(|r| r.settled.clone()).collect::<Vec<_>>(),
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
        let live = ranks.iter().filter(|r| !r.dead);
        if live.clone().all(|r| r.settled.iter().all(Option::is_some)) {
            break;
        }
        // One scheduled action.
        let choice = rng.below(100);
        if on_device && (40..55).contains(&choice) {
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
            } else if rank.submitted > 0 {
                // The caller makes its stream wait for an operation it started
                // (a `Work::wait` on a CUDA tensor's work, as late as it likes).
                let seq = pick % rank.submitted as u64;
                let engine = &rank.engine;
                engine
                    .memory
                    .enqueue_wait(seq, || engine.awaits_on_device(seq));
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
            let outstanding = (0..rank.submitted)
                .filter(|&k| rank.settled[k].is_none())
                .count();
            if choice >= 85 && rank.submitted < ops.len() && outstanding < window {
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
                    engine.memory.submit_device(to, from)
                } else {
                    SimTensor::Host(HostTensor::new(rank.tensors[k].as_mut_ptr().cast(), bytes))
                };
                let sub = Submission {
                    seq,
                    tensor,
                    elements: op.planned(),
                    dtype: op.dtype,
                    op: op.op,
                    algorithm: op.algorithm,
                    wire: op.wire,
                    descriptor: sc.descriptor(k),
                    deliver: None,
                };
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
            } else {
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
        let failed = rank.settled.iter().filter(|s| **s == Some(false)).count();
        outcome.done += rank.settled.len() - failed;
        let device_done = rank
            .settled
            .iter()
            .zip(&sc.device)
            .filter(|&(s, &d)| d && *s == Some(true))
            .count();
        outcome.device += device_done;
        if sc.collectives && d > 1 {
            outcome.collective += device_done;
        }
        outcome.failed += failed;
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
    Ok(outcome)
}

/// The bytes of 8-byte words.
fn bytemuck_bytes(words: &mut [u64]) -> &mut [u8] {
    let len = std::mem::size_of_val(words);
    // SAFETY: `u64` has no padding and any byte pattern is valid for `u8`; the
    // slice covers exactly the words' memory, borrowed mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

/// Checks rank `r`'s result of operation `k` element by element.
fn check(op: &Op, k: usize, world: u32, r: usize, words: &[u64]) -> Result<(), String> {
    let len = std::mem::size_of_val(words);
    // SAFETY: as in `bytemuck_bytes`, read-only.
    let bytes = unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), len) };
    for i in 0..usize::try_from(op.elements).unwrap_or(0) {
        if !op.defined(r, i as u64) {
            continue;
        }
        if let Some(origin) = op.origin_of(i as u64) {
            let want = narrow(op.dtype, input(op.dtype, origin, k, i as u64));
            let got = read(op.dtype, bytes, i);
            if got != want {
                return Err(format!(
                    "rank {r}, operation {k} ({op:?}): element {i} is {got}, expected rank \
                     {origin}'s {want}"
                ));
            }
            continue;
        }
        let want = (1..world).fold(
            narrow(op.dtype, input(op.dtype, 0, k, i as u64)),
            |acc, q| {
                narrow(
                    op.dtype,
                    fold(
                        op.op,
                        acc,
                        narrow(op.dtype, input(op.dtype, q, k, i as u64)),
                    ),
                )
            },
        );
        let got = read(op.dtype, bytes, i);
        if got != want {
            return Err(format!(
                "rank {r}, operation {k} ({op:?}): element {i} is {got}, expected {want}"
            ));
        }
    }
    Ok(())
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

#[test]
fn seeded_schedules_settle_with_exact_results() {
    let seeds = seeds();
    let (mut killed, mut steps, mut done, mut failed) = (0, 0, 0, 0);
    let (mut device, mut collective) = (0, 0);
    for &seed in &seeds {
        let result = std::panic::catch_unwind(|| run(seed, Design::GateOnHost));
        let outcome = match result {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => panic!(
                "simulation seed {seed}: {e}\nreplay: FAIRRING_SIM_SEED={seed} cargo test -p fairring --lib simulation"
            ),
            Err(_) => panic!(
                "simulation seed {seed} panicked\nreplay: FAIRRING_SIM_SEED={seed} cargo test -p fairring --lib simulation"
            ),
        };
        killed += usize::from(outcome.killed.is_some());
        steps += outcome.steps;
        done += outcome.done;
        failed += outcome.failed;
        device += outcome.device;
        collective += outcome.collective;
    }
    eprintln!(
        "simulation: {} seeds ({killed} with a killed rank), {steps} steps, {done} operations \
         done ({device} on the simulated device, {collective} of them through a machine's \
         collectives), {failed} failed",
        seeds.len()
    );
    assert!(done > 0);
    assert!(
        seeds.len() < 100 || device > 0,
        "the seeds run device operations"
    );
    assert!(
        seeds.len() < 100 || collective > 0,
        "the seeds run device operations through a machine's collectives"
    );
}

/// Relayed chunks land early in the slice area of a buffer, the bytes a local
/// rank's all-gather reads from its peers' buffers: all-reduces with a local step
/// interleaved with relays, over few buffers, on schedules where a rank runs
/// ahead of the other ranks of its machine.
#[test]
fn relays_after_local_steps_leave_local_readers_their_bytes() {
    let (mut checked, mut expected) = (0, 0);
    for seed in 1..=400u64 {
        let mut rng = Rng::new(seed);
        let (machines, devices) = rng.pick(&[(2, 2), (2, 3), (3, 2)]);
        let world = machines * devices;
        let reduce = |elements| Op {
            elements,
            dtype: DataType::I64,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::Exact,
            origins: None,
            share: None,
        };
        let relay = |origins| Op {
            elements: match origins {
                Origins::Blocks(block) => block * u64::from(world),
                Origins::Rank(_) => 3000,
            },
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            algorithm: Resolved::Relay,
            wire: WireFormat::Exact,
            origins: Some(origins),
            share: None,
        };
        let scenario = Scenario {
            machines,
            devices,
            layout: RankLayout::Contiguous,
            servers: 0,
            buffers: 1 + rng.below(2) as u32,
            slice_bytes: 1024,
            ops: vec![
                reduce(300),
                relay(Origins::Blocks(400)),
                reduce(200),
                relay(Origins::Rank(world - 1)),
                reduce(129),
                relay(Origins::Blocks(97)),
            ],
            window: 2 + rng.below(3) as usize,
            kill: None,
            direct: DirectSettings::from(None),
            device: vec![false; 6],
            collectives: false,
        };
        match play(&scenario, &mut rng, Design::GateOnHost, STEP_LIMIT) {
            Ok(outcome) => checked += outcome.done,
            Err(e) => panic!("seed {seed}, {scenario:?}: {e}"),
        }
        expected += world as usize * scenario.ops.len();
    }
    assert_eq!(checked, expected, "every operation of every rank is done");
}

/// The engines of a small job for the focused tests: `m x d` ranks, two
/// buffers of 4 KiB slices, under `design` and `timeout`, each local step
/// through `wrap`.
fn small_job(
    (m, d): (u32, u32),
    design: Design,
    timeout: Duration,
    wrap: impl Fn(u32, SimStep) -> Box<dyn LocalStep<SimMemory>>,
) -> (
    Vec<Engine<SimFabric, SimMemory>>,
    Arc<std::sync::Mutex<Network>>,
) {
    let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
    let geometry = Geometry::new(topology, PlanConfig::new(4096, 64).unwrap()).unwrap();
    let layout = StagingLayout::new(&geometry, m * d).unwrap();
    let net = Network::new(m * d);
    let engines = build_job(
        &geometry,
        &layout,
        2,
        &net,
        DirectSettings::from(None),
        design,
        false,
        timeout,
        wrap,
    )
    .unwrap();
    (engines, net)
}

/// Submits operation 0 on `engine`: a hierarchical `i64` sum of `tensor`, a
/// device tensor whose caller's stream first writes `input` into it.
fn submit_device_sum(
    engine: &Engine<SimFabric, SimMemory>,
    tensor: &mut [u64],
    input: &mut [u64],
) -> crate::Result<()> {
    assert!(engine.works.try_take(0));
    let elements = tensor.len() as u64;
    let descriptor = Descriptor {
        collective: Collective::AllReduce,
        dtype: DataType::I64,
        op: ReduceOp::Sum,
        algorithm: Resolved::Hierarchical,
        wire: WireFormat::Exact,
        memory: MemoryKind::Device,
        root: 0,
        elements,
    };
    let tensor = engine
        .memory
        .submit_device(bytemuck_bytes(tensor), bytemuck_bytes(input));
    engine.submit(Submission {
        seq: 0,
        tensor,
        elements,
        dtype: DataType::I64,
        op: ReduceOp::Sum,
        algorithm: Resolved::Hierarchical,
        wire: WireFormat::Exact,
        descriptor,
        deliver: None,
    })
}

/// A local step that panics in its all-gather: a bug inside a step.
struct PanickingAllGather(SimStep);

impl LocalStep<SimMemory> for PanickingAllGather {
    fn buffer_free(&self, buffer: u32, number: u64) -> bool {
        self.0.buffer_free(buffer, number)
    }
    fn begin(&self, s: &LocalSlice<'_, SimMemory>) -> crate::Result<()> {
        self.0.begin(s)
    }
    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, SimMemory>,
        final_world: Option<u32>,
    ) -> crate::Result<Option<SimFence>> {
        self.0.try_reduce_scatter(s, final_world)
    }
    fn publish_slot(&self, s: &LocalSlice<'_, SimMemory>) {
        self.0.publish_slot(s);
    }
    fn try_all_gather(
        &self,
        _s: &LocalSlice<'_, SimMemory>,
        _own_in_tensor: bool,
    ) -> crate::Result<Option<SimFence>> {
        panic!("an injected panic in the all-gather");
    }
    fn finish(&self, buffer: u32, number: u64) {
        self.0.finish(buffer, number);
    }
    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        self.0.laggards(buffer, number)
    }
}

#[test]
fn a_panic_inside_a_step_fails_the_communicator_with_its_message() {
    let (engines, _net) = small_job(
        (1, 2),
        Design::GateOnHost,
        Duration::from_secs(3600),
        |rank, step| {
            if rank == 1 {
                Box::new(PanickingAllGather(step))
            } else {
                Box::new(step)
            }
        },
    );
    let mut tensors = [[1u64; 300], [2u64; 300]];
    for (engine, tensor) in engines.iter().zip(&mut tensors) {
        assert!(engine.works.try_take(0));
        let descriptor = Descriptor {
            collective: Collective::AllReduce,
            dtype: DataType::I64,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::Exact,
            memory: crate::memory::MemoryKind::Host,
            root: 0,
            elements: 300,
        };
        engine
            .submit(Submission {
                seq: 0,
                tensor: SimTensor::Host(HostTensor::new(tensor.as_mut_ptr().cast(), 2400)),
                elements: 300,
                dtype: DataType::I64,
                op: ReduceOp::Sum,
                algorithm: Resolved::Hierarchical,
                wire: WireFormat::Exact,
                descriptor,
                deliver: None,
            })
            .unwrap();
    }
    let settled = |e: &Engine<SimFabric, SimMemory>| e.works.state(0).is_some_and(|s| s != 0);
    for _ in 0..10_000 {
        if engines.iter().all(settled) {
            break;
        }
        for e in &engines {
            e.try_drive();
        }
    }
    for e in &engines {
        assert_eq!(e.works.state(0), Some(FAILED), "rank {}", e.rank());
    }
    let own = engines[1].failure().unwrap();
    assert!(
        matches!(&own, crate::Error::Internal { detail, .. } if detail.contains("injected panic")),
        "{own}"
    );
    let peer = engines[0].failure().unwrap().to_string();
    assert!(
        peer.contains("rank 1") && peer.contains("injected panic"),
        "{peer}"
    );
    assert!(!engines[1].driver.is_poisoned());
    // The failed engine takes no more work and drives nothing.
    assert!(!engines[1].try_drive());
    assert!(engines[1].works.try_take(1));
    let refused = engines[1].submit(Submission {
        seq: 1,
        tensor: SimTensor::Host(HostTensor::new(std::ptr::null_mut(), 0)),
        elements: 0,
        dtype: DataType::U8,
        op: ReduceOp::Sum,
        algorithm: Resolved::Hierarchical,
        wire: WireFormat::Exact,
        descriptor: Descriptor {
            collective: Collective::Barrier,
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::Exact,
            memory: crate::memory::MemoryKind::Host,
            root: 0,
            elements: 0,
        },
        deliver: None,
    });
    assert!(matches!(refused, Err(crate::Error::Failed { .. })));
}

/// The design the gate replaced ([`Design::WaitOnStreams`]) hangs where the
/// shipped one does not, in both ways the simulated device shows:
///
/// - seed 357 (a 2x1 job whose rank 0 is killed): rank 1 fails, and waits
///   for an engine copy to end before it declares its operations failed; the
///   copy waits for the start of an operation its caller submitted behind a
///   wait for an earlier one, which only that declaration would release (the
///   engine before the gate drained its streams there, with its lock held, and
///   hung the same way);
/// - seed 13: the caller waits on the device for a host operation that
///   finished before the device side existed, whose word is never set.
#[test]
fn the_design_before_the_gate_hangs_where_the_gate_does_not() {
    let drained = run_for(357, Design::WaitOnStreams, 200_000).unwrap_err();
    assert!(
        drained.contains("not settled") && drained.contains("WaitFor"),
        "{drained}"
    );
    let waited = run(13, Design::WaitOnStreams).unwrap_err();
    assert!(
        waited.contains("a stream waits forever") && waited.contains("WaitWord"),
        "{waited}"
    );
    for seed in [357, 13] {
        let outcome = run(seed, Design::GateOnHost).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert!(outcome.device > 0, "seed {seed} runs device operations");
    }
}

/// The stall timer runs from an operation's start on the caller's stream:
/// a rank whose caller's stream takes longer than the timeout to reach the
/// start does not fail, and its operation then completes exactly. Under the
/// design before the gate its engine issued the operation's copies at once,
/// and they waited on its stream past the timeout: the stall timer fired.
#[test]
fn time_before_an_operation_starts_is_the_callers() {
    let timeout = Duration::from_millis(40);
    let outcome = |design| -> Result<Vec<i64>, String> {
        let (engines, net) = small_job((2, 1), design, timeout, |_, step| Box::new(step));
        let mut tensors = [vec![0u64; 1000], vec![0u64; 1000]];
        let mut inputs = [vec![3u64; 1000], vec![4u64; 1000]];
        let pump = |engines: &[Engine<SimFabric, SimMemory>]| {
            for e in engines {
                e.try_drive();
            }
            let mut net = net
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (a, b) in net.busy_links() {
                net.deliver(a, b);
            }
        };
        let submit = |r: usize, tensor: &mut [u64], input: &mut [u64]| {
            submit_device_sum(&engines[r], tensor, input).map_err(|e| e.to_string())
        };
        let [t0, t1] = &mut tensors;
        let [i0, i1] = &mut inputs;
        // Rank 0's caller's stream is busy for three timeouts before it
        // reaches the start; rank 1 has not called yet.
        submit(0, t0, i0)?;
        let begun = std::time::Instant::now();
        while begun.elapsed() < 3 * timeout {
            pump(&engines);
            if let Some(e) = engines[0].failure() {
                return Err(e.to_string());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        submit(1, t1, i1)?;
        for _ in 0..100_000 {
            if engines.iter().all(|e| e.works.state(0) == Some(DONE)) {
                return Ok(tensors.iter().map(|t| t[999] as i64).collect());
            }
            for e in &engines {
                e.memory.gpu().run_any(|_| 0);
            }
            pump(&engines);
            if let Some(e) = engines.iter().find_map(|e| e.failure()) {
                return Err(e.to_string());
            }
        }
        Err("not done".into())
    };
    assert_eq!(outcome(Design::GateOnHost), Ok(vec![7, 7]));
    let before = outcome(Design::WaitOnStreams).unwrap_err();
    assert!(
        before.contains("timed out") || before.contains("stall"),
        "{before}"
    );
}

/// A failing engine neither waits for the GPU nor declares an operation
/// failed while one of its copies may still write the caller's tensor: the
/// operation stays pending until the copy has run, then fails.
#[test]
fn a_failure_waits_for_running_copies_without_blocking() {
    // One rank per machine (a copy a slice's step holds) and two (the staged
    // step's copies in, which only the local step holds).
    for layout in [(2, 1), (1, 2)] {
        let (engines, _net) = small_job(
            layout,
            Design::GateOnHost,
            Duration::from_secs(3600),
            |_, step| Box::new(step),
        );
        let mut tensors = [vec![0u64; 1000], vec![0u64; 1000]];
        let mut inputs = [vec![3u64; 1000], vec![4u64; 1000]];
        for (r, (t, i)) in tensors.iter_mut().zip(&mut inputs).enumerate() {
            submit_device_sum(&engines[r], t, i).unwrap();
        }
        // Rank 0's caller's stream reaches the start (the input's copy runs);
        // its engine then issues the slice's first copy, which has not run.
        assert!(engines[0].memory.gpu().run_any(|_| 0));
        for _ in 0..100 {
            for e in &engines {
                e.try_drive();
            }
        }
        let waiting = engines[0].memory.gpu().waiting().unwrap_or_default();
        assert!(waiting.contains("engine stream"), "{layout:?}: {waiting}");
        engines[0].fail(crate::Error::Aborted);
        assert_eq!(
            engines[0].works.state(0),
            Some(work::PENDING),
            "{layout:?}: declared failed while its copy may still touch the tensor"
        );
        assert!(engines[0].memory.gpu().run_out().is_none());
        engines[0].try_drive();
        assert_eq!(engines[0].works.state(0), Some(FAILED), "{layout:?}");
    }
}
