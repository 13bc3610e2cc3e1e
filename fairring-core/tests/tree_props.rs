//! Property tests of the double binary tree (`plan/tree.rs`) over every
//! machine count up to the limit: each tree spans the machines, no machine
//! has more than two children, depth stays within `log2 M`, parents and
//! children agree, and no machine is an inner node of both trees.

use fairring_core::plan::{DoubleTree, PlanError, TREES};
use fairring_core::topology::MAX_MACHINES;
use proptest::prelude::*;

/// Checks both trees over `m` machines; returns nothing, fails naming what broke.
fn check(m: u32) -> Result<(), TestCaseError> {
    let t = DoubleTree::new(m).unwrap();
    let levels = 31 - m.leading_zeros();
    let mut inner_in = vec![0u32; m as usize];
    for tree in 0..TREES {
        let root = t.root(tree).unwrap();
        prop_assert!(root < m);
        prop_assert_eq!(t.parent(tree, root).unwrap(), None);
        let mut edges = 0u32;
        for machine in 0..m {
            // The parent chain reaches the root within floor(log2 M) levels.
            let (mut at, mut depth) = (machine, 0);
            while let Some(up) = t.parent(tree, at).unwrap() {
                prop_assert!(up < m && up != at, "tree {tree}, M {m}: {at} -> {up}");
                at = up;
                depth += 1;
                prop_assert!(
                    depth <= levels,
                    "tree {tree}, M {m}: machine {machine} deeper than {levels}"
                );
            }
            prop_assert_eq!(
                at,
                root,
                "tree {}, M {}: machine {} ends at {}",
                tree,
                m,
                machine,
                at
            );
            // Its parent lists it as a child, once.
            if let Some(up) = t.parent(tree, machine).unwrap() {
                let listed = t
                    .children(tree, up)
                    .unwrap()
                    .iter()
                    .filter(|c| **c == Some(machine))
                    .count();
                prop_assert_eq!(
                    listed,
                    1,
                    "tree {}, M {}: {} not a child of its parent {}",
                    tree,
                    m,
                    machine,
                    up
                );
            }
            // Its children name it as their parent.
            let children = t.children(tree, machine).unwrap();
            for child in children.into_iter().flatten() {
                prop_assert!(child < m && child != machine);
                prop_assert_eq!(t.parent(tree, child).unwrap(), Some(machine));
                edges += 1;
            }
            let inner = children.iter().any(Option::is_some);
            prop_assert_eq!(
                t.is_inner(tree, machine).unwrap(),
                inner,
                "tree {}, M {}, machine {}",
                tree,
                m,
                machine
            );
            inner_in[machine as usize] += u32::from(inner);
        }
        // A spanning tree: M - 1 edges.
        prop_assert_eq!(edges, m - 1, "tree {}, M {}", tree, m);
    }
    // No machine is inner in both trees; with an odd M, exactly one machine
    // (M - 1) is a leaf of both, with an even M none is (for M > 1).
    prop_assert!(inner_in.iter().all(|&n| n <= 1), "M {m}: inner in both");
    let leaf_in_both: Vec<u32> = (0..m).filter(|&x| inner_in[x as usize] == 0).collect();
    let expected: Vec<u32> = match m {
        1 => vec![0],
        _ if m % 2 == 1 => vec![m - 1],
        _ => vec![],
    };
    prop_assert_eq!(leaf_in_both, expected, "M {}", m);
    Ok(())
}

#[test]
fn small_machine_counts_form_two_complementary_trees() {
    for m in 1..=300 {
        check(m).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_machine_count_forms_two_complementary_trees(m in 301u32..=MAX_MACHINES) {
        check(m)?;
    }
}

#[test]
fn powers_of_two_and_the_limit() {
    for m in [512, 1024, 2048, 4095, MAX_MACHINES] {
        check(m).unwrap();
    }
}

#[test]
fn out_of_range_arguments_are_named() {
    assert!(matches!(
        DoubleTree::new(0),
        Err(PlanError::MachineOutOfRange { machine: 0, .. })
    ));
    assert!(DoubleTree::new(MAX_MACHINES + 1).is_err());
    let t = DoubleTree::new(5).unwrap();
    let e = t.parent(2, 0).unwrap_err();
    assert_eq!(e, PlanError::TreeOutOfRange { tree: 2 });
    assert!(e.to_string().contains("tree 2"), "{e}");
    assert!(matches!(
        t.children(0, 5),
        Err(PlanError::MachineOutOfRange {
            machine: 5,
            machines: 5
        })
    ));
    assert!(t.root(7).is_err());
}
