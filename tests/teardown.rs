//! After a communicator is dropped, the process holds the file descriptors,
//! threads and shared-memory segments it held before: nothing leaks per job.
//! (Its own test binary: other tests' jobs would move the counts.)

mod common;

use common::job;
use fairring::ReduceOp;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .count()
}

fn segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .expect("/dev/shm")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("fairring-"))
        .collect()
}

fn one_job(m: u32, d: u32) {
    job(
        m,
        d,
        |b| b,
        |rank, comm| {
            let mut x = vec![1i32; 100_000];
            comm.all_reduce(&mut x, ReduceOp::Sum).expect("all-reduce");
            comm.barrier().expect("barrier");
            assert!(x.iter().all(|&v| v == (m * d) as i32), "rank {rank}");
        },
    );
}

#[test]
fn descriptors_threads_and_segments_return_to_baseline() {
    // A first job warms up what the process keeps for good (the allocator's
    // arenas, lazily opened files such as the random source).
    one_job(1, 2);
    let before = (open_fds(), threads(), segments());
    for (m, d) in [(1, 2), (2, 2), (3, 1)] {
        one_job(m, d);
        // Threads of the fabric exit shortly after their communicator drops.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while threads() > before.1 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let after = (open_fds(), threads(), segments());
        assert_eq!(
            after, before,
            "{m}x{d}: (fds, threads, /dev/shm segments) changed"
        );
    }
}
