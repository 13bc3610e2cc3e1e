//! NCCL's all-reduce as NCCL's own tuner predicts it.
//!
//! A port of `ncclTopoTuneModel` and `ncclTopoGetAlgoTime`
//! (`src/graph/tuning.cc` of NVIDIA/nccl at commit 5067397c, the lines cited
//! below) for an all-reduce: for each algorithm (Tree, Ring, NVLS, NVLSTree) and
//! protocol (LL, LL128, Simple) a bus bandwidth from the channels and
//! per-channel rates NCCL's topology search finds, capped and corrected as the
//! tuner does, turned into an algorithm bandwidth; a latency from the tuner's
//! base and per-hop tables; and a time `latency + bytes / bandwidth`. NCCL runs
//! the pair of least time (`topoGetAlgoInfo` in `src/enqueue.cc`), which is the
//! `nccl-best` row; `nccl-ring`, `nccl-tree` and `nccl-nvlstree` are the best
//! protocol of each algorithm.
//!
//! What the topology search would find (channel counts, per-channel rates
//! within and between machines, the tree pattern, the CPU) is a preset's
//! `nccl` table ([`NcclTopology`]); `benches/presets/hardware.toml` says where
//! each figure comes from. NCCL runs one collective at a time on its stream, so
//! `tensors` tensors take `tensors` times one.
//!
//! The engine's own calls within a machine are timed the same way
//! ([`estimate_collective`]): a reduce, a reduce-scatter and an all-gather.
//!
//! Not ported: CollNet (SHARP), PAT (all-reduce never uses it, a
//! reduce-scatter only with one GPU a machine), the fp8 ring
//! penalty, tuner plugins and `NCCL_ALGO`/`NCCL_PROTO` overrides, the x86 test
//! of NVLSTree's size correction (which applies from compute capability 10.0,
//! no preset's), and LL128's
//! default rule (tuning.cc 515-534), which enables it where the NICs sit at most
//! a PCIe bridge from their GPUs and the GPUs share NVLink: every preset's
//! machines, so LL128 is always enabled here. The search's results are a
//! preset's, found for its own GPUs per machine: a job of another count
//! (`--devices`) is tuned with them as they are.

use serde::Deserialize;

use super::{Algo, Job, ModelError, Prediction};

/// NCCL's all-reduce algorithms the port covers, in NCCL's index order
/// (`src/include/plugin/nccl_tuner.h`: Tree 0, Ring 1, NVLS 4, NVLSTree 5),
/// which breaks ties in the choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NcclAlgorithm {
    /// The double binary tree between machines, a chain within each.
    Tree,
    /// Rings, one per channel.
    Ring,
    /// NVLink SHARP: the reduction in the NVSwitch (one machine here: several
    /// need CollNet, which the port leaves out).
    Nvls,
    /// NVLS within each machine, a tree between machines.
    NvlsTree,
}

/// NCCL's protocols, in NCCL's index order (LL 0, LL128 1, Simple 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// 8-byte stores of 4 bytes of data and a flag.
    Ll,
    /// 128-byte lines of 120 bytes of data and a flag.
    Ll128,
    /// Whole buffers and a fence.
    Simple,
}

impl NcclAlgorithm {
    /// Every algorithm, in NCCL's order.
    pub const ALL: [NcclAlgorithm; 4] = [
        NcclAlgorithm::Tree,
        NcclAlgorithm::Ring,
        NcclAlgorithm::Nvls,
        NcclAlgorithm::NvlsTree,
    ];

    /// NCCL's name.
    pub const fn name(self) -> &'static str {
        match self {
            NcclAlgorithm::Tree => "Tree",
            NcclAlgorithm::Ring => "Ring",
            NcclAlgorithm::Nvls => "NVLS",
            NcclAlgorithm::NvlsTree => "NVLSTree",
        }
    }
}

impl Protocol {
    /// Every protocol, in NCCL's order.
    pub const ALL: [Protocol; 3] = [Protocol::Ll, Protocol::Ll128, Protocol::Simple];

    /// NCCL's name.
    pub const fn name(self) -> &'static str {
        match self {
            Protocol::Ll => "LL",
            Protocol::Ll128 => "LL128",
            Protocol::Simple => "Simple",
        }
    }

    const fn index(self) -> usize {
        match self {
            Protocol::Ll => 0,
            Protocol::Ll128 => 1,
            Protocol::Simple => 2,
        }
    }
}

