//! Tests on a CUDA device. Each is ignored with its reason on a machine without
//! one; run them where a device exists with
//! `cargo test -p fairring-cuda --test gpu -- --include-ignored` (NCCL and NVRTC
//! on the loader path, see the README), where they fail loudly if the device or
//! a library is missing.
//!
//! One file, longer than most: the GPU kit carries one executable per suite
//! (`ci/gpu-build`), and this is the GPU layer's.
#![expect(
    clippy::cast_possible_truncation,
    reason = "test sizes are small; random bits are truncated on purpose"
)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairring_core::plan::{Geometry, PlanConfig};
use fairring_core::reduce::{finish_avg_bytes, reduce_bytes, reduce_many_bytes};
use fairring_core::topology::{RankLayout, Topology};
use fairring_core::{DataType, ReduceOp};
use fairring_cuda::nccl::{Communicator, UniqueId, group};
use fairring_cuda::{
    Device, DeviceBuffer, DeviceSlice, DeviceSliceMut, Error, Event, HostStaging, PinnedBuffer,
    ReductionKernels, Stage, StagingPool, Stream, Timing,
};

const OPERATORS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
];

/// Device 0, or a loud failure naming what is missing.
fn device() -> Arc<Device> {
    Device::for_local_rank(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"))
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// `n` elements of `dtype` as bytes: random values, with the special values of
/// float types (NaN, infinities, zeros of both signs, subnormals) mixed in.
fn elements(dtype: DataType, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    let mut out = Vec::with_capacity(n * dtype.size_bytes() as usize);
    for i in 0..n {
        let r = rng.next();
        let special = i % 17 == 5;
        match dtype {
            DataType::F32 => {
                let specials = [f32::NAN, f32::INFINITY, -0.0, 0.0, 1e-40, -1e-39];
                let v = if special {
                    specials[(r % 6) as usize]
                } else {
                    ((r >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * 200.0
                };
                out.extend_from_slice(&v.to_le_bytes());
            }
            DataType::F64 => {
                let specials = [f64::NAN, f64::NEG_INFINITY, -0.0, 0.0, 1e-310, 5e-324];
                let v = if special {
                    specials[(r % 6) as usize]
                } else {
                    ((r >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 1e6
                };
                out.extend_from_slice(&v.to_le_bytes());
            }
            DataType::F16 => {
                let specials = [0x7E00u16, 0x7C00, 0x8000, 0x0000, 0x0001, 0x83FF];
                let bits = if special {
                    specials[(r % 6) as usize]
                } else {
                    half::f16::from_f32(((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 100.0)
                        .to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            DataType::BF16 => {
                let specials = [0x7FC0u16, 0xFF80, 0x8000, 0x0000, 0x0001, 0x807F];
                let bits = if special {
                    specials[(r % 6) as usize]
                } else {
                    half::bf16::from_f32(((r >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1e4)
                        .to_bits()
                };
                out.extend_from_slice(&bits.to_le_bytes());
            }
            DataType::I32 => out.extend_from_slice(&(r as u32).to_le_bytes()),
            DataType::I64 => out.extend_from_slice(&r.to_le_bytes()),
            DataType::U8 | DataType::I8 => out.push(r as u8),
            DataType::I16 => out.extend_from_slice(&(r as u16).to_le_bytes()),
            // A third false, the rest true, in bytes other than 1 as well.
            DataType::Bool => out.push(if r.is_multiple_of(3) {
                0
            } else {
                (r >> 8) as u8 | 1
            }),
        }
    }
    out
}

/// Whether two elements agree: the same bits, or both NaN (payloads may differ).
fn same(dtype: DataType, a: &[u8], b: &[u8]) -> bool {
    if a == b {
        return true;
    }
    match dtype {
        DataType::F32 => {
            f32::from_le_bytes(a.try_into().unwrap()).is_nan()
                && f32::from_le_bytes(b.try_into().unwrap()).is_nan()
        }
        DataType::F64 => {
            f64::from_le_bytes(a.try_into().unwrap()).is_nan()
                && f64::from_le_bytes(b.try_into().unwrap()).is_nan()
        }
        DataType::F16 => {
            let nan = |x: &[u8]| u16::from_le_bytes(x.try_into().unwrap()) & 0x7FFF > 0x7C00;
            nan(a) && nan(b)
        }
        DataType::BF16 => {
            let nan = |x: &[u8]| u16::from_le_bytes(x.try_into().unwrap()) & 0x7FFF > 0x7F80;
            nan(a) && nan(b)
        }
        _ => false,
    }
}

fn assert_same(dtype: DataType, got: &[u8], want: &[u8], what: &str) {
    let size = dtype.size_bytes() as usize;
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
        assert!(
            same(dtype, g, w),
            "{what}: element {i} is {g:02x?}, expected {w:02x?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_kernel_matches_the_host_kernels_for_every_type_operator_size_and_alignment() {
    let device = device();
    let kernels = ReductionKernels::load(&device).unwrap();
    let stream = Stream::new(&device, false).unwrap();
    for dtype in DataType::ALL.iter().copied() {
        let size = dtype.size_bytes() as usize;
        for op in OPERATORS.into_iter().filter(|op| op.supports(dtype)) {
            for n in [1usize, 3, (1 << 20) + 7] {
                // Element offsets of dst and src in their buffers: aligned, both off
                // by one element, and off by different amounts (the scalar path).
                for (dst_off, src_off) in [(0usize, 0usize), (1, 1), (0, 1)] {
                    let what = format!("{dtype} {op} n={n} offsets=({dst_off},{src_off})");
                    let dst_host = elements(dtype, n, 0x1234 + n as u64);
                    let src_host = elements(dtype, n, 0x9876 + n as u64);
                    let mut want = dst_host.clone();
                    reduce_bytes(dtype, op, &mut want, &src_host).unwrap();
                    if op == ReduceOp::Avg {
                        finish_avg_bytes(dtype, &mut want, 3).unwrap();
                    }
                    let dst_buf = DeviceBuffer::zeroed(&device, (n + 2) * size).unwrap();
                    let src_buf = DeviceBuffer::zeroed(&device, (n + 2) * size).unwrap();
                    let bytes = n * size;
                    // Views made from raw addresses, as a host runtime hands them over.
                    // SAFETY: in bounds of the buffers, which outlive every use below.
                    let mut dst = unsafe {
                        DeviceSliceMut::from_raw(
                            dst_buf.raw() + (dst_off * size) as u64,
                            bytes,
                            &device,
                        )
                    };
                    // SAFETY: as above.
                    let mut src_w = unsafe {
                        DeviceSliceMut::from_raw(
                            src_buf.raw() + (src_off * size) as u64,
                            bytes,
                            &device,
                        )
                    };
                    stream.upload_blocking(&mut dst, &dst_host).unwrap();
                    stream.upload_blocking(&mut src_w, &src_host).unwrap();
                    kernels
                        .reduce(&stream, dtype, op, &mut dst, src_w.as_slice())
                        .unwrap();
                    if op == ReduceOp::Avg {
                        kernels.finish_avg(&stream, dtype, &mut dst, 3).unwrap();
                    }
                    let mut got = vec![0u8; bytes];
                    stream.download_blocking(&mut got, dst.as_slice()).unwrap();
                    assert_same(dtype, &got, &want, &what);
                    // The kernel wrote nothing outside dst.
                    let mut whole = vec![0u8; (n + 2) * size];
                    stream
                        .download_blocking(&mut whole, dst_buf.slice())
                        .unwrap();
                    assert!(
                        whole[..dst_off * size].iter().all(|b| *b == 0),
                        "{what}: before dst"
                    );
                    assert!(
                        whole[dst_off * size + bytes..].iter().all(|b| *b == 0),
                        "{what}: after dst"
                    );
                }
            }
        }
    }
}

/// The many-source kernel against the host's `reduce_many`, for every type
/// and operator, one source to more than one launch takes, aligned and not.
#[test]
#[ignore = "needs a CUDA device"]
fn the_many_source_kernel_matches_the_host_reduce_many() {
    let device = device();
    let kernels = ReductionKernels::load(&device).unwrap();
    let stream = Stream::new(&device, false).unwrap();
    let most = ReductionKernels::MAX_SOURCES;
    for dtype in DataType::ALL.iter().copied() {
        let size = dtype.size_bytes() as usize;
        for op in OPERATORS.into_iter().filter(|op| op.supports(dtype)) {
            for n in [1usize, 1001, (1 << 20) + 7] {
                for k in [1usize, 3, 7, most + 1] {
                    // Every operand at the same offset, or one source off by an
                    // element (the scalar path).
                    for (dst_off, odd) in [(0usize, 0usize), (1, 1), (0, 1)] {
                        let what = format!("{dtype} {op} n={n} k={k} offsets=({dst_off},{odd})");
                        let dst_host = elements(dtype, n, 0x1234 + n as u64);
                        let srcs_host: Vec<Vec<u8>> = (0..k)
                            .map(|j| elements(dtype, n, 0x9876 + (n * 17 + j) as u64))
                            .collect();
                        // One launch folds at most `most` sources, rounding
                        // half-precision types once per launch.
                        let mut want = dst_host.clone();
                        for group in srcs_host.chunks(most) {
                            let views: Vec<&[u8]> = group.iter().map(Vec::as_slice).collect();
                            reduce_many_bytes(dtype, op, &mut want, &views).unwrap();
                        }
                        if op == ReduceOp::Avg {
                            finish_avg_bytes(dtype, &mut want, 3).unwrap();
                        }
                        let bytes = n * size;
                        let dst_buf = DeviceBuffer::zeroed(&device, (n + 2) * size).unwrap();
                        let src_bufs: Vec<DeviceBuffer> = (0..k)
                            .map(|_| DeviceBuffer::zeroed(&device, (n + 2) * size).unwrap())
                            .collect();
                        // SAFETY: in bounds of the buffer, which outlives every use.
                        let mut dst = unsafe {
                            DeviceSliceMut::from_raw(
                                dst_buf.raw() + (dst_off * size) as u64,
                                bytes,
                                &device,
                            )
                        };
                        stream.upload_blocking(&mut dst, &dst_host).unwrap();
                        let mut srcs = Vec::new();
                        for (j, (buf, host)) in src_bufs.iter().zip(&srcs_host).enumerate() {
                            let off = if j == k / 2 { odd } else { dst_off };
                            // SAFETY: as above.
                            let mut view = unsafe {
                                DeviceSliceMut::from_raw(
                                    buf.raw() + (off * size) as u64,
                                    bytes,
                                    &device,
                                )
                            };
                            stream.upload_blocking(&mut view, host).unwrap();
                            // SAFETY: as above; read only from here on.
                            srcs.push(unsafe { DeviceSlice::from_raw(view.raw(), bytes, &device) });
                        }
                        kernels
                            .reduce_many(&stream, dtype, op, &mut dst, &srcs)
                            .unwrap();
                        if op == ReduceOp::Avg {
                            kernels.finish_avg(&stream, dtype, &mut dst, 3).unwrap();
                        }
                        let mut got = vec![0u8; bytes];
                        stream.download_blocking(&mut got, dst.as_slice()).unwrap();
                        assert_same(dtype, &got, &want, &what);
                        let mut whole = vec![0u8; (n + 2) * size];
                        stream
                            .download_blocking(&mut whole, dst_buf.slice())
                            .unwrap();
                        assert!(
                            whole[..dst_off * size].iter().all(|b| *b == 0),
                            "{what}: before dst"
                        );
                        assert!(
                            whole[dst_off * size + bytes..].iter().all(|b| *b == 0),
                            "{what}: after dst"
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn the_kernel_refuses_bad_operands_before_enqueueing() {
    let device = device();
    let kernels = ReductionKernels::load(&device).unwrap();
    let stream = Stream::new(&device, false).unwrap();
    let mut a = DeviceBuffer::zeroed(&device, 64).unwrap();
    let b = DeviceBuffer::zeroed(&device, 64).unwrap();
    let refused = |r: fairring_cuda::Result<()>, argument: &str| match r {
        Err(Error::InvalidArgument { argument: a, .. }) => assert_eq!(a, argument),
        other => panic!("expected {argument} to be refused, got {other:?}"),
    };
    let short = b.slice().range(0..32).unwrap();
    refused(
        kernels.reduce(
            &stream,
            DataType::F32,
            ReduceOp::Sum,
            &mut a.slice_mut(),
            short,
        ),
        "source",
    );
    refused(
        kernels.reduce(
            &stream,
            DataType::I32,
            ReduceOp::Avg,
            &mut a.slice_mut(),
            b.slice(),
        ),
        "reduce op",
    );
    let mut whole = a.slice_mut();
    let overlapping = {
        // SAFETY: the same live buffer, read only by the refused call.
        unsafe { DeviceSlice::from_raw(whole.raw() + 16, 48, &device) }
    };
    let mut first = whole.range(0..48).unwrap();
    refused(
        kernels.reduce(
            &stream,
            DataType::F32,
            ReduceOp::Sum,
            &mut first,
            overlapping,
        ),
        "source",
    );
    let odd = b.slice().range(1..9).unwrap();
    let mut eight = a.slice_mut();
    let mut eight = eight.range(0..8).unwrap();
    refused(
        kernels.reduce(&stream, DataType::F64, ReduceOp::Sum, &mut eight, odd),
        "source",
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_event_orders_a_second_stream_after_the_first() {
    let device = device();
    let first = Stream::new(&device, false).unwrap();
    let second = Stream::new(&device, false).unwrap();
    let bytes = 64 << 20;
    let mut flag = DeviceBuffer::zeroed(&device, bytes).unwrap();
    let mut big_a = DeviceBuffer::zeroed(&device, 256 << 20).unwrap();
    let big_b = DeviceBuffer::zeroed(&device, 256 << 20).unwrap();
    let mut seen = DeviceBuffer::zeroed(&device, bytes).unwrap();
    let ready = Event::new(&device, Timing::Disabled).unwrap();
    for round in 0..3u8 {
        let value = 0x20 + round;
        first.fill(&mut flag.slice_mut(), 0x11).unwrap();
        // Tens of milliseconds of unrelated work before the value the second
        // stream must see.
        for _ in 0..20 {
            first.copy(&mut big_a.slice_mut(), big_b.slice()).unwrap();
        }
        first.fill(&mut flag.slice_mut(), value).unwrap();
        ready.record(&first).unwrap();
        second.wait(&ready).unwrap();
        second.copy(&mut seen.slice_mut(), flag.slice()).unwrap();
        let mut host = vec![0u8; bytes];
        second.download_blocking(&mut host, seen.slice()).unwrap();
        assert!(
            host.iter().all(|b| *b == value),
            "round {round}: the copy ran before the event"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn events_report_completion_and_elapsed_time() {
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let start = Event::new(&device, Timing::Enabled).unwrap();
    let end = Event::new(&device, Timing::Enabled).unwrap();
    let mut a = DeviceBuffer::zeroed(&device, 256 << 20).unwrap();
    let b = DeviceBuffer::zeroed(&device, 256 << 20).unwrap();
    start.record(&stream).unwrap();
    for _ in 0..10 {
        stream.copy(&mut a.slice_mut(), b.slice()).unwrap();
    }
    end.record(&stream).unwrap();
    end.synchronize().unwrap();
    assert!(end.is_complete().unwrap());
    assert!(stream.is_idle().unwrap());
    let elapsed = end.elapsed_since(&start).unwrap();
    assert!(
        elapsed > Duration::ZERO && elapsed < Duration::from_secs(10),
        "{elapsed:?}"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn pinned_host_memory_round_trips_through_the_device() {
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let bytes = (32 << 20) + 13;
    let mut out = PinnedBuffer::zeroed(&device, bytes).unwrap();
    let mut back = PinnedBuffer::zeroed(&device, bytes).unwrap();
    let pattern = elements(DataType::U8, bytes, 77);
    out.as_mut_slice().copy_from_slice(&pattern);
    let mut on_device = DeviceBuffer::zeroed(&device, bytes).unwrap();
    // SAFETY: `out` is not touched until the stream is synchronised.
    unsafe { stream.copy_to_device(&mut on_device.slice_mut(), out.as_slice()) }.unwrap();
    // SAFETY: `back` is not touched until the stream is synchronised.
    unsafe { stream.copy_to_host(back.as_mut_slice(), on_device.slice()) }.unwrap();
    stream.synchronize().unwrap();
    assert!(
        back.as_slice() == pattern.as_slice(),
        "the round trip changed the bytes"
    );
}

/// The types NCCL has; `i16` and `bool` are refused, naming the type (the
/// engine reduces them with its own kernels).
const NCCL_TYPES: [DataType; 8] = [
    DataType::F32,
    DataType::F64,
    DataType::F16,
    DataType::BF16,
    DataType::I32,
    DataType::I64,
    DataType::U8,
    DataType::I8,
];

/// A single-rank communicator of device 0.
fn single_rank(device: &Arc<Device>) -> Communicator {
    let id = UniqueId::new().unwrap();
    Communicator::new(device, 0, 1, &id, Duration::from_secs(30)).unwrap()
}

#[test]
#[ignore = "needs a CUDA device"]
fn nccl_reduce_scatter_and_all_gather_on_one_rank_for_every_type() {
    let device = device();
    let comm = single_rank(&device);
    let stream = Stream::new(&device, false).unwrap();
    for dtype in NCCL_TYPES {
        let n = 1000 + 3;
        let data = elements(dtype, n, 5);
        let bytes = data.len();
        let mut buf = DeviceBuffer::zeroed(&device, bytes).unwrap();
        let mut out = DeviceBuffer::zeroed(&device, bytes).unwrap();
        stream.upload_blocking(&mut buf.slice_mut(), &data).unwrap();
        group(&[&comm], || {
            comm.reduce_scatter_in_place(&stream, &mut buf.slice_mut(), dtype, ReduceOp::Sum)?;
            comm.all_gather_in_place(&stream, &mut buf.slice_mut(), dtype)
        })
        .unwrap();
        comm.reduce_scatter(
            &stream,
            buf.slice(),
            &mut out.slice_mut(),
            dtype,
            ReduceOp::Max,
        )
        .unwrap();
        let mut got = vec![0u8; bytes];
        stream.download_blocking(&mut got, out.slice()).unwrap();
        // One rank: every collective is the identity.
        assert_same(dtype, &got, &data, &format!("{dtype} through one rank"));
    }
    comm.check().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn nccl_reduce_broadcast_and_all_reduce_in_place_on_one_rank() {
    let device = device();
    let comm = single_rank(&device);
    let stream = Stream::new(&device, false).unwrap();
    for dtype in NCCL_TYPES {
        let data = elements(dtype, 777, 9);
        let mut buf = DeviceBuffer::zeroed(&device, data.len()).unwrap();
        stream.upload_blocking(&mut buf.slice_mut(), &data).unwrap();
        group(&[&comm], || {
            comm.reduce_in_place(&stream, &mut buf.slice_mut(), dtype, ReduceOp::Sum, 0)?;
            comm.broadcast_in_place(&stream, &mut buf.slice_mut(), dtype, 0)
        })
        .unwrap();
        comm.all_reduce_in_place(&stream, &mut buf.slice_mut(), dtype, ReduceOp::Max)
            .unwrap();
        let mut got = vec![0u8; data.len()];
        stream.download_blocking(&mut got, buf.slice()).unwrap();
        assert_same(dtype, &got, &data, &format!("{dtype} through one rank"));
    }
    // Refused before anything is enqueued, naming the argument.
    let mut buf = DeviceBuffer::zeroed(&device, 8).unwrap();
    for dtype in DataType::ALL.iter().copied() {
        let refused = comm.all_reduce_in_place(&stream, &mut buf.slice_mut(), dtype, ReduceOp::Max);
        if NCCL_TYPES.contains(&dtype) {
            refused.unwrap();
        } else {
            let e = refused.unwrap_err().to_string();
            assert!(e.contains(dtype.name()), "{dtype}: {e}");
        }
    }
    let e = comm
        .broadcast_in_place(&stream, &mut buf.slice_mut(), DataType::F32, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("root") && e.contains("rank 1"), "{e}");
    let e = comm
        .all_reduce_in_place(&stream, &mut buf.slice_mut(), DataType::I32, ReduceOp::Avg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("avg"), "{e}");
    comm.check().unwrap();
}

#[test]
#[ignore = "needs a CUDA device"]
fn nccl_reduce_scatter_and_all_gather_across_every_visible_device() {
    let devices = fairring_cuda::probe::driver_info().unwrap().devices;
    let id = UniqueId::new().unwrap();
    let n_per_rank = 4099usize;
    let handles: Vec<_> = (0..devices)
        .map(|rank| {
            std::thread::spawn(move || {
                let device = Device::open(rank).unwrap();
                let comm = Communicator::new(&device, rank, devices, &id, Duration::from_secs(60))
                    .unwrap();
                let stream = Stream::new(&device, false).unwrap();
                let total = n_per_rank * devices as usize;
                // Rank r contributes r + 1 at every element.
                let mine: Vec<u8> = (0..total)
                    .flat_map(|_| (rank as i32 + 1).to_le_bytes())
                    .collect();
                let mut buf = DeviceBuffer::zeroed(&device, mine.len()).unwrap();
                stream.upload_blocking(&mut buf.slice_mut(), &mine).unwrap();
                comm.reduce_scatter_in_place(
                    &stream,
                    &mut buf.slice_mut(),
                    DataType::I32,
                    ReduceOp::Sum,
                )
                .unwrap();
                comm.all_gather_in_place(&stream, &mut buf.slice_mut(), DataType::I32)
                    .unwrap();
                let mut got = vec![0u8; mine.len()];
                stream.download_blocking(&mut got, buf.slice()).unwrap();
                let want = (devices * (devices + 1) / 2) as i32;
                for (i, e) in got.chunks(4).enumerate() {
                    assert_eq!(
                        i32::from_le_bytes(e.try_into().unwrap()),
                        want,
                        "rank {rank} element {i}"
                    );
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn abort_returns_promptly_and_every_later_call_fails() {
    let device = device();
    let comm = single_rank(&device);
    let stream = Stream::new(&device, false).unwrap();
    let mut buf = DeviceBuffer::zeroed(&device, 4096).unwrap();
    let took = comm.abort();
    assert!(took < Duration::from_secs(5), "abort took {took:?}");
    // Idempotent by its effect: a second abort returns promptly too, and the
    // communicator stays aborted.
    let again = comm.abort();
    assert!(
        again < Duration::from_secs(5),
        "a second abort took {again:?}"
    );
    assert_eq!(comm.check(), Err(Error::Aborted));
    let r = comm.all_gather_in_place(&stream, &mut buf.slice_mut(), DataType::F32);
    assert_eq!(r, Err(Error::Aborted));
    assert_eq!(comm.check(), Err(Error::Aborted));
}

#[test]
#[ignore = "needs a CUDA device"]
fn an_abort_waits_for_a_group_being_enqueued_on_another_thread() {
    let device = device();
    let comm = single_rank(&device);
    let mut buf = DeviceBuffer::zeroed(&device, 1 << 20).unwrap();
    let enqueued = std::sync::atomic::AtomicU64::new(0);
    let outcome = std::thread::scope(|s| {
        let enqueuer = s.spawn(|| {
            let stream = Stream::new(&device, false).unwrap();
            loop {
                let r = group(&[&comm], || {
                    comm.all_reduce_in_place(
                        &stream,
                        &mut buf.slice_mut(),
                        DataType::F32,
                        ReduceOp::Sum,
                    )
                });
                match r {
                    Ok(()) => {
                        enqueued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(e) => return e,
                }
            }
        });
        while enqueued.load(std::sync::atomic::Ordering::Relaxed) < 100 {
            std::thread::yield_now();
        }
        let took = comm.abort();
        (took, enqueuer.join().unwrap())
    });
    let (took, ended) = outcome;
    assert!(took < Duration::from_secs(10), "the abort took {took:?}");
    assert_eq!(ended, Error::Aborted);
    assert_eq!(
        group(&[&comm], || Ok(())),
        Err(Error::Aborted),
        "a group begun after the abort"
    );
}

/// Two GPUs, or device 0 twice where NCCL may put two ranks on one GPU
/// (`NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL 2.31 or later); a loud failure
/// otherwise.
fn two_rank_devices() -> [Arc<Device>; 2] {
    let devices = fairring_cuda::probe::driver_info().unwrap().devices;
    let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v == "1");
    assert!(
        devices >= 2 || shared,
        "this test needs two GPUs, or NCCL_MULTI_RANK_GPU_ENABLE=1 with NCCL 2.31 or later"
    );
    [Device::open(0).unwrap(), Device::open(1 % devices).unwrap()]
}

#[test]
#[ignore = "needs a CUDA device"]
fn aborting_two_communicators_together_ends_kernels_queued_behind_each_other() {
    // Rank 0 queues a kernel of `b` then one of `a` on one stream; rank 1
    // never joins them. `a`'s kernel cannot start before `b`'s ends, and
    // `b`'s only ends when `b` is aborted: aborting `a` alone may wait for
    // its kernel, so both must be asked to stop before either abort waits.
    // Threads of their own, not scoped: where the aborts hang, the test
    // fails at its bound rather than waiting for them. Where they end, the
    // test waits for them: a process that exits while NCCL is aborting can
    // crash in its exit.
    let devices = two_rank_devices();
    let ids = [UniqueId::new().unwrap(), UniqueId::new().unwrap()];
    let warmed = Arc::new(std::sync::Barrier::new(2));
    let (done, finished) = std::sync::mpsc::channel::<Duration>();
    let (rank_0_done, rank_1_may_go) = std::sync::mpsc::channel::<()>();
    let (ended, threads_ended) = std::sync::mpsc::channel::<u32>();
    let mut rank_1_may_go = Some(rank_1_may_go);
    for (rank, device) in (0u32..).zip(devices) {
        let (warmed, done, rank_0_done) = (Arc::clone(&warmed), done.clone(), rank_0_done.clone());
        let ended = ended.clone();
        let go = if rank == 1 {
            rank_1_may_go.take()
        } else {
            None
        };
        std::thread::spawn(move || {
            let bound = Duration::from_secs(60);
            let [a, b] = ids.map(|id| Communicator::new(&device, rank, 2, &id, bound).unwrap());
            let stream = Stream::new(&device, false).unwrap();
            let mut buf = DeviceBuffer::zeroed(&device, 1 << 16).unwrap();
            let (f32, sum) = (DataType::F32, ReduceOp::Sum);
            // Both connect at their first collective, with both ranks.
            for c in [&a, &b] {
                c.all_reduce_in_place(&stream, &mut buf.slice_mut(), f32, sum)
                    .unwrap();
            }
            stream.synchronize().unwrap();
            warmed.wait();
            if let Some(go) = go {
                // Gone, as far as the kernels are concerned.
                let _ = go.recv_timeout(Duration::from_secs(120));
                Communicator::abort_all(&[&a, &b]);
                drop((a, b, buf, stream));
                let _ = ended.send(rank);
                return;
            }
            b.all_reduce_in_place(&stream, &mut buf.slice_mut(), f32, sum)
                .unwrap();
            a.all_reduce_in_place(&stream, &mut buf.slice_mut(), f32, sum)
                .unwrap();
            let took = Communicator::abort_all(&[&a, &b]);
            done.send(took).unwrap();
            rank_0_done.send(()).unwrap();
            // The stream drains once the kernels have ended (its error, if
            // any, is the aborted kernels').
            let _ = stream.synchronize();
            drop((a, b, buf, stream));
            let _ = ended.send(rank);
        });
    }
    let took = finished.recv_timeout(Duration::from_secs(90));
    assert!(
        took.is_ok_and(|t| t < Duration::from_secs(60)),
        "aborting both communicators did not end rank 0's kernels: {took:?}"
    );
    for _ in 0..2 {
        let rank = threads_ended.recv_timeout(Duration::from_secs(60));
        assert!(
            rank.is_ok(),
            "a rank's thread did not end after the aborts: {rank:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_communicator_missing_a_rank_gives_up_at_its_bound() {
    let device = device();
    let id = UniqueId::new().unwrap();
    let bound = Duration::from_secs(2);
    let started = Instant::now();
    // Rank 1 of 2 never joins.
    let r = Communicator::new(&device, 0, 2, &id, bound);
    let took = started.elapsed();
    match r {
        Err(Error::Timeout { what, after }) => {
            assert_eq!(after, bound);
            assert!(what.contains("rank 0 of 2"), "{what}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        took < bound + Duration::from_secs(10),
        "set-up and abort took {took:?}"
    );
}

/// One device of a two-machine job, with the fabric played by the host: each
/// slice's contribution from the other machine arrives in pinned memory, is
/// collected, added, diffused back to pinned memory and all-gathered into the
/// tensor, every stage on its own stream, ordered only by the pool's events (the
/// host waits only for the caller's stream, after completion).
#[test]
#[ignore = "needs a CUDA device"]
fn the_staging_pipeline_orders_its_stages_with_events_alone() {
    let device = device();
    let kernels = ReductionKernels::load(&device).unwrap();
    let topology = Topology::new(2, 1, RankLayout::Contiguous).unwrap();
    let config = PlanConfig::new(4 << 20, 64 << 10).unwrap();
    let geometry = Geometry::new(topology, config).unwrap();
    let layout = geometry.staging_layout();
    let budget = 2 * layout.total_bytes();
    let mut pool =
        StagingPool::for_geometry(&device, &geometry, budget, HostStaging::Pinned).unwrap();
    assert_eq!(pool.buffers(), 2);
    let caller = Stream::new(&device, false).unwrap();
    let slot = layout.slot().byte_range().unwrap();
    let area = layout.contribution(1, 0).unwrap().byte_range().unwrap();
    // One shard's worth of the slot: what this device serves.
    let bytes = area.len().min(slot.len()) / 4 * 4;
    let (own, theirs_at) = (
        slot.start..slot.start + bytes,
        area.start..area.start + bytes,
    );
    let mut tensor = DeviceBuffer::zeroed(&device, bytes).unwrap();
    for slice in 0..6u64 {
        let buffer = (slice % 2) as u32;
        let mine = elements(DataType::I32, bytes / 4, 100 + slice);
        let theirs = elements(DataType::I32, bytes / 4, 200 + slice);
        let mut want = mine.clone();
        reduce_bytes(DataType::I32, ReduceOp::Sum, &mut want, &theirs).unwrap();
        // The caller's stream produces the input (and the last slice's result was
        // read back through it, so this buffer's previous slice is complete and
        // its pinned memory free); the fabric's delivery lands in pinned memory.
        caller
            .upload_blocking(&mut tensor.slice_mut(), &mine)
            .unwrap();
        pool.parts(buffer)
            .unwrap()
            .host_memory
            .unwrap()
            .as_mut_slice()[theirs_at.clone()]
        .copy_from_slice(&theirs);
        pool.begin(buffer, &caller).unwrap();
        let parts = pool.parts(buffer).unwrap();
        let streams = parts.streams;
        let host = parts.host_memory.unwrap();
        let (mut slot_part, mut area_part) = parts.device_memory.split_at(area.start).unwrap();
        let mut own_view = slot_part.range(own.clone()).unwrap();
        let mut theirs_view = area_part.range(0..bytes).unwrap();
        // Reduce-scatter stage (D = 1: the slot is the tensor).
        streams
            .get(Stage::ReduceScatter)
            .copy(&mut own_view, tensor.slice())
            .unwrap();
        // Collect: the pinned contribution into the device contribution area.
        // SAFETY: the host does not touch the pinned buffer until the caller's
        // stream, which waits for the slice's completion, is synchronised.
        unsafe {
            streams
                .get(Stage::Collect)
                .copy_to_device(&mut theirs_view, &host.as_slice()[theirs_at.clone()])
                .unwrap();
        }
        pool.hand_over(buffer, Stage::ReduceScatter, Stage::Add)
            .unwrap();
        pool.hand_over(buffer, Stage::Collect, Stage::Add).unwrap();
        let parts = pool.parts(buffer).unwrap();
        let streams = parts.streams;
        let (mut slot_part, area_part) = parts.device_memory.split_at(area.start).unwrap();
        let mut own_view = slot_part.range(own.clone()).unwrap();
        let theirs_view = area_part.as_slice().range(0..bytes).unwrap();
        // Add: slot += contribution.
        kernels
            .reduce(
                streams.get(Stage::Add),
                DataType::I32,
                ReduceOp::Sum,
                &mut own_view,
                theirs_view,
            )
            .unwrap();
        pool.hand_over(buffer, Stage::Add, Stage::Diffuse).unwrap();
        let parts = pool.parts(buffer).unwrap();
        let streams = parts.streams;
        let host = parts.host_memory.unwrap();
        let mut memory = parts.device_memory;
        let own_view = memory.range(own.clone()).unwrap();
        // Diffuse: the reduced shard out to pinned memory for the fabric.
        // SAFETY: as for the collect stage.
        unsafe {
            streams
                .get(Stage::Diffuse)
                .copy_to_host(&mut host.as_mut_slice()[own.clone()], own_view.as_slice())
                .unwrap();
        }
        pool.hand_over(buffer, Stage::Diffuse, Stage::AllGather)
            .unwrap();
        let parts = pool.parts(buffer).unwrap();
        let streams = parts.streams;
        let mut memory = parts.device_memory;
        let own_view = memory.range(own.clone()).unwrap();
        // All-gather stage: the final slot back into the tensor.
        streams
            .get(Stage::AllGather)
            .copy(&mut tensor.slice_mut(), own_view.as_slice())
            .unwrap();
        let done = pool.complete(buffer).unwrap();
        caller.wait(done).unwrap();
        let mut got = vec![0u8; bytes];
        caller.download_blocking(&mut got, tensor.slice()).unwrap();
        assert_same(
            DataType::I32,
            &got,
            &want,
            &format!("slice {slice}: the tensor"),
        );
        let diffused = &pool.parts(buffer).unwrap().host_memory.unwrap().as_slice()[own.clone()];
        assert_same(
            DataType::I32,
            diffused,
            &want,
            &format!("slice {slice}: the diffused shard"),
        );
    }
}

/// The context current on the calling thread (null when none is).
fn current_context() -> cudarc::driver::sys::CUcontext {
    let mut current = std::ptr::null_mut();
    // SAFETY: writes one context handle; the driver is loaded (a device was
    // opened first).
    let status = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut current) };
    assert_eq!(status, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    current
}

/// The crate's calls leave the calling thread's current context as they
/// found it: a host runtime's current device does not change under it.
#[test]
#[ignore = "needs a CUDA device"]
fn driver_calls_leave_the_threads_current_context_as_they_found_it() {
    let device = device();
    assert!(device.supports_64_bit_stream_memory_ops() || !device.name().is_empty());
    std::thread::spawn(move || {
        assert!(current_context().is_null(), "a new thread has no context");
        let stream = Stream::new(&device, true).unwrap();
        let event = Event::new(&device, Timing::Disabled).unwrap();
        event.record(&stream).unwrap();
        stream.synchronize().unwrap();
        assert!(event.is_complete().unwrap());
        drop(event);
        drop(stream);
        assert!(
            current_context().is_null(),
            "the calls made the device's context current on the caller's thread"
        );
        // Made current by the caller, it stays current.
        let bound = device.bind().unwrap();
        let ours = current_context();
        assert_eq!(ours, device.raw_context());
        let inner = Stream::new(&device, true).unwrap();
        drop(inner);
        assert_eq!(current_context(), ours);
        drop(bound);
        assert!(current_context().is_null());
    })
    .join()
    .unwrap();
}

/// The driver reports the module loading `CUDA_MODULE_LOADING` asked for (lazy
/// where it names none: the driver's default), which the engine's warning and
/// the Python package's eager default rest on.
#[test]
#[ignore = "needs a CUDA device"]
fn module_loading_follows_the_environment() {
    let _device = device();
    let want = match std::env::var("CUDA_MODULE_LOADING").as_deref() {
        Ok("EAGER") => fairring_cuda::ModuleLoading::Eager,
        _ => fairring_cuda::ModuleLoading::Lazy,
    };
    assert_eq!(fairring_cuda::module_loading().unwrap(), want);
}
