//! Broadcast, all-gather, reduce-scatter, barrier and coalesced all-reduce across
//! simulated machines in one process, on every layout and algorithm, checked
//! exactly against values computed here.
#![expect(clippy::cast_possible_truncation, reason = "test values are small")]

mod common;

use std::sync::atomic::{AtomicU32, Ordering};

use common::{SERVER_LAYOUTS, job, job_and_servers, job_with_servers, small_slices};
use fairring::core::reduce::Element;
use fairring::{Algorithm, ReduceOp};

const LAYOUTS: [(u32, u32); 4] = [(1, 1), (1, 3), (2, 2), (3, 1)];

/// Rank `rank`'s value at element `i` of tensor `k`: distinct per rank, so that a
/// value from the wrong rank or offset is caught.
fn value(rank: u32, k: usize, i: usize) -> i64 {
    (i64::from(rank) << 40) ^ ((k as i64) << 32) ^ (i as i64 * 2_654_435_761 % 1_000_003)
}

/// The `f32` bit pattern of [`value`], sign flipped: the rank and tensor still
/// tell patterns apart, and NaN payloads and `-0.0` occur.
fn bits(rank: u32, k: usize, i: usize) -> u32 {
    let v = value(rank, k, i);
    (v ^ (v >> 29)) as u32 ^ 0x8000_0000
}

/// Element counts: tiny, odd, and spanning several 64 KiB slices.
const SIZES: [usize; 4] = [1, 7, 1001, 40_003];

/// Every co-located layout with every algorithm, then every layout with
/// dedicated servers: hierarchical (the servers' algorithm), the ring (over
/// the workers' rails where machines have several devices) and `auto`.
fn for_every_layout(test: impl Fn(u32, u32, u32, Algorithm)) {
    for (m, d) in LAYOUTS {
        for &algorithm in Algorithm::ALL {
            test(m, d, 0, algorithm);
        }
    }
    for (m, d, servers) in SERVER_LAYOUTS {
        for algorithm in [Algorithm::Hierarchical, Algorithm::Ring, Algorithm::Auto] {
            test(m, d, servers, algorithm);
        }
    }
}

#[test]
fn broadcast_from_every_root() {
    for_every_layout(|m, d, servers, algorithm| {
        let world = m * d;
        let results = job_with_servers(
            m,
            d,
            servers,
            |b| small_slices(b, algorithm),
            |rank, comm| {
                let mut out = Vec::new();
                for root in 0..world {
                    for (k, &n) in SIZES.iter().enumerate() {
                        // f32 bit patterns including NaN payloads and -0.0 must
                        // arrive untouched.
                        let mut data: Vec<f32> =
                            (0..n).map(|i| f32::from_bits(bits(rank, k, i))).collect();
                        comm.broadcast(&mut data, root)
                            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                        out.push((root, k, data));
                    }
                }
                out
            },
        );
        for (rank, per_rank) in results.iter().enumerate() {
            for (root, k, data) in per_rank {
                let wrong = data
                    .iter()
                    .enumerate()
                    .filter(|&(i, v)| v.to_bits() != bits(*root, *k, i))
                    .count();
                assert_eq!(
                    wrong, 0,
                    "{m}x{d}+{servers} {algorithm}: rank {rank}, root {root}, tensor {k}: {wrong} wrong"
                );
            }
        }
    });
}

/// A broadcast's root sends from its tensor (from any size) or stages it
/// (never), relaying over machines of one rank each: the same exact results
/// from every root, with several broadcasts in flight over many slices, and
/// the root's tensor left as it was.
#[test]
fn broadcasts_sent_from_the_roots_tensor_match_staged_ones() {
    for (m, direct_from) in [(2, Some(0)), (3, Some(0)), (3, None), (4, Some(0))] {
        let results = job(
            m,
            1,
            |b| small_slices(b, Algorithm::Ring).direct_from(direct_from),
            |rank, comm| {
                let mut out = Vec::new();
                for root in 0..m {
                    let mut tensors: Vec<Vec<i32>> = SIZES
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| (0..n).map(|i| bits(rank, k, i) as i32).collect())
                        .collect();
                    comm.scope(|s| {
                        let works: Vec<_> = tensors
                            .iter_mut()
                            .map(|t| s.broadcast(t, root, ()).unwrap())
                            .collect();
                        for w in works {
                            w.wait().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                        }
                    });
                    out.push((root, tensors));
                }
                out
            },
        );
        for (rank, per_rank) in results.iter().enumerate() {
            for (root, tensors) in per_rank {
                for (k, t) in tensors.iter().enumerate() {
                    let wrong = t
                        .iter()
                        .enumerate()
                        .filter(|&(i, &v)| v != bits(*root, k, i) as i32)
                        .count();
                    assert_eq!(
                        wrong, 0,
                        "{m}x1, from {direct_from:?}: rank {rank}, root {root}, tensor {k}"
                    );
                }
            }
        }
    }
}

