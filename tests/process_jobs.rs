//! The launcher of process jobs that the GPU tests use, checked where no GPU
//! is needed: a rank's reports reach the launcher as lines of their own,
//! although libtest prints `test NAME ... ` before the rank's output without
//! ending that line; a job's dedicated servers serve and report.

mod common;

use std::time::Duration;

use common::processes::{ProcessJob, moved_by_server, rank_of_job, say};

#[test]
fn a_ranks_reports_reach_the_launcher_as_lines_of_their_own() {
    let test = "a_ranks_reports_reach_the_launcher_as_lines_of_their_own";
    let Some(comm) = rank_of_job(test) else {
        let mut job = ProcessJob::start(test, 2, 1, &[]);
        let ready = job.await_line(&[0, 1], "READY", Duration::from_secs(60));
        for (rank, line) in ready.iter().enumerate() {
            assert_eq!(line, &format!("READY rank {rank}"), "rank {rank}");
        }
        let done = job.await_line(&[0, 1], "DONE", Duration::from_secs(60));
        assert!(done.iter().all(|line| line == "DONE"), "{done:?}");
        job.finish(Duration::from_secs(60));
        return;
    };
    say(&format!("READY rank {}", comm.rank()));
    let mut sum = [1.0f32];
    comm.all_reduce(&mut sum, fairring::ReduceOp::Sum).unwrap();
    assert_eq!(sum[0], comm.world_size() as f32);
    say("DONE");
}

/// A process job with dedicated servers: the servers are processes of this
/// binary too, serve the ranks' all-reduce, and report the bytes they moved
/// to the launcher once every rank has left.
#[test]
fn a_jobs_servers_serve_and_report_what_they_moved() {
    let test = "a_jobs_servers_serve_and_report_what_they_moved";
    let Some(comm) = rank_of_job(test) else {
        let mut job = ProcessJob::start_with_servers(test, 2, 1, 2, &[]);
        let done = job.await_line(&[2, 3], "DONE", Duration::from_secs(60));
        for (server, line) in done.iter().enumerate() {
            let (sent, received) = moved_by_server(line);
            assert!(
                sent > 0 && received > 0,
                "server {server} moved data: {line}"
            );
        }
        job.finish(Duration::from_secs(60));
        return;
    };
    let mut sum = vec![1.0f32; 1 << 18];
    comm.all_reduce(&mut sum, fairring::ReduceOp::Sum).unwrap();
    assert!(sum.iter().all(|&v| v == comm.world_size() as f32));
}
