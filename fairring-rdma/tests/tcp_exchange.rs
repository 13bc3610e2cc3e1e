//! Data movement over the tcp provider on loopback: every byte where it belongs.

#![expect(
    clippy::cast_possible_truncation,
    reason = "ranks, counts and offsets in tests are small"
)]

mod common;

use std::collections::HashMap;
use std::sync::Barrier;
use std::time::Duration;

use common::{Buffer, Rng, drain_until, mesh};
use fairring_rdma::fabric::{
    CompletionEvent, Fabric, FabricError, LocalRegion, PeerFailure, ProtocolViolation, WriteRequest,
};
use fairring_rdma::tcp::TcpFabric;

const SLOT: usize = 256 << 10;
const WRITES_PER_PAIR: usize = 24;

#[derive(Clone, Copy, Debug)]
struct Posted {
    source_offset: usize,
    len: usize,
    target_offset: usize,
}

/// Eight ranks, each writing randomly sized pieces at random offsets into a slot of
/// every other rank's region; each slot must end up exactly as the writes, applied
/// in posting order, make it, and every completion must match its write.
#[test]
fn all_to_all_among_eight_peers_is_byte_exact() {
    const N: u32 = 8;
    let fabrics = mesh(N, |c| c);
    let sources: Vec<Buffer> = (0..N)
        .map(|r| {
            let mut bytes = vec![0; 1 << 20];
            Rng(u64::from(r) + 1).fill(&mut bytes);
            Buffer::new(&fabrics[r as usize], bytes)
        })
        .collect();
    let targets: Vec<Buffer> = (0..N)
        .map(|r| Buffer::new(&fabrics[r as usize], vec![0; SLOT * N as usize]))
        .collect();
    let remotes: Vec<_> = targets.iter().map(|t| t.region().remote()).collect();

    // The plan of every write, drawn up front so the checks can replay it.
    let mut rng = Rng(0xa117_0a11);
    let mut plan: HashMap<(u32, u32), Vec<Posted>> = HashMap::new();
    for s in 0..N {
        for t in (0..N).filter(|&t| t != s) {
            let writes = (0..WRITES_PER_PAIR)
                .map(|_| {
                    let big = rng.below(4) == 0;
                    let len = 1 + rng.below(if big { SLOT as u64 } else { 4096 }) as usize;
                    Posted {
                        source_offset: rng.below((1 << 20) - len as u64 + 1) as usize,
                        len,
                        target_offset: rng.below((SLOT - len + 1) as u64) as usize,
                    }
                })
                .collect();
            plan.insert((s, t), writes);
        }
    }

    let barrier = Barrier::new(N as usize);
    std::thread::scope(|scope| {
        for me in 0..N {
            let (fabric, source, plan, remotes, barrier) = (
                &fabrics[me as usize],
                &sources[me as usize],
                &plan,
                &remotes,
                &barrier,
            );
            scope.spawn(move || {
                // Interleave the peers: write i to every peer, then write i + 1.
                #[expect(clippy::needless_range_loop, reason = "i indexes every peer's plan")]
                for i in 0..WRITES_PER_PAIR {
                    for t in (0..N).filter(|&t| t != me) {
                        let w = plan[&(me, t)][i];
                        fabric
                            .write(
                                t,
                                WriteRequest {
                                    source: source.region(),
                                    source_offset: w.source_offset,
                                    len: w.len,
                                    target: remotes[t as usize],
                                    target_offset: (me as usize * SLOT + w.target_offset) as u64,
                                    immediate: i as u32,
                                    token: (u64::from(t) << 32) | i as u64,
                                },
                            )
                            .unwrap();
                    }
                }
                let expected = (N as usize - 1) * WRITES_PER_PAIR;
                let (mut sent, mut landed) = (0, 0);
                let mut next_from: HashMap<u32, u32> = HashMap::new();
                drain_until(fabric, Duration::from_secs(60), |c| {
                    match c.event {
                        CompletionEvent::Sent { token } => {
                            assert_eq!(token >> 32, u64::from(c.peer), "token names its peer");
                            sent += 1;
                        }
                        CompletionEvent::Landed { len, immediate } => {
                            let i = next_from.entry(c.peer).or_default();
                            assert_eq!(immediate, *i, "writes from rank {} out of order", c.peer);
                            let w = plan[&(c.peer, me)][*i as usize];
                            assert_eq!(len, w.len as u64);
                            *i += 1;
                            landed += 1;
                        }
                        other => panic!("rank {me}: unexpected {other:?} from rank {}", c.peer),
                    }
                    sent == expected && landed == expected
                });
                barrier.wait();
            });
        }
    });

    for t in 0..N {
        let image = targets[t as usize].read();
        for s in (0..N).filter(|&s| s != t) {
            let mut expected = vec![0u8; SLOT];
            let source = sources[s as usize].read();
            for w in &plan[&(s, t)] {
                expected[w.target_offset..w.target_offset + w.len]
                    .copy_from_slice(&source[w.source_offset..w.source_offset + w.len]);
            }
            let slot = &image[s as usize * SLOT..(s as usize + 1) * SLOT];
            assert!(
                slot == expected.as_slice(),
                "rank {t}'s slot for rank {s} differs"
            );
        }
    }
}