#[test]
fn all_gather_places_every_input() {
    for_every_layout(|m, d, servers, algorithm| {
        let world = m * d;
        let results = job_with_servers(
            m,
            d,
            servers,
            |b| small_slices(b, algorithm),
            |rank, comm| {
                SIZES
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| {
                        let input: Vec<i64> = (0..n).map(|i| value(rank, k, i)).collect();
                        let mut output = vec![-1i64; n * world as usize];
                        comm.all_gather(&input, &mut output)
                            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                        output
                    })
                    .collect::<Vec<_>>()
            },
        );
        for (rank, outputs) in results.iter().enumerate() {
            for (k, output) in outputs.iter().enumerate() {
                let n = SIZES[k];
                let wrong = output
                    .iter()
                    .enumerate()
                    .filter(|&(j, &v)| v != value((j / n) as u32, k, j % n))
                    .count();
                assert_eq!(
                    wrong, 0,
                    "{m}x{d}+{servers} {algorithm}: rank {rank}, tensor {k}"
                );
            }
        }
    });
}

/// Beside dedicated servers `auto` relays broadcasts and all-gathers and
/// scatters reduce-scatters around the workers' rails (on one machine, within
/// it), as a job without servers does: every result exact, the servers
/// moving no byte of them, and the workers sending what the rails take. An
/// all-reduce through the servers would move bytes through them, and a relay
/// or a scatter over the ranks would send between ranks of one machine too:
/// a broadcast's every rank but the ring's last its whole tensor, a
/// reduce-scatter's every rank `(N-1)/N` of its input.
#[test]
fn beside_servers_auto_relays_and_scatters_around_the_rails() {
    let n = 1 << 16; // i64 elements per rank and call: 512 KiB
    for (m, d, servers) in [(2, 2, 2), (2, 4, 2), (1, 2, 1)] {
        let world = m * d;
        let all = n * world as usize;
        let (results, served) = job_and_servers(
            m,
            d,
            servers,
            |b| b.algorithm(Algorithm::Auto),
            |rank, comm| {
                let mut sent = Vec::new();
                let mut wrong = 0;
                let before = comm.traffic().sent_bytes;
                let mut data: Vec<i64> = (0..all).map(|i| value(rank, 0, i)).collect();
                comm.broadcast(&mut data, 0).expect("broadcast");
                wrong += (0..all).filter(|&i| data[i] != value(0, 0, i)).count();
                sent.push(comm.traffic().sent_bytes - before);
                let before = comm.traffic().sent_bytes;
                let input: Vec<i64> = (0..n).map(|i| value(rank, 1, i)).collect();
                let mut output = vec![-1i64; all];
                comm.all_gather(&input, &mut output).expect("all-gather");
                wrong += (0..all)
                    .filter(|&j| output[j] != value((j / n) as u32, 1, j % n))
                    .count();
                sent.push(comm.traffic().sent_bytes - before);
                let before = comm.traffic().sent_bytes;
                let mut input: Vec<i64> = (0..all).map(|i| value(rank, 2, i)).collect();
                let mut share = vec![-1i64; n];
                comm.reduce_scatter(&mut input, &mut share, ReduceOp::Sum)
                    .expect("reduce-scatter");
                let own = rank as usize * n;
                wrong += (0..n)
                    .filter(|&i| {
                        share[i]
                            != (0..world).fold(0i64, |a, r| a.wrapping_add(value(r, 2, own + i)))
                    })
                    .count();
                sent.push(comm.traffic().sent_bytes - before);
                (wrong, sent)
            },
        );
        let what = format!("{m}x{d}+{servers}");
        for (index, outcome) in served.into_iter().enumerate() {
            let moved = outcome.unwrap_or_else(|e| panic!("{what}: server {index}: {e}"));
            assert_eq!(
                (moved.sent_bytes, moved.received_bytes),
                (0, 0),
                "{what}: server {index} moved bytes"
            );
        }
        let bytes = (all * 8) as u64;
        let (mut broadcast, mut all_gather, mut reduce_scatter) = (0, 0, 0);
        for (rank, (wrong, sent)) in results.iter().enumerate() {
            assert_eq!(*wrong, 0, "{what}: rank {rank}");
            broadcast += sent[0];
            all_gather += sent[1];
            reduce_scatter = reduce_scatter.max(sent[2]);
        }
        // Around the rails a broadcast's tensor crosses to each other machine
        // once, spread over the rails: `(M - 1) S` in all, and so does each
        // machine's part of an all-gather's output; a reduce-scatter
        // sends `(M - 1) / M` of each rank's slot, an `N`th of its input per
        // other machine.
        assert_eq!(broadcast, u64::from(m - 1) * bytes, "{what}: broadcast");
        assert_eq!(all_gather, u64::from(m - 1) * bytes, "{what}: all-gather");
        assert_eq!(
            reduce_scatter,
            u64::from(m - 1) * bytes / u64::from(world),
            "{what}: reduce-scatter"
        );
    }
}

