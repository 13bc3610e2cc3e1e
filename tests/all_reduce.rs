//! All-reduce across simulated machines in one process: exact results for every
//! layout, algorithm, size class and operator.
#![expect(clippy::cast_possible_truncation, reason = "test values are small")]

mod common;

use common::{SERVER_LAYOUTS, job, job_and_servers, job_with_servers, small_slices};
use fairring::{Algorithm, Grouping, MachinesServe, ReduceOp};
use fairring_core::DataType;
use fairring_core::plan::{Geometry, Plan, PlanConfig, Routing};
use fairring_core::topology::{RankLayout, Topology};

/// The value rank `r` holds at element `i` of operation `op_index`: small integers,
/// so that f32 sums are exact in any order.
fn input(rank: u32, op_index: usize, i: usize) -> f32 {
    ((rank as usize * 7 + op_index * 13 + i * 3) % 61) as f32 - 30.0
}

fn sizes() -> Vec<usize> {
    // Empty, tiny, not a multiple of anything, several slices (slices are 64 KiB).
    vec![0, 1, 3, 17, 1000, 16_411, 100_003, 250_000]
}

fn check_layout(m: u32, d: u32, algorithm: Algorithm) {
    check_layout_with_servers(m, d, 0, algorithm);
}

fn check_layout_with_servers(m: u32, d: u32, servers: u32, algorithm: Algorithm) {
    let world = m * d;
    let results = job_with_servers(
        m,
        d,
        servers,
        |b| small_slices(b, algorithm),
        |rank, comm| {
            let sizes = sizes();
            let mut bufs: Vec<Vec<f32>> = sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| (0..n).map(|i| input(rank, k, i)).collect())
                .collect();
            // All in flight at once.
            comm.scope(|s| {
                let works: Vec<_> = bufs
                    .iter_mut()
                    .map(|b| s.all_reduce(b, ReduceOp::Sum, ()).expect("start"))
                    .collect();
                for w in works {
                    w.wait().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                }
            });
            bufs
        },
    );
    for (rank, bufs) in results.iter().enumerate() {
        for (k, buf) in bufs.iter().enumerate() {
            let wrong = buf
                .iter()
                .enumerate()
                .filter(|&(i, &v)| v != (0..world).map(|r| input(r, k, i)).sum::<f32>())
                .count();
            assert_eq!(
                wrong,
                0,
                "{m}x{d} + {servers} servers {algorithm}: rank {rank}, tensor {k} ({} elements): \
                 {wrong} wrong",
                buf.len()
            );
        }
    }
}

#[test]
fn hierarchical_every_layout() {
    for (m, d) in [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (1, 3), (3, 2)] {
        check_layout(m, d, Algorithm::Hierarchical);
    }
}

#[test]
fn dedicated_servers_every_layout() {
    for (m, d, servers) in SERVER_LAYOUTS {
        check_layout_with_servers(m, d, servers, Algorithm::Hierarchical);
    }
    // A ring operation leaves the servers out, and they keep in step.
    check_layout_with_servers(2, 1, 1, Algorithm::Ring);
}

/// A dedicated server sums in machine order, whatever order the cells land
/// in. In `f32`, 1e8 + 3 rounds to 1e8, so machines holding 1e8, 3 and -1e8
/// sum to 0 in that order and to 3 if machine 1's cell is added last; every
/// all-reduce of 3x1 must give 0, and every element the same.
#[test]
fn a_dedicated_server_sums_in_machine_order() {
    let values = [1e8f32, 3.0, -1e8];
    let results = job_with_servers(
        3,
        1,
        1,
        |b| small_slices(b, Algorithm::Hierarchical),
        |rank, comm| {
            (0..300)
                .map(|_| {
                    let mut data = vec![values[rank as usize]; 3000];
                    comm.all_reduce(&mut data, ReduceOp::Sum).unwrap();
                    data.iter().filter(|&&v| v != 0.0).count()
                })
                .sum::<usize>()
        },
    );
    assert_eq!(results, vec![0; 3], "elements that were not 0, per rank");
}

#[test]
fn ring_every_layout() {
    for (m, d) in [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (1, 3)] {
        check_layout(m, d, Algorithm::Ring);
    }
}

