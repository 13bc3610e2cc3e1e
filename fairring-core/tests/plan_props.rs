//! Property tests of the plan: the invariants of docs/DESIGN.md section 3 over random
//! tensors, element types, topologies (M up to 4096, D up to 16), slice sizes and
//! minimum shard sizes.

use fairring_core::DataType;
use fairring_core::plan::{
    ALIGN_BYTES, Geometry, InputArea, Plan, PlanConfig, Routing, SERVER_FOLD_CELLS, Slice,
    TREE_PARTS, TREES,
};
use fairring_core::staging::Role;
use fairring_core::topology::{Location, MAX_MACHINES, RankLayout, Topology};
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = DataType> {
    prop::sample::select(DataType::ALL.to_vec())
}

/// Machines: mostly small, sometimes up to the limit.
fn machines() -> impl Strategy<Value = u32> {
    prop_oneof![4 => 1u32..=16, 2 => 17u32..=256, 1 => 257u32..=4096]
}

/// A byte size spread over orders of magnitude.
fn log_size(max_log2: u32) -> impl Strategy<Value = u64> {
    (6u32..=max_log2, any::<u64>()).prop_map(|(exp, r)| {
        let lo = 1u64 << exp;
        lo + r % lo
    })
}

prop_compose! {
    /// A geometry of a given slice size, or (one in four) of the default
    /// slices in one level, which the routing picks (flat or through the
    /// trees; groups have properties of their own, `groups_props.rs`).
    fn geometry()(m in machines(), d in 1u32..=16, slice in log_size(26), min_shard in log_size(20),
                  default_slices in prop::bool::weighted(0.25))
        -> Geometry
    {
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let slice = slice.max(u64::from(d) * ALIGN_BYTES);
        let config = if default_slices {
            PlanConfig::with_default_slices(min_shard).unwrap().in_one_level()
        } else {
            PlanConfig::new(slice, min_shard).unwrap()
        };
        Geometry::new(topology, config).unwrap()
    }
}

prop_compose! {
    /// A plan with up to a few hundred slices, tail included.
    fn plan()(g in geometry(), dtype in dtype(), slices in 0u64..300, frac in 0u64..=1000, rot in any::<u64>())
        -> Plan
    {
        let per_slice = g.full_slice_bytes() / dtype.size_bytes();
        let n = slices * per_slice + per_slice * frac / 1000;
        Plan::new(&g, dtype, n, rot).unwrap()
    }
}

/// The slices worth checking cell by cell: first, last and a few in between.
fn sample_slices(plan: &Plan, picks: &[u64]) -> Vec<Slice> {
    let n = plan.slice_count();
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u64> = vec![0, n - 1];
    idx.extend(picks.iter().map(|p| p % n));
    idx.sort_unstable();
    idx.dedup();
    idx.into_iter().map(|i| plan.slice(i).unwrap()).collect()
}