/// Runs a reduce-scatter with `op` of every size in [`SIZES`] on an `m x d`
/// job (rank `r`'s element `i` of tensor `k` being `input(r, k, i)`) and checks
/// every rank's share: element `j` of the whole result must be `want(k, j)`, in
/// the output and in the input's own share alike.
fn check_reduce_scatter<T: Element + PartialEq + Send + Sync>(
    (m, d, servers): (u32, u32, u32),
    algorithm: Algorithm,
    op: ReduceOp,
    input: impl Fn(u32, usize, usize) -> T + Sync,
    want: impl Fn(usize, usize) -> T,
    fill: T,
) {
    let world = m * d;
    let results = job_with_servers(
        m,
        d,
        servers,
        |b| small_slices(b, algorithm),
        |rank, comm| {
            SIZES
                .iter()
                .enumerate()
                .map(|(k, &n)| {
                    let mut all: Vec<T> =
                        (0..n * world as usize).map(|i| input(rank, k, i)).collect();
                    let mut output = vec![fill; n];
                    comm.reduce_scatter(&mut all, &mut output, op)
                        .unwrap_or_else(|e| {
                            panic!("{m}x{d}+{servers} {algorithm} {op}: rank {rank}: {e}")
                        });
                    let share = all[rank as usize * n..(rank as usize + 1) * n].to_vec();
                    (output, share)
                })
                .collect::<Vec<_>>()
        },
    );
    for (rank, outputs) in results.iter().enumerate() {
        for (k, (output, share)) in outputs.iter().enumerate() {
            let n = SIZES[k];
            let wrong = |got: &[T]| {
                got.iter()
                    .enumerate()
                    .filter(|&(i, v)| *v != want(k, rank * n + i))
                    .count()
            };
            let context = format!("{m}x{d}+{servers} {algorithm} {op}: rank {rank}, tensor {k}");
            assert_eq!(wrong(output), 0, "{context}: output");
            assert_eq!(wrong(share), 0, "{context}: the input's own share");
        }
    }
}

#[test]
fn reduce_scatter_leaves_each_rank_its_share() {
    for_every_layout(|m, d, servers, algorithm| {
        let world = m * d;
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let want = |k, j| {
                let all = (0..world).map(|r| value(r, k, j));
                match op {
                    ReduceOp::Max => all.max().unwrap_or(0),
                    _ => all.fold(0i64, i64::wrapping_add),
                }
            };
            check_reduce_scatter((m, d, servers), algorithm, op, value, want, -1);
        }
    });
}

#[test]
fn reduce_scatter_averages_each_share_once() {
    // The scatter algorithm divides a share once, after its last partial; the
    // others average the whole input. Sums of these small integers are exact in
    // f64, so each quotient is the one correctly rounded value.
    let small = |r, k, i| (value(r, k, i) % 1000) as f64;
    for (m, d) in [(2, 1), (3, 1), (2, 2), (1, 3)] {
        let world = m * d;
        let want = |k, j| (0..world).map(|r| small(r, k, j)).sum::<f64>() / f64::from(world);
        for &algorithm in Algorithm::ALL {
            check_reduce_scatter((m, d, 0), algorithm, ReduceOp::Avg, small, want, f64::NAN);
        }
    }
}

#[test]
fn barrier_waits_for_every_rank() {
    for_every_layout(|m, d, servers, algorithm| {
        let world = m * d;
        let arrived = AtomicU32::new(0);
        let seen = job_with_servers(
            m,
            d,
            servers,
            |b| small_slices(b, algorithm),
            |rank, comm| {
                let mut seen = Vec::new();
                for round in 1..=3u32 {
                    if rank == round % world {
                        // The late rank: the others must not pass before it.
                        std::thread::sleep(std::time::Duration::from_millis(30));
                    }
                    arrived.fetch_add(1, Ordering::SeqCst);
                    comm.barrier()
                        .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    seen.push((round, arrived.load(Ordering::SeqCst)));
                }
                seen
            },
        );
        for (rank, rounds) in seen.iter().enumerate() {
            for &(round, count) in rounds {
                assert!(
                    count >= round * world,
                    "{m}x{d}+{servers} {algorithm}: rank {rank} left barrier {round} after only {count} \
                     arrivals (want {})",
                    round * world
                );
            }
        }
    });
}

#[test]
fn coalesced_all_reduce_of_many_tensors() {
    for_every_layout(|m, d, servers, algorithm| {
        let world = m * d;
        let results = job_with_servers(
            m,
            d,
            servers,
            |b| small_slices(b, algorithm),
            |rank, comm| {
                let mut tensors: Vec<Vec<i64>> = (0..12)
                    .map(|k| (0..SIZES[k % 4] + k).map(|i| value(rank, k, i)).collect())
                    .collect();
                let mut views: Vec<&mut [i64]> =
                    tensors.iter_mut().map(Vec::as_mut_slice).collect();
                comm.all_reduce_fused(&mut views, ReduceOp::Sum)
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                // An empty group is a no-op that still completes.
                comm.all_reduce_fused::<i64>(&mut [], ReduceOp::Sum)
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                tensors
            },
        );
        for (rank, tensors) in results.iter().enumerate() {
            for (k, t) in tensors.iter().enumerate() {
                let wrong = t
                    .iter()
                    .enumerate()
                    .filter(|&(i, &v)| {
                        v != (0..world)
                            .map(|r| value(r, k, i))
                            .fold(0, i64::wrapping_add)
                    })
                    .count();
                assert_eq!(
                    wrong, 0,
                    "{m}x{d}+{servers} {algorithm}: rank {rank}, tensor {k}"
                );
            }
        }
    });
}

