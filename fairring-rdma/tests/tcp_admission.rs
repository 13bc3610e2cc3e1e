//! Admission on the tcp provider: every refusal, and that none of them disturbs
//! the peers already admitted.

#![expect(
    clippy::cast_possible_truncation,
    reason = "ranks, counts and offsets in tests are small"
)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::{Buffer, JOB, config, drain_until, mesh, secret};
use fairring_core::wire::{FrameHeader, FrameKind, RegionAddress, WireError};
use fairring_rdma::JobSecret;
use fairring_rdma::fabric::{
    CompletionEvent, Fabric, FabricError, LocalRegion, PeerFailure, ProtocolViolation, Refusal,
    WriteRequest,
};
use fairring_rdma::tcp::protocol::{Dialer, DialerStep, HandshakeParams, HelloReader};
use fairring_rdma::tcp::{RefusalRecord, TcpFabric};

fn params(rank: u32, world_size: u32) -> HandshakeParams {
    HandshakeParams {
        job_tag: JOB,
        epoch: 0,
        world_size,
        rank,
        secret: secret(),
    }
}

fn address(fabric: &TcpFabric) -> SocketAddr {
    fabric.local_address()
}

/// Waits until `fabric` has recorded a refusal, and returns the first.
fn first_refusal(fabric: &TcpFabric) -> RefusalRecord {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(r) = fabric.refusals().first() {
            return *r;
        }
        assert!(Instant::now() < deadline, "no refusal recorded");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads until the other side closes; returns the bytes read.
fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut all = Vec::new();
    let mut buf = [0; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return all,
            Ok(n) => all.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return all,
            Err(e) => panic!("the refused connection was not closed: {e}"),
        }
    }
}

/// Runs the dialer's side of the handshake by hand over a raw socket.
fn raw_handshake(
    to: SocketAddr,
    params: &HandshakeParams,
    target: u32,
) -> (TcpStream, Result<(), Refusal>) {
    let mut stream = TcpStream::connect(to).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (mut dialer, hello) = Dialer::start(params, target, [9; 32]);
    stream.write_all(hello.as_bytes()).unwrap();
    let mut reader = HelloReader::new();
    loop {
        let n = stream.read(reader.buffer()).unwrap();
        assert!(n > 0, "closed without a refusal");
        let Some((header, payload)) = reader.filled(n).unwrap() else {
            continue;
        };
        match dialer.on_frame(params, &header, payload) {
            Ok(DialerStep::Reply(frame)) => stream.write_all(frame.as_bytes()).unwrap(),
            Ok(DialerStep::Admitted) => return (stream, Ok(())),
            Err(failure) => return (stream, Err(failure.refusal)),
        }
    }
}

