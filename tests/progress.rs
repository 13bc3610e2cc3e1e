//! Operations advance with nobody waiting: the progress thread drives them, also
//! right after a blocking call (when it is parked).

mod common;

use std::time::{Duration, Instant};

use common::{job, small_slices};
use fairring::{Algorithm, ReduceOp};

fn input(rank: u32, round: usize, i: usize) -> f32 {
    ((rank as usize * 5 + round * 11 + i * 7) % 53) as f32 - 26.0
}

/// Polls `test()` (which never drives) until the operation is done.
fn finished_without_waiting(work: &fairring::Work<'_>) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if work.test().expect("operation failed") {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

fn unattended(m: u32, d: u32, algorithm: Algorithm) {
    let world = m * d;
    // 16 slices of 64 KiB through 2 staging buffers: far more than a submission
    // does by itself.
    let n = 250_000;
    let results = job(
        m,
        d,
        |b| small_slices(b, algorithm),
        |rank, comm| {
            let mut rounds = Vec::new();
            for round in 0..3 {
                // A blocking call parks the progress thread while it waits.
                let mut warm = [rank as f32];
                comm.all_reduce(&mut warm, ReduceOp::Sum).expect("warm-up");
                if round == 2 {
                    // Long after the last wait: the submission wakes the thread.
                    std::thread::sleep(Duration::from_millis(20));
                }
                let mut buf: Vec<f32> = (0..n).map(|i| input(rank, round, i)).collect();
                let done = comm.scope(|s| {
                    let work = s.all_reduce(&mut buf, ReduceOp::Sum, ()).expect("start");
                    finished_without_waiting(&work)
                });
                assert!(done, "rank {rank}, round {round}: not finished after 20 s");
                rounds.push(buf);
            }
            rounds
        },
    );
    for (rank, rounds) in results.iter().enumerate() {
        for (round, buf) in rounds.iter().enumerate() {
            let wrong = buf
                .iter()
                .enumerate()
                .filter(|&(i, &v)| v != (0..world).map(|r| input(r, round, i)).sum::<f32>())
                .count();
            assert_eq!(wrong, 0, "{m}x{d} {algorithm}: rank {rank}, round {round}");
        }
    }
}

#[test]
fn the_progress_thread_finishes_what_nobody_waits_for() {
    unattended(1, 2, Algorithm::Hierarchical);
    unattended(2, 2, Algorithm::Hierarchical);
    unattended(3, 1, Algorithm::Ring);
}