/// One gibibyte through one connection: 16 rounds of a 64 MiB region, each round a
/// different rotation of random bytes, acknowledged by a message before the next.
#[test]
fn one_gibibyte_through_one_connection() {
    const LEN: usize = 64 << 20;
    const ROUNDS: usize = 16;
    const PIECES: usize = 4;
    let fabrics = mesh(2, |c| c);
    let mut base = vec![0u8; LEN];
    Rng(7).fill(&mut base);
    let rotation = |round: usize| (round * 4_194_319) % LEN;
    let mut source = Buffer::new(&fabrics[1], vec![0; LEN]);
    let target = Buffer::new(&fabrics[0], vec![0; LEN]);
    let remote = target.region().remote();
    let base = &base;

    std::thread::scope(|scope| {
        let receiver = &fabrics[0];
        let target = &target;
        scope.spawn(move || {
            for round in 0..ROUNDS {
                let mut landed = 0;
                drain_until(receiver, Duration::from_secs(60), |c| {
                    match c.event {
                        CompletionEvent::Landed { immediate, len, .. } => {
                            assert_eq!(immediate as usize, round);
                            assert_eq!(len as usize, LEN / PIECES);
                            landed += 1;
                        }
                        CompletionEvent::Sent { .. } => {}
                        other => panic!("unexpected {other:?}"),
                    }
                    landed == PIECES
                });
                let k = rotation(round);
                let image = target.read();
                assert!(
                    image[..LEN - k] == base[k..],
                    "round {round}: first part differs"
                );
                assert!(
                    image[LEN - k..] == base[..k],
                    "round {round}: second part differs"
                );
                receiver
                    .send_message(1, round as u32, b"ack", round as u64)
                    .unwrap();
            }
        });

        let sender = &fabrics[1];
        for round in 0..ROUNDS {
            let k = rotation(round);
            // The previous round's writes have all been sent (and acknowledged), so
            // the source may be rewritten.
            let bytes = source.bytes.as_mut_slice();
            bytes[..LEN - k].copy_from_slice(&base[k..]);
            bytes[LEN - k..].copy_from_slice(&base[..k]);
            for piece in 0..PIECES {
                let at = piece * LEN / PIECES;
                sender
                    .write(
                        0,
                        WriteRequest {
                            source: source.region(),
                            source_offset: at,
                            len: LEN / PIECES,
                            target: remote,
                            target_offset: at as u64,
                            immediate: round as u32,
                            token: (round * PIECES + piece) as u64,
                        },
                    )
                    .unwrap();
            }
            let mut sent = 0;
            let mut acked = false;
            drain_until(sender, Duration::from_secs(60), |c| {
                match c.event {
                    CompletionEvent::Sent { .. } => sent += 1,
                    CompletionEvent::Message(m) => {
                        assert_eq!((m.immediate as usize, m.payload()), (round, &b"ack"[..]));
                        acked = true;
                    }
                    other => panic!("unexpected {other:?}"),
                }
                sent == PIECES && acked
            });
        }
    });
}

