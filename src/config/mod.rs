//! What a communicator is built from: the job (ranks, rendezvous address) and the
//! knobs, from a builder or from the environment a launcher sets: torchrun's
//! (below), or OpenMPI's, PMI's (MPICH, Intel MPI) or Slurm's, read as torchrun's
//! (see `launchers`).
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `RANK`, `WORLD_SIZE` | this process's rank and the number of ranks (workers: dedicated servers are not counted) | required (`RANK` not read by a server) |
//! | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | rank on this machine and ranks per machine; checked against what the rendezvous finds | optional |
//! | `MASTER_ADDR`, `MASTER_PORT` | where rank 0 serves the rendezvous store | required |
//! | `TORCHELASTIC_USE_AGENT_STORE` | `True` under torchrun: its agent already serves PyTorch's TCPStore at `MASTER_ADDR:MASTER_PORT`, and every rank rendezvouses through it (keys under `TORCHELASTIC_RESTART_COUNT`'s attempt) | `False`: rank 0 serves fairring's store |
//! | `FAIRRING_TOTAL_MEMORY` | staging memory per rank, bytes (`K`/`M`/`G` suffixes) | where slices cross the network, as many buffers as the original's 50 MiB held, where more than 2 (at most 16); else 50 MiB ([`DEFAULT_TOTAL_MEMORY`]) |
//! | `FAIRRING_SLICE_SIZE` | largest slice, bytes; the same on every rank, as the budget and the minimum shard are (a rank that plans otherwise is refused) | 25 MiB; 32 MiB where that keeps the plan flat and in groups; 20 MiB through the trees; a tensor of fewer than four full slices in four, no smaller than 16 MiB (`Geometry::slice_bytes_for`); halved while the budget would hold fewer than 2 buffers (halved slices count as given) |
//! | `FAIRRING_MIN_SHARD_SIZE` | smallest shard, bytes; the same on every rank and server | 64 KiB; 16 KiB with dedicated servers (`PlanConfig::DEFAULT_SERVER_MIN_SHARD_BYTES`) |
//! | `FAIRRING_GROUP_SIZE` | how the machines are grouped for the hierarchical all-reduce (see [`Grouping`]): `auto`; `off` (one level: flat, or through the trees); or `N`, two levels, within groups of at most `N` machines and then across the groups (from 2 to half the machines, leaving no group of one); with dedicated servers, groups of at most `N` servers of each rail group, each serving as many groups of workers (the servers a multiple of the devices a machine has, at least as many machines as groups); the same on every rank | `auto`: where the default slices would otherwise widen to stay flat, equal groups where the machines make some (`PlanConfig::equal_group_size`); where they would otherwise go through the trees, groups (of `PlanConfig::default_group_size`: equal ones of at most 32 to 64 machines where they can be, else equal ones of the largest size from 20 to 48 that divides the machines, else of at most 48); with dedicated servers, where a full slot cannot give each server of a rail group a cell of the minimum shard, groups of at most `PlanConfig::DEFAULT_SERVER_GROUP_SIZE` (64) servers, or half of them |
//! | `FAIRRING_DIRECT_FROM` | size from which an all-reduce of a host tensor sends from the tensor instead of staging it, where the fabric registers memory to send from (tcp), by hierarchical between machines of one rank each or by the ring, and so does a broadcast's root (a message's sender) relaying over machines of one rank each; between two such machines the broadcast's chunks and the all-reduce's results land in the receivers' tensors too; bytes, or `never` | 256 KiB |
//! | `FAIRRING_SOCKET_IFNAME` | interface the fabric listens on | the one that reaches `MASTER_ADDR` |
//! | `FAIRRING_TIMEOUT` | rendezvous and peer-silence bound (`30`, `2.5s`, `500ms`, `5min`); fairring's own store is waited for, and connected to again where it closes or leaves unanswered a connection before admitting it, until then | 300 s |
//! | `FAIRRING_JOB_SECRET` | 64 hex digits shared by every rank; admits peers | derived from the job (see below) |
//! | `FAIRRING_ALGO` | `auto`, `hierarchical`, `ring` or `doubling` | `auto` |
//! | `FAIRRING_WIRE` | how `f32` reductions travel between machines: `exact`, `bf16` or `f16` (see below) | `exact` |
//! | `FAIRRING_HOST_ID` | overrides the machine identity (simulates machines on one host) | boot id and host name |
//! | `FAIRRING_FABRIC` | `tcp`, `verbs` or `auto` (see [`FabricChoice`]) | `auto` |
//! | `FAIRRING_DEVICE_LOCAL` | how a machine's ranks reduce device tensors among themselves: `nccl`, `host` or `auto` (see [`DeviceLocal`]) | `auto` |
//! | `FAIRRING_NCCL_ACROSS_MACHINES` | whether a device all-reduce on two to seven machines may run as one NCCL all-reduce over the whole job where NCCL's NVLSTree is ahead of the plan: `auto` (GPUs that reduce in their NVSwitch), `on` or `off` (see [`NcclAcrossMachines`]) | `auto` |
//! | `FAIRRING_MACHINES_SERVE` | with dedicated servers, whether an all-reduce `auto` would give the servers runs as the same job without servers would, the machines serving their own shards and the servers none: `auto` (device tensors, where every GPU reduces in its NVSwitch), `on` (every such all-reduce, host tensors too) or `off` (see [`MachinesServe`]); alike on every worker | `auto` |
//! | `FAIRRING_DEVICE` | the GPU a communicator's device tensors live on, readied when it is made (its staging page-locked, the machine's NCCL communicators made and warmed up): an ordinal, or `local` (the one `LOCAL_RANK` names); see [`ConfigBuilder::device`] | unset: readied at the first device operation |
//! | `FAIRRING_VERBS_DEVICE`, `_PORT`, `_GID_INDEX` | the RDMA device, its port and GID index | first device, 1, 0 |
//! | `FAIRRING_SERVERS` | dedicated reduction servers in the job, set alike on every process (see below) | 0: the machines serve |
//! | `FAIRRING_ROLE` | `worker` or `server` | `worker` |
//! | `FAIRRING_SERVER_RANK` | a server's index, `0..FAIRRING_SERVERS` | required for a server |
//!
//! **Dedicated servers** (Herring's design). With `FAIRRING_SERVERS=K`, the job has
//! `WORLD_SIZE` workers (ranks `0..WORLD_SIZE`, as torchrun numbers them) and `K`
//! CPU-only reduction servers, processes started with `FAIRRING_ROLE=server` and
//! `FAIRRING_SERVER_RANK=i` (the `fairring-server` binary, or
//! [`Server`](crate::Server)). They meet at the same `MASTER_ADDR:MASTER_PORT`; on
//! the fabric, server `i` is process `WORLD_SIZE + i`. The servers take the
//! inter-machine step of every hierarchical all-reduce: each worker sends its slot
//! to the servers and gets the sums back.
//!
//! **Compressed wire** (the Herring and Horovod seeds' option). With
//! `FAIRRING_WIRE=bf16` or `f16`, the `f32` all-reduces and reduce-scatters that
//! run hierarchically carry half the bytes between machines: each machine's
//! partial sum is rounded to the 16-bit format before it leaves, the serving
//! machine (or dedicated server) widens and reduces in `f32`, and rounds the
//! result once more before sending it back (a serving machine keeps the rounded
//! value too, so every rank ends with the same bits). The error is bounded by two roundings: at most `2^-8` (bf16) or
//! `2^-11` (f16) of the sum of the machines' partial sums' magnitudes, plus as
//! much of the result's. f16 overflows to infinity past 65504 and loses
//! precision below 2^-14; bf16 has `f32`'s range. Other types, the ring,
//! single-machine jobs without servers, and jobs whose all-reduces go through
//! the trees or whose machines form groups run exact. Set it alike on every rank:
//! the descriptor check compares it.
//!
//! Every value is validated when the communicator is built; a bad one fails with
//! [`Error::Config`] naming the variable and the value.
//!
//! **Job secret.** Peers and store clients are admitted only if they prove they know
//! the job secret. When `FAIRRING_JOB_SECRET` is unset the secret is derived from the
//! rendezvous address and `TORCHELASTIC_RUN_ID`: that keeps two jobs from mixing by
//! accident, but anyone who can read the job's environment can join it. Set the
//! variable on shared networks.