#[test]
fn doubling_every_layout() {
    // Powers of two, and 3, 5, 6 ranks with extra ranks that fold in.
    for (m, d) in [(1, 1), (2, 1), (1, 2), (3, 1), (2, 2), (5, 1), (3, 2)] {
        check_layout(m, d, Algorithm::Doubling);
    }
    check_layout_with_servers(3, 1, 1, Algorithm::Doubling);
}

/// Sending from the tensor (from any size) and staging it give the same exact
/// results: hierarchical between machines of one rank each, the ring on any
/// layout; for an operator that finishes in the reduction too (an average
/// divides in the tensor), across many slices with several in flight.
#[test]
fn sending_from_the_tensor_matches_staging_it() {
    let (hierarchical, ring) = (Algorithm::Hierarchical, Algorithm::Ring);
    for (m, d, algorithm, direct_from) in [
        (2, 1, hierarchical, Some(0)),
        (3, 1, hierarchical, Some(0)),
        (3, 1, hierarchical, None),
        (3, 1, ring, Some(0)),
        (2, 2, ring, Some(0)),
        (2, 2, ring, None),
    ] {
        let world = m * d;
        let in_place = job(
            m,
            d,
            |b| small_slices(b, algorithm).direct_from(direct_from),
            |rank, comm| {
                let before = comm.traffic();
                let n = 100_003;
                let mut sums: Vec<i32> = (0..n).map(|i| i as i32 ^ (rank as i32) << 20).collect();
                let mut maxes: Vec<i64> = (0..n)
                    .map(|i| (i as i64 * 31 + i64::from(rank) * 7) % 1009)
                    .collect();
                let mut avgs: Vec<f32> = (0..n)
                    .map(|i| (i % 97) as f32 * world as f32 + rank as f32)
                    .collect();
                comm.scope(|s| {
                    let works = [
                        s.all_reduce(&mut sums, ReduceOp::Sum, ()).unwrap(),
                        s.all_reduce(&mut maxes, ReduceOp::Max, ()).unwrap(),
                        s.all_reduce(&mut avgs, ReduceOp::Avg, ()).unwrap(),
                    ];
                    for w in works {
                        w.wait().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    }
                });
                let label = format!("{m}x{d} {algorithm}, from {direct_from:?}, rank {rank}");
                let bad = (0..n).find(|&i| {
                    sums[i] != (0..world).map(|r| i as i32 ^ (r as i32) << 20).sum::<i32>()
                });
                assert_eq!(bad, None, "{label}: sum");
                let bad = (0..n).find(|&i| {
                    maxes[i]
                        != (0..world)
                            .map(|r| (i as i64 * 31 + i64::from(r) * 7) % 1009)
                            .max()
                            .unwrap()
                });
                assert_eq!(bad, None, "{label}: max");
                let mean = (0..world).sum::<u32>() as f32 / world as f32;
                let bad = (0..n).find(|&i| avgs[i] != (i % 97) as f32 * world as f32 + mean);
                assert_eq!(bad, None, "{label}: avg");
                comm.traffic().received_in_place_bytes - before.received_in_place_bytes
            },
        );
        // Between two ranks, each result lands in the tensor of the rank that
        // does not serve it: every byte once, over the two; elsewhere, in
        // staging.
        let tensors = 100_003 * (4 + 8 + 4);
        let landed: u64 = in_place.iter().sum();
        let expected = if (m, d, direct_from) == (2, 1, Some(0)) {
            tensors
        } else {
            0
        };
        assert_eq!(
            landed, expected,
            "{m}x{d} {algorithm}, from {direct_from:?}: bytes landed in tensors ({in_place:?})"
        );
    }
}

