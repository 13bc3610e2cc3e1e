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

use fairring_core::plan::{MachineGroups, PlanError, ServerGroups};
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
            prop_assert_eq!(servers.clone(), first..first + g.servers().size(group).unwrap());
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
        Err(PlanError::MachineOutOfRange { machine: m, machines: m })
    );
    prop_assert_eq!(
        g.workers(q),
        Err(PlanError::GroupOutOfRange { group: q, groups: q })
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

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
