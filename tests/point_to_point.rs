//! Point-to-point messages between ranks simulated as machines of one
//! process: every pair, both directions, in flight together, exact and in
//! order; mismatches and bad peers refused naming what was wrong.
#![expect(clippy::cast_possible_truncation, reason = "test values are small")]

mod common;

use std::time::{Duration, Instant};

use common::{job, job_with_servers, small_slices};
use fairring::{Algorithm, Call, DataType, Error, Work};

/// The value of element `i` of message `k` from `src` to `dst`: distinct per
/// pair, message and place, NaN payloads and negative zeros among them.
fn bits(src: u32, dst: u32, k: usize, i: usize) -> u32 {
    let v = (u64::from(src) << 48)
        ^ (u64::from(dst) << 40)
        ^ ((k as u64) << 32)
        ^ (i as u64 * 2_654_435_761);
    (v ^ (v >> 29)) as u32 ^ 0x8000_0000
}

/// Message sizes: empty, tiny, odd, and spanning several small slices.
const SIZES: [usize; 4] = [0, 1, 1001, 40_003];

/// Every rank posts every message to and from every other rank at once
/// (sends first: a rank never waits for a peer to reach its own first
/// message), waits for them all, and checks each bit. `tagged`: message `k`
/// has tag `k + 1` and the receives are posted in the reverse order (the
/// sizes differ, so a receive matched by order instead of tag fails);
/// otherwise all have tag 0 and match in order.
fn every_pair_at_once(m: u32, d: u32, servers: u32, algorithm: Algorithm, tagged: bool) {
    let world = m * d;
    let results = job_with_servers(
        m,
        d,
        servers,
        |b| small_slices(b, algorithm),
        |rank, comm| {
            let mut sends: Vec<(u32, usize, Vec<f32>)> = Vec::new();
            let mut receives: Vec<(u32, usize, Vec<f32>)> = Vec::new();
            for peer in (0..world).filter(|&p| p != rank) {
                for (k, &n) in SIZES.iter().enumerate() {
                    sends.push((
                        peer,
                        k,
                        (0..n)
                            .map(|i| f32::from_bits(bits(rank, peer, k, i)))
                            .collect(),
                    ));
                    receives.push((peer, k, vec![0.0; n]));
                }
            }
            let tag = |k: usize| if tagged { k as u32 + 1 } else { 0 };
            if tagged {
                receives.reverse();
            }
            let mut messages: Vec<Work<'_>> = Vec::new();
            for (peer, k, data) in &mut sends {
                // SAFETY: `data` lives, untouched, until every message is waited.
                messages.push(
                    unsafe {
                        comm.post_send(
                            *peer,
                            tag(*k),
                            data.as_mut_ptr().cast(),
                            data.len() as u64,
                            DataType::F32,
                        )
                    }
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}")),
                );
            }
            for (peer, k, data) in &mut receives {
                // SAFETY: as above.
                messages.push(
                    unsafe {
                        comm.post_recv(
                            *peer,
                            tag(*k),
                            data.as_mut_ptr().cast(),
                            data.len() as u64,
                            DataType::F32,
                        )
                    }
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}")),
                );
            }
            for msg in &messages {
                msg.wait_timeout(Duration::from_secs(60))
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                assert!(msg.test().expect("a finished message tests clean"));
                assert_eq!(msg.sequence(), None, "a message is not numbered");
            }
            drop(messages);
            // The sends are unchanged, and every receive holds its sender's.
            for (peer, k, data) in &sends {
                assert!(
                    data.iter()
                        .enumerate()
                        .all(|(i, v)| v.to_bits() == bits(rank, *peer, *k, i))
                );
            }
            receives
        },
    );
    for (rank, receives) in (0u32..).zip(&results) {
        for (peer, k, data) in receives {
            let wrong = data
                .iter()
                .enumerate()
                .filter(|&(i, v)| v.to_bits() != bits(*peer, rank, *k, i))
                .count();
            assert_eq!(
                wrong, 0,
                "{m}x{d}+{servers} {algorithm} (tagged: {tagged}): rank {rank} from {peer}, \
                 message {k}"
            );
        }
    }
}

