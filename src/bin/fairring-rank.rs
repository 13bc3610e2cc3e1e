//! One rank of a scripted job, configured like any rank (torchrun's environment
//! and `FAIRRING_*`): what the fault tests run as separate processes, to kill,
//! stop and starve, and a quick way to try a deployment by hand.
//!
//! ```text
//! fairring-rank steady [BYTES [SECONDS]]   all-reduce BYTES of f32 in a loop
//! fairring-rank repeat BYTES COUNT         all-reduce BYTES of f32 COUNT times (every
//!                                          rank issues the same number, then leaves)
//! fairring-rank messages [BYTES [SECONDS]] send BYTES of f32 to the next rank of the
//!                                          ring and receive as much from the previous
//!                                          one, in a loop (each pair linked when
//!                                          first named)
//! fairring-rank rooted [BYTES [SECONDS]]   gather, scatter and reduce BYTES of f32 to
//!                                          and from rank 0 in a loop (as messages from
//!                                          2 MiB)
//! fairring-rank every-peer [BYTES]         after an all-reduce, one send of BYTES of f32 to
//!                                          and one receive from every other rank at once;
//!                                          reports the process's threads and resident
//!                                          memory before and after (`RESOURCES`)
//! fairring-rank abort-late                 rank 0 aborts from a second thread while
//!                                          every rank waits in a barrier that rank 1
//!                                          joins late; then everyone tries more work
//! ```
//!
//! It reports on stdout, one line per event, flushed at once:
//! `READY` after the first operation, `DONE n` after `n` operations, `FAILED ms
//! message` when an operation fails (`ms`: since the last one that succeeded),
//! `REFUSED message` when work after a failure is refused, and `INIT-FAILED
//! message` when the communicator cannot be built. Exit status: 0 done, 3 failed.

use std::io::Write;
use std::time::{Duration, Instant};

use fairring::{Communicator, ReduceOp};

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn number(args: &[String], i: usize, default: u64) -> u64 {
    args.get(i).map_or(default, |a| {
        a.parse().unwrap_or_else(|_| {
            eprintln!("fairring-rank: argument {i} ({a:?}) is not a number");
            std::process::exit(2)
        })
    })
}

fn steady(comm: &Communicator, bytes: u64, seconds: u64) -> i32 {
    let elements = usize::try_from(bytes / 4).unwrap_or(1).max(1);
    let mut data = vec![1.0f32; elements];
    in_a_loop(seconds, |after_failure| {
        let op = if after_failure {
            ReduceOp::Sum
        } else {
            ReduceOp::Avg
        };
        comm.all_reduce(&mut data, op)
    })
}

fn messages(comm: &Communicator, bytes: u64, seconds: u64) -> i32 {
    let elements = usize::try_from(bytes / 4).unwrap_or(1).max(1);
    let (rank, world) = (comm.rank(), comm.world_size());
    let (next, previous) = ((rank + 1) % world, (rank + world - 1) % world);
    let mut out = vec![1.0f32; elements];
    let mut back = vec![0.0f32; elements];
    in_a_loop(seconds, |_| {
        comm.send_recv(
            &mut [(next, &mut out[..])],
            &mut [(previous, &mut back[..])],
        )
    })
}

/// The process's threads and resident memory (KiB), from `/proc/self/status`.
fn resources() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("Threads:"), field("VmRSS:"))
}

fn every_peer(comm: &Communicator, bytes: u64) -> i32 {
    let elements = usize::try_from(bytes / 4).unwrap_or(1).max(1);
    let (rank, world) = (comm.rank(), comm.world_size());
    let step = || -> fairring::Result<()> {
        comm.all_reduce(&mut vec![1.0f32; elements], ReduceOp::Sum)?;
        comm.barrier()?;
        let (threads, rss) = resources();
        say(&format!("RESOURCES before threads={threads} rss_kib={rss}"));
        let peers: Vec<u32> = (0..world).filter(|&p| p != rank).collect();
        let mut outs: Vec<Vec<f32>> = peers.iter().map(|_| vec![1.0; elements]).collect();
        let mut ins: Vec<Vec<f32>> = peers.iter().map(|_| vec![0.0; elements]).collect();
        let mut sends: Vec<(u32, &mut [f32])> = peers
            .iter()
            .copied()
            .zip(outs.iter_mut().map(|v| &mut v[..]))
            .collect();
        let mut receives: Vec<(u32, &mut [f32])> = peers
            .iter()
            .copied()
            .zip(ins.iter_mut().map(|v| &mut v[..]))
            .collect();
        comm.send_recv(&mut sends, &mut receives)?;
        comm.barrier()?;
        let (threads, rss) = resources();
        say(&format!("RESOURCES after threads={threads} rss_kib={rss}"));
        comm.barrier()
    };
    match step() {
        Ok(()) => {
            say("DONE 1");
            0
        }
        Err(e) => {
            say(&format!("FAILED 0 {e}"));
            3
        }
    }
}

