//! One description of any call ([`Call`]) and one start: a group of different
//! collectives with different options under one work, exact; a refused call
//! or group changes nothing, its memory included.

mod common;

use common::job;
use fairring::{Algorithm, Call, DataType, Options, ReduceOp, WireFormat};

/// Every collective, each with options of its own, started as one group.
#[test]
fn a_group_of_every_collective_with_its_own_options_is_exact() {
    for (m, d) in [(2, 1), (1, 2), (2, 2)] {
        let results = job(
            m,
            d,
            |b| b,
            |rank, comm| {
                let world = comm.world_size() as usize;
                let r = i32::try_from(rank).unwrap();
                let mut summed: Vec<i32> = (0..1000).map(|i| i * (r + 1)).collect();
                let mut broadcast: Vec<f64> = vec![f64::from(r) - 0.5; 333];
                let input: Vec<u8> = (0..77u8)
                    .map(|i| i.wrapping_add(u8::try_from(rank).unwrap()))
                    .collect();
                let mut gathered = vec![0u8; 77 * world];
                let mut scattered_in: Vec<f32> = (0..64 * world).map(|i| i as f32 + 1.0).collect();
                let mut scattered = vec![0f32; 64];
                let calls = [
                    Call::all_reduce(
                        summed.as_mut_ptr().cast(),
                        1000,
                        DataType::I32,
                        ReduceOp::Sum,
                    )
                    .with(Algorithm::Ring),
                    Call::broadcast(broadcast.as_mut_ptr().cast(), 333, DataType::F64, 1),
                    Call::all_gather(input.as_ptr(), gathered.as_mut_ptr(), 77, DataType::U8)
                        .with(Algorithm::Hierarchical),
                    Call::reduce_scatter(
                        scattered_in.as_mut_ptr().cast(),
                        scattered.as_mut_ptr().cast(),
                        64,
                        DataType::F32,
                        ReduceOp::Max,
                    )
                    .with(Options {
                        algorithm: Some(Algorithm::Auto),
                        wire: Some(WireFormat::Exact),
                    }),
                    Call::barrier(),
                ];
                // SAFETY: every buffer outlives the wait below and is not
                // touched until then; none overlap.
                let work = unsafe { comm.start_group(&calls) };
                work.and_then(fairring::Work::wait)
                    .unwrap_or_else(|e| panic!("{m}x{d} rank {rank}: {e}"));
                (rank, summed, broadcast, gathered, scattered)
            },
        );
        let world = (m * d) as i32;
        for (rank, summed, broadcast, gathered, scattered) in results {
            let at = format!("{m}x{d} rank {rank}");
            let triangle = world * (world + 1) / 2;
            let want: Vec<i32> = (0..1000).map(|i| i * triangle).collect();
            assert_eq!(summed, want, "{at}: all-reduce");
            assert!(broadcast.iter().all(|&x| x == 0.5), "{at}: broadcast");
            for (r, part) in gathered.chunks(77).enumerate() {
                let r = u8::try_from(r).unwrap();
                let want: Vec<u8> = (0..77u8).map(|i| i.wrapping_add(r)).collect();
                assert_eq!(part, want, "{at}: all-gather, rank {r}'s part");
            }
            let base = rank as usize * 64;
            let want: Vec<f32> = (0..64).map(|i| (base + i) as f32 + 1.0).collect();
            assert_eq!(scattered, want, "{at}: reduce-scatter");
        }
    }
}

/// A group with one bad call is refused whole, naming the call; nothing it
/// holds is touched (a broadcast's zeros included) and no operation is
/// numbered, so the ranks go on agreeing.
#[test]
fn a_refused_group_changes_nothing() {
    job(
        2,
        1,
        |b| b,
        |rank, comm| {
            let mut a = [7i64; 5];
            let mut b = [9.0f32; 6];
            let calls = [
                // Rank 1 zeroes this broadcast's tensor (hierarchical runs it
                // as a sum) before it starts: only once the group is accepted.
                Call::broadcast(b.as_mut_ptr().cast(), 6, DataType::F32, 0)
                    .with(Algorithm::Hierarchical),
                // A compressed wire carries f32 only.
                Call::all_reduce(a.as_mut_ptr().cast(), 5, DataType::I64, ReduceOp::Sum).with(
                    Options {
                        algorithm: None,
                        wire: Some(WireFormat::Bf16),
                    },
                ),
            ];
            // SAFETY: refused before any memory is touched (and if it were
            // not, both buffers outlive the wait the work's drop does).
            let e = unsafe { comm.start_group(&calls) }
                .expect_err("refused")
                .to_string();
            assert!(
                e.contains("calls") && e.contains("call 1"),
                "rank {rank}: {e}"
            );
            assert!(e.contains("wire"), "rank {rank}: {e}");
            assert_eq!(a, [7; 5], "rank {rank}: the all-reduce's tensor");
            assert_eq!(b, [9.0; 6], "rank {rank}: the broadcast's tensor");
            // A broadcast only moves bytes: a compressed wire is refused.
            let call = calls[0].with(Options {
                algorithm: Some(Algorithm::Hierarchical),
                wire: Some(WireFormat::F16),
            });
            // SAFETY: as above.
            let alone = unsafe { comm.start(&call) }.expect_err("refused");
            assert!(alone.to_string().contains("wire"), "rank {rank}: {alone}");
            assert_eq!(b, [9.0; 6], "rank {rank}: the broadcast's tensor");
            // Nothing was numbered: the next call meets its peer.
            comm.all_reduce(&mut a, ReduceOp::Sum)
                .expect("after refusals");
            assert_eq!(a, [14; 5], "rank {rank}");
        },
    );
}

