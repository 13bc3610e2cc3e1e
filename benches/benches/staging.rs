//! The staging state machine: one slice's events on one thread, and two threads
//! contending for one word.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fairring_core::staging::{Event, Role, StagingState};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// A server in an 8-machine job with 8 shards: 7 sends and 7 receives each way.
const SERVER: Role = Role {
    contributions_to_send: 7,
    contributions_to_receive: 7,
    results_to_send: 7,
    results_to_receive: 7,
    reduces: true,
    forwards: false,
};

/// One whole slice: acquire, then every event in a legal order. 31 transitions.
fn slice(state: &StagingState, generation: u64) {
    state.acquire(generation, SERVER).unwrap();
    let step = |e| black_box(state.on_event(e, generation).unwrap());
    step(Event::ReduceScatterDone);
    for _ in 0..7 {
        step(Event::ContributionReceived);
        step(Event::ContributionSent);
    }
    step(Event::Reduced);
    for _ in 0..7 {
        step(Event::ResultReceived);
        step(Event::ResultSent);
    }
    step(Event::AllGatherDone);
}

fn staging(c: &mut Criterion) {
    let mut group = c.benchmark_group("staging");
    group.throughput(Throughput::Elements(31));
    group.bench_function("slice_single_thread", |b| {
        let state = StagingState::new();
        let mut generation = 0;
        b.iter(|| {
            slice(&state, generation);
            generation += 1;
        })
    });

    // Two threads deliver the 4095 contributions of one slice to one word at once:
    // every transition contends for the same cache line.
    let contended = Role {
        contributions_to_send: 0,
        contributions_to_receive: 4094,
        results_to_send: 1,
        results_to_receive: 0,
        reduces: true,
        forwards: false,
    };
    group.throughput(Throughput::Elements(4094));
    group.bench_function("contended_two_threads", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for generation in 0..iters {
                let state = StagingState::new();
                state.acquire(0, contended).unwrap();
                let start = Instant::now();
                std::thread::scope(|s| {
                    for _ in 0..2 {
                        s.spawn(|| {
                            for _ in 0..2047 {
                                black_box(state.on_event(Event::ContributionReceived, 0).unwrap());
                            }
                        });
                    }
                });
                total += start.elapsed();
                black_box(generation);
            }
            total
        })
    });
    group.finish();
}

criterion_group!(benches, staging);
criterion_main!(benches);
