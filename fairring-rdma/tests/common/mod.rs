//! Helpers shared by the tcp provider's tests.
#![allow(dead_code, unreachable_pub, clippy::cast_possible_truncation)]

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use fairring_rdma::JobSecret;
use fairring_rdma::fabric::{Completion, CompletionEvent, Fabric};
use fairring_rdma::tcp::{BindTo, TcpConfig, TcpFabric, TcpRegion};

pub const JOB: u64 = 0xfa12_0001;

pub fn secret() -> JobSecret {
    JobSecret::from_bytes([0x5a; 32])
}

pub fn config(rank: u32, world: u32) -> TcpConfig {
    let mut c = TcpConfig::new(rank, world, JOB, secret(), BindTo::loopback());
    c.connect_timeout = Duration::from_secs(20);
    c
}

/// `n` fabrics, every pair connected.
pub fn mesh(n: u32, configure: impl Fn(TcpConfig) -> TcpConfig) -> Vec<TcpFabric> {
    let fabrics: Vec<TcpFabric> = (0..n)
        .map(|r| TcpFabric::new(configure(config(r, n))).unwrap())
        .collect();
    std::thread::scope(|s| {
        for (me, fabric) in fabrics.iter().enumerate() {
            let fabrics = &fabrics;
            s.spawn(move || {
                for (peer, other) in fabrics.iter().enumerate() {
                    if peer != me {
                        let endpoint = other.endpoint(me as u32).unwrap();
                        fabric.connect(peer as u32, &endpoint).unwrap();
                    }
                }
            });
        }
    });
    fabrics
}

/// Memory owned by a test, registered with a fabric.
pub struct Buffer {
    pub region: Option<TcpRegion>,
    pub bytes: Vec<u8>,
}

impl Buffer {
    pub fn new(fabric: &TcpFabric, bytes: Vec<u8>) -> Buffer {
        let mut bytes = bytes;
        let ptr = NonNull::new(bytes.as_mut_ptr()).unwrap();
        // SAFETY: `bytes` is never moved or resized while registered (the region
        // is dropped first, in `Drop`), and tests read it only after the writes
        // into it have landed.
        let region = unsafe { fabric.register(ptr, bytes.len()) }.unwrap();
        Buffer {
            region: Some(region),
            bytes,
        }
    }

    pub fn region(&self) -> &TcpRegion {
        self.region.as_ref().unwrap()
    }

    /// Reads the memory; the caller knows no write is in flight into it.
    pub fn read(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        self.region.take();
    }
}

pub fn empty() -> Completion {
    Completion {
        peer: 0,
        event: CompletionEvent::Sent { token: 0 },
    }
}

/// Waits for completions until `done` says so, or panics after `timeout`.
pub fn drain_until(
    fabric: &TcpFabric,
    timeout: Duration,
    mut each: impl FnMut(&Completion) -> bool,
) {
    let deadline = Instant::now() + timeout;
    let mut out = [empty(); 64];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "timed out waiting for completions");
        let n = fabric.wait(&mut out, left.min(Duration::from_millis(100)));
        for c in &out[..n] {
            if each(c) {
                return;
            }
        }
    }
}

/// A small deterministic generator (splitmix64), so failures replay.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    pub fn fill(&mut self, bytes: &mut [u8]) {
        for chunk in bytes.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}
