//! The compressed wire: `f32` all-reduces whose values cross between machines as
//! bf16 or f16. On two machines of one device each the result is known exactly:
//! the machine serving an element adds its own value to the other's rounded one
//! and rounds the sum, and both ranks end with those bits. On more devices the
//! error stays within the documented bound; the bytes on the wire halve; other
//! types and single machines stay exact.
#![expect(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    reason = "test values"
)]

mod common;

use common::{Rng, job, job_with_servers, small_slices};
use fairring::{Algorithm, Error, ReduceOp, WireFormat};
use half::{bf16, f16};

const COMPRESSED: [WireFormat; 2] = [WireFormat::Bf16, WireFormat::F16];

/// `x` rounded through `wire` and back.
fn round(wire: WireFormat, x: f32) -> f32 {
    match wire {
        WireFormat::Bf16 => bf16::from_f32(x).to_f32(),
        WireFormat::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Values of varied magnitude and sign, within f16's range.
fn inputs(rank: u32, n: usize) -> Vec<f32> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (u64::from(rank + 1) * 0x2545_f491_4f6c_dd1d));
    (0..n)
        .map(|_| {
            let mantissa = (rng.next() >> 40) as f32 / (1u64 << 24) as f32;
            let exponent = (rng.next() % 16) as i32 - 8;
            let sign = if rng.next().is_multiple_of(2) {
                1.0
            } else {
                -1.0
            };
            sign * (1.0 + mantissa) * 2f32.powi(exponent)
        })
        .collect()
}

fn all_reduce_on(m: u32, d: u32, wire: WireFormat, op: ReduceOp, n: usize) -> Vec<(Vec<f32>, u64)> {
    job(
        m,
        d,
        |b| small_slices(b, Algorithm::Auto).wire(wire),
        |rank, comm| {
            assert_eq!(comm.wire(), wire);
            let mut x = inputs(rank, n);
            let before = comm.traffic().sent_bytes;
            comm.all_reduce(&mut x, op)
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            (x, comm.traffic().sent_bytes - before)
        },
    )
}

#[test]
fn two_machines_get_the_servers_rounding_bit_for_bit() {
    let n = 100_003;
    let (a, b) = (inputs(0, n), inputs(1, n));
    for wire in COMPRESSED {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
            let results = all_reduce_on(2, 1, wire, op, n);
            let (r0, r1) = (&results[0].0, &results[1].0);
            let combine = |own: f32, other: f32| match op {
                ReduceOp::Sum => own + other,
                ReduceOp::Avg => (own + other) / 2.0,
                _ => own.max(other),
            };
            let mut served = [0usize; 2];
            for i in 0..n {
                assert_eq!(
                    r0[i].to_bits(),
                    r1[i].to_bits(),
                    "{wire} {op}: the ranks differ at {i}"
                );
                // Served by machine 0 or by machine 1.
                let by0 = round(wire, combine(a[i], round(wire, b[i])));
                let by1 = round(wire, combine(round(wire, a[i]), b[i]));
                if r0[i].to_bits() == by0.to_bits() {
                    served[0] += 1;
                } else if r0[i].to_bits() == by1.to_bits() {
                    served[1] += 1;
                } else {
                    panic!(
                        "{wire} {op}: element {i} is {:e}; serving rounds {:e} + {:e} to {by0:e} or {by1:e}",
                        r0[i], a[i], b[i]
                    );
                }
            }
            // Both machines served shards (ties between the two candidates count
            // for machine 0, so machine 1 must show up on its own). Rounding is
            // monotone, so for max the two candidates are always equal.
            if op != ReduceOp::Max {
                assert!(served[1] > n / 10, "{wire} {op}: {served:?}");
            }
        }
    }
}