/// Messages and writes to one peer arrive in posting order, whole, with their
/// immediates.
#[test]
fn messages_and_writes_keep_their_order() {
    let fabrics = mesh(2, |c| c);
    let mut bytes = vec![0u8; 4096];
    Rng(3).fill(&mut bytes);
    let source = Buffer::new(&fabrics[0], bytes);
    let target = Buffer::new(&fabrics[1], vec![0; 4096]);
    let remote = target.region().remote();
    let mut rng = Rng(11);
    let mut expected = Vec::new();
    for i in 0..600u32 {
        if rng.below(3) == 0 {
            let len = rng.below(65) as usize;
            let mut payload = vec![0u8; len];
            rng.fill(&mut payload);
            fabrics[0]
                .send_message(1, i, &payload, u64::from(i))
                .unwrap();
            expected.push((i, Some(payload)));
        } else {
            let len = 1 + rng.below(4096) as usize;
            let request = WriteRequest {
                source: source.region(),
                source_offset: 4096 - len,
                len,
                target: remote,
                target_offset: 0,
                immediate: i,
                token: u64::from(i),
            };
            // The queue holds 1024; 600 posts fit without polling.
            fabrics[0].write(1, request).unwrap();
            expected.push((i, None));
        }
    }
    let mut next = 0;
    drain_until(&fabrics[1], Duration::from_secs(30), |c| {
        let (i, payload) = &expected[next];
        match (&c.event, payload) {
            (CompletionEvent::Message(m), Some(p)) => {
                assert_eq!((m.immediate, m.payload()), (*i, p.as_slice()));
            }
            (CompletionEvent::Landed { immediate, .. }, None) => assert_eq!(immediate, i),
            (other, _) => panic!("completion {next}: {other:?}, expected {i}"),
        }
        next += 1;
        next == expected.len()
    });
}

/// Bursts posted inside (nested) batches, with writes around the receiver's
/// read-ahead size (16 KiB: smaller ones are read through it, larger ones
/// straight into the region) and messages between them: every byte lands where
/// it belongs, completions keep posting order on both sides, and nothing waits
/// for a later batch.
#[test]
fn batched_bursts_land_whole_and_in_order() {
    const LENS: [usize; 9] = [1, 2, 100, 4096, 16383, 16384, 16385, 50_000, 70_001];
    // Keep-alives wake the I/O thread, which would send held frames too; far
    // apart, they cannot hide a batch that ends without sending.
    let fabrics = mesh(2, |mut c| {
        c.silence_timeout = Duration::from_secs(300);
        c.keepalive_interval = Duration::from_secs(100);
        c
    });
    let mut rng = Rng(29);
    let mut bytes = vec![0u8; 1 << 17];
    rng.fill(&mut bytes);
    let source = Buffer::new(&fabrics[0], bytes);
    let target = Buffer::new(&fabrics[1], vec![0; 4 << 20]);
    let remote = target.region().remote();
    let mut expected = vec![0u8; 4 << 20];
    let mut at = 0usize;
    let mut next = 0u32;
    for burst in 0..40 {
        // (immediate, a message's payload or a write's length)
        let mut posts: Vec<(u32, Result<Vec<u8>, usize>)> = Vec::new();
        {
            let _outer = fabrics[0].batch();
            for k in 0..2 + burst % 7 {
                let _inner = (k % 3 == 0).then(|| fabrics[0].batch());
                let i = next;
                next += 1;
                if rng.below(3) == 0 {
                    let mut payload = vec![0u8; rng.below(65) as usize];
                    rng.fill(&mut payload);
                    fabrics[0]
                        .send_message(1, i, &payload, u64::from(i))
                        .unwrap();
                    posts.push((i, Ok(payload)));
                    continue;
                }
                let len = LENS[rng.below(LENS.len() as u64) as usize];
                let from = rng.below((source.read().len() - len) as u64) as usize;
                let request = WriteRequest {
                    source: source.region(),
                    source_offset: from,
                    len,
                    target: remote,
                    target_offset: at as u64,
                    immediate: i,
                    token: u64::from(i),
                };
                fabrics[0].write(1, request).unwrap();
                expected[at..at + len].copy_from_slice(&source.read()[from..from + len]);
                posts.push((i, Err(len)));
                at += len;
            }
        }
        // The whole burst arrives once the batch has ended, with no later post
        // to push it out.
        let mut got = 0;
        drain_until(&fabrics[1], Duration::from_secs(20), |c| {
            let (i, post) = &posts[got];
            match (&c.event, post) {
                (CompletionEvent::Message(m), Ok(p)) => {
                    assert_eq!((m.immediate, m.payload()), (*i, p.as_slice()));
                }
                (CompletionEvent::Landed { immediate, len }, Err(l)) => {
                    assert_eq!((*immediate, *len), (*i, *l as u64));
                }
                (other, _) => panic!("burst {burst}: {other:?}, expected post {i}"),
            }
            got += 1;
            got == posts.len()
        });
    }
    let mut sent = 0u64;
    drain_until(&fabrics[0], Duration::from_secs(30), |c| {
        assert_eq!(c.event, CompletionEvent::Sent { token: sent });
        sent += 1;
        sent == u64::from(next)
    });
    assert!(target.read() == expected.as_slice(), "the target differs");
}