mod device_local;
mod env;
mod fabric_choice;
mod grouping;
mod launchers;
mod machines_serve;
mod nccl_across_machines;
mod parse;

use std::time::Duration;

use fairring_core::WireFormat;
use fairring_rdma::JobSecret;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
pub use device_local::DeviceLocal;
pub use fabric_choice::FabricChoice;
pub(crate) use fabric_choice::{VerbsKnobs, verbs_not_built};
pub use grouping::Grouping;
pub use launchers::Launcher;
pub use machines_serve::MachinesServe;
pub use nccl_across_machines::NcclAcrossMachines;

fairring_core::named_enum! {
    /// How an all-reduce moves its data. The values are those of the C ABI's
    /// `FR_ALGO_*` (0 there: the communicator's).
    pub enum Algorithm {
        /// Per operation, whichever of the others was measured faster for its
        /// collective and size on the job's layout (the `FAIRRING_ALGO` row of
        /// docs/manual.md says which; `src/engine/choice.rs` holds the rules and the
        /// measurements). The default.
        Auto = 1 => "auto",
        /// Reduction-server all-reduce: intra-machine reduce-scatter, sharded
        /// exchange along rails, intra-machine all-gather (docs/DESIGN.md
        /// section 1).
        Hierarchical = 2 => "hierarchical",
        /// Ring reduce-scatter and all-gather over every rank through the
        /// fabric, the baseline of Horovod, Gloo and NCCL.
        Ring = 3 => "ring",
        /// Recursive doubling over every rank through the fabric: `log2 N`
        /// exchanges of the whole slice, for small operations (what MPI
        /// libraries use there).
        Doubling = 4 => "doubling",
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Algorithm, String> {
        Algorithm::from_name(&s.trim().to_ascii_lowercase())
            .ok_or_else(|| "expected auto, hierarchical, ring or doubling".into())
    }
}

/// The staging memory the original Fairring took per GPU by default: 50 MiB.
///
/// Where no budget is given (`FAIRRING_TOTAL_MEMORY` unset), a rank stages in
/// this much, the default slices halved until two buffers fit, unless the job
/// spans machines or has dedicated servers and this much of the original's
/// staging (slot-sized
/// buffers, the core's [`StagingLayout`](fairring_core::plan::StagingLayout)
/// of a slot) held more than two slices in flight: then a rank takes as many
/// of its own buffers, each of which holds a whole slice, no fewer than five
/// and no more than sixteen ([`Config::staging`]).
pub const DEFAULT_TOTAL_MEMORY: u64 = 50 << 20;
/// Default size from which an all-reduce, or a broadcast's root, sends from
/// its tensor where it may (`FAIRRING_DIRECT_FROM`).
pub const DEFAULT_DIRECT_FROM: u64 = 256 << 10;

/// The kernel receive buffer asked for each tcp connection by default
/// (`FAIRRING_TCP_RECEIVE_BUFFER`; see `fairring_rdma::tcp::TcpConfig`'s
/// `receive_buffer`).
pub const DEFAULT_TCP_RECEIVE_BUFFER: u64 = 4 << 20;

/// The largest receive buffer that may be asked for: `SO_RCVBUF` takes an
/// `int`.
const MAX_TCP_RECEIVE_BUFFER: u64 = i32::MAX as u64;

/// Default bound on rendezvous and on a silent peer.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// What a communicator stages with ([`Config::staging`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staging {
    /// The slices and shards every tensor is planned with.
    pub geometry: fairring_core::plan::Geometry,
    /// Bytes of one staging buffer of a rank.
    pub buffer_bytes: u64,
    /// Bytes of one staging buffer of a dedicated server (0 without servers).
    pub server_buffer_bytes: u64,
    /// Staging buffers of each rank (and server): slices in flight at most.
    pub buffers: u32,
    /// Beside dedicated servers, what the machines' own plan
    /// (`FAIRRING_MACHINES_SERVE`) plans with, in the same buffers: the
    /// geometry of the same job without servers, from the same slices, of
    /// the minimum shard given or else a job without servers' default.
    /// `None` without servers.
    pub colocated: Option<fairring_core::plan::Geometry>,
    /// On the flat plan in the default slices, exact, from
    /// [`GROUPED_FROM_MACHINES`](crate::GROUPED_FROM_MACHINES) machines: the
    /// geometry its small tensors plan with in the same buffers, the same
    /// machines in groups ([`grouped_geometry`](crate::grouped_geometry),
    /// [`takes_groups`](crate::takes_groups)). `None` elsewhere.
    pub grouped: Option<fairring_core::plan::Geometry>,
}

