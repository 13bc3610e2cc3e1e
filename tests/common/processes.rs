//! Jobs whose ranks are processes: this test binary, re-executed to run one
//! test as one rank, with torchrun's variables in its environment and each
//! rank a machine of its own (`FAIRRING_HOST_ID`), or `d` ranks per machine.
//!
//! A test calls [`rank_of_job`] first: inside a rank it returns the rank's
//! communicator and the test runs its rank's part; otherwise the test is the
//! launcher and starts a [`ProcessJob`] of itself.
//!
//! Ranks report on stdout, one line per event ([`say`]); the launcher reads
//! the lines as they come, so it can act mid-job (kill a rank once it is
//! working) and wait for every rank's verdict with a deadline. A rank's stderr
//! goes to the launcher's, so a failing rank's panic is in the test's output.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use fairring::Communicator;
use fairring_local_job::{LocalJob, Ranks};

/// Set in a rank's environment: the test to run as a rank.
const RANK_OF: &str = "FAIRRING_TEST_RANK_OF";

/// Set in the environment of a process that runs one test alone.
const ALONE: &str = "FAIRRING_TEST_ALONE";

/// Whether this process runs `test` alone ([`run_alone`]).
pub fn in_process_of_its_own(test: &str) -> bool {
    std::env::var(ALONE).is_ok_and(|t| t == test)
}

/// Runs `test` (this binary's test of that name) in a process of its own,
/// where no other test shares its threads or its allocation count, and
/// panics if it fails or runs past `within`. The test calls
/// [`in_process_of_its_own`] first and does its work only there.
pub fn run_alone(test: &str, within: Duration) {
    let exe = std::env::current_exe().expect("this test binary");
    let mut child = std::process::Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(ALONE, test)
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {test} alone: {e}"));
    let deadline = Instant::now() + within;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                assert!(
                    status.success(),
                    "{test}, alone in its process: {status} (its panic is above)"
                );
                return;
            }
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{test}, alone in its process, still ran after {within:?}");
            }
            Err(e) => panic!("waiting for {test}: {e}"),
        }
    }
}

/// Inside a rank of a job started for `test`, its communicator; `None` in the
/// launcher. Inside a dedicated server of the job
/// ([`ProcessJob::start_with_servers`]), serves until every worker of its
/// rail group has left, says `DONE sent S received R bytes` (the data bytes
/// it moved: [`moved_by_server`]) and ends the process; a failure panics,
/// naming the server.
pub fn rank_of_job(test: &str) -> Option<Communicator> {
    match std::env::var(RANK_OF) {
        Ok(t) if t == test => {
            if std::env::var("FAIRRING_ROLE").is_ok_and(|r| r == "server") {
                serve(test);
            }
            Some(
                Communicator::from_env()
                    .unwrap_or_else(|e| panic!("joining the job of {test}: {e}")),
            )
        }
        _ => None,
    }
}

/// A dedicated server of `test`'s job: serves, reports what it moved, and
/// ends the process.
fn serve(test: &str) -> ! {
    let index = std::env::var("FAIRRING_SERVER_RANK").unwrap_or_default();
    let server = fairring::Server::from_env()
        .unwrap_or_else(|e| panic!("server {index} joining the job of {test}: {e}"));
    let rank = server.rank();
    match server.run() {
        Ok(t) => {
            say(&format!(
                "DONE sent {} received {} bytes",
                t.sent_bytes, t.received_bytes
            ));
            std::process::exit(0);
        }
        Err(e) => panic!("server {index} (rank {rank}) of {test}: {e}"),
    }
}

/// The data bytes a server sent and received, from its `DONE` line
/// ([`rank_of_job`]); panics on any other line.
pub fn moved_by_server(line: &str) -> (u64, u64) {
    let numbers: Vec<u64> = line
        .split(' ')
        .filter_map(|word| word.parse().ok())
        .collect();
    match (line.starts_with("DONE sent "), numbers.as_slice()) {
        (true, &[sent, received]) => (sent, received),
        _ => panic!("a server's report: {line:?}"),
    }
}

/// Reports `line` to the launcher at once, on a line of its own: libtest
/// has already printed `test NAME ... ` without ending the line, so the
/// report starts a new one.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "\n{line}");
    let _ = out.flush();
}

/// Running ranks, killed when dropped.
pub struct ProcessJob {
    test: String,
    ranks: Ranks,
    /// Each rank's lines as they come, then `None` when its stdout closes.
    lines: Receiver<(u32, Option<String>)>,
    /// Lines read so far, per rank.
    seen: HashMap<u32, Vec<String>>,
    /// Ranks whose stdout has closed (they exited, or were killed).
    ended: Vec<u32>,
}

