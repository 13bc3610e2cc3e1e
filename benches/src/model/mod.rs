//! The scale model: predicted time and bus bandwidth of an all-reduce on jobs no
//! test machine has, from 8 to thousands of GPUs.
//!
//! # What is modelled
//!
//! Between machines a LogGP model: a message occupies its sender for the larger
//! of the post's overhead (NCCL's `NET_OVERHEAD` for the CPU) and its bytes at the
//! link's rate, and lands the link's latency (`latency_us`) later, once per
//! dependent hop. Within a machine fairring's own NCCL calls are timed by NCCL's
//! tuner on the machine's communicator, as NCCL runs them; a byte reduced costs
//! the memory traffic of the reduction (from the memory's rate). Link classes are NVLink (within a machine, per GPU), PCIe, the NICs of a
//! GPU machine and those of a server machine ([`Hardware`], read from a presets
//! file).
//!
//! **fairring's algorithms are driven by fairring-core's own plan** for the job:
//! the model makes the [`Geometry`](fairring_core::plan::Geometry) and
//! [`Plan`](fairring_core::plan::Plan) the engine would make, walks every slice,
//! asks each machine's [`Role`](fairring_core::staging::Role) how many contributions
//! and results it sends and receives, and each cell how many bytes it holds; the
//! slices and the number of staging buffers are the engine's own
//! ([`fairring::Config::staging`]: its buffers' layout under the budget, the
//! default slices halved until two buffers fit). So
//! adaptive sharding, rotation of servers and the staging budget act on the
//! prediction exactly as they act on a real job. Each slice then passes through a
//! pipeline of stages (intra-machine reduce-scatter, contributions out, reduction,
//! results back, intra-machine all-gather), each stage holding a resource of the
//! machine that runs it (its NVLink, its rail's send and receive sides, its GPU),
//! so that slices in different staging buffers overlap as they do in the engine,
//! and a slice takes a buffer only when the slice `buffers` before it has released
//! it on that machine. The stages form a discrete-event schedule: each starts once
//! its inputs are in and its resource has run every stage that was ready before
//! it. See [`hierarchical`] and [`servers`].
//!
//! **NCCL is what its own tuner predicts** ([`nccl`]: a port of `ncclTopoTuneModel`
//! and `ncclTopoGetAlgoTime`): its ring, tree and NVLSTree, and the one it would
//! choose; fairring's own ring ([`ring`]) is one ring over every rank, slice by slice.
//!
//! # What is not modelled
//!
//! Congestion inside the network (every NIC is assumed to reach its rate to any
//! peer), stragglers and jitter, the CPU cost of the progress thread beyond the
//! fixed per-step cost, and NCCL's protocol choice (LL, LL128, Simple) beyond its
//! latency. Only rail 0 of each machine is simulated: rails are symmetric, and rail
//! 0's slot is the largest (earlier slots take the extra units).

pub mod groups;
mod hardware;
pub mod hierarchical;
pub mod nccl;
pub mod ring;
pub mod server_groups;
pub mod servers;
mod stages;

pub mod calibrate;
mod events;

use std::fmt;

use fairring_core::DataType;
use fairring_core::plan::{PlanConfig, PlanError};
use fairring_core::topology::{RankLayout, Topology, TopologyError};

pub use hardware::{
    BUILTIN_PRESETS, Hardware, Link, Memory, Nics, Server, Software, parse_presets, preset,
};

/// The algorithms the model predicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Algo {
    /// fairring's hierarchical all-reduce with co-located servers (every GPU also
    /// serves), as the engine runs it.
    Hierarchical,
    /// The hierarchical all-reduce with dedicated CPU reduction servers (Herring).
    Servers,
    /// fairring's ring: one ring over every rank, slice by slice.
    Ring,
    /// NCCL's ring, as NCCL's tuner predicts it ([`nccl`]).
    NcclRing,
    /// NCCL's double binary tree between machines, a chain within each.
    NcclTree,
    /// NCCL's NVLSTree: NVLink SHARP within each machine, a tree between.
    NcclNvlsTree,
    /// Whichever of NCCL's algorithms and protocols its tuner would run.
    NcclBest,
    /// A study of the two-level plan over group sizes of its choice
    /// ([`groups`]): reduction servers within groups of machines, then
    /// across the groups (what `hierarchical` runs, in the engine's groups,
    /// past the wide flat slices and in equal groups in them).
    Groups,
    /// A study of dedicated servers in two levels ([`server_groups`]): the
    /// servers of a rail group in groups, each serving a group of worker
    /// machines, then reducing across the groups server to server.
    ServerGroups,
}

