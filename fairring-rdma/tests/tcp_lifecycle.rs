//! Dropping a fabric joins its thread and closes its sockets: after many
//! set-ups and tear-downs, this process's descriptors and threads are back where
//! they started. (Its own test binary, so no other test's fabrics are counted.)

mod common;

use std::time::Duration;

use common::{drain_until, mesh};
use fairring_rdma::fabric::{CompletionEvent, Fabric};

fn count(dir: &str) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

/// Threads, once the kernel has reaped the ones just joined (a joined thread's
/// `/proc` entry can outlive `pthread_join` by a moment).
fn settled_threads(expected: usize) -> usize {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let n = count("/proc/self/task");
        if n == expected || std::time::Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn teardown_returns_descriptors_and_threads() {
    let (fds, threads) = (count("/proc/self/fd"), count("/proc/self/task"));
    for round in 0..10 {
        let fabrics = mesh(3, |c| c);
        assert!(
            count("/proc/self/task") >= threads + 3,
            "one I/O thread per fabric"
        );
        for (i, fabric) in (0u32..).zip(&fabrics) {
            let next = (i + 1) % 3;
            fabric.send_message(next, round, b"hello", 0).unwrap();
        }
        for fabric in &fabrics {
            drain_until(
                fabric,
                Duration::from_secs(10),
                |c| matches!(c.event, CompletionEvent::Message(m) if m.immediate == round),
            );
        }
        drop(fabrics);
        assert_eq!(
            settled_threads(threads),
            threads,
            "round {round}: threads left behind"
        );
        assert_eq!(
            count("/proc/self/fd"),
            fds,
            "round {round}: descriptors left open"
        );
    }
}
