//! A hostile network between ranks: every tcp connection of a job goes through a
//! proxy ([`common::fault_proxy`]), and once the job is working, the proxy
//! between two ranks on different machines blackholes one direction, closes or
//! resets the connection (mid-frame), delays, throttles, or reads slowly.
//!
//! On 2x1 and 2x2, for all-reduces and for messages (each rank exchanging with
//! the rank of its place on the other machine):
//!
//! - a fault that loses data or the connection fails every rank that depends on
//!   the link within its timeout (and a little), each naming a peer; a rank
//!   never sees a wrong result, and no rank's tensor changes after its call has
//!   failed;
//! - a fault that only slows the link lets the job finish, exact.
//!
//! Ranks are threads of this process, each with its own communicator, meeting
//! through the proxying store.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use common::fault_proxy::{Direction, Fault, ProxiedStore};
use fairring::{Communicator, Config, ReduceOp};

/// `FAIRRING_TIMEOUT` of a job whose network loses data: the failure it must
/// report within about twice this.
const TIMEOUT: Duration = Duration::from_secs(2);
/// `FAIRRING_TIMEOUT` of a job whose network only slows: long enough that
/// joining and the slowed transfers never reach it on two loaded cores (this
/// binary runs its tests' jobs at once), so that any failure is the fault's.
const SLOWED_TIMEOUT: Duration = Duration::from_secs(20);
/// Beyond twice the timeout, how late a rank of a job whose network loses
/// data may fail: the scheduling of this binary's concurrent jobs on two
/// cores (a rank once failed 4.50 s after the fault with 2 s timeouts). A rank
/// that waited out a third timeout would still be late.
const FAILURE_SLACK: Duration = Duration::from_millis(1500);
/// Elements per tensor: 4 MiB of `f32`, so that a fault can fall inside a
/// frame of a large write.
const ELEMENTS: usize = 1 << 20;
/// Bytes through the proxy, once armed, before the fault strikes: not a
/// multiple of any frame.
const STRIKE_AFTER: u64 = 1_000_003;
/// How long a rank watches its tensor after its call failed.
const WATCH: Duration = Duration::from_millis(1500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workload {
    AllReduce,
    /// Each rank exchanges a tensor with its partner on the other machine.
    Messages,
}

/// How a rank's part ended.
#[derive(Debug)]
enum Outcome {
    /// Every iteration completed, exact.
    Finished,
    /// A call failed with this error at `at`, and the tensor was quiet
    /// afterwards (or not).
    Failed {
        error: String,
        at: Instant,
        written_after: bool,
    },
    /// A call completed with a wrong element (reported through `Debug`).
    Wrong {
        #[expect(dead_code, reason = "read through Debug in the failure message")]
        iteration: u32,
        #[expect(dead_code, reason = "read through Debug in the failure message")]
        index: usize,
    },
}

/// The value rank `rank` puts at `index` in iteration `i` (small integers: every
/// sum is exact in `f32`).
fn value(rank: u32, i: u32, index: usize) -> f32 {
    let small = u32::try_from(index % 13).expect("below 13");
    #[expect(clippy::cast_precision_loss, reason = "small integers")]
    let v = ((rank + 1) * 7 + i % 5 + small) as f32;
    v
}

/// A rank's part: `iterations` calls of `workload`, reporting the first
/// completed one on `working`.
fn rank_part(
    rank: u32,
    world: u32,
    devices: u32,
    comm: &Communicator,
    workload: Workload,
    iterations: u32,
    working: &AtomicU32,
) -> Outcome {
    let mut data = vec![0f32; ELEMENTS];
    let mut inbox = vec![0f32; ELEMENTS];
    // The rank of the same place on the other machine (two machines).
    let partner = (rank + devices) % world;
    for i in 0..iterations {
        for (j, x) in data.iter_mut().enumerate() {
            *x = value(rank, i, j);
        }
        let result = match workload {
            Workload::AllReduce => comm.all_reduce(&mut data, ReduceOp::Sum),
            Workload::Messages => comm.send_recv(
                &mut [(partner, &mut data[..])],
                &mut [(partner, &mut inbox[..])],
            ),
        };
        if let Err(e) = result {
            let at = Instant::now();
            let target: &[f32] = match workload {
                Workload::AllReduce => &data,
                Workload::Messages => &inbox,
            };
            let before = target.to_vec();
            std::thread::sleep(WATCH);
            let written_after = target != before.as_slice();
            return Outcome::Failed {
                error: e.to_string(),
                at,
                written_after,
            };
        }
        let wrong = match workload {
            Workload::AllReduce => data
                .iter()
                .enumerate()
                .position(|(j, &x)| x != (0..world).map(|r| value(r, i, j)).sum::<f32>()),
            Workload::Messages => inbox
                .iter()
                .enumerate()
                .position(|(j, &x)| x != value(partner, i, j)),
        };
        if let Some(index) = wrong {
            return Outcome::Wrong {
                iteration: i,
                index,
            };
        }
        working.fetch_add(1, Ordering::SeqCst);
    }
    Outcome::Finished
}

/// Runs an `m x d` job of `workload` through proxies, arms `fault` on the link
/// between rank 0 and rank `d` (rank 0's place on the other machine) once every
/// rank has completed a call, and returns each rank's outcome and when the
/// fault was armed.
fn run(m: u32, d: u32, workload: Workload, fault: Fault) -> (Vec<Outcome>, Instant) {
    assert_eq!(m, 2, "two machines: one link between places");
    let world = m * d;
    // Enough iterations that a slowed job runs past the arming, few enough
    // that a throttled one ends in seconds.
    let iterations = if fault.loses() { 10_000 } else { 6 };
    let store = ProxiedStore::new();
    let working = Arc::new(AtomicU32::new(0));
    let (tx, rx) = channel();
    let port = common::free_port();
    let run_id = format!("network-faults-{port}");
    let timeout = if fault.loses() {
        TIMEOUT
    } else {
        SLOWED_TIMEOUT
    };
    for rank in 0..world {
        let (store, working, tx, run_id) = (
            Arc::clone(&store),
            Arc::clone(&working),
            tx.clone(),
            run_id.clone(),
        );
        std::thread::spawn(move || {
            let config = Config::builder(rank, world, "127.0.0.1", port)
                .host_id(format!("machine-{}", rank / d))
                .run_id(run_id)
                .timeout(timeout)
                .build()
                .expect("a config");
            let comm = Communicator::with_store(config, store)
                .unwrap_or_else(|e| panic!("rank {rank} joining: {e}"));
            let outcome = rank_part(rank, world, d, &comm, workload, iterations, &working);
            let _ = tx.send((rank, outcome));
            // The communicator drops here, on the rank's own thread.
        });
    }
    drop(tx);
    // Armed once every rank has completed a call.
    let deadline = Instant::now() + Duration::from_secs(60);
    while working.load(Ordering::SeqCst) < world {
        assert!(
            Instant::now() < deadline,
            "{workload:?}: the job never got working"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let proxy = store.proxy(0, d, Duration::from_secs(10));
    assert!(
        proxy.accepted() >= 1,
        "the ranks' connection goes through the proxy"
    );
    proxy.arm(fault, STRIKE_AFTER);
    let armed = Instant::now();
    let mut outcomes: Vec<Option<Outcome>> = (0..world).map(|_| None).collect();
    // A losing fault: within the timeout twice over, the watch and some slack;
    // a slowing one: as long as the throttled transfers take.
    let within = if fault.loses() {
        2 * TIMEOUT + WATCH + Duration::from_secs(5)
    } else {
        Duration::from_secs(120)
    };
    for _ in 0..world {
        let left = (armed + within).saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, outcome)) => outcomes[rank as usize] = Some(outcome),
            Err(_) => panic!(
                "{workload:?} under {fault:?} on {m}x{d}: ranks {:?} still running {within:?} \
                 after the fault was armed",
                (0..world)
                    .filter(|&r| outcomes[r as usize].is_none())
                    .collect::<Vec<_>>()
            ),
        }
    }
    (outcomes.into_iter().map(Option::unwrap).collect(), armed)
}