/// A validated configuration. Build one with [`Config::builder`] or
/// [`Config::from_env`].
#[derive(Clone, Debug)]
pub struct Config {
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) local_rank: Option<u32>,
    pub(crate) local_world_size: Option<u32>,
    pub(crate) master_addr: String,
    pub(crate) master_port: u16,
    /// `None`: the default ([`DEFAULT_TOTAL_MEMORY`]).
    pub(crate) total_memory: Option<u64>,
    pub(crate) slice_bytes: Option<u64>,
    /// `None`: the default ([`Config::min_shard_bytes`]).
    pub(crate) min_shard_bytes: Option<u64>,
    /// How the machines are grouped for the hierarchical all-reduce.
    pub(crate) grouping: Grouping,
    /// The size from which an all-reduce may send from its tensor (`None`:
    /// never).
    pub(crate) direct_from: Option<u64>,
    /// Bytes of kernel receive buffer asked for each tcp connection (0: the
    /// kernel's autotuning).
    pub(crate) tcp_receive_buffer: u64,
    pub(crate) socket_ifname: Option<String>,
    pub(crate) timeout: Duration,
    pub(crate) secret: JobSecret,
    pub(crate) job_tag: u64,
    pub(crate) algorithm: Algorithm,
    /// How `f32` reductions travel between machines.
    pub(crate) wire: WireFormat,
    pub(crate) host_id: Option<String>,
    pub(crate) fabric: FabricChoice,
    /// The intra-machine step of device tensors.
    pub(crate) device_local: DeviceLocal,
    /// Whether a device all-reduce on few machines may run as one NCCL
    /// all-reduce across the job.
    pub(crate) nccl_across_machines: NcclAcrossMachines,
    /// Whether the machines serve an all-reduce's shards themselves beside
    /// dedicated servers.
    pub(crate) machines_serve: MachinesServe,
    /// The GPU readied when the communicator is made, if any.
    pub(crate) device: Option<u32>,
    #[cfg_attr(
        not(feature = "verbs"),
        allow(dead_code, reason = "read by the verbs provider")
    )]
    pub(crate) verbs: VerbsKnobs,
    /// Dedicated reduction servers (0: none).
    pub(crate) servers: u32,
    /// This process's part: a worker, or server `i`.
    pub(crate) role: Role,
    /// `Some(attempt)` when torchrun's agent serves the store (see the module docs).
    pub(crate) agent_store: Option<u32>,
}

