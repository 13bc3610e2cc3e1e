//! Building a communicator: rendezvous, topology, shared memory, fabric.

use std::sync::Arc;

use fairring_core::WireFormat;
use fairring_core::plan::{Geometry, PlanConfig, PlanError, Routing};
use fairring_core::topology::{Location, Topology};
use fairring_rdma::any::AnyFabric;
use fairring_rdma::fabric::{Endpoint, Fabric, LocalRegion, RemoteRegion};

pub(crate) mod job_id;
mod late_links;
mod open_fabric;
mod progress;

pub(crate) use late_links::start_linker;
pub(crate) use open_fabric::choice_of;
pub(crate) use progress::{start_progress, stop_progress};

use crate::config::{Config, DEFAULT_TOTAL_MEMORY, Grouping};
use crate::engine::Wiring;
use crate::engine::layout::{BufferLayout, colocated_geometry, grouped_geometry};
use crate::engine::tags::MAX_BUFFERS;
use crate::engine::{Engine, EngineParts};
use crate::error::{Error, Result};
use crate::local::{LocalStep, Machine, PlacedStep, ShmStep, Solo};
use crate::memory::{Host, MemorySpace, Placed};
use crate::shm::Segment;
use crate::store::{C10dStore, PrefixStore, Store, TcpStore, TcpStoreServer, gather};

/// This machine's identity: the kernel's boot id and the host name, unless
/// overridden (`FAIRRING_HOST_ID`, to simulate machines on one host).
/// The store a job meets through, and the server this process runs for it (if
/// any): under torchrun's agent store, PyTorch's TCPStore torchrun serves (keys
/// under the restart attempt); otherwise fairring's own, served by rank 0.
pub(crate) fn job_store(config: &Config) -> Result<(Arc<dyn Store>, Option<TcpStoreServer>)> {
    if let Some(attempt) = config.agent_store {
        let store = C10dStore::connect(&config.master_addr, config.master_port, config.timeout)?;
        // The attempt keeps a restarted job's keys apart from the last one's.
        let scoped = PrefixStore::new(format!("/fairring/attempt_{attempt}"), store);
        return Ok((Arc::new(scoped), None));
    }
    let server = if config.rank == 0 {
        let addr = crate::store::tcp::resolve_master(&config.master_addr, config.master_port)?;
        let cap = 2 * config.processes() as usize + 16;
        Some(TcpStoreServer::bind(
            addr,
            config.secret.clone(),
            config.job_tag,
            cap,
        )?)
    } else {
        None
    };
    Ok((Arc::new(connect_store(config)?), server))
}

/// A client of the job's own store, at `config`'s meeting point, admitted by
/// its secret and tag within its timeout.
pub(crate) fn connect_store(config: &Config) -> Result<TcpStore> {
    TcpStore::connect(
        &config.master_addr,
        config.master_port,
        &config.secret,
        config.job_tag,
        config.timeout,
    )
}

/// `store` as this job sees it: its keys under the job's tag.
pub(crate) fn scoped(config: &Config, store: &Arc<dyn Store>) -> PrefixStore<Arc<dyn Store>> {
    PrefixStore::new(
        format!("fairring/{:016x}", config.job_tag),
        Arc::clone(store),
    )
}