#[test]
fn dedicated_servers_reduce_the_compressed_wire_in_f32() {
    // Each machine's partial sum (exact in f32 for two local ranks, in either
    // order) leaves rounded; the server widens, combines in f32 and rounds the
    // result once, which every rank receives.
    let n = 60_001;
    // (2, 2, 2): two rail groups, a server for each device's slots.
    for (m, d, servers) in [(2, 1, 1), (2, 1, 2), (2, 2, 1), (2, 2, 2)] {
        let world = m * d;
        let all: Vec<Vec<f32>> = (0..world).map(|r| inputs(r, n)).collect();
        let partial = |op: ReduceOp, machine: u32, i: usize| -> f32 {
            let local = (0..d).map(|dev| all[(machine * d + dev) as usize][i]);
            match op {
                ReduceOp::Max => local.fold(f32::NEG_INFINITY, f32::max),
                _ => local.sum(),
            }
        };
        let run = |wire: WireFormat, op: ReduceOp| {
            job_with_servers(
                m,
                d,
                servers,
                |b| small_slices(b, Algorithm::Hierarchical).wire(wire),
                |rank, comm| {
                    let mut x = inputs(rank, n);
                    let before = comm.traffic().sent_bytes;
                    comm.all_reduce(&mut x, op)
                        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    (x, comm.traffic().sent_bytes - before)
                },
            )
        };
        let exact_bytes: u64 = run(WireFormat::Exact, ReduceOp::Sum)
            .iter()
            .map(|r| r.1)
            .sum();
        for wire in COMPRESSED {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let results = run(wire, op);
                for i in 0..n {
                    let (p0, p1) = (
                        round(wire, partial(op, 0, i)),
                        round(wire, partial(op, 1, i)),
                    );
                    let combined = match op {
                        ReduceOp::Sum => p0 + p1,
                        ReduceOp::Avg => (p0 + p1) / world as f32,
                        _ => p0.max(p1),
                    };
                    let want = round(wire, combined);
                    for (rank, (x, _)) in results.iter().enumerate() {
                        assert_eq!(
                            x[i].to_bits(),
                            want.to_bits(),
                            "{m}x{d}+{servers} {wire} {op}: rank {rank}, element {i} is {:e}, \
                             expected {want:e}",
                            x[i]
                        );
                    }
                }
                let sent: u64 = results.iter().map(|r| r.1).sum();
                let ratio = sent as f64 / exact_bytes as f64;
                assert!(
                    (0.49..=0.51).contains(&ratio),
                    "{m}x{d}+{servers} {wire}: the workers sent {sent} bytes against \
                     {exact_bytes} exact ({ratio:.3})"
                );
            }
        }
    }
}

#[test]
fn the_error_stays_within_two_roundings_and_every_rank_agrees() {
    let (m, d, n) = (2, 2, 70_001);
    let world = m * d;
    let all: Vec<Vec<f32>> = (0..world).map(|r| inputs(r, n)).collect();
    for wire in COMPRESSED {
        // Two roundings of at most half an ulp: 2^-8 relative for bf16's 8
        // significant bits, 2^-11 for f16's 11, of the partial sums' magnitudes
        // and of the result's; f32 arithmetic adds a little.
        let unit = match wire {
            WireFormat::Bf16 => 2f64.powi(-8),
            _ => 2f64.powi(-11),
        };
        let results = all_reduce_on(m, d, wire, ReduceOp::Sum, n);
        let mut worst = 0f64;
        for i in 0..n {
            let exact: f64 = all.iter().map(|x| f64::from(x[i])).sum();
            let magnitude: f64 = all.iter().map(|x| f64::from(x[i]).abs()).sum();
            let got = results[0].0[i];
            for (rank, (r, _)) in results.iter().enumerate() {
                assert_eq!(r[i].to_bits(), got.to_bits(), "{wire}: rank {rank} at {i}");
            }
            let error = (f64::from(got) - exact).abs();
            let bound = unit * (magnitude + f64::from(got).abs()) + 1e-6 * magnitude;
            assert!(
                error <= bound,
                "{wire}: element {i} is {got:e}, exactly {exact:e} (error {error:e} > {bound:e})"
            );
            worst = worst.max(error / magnitude);
        }
        // It does round: a wire that sent f32 would be far below the bound.
        assert!(
            worst > unit / 64.0,
            "{wire}: worst relative error {worst:e}"
        );
    }
}

#[test]
fn a_compressed_wire_sends_half_the_bytes() {
    let n = 250_000;
    for (m, d) in [(2, 1), (2, 2), (3, 1)] {
        let exact: u64 = all_reduce_on(m, d, WireFormat::Exact, ReduceOp::Sum, n)
            .iter()
            .map(|r| r.1)
            .sum();
        for wire in COMPRESSED {
            let sent: u64 = all_reduce_on(m, d, wire, ReduceOp::Sum, n)
                .iter()
                .map(|r| r.1)
                .sum();
            let ratio = sent as f64 / exact as f64;
            assert!(
                (0.49..=0.51).contains(&ratio),
                "{m}x{d} {wire}: {sent} bytes against {exact} exact ({ratio:.3})"
            );
        }
    }
}

