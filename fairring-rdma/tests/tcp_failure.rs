//! Failure on the tcp provider: peers that close, die or go silent become error
//! completions naming them, within their bounds; nothing hangs.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Buffer, config, drain_until, mesh};
use fairring_rdma::fabric::{CompletionEvent, Fabric, LocalRegion, PeerFailure};
use fairring_rdma::tcp::TcpFabric;

/// A peer process (rank 1) that dials `fabric` (rank 0), started and admitted.
fn spawn_peer(fabric: &TcpFabric, extra: &[&str]) -> Child {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fairring-fabric-peer"))
        .args([
            "--rank",
            "1",
            "--world",
            "2",
            "--job",
            &format!("{:x}", common::JOB),
        ])
        .args([
            "--dial",
            &fabric.local_address().to_string(),
            "--bind",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("FAIRRING_JOB_SECRET", common::secret().to_hex())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "admitted", "the peer process did not connect");
    child
}

fn signal(child: &Child, signal: i32) {
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: `kill` has no memory-safety preconditions; the pid is our child's,
    // which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
}

/// Waits for rank 1's `PeerFailed`; returns its failure and how long it took.
fn await_failure(fabric: &TcpFabric, since: Instant, timeout: Duration) -> (PeerFailure, Duration) {
    let mut found = None;
    drain_until(fabric, timeout, |c| {
        if let CompletionEvent::PeerFailed { failure } = c.event {
            assert_eq!(c.peer, 1, "the failure names the wrong peer");
            found = Some((failure, since.elapsed()));
            return true;
        }
        false
    });
    found.unwrap()
}

#[test]
fn peer_killed_mid_transfer_fails_at_once() {
    let zero = TcpFabric::new(config(0, 2)).unwrap();
    let target = Buffer::new(&zero, vec![0; 64 << 20]);
    let remote = target.region().remote();
    let mut child = spawn_peer(
        &zero,
        &[
            "--stream",
            &(16usize << 20).to_string(),
            "--target",
            &format!("{}:{}", remote.key, remote.len),
        ],
    );
    // Let some writes land, so the kill falls in the middle of the stream.
    let mut landed = 0;
    drain_until(&zero, Duration::from_secs(30), |c| {
        if let CompletionEvent::Landed { len, .. } = c.event {
            assert_eq!(len, 16 << 20);
            landed += 1;
        }
        landed == 3
    });
    let killed = Instant::now();
    child.kill().unwrap(); // SIGKILL
    let (failure, took) = await_failure(&zero, killed, Duration::from_secs(10));
    child.wait().unwrap();
    assert!(
        matches!(
            failure,
            PeerFailure::Closed
                | PeerFailure::ClosedMidFrame
                | PeerFailure::Io(std::io::ErrorKind::ConnectionReset)
        ),
        "{failure:?}"
    );
    // A closed socket is noticed at once, nowhere near the 30 s silence bound.
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let e = zero.send_message(1, 0, b"", 0).unwrap_err().to_string();
    assert!(e.starts_with("rank 1 failed"), "{e}");
    eprintln!("SIGKILL noticed after {took:?} ({failure})");
}

#[test]
fn peer_stopped_fails_after_the_silence_bound() {
    let silence = Duration::from_millis(1500);
    let zero = TcpFabric::new(config(0, 2).with_silence_timeout(silence)).unwrap();
    // Both sides use the same bound, so each sends keep-alives every tenth of it.
    let child = spawn_peer(&zero, &["--idle", "--silence-ms", "1500"]);
    // Alive and idle: keep-alives hold the connection past the bound.
    std::thread::sleep(silence * 2);
    assert!(zero.is_connected(1), "an idle live peer was failed");
    let stopped = Instant::now();
    signal(&child, libc::SIGSTOP);
    // Messages posted to the stopped peer are sent or fail, never hang.
    let mut tokens_posted = 0u64;
    while zero.send_message(1, 0, &[0; 64], tokens_posted).is_ok() && tokens_posted < 100 {
        tokens_posted += 1;
    }
    let (failure, took) = await_failure(&zero, stopped, silence * 4);
    assert_eq!(failure, PeerFailure::Silent { after_ms: 1500 });
    // Silence counts from the last keep-alive, at most a tenth of the bound
    // before the stop.
    assert!(
        took >= silence - silence / 10 - Duration::from_millis(50),
        "took {took:?}"
    );
    assert!(took < silence * 3, "took {took:?}");
    // Resumed, the stale peer finds itself cut off and exits naming rank 0.
    signal(&child, libc::SIGCONT);
    let output = child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("rank 0 failed"), "{stderr}");
    eprintln!("SIGSTOP noticed after {took:?} with a {silence:?} bound");
}

