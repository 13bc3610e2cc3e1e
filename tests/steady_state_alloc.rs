//! After warm-up, an all-reduce allocates nothing, on any thread of any rank.
//!
//! Each test launches a job of processes (this test binary, re-executed with
//! the rank in its environment): 2x2, and 2x1, where hierarchical all-reduces
//! send from their tensors. Each rank counts heap allocations in its whole
//! process (progress thread and fabric I/O thread included) across the 10th to
//! 20th of 20 identical all-reduces, for each algorithm, and fails if any
//! happened.

mod common;

use std::time::Duration;

use fairring::{Algorithm, Communicator, ReduceOp};

use common::allocations::{Counting, allocations};
use common::processes::{ProcessJob, rank_of_job};

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn no_allocation_per_all_reduce_on_any_rank() {
    let test = "no_allocation_per_all_reduce_on_any_rank";
    match rank_of_job(test) {
        Some(comm) => warm_all_reduces_allocate_nothing(&comm),
        None => launch(test, 2, 2),
    }
}

/// One rank per machine: the hierarchical all-reduces send from their
/// tensors, whose registrations a warm rank keeps.
#[test]
fn no_allocation_per_all_reduce_sent_from_its_tensor() {
    let test = "no_allocation_per_all_reduce_sent_from_its_tensor";
    match rank_of_job(test) {
        Some(comm) => warm_all_reduces_allocate_nothing(&comm),
        None => launch(test, 2, 1),
    }
}

/// Runs `test`'s ranks as an `m x d` job of processes.
fn launch(test: &str, m: u32, d: u32) {
    let env = [
        ("FAIRRING_TIMEOUT", "60".to_owned()),
        ("FAIRRING_SLICE_SIZE", "1M".to_owned()),
        ("FAIRRING_TOTAL_MEMORY", "8M".to_owned()),
    ];
    ProcessJob::run(test, m, d, &env, Duration::from_secs(120));
}

/// Every algorithm, a large and a small all-reduce: none of the 10th to 20th
/// of 20 identical calls allocates.
fn warm_all_reduces_allocate_nothing(comm: &Communicator) {
    // Large enough for several slices in flight, and a small one.
    for elements in [3 << 20, 1000] {
        for &algorithm in Algorithm::ALL {
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
