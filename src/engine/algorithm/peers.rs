//! Whom each rank writes to and is written by, as the algorithms need: the
//! servers of its rail group (hierarchical, where the job has dedicated
//! servers), the rails (hierarchical without them, the relay and scatter over
//! the machines, and the descriptor checks between machines that the job's
//! NCCL all-reduce waits for, with or without servers), the ring's
//! neighbours (ring, relay, scatter over the ranks), and the partners of
//! recursive doubling. The links connect exactly these.

use fairring_core::plan::{ServerGroups, server_rails, serves_rail};
use fairring_core::topology::{Location, Topology};

use super::doubling;

/// Ranks worker `rank` writes to and ranks that write to it, in a job with
/// `servers` dedicated servers (ranks `world..world + servers`): the servers of
/// its device's rail group (server `i` where `i mod R = device mod R`,
/// `R = gcd(servers, D)`), the rails, the ring's neighbours, and the
/// partners of recursive doubling.
pub(crate) fn peers(
    topology: Topology,
    location: Location,
    rank: u32,
    servers: u32,
) -> (Vec<u32>, Vec<u32>) {
    let world = topology.world_size();
    let rails = server_rails(servers, topology.devices_per_machine());
    let mut out: Vec<u32> = (0..servers)
        .filter(|&i| serves_rail(rails, i, location.device))
        .map(|i| world + i)
        .collect();
    let mut inbound = out.clone();
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

/// Ranks dedicated server `index` of `servers` writes to and ranks that write
/// to it: every worker of its rail group (device `d` where `d mod R = index
/// mod R`), and where the servers are in groups (`groups`, of each rail
/// group's servers) the servers of its rail group it may exchange pieces
/// with across the groups (`ServerGroups::across_partners`: at most three a
/// group).
pub(crate) fn server_peers(
    topology: Topology,
    index: u32,
    servers: u32,
    groups: Option<ServerGroups>,
) -> (Vec<u32>, Vec<u32>) {
    let world = topology.world_size();
    let rails = server_rails(servers, topology.devices_per_machine());
    let mut peers: Vec<u32> = (0..world)
        .filter(|&w| {
            topology
                .locate(w)
                .is_ok_and(|l| serves_rail(rails, index, l.device))
        })
        .collect();
    if let Some(groups) = groups {
        let (own, rail) = (index / rails, index % rails);
        let servers = groups.servers();
        for group in 0..servers.groups() {
            let (Ok(partners), Ok(first)) =
                (groups.across_partners(own, group), servers.first(group))
            else {
                continue;
            };
            peers.extend(partners.map(|member| world + (first + member) * rails + rail));
        }
    }
    (peers.clone(), peers)
}

/// One process's place on the fabric: the processes it writes to (`out`),
/// those that write to it (`inbound`), and those it links with (either).
/// Made from the job's shape alone, the same way by every assembly of an
/// engine (the communicator's bootstrap and the simulation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Wiring {
    pub(crate) out: Vec<u32>,
    pub(crate) inbound: Vec<u32>,
    pub(crate) linked: Vec<u32>,
}

impl Wiring {
    /// The wiring of worker `rank` at `location` (`server`: `None`), or of
    /// dedicated server `server`, in a job with `servers` dedicated servers,
    /// in `server_groups` where they are in groups.
    pub(crate) fn of(
        topology: Topology,
        location: Location,
        rank: u32,
        servers: u32,
        server: Option<u32>,
        server_groups: Option<ServerGroups>,
    ) -> Wiring {
        let (out, inbound) = match server {
            Some(index) => server_peers(topology, index, servers, server_groups),
            None => peers(topology, location, rank, servers),
        };
        let mut linked: Vec<u32> = out.iter().chain(&inbound).copied().collect();
        linked.sort_unstable();
        linked.dedup();
        Wiring {
            out,
            inbound,
            linked,
        }
    }

    /// Per process of `processes`, the region of each process this one
    /// writes to, from `region_of` (which the caller serves from its
    /// rendezvous).
    pub(crate) fn remote_regions<R, E>(
        &self,
        processes: u32,
        mut region_of: impl FnMut(u32) -> Result<R, E>,
    ) -> Result<Vec<Option<R>>, E>
    where
        R: Clone,
    {
        let mut remote = vec![None; processes as usize];
        for &p in &self.out {
            remote[p as usize] = Some(region_of(p)?);
        }
        Ok(remote)
    }
}

#[cfg(test)]
mod tests {
    use fairring_core::topology::RankLayout;

    use super::*;