impl Algo {
    /// Every algorithm, in table order.
    pub const ALL: [Algo; 7] = [
        Algo::Hierarchical,
        Algo::Servers,
        Algo::Ring,
        Algo::NcclRing,
        Algo::NcclTree,
        Algo::NcclNvlsTree,
        Algo::NcclBest,
    ];

    /// Studies of plans over choices the engine does not make itself, asked
    /// for by name only (not in [`Algo::ALL`]).
    pub const STUDIES: [Algo; 2] = [Algo::Groups, Algo::ServerGroups];

    /// The name used on the command line and in tables.
    pub const fn name(self) -> &'static str {
        match self {
            Algo::Hierarchical => "hierarchical",
            Algo::Servers => "servers",
            Algo::Ring => "ring",
            Algo::NcclRing => "nccl-ring",
            Algo::NcclTree => "nccl-tree",
            Algo::NcclNvlsTree => "nccl-nvlstree",
            Algo::NcclBest => "nccl-best",
            Algo::Groups => "groups",
            Algo::ServerGroups => "server-groups",
        }
    }

    /// The algorithm named `name`.
    pub fn from_name(name: &str) -> Option<Algo> {
        Algo::ALL
            .into_iter()
            .chain(Algo::STUDIES)
            .find(|a| a.name() == name)
    }
}

impl fmt::Display for Algo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The job and workload of one prediction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Job {
    /// GPU machines, `M`.
    pub machines: u32,
    /// GPUs per machine, `D`.
    pub devices: u32,
    /// Bytes of each tensor.
    pub bytes: u64,
    /// Tensors submitted at once, one after the other (DDP's buckets of a step).
    pub tensors: u32,
    /// Element type: it sets the element count of a byte size.
    pub dtype: DataType,
    /// Slice size and minimum shard, as the engine's configuration.
    pub slicing: PlanConfig,
    /// Whether [`Job::slicing`]'s minimum shard was given
    /// (`FAIRRING_MIN_SHARD_SIZE`); if not, the engine takes its default,
    /// which is smaller with dedicated servers
    /// ([`PlanConfig::DEFAULT_SERVER_MIN_SHARD_BYTES`]), and a slicing with
    /// another minimum shard is refused ([`Job::staging`]).
    pub min_shard_given: bool,
    /// Staging memory per GPU (`FAIRRING_TOTAL_MEMORY`).
    /// `None`: the engine's default (`fairring::config::DEFAULT_TOTAL_MEMORY`).
    pub budget_bytes: Option<u64>,
    /// Dedicated server machines for [`Algo::Servers`]; 0 means one per GPU machine
    /// (Herring's setup).
    pub servers: u32,
    /// Whether the engine may run an all-reduce as one NCCL all-reduce across
    /// the job (`FAIRRING_NCCL_ACROSS_MACHINES`: `auto`, the default, or
    /// `off`); where it does is `fairring::nccl_across_job`'s.
    pub nccl_across_machines: bool,
    /// Whether the engine may let the machines serve their own shards beside
    /// dedicated servers (`FAIRRING_MACHINES_SERVE`: `auto`, the default,
    /// or `off`); where it does is [`servers::machines_serve`]'s.
    pub machines_serve: bool,
    /// Machines per group for [`Algo::Groups`]; 0: the size of
    /// [`groups::group_sizes`] whose prediction is shortest.
    pub group: u32,
    /// How the engine groups the machines where they serve
    /// (`FAIRRING_GROUP_SIZE`), for [`Algo::Hierarchical`]; a one-level
    /// [`Job::slicing`] keeps one level whatever this says.
    pub grouping: fairring::Grouping,
    /// NCCL communicators each machine uses for each direction within it
    /// (reduce-scatters, all-gathers) in fairring's algorithms: 1, as the
    /// engine makes them; 2, a study the engine does not run, whose
    /// slices take the two in turn so that one call's latency passes while
    /// the other's bytes move (what the co-located targets would need:
    /// `docs/scale-model.md`).
    pub comms_per_direction: u32,
}

impl Job {
    /// One tensor of `bytes` bytes of f32 on `machines x devices` GPUs with the
    /// engine's defaults: 25 MiB slices (20 MiB through the trees), 64 KiB minimum
    /// shard (16 KiB with dedicated servers), the default staging ([`fairring::config::DEFAULT_TOTAL_MEMORY`]).
    pub fn new(machines: u32, devices: u32, bytes: u64) -> Job {
        Job {
            machines,
            devices,
            bytes,
            tensors: 1,
            dtype: DataType::F32,
            slicing: PlanConfig::DEFAULT,
            min_shard_given: false,
            budget_bytes: None,
            servers: 0,
            nccl_across_machines: true,
            machines_serve: true,
            group: 0,
            grouping: fairring::Grouping::Auto,
            comms_per_direction: 1,
        }
    }