#[test]
fn dropped_fabric_is_noticed_at_once_and_fails_what_was_queued() {
    let mut fabrics = mesh(2, |c| c);
    let one = fabrics.pop().unwrap();
    let zero = fabrics.pop().unwrap();
    let source = Buffer::new(&zero, vec![0; 1 << 20]);
    let target = Buffer::new(&one, vec![0; 1 << 20]);
    let remote = target.region().remote();
    drop(target);
    let dropped = Instant::now();
    drop(one);
    // Writes posted now either leave before the close is seen, or fail.
    let (mut sent, mut failed, mut refused) = (0, 0, 0);
    for token in 0..50 {
        let request = fairring_rdma::WriteRequest {
            source: source.region(),
            source_offset: 0,
            len: 1 << 20,
            target: remote,
            target_offset: 0,
            immediate: 0,
            token,
        };
        if zero.write(1, request).is_err() {
            refused += 1;
        }
    }
    let mut peer_failed = false;
    drain_until(&zero, Duration::from_secs(10), |c| {
        match c.event {
            CompletionEvent::Sent { .. } => sent += 1,
            CompletionEvent::SendFailed { .. } => failed += 1,
            CompletionEvent::PeerFailed { failure } => {
                assert!(
                    matches!(failure, PeerFailure::Closed | PeerFailure::Io(_)),
                    "{failure:?}"
                );
                peer_failed = true;
            }
            other => panic!("{other:?}"),
        }
        peer_failed && sent + failed + refused == 50
    });
    assert!(dropped.elapsed() < Duration::from_secs(5));
    assert!(failed + refused > 0, "every write 'sent' to a closed peer");
}

/// Sets its flag when dropped.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A fabric dropped while its peer still sends to it (bytes it will never read,
/// so its sockets close with a reset) first lets the peer's kernel take what it
/// wrote: the peer gets the whole write, then the failure. A reset while the
/// write's end still waited to be sent would throw that end away.
#[test]
fn a_dropped_fabric_delivers_what_it_wrote_before_its_reset() {
    const LEN: usize = 32 << 20;
    for round in 0..5 {
        let mut fabrics = mesh(2, |c| c);
        let one = fabrics.pop().unwrap();
        let zero = fabrics.pop().unwrap();
        let mut bytes = vec![0; LEN];
        common::Rng(round).fill(&mut bytes);
        let source = Buffer::new(&zero, bytes.clone());
        let target = Buffer::new(&one, vec![0; LEN]);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            // Rank 1 keeps talking to rank 0, which stops reading once dropped.
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let _ = one.send_message(0, 7, b"chatter", 0);
                    std::thread::sleep(Duration::from_micros(20));
                }
            });
            // Ends the chatter however this closure ends, a panic included.
            let _stop = StopOnDrop(&stop);
            let request = fairring_rdma::WriteRequest {
                source: source.region(),
                source_offset: 0,
                len: LEN,
                target: target.region().remote(),
                target_offset: 0,
                immediate: 42,
                token: 1,
            };
            zero.write(1, request).unwrap();
            drain_until(&zero, Duration::from_secs(20), |c| {
                matches!(c.event, CompletionEvent::Sent { token: 1 })
            });
            drop(zero);
            drain_until(&one, Duration::from_secs(20), |c| match c.event {
                CompletionEvent::Landed { immediate: 42, len } => {
                    assert_eq!(len, LEN as u64);
                    true
                }
                CompletionEvent::PeerFailed { failure } => {
                    panic!("round {round}: rank 0's write failed to land: {failure:?}")
                }
                _ => false,
            });
        });
        drop(source);
        assert!(target.read() == &bytes[..], "round {round}: bytes differ");
    }
}