fn check_slice(plan: &Plan, slice: &Slice) -> Result<(), TestCaseError> {
    let g = plan.geometry();
    let topo = g.topology();
    let (m, d) = (topo.machines(), topo.devices_per_machine());
    let k = slice.shards();
    let layout = g.staging_layout();
    let whole = g.staging_layout_with(InputArea::Slice);
    let span = slice.span();
    prop_assert!(k >= 1 && k <= m, "shards {k} for {m} machines");

    // Equal slots are the slice's `d` equal chunks, slot `i` the `i`th: one
    // reduce-scatter of the slice serves them.
    let slots: Vec<_> = (0..d).map(|i| slice.slot(i).unwrap()).collect();
    let chunk = span.len() / u64::from(d);
    let chunks = span.len().is_multiple_of(u64::from(d))
        && slots
            .iter()
            .zip(0u64..)
            .all(|(s, i)| s.offset() == span.offset() + i * chunk && s.len() == chunk);
    prop_assert_eq!(
        slice.slots_equal(),
        chunks,
        "slots {:?} of {:?}",
        slots,
        span
    );

    // Cells travel whole straight to their server; through the trees in as
    // many parts of at least the minimum shard as the smallest cell holds, at
    // most TREE_PARTS; else in two where it has two units, else whole.
    let unit_elements = ALIGN_BYTES / plan.dtype().size_bytes();
    let fewest_units = slice
        .cells()
        .map(|c| c.span().len() / unit_elements)
        .min()
        .unwrap_or(0);
    let min_units = g.min_shard_bytes() / ALIGN_BYTES;
    let fit = fewest_units / min_units;
    let parts = match slice.double_tree() {
        None => 1,
        Some(_) if fit >= 2 => fit.min(u64::from(TREE_PARTS)),
        Some(_) => fewest_units.clamp(1, 2),
    };
    prop_assert_eq!(u64::from(slice.parts()), parts);
    for cell in slice.cells() {
        // Parts tile the cell, in order, aligned, none empty but an empty cell's.
        prop_assert_eq!(cell.parts(), slice.parts());
        let mut at = cell.span().offset();
        for p in 0..cell.parts() {
            let part = cell.part(p).unwrap();
            prop_assert_eq!(part.offset(), at, "part {} of {:?}", p, cell);
            prop_assert!(
                !part.is_empty() || cell.span().is_empty(),
                "part {} of {:?} is empty",
                p,
                cell
            );
            prop_assert_eq!(part.byte_offset() % ALIGN_BYTES, 0);
            if fit >= 2 {
                prop_assert!(
                    part.byte_len() >= g.min_shard_bytes(),
                    "part {} of {:?}",
                    p,
                    cell
                );
            }
            at = part.end();
        }
        prop_assert_eq!(at, cell.span().end());
        prop_assert!(cell.part(cell.parts()).is_err());
    }

    // Cells tile the slice exactly, in order.
    let mut next = span.offset();
    let (mut min_len, mut max_len) = (u64::MAX, 0);
    let mut count = 0u64;
    for cell in slice.cells() {
        prop_assert_eq!(
            cell.span().offset(),
            next,
            "gap or overlap before cell {:?}",
            cell
        );
        next = cell.span().end();
        count += 1;
        let bytes = cell.span().byte_len();
        min_len = min_len.min(bytes);
        max_len = max_len.max(bytes);
        // Aligned from the start of the tensor.
        prop_assert_eq!(cell.span().byte_offset() % ALIGN_BYTES, 0);
        // Its server serves exactly this shard.
        prop_assert!(cell.server() < m);
        prop_assert_eq!(
            slice.server(cell.device(), cell.shard()).unwrap(),
            cell.server()
        );
        prop_assert_eq!(
            slice.shard_served_by(cell.server()).unwrap(),
            Some(cell.shard())
        );
        // It lies inside its slot, at its slot offset.
        let slot = slice.slot(cell.device()).unwrap();
        prop_assert_eq!(
            slot.offset() + cell.slot_span().offset(),
            cell.span().offset()
        );
        prop_assert!(cell.span().end() <= slot.end());
        // Adaptive sharding: with more than one shard, no shard below the minimum.
        if k > 1 {
            prop_assert!(bytes >= g.min_shard_bytes(), "shard of {bytes} B < minimum");
        }
        // The staging layout holds it.
        prop_assert!(
            bytes <= layout.shard_stride(),
            "cell {bytes} B > stride {}",
            layout.shard_stride()
        );
        prop_assert!(cell.slot_span().byte_end() <= layout.slot().byte_len());
        // Its byte range within the slice, as an engine slices memory with it.
        let within = cell.span().byte_range_in(span).unwrap();
        prop_assert_eq!(
            within.start as u64,
            cell.span().byte_offset() - span.byte_offset()
        );
        prop_assert_eq!(within.len() as u64, bytes);
        prop_assert!(within.end as u64 <= whole.slot().byte_len());
        prop_assert_eq!(cell.span().byte_range().unwrap().len() as u64, bytes);
    }
    // A cell does not lie within another (non-empty) cell.
    let non_empty: Vec<_> = slice.cells().filter(|c| !c.span().is_empty()).collect();
    for pair in non_empty.windows(2) {
        prop_assert!(pair[1].span().byte_range_in(pair[0].span()).is_none());
        prop_assert!(pair[0].span().byte_range_in(pair[1].span()).is_none());
    }
    prop_assert_eq!(next, span.end(), "cells do not reach the end of the slice");
    prop_assert_eq!(count, u64::from(d) * u64::from(k));
    // Balanced within one alignment unit.
    prop_assert!(
        max_len - min_len <= ALIGN_BYTES,
        "cells from {min_len} to {max_len} B"
    );

    // Slots tile the slice and are balanced too.
    let mut next = span.offset();
    let (mut lo, mut hi) = (u64::MAX, 0);
    for dev in 0..d {
        let slot = slice.slot(dev).unwrap();
        prop_assert_eq!(slot.offset(), next);
        next = slot.end();
        lo = lo.min(slot.byte_len());
        hi = hi.max(slot.byte_len());
        prop_assert!(slot.byte_len() <= layout.slot().byte_len());
    }
    prop_assert_eq!(next, span.end());
    prop_assert!(hi - lo <= ALIGN_BYTES);

    // Servers of the k shards are distinct machines.
    let mut servers: Vec<u32> = (0..k).map(|j| slice.server(0, j).unwrap()).collect();
    servers.sort_unstable();
    servers.dedup();
    prop_assert_eq!(servers.len(), k as usize);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn cells_partition_balance_align_and_fit(plan in plan(), picks in prop::collection::vec(any::<u64>(), 3)) {
        for slice in sample_slices(&plan, &picks) {
            check_slice(&plan, &slice)?;
        }
    }

    #[test]
    fn slices_tile_the_tensor(plan in plan()) {
        let mut next = 0;
        for (i, slice) in plan.slices().enumerate() {
            prop_assert_eq!(slice.index(), i as u64);
            prop_assert_eq!(slice.span().offset(), next);
            prop_assert!(!slice.span().is_empty());
            prop_assert!(slice.span().byte_len() <= plan.geometry().full_slice_bytes());
            prop_assert!(plan.geometry().full_slice_bytes() <= plan.geometry().config().slice_bytes());
            if i as u64 + 1 < plan.slice_count() {
                prop_assert_eq!(slice.span().len(), plan.slice_elements());
            }
            next = slice.span().end();
        }
        prop_assert_eq!(next, plan.elements());
        prop_assert!(plan.slice(plan.slice_count()).is_err());
    }

    #[test]
    fn every_element_has_exactly_one_owner(plan in plan(), picks in prop::collection::vec(any::<u64>(), 16)) {
        prop_assume!(plan.elements() > 0);
        for p in picks {
            let x = p % plan.elements();
            let cell = plan.locate(x).unwrap();
            prop_assert!(cell.span().offset() <= x && x < cell.span().end(), "element {x} not in {cell:?}");
            let slice = plan.slice(cell.slice()).unwrap();
            prop_assert_eq!(slice.cell(cell.device(), cell.shard()).unwrap(), cell);
            // No other cell of its slice holds it.
            let holders = slice.cells().filter(|c| c.span().offset() <= x && x < c.span().end()).count();
            prop_assert_eq!(holders, 1);
        }
        prop_assert!(plan.locate(plan.elements()).is_err());
    }

    #[test]
    fn roles_are_valid_and_conserve_messages(plan in plan(), picks in prop::collection::vec(any::<u64>(), 2)) {
        let topo = plan.geometry().topology();
        prop_assume!(topo.machines() <= 64);
        for slice in sample_slices(&plan, &picks) {
            for device in 0..topo.devices_per_machine() {
                let (mut sent, mut received, mut results_sent, mut results_received) = (0u64, 0u64, 0u64, 0u64);
                let slot_empty = slice.slot(device).unwrap().is_empty();
                for machine in 0..topo.machines() {
                    let role = slice.role(Location { machine, device }).unwrap();
                    prop_assert!(role.is_valid(), "{role:?}");
                    if slot_empty {
                        prop_assert_eq!(role, Role::IDLE);
                    }
                    // A partial sum sent up is a contribution its parent receives,
                    // and its parent's result one more result received.
                    let up = u64::from(role.forwards);
                    sent += u64::from(role.contributions_to_send) + up;
                    received += u64::from(role.contributions_to_receive);
                    results_sent += u64::from(role.results_to_send);
                    results_received += u64::from(role.results_to_receive) + up;
                }
                // Every contribution sent is received by one server (or parent), and
                // every result sent reaches one client (or child).
                prop_assert_eq!(sent, received);
                prop_assert_eq!(results_sent, results_received);
            }
        }
    }

    #[test]
    fn staging_layout_areas_are_disjoint(g in geometry(), whole_slice in any::<bool>()) {
        let input = if whole_slice { InputArea::Slice } else { InputArea::Slot };
        let layout = g.staging_layout_with(input);
        let m = g.topology().machines();
        prop_assume!(m <= 64);
        prop_assert_eq!(layout.input(), input);
        let input_bytes = if whole_slice { g.full_slice_bytes() } else { g.full_slot_bytes() };
        prop_assert_eq!(layout.slot().byte_len(), input_bytes);
        prop_assert_eq!(g.staging_layout(), g.staging_layout_with(InputArea::Slot));
        prop_assert_eq!((layout.shard_stride() / ALIGN_BYTES) % 2, 1, "even number of cache lines");
        if g.routing() == Routing::Trees {
            // Two areas by child, after the input area, whatever M.
            prop_assert_eq!(layout.contribution_areas(), 2);
            let left = layout.child(0).unwrap();
            let right = layout.child(1).unwrap();
            prop_assert_eq!(left.byte_offset(), layout.slot().byte_end());
            prop_assert_eq!(right.byte_offset(), left.byte_end());
            prop_assert_eq!(right.byte_end(), layout.total_bytes());
            prop_assert!(layout.child(2).is_err());
            prop_assert!(layout.contribution(0, 1).is_err());
            return Ok(());
        }
        prop_assert!(layout.child(0).is_err());
        for own in 0..m {
            let mut areas: Vec<(u64, u64)> = (0..m)
                .filter(|&from| from != own)
                .map(|from| {
                    let a = layout.contribution(from, own).unwrap();
                    (a.byte_offset(), a.byte_end())
                })
                .collect();
            areas.sort_unstable();
            let mut end = layout.slot().byte_end();
            for (start, stop) in areas {
                prop_assert!(start >= end, "overlap");
                prop_assert_eq!(start % ALIGN_BYTES, 0);
                end = stop;
            }
            prop_assert!(end <= layout.total_bytes());
            prop_assert!(layout.contribution(own, own).is_err());
        }
    }
}

/// Per (machine, device) served bytes of a sequence of plans.
fn served_bytes(plans: &[Plan]) -> Vec<Vec<u64>> {
    let topo = plans[0].geometry().topology();
    let mut served =
        vec![vec![0u64; topo.devices_per_machine() as usize]; topo.machines() as usize];
    for plan in plans {
        for slice in plan.slices() {
            for cell in slice.cells() {
                served[cell.server() as usize][cell.device() as usize] += cell.span().byte_len();
            }
        }
    }
    served
}