    /// The original Fairring's slicing: fixed 25 MiB slices cut into one shard per
    /// machine, however small (no minimum shard), and no NCCL across the job.
    pub fn original(mut self) -> Job {
        self.nccl_across_machines = false;
        self.machines_serve = false;
        self.min_shard_given = true;
        self.slicing =
            match PlanConfig::new(PlanConfig::DEFAULT_SLICE_BYTES, PlanConfig::MIN_SHARD_FLOOR) {
                Ok(c) => c,
                Err(_) => self.slicing,
            };
        self
    }

    /// GPUs in the job, `N = M * D`.
    pub fn gpus(&self) -> u64 {
        u64::from(self.machines) * u64::from(self.devices)
    }

    /// Bytes of every tensor together.
    pub fn total_bytes(&self) -> u64 {
        self.bytes * u64::from(self.tensors)
    }

    /// Elements of one tensor (its bytes rounded down to whole elements).
    pub fn elements(&self) -> u64 {
        self.bytes / self.dtype.size_bytes()
    }

    /// What the engine stages this job with, with `servers` dedicated server
    /// processes (0: the machines serve): its geometry and buffer count under
    /// [`Job::budget_bytes`], as [`fairring::Config::staging`] sizes them.
    /// A minimum shard other than the default in [`Job::slicing`] must be
    /// marked given ([`Job::min_shard_given`]), or it is refused.
    pub fn staging(&self, servers: u32) -> Result<fairring::Staging, ModelError> {
        let world = u32::try_from(self.gpus())
            .map_err(|_| ModelError::InvalidJob(format!("{} GPUs", self.gpus())))?;
        let topology = Topology::new(self.machines, self.devices, RankLayout::Contiguous)?;
        let mut builder = fairring::Config::builder(0, world, "127.0.0.1", 1).servers(servers);
        if self.min_shard_given {
            builder = builder.min_shard_bytes(self.slicing.min_shard_bytes());
        } else if self.slicing.min_shard_bytes() != PlanConfig::DEFAULT_MIN_SHARD_BYTES {
            return Err(ModelError::InvalidJob(format!(
                "the slicing's minimum shard of {} bytes is not the engine's default, but \
                 Job::min_shard_given is false, so the engine would not take it",
                self.slicing.min_shard_bytes()
            )));
        }
        if let Some(budget) = self.budget_bytes {
            builder = builder.total_memory(budget);
        }
        if !self.slicing.slice_by_routing() {
            builder = builder.slice_bytes(self.slicing.slice_bytes());
        }
        if self.slicing.is_one_level() {
            builder = builder.grouping(fairring::Grouping::OneLevel);
        } else {
            builder = builder.grouping(self.grouping);
        }
        builder
            .build()
            .and_then(|config| config.staging(topology))
            .map_err(|e| ModelError::Refused(e.to_string()))
    }

    /// Server machines for [`Algo::Servers`].
    pub fn server_machines(&self) -> u32 {
        if self.servers == 0 {
            self.machines
        } else {
            self.servers
        }
    }
}

/// What fairring's plan made each machine do, for the machine that did most.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Slices over all tensors.
    pub slices: u64,
    /// Shards per slot of a full slice (the adaptive-sharding rule's `k`).
    pub shards_per_full_slice: u32,
    /// Whether the plan routes the cells through its two trees
    /// (`Routing::Trees`), not straight to their servers.
    pub through_trees: bool,
    /// Whether the plan reduces the slots in groups (`Routing::Groups`);
    /// [`Traffic::shards_per_full_slice`] is then the largest group.
    pub in_groups: bool,
    /// Staging buffers per GPU, hence slices in flight.
    pub staging_buffers: u32,
    /// Messages rail 0 of the busiest machine sent between machines.
    pub messages_sent: u64,
    /// Bytes rail 0 of the busiest machine sent between machines.
    pub bytes_sent: u64,
    /// Bytes rail 0 of the busiest machine received from other machines.
    pub bytes_received: u64,
}

/// Where the time of fairring's busiest machine went: seconds each of its
/// resources (rail 0 standing for every rail) was busy, over the whole
/// prediction. Set against [`Prediction::seconds`] they say which resource
/// bounds the schedule and how much of the time the others idle.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Busy {
    /// The rail's send side, posts included.
    pub send: f64,
    /// The part of `send` beyond its bytes' time on the wire: posts that no
    /// earlier message's bytes hid.
    pub send_alpha: f64,
    /// The rail's receive side.
    pub receive: f64,
    /// The GPU reducing (0 where servers reduce).
    pub gpu: f64,
    /// NVLink (or the copies to and from staging where `D = 1`).
    pub nvlink: f64,
}

