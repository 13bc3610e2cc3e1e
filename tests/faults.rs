//! Faults in multi-process jobs: every rank is a `fairring-rank` process, killed,
//! stopped, aborted or never started; each survivor must fail cleanly, naming the
//! peer, within twice `FAIRRING_TIMEOUT`, and refuse work afterwards.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use common::free_port;

/// `FAIRRING_TIMEOUT` of every job here.
const TIMEOUT: Duration = Duration::from_secs(2);

/// A job of `fairring-rank` processes, killed when dropped.
struct Job {
    children: Vec<Option<Child>>,
    lines: Receiver<(u32, String, Instant)>,
    /// Lines already read, per rank.
    seen: Vec<Vec<(String, Instant)>>,
}

impl Job {
    /// Starts ranks `ranks` of an `m x d` job running `args`, with `env` added.
    fn start(m: u32, d: u32, ranks: &[u32], args: &[&str], env: &[(&str, &str)]) -> Job {
        Job::with_servers(m, d, 0, ranks, args, env)
    }

    /// [`Job::start`] with `servers` dedicated servers too, `fairring-server`
    /// processes that are ranks `m * d..` here.
    fn with_servers(
        m: u32,
        d: u32,
        servers: u32,
        ranks: &[u32],
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Job {
        let port = free_port();
        let (tx, lines) = channel();
        let world = m * d;
        let mut children: Vec<Option<Child>> = (0..world + servers).map(|_| None).collect();
        let every = ranks.iter().copied().chain(world..world + servers);
        for rank in every {
            let mut cmd = if rank < world {
                let mut c = Command::new(env!("CARGO_BIN_EXE_fairring-rank"));
                c.args(args).env("RANK", rank.to_string());
                c
            } else {
                let mut c = Command::new(env!("CARGO_BIN_EXE_fairring-server"));
                c.env("FAIRRING_SERVER_RANK", (rank - world).to_string());
                c
            };
            cmd.env("FAIRRING_SERVERS", servers.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("TORCHELASTIC_RUN_ID", format!("faults-{port}"))
                .env("FAIRRING_HOST_ID", format!("machine-{}", rank / d))
                .env("FAIRRING_TIMEOUT", format!("{}ms", TIMEOUT.as_millis()))
                .env("FAIRRING_TOTAL_MEMORY", "8M")
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("start fairring-rank");
            let out = child.stdout.take().expect("piped stdout");
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send((rank, line, Instant::now()));
                }
            });
            children[rank as usize] = Some(child);
        }
        Job {
            children,
            lines,
            seen: vec![Vec::new(); (world + servers) as usize],
        }
    }

    /// Waits until every rank of `ranks` has printed a line starting with
    /// `prefix`; returns those lines and when they came, in `ranks` order.
    fn await_all(
        &mut self,
        ranks: &[u32],
        prefix: &str,
        within: Duration,
    ) -> Vec<(String, Instant)> {
        let deadline = Instant::now() + within;
        loop {
            let found: Vec<Option<(String, Instant)>> = ranks
                .iter()
                .map(|&r| {
                    self.seen[r as usize]
                        .iter()
                        .find(|(l, _)| l.starts_with(prefix))
                        .cloned()
                })
                .collect();
            if found.iter().all(Option::is_some) {
                return found.into_iter().flatten().collect();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((rank, line, at)) => self.seen[rank as usize].push((line, at)),
                Err(_) => panic!(
                    "no {prefix:?} from every rank of {ranks:?} within {within:?}; lines: {:?}",
                    self.seen
                ),
            }
        }
    }

    fn pid(&self, rank: u32) -> i32 {
        let child = self.children[rank as usize]
            .as_ref()
            .expect("a started rank");
        i32::try_from(child.id()).expect("pid")
    }

    fn signal(&self, rank: u32, signal: i32) {
        // SAFETY: sends a signal to a child process this job started and has not
        // reaped.
        let r = unsafe { libc::kill(self.pid(rank), signal) };
        assert_eq!(r, 0, "kill({rank}, {signal})");
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Kills or stops rank 1 of a 2x2 job, then of a 3x1 job (whose all-reduces
/// send from their tensors), then of a 4x1 job whose all-reduces go through
/// the trees (256 KiB slices, 256 KiB shards: rank 1 is an inner node below
/// the root of one tree), in the middle of their all-reduces of 4 MiB;
/// every other rank must fail within twice the timeout with an error naming
/// rank 1, then refuse more work.
fn survivors_name_the_lost_rank(signal: i32, what: &str) {
    survivors_name_the_lost_rank_of(2, 2, signal, what, &[]);
    survivors_name_the_lost_rank_of(3, 1, signal, what, &[]);
    let trees = [
        ("FAIRRING_SLICE_SIZE", "262144"),
        ("FAIRRING_MIN_SHARD_SIZE", "262144"),
    ];
    survivors_name_the_lost_rank_of(4, 1, signal, what, &trees);
}

fn survivors_name_the_lost_rank_of(m: u32, d: u32, signal: i32, what: &str, env: &[(&str, &str)]) {
    let ranks: Vec<u32> = (0..m * d).collect();
    let mut job = Job::start(m, d, &ranks, &["steady", "4194304", "60"], env);
    job.await_all(&ranks, "READY", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(100));
    let at = Instant::now();
    job.signal(1, signal);
    let what = format!("{what} on {m}x{d}");
    let survivors: Vec<u32> = ranks.iter().copied().filter(|&r| r != 1).collect();
    let failed = job.await_all(&survivors, "FAILED", 2 * TIMEOUT + Duration::from_secs(1));
    for (&rank, (line, when)) in survivors.iter().zip(&failed) {
        let took = when.duration_since(at);
        eprintln!("{what}: rank {rank} failed after {took:?}: {line}");
        assert!(took <= 2 * TIMEOUT, "{what}: rank {rank} took {took:?}");
        assert!(
            line.contains("rank 1"),
            "{what}: rank {rank} does not name rank 1: {line}"
        );
    }
    for (rank, (line, _)) in
        survivors
            .iter()
            .zip(job.await_all(&survivors, "REFUSED", Duration::from_secs(5)))
    {
        assert!(line.contains("failed earlier"), "rank {rank}: {line}");
    }
    if signal == libc::SIGSTOP {
        job.signal(1, libc::SIGKILL);
    }
}

#[test]
fn a_killed_rank_fails_every_other_rank_naming_it() {
    survivors_name_the_lost_rank(libc::SIGKILL, "SIGKILL");
}

/// Kills (or stops) rank 1 of a ring of messages (each rank sends 4 MiB to
/// the next and receives from the previous one),
/// between machines and within one: rank 0, which sends to it, and rank 2,
/// which receives from it, fail within twice the timeout naming rank 1, and
/// their next exchange is refused, naming a rank that is gone (rank 1, or a
/// peer that has failed and left meanwhile).
#[test]
fn a_killed_rank_fails_its_message_peers_naming_it() {
    message_peers_name_the_lost_rank(libc::SIGKILL);
}

#[test]
fn a_stopped_rank_fails_its_message_peers_naming_it() {
    message_peers_name_the_lost_rank(libc::SIGSTOP);
}

/// Gathers, scatters and reduces of 4 MiB move as messages (a reduce as a
/// chain, 2 -> 1 -> 0 on 3x1): a rank lost in the middle fails the others.
#[test]
fn a_killed_rank_fails_the_peers_of_its_gathers_scatters_and_chained_reduces() {
    message_peers_name_the_lost_rank_in(libc::SIGKILL, "rooted");
}

fn message_peers_name_the_lost_rank(signal: i32) {
    message_peers_name_the_lost_rank_in(signal, "messages");
}

fn message_peers_name_the_lost_rank_in(signal: i32, scenario: &str) {
    for (m, d) in [(3, 1), (1, 3)] {
        let mut job = Job::start(m, d, &[0, 1, 2], &[scenario, "4194304", "60"], &[]);
        job.await_all(&[0, 1, 2], "READY", Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(100));
        let at = Instant::now();
        job.signal(1, signal);
        let peers = [0, 2];
        let failed = job.await_all(&peers, "FAILED", 2 * TIMEOUT + Duration::from_secs(1));
        for (&rank, (line, when)) in peers.iter().zip(&failed) {
            let took = when.duration_since(at);
            eprintln!("{m}x{d} {scenario}: rank {rank} failed after {took:?}: {line}");
            assert!(took <= 2 * TIMEOUT, "{m}x{d}: rank {rank} took {took:?}");
            assert!(
                line.contains("rank 1"),
                "{m}x{d}: rank {rank} does not name rank 1: {line}"
            );
        }
        for (rank, (line, _)) in
            peers
                .iter()
                .zip(job.await_all(&peers, "REFUSED", Duration::from_secs(5)))
        {
            assert!(line.contains("rank "), "{m}x{d}: rank {rank}: {line}");
            // A failed collective fails the communicator, so the next one is
            // refused with that failure: it never reaches a survivor still in
            // the failed one, which would take it for a mismatch.
            if scenario == "rooted" {
                assert!(
                    line.contains("rank 1"),
                    "{m}x{d}: rank {rank} refuses without naming rank 1: {line}"
                );
            }
        }
        if signal == libc::SIGSTOP {
            job.signal(1, libc::SIGKILL);
        }
    }
}

#[test]
fn a_killed_server_fails_every_worker_naming_it() {
    let mut job = Job::with_servers(2, 2, 2, &[0, 1, 2, 3], &["steady", "4194304", "60"], &[]);
    let workers = [0, 1, 2, 3];
    job.await_all(&[4, 5], "SERVING", Duration::from_secs(30));
    job.await_all(&workers, "READY", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(100));
    let at = Instant::now();
    job.signal(4, libc::SIGKILL);
    let failed = job.await_all(&workers, "FAILED", 2 * TIMEOUT + Duration::from_secs(1));
    for (&rank, (line, when)) in workers.iter().zip(&failed) {
        let took = when.duration_since(at);
        eprintln!("server killed: rank {rank} failed after {took:?}: {line}");
        assert!(took <= 2 * TIMEOUT, "rank {rank} took {took:?}");
        assert!(
            line.contains("rank 4"),
            "rank {rank} does not name server 0 (rank 4): {line}"
        );
    }
    // The other server learns of it too, and exits with the job's error.
    let (line, _) = &job.await_all(&[5], "FAILED", 2 * TIMEOUT + Duration::from_secs(1))[0];
    assert!(line.contains("rank "), "server 1: {line}");
}

#[test]
fn a_job_with_servers_ends_cleanly() {
    let mut job = Job::with_servers(2, 1, 1, &[0, 1], &["repeat", "65536", "20"], &[]);
    job.await_all(&[0, 1], "DONE", Duration::from_secs(30));
    let exits: Vec<_> = job
        .children
        .iter_mut()
        .flatten()
        .map(|c| c.wait().expect("wait").code())
        .collect();
    assert_eq!(exits, vec![Some(0); 3], "workers then the server");
}

#[test]
fn a_stopped_rank_fails_every_other_rank_naming_it() {
    survivors_name_the_lost_rank(libc::SIGSTOP, "SIGSTOP");
}

#[test]
fn abort_unblocks_every_waiter_and_later_work_is_refused() {
    let mut job = Job::start(2, 2, &[0, 1, 2, 3], &["abort-late"], &[]);
    job.await_all(&[0, 1, 2, 3], "READY", Duration::from_secs(30));
    let waiters = [0, 2, 3];
    let failed = job.await_all(&waiters, "FAILED", Duration::from_secs(3));
    for (&rank, (line, _)) in waiters.iter().zip(&failed) {
        // "FAILED <ms> ...": the barrier began 300 ms before the abort.
        let ms: u64 = line
            .split(' ')
            .nth(1)
            .and_then(|t| t.parse().ok())
            .expect("ms");
        eprintln!("abort: rank {rank} unblocked after {ms} ms in the barrier: {line}");
        assert!(ms < 300 + 500, "rank {rank}: {line}");
        assert!(line.contains("aborted"), "rank {rank}: {line}");
        if rank != 0 {
            assert!(line.contains("rank 0"), "rank {rank}: {line}");
        }
    }
    for (rank, (line, _)) in
        waiters
            .iter()
            .zip(job.await_all(&waiters, "REFUSED", Duration::from_secs(3)))
    {
        assert!(line.contains("failed earlier"), "rank {rank}: {line}");
    }
}

#[test]
fn a_rank_that_never_arrives_is_named_within_the_timeout() {
    let start = Instant::now();
    let mut job = Job::start(3, 1, &[0, 1], &["steady", "4096", "1"], &[]);
    let failed = job.await_all(&[0, 1], "INIT-FAILED", 2 * TIMEOUT + Duration::from_secs(1));
    for (rank, (line, when)) in failed.iter().enumerate() {
        let took = when.duration_since(start);
        eprintln!("missing rank: rank {rank} failed after {took:?}: {line}");
        assert!(took <= 2 * TIMEOUT, "rank {rank} took {took:?}");
        assert!(line.contains("rank(s) 2 of 3"), "rank {rank}: {line}");
    }
}

#[test]
fn bad_knob_values_fail_init_naming_the_variable() {
    for (var, value) in [
        ("FAIRRING_TIMEOUT", "abc"),
        ("FAIRRING_TIMEOUT", "-1"),
        ("FAIRRING_TOTAL_MEMORY", "-1"),
        ("FAIRRING_SLICE_SIZE", "abc"),
        ("LOCAL_RANK", "4294967296"),
        ("WORLD_SIZE", "4294967296"),
        ("FAIRRING_ALGO", "fastest"),
    ] {
        let mut job = Job::start(1, 1, &[0], &["steady", "4096", "1"], &[(var, value)]);
        let line = job
            .await_all(&[0], "INIT-FAILED", Duration::from_secs(10))
            .remove(0)
            .0;
        assert!(line.contains(var), "{var}={value}: {line}");
    }
}