/// The CPU vendor NCCL sees: it sets the network post overhead
/// (`getNetOverhead`, tuning.cc 228-233) and LL's caps between machines
/// (`llMaxBws`, rows by vendor where machines are several).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Cpu {
    /// Intel x86: 1 us a post.
    Intel,
    /// AMD x86: 2 us a post.
    Amd,
}

/// NCCL's `NET_OVERHEAD`: what a network post costs, us (`getNetOverhead`,
/// tuning.cc 228-233).
pub fn post_overhead_us(cpu: Cpu) -> f64 {
    match cpu {
        Cpu::Intel => 1.0,
        Cpu::Amd => 2.0,
    }
}

/// The pattern of the tree graph NCCL's search settles on
/// (`NCCL_TOPO_PATTERN_*`, `src/include/graph.h`): a plain tree costs the
/// tree 15% of its bandwidth (tuning.cc 336).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TreePattern {
    /// `NCCL_TOPO_PATTERN_BALANCED_TREE`.
    Balanced,
    /// `NCCL_TOPO_PATTERN_SPLIT_TREE`.
    Split,
    /// `NCCL_TOPO_PATTERN_TREE`.
    Tree,
}

/// One graph of NCCL's topology search (`struct ncclTopoGraph`): its channels
/// and the rate of each within and between machines.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Graph {
    /// `nChannels`.
    pub channels: u32,
    /// `bwIntra`, GB/s per channel.
    pub bw_intra: f64,
    /// `bwInter`, GB/s per channel.
    pub bw_inter: f64,
    /// `sameChannels`: every channel takes the first channel's order of GPUs
    /// (`src/graph/search.cc` tries this first). A reduce or a broadcast then
    /// pays one hop's latency, not one per step (tuning.cc 393-402).
    #[serde(default = "same_channels")]
    pub same_channels: bool,
}

fn same_channels() -> bool {
    true
}

/// The collectives the port times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Collective {
    /// `ncclAllReduce`.
    AllReduce,
    /// `ncclReduce`: the tuner runs it as a ring only (tuning.cc 294).
    Reduce,
    /// `ncclReduceScatter`: a ring, or on one machine NVLS, whose bus
    /// bandwidth the tuner keeps as the algorithm's (tuning.cc 295-296,
    /// 310-318, 376-381; PAT needs one GPU a machine, CollNet is left out).
    ReduceScatter,
    /// `ncclAllGather`, and the broadcasts of a group with several roots, which
    /// NCCL runs as one ring all-gather (`ncclScheduleBcastTasksToPlan`,
    /// `src/scheduler/allgatherv_sched.cc` 47-75: NVLS off): a ring only here.
    AllGather,
}

/// What NCCL's search finds on a set of machines: the graphs of the ring,
/// the tree and NVLS (none where `nvls` is absent).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Graphs {
    /// `comm->nChannels` once set up (`ncclTopoPostset`): the ring's
    /// plateau rule divides by it (tuning.cc 647-648).
    pub channels: u32,
    /// The ring graph.
    pub ring: Graph,
    /// The tree graph.
    pub tree: Graph,
    /// The NVLS graph (NVLS and NVLSTree), where the machine has NVLink SHARP.
    pub nvls: Option<Graph>,
}

/// NCCL's tuning inputs for a preset's machines: what `ncclTopoTuneModel`
/// reads besides the job's shape.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NcclTopology {
    /// The GPUs' compute capability times ten (90 for Hopper).
    pub compute_capability: u32,
    /// The CPU vendor.
    pub cpu: Cpu,
    /// The tree graph's pattern.
    pub tree_pattern: TreePattern,
    /// What the search finds on several machines.
    pub machines: Graphs,
    /// What it finds on one.
    pub one_machine: Graphs,
}

