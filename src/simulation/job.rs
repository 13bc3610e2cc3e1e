//! The engines of a simulated job: every rank's (and every dedicated
//! server's) memory, local step, fabric and region, assembled as the
//! bootstrap assembles a communicator's.

use super::*;

/// The machines' collectives in a simulated job: from which size a slice of
/// equal slots reduce-scatters in one call, and the count of those that met.
/// Where the job's communicator is made (`across_job`, on several machines,
/// with or without servers; on one beside servers the machine's collectives
/// take the workers' all-reduce), every worker joins it too, and the job's
/// all-reduces that met on it are counted.
#[derive(Clone, Debug)]
pub(super) struct Collectives {
    pub(super) one_reduce_scatter_from: u64,
    pub(super) scatters: Arc<std::sync::atomic::AtomicU64>,
    pub(super) across_job: bool,
    pub(super) job_all_reduces: Arc<std::sync::atomic::AtomicU64>,
    /// The job's calls that arrived while their rank's engine had not
    /// failed (on a gate it opened, or ungated; not on one its failure
    /// released).
    pub(super) job_arrived_unfailed: Arc<std::sync::atomic::AtomicU64>,
}

impl Collectives {
    /// The engine's own rule, counted nowhere, without the job's
    /// communicator.
    pub(super) fn shipped() -> Collectives {
        Collectives {
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            scatters: Arc::default(),
            across_job: false,
            job_all_reduces: Arc::default(),
            job_arrived_unfailed: Arc::default(),
        }
    }
}

/// The engines of every rank of `geometry`'s job over `net` (the workers, then
/// its dedicated servers), each worker's local step passed through `wrap` (to
/// inject faults). Device tensors of several ranks per machine go through the
/// machine's `collectives` where given, through the host otherwise.
#[expect(clippy::too_many_arguments, reason = "a job's every setting, once")]
pub(super) fn build_job(
    geometry: &Geometry,
    layout: &BufferLayout,
    buffers: u32,
    net: &Arc<std::sync::Mutex<Network>>,
    direct: DirectSettings,
    design: Design,
    collectives: Option<&Collectives>,
    whole_up_to: usize,
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
    let segments: Vec<Arc<Segment>> = (0..m)
        .map(|_| Segment::anonymous(d, buffers, layout.buffer_bytes()).map(Arc::new))
        .collect::<crate::Result<_>>()
        .map_err(|e| e.to_string())?;
    let machines: Vec<SimMachine> = (0..m)
        .map(|_| {
            SimMachine::new(
                d,
                collectives
                    .map(|c| Arc::clone(&c.scatters))
                    .unwrap_or_default(),
            )
        })
        .collect();
    let job = collectives
        .filter(|c| c.across_job && d > 1 && m > 1)
        .map(|c| {
            SimMachine::job(
                world,
                Arc::clone(&c.job_all_reduces),
                Arc::clone(&c.job_arrived_unfailed),
            )
        });
    let one_call_from = collectives.map_or(u64::MAX, |c| c.one_reduce_scatter_from);
    let mut parts = Vec::new();
    for rank in 0..world {
        let location = topology.locate(rank).map_err(|e| e.to_string())?;
        let segment = &segments[location.machine as usize];
        let memory = SimMemory::new(
            Host::new(Arc::clone(segment), location.device, buffers),
            design,
        );
        let joined = (collectives.is_some() && d > 1).then(|| {
            join(
                &memory,
                &machines[location.machine as usize],
                location.device,
                job.as_ref().map(|job| (job, rank)),
            )
        });
        // Broadcasts on one machine are copied between tensors in the jobs
        // of an even number of buffers (half those drawn), and summed with
        // zeros in the others, as where ranks may not copy between them.
        let peer_copy = (d > 1 && buffers.is_multiple_of(2)).then(|| {
            Arc::new(PeerCopy::within_this_process(&local_ranks(
                topology,
                location.machine,
            )))
        });
        let shm = ShmStep::new(Arc::clone(segment), location.device, d, buffers)
            .copying_between_tensors(peer_copy.clone(), 1)
            .reducing_whole(whole_up_to);
        let local = wrap(rank, reach::step(&memory, shm, joined, one_call_from));
        let machine = Machine::new(Arc::clone(segment), location.device, d);
        let fabric = SimFabric {
            rank,
            net: Arc::clone(net),
        };
        let (area, len) = memory.registered();
        // SAFETY: the area is this rank's part of a segment the memory space keeps
        // mapped for as long as the engine lives.
        let region = unsafe { fabric.register(area, len) }.map_err(|e| e.to_string())?;
        parts.push((
            location, memory, local, machine, fabric, region, None, peer_copy,
        ));
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
            None,
        ));
    }
    let regions: Vec<_> = parts.iter().map(|p| p.5.remote()).collect();
    let mut engines = Vec::new();
    for (rank, (location, memory, local, machine, fabric, region, server, peer_copy)) in
        (0..processes).zip(parts)
    {
        let wiring = Wiring::of(
            topology,
            location,
            rank,
            servers,
            server,
            geometry.server_groups(),
        );
        for &p in &wiring.linked {
            let ep = fabric.endpoint(p).map_err(|e| e.to_string())?;
            fabric.connect(p, &ep).map_err(|e| e.to_string())?;
        }
        let remote = wiring.remote_regions(processes, |p| Ok::<_, String>(regions[p as usize]))?;
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
            buffers,
            wiring,
            timeout,
            direct,
            // Messages between the machine's ranks go through its mailboxes
            // where its ranks copy between tensors, and over the network
            // where they do not.
            peer_copy,
        }));
    }
    Ok(engines)
}

/// The engines of a small job for the focused tests: `m x d` ranks, two
/// buffers of 4 KiB slices, under `design` and `timeout`, each local step
/// through `wrap`.
pub(super) fn small_job(
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
    let layout = BufferLayout::new(&geometry, m * d).unwrap();
    let net = Network::new(m * d);
    let engines = build_job(
        &geometry,
        &layout,
        2,
        &net,
        DirectSettings::from(None),
        design,
        None,
        0,
        timeout,
        wrap,
    )
    .unwrap();
    (engines, net)
}

/// The ranks of machine `machine`, by local rank.
fn local_ranks(topology: Topology, machine: u32) -> Vec<u32> {
    (0..topology.devices_per_machine())
        .filter_map(|device| topology.rank(Location { machine, device }).ok())
        .collect()
}