#[test]
fn an_algorithm_converts_into_options_that_keep_the_wire() {
    let options = Options::from(Algorithm::Ring);
    assert_eq!(options.algorithm, Some(Algorithm::Ring));
    assert_eq!(options.wire, None);
    assert_eq!(Options::default().algorithm, None);
    let call = Call::barrier().with(Algorithm::Doubling);
    assert_eq!(call.options, options_of(Algorithm::Doubling));
}

fn options_of(algorithm: Algorithm) -> Options {
    Options {
        algorithm: Some(algorithm),
        wire: None,
    }
}

/// Sends and receives are calls like any collective: a group mixes them
/// with collectives under one work; a group of messages alone is not
/// numbered; a message whose match has another size fails alone, in its
/// group, and the communicator goes on.
#[test]
fn sends_and_receives_start_as_calls_in_groups_with_collectives() {
    for (m, d) in [(2, 1), (1, 2)] {
        let results = job(
            m,
            d,
            |b| b,
            |rank, comm| {
                let peer = 1 - rank;
                let r = i64::from(rank);
                let mut summed = vec![r + 1; 300];
                let outgoing: Vec<i64> = (0..5000).map(|i| i * 10 + r).collect();
                let mut incoming = vec![0i64; 5000];
                let tagged = [r + 100; 3];
                let mut tagged_in = [0i64; 3];
                let calls = [
                    // Tag 9 first on one side, last on the other: tags match
                    // on their own.
                    Call::send(peer, 9, tagged.as_ptr().cast(), 3, DataType::I64),
                    Call::all_reduce(
                        summed.as_mut_ptr().cast(),
                        300,
                        DataType::I64,
                        ReduceOp::Sum,
                    ),
                    Call::send(peer, 0, outgoing.as_ptr().cast(), 5000, DataType::I64),
                    Call::recv(peer, 0, incoming.as_mut_ptr().cast(), 5000, DataType::I64),
                    Call::recv(peer, 9, tagged_in.as_mut_ptr().cast(), 3, DataType::I64),
                ];
                // SAFETY: every buffer outlives the wait below and is not
                // touched until then; none overlap.
                let work = unsafe { comm.start_group(&calls) }
                    .unwrap_or_else(|e| panic!("{m}x{d} rank {rank}: {e}"));
                assert!(
                    work.sequence().is_some(),
                    "a group with a collective is numbered"
                );
                work.wait()
                    .unwrap_or_else(|e| panic!("{m}x{d} rank {rank}: {e}"));
                assert_eq!(summed, vec![3; 300]);
                let p = i64::from(peer);
                assert!(
                    incoming
                        .iter()
                        .enumerate()
                        .all(|(i, &v)| v == i as i64 * 10 + p)
                );
                assert_eq!(tagged_in, [p + 100; 3]);
                // Messages alone: no sequence number.
                let mut one = [0i64; 4];
                let call = if rank == 0 {
                    Call::send(peer, 1, one.as_ptr().cast(), 4, DataType::I64)
                } else {
                    Call::recv(peer, 1, one.as_mut_ptr().cast(), 4, DataType::I64)
                };
                // SAFETY: `one` outlives the wait.
                let work = unsafe { comm.start(&call) }.unwrap();
                assert_eq!(work.sequence(), None);
                work.wait().unwrap();
                // A receive of another size fails its group, naming both
                // calls; the communicator goes on. (The send is of more than
                // 16 KiB: a smaller one between machines goes eagerly, and
                // only its receive fails.)
                let long = vec![0i64; 4096];
                let mut short = vec![0i64; 4095];
                let mut total = [1i64];
                let calls = [
                    if rank == 0 {
                        Call::send(peer, 2, long.as_ptr().cast(), 4096, DataType::I64)
                    } else {
                        Call::recv(peer, 2, short.as_mut_ptr().cast(), 4095, DataType::I64)
                    },
                    Call::all_reduce(total.as_mut_ptr().cast(), 1, DataType::I64, ReduceOp::Sum),
                ];
                // SAFETY: as above.
                let e = unsafe { comm.start_group(&calls) }
                    .unwrap()
                    .wait()
                    .expect_err("a mismatched message fails");
                assert!(matches!(e, fairring::Error::Mismatch { .. }), "{e}");
                assert_eq!(total, [2], "the group's collective ran");
                comm.all_reduce(&mut total, ReduceOp::Sum).unwrap();
                assert_eq!(total, [4], "the communicator goes on");
                rank
            },
        );
        assert_eq!(results.len(), 2);
    }
}
