//! Property tests of machines in groups (`plan/groups.rs`): the groups are
//! consecutive, as even as can be and never of one machine (a size that
//! would leave one is refused), each group's ranges tile a slot within
//! one unit of each other, the intervals tile the slot and each lies within
//! one range of every group (its holder), a range meets at most two
//! intervals (one where the groups are equal), and each interval's pieces
//! tile it.

use fairring_core::plan::{MachineGroups, Membership, PlanError};
use fairring_core::topology::MAX_MACHINES;
use proptest::prelude::*;

/// Checks `m` machines in groups of about `size` over a slot of `units`;
/// fails naming what broke.
fn check(m: u32, size: u32, units: u64) -> Result<(), TestCaseError> {
    let groups = match MachineGroups::new(m, size) {
        Ok(groups) => groups,
        Err(e) => {
            prop_assert_eq!(e, PlanError::InvalidGroupSize { size, machines: m });
            prop_assert!(
                m / m.div_ceil(size) < 2,
                "M {} in groups of {} refused",
                m,
                size
            );
            return Ok(());
        }
    };
    let q = groups.groups();
    let what = format!("M {m}, size {size}, {units} units");
    prop_assert_eq!(q, m.div_ceil(size), "{}", what);
    // Consecutive, as even as can be, every machine located where it is.
    let (mut next, mut lens) = (0u32, Vec::new());
    for group in 0..q {
        let len = groups.size(group).unwrap();
        prop_assert_eq!(groups.first(group).unwrap(), next, "{}", what);
        for member in 0..len {
            let machine = groups.machine(group, member).unwrap();
            prop_assert_eq!(machine, next + member, "{}", what);
            prop_assert_eq!(
                groups.locate(machine).unwrap(),
                Membership { group, member }
            );
        }
        next += len;
        lens.push(len);
    }
    prop_assert_eq!(next, m, "{}", what);
    let (lo, hi) = (*lens.iter().min().unwrap(), *lens.iter().max().unwrap());
    prop_assert!(
        lo >= 2 && hi - lo <= 1 && hi == groups.largest(),
        "{}: sizes {:?}",
        what,
        lens
    );
    prop_assert!(
        lens.windows(2).all(|w| w[0] >= w[1]),
        "{}: larger first",
        what
    );
    // Each group's ranges tile the slot, within one unit of each other.
    for group in 0..q {
        let len = lens[group as usize];
        let mut at = 0;
        for member in 0..len {
            let r = groups.range(units, group, member).unwrap();
            prop_assert_eq!(r.start, at, "{}", what);
            let n = r.end - r.start;
            prop_assert!(n >= units / u64::from(len) && n <= units.div_ceil(u64::from(len)));
            for unit in [r.start, r.end.saturating_sub(1)] {
                if unit >= r.start && unit < r.end {
                    prop_assert_eq!(groups.holder(units, group, unit).unwrap(), member);
                }
            }
            at = r.end;
        }
        prop_assert_eq!(at, units, "{}", what);
    }
    // The intervals tile the slot; each lies within one range of every
    // group; a range meets at most two of them (one with equal groups);
    // each interval's pieces tile it.
    let mut met = vec![0u32; m as usize];
    let mut at = 0;
    for interval in groups.intervals(units) {
        prop_assert_eq!(interval.start, at, "{}", what);
        prop_assert!(interval.end > interval.start, "{}", what);
        at = interval.end;
        for group in 0..q {
            let holder = groups.holder(units, group, interval.start).unwrap();
            prop_assert_eq!(
                groups.holder(units, group, interval.end - 1).unwrap(),
                holder
            );
            met[groups.machine(group, holder).unwrap() as usize] += 1;
        }
        let mut p = interval.start;
        let n = interval.end - interval.start;
        for group in 0..q {
            let piece = groups.piece(&interval, group).unwrap();
            prop_assert_eq!(piece.start, p, "{}", what);
            let len = piece.end - piece.start;
            prop_assert!(len >= n / u64::from(q) && len <= n.div_ceil(u64::from(q)));
            p = piece.end;
        }
        prop_assert_eq!(p, interval.end, "{}", what);
    }
    prop_assert_eq!(at, units, "{}", what);
    let most = if lo == hi { 1 } else { 2 };
    prop_assert!(
        met.iter().all(|&k| k <= most),
        "{}: a range meets {:?}",
        what,
        met.iter().max()
    );
    Ok(())
}

