//! Dedicated servers in groups (`plan/server_groups.rs`): the workers'
//! groups tile the machines as the module docs say, a worker's cells tile its
//! slot as its group's servers' ranges, and the reduction the arithmetic
//! describes, run unit by unit (cells up to the servers, pieces across the
//! groups through the intervals' holders, ranges back), leaves every worker
//! with the sum over all workers.
#![expect(
    clippy::cast_possible_truncation,
    reason = "the tests' slots, machines and servers are far below 2^32"
)]

use std::ops::Range;

use fairring_core::DataType;
use fairring_core::plan::{
    Geometry, MachineGroups, Plan, PlanConfig, PlanError, Routing, ServerGroups,
};
use fairring_core::topology::{Location, RankLayout, Topology};
use proptest::prelude::*;

/// A worker's value at a unit of its slot, distinct per worker and unit.
fn value(machine: u32, unit: u64) -> u64 {
    u64::from(machine) * 1_000_003 + unit * 7 + 1
}

/// Servers `servers`, machines `machines`, groups of at most `size`: the
/// groups, or `None` where the servers make no two levels.
fn groups(machines: u32, servers: u32, size: u32) -> Option<ServerGroups> {
    ServerGroups::new(machines, servers, size).ok()
}

/// Every check of the workers' groups and cells on one configuration.
fn check_groups(g: &ServerGroups, slot_units: u64) -> Result<(), TestCaseError> {
    let q = g.groups();
    let m = g.machines();
    prop_assert_eq!(q, g.servers().groups());
    // The workers' groups tile 0..M in order, the larger first, each
    // nonempty, within one machine of each other.
    let mut next = 0;
    let mut sizes = Vec::new();
    for group in 0..q {
        let workers = g.workers(group).unwrap();
        prop_assert_eq!(workers.start, next);
        prop_assert!(!workers.is_empty());
        sizes.push(workers.len() as u32);
        for (member, machine) in workers.clone().enumerate() {
            let at = g.locate_worker(machine).unwrap();
            prop_assert_eq!((at.group, at.member), (group, member as u32));
            let servers = g.servers_of(machine).unwrap();
            let first = g.servers().first(group).unwrap();
            prop_assert_eq!(
                servers.clone(),
                first..first + g.servers().size(group).unwrap()
            );
            prop_assert!(servers.len() >= 2);
        }
        next = workers.end;
    }
    prop_assert_eq!(next, m);
    prop_assert!(sizes.windows(2).all(|w| w[0] >= w[1]));
    prop_assert!(sizes[0] - sizes[q as usize - 1] <= 1);
    prop_assert_eq!(g.most_workers(), sizes[0]);
    prop_assert_eq!(
        g.locate_worker(m),
        Err(PlanError::MachineOutOfRange {
            machine: m,
            machines: m
        })
    );
    prop_assert_eq!(
        g.workers(q),
        Err(PlanError::GroupOutOfRange {
            group: q,
            groups: q
        })
    );
    // A worker's cells tile its slot in order, one per server of its group,
    // each that server's range, the same for every worker of the group.
    for machine in 0..m {
        let group = g.locate_worker(machine).unwrap().group;
        let members = g.servers().size(group).unwrap();
        let mut at = 0;
        for member in 0..members {
            let cell = g.cell(slot_units, machine, member).unwrap();
            prop_assert_eq!(cell.start, at);
            prop_assert_eq!(
                cell.clone(),
                g.servers().range(slot_units, group, member).unwrap()
            );
            prop_assert!(cell.end - cell.start <= slot_units.div_ceil(u64::from(members)));
            at = cell.end;
        }
        prop_assert_eq!(at, slot_units);
        prop_assert!(g.cell(slot_units, machine, members).is_err());
    }
    Ok(())
}