#[test]
fn collectives_refuse_bad_shapes_without_side_effects() {
    job(
        2,
        1,
        |b| b,
        |rank, comm| {
            let input = [1i32, 2, 3];
            let mut output = [7i32; 5];
            let e = comm
                .all_gather(&input, &mut output)
                .unwrap_err()
                .to_string();
            assert!(e.contains("output") && e.contains("need 6"), "{e}");
            assert_eq!(output, [7; 5]);
            let mut input = [9i32; 5];
            let mut share = [7i32; 2];
            let e = comm
                .reduce_scatter(&mut input, &mut share, ReduceOp::Sum)
                .unwrap_err()
                .to_string();
            assert!(e.contains("input") && e.contains("need 4"), "{e}");
            assert_eq!((input, share), ([9; 5], [7; 2]));
            let mut data = [5u8; 4];
            let e = comm.broadcast(&mut data, 2).unwrap_err().to_string();
            assert!(e.contains("root") && e.contains("rank 2"), "{e}");
            assert_eq!(data, [5; 4]);
            let e = comm
                .reduce_scatter(&mut [1i32; 2], &mut [0i32; 1], ReduceOp::Avg)
                .unwrap_err()
                .to_string();
            assert!(e.contains("avg") && e.contains("i32"), "{e}");
            // Refusals used no sequence number: the ranks still agree.
            let mut x = [rank as i32 + 1];
            comm.all_reduce(&mut x, ReduceOp::Sum)
                .expect("after refusals");
            assert_eq!(x, [3]);
        },
    );
}

#[test]
fn an_in_place_all_gather_reads_its_input_from_its_own_place() {
    // As torch's all_gather_into_tensor passes it: the input is this rank's
    // place in the output.
    let results = job(
        2,
        2,
        |b| b,
        |rank, comm| {
            let n = 1001usize;
            let world = comm.world_size() as usize;
            let mut output = vec![-1i64; n * world];
            let at = rank as usize * n;
            for (i, x) in output[at..at + n].iter_mut().enumerate() {
                *x = value(rank, 0, i);
            }
            let base = output.as_mut_ptr();
            // SAFETY: `output` outlives the wait below and is not touched until
            // then; the input is its own place in it.
            let work = unsafe {
                comm.start(&fairring::Call::all_gather(
                    base.wrapping_add(at).cast::<u8>().cast_const(),
                    base.cast(),
                    n as u64,
                    fairring::DataType::I64,
                ))
            };
            work.and_then(fairring::Work::wait)
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            output
        },
    );
    for output in results {
        let expected: Vec<i64> = (0..4u32)
            .flat_map(|r| (0..1001).map(move |i| value(r, 0, i)))
            .collect();
        assert_eq!(output, expected);
    }
}