fn spread(served: &[Vec<u64>], device: usize) -> u64 {
    let col = served.iter().map(|row| row[device]);
    col.clone().max().unwrap() - col.min().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Within one tensor, every machine serves the same bytes on every rail within
    /// one shard (the largest of the plan) plus one alignment unit, however the
    /// shards per slice compare with M.
    #[test]
    fn rotation_is_fair_within_a_tensor(
        m in 1u32..=48, d in 1u32..=4, units in 1u64..=64, min_units in 1u64..=16,
        slices in 1u64..=400, tail in 0u64..=1000, rot in any::<u64>(), dtype in dtype(),
    ) {
        // No more machines than a slot has shards of the minimum, so that
        // the plan is flat: through the trees there are no servers to share
        // the work out to (the properties of `tree_*` below say what holds
        // there). Drawing the machines and rejecting the trees instead
        // rejected seven draws in eight, and now and then more than
        // proptest allows.
        let m = m.min(u32::try_from((units / min_units).max(1)).unwrap());
        let topo = Topology::new(m, d, RankLayout::Interleaved).unwrap();
        let config = PlanConfig::new(units * u64::from(d) * ALIGN_BYTES, min_units * ALIGN_BYTES).unwrap();
        let g = Geometry::new(topo, config).unwrap();
        prop_assert_eq!(g.routing(), Routing::Flat);
        let per_slice = g.full_slice_bytes() / dtype.size_bytes();
        let n = (slices - 1) * per_slice + 1 + (per_slice - 1) * tail / 1000;
        let plan = Plan::new(&g, dtype, n, rot).unwrap();
        let largest = plan.slices().flat_map(|s| s.cells()).map(|c| c.span().byte_len()).max().unwrap();
        let served = served_bytes(&[plan]);
        for device in 0..d as usize {
            let s = spread(&served, device);
            prop_assert!(s <= largest + ALIGN_BYTES, "device {device}: spread {s} B > {largest} + {ALIGN_BYTES}");
        }
    }

    /// Across tensors chained with `next_rotation`, shards keep going round robin:
    /// the number of shards each machine serves differs by at most one; and when every
    /// slice is full (fusion buffers sized in whole slices), so do the bytes, by one
    /// shard.
    #[test]
    fn rotation_continues_across_tensors(
        m in 1u32..=24, units in 1u64..=32, min_units in 1u64..=8,
        sizes in prop::collection::vec(1u64..=2000, 1..40), whole in any::<bool>(),
    ) {
        let topo = Topology::new(m, 1, RankLayout::Contiguous).unwrap();
        let config = PlanConfig::new(units * ALIGN_BYTES, min_units * ALIGN_BYTES).unwrap();
        let g = Geometry::new(topo, config).unwrap();
        prop_assume!(g.routing() == Routing::Flat);
        let per_slice = g.full_slice_bytes() / 4;
        let mut rotation = 0;
        let mut plans = Vec::new();
        let mut counts = vec![0u64; m as usize];
        for s in sizes {
            let n = if whole { (s % 5 + 1) * per_slice } else { s };
            let plan = Plan::new(&g, DataType::F32, n, rotation).unwrap();
            rotation = plan.next_rotation();
            for slice in plan.slices() {
                for j in 0..slice.shards() {
                    counts[slice.server(0, j).unwrap() as usize] += 1;
                }
            }
            plans.push(plan);
        }
        let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        prop_assert!(hi - lo <= 1, "shard counts {counts:?}");
        if whole {
            let full_shard = g.full_slot_bytes() / u64::from(g.shards_per_full_slice());
            prop_assert!(spread(&served_bytes(&plans), 0) <= full_shard);
        }
    }
}