/// What a process is in its job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A worker: a rank that issues collectives (the default).
    Worker,
    /// Dedicated reduction server `i` (`FAIRRING_SERVER_RANK`).
    Server(u32),
}

/// Builds a [`Config`] field by field; [`ConfigBuilder::build`] validates.
#[derive(Clone, Debug)]
pub struct ConfigBuilder {
    /// The settings as set so far: the job secret and tag are made by `build`.
    config: Config,
    secret: Option<JobSecret>,
    run_id: String,
}

impl Config {
    /// The smallest shard: as given, else
    /// [`PlanConfig::DEFAULT_MIN_SHARD_BYTES`](fairring_core::plan::PlanConfig::DEFAULT_MIN_SHARD_BYTES),
    /// or with dedicated servers
    /// [`PlanConfig::DEFAULT_SERVER_MIN_SHARD_BYTES`](fairring_core::plan::PlanConfig::DEFAULT_SERVER_MIN_SHARD_BYTES).
    pub(crate) fn min_shard_bytes(&self) -> u64 {
        use fairring_core::plan::PlanConfig;
        self.min_shard_bytes.unwrap_or(if self.servers > 0 {
            PlanConfig::DEFAULT_SERVER_MIN_SHARD_BYTES
        } else {
            PlanConfig::DEFAULT_MIN_SHARD_BYTES
        })
    }