/// A post with a bad argument fails with an error naming it, and posts nothing.
#[test]
fn bad_posts_are_refused_without_side_effects() {
    let fabrics = mesh(3, |c| c);
    let source = Buffer::new(&fabrics[0], vec![1; 1000]);
    let target = Buffer::new(&fabrics[1], vec![0; 500]);
    let remote = target.region().remote();
    let request = |source_offset, len, target_offset| WriteRequest {
        source: source.region(),
        source_offset,
        len,
        target: remote,
        target_offset,
        immediate: 0,
        token: 0,
    };
    let error = |r: Result<(), FabricError>| r.unwrap_err().to_string();

    let e = error(fabrics[0].write(1, request(990, 20, 0)));
    assert!(e.contains("source range of 20 bytes at offset 990"), "{e}");
    let e = error(fabrics[0].write(1, request(0, 100, 450)));
    assert!(e.contains("target range of 100 bytes at offset 450"), "{e}");
    let e = error(fabrics[0].write(1, request(usize::MAX, 2, 0)));
    assert!(e.contains("source range"), "{e}");
    let e = error(fabrics[0].write(1, request(0, 1, u64::MAX)));
    assert!(e.contains("target range"), "{e}");
    let e = error(fabrics[0].write(0, request(0, 1, 0)));
    assert!(e.contains("this rank"), "{e}");
    let e = error(fabrics[0].write(3, request(0, 1, 0)));
    assert!(e.contains("outside the job"), "{e}");
    let e = error(fabrics[0].send_message(1, 0, &[0; 65], 0));
    assert!(e.contains("`payload`"), "{e}");

    // Nothing was sent: a valid write now is the first thing rank 1 sees.
    fabrics[0].write(1, request(0, 500, 0)).unwrap();
    drain_until(&fabrics[1], Duration::from_secs(10), |c| {
        assert!(
            matches!(
                c.event,
                CompletionEvent::Landed {
                    len: 500,
                    immediate: 0
                }
            ),
            "{c:?}"
        );
        true
    });
    assert!(target.read().iter().all(|&b| b == 1));
}

/// Memory registered to send from only: writes from it land, and it names no
/// region a peer can write into (its key is refused, as a key never handed
/// out is).
#[test]
fn a_source_region_sends_and_cannot_be_written() {
    let fabrics = mesh(2, |c| c);
    assert!(fabrics[0].registers_sources());
    let mut bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
    let original = bytes.clone();
    let ptr = std::ptr::NonNull::new(bytes.as_mut_ptr()).unwrap();
    // SAFETY: `bytes` outlives the region and is not written while registered.
    let source = unsafe { fabrics[0].register_source(ptr, bytes.len()) }.unwrap();
    let target = Buffer::new(&fabrics[1], vec![0; 4096]);
    fabrics[0]
        .write(
            1,
            WriteRequest {
                source: &source,
                source_offset: 100,
                len: 3000,
                target: target.region().remote(),
                target_offset: 7,
                immediate: 5,
                token: 9,
            },
        )
        .unwrap();
    drain_until(&fabrics[1], Duration::from_secs(10), |c| {
        assert!(
            matches!(
                c.event,
                CompletionEvent::Landed {
                    len: 3000,
                    immediate: 5
                }
            ),
            "{c:?}"
        );
        true
    });
    drain_until(&fabrics[0], Duration::from_secs(10), |c| {
        assert!(
            matches!(c.event, CompletionEvent::Sent { token: 9 }),
            "{c:?}"
        );
        true
    });
    assert_eq!(&target.read()[7..3007], &bytes[100..3100]);
    assert!(target.read()[..7].iter().all(|&b| b == 0));
    // Rank 1 aims at the source region's own descriptor: refused at rank 0,
    // which drops rank 1 rather than write a byte.
    let aimed = source.remote();
    let back = Buffer::new(&fabrics[1], vec![0xab; 64]);
    fabrics[1]
        .write(
            0,
            WriteRequest {
                source: back.region(),
                source_offset: 0,
                len: 64,
                target: aimed,
                target_offset: 0,
                immediate: 0,
                token: 1,
            },
        )
        .unwrap();
    drain_until(&fabrics[0], Duration::from_secs(10), |c| match c.event {
        CompletionEvent::PeerFailed { failure } => {
            assert_eq!(
                failure,
                PeerFailure::Protocol(ProtocolViolation::UnknownRegion { region: aimed.key })
            );
            true
        }
        _ => false,
    });
    drop(source);
    assert_eq!(bytes, original, "a byte of the source region was written");
}

