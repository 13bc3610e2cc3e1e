//! Whom each rank writes to and is written by, as the algorithms need: the
//! servers or the rails (hierarchical, and the relay and scatter over the
//! machines), the ring's neighbours (ring, relay, scatter over the ranks), and
//! the partners of recursive doubling. The links connect exactly these.

use fairring_core::topology::{Location, Topology};

use super::doubling;

/// Ranks worker `rank` writes to and ranks that write to it, in a job with
/// `servers` dedicated servers (ranks `world..world + servers`): the servers or
/// the rails, the ring's neighbours, and the partners of recursive doubling.
pub(crate) fn peers(
    topology: Topology,
    location: Location,
    rank: u32,
    servers: u32,
) -> (Vec<u32>, Vec<u32>) {
    let world = topology.world_size();
    let mut out: Vec<u32> = (world..world + servers).collect();
    let mut inbound = out.clone();
    let rails = if servers > 0 { 0 } else { topology.machines() };
    for m in (0..rails).filter(|&m| m != location.machine) {
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
    for partner in doubling::partners(rank, world) {
        out.push(partner);
        inbound.push(partner);
    }
    out.sort_unstable();
    out.dedup();
    inbound.sort_unstable();
    inbound.dedup();
    (out, inbound)
}

/// Ranks a dedicated server writes to and ranks that write to it: every worker.
pub(crate) fn server_peers(topology: Topology) -> (Vec<u32>, Vec<u32>) {
    let workers: Vec<u32> = (0..topology.world_size()).collect();
    (workers.clone(), workers)
}
