//! Ranks that issue different operations under one sequence number: every rank
//! gets an error naming the sequence number and both sides' calls, well within
//! the timeout, and no rank reports success.

mod common;

use std::time::{Duration, Instant};

use common::job_and_servers;
use fairring::{Algorithm, Communicator, Error, ReduceOp, WireFormat};

const TIMEOUT: Duration = Duration::from_secs(5);

/// Runs `call(rank, comm)` on every rank of an `m x d` job after one matching
/// all-reduce, and checks that every rank fails with a mismatch at
/// sequence 1 naming `want_a` and `want_b`, and then refuses new work.
fn expect_mismatch(
    m: u32,
    d: u32,
    call: impl Fn(u32, &Communicator) -> fairring::Result<()> + Sync,
    want: [&str; 2],
) {
    expect_mismatch_with_servers(m, d, 0, call, want);
}

/// [`expect_mismatch`] in a job with `servers` dedicated servers, which must fail
/// with the job's error too.
fn expect_mismatch_with_servers(
    m: u32,
    d: u32,
    servers: u32,
    call: impl Fn(u32, &Communicator) -> fairring::Result<()> + Sync,
    want: [&str; 2],
) {
    let (results, served) = job_and_servers(
        m,
        d,
        servers,
        |b| b.timeout(TIMEOUT).algorithm(Algorithm::Auto),
        |rank, comm| {
            let start = Instant::now();
            // A rank may still be finishing the matching first operation when
            // another finds the mismatch and fails the job: then that operation
            // fails too, with the same error.
            let mut x = [1.0f32; 8];
            let r = comm
                .all_reduce(&mut x, ReduceOp::Sum)
                .and_then(|()| call(rank, comm));
            let took = start.elapsed();
            let mut after = [0u8; 4];
            let refused = comm.all_reduce(&mut after, ReduceOp::Sum);
            (r, took, refused)
        },
    );
    for (rank, (r, took, refused)) in results.into_iter().enumerate() {
        let e = r.expect_err(&format!("{m}x{d}: rank {rank} reported success"));
        let text = e.to_string();
        // A rank that learns of the mismatch before its own call is refused with
        // the same error inside `Failed`.
        let cause = match &e {
            Error::Failed { first } => first.as_ref(),
            other => other,
        };
        match cause {
            Error::Mismatch { sequence, .. } => assert_eq!(*sequence, 1, "{text}"),
            other => panic!("{m}x{d}: rank {rank}: not a mismatch: {other}"),
        }
        for w in want {
            assert!(
                text.contains(w),
                "{m}x{d}: rank {rank}: {text:?} lacks {w:?}"
            );
        }
        assert!(took < TIMEOUT, "{m}x{d}: rank {rank} took {took:?}");
        let refused = refused.expect_err("new work after a mismatch").to_string();
        assert!(refused.contains("failed earlier"), "{refused}");
    }
    for (index, outcome) in served.into_iter().enumerate() {
        let e = outcome.expect_err("a server of a failed job ends with its error");
        let cause = match &e {
            Error::Failed { first } => first.as_ref(),
            other => other,
        };
        assert!(
            matches!(cause, Error::Mismatch { sequence: 1, .. }),
            "server {index}: not the mismatch at #1: {e}"
        );
        // It names two workers' calls, not its own.
        let server_rank = m * d + u32::try_from(index).unwrap_or(u32::MAX);
        assert!(
            !e.to_string()
                .contains(&format!("rank {server_rank} called")),
            "server {index}: {e}"
        );
    }
}

#[test]
fn sizes_differ_with_dedicated_servers() {
    for (m, d, servers) in [(2, 1, 1), (2, 2, 2), (1, 2, 1)] {
        let last = m * d - 1;
        expect_mismatch_with_servers(
            m,
            d,
            servers,
            |rank, comm| {
                let mut x = vec![1.0f32; if rank == last { 20_000 } else { 10_000 }];
                comm.all_reduce(&mut x, ReduceOp::Sum)
            },
            ["all_reduce of 10000 x f32", "all_reduce of 20000 x f32"],
        );
    }
}

const LAYOUTS: [(u32, u32); 3] = [(1, 2), (2, 1), (2, 2)];

#[test]
fn sizes_differ() {
    for (m, d) in LAYOUTS {
        let last = m * d - 1;
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let mut x = vec![1.0f32; if rank == last { 200 } else { 100 }];
                comm.all_reduce(&mut x, ReduceOp::Sum)
            },
            ["all_reduce of 100 x f32", "all_reduce of 200 x f32"],
        );
    }
}

#[test]
fn types_and_operators_differ() {
    for (m, d) in LAYOUTS {
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                if rank == 0 {
                    comm.all_reduce(&mut [0i32; 64], ReduceOp::Sum)
                } else {
                    comm.all_reduce(&mut [0.0f32; 64], ReduceOp::Sum)
                }
            },
            ["64 x i32 (sum", "64 x f32 (sum"],
        );
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let op = if rank == 0 {
                    ReduceOp::Max
                } else {
                    ReduceOp::Min
                };
                comm.all_reduce(&mut [0.0f32; 64], op)
            },
            ["(max,", "(min,"],
        );
    }
}