    /// The smallest shard of the machines' own plan beside dedicated
    /// servers (`FAIRRING_MACHINES_SERVE`): as given, or the default of a
    /// job without servers.
    pub(crate) fn colocated_min_shard_bytes(&self) -> u64 {
        self.min_shard_bytes
            .unwrap_or(fairring_core::plan::PlanConfig::DEFAULT_MIN_SHARD_BYTES)
    }

    /// A builder for rank `rank` of `world_size`, meeting at `master_addr:master_port`.
    pub fn builder(
        rank: u32,
        world_size: u32,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> ConfigBuilder {
        ConfigBuilder {
            config: Config {
                rank,
                world_size,
                local_rank: None,
                local_world_size: None,
                master_addr: master_addr.into(),
                master_port,
                total_memory: None,
                slice_bytes: None,
                min_shard_bytes: None,
                grouping: Grouping::Auto,
                direct_from: Some(DEFAULT_DIRECT_FROM),
                tcp_receive_buffer: DEFAULT_TCP_RECEIVE_BUFFER,
                socket_ifname: None,
                timeout: DEFAULT_TIMEOUT,
                algorithm: Algorithm::Auto,
                wire: WireFormat::Exact,
                host_id: None,
                fabric: FabricChoice::Auto,
                device_local: DeviceLocal::Auto,
                nccl_across_machines: NcclAcrossMachines::Auto,
                machines_serve: MachinesServe::Auto,
                device: None,
                verbs: VerbsKnobs::default(),
                servers: 0,
                role: Role::Worker,
                agent_store: None,
                // Made by `build`.
                secret: JobSecret::from_bytes([0; 32]),
                job_tag: 0,
            },
            secret: None,
            run_id: String::new(),
        }
    }

    /// A builder for dedicated reduction server `index` of a job of `workers`
    /// workers, meeting at `master_addr:master_port`; set the job's server count
    /// with [`ConfigBuilder::servers`].
    pub fn server_builder(
        index: u32,
        workers: u32,
        master_addr: impl Into<String>,
        master_port: u16,
    ) -> ConfigBuilder {
        let mut b = Config::builder(0, workers, master_addr, master_port);
        b.config.role = Role::Server(index);
        b
    }

    /// This process's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the job (workers; dedicated servers are not counted).
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// Dedicated reduction servers in the job (0: the machines serve).
    pub fn servers(&self) -> u32 {
        self.servers
    }

    /// This process's part in the job.
    pub fn role(&self) -> Role {
        self.role
    }

    /// This process's rank on the fabric: its rank for a worker, `WORLD_SIZE + i`
    /// for server `i`.
    pub(crate) fn process(&self) -> u32 {
        self.rank
    }

    /// Processes on the fabric: workers and servers.
    pub(crate) fn processes(&self) -> u32 {
        self.world_size + self.servers
    }

    /// The default algorithm of all-reduces.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// How `f32` reductions travel between machines.
    pub fn wire(&self) -> WireFormat {
        self.wire
    }

    /// The bound on rendezvous and on a silent peer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The fabric asked for.
    pub fn fabric(&self) -> FabricChoice {
        self.fabric
    }

    /// The staging a communicator of this configuration makes on `topology`:
    /// its geometry (the slices and shards it plans with), the bytes of one
    /// staging buffer and how many fit the budget (`FAIRRING_TOTAL_MEMORY`).
    /// Without a slice size given, the default slices are halved until the
    /// budget holds two buffers; without a budget given, see
    /// [`DEFAULT_TOTAL_MEMORY`].
    ///
    /// A buffer holds a whole slice (the machine's ranks stage their slices
    /// in each other's sight), the areas where other machines' contributions
    /// land, and what the ring and the reduce-scatter stage, so it is about
    /// twice a slice.
    pub fn staging(&self, topology: fairring_core::topology::Topology) -> Result<Staging> {
        let (geometry, layout, buffers) = crate::bootstrap::size_staging(self, topology)?;
        Ok(Staging {
            geometry,
            buffer_bytes: layout.buffer_bytes() as u64,
            server_buffer_bytes: layout.server_buffer_bytes() as u64,
            buffers,
            colocated: layout
                .second_geometry()
                .filter(|_| geometry.servers().is_some()),
            grouped: layout
                .second_geometry()
                .filter(|_| geometry.servers().is_none()),
        })
    }

    /// How several ranks of a machine reduce device tensors among themselves.
    pub fn device_local(&self) -> DeviceLocal {
        self.device_local
    }

    /// Whether a device all-reduce on few machines may run as one NCCL
    /// all-reduce across the job.
    pub fn nccl_across_machines(&self) -> NcclAcrossMachines {
        self.nccl_across_machines
    }

    /// Whether the machines serve an all-reduce's shards themselves beside
    /// dedicated servers.
    pub fn machines_serve(&self) -> MachinesServe {
        self.machines_serve
    }

    /// The GPU the communicator readies when it is made (see
    /// [`ConfigBuilder::device`]).
    pub fn device(&self) -> Option<u32> {
        self.device
    }
}

impl ConfigBuilder {
    /// Dedicated reduction servers in the job (the same on every process).
    pub fn servers(mut self, servers: u32) -> Self {
        self.config.servers = servers;
        self
    }

