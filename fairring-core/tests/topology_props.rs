//! Property tests of topologies: rank layouts round trip, and detection from the
//! machine of each rank finds the layout or says precisely why not.

use fairring_core::topology::{Location, RankLayout, Topology, TopologyError};
use proptest::prelude::*;

fn layout() -> impl Strategy<Value = RankLayout> {
    prop::sample::select(vec![RankLayout::Contiguous, RankLayout::Interleaved])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn ranks_round_trip(m in 1u32..=64, d in 1u32..=16, layout in layout()) {
        let t = Topology::new(m, d, layout).unwrap();
        let mut seen = vec![false; t.world_size() as usize];
        for machine in 0..m {
            for device in 0..d {
                let rank = t.rank(Location { machine, device }).unwrap();
                prop_assert!(!seen[rank as usize], "rank {} given twice", rank);
                seen[rank as usize] = true;
                prop_assert_eq!(t.locate(rank).unwrap(), Location { machine, device });
                prop_assert_eq!(t.rail(rank).unwrap(), device);
                for other in 0..m {
                    let peer = t.rail_peer(rank, other).unwrap();
                    prop_assert_eq!(t.locate(peer).unwrap(), Location { machine: other, device });
                }
            }
        }
        prop_assert!(t.locate(t.world_size()).is_err());
        prop_assert!(t.rank(Location { machine: m, device: 0 }).is_err(), "machine past the end accepted");
        prop_assert!(t.rank(Location { machine: 0, device: d }).is_err(), "device past the end accepted");
    }

    #[test]
    fn detection_finds_the_layout(m in 1u32..=32, d in 1u32..=8, layout in layout()) {
        let t = Topology::new(m, d, layout).unwrap();
        let machines: Vec<u32> = (0..t.world_size()).map(|r| t.locate(r).unwrap().machine).collect();
        let found = Topology::detect(&machines).unwrap();
        prop_assert_eq!((found.machines(), found.devices_per_machine()), (m, d));
        // Where both layouts number ranks alike, contiguous is reported.
        for rank in 0..t.world_size() {
            prop_assert_eq!(found.locate(rank).unwrap(), t.locate(rank).unwrap());
        }
    }

    /// Arbitrary machine lists never panic; whatever is accepted is consistent.
    #[test]
    fn arbitrary_lists(machines in prop::collection::vec(0u32..6, 0..40)) {
        match Topology::detect(&machines) {
            Ok(t) => {
                prop_assert_eq!(t.world_size() as usize, machines.len());
                for (rank, &m) in machines.iter().enumerate() {
                    prop_assert_eq!(t.locate(u32::try_from(rank).unwrap()).unwrap().machine, m);
                }
            }
            Err(TopologyError::NonUniformDevices { machine, devices, expected }) => {
                let count = |x: u32| u32::try_from(machines.iter().filter(|&&y| y == x).count()).unwrap();
                prop_assert_eq!(count(machine), devices);
                prop_assert_eq!(count(0), expected);
                prop_assert_ne!(devices, expected);
            }
            Err(_) => {}
        }
    }
}
