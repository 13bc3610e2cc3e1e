//! Building a communicator: rendezvous, topology, shared memory, fabric.

use std::net::{IpAddr, SocketAddr, UdpSocket};

use fairring_core::plan::{Geometry, PlanConfig};
use fairring_core::topology::{Location, Topology};
use fairring_rdma::fabric::{Endpoint, Fabric, LocalRegion, RemoteRegion};
use fairring_rdma::tcp::{BindTo, TcpConfig, TcpFabric};

use crate::config::Config;
use crate::engine::tags::MAX_BUFFERS;
use crate::engine::{BufferLayout, Engine, EngineParts};
use crate::error::{Error, Result};
use crate::local::ShmGroup;
use crate::store::{Store, gather};

/// This machine's identity: the kernel's boot id and the host name, unless
/// overridden (`FAIRRING_HOST_ID`, to simulate machines on one host).
fn host_identity(config: &Config) -> String {
    if let Some(id) = &config.host_id {
        return id.clone();
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", boot.trim(), host.trim())
}

/// Finds which ranks share a machine and checks the deployment is regular.
pub(super) fn detect_topology(config: &Config, store: &dyn Store) -> Result<(Topology, Location)> {
    let me = host_identity(config);
    store.set(&format!("host/{}", config.rank), me.as_bytes())?;
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
    let topology = Topology::detect(&machine_of_rank).map_err(|e| Error::Topology {
        reason: format!(
            "{e}; ranks per machine: {}",
            per_machine_counts(&machine_of_rank, names.len())
        ),
    })?;
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

/// The geometry, buffer layout and buffer count for the configured budget.
pub(super) fn size_staging(
    config: &Config,
    topology: Topology,
) -> Result<(Geometry, BufferLayout, u32)> {
    let world = topology.world_size();
    let plan_for = |slice: u64| -> Result<(Geometry, BufferLayout)> {
        let pc = PlanConfig::new(slice, config.min_shard_bytes)
            .map_err(|e| Error::config("FAIRRING_SLICE_SIZE", slice, e.to_string()))?;
        let g = Geometry::new(topology, pc)
            .map_err(|e| Error::config("FAIRRING_SLICE_SIZE", slice, e.to_string()))?;
        Ok((g, BufferLayout::new(&g, world)))
    };
    let (geometry, layout) = match config.slice_bytes {
        Some(s) => plan_for(s)?,
        None => {
            // 25 MiB, halved until the budget holds at least two buffers.
            let mut s = PlanConfig::DEFAULT_SLICE_BYTES;
            loop {
                let (g, l) = plan_for(s)?;
                if config.total_memory / l.buffer_bytes as u64 >= 2 || s <= 64 << 10 {
                    break (g, l);
                }
                s = (s / 2).max(64 << 10) / 64 * 64;
            }
        }
    };
    let buffers = config.total_memory / layout.buffer_bytes as u64;
    if buffers == 0 {
        return Err(Error::config(
            "FAIRRING_TOTAL_MEMORY",
            config.total_memory,
            format!(
                "one staging buffer needs {} bytes with slices of {} bytes",
                layout.buffer_bytes,
                geometry.full_slice_bytes()
            ),
        ));
    }
    let buffers = u32::try_from(buffers).unwrap_or(u32::MAX).min(MAX_BUFFERS);
    Ok((geometry, layout, buffers))
}

/// Attaches this rank to its machine's shared segment.
pub(super) fn attach_local(
    config: &Config,
    store: &dyn Store,
    topology: Topology,
    location: Location,
    buffers: u32,
    layout: &BufferLayout,
) -> Result<ShmGroup> {
    let d = topology.devices_per_machine();
    let key = format!("shm/{}", location.machine);
    let name = if location.device == 0 {
        let mut nonce = [0u8; 4];
        getrandom::fill(&mut nonce)
            .map_err(|e| Error::io("reading the random source", std::io::Error::other(e)))?;
        let name = format!(
            "/fairring-{:016x}-m{}-{:08x}",
            config.job_tag,
            location.machine,
            u32::from_le_bytes(nonce)
        );
        name
    } else {
        let v = store.get(&key, config.timeout)?;
        String::from_utf8(v).map_err(|_| Error::store("get", format!("{key} is not UTF-8")))?
    };
    let group = ShmGroup::attach(
        &name,
        location.device,
        d,
        buffers,
        layout.buffer_bytes,
        config.timeout,
    )?;
    if location.device == 0 {
        store.set(&key, name.as_bytes())?;
    }
    store.set(&format!("attached/{}", config.rank), b"1")?;
    if location.device == 0 {
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
        group.unlink();
    }
    Ok(group)
}

/// The address this rank's fabric listens on.
fn bind_address(config: &Config) -> Result<BindTo> {
    if let Some(name) = &config.socket_ifname {
        return Ok(BindTo::Interface(name.clone()));
    }
    let master = crate::store::tcp::resolve_master(&config.master_addr, config.master_port)?;
    if master.ip().is_loopback() {
        return Ok(BindTo::loopback());
    }
    // The local address of the route to the rendezvous host (no packet is sent).
    let any: SocketAddr = match master.ip() {
        IpAddr::V4(_) => "0.0.0.0:0"
            .parse()
            .map_err(|_| Error::invalid("address", "v4"))?,
        IpAddr::V6(_) => "[::]:0"
            .parse()
            .map_err(|_| Error::invalid("address", "v6"))?,
    };
    let probe = UdpSocket::bind(any)
        .and_then(|s| s.connect(master).map(|()| s))
        .and_then(|s| s.local_addr())
        .map_err(|e| {
            Error::io(
                format!("finding the local address that reaches {master}"),
                e,
            )
        })?;
    Ok(BindTo::Address(SocketAddr::new(probe.ip(), 0)))
}

/// Ranks this rank writes to and ranks that write to it.
pub(crate) fn peers(topology: Topology, location: Location, rank: u32) -> (Vec<u32>, Vec<u32>) {
    let world = topology.world_size();
    let mut out = Vec::new();
    let mut inbound = Vec::new();
    for m in (0..topology.machines()).filter(|&m| m != location.machine) {
        if let Ok(r) = topology.rank(Location {
            machine: m,
            device: location.device,
        }) {
            out.push(r);
            inbound.push(r);
        }
    }
    if world > 1 {
        out.push((rank + 1) % world);
        inbound.push((rank + world - 1) % world);
    }
    out.sort_unstable();
    out.dedup();
    inbound.sort_unstable();
    inbound.dedup();
    (out, inbound)
}

/// Every rank connected to this one: those it writes to and those that write to it.
pub(crate) fn linked(out: &[u32], inbound: &[u32]) -> Vec<u32> {
    let mut linked: Vec<u32> = out.iter().chain(inbound).copied().collect();
    linked.sort_unstable();
    linked.dedup();
    linked
}

/// Everything that goes into an engine, put together.
pub(super) struct Built {
    pub(super) engine: Engine<TcpFabric>,
    pub(super) topology: Topology,
    pub(super) location: Location,
}

pub(super) fn build(config: &Config, store: &dyn Store) -> Result<Built> {
    let (topology, location) = detect_topology(config, store)?;
    let (geometry, layout, buffers) = size_staging(config, topology)?;
    let group = attach_local(config, store, topology, location, buffers, &layout)?;
    let world = config.world_size;
    let tcp = TcpConfig::new(
        config.rank,
        world,
        config.job_tag,
        config.secret.clone(),
        bind_address(config)?,
    )
    // Half the timeout: a peer that stops (SIGSTOP, a hung host) is reported by
    // name through its silence before the engine's own stall timeout fires.
    .with_silence_timeout(config.timeout / 2);
    let mut tcp = tcp;
    tcp.connect_timeout = config.timeout;
    let fabric = TcpFabric::new(tcp)?;
    let (area, len) = group.own_area();
    // SAFETY: the area is this rank's part of the mapped segment, valid until the
    // group is dropped, which the engine does only after the fabric (field order);
    // the engine's protocol keeps the fabric's and the driver's accesses apart.
    let region = unsafe { fabric.register(area, len)? };
    let (out, inbound) = peers(topology, location, config.rank);
    let linked = linked(&out, &inbound);
    for &p in &linked {
        let ep = fabric.endpoint(p)?;
        store.set(&format!("ep/{}/{p}", config.rank), ep.as_bytes())?;
    }
    store.set(
        &format!("region/{}", config.rank),
        &region.remote().to_bytes(),
    )?;
    for &p in &linked {
        let bytes = store.get(&format!("ep/{p}/{}", config.rank), config.timeout)?;
        let ep = Endpoint::from_bytes(&bytes)
            .ok_or_else(|| Error::peer(p, "published a malformed endpoint"))?;
        fabric.connect(p, &ep)?;
    }
    let mut remote = vec![None; world as usize];
    for &p in &out {
        let bytes = store.get(&format!("region/{p}"), config.timeout)?;
        let r = RemoteRegion::from_bytes(&bytes)
            .ok_or_else(|| Error::peer(p, "published a malformed region"))?;
        remote[p as usize] = Some(r);
    }
    let engine = Engine::new(EngineParts {
        fabric,
        region,
        remote,
        local: Box::new(group),
        geometry,
        location,
        rank: config.rank,
        buffers,
        layout,
        inbound,
        linked,
        timeout: config.timeout,
    });
    Ok(Built {
        engine,
        topology,
        location,
    })
}