#[test]
fn every_operator_and_type() {
    let (m, d) = (2, 2);
    let world = m * d;
    job(
        m,
        d,
        |b| {
            b.slice_bytes(64 << 10)
                .min_shard_bytes(4 << 10)
                .total_memory(1 << 20)
        },
        |rank, comm| {
            for &algorithm in Algorithm::ALL {
                let n = 40_003;
                let mut ints: Vec<i64> = (0..n).map(|i| i as i64 * (i64::from(rank) + 1)).collect();
                comm.scope(|s| {
                    s.all_reduce(&mut ints, ReduceOp::Max, algorithm)
                        .unwrap()
                        .wait()
                })
                .unwrap();
                assert!(
                    ints.iter()
                        .enumerate()
                        .all(|(i, &v)| v == i as i64 * i64::from(world)),
                    "{algorithm} max"
                );

                let mut avg: Vec<f64> = (0..n).map(|i| f64::from(rank) + i as f64).collect();
                comm.scope(|s| {
                    s.all_reduce(&mut avg, ReduceOp::Avg, algorithm)
                        .unwrap()
                        .wait()
                })
                .unwrap();
                let mean = f64::from(world - 1) / 2.0;
                assert!(
                    avg.iter().enumerate().all(|(i, &v)| v == mean + i as f64),
                    "{algorithm} avg"
                );

                let mut bytes: Vec<u8> = (0..n).map(|i| (i % 200) as u8 + rank as u8).collect();
                comm.scope(|s| {
                    s.all_reduce(&mut bytes, ReduceOp::Min, algorithm)
                        .unwrap()
                        .wait()
                })
                .unwrap();
                assert!(
                    bytes.iter().enumerate().all(|(i, &v)| v == (i % 200) as u8),
                    "{algorithm} min"
                );
            }
        },
    );
}

#[test]
fn repeated_multi_slice_operations() {
    for &algorithm in Algorithm::ALL {
        let (m, d) = (2, 2);
        job(
            m,
            d,
            |b| {
                b.slice_bytes(256 << 10)
                    .min_shard_bytes(4 << 10)
                    .total_memory(8 << 20)
                    .algorithm(algorithm)
            },
            |rank, comm| {
                let n = 12 * (64 << 10) + 5;
                let mut data = vec![0f32; n];
                for call in 0..30 {
                    for (i, v) in data.iter_mut().enumerate() {
                        *v = ((i + call + rank as usize) % 5) as f32;
                    }
                    comm.all_reduce(&mut data, ReduceOp::Sum).unwrap();
                    let bad = (0..n).find(|&i| {
                        data[i] != (0..4).map(|r| ((i + call + r) % 5) as f32).sum::<f32>()
                    });
                    assert!(
                        bad.is_none(),
                        "{algorithm} call {call} rank {rank}: element {bad:?} wrong (buffers {})",
                        comm.staging_buffers()
                    );
                }
            },
        );
    }
}

/// The default slices cut a tensor too small for four of them into slices of
/// 16 MiB (`Geometry::slice_bytes_for`): 40 MiB in 16, 16 and 8 MiB where 25
/// and 15 would be, 20 MiB in 16 and 4 where one slice would be. Every rank
/// plans the same cut and the sums are exact.
#[test]
fn default_slices_cut_small_tensors_into_more_slices() {
    let (m, d) = (2, 1);
    let tune = |b: fairring::ConfigBuilder| b.total_memory(128 << 20);
    let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
    let staging = tune(fairring::Config::builder(0, m * d, "127.0.0.1", 1))
        .build()
        .unwrap()
        .staging(topology)
        .unwrap();
    let g = staging.geometry;
    assert_eq!(g.full_slice_bytes(), 25 << 20);
    let sizes = [40usize << 20, 20 << 20];
    for bytes in sizes {
        assert_eq!(g.slice_bytes_for(bytes as u64), 16 << 20);
    }
    job(m, d, tune, |rank, comm| {
        for bytes in sizes {
            let n = bytes / 4;
            let mut data: Vec<f32> = (0..n).map(|i| ((i + rank as usize) % 7) as f32).collect();
            comm.all_reduce(&mut data, ReduceOp::Sum).unwrap();
            let bad = (0..n).find(|&i| data[i] != ((i % 7) + ((i + 1) % 7)) as f32);
            assert!(
                bad.is_none(),
                "{bytes} B, rank {rank}: element {bad:?} wrong"
            );
        }
    });
}