/// A window lands writes only while open: opened, written, closed and
/// opened again it lands each time; a write while it is closed is refused at
/// the receiver, which drops the writer rather than write a byte.
#[test]
fn a_window_lands_writes_only_while_open() {
    let fabrics = mesh(2, |c| c);
    assert!(fabrics[1].registers_windows());
    let mut bytes = vec![0u8; 4096];
    let ptr = std::ptr::NonNull::new(bytes.as_mut_ptr()).unwrap();
    let window = fabrics[1].register_window(ptr, bytes.len()).unwrap();
    let source = Buffer::new(&fabrics[0], (0..4096u32).map(|i| (i % 253) as u8).collect());
    let write = |fill: usize, token: u64| {
        fabrics[0]
            .write(
                1,
                WriteRequest {
                    source: source.region(),
                    source_offset: fill,
                    len: 1000,
                    target: window.remote(),
                    target_offset: fill as u64,
                    immediate: 3,
                    token,
                },
            )
            .unwrap();
    };
    for (round, at) in [(1, 0usize), (2, 2000)] {
        // SAFETY: `bytes` outlives the window and is read below only after
        // the write into it has landed and the window is closed.
        unsafe { fabrics[1].open_window(&window) }.unwrap();
        write(at, round);
        drain_until(&fabrics[1], Duration::from_secs(10), |c| {
            assert!(
                matches!(
                    c.event,
                    CompletionEvent::Landed {
                        len: 1000,
                        immediate: 3
                    }
                ),
                "{c:?}"
            );
            true
        });
        fabrics[1].close_window(&window);
        // Closing twice is harmless.
        fabrics[1].close_window(&window);
        drain_until(&fabrics[0], Duration::from_secs(10), |c| {
            assert!(
                matches!(c.event, CompletionEvent::Sent { token } if token == round),
                "{c:?}"
            );
            true
        });
    }
    let want = source.read();
    assert_eq!(&bytes[..1000], &want[..1000]);
    assert_eq!(&bytes[2000..3000], &want[2000..3000]);
    assert!(
        bytes[1000..2000]
            .iter()
            .chain(&bytes[3000..])
            .all(|&b| b == 0)
    );
    // Closed: a write is refused and lands nothing.
    write(1000, 3);
    drain_until(&fabrics[1], Duration::from_secs(10), |c| match c.event {
        CompletionEvent::PeerFailed { failure } => {
            assert_eq!(
                failure,
                PeerFailure::Protocol(ProtocolViolation::UnknownRegion {
                    region: window.remote().key
                })
            );
            true
        }
        _ => false,
    });
    drop(window);
    assert!(
        bytes[1000..2000].iter().all(|&b| b == 0),
        "a closed window was written"
    );
}

/// Not yet connected, and connected to nobody: clear errors, no hang.
#[test]
fn unconnected_peers_are_named() {
    let fabric = TcpFabric::new(common::config(0, 2)).unwrap();
    let e = fabric.send_message(1, 0, b"", 0).unwrap_err().to_string();
    assert_eq!(e, "rank 1 is not connected");
    let mut config = common::config(1, 2);
    config.connect_timeout = Duration::from_millis(300);
    let lonely = TcpFabric::new(config).unwrap();
    // Rank 1 dials rank 0 at an address where nothing listens.
    let nowhere = {
        let probe = TcpFabric::new(common::config(0, 2)).unwrap();
        probe.endpoint(1).unwrap()
    };
    let e = lonely.connect(0, &nowhere).unwrap_err().to_string();
    assert!(e.contains("timed out") && e.contains("rank 0"), "{e}");
}

