//! Collectives on device tensors (the `cuda` feature), through the engine: jobs
//! of ranks that are threads of this process sharing GPU 0, each its own
//! machine (a host identity of its own), over the tcp fabric.
//!
//! Each test is ignored with its reason on a machine without a GPU; run them
//! where one exists with `cargo test --features cuda --test device_collectives
//! -- --include-ignored`, where they fail loudly if the device is missing.
#![cfg(feature = "cuda")]
#![expect(
    clippy::cast_possible_truncation,
    reason = "test values and counts are small"
)]

mod common;

use std::sync::Arc;

use fairring::cuda::{Device, DeviceBuffer, PinnedBuffer, ReductionKernels, Stream};
use fairring::{Algorithm, DataType, Error, ReduceOp};

use common::{job, small_slices};

/// GPU 0, or a loud failure naming what is missing.
fn device() -> Arc<Device> {
    Device::open(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"))
}

/// Readies `comm` for device operations once every rank has allocated what it
/// needs: one device all-reduce waited for on the host (it makes each rank's
/// device side), then a barrier.
///
/// The ranks of these tests are threads of one process sharing one context,
/// so one rank's synchronising driver call (allocating, freeing, registering
/// memory) waits for another rank's streams; a stream that waits for an
/// operation (`enqueue_wait`) waits for the other ranks too. Each test
/// therefore allocates before this and frees only after [`settle`] (a free
/// while another rank's stream waits for an operation this rank has not yet
/// submitted would wait for ever).
fn ready(comm: &fairring::Communicator, device: &Arc<Device>, stream: &Stream) {
    let mut one = upload(device, stream, &encode(DataType::F32, std::iter::once(1)));
    let mut view = one.slice_mut();
    comm.scope(|s| {
        s.all_reduce_device(&mut view, DataType::F32, ReduceOp::Sum, stream)?
            .wait()
    })
    .unwrap_or_else(|e| panic!("rank {}: the first device all-reduce: {e}", comm.rank()));
    // Freed before the barrier: once past it, another rank's stream may wait
    // for an operation this rank has yet to submit.
    drop(one);
    comm.barrier().unwrap();
}

/// Every rank's device operations have finished (see [`ready`]).
fn settle(comm: &fairring::Communicator, stream: &Stream) {
    stream.synchronize().unwrap();
    comm.barrier().unwrap();
}

/// Rank `rank`'s element `i`: small integers, so that every sum is exact in
/// every type and every order.
fn value(rank: u32, i: usize) -> i64 {
    ((i * 7 + rank as usize * 13) % 29) as i64 - 9
}

fn encode(dtype: DataType, values: impl Iterator<Item = i64>) -> Vec<u8> {
    let mut out = Vec::new();
    for v in values {
        match dtype {
            DataType::F32 => out.extend((v as f32).to_le_bytes()),
            DataType::F64 => out.extend((v as f64).to_le_bytes()),
            DataType::I32 => out.extend((v as i32).to_le_bytes()),
            DataType::I64 => out.extend(v.to_le_bytes()),
            DataType::BF16 => out.extend(half::bf16::from_f32(v as f32).to_le_bytes()),
            DataType::F16 => out.extend(half::f16::from_f32(v as f32).to_le_bytes()),
            other => panic!("no encoding for {other}"),
        }
    }
    out
}

/// What every rank holds after all-reducing `n` elements with `op` in a job of
/// `world` ranks.
fn expected(dtype: DataType, op: ReduceOp, world: u32, n: usize) -> Vec<u8> {
    let values = (0..n).map(|i| {
        let all = (0..world).map(|r| value(r, i));
        match op {
            ReduceOp::Sum => all.sum(),
            ReduceOp::Max => all.max().unwrap_or(0),
            ReduceOp::Min => all.min().unwrap_or(0),
            other => panic!("no expectation for {other}"),
        }
    });
    encode(dtype, values)
}

/// Uploads `bytes` into a fresh device buffer.
fn upload(device: &Arc<Device>, stream: &Stream, bytes: &[u8]) -> DeviceBuffer {
    let mut buf = DeviceBuffer::zeroed(device, bytes.len().max(1)).unwrap();
    if !bytes.is_empty() {
        stream.upload_blocking(&mut buf.slice_mut(), bytes).unwrap();
    }
    buf
}

fn download(stream: &Stream, buf: &DeviceBuffer, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    if len > 0 {
        stream
            .download_blocking(&mut out, buf.slice().range(0..len).unwrap())
            .unwrap();
    }
    out
}

#[test]
#[ignore = "needs a CUDA device"]
fn device_all_reduces_are_exact_for_every_layout_type_operator_and_size() {
    // Sizes: none, one element, an odd count, and several slices (64 KiB
    // slices).
    let sizes = [0usize, 1, 1001, 3 * 16384 + 7];
    let cases = [
        (DataType::F32, ReduceOp::Sum),
        (DataType::F32, ReduceOp::Max),
        (DataType::F64, ReduceOp::Sum),
        (DataType::I32, ReduceOp::Min),
        (DataType::I64, ReduceOp::Sum),
        (DataType::BF16, ReduceOp::Sum),
        (DataType::F16, ReduceOp::Max),
    ];
    for m in [1u32, 2, 3, 4] {
        for algorithm in [Algorithm::Hierarchical, Algorithm::Ring] {
            eprintln!("{m}x1 {algorithm}");
            let failures = job(
                m,
                1,
                |b| small_slices(b, algorithm),
                |rank, comm| {
                    let device = device();
                    let stream = Stream::new(&device, false).unwrap();
                    let mut buf = DeviceBuffer::zeroed(&device, sizes[3] * 8).unwrap();
                    ready(comm, &device, &stream);
                    let mut failures = Vec::new();
                    for &(dtype, op) in &cases {
                        for &n in &sizes {
                            let input = encode(dtype, (0..n).map(|i| value(rank, i)));
                            let mut view = buf.slice_mut().split_at(input.len()).unwrap().0;
                            stream.upload_blocking(&mut view, &input).unwrap();
                            comm.scope(|s| {
                                let w = s.all_reduce_device(&mut view, dtype, op, &stream)?;
                                w.enqueue_wait(&stream)?;
                                w.wait()
                            })
                            .unwrap_or_else(|e| {
                                panic!("rank {rank}: {m}x1 {algorithm} {dtype} {op} x{n}: {e}")
                            });
                            let got = download(&stream, &buf, input.len());
                            if got != expected(dtype, op, m, n) {
                                failures.push(format!("{m}x1 {algorithm} {dtype} {op} x{n}"));
                            }
                            // Every rank's operation is over before the next
                            // copies (see `ready`).
                            comm.barrier().unwrap();
                        }
                    }
                    settle(comm, &stream);
                    failures
                },
            );
            for (rank, f) in failures.iter().enumerate() {
                assert!(f.is_empty(), "rank {rank}: wrong results for {f:?}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn many_device_operations_in_flight_all_finish_exact() {
    let n = 20_000usize;
    let ops = 12u32;
    let results = job(
        3,
        1,
        |b| small_slices(b, Algorithm::Hierarchical),
        |rank, comm| {
            let device = device();
            let stream = Stream::new(&device, false).unwrap();
            let inputs: Vec<Vec<u8>> = (0..ops)
                .map(|k| encode(DataType::F32, (0..n).map(|i| value(rank + k, i))))
                .collect();
            let mut bufs: Vec<DeviceBuffer> =
                inputs.iter().map(|x| upload(&device, &stream, x)).collect();
            ready(comm, &device, &stream);
            let mut views: Vec<_> = bufs.iter_mut().map(|b| b.slice_mut()).collect();
            comm.scope(|s| {
                let works = views
                    .iter_mut()
                    .map(|v| s.all_reduce_device(v, DataType::F32, ReduceOp::Sum, &stream))
                    .collect::<fairring::Result<Vec<_>>>()?;
                for w in &works {
                    w.enqueue_wait(&stream)?;
                }
                works.into_iter().try_for_each(fairring::Work::wait)
            })
            .unwrap();
            let outs = (0..ops as usize)
                .map(|k| download(&stream, &bufs[k], inputs[k].len()))
                .collect::<Vec<_>>();
            settle(comm, &stream);
            outs
        },
    );
    for (rank, outs) in results.iter().enumerate() {
        for (k, got) in outs.iter().enumerate() {
            let want = encode(
                DataType::F32,
                (0..n).map(|i| (0..3).map(|r| value(r + k as u32, i)).sum()),
            );
            assert!(got == &want, "rank {rank}, operation {k}: wrong result");
        }
    }
}

/// A kernel enqueued on the caller's stream before the all-reduce writes its
/// input, and one enqueued after it reads the result, with no host
/// synchronisation in between: the collective is ordered on the stream.
#[test]
#[ignore = "needs a CUDA device"]
fn the_collective_is_ordered_on_the_callers_stream() {
    let n = 1 << 20; // f32 elements: 4 MiB, many slices
    let rounds = 20;
    let results = job(
        2,
        1,
        |b| b.algorithm(Algorithm::Hierarchical),
        |rank, comm| {
            let device = device();
            let kernels = ReductionKernels::load(&device).unwrap();
            let stream = Stream::new(&device, false).unwrap();
            let ones = upload(&device, &stream, &encode(DataType::F32, (0..n).map(|_| 1)));
            let mut data = DeviceBuffer::zeroed(&device, n * 4).unwrap();
            let mut after = DeviceBuffer::zeroed(&device, n * 4).unwrap();
            let mut host = PinnedBuffer::zeroed(&device, n * 4).unwrap();
            stream.synchronize().unwrap();
            ready(comm, &device, &stream);
            let mut run = || -> fairring::Result<()> {
                // Before: `rounds` kernels write the input (data = rounds).
                for _ in 0..rounds {
                    kernels
                        .reduce(
                            &stream,
                            DataType::F32,
                            ReduceOp::Sum,
                            &mut data.slice_mut(),
                            ones.slice(),
                        )
                        .unwrap();
                }
                // SAFETY: nothing but work ordered after `enqueue_wait` on
                // `stream` touches `data` until the operation finishes.
                let w = unsafe {
                    comm.all_reduce_device_raw(
                        data.raw(),
                        n as u64,
                        DataType::F32,
                        ReduceOp::Sum,
                        stream.raw(),
                        None,
                    )?
                };
                w.enqueue_wait(&stream)?;
                // After: a kernel reads the result (after = result), and a copy
                // brings it to the host, all on the stream.
                kernels
                    .reduce(
                        &stream,
                        DataType::F32,
                        ReduceOp::Sum,
                        &mut after.slice_mut(),
                        data.slice(),
                    )
                    .unwrap();
                // SAFETY: the host reads `host` only after synchronising below.
                unsafe { stream.copy_to_host(host.as_mut_slice(), after.slice()) }.unwrap();
                w.wait()
            };
            run().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            settle(comm, &stream);
            let want = (2 * rounds) as f32;
            host.as_slice()
                .chunks_exact(4)
                .filter(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want)
                .count()
        },
    );
    assert_eq!(
        results,
        vec![0, 0],
        "elements differing from the ordered result"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_rank_passing_host_memory_where_another_passes_device_memory_is_a_mismatch() {
    let n = 4096;
    let results = job(
        2,
        1,
        |b| b.algorithm(Algorithm::Hierarchical),
        |rank, comm| {
            let device = device();
            let stream = Stream::new(&device, false).unwrap();
            if rank == 0 {
                let mut buf = upload(&device, &stream, &vec![0u8; n * 4]);
                let mut view = buf.slice_mut();
                comm.scope(|s| {
                    s.all_reduce_device(&mut view, DataType::F32, ReduceOp::Sum, &stream)?
                        .wait()
                })
            } else {
                let mut host = vec![0f32; n];
                comm.all_reduce(&mut host, ReduceOp::Sum)
            }
        },
    );
    for (rank, r) in results.iter().enumerate() {
        match r {
            Err(Error::Mismatch {
                called,
                peer_called,
                ..
            }) => {
                let both = format!("{called} / {peer_called}");
                assert!(both.contains("device memory"), "rank {rank}: {both}");
            }
            Err(Error::Failed { first }) if matches!(**first, Error::Mismatch { .. }) => {}
            other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn host_memory_passed_as_device_memory_is_refused_naming_data() {
    let results = job(
        1,
        1,
        |b| b,
        |_, comm| {
            let device = device();
            let stream = Stream::new(&device, false).unwrap();
            let mut host = vec![0f32; 16];
            // SAFETY: refused before anything touches the memory.
            let r = unsafe {
                comm.all_reduce_device_raw(
                    host.as_mut_ptr() as u64,
                    16,
                    DataType::F32,
                    ReduceOp::Sum,
                    stream.raw(),
                    None,
                )
            };
            match r {
                Err(Error::InvalidArgument { argument, .. }) => argument,
                Err(e) => panic!("expected a refusal naming data, got {e}"),
                Ok(_) => panic!("host memory was taken for device memory"),
            }
        },
    );
    assert_eq!(results, vec!["data"]);
}

#[test]
#[ignore = "needs a CUDA device"]
fn several_ranks_per_machine_are_refused_with_a_reason() {
    let results = job(
        1,
        2,
        |b| b,
        |_, comm| {
            let device = device();
            let stream = Stream::new(&device, false).unwrap();
            let mut buf = upload(&device, &stream, &[0u8; 64]);
            let mut view = buf.slice_mut();
            let r = comm.scope(|s| {
                s.all_reduce_device(&mut view, DataType::F32, ReduceOp::Sum, &stream)
                    .map(drop)
            });
            match r {
                Err(Error::InvalidArgument { argument, reason }) => {
                    assert!(reason.contains("NCCL"), "{reason}");
                    argument
                }
                other => panic!("expected a refusal, got {other:?}"),
            }
        },
    );
    assert_eq!(results, vec!["data", "data"]);
}
