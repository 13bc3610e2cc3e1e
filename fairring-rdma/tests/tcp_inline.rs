//! The tcp provider's inline I/O: posting threads that write, and callers of
//! `progress` that read, beside the I/O thread. Completions keep their order and
//! none is lost, even when the completion queue is full; failures met inline are
//! reported like the I/O thread's own.

#![expect(
    clippy::cast_possible_truncation,
    reason = "ranks, counts and offsets in tests are small"
)]

mod common;

use std::time::{Duration, Instant};

use common::{Buffer, Rng, empty, mesh};
use fairring_rdma::fabric::{CompletionEvent, Fabric, LocalRegion, PeerFailure, WriteRequest};

/// Completions a queue holds in these tests: small enough that both inline
/// readers and writers often find it full.
const TINY_QUEUE: usize = 4;

/// Posts per sender.
const POSTS: u32 = 1500;
/// Bytes of one write slot; each sender writes into 4 slots of its own.
const SLOT: usize = 8192;

/// What one sender posts, in order: (immediate, a message's payload or a write's
/// length).
fn plan(seed: u64) -> Vec<(u32, Result<Vec<u8>, usize>)> {
    let mut rng = Rng(seed);
    (0..POSTS)
        .map(|i| {
            if rng.below(2) == 0 {
                let mut payload = vec![0u8; rng.below(60) as usize];
                rng.fill(&mut payload);
                (i, Ok(payload))
            } else {
                (i, Err(1 + rng.below(SLOT as u64) as usize))
            }
        })
        .collect()
}

/// Ranks 0 and 2 each post 1500 writes and messages to rank 1, draining their own
/// (tiny) queues of `Sent` completions only now and then; rank 1 reads inline many
/// times between polls, while its I/O thread reads too, so that its tiny queue
/// fills under inline reads and completions are held. Every completion arrives
/// exactly once, in posting order per peer, and the bytes land.
#[test]
fn a_full_queue_holds_completions_in_order_on_both_sides() {
    let fabrics = mesh(3, |mut c| {
        c.completion_capacity = TINY_QUEUE;
        c
    });
    let mut bytes = vec![0u8; SLOT];
    Rng(5).fill(&mut bytes);
    let target = Buffer::new(&fabrics[1], vec![0; SLOT * 8]);
    let remote = target.region().remote();
    let plans = [plan(17), Vec::new(), plan(23)];
    std::thread::scope(|s| {
        for sender_rank in [0usize, 2] {
            let sender = &fabrics[sender_rank];
            let plan = &plans[sender_rank];
            let source = Buffer::new(sender, bytes.clone());
            // Sender 0 writes slots 0..4, sender 2 slots 4..8.
            let base = if sender_rank == 0 { 0 } else { 4 };
            s.spawn(move || {
                let mut out = [empty(); 16];
                let mut next_sent = 0u64;
                let take_sent = |out: &mut [_], next_sent: &mut u64| {
                    let n = sender.poll(out);
                    for c in &out[..n] {
                        match c.event {
                            CompletionEvent::Sent { token } => {
                                assert_eq!(token, *next_sent, "Sent completions out of order");
                                *next_sent += 1;
                            }
                            ref other => panic!("rank {sender_rank} got {other:?}"),
                        }
                    }
                };
                for (i, what) in plan {
                    loop {
                        let posted = match what {
                            Ok(payload) => sender.send_message(1, *i, payload, u64::from(*i)),
                            Err(len) => sender.write(
                                1,
                                WriteRequest {
                                    source: source.region(),
                                    source_offset: SLOT - len,
                                    len: *len,
                                    target: remote,
                                    target_offset: ((base + u64::from(*i) % 4) as usize * SLOT)
                                        as u64,
                                    immediate: *i,
                                    token: u64::from(*i),
                                },
                            ),
                        };
                        match posted {
                            Ok(()) => break,
                            Err(fairring_rdma::fabric::FabricError::QueueFull { .. }) => {
                                take_sent(&mut out, &mut next_sent);
                            }
                            Err(e) => panic!("post {i}: {e}"),
                        }
                    }
                    if i % 64 == 63 {
                        take_sent(&mut out, &mut next_sent);
                    }
                }
                let deadline = Instant::now() + Duration::from_secs(60);
                while next_sent < u64::from(POSTS) {
                    assert!(Instant::now() < deadline, "{next_sent} of {POSTS} sent");
                    take_sent(&mut out, &mut next_sent);
                    std::thread::yield_now();
                }
                drop(source);
            });
        }
        let receiver = &fabrics[1];
        let mut out = [empty(); 3];
        let mut next = [0usize; 3];
        let deadline = Instant::now() + Duration::from_secs(60);
        while next[0] + next[2] < 2 * POSTS as usize {
            assert!(
                Instant::now() < deadline,
                "{next:?} of {POSTS} each arrived"
            );
            // Read inline many times before polling, so that inline reads find
            // the queue full and hold completions.
            for _ in 0..50 {
                receiver.progress();
            }
            let n = receiver.poll(&mut out);
            for c in &out[..n] {
                let from = c.peer as usize;
                let (i, what) = &plans[from][next[from]];
                match (&c.event, what) {
                    (CompletionEvent::Message(m), Ok(payload)) => {
                        assert_eq!((m.immediate, m.payload()), (*i, payload.as_slice()));
                    }
                    (CompletionEvent::Landed { len, immediate }, Err(expected_len)) => {
                        assert_eq!((*immediate, *len), (*i, *expected_len as u64));
                    }
                    (other, _) => {
                        panic!(
                            "completion {} from {from}: {other:?}, expected post {i}",
                            next[from]
                        )
                    }
                }
                next[from] += 1;
            }
        }
    });
    // Each slot holds the last write into it.
    for (sender_rank, base) in [(0usize, 0usize), (2, 4)] {
        for slot in 0..4usize {
            let last = plans[sender_rank]
                .iter()
                .rev()
                .find_map(|(i, what)| match what {
                    Err(len) if *i as usize % 4 == slot => Some(*len),
                    _ => None,
                })
                .unwrap();
            let at = (base + slot) * SLOT;
            assert_eq!(
                &target.read()[at..at + last],
                &bytes[SLOT - last..],
                "rank {sender_rank}'s slot {slot} holds the wrong bytes"
            );
        }
    }
}