fn rooted(comm: &Communicator, bytes: u64, seconds: u64) -> i32 {
    let elements = usize::try_from(bytes / 4).unwrap_or(1).max(1);
    let world = comm.world_size() as usize;
    let part = elements / world;
    let mut whole = vec![1.0f32; part * world];
    let mut mine = vec![1.0f32; part];
    let mut reduced = vec![1.0f32; elements];
    in_a_loop(seconds, |_| {
        comm.gather(&mine.clone(), &mut whole, 0)?;
        comm.scatter(&mut whole, &mut mine, 0)?;
        comm.reduce(&vec![1.0f32; elements], &mut reduced, ReduceOp::Max, 0)
    })
}

/// Runs `step(false)` for `seconds`, saying `READY` after the first success;
/// on a failure says `FAILED`, tries `step(true)` once more (saying
/// `REFUSED` if that fails too) and returns 3.
fn in_a_loop(seconds: u64, mut step: impl FnMut(bool) -> fairring::Result<()>) -> i32 {
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut last_ok = Instant::now();
    let mut done = 0u64;
    while Instant::now() < end {
        match step(false) {
            Ok(()) => {
                if done == 0 {
                    say("READY");
                }
                done += 1;
                last_ok = Instant::now();
            }
            Err(e) => {
                say(&format!("FAILED {} {e}", last_ok.elapsed().as_millis()));
                if let Err(e) = step(true) {
                    say(&format!("REFUSED {e}"));
                }
                return 3;
            }
        }
    }
    say(&format!("DONE {done}"));
    0
}

fn repeat(comm: &Communicator, bytes: u64, count: u64) -> i32 {
    let elements = usize::try_from(bytes / 4).unwrap_or(1).max(1);
    let mut data = vec![1.0f32; elements];
    for done in 0..count {
        if let Err(e) = comm.all_reduce(&mut data, ReduceOp::Sum) {
            say(&format!("FAILED 0 {e}"));
            return 3;
        }
        if done == 0 {
            say("READY");
        }
    }
    let world = comm.world_size() as f32;
    let want = world.powi(i32::try_from(count).unwrap_or(i32::MAX));
    if data.iter().any(|&v| v != want) {
        say(&format!(
            "FAILED 0 wrong result: expected {want} everywhere"
        ));
        return 3;
    }
    say(&format!("DONE {count}"));
    0
}

fn abort_late(comm: &Communicator) -> i32 {
    let mut x = [1.0f32; 4];
    if let Err(e) = comm.all_reduce(&mut x, ReduceOp::Sum) {
        say(&format!("FAILED 0 {e}"));
        return 3;
    }
    say("READY");
    let rank = comm.rank();
    let status = std::thread::scope(|s| {
        if rank == 0 {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                comm.abort();
            });
        }
        if rank == 1 {
            std::thread::sleep(Duration::from_secs(30));
        }
        let start = Instant::now();
        match comm.barrier() {
            Ok(()) => {
                say("DONE 1");
                0
            }
            Err(e) => {
                say(&format!("FAILED {} {e}", start.elapsed().as_millis()));
                3
            }
        }
    });
    if status != 0
        && let Err(e) = comm.barrier()
    {
        say(&format!("REFUSED {e}"));
    }
    status
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let scenario = args.get(1).map_or("steady", String::as_str);
    let comm = match Communicator::from_env() {
        Ok(c) => c,
        Err(e) => {
            say(&format!("INIT-FAILED {e}"));
            std::process::exit(3);
        }
    };
    let status = match scenario {
        "steady" => steady(&comm, number(&args, 2, 1 << 20), number(&args, 3, 60)),
        "repeat" => repeat(&comm, number(&args, 2, 1 << 20), number(&args, 3, 10)),
        "messages" => messages(&comm, number(&args, 2, 1 << 20), number(&args, 3, 60)),
        "every-peer" => every_peer(&comm, number(&args, 2, 1 << 20)),
        "rooted" => rooted(&comm, number(&args, 2, 4 << 20), number(&args, 3, 60)),
        "abort-late" => abort_late(&comm),
        other => {
            eprintln!(
                "fairring-rank: unknown scenario {other:?} (steady, repeat, messages, rooted, abort-late)"
            );
            2
        }
    };
    drop(comm);
    std::process::exit(status);
}