#[test]
fn every_pair_exchanges_exact_messages_in_order() {
    for (m, d) in [(1, 2), (2, 1), (2, 2), (3, 1)] {
        every_pair_at_once(m, d, 0, Algorithm::Auto, false);
    }
}

/// Tags: the k-th send of a tag meets the k-th receive of that tag, however
/// the tags interleave; between machines (the fabric) and within one (the
/// machine's mailboxes).
#[test]
fn messages_match_by_tag_whatever_order_the_tags_are_posted_in() {
    for (m, d) in [(1, 2), (2, 1), (2, 2)] {
        every_pair_at_once(m, d, 0, Algorithm::Auto, true);
    }
}

#[test]
fn messages_run_whatever_the_communicators_algorithm_and_servers() {
    for algorithm in [
        Algorithm::Ring,
        Algorithm::Doubling,
        Algorithm::Hierarchical,
    ] {
        every_pair_at_once(2, 1, 0, algorithm, false);
    }
    every_pair_at_once(2, 1, 2, Algorithm::Hierarchical, false);
}

#[test]
fn a_ring_exchange_in_one_call_and_blocking_pairs() {
    let results = job(
        1,
        3,
        |b| b,
        |rank, comm| {
            let (next, prev) = ((rank + 1) % 3, (rank + 2) % 3);
            let mut out = vec![rank as i16; 513];
            let mut back = vec![i16::MAX; 513];
            comm.send_recv(&mut [(next, &mut out[..])], &mut [(prev, &mut back[..])])
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            // Blocking forms, ordered so that they pair up: 0 with 1.
            let mut one = [0i64; 3];
            match rank {
                0 => {
                    one = [7, -8, 9];
                    comm.send(1, &mut one).unwrap();
                    comm.recv(1, &mut one).unwrap();
                }
                1 => {
                    comm.recv(0, &mut one).unwrap();
                    one.iter_mut().for_each(|v| *v *= 10);
                    comm.send(0, &mut one).unwrap();
                }
                _ => {}
            }
            (back, one)
        },
    );
    for (rank, (back, _)) in (0u32..).zip(&results) {
        let prev = (rank + 2) % 3;
        assert!(back.iter().all(|&v| v as u32 == prev), "rank {rank}");
    }
    assert_eq!(results[0].1, [70, -80, 90]);
}

/// A large message lands in the receiver's tensor: between machines every
/// byte crosses the fabric into the window the receiver opened (counted as
/// received in place), and between ranks of one machine the receiver copies
/// it from the sender's tensor (or, where it may not, the fabric writes it
/// in place too). A small one between machines may go eagerly instead,
/// into a slot of the receiver's, with a header. Exact, both directions at
/// once, round after round (the window opens and closes each time).
#[test]
fn large_messages_between_machines_land_in_the_receivers_tensor() {
    const LARGE: usize = 300_001;
    for (m, d) in [(2, 1), (1, 2)] {
        let traffic = job(
            m,
            d,
            |b| b,
            |rank, comm| {
                let peer = 1 - rank;
                let before = comm.traffic();
                for round in 0..3 {
                    for (k, n) in [(2 * round, 1000), (2 * round + 1, LARGE)] {
                        let mut out: Vec<f32> = (0..n)
                            .map(|i| f32::from_bits(bits(rank, peer, k, i)))
                            .collect();
                        let mut back = vec![0.0f32; n];
                        comm.send_recv(&mut [(peer, &mut out[..])], &mut [(peer, &mut back[..])])
                            .unwrap_or_else(|e| panic!("{m}x{d} rank {rank}: {e}"));
                        for (i, v) in back.iter().enumerate() {
                            assert_eq!(
                                v.to_bits(),
                                bits(peer, rank, k, i),
                                "{m}x{d} rank {rank}, message {k}, element {i}"
                            );
                        }
                    }
                }
                let after = comm.traffic();
                (
                    after.received_bytes - before.received_bytes,
                    after.received_in_place_bytes - before.received_in_place_bytes,
                )
            },
        );
        let (large, small) = (3 * LARGE as u64 * 4, 3 * 1000 * 4);
        for (received, in_place) in traffic {
            // Whatever crosses the fabric lands in the tensor, but for small
            // messages sent eagerly.
            assert!(
                in_place <= received && received - in_place <= small + 3 * 64,
                "{m}x{d}: {received} bytes received, {in_place} in place"
            );
            if m == 2 {
                assert!(
                    in_place >= large && received >= large + small,
                    "{m}x{d}: every byte crosses the fabric, every large one in place: \
                     {received} received, {in_place} in place"
                );
            }
        }
    }
}

