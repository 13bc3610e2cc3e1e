//! After warm-up, an all-reduce allocates nothing, on any thread of any rank.
//!
//! Each test launches a job of processes (this test binary, re-executed with
//! the rank in its environment): 2x2; 2x1, where hierarchical all-reduces
//! send from their tensors; and 4x1 in pairs (`FAIRRING_GROUP_SIZE=2`), where
//! they run in two levels. Each rank counts heap allocations in its whole
//! process (progress thread and fabric I/O thread included) across the 10th to
//! 20th of 20 identical all-reduces, for each algorithm, and fails if any
//! happened. A job with a dedicated server runs as threads of one process
//! of its own, the server's among them.

mod common;

use std::sync::Barrier;
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

/// Four machines in pairs: the hierarchical all-reduces run in two levels.
#[test]
fn no_allocation_per_all_reduce_in_groups() {
    let test = "no_allocation_per_all_reduce_in_groups";
    match rank_of_job(test) {
        Some(comm) => warm_all_reduces_allocate_nothing(&comm),
        None => launch_with(test, 4, 1, &[("FAIRRING_GROUP_SIZE", "2")]),
    }
}

/// Three machines and a dedicated server, threads of one process of their
/// own (no other test's threads allocating beside them): the server folds
/// each slot's cells and sends the sums back, allocating nothing once warm
/// either. The ranks and the server share the count, so every rank counts
/// the same stretch: every rank's thread reads the count between barriers,
/// where none of them allocates.
#[test]
fn no_allocation_per_all_reduce_with_a_dedicated_server() {
    let test = "no_allocation_per_all_reduce_with_a_dedicated_server";
    if !common::processes::in_process_of_its_own(test) {
        common::processes::run_alone(test, Duration::from_secs(120));
        return;
    }
    let machines = 3;
    let between_calls = Barrier::new(machines as usize);
    let counted = common::job_with_servers(
        machines,
        1,
        1,
        |b| {
            b.slice_bytes(1 << 20)
                .min_shard_bytes(64 << 10)
                .total_memory(8 << 20)
                .algorithm(Algorithm::Hierarchical)
                .timeout(Duration::from_secs(60))
        },
        |rank, comm| {
            let mut counts = Vec::new();
            for (elements, op) in [
                (3 << 20, ReduceOp::Sum),
                (1000, ReduceOp::Sum),
                (3 << 20, ReduceOp::Avg),
            ] {
                let mut data = vec![1.0f32; elements];
                let mut all_reduce = || {
                    comm.scope(|s| {
                        s.all_reduce(&mut data, op, Algorithm::Hierarchical)
                            .unwrap()
                            .wait()
                    })
                    .unwrap();
                };
                for _ in 0..10 {
                    all_reduce();
                }
                between_calls.wait();
                let before = allocations();
                for _ in 0..10 {
                    all_reduce();
                }
                between_calls.wait();
                let after = allocations();
                between_calls.wait();
                counts.push((elements, op, after - before));
                let expected = if op == ReduceOp::Sum {
                    (0..20).fold(1f32, |x, _| x * 3.0)
                } else {
                    1.0
                };
                let bad = data.iter().position(|&v| v != expected);
                assert!(
                    bad.is_none(),
                    "rank {rank} {op:?} {elements}: element {bad:?} is {:?}, expected {expected}",
                    bad.map(|i| data[i])
                );
            }
            counts
        },
    );
    for (rank, counts) in counted.iter().enumerate() {
        for &(elements, op, n) in counts {
            assert_eq!(
                n, 0,
                "{n} allocations in the job's process while rank {rank} ran 10 warm {op:?} \
                 all-reduces of {elements} elements with a dedicated server"
            );
        }
    }
}

/// Runs `test`'s ranks as an `m x d` job of processes.
fn launch(test: &str, m: u32, d: u32) {
    launch_with(test, m, d, &[]);
}

/// [`launch`], with `more` in every rank's environment.
fn launch_with(test: &str, m: u32, d: u32, more: &[(&str, &str)]) {
    let mut env = vec![
        ("FAIRRING_TIMEOUT", "60".to_owned()),
        ("FAIRRING_SLICE_SIZE", "1M".to_owned()),
        ("FAIRRING_TOTAL_MEMORY", "8M".to_owned()),
    ];
    env.extend(more.iter().map(|&(k, v)| (k, v.to_owned())));
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
                    s.all_reduce(&mut data, ReduceOp::Sum, algorithm)
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

/// The rooted collectives and point-to-point messages (a ping-pong and an
/// all-to-all), between machines and within one.
#[test]
fn no_allocation_per_warm_rooted_collective_or_message() {
    let test = "no_allocation_per_warm_rooted_collective_or_message";
    match rank_of_job(test) {
        Some(comm) => warm_rooted_and_messages_allocate_nothing(&comm),
        None => {
            launch(test, 2, 1);
            launch(test, 1, 2);
        }
    }
}

/// Counts the allocations of the 10th to 20th of 20 calls of `call`, on
/// every thread of this process; fails naming `what` if there were any.
fn none_when_warm(comm: &Communicator, what: &str, mut call: impl FnMut()) {
    let mut counted = 0;
    for i in 0..20 {
        let before = allocations();
        call();
        if i >= 10 {
            counted += allocations() - before;
        }
    }
    assert_eq!(
        counted,
        0,
        "rank {}: {counted} allocations in 10 warm {what}",
        comm.rank()
    );
}

fn warm_rooted_and_messages_allocate_nothing(comm: &Communicator) {
    let (rank, world) = (comm.rank(), comm.world_size());
    // 2 MiB gathers and scatters: they move as messages.
    let n = 1 << 19;
    let mut input = vec![1.0f32; n];
    let mut output = vec![0.0f32; n * world as usize];
    let peer = 1 - rank;
    let mut back = vec![0.0f32; n];
    let counts = vec![(n / world as usize) as u64; world as usize];
    // Each pair is linked first where it has no connection yet: a link goes
    // through the store that rank 0's process serves (allocating there), and
    // ranks reach each step at different times.
    comm.send_recv(
        &mut [(peer, &mut input[..1])],
        &mut [(peer, &mut back[..1])],
    )
    .unwrap();
    comm.barrier().unwrap();
    none_when_warm(comm, "reduces", || {
        comm.reduce(&input, &mut output[..n], ReduceOp::Sum, 0)
            .unwrap();
    });
    assert!(rank != 0 || output[..n].iter().all(|&v| v == world as f32));
    none_when_warm(comm, "gathers", || {
        comm.gather(&input[..n / 2], &mut output[..n / 2 * world as usize], 1)
            .unwrap();
    });
    none_when_warm(comm, "scatters", || {
        let (whole, part) = output.split_at_mut(n);
        comm.scatter(&mut whole[..n], &mut part[..n / world as usize], 0)
            .unwrap();
    });
    none_when_warm(comm, "ping-pongs", || {
        if rank == 0 {
            comm.send(peer, &mut input).unwrap();
            comm.recv(peer, &mut back).unwrap();
        } else {
            comm.recv(peer, &mut back).unwrap();
            comm.send(peer, &mut back).unwrap();
        }
    });
    assert!(
        back.iter().all(|&v| v == 1.0),
        "rank {rank}: the ping-pong's data"
    );
    none_when_warm(comm, "all-to-alls", || {
        comm.all_to_all_v(&mut input, &counts, &mut back, &counts)
            .unwrap();
    });
}