fn refusal_of(result: Result<(), FabricError>) -> (Refusal, bool) {
    match result {
        Err(FabricError::Refused {
            refusal, by_peer, ..
        }) => (refusal, by_peer),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn wrong_secret_is_refused_on_both_sides() {
    let zero = TcpFabric::new(config(0, 2)).unwrap();
    let mut other = config(1, 2);
    other.secret = JobSecret::from_bytes([0x5b; 32]);
    let one = TcpFabric::new(other).unwrap();
    // The dialer checks the acceptor's proof first, and refuses it.
    let (refusal, by_peer) = refusal_of(one.connect(0, &zero.endpoint(1).unwrap()));
    assert_eq!((refusal, by_peer), (Refusal::WrongSecret, false));
    let record = first_refusal(&zero);
    assert_eq!(
        (record.refusal, record.by_peer, record.claimed_rank),
        (Refusal::WrongSecret, true, Some(1))
    );
    assert!(!zero.is_connected(1));
}

#[test]
fn forged_proof_is_refused() {
    let zero = TcpFabric::new(config(0, 2)).unwrap();
    // An intruder that skips checking the acceptor's proof and answers with junk.
    let mut stream = TcpStream::connect(address(&zero)).unwrap();
    let params = params(1, 2);
    let (_dialer, hello) = Dialer::start(&params, 0, [1; 32]);
    stream.write_all(hello.as_bytes()).unwrap();
    let mut reply = [0u8; 48 + 65];
    stream.read_exact(&mut reply).unwrap();
    let mut forged = [3u8; 33];
    forged[1..].copy_from_slice(&reply[48 + 1..48 + 33]); // the acceptor's nonce, not a proof
    let header = FrameHeader::control(FrameKind::Hello, JOB, 1, 33);
    stream.write_all(&header.encode()).unwrap();
    stream.write_all(&forged).unwrap();
    read_to_close(&mut stream);
    let record = first_refusal(&zero);
    assert_eq!(
        (record.refusal, record.by_peer),
        (Refusal::WrongSecret, false)
    );
    assert!(!zero.is_connected(1));
}

#[test]
fn another_job_is_refused() {
    let zero = TcpFabric::new(config(0, 2)).unwrap();
    let mut other = config(1, 2);
    other.job_tag = JOB + 1;
    let one = TcpFabric::new(other).unwrap();
    let (refusal, by_peer) = refusal_of(one.connect(0, &zero.endpoint(1).unwrap()));
    assert_eq!(
        refusal,
        Refusal::WrongJob {
            expected: JOB,
            found: JOB + 1
        }
    );
    assert!(by_peer);
    assert_eq!(first_refusal(&zero).refusal, refusal);
}

#[test]
fn stale_epoch_is_refused() {
    let mut current = config(0, 2);
    current.epoch = 3;
    let zero = TcpFabric::new(current).unwrap();
    let mut stale = config(1, 2);
    stale.epoch = 2;
    let one = TcpFabric::new(stale).unwrap();
    let (refusal, by_peer) = refusal_of(one.connect(0, &zero.endpoint(1).unwrap()));
    assert_eq!(
        (refusal, by_peer),
        (
            Refusal::WrongEpoch {
                expected: 3,
                found: 2
            },
            true
        )
    );
    assert_eq!(first_refusal(&zero).refusal, refusal);
}

#[test]
fn other_world_size_is_refused() {
    let zero = TcpFabric::new(config(0, 2)).unwrap();
    let one = TcpFabric::new(config(1, 3)).unwrap();
    let (refusal, _) = refusal_of(one.connect(0, &zero.endpoint(1).unwrap()));
    assert_eq!(
        refusal,
        Refusal::WrongWorldSize {
            expected: 2,
            found: 3
        }
    );
}

#[test]
fn unknown_ranks_are_refused() {
    let zero = TcpFabric::new(config(1, 4)).unwrap();
    // A rank outside the job.
    let (_s, result) = raw_handshake(address(&zero), &params(9, 4), 1);
    assert_eq!(result, Err(Refusal::UnknownRank { rank: 9 }));
    // A lower rank, which never dials a higher one.
    let (_s, result) = raw_handshake(address(&zero), &params(0, 4), 1);
    assert_eq!(result, Err(Refusal::UnknownRank { rank: 0 }));
    // This process's own rank.
    let (_s, result) = raw_handshake(address(&zero), &params(1, 4), 1);
    assert_eq!(result, Err(Refusal::UnknownRank { rank: 1 }));
    // A dialer that wanted someone else.
    let (_s, result) = raw_handshake(address(&zero), &params(3, 4), 2);
    assert_eq!(
        result,
        Err(Refusal::WrongTarget {
            wanted: 2,
            actual: 1
        })
    );
    let refusals: Vec<Refusal> = zero.refusals().iter().map(|r| r.refusal).collect();
    assert_eq!(refusals.len(), 4, "{refusals:?}");
}

#[test]
fn duplicate_rank_is_refused_and_the_first_keeps_working() {
    let fabrics = mesh(2, |c| c);
    let impostor = TcpFabric::new(config(1, 2)).unwrap();
    let (refusal, by_peer) = refusal_of(impostor.connect(0, &fabrics[0].endpoint(1).unwrap()));
    assert_eq!(
        (refusal, by_peer),
        (Refusal::DuplicateRank { rank: 1 }, true)
    );
    // The admitted rank 1 is undisturbed.
    fabrics[1].send_message(0, 77, b"still here", 0).unwrap();
    drain_until(&fabrics[0], Duration::from_secs(10), |c| {
        assert!(
            matches!(c.event, CompletionEvent::Message(m) if m.immediate == 77),
            "{c:?}"
        );
        true
    });
}

#[test]
fn garbage_bytes_are_refused() {
    let zero = TcpFabric::new(config(0, 2)).unwrap();
    let mut stream = TcpStream::connect(address(&zero)).unwrap();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: fairring\r\nUser-Agent: curl/8.0\r\n\r\n")
        .unwrap();
    read_to_close(&mut stream);
    let record = first_refusal(&zero);
    assert!(
        matches!(record.refusal, Refusal::Garbage(WireError::BadMagic { .. })),
        "{record:?}"
    );
    assert_eq!(record.claimed_rank, None);
}

#[test]
fn oversized_length_fields_are_refused() {
    let zero = TcpFabric::new(config(0, 2)).unwrap();
    for (len, expect_garbage) in [(4096u32, false), (1 << 31, true)] {
        let mut stream = TcpStream::connect(address(&zero)).unwrap();
        let header = FrameHeader::control(FrameKind::Hello, JOB, 1, len);
        let mut bytes = header.encode();
        if expect_garbage {
            // Too long for any Hello frame: re-seal it so only the length is wrong.
            bytes[40..44].copy_from_slice(&len.to_le_bytes());
            let crc = fairring_core::wire::crc32c(&bytes[..44]);
            bytes[44..48].copy_from_slice(&crc.to_le_bytes());
        }
        stream.write_all(&bytes).unwrap();
        read_to_close(&mut stream);
    }
    let refusals: Vec<Refusal> = zero.refusals().iter().map(|r| r.refusal).collect();
    assert_eq!(refusals[0], Refusal::Malformed);
    assert!(
        matches!(
            refusals[1],
            Refusal::Garbage(WireError::PayloadTooLarge { .. })
        ),
        "{refusals:?}"
    );
}

#[test]
fn slow_handshake_hits_its_deadline() {
    let mut c = config(0, 2);
    c.handshake_timeout = Duration::from_millis(300);
    let zero = TcpFabric::new(c).unwrap();
    let started = Instant::now();
    let mut stream = TcpStream::connect(address(&zero)).unwrap();
    stream.write_all(b"FRNG").unwrap(); // a start, and then nothing
    read_to_close(&mut stream);
    let took = started.elapsed();
    assert_eq!(first_refusal(&zero).refusal, Refusal::Deadline);
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn unauthenticated_connections_are_capped() {
    let mut c = config(0, 2);
    c.max_pending_handshakes = 2;
    let zero = TcpFabric::new(c).unwrap();
    let _idle: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(address(&zero)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let mut third = TcpStream::connect(address(&zero)).unwrap();
    read_to_close(&mut third);
    assert_eq!(first_refusal(&zero).refusal, Refusal::TooManyPending);
}

/// An admitted peer that names a range outside a region, or a region that does
/// not exist, is dropped; the region is untouched.
#[test]
fn writes_outside_any_region_drop_the_liar() {
    for (lie, expected) in [
        (
            RegionAddress {
                region: 0,
                offset: 0,
                immediate: 0,
            },
            "unknown",
        ),
        (
            RegionAddress {
                region: 0,
                offset: 1000,
                immediate: 0,
            },
            "outside",
        ),
    ] {
        let zero = TcpFabric::new(config(0, 2)).unwrap();
        let target = Buffer::new(&zero, vec![0xee; 1024]);
        let key = target.region().remote().key;
        let (mut stream, admitted) = raw_handshake(address(&zero), &params(1, 2), 0);
        admitted.unwrap();
        let region = if expected == "unknown" { key + 1 } else { key };
        let header = FrameHeader::for_region(
            FrameKind::Write,
            JOB,
            1,
            RegionAddress { region, ..lie },
            4096,
        )
        .unwrap();
        stream.write_all(&header.encode()).unwrap();
        let _ = stream.write_all(&[0x11; 4096]);
        drain_until(&zero, Duration::from_secs(10), |c| match c.event {
            CompletionEvent::PeerFailed { failure } => {
                let violation = match failure {
                    PeerFailure::Protocol(v) => v,
                    other => panic!("{other:?}"),
                };
                match expected {
                    "unknown" => assert_eq!(violation, ProtocolViolation::UnknownRegion { region }),
                    _ => assert_eq!(
                        violation,
                        ProtocolViolation::OutsideRegion {
                            region,
                            offset: 1000,
                            len: 4096,
                            region_len: 1024
                        }
                    ),
                }
                true
            }
            _ => false,
        });
        assert!(
            target.read().iter().all(|&b| b == 0xee),
            "a byte was written"
        );
        let e = zero.send_message(1, 0, b"", 0).unwrap_err().to_string();
        assert!(e.contains("rank 1 failed: protocol violation"), "{e}");
    }
}

/// Every kind of intruder at once, while two admitted ranks stream writes: the
/// stream completes byte-exact and nobody admitted fails.
#[test]
fn intruders_do_not_disturb_admitted_traffic() {
    let fabrics = mesh(2, |c| c);
    let mut bytes = vec![0; 1 << 20];
    common::Rng(5).fill(&mut bytes);
    let source = Buffer::new(&fabrics[1], bytes);
    let target = Buffer::new(&fabrics[0], vec![0; 1 << 20]);
    let remote = target.region().remote();
    let to = address(&fabrics[0]);
    std::thread::scope(|s| {
        s.spawn(|| {
            for round in 0..20u32 {
                let mut garbage = TcpStream::connect(to).unwrap();
                let _ = garbage.write_all(&[round as u8; 100]);
                let _idle = TcpStream::connect(to).unwrap();
                let mut wrong = params(1, 2);
                wrong.secret = JobSecret::from_bytes([round as u8; 32]);
                let _ = raw_handshake(to, &wrong, 0);
                let mut stale = params(1, 2);
                stale.epoch = 9;
                let _ = raw_handshake(to, &stale, 0);
                let _ = raw_handshake(to, &params(1, 2), 0); // a duplicate of rank 1
            }
        });
        for i in 0..200u32 {
            let len = if i == 199 {
                1 << 20
            } else {
                4096 * (1 + i as usize % 256)
            };
            let request = WriteRequest {
                source: source.region(),
                source_offset: 0,
                len,
                target: remote,
                target_offset: 0,
                immediate: i,
                token: u64::from(i),
            };
            while let Err(e) = fabrics[1].write(0, request) {
                assert!(matches!(e, FabricError::QueueFull { .. }), "{e}");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let mut next = 0;
        drain_until(&fabrics[0], Duration::from_secs(60), |c| {
            match c.event {
                CompletionEvent::Landed { immediate, .. } => assert_eq!(immediate, next),
                other => panic!("admitted traffic disturbed: {other:?}"),
            }
            next += 1;
            next == 200
        });
    });
    assert!(target.read() == source.read());
    assert!(fabrics[0].is_connected(1) && fabrics[1].is_connected(0));
    // Every intruder was refused: garbage, wrong secret, stale epoch and duplicate
    // rank, 20 of each (and the idle ones too, if the run outlasts their deadline).
    // Some refusals are recorded after the intruder has gone, so wait for them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while fabrics[0].refusals().len() < 80 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        fabrics[0].refusals().len() >= 80,
        "{:?}",
        fabrics[0].refusals()
    );
}