impl NcclTopology {
    pub(super) fn check(&self) -> Result<(), String> {
        for (name, g) in [
            ("machines", self.machines),
            ("one_machine", self.one_machine),
        ] {
            let mut graphs = vec![("ring", g.ring), ("tree", g.tree)];
            graphs.extend(g.nvls.map(|n| ("nvls", n)));
            if g.channels == 0 {
                return Err(format!("nccl.{name}.channels must be positive"));
            }
            for (graph, v) in graphs {
                if v.channels == 0 {
                    return Err(format!("nccl.{name}.{graph}.channels must be positive"));
                }
                for (field, rate) in [("bw_intra", v.bw_intra), ("bw_inter", v.bw_inter)] {
                    if !(rate.is_finite() && rate > 0.0) {
                        return Err(format!(
                            "nccl.{name}.{graph}.{field} must be a positive number of GB/s, \
                             got {rate}"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The compute-capability row of the tuner's tables
    /// (`NCCL_*_COMPCAP_IDX`, tuning.cc 263-266).
    fn arch(&self) -> usize {
        match self.compute_capability {
            c if c >= 100 => 3,
            c if c >= 90 => 2,
            c if c >= 80 => 1,
            _ => 0,
        }
    }
}

/// `baseLatencies` (tuning.cc 150-156), us, by algorithm then protocol.
const BASE_LATENCY: [[f64; 3]; 4] = [
    [6.8, 14.0, 8.4], // Tree
    [6.6, 14.0, 8.4], // Ring
    [0.0, 0.0, 0.0],  // NVLS
    [0.0, 0.0, 0.0],  // NVLSTree
];

/// `hwLatencies` (tuning.cc 158-175), us: NVLink, PCI, network rows, by
/// algorithm then protocol.
const HW_LATENCY: [[[f64; 3]; 4]; 3] = [
    [
        [0.6, 1.25, 4.0],
        [0.6, 1.9, 3.4],
        [0.0, 0.0, 25.0],
        [0.0, 0.0, 25.0],
    ],
    [
        [1.0, 1.9, 4.0],
        [1.0, 2.5, 5.7],
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
    ],
    [
        [5.0, 8.5, 14.0],
        [2.7, 4.0, 14.0],
        [0.0, 0.0, 18.0],
        [0.0, 0.0, 20.9],
    ],
];
const HW_NVLINK: usize = 0;
const HW_NET: usize = 2;

/// `llMaxBws` (tuning.cc 177-183): rows Volta-N1/Intel-N2/Intel-N4,
/// Ampere-N1/AMD-N2/AMD-N4, Hopper-N1, Blackwell-N1.
const LL_MAX_BW: [[f64; 3]; 4] = [
    [39.0, 39.0, 20.4],
    [87.7, 22.5, 19.0],
    [141.0, 45.0, 35.0],
    [2.0 * 141.0, 2.0 * 45.0, 2.0 * 35.0],
];
/// `perChMaxRingLL128Bws` (tuning.cc 185-190), by architecture, N1/N2/N4.
const RING_LL128_MAX_BW: [[f64; 3]; 4] = [
    [20.0, 20.0, 20.0],
    [20.0, 20.0, 20.0],
    [36.7, 36.7, 36.7],
    [40.0, 40.0, 40.0],
];
/// `perChMaxTreeLL128Bws` (tuning.cc 192-197).
const TREE_LL128_MAX_BW: [[f64; 3]; 4] = [
    [20.0, 20.0, 20.0],
    [20.0, 20.0, 20.0],
    [36.7, 36.7, 29.0],
    [55.6, 31.67, 20.0],
];
/// `perChMaxTreeBws` (tuning.cc 199-204).
const TREE_MAX_BW: [[f64; 3]; 4] = [
    [26.5, 18.5, 10.0],
    [24.0, 23.6, 17.8],
    [38.7, 41.4, 36.0],
    [70.0, 42.8, 24.0],
];
/// `perChMaxNVLSTreeBws` (tuning.cc 206-211).
const NVLS_TREE_MAX_BW: [[f64; 3]; 4] = [
    [26.5, 18.5, 10.0],
    [24.0, 23.6, 17.8],
    [0.0, 57.7, 45.5],
    [0.0, 96.0, 80.0],
];
/// `nvlsEfficiency` (tuning.cc 139-144), by architecture.
const NVLS_EFFICIENCY: [f64; 4] = [0.0, 0.0, 0.85, 0.74];

/// `treeCorrectionFactor` (tuning.cc 620-627), by protocol and
/// `log2(bytes / 64)`, 0 to 23.
const TREE_CORRECTION: [[f64; 24]; 3] = [
    [
        1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.7, 0.7, 0.7, 0.7, 0.6, 0.5, 0.4, 0.4, 0.5, 0.6, 0.7, 0.8,
        0.9, 1.0, 1.0, 1.0, 1.0, 1.0,
    ],
    [
        1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.8, 0.8, 0.8, 0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6, 0.8, 0.9,
        0.9, 0.9, 0.9, 1.0, 1.0, 1.0,
    ],
    [
        0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.8, 0.7, 0.6, 0.6, 0.5, 0.5, 0.5, 0.5, 0.6, 0.7, 0.8,
        0.7, 0.7, 0.8, 0.9, 0.9, 0.9,
    ],
];

/// `floor(log2(n))` for `n >= 1` (`log2i`, `src/include/bitops.h`).
fn log2i(n: u64) -> i64 {
    if n == 0 {
        -1
    } else {
        i64::from(63 - n.leading_zeros())
    }
}

/// What the tuner predicts for one algorithm and protocol.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// The algorithm.
    pub algorithm: NcclAlgorithm,
    /// The protocol.
    pub protocol: Protocol,
    /// `comm->bandwidths`: the algorithm bandwidth, GB/s, before the size
    /// corrections of `ncclTopoGetAlgoTime`.
    pub bandwidth_gbps: f64,
    /// `comm->latencies`, us, before the ring's plateau factor.
    pub latency_us: f64,
    /// `ncclTopoGetAlgoTime`'s time for the job's bytes, us.
    pub time_us: f64,
}

/// The tuner's estimate of an all-reduce of `bytes` bytes on `machines x
/// devices` GPUs by `algorithm` and `protocol`, or `None` where NCCL would
/// not run that pair (its bandwidth is 0: NVLSTree on one machine, NVLS on
/// several, NVLS where the machines have none, NVLS or NVLSTree other than
/// Simple).
pub fn estimate(
    t: &NcclTopology,
    machines: u32,
    devices: u32,
    bytes: u64,
    algorithm: NcclAlgorithm,
    protocol: Protocol,
) -> Option<Estimate> {
    estimate_collective(
        t,
        Collective::AllReduce,
        machines,
        devices,
        bytes,
        algorithm,
        protocol,
    )
}

/// The tuner's estimate of `collective` of `bytes` bytes (NCCL's `nBytes`: for
/// a reduce the buffer, for an all-gather the whole output) on `machines x
/// devices` GPUs, or `None` where NCCL would not run that pair.
pub fn estimate_collective(
    t: &NcclTopology,
    collective: Collective,
    machines: u32,
    devices: u32,
    bytes: u64,
    algorithm: NcclAlgorithm,
    protocol: Protocol,
) -> Option<Estimate> {
    let all_reduce = collective == Collective::AllReduce;
    let nvls_scatter = collective == Collective::ReduceScatter && algorithm == NcclAlgorithm::Nvls;
    if !all_reduce && algorithm != NcclAlgorithm::Ring && !nvls_scatter {
        return None;
    }
    let n_nodes = machines.max(1);
    let n_ranks = n_nodes * devices.max(1);
    if n_ranks <= 1 {
        return None;
    }
    let graphs = if n_nodes == 1 {
        t.one_machine
    } else {
        t.machines
    };
    let arch = t.arch();
    // tuning.cc 267-276.
    let scale = match n_nodes {
        1 => 0,
        2 => 1,
        _ => 2,
    };
    let vendor_row = match (n_nodes, t.cpu) {
        (1, _) => arch,
        (_, Cpu::Amd) => 1,
        (_, Cpu::Intel) => 0,
    };
    let ll_max = LL_MAX_BW[vendor_row][scale];
    let p = protocol.index();
    let nvls_family = matches!(algorithm, NcclAlgorithm::Nvls | NcclAlgorithm::NvlsTree);
    // tuning.cc 301, 500-506.
    if nvls_family && protocol != Protocol::Simple {
        return None;
    }
    // NVLink SHARP reduces across a machine's GPUs: one GPU has none to
    // reduce with (NCCL's `nvlsSupport` needs two local ranks).
    if (algorithm == NcclAlgorithm::NvlsTree && n_nodes == 1)
        || (algorithm == NcclAlgorithm::Nvls && n_nodes > 1)
        || (nvls_family && devices < 2)
    {
        return None;
    }
    let graph = match algorithm {
        NcclAlgorithm::Tree => graphs.tree,
        NcclAlgorithm::Ring => graphs.ring,
        NcclAlgorithm::Nvls | NcclAlgorithm::NvlsTree => graphs.nvls?,
    };
    let channels = f64::from(graph.channels);
    // tuning.cc 289-291.
    let nsteps = match collective {
        Collective::AllReduce => 2.0 * f64::from(n_ranks - 1),
        Collective::AllGather | Collective::ReduceScatter => f64::from(n_ranks - 1),
        Collective::Reduce => f64::from(n_ranks),
    };
    // tuning.cc 306-324.
    let mut bw = if n_nodes <= 2 {
        graph.bw_intra
    } else {
        graph.bw_inter
    };
    if nvls_family {
        if graph.channels < 2 {
            return None;
        }
        // An all-reduce pipelines two operations; anything else moves a
        // `(ppn - 1) / ppn` share (tuning.cc 313-318).
        let ppn = f64::from(devices.max(1));
        let share = if all_reduce { 2.0 } else { (ppn - 1.0) / ppn };
        let intra = graph.bw_intra * NVLS_EFFICIENCY[arch] * (channels - 1.0) / channels * share;
        let inter = graph.bw_inter
            * if n_nodes <= 2 && algorithm == NcclAlgorithm::NvlsTree {
                2.0
            } else {
                1.0
            };
        let cap = if algorithm == NcclAlgorithm::NvlsTree {
            NVLS_TREE_MAX_BW[arch][scale]
        } else {
            f64::INFINITY
        };
        bw = intra.min(inter).min(cap);
    }
    let mut bus = channels * bw;
    // tuning.cc 326-336.
    match (algorithm, protocol) {
        (NcclAlgorithm::Ring, Protocol::Ll) => bus = ll_max.min(bus * 0.5),
        (NcclAlgorithm::Ring, Protocol::Ll128) => {
            bus = (bus * 0.92).min(channels * RING_LL128_MAX_BW[arch][scale]);
        }
        _ => {}
    }
    if algorithm == NcclAlgorithm::Tree && all_reduce {
        bus = (bus * 0.92).min(channels * TREE_MAX_BW[arch][scale]);
        match protocol {
            Protocol::Ll => bus = (bus / 3.8).min(ll_max),
            Protocol::Ll128 => {
                let keep = if n_nodes == 1 {
                    7.0 / 9.0
                } else {
                    120.0 / 128.0
                };
                bus = (bus * keep).min(channels * TREE_LL128_MAX_BW[arch][scale]);
            }
            Protocol::Simple => {}
        }
        if t.tree_pattern == TreePattern::Tree {
            bus *= 0.85;
        }
    }
    if bus <= 0.0 {
        return None;
    }
    // tuning.cc 377-382: bus bandwidth to algorithm bandwidth, but for a
    // reduce-scatter other than the ring's, whose bus bandwidth stands.
    let bandwidth = if nvls_scatter {
        bus
    } else if algorithm == NcclAlgorithm::Tree {
        bus * 0.5
    } else {
        bus * f64::from(n_ranks) / nsteps
    };
    // tuning.cc 384-428. The network's own latency (`latencyInter`) is 0 on
    // InfiniBand (`props->latency = 0`, `src/transport/net_ib`).
    let a = algorithm as usize;
    let hw_intra = HW_NVLINK;
    let intra = HW_LATENCY[hw_intra][a][p];
    let inter = if n_ranks == n_nodes {
        HW_LATENCY[HW_NET][NcclAlgorithm::Tree as usize][p]
    } else {
        HW_LATENCY[HW_NET][a][p]
    };
    let nodes = f64::from(n_nodes);
    let latency = BASE_LATENCY[a][p]
        + match algorithm {
            NcclAlgorithm::Ring if collective == Collective::Reduce => {
                // tuning.cc 393-402: one hop's latency where every channel
                // takes the same order, else one a step (Simple then at the
                // tree's rate). The hop is NVLink's on one machine, the
                // network's between several.
                let row = if n_nodes == 1 { hw_intra } else { HW_NET };
                if graph.same_channels {
                    HW_LATENCY[row][a][p]
                } else if protocol == Protocol::Simple {
                    nsteps * HW_LATENCY[row][NcclAlgorithm::Tree as usize][p]
                } else {
                    nsteps * HW_LATENCY[row][a][p]
                }
            }
            NcclAlgorithm::Ring => {
                // "Inter-node rings still have to launch nsteps * net
                // overhead" (tuning.cc 404-412).
                let overhead = if n_nodes > 1 {
                    let post = post_overhead_us(t.cpu);
                    if protocol == Protocol::Simple {
                        3.0 * post
                    } else {
                        post
                    }
                } else {
                    0.0
                };
                let intra = intra.max(overhead);
                let inter_steps = match (n_nodes, collective) {
                    (1, _) => 0.0,
                    (_, Collective::AllReduce) => 2.0 * (nodes - 1.0),
                    _ => nodes - 1.0,
                };
                (nsteps - inter_steps) * intra + inter_steps * inter
            }
            NcclAlgorithm::Tree => {
                // `nRanks / nNodes` is an integer division.
                let per_node = f64::from(n_ranks / n_nodes);
                #[expect(clippy::cast_precision_loss, reason = "a small logarithm")]
                let levels = log2i(u64::from(n_nodes)) as f64;
                2.0 * ((per_node - 1.0) * intra + levels * inter)
            }
            NcclAlgorithm::Nvls => {
                if n_nodes > 1 {
                    intra + inter
                } else {
                    intra
                }
            }
            NcclAlgorithm::NvlsTree => {
                #[expect(clippy::cast_precision_loss, reason = "a small logarithm")]
                let levels = log2i(u64::from(n_nodes)) as f64;
                intra + 2.0 * levels * inter
            }
        };
    // tuning.cc 630-654: ncclTopoGetAlgoTime, one operation.
    let mut bw_now = bandwidth;
    let log_size = log2i(bytes >> 6);
    if algorithm == NcclAlgorithm::Tree && all_reduce && (0..23).contains(&log_size) {
        bw_now *= TREE_CORRECTION[p][usize::try_from(log_size).unwrap_or(0)];
    }
    if algorithm == NcclAlgorithm::NvlsTree
        && all_reduce
        && (0..24).contains(&log_size)
        && t.compute_capability >= 100
    {
        bw_now *= TREE_CORRECTION[p][usize::try_from(log_size).unwrap_or(0)];
    }
    let mut lat_now = latency;
    if algorithm == NcclAlgorithm::Ring
        && protocol == Protocol::Simple
        && all_reduce
        && n_nodes > 1
        && bytes / (u64::from(graphs.channels) * u64::from(n_ranks)) >= 64
    {
        // "Plateau effect of ring".
        lat_now *= if t.compute_capability < 80 { 1.9 } else { 1.4 };
    }
    #[expect(clippy::cast_precision_loss, reason = "byte counts far below 2^52")]
    let time = lat_now + bytes as f64 / (1000.0 * bw_now);
    Some(Estimate {
        algorithm,
        protocol,
        bandwidth_gbps: bandwidth,
        latency_us: latency,
        time_us: time,
    })
}

/// The pair NCCL runs among `algorithms`: the least time, ties to the lower
/// index (algorithm first, then protocol), as `topoGetAlgoInfo` picks.
pub fn choose(
    t: &NcclTopology,
    machines: u32,
    devices: u32,
    bytes: u64,
    algorithms: &[NcclAlgorithm],
) -> Option<Estimate> {
    choose_collective(
        t,
        Collective::AllReduce,
        machines,
        devices,
        bytes,
        algorithms,
    )
}

/// The pair NCCL runs for `collective` among `algorithms`, as [`choose`].
pub fn choose_collective(
    t: &NcclTopology,
    collective: Collective,
    machines: u32,
    devices: u32,
    bytes: u64,
    algorithms: &[NcclAlgorithm],
) -> Option<Estimate> {
    let mut best: Option<Estimate> = None;
    for &a in algorithms {
        for p in Protocol::ALL {
            if let Some(e) = estimate_collective(t, collective, machines, devices, bytes, a, p)
                && best.is_none_or(|b| e.time_us < b.time_us)
            {
                best = Some(e);
            }
        }
    }
    best
}

/// The row `algo` (one of NCCL's) for `job` on `t`.
pub fn predict(t: &NcclTopology, job: &Job, algo: Algo) -> Result<Prediction, ModelError> {
    let (algorithms, reason): (&[NcclAlgorithm], &'static str) = match algo {
        Algo::NcclRing => (&[NcclAlgorithm::Ring], "NCCL's ring needs two GPUs"),
        Algo::NcclTree => (&[NcclAlgorithm::Tree], "NCCL's tree needs two GPUs"),
        Algo::NcclNvlsTree => (
            &[NcclAlgorithm::NvlsTree],
            "NCCL's NVLSTree runs between machines that have NVLink SHARP",
        ),
        Algo::NcclBest => (&NcclAlgorithm::ALL, "NCCL needs two GPUs"),
        _ => {
            return Err(ModelError::NotApplicable {
                algo,
                reason: "not one of NCCL's rows",
            });
        }
    };
    let e = choose(t, job.machines, job.devices, job.bytes, algorithms)
        .ok_or(ModelError::NotApplicable { algo, reason })?;
    let mut p = Prediction::new(algo, job, f64::from(job.tensors) * e.time_us * 1e-6, None);
    p.nccl = Some(e);
    Ok(p)
}
