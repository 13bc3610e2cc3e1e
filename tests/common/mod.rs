//! Helpers: a job of `machines x devices` ranks as threads of this process, each
//! with its own communicator (machines simulated through host identities).

#![allow(dead_code, unreachable_pub)]

pub mod allocations;
pub mod processes;

use std::net::TcpListener;
use std::time::Duration;

use fairring::{Algorithm, Communicator, Config, ConfigBuilder, Server};

/// A port that was free a moment ago, for a job's rendezvous store.
///
/// Chosen at random below the kernel's ephemeral range: a port the kernel handed
/// out (`bind` to port 0) and released can be handed out again at once as the
/// local port of some other test's outgoing connection, and the store's `bind`
/// then fails with "address already in use". Ports below the range are never
/// handed out that way. Falls back to the kernel's choice if none is free.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            t.split_whitespace()
                .next()
                .and_then(|p| p.parse::<u16>().ok())
        })
        .unwrap_or(32768);
    let (low, high) = (10_000u16, ephemeral_low.max(10_001));
    for _ in 0..64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let port = low + u16::try_from(h.finish() % u64::from(high - low)).unwrap_or(0);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
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

/// [`job_with_servers`], returning how each server ended too.
pub fn job_and_servers<R: Send>(
    m: u32,
    d: u32,
    servers: u32,
    tune: impl Fn(ConfigBuilder) -> ConfigBuilder + Sync,
    body: impl Fn(u32, &Communicator) -> R + Sync,
) -> (Vec<R>, Vec<fairring::Result<()>>) {
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
                    Server::new(config).and_then(Server::run).map(drop)
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
/// servers)`, with more servers than machines, fewer, and as many.
pub const SERVER_LAYOUTS: [(u32, u32, u32); 4] = [(1, 2, 1), (2, 2, 2), (3, 1, 2), (2, 1, 3)];

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