/// Every rank's tensors of `T` reduced with every `op` of `ops`, all sizes of
/// [`SIZES`], in one job per layout; element `i` of tensor `k` must be
/// `want(op, k, i)` on every rank.
fn check_all_reduce<T: Element + PartialEq + Send + Sync + std::fmt::Debug>(
    (m, d, servers): (u32, u32, u32),
    algorithm: Algorithm,
    ops: &[ReduceOp],
    input: impl Fn(u32, usize, usize) -> T + Sync,
    want: impl Fn(ReduceOp, usize, usize) -> T,
) {
    let results = job_with_servers(
        m,
        d,
        servers,
        |b| small_slices(b, algorithm),
        |rank, comm| {
            ops.iter()
                .map(|&op| {
                    SIZES
                        .iter()
                        .enumerate()
                        .map(|(k, &n)| {
                            let mut data: Vec<T> = (0..n).map(|i| input(rank, k, i)).collect();
                            comm.all_reduce(&mut data, op).unwrap_or_else(|e| {
                                panic!("{m}x{d}+{servers} {algorithm} {op}: rank {rank}: {e}")
                            });
                            data
                        })
                        .collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        },
    );
    for (rank, per_op) in results.iter().enumerate() {
        for (&op, tensors) in ops.iter().zip(per_op) {
            for (k, got) in tensors.iter().enumerate() {
                let bad = got.iter().enumerate().find(|&(i, v)| *v != want(op, k, i));
                assert_eq!(
                    bad,
                    None,
                    "{m}x{d}+{servers} {algorithm} {} {op}: rank {rank}, tensor {k}",
                    T::DTYPE
                );
            }
        }
    }
}

#[test]
fn bitwise_operators_i16_and_bool_reduce_exactly() {
    use fairring::core::reduce::Bool;
    for_every_layout(|m, d, servers, algorithm| {
        let layout = (m, d, servers);
        let world = m * d;
        let bitwise = [ReduceOp::BitAnd, ReduceOp::BitOr, ReduceOp::BitXor];
        let fold = |op: ReduceOp, all: &mut dyn Iterator<Item = i64>| match op {
            ReduceOp::BitAnd => all.fold(-1, |a, b| a & b),
            ReduceOp::BitOr => all.fold(0, |a, b| a | b),
            ReduceOp::BitXor => all.fold(0, |a, b| a ^ b),
            ReduceOp::Sum => all.fold(0, i64::wrapping_add),
            ReduceOp::Min => all.min().unwrap_or(0),
            _ => all.max().unwrap_or(0),
        };
        // i16: every bitwise operator, and sums that wrap at 16 bits.
        let i16_ops = [bitwise.as_slice(), &[ReduceOp::Sum, ReduceOp::Min]].concat();
        check_all_reduce(
            layout,
            algorithm,
            &i16_ops,
            |r, k, i| (value(r, k, i) ^ (value(r, k, i) >> 40)) as i16,
            |op, k, i| {
                let mut all =
                    (0..world).map(|r| i64::from((value(r, k, i) ^ (value(r, k, i) >> 40)) as i16));
                let folded = fold(op, &mut all);
                folded as i16
            },
        );
        // Wider integers: the bitwise operators on their high bits too.
        check_all_reduce(layout, algorithm, &bitwise, value, |op, k, i| {
            fold(op, &mut (0..world).map(|r| value(r, k, i)))
        });
        check_all_reduce(
            layout,
            algorithm,
            &bitwise,
            |r, k, i| value(r, k, i) as u8,
            |op, k, i| fold(op, &mut (0..world).map(|r| i64::from(value(r, k, i) as u8))) as u8,
        );
        // bool: true bytes other than 1, every result 0 or 1.
        let truth = |r: u32, k: usize, i: usize| Bool(((value(r, k, i) >> 3) % 3) as u8 * 0x41);
        check_all_reduce(
            layout,
            algorithm,
            &[
                ReduceOp::Sum,
                ReduceOp::Product,
                ReduceOp::Min,
                ReduceOp::Max,
                ReduceOp::BitAnd,
                ReduceOp::BitOr,
                ReduceOp::BitXor,
            ],
            truth,
            |op, k, i| {
                if world == 1 {
                    return truth(0, k, i); // nothing combined: the bytes as they are
                }
                let mut all = (0..world).map(|r| truth(r, k, i).0 != 0);
                Bool(u8::from(match op {
                    ReduceOp::Sum | ReduceOp::Max | ReduceOp::BitOr => all.any(|t| t),
                    ReduceOp::Product | ReduceOp::Min | ReduceOp::BitAnd => all.all(|t| t),
                    _ => all.filter(|&t| t).count() % 2 == 1,
                }))
            },
        );
        // Reduce-scatter of the new type and operators.
        let half = |r: u32, k: usize, i: usize| (value(r, k, i) >> 7) as i16;
        check_reduce_scatter(
            layout,
            algorithm,
            ReduceOp::BitXor,
            half,
            |k, j| (0..world).fold(0i16, |a, r| a ^ half(r, k, j)),
            -1,
        );
        check_reduce_scatter(
            layout,
            algorithm,
            ReduceOp::BitAnd,
            truth,
            |k, j| match world {
                1 => truth(0, k, j),
                _ => Bool(u8::from((0..world).all(|r| truth(r, k, j).0 != 0))),
            },
            Bool(7),
        );
    });
}

#[test]
fn bitwise_operators_on_floats_and_avg_on_bool_are_refused_naming_the_op() {
    job(
        1,
        2,
        |b| b,
        |_, comm| {
            let mut f = vec![1.0f32; 8];
            let e = comm
                .all_reduce(&mut f, ReduceOp::BitOr)
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("op") && e.contains("bor") && e.contains("f32"),
                "{e}"
            );
            let mut b = vec![fairring::core::reduce::Bool(1); 8];
            let e = comm
                .all_reduce(&mut b, ReduceOp::Avg)
                .unwrap_err()
                .to_string();
            assert!(e.contains("avg") && e.contains("bool"), "{e}");
            // Refusals number nothing: the ranks still agree.
            comm.all_reduce(&mut f, ReduceOp::Sum).unwrap();
            assert_eq!(f, vec![2.0; 8]);
        },
    );
}

/// Reduces `data` in place to `root`, through [`fairring::Call::reduce`].
fn reduce_in_place<T: Element>(
    comm: &fairring::Communicator,
    data: &mut [T],
    op: ReduceOp,
    root: u32,
) -> fairring::Result<()> {
    let p = data.as_mut_ptr();
    let n = data.len() as u64;
    let call = fairring::Call::reduce(p.cast_const().cast(), p.cast(), n, T::DTYPE, op, root);
    // SAFETY: `data` is borrowed mutably until the work has been waited for.
    unsafe { comm.start(&call) }.and_then(|work| work.wait())
}

#[test]
fn reduce_gather_and_scatter_to_and_from_every_root() {
    for_every_layout(|m, d, servers, algorithm| {
        let world = m * d;
        let w = world as usize;
        let label = format!("{m}x{d}+{servers} {algorithm}");
        let results = job_with_servers(
            m,
            d,
            servers,
            |b| small_slices(b, algorithm),
            |rank, comm| {
                let mut out = Vec::new();
                for root in 0..world {
                    for (k, &n) in SIZES.iter().enumerate() {
                        // Reduce, not in place: the input stays as it was.
                        let input: Vec<i64> = (0..n).map(|i| value(rank, k, i)).collect();
                        let mut reduced = vec![-1i64; n];
                        comm.reduce(&input, &mut reduced, ReduceOp::BitXor, root)
                            .unwrap_or_else(|e| panic!("{label}: rank {rank}: reduce: {e}"));
                        assert!(
                            input
                                .iter()
                                .enumerate()
                                .all(|(i, &v)| v == value(rank, k, i))
                        );
                        // In place.
                        let mut in_place: Vec<i64> = input.clone();
                        reduce_in_place(comm, &mut in_place, ReduceOp::Max, root).unwrap_or_else(
                            |e| panic!("{label}: rank {rank}: reduce in place: {e}"),
                        );
                        // Gather of f32 bit patterns (NaN payloads, -0.0).
                        let mine: Vec<f32> =
                            (0..n).map(|i| f32::from_bits(bits(rank, k, i))).collect();
                        let mut gathered = vec![0.0f32; n * w];
                        comm.gather(&mine, &mut gathered, root)
                            .unwrap_or_else(|e| panic!("{label}: rank {rank}: gather: {e}"));
                        // Scatter: only the root's input matters.
                        let mut parts: Vec<f32> = (0..n * w)
                            .map(|i| f32::from_bits(bits(rank, k + 7, i)))
                            .collect();
                        let mut part = vec![1.5f32; n];
                        comm.scatter(&mut parts, &mut part, root)
                            .unwrap_or_else(|e| panic!("{label}: rank {rank}: scatter: {e}"));
                        if rank == root {
                            out.push((root, k, reduced, in_place, gathered, part));
                        } else {
                            out.push((root, k, Vec::new(), Vec::new(), Vec::new(), part));
                        }
                    }
                }
                out
            },
        );
        for (rank, per_rank) in results.iter().enumerate() {
            for (root, k, reduced, in_place, gathered, part) in per_rank {
                let (root, k) = (*root, *k);
                let n = SIZES[k];
                let context = format!("{label}: rank {rank}, root {root}, tensor {k}");
                if rank as u32 == root {
                    let xor = |i| (0..world).fold(0i64, |a, r| a ^ value(r, k, i));
                    let max = |i| (0..world).map(|r| value(r, k, i)).max().unwrap_or(0);
                    assert!((0..n).all(|i| reduced[i] == xor(i)), "{context}: reduce");
                    assert!(
                        (0..n).all(|i| in_place[i] == max(i)),
                        "{context}: reduce in place"
                    );
                    let wrong = (0..n * w)
                        .filter(|&j| gathered[j].to_bits() != bits((j / n) as u32, k, j % n))
                        .count();
                    assert_eq!(wrong, 0, "{context}: gather");
                }
                let wrong = (0..n)
                    .filter(|&i| part[i].to_bits() != bits(root, k + 7, rank * n + i))
                    .count();
                assert_eq!(wrong, 0, "{context}: scatter");
            }
        }
    });
}

/// Gathers and scatters of 2 MiB or more move as messages after a check:
/// every layout (and 1x2 and 2x1), with dedicated servers too, every root,
/// odd sizes of bytes and of `f32` bit patterns, in place and not.
#[test]
fn gathers_and_scatters_that_move_as_messages_are_exact_from_every_root() {
    let layouts = LAYOUTS
        .iter()
        .chain(&[(1, 2), (2, 1)])
        .map(|&(m, d)| (m, d, 0))
        .chain(SERVER_LAYOUTS);
    for (m, d, servers) in layouts {
        let world = m * d;
        let w = world as usize;
        let label = format!("{m}x{d}+{servers}");
        // Just over 2 MiB in all: odd per-rank counts.
        let bytes = (2 << 20) / w + 3;
        let floats = (2 << 20) / (4 * w) + 1;
        let results = job_with_servers(
            m,
            d,
            servers,
            |b| b,
            |rank, comm| {
                let mut out = Vec::new();
                for root in 0..world {
                    let k = root as usize;
                    // u8, not in place.
                    let mine: Vec<u8> = (0..bytes).map(|i| value(rank, k, i) as u8).collect();
                    let mut gathered = vec![0u8; bytes * w];
                    comm.gather(&mine, &mut gathered, root)
                        .unwrap_or_else(|e| panic!("{label}: rank {rank}: gather: {e}"));
                    // f32 bit patterns, in place: the input is this rank's place.
                    let mut in_place = vec![0.0f32; floats * w];
                    let at = rank as usize * floats;
                    for i in 0..floats {
                        in_place[at + i] = f32::from_bits(bits(rank, k, i));
                    }
                    let p = in_place.as_mut_ptr();
                    // SAFETY: the input is the rank's place in the output.
                    let call = unsafe {
                        fairring::Call::gather(
                            p.add(at).cast_const().cast(),
                            p.cast(),
                            floats as u64,
                            fairring::DataType::F32,
                            root,
                        )
                    };
                    // SAFETY: `in_place` is untouched until the work is waited for.
                    unsafe { comm.start(&call) }
                        .and_then(|work| work.wait())
                        .unwrap_or_else(|e| panic!("{label}: rank {rank}: gather in place: {e}"));
                    let mut parts: Vec<f32> = (0..floats * w)
                        .map(|i| f32::from_bits(bits(rank, k + 7, i)))
                        .collect();
                    let mut part = vec![1.5f32; floats];
                    comm.scatter(&mut parts, &mut part, root)
                        .unwrap_or_else(|e| panic!("{label}: rank {rank}: scatter: {e}"));
                    let root_only = |v: Vec<u8>| if rank == root { v } else { Vec::new() };
                    let in_place = if rank == root { in_place } else { Vec::new() };
                    out.push((root, root_only(gathered), in_place, part));
                }
                out
            },
        );
        for (rank, per_rank) in results.iter().enumerate() {
            for (root, gathered, in_place, part) in per_rank {
                let (root, k) = (*root, *root as usize);
                let context = format!("{label}: rank {rank}, root {root}");
                if rank as u32 == root {
                    let wrong = (0..bytes * w)
                        .filter(|&j| gathered[j] != value((j / bytes) as u32, k, j % bytes) as u8)
                        .count();
                    assert_eq!(wrong, 0, "{context}: gather");
                    let wrong = (0..floats * w)
                        .filter(|&j| {
                            in_place[j].to_bits() != bits((j / floats) as u32, k, j % floats)
                        })
                        .count();
                    assert_eq!(wrong, 0, "{context}: gather in place");
                }
                let wrong = (0..floats)
                    .filter(|&i| part[i].to_bits() != bits(root, k + 7, rank * floats + i))
                    .count();
                assert_eq!(wrong, 0, "{context}: scatter");
            }
        }
    }
}

/// Reduces of 2 MiB or more (but of halves) run as a chain of messages
/// ending at the root where machines have one rank each: 2 to 4 machines,
/// with dedicated servers too, every root, in place and not, several
/// operators and types, odd sizes spanning several chunks.
#[test]
fn reduces_that_move_as_a_chain_are_exact_at_every_root() {
    let layouts = [(2, 1, 0), (3, 1, 0), (4, 1, 0)]
        .into_iter()
        .chain(SERVER_LAYOUTS.into_iter().filter(|&(_, d, _)| d == 1));
    // Just over 2 MiB: three chunks, the last one short.
    let n = (2 << 20) / 8 + 3;
    for (m, d, servers) in layouts {
        let world = m * d;
        let label = format!("{m}x{d}+{servers}");
        let results = job_with_servers(
            m,
            d,
            servers,
            |b| b,
            |rank, comm| {
                let mut out = Vec::new();
                for root in 0..world {
                    let k = root as usize;
                    // i64 xor, not in place: the input stays as it was.
                    let input: Vec<i64> = (0..n).map(|i| value(rank, k, i)).collect();
                    let mut xor = vec![-1i64; n];
                    comm.reduce(&input, &mut xor, ReduceOp::BitXor, root)
                        .unwrap_or_else(|e| panic!("{label}: rank {rank}: reduce: {e}"));
                    assert!((0..n).all(|i| input[i] == value(rank, k, i)));
                    // f64 average of whole numbers, in place: exact sums, one
                    // division at the root.
                    let mut avg: Vec<f64> =
                        (0..n).map(|i| (value(rank, k, i) % 1000) as f64).collect();
                    reduce_in_place(comm, &mut avg, ReduceOp::Avg, root)
                        .unwrap_or_else(|e| panic!("{label}: rank {rank}: reduce in place: {e}"));
                    // u8 max of an odd byte count.
                    let bytes: Vec<u8> = (0..2 * n + 1).map(|i| value(rank, k, i) as u8).collect();
                    let mut max = vec![0u8; 2 * n + 1];
                    comm.reduce(&bytes, &mut max, ReduceOp::Max, root)
                        .unwrap_or_else(|e| panic!("{label}: rank {rank}: reduce u8: {e}"));
                    if rank == root {
                        out.push((root, xor, avg, max));
                    }
                }
                out
            },
        );
        for (rank, per_rank) in results.iter().enumerate() {
            for (root, xor, avg, max) in per_rank {
                let (root, k) = (*root, *root as usize);
                assert_eq!(rank as u32, root);
                let context = format!("{label}: root {root}");
                let wrong = (0..n)
                    .filter(|&i| xor[i] != (0..world).fold(0, |a, r| a ^ value(r, k, i)))
                    .count();
                assert_eq!(wrong, 0, "{context}: xor");
                let wrong = (0..n)
                    .filter(|&i| {
                        let sum: f64 = (0..world).map(|r| (value(r, k, i) % 1000) as f64).sum();
                        avg[i].to_bits() != (sum / f64::from(world)).to_bits()
                    })
                    .count();
                assert_eq!(wrong, 0, "{context}: avg");
                let wrong = (0..2 * n + 1)
                    .filter(|&i| {
                        max[i] != (0..world).map(|r| value(r, k, i) as u8).max().unwrap_or(0)
                    })
                    .count();
                assert_eq!(wrong, 0, "{context}: max");
            }
        }
    }
}

#[test]
fn a_chained_reduce_moves_the_tensor_once_per_link() {
    // Four machines of one rank, root 1: the chain is 0 -> 3 -> 2 -> 1. An
    // all-reduce (what a reduce once ran as) sends and receives 1.5 tensors
    // per rank.
    let (m, n) = (4u32, 4usize << 20);
    let slack = n as u64 / 8;
    let moved = job(
        m,
        1,
        |b| b,
        |rank, comm| {
            let input = vec![rank as u8; n];
            let mut output = vec![0u8; n];
            let mut counted = (0, 0);
            // The first round warms the messages; the second is measured.
            for round in 0..2 {
                let before = comm.traffic();
                comm.reduce(&input, &mut output, ReduceOp::Sum, 1)
                    .unwrap_or_else(|e| panic!("rank {rank}: reduce: {e}"));
                let after = comm.traffic();
                if round == 1 {
                    counted = (
                        after.sent_bytes - before.sent_bytes,
                        after.received_bytes - before.received_bytes,
                    );
                }
            }
            if rank == 1 {
                assert!(output.iter().all(|&b| b == 6), "rank 1: the sum");
            }
            counted
        },
    );
    let once = |bytes: u64| bytes >= n as u64 && bytes <= n as u64 + slack;
    let none = |bytes: u64| bytes < slack;
    for (rank, &(sent, received)) in moved.iter().enumerate() {
        let context = format!("rank {rank}: sent {sent} and received {received} bytes of {n}");
        match rank {
            // The chain's start, the root, and the two between.
            0 => assert!(once(sent) && none(received), "{context}"),
            1 => assert!(none(sent) && once(received), "{context}"),
            _ => assert!(once(sent) && once(received), "{context}"),
        }
    }
}

#[test]
fn gathers_and_scatters_move_each_part_once() {
    // Four machines of one rank: every byte crosses the fabric, and each
    // rank's traffic counts it. An all-gather or a broadcast of the whole
    // buffer (what a gather and a scatter once ran as) sends each rank about
    // six parts.
    let (m, n) = (4u32, 1usize << 20);
    let parts = u64::from(m - 1) * n as u64;
    let slack = n as u64 / 4;
    let moved = job(
        m,
        1,
        |b| b,
        |rank, comm| {
            let mut outcome = Vec::new();
            for root in [0, 2] {
                let input = vec![rank as u8 + 1; n];
                let mut gathered = vec![0u8; n * m as usize];
                let mut whole = vec![root as u8 + 10; n * m as usize];
                let mut part = vec![0u8; n];
                // The first round warms the messages; the second is measured.
                for round in 0..2 {
                    let before = comm.traffic();
                    comm.gather(&input, &mut gathered, root)
                        .unwrap_or_else(|e| panic!("rank {rank}: gather: {e}"));
                    let between = comm.traffic();
                    comm.scatter(&mut whole, &mut part, root)
                        .unwrap_or_else(|e| panic!("rank {rank}: scatter: {e}"));
                    let after = comm.traffic();
                    if round == 1 {
                        outcome.push((
                            root,
                            between.sent_bytes - before.sent_bytes,
                            between.received_bytes - before.received_bytes,
                            after.sent_bytes - between.sent_bytes,
                            after.received_bytes - between.received_bytes,
                        ));
                    }
                }
                if rank == root {
                    for r in 0..m as usize {
                        assert!(
                            gathered[r * n..(r + 1) * n]
                                .iter()
                                .all(|&b| b == r as u8 + 1)
                        );
                    }
                }
                assert!(
                    part.iter().all(|&b| b == root as u8 + 10),
                    "rank {rank}: scatter"
                );
            }
            outcome
        },
    );
    let within = |bytes: u64, expected: u64| bytes >= expected && bytes <= expected + slack;
    for (rank, rounds) in moved.iter().enumerate() {
        for &(root, g_sent, g_received, s_sent, s_received) in rounds {
            let context = format!(
                "rank {rank}, root {root}: gather sent {g_sent} and received {g_received}, \
                 scatter sent {s_sent} and received {s_received} bytes ({n} per part)"
            );
            if rank as u32 == root {
                assert!(within(g_received, parts) && g_sent < slack, "{context}");
                assert!(within(s_sent, parts) && s_received < slack, "{context}");
            } else {
                assert!(within(g_sent, n as u64) && g_received < slack, "{context}");
                assert!(within(s_received, n as u64) && s_sent < slack, "{context}");
            }
        }
    }
}

#[test]
fn reduce_gather_and_scatter_refuse_bad_roots_shapes_and_overlaps() {
    job(
        1,
        2,
        |b| b,
        |_, comm| {
            let input = [1i32; 8];
            let mut output = [0i32; 8];
            let e = comm
                .reduce(&input, &mut output, ReduceOp::Sum, 2)
                .unwrap_err()
                .to_string();
            assert!(e.contains("root") && e.contains("rank 2"), "{e}");
            let e = comm.gather(&input, &mut output, 0).unwrap_err().to_string();
            assert!(e.contains("output") && e.contains("16"), "{e}");
            let mut whole = [0i32; 16];
            let e = comm
                .scatter(&mut whole[..15], &mut output, 0)
                .unwrap_err()
                .to_string();
            assert!(e.contains("input"), "{e}");
            // A reduce whose input overlaps its output other than in place.
            let mut buffer = [0i32; 12];
            let p = buffer.as_mut_ptr();
            // SAFETY: both offsets stay inside `buffer`.
            let call = unsafe {
                fairring::Call::reduce(
                    p.add(2).cast_const().cast(),
                    p.cast(),
                    8,
                    fairring::DataType::I32,
                    ReduceOp::Sum,
                    0,
                )
            };
            // SAFETY: the call is refused (checked below), so nothing touches `buffer`.
            let e = unsafe { comm.start(&call) }
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(e.contains("input") && e.contains("in place"), "{e}");
            let p = whole.as_mut_ptr();
            // SAFETY: the offset stays inside `whole`.
            let call = unsafe {
                fairring::Call::scatter(p.cast(), p.add(8).cast(), 8, fairring::DataType::I32, 0)
            };
            // SAFETY: refused.
            let e = unsafe { comm.start(&call) }
                .map(|_| ())
                .unwrap_err()
                .to_string();
            assert!(e.contains("output") && e.contains("overlaps"), "{e}");
            // The refusals numbered nothing: the ranks still agree.
            let mut x = [1i32; 4];
            comm.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x, [2; 4]);
        },
    );
}