fn host_identity(config: &Config) -> String {
    if let Some(id) = &config.host_id {
        return id.clone();
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", boot.trim(), host.trim())
}

/// Finds which ranks share a machine and checks the deployment is regular.
pub(crate) fn detect_topology(config: &Config, store: &dyn Store) -> Result<(Topology, Location)> {
    let me = host_identity(config);
    store.set(&format!("host/{}", config.rank), me.as_bytes())?;
    let topology = job_topology(config, store)?;
    locate(config, topology)
}

/// The workers' machines, once every worker has published its host.
fn job_topology(config: &Config, store: &dyn Store) -> Result<Topology> {
    let keys: Vec<String> = (0..config.world_size)
        .map(|r| format!("host/{r}"))
        .collect();
    await_ranks(store, &keys, config)?;
    let hosts = gather(store, &keys, config.timeout)?;
    let mut names: Vec<&[u8]> = Vec::new();
    let mut machine_of_rank = Vec::with_capacity(hosts.len());
    for h in &hosts {
        let m = names
            .iter()
            .position(|n| *n == h.as_slice())
            .unwrap_or_else(|| {
                names.push(h);
                names.len() - 1
            });
        machine_of_rank.push(u32::try_from(m).unwrap_or(u32::MAX));
    }
    Topology::detect(&machine_of_rank).map_err(|e| Error::Topology {
        reason: format!(
            "{e}; ranks per machine: {}",
            per_machine_counts(&machine_of_rank, names.len())
        ),
    })
}

/// This worker's place in `topology`, checked against torchrun's local ranks.
fn locate(config: &Config, topology: Topology) -> Result<(Topology, Location)> {
    let location = topology.locate(config.rank).map_err(|e| Error::Topology {
        reason: e.to_string(),
    })?;
    if let Some(n) = config.local_world_size
        && n != topology.devices_per_machine()
    {
        return Err(Error::config(
            "LOCAL_WORLD_SIZE",
            n,
            format!(
                "the rendezvous found {} ranks on this machine",
                topology.devices_per_machine()
            ),
        ));
    }
    if let Some(r) = config.local_rank
        && r != location.device
    {
        return Err(Error::config(
            "LOCAL_RANK",
            r,
            format!(
                "rank {} is local rank {} in the {:?} layout the rendezvous found",
                config.rank,
                location.device,
                topology.layout()
            ),
        ));
    }
    Ok((topology, location))
}

/// Waits until every rank has published its key `keys[rank]`; on timeout the
/// error lists the ranks still missing at the last look (made while the store was
/// still up: rank 0, which serves it, gives up at the same time).
fn await_ranks(store: &dyn Store, keys: &[String], config: &Config) -> Result<()> {
    let deadline = std::time::Instant::now() + config.timeout;
    let mut missing: Vec<usize> = (0..keys.len()).collect();
    // Whether one look at every missing key completed.
    let mut looked = false;
    let give_up = |missing: &[usize], why: String| {
        let list: Vec<String> = missing.iter().map(usize::to_string).collect();
        Error::timeout(
            format!(
                "rank(s) {} of {} to join the rendezvous{why}",
                list.join(", "),
                config.world_size
            ),
            config.timeout,
        )
    };
    loop {
        let mut still = Vec::with_capacity(missing.len());
        for &r in &missing {
            match store.check(&[keys[r].as_str()]) {
                Ok(true) => {}
                Ok(false) => still.push(r),
                // A store that watches its communicator reports that it
                // failed or was aborted: that is the error.
                Err(e @ (Error::Aborted | Error::Failed { .. } | Error::Peer { .. })) => {
                    return Err(e);
                }
                // The store's server (rank 0) gave up first: report what the
                // last complete look found.
                Err(e) if looked => {
                    return Err(give_up(&missing, format!(" (then the store closed: {e})")));
                }
                Err(e) => return Err(e),
            }
        }
        missing = still;
        looked = true;
        if missing.is_empty() {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            return Err(give_up(&missing, String::new()));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn per_machine_counts(machine_of_rank: &[u32], machines: usize) -> String {
    let mut counts = vec![0u32; machines];
    for &m in machine_of_rank {
        counts[m as usize] += 1;
    }
    counts
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The most staging buffers a rank takes where no budget is given (see
/// [`DEFAULT_TOTAL_MEMORY`]): 16 buffers of about two default slices each.
const MOST_DEFAULT_BUFFERS: u32 = 16;

/// The fewest staging buffers a rank takes where no budget is given and the
/// original's staging would have held more than two slices in flight (see
/// [`DEFAULT_TOTAL_MEMORY`]): a slice holds its buffer through five steps (the
/// local reduce-scatter, the contributions out, their reduction, the results
/// back, the all-gather; `engine/algorithm/hierarchical.rs`), and with fewer
/// buffers than steps the network waits for one to drain. The scale model puts
/// 512 H100s flat in one level (`FAIRRING_GROUP_SIZE=off`), in 32 MiB slices,
/// at 378 GB/s busbw for 1 GiB with four buffers, 385 with five (by default
/// they form groups there, in six).
const FEWEST_DEFAULT_BUFFERS: u32 = 5;

/// The geometry, buffer layout and buffer count for the configured budget.
pub(crate) fn size_staging(
    config: &Config,
    topology: Topology,
) -> Result<(Geometry, BufferLayout, u32)> {
    let world = topology.world_size();
    let slice_error = |slice: u64, e: &dyn std::fmt::Display| {
        Error::config("FAIRRING_SLICE_SIZE", slice, e.to_string())
    };
    let plan_for = |pc: PlanConfig| -> Result<(Geometry, BufferLayout)> {
        let slice = pc.slice_bytes();
        let g = match (config.servers, config.grouping) {
            (0, Grouping::AtMost(size)) => Geometry::with_groups(topology, pc, size),
            (0, Grouping::Auto) if config.wire != WireFormat::Exact => {
                compressing_default(topology, pc)
            }
            (0, grouping) => Geometry::new(topology, grouping.plan_config(pc)),
            (k, Grouping::AtMost(size)) => Geometry::with_servers_in_groups(topology, pc, k, size),
            // Only flat servers carry values compressed.
            (k, Grouping::Auto) if config.wire != WireFormat::Exact => {
                Geometry::with_servers(topology, pc.in_one_level(), k)
            }
            (k, grouping) => Geometry::with_servers(topology, grouping.plan_config(pc), k),
        }
        .map_err(|e| match (e, config.grouping) {
            (
                PlanError::InvalidGroupSize { .. }
                | PlanError::TooFewWorkers { .. }
                | PlanError::ServersNotPerRail { .. },
                Grouping::AtMost(size),
            ) => Error::config("FAIRRING_GROUP_SIZE", size, e.to_string()),
            _ => slice_error(slice, &e),
        })?;
        let fits = || {
            slice_error(
                slice,
                &"a staging buffer for it does not fit this machine's address space",
            )
        };
        let mut layout = BufferLayout::new(&g, world).ok_or_else(fits)?;
        // The buffers also hold the job's second geometry: beside dedicated
        // servers the machines' own plan (`FAIRRING_MACHINES_SERVE`); on the
        // flat plan in the default slices (not halved to fit the budget),
        // exact, its small tensors in groups.
        let default_slices = pc.slice_by_routing()
            && config.grouping == Grouping::Auto
            && config.wire == WireFormat::Exact;
        let second = colocated_geometry(&g, config.colocated_min_shard_bytes())
            .or_else(|| grouped_geometry(&g, default_slices));
        if let Some(second) = second {
            layout = layout.holding_second(second, world).ok_or_else(fits)?;
        }
        Ok((g, layout))
    };
    let given = |slice: u64| {
        PlanConfig::new(slice, config.min_shard_bytes()).map_err(|e| slice_error(slice, &e))
    };
    let configured = match config.slice_bytes {
        Some(s) => given(s)?,
        None => PlanConfig::with_default_slices(config.min_shard_bytes())
            .map_err(|e| slice_error(PlanConfig::DEFAULT_SLICE_BYTES, &e))?,
    };
    let (mut geometry, mut layout) = plan_for(configured)?;
    if config.total_memory.is_none() {
        // No budget given, where slices cross the network (between machines,
        // or to dedicated servers): as many of its buffers as the original's
        // 50 MiB of slot-sized staging held, where that is more than two (and
        // no fewer than five).
        let original = geometry
            .staging_buffers(DEFAULT_TOTAL_MEMORY)
            .unwrap_or(0)
            .min(MOST_DEFAULT_BUFFERS);
        let networked = topology.machines() > 1 || config.servers > 0;
        if networked && original > 2 {
            return Ok((geometry, layout, original.max(FEWEST_DEFAULT_BUFFERS)));
        }
    }
    let total = config.total_memory.unwrap_or(DEFAULT_TOTAL_MEMORY);
    if config.slice_bytes.is_none() {
        // The default slices, halved until the budget holds two buffers.
        let mut s = geometry.config().slice_bytes();
        while total / (layout.buffer_bytes() as u64) < 2 && s > 64 << 10 {
            s = (s / 2).max(64 << 10) / 64 * 64;
            (geometry, layout) = plan_for(given(s)?)?;
        }
    }
    let mut buffers = total / layout.buffer_bytes() as u64;
    if config.total_memory.is_none() {
        // Slices given without a budget: room for two of them at least.
        buffers = buffers.max(2);
    }
    if buffers == 0 {
        return Err(Error::config(
            "FAIRRING_TOTAL_MEMORY",
            total,
            format!(
                "one staging buffer needs {} bytes with slices of {} bytes",
                layout.buffer_bytes(),
                geometry.full_slice_bytes()
            ),
        ));
    }
    let buffers = u32::try_from(buffers).unwrap_or(u32::MAX).min(MAX_BUFFERS);
    Ok((geometry, layout, buffers))
}

/// The default geometry for a job whose wire compresses (`FAIRRING_WIRE`):
/// the flat plan where it would serve in one level and the default would form
/// groups instead (equal groups in the wide flat slices), since only the
/// flat plan (and dedicated servers) carry values compressed; elsewhere the
/// default's, which past the wide flat slices forms groups, exact as the
/// trees are.
fn compressing_default(
    topology: Topology,
    config: PlanConfig,
) -> std::result::Result<Geometry, PlanError> {
    let grouped = Geometry::new(topology, config)?;
    if grouped.routing() == Routing::Groups {
        let flat = Geometry::new(topology, config.in_one_level())?;
        if flat.routing() == Routing::Flat {
            return Ok(flat);
        }
    }
    Ok(grouped)
}

/// Attaches this rank to its machine's shared segment (local rank 0 creates it).
pub(crate) fn attach_local(
    config: &Config,
    store: &dyn Store,
    topology: Topology,
    location: Location,
    buffers: u32,
    layout: &BufferLayout,
) -> Result<Arc<Segment>> {
    let d = topology.devices_per_machine();
    let key = format!("shm/{}", location.machine);
    let creator = location.device == 0;
    let name = if creator {
        let mut nonce = [0u8; 4];
        getrandom::fill(&mut nonce)
            .map_err(|e| Error::io("reading the random source", std::io::Error::other(e)))?;
        format!(
            "/fairring-{:016x}-m{}-{:08x}",
            config.job_tag,
            location.machine,
            u32::from_le_bytes(nonce)
        )
    } else {
        let v = store.get(&key, config.timeout)?;
        String::from_utf8(v).map_err(|_| Error::store("get", format!("{key} is not UTF-8")))?
    };
    let segment = Arc::new(Segment::attach(
        &name,
        creator,
        d,
        buffers,
        layout.buffer_bytes(),
        config.timeout,
    )?);
    if creator {
        store.set(&key, name.as_bytes())?;
    }
    store.set(&format!("attached/{}", config.rank), b"1")?;
    if creator {
        let keys: Vec<String> = (0..d)
            .map(|dev| {
                let r = topology
                    .rank(Location {
                        machine: location.machine,
                        device: dev,
                    })
                    .unwrap_or(0);
                format!("attached/{r}")
            })
            .collect();
        gather(store, &keys, config.timeout)?;
        // Every local rank has mapped it: the name can go.
        segment.unlink();
    }
    Ok(segment)
}

/// Whether the machine's ranks read each other's memory (see
/// [`PeerCopy`](crate::local::PeerCopy)): where there are several.
fn agree_on_peer_copies(
    config: &Config,
    store: &dyn Store,
    topology: Topology,
    location: Location,
) -> Result<Option<crate::local::PeerCopy>> {
    let d = topology.devices_per_machine();
    if d == 1 {
        return Ok(None);
    }
    let ranks = (0..d)
        .map(|device| {
            topology
                .rank(Location {
                    machine: location.machine,
                    device,
                })
                .map_err(|e| Error::internal("every local rank has a rank", e.to_string()))
        })
        .collect::<Result<Vec<u32>>>()?;
    crate::local::PeerCopy::agree(store, &ranks, location.device, config.timeout)
}

/// Everything that goes into an engine, put together.
pub(crate) struct Built {
    pub(crate) engine: Engine<AnyFabric, Placed>,
    pub(crate) topology: Topology,
    pub(crate) location: Location,
    /// Where the local step finds the machine's NCCL communicators.
    #[cfg(feature = "cuda")]
    pub(crate) nccl: crate::local::NcclCell,
}

/// A worker's engine.
pub(crate) fn build(config: &Config, store: &dyn Store) -> Result<Built> {
    let (topology, location) = detect_topology(config, store)?;
    let (geometry, layout, buffers) = size_staging(config, topology)?;
    let segment = attach_local(config, store, topology, location, buffers, &layout)?;
    let d = topology.devices_per_machine();
    let memory = Placed::new(Host::new(Arc::clone(&segment), location.device, buffers));
    let peer_copy = agree_on_peer_copies(config, store, topology, location)?.map(Arc::new);
    let shm = ShmStep::new(Arc::clone(&segment), location.device, d, buffers)
        .copying_between_tensors(peer_copy.clone(), crate::local::COPY_BETWEEN_TENSORS_FROM)
        .reducing_whole(if topology.machines() == 1 && config.servers == 0 {
            crate::local::REDUCE_WHOLE_UP_TO
        } else {
            0
        });
    #[cfg(feature = "cuda")]
    let nccl = crate::local::NcclCell::default();
    #[cfg(feature = "cuda")]
    let local = PlacedStep::new(shm, crate::local::GpuReach::new(&memory, Arc::clone(&nccl)));
    #[cfg(not(feature = "cuda"))]
    let local = PlacedStep::new(shm, crate::local::HostOnly);
    let machine = Machine::new(segment, location.device, d);
    let wiring = Wiring::of(topology, location, config.rank, config.servers, None, None);
    let engine = assemble(
        config,
        store,
        Assembly {
            memory,
            local: Box::new(local),
            machine,
            geometry,
            layout,
            location,
            server: None,
            buffers,
            wiring,
            peer_copy,
        },
    )?;
    Ok(Built {
        engine,
        topology,
        location,
        #[cfg(feature = "cuda")]
        nccl,
    })
}

/// A dedicated server's engine: the workers' geometry and buffer count, its own
/// staging buffers in private memory, no local step.
pub(crate) fn build_server(
    config: &Config,
    store: &dyn Store,
    index: u32,
) -> Result<Engine<AnyFabric, Host>> {
    let topology = job_topology(config, store)?;
    let (geometry, layout, buffers) = size_staging(config, topology)?;
    let segment = Arc::new(Segment::anonymous(
        1,
        buffers,
        layout.server_buffer_bytes(),
    )?);
    let memory = Host::new(Arc::clone(&segment), 0, buffers);
    let machine = Machine::new(segment, 0, 1);
    let location = Location {
        machine: u32::MAX,
        device: 0,
    };
    let wiring = Wiring::of(
        topology,
        location,
        config.process(),
        config.servers,
        Some(index),
        geometry.server_groups(),
    );
    assemble(
        config,
        store,
        Assembly {
            memory,
            local: Box::new(Solo),
            machine,
            geometry,
            layout,
            // On no worker's machine.
            location,
            server: Some(index),
            buffers,
            wiring,
            peer_copy: None,
        },
    )
}

/// What a process plans with, which every process of the job must share: each
/// tensor's slices, their shards and the staging buffers they take follow from
/// it, and a process planning otherwise would place its peers' bytes in the
/// wrong cells or wait for slices they never send.
fn staging_terms(a: &Assembly<impl MemorySpace>) -> String {
    let g = &a.geometry;
    let mut terms = format!(
        "{}, {} staging buffers of {} bytes a worker",
        plan_terms(g),
        a.buffers,
        a.layout.buffer_bytes()
    );
    if let Some(g) = g.server_groups() {
        terms += &format!(
            ", servers in groups of at most {} a rail",
            g.servers().largest()
        );
    }
    // The second geometry, whose areas the buffers hold whether or not a
    // call runs it: beside servers the machines' own plan
    // (`FAIRRING_MACHINES_SERVE`), else the small tensors' groups.
    if let Some(second) = a.layout.second_geometry() {
        let of = if g.servers().is_some() {
            "the machines' own plan"
        } else {
            "small tensors"
        };
        terms += &format!("; {of}: {}", plan_terms(&second));
    }
    terms
}

/// How geometry `g` cuts a tensor: its slices, shards and levels.
fn plan_terms(g: &Geometry) -> String {
    format!(
        "slices of {} bytes{}, shards of at least {} bytes",
        g.full_slice_bytes(),
        if g.config().slice_by_routing() {
            " (the default's)"
        } else {
            ""
        },
        g.min_shard_bytes(),
    ) + &match (g.machine_groups(), g.routing()) {
        (Some(groups), _) => format!(", machines in groups of at most {}", groups.largest()),
        (None, Routing::Trees) => ", through the trees".to_owned(),
        (None, _) => String::new(),
    }
}

/// Publishes this process's [`staging_terms`] and checks them against rank
/// 0's and its linked peers': a process configured otherwise
/// (`FAIRRING_SLICE_SIZE`, `FAIRRING_MIN_SHARD_SIZE`, `FAIRRING_TOTAL_MEMORY`,
/// `FAIRRING_GROUP_SIZE`, and `FAIRRING_WIRE` where it decides whether the
/// machines or the dedicated servers form groups, or whether a flat job of 16
/// machines or more has groups for its small tensors) is refused, naming it
/// and both sides' terms, before any slice travels.
fn agree_on_staging<M: MemorySpace>(
    config: &Config,
    store: &dyn Store,
    a: &Assembly<M>,
) -> Result<()> {
    let rank = config.process();
    let mine = staging_terms(a);
    store.set(&format!("staging/{rank}"), mine.as_bytes())?;
    let linked = a.wiring.linked.iter().copied().filter(|&p| p != 0);
    for p in std::iter::once(0).chain(linked).filter(|&p| p != rank) {
        let theirs = store.get(&format!("staging/{p}"), config.timeout)?;
        if theirs != mine.as_bytes() {
            return Err(Error::peer(
                p,
                format!(
                    "plans with {}, where rank {rank} plans with {mine}: set \
                     FAIRRING_SLICE_SIZE, FAIRRING_MIN_SHARD_SIZE, \
                     FAIRRING_TOTAL_MEMORY, FAIRRING_GROUP_SIZE and FAIRRING_WIRE \
                     alike on every rank",
                    String::from_utf8_lossy(&theirs)
                ),
            ));
        }
    }
    Ok(())
}

/// What differs between a worker's engine and a server's.
struct Assembly<M: MemorySpace> {
    memory: M,
    local: Box<dyn LocalStep<M>>,
    machine: Machine,
    geometry: Geometry,
    layout: BufferLayout,
    location: Location,
    server: Option<u32>,
    buffers: u32,
    wiring: Wiring,
    /// Where the machine's ranks read each other's memory.
    peer_copy: Option<Arc<crate::local::PeerCopy>>,
}

/// Opens the fabric, registers the staging buffers, connects to the peers through
/// the store and builds the engine.
fn assemble<M: MemorySpace>(
    config: &Config,
    store: &dyn Store,
    a: Assembly<M>,
) -> Result<Engine<AnyFabric, M>> {
    let rank = config.process();
    let fabric = open_fabric::build(config)?;
    log::debug!(
        "fairring rank {rank}: {} fabric, {} staging buffers of {} bytes",
        choice_of(&fabric),
        a.buffers,
        a.memory.buffer_bytes()
    );
    agree_on_staging(config, store, &a)?;
    let (area, len) = a.memory.registered();
    // The memory space holds the segment and the engine drops it after the fabric
    // (field order).
    // SAFETY: this process's part of the mapped segment, valid until then; the
    // engine's protocol keeps the fabric's and the driver's accesses apart.
    let region = unsafe { fabric.register(area, len)? };
    let linked = &a.wiring.linked;
    for &p in linked {
        let ep = fabric.endpoint(p)?;
        store.set(&format!("ep/{rank}/{p}"), ep.as_bytes())?;
    }
    store.set(&format!("region/{rank}"), &region.remote().to_bytes())?;
    for &p in linked {
        let bytes = store.get(&format!("ep/{p}/{rank}"), config.timeout)?;
        let ep = Endpoint::from_bytes(&bytes)
            .ok_or_else(|| Error::peer(p, "published a malformed endpoint"))?;
        fabric.connect(p, &ep)?;
    }
    let remote = a.wiring.remote_regions(config.processes(), |p| {
        let bytes = store.get(&format!("region/{p}"), config.timeout)?;
        RemoteRegion::from_bytes(&bytes)
            .ok_or_else(|| Error::peer(p, "published a malformed region"))
    })?;
    Ok(Engine::new(EngineParts {
        fabric,
        region,
        remote,
        memory: a.memory,
        local: a.local,
        machine: a.machine,
        geometry: a.geometry,
        layout: a.layout,
        location: a.location,
        rank,
        world: config.processes(),
        servers: config.servers,
        server: a.server,
        buffers: a.buffers,
        wiring: a.wiring,
        timeout: config.timeout,
        direct: crate::engine::DirectSettings::from(config.direct_from),
        peer_copy: a.peer_copy,
    }))
}

#[cfg(test)]
mod tests {
    use fairring_core::plan::{InputArea, Routing};
    use fairring_core::topology::RankLayout;

    use super::*;
    use crate::config::ConfigBuilder;

    /// A configuration of `world` ranks with room for several buffers of the
    /// largest default slices.
    fn config(world: u32, configure: impl Fn(ConfigBuilder) -> ConfigBuilder) -> Config {
        configure(Config::builder(0, world, "127.0.0.1", 1).total_memory(256 << 20))
            .build()
            .unwrap()
    }

    /// Where neither a budget nor slices are given, a job across machines takes
    /// as many buffers as the original's 50 MiB of slot-sized staging held
    /// (worked by hand below), where that is more than two; else 50 MiB.
    #[test]
    fn an_unset_budget_holds_the_originals_slices_in_flight() {
        let unset = |m: u32, d: u32, configure: &dyn Fn(ConfigBuilder) -> ConfigBuilder| {
            let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let config = configure(Config::builder(0, m * d, "127.0.0.1", 1))
                .build()
                .unwrap();
            size_staging(&config, topology).unwrap()
        };
        // 8x8: a 3.125 MiB slot and 7 areas of 400 KiB and a line: 6,144,448
        // bytes, 8 of them in 50 MiB.
        let (g, layout, buffers) = unset(8, 8, &|b| b);
        assert_eq!((g.full_slice_bytes(), buffers), (25 << 20, 8));
        assert!(layout.buffer_bytes() >= 25 << 20);
        // 64x8, flat in 32 MiB slices (in one level): a 4 MiB slot and 63
        // areas of 128 KiB (the largest cell of a smaller slice, two minimum
        // shards) and a line: 12,455,872 bytes, 4 of them, so the fewest, 5.
        let (g, _, buffers) = unset(64, 8, &|b| b.grouping(Grouping::OneLevel));
        assert_eq!(
            (g.full_slice_bytes(), buffers),
            (32 << 20, 4.max(FEWEST_DEFAULT_BUFFERS))
        );
        assert_eq!(g.staging_layout().total_bytes(), 12_455_872);
        // 64x8 by default, in four equal groups of 16 in the same slices: a 4
        // MiB slot, 15 areas within of its range (4,096 units, made odd:
        // 262,208 bytes) and 2 x 3 across of its largest piece (1,024 units:
        // 65,600 bytes): 8,521,024 bytes, 6 of them.
        let (g, _, buffers) = unset(64, 8, &|b| b);
        assert_eq!((g.full_slice_bytes(), buffers), (32 << 20, 6));
        assert_eq!(g.machine_groups().map(|groups| groups.groups()), Some(4));
        let two_level = g.two_level_layout(InputArea::Slot).unwrap();
        assert_eq!(two_level.total_bytes(), 8_521_024);
        // 65x8, in groups of 22, 22 and 21 in 32 MiB slices: a 4 MiB slot
        // (65,536 units), 21 areas within of its largest range (3,121 units,
        // odd: 199,744 bytes) and 2 x 2 across of its largest piece (1,041
        // units: 66,624 bytes): 8,655,424 bytes, 6 of them.
        let (g, layout, buffers) = unset(65, 8, &|b| b);
        assert_eq!((g.full_slice_bytes(), buffers), (32 << 20, 6));
        let two_level = g.two_level_layout(InputArea::Slot).unwrap();
        assert_eq!(two_level.total_bytes(), 8_655_424);
        // The engine's buffer holds the whole slice before the same areas
        // (and the ring's receive slots over them: 67,069,376 bytes).
        assert!(layout.buffer_bytes() >= 8_655_424 + 28 * (1 << 20));
        // In one level, through the trees in 20 MiB slices: a 2.5 MiB slot
        // and two areas of 1.25 MiB and a line: 5,243,008 bytes, 9 of them.
        let (g, _, buffers) = unset(65, 8, &|b| b.grouping(Grouping::OneLevel));
        assert_eq!((g.full_slice_bytes(), buffers), (20 << 20, 9));
        assert_eq!(g.staging_layout().total_bytes(), 5_243_008);
        // 2x2: a 12.5 MiB slot and one area of 6.25 MiB: two of them, so 50
        // MiB, the slices halved until two buffers fit, as with 50 MiB given.
        let (g, _, buffers) = unset(2, 2, &|b| b);
        let (given, _, given_buffers) = unset(2, 2, &|b| b.total_memory(50 << 20));
        assert_eq!((g, buffers), (given, given_buffers));
        assert_eq!((g.full_slice_bytes(), buffers), (25 << 19, 2));
        // One machine: 50 MiB.
        let (g, _, buffers) = unset(1, 8, &|b| b);
        assert_eq!((g.full_slice_bytes(), buffers), (25 << 19, 2));
        // One machine with a dedicated server: its slices cross the network,
        // a 3.125 MiB slot and no areas, 16 of them.
        let (g, _, buffers) = unset(1, 8, &|b| b.servers(1));
        assert_eq!((g.full_slice_bytes(), buffers), (25 << 20, 16));
        let (_, _, buffers) = unset(2, 8, &|b| b.servers(2));
        assert_eq!(buffers, 16);
        // Slices given: the same rule. 1 MiB slices on 8x8 go through the
        // trees: a slot of 128 KiB and two areas of 64 KiB and a line (262,272
        // bytes), 199 of them in 50 MiB, so the most, 16.
        let (g, _, buffers) = unset(8, 8, &|b| b.slice_bytes(1 << 20));
        assert_eq!((g.full_slice_bytes(), buffers), (1 << 20, 16));
        // On one machine, 50 MiB of them, and no fewer than two.
        let (_, layout, buffers) = unset(1, 8, &|b| b.slice_bytes(1 << 20));
        assert_eq!(
            u64::from(buffers),
            (50 << 20) / layout.buffer_bytes() as u64
        );
        let (_, _, buffers) = unset(1, 8, &|b| b.slice_bytes(40 << 20));
        assert_eq!(buffers, 2);
        // A budget given is what it holds.
        let (_, layout, buffers) = unset(8, 8, &|b| b.total_memory(200 << 20));
        assert_eq!(
            u64::from(buffers),
            (200 << 20) / layout.buffer_bytes() as u64
        );
        assert!(buffers < 8);
        assert!(
            Topology::new(1, 8, RankLayout::Contiguous).is_ok_and(|t| size_staging(
                &Config::builder(0, 8, "127.0.0.1", 1)
                    .slice_bytes(40 << 20)
                    .total_memory(50 << 20)
                    .build()
                    .unwrap(),
                t
            )
            .is_err()),
            "a budget given that holds no buffer is refused"
        );
    }

    /// A flat job of 16 machines or more holds groups for its small tensors
    /// only in the default slices, whole, with an exact wire and no
    /// `FAIRRING_GROUP_SIZE`: not with slices given, a compressed wire, one
    /// level asked for, a size of groups given, slices halved to fit the
    /// budget (16x1 under the default budget: a buffer of 25 MiB slices is
    /// over 50 MiB there), fewer machines, or dedicated servers.
    #[test]
    fn only_the_default_slices_whole_and_exact_hold_groups_for_small_tensors() {
        let grouped = |m: u32, d: u32, configure: &dyn Fn(ConfigBuilder) -> ConfigBuilder| {
            let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let config = configure(Config::builder(0, m * d, "127.0.0.1", 1))
                .build()
                .unwrap();
            let (g, layout, _) = size_staging(&config, topology).unwrap();
            assert_eq!(g.routing(), Routing::Flat, "{m}x{d}");
            layout.second_geometry()
        };
        let whole = |b: ConfigBuilder| b.total_memory(1 << 40);
        let second = grouped(16, 8, &|b| b).expect("16x8 under the default budget");
        assert_eq!(second.machine_groups().map(|g| g.groups()), Some(4));
        assert_eq!(second.servers(), None);
        assert!(grouped(16, 1, &whole).is_some());
        assert!(grouped(16, 1, &|b| b).is_none(), "halved");
        assert!(grouped(15, 8, &|b| b).is_none());
        assert!(grouped(16, 8, &|b| b.slice_bytes(25 << 20)).is_none());
        assert!(grouped(16, 8, &|b| b.wire(WireFormat::Bf16)).is_none());
        assert!(grouped(16, 8, &|b| b.grouping(Grouping::OneLevel)).is_none());
        let topology = Topology::new(16, 8, RankLayout::Contiguous).unwrap();
        let beside = Config::builder(0, 128, "127.0.0.1", 1)
            .servers(8)
            .build()
            .unwrap();
        let (g, layout, _) = size_staging(&beside, topology).unwrap();
        assert_eq!(layout.second_geometry().map(|s| s.servers()), Some(None));
        assert!(
            g.servers().is_some() && layout.second_geometry().unwrap().machine_groups().is_none()
        );
    }

    #[test]
    fn default_slices_follow_the_routing_and_a_given_size_is_kept() {
        // 61 machines of 8 GPUs: a 25 MiB slice's slot holds 50 shards of 64
        // KiB, fewer than the machines, so the default slices widen to 32 MiB,
        // flat (61 machines make no equal groups).
        let wide = Topology::new(61, 8, RankLayout::Contiguous).unwrap();
        let (g, _, buffers) = size_staging(&config(488, |b| b), wide).unwrap();
        assert_eq!(g.routing(), Routing::Flat);
        assert!(g.full_slice_bytes() <= 32 << 20 && g.full_slice_bytes() > 25 << 20);
        assert!(buffers >= 2);
        // 64 machines make four equal groups of 16, in the same slices; in
        // one level they stay flat.
        let wide = Topology::new(64, 8, RankLayout::Contiguous).unwrap();
        let (g, _, buffers) = size_staging(&config(512, |b| b), wide).unwrap();
        assert_eq!(g.routing(), Routing::Groups);
        assert_eq!(g.machine_groups().map(|groups| groups.largest()), Some(16));
        assert_eq!(g.full_slice_bytes(), 32 << 20);
        assert!(buffers >= 2);
        let (g, _, _) =
            size_staging(&config(512, |b| b.grouping(Grouping::OneLevel)), wide).unwrap();
        assert_eq!(g.routing(), Routing::Flat);
        assert_eq!(g.full_slice_bytes(), 32 << 20);
        // So too where the wire compresses, which only the flat plan carries;
        // past the wide flat slices (65 machines) the groups stay, exact as
        // the trees would be.
        let bf16 = |b: ConfigBuilder| b.wire(fairring_core::WireFormat::Bf16);
        let (g, _, _) = size_staging(&config(512, bf16), wide).unwrap();
        assert_eq!(g.routing(), Routing::Flat);
        assert_eq!(g.shards_per_full_slice(), 64);
        let deep = Topology::new(65, 8, RankLayout::Contiguous).unwrap();
        let (g, _, _) = size_staging(&config(520, bf16), deep).unwrap();
        assert_eq!(g.routing(), Routing::Groups);
        // 65 machines: a 32 MiB slice's slot holds 64 shards of 64 KiB, so the
        // machines form groups, in 32 MiB slices by default; in one level the
        // cells go through the trees, in 20 MiB slices.
        let deep = Topology::new(65, 8, RankLayout::Contiguous).unwrap();
        let (g, _, buffers) = size_staging(&config(520, |b| b), deep).unwrap();
        assert_eq!(g.routing(), Routing::Groups);
        assert_eq!(g.full_slice_bytes(), 32 << 20);
        assert!(buffers >= 2);
        let (g, _, buffers) =
            size_staging(&config(520, |b| b.grouping(Grouping::OneLevel)), deep).unwrap();
        assert_eq!(g.routing(), Routing::Trees);
        assert_eq!(g.full_slice_bytes(), 20 << 20);
        assert!(buffers >= 2);
        // Groups asked for: of at most 5 machines, 13 of them, in 32 MiB
        // slices; a size that makes no two levels is named.
        let (g, _, _) =
            size_staging(&config(520, |b| b.grouping(Grouping::AtMost(5))), deep).unwrap();
        assert_eq!(g.machine_groups().map(|groups| groups.groups()), Some(13));
        assert_eq!(g.full_slice_bytes(), 32 << 20);
        let refused = size_staging(&config(520, |b| b.grouping(Grouping::AtMost(40))), deep);
        assert!(
            matches!(&refused, Err(Error::Config { variable, .. }) if *variable == "FAIRRING_GROUP_SIZE"),
            "{refused:?}"
        );
        // 8 machines: flat, 25 MiB.
        let flat = Topology::new(8, 8, RankLayout::Contiguous).unwrap();
        let (g, _, _) = size_staging(&config(64, |b| b), flat).unwrap();
        assert_eq!(g.routing(), Routing::Flat);
        assert_eq!(g.full_slice_bytes(), 25 << 20);
        // A slice size given is kept through the trees.
        let (g, _, _) = size_staging(&config(512, |b| b.slice_bytes(25 << 20)), deep).unwrap();
        assert_eq!(g.routing(), Routing::Trees);
        assert_eq!(g.full_slice_bytes(), 25 << 20);
        // Dedicated servers are flat, in 25 MiB slices.
        let (g, _, _) = size_staging(&config(512, |b| b.servers(64)), deep).unwrap();
        assert_eq!(g.routing(), Routing::Flat);
        assert_eq!(g.full_slice_bytes(), 25 << 20);
        // A budget of less than two buffers halves the default slices until
        // two fit.
        let (g, layout, buffers) =
            size_staging(&config(512, |b| b.total_memory(12 << 20)), deep).unwrap();
        assert_eq!(buffers, 2);
        assert!(g.full_slice_bytes() < 16 << 20);
        assert!(2 * layout.buffer_bytes() as u64 <= 12 << 20);
        let (larger, _, _) = size_staging(
            &config(512, |b| b.slice_bytes(2 * g.full_slice_bytes())),
            deep,
        )
        .unwrap();
        let (_, larger_layout, _) = size_staging(
            &config(512, |b| {
                b.slice_bytes(larger.full_slice_bytes())
                    .total_memory(12 << 20)
            }),
            deep,
        )
        .unwrap();
        assert!(2 * larger_layout.buffer_bytes() as u64 > 12 << 20);
    }
}