#[test]
fn collectives_roots_and_algorithms_differ() {
    for (m, d) in LAYOUTS {
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                if rank == 0 {
                    comm.broadcast(&mut [0i32; 16], 0)
                } else {
                    comm.all_reduce(&mut [0i32; 16], ReduceOp::Sum)
                }
            },
            [
                "broadcast of 16 x i32 from rank 0",
                "all_reduce of 16 x i32",
            ],
        );
        expect_mismatch(
            m,
            d,
            |rank, comm| comm.broadcast(&mut [0i32; 16], u32::from(rank == 0)),
            ["from rank 1", "from rank 0"],
        );
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let algorithm = if rank == 0 {
                    Algorithm::Ring
                } else {
                    Algorithm::Hierarchical
                };
                let mut x = [0.0f32; 16];
                comm.scope(|s| s.all_reduce(&mut x, ReduceOp::Sum, algorithm)?.wait())
            },
            ["(sum, ring)", "(sum, hierarchical)"],
        );
    }
}

#[test]
fn a_skipped_call_of_another_shape() {
    for (m, d) in LAYOUTS {
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                // Every rank but 0 skips the barrier.
                if rank == 0 {
                    comm.barrier()?;
                }
                comm.all_reduce(&mut [0.0f32; 16], ReduceOp::Sum)
            },
            ["barrier", "all_reduce of 16 x f32"],
        );
    }
}

#[test]
fn wire_formats_differ() {
    for (m, d) in [(2, 1), (2, 2)] {
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let wire = if rank == 0 {
                    WireFormat::Bf16
                } else {
                    WireFormat::Exact
                };
                let mut x = vec![1.0f32; 1000];
                comm.scope(|s| s.all_reduce(&mut x, ReduceOp::Sum, on_wire(wire))?.wait())
            },
            [
                "all_reduce of 1000 x f32 (sum, hierarchical, bf16 wire)",
                "all_reduce of 1000 x f32 (sum, hierarchical)",
            ],
        );
    }
}

/// Hierarchical, with `wire` between machines.
fn on_wire(wire: WireFormat) -> fairring::Options {
    fairring::Options {
        algorithm: Some(fairring::Algorithm::Hierarchical),
        wire: Some(wire),
    }
}

/// Gathers, scatters and reduces of 2 MiB or more move as messages once a
/// check has passed: ranks that disagree on the root, the size or the
/// operator fail the check, naming both, and no message is matched against
/// another call's.
#[test]
fn roots_sizes_and_operators_of_calls_that_move_as_messages_differ() {
    for (m, d) in LAYOUTS {
        let world = (m * d) as usize;
        let n = (2 << 20) / world;
        let other_root = |rank: u32| u32::from(rank == 0);
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let mut output = vec![0u8; n * world];
                comm.gather(&vec![1u8; n], &mut output, other_root(rank))
            },
            [
                &format!("gather of {n} x u8 per rank, root 1"),
                &format!("gather of {n} x u8 per rank, root 0"),
            ],
        );
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let k = if rank == 0 { n } else { n + 1 };
                let mut input = vec![0u8; k * world];
                comm.scatter(&mut input, &mut vec![0u8; k], 0)
            },
            [
                &format!("scatter of {n} x u8 per rank, root 0"),
                &format!("scatter of {} x u8 per rank, root 0", n + 1),
            ],
        );
        let f = (2 << 20) / 4;
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let mut output = vec![0f32; f];
                comm.reduce(&vec![1f32; f], &mut output, ReduceOp::Sum, other_root(rank))
            },
            [
                &format!("reduce of {f} x f32 to rank 1"),
                &format!("reduce of {f} x f32 to rank 0"),
            ],
        );
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let op = if rank == 0 {
                    ReduceOp::Sum
                } else {
                    ReduceOp::Max
                };
                comm.reduce(&vec![1f32; f], &mut vec![0f32; f], op, 0)
            },
            ["(sum", "(max"],
        );
    }
}

#[test]
fn roots_of_reduces_gathers_and_scatters_differ() {
    for (m, d) in LAYOUTS {
        let other_root = |rank: u32| u32::from(rank == 0);
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                comm.reduce(
                    &[1i32; 16],
                    &mut [0i32; 16],
                    ReduceOp::Sum,
                    other_root(rank),
                )
            },
            [
                "reduce of 16 x i32 to rank 1",
                "reduce of 16 x i32 to rank 0",
            ],
        );
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let mut output = vec![0u8; 16 * (m * d) as usize];
                comm.gather(&[1u8; 16], &mut output, other_root(rank))
            },
            [
                "gather of 16 x u8 per rank, root 1",
                "gather of 16 x u8 per rank, root 0",
            ],
        );
        expect_mismatch(
            m,
            d,
            |rank, comm| {
                let mut input = vec![0u8; 16 * (m * d) as usize];
                if rank == 0 {
                    comm.scatter(&mut input, &mut [0u8; 16], 0)
                } else {
                    comm.broadcast(&mut input, 0)
                }
            },
            ["scatter of 16 x u8 per rank, root 0", "broadcast of"],
        );
    }
}
