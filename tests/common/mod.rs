//! Helpers: a job of `machines x devices` ranks as threads of this process, each
//! with its own communicator (machines simulated through host identities).

#![allow(dead_code, unreachable_pub)]

pub mod allocations;
pub mod fault_proxy;
pub mod processes;

use std::time::Duration;

use fairring::{Algorithm, Communicator, Config, ConfigBuilder, Server};

/// A port that was free a moment ago, for a job's rendezvous store (see
/// [`fairring_local_job::free_port`]).
pub fn free_port() -> u16 {
    fairring_local_job::free_port().expect("a free port")
}

/// Runs `body(rank, &comm)` on every rank of an `m x d` job, with `tune` applied
/// to each rank's configuration; returns each rank's result in rank order.
pub fn job<R: Send>(
    m: u32,
    d: u32,
    tune: impl Fn(ConfigBuilder) -> ConfigBuilder + Sync,
    body: impl Fn(u32, &Communicator) -> R + Sync,
) -> Vec<R> {
    job_with_servers(m, d, 0, tune, body)
}

/// [`job`] with `servers` dedicated reduction servers, threads of this process
/// too, each with `tune` applied; every server must end without error.
pub fn job_with_servers<R: Send>(
    m: u32,
    d: u32,
    servers: u32,
    tune: impl Fn(ConfigBuilder) -> ConfigBuilder + Sync,
    body: impl Fn(u32, &Communicator) -> R + Sync,
) -> Vec<R> {
    let (results, served) = job_and_servers(m, d, servers, tune, body);
    for (index, outcome) in served.into_iter().enumerate() {
        outcome.unwrap_or_else(|e| panic!("server {index}: {e}"));
    }
    results
}

/// [`job_with_servers`], returning how each server ended too (the data
/// bytes it moved, or its error).
pub fn job_and_servers<R: Send>(
    m: u32,
    d: u32,
    servers: u32,
    tune: impl Fn(ConfigBuilder) -> ConfigBuilder + Sync,
    body: impl Fn(u32, &Communicator) -> R + Sync,
) -> (Vec<R>, Vec<fairring::Result<fairring::Traffic>>) {
    let port = free_port();
    let world = m * d;
    let run_id = format!("test-{port}-{}", std::process::id());
    std::thread::scope(|s| {
        let server_threads: Vec<_> = (0..servers)
            .map(|index| {
                let tune = &tune;
                let run_id = run_id.clone();
                s.spawn(move || {
                    let b = Config::server_builder(index, world, "127.0.0.1", port)
                        .run_id(run_id)
                        .timeout(Duration::from_secs(30));
                    let config = tune(b).servers(servers).build().expect("config");
                    Server::new(config).and_then(Server::run)
                })
            })
            .collect();
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let tune = &tune;
                let body = &body;
                let run_id = run_id.clone();
                s.spawn(move || {
                    let b = Config::builder(rank, world, "127.0.0.1", port)
                        .host_id(format!("machine-{}", rank / d))
                        .run_id(run_id)
                        .timeout(Duration::from_secs(30));
                    let config = tune(b).servers(servers).build().expect("config");
                    let comm =
                        Communicator::new(config).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    body(rank, &comm)
                })
            })
            .collect();
        let results = handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect();
        let served = server_threads
            .into_iter()
            .map(|h| h.join().expect("a server panicked"))
            .collect();
        (results, served)
    })
}

/// The layouts every collective also runs on with dedicated servers: `(M, D,
/// servers)`, with more servers than machines, fewer, and as many; in rail
/// groups (`gcd(servers, D)`) of one server and of two, and a group whose
/// server serves two slots of each machine (2x4 with two servers).
pub const SERVER_LAYOUTS: [(u32, u32, u32); 6] = [
    (1, 2, 1),
    (2, 2, 2),
    (3, 1, 2),
    (2, 1, 3),
    (2, 2, 4),
    (2, 4, 2),
];

/// A small deterministic generator.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Small slices and shards, so that modest tensors span many slices and shards.
pub fn small_slices(b: ConfigBuilder, algorithm: Algorithm) -> ConfigBuilder {
    b.slice_bytes(64 << 10)
        .min_shard_bytes(4 << 10)
        .total_memory(1 << 20)
        .algorithm(algorithm)
}
