//! The tcp fabric against plain sockets, on loopback, in one run.
//!
//! - `throughput/{fabric,socket}/{1MiB,64MiB}`: one-way stream of writes of that
//!   size; the fabric keeps four writes outstanding and the clock stops when the
//!   receiver has seen the last one land; the plain pair is a `TcpStream` writer
//!   and a `read_exact` reader (both with `TCP_NODELAY`).
//! - `round_trip/{fabric,socket}`: an 8-byte write and an 8-byte write back; both
//!   sides block in `wait` (the fabric) or `read` (the socket), nobody spins.
//!
//! Compare the `fabric` and `socket` figures of one run: this machine is shared.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fairring_rdma::JobSecret;
use fairring_rdma::fabric::{
    Completion, CompletionEvent, Fabric, LocalRegion, RemoteRegion, WriteRequest,
};
use fairring_rdma::tcp::{BindTo, TcpConfig, TcpFabric, TcpRegion};

const BIG: usize = 64 << 20;

fn pair() -> (TcpFabric, TcpFabric) {
    let secret = JobSecret::from_bytes([1; 32]);
    let config = |rank| TcpConfig::new(rank, 2, 0xbe7c, secret.clone(), BindTo::loopback());
    let (zero, one) = (
        TcpFabric::new(config(0)).unwrap(),
        TcpFabric::new(config(1)).unwrap(),
    );
    let (e0, e1) = (zero.endpoint(1).unwrap(), one.endpoint(0).unwrap());
    std::thread::scope(|s| {
        s.spawn(|| zero.connect(1, &e1).unwrap());
        one.connect(0, &e0).unwrap();
    });
    (zero, one)
}

fn register(fabric: &TcpFabric, memory: &mut [u8]) -> TcpRegion {
    // SAFETY: the benches keep `memory` alive and untouched while registered.
    unsafe { fabric.register(NonNull::new(memory.as_mut_ptr()).unwrap(), memory.len()) }.unwrap()
}

fn blank() -> Completion {
    Completion {
        peer: 0,
        event: CompletionEvent::Sent { token: 0 },
    }
}

/// Waits for `count` completions matching `wanted`.
fn await_count(fabric: &TcpFabric, count: u64, wanted: impl Fn(&CompletionEvent) -> bool) {
    let mut out = [blank(); 64];
    let mut seen = 0;
    while seen < count {
        let n = fabric.wait(&mut out, Duration::from_secs(30));
        assert!(n > 0, "no completion in 30 s");
        seen += out[..n].iter().filter(|c| wanted(&c.event)).count() as u64;
    }
}

fn stream_fabric(
    sender: &TcpFabric,
    receiver: &TcpFabric,
    source: &TcpRegion,
    target: RemoteRegion,
    size: usize,
    iters: u64,
) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            await_count(receiver, iters, |e| {
                matches!(e, CompletionEvent::Landed { .. })
            })
        });
        let mut out = [blank(); 64];
        let mut outstanding = 0;
        for i in 0..iters {
            while outstanding == 4 {
                let n = sender.wait(&mut out, Duration::from_secs(30));
                outstanding -= out[..n]
                    .iter()
                    .filter(|c| matches!(c.event, CompletionEvent::Sent { .. }))
                    .count();
            }
            let request = WriteRequest {
                source,
                source_offset: 0,
                len: size,
                target,
                target_offset: 0,
                immediate: 0,
                token: i,
            };
            sender.write(0, request).unwrap();
            outstanding += 1;
        }
        while outstanding > 0 {
            let n = sender.wait(&mut out, Duration::from_secs(30));
            outstanding -= out[..n]
                .iter()
                .filter(|c| matches!(c.event, CompletionEvent::Sent { .. }))
                .count();
        }
    });
    start.elapsed()
}

fn socket_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (b, _) = listener.accept().unwrap();
    a.set_nodelay(true).unwrap();
    b.set_nodelay(true).unwrap();
    (a, b)
}