/// A fabric of 65 ranks where rank 0 talks to 64 peers, all served by its one
/// I/O thread: every peer's write lands in its own slot, and rank 0's write to
/// every peer lands there.
#[test]
fn sixty_four_peers() {
    const PEERS: u32 = 64;
    const PIECE: usize = 64 << 10;
    let hub = TcpFabric::new(common::config(0, PEERS + 1)).unwrap();
    let spokes: Vec<TcpFabric> = (1..=PEERS)
        .map(|r| TcpFabric::new(common::config(r, PEERS + 1)).unwrap())
        .collect();
    std::thread::scope(|s| {
        for spoke in &spokes {
            let endpoint = hub.endpoint(spoke.rank()).unwrap();
            s.spawn(move || spoke.connect(0, &endpoint).unwrap());
        }
        for spoke in &spokes {
            hub.connect(spoke.rank(), &spoke.endpoint(0).unwrap())
                .unwrap();
        }
    });
    let hub_target = Buffer::new(&hub, vec![0; PIECE * PEERS as usize]);
    let mut hub_bytes = vec![0; PIECE];
    Rng(99).fill(&mut hub_bytes);
    let hub_source = Buffer::new(&hub, hub_bytes);
    let spoke_buffers: Vec<(Buffer, Buffer)> = spokes
        .iter()
        .map(|s| {
            let mut bytes = vec![0; PIECE];
            Rng(u64::from(s.rank())).fill(&mut bytes);
            (Buffer::new(s, bytes), Buffer::new(s, vec![0; PIECE]))
        })
        .collect();
    for (spoke, (source, target)) in spokes.iter().zip(&spoke_buffers) {
        let slot = (spoke.rank() - 1) as u64 * PIECE as u64;
        let to_hub = WriteRequest {
            source: source.region(),
            source_offset: 0,
            len: PIECE,
            target: hub_target.region().remote(),
            target_offset: slot,
            immediate: spoke.rank(),
            token: 0,
        };
        spoke.write(0, to_hub).unwrap();
        let to_spoke = WriteRequest {
            source: hub_source.region(),
            source_offset: 0,
            len: PIECE,
            target: target.region().remote(),
            target_offset: 0,
            immediate: 0,
            token: u64::from(spoke.rank()),
        };
        hub.write(spoke.rank(), to_spoke).unwrap();
    }
    let (mut landed, mut sent) = (0, 0);
    drain_until(&hub, Duration::from_secs(60), |c| {
        match c.event {
            CompletionEvent::Landed { immediate, .. } => {
                assert_eq!(immediate, c.peer);
                landed += 1;
            }
            CompletionEvent::Sent { token } => {
                assert_eq!(token, u64::from(c.peer));
                sent += 1;
            }
            other => panic!("{other:?}"),
        }
        landed == PEERS && sent == PEERS
    });
    for (spoke, (source, target)) in spokes.iter().zip(&spoke_buffers) {
        drain_until(spoke, Duration::from_secs(30), |c| {
            matches!(c.event, CompletionEvent::Landed { .. })
        });
        let slot = (spoke.rank() - 1) as usize * PIECE;
        assert!(hub_target.read()[slot..slot + PIECE] == *source.read());
        assert!(target.read() == hub_source.read());
    }
}

/// A completion notifier runs once per queued completion, so a consumer can sleep
/// on a wake-up of its own; a second notifier is refused.
#[test]
fn the_notifier_announces_every_completion() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    let fabrics = mesh(2, |c| c);
    let announced = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&announced);
    assert!(fabrics[1].notify_completions(Arc::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    })));
    assert!(
        !fabrics[1].notify_completions(Arc::new(|| {})),
        "a second notifier was taken"
    );
    for i in 0..50u32 {
        fabrics[0]
            .send_message(1, i, &[1, 2, 3], u64::from(i))
            .unwrap();
    }
    let mut seen = 0u32;
    drain_until(&fabrics[1], Duration::from_secs(30), |c| {
        assert!(matches!(c.event, CompletionEvent::Message(_)));
        seen += 1;
        seen == 50
    });
    // The last notification may run just after its completion was polled.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while announced.load(Ordering::SeqCst) < 50 && std::time::Instant::now() < deadline {
        std::thread::yield_now();
    }
    assert_eq!(announced.load(Ordering::SeqCst), 50);
}
