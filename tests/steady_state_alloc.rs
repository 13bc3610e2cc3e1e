//! After warm-up, an all-reduce allocates nothing, on any thread of any rank.
//!
//! The test launches a 2x2 job of processes (this test binary, re-executed with
//! the rank in its environment). Each rank counts heap allocations in its whole
//! process (progress thread and fabric I/O thread included) across the 10th to
//! 20th of 20 identical all-reduces, for each algorithm, and fails if any
//! happened.

mod common;

use std::time::Duration;

use fairring::{Algorithm, ReduceOp};

use common::allocations::{Counting, allocations};
use common::processes::{ProcessJob, rank_of_job};

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn no_allocation_per_all_reduce_on_any_rank() {
    let test = "no_allocation_per_all_reduce_on_any_rank";
    let Some(comm) = rank_of_job(test) else {
        let env = [
            ("FAIRRING_TIMEOUT", "60".to_owned()),
            ("FAIRRING_SLICE_SIZE", "1M".to_owned()),
            ("FAIRRING_TOTAL_MEMORY", "8M".to_owned()),
        ];
        ProcessJob::run(test, 2, 2, &env, Duration::from_secs(120));
        return;
    };
    // Large enough for several slices in flight, and a small one.
    for elements in [3 << 20, 1000] {
        for algorithm in Algorithm::ALL {
            let mut data = vec![1.0f32; elements];
            let mut counted = 0;
            for call in 0..20 {
                let before = allocations();
                comm.scope(|s| {
                    s.all_reduce_with(&mut data, ReduceOp::Sum, algorithm)
                        .unwrap()
                        .wait()
                })
                .unwrap();
                let after = allocations();
                if call >= 10 {
                    counted += after - before;
                }
            }
            assert_eq!(
                counted,
                0,
                "rank {}: {counted} allocations in 10 warm {algorithm} all-reduces of {elements} elements",
                comm.rank()
            );
            let world = comm.world_size() as f32;
            let expected = world.powi(20);
            let bad = data.iter().position(|&v| v != expected);
            assert!(
                bad.is_none(),
                "rank {} {algorithm} {elements}: element {bad:?} is {:?}, expected {expected}",
                comm.rank(),
                bad.map(|i| data[i])
            );
        }
    }
}