    /// Rank on this machine and ranks per machine, checked against the rendezvous.
    pub fn local(mut self, local_rank: u32, local_world_size: u32) -> Self {
        self.config.local_rank = Some(local_rank);
        self.config.local_world_size = Some(local_world_size);
        self
    }

    /// Staging memory per rank, in bytes (default: see [`DEFAULT_TOTAL_MEMORY`]).
    pub fn total_memory(mut self, bytes: u64) -> Self {
        self.config.total_memory = Some(bytes);
        self
    }

    /// Largest slice, in bytes.
    pub fn slice_bytes(mut self, bytes: u64) -> Self {
        self.config.slice_bytes = Some(bytes);
        self
    }

    /// Smallest shard, in bytes.
    pub fn min_shard_bytes(mut self, bytes: u64) -> Self {
        self.config.min_shard_bytes = Some(bytes);
        self
    }

    /// How the machines are grouped for the hierarchical all-reduce
    /// (`FAIRRING_GROUP_SIZE`; see [`Grouping`]). A size that does not make
    /// two levels of the job's machines, or groups with dedicated servers,
    /// fails naming the variable.
    pub fn grouping(mut self, grouping: Grouping) -> Self {
        self.config.grouping = grouping;
        self
    }

    /// The size from which an all-reduce of a host tensor sends from the
    /// tensor instead of staging it, where the fabric registers memory to send
    /// from (tcp), by hierarchical between machines of one rank each or by the
    /// ring, and so does a broadcast's root relaying over machines of one rank
    /// each (a message's sender); `None`: always stage.
    pub fn direct_from(mut self, bytes: Option<u64>) -> Self {
        self.config.direct_from = bytes;
        self
    }

    /// Bytes of kernel receive buffer the tcp fabric asks for each connection
    /// (`SO_RCVBUF`), where the kernel allows that much (`net.core.rmem_max`;
    /// elsewhere, and for 0, the kernel's autotuning stays). A fixed buffer
    /// replaces autotuning, whose ceiling (`net.ipv4.tcp_rmem`'s third field)
    /// may be higher: give 0 for links whose bandwidth-delay product exceeds
    /// the buffer.
    pub fn tcp_receive_buffer(mut self, bytes: u64) -> Self {
        self.config.tcp_receive_buffer = bytes;
        self
    }

    /// The interface the fabric listens on.
    pub fn socket_ifname(mut self, name: impl Into<String>) -> Self {
        self.config.socket_ifname = Some(name.into());
        self
    }

    /// Rendezvous and peer-silence bound.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout = timeout;
        self
    }

    /// The job secret (the same on every rank).
    pub fn secret(mut self, secret: JobSecret) -> Self {
        self.secret = Some(secret);
        self
    }