fn throughput(c: &mut Criterion) {
    let (zero, one) = pair();
    let mut source_bytes = vec![7u8; BIG];
    let mut target_bytes = vec![0u8; BIG];
    let source = register(&one, &mut source_bytes);
    let target = register(&zero, &mut target_bytes);
    let (mut writer, mut reader) = socket_pair();
    let plain_source = vec![7u8; BIG];
    let mut plain_target = vec![0u8; BIG];

    let mut group = c.benchmark_group("throughput");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(4))
        .warm_up_time(Duration::from_secs(1));
    for (name, size) in [("1MiB", 1usize << 20), ("64MiB", BIG)] {
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function(format!("fabric/{name}"), |b| {
            b.iter_custom(|iters| {
                stream_fabric(&one, &zero, &source, target.remote(), size, iters)
            });
        });
        group.bench_function(format!("socket/{name}"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                std::thread::scope(|s| {
                    let target = &mut plain_target[..size];
                    let reader = &mut reader;
                    s.spawn(move || {
                        for _ in 0..iters {
                            reader.read_exact(target).unwrap();
                        }
                    });
                    for _ in 0..iters {
                        writer.write_all(&plain_source[..size]).unwrap();
                    }
                });
                start.elapsed()
            });
        });
    }
    group.finish();
}

fn round_trip(c: &mut Criterion) {
    let (zero, one) = pair();
    let mut ping_bytes = [1u8; 8];
    let mut pong_bytes = [2u8; 8];
    let mut ping_target = [0u8; 8];
    let mut pong_target = [0u8; 8];
    let ping = register(&one, &mut ping_bytes);
    let pong = register(&zero, &mut pong_bytes);
    let at_zero = register(&zero, &mut ping_target);
    let at_one = register(&one, &mut pong_target);
    let (mut a, mut b) = socket_pair();

    let mut group = c.benchmark_group("round_trip");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_secs(1));
    group.bench_function("fabric", |bencher| {
        bencher.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                let (zero, pong, at_one) = (&zero, &pong, at_one.remote());
                s.spawn(move || {
                    let mut out = [blank(); 64];
                    let mut echoed = 0;
                    while echoed < iters {
                        let n = zero.wait(&mut out, Duration::from_secs(30));
                        for c in &out[..n] {
                            if let CompletionEvent::Landed { .. } = c.event {
                                let back = WriteRequest {
                                    source: pong,
                                    source_offset: 0,
                                    len: 8,
                                    target: at_one,
                                    target_offset: 0,
                                    immediate: 0,
                                    token: 0,
                                };
                                zero.write(1, back).unwrap();
                                echoed += 1;
                            }
                        }
                    }
                });
                let mut out = [blank(); 64];
                for i in 0..iters {
                    let request = WriteRequest {
                        source: &ping,
                        source_offset: 0,
                        len: 8,
                        target: at_zero.remote(),
                        target_offset: 0,
                        immediate: 0,
                        token: i,
                    };
                    one.write(0, request).unwrap();
                    let mut back = false;
                    while !back {
                        let n = one.wait(&mut out, Duration::from_secs(30));
                        back = out[..n]
                            .iter()
                            .any(|c| matches!(c.event, CompletionEvent::Landed { .. }));
                    }
                }
            });
            start.elapsed()
        });
    });
    group.bench_function("socket", |bencher| {
        bencher.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                let b = &mut b;
                s.spawn(move || {
                    let mut buf = [0u8; 8];
                    for _ in 0..iters {
                        b.read_exact(&mut buf).unwrap();
                        b.write_all(&buf).unwrap();
                    }
                });
                let mut buf = [0u8; 8];
                for _ in 0..iters {
                    a.write_all(&[1; 8]).unwrap();
                    a.read_exact(&mut buf).unwrap();
                }
            });
            start.elapsed()
        });
    });
    group.finish();
}

criterion_group!(benches, throughput, round_trip);
criterion_main!(benches);