/// A peer that goes away while its neighbour reads inline (whichever thread meets
/// the close) is reported once, as `PeerFailed`.
#[test]
fn a_closed_peer_under_inline_reads_fails_once() {
    let mut fabrics = mesh(2, |c| c);
    let survivor = fabrics.remove(0);
    drop(fabrics);
    let mut out = [empty(); 8];
    let mut failures = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline && failures.is_empty() {
        survivor.progress();
        let n = survivor.poll(&mut out);
        for c in &out[..n] {
            if let CompletionEvent::PeerFailed { failure } = c.event {
                failures.push((c.peer, failure));
            }
        }
    }
    // Anything else reported afterwards must not repeat the failure.
    let settle = Instant::now() + Duration::from_millis(300);
    while Instant::now() < settle {
        survivor.progress();
        let n = survivor.poll(&mut out);
        for c in &out[..n] {
            if let CompletionEvent::PeerFailed { failure } = c.event {
                failures.push((c.peer, failure));
            }
        }
    }
    assert_eq!(failures, vec![(1, PeerFailure::Closed)]);
    assert!(!survivor.is_connected(1));
}

/// While a thread reads inline the I/O thread naps instead of waiting on the
/// sockets; once the thread stops spinning, with `spin_ends` before it sleeps or
/// simply by leaving, arrivals are the I/O thread's again: a caller sleeping in
/// `wait` gets each message, none lost in the hand-over.
#[test]
fn arrivals_reach_a_sleeping_caller_after_inline_reads_stop() {
    let fabrics = mesh(2, |c| c);
    let (sender, receiver) = (&fabrics[0], &fabrics[1]);
    let mut out = [empty(); 8];
    let spin = |out: &mut [_], for_: Duration| {
        let until = Instant::now() + for_;
        while Instant::now() < until {
            receiver.progress();
            let n = receiver.poll(out);
            assert_eq!(n, 0, "nothing is sent while the receiver spins");
        }
    };
    for (round, says_so) in [(1u32, true), (2, false), (3, true)] {
        spin(&mut out, Duration::from_millis(20));
        if says_so {
            receiver.spin_ends();
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(30));
                sender
                    .send_message(1, round, &round.to_le_bytes(), u64::from(round))
                    .expect("a message to a connected peer");
            });
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut got = None;
            while got.is_none() && Instant::now() < deadline {
                let n = receiver.wait(&mut out, Duration::from_millis(100));
                got = out[..n].iter().find_map(|c| match &c.event {
                    CompletionEvent::Message(m) => {
                        Some((c.peer, m.immediate, m.payload().to_vec()))
                    }
                    _ => None,
                });
            }
            assert_eq!(
                got,
                Some((0, round, round.to_le_bytes().to_vec())),
                "round {round} (spin_ends: {says_so})"
            );
        });
        // The sender's `Sent`.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut sent = false;
        while !sent && Instant::now() < deadline {
            let n = sender.wait(&mut out, Duration::from_millis(100));
            sent = out[..n].iter().any(
                |c| matches!(c.event, CompletionEvent::Sent { token } if token == u64::from(round)),
            );
        }
        assert!(sent, "round {round}: the sender's completion");
    }
}