/// Recursive doubling combines partials in a tree, not in rank order: every rank
/// must still end with the same bits, for sums that round and for NaNs.
#[test]
fn doubling_gives_every_rank_the_same_bits() {
    for (m, d) in [(3, 1), (2, 2), (5, 1)] {
        let results = job(
            m,
            d,
            |b| small_slices(b, Algorithm::Doubling),
            |rank, comm| {
                let n = 20_011;
                let mut data: Vec<f32> = (0..n)
                    // Every rank's NaN at the same places, each with its own payload:
                    // which one survives depends on the order of the operands.
                    .map(|i| match i % 97 {
                        0 => f32::from_bits(0x7fc0_0000 | (rank + 1)),
                        _ => 1.0 / (1.0 + (i * 31 + rank as usize * 17) as f32),
                    })
                    .collect();
                comm.scope(|s| s.all_reduce(&mut data, ReduceOp::Sum, ())?.wait())
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                data.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            },
        );
        let rounded = results[0]
            .iter()
            .enumerate()
            .filter(|&(i, _)| {
                if i % 97 == 0 {
                    return false;
                }
                let exact: f64 = (0..m * d)
                    .map(|r| 1.0 / (1.0 + (i * 31 + r as usize * 17) as f32) as f64)
                    .sum();
                f64::from(f32::from_bits(results[0][i])) != exact
            })
            .count();
        assert!(rounded > 0, "{m}x{d}: the sums round somewhere");
        for (rank, bits) in results.iter().enumerate() {
            let differ = bits.iter().zip(&results[0]).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{m}x{d}: rank {rank} differs from rank 0");
        }
    }
}

/// Tensors of one element to several slices, every type, every operator that
/// applies to it (for `f16` and `bf16` those whose results are exact however
/// partial sums are rounded), each checked on this rank: what failed.
fn every_type_and_operator(comm: &fairring::Communicator, rank: u32, world: u32) -> Vec<String> {
    let mut failed = Vec::new();
    for n in [1, 1000, 6000, 40_003] {
        let mut run = |outcome: Result<(), String>| {
            if let Err(e) = outcome {
                failed.push(e);
            }
        };
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Avg] {
            run(check_typed(comm, rank, world, n, op, |v| v as f32));
        }
        for op in [ReduceOp::Product, ReduceOp::Avg, ReduceOp::Max] {
            run(check_typed(comm, rank, world, n, op, |v| v));
        }
        for op in [ReduceOp::Sum, ReduceOp::Product] {
            run(check_typed(comm, rank, world, n, op, |v| v as i32));
        }
        for op in [ReduceOp::Max, ReduceOp::BitXor, ReduceOp::BitAnd] {
            run(check_typed(comm, rank, world, n, op, |v| v as i64));
        }
        for op in [ReduceOp::BitOr, ReduceOp::Min] {
            run(check_typed(comm, rank, world, n, op, |v| v as u8));
        }
        run(check_typed(comm, rank, world, n, ReduceOp::Max, |v| {
            v as i8
        }));
        run(check_typed(comm, rank, world, n, ReduceOp::Sum, |v| {
            v as i16
        }));
        // Whole numbers below 2048 (f16) and the extremes (bf16)
        // are exact however often partial sums are rounded.
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            run(check_typed(comm, rank, world, n, op, |v| {
                half::f16::from_f64(v)
            }));
        }
        for op in [ReduceOp::Min, ReduceOp::Max] {
            run(check_typed(comm, rank, world, n, op, |v| {
                half::bf16::from_f64(v)
            }));
        }
    }
    failed
}

/// Machines in groups (`FAIRRING_GROUP_SIZE`): every hierarchical all-reduce
/// in two levels, within the groups and then across them, in 64 KiB slices
/// of 64-byte minimum shards. 12x1 in three groups of four; 16x1 in groups
/// of six, five and five, where ranges of the group of six are cut in two
/// intervals by the groups of five's; 10x1 in groups of four, three and
/// three; and 6x2 in two groups of three, whose ranks are not their
/// machines' numbers. Every rank's result exact, for every type and
/// operator, from one element (one machine's range holds it, the others'
/// are empty) to several slices.
#[test]
fn machines_in_groups_reduce_in_two_levels() {
    for (m, d, size) in [(12, 1, 4), (16, 1, 6), (10, 1, 4), (6, 2, 3)] {
        let world = m * d;
        let tune = |b: fairring::ConfigBuilder| {
            b.slice_bytes(64 << 10)
                .min_shard_bytes(64)
                .total_memory(1 << 20)
                .grouping(Grouping::AtMost(size))
                .algorithm(Algorithm::Hierarchical)
        };
        // What the communicator plans with, from the same configuration.
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let staging = tune(fairring::Config::builder(0, world, "127.0.0.1", 1))
            .build()
            .unwrap()
            .staging(topology)
            .unwrap();
        assert_eq!(staging.geometry.routing(), Routing::Groups);
        assert_eq!(
            staging.geometry.machine_groups().map(|g| g.largest()),
            Some(size)
        );
        let failures = job(m, d, tune, |rank, comm| {
            every_type_and_operator(comm, rank, world)
        });
        for (rank, failed) in failures.iter().enumerate() {
            assert!(
                failed.is_empty(),
                "{m}x{d} in groups of {size}, rank {rank}: {failed:?}"
            );
        }
    }
}