    #[test]
    fn a_process_links_once_with_everyone_it_writes_to_or_hears_from() {
        for (m, d, servers) in [
            (1, 1, 0),
            (2, 2, 0),
            (3, 2, 1),
            (4, 1, 2),
            (5, 3, 0),
            (2, 4, 2),
            (3, 2, 4),
        ] {
            let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let world = topology.world_size();
            for rank in 0..world {
                let location = topology.locate(rank).unwrap();
                let w = Wiring::of(topology, location, rank, servers, None, None);
                let (out, inbound) = peers(topology, location, rank, servers);
                assert_eq!((&w.out, &w.inbound), (&out, &inbound));
                let mut union: Vec<u32> = out.iter().chain(&inbound).copied().collect();
                union.sort_unstable();
                union.dedup();
                assert_eq!(w.linked, union, "{m}x{d}+{servers}: rank {rank}");
                // Its rails, with or without servers.
                for other in (0..m).filter(|&other| other != location.machine) {
                    let rail = topology
                        .rank(Location {
                            machine: other,
                            device: location.device,
                        })
                        .unwrap();
                    assert!(
                        out.contains(&rail) && inbound.contains(&rail),
                        "{m}x{d}+{servers}: rank {rank} and its rail {rail}"
                    );
                }
                let remote = w.remote_regions(world + servers, Ok::<_, ()>).unwrap();
                for (p, r) in (0u32..).zip(&remote) {
                    assert_eq!(r.is_some(), out.contains(&p), "rank {rank}: region of {p}");
                }
            }
            for index in 0..servers {
                let nowhere = Location {
                    machine: u32::MAX,
                    device: 0,
                };
                let w = Wiring::of(topology, nowhere, world + index, servers, Some(index), None);
                // Its rail group's workers, each of which links back with it.
                let rails = server_rails(servers, d);
                let workers: Vec<u32> = (0..world)
                    .filter(|&r| topology.locate(r).unwrap().device % rails == index % rails)
                    .collect();
                assert_eq!(
                    (&w.out, &w.inbound, &w.linked),
                    (&workers, &workers, &workers)
                );
                assert_eq!(workers.len(), (world / rails) as usize, "{m}x{d}+{servers}");
                for rank in 0..world {
                    let location = topology.locate(rank).unwrap();
                    let worker = Wiring::of(topology, location, rank, servers, None, None);
                    assert_eq!(
                        worker.linked.contains(&(world + index)),
                        workers.contains(&rank),
                        "{m}x{d}+{servers}: rank {rank} and server {index}"
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod in_groups_tests {
    use fairring_core::topology::RankLayout;

    use super::*;

    /// Where the servers are in groups, a server links with every worker of
    /// its rail group and with the servers of its rail that may hold a piece
    /// of its range in another group (members `i - 1` to `i + 1` of each),
    /// both ways, and with no server of its own group or of another rail.
    #[test]
    fn a_server_in_groups_links_with_its_partners_across() {
        for (m, d, per_rail, size) in [(4, 1, 4, 2), (3, 2, 7, 3), (4, 2, 12, 3), (3, 4, 9, 4)] {
            let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
            let world = topology.world_size();
            let servers = per_rail * d;
            let groups = ServerGroups::new(m, per_rail, size).unwrap();
            let plan = groups.servers();
            let nowhere = Location {
                machine: u32::MAX,
                device: 0,
            };
            let wiring = |index| {
                Wiring::of(
                    topology,
                    nowhere,
                    world + index,
                    servers,
                    Some(index),
                    Some(groups),
                )
            };
            for index in 0..servers {
                let flat = Wiring::of(topology, nowhere, world + index, servers, Some(index), None);
                let grouped = wiring(index);
                let (own, rail) = (index / d, index % d);
                let me = plan.locate(own).unwrap();
                let mates: Vec<u32> = grouped
                    .linked
                    .iter()
                    .copied()
                    .filter(|&p| p >= world)
                    .collect();
                for &p in &mates {
                    let other = p - world;
                    assert_eq!(
                        other % d,
                        rail,
                        "{m}x{d}+{servers}: server {index} links {p}"
                    );
                    let them = plan.locate(other / d).unwrap();
                    assert_ne!(them.group, me.group);
                    assert!(them.member.abs_diff(me.member) <= 1);
                    assert!(wiring(other).linked.contains(&(world + index)), "both ways");
                }
                // Members i - 1 to i + 1 of each other group that has them.
                let want: usize = (0..plan.groups())
                    .filter(|&g| g != me.group)
                    .map(|g| {
                        let len = plan.size(g).unwrap();
                        (me.member.saturating_sub(1)..(me.member + 2).min(len)).len()
                    })
                    .sum();
                assert_eq!(mates.len(), want);
                let workers: Vec<u32> = grouped
                    .linked
                    .iter()
                    .copied()
                    .filter(|&p| p < world)
                    .collect();
                assert_eq!(workers, flat.linked);
                assert_eq!(grouped.out, grouped.inbound);
            }
        }
    }
}
