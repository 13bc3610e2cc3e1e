//! After warm-up, an all-reduce allocates nothing, on any thread of any rank.
//!
//! The test launches a 2x2 job of processes (this test binary, re-executed with
//! the rank in its environment). Each rank counts heap allocations in its whole
//! process (progress thread and fabric I/O thread included) across the 10th to
//! 20th of 20 identical all-reduces, for each algorithm, and fails if any
//! happened.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fairring::{Algorithm, ReduceOp};

use common::processes::{ProcessJob, rank_of_job};

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds `GlobalAlloc::dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller upholds `GlobalAlloc::realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

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
                let before = ALLOCATIONS.load(Ordering::Relaxed);
                comm.scope(|s| {
                    s.all_reduce_with(&mut data, ReduceOp::Sum, algorithm)
                        .unwrap()
                        .wait()
                })
                .unwrap();
                let after = ALLOCATIONS.load(Ordering::Relaxed);
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