/// Runs the reduction of one slot of `slot_units` units over every worker:
/// each worker's cells summed on its group's servers, the servers' pieces
/// summed across the groups by each interval's holders and sent back, the
/// final ranges back to the workers. Returns every worker's slot.
fn reduce(g: &ServerGroups, slot_units: u64) -> Vec<Vec<u64>> {
    let servers = g.servers();
    let len = slot_units as usize;
    // Per server (of the rail group), its range's partial sum, unit by unit
    // over the whole slot (units outside its range stay unused).
    let mut partial = vec![vec![0u64; len]; servers.machines() as usize];
    for machine in 0..g.machines() {
        let group = g.locate_worker(machine).unwrap().group;
        for member in 0..servers.size(group).unwrap() {
            let server = servers.machine(group, member).unwrap() as usize;
            for unit in g.cell(slot_units, machine, member).unwrap() {
                partial[server][unit as usize] += value(machine, unit);
            }
        }
    }
    // Across: each interval's piece of group `h` reduced by its holder in
    // `h` over the other holders' partial sums, then sent back to them.
    let mut total = partial.clone();
    for interval in servers.intervals(slot_units) {
        let holders: Vec<usize> = (0..servers.groups())
            .map(|group| {
                let member = servers.holder(slot_units, group, interval.start).unwrap();
                servers.machine(group, member).unwrap() as usize
            })
            .collect();
        for group in 0..servers.groups() {
            for unit in servers.piece(&interval, group).unwrap() {
                let sum: u64 = holders.iter().map(|&s| partial[s][unit as usize]).sum();
                for &s in &holders {
                    total[s][unit as usize] = sum;
                }
            }
        }
    }
    // Back to the workers: each server's range, from its final values.
    (0..g.machines())
        .map(|machine| {
            let group = g.locate_worker(machine).unwrap().group;
            let mut slot = vec![0u64; len];
            for member in 0..servers.size(group).unwrap() {
                let server = servers.machine(group, member).unwrap() as usize;
                for unit in g.cell(slot_units, machine, member).unwrap() {
                    slot[unit as usize] = total[server][unit as usize];
                }
            }
            slot
        })
        .collect()
}

fn check_sum(g: &ServerGroups, slot_units: u64) -> Result<(), TestCaseError> {
    let slots = reduce(g, slot_units);
    for unit in 0..slot_units {
        let want: u64 = (0..g.machines()).map(|m| value(m, unit)).sum();
        for (machine, slot) in slots.iter().enumerate() {
            prop_assert_eq!(
                slot[unit as usize],
                want,
                "worker {} unit {} of {} ({:?})",
                machine,
                unit,
                slot_units,
                g
            );
        }
    }
    Ok(())
}

/// Every unit each server's range covers lies in exactly one interval, and
/// every interval lies in one range of each group: what the reduction above
/// relies on, checked on its own so that a failure names it.
fn check_intervals(servers: MachineGroups, slot_units: u64) -> Result<(), TestCaseError> {
    let mut at = 0;
    for interval in servers.intervals(slot_units) {
        prop_assert_eq!(interval.start, at);
        prop_assert!(interval.end > interval.start);
        for group in 0..servers.groups() {
            let member = servers.holder(slot_units, group, interval.start).unwrap();
            let range: Range<u64> = servers.range(slot_units, group, member).unwrap();
            prop_assert!(range.start <= interval.start && interval.end <= range.end);
        }
        at = interval.end;
    }
    prop_assert_eq!(at, slot_units);
    Ok(())
}