/// Every rank fails within its timeout (counted from the arming, with the
/// fault's own delay in it), naming a peer, without a wrong result and without
/// a write after its failure.
fn expect_failure(m: u32, d: u32, workload: Workload, fault: Fault) {
    let (outcomes, armed) = run(m, d, workload, fault);
    let world = m * d;
    for (rank, outcome) in (0u32..).zip(&outcomes) {
        match outcome {
            Outcome::Failed {
                error,
                at,
                written_after,
            } => {
                let took = at.saturating_duration_since(armed);
                assert!(
                    took <= 2 * TIMEOUT + FAILURE_SLACK,
                    "{workload:?} under {fault:?} on {m}x{d}: rank {rank} failed {took:?} after \
                     the fault: {error}"
                );
                let names_a_peer = (0..world)
                    .filter(|&r| r != rank)
                    .any(|r| error.contains(&format!("rank {r}")));
                assert!(
                    names_a_peer,
                    "{workload:?} under {fault:?} on {m}x{d}: rank {rank}'s error names no \
                     peer: {error}"
                );
                assert!(
                    !error.contains(&format!("rank {rank}: failed")),
                    "{workload:?} under {fault:?} on {m}x{d}: rank {rank} blames itself: {error}"
                );
                assert!(
                    !written_after,
                    "{workload:?} under {fault:?} on {m}x{d}: rank {rank}'s tensor changed \
                     after its call failed ({error})"
                );
            }
            other => panic!(
                "{workload:?} under {fault:?} on {m}x{d}: rank {rank} did not fail: {other:?}"
            ),
        }
    }
}