/// On the flat plan of 16x1 in the default slices (a budget of two of
/// their buffers), `auto` runs every all-reduce below 12 shards of the minimum
/// (768 KiB) in four groups of four (`Resolved::Grouped`): every type and
/// operator exact, from one element to 320 KB, and every rank moves the
/// same bytes for a 64 KiB one. Flat (`FAIRRING_GROUP_SIZE=off`), the one
/// machine serving its one shard moves fifteen times the others' share.
#[test]
fn small_tensors_on_the_flat_plan_run_in_groups() {
    let (m, d) = (16, 1);
    let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
    let staging = |grouping: Grouping, budget: Option<u64>| {
        let mut b = fairring::Config::builder(0, m * d, "127.0.0.1", 1).grouping(grouping);
        if let Some(budget) = budget {
            b = b.total_memory(budget);
        }
        b.build().unwrap().staging(topology).unwrap()
    };
    // The default slices are halved until the default budget holds two
    // buffers; a budget of two whole ones keeps them.
    let two_buffers = 2 * staging(Grouping::Auto, Some(1 << 40)).buffer_bytes;
    for grouping in [Grouping::Auto, Grouping::OneLevel] {
        let planned = staging(grouping, Some(two_buffers));
        assert_eq!(planned.geometry.routing(), Routing::Flat);
        assert_eq!(
            planned
                .grouped
                .and_then(|g| g.machine_groups())
                .map(|g| (g.groups(), g.largest())),
            (grouping == Grouping::Auto).then_some((4, 4)),
            "{grouping:?}"
        );
        let tune = |b: fairring::ConfigBuilder| b.grouping(grouping).total_memory(two_buffers);
        let outcomes = job(m, d, tune, |rank, comm| {
            let mut failed = if grouping == Grouping::Auto {
                every_type_and_operator(comm, rank, m * d)
            } else {
                Vec::new()
            };
            let before = comm.traffic();
            let mut data = vec![rank as f32; 16 << 10];
            if let Err(e) = comm.scope(|s| s.all_reduce(&mut data, ReduceOp::Sum, ())?.wait()) {
                failed.push(format!("64 KiB: {e}"));
            }
            if let Err(e) = comm.barrier() {
                failed.push(format!("barrier: {e}"));
            }
            let sum = (0..m * d).sum::<u32>() as f32;
            if data.iter().any(|&v| v != sum) {
                failed.push(format!("64 KiB: not {sum} everywhere"));
            }
            (failed, comm.traffic().sent_bytes - before.sent_bytes)
        });
        let mut sent = Vec::new();
        for (rank, (failed, bytes)) in outcomes.into_iter().enumerate() {
            assert!(failed.is_empty(), "{grouping:?}, rank {rank}: {failed:?}");
            sent.push(bytes);
        }
        let (least, most) = (*sent.iter().min().unwrap(), *sent.iter().max().unwrap());
        assert!(least > 0, "{grouping:?}: {sent:?}");
        if grouping == Grouping::Auto {
            assert!(most * 10 <= least * 11, "in groups, even: {sent:?}");
        } else {
            assert!(most >= 8 * least, "flat, one machine serves: {sent:?}");
        }
    }
}