    /// A name of this run, mixed into the job's tag and derived secret.
    pub fn run_id(mut self, run_id: impl Into<String>) -> Self {
        self.run_id = run_id.into();
        self
    }

    /// The default algorithm.
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.config.algorithm = algorithm;
        self
    }

    /// How `f32` reductions travel between machines (see the module docs).
    pub fn wire(mut self, wire: WireFormat) -> Self {
        self.config.wire = wire;
        self
    }

    /// This machine's identity: ranks with the same identity share memory.
    pub fn host_id(mut self, id: impl Into<String>) -> Self {
        self.config.host_id = Some(id.into());
        self
    }

    /// The fabric.
    pub fn fabric(mut self, fabric: FabricChoice) -> Self {
        self.config.fabric = fabric;
        self
    }

    /// How several ranks of a machine reduce device tensors among themselves.
    pub fn device_local(mut self, choice: DeviceLocal) -> Self {
        self.config.device_local = choice;
        self
    }

    /// Whether a device all-reduce on few machines may run as one NCCL
    /// all-reduce across the job.
    pub fn nccl_across_machines(mut self, choice: NcclAcrossMachines) -> Self {
        self.config.nccl_across_machines = choice;
        self
    }

    /// Whether the machines serve an all-reduce's shards themselves beside
    /// dedicated servers.
    pub fn machines_serve(mut self, choice: MachinesServe) -> Self {
        self.config.machines_serve = choice;
        self
    }

    /// The GPU `ordinal` this rank's device tensors live on, readied when the
    /// communicator is made: its staging page-locked, its device programs'
    /// words and streams made, and, with several ranks per machine, the
    /// machine's NCCL communicators made and run once for every collective
    /// and size class the engine issues. Without it, the first device
    /// operation does this (on the caller's thread, before it returns).
    /// Collective: every rank of a machine names its GPU, or none does.
    pub fn device(mut self, ordinal: u32) -> Self {
        self.config.device = Some(ordinal);
        self
    }

    /// The RDMA device the verbs provider opens (the first one by default).
    pub fn verbs_device(mut self, name: impl Into<String>) -> Self {
        self.config.verbs.device = Some(name.into());
        self
    }

    /// The verbs device's port (1 by default) and GID index (0 by default).
    pub fn verbs_port(mut self, port: u8, gid_index: u8) -> Self {
        self.config.verbs.port = port;
        self.config.verbs.gid_index = gid_index;
        self
    }

    /// Rendezvous through the PyTorch TCPStore torchrun's agent serves at the
    /// master address, under restart `attempt`, instead of serving one on rank 0.
    pub fn agent_store(mut self, attempt: u32) -> Self {
        self.config.agent_store = Some(attempt);
        self
    }

    /// Validates every field.
    pub fn build(self) -> Result<Config> {
        if self.config.world_size == 0 {
            return Err(Error::config("WORLD_SIZE", 0, "must be at least 1"));
        }
        if self.config.servers > fairring_core::topology::MAX_MACHINES {
            return Err(Error::config(
                "FAIRRING_SERVERS",
                self.config.servers,
                format!("must be at most {}", fairring_core::topology::MAX_MACHINES),
            ));
        }
        let rank = match self.config.role {
            Role::Worker => self.config.rank,
            Role::Server(i) if i < self.config.servers => self.config.world_size + i,
            Role::Server(i) => {
                return Err(Error::config(
                    "FAIRRING_SERVER_RANK",
                    i,
                    format!("must be below FAIRRING_SERVERS={}", self.config.servers),
                ));
            }
        };
        if self.config.role == Role::Worker && self.config.rank >= self.config.world_size {
            return Err(Error::config(
                "RANK",
                self.config.rank,
                format!("must be below WORLD_SIZE={}", self.config.world_size),
            ));
        }
        if let Some(n) = self.config.local_world_size {
            if n == 0 || !self.config.world_size.is_multiple_of(n) {
                return Err(Error::config(
                    "LOCAL_WORLD_SIZE",
                    n,
                    format!("must divide WORLD_SIZE={}", self.config.world_size),
                ));
            }
            if let Some(r) = self.config.local_rank
                && r >= n
            {
                return Err(Error::config(
                    "LOCAL_RANK",
                    r,
                    format!("must be below LOCAL_WORLD_SIZE={n}"),
                ));
            }
        }
        if self.config.master_addr.trim().is_empty() {
            return Err(Error::config(
                "MASTER_ADDR",
                &self.config.master_addr,
                "empty",
            ));
        }
        if self.config.master_port == 0 {
            return Err(Error::config(
                "MASTER_PORT",
                0,
                "expected a port in 1..=65535",
            ));
        }
        let max_slice = fairring_core::plan::PlanConfig::MAX_SLICE_BYTES;
        if let Some(s) = self.config.slice_bytes
            && !(64 << 10..=max_slice).contains(&s)
        {
            return Err(Error::config(
                "FAIRRING_SLICE_SIZE",
                s,
                format!("must be between 64 KiB and {max_slice} bytes"),
            ));
        }
        let floor = fairring_core::plan::PlanConfig::MIN_SHARD_FLOOR;
        if let Some(bytes) = self.config.min_shard_bytes
            && !(floor..=max_slice).contains(&bytes)
        {
            return Err(Error::config(
                "FAIRRING_MIN_SHARD_SIZE",
                bytes,
                format!("must be between {floor} and {max_slice} bytes"),
            ));
        }
        if let Grouping::AtMost(size) = self.config.grouping
            && size < 2
        {
            return Err(Error::config(
                "FAIRRING_GROUP_SIZE",
                size,
                "groups need at least 2 members (machines, or servers of a rail)",
            ));
        }
        if self.config.tcp_receive_buffer > MAX_TCP_RECEIVE_BUFFER {
            return Err(Error::config(
                "FAIRRING_TCP_RECEIVE_BUFFER",
                self.config.tcp_receive_buffer,
                format!("must be at most {MAX_TCP_RECEIVE_BUFFER} bytes (a socket option's int)"),
            ));
        }
        if let Some(total) = self.config.total_memory
            && total < 1 << 20
        {
            return Err(Error::config(
                "FAIRRING_TOTAL_MEMORY",
                total,
                "must be at least 1 MiB",
            ));
        }
        if self.config.timeout.is_zero() {
            return Err(Error::config("FAIRRING_TIMEOUT", "0", "must be positive"));
        }
        if self.config.fabric == FabricChoice::Verbs && !cfg!(feature = "verbs") {
            return Err(verbs_not_built());
        }
        if self.config.verbs.port == 0 {
            return Err(Error::config("FAIRRING_VERBS_PORT", 0, "expected 1 to 255"));
        }
        let secret = match self.secret {
            Some(s) => s,
            None => derived_secret(
                &self.config.master_addr,
                self.config.master_port,
                &self.run_id,
            ),
        };
        let job_tag = job_tag(&secret, &self.run_id);
        Ok(Config {
            rank,
            secret,
            job_tag,
            ..self.config
        })
    }
}

/// A boolean variable as torchrun writes them (`True`/`False`, also `1`/`0`);
/// unset is false.
fn parse_flag(name: &'static str, value: Option<&str>) -> Result<bool> {
    match value.map(str::trim) {
        None | Some("") => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("true") || v == "1" => Ok(true),
        Some(v) if v.eq_ignore_ascii_case("false") || v == "0" => Ok(false),
        Some(v) => Err(Error::config(name, v, "expected True or False")),
    }
}

fn derived_secret(addr: &str, port: u16, run_id: &str) -> JobSecret {
    let mut h = Sha256::new();
    h.update(b"fairring derived job secret v1\0");
    h.update(addr.as_bytes());
    h.update(port.to_le_bytes());
    h.update(run_id.as_bytes());
    JobSecret::from_bytes(h.finalize().into())
}

/// The tag of the job of `secret` and `run_id`: its store's keys and its
/// peers' admission name it.
pub(crate) fn job_tag(secret: &JobSecret, run_id: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(b"fairring job tag v1\0");
    h.update(secret.as_bytes());
    h.update(run_id.as_bytes());
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().unwrap_or([0; 8]))
}

#[cfg(test)]
mod tests;