/// Every rank finishes, exact.
fn expect_success(m: u32, d: u32, workload: Workload, fault: Fault) {
    let (outcomes, _) = run(m, d, workload, fault);
    for (rank, outcome) in outcomes.iter().enumerate() {
        assert!(
            matches!(outcome, Outcome::Finished),
            "{workload:?} under {fault:?} on {m}x{d}: rank {rank}: {outcome:?}"
        );
    }
}

const LOSING: [Fault; 4] = [
    Fault::Blackhole(Direction::ToListener),
    Fault::Blackhole(Direction::ToDialer),
    Fault::Close,
    Fault::Reset,
];

const SLOWING: [Fault; 3] = [
    Fault::Delay(Duration::from_millis(20)),
    Fault::Throttle(20 << 20),
    Fault::SlowReader(Direction::ToListener, Duration::from_micros(200)),
];

#[test]
fn all_reduces_fail_cleanly_when_the_network_loses_data_2x1() {
    for fault in LOSING {
        expect_failure(2, 1, Workload::AllReduce, fault);
    }
}

#[test]
fn messages_fail_cleanly_when_the_network_loses_data_2x1() {
    for fault in LOSING {
        expect_failure(2, 1, Workload::Messages, fault);
    }
}

#[test]
fn all_reduces_fail_cleanly_when_the_network_loses_data_2x2() {
    for fault in LOSING {
        expect_failure(2, 2, Workload::AllReduce, fault);
    }
}

#[test]
fn all_reduces_and_messages_survive_a_slow_network() {
    for (m, d) in [(2, 1), (2, 2)] {
        for workload in [Workload::AllReduce, Workload::Messages] {
            for fault in SLOWING {
                expect_success(m, d, workload, fault);
            }
        }
    }
}

#[test]
fn messages_fail_cleanly_when_the_network_loses_data_2x2() {
    for fault in LOSING {
        expect_failure(2, 2, Workload::Messages, fault);
    }
}