/// One prediction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// The algorithm.
    pub algo: Algo,
    /// Seconds from submitting the first tensor to the last result.
    pub seconds: f64,
    /// Bytes of all tensors over the time, GB/s.
    pub algbw_gbps: f64,
    /// `algbw * 2(N-1)/N`, as nccl-tests reports it.
    pub busbw_gbps: f64,
    /// fairring's plan at work (fairring's algorithms only).
    pub traffic: Option<Traffic>,
    /// Where the busiest machine's time went (fairring's algorithms only).
    pub busy: Option<Busy>,
    /// The algorithm, protocol and terms NCCL's tuner chose (NCCL's rows only).
    pub nccl: Option<nccl::Estimate>,
}

impl Prediction {
    fn new(algo: Algo, job: &Job, seconds: f64, traffic: Option<Traffic>) -> Prediction {
        Prediction::with_busy(algo, job, seconds, traffic, None)
    }

    fn with_busy(
        algo: Algo,
        job: &Job,
        seconds: f64,
        traffic: Option<Traffic>,
        busy: Option<Busy>,
    ) -> Prediction {
        #[expect(clippy::cast_precision_loss, reason = "byte counts far below 2^52")]
        let algbw = job.total_bytes() as f64 / seconds / 1e9;
        #[expect(clippy::cast_precision_loss, reason = "GPU counts far below 2^52")]
        let n = job.gpus() as f64;
        let busbw = if n > 1.0 {
            algbw * 2.0 * (n - 1.0) / n
        } else {
            algbw
        };
        Prediction {
            algo,
            seconds,
            algbw_gbps: algbw,
            busbw_gbps: busbw,
            traffic,
            busy,
            nccl: None,
        }
    }
}

/// Why a prediction or a presets file was refused.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelError {
    /// The job is not a valid topology.
    Topology(TopologyError),
    /// fairring-core refused the plan (slice size, budget, ...).
    Plan(PlanError),
    /// A presets file could not be read.
    Presets {
        /// Where the presets came from.
        source: String,
        /// What was wrong.
        detail: String,
    },
    /// No preset of that name.
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The names there are.
        known: Vec<String>,
    },
    /// The algorithm does not run on this job.
    NotApplicable {
        /// The algorithm.
        algo: Algo,
        /// Why not.
        reason: &'static str,
    },
    /// A job parameter is out of range.
    InvalidJob(String),
    /// The engine refuses the job's configuration as a communicator is made
    /// (`fairring::Config::staging`: a group size that splits nothing, a
    /// budget that holds no buffer, ...).
    Refused(String),
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Topology(e) => write!(f, "topology: {e}"),
            ModelError::Plan(e) => write!(f, "plan: {e}"),
            ModelError::Presets { source, detail } => write!(f, "presets in {source}: {detail}"),
            ModelError::UnknownPreset { name, known } => {
                write!(
                    f,
                    "no preset named {name:?}; there are: {}",
                    known.join(", ")
                )
            }
            ModelError::NotApplicable { algo, reason } => write!(f, "{algo}: {reason}"),
            ModelError::InvalidJob(what) => write!(f, "job: {what}"),
            ModelError::Refused(why) => write!(f, "fairring refuses: {why}"),
        }
    }
}

impl std::error::Error for ModelError {}

impl From<PlanError> for ModelError {
    fn from(e: PlanError) -> ModelError {
        ModelError::Plan(e)
    }
}

impl From<TopologyError> for ModelError {
    fn from(e: TopologyError) -> ModelError {
        ModelError::Topology(e)
    }
}

/// The predicted time of `algo` on `job`, on `hw`.
pub fn predict(hw: &Hardware, job: &Job, algo: Algo) -> Result<Prediction, ModelError> {
    if job.tensors == 0 {
        return Err(ModelError::InvalidJob("tensors must be at least 1".into()));
    }
    if !(1..=2).contains(&job.comms_per_direction) {
        return Err(ModelError::InvalidJob(format!(
            "comms_per_direction is {}: 1 (the engine's) or 2 (the study)",
            job.comms_per_direction
        )));
    }
    if job.elements() == 0 {
        return Err(ModelError::InvalidJob(format!(
            "{} bytes hold no {} element",
            job.bytes, job.dtype
        )));
    }
    match algo {
        Algo::Hierarchical => hierarchical::predict(hw, job),
        Algo::Servers => servers::predict(hw, job),
        Algo::Ring => ring::predict(hw, job),
        Algo::Groups => groups::predict(hw, job),
        Algo::ServerGroups => server_groups::predict(hw, job),
        Algo::NcclRing | Algo::NcclTree | Algo::NcclNvlsTree | Algo::NcclBest => {
            nccl::predict(&hw.nccl, job, algo)
        }
    }
}