impl ProcessJob {
    /// Starts the `m * d` ranks of `test` (this binary's test of that name),
    /// with `env` added to each rank's environment.
    pub fn start(test: &str, m: u32, d: u32, env: &[(&str, String)]) -> ProcessJob {
        ProcessJob::start_with_servers(test, m, d, 0, env)
    }

    /// [`ProcessJob::start`] with `servers` dedicated reduction servers,
    /// processes `m * d` onwards (this binary's test of that name, which
    /// serves in [`rank_of_job`]).
    pub fn start_with_servers(
        test: &str,
        m: u32,
        d: u32,
        servers: u32,
        env: &[(&str, String)],
    ) -> ProcessJob {
        assert!(
            std::env::var_os(RANK_OF).is_none(),
            "a rank of a job tried to launch {test}: the test's name passed to rank_of_job \
             and to ProcessJob::start must be its function's name"
        );
        let exe = std::env::current_exe().expect("this test binary");
        let job = LocalJob::new(test, m, d)
            .expect("a local job")
            .with_servers(servers);
        let run_id = format!("{test}-{}", job.port());
        let mut ranks = job
            .spawn(|rank| {
                let mut c = job.command(&exe, rank);
                c.args([test, "--exact", "--include-ignored", "--nocapture"])
                    .args(["--test-threads", "1"])
                    .env(RANK_OF, test)
                    .env("TORCHELASTIC_RUN_ID", &run_id)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit());
                for (k, v) in env {
                    c.env(k, v);
                }
                c
            })
            .unwrap_or_else(|e| panic!("{e}"));
        let (tx, lines) = channel();
        for rank in 0..m * d + servers {
            let child = ranks.child_mut(rank).expect("a started rank");
            let out = child.stdout.take().expect("piped stdout");
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send((rank, Some(line))).is_err() {
                        return;
                    }
                }
                let _ = tx.send((rank, None));
            });
        }
        ProcessJob {
            test: test.to_owned(),
            ranks,
            lines,
            seen: HashMap::new(),
            ended: Vec::new(),
        }
    }

    /// Waits until each of `ranks` (processes: a server is process
    /// `m * d + i`) has said a line starting with `prefix`;
    /// returns those lines in the order of `ranks`. Panics after `within`.
    pub fn await_line(&mut self, ranks: &[u32], prefix: &str, within: Duration) -> Vec<String> {
        let deadline = Instant::now() + within;
        loop {
            let found: Vec<Option<String>> = ranks
                .iter()
                .map(|r| {
                    self.seen
                        .get(r)
                        .and_then(|ls| ls.iter().find(|l| l.starts_with(prefix)).cloned())
                })
                .collect();
            if found.iter().all(Option::is_some) {
                return found.into_iter().flatten().collect();
            }
            let gone = ranks
                .iter()
                .zip(&found)
                .find(|(r, f)| f.is_none() && self.ended.contains(r));
            if let Some((rank, _)) = gone {
                panic!(
                    "{}: rank {rank} ended without saying {prefix:?}; it said {:?}",
                    self.test,
                    self.seen.get(rank)
                );
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok((rank, Some(line))) => self.seen.entry(rank).or_default().push(line),
                Ok((rank, None)) => self.ended.push(rank),
                Err(_) if Instant::now() >= deadline => panic!(
                    "{}: not every rank of {ranks:?} said {prefix:?} within {within:?}; \
                     they said {:?}",
                    self.test, self.seen
                ),
                Err(_) => {}
            }
        }
    }

    /// Kills rank `rank` at once (SIGKILL).
    pub fn kill(&mut self, rank: u32) {
        self.ranks
            .kill(rank)
            .unwrap_or_else(|e| panic!("killing rank {rank}: {e}"));
    }

    /// Waits for every rank not killed to exit, and panics naming each that
    /// failed or that is still running after `within` (the first failure
    /// ends the others).
    pub fn finish(mut self, within: Duration) {
        if let Err(e) = self.ranks.wait(Some(within)) {
            panic!("{}: {e} (each rank's panic is above)", self.test);
        }
    }

    /// Starts `test` as an `m x d` job and waits for every rank to succeed.
    pub fn run(test: &str, m: u32, d: u32, env: &[(&str, String)], within: Duration) {
        ProcessJob::start(test, m, d, env).finish(within);
    }
}