/// A send of more than 16 KiB and its receive of another size both fail,
/// each naming both; the communicator keeps working.
#[test]
fn a_receive_of_another_size_fails_both_ranks_naming_both() {
    expect_mismatch_of(5000, 5001, true);
}

/// A small send between machines does not learn of a mismatch, whichever
/// way it went: eagerly (done once its bytes have left), whether its
/// receive was posted late or first and small (it waits for the eager send
/// unannounced), or by announcement (a receive of more than 16 KiB, posted
/// first, announces itself). Its receive fails naming both, and the
/// communicator keeps working.
#[test]
fn a_small_send_of_another_size_fails_only_its_receive_naming_both() {
    // (whether the receive is posted first, its f32, whether the send goes
    // eagerly)
    const ROUNDS: [(bool, usize, bool); 3] =
        [(false, 17, true), (true, 17, true), (true, 5000, false)];
    let results = job(
        2,
        1,
        |b| b.timeout(Duration::from_secs(10)),
        |rank, comm| {
            let peer = 1 - rank;
            // Each rank opens its eager slots to the other.
            let (mut out, mut back) = ([rank as f32; 3], [0f32; 3]);
            comm.send_recv(&mut [(peer, &mut out[..])], &mut [(peer, &mut back[..])])
                .unwrap();
            let staged = |t: fairring::Traffic| t.received_bytes - t.received_in_place_bytes;
            // Each count is taken before a barrier, which the peer's next send
            // waits for: a round's bytes land after its first count, however
            // late this rank leaves the barrier.
            let mut before = staged(comm.traffic());
            comm.barrier().unwrap();
            let mut outcomes = Vec::new();
            for (receive_first, received, _) in ROUNDS {
                let outcome = if rank == 0 {
                    if receive_first {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    comm.send(1, &mut [1.0f32; 16])
                } else {
                    if !receive_first {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    comm.recv(0, &mut vec![0.0f32; received])
                };
                let after = staged(comm.traffic());
                comm.barrier().unwrap();
                outcomes.push((outcome, after - before));
                before = after;
            }
            outcomes
        },
    );
    for (round, (receive_first, received, eagerly)) in ROUNDS.into_iter().enumerate() {
        let case = format!("receive first: {receive_first}, of {received} x f32");
        let (sent, _) = &results[0][round];
        assert!(sent.is_ok(), "{case}: {sent:?}");
        let (outcome, staged) = &results[1][round];
        // Eagerly, 64 bytes and a header land in a slot of rank 1's.
        assert_eq!(*staged >= 64, eagerly, "{case}: {staged} bytes staged");
        match outcome {
            Err(Error::Mismatch {
                called,
                peer_called,
                ..
            }) => assert_eq!(
                (called.clone(), peer_called.as_str()),
                (
                    format!("a receive of {received} x f32 from rank 0 (tag 0)"),
                    "a send of 16 x f32 to rank 1 (tag 0)"
                ),
                "{case}"
            ),
            other => panic!("{case}: expected a mismatch, got {other:?}"),
        }
    }
}

/// Rank 2 of three sends `sent` `f32` to rank 1, which receives `received`;
/// rank 0 takes no part. Both fail with a mismatch naming both (only the
/// receiver, unless `both`).
fn expect_mismatch_of(sent: usize, received: usize, both: bool) {
    let results = job(
        3,
        1,
        |b| b.timeout(Duration::from_secs(10)),
        |rank, comm| {
            let mut data = vec![1.0f32; if rank == 2 { sent } else { received }];
            let outcome = match rank {
                2 => comm.send(1, &mut data),
                1 => comm.recv(2, &mut data),
                _ => Ok(()),
            };
            // A message that does not match fails alone: the communicator
            // itself keeps working.
            comm.barrier()
                .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            outcome
        },
    );
    assert!(results[0].is_ok(), "{:?}", results[0]);
    if !both {
        assert!(results[2].is_ok(), "{:?}", results[2]);
    }
    let failing = if both { &results[1..] } else { &results[1..2] };
    for (rank, r) in (1u32..).zip(failing) {
        match r {
            Err(Error::Mismatch {
                rank: one,
                peer: other,
                called,
                peer_called,
                ..
            }) => {
                // Both ranks named, in the job's numbering, whichever is
                // given first.
                let named = ((*one).min(*other), (*one).max(*other));
                assert_eq!(named, (1, 2), "rank {rank}: {called} / {peer_called}");
                // Each side says what it called and what its match was.
                let (send, receive) = (
                    format!("a send of {sent} x f32 to rank 1 (tag 0)"),
                    format!("a receive of {received} x f32 from rank 2 (tag 0)"),
                );
                let (own, theirs) = if rank == 2 {
                    (send, receive)
                } else {
                    (receive, send)
                };
                assert_eq!(
                    (called.as_str(), peer_called.as_str()),
                    (own.as_str(), theirs.as_str()),
                    "rank {rank}"
                );
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn bad_peers_and_pointers_are_refused_naming_the_argument() {
    job(
        1,
        2,
        |b| b,
        |rank, comm| {
            let mut data = [0u8; 4];
            for peer in [rank, 2, u32::MAX] {
                match comm.send(peer, &mut data) {
                    Err(Error::InvalidArgument {
                        argument: "peer",
                        reason,
                    }) => {
                        assert!(reason.contains(&peer.to_string()), "{reason}");
                    }
                    other => panic!("peer {peer}: {other:?}"),
                }
            }
            // A bad peer anywhere in a batch refuses the whole batch at once,
            // naming its list and entry.
            let (mut a, mut b) = ([0u8; 2], [0u8; 2]);
            match comm.send_recv(&mut [(1 - rank, &mut a[..])], &mut [(7, &mut b[..])]) {
                Err(Error::InvalidArgument {
                    argument: "receives",
                    reason,
                }) => assert!(
                    reason.starts_with("receive 0: rank 7 is not another rank"),
                    "{reason}"
                ),
                other => panic!("a batch with peer 7: {other:?}"),
            }
            // SAFETY: refused before anything touches the (null) memory.
            let null =
                unsafe { comm.post_recv(1 - rank, 0, std::ptr::null_mut(), 4, DataType::F32) };
            assert!(
                matches!(
                    null,
                    Err(Error::InvalidArgument {
                        argument: "data",
                        ..
                    })
                ),
                "{null:?}"
            );
        },
    );
}

#[test]
fn a_message_to_a_rank_that_never_answers_fails_within_the_timeout() {
    let timeout = Duration::from_secs(2);
    let results = job(
        2,
        1,
        |b| b.timeout(timeout),
        |rank, comm| {
            if rank == 1 {
                return None;
            }
            let mut data = [1i32; 8];
            let start = Instant::now();
            let outcome = comm.send(1, &mut data);
            Some((outcome, start.elapsed()))
        },
    );
    let (outcome, took) = results[0].as_ref().expect("rank 0 sent");
    let e = outcome.as_ref().expect_err("nobody received");
    assert!(*took < timeout * 4, "took {took:?}");
    let text = e.to_string();
    assert!(text.contains("0->1") || text.contains("rank 1"), "{text}");
}

/// A message issued after a gather that moves as messages (2 MiB in all)
/// reaches the engine after the gather's on both ranks, whichever rank is
/// late to issue it. The sizes are equal, so a swap would pass the size check
/// and deliver each payload to the other's buffer.
#[test]
fn messages_keep_their_order_behind_gathers_that_move_as_messages() {
    let n = (2 << 20) / 4 / 2;
    for late in [0u32, 1] {
        let results = job(
            2,
            1,
            |b| b,
            |rank, comm| {
                let mine = vec![rank as f32 + 1.0; n];
                let mut every = vec![0.0f32; 2 * n];
                let mut message = vec![if rank == 1 { 9.0f32 } else { 0.0 }; n];
                comm.scope(|s| -> fairring::Result<()> {
                    let gather = s.gather(&mine, &mut every, 0, ())?;
                    if rank == late {
                        // By now this rank's gather has been handed over.
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    if rank == 1 {
                        comm.send(0, &mut message)?;
                    } else {
                        comm.recv(1, &mut message)?;
                    }
                    gather.wait()
                })
                .unwrap_or_else(|e| panic!("late {late}, rank {rank}: {e}"));
                (every, message)
            },
        );
        let (every, message) = &results[0];
        assert!(
            message.iter().all(|&v| v == 9.0),
            "late {late}: the message"
        );
        assert!(
            every[..n].iter().all(|&v| v == 1.0),
            "late {late}: rank 0's part"
        );
        assert!(
            every[n..].iter().all(|&v| v == 2.0),
            "late {late}: rank 1's part"
        );
    }
}

/// Aborting a communicator fails its messages in flight at once: one to a
/// linked peer, and one to a peer that never names this rank (so never
/// linked); later messages are refused.
#[test]
fn abort_fails_messages_in_flight_and_refuses_later_ones() {
    let timeout = Duration::from_secs(30);
    let results = job(
        3,
        1,
        |b| b.timeout(timeout),
        |rank, comm| {
            let mut data = [1i32; 8];
            match rank {
                // Met once, then never sent on again.
                1 => comm.send(0, &mut data).unwrap(),
                0 => {
                    comm.recv(1, &mut data).unwrap();
                    let mut more = [0i32; 8];
                    let mut never = [0i32; 8];
                    // SAFETY: both live until the messages are waited for.
                    let met =
                        unsafe { comm.post_recv(1, 0, more.as_mut_ptr().cast(), 8, DataType::I32) }
                            .unwrap();
                    // SAFETY: as above.
                    let meeting = unsafe {
                        comm.post_recv(2, 0, never.as_mut_ptr().cast(), 8, DataType::I32)
                    }
                    .unwrap();
                    let start = Instant::now();
                    std::thread::scope(|s| {
                        s.spawn(|| {
                            std::thread::sleep(Duration::from_millis(200));
                            comm.abort();
                        });
                        for m in [met, meeting] {
                            let e = m.wait().expect_err("aborted");
                            assert!(matches!(e, Error::Aborted), "{e}");
                        }
                    });
                    let took = start.elapsed();
                    assert!(took < Duration::from_secs(5), "took {took:?}");
                    let e = comm.send(1, &mut data).expect_err("refused");
                    assert!(matches!(e, Error::Aborted), "{e}");
                }
                _ => {}
            }
            // The peers stay until rank 0 is done: a peer that leaves fails
            // its messages without any abort.
            std::thread::sleep(Duration::from_secs(if rank == 0 { 0 } else { 3 }));
        },
    );
    assert_eq!(results.len(), 3);
}

/// Elements rank `src` sends rank `dst` in all-to-all round `round`: zero
/// among them.
fn split(src: u32, dst: u32, round: u32) -> u64 {
    u64::from((src * 7 + dst * 3 + round * 5) % 6) * 37
}

#[test]
fn all_to_all_with_unequal_splits_on_every_layout() {
    for (m, d) in [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)] {
        let world = m * d;
        let results = job(
            m,
            d,
            |b| small_slices(b, Algorithm::Auto),
            |rank, comm| {
                let mut got = Vec::new();
                for round in 0..3 {
                    let ins: Vec<u64> = (0..world).map(|j| split(rank, j, round)).collect();
                    let outs: Vec<u64> = (0..world).map(|j| split(j, rank, round)).collect();
                    let mut input: Vec<f32> = (0..world)
                        .flat_map(|j| {
                            (0..split(rank, j, round) as usize)
                                .map(move |i| f32::from_bits(bits(rank, j, round as usize, i)))
                        })
                        .collect();
                    let mut output = vec![0f32; outs.iter().sum::<u64>() as usize];
                    comm.all_to_all_v(&mut input, &ins, &mut output, &outs)
                        .unwrap_or_else(|e| panic!("{m}x{d} rank {rank}: {e}"));
                    got.push(output);
                }
                // Equal blocks, one call.
                let k = 5usize;
                let mut input: Vec<i64> = (0..world as usize * k)
                    .map(|i| i64::from(rank) * 1000 + i as i64)
                    .collect();
                let mut output = vec![0i64; input.len()];
                comm.all_to_all(&mut input, &mut output).unwrap();
                (got, output)
            },
        );
        for (rank, (got, equal)) in (0u32..).zip(&results) {
            for (round, output) in (0u32..).zip(got) {
                let want: Vec<u32> = (0..world)
                    .flat_map(|j| {
                        (0..split(j, rank, round) as usize)
                            .map(move |i| bits(j, rank, round as usize, i))
                    })
                    .collect();
                let have: Vec<u32> = output.iter().map(|v| v.to_bits()).collect();
                assert_eq!(have, want, "{m}x{d}: rank {rank}, round {round}");
            }
            let want: Vec<i64> = (0..world as i64)
                .flat_map(|j| (0..5).map(move |i| j * 1000 + i64::from(rank) * 5 + i))
                .collect();
            assert_eq!(equal, &want, "{m}x{d}: rank {rank}, equal blocks");
        }
    }
}

#[test]
fn all_to_all_splits_that_disagree_fail_naming_both() {
    let results = job(
        1,
        3,
        |b| b.timeout(Duration::from_secs(10)),
        |rank, comm| {
            // Rank 2 sends rank 0 four elements; rank 0 expects three.
            let ins: Vec<u64> = (0..3)
                .map(|j| if rank == 2 && j == 0 { 4 } else { 3 })
                .collect();
            let outs = vec![3u64; 3];
            let mut input = vec![1u8; ins.iter().sum::<u64>() as usize];
            let mut output = vec![0u8; 9];
            comm.all_to_all_v(&mut input, &ins, &mut output, &outs)
        },
    );
    assert!(results[1].is_ok(), "{:?}", results[1]);
    for rank in [0u32, 2] {
        match &results[rank as usize] {
            Err(Error::Mismatch {
                rank: me,
                peer,
                called,
                peer_called,
                ..
            }) => {
                // Both ranks named, in the job's numbering.
                assert_eq!((*me).min(*peer), 0, "{called} / {peer_called}");
                assert_eq!((*me).max(*peer), 2, "{called} / {peer_called}");
                // The sender's four elements against the receiver's three.
                let both = format!("{called} / {peer_called}");
                assert!(
                    both.contains("a send of 4 x u8 to rank 0")
                        && both.contains("a receive of 3 x u8 from rank 2"),
                    "{both}"
                );
            }
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
fn all_to_all_arguments_are_checked_naming_them() {
    job(
        1,
        2,
        |b| b,
        |rank, comm| {
            let mut input = vec![0f32; 4];
            let mut output = vec![0f32; 4];
            let refused = |r: fairring::Result<()>, argument: &str| match r {
                Err(Error::InvalidArgument {
                    argument: a,
                    reason,
                }) => assert_eq!(a, argument, "{reason}"),
                other => panic!("rank {rank}: expected {argument} refused, got {other:?}"),
            };
            refused(
                comm.all_to_all_v(&mut input, &[2, 2, 0], &mut output, &[2, 2]),
                "input_counts",
            );
            refused(
                comm.all_to_all_v(&mut input, &[2, 1], &mut output, &[2, 2]),
                "input_counts",
            );
            refused(
                comm.all_to_all_v(&mut input, &[2, 2], &mut output, &[3, 1]),
                "output_counts",
            );
            refused(comm.all_to_all(&mut input[..3], &mut output[..3]), "input");
            refused(comm.all_to_all(&mut input, &mut output[..2]), "output");
            let p: *mut u8 = input.as_mut_ptr().cast();
            // SAFETY: refused before anything is touched.
            let overlapping = unsafe {
                comm.post_all_to_all(p, &[1, 1], p.wrapping_add(4), &[1, 1], DataType::F32)
            };
            assert!(
                matches!(
                    overlapping,
                    Err(Error::InvalidArgument {
                        argument: "output",
                        ..
                    })
                ),
                "{overlapping:?}"
            );
        },
    );
}

/// Two ranks of one machine exchange large messages, and `aborted` (the
/// sender 0 or the receiver 1) is aborted meanwhile; as soon as its call has
/// failed it writes a byte of every page of its buffer, from the last page
/// (a copy still running would reach those after this write). Returns the
/// pages that went wrong: pages of the aborted receiver's buffer written
/// after its receive failed, or pages of a receive that succeeded but holds
/// what the aborted sender wrote after its send failed. Where the two copy
/// between each other's tensors, the aborted rank waits for its peer's copy
/// to or from its buffer to end before its call fails.
fn abort_during_large_messages(aborted: u32, round: u64) -> usize {
    const LEN: usize = 8 << 20;
    const SENT: u8 = 0x11;
    const REUSED: u8 = 0xA5;
    let wrong = job(
        1,
        2,
        |b| b.timeout(Duration::from_secs(30)),
        |rank, comm| {
            let mut buf = vec![if rank == 0 { SENT } else { 0 }; LEN];
            let call = |buf: &mut Vec<u8>| {
                if rank == 0 {
                    comm.send(1, buf)
                } else {
                    comm.recv(0, buf)
                }
            };
            // The pair has exchanged a message before the abort can come.
            call(&mut buf).unwrap();
            if rank != aborted {
                let mut wrong = 0;
                while call(&mut buf).is_ok() {
                    if rank == 1 {
                        wrong += buf
                            .chunks(4096)
                            .filter(|p| p.iter().any(|&b| b != SENT))
                            .count();
                    }
                }
                return wrong;
            }
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(Duration::from_millis(20 + 7 * round));
                    comm.abort();
                });
                while call(&mut buf).is_ok() {}
                // The call failed: the buffer is the caller's again.
                for page in buf.chunks_mut(4096).rev() {
                    page[0] = REUSED;
                }
            });
            std::thread::sleep(Duration::from_millis(100));
            if rank == 0 {
                0
            } else {
                buf.chunks(4096).filter(|page| page[0] != REUSED).count()
            }
        },
    );
    wrong.iter().sum()
}

#[test]
fn an_aborted_rank_of_one_machine_may_reuse_its_buffer_at_once() {
    for round in 0..8 {
        for aborted in [0, 1] {
            let wrong = abort_during_large_messages(aborted, round);
            assert_eq!(wrong, 0, "rank {aborted} aborted: {wrong} pages went wrong");
        }
    }
}

/// A rank aborted before a peer of its machine sends it its first message:
/// the peer's send fails with the communicator's failure at once, not at the
/// timeout.
#[test]
fn a_first_send_fails_at_once_when_the_receiver_is_aborted() {
    let timeout = Duration::from_secs(60);
    let results = job(
        1,
        2,
        |b| b.timeout(timeout),
        |rank, comm| {
            let mut data = [7i32; 1024];
            if rank == 1 {
                comm.abort();
                // Stays, so that its process (here, its thread) is not gone.
                std::thread::sleep(Duration::from_secs(3));
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
            let start = Instant::now();
            let e = comm
                .send(1, &mut data)
                .expect_err("the receiver was aborted");
            Some((start.elapsed(), e.to_string()))
        },
    );
    let (took, e) = results[0].clone().unwrap();
    assert!(took < Duration::from_secs(10), "took {took:?}: {e}");
    assert!(e.contains("rank 1") && e.contains("aborted"), "{e}");
    println!("the send failed after {took:?}: {e}");
}

/// More messages in flight between two ranks of different machines than
/// the engine keeps registrations for (64 windows, 64 sources): the rest
/// open windows and register sources of their own, and every pair meets
/// its own match, exact. (They once failed, and a receive that failed unseen
/// by its sender let the sender's next send meet the receive after it.)
#[test]
fn more_messages_in_flight_than_registrations_kept_all_land_exact() {
    const MESSAGES: usize = 70;
    // Above the eager bound, so that every send waits for its receive.
    const ELEMENTS: usize = 5000;
    let results = job(
        2,
        1,
        |b| b.timeout(Duration::from_secs(10)),
        |rank, comm| {
            let value = |k: usize, i: usize| (k * ELEMENTS + i) as f32;
            let mut tensors: Vec<Vec<f32>> = (0..MESSAGES)
                .map(|k| {
                    (0..ELEMENTS)
                        .map(|i| if rank == 0 { value(k, i) } else { -1.0 })
                        .collect()
                })
                .collect();
            let calls: Vec<Call> = tensors
                .iter_mut()
                .map(|t| {
                    let n = t.len() as u64;
                    if rank == 0 {
                        Call::send(1, 0, t.as_ptr().cast(), n, DataType::F32)
                    } else {
                        Call::recv(0, 0, t.as_mut_ptr().cast(), n, DataType::F32)
                    }
                })
                .collect();
            // The receives first, all of them in flight; then the sends,
            // all matched at once.
            if rank == 0 {
                comm.barrier().unwrap();
            }
            // SAFETY: every tensor outlives its work, waited below.
            let works: Vec<_> = calls
                .iter()
                .map(|c| unsafe { comm.start(c) }.unwrap())
                .collect();
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(200));
                comm.barrier().unwrap();
            }
            for (k, w) in works.into_iter().enumerate() {
                w.wait()
                    .unwrap_or_else(|e| panic!("rank {rank}, message {k}: {e}"));
            }
            tensors
                .iter()
                .enumerate()
                .all(|(k, t)| t.iter().enumerate().all(|(i, &v)| v == value(k, i)))
        },
    );
    assert!(results[1], "every message lands in its own receive, exact");
}

/// A message posted to or from a rank that has left the job fails at once,
/// naming it, on both paths (a small send between machines once went
/// eagerly into the departed rank's slots, and was done).
#[test]
fn a_message_with_a_rank_that_left_fails_at_once_naming_it() {
    let timeout = Duration::from_secs(5);
    for (m, d) in [(2, 1), (1, 2)] {
        let results = job(
            m,
            d,
            |b| b.timeout(timeout),
            |rank, comm| {
                let peer = 1 - rank;
                let (mut out, mut back) = ([1i32; 4], [0i32; 4]);
                comm.send_recv(&mut [(peer, &mut out[..])], &mut [(peer, &mut back[..])])
                    .unwrap();
                if rank == 1 {
                    return Vec::new();
                }
                // Rank 1's goodbye arrives meanwhile.
                std::thread::sleep(Duration::from_millis(500));
                let start = Instant::now();
                let sent = comm.send(1, &mut out);
                let received = comm.recv(1, &mut back);
                vec![(sent, start.elapsed()), (received, start.elapsed())]
            },
        );
        for (outcome, took) in &results[0] {
            let e = outcome.as_ref().expect_err("the peer left").to_string();
            assert!(
                e.contains("rank 1") && e.contains("left the job"),
                "{m}x{d}: {e}"
            );
            assert!(*took < timeout / 2, "{m}x{d}: took {took:?}");
        }
    }
}
