//! Property tests of machines in groups (`plan/groups.rs`): the groups are
//! consecutive, as even as can be and never of one machine (a size that
//! would leave one is refused), each group's ranges tile a slot within
//! one unit of each other, the intervals tile the slot and each lies within
//! one range of every group (its holder), a range meets at most two
//! intervals (one where the groups are equal), and each interval's pieces
//! tile it.

use fairring_core::DataType;
use fairring_core::plan::{
    Geometry, InputArea, MachineGroups, Membership, Plan, PlanConfig, PlanError, Routing,
};
use fairring_core::topology::{Location, MAX_MACHINES, RankLayout, Topology};
use fairring_core::wire::{FrameCheck, WireError};
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

/// A geometry in groups over `m` machines of `d` devices: every slice of a
/// tensor of `elements` of `dtype` has one cell a slot; every group's
/// ranges of each slot, in elements, tile the slot (the last ending at its
/// end, with any part of a unit), each interval's pieces tile the interval;
/// every range and piece fits its staging area; the staging budget counts
/// the two levels' buffer; and what a flat plan's queries assume is refused.
fn check_geometry(
    (m, size): (u32, u32),
    d: u32,
    slice_bytes: u64,
    dtype: DataType,
    elements: u64,
) -> Result<(), TestCaseError> {
    let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
    let config = PlanConfig::new(slice_bytes, 64).unwrap();
    let geometry = match Geometry::with_groups(topology, config, size) {
        Ok(g) => g,
        Err(e) => {
            prop_assert!(
                matches!(
                    e,
                    PlanError::InvalidGroupSize { .. } | PlanError::SliceTooSmall { .. }
                ),
                "{e}"
            );
            return Ok(());
        }
    };
    let what =
        format!("{m}x{d} in groups of {size}, {slice_bytes}-byte slices, {elements} {dtype:?}");
    prop_assert_eq!(geometry.routing(), Routing::Groups, "{}", what);
    prop_assert_eq!(geometry.shards_per_full_slice(), 1, "{}", what);
    let groups = geometry.machine_groups().unwrap();
    let layout = geometry.two_level_layout(InputArea::Slot).unwrap();
    prop_assert_eq!(
        geometry.staging_buffers(layout.total_bytes() * 3),
        Ok(3),
        "{}",
        what
    );
    prop_assert_eq!(
        geometry.staging_layout().contribution(0, 1),
        Err(PlanError::RoutedInGroups),
        "{}",
        what
    );
    let plan = Plan::new(&geometry, dtype, elements, 0).unwrap();
    let size_of = dtype.size_bytes();
    for slice in plan.slices() {
        prop_assert_eq!(slice.shards(), 1, "{}", what);
        prop_assert_eq!(slice.machine_groups(), Some(groups), "{}", what);
        prop_assert_eq!(slice.shard_served_by(0), Ok(None), "{}", what);
        prop_assert_eq!(
            slice.role(Location {
                machine: 0,
                device: 0
            }),
            Err(PlanError::RoutedInGroups),
            "{}",
            what
        );
        for device in 0..d {
            let slot = slice.slot(device).unwrap();
            let units = slice.group_units(device).unwrap();
            prop_assert_eq!(units, slot.len().div_ceil(64 / size_of), "{}", what);
            let span = |r: core::ops::Range<u64>| slice.slot_units_span(device, r).unwrap();
            for group in 0..groups.groups() {
                let mut at = slot.offset();
                for member in 0..groups.size(group).unwrap() {
                    let range = groups.range(units, group, member).unwrap();
                    let s = span(range.clone());
                    prop_assert_eq!(
                        s.offset(),
                        at,
                        "{}: group {} member {}",
                        what,
                        group,
                        member
                    );
                    prop_assert!(s.byte_len() <= layout.within_stride(), "{}", what);
                    at += s.len();
                }
                prop_assert_eq!(at, slot.offset() + slot.len(), "{}: group {}", what, group);
            }
            for interval in groups.intervals(units) {
                let mut at = span(interval.clone()).offset();
                for group in 0..groups.groups() {
                    let piece = span(groups.piece(&interval, group).unwrap());
                    prop_assert_eq!(piece.offset(), at, "{}", what);
                    prop_assert!(piece.byte_len() <= layout.across_stride(), "{}", what);
                    at += piece.len();
                }
                let whole = span(interval);
                prop_assert_eq!(at, whole.offset() + whole.len(), "{}", what);
            }
        }
    }
    prop_assert_eq!(
        FrameCheck::new(1, 0, &geometry),
        Err(WireError::RoutedInGroups),
        "{}",
        what
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn a_geometry_in_groups_cuts_every_slot_the_same_way(
        machines in machines_and_size(),
        d in 1u32..=4,
        slice_bytes in prop_oneof![Just(64u64), 64u64..=4096, Just(64 << 10)],
        dtype in prop_oneof![Just(DataType::U8), Just(DataType::F16), Just(DataType::F32), Just(DataType::I64)],
        elements in prop_oneof![0u64..=3, 1u64..=20_000],
    ) {
        check_geometry(machines, d, slice_bytes, dtype, elements)?;
    }
}

/// Groups in a configuration's own slices
/// (`Geometry::with_groups_in_its_slices`): the machines in the groups
/// `Geometry::with_groups` makes, but in the default 25 MiB slices, not the
/// wide 32 MiB ones, still cut for small tensors; a tensor's slices tile
/// it, none larger than a full one, and a tensor of at least four of the
/// smallest cut slices (16 MiB) is cut in four or more.
fn check_groups_in_own_slices(
    (m, size): (u32, u32),
    d: u32,
    min_shard: u64,
    bytes: u64,
) -> Result<(), TestCaseError> {
    let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
    let config = PlanConfig::with_default_slices(min_shard).unwrap();
    let what = format!("{m}x{d} in groups of {size}, {min_shard}-byte shards, {bytes} bytes");
    let (own, wide) = match (
        Geometry::with_groups_in_its_slices(topology, config, size),
        Geometry::with_groups(topology, config, size),
    ) {
        (Ok(own), Ok(wide)) => (own, wide),
        (Err(a), Err(b)) => {
            prop_assert_eq!(a, b, "{}", what);
            return Ok(());
        }
        (a, b) => {
            return Err(TestCaseError::fail(format!(
                "{what}: in its slices {a:?}, wide {b:?}"
            )));
        }
    };
    prop_assert_eq!(own.routing(), Routing::Groups, "{}", what);
    prop_assert_eq!(own.machine_groups(), wide.machine_groups(), "{}", what);
    prop_assert!(
        own.full_slice_bytes() <= PlanConfig::DEFAULT_SLICE_BYTES,
        "{}: {}",
        what,
        own.full_slice_bytes()
    );
    let plan = Plan::new(&own, DataType::U8, bytes, 0).unwrap();
    let mut at = 0;
    for slice in plan.slices() {
        prop_assert_eq!(slice.span().offset(), at, "{}", what);
        prop_assert!(slice.span().len() <= own.full_slice_bytes(), "{}", what);
        at += slice.span().len();
    }
    prop_assert_eq!(at, bytes, "{}", what);
    if bytes >= 4 * PlanConfig::SMALLEST_CUT_SLICE_BYTES {
        prop_assert!(
            plan.slice_count() >= 4,
            "{}: {} slices",
            what,
            plan.slice_count()
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn groups_in_their_own_slices_cut_small_tensors(
        machines in machines_and_size(),
        d in prop_oneof![Just(1u32), Just(8), 1u32..=16],
        min_shard in prop_oneof![Just(64u64), Just(4096), Just(64 << 10)],
        bytes in prop_oneof![0u64..=4096, 1u64..=(200 << 20)],
    ) {
        check_groups_in_own_slices(machines, d, min_shard, bytes)?;
    }
}
