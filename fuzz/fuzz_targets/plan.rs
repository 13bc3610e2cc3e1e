//! Plan queries on arbitrary jobs: every answer must be consistent with every other.
#![no_main]

use arbitrary::Arbitrary;
use fairring_core::plan::ALIGN_BYTES;
use fairring_core::staging::Role;
use fairring_core::topology::Location;
use fairring_fuzz::Job;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input {
    job: Job,
    queries: Vec<(u64, u32, u32, u32)>,
}

fuzz_target!(|input: Input| {
    let Some((geometry, plan)) = input.job.build() else {
        return;
    };
    let topology = geometry.topology();
    let layout = geometry.staging_layout();
    assert!(geometry.full_slice_bytes() <= geometry.config().slice_bytes());
    for &(at, device, shard, machine) in input.queries.iter().take(64) {
        if plan.elements() == 0 {
            assert_eq!(plan.slice_count(), 0);
            assert!(plan.locate(at).is_err());
            return;
        }
        let x = at % plan.elements();
        let cell = plan.locate(x).unwrap();
        assert!(cell.span().offset() <= x && x < cell.span().end());
        let slice = plan.slice(cell.slice()).unwrap();
        assert!(
            slice.span().offset() <= cell.span().offset()
                && cell.span().end() <= slice.span().end()
        );
        assert_eq!(slice.cell(cell.device(), cell.shard()).unwrap(), cell);
        let slot = slice.slot(cell.device()).unwrap();
        assert!(slot.offset() <= cell.span().offset() && cell.span().end() <= slot.end());
        assert_eq!(cell.span().byte_offset() % ALIGN_BYTES, 0);
        assert!(cell.span().byte_len() <= layout.shard_stride());
        assert!(slot.byte_len() <= layout.slot().byte_len());
        assert_eq!(
            slice.shard_served_by(cell.server()).unwrap(),
            Some(cell.shard())
        );
        if slice.shards() > 1 {
            assert!(cell.span().byte_len() >= geometry.min_shard_bytes());
        }
        // Arbitrary indices: in range or refused.
        let d = device % (topology.devices_per_machine() + 2);
        let j = shard % (slice.shards() + 2);
        let m = machine % (topology.machines() + 2);
        assert_eq!(
            slice.cell(d, j).is_ok(),
            d < topology.devices_per_machine() && j < slice.shards()
        );
        assert_eq!(
            slice.server(d, j).is_ok(),
            d < topology.devices_per_machine() && j < slice.shards()
        );
        let role = slice.role(Location {
            machine: m,
            device: d,
        });
        assert_eq!(
            role.is_ok(),
            m < topology.machines() && d < topology.devices_per_machine()
        );
        if let Ok(role) = role {
            assert!(role.is_valid());
            let machines = topology.machines();
            let serves = slice.shard_served_by(m).unwrap().is_some();
            let empty = slice.slot(d).unwrap().is_empty();
            if empty || machines == 1 {
                assert_eq!(role, Role::IDLE);
            } else {
                assert_eq!(
                    u32::from(role.contributions_to_send) + u32::from(serves),
                    slice.shards()
                );
                assert_eq!(role.results_to_receive, role.contributions_to_send);
                assert_eq!(role.reduces, serves);
                assert_eq!(role.contributions_to_receive, role.results_to_send);
                match (slice.double_tree(), slice.shard_served_by(m).unwrap()) {
                    // Through trees: the served shard's children, and a
                    // parent to forward to below the root.
                    (Some(trees), served) => {
                        let (children, parent) = match served {
                            Some(j) => {
                                let tree = slice.tree_of(j).unwrap().unwrap();
                                let below = trees.children(tree, m).unwrap();
                                let n = below.iter().flatten().count() as u16;
                                (n, trees.parent(tree, m).unwrap())
                            }
                            None => (0, None),
                        };
                        assert_eq!(role.contributions_to_receive, children);
                        assert!(children <= 2);
                        assert_eq!(role.forwards, parent.is_some());
                    }
                    (None, _) => {
                        let others = if serves { machines - 1 } else { 0 };
                        assert_eq!(u32::from(role.contributions_to_receive), others);
                        assert!(!role.forwards);
                    }
                }
            }
        }
    }
    let _ = plan.next_rotation();
});
