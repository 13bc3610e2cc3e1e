//! Criterion benches of the GPU layer, for a GPU machine (the kit carries
//! this executable as `device-benches`; `ci/gpu-check long` runs it):
//!
//! - the device reduction kernels over 64 MiB operands: pairwise (`dst op=
//!   src`) and many-source (`dst op= src_1 op ... op src_k`, k from 1 to 7,
//!   a server's contributions in one pass), f32 and bf16, beside a
//!   device-to-device copy of the same bytes, the bound: throughput counts
//!   every byte read and written, so a kernel's rate over the copy's is its
//!   fraction of the copy bound;
//! - one NCCL step of the machine's all-reduce: an in-place all-reduce of 64
//!   MiB on a communicator of this process's GPU (its launch and its pass
//!   over the bytes; a machine's other ranks are processes, which a
//!   criterion run is not).
//!
//! Each operation is timed to its end on the device (the stream
//! synchronised). Without a CUDA device, NVRTC or NCCL, each group says why
//! on stderr and measures nothing.

use std::sync::Arc;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fairring_core::{DataType, ReduceOp};
use fairring_cuda::nccl::{Communicator, UniqueId};
use fairring_cuda::{Device, DeviceBuffer, ReductionKernels, Stream};

const BYTES: usize = 64 << 20;

/// The most sources a many-source case folds: the contributions a server of
/// an 8-machine job reduces.
const MOST_SOURCES: usize = 7;

/// GPU 0, or why not.
fn device() -> Option<Arc<Device>> {
    if !fairring_cuda::cuda_available() {
        eprintln!("device benches: skipped: no CUDA driver here");
        return None;
    }
    Device::open(0)
        .map_err(|e| eprintln!("device benches: skipped: {e}"))
        .ok()
}

fn kernels(c: &mut Criterion) {
    let Some(device) = device() else {
        return;
    };
    let ready = (|| {
        let kernels = ReductionKernels::load(&device)?;
        let stream = Stream::new(&device, false)?;
        let dst = DeviceBuffer::zeroed(&device, BYTES)?;
        let srcs = (0..MOST_SOURCES)
            .map(|_| DeviceBuffer::zeroed(&device, BYTES))
            .collect::<fairring_cuda::Result<Vec<_>>>()?;
        Ok::<_, fairring_cuda::Error>((kernels, stream, dst, srcs))
    })();
    let (kernels, stream, mut dst, srcs) = match ready {
        Ok(ready) => ready,
        Err(e) => {
            eprintln!("device benches: kernels skipped: {e}");
            return;
        }
    };
    let mut group = c.benchmark_group("device_reduce_64MiB");
    group.sample_size(20);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes(2 * BYTES as u64));
    group.bench_function("copy", |b| {
        b.iter(|| {
            stream.copy(&mut dst.slice_mut(), srcs[0].slice()).unwrap();
            stream.synchronize().unwrap();
        });
    });
    for dtype in [DataType::F32, DataType::BF16] {
        group.throughput(Throughput::Bytes(3 * BYTES as u64));
        group.bench_function(BenchmarkId::new("pairwise sum", dtype), |b| {
            b.iter(|| {
                let (d, s) = (&mut dst.slice_mut(), srcs[0].slice());
                kernels.reduce(&stream, dtype, ReduceOp::Sum, d, s).unwrap();
                stream.synchronize().unwrap();
            });
        });
        for k in 1..=MOST_SOURCES {
            group.throughput(Throughput::Bytes((k as u64 + 2) * BYTES as u64));
            let id = BenchmarkId::new(format!("many-source sum {dtype}"), k);
            group.bench_function(id, |b| {
                let views: Vec<_> = srcs[..k].iter().map(DeviceBuffer::slice).collect();
                b.iter(|| {
                    let d = &mut dst.slice_mut();
                    kernels
                        .reduce_many(&stream, dtype, ReduceOp::Sum, d, &views)
                        .unwrap();
                    stream.synchronize().unwrap();
                });
            });
        }
    }
    group.finish();
}

fn nccl_step(c: &mut Criterion) {
    let Some(device) = device() else {
        return;
    };
    let ready = (|| {
        let id = UniqueId::new()?;
        let comm = Communicator::new(&device, 0, 1, &id, Duration::from_secs(60))?;
        let stream = Stream::new(&device, false)?;
        let buffer = DeviceBuffer::zeroed(&device, BYTES)?;
        Ok::<_, fairring_cuda::Error>((comm, stream, buffer))
    })();
    let (comm, stream, mut buffer) = match ready {
        Ok(ready) => ready,
        Err(e) => {
            eprintln!("device benches: NCCL step skipped: {e}");
            return;
        }
    };
    let mut group = c.benchmark_group("nccl_step_64MiB");
    group.sample_size(20);
    group.warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Bytes(BYTES as u64));
    group.bench_function("all-reduce in place, f32 sum", |b| {
        b.iter(|| {
            let view = &mut buffer.slice_mut();
            comm.all_reduce_in_place(&stream, view, DataType::F32, ReduceOp::Sum)
                .unwrap();
            stream.synchronize().unwrap();
        });
    });
    group.finish();
}

criterion_group!(benches, kernels, nccl_step);
criterion_main!(benches);