#[test]
fn other_types_and_single_machines_stay_exact() {
    // Integers on a communicator whose f32 wire is compressed: exact.
    let results = job(
        2,
        1,
        |b| small_slices(b, Algorithm::Auto).wire(WireFormat::Bf16),
        |rank, comm| {
            let mut x: Vec<i32> = (0..50_000)
                .map(|i: i32| i.wrapping_mul(1_000_003) + rank as i32)
                .collect();
            comm.all_reduce(&mut x, ReduceOp::Sum).expect("i32");
            x
        },
    );
    for x in &results {
        for (i, v) in x.iter().enumerate() {
            let i = i as i32;
            assert_eq!(
                *v,
                i.wrapping_mul(1_000_003).wrapping_mul(2).wrapping_add(1)
            );
        }
    }
    // One machine: nothing crosses a wire, so f32 sums are exact (these are).
    let results = job(
        1,
        2,
        |b| small_slices(b, Algorithm::Auto).wire(WireFormat::Bf16),
        |rank, comm| {
            let mut x: Vec<f32> = (0..50_000)
                .map(|i| 1.0 + (i % 1000) as f32 / 1024.0 + rank as f32)
                .collect();
            comm.all_reduce(&mut x, ReduceOp::Sum).expect("f32");
            x
        },
    );
    for x in &results {
        for (i, v) in x.iter().enumerate() {
            assert_eq!(*v, 3.0 + 2.0 * (i % 1000) as f32 / 1024.0, "element {i}");
        }
    }
}

#[test]
fn asking_for_a_compressed_wire_on_an_integer_names_the_wire() {
    let results = job(
        2,
        1,
        |b| small_slices(b, Algorithm::Auto),
        |_, comm| {
            let mut x = vec![1i32; 10];
            let refused = comm.scope(|s| {
                s.all_reduce(&mut x, ReduceOp::Sum, on_wire(WireFormat::F16))
                    .map(drop)
            });
            // The communicator is still good: the refusal had no side effects.
            let mut y = vec![1.5f32; 10];
            comm.scope(|s| {
                s.all_reduce(&mut y, ReduceOp::Sum, on_wire(WireFormat::F16))?
                    .wait()
            })
            .expect("f32 on the f16 wire");
            (refused, y)
        },
    );
    for (refused, y) in results {
        match refused {
            Err(Error::InvalidArgument { argument, reason }) => {
                assert_eq!(argument, "wire");
                assert!(reason.contains("i32") && reason.contains("f16"), "{reason}");
            }
            other => panic!("expected the wire to be refused, got {other:?}"),
        }
        assert!(y.iter().all(|&v| v == 3.0), "{y:?}");
    }
}

/// Hierarchical, with `wire` between machines.
fn on_wire(wire: WireFormat) -> fairring::Options {
    fairring::Options {
        algorithm: Some(Algorithm::Hierarchical),
        wire: Some(wire),
    }
}

/// A reduce of 2 MiB or more between machines of one rank each runs as a
/// chain of exact messages, but one on a compressed wire keeps the wire: it
/// runs as a compressed all-reduce, sending about half the bytes the chain
/// would.
#[test]
fn a_large_reduce_on_a_compressed_wire_stays_compressed() {
    let n = (2 << 20) / 4 + 1;
    let results = job(
        2,
        1,
        |b| small_slices(b, Algorithm::Auto).wire(WireFormat::Bf16),
        |rank, comm| {
            let input = vec![rank as f32 + 1.0; n];
            let mut output = vec![0.0f32; n];
            let before = comm.traffic().sent_bytes;
            comm.reduce(&input, &mut output, ReduceOp::Sum, 0)
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            (output, comm.traffic().sent_bytes - before)
        },
    );
    assert!(results[0].0.iter().all(|&v| v == 3.0), "the sum");
    let chain = 4 * n as u64;
    let sent = results[1].1;
    assert!(
        sent < chain * 3 / 4,
        "rank 1 sent {sent} bytes; exact, a chain sends {chain}"
    );
}