/// Beside dedicated servers, with the machines serving
/// (`FAIRRING_MACHINES_SERVE=on`), `auto` runs every exact all-reduce as the
/// same job without servers would: every rank's result exact, for every
/// type and operator, from one element to several slices, and no server
/// moves a byte. On the six server layouts (one machine, one rank a
/// machine, more servers than machines, rail groups), in 64 KiB slices;
/// and on 12x1 beside two servers in 64 KiB slices of 64-byte shards, where
/// the machines reduce in groups without servers. With the servers asked to
/// serve (`off`) the same calls go through them.
#[test]
fn beside_servers_the_machines_serve_their_own_shards() {
    let layouts = SERVER_LAYOUTS.map(|(m, d, k)| (m, d, k, 4 << 10));
    for (m, d, servers, min_shard) in layouts.into_iter().chain([(12, 1, 2, 64)]) {
        for serve in [MachinesServe::On, MachinesServe::Off] {
            if serve == MachinesServe::Off && (m, d, servers) != (2, 2, 2) {
                continue;
            }
            let world = m * d;
            let (failures, served) = job_and_servers(
                m,
                d,
                servers,
                |b| {
                    b.slice_bytes(64 << 10)
                        .min_shard_bytes(min_shard)
                        .total_memory(1 << 20)
                        .machines_serve(serve)
                },
                |rank, comm| every_type_and_operator(comm, rank, world),
            );
            let what = format!("{m}x{d} + {servers} servers, machines serving {serve}");
            for (rank, failed) in failures.iter().enumerate() {
                assert!(failed.is_empty(), "{what}, rank {rank}: {failed:?}");
            }
            for (index, outcome) in served.into_iter().enumerate() {
                let moved = outcome.unwrap_or_else(|e| panic!("{what}: server {index}: {e}"));
                if serve == MachinesServe::On {
                    assert_eq!(
                        (moved.sent_bytes, moved.received_bytes),
                        (0, 0),
                        "{what}: server {index} moved bytes"
                    );
                } else {
                    assert!(
                        moved.received_bytes > 0,
                        "{what}: server {index} moved none"
                    );
                }
            }
        }
    }
}

/// One element type's all-reduce on a rank, checked against the fold of every
/// rank's input in `i64` (or `f64` for an average).
fn check_typed<T: fairring::core::reduce::Element + PartialEq + std::fmt::Debug>(
    comm: &fairring::Communicator,
    rank: u32,
    world: u32,
    n: usize,
    op: ReduceOp,
    from: impl Fn(f64) -> T,
) -> Result<(), String> {
    let value = |r: u32, i: usize| -> i64 {
        match op {
            // Ones and twos: a product of sixteen fits every type used with it.
            ReduceOp::Product => 1 + ((r as usize + i) % 2) as i64,
            _ => ((r as usize * 7 + i * 3) % 61) as i64,
        }
    };
    let mut data: Vec<T> = (0..n).map(|i| from(value(rank, i) as f64)).collect();
    comm.scope(|s| s.all_reduce(&mut data, op, ())?.wait())
        .map_err(|e| format!("{op} of {n}: {e}"))?;
    for (i, got) in data.iter().enumerate() {
        let all = (0..world).map(|r| value(r, i));
        let expected = match op {
            ReduceOp::Sum => all.sum::<i64>() as f64,
            ReduceOp::Product => all.product::<i64>() as f64,
            ReduceOp::Min => all.min().unwrap() as f64,
            ReduceOp::Max => all.max().unwrap() as f64,
            ReduceOp::BitXor => all.fold(0, |a, v| a ^ v) as f64,
            ReduceOp::BitOr => all.fold(0, |a, v| a | v) as f64,
            ReduceOp::BitAnd => all.fold(-1, |a, v| a & v) as f64,
            ReduceOp::Avg => all.sum::<i64>() as f64 / f64::from(world),
        };
        let expected = from(expected);
        if *got != expected {
            return Err(format!(
                "{op} of {n} elements: element {i} is {got:?}, not {expected:?}"
            ));
        }
    }
    Ok(())
}