/// A large write leaves partly from the posting thread and partly from a thread
/// that spins (`progress` writes what the socket takes), while the I/O thread
/// naps; when the spinner stops, with `spin_ends` (to sleep), `spinner_leaves`
/// (back to its caller) or simply by leaving (the nap then ends once its
/// last inline read is a window old), what it left unsent is the I/O thread's: every byte lands,
/// whole, and the sender's `Sent` comes, however the hand-over falls.
#[test]
fn frames_a_spinner_leaves_unsent_reach_the_peer() {
    // Larger than the kernel's socket buffers and the inline byte limit, so
    // that some of it is left unsent at every hand-over.
    const LEN: usize = 24 << 20;
    let fabrics = mesh(2, |c| c);
    let (sender, receiver) = (&fabrics[0], &fabrics[1]);
    let mut pattern = vec![0u8; LEN];
    Rng(11).fill(&mut pattern);
    let source = Buffer::new(sender, pattern.clone());
    let mut out = [empty(); 8];
    for (round, says_so) in (1u32..=9).map(|r| (r, r % 3)) {
        let target = Buffer::new(receiver, vec![0; LEN]);
        sender
            .write(
                1,
                WriteRequest {
                    source: source.region(),
                    source_offset: 0,
                    len: LEN,
                    target: target.region().remote(),
                    target_offset: 0,
                    immediate: round,
                    token: u64::from(round),
                },
            )
            .expect("a write to a connected peer");
        // The sender spins a little (writing inline), then stops.
        let until = Instant::now() + Duration::from_millis(2);
        while Instant::now() < until {
            sender.progress();
        }
        match says_so {
            0 => sender.spin_ends(),
            1 => sender.spinner_leaves(),
            _ => {}
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut out = [empty(); 8];
                let deadline = Instant::now() + Duration::from_secs(20);
                let mut landed = None;
                while landed.is_none() && Instant::now() < deadline {
                    let n = receiver.wait(&mut out, Duration::from_millis(100));
                    landed = out[..n].iter().find_map(|c| match c.event {
                        CompletionEvent::Landed { immediate, len, .. } => Some((immediate, len)),
                        _ => None,
                    });
                }
                assert_eq!(landed, Some((round, LEN as u64)), "round {round}");
            });
            // The sender sleeps for its completion, no longer spinning.
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut sent = false;
            while !sent && Instant::now() < deadline {
                let n = sender.wait(&mut out, Duration::from_millis(100));
                sent = out[..n].iter().any(|c| {
                    matches!(c.event, CompletionEvent::Sent { token } if token == u64::from(round))
                });
            }
            assert!(
                sent,
                "round {round} (hand-over {says_so}): the sender's completion"
            );
        });
        assert!(
            target.read() == pattern.as_slice(),
            "round {round}: the bytes"
        );
    }
}