#[test]
fn zero_elements_plan_to_nothing() {
    let topo = Topology::new(4, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    let plan = Plan::new(&g, DataType::F32, 0, 7).unwrap();
    assert_eq!(plan.slice_count(), 0);
    assert_eq!(plan.slices().count(), 0);
    assert!(plan.locate(0).is_err());
    assert_eq!(plan.next_rotation(), 3);
}

#[test]
fn adaptive_sharding_examples() {
    // 8 machines x 8 devices, defaults: a 25 MiB slice gives slots of 3.125 MiB,
    // cut into 8 shards of 400 KiB.
    let topo = Topology::new(8, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    assert_eq!(g.shards_per_full_slice(), 8);
    assert_eq!(g.full_slice_bytes(), 25 << 20);
    // A 1 MiB tensor: 128 KiB slots, two 64 KiB shards, not eight 16 KiB ones.
    let plan = Plan::new(&g, DataType::F32, (1 << 20) / 4, 0).unwrap();
    let slice = plan.slice(0).unwrap();
    assert_eq!(slice.shards(), 2);
    assert_eq!(slice.cell(0, 0).unwrap().span().byte_len(), 64 << 10);
    // 50 machines x 8 devices: a 3.125 MiB slot holds 50 shards of 64 KiB, so
    // every machine still serves one.
    let topo = Topology::new(50, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    assert_eq!(g.routing(), Routing::Flat);
    assert_eq!(g.shards_per_full_slice(), 50);
    // 61 machines x 8 devices (a prime count): a 3.125 MiB slot would hold
    // only 50 shards of 64 KiB, so the default slices widen to 32 MiB, whose
    // 4 MiB slot gives each of the 61 machines one. 64 machines make equal
    // groups, four of 16, which reduce in two levels in those 32 MiB slices;
    // in one level they stay flat in them. At 65 machines the machines form
    // groups past the wide flat slices (three of 22, 22 and 21), in 32 MiB
    // slices, a 64 MiB tensor in four of 16 MiB and 100 MiB in four of 25
    // MiB; in one level, the cells go through the trees.
    let topo = Topology::new(61, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    assert_eq!(g.routing(), Routing::Flat);
    assert_eq!(g.config().slice_bytes(), 32 << 20);
    assert_eq!(g.shards_per_full_slice(), 61);
    let topo = Topology::new(64, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    assert_eq!(g.routing(), Routing::Groups);
    let groups = g.machine_groups().unwrap();
    assert_eq!((groups.groups(), groups.largest()), (4, 16));
    assert_eq!(g.full_slice_bytes(), 32 << 20);
    let g = Geometry::new(topo, PlanConfig::default().in_one_level()).unwrap();
    assert_eq!(g.routing(), Routing::Flat);
    assert_eq!(g.full_slice_bytes(), 32 << 20);
    assert_eq!(g.shards_per_full_slice(), 64);
    // Made again from its configuration, the same groups.
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    assert_eq!(Geometry::new(topo, g.config()).unwrap(), g);
    // The equal groups' size, by hand: 52 machines in four groups of 13; 51
    // (3 x 17) in three; 58 (2 x 29) in two; 63 in seven of 9; 53, prime, in
    // none; 16 in two of 8; 15 in none (no group of 8 or more).
    for (m, size) in [
        (52, Some(13)),
        (51, Some(17)),
        (58, Some(29)),
        (63, Some(9)),
        (53, None),
        (16, Some(8)),
        (15, None),
    ] {
        assert_eq!(PlanConfig::equal_group_size(m), size, "{m} machines");
    }
    let topo = Topology::new(65, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    assert_eq!(g.routing(), Routing::Groups);
    let groups = g.machine_groups().unwrap();
    assert_eq!((groups.groups(), groups.largest()), (3, 22));
    assert_eq!(g.full_slice_bytes(), 32 << 20);
    assert_eq!(g.shards_per_full_slice(), 1);
    assert_eq!(g.slice_bytes_for(64 << 20), 16 << 20);
    assert_eq!(g.slice_bytes_for(100 << 20), 25 << 20);
    let g = Geometry::new(topo, PlanConfig::default().in_one_level()).unwrap();
    assert_eq!(g.routing(), Routing::Trees);
    assert_eq!(g.full_slice_bytes(), 20 << 20);
    // A 64 MiB tensor there goes in four slices of 16 MiB, 100 MiB in five of
    // 20 MiB.
    assert_eq!(g.slice_bytes_for(64 << 20), 16 << 20);
    assert_eq!(g.slice_bytes_for(100 << 20), 20 << 20);
    // 512 machines x 8 devices (4096 GPUs): where a fixed M-way split would cut
    // 6.25 KiB shards, the machines form 16 groups of 32; in one level, the
    // cells go through the trees, half a slot each, in the default slices of
    // the trees (20 MiB), and a staging buffer holds the slot and two
    // children's halves.
    // The default group size, by hand: 256 machines in 8 groups of 32; 252
    // in 7 of 36 (32 would make 8 unequal ones, 40 makes 7 equal); 100 in 4
    // of 25; 189 in 3 of 63 (64 is the first size to make equal groups,
    // ahead of 27, which divides it too); 198 in 6 of 33 (32, 40, 48, 56 and 64 make 7, 5, 5, 4 and 4 unequal
    // ones; 33 is the largest size from 20 to 48 that divides 198); 65
    // (5 x 13) and 131, prime, in unequal groups of at most 32 (half of 65)
    // and 48; 40 (one level at the default minimum shard) in two of 20.
    for (m, size, groups, largest) in [
        (256, 32, 8, 32),
        (252, 40, 7, 36),
        (100, 32, 4, 25),
        (189, 64, 3, 63),
        (198, 33, 6, 33),
        (65, 32, 3, 22),
        (131, 48, 3, 44),
        (40, 20, 2, 20),
    ] {
        assert_eq!(PlanConfig::default_group_size(m), size, "{m} machines");
        let g = fairring_core::plan::MachineGroups::new(m, size).unwrap();
        assert_eq!((g.groups(), g.largest()), (groups, largest), "{m} machines");
    }
    let topo = Topology::new(512, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    let groups = g.machine_groups().unwrap();
    assert_eq!((groups.groups(), groups.largest()), (16, 32));
    let g = Geometry::new(topo, PlanConfig::default().in_one_level()).unwrap();
    assert_eq!(g.routing(), Routing::Trees);
    assert_eq!(g.full_slice_bytes(), 20 << 20);
    assert_eq!(g.shards_per_full_slice(), 2);
    let half = (20 << 20) / 8 / 2;
    assert_eq!(g.staging_layout().shard_stride(), half + 64);
    assert_eq!(
        g.staging_layout().total_bytes(),
        (20 << 20) / 8 + 2 * (half + 64)
    );
    // A slice size given is kept through the trees.
    let given = PlanConfig::new(25 << 20, 64 << 10).unwrap();
    let g = Geometry::new(topo, given).unwrap();
    assert_eq!(g.routing(), Routing::Trees);
    assert_eq!(g.full_slice_bytes(), 25 << 20);
    // Configuration errors name the field.
    assert!(PlanConfig::new(0, 1 << 16).is_err());
    assert!(PlanConfig::new(1 << 20, 32).is_err());
    let tiny = PlanConfig::new(64 * 4, 64).unwrap();
    let topo = Topology::new(1, 8, RankLayout::Contiguous).unwrap();
    assert!(Geometry::new(topo, tiny).is_err());
    assert!(
        Plan::new(
            &Geometry::new(topo, PlanConfig::default()).unwrap(),
            DataType::F64,
            u64::MAX / 4,
            0
        )
        .is_err()
    );
}

#[test]
fn staging_buffers_for_a_budget() {
    let topo = Topology::new(8, 8, RankLayout::Contiguous).unwrap();
    let g = Geometry::new(topo, PlanConfig::default()).unwrap();
    let layout = g.staging_layout();
    // 3.125 MiB slot plus 7 contribution areas of 400 KiB, each padded to an odd
    // number of cache lines.
    assert_eq!(layout.shard_stride(), (400 << 10) + 64);
    assert_eq!(
        layout.total_bytes(),
        (25 << 20) / 8 + 7 * ((400 << 10) + 64)
    );
    assert_eq!(g.staging_buffers(50 << 20).unwrap(), 8);
    assert!(g.staging_buffers(1 << 20).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// With dedicated servers kept in one level: machines serve nothing and send
    /// every shard of their slot; the servers form `gcd(K, D)` rail groups, and a cell goes to a server
    /// of its slot's group; every server gets the same bytes of every full slice
    /// within one unit a cell (Herring's balanced buffers), and its cells fit its
    /// layout's disjoint areas.
    #[test]
    fn dedicated_servers_take_equal_shares(
        m in 1u32..=12, d in 1u32..=4, k in 1u32..=12, units in 1u64..=256,
        min_units in 1u64..=16, slices in 1u64..=40, tail in 0u64..=1000,
        rot in any::<u64>(), dtype in dtype(),
    ) {
        let topo = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let config = PlanConfig::new(units * u64::from(d) * ALIGN_BYTES, min_units * ALIGN_BYTES).unwrap();
        // Kept flat: where a slot's cells would fall below the minimum,
        // the servers would form groups (`server_groups_props.rs`).
        let g = Geometry::with_servers(topo, config.in_one_level(), k).unwrap();
        let rails = (1..=d.min(k)).rev().find(|r| k % r == 0 && d % r == 0).unwrap();
        prop_assert_eq!(g.servers(), Some(k));
        prop_assert_eq!(g.server_rails(), rails);
        prop_assert_eq!(g.serving(), k / rails);
        prop_assert!(g.shards_per_full_slice() <= k / rails);
        prop_assert_eq!(g.staging_layout().contribution_areas(), 0);
        let layout = g.server_layout().unwrap();
        let per_slice = g.full_slice_bytes() / dtype.size_bytes();
        let n = (slices - 1) * per_slice + 1 + (per_slice - 1) * tail / 1000;
        let plan = Plan::new(&g, dtype, n, rot).unwrap();
        for slice in plan.slices() {
            let full = slice.span().len() == per_slice;
            let mut per_server = vec![0u64; k as usize];
            let mut cells_of_server = vec![0u32; k as usize];
            for machine in 0..m {
                prop_assert_eq!(slice.shard_served_by(machine).unwrap(), None);
                for device in 0..d {
                    let role = slice.role(Location { machine, device }).unwrap();
                    if !slice.slot(device).unwrap().is_empty() {
                        prop_assert_eq!(u32::from(role.contributions_to_send), slice.shards());
                        prop_assert_eq!(u32::from(role.results_to_receive), slice.shards());
                        prop_assert!(!role.reduces && role.contributions_to_receive == 0);
                    }
                }
            }
            for cell in slice.cells() {
                prop_assert!(cell.server() < k);
                prop_assert_eq!(cell.server() % rails, cell.device() % rails);
                prop_assert!(g.server_serves_slot(cell.server(), cell.device()));
                prop_assert_eq!(slice.server(cell.device(), cell.shard()).unwrap(), cell.server());
                prop_assert!(cell.span().byte_len() <= layout.shard_stride());
                prop_assert_eq!(slice.shard_of_server(cell.server()).unwrap(), Some(cell.shard()));
                per_server[cell.server() as usize] += cell.span().byte_len() * u64::from(m);
                cells_of_server[cell.server() as usize] += 1;
            }
            // Every server of the slice holds one cell of each slot of its group.
            let serving: Vec<u32> = cells_of_server.iter().copied().filter(|&c| c > 0).collect();
            prop_assert_eq!(serving.len(), (slice.shards() * rails) as usize);
            prop_assert!(serving.iter().all(|&c| c == d / rails));
            if full && slice.shards() == k / rails {
                let spread = per_server.iter().max().unwrap() - per_server.iter().min().unwrap();
                prop_assert!(spread <= u64::from(m * d) * ALIGN_BYTES, "spread {spread} over {per_server:?}");
            }
        }
        prop_assert!(plan.slice(0).unwrap().shard_of_server(k).is_err());
        prop_assert!(!g.server_serves_slot(k, 0) && !g.server_serves_slot(0, d));
        // A server's areas: one per machine and slot of its group, disjoint,
        // filling the buffer.
        for group in 0..rails {
            let mut areas: Vec<(u64, u64)> = (0..m)
                .flat_map(|machine| (group..d).step_by(rails as usize).map(move |device| (machine, device)))
                .map(|(machine, device)| {
                    let a = layout.area(machine, device).unwrap();
                    (a.byte_offset(), a.byte_end())
                })
                .collect();
            areas.sort_unstable();
            for w in areas.windows(2) {
                prop_assert!(w[0].1 <= w[1].0, "overlap");
            }
            prop_assert_eq!(areas.len(), (m * d / rails) as usize);
            prop_assert_eq!(areas.last().unwrap().1, layout.total_bytes());
        }
        prop_assert!(layout.area(m, 0).is_err() && layout.area(0, d).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A server's folds take machines 1 to `M - 1` in order, each of them once,
    /// in full batches of `SERVER_FOLD_CELLS` and one shorter at the end; the
    /// cells of a fold lie in areas one stride apart (so one reduction reads
    /// them all).
    #[test]
    fn a_servers_folds_take_every_other_machine_once_in_order(
        m in 1u32..=300, d in 1u32..=8, k in 1u32..=16,
    ) {
        let topo = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let g = Geometry::with_servers(topo, PlanConfig::DEFAULT, k).unwrap();
        let layout = g.server_layout().unwrap();
        let mut next = 1;
        for index in 0..layout.folds() {
            let fold = layout.fold(index).unwrap();
            prop_assert_eq!(fold.start, next);
            prop_assert!(!fold.is_empty() && fold.len() <= SERVER_FOLD_CELLS as usize);
            if index + 1 < layout.folds() {
                prop_assert_eq!(fold.len(), SERVER_FOLD_CELLS as usize);
            }
            for device in (0..d).step_by(g.server_rails() as usize) {
                for machine in fold.clone() {
                    let here = layout.area(machine, device).unwrap().byte_offset();
                    let before = layout.area(machine - 1, device).unwrap().byte_offset();
                    prop_assert_eq!(here - before, layout.shard_stride());
                }
            }
            next = fold.end;
        }
        prop_assert_eq!(next, m);
        prop_assert!(layout.fold(layout.folds()).is_none());
        prop_assert_eq!(layout.folds() == 0, m == 1);
    }
}

#[test]
fn a_servers_folds_at_hand_worked_counts() {
    let folds = |m: u32| {
        let topo = Topology::new(m, 8, RankLayout::Contiguous).unwrap();
        let layout = Geometry::with_servers(topo, PlanConfig::DEFAULT, 64)
            .unwrap()
            .server_layout()
            .unwrap();
        (0..layout.folds())
            .map(|i| layout.fold(i).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(folds(1), vec![]);
    assert_eq!(folds(2), vec![1..2]);
    assert_eq!(folds(17), vec![1..17]);
    assert_eq!(folds(18), vec![1..17, 17..18]);
    assert_eq!(folds(256).len(), 16);
    assert_eq!(folds(256)[15], 241..256);
}

#[test]
fn server_counts_outside_the_range_are_refused() {
    let topo = Topology::new(2, 1, RankLayout::Contiguous).unwrap();
    let config = PlanConfig::DEFAULT;
    assert!(Geometry::with_servers(topo, config, 0).is_err());
    assert!(Geometry::with_servers(topo, config, 4097).is_err());
    let co_located = Geometry::new(topo, config).unwrap();
    assert_eq!(co_located.servers(), None);
    assert!(co_located.server_layout().is_none());
    let plan = Plan::new(&co_located, DataType::F32, 1024, 0).unwrap();
    assert!(plan.slice(0).unwrap().shard_of_server(0).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A whole-tensor plan on one machine is one slice holding every element,
    /// its slots dealt as evenly as any slice's, every element owned by one cell
    /// of it; on several machines, or with dedicated servers, it is refused.
    #[test]
    fn a_whole_tensor_plan_is_one_slice_on_one_machine(
        d in 1u32..=16,
        m in 1u32..=64,
        servers in prop_oneof![3 => Just(0u32), 1 => 1u32..=8],
        dtype in dtype(),
        elements in prop_oneof![1 => Just(0u64), 4 => 1u64..=1 << 40],
        picks in prop::collection::vec(any::<u64>(), 8),
    ) {
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let g = if servers > 0 {
            Geometry::with_servers(topology, PlanConfig::default(), servers).unwrap()
        } else {
            Geometry::new(topology, PlanConfig::default()).unwrap()
        };
        let whole = Plan::whole(&g, dtype, elements);
        if m > 1 || servers > 0 {
            let e = whole.unwrap_err();
            let said = e.to_string();
            prop_assert!(said.contains(&format!("{m} machines")) && said.contains(&format!("{servers} servers")), "{}", said);
            return Ok(());
        }
        let plan = whole.unwrap();
        prop_assert_eq!(plan.elements(), elements);
        prop_assert_eq!(plan.slice_count(), u64::from(elements > 0));
        prop_assert_eq!(plan.next_rotation(), 0);
        if elements == 0 {
            prop_assert!(plan.slice(0).is_err());
            return Ok(());
        }
        let slice = plan.slice(0).unwrap();
        prop_assert_eq!(slice.span().offset(), 0);
        prop_assert_eq!(slice.span().len(), elements);
        prop_assert_eq!(slice.shards(), 1);
        // Slots tile the slice in order and differ by at most one unit.
        let unit = ALIGN_BYTES / dtype.size_bytes();
        let mut next = 0;
        let (mut least, mut most) = (u64::MAX, 0);
        for device in 0..d {
            let slot = slice.slot(device).unwrap();
            prop_assert_eq!(slot.offset(), next);
            next = slot.end();
            let units = slot.len() / unit;
            least = least.min(units);
            most = most.max(units);
        }
        prop_assert_eq!(next, elements);
        prop_assert!(most - least <= 1, "slots of {} to {} units", least, most);
        for p in picks {
            let x = p % elements;
            let cell = plan.locate(x).unwrap();
            prop_assert_eq!(cell.slice(), 0);
            prop_assert!(cell.span().offset() <= x && x < cell.span().end());
        }
        prop_assert!(plan.locate(elements).is_err());
    }
}

prop_compose! {
    /// A geometry whose cells go through the trees: more machines than shards of
    /// the minimum size fit in a slot.
    fn tree_geometry()(m in 2u32..=300, d in 1u32..=4, slot_units in 1u64..=64, min_units in 1u64..=32)
        -> Geometry
    {
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        // Fewer shards of the minimum than machines: slot / min < m.
        let slot_units = slot_units.min(min_units * u64::from(m) - 1);
        let config = PlanConfig::new(slot_units * u64::from(d) * ALIGN_BYTES, min_units * ALIGN_BYTES).unwrap();
        Geometry::new(topology, config).unwrap()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The routing is the trees exactly where a slot cut at the minimum shard
    /// has fewer shards than machines, and never with dedicated servers.
    #[test]
    fn trees_are_chosen_where_machines_outnumber_shards(g in geometry(), servers in 1u32..=8) {
        let topo = g.topology();
        let slot_units = g.config().slice_bytes() / ALIGN_BYTES / u64::from(topo.devices_per_machine());
        let fit = slot_units / g.min_shard_bytes().div_ceil(ALIGN_BYTES);
        // A slot too small for one shard of the minimum still makes one.
        let expected = if fit.max(1) < u64::from(topo.machines()) { Routing::Trees } else { Routing::Flat };
        prop_assert_eq!(g.routing(), expected);
        let cap = if expected == Routing::Trees { TREES } else { topo.machines() };
        prop_assert!(g.shards_per_full_slice() <= cap);
        // Dedicated servers never route through the trees: flat, or in
        // groups of servers where a slot's cells would be too small.
        let dedicated = Geometry::with_servers(topo, g.config(), servers).unwrap();
        let grouped = dedicated.server_groups().is_some();
        prop_assert_eq!(
            dedicated.routing(),
            if grouped { Routing::Groups } else { Routing::Flat }
        );
    }

    /// The default group size: equal groups of the first size of
    /// `EQUAL_GROUP_SIZES` that makes them, else of the largest size from
    /// `SMALLEST_EQUAL_GROUP` to 48 (or half the machines) that divides the
    /// machines, else at most that bound: for every count of 4 machines or
    /// more but 5 (which no size splits in two levels: the geometry then
    /// keeps the trees), two levels of groups no larger than the size
    /// (worked by hand for a few counts in `adaptive_sharding_examples`).
    #[test]
    fn the_default_group_size_prefers_equal_groups(m in 4u32..=MAX_MACHINES) {
        let size = PlanConfig::default_group_size(m);
        let Ok(groups) = fairring_core::plan::MachineGroups::new(m, size) else {
            prop_assert_eq!(m, 5);
            prop_assert!((2..=m / 2).all(|s| fairring_core::plan::MachineGroups::new(m, s).is_err()));
            return Ok(());
        };
        prop_assert!(groups.largest() <= size);
        let equal = (0..groups.groups()).all(|g| groups.size(g).unwrap() == groups.largest());
        let first_equal = PlanConfig::EQUAL_GROUP_SIZES
            .iter()
            .copied()
            .find(|&g| g <= m / 2 && m % m.div_ceil(g) == 0);
        match first_equal {
            Some(g) => {
                prop_assert_eq!(size, g);
                prop_assert!(equal);
            }
            None => {
                // The largest size from 20 to the bound whose groups, as
                // `MachineGroups` makes them, are all of that size.
                let bound = (m / 2).min(PlanConfig::DEFAULT_GROUP_SIZE);
                let all_of = |s: u32| {
                    fairring_core::plan::MachineGroups::new(m, s).is_ok_and(|g| {
                        (0..g.groups()).all(|i| g.size(i).is_ok_and(|n| n == s))
                    })
                };
                let divides = (PlanConfig::SMALLEST_EQUAL_GROUP..=bound)
                    .filter(|&s| all_of(s))
                    .max();
                match divides {
                    Some(s) => {
                        prop_assert_eq!(size, s);
                        prop_assert!(equal);
                    }
                    None => prop_assert_eq!(size, bound),
                }
            }
        }
    }

    /// The equal groups' size: the fewest groups, at least four, of 8 to 64
    /// machines each that divide the machines equally, else three, else two;
    /// none where no such groups exist. Counted here over every number of
    /// groups.
    #[test]
    fn the_equal_group_size_takes_the_fewest_equal_groups_from_four(m in 1u32..=MAX_MACHINES) {
        let equal: Vec<u32> = (2..=m)
            .filter(|&q| m % q == 0 && (8..=64).contains(&(m / q)))
            .collect();
        let expected = equal
            .iter()
            .find(|&&q| q >= 4)
            .or_else(|| equal.iter().find(|&&q| q == 3))
            .or_else(|| equal.iter().find(|&&q| q == 2))
            .map(|&q| m / q);
        prop_assert_eq!(PlanConfig::equal_group_size(m), expected);
        if let Some(size) = expected {
            let groups = fairring_core::plan::MachineGroups::new(m, size).unwrap();
            prop_assert_eq!(groups.groups() * size, m);
            prop_assert!((0..groups.groups()).all(|g| groups.size(g).unwrap() == size));
        }
    }

    /// The default slices are 25 MiB's geometry exactly where that is flat or
    /// served by dedicated servers (in groups of servers, or not). Where 25 MiB slices would go through the
    /// trees, they are the geometry of 32 MiB slices given where that is flat
    /// (every machine serving a shard), and else, where the machines make two
    /// levels in groups of `PlanConfig::default_group_size`, the
    /// geometry in such groups of 32 MiB slices, its configuration still the
    /// default's; in one level, or where they make no two levels, that of
    /// 20 MiB slices given, which go through the trees too, its
    /// configuration still the default's. Its configuration makes it again.
    #[test]
    fn default_slices_widen_to_stay_flat_then_shrink_through_the_trees(
        m in machines(), d in 1u32..=16, min_shard in log_size(20), servers in 0u32..=8
    ) {
        let topo = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let make = |config: PlanConfig| match servers {
            0 => Geometry::new(topo, config),
            k => Geometry::with_servers(topo, config, k),
        }.unwrap();
        let default_slices = PlanConfig::with_default_slices(min_shard).unwrap();
        let defaults = make(default_slices);
        let one_level = make(default_slices.in_one_level());
        let large = make(PlanConfig::new(25 << 20, min_shard).unwrap());
        let wide = make(PlanConfig::new(32 << 20, min_shard).unwrap());
        prop_assert_eq!(make(defaults.config()), defaults);
        prop_assert_eq!(make(one_level.config()), one_level);
        if defaults.server_groups().is_some() {
            // Servers in groups in the 25 MiB slices (a slot's cells below
            // the minimum: `server_groups_props.rs`), made again from
            // its configuration (above); in one level they stay flat.
            prop_assert!(servers > 0 && one_level.server_groups().is_none());
            prop_assert_eq!(one_level.routing(), Routing::Flat);
            prop_assert_eq!(defaults.config().slice_bytes(), 25 << 20);
            prop_assert_eq!(large.server_groups(), defaults.server_groups());
            return Ok(());
        }
        if defaults.routing() != Routing::Groups {
            // The same plan, but for the configuration's flag.
            prop_assert_eq!(one_level.routing(), defaults.routing());
            prop_assert_eq!(one_level.full_slice_bytes(), defaults.full_slice_bytes());
            prop_assert_eq!(one_level.shards_per_full_slice(), defaults.shards_per_full_slice());
            prop_assert_eq!(one_level.staging_layout(), defaults.staging_layout());
        }
        if large.routing() == Routing::Flat {
            prop_assert_eq!(defaults.routing(), Routing::Flat);
            prop_assert_eq!(defaults.full_slice_bytes(), large.full_slice_bytes());
            prop_assert_eq!(defaults.shards_per_full_slice(), large.shards_per_full_slice());
            prop_assert_eq!(defaults.config().slice_bytes(), 25 << 20);
            prop_assert!(defaults.config().slice_by_routing());
        } else if wide.routing() == Routing::Flat {
            prop_assert_eq!(servers, 0);
            // In one level, or where the machines make no equal groups, the
            // wide flat slices.
            prop_assert_eq!(one_level.routing(), Routing::Flat);
            prop_assert_eq!(one_level.shards_per_full_slice(), m);
            prop_assert_eq!(one_level.config().slice_bytes(), 32 << 20);
            prop_assert!(!one_level.config().slice_by_routing());
            prop_assert_eq!(one_level.full_slice_bytes(), wide.full_slice_bytes());
            prop_assert_eq!(one_level.staging_layout(), wide.staging_layout());
            match PlanConfig::equal_group_size(m) {
                Some(size) => {
                    prop_assert_eq!(defaults.routing(), Routing::Groups);
                    let groups = defaults.machine_groups().unwrap();
                    prop_assert_eq!(groups.groups() * groups.largest(), m);
                    prop_assert_eq!(groups.largest(), size);
                    prop_assert_eq!(defaults.config().slice_bytes(), 32 << 20);
                    prop_assert!(defaults.config().slice_by_routing());
                    let given = Geometry::with_groups(topo, default_slices, size).unwrap();
                    prop_assert_eq!(given, defaults);
                }
                None => prop_assert_eq!(defaults, wide),
            }
        } else {
            prop_assert_eq!(servers, 0);
            let size = PlanConfig::default_group_size(m);
            match fairring_core::plan::MachineGroups::new(m, size) {
                Ok(groups) => {
                    prop_assert_eq!(defaults.routing(), Routing::Groups);
                    prop_assert_eq!(defaults.machine_groups(), Some(groups));
                    prop_assert_eq!(defaults.config().slice_bytes(), 32 << 20);
                    prop_assert!(defaults.config().slice_by_routing());
                    prop_assert!(defaults.full_slice_bytes() <= 32 << 20);
                    let given = Geometry::with_groups(topo, default_slices, size).unwrap();
                    prop_assert_eq!(given, defaults);
                }
                Err(_) => prop_assert_eq!(defaults.routing(), Routing::Trees),
            }
            let trees = make(PlanConfig::new(20 << 20, min_shard).unwrap());
            prop_assert_eq!(one_level.routing(), Routing::Trees);
            prop_assert_eq!(one_level.config().slice_bytes(), 20 << 20);
            // Still the default's: small tensors are cut.
            prop_assert!(one_level.config().slice_by_routing());
            prop_assert_eq!(one_level.full_slice_bytes(), trees.full_slice_bytes());
            prop_assert_eq!(one_level.shards_per_full_slice(), trees.shards_per_full_slice());
            prop_assert_eq!(one_level.staging_layout(), trees.staging_layout());
            prop_assert!(one_level.full_slice_bytes() <= 20 << 20);
        }
    }

    /// Wherever a slot of 25 MiB holds fewer shards of the minimum than there
    /// are machines and a slot of 32 MiB holds as many, the default slices are
    /// 32 MiB: in equal groups where the machines make some
    /// (`PlanConfig::equal_group_size`), else, and in one level, on the flat
    /// plan, every machine serving a shard of at least the minimum of every
    /// full slot; one machine more, and the machines form
    /// groups in 32 MiB slices where they make two levels (in one level, or
    /// where they make none, the cells go through the trees in 20 MiB
    /// slices).
    #[test]
    fn default_slices_widen_where_32_mib_gives_every_machine_a_shard(
        d in 1u32..=16, min_shard in log_size(20), pick in any::<u64>()
    ) {
        let fit = |slice: u64| {
            // A slot too small for one shard of the minimum still makes one.
            (slice / ALIGN_BYTES / u64::from(d) / min_shard.div_ceil(ALIGN_BYTES)).max(1)
        };
        let (fewest, most) = (fit(25 << 20) + 1, fit(32 << 20));
        let largest_job = u64::from(MAX_MACHINES);
        prop_assume!(fewest <= most && fewest <= largest_job);
        let m = u32::try_from(fewest + pick % (most.min(largest_job) - fewest + 1)).unwrap();
        let defaults = PlanConfig::with_default_slices(min_shard).unwrap();
        let topo = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let g = Geometry::new(topo, defaults.in_one_level()).unwrap();
        prop_assert_eq!(g.routing(), Routing::Flat);
        prop_assert_eq!(g.config().slice_bytes(), 32 << 20);
        prop_assert!(g.full_slice_bytes() <= 32 << 20);
        prop_assert_eq!(g.shards_per_full_slice(), m);
        prop_assert!(g.full_slot_bytes() / u64::from(m) >= min_shard);
        // In two levels where the machines make equal groups, in the same
        // slices.
        let g = Geometry::new(topo, defaults).unwrap();
        prop_assert_eq!(g.config().slice_bytes(), 32 << 20);
        prop_assert!(g.full_slice_bytes() <= 32 << 20);
        match PlanConfig::equal_group_size(m) {
            Some(size) => {
                prop_assert_eq!(g.routing(), Routing::Groups);
                prop_assert_eq!(g.machine_groups().map(|groups| groups.largest()), Some(size));
            }
            None => {
                prop_assert_eq!(g.routing(), Routing::Flat);
                prop_assert_eq!(g.shards_per_full_slice(), m);
            }
        }
        if most < largest_job {
            let one_more = Topology::new(u32::try_from(most + 1).unwrap(), d, RankLayout::Contiguous).unwrap();
            let g = Geometry::new(one_more, defaults).unwrap();
            let m = one_more.machines();
            let size = PlanConfig::default_group_size(m);
            if fairring_core::plan::MachineGroups::new(m, size).is_ok() {
                prop_assert_eq!(g.routing(), Routing::Groups);
                prop_assert_eq!(g.config().slice_bytes(), 32 << 20);
                prop_assert!(g.full_slice_bytes() <= 32 << 20);
            } else {
                // Too few machines for two levels.
                prop_assert_eq!(g.routing(), Routing::Trees);
            }
            let g = Geometry::new(one_more, defaults.in_one_level()).unwrap();
            prop_assert_eq!(g.routing(), Routing::Trees);
            prop_assert!(g.full_slice_bytes() <= 20 << 20);
        }
    }

    /// Through the trees, every device of every slice sends at most four
    /// messages and receives at most two contributions, and sends and receives
    /// at most two slots' bytes (within a unit per cell; three where a small
    /// slot is one shard), whatever M; every
    /// cell is reduced by exactly the inner nodes of its tree, the root last.
    #[test]
    fn tree_roles_are_bounded_and_cover_every_machine(
        g in tree_geometry(), dtype in dtype(), slices in 1u64..=5, frac in 0u64..=1000, rot in any::<u64>(),
    ) {
        prop_assert_eq!(g.routing(), Routing::Trees);
        let per_slice = g.full_slice_bytes() / dtype.size_bytes();
        let n = (slices - 1) * per_slice + 1 + (per_slice - 1) * frac / 1000;
        let plan = Plan::new(&g, dtype, n, rot).unwrap();
        let topo = g.topology();
        for slice in plan.slices() {
            check_slice(&plan, &slice)?;
            let trees = slice.double_tree().unwrap();
            for device in 0..topo.devices_per_machine() {
                let slot = slice.slot(device).unwrap();
                if slot.is_empty() {
                    continue;
                }
                let cell_bytes: Vec<u64> = (0..slice.shards())
                    .map(|j| slice.cell(device, j).unwrap().span().byte_len())
                    .collect();
                for machine in 0..topo.machines() {
                    let role = slice.role(Location { machine, device }).unwrap();
                    prop_assert!(role.is_valid(), "{role:?}");
                    let up = u16::from(role.forwards);
                    prop_assert!(role.contributions_to_receive <= 2);
                    prop_assert!(role.contributions_to_send + up + role.results_to_send <= 4, "{role:?}");
                    // Bytes sent: each leaf cell once, the inner cell up (below
                    // the root) and to each child.
                    let mut sent = 0u64;
                    let mut received = 0u64;
                    let mut inner = None;
                    for j in 0..slice.shards() {
                        let tree = slice.tree_of(j).unwrap().unwrap();
                        let children = trees.children(tree, machine).unwrap().iter().flatten().count() as u64;
                        let parent = trees.parent(tree, machine).unwrap();
                        if children > 0 {
                            prop_assert!(inner.is_none(), "inner node of two trees");
                            inner = Some(j);
                            prop_assert_eq!(u64::from(role.contributions_to_receive), children);
                            prop_assert_eq!(role.forwards, parent.is_some());
                            if parent.is_none() {
                                prop_assert_eq!(slice.server(0, j).unwrap(), machine);
                            }
                        } else {
                            prop_assert!(parent.is_some(), "a leaf below no one");
                        }
                        let up = u64::from(parent.is_some());
                        sent += cell_bytes[j as usize] * (up + children);
                        received += cell_bytes[j as usize] * (up + children);
                    }
                    prop_assert_eq!(slice.shard_served_by(machine).unwrap(), inner);
                    prop_assert_eq!(role.reduces, inner.is_some());
                    // Two shards: an inner node's cell three times and a leaf's
                    // once, two slots. One shard (a small slot): its one cell up
                    // to three times.
                    let bound = if slice.shards() == 2 {
                        2 * slot.byte_len() + 2 * ALIGN_BYTES
                    } else {
                        3 * slot.byte_len()
                    };
                    prop_assert!(sent <= bound, "sends {sent} B of a {} B slot", slot.byte_len());
                    prop_assert!(received <= bound, "receives {received} B of a {} B slot", slot.byte_len());
                }
            }
        }
    }

    /// Through the trees, a staging buffer's size does not depend on M: the
    /// same configuration gives the same layout at any machine count that
    /// routes through trees.
    #[test]
    fn tree_staging_does_not_grow_with_machines(g in tree_geometry(), more in 1u32..=3800) {
        let topo = g.topology();
        let bigger = Topology::new((topo.machines() + more).min(4096), topo.devices_per_machine(), RankLayout::Contiguous).unwrap();
        let h = Geometry::new(bigger, g.config()).unwrap();
        prop_assert_eq!(h.routing(), Routing::Trees);
        prop_assert_eq!(h.staging_layout().total_bytes(), g.staging_layout().total_bytes());
        prop_assert!(g.staging_layout().total_bytes() <= g.full_slot_bytes() + 2 * g.staging_layout().shard_stride());
    }

    /// Through the trees, consecutive tensors chained with `next_rotation`
    /// alternate the tree each shard takes, so that over the job each tree
    /// carries the same shards within one.
    #[test]
    fn tree_rotation_alternates(g in tree_geometry(), sizes in prop::collection::vec(1u64..=3000, 1..30)) {
        let mut rotation = 0;
        let mut per_tree = [0u64; 2];
        for s in sizes {
            let plan = Plan::new(&g, DataType::F32, s, rotation).unwrap();
            rotation = plan.next_rotation();
            prop_assert!(rotation < u64::from(TREES));
            for slice in plan.slices() {
                for j in 0..slice.shards() {
                    per_tree[slice.tree_of(j).unwrap().unwrap() as usize] += 1;
                }
            }
        }
        prop_assert!(per_tree[0].abs_diff(per_tree[1]) <= 1, "{per_tree:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// With the default slices (25 MiB flat, 20 MiB through the trees; not
    /// the wide flat ones) without servers, a tensor too small for four full
    /// slices is cut into smaller ones: a multiple of `D * ALIGN_BYTES`, at
    /// least 16 MiB and a shard of the minimum for each of a full slot's
    /// shards (every machine, flat), at least four of them unless that floor
    /// allows fewer, and as many shards as a full slice's; larger tensors,
    /// given slices, the wide ones and dedicated servers keep full slices.
    /// Larger tensors never get smaller slices.
    #[test]
    fn small_tensors_on_the_default_slices_take_several(
        m in machines(),
        d in 1u32..=16,
        min_shard in log_size(20),
        servers in prop_oneof![3 => Just(0u32), 1 => 1u32..=8],
        given in prop::bool::weighted(0.2),
        dtype in dtype(),
        bytes in 0u64..=200 << 20,
        more in 0u64..=100 << 20,
    ) {
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let config = if given {
            PlanConfig::new(PlanConfig::DEFAULT_SLICE_BYTES, min_shard).unwrap()
        } else {
            PlanConfig::with_default_slices(min_shard).unwrap()
        };
        let g = if servers > 0 {
            Geometry::with_servers(topology, config, servers).unwrap()
        } else {
            Geometry::new(topology, config).unwrap()
        };
        // A plan slices whole elements, so the tensor is a whole number of them.
        let bytes = bytes - bytes % dtype.size_bytes();
        let full = g.full_slice_bytes();
        let step = u64::from(d) * ALIGN_BYTES;
        let s = g.slice_bytes_for(bytes);
        prop_assert!(s <= full && s % step == 0 && s > 0, "{} of {}", s, full);
        prop_assert!(s <= g.slice_bytes_for(bytes + more));
        let wide = g.routing() == Routing::Flat && g.config().slice_bytes() == 32 << 20;
        let cut = !given && servers == 0 && !wide;
        prop_assert_eq!(cut, !given && servers == 0 && g.config().slice_by_routing());
        if !cut || bytes >= 4 * full {
            prop_assert_eq!(s, full);
            return Ok(());
        }
        if s == full {
            return Ok(());
        }
        let shards = match g.routing() {
            Routing::Flat => m,
            Routing::Trees | Routing::Groups => g.shards_per_full_slice(),
        };
        let floor = (16u64 << 20).max(g.min_shard_bytes() * u64::from(shards) * u64::from(d));
        prop_assert!(s >= floor, "{} under {}", s, floor);
        prop_assert!(
            bytes.div_ceil(s) >= PlanConfig::MIN_SLICES_PER_TENSOR || s < floor + step,
            "{} B in slices of {} B", bytes, s
        );
        let elements = bytes / dtype.size_bytes();
        let plan = Plan::new(&g, dtype, elements, 0).unwrap();
        prop_assert_eq!(plan.slice_elements() * dtype.size_bytes(), s);
        if plan.slice_count() > 1 {
            prop_assert_eq!(plan.slice(0).unwrap().shards(), g.shards_per_full_slice());
        }
    }
}

proptest! {
    /// Another minimum shard keeps the slicing: the slices as given or by
    /// routing, one level or not; the shard is the one asked for, refused
    /// exactly where `PlanConfig::new` refuses it.
    #[test]
    fn another_minimum_shard_keeps_the_slicing(
        slice in log_size(28),
        shard in log_size(28),
        other in prop_oneof![Just(0u64), Just(1u64), log_size(30)],
        by_routing in any::<bool>(),
        one_level in any::<bool>(),
    ) {
        let Ok(base) = (if by_routing {
            PlanConfig::with_default_slices(shard)
        } else {
            PlanConfig::new(slice, shard)
        }) else {
            return Ok(());
        };
        let config = if one_level { base.in_one_level() } else { base };
        match config.with_min_shard_bytes(other) {
            Ok(changed) => {
                prop_assert_eq!(changed.min_shard_bytes(), other);
                prop_assert_eq!(changed.slice_bytes(), config.slice_bytes());
                prop_assert_eq!(changed.slice_by_routing(), config.slice_by_routing());
                prop_assert_eq!(changed.is_one_level(), config.is_one_level());
            }
            Err(e) => prop_assert_eq!(Err(e), PlanConfig::new(config.slice_bytes(), other).map(|_| ())),
        }
    }
}