/// Every holder of an interval of a server's range, in every other group and
/// for every slot of up to `most_units`, is among that group's
/// [`ServerGroups::across_partners`] of the server: the servers it links with.
fn check_partners(g: &ServerGroups, most_units: u64) -> Result<(), TestCaseError> {
    let servers = g.servers();
    for units in 0..=most_units {
        for server in 0..servers.machines() {
            let roles = servers.roles(units, server).unwrap();
            let own = roles.membership().group;
            for across in roles.across() {
                for group in (0..servers.groups()).filter(|&h| h != own) {
                    let holder = servers.holder(units, group, across.interval.start).unwrap();
                    let partners = g.across_partners(server, group).unwrap();
                    prop_assert!(
                        partners.contains(&holder),
                        "{units} units: server {server}'s holder {holder} of group {group} \
                         is not among {partners:?}"
                    );
                }
            }
            prop_assert_eq!(g.across_partners(server, own).unwrap(), 0..0);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_servers_partners_across_hold_every_interval_of_its_range(
        servers in 4u32..=48,
        size in 2u32..=24,
    ) {
        if let Some(g) = groups(servers, servers, size) {
            check_partners(&g, 600)?;
        }
    }

    #[test]
    fn workers_and_cells_follow_the_groups(
        machines in 1u32..=300,
        servers in 4u32..=300,
        size in 2u32..=150,
        slot_units in 0u64..=2_000,
    ) {
        match groups(machines, servers, size) {
            Some(g) => check_groups(&g, slot_units)?,
            None => {
                // Refused: the servers make no two levels, or too few workers.
                let two_levels = MachineGroups::new(servers, size);
                match (two_levels, ServerGroups::new(machines, servers, size)) {
                    (Err(e), Err(refused)) => prop_assert_eq!(e, refused),
                    (Ok(groups), Err(refused)) => prop_assert_eq!(
                        refused,
                        PlanError::TooFewWorkers { machines, groups: groups.groups() }
                    ),
                    (_, Ok(_)) => prop_assert!(false, "refused and made"),
                }
            }
        }
    }

    #[test]
    fn every_worker_ends_with_the_sum(
        machines in 1u32..=64,
        servers in 4u32..=64,
        size in 2u32..=32,
        slot_units in 0u64..=300,
    ) {
        if let Some(g) = groups(machines, servers, size) {
            check_intervals(g.servers(), slot_units)?;
            check_sum(&g, slot_units)?;
        }
    }
}

/// Cases the ranges make hard: fewer units than a group has servers (empty
/// ranges), groups of unequal size on both sides, one worker a group, and
/// the study's 2048 GPUs (256 machines and servers in groups of 64).
#[test]
fn chosen_cases_end_with_the_sum() {
    for (machines, servers, size, units) in [
        (4, 4, 2, 1),
        (4, 4, 2, 3),
        (2, 4, 2, 7),
        (5, 9, 4, 10),
        (8, 7, 3, 11),
        (3, 12, 4, 100),
        (17, 10, 3, 29),
        (256, 256, 64, 1600),
    ] {
        let g = ServerGroups::new(machines, servers, size).unwrap();
        check_groups(&g, units).unwrap();
        check_intervals(g.servers(), units).unwrap();
        check_sum(&g, units).unwrap();
        check_partners(&g, 300).unwrap();
    }
    assert_eq!(
        ServerGroups::new(2, 12, 4),
        Err(PlanError::TooFewWorkers {
            machines: 2,
            groups: 3
        })
    );
    assert_eq!(
        ServerGroups::new(0, 4, 2),
        Err(PlanError::MachineOutOfRange {
            machine: 0,
            machines: 0
        })
    );
    assert_eq!(
        ServerGroups::new(8, 5, 2),
        Err(PlanError::InvalidGroupSize {
            size: 2,
            machines: 5
        })
    );
}

/// Every check of a geometry with its servers in groups on one tensor: every
/// slot is one cell; a worker's role sends and receives one cell per nonempty
/// range of its group's servers; every server's range and pieces fit their
/// areas, and the areas tile the buffer without overlap.
fn check_geometry(geometry: &Geometry, elements: u64) -> Result<(), TestCaseError> {
    let groups = geometry.server_groups().unwrap();
    prop_assert_eq!(geometry.routing(), Routing::Groups);
    prop_assert_eq!(geometry.shards_per_full_slice(), 1);
    prop_assert!(geometry.server_layout().is_none());
    let layout = geometry.server_group_layout().unwrap();
    let servers = groups.servers();
    // The areas, in order, end to end.
    let mut areas = vec![layout.accumulator()];
    for member in 1..groups.most_workers() {
        areas.push(layout.within(member).unwrap());
    }
    prop_assert!(layout.within(0).is_err());
    prop_assert!(layout.within(groups.most_workers()).is_err());
    let own = servers.first(0).unwrap();
    for interval in 0..2 {
        for group in 1..servers.groups() {
            let from = servers.first(group).unwrap();
            areas.push(layout.across(interval, from, own).unwrap());
        }
    }
    let mut at = 0;
    for area in &areas {
        prop_assert_eq!(area.byte_offset(), at);
        at += area.byte_len();
    }
    prop_assert_eq!(at, layout.total_bytes());
    let plan = Plan::new(geometry, DataType::F32, elements, 0).unwrap();
    let devices = geometry.topology().devices_per_machine();
    for slice in plan.slices() {
        prop_assert_eq!(slice.shards(), 1);
        for device in 0..devices {
            let units = slice.group_units(device).unwrap();
            let span_of = |r: Range<u64>| slice.slot_units_span(device, r).unwrap().byte_len();
            for machine in 0..geometry.topology().machines() {
                let group = groups.locate_worker(machine).unwrap().group;
                let members = servers.size(group).unwrap();
                let cells = (0..members)
                    .filter(|&i| !groups.cell(units, machine, i).unwrap().is_empty())
                    .count() as u16;
                let role = slice.role(Location { machine, device }).unwrap();
                let want = if slice.slot(device).unwrap().is_empty() {
                    0
                } else {
                    cells
                };
                prop_assert_eq!(role.contributions_to_send, want);
                prop_assert_eq!(role.results_to_receive, want);
                prop_assert!(!role.reduces);
            }
            for server in 0..servers.machines() {
                let roles = servers.roles(units, server).unwrap();
                prop_assert!(span_of(roles.range()) <= layout.within_stride());
                prop_assert!(roles.range().end <= units);
                for across in roles.across() {
                    prop_assert!(span_of(across.piece.clone()) <= layout.across_stride());
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_geometry_in_server_groups_fits_every_slice(
        machines in 1u32..=24,
        devices in 1u32..=4,
        per_rail in 4u32..=24,
        size in 2u32..=12,
        slice_kib in 1u64..=64,
        elements in 0u64..=100_000,
    ) {
        let topology = Topology::new(machines, devices, RankLayout::Contiguous).unwrap();
        let config = PlanConfig::new(slice_kib * 1024, PlanConfig::MIN_SHARD_FLOOR).unwrap();
        match Geometry::with_servers_in_groups(topology, config, per_rail * devices, size) {
            Ok(g) => check_geometry(&g, elements)?,
            Err(e) => prop_assert_eq!(
                Err(e),
                ServerGroups::new(machines, per_rail, size).map(|_| ())
            ),
        }
    }
}

/// Servers that do not serve one rail each make no groups; where a full
/// slot cannot give every server a cell of the minimum shard,
/// `with_servers` forms groups itself, of at most
/// [`PlanConfig::DEFAULT_SERVER_GROUP_SIZE`] or half the servers of a rail,
/// and not in one level.
#[test]
fn servers_form_groups_where_their_cells_would_fall_below_the_minimum() {
    let topology = Topology::new(256, 8, RankLayout::Contiguous).unwrap();
    assert_eq!(
        Geometry::with_servers_in_groups(topology, PlanConfig::DEFAULT, 12, 2),
        Err(PlanError::ServersNotPerRail {
            servers: 12,
            devices: 8
        })
    );
    let config =
        PlanConfig::with_default_slices(PlanConfig::DEFAULT_SERVER_MIN_SHARD_BYTES).unwrap();
    // 25 MiB slices, 3.125 MiB slots: 200 cells of 16 KiB.
    for (machines, grouped) in [(200u32, false), (201, true), (256, true)] {
        let topology = Topology::new(machines, 8, RankLayout::Contiguous).unwrap();
        let g = Geometry::with_servers(topology, config, 8 * machines).unwrap();
        // Groups of at most 64, as even as can be: 201 in four of 51 and 50.
        let groups = machines.div_ceil(64);
        let largest = grouped.then(|| machines.div_ceil(groups));
        assert_eq!(
            g.server_groups().map(|groups| groups.servers().largest()),
            largest,
            "{machines} machines"
        );
        assert_eq!(
            PlanConfig::default_server_group_size(machines),
            64.min(machines / 2)
        );
        if g.server_groups().is_some() {
            check_geometry(&g, 64 << 18).unwrap();
        }
        let one = Geometry::with_servers(topology, config.in_one_level(), 8 * machines).unwrap();
        assert!(one.server_groups().is_none());
    }
    // Fewer servers than a slot's cells of the minimum, or not one per
    // rail: flat.
    let topology = Topology::new(256, 8, RankLayout::Contiguous).unwrap();
    assert!(
        Geometry::with_servers(topology, config, 8 * 200)
            .unwrap()
            .server_groups()
            .is_none()
    );
    assert!(
        Geometry::with_servers(topology, config, 4 * 256 + 4)
            .unwrap()
            .server_groups()
            .is_none()
    );
}