/// A machine count, and a group size from 2 to half of it.
fn machines_and_size() -> impl Strategy<Value = (u32, u32)> {
    prop_oneof![3 => 4u32..=64, 2 => 65u32..=512, 1 => 513u32..=MAX_MACHINES]
        .prop_flat_map(|m| (Just(m), 2u32..=m / 2))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn groups_ranges_and_intervals_tile_the_slot(
        (m, size) in machines_and_size(),
        units in prop_oneof![1u64..=64, 65u64..=1 << 20, Just(1u64 << 24)],
    ) {
        check(m, size, units)?;
    }
}

#[test]
fn groups_that_divide_the_machines_have_their_ranges_as_intervals() {
    for (m, size) in [(4, 2), (256, 64), (256, 16), (128, 32), (64, 8)] {
        let groups = MachineGroups::new(m, size).unwrap();
        let units = 1 << 16;
        let ranges: Vec<_> = (0..size)
            .map(|i| groups.range(units, 0, i).unwrap())
            .collect();
        let intervals: Vec<_> = groups.intervals(units).collect();
        assert_eq!(intervals, ranges, "M {m}, size {size}");
        check(m, size, units).unwrap();
    }
    // 255 machines in groups of about 64: 4 groups, 64, 64, 64 and 63.
    let groups = MachineGroups::new(255, 64).unwrap();
    let lens: Vec<u32> = (0..4).map(|g| groups.size(g).unwrap()).collect();
    assert_eq!(lens, [64, 64, 64, 63]);
    assert_eq!(
        groups.locate(254).unwrap(),
        Membership {
            group: 3,
            member: 62
        }
    );
}

#[test]
fn what_is_out_of_range_is_named() {
    for (m, size) in [(3, 2), (8, 1), (8, 5), (0, 2), (5, 2), (65, 2)] {
        let e = MachineGroups::new(m, size).unwrap_err();
        assert_eq!(e, PlanError::InvalidGroupSize { size, machines: m });
        assert!(
            e.to_string()
                .contains(&format!("groups of {size} machines")),
            "{e}"
        );
    }
    assert!(matches!(
        MachineGroups::new(MAX_MACHINES + 1, 2),
        Err(PlanError::MachineOutOfRange { .. })
    ));
    let groups = MachineGroups::new(10, 3).unwrap();
    assert_eq!(groups.groups(), 4);
    let past = PlanError::GroupOutOfRange {
        group: 4,
        groups: 4,
    };
    assert_eq!(groups.size(4), Err(past));
    assert_eq!(groups.first(4), Err(past));
    assert_eq!(groups.machine(4, 0), Err(past));
    assert_eq!(groups.range(100, 4, 0), Err(past));
    assert_eq!(groups.holder(100, 4, 0), Err(past));
    assert_eq!(groups.piece(&(0..10), 4), Err(past));
    assert_eq!(
        groups.range(100, 2, 2),
        Err(PlanError::MemberOutOfRange {
            member: 2,
            members: 2
        })
    );
    // A reversed range is taken as empty, not overflowed.
    #[expect(clippy::reversed_empty_ranges, reason = "the case under test")]
    let reversed = 10..4;
    assert_eq!(groups.piece(&reversed, 0), Ok(10..10));
    assert_eq!(
        groups.machine(2, 2),
        Err(PlanError::MemberOutOfRange {
            member: 2,
            members: 2
        })
    );
    assert_eq!(
        groups.holder(100, 0, 100),
        Err(PlanError::UnitOutOfRange {
            unit: 100,
            units: 100
        })
    );
    assert!(matches!(
        groups.locate(10),
        Err(PlanError::MachineOutOfRange { .. })
    ));
    assert_eq!(groups.intervals(0).count(), 0);
}
