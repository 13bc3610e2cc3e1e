//! Host reduction kernels against the memory-bandwidth bound: a `copy_from_slice` of
//! the same bytes, in the same group, so that the ratio is measured in one run.
//!
//! Throughput is counted as the bytes of `dst`. A copy reads and writes `dst`'s
//! size once each; `dst += src` reads two such buffers and writes one, so on a
//! bandwidth-bound machine it takes about 1.5x as long as the copy.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fairring_core::ReduceOp;
use fairring_core::reduce::{self, Element};
use half::{bf16, f16};
use std::hint::black_box;
use std::time::Duration;

const BYTES: usize = 64 << 20;

fn buffers<T: Element>(x: T) -> (Vec<T>, Vec<T>) {
    let n = BYTES / size_of::<T>();
    (vec![x; n], vec![x; n])
}

fn typed<T: Element>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    x: T,
    ops: &[ReduceOp],
) {
    let (mut dst, src) = buffers(x);
    for &op in ops {
        group.bench_function(BenchmarkId::new(name, op.name()), |b| {
            b.iter(|| reduce::reduce(op, black_box(&mut dst), black_box(&src)).unwrap())
        });
    }
}

fn kernels(c: &mut Criterion) {
    let mut group = c.benchmark_group("reduce_64MiB");
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));

    let (mut dst, src) = buffers(1.0f32);
    group.bench_function("copy_from_slice", |b| {
        b.iter(|| black_box(&mut dst).copy_from_slice(black_box(&src)))
    });
    typed(&mut group, "f32", 1.0f32, ReduceOp::ALL);
    typed(&mut group, "f64", 1.0f64, &[ReduceOp::Sum]);
    typed(&mut group, "f16", f16::ONE, &[ReduceOp::Sum]);
    typed(&mut group, "bf16", bf16::ONE, &[ReduceOp::Sum]);
    typed(&mut group, "i32", 1i32, &[ReduceOp::Sum, ReduceOp::Max]);
    typed(&mut group, "i64", 1i64, &[ReduceOp::Sum]);
    typed(&mut group, "u8", 1u8, &[ReduceOp::Sum]);
    typed(&mut group, "i8", 1i8, &[ReduceOp::Sum]);
    group.finish();

    // A server's reduction in an 8-machine job: 7 contributions into its slot, in
    // one pass (`reduce_many`) or pairwise. The slot and contributions lie in one
    // staging buffer as `StagingLayout` places them (strides of an odd number of
    // cache lines).
    let mut group = c.benchmark_group("reduce_many_8MiB");
    let n = (8 << 20) / 4;
    let stride = n + 16;
    group.throughput(Throughput::Bytes(8 << 20));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(3));
    let mut buffer = vec![1.0f32; n + 7 * stride];
    let (slot, areas) = buffer.split_at_mut(n);
    let views: Vec<&[f32]> = (0..7).map(|i| &areas[i * stride..i * stride + n]).collect();
    group.bench_function("f32_sum_7_sources_one_pass", |b| {
        b.iter(|| {
            reduce::reduce_many(ReduceOp::Sum, black_box(&mut *slot), black_box(&views)).unwrap()
        })
    });
    group.bench_function("f32_sum_7_sources_pairwise", |b| {
        b.iter(|| {
            for s in &views {
                reduce::reduce(ReduceOp::Sum, black_box(&mut *slot), black_box(s)).unwrap();
            }
        })
    });
    group.finish();
}

/// The compressed wire's passes over 16 MiB of `f32` (a 2x2 job's slot at 64
/// MiB), beside a copy of the same bytes: narrowing and widening where the
/// values lie, and a reduction of one narrow source into `f32`.
fn compressed(c: &mut Criterion) {
    use fairring_core::WireFormat;
    use fairring_core::reduce::{narrow_in_place, reduce_many_compressed_bytes, widen_in_place};
    let n = (16 << 20) / 4;
    let mut group = c.benchmark_group("compressed_16MiB");
    group.throughput(Throughput::Bytes(16 << 20));
    group.sample_size(10);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    let (mut dst, src) = (vec![1.5f32; n], vec![1.5f32; n]);
    group.bench_function("copy_from_slice", |b| {
        b.iter(|| black_box(&mut dst).copy_from_slice(black_box(&src)))
    });
    for wire in [WireFormat::Bf16, WireFormat::F16] {
        let mut values = vec![1.5f32; n];
        group.bench_function(
            BenchmarkId::new("narrow_widen_in_place", wire.name()),
            |b| {
                b.iter(|| {
                    let bytes: &mut [u8] = bytemuck::cast_slice_mut(black_box(&mut values));
                    narrow_in_place(wire, bytes).unwrap();
                    widen_in_place(wire, bytes).unwrap();
                })
            },
        );
        let narrow = vec![0u16; n];
        group.bench_function(
            BenchmarkId::new("sum_one_narrow_source", wire.name()),
            |b| {
                b.iter(|| {
                    reduce_many_compressed_bytes(
                        ReduceOp::Sum,
                        wire,
                        bytemuck::cast_slice_mut(black_box(&mut dst)),
                        &[bytemuck::cast_slice(black_box(&narrow))],
                    )
                    .unwrap()
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, kernels, compressed);
criterion_main!(benches);