/// Many machines whose slots hold fewer shards of the minimum size than there
/// are machines (64 KiB slices, 16 KiB shards: at most four a slot), so that
/// the cells go up and down the core's two trees (12x1, 16x1, and 5x2, whose
/// ranks are not their machines' numbers), and with dedicated servers, which
/// each receive a contribution from every machine (12x1 with two, and 4x2 with
/// four in two rail groups, each server hearing from one rail). Tensors of one element to
/// several slices, every type, every operator that applies to it (for `f16`
/// and `bf16` those whose results are exact however partial sums are
/// rounded): every rank's result exact.
#[test]
fn many_machines_with_fewer_shards_than_machines() {
    // 64 KiB slices of 16 KiB shards: cells of 32 KiB, in two parts. On 16x1,
    // 120 KiB slices of 8 KiB shards go through the trees too (15 shards a
    // slot for 16 machines), in cells of 60 KiB and seven parts.
    let deep = (120 << 10, 8 << 10);
    let topology = Topology::new(16, 1, RankLayout::Contiguous).unwrap();
    let geometry = Geometry::new(topology, PlanConfig::new(deep.0, deep.1).unwrap()).unwrap();
    let plan = Plan::new(&geometry, DataType::F32, 40_003, 0).unwrap();
    assert_eq!(plan.slice(0).unwrap().parts(), 7);
    for (m, d, servers, (slice, shard)) in [
        (12, 1, 0, (64 << 10, 16 << 10)),
        (16, 1, 0, (64 << 10, 16 << 10)),
        (16, 1, 0, deep),
        (5, 2, 0, (64 << 10, 16 << 10)),
        (12, 1, 2, (64 << 10, 16 << 10)),
        (4, 2, 4, (64 << 10, 16 << 10)),
    ] {
        let world = m * d;
        let failures = job_with_servers(
            m,
            d,
            servers,
            |b| {
                b.slice_bytes(slice)
                    .min_shard_bytes(shard)
                    .total_memory(1 << 20)
                    .algorithm(Algorithm::Hierarchical)
            },
            |rank, comm| every_type_and_operator(comm, rank, world),
        );
        for (rank, failed) in failures.iter().enumerate() {
            assert!(
                failed.is_empty(),
                "{m}x{d} + {servers} servers, rank {rank}: {failed:?}"
            );
        }
    }
}

/// Dedicated servers in groups (`FAIRRING_GROUP_SIZE` with `FAIRRING_SERVERS`,
/// fairring-core's `ServerGroups`): each server reduces its range of a slot
/// over its group's workers, then its pieces across the groups, server to
/// server; in 64 KiB slices of 64-byte minimum shards. 12x1 with 8 servers
/// in two groups of four (six workers each); 16x1 with 10 in groups of three,
/// three, two and two, whose ranges cut each other's in two intervals; 5x1
/// with 7 in groups of three, two and two, serving two, two and one
/// workers; 6x2 with 8 in two rail groups of two groups of two, whose ranks are
/// not their machines' numbers. Every rank's result exact, for every type
/// and operator, from one element (one server's range holds it, the others'
/// are empty) to several slices.
#[test]
fn dedicated_servers_in_groups_reduce_in_two_levels() {
    for (m, d, servers, size) in [(12, 1, 8, 4), (16, 1, 10, 3), (5, 1, 7, 3), (6, 2, 8, 2)] {
        let world = m * d;
        let tune = |b: fairring::ConfigBuilder| {
            b.slice_bytes(64 << 10)
                .min_shard_bytes(64)
                .total_memory(1 << 20)
                .grouping(Grouping::AtMost(size))
                .algorithm(Algorithm::Hierarchical)
        };
        // What the communicator plans with, from the same configuration.
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let staging = tune(fairring::Config::builder(0, world, "127.0.0.1", 1).servers(servers))
            .build()
            .unwrap()
            .staging(topology)
            .unwrap();
        assert_eq!(staging.geometry.routing(), Routing::Groups);
        let groups = staging.geometry.server_groups().unwrap();
        assert_eq!(groups.servers().largest(), size);
        assert_eq!(groups.servers().machines(), servers / d);
        let failures = job_with_servers(m, d, servers, tune, |rank, comm| {
            every_type_and_operator(comm, rank, world)
        });
        for (rank, failed) in failures.iter().enumerate() {
            assert!(
                failed.is_empty(),
                "{m}x{d} + {servers} servers in groups of {size}, rank {rank}: {failed:?}"
            );
        }
    }
    // Groups the servers cannot form are refused, naming the variable: 12
    // servers beside machines of 8 GPUs (not one per rail), and 8 servers
    // in four groups for two machines.
    for (m, d, servers, size, why) in [
        (4, 8, 12, 2, "a multiple of 8"),
        (
            2,
            1,
            8,
            2,
            "2 worker machines cannot be split among 4 groups",
        ),
    ] {
        let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
        let e = fairring::Config::builder(0, m * d, "127.0.0.1", 1)
            .servers(servers)
            .grouping(Grouping::AtMost(size))
            .build()
            .unwrap()
            .staging(topology)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FAIRRING_GROUP_SIZE") && e.contains(why),
            "{m}x{d} + {servers} servers in groups of {size}: {e}"
        );
    }
}
