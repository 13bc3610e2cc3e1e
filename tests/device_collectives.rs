//! Collectives on device tensors (the `cuda` feature), through the engine:
//! jobs of processes sharing GPU 0, each rank a machine of its own (a host
//! identity of its own) over the tcp fabric, as a job of one GPU per machine
//! runs.
//!
//! One file, longer than most: the GPU kit carries one executable per suite
//! (`ci/gpu-build`), and this is the engine's.
//!
//! Each rank is this test binary re-executed (see `common::processes`), so
//! every rank has its own CUDA context, as in a real job. (Ranks that are
//! threads of one process share a context, and one rank's synchronising driver
//! call can then wait for another rank's stream.)
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
use std::time::{Duration, Instant};

use fairring::cuda::{Device, DeviceBuffer, PinnedBuffer, ReductionKernels, Stream};
use fairring::{Algorithm, Call, Communicator, DataType, Error, ReduceOp, Tensor, TensorMut};

use common::allocations::{Counting, allocations};
use common::job;
use common::processes::{ProcessJob, moved_by_server, rank_of_job, say};

#[global_allocator]
static GLOBAL: Counting = Counting;

/// How long a launcher waits for its job.
const JOB_LIMIT: Duration = Duration::from_secs(300);

/// GPU 0, or a loud failure naming what is missing.
fn device() -> Arc<Device> {
    Device::open(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"))
}

/// Small slices and shards, so that modest tensors span many slices and
/// shards, with `algorithm`.
fn small_slices(algorithm: Algorithm) -> Vec<(&'static str, String)> {
    vec![
        ("FAIRRING_SLICE_SIZE", "65536".into()),
        ("FAIRRING_MIN_SHARD_SIZE", "4096".into()),
        ("FAIRRING_TOTAL_MEMORY", "1048576".into()),
        ("FAIRRING_ALGO", algorithm.to_string()),
        ("FAIRRING_TIMEOUT", "30".into()),
    ]
}

/// Several ranks of a machine reduce device tensors through NCCL, two ranks
/// sharing GPU 0 (NCCL 2.30 and later).
fn through_nccl() -> Vec<(&'static str, String)> {
    vec![
        ("FAIRRING_DEVICE_LOCAL", "nccl".into()),
        ("NCCL_MULTI_RANK_GPU_ENABLE", "1".into()),
    ]
}

/// Several ranks of a machine reduce device tensors on the host.
fn through_host() -> Vec<(&'static str, String)> {
    vec![("FAIRRING_DEVICE_LOCAL", "host".into())]
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

/// Rank `rank`'s `n` elements of `dtype`.
fn input(dtype: DataType, rank: u32, n: usize) -> Vec<u8> {
    encode(dtype, (0..n).map(|i| value(rank, i)))
}

/// What every rank holds after all-reducing `n` elements with `op` in a job of
/// `world` ranks.
fn reduced(dtype: DataType, op: ReduceOp, world: u32, n: usize) -> Vec<u8> {
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

/// Copies `bytes` to the start of `buf`.
fn upload(stream: &Stream, buf: &mut DeviceBuffer, at: usize, bytes: &[u8]) {
    if !bytes.is_empty() {
        let mut view = buf.slice_mut();
        let mut place = view.range(at..at + bytes.len()).unwrap();
        stream.upload_blocking(&mut place, bytes).unwrap();
    }
}

/// Bytes `at..at + len` of `buf`.
fn download(stream: &Stream, buf: &DeviceBuffer, at: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    if len > 0 {
        stream
            .download_blocking(&mut out, buf.slice().range(at..at + len).unwrap())
            .unwrap();
    }
    out
}

/// Waits for `w` on the device (the stream) and on the host.
fn finish(stream: &Stream, w: fairring::Work<'_>) -> fairring::Result<()> {
    w.enqueue_wait(stream)?;
    w.wait()
}

/// Sizes: none, one element, an odd count, and several 64 KiB slices.
const SIZES: [usize; 4] = [0, 1, 1001, 3 * 16384 + 7];

#[test]
#[ignore = "needs a CUDA device"]
fn device_collectives_are_exact_for_every_layout_type_operator_and_size() {
    let test = "device_collectives_are_exact_for_every_layout_type_operator_and_size";
    if let Some(comm) = rank_of_job(test) {
        let failures = every_collective(&comm);
        assert!(
            failures.is_empty(),
            "rank {}: wrong results for {failures:?}",
            comm.rank()
        );
        return;
    }
    // One job per way a machine's ranks meet: one rank per machine, and two
    // per machine through NCCL and through the machine's shared segment, all
    // processes sharing GPU 0. Each job runs every case under `auto`
    // (hierarchical, recursive doubling, the relay and the scatter
    // algorithm, as the layout and the size choose) and its all-reduces
    // again under the ring: five jobs, where one per case would start dozens.
    let jobs = [
        ((2u32, 1u32), Vec::new()),
        ((1, 2), through_nccl()),
        ((1, 2), through_host()),
        ((2, 2), through_nccl()),
        ((2, 2), through_host()),
    ];
    for ((m, d), local) in jobs {
        eprintln!("{m}x{d} {local:?}");
        let mut env = small_slices(Algorithm::Auto);
        env.extend(local);
        ProcessJob::run(test, m, d, &env, JOB_LIMIT);
    }
}

/// One rank's part of the exactness test: the cases that came out wrong.
fn every_collective(comm: &Communicator) -> Vec<String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let most = SIZES[3] * 8 * world as usize;
    let mut a = DeviceBuffer::zeroed(&device, most).unwrap();
    let mut b = DeviceBuffer::zeroed(&device, most).unwrap();
    let mut failures = Vec::new();
    let mut check = |what: String, got: Vec<u8>, want: Vec<u8>| {
        if got != want {
            failures.push(what);
        }
    };
    let fail = |what: &str, e: Error| -> ! { panic!("rank {rank}: {what}: {e}") };

    // All-reduce.
    let cases = [
        (DataType::F32, ReduceOp::Sum),
        (DataType::F32, ReduceOp::Max),
        (DataType::F64, ReduceOp::Sum),
        (DataType::I32, ReduceOp::Min),
        (DataType::I64, ReduceOp::Sum),
        (DataType::BF16, ReduceOp::Sum),
        (DataType::F16, ReduceOp::Max),
    ];
    for &(dtype, op) in &cases {
        for &n in &SIZES {
            let what = format!("all-reduce {dtype} {op} x{n}");
            let mine = input(dtype, rank, n);
            upload(&stream, &mut a, 0, &mine);
            let mut view = a.slice_mut().split_at(mine.len()).unwrap().0;
            comm.scope(|s| {
                finish(
                    &stream,
                    s.all_reduce(TensorMut::device(&mut view, dtype, &stream)?, op, ())?,
                )
            })
            .unwrap_or_else(|e| fail(&what, e));
            check(
                what,
                download(&stream, &a, 0, mine.len()),
                reduced(dtype, op, world, n),
            );
        }
        // Again under the ring, at one element and at several slices.
        for n in [SIZES[1], SIZES[3]] {
            let what = format!("ring all-reduce {dtype} {op} x{n}");
            let mine = input(dtype, rank, n);
            upload(&stream, &mut a, 0, &mine);
            let call = Call::all_reduce(a.raw() as *mut u8, n as u64, dtype, op)
                .with(Algorithm::Ring)
                .on_stream(stream.raw());
            // SAFETY: `a` holds the tensor; nothing touches it until `finish`
            // has waited for the operation.
            let r = unsafe { comm.start(&call) }.and_then(|w| finish(&stream, w));
            r.unwrap_or_else(|e| fail(&what, e));
            check(
                what,
                download(&stream, &a, 0, mine.len()),
                reduced(dtype, op, world, n),
            );
        }
    }

    // Broadcast from the last rank: every rank ends with the root's input.
    let root = world - 1;
    for dtype in [DataType::F32, DataType::F16, DataType::I64] {
        for &n in &SIZES {
            let what = format!("broadcast {dtype} x{n} from {root}");
            let mine = input(dtype, rank, n);
            upload(&stream, &mut a, 0, &mine);
            let mut view = a.slice_mut().split_at(mine.len()).unwrap().0;
            comm.scope(|s| {
                finish(
                    &stream,
                    s.broadcast(TensorMut::device(&mut view, dtype, &stream)?, root, ())?,
                )
            })
            .unwrap_or_else(|e| fail(&what, e));
            check(
                what,
                download(&stream, &a, 0, mine.len()),
                input(dtype, root, n),
            );
        }
    }

    // All-gather, out of place (input in `b`) and in place (input at this
    // rank's place of the output, through the raw call).
    for dtype in [DataType::F32, DataType::BF16] {
        for &n in &SIZES {
            let mine = input(dtype, rank, n);
            let all: Vec<u8> = (0..world).flat_map(|r| input(dtype, r, n)).collect();
            let what = format!("all-gather {dtype} x{n}");
            // Stale bytes where other ranks' inputs go must be overwritten.
            upload(&stream, &mut a, 0, &vec![0xA5; all.len()]);
            upload(&stream, &mut b, 0, &mine);
            let input_view = b.slice().range(0..mine.len()).unwrap();
            let mut output = a.slice_mut().split_at(all.len()).unwrap().0;
            comm.scope(|s| {
                finish(
                    &stream,
                    s.all_gather(
                        Tensor::device(&input_view, dtype, &stream)?,
                        TensorMut::device(&mut output, dtype, &stream)?,
                        (),
                    )?,
                )
            })
            .unwrap_or_else(|e| fail(&what, e));
            check(what, download(&stream, &a, 0, all.len()), all.clone());

            let what = format!("in-place all-gather {dtype} x{n}");
            upload(&stream, &mut a, 0, &vec![0x5A; all.len()]);
            upload(&stream, &mut a, rank as usize * mine.len(), &mine);
            let place = a.raw() + (rank as usize * mine.len()) as u64;
            // SAFETY: `a` holds the output; nothing touches it until `finish`
            // has waited for the operation.
            let r = unsafe {
                comm.start(
                    &Call::all_gather(place as *const u8, a.raw() as *mut u8, n as u64, dtype)
                        .on_stream(stream.raw()),
                )
            }
            .and_then(|w| finish(&stream, w));
            r.unwrap_or_else(|e| fail(&what, e));
            check(what, download(&stream, &a, 0, all.len()), all);
        }
    }

    // Reduce-scatter: `a` holds every rank's input, this rank's share lands
    // in `b`.
    for (dtype, op) in [
        (DataType::F32, ReduceOp::Sum),
        (DataType::I32, ReduceOp::Max),
    ] {
        for &n in &SIZES {
            let what = format!("reduce-scatter {dtype} {op} x{n}");
            let total = n * world as usize;
            let mine = input(dtype, rank, total);
            let size = dtype.size_bytes() as usize;
            upload(&stream, &mut a, 0, &mine);
            upload(&stream, &mut b, 0, &vec![0xA5; n * size]);
            let mut inp = a.slice_mut().split_at(mine.len()).unwrap().0;
            let mut out = b.slice_mut().split_at(n * size).unwrap().0;
            comm.scope(|s| {
                finish(
                    &stream,
                    s.reduce_scatter(
                        TensorMut::device(&mut inp, dtype, &stream)?,
                        TensorMut::device(&mut out, dtype, &stream)?,
                        op,
                        (),
                    )?,
                )
            })
            .unwrap_or_else(|e| fail(&what, e));
            let want = reduced(dtype, op, world, total);
            let share = rank as usize * n * size..(rank as usize + 1) * n * size;
            check(
                what,
                download(&stream, &b, 0, n * size),
                want[share].to_vec(),
            );
        }
    }

    // Coalesced all-reduce of several tensors, in flight together.
    let counts = [1usize, 1001, 16384 + 3, 0];
    let mut at = 0;
    let mut places = Vec::new();
    for &n in &counts {
        upload(&stream, &mut a, at, &input(DataType::F32, rank, n));
        places.push((at, n));
        at += n * 4;
    }
    let mut rest = a.slice_mut();
    let mut views = Vec::new();
    for &(_, n) in &places {
        let (head, tail) = rest.split_at(n * 4).unwrap();
        views.push(head);
        rest = tail;
    }
    comm.scope(|s| {
        let tensors = views
            .iter_mut()
            .map(|v| TensorMut::device(v, DataType::F32, &stream))
            .collect::<fairring::Result<Vec<_>>>()?;
        let w = s.all_reduce_coalesced(tensors, ReduceOp::Sum)?;
        finish(&stream, w)
    })
    .unwrap_or_else(|e| fail("coalesced all-reduce", e));
    drop(views);
    for (k, &(at, n)) in places.iter().enumerate() {
        check(
            format!("coalesced all-reduce, tensor {k} x{n}"),
            download(&stream, &a, at, n * 4),
            reduced(DataType::F32, ReduceOp::Sum, world, n),
        );
    }
    stream.synchronize().unwrap();
    failures
}

#[test]
#[ignore = "needs a CUDA device"]
fn many_device_operations_in_flight_all_finish_exact() {
    let test = "many_device_operations_in_flight_all_finish_exact";
    let n = 20_000usize;
    let ops = 12u32;
    let Some(comm) = rank_of_job(test) else {
        let env = small_slices(Algorithm::Hierarchical);
        ProcessJob::run(test, 3, 1, &env, JOB_LIMIT);
        return;
    };
    let rank = comm.rank();
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let inputs: Vec<Vec<u8>> = (0..ops)
        .map(|k| encode(DataType::F32, (0..n).map(|i| value(rank + k, i))))
        .collect();
    let mut bufs: Vec<DeviceBuffer> = inputs
        .iter()
        .map(|x| {
            let mut b = DeviceBuffer::zeroed(&device, x.len()).unwrap();
            upload(&stream, &mut b, 0, x);
            b
        })
        .collect();
    let mut views: Vec<_> = bufs.iter_mut().map(DeviceBuffer::slice_mut).collect();
    comm.scope(|s| {
        let works = views
            .iter_mut()
            .map(|v| {
                s.all_reduce(
                    TensorMut::device(v, DataType::F32, &stream)?,
                    ReduceOp::Sum,
                    (),
                )
            })
            .collect::<fairring::Result<Vec<_>>>()?;
        for w in &works {
            w.enqueue_wait(&stream)?;
        }
        works.into_iter().try_for_each(fairring::Work::wait)
    })
    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    drop(views);
    for (k, buf) in bufs.iter().enumerate() {
        let want = encode(
            DataType::F32,
            (0..n).map(|i| (0..3).map(|r| value(r + k as u32, i)).sum()),
        );
        let got = download(&stream, buf, 0, want.len());
        assert!(got == want, "rank {rank}, operation {k}: wrong result");
    }
}

/// Two machines of two ranks reducing through NCCL, in the default slices:
/// 85 MiB of `f32` is three full 25 MiB slices of equal slots, of which each
/// machine reduce-scatters the second and third with one `ncclReduceScatter`
/// (`fairring::reduces_in_one_call`), and the first (which starts the
/// tensor's pipeline) and a 10 MiB tail slot by slot. Every element is
/// exact, on every rank.
#[test]
#[ignore = "needs a CUDA device"]
fn large_slices_reduce_scattered_in_one_call_are_exact() {
    let test = "large_slices_reduce_scattered_in_one_call_are_exact";
    let n = (85usize << 20) / 4;
    let Some(comm) = rank_of_job(test) else {
        // A budget that holds full 25 MiB slices (unset, 2x2 keeps 50 MiB
        // and halves the slices until two buffers fit).
        let mut env = vec![
            ("FAIRRING_ALGO", "hierarchical".to_owned()),
            ("FAIRRING_TOTAL_MEMORY", "256M".to_owned()),
            ("FAIRRING_TIMEOUT", "60".to_owned()),
        ];
        env.extend(through_nccl());
        ProcessJob::run(test, 2, 2, &env, JOB_LIMIT);
        return;
    };
    let rank = comm.rank();
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let x = input(DataType::F32, rank, n);
    let mut buf = DeviceBuffer::zeroed(&device, x.len()).unwrap();
    upload(&stream, &mut buf, 0, &x);
    let mut view = buf.slice_mut();
    comm.scope(|s| {
        let work = s.all_reduce(
            TensorMut::device(&mut view, DataType::F32, &stream)?,
            ReduceOp::Sum,
            (),
        )?;
        finish(&stream, work)
    })
    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    let want = reduced(DataType::F32, ReduceOp::Sum, comm.world_size(), n);
    let got = download(&stream, &buf, 0, want.len());
    let wrong = got.chunks(4).zip(want.chunks(4)).position(|(g, w)| g != w);
    assert!(wrong.is_none(), "rank {rank}: element {wrong:?} wrong");
}

/// 2x2 with the job's NCCL communicator made on any GPU
/// (`FAIRRING_NCCL_ACROSS_MACHINES=on`): `auto` runs all-reduces of 4 MiB
/// and more as one NCCL all-reduce across the job (`fairring::nccl_across_job`
/// on two machines), sums of two types and an integer maximum, and a 1 MiB
/// sum below the rule on the plan. Every element is exact, on every rank.
/// Then the same beside two dedicated servers, which plan the NCCL
/// all-reduces and move no byte of them, and serve the 1 MiB sum.
#[test]
#[ignore = "needs a CUDA device"]
fn all_reduces_across_the_job_through_nccl_are_exact() {
    let test = "all_reduces_across_the_job_through_nccl_are_exact";
    let Some(comm) = rank_of_job(test) else {
        let mut env = vec![
            ("FAIRRING_NCCL_ACROSS_MACHINES", "on".to_owned()),
            ("FAIRRING_TIMEOUT", "60".to_owned()),
        ];
        env.extend(through_nccl());
        ProcessJob::run(test, 2, 2, &env, JOB_LIMIT);
        for below_the_rule in [false, true] {
            let mut env = env.clone();
            env.push(("FAIRRING_TEST_BELOW_THE_RULE", below_the_rule.to_string()));
            let (moved, done) = beside_two_servers(test, 2, 2, &env);
            assert_eq!(
                moved == 0,
                !below_the_rule,
                "the servers moved {moved} bytes: {done:?}"
            );
        }
        return;
    };
    assert!(fairring::nccl_across_job(2, 4 << 20));
    assert!(!fairring::nccl_across_job(2, 1 << 20));
    let in_windows = [
        (DataType::F32, ReduceOp::Sum, 6 << 20),
        (DataType::I64, ReduceOp::Sum, 4 << 20),
        (DataType::I32, ReduceOp::Max, 5 << 20),
    ];
    let below = [(DataType::F32, ReduceOp::Sum, 1 << 20)];
    match std::env::var("FAIRRING_TEST_BELOW_THE_RULE")
        .ok()
        .as_deref()
    {
        None => {
            all_reduce_device_tensors_exactly(&comm, &in_windows);
            all_reduce_device_tensors_exactly(&comm, &below);
        }
        Some("true") => all_reduce_device_tensors_exactly(&comm, &below),
        Some(_) => all_reduce_device_tensors_exactly(&comm, &in_windows),
    }
}

/// 2x2 beside two dedicated servers, its device tensors through NCCL within
/// each machine, the machines serving their own shards
/// (`FAIRRING_MACHINES_SERVE=on`, on any GPU; no NCCL all-reduce across
/// the job): `auto` runs every exact device all-reduce as the same job
/// without servers would, sums of two types, an integer and a float
/// maximum, from 4 bytes to 6 MiB, every element exact on every rank, and
/// the servers, which plan them, move no byte. With `off` the servers serve
/// the same calls.
#[test]
#[ignore = "needs a CUDA device"]
fn device_all_reduces_beside_servers_run_as_the_machines_own_plan() {
    let test = "device_all_reduces_beside_servers_run_as_the_machines_own_plan";
    let Some(comm) = rank_of_job(test) else {
        let mut env = vec![
            ("FAIRRING_NCCL_ACROSS_MACHINES", "off".to_owned()),
            ("FAIRRING_TIMEOUT", "60".to_owned()),
        ];
        env.extend(through_nccl());
        for serve in ["on", "off"] {
            let mut env = env.clone();
            env.push(("FAIRRING_MACHINES_SERVE", serve.to_owned()));
            let (moved, done) = beside_two_servers(test, 2, 2, &env);
            assert_eq!(
                moved == 0,
                serve == "on",
                "machines serving {serve}: the servers moved {moved} bytes: {done:?}"
            );
        }
        return;
    };
    all_reduce_device_tensors_exactly(
        &comm,
        &[
            (DataType::F32, ReduceOp::Sum, 6 << 20),
            (DataType::F32, ReduceOp::Sum, 4),
            (DataType::I64, ReduceOp::Sum, 1 << 20),
            (DataType::I32, ReduceOp::Max, 5 << 20),
            (DataType::F32, ReduceOp::Max, 1 << 20),
        ],
    );
}

/// Runs `test` as an `m`x`d` process job beside two server processes, with
/// `env`: the data bytes the servers moved in all, and what each reported.
fn beside_two_servers(test: &str, m: u32, d: u32, env: &[(&str, String)]) -> (u64, Vec<String>) {
    let mut job = ProcessJob::start_with_servers(test, m, d, 2, env);
    let world = m * d;
    let done = job.await_line(&[world, world + 1], "DONE", JOB_LIMIT);
    let moved = done
        .iter()
        .map(|line| {
            let (sent, received) = moved_by_server(line);
            sent + received
        })
        .sum();
    job.finish(JOB_LIMIT);
    (moved, done)
}

/// All-reduces, one after another, a device tensor of each `(type,
/// operator, bytes)` of `calls` from this rank's inputs, and checks every
/// element of each result.
fn all_reduce_device_tensors_exactly(comm: &Communicator, calls: &[(DataType, ReduceOp, usize)]) {
    let rank = comm.rank();
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    for &(dtype, op, bytes) in calls {
        let n = bytes / dtype.size_bytes() as usize;
        let x = input(dtype, rank, n);
        let mut buf = DeviceBuffer::zeroed(&device, x.len()).unwrap();
        upload(&stream, &mut buf, 0, &x);
        let mut view = buf.slice_mut();
        comm.scope(|s| {
            let work = s.all_reduce(TensorMut::device(&mut view, dtype, &stream)?, op, ())?;
            finish(&stream, work)
        })
        .unwrap_or_else(|e| panic!("rank {rank}: {dtype} {op:?}: {e}"));
        let want = reduced(dtype, op, comm.world_size(), n);
        let got = download(&stream, &buf, 0, want.len());
        let size = dtype.size_bytes() as usize;
        let wrong = got
            .chunks(size)
            .zip(want.chunks(size))
            .position(|(g, w)| g != w);
        assert!(
            wrong.is_none(),
            "rank {rank}: {dtype} {op:?}: element {wrong:?} wrong"
        );
    }
}

/// One machine of two ranks beside two dedicated servers, its device tensors
/// through NCCL: `auto` runs every device all-reduce NCCL reduces as one
/// NCCL all-reduce on the machine's communicator, sums of two types and an
/// integer maximum from 4 bytes to 6 MiB, every element exact on every rank;
/// the servers, which plan them, move no byte of them. A float maximum
/// (which NCCL does not reduce under fairring's NaN rules) goes to the
/// servers, exact too.
#[test]
#[ignore = "needs a CUDA device"]
fn device_all_reduces_of_one_machine_beside_servers_run_through_nccl() {
    let test = "device_all_reduces_of_one_machine_beside_servers_run_through_nccl";
    let Some(comm) = rank_of_job(test) else {
        let mut env = vec![("FAIRRING_TIMEOUT", "60".to_owned())];
        env.extend(through_nccl());
        for float_maximum in [false, true] {
            let mut env = env.clone();
            env.push(("FAIRRING_TEST_FLOAT_MAXIMUM", float_maximum.to_string()));
            let (moved, done) = beside_two_servers(test, 1, 2, &env);
            assert_eq!(
                moved == 0,
                !float_maximum,
                "the servers moved {moved} bytes: {done:?}"
            );
        }
        return;
    };
    let float_maximum = std::env::var("FAIRRING_TEST_FLOAT_MAXIMUM").is_ok_and(|v| v == "true");
    let calls: &[(DataType, ReduceOp, usize)] = if float_maximum {
        &[(DataType::F32, ReduceOp::Max, 1 << 20)]
    } else {
        &[
            (DataType::F32, ReduceOp::Sum, 6 << 20),
            (DataType::F32, ReduceOp::Sum, 4),
            (DataType::I64, ReduceOp::Sum, 1 << 20),
            (DataType::I32, ReduceOp::Max, 5 << 20),
        ]
    };
    all_reduce_device_tensors_exactly(&comm, calls);
}

/// A kernel enqueued on the caller's stream before the all-reduce writes its
/// input, and one enqueued after it reads the result, with no host
/// synchronisation in between: the collective is ordered on the stream.
#[test]
#[ignore = "needs a CUDA device"]
fn the_collective_is_ordered_on_the_callers_stream() {
    let test = "the_collective_is_ordered_on_the_callers_stream";
    let Some(comm) = rank_of_job(test) else {
        let env = [("FAIRRING_ALGO", "hierarchical".to_owned())];
        ProcessJob::run(test, 2, 1, &env, JOB_LIMIT);
        return;
    };
    let n = 1 << 20; // f32 elements: 4 MiB, many slices
    let rounds = 20;
    let rank = comm.rank();
    let device = device();
    let kernels = ReductionKernels::load(&device).unwrap();
    let stream = Stream::new(&device, false).unwrap();
    let mut ones = DeviceBuffer::zeroed(&device, n * 4).unwrap();
    upload(
        &stream,
        &mut ones,
        0,
        &encode(DataType::F32, (0..n).map(|_| 1)),
    );
    let mut data = DeviceBuffer::zeroed(&device, n * 4).unwrap();
    let mut after = DeviceBuffer::zeroed(&device, n * 4).unwrap();
    let mut host = PinnedBuffer::zeroed(&device, n * 4).unwrap();
    stream.synchronize().unwrap();
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
        // SAFETY: nothing but work ordered after `enqueue_wait` on `stream`
        // touches `data` until the operation finishes.
        let w = unsafe {
            comm.start(
                &Call::all_reduce(
                    data.raw() as *mut u8,
                    n as u64,
                    DataType::F32,
                    ReduceOp::Sum,
                )
                .on_stream(stream.raw()),
            )?
        };
        w.enqueue_wait(&stream)?;
        // After: a kernel reads the result (after = result), and a copy brings
        // it to the host, all on the stream.
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
    stream.synchronize().unwrap();
    let want = (2 * rounds) as f32;
    let wrong = host
        .as_slice()
        .chunks_exact(4)
        .filter(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want)
        .count();
    assert_eq!(wrong, 0, "rank {rank}: elements differing from {want}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_rank_passing_host_memory_where_another_passes_device_memory_is_a_mismatch() {
    let test = "a_rank_passing_host_memory_where_another_passes_device_memory_is_a_mismatch";
    let Some(comm) = rank_of_job(test) else {
        let env = [("FAIRRING_ALGO", "hierarchical".to_owned())];
        ProcessJob::run(test, 2, 1, &env, JOB_LIMIT);
        return;
    };
    let n = 4096;
    let rank = comm.rank();
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let r = if rank == 0 {
        let mut buf = DeviceBuffer::zeroed(&device, n * 4).unwrap();
        let mut view = buf.slice_mut();
        comm.scope(|s| {
            s.all_reduce(
                TensorMut::device(&mut view, DataType::F32, &stream)?,
                ReduceOp::Sum,
                (),
            )?
            .wait()
        })
    } else {
        let mut host = vec![0f32; n];
        comm.all_reduce(&mut host, ReduceOp::Sum)
    };
    match r {
        Err(Error::Mismatch {
            called,
            peer_called,
            ..
        }) => {
            let both = format!("{called} / {peer_called}");
            assert!(both.contains("device memory"), "rank {rank}: {both}");
        }
        Err(Error::Failed { first }) if matches!(*first, Error::Mismatch { .. }) => {}
        other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
    }
}

/// On one machine through NCCL (1x2, the communicators made with the device,
/// so NCCL's are ready on both ranks), rank 0's all-reduce of a device tensor
/// is one NCCL call, which starts as its stream reaches it, without waiting
/// for the engine; rank 1 passes host memory and makes no NCCL call. Both
/// fail with the mismatch, and rank 0's stream still drains: the engine's
/// failure aborts the call NCCL had begun.
#[test]
#[ignore = "needs a CUDA device"]
fn a_mismatch_against_an_nccl_call_already_begun_fails_both_and_its_stream_drains() {
    let test = "a_mismatch_against_an_nccl_call_already_begun_fails_both_and_its_stream_drains";
    let Some(comm) = rank_of_job(test) else {
        let mut env = vec![
            ("FAIRRING_DEVICE", "0".to_owned()),
            ("FAIRRING_TIMEOUT", "20".to_owned()),
        ];
        env.extend(through_nccl());
        ProcessJob::run(test, 1, 2, &env, JOB_LIMIT);
        return;
    };
    let n = 1 << 20;
    let rank = comm.rank();
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let mut buf = DeviceBuffer::zeroed(&device, n * 4).unwrap();
    let r = if rank == 0 {
        let mut view = buf.slice_mut();
        comm.scope(|s| {
            let work = s.all_reduce(
                TensorMut::device(&mut view, DataType::F32, &stream)?,
                ReduceOp::Sum,
                (),
            )?;
            finish(&stream, work)
        })
    } else {
        let mut host = vec![0f32; n];
        comm.all_reduce(&mut host, ReduceOp::Sum)
    };
    match r {
        Err(Error::Mismatch { .. }) => {}
        Err(Error::Failed { first }) if matches!(*first, Error::Mismatch { .. }) => {}
        other => panic!("rank {rank}: expected a mismatch, got {other:?}"),
    }
    stream
        .synchronize()
        .unwrap_or_else(|e| panic!("rank {rank}: the stream drains: {e}"));
}

/// The launcher's side of a killed-rank test: an `m`x`d` job with a 2 s
/// timeout and `extra` in its environment; once every rank says READY rank 2
/// is killed, each survivor must say FAILED naming rank 2 within twice the
/// timeout, then `then` with a line containing `then_says`.
fn kill_rank_2_of(
    test: &str,
    (m, d): (u32, u32),
    extra: &[(&'static str, String)],
    then: &str,
    then_says: &str,
) {
    eprintln!("{m}x{d} {extra:?}");
    let timeout = Duration::from_secs(2);
    let mut env = vec![
        ("FAIRRING_ALGO", "hierarchical".to_owned()),
        ("FAIRRING_TIMEOUT", "2".to_owned()),
    ];
    env.extend_from_slice(extra);
    let mut job = ProcessJob::start(test, m, d, &env);
    let all: Vec<u32> = (0..m * d).collect();
    let survivors: Vec<u32> = all.iter().copied().filter(|&r| r != 2).collect();
    job.await_line(&all, "READY", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(100));
    let at = Instant::now();
    job.kill(2);
    let failed = job.await_line(&survivors, "FAILED", 2 * timeout + Duration::from_secs(3));
    let took = at.elapsed();
    for (rank, line) in failed.iter().enumerate() {
        eprintln!("rank {rank} after {took:?}: {line}");
        assert!(
            line.contains("rank 2"),
            "rank {rank} does not name rank 2: {line}"
        );
    }
    for (rank, line) in job
        .await_line(&survivors, then, Duration::from_secs(10))
        .iter()
        .enumerate()
    {
        assert!(line.contains(then_says), "rank {rank}: {line}");
    }
    job.finish(Duration::from_secs(60));
}

/// Kills rank 2 of a 3x1 job in the middle of its device all-reduces: each
/// survivor's operation fails naming rank 2 within twice the timeout, every
/// stream waiting for it is released, and later work is refused.
#[test]
#[ignore = "needs a CUDA device"]
fn a_killed_rank_fails_every_survivors_device_operation_naming_it() {
    let test = "a_killed_rank_fails_every_survivors_device_operation_naming_it";
    let Some(comm) = rank_of_job(test) else {
        kill_rank_2_of(test, (3, 1), &[], "REFUSED", "failed earlier");
        return;
    };
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let n = 1 << 20;
    let buf = DeviceBuffer::zeroed(&device, n * 4).unwrap();
    let end = Instant::now() + Duration::from_secs(120);
    let mut done = 0u64;
    let all_reduce = || {
        // SAFETY: nothing else touches `buf` while the operation runs: each is
        // waited for (on the stream and the host) before the next.
        let w = unsafe {
            comm.start(
                &Call::all_reduce(buf.raw() as *mut u8, n as u64, DataType::F32, ReduceOp::Avg)
                    .on_stream(stream.raw()),
            )?
        };
        finish(&stream, w)
    };
    while Instant::now() < end {
        match all_reduce() {
            Ok(()) => {
                done += 1;
                if done == 1 {
                    say("READY");
                }
            }
            Err(e) => {
                say(&format!("FAILED {e}"));
                // A failed operation releases the streams that wait for it.
                stream.synchronize().unwrap();
                match all_reduce() {
                    Err(e) => say(&format!("REFUSED {e}")),
                    Ok(()) => panic!("rank {}: work after a failure ran", comm.rank()),
                }
                return;
            }
        }
    }
    panic!("rank {}: no failure after {done} operations", comm.rank());
}

/// The pattern of every PyTorch job, under a failure: each survivor keeps
/// two device all-reduces in flight on one stream, the second submitted after
/// the stream was made to wait for the first (so the second's start sits
/// behind a wait the engine releases), and never waits on the host before
/// submitting. Rank 2 is killed: every survivor fails naming it within twice
/// the timeout, and its stream is released (it synchronises).
#[test]
#[ignore = "needs a CUDA device"]
fn a_killed_rank_fails_survivors_whose_streams_wait_behind_operations() {
    let test = "a_killed_rank_fails_survivors_whose_streams_wait_behind_operations";
    let Some(comm) = rank_of_job(test) else {
        // One GPU per machine; then two per machine, rank 2's machine peer
        // waiting in NCCL's kernels (the abort must end them) or on the
        // host-staged step.
        kill_rank_2_of(test, (3, 1), &[], "RELEASED", "stream");
        for local in [through_nccl(), through_host()] {
            kill_rank_2_of(test, (2, 2), &local, "RELEASED", "stream");
        }
        return;
    };
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let n = 1 << 20;
    let bufs = [
        DeviceBuffer::zeroed(&device, n * 4).unwrap(),
        DeviceBuffer::zeroed(&device, n * 4).unwrap(),
    ];
    let end = Instant::now() + Duration::from_secs(120);
    let start = |i: usize| {
        // SAFETY: each buffer is handed to one operation at a time: the
        // operation on it two steps back has been waited for on the host.
        let w = unsafe {
            comm.start(
                &Call::all_reduce(
                    bufs[i % 2].raw() as *mut u8,
                    n as u64,
                    DataType::F32,
                    ReduceOp::Avg,
                )
                .on_stream(stream.raw()),
            )?
        };
        w.enqueue_wait(&stream)?;
        Ok(w)
    };
    let mut in_flight = std::collections::VecDeque::new();
    let mut done = 0u64;
    while Instant::now() < end {
        let next: fairring::Result<()> = start(done as usize).and_then(|w| {
            in_flight.push_back(w);
            if in_flight.len() > 1
                && let Some(oldest) = in_flight.pop_front()
            {
                oldest.wait()?;
            }
            Ok(())
        });
        match next {
            Ok(()) => {
                done += 1;
                if done == 4 {
                    say("READY");
                }
            }
            Err(e) => {
                say(&format!("FAILED {e}"));
                let (tx, rx) = std::sync::mpsc::channel();
                let raw = stream.raw() as usize;
                let device = Arc::clone(&device);
                std::thread::spawn(move || {
                    // SAFETY: the test's stream, alive until the test returns,
                    // which waits for this thread's answer (or fails first).
                    let view = unsafe { Stream::from_raw(&device, raw as _) };
                    let _ = tx.send(view.synchronize());
                });
                match rx.recv_timeout(Duration::from_secs(10)) {
                    Ok(Ok(())) => say("RELEASED the stream synchronised"),
                    other => panic!(
                        "rank {}: the stream is not released: {other:?}",
                        comm.rank()
                    ),
                }
                return;
            }
        }
    }
    panic!("rank {}: no failure after {done} operations", comm.rank());
}

/// A stream made to wait for a host operation that finished before any device
/// operation made the device side (a barrier) goes on at once.
#[test]
#[ignore = "needs a CUDA device"]
fn enqueue_wait_after_a_host_barrier_returns() {
    let test = "enqueue_wait_after_a_host_barrier_returns";
    let Some(comm) = rank_of_job(test) else {
        let job = ProcessJob::start(test, 2, 1, &[]);
        job.finish(JOB_LIMIT);
        return;
    };
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    // SAFETY: a barrier touches no memory of the caller's.
    let barrier = unsafe { comm.start(&Call::barrier()) }.unwrap();
    barrier.wait_timeout(Duration::from_secs(60)).unwrap();
    let buf = DeviceBuffer::zeroed(&device, 4096).unwrap();
    // SAFETY: `buf` is waited for below before it drops.
    let w = unsafe {
        comm.start(
            &Call::all_reduce(buf.raw() as *mut u8, 1024, DataType::F32, ReduceOp::Sum)
                .on_stream(stream.raw()),
        )
        .unwrap()
    };
    finish(&stream, w).unwrap();
    barrier.enqueue_wait(&stream).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let raw = stream.raw() as usize;
    let side = Arc::clone(&device);
    std::thread::spawn(move || {
        // SAFETY: the test's stream, alive until the test returns.
        let view = unsafe { Stream::from_raw(&side, raw as _) };
        let _ = tx.send(view.synchronize());
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(())) => {}
        other => panic!("rank {}: the stream waits on: {other:?}", comm.rank()),
    }
}

/// A communicator dropped while a caller's stream has yet to reach a wait for
/// one of its operations: the stream still goes on past the wait once it gets
/// there (the words it reads stay allocated, and were raised past every
/// value). The stream is held first by a word of the test's own.
///
/// The communicator's device side is made (by a first operation) before the
/// stream is held: making it page-locks memory, which waits for the device,
/// and so for the held stream.
#[test]
#[ignore = "needs a CUDA device"]
fn a_stream_waiting_on_a_dropped_communicator_goes_on() {
    let test = "a_stream_waiting_on_a_dropped_communicator_goes_on";
    let Some(comm) = rank_of_job(test) else {
        let job = ProcessJob::start(test, 1, 1, &[]);
        job.finish(JOB_LIMIT);
        return;
    };
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let hold = fairring::cuda::HostFlags::new(&device, 1).unwrap();
    let buf = DeviceBuffer::zeroed(&device, 4096).unwrap();
    let call = Call::all_reduce(buf.raw() as *mut u8, 1024, DataType::F32, ReduceOp::Sum)
        .on_stream(stream.raw());
    // SAFETY: waited for on the host before `buf` is touched again.
    unsafe { comm.start(&call) }.unwrap().wait().unwrap();
    hold.enqueue_wait(&stream, 0, 1).unwrap();
    // SAFETY: `buf` outlives the stream's use of it: the test synchronises
    // the stream before it returns.
    let w = unsafe { comm.start(&call) }.unwrap();
    w.enqueue_wait(&stream).unwrap();
    // The operation cannot start (its start is behind `hold`): abort it, and
    // drop the communicator with the stream's wait still ahead of it.
    comm.abort();
    assert!(w.wait_timeout(Duration::from_secs(1)).is_err());
    std::mem::forget(w);
    drop(comm);
    hold.set(0, 1).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let raw = stream.raw() as usize;
    let side = Arc::clone(&device);
    std::thread::spawn(move || {
        // SAFETY: the test's stream, alive until the test returns.
        let view = unsafe { Stream::from_raw(&side, raw as _) };
        let _ = tx.send(view.synchronize());
    });
    match rx.recv_timeout(Duration::from_secs(10)) {
        Ok(Ok(())) => {}
        other => panic!("the stream does not go on: {other:?}"),
    }
}

/// A device broadcast or all-gather refused (here: the communicator was
/// aborted) leaves its output as it was: nothing was enqueued for it.
#[test]
#[ignore = "needs a CUDA device"]
fn a_refused_device_call_leaves_its_output_unchanged() {
    let test = "a_refused_device_call_leaves_its_output_unchanged";
    let Some(comm) = rank_of_job(test) else {
        let job = ProcessJob::start(test, 2, 1, &[]);
        job.finish(JOB_LIMIT);
        return;
    };
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    let n = 1024;
    let world = comm.world_size() as usize;
    let mut output = DeviceBuffer::zeroed(&device, n * 4 * world).unwrap();
    let ones = encode(DataType::F32, std::iter::repeat_n(1, n * world));
    upload(&stream, &mut output, 0, &ones);
    let input = DeviceBuffer::zeroed(&device, n * 4).unwrap();
    comm.abort();
    let root = (comm.rank() + 1) % comm.world_size();
    // SAFETY: the buffer outlives the call, which is refused.
    let broadcast = unsafe {
        comm.start(
            &Call::broadcast(output.raw() as *mut u8, n as u64, DataType::F32, root)
                .on_stream(stream.raw()),
        )
        .map(drop)
    };
    // SAFETY: as above, for both buffers.
    let gather = unsafe {
        let call = Call::all_gather(
            input.raw() as *const u8,
            output.raw() as *mut u8,
            n as u64,
            DataType::F32,
        );
        comm.start(&call.on_stream(stream.raw())).map(drop)
    };
    let refused = [broadcast, gather];
    for r in refused {
        assert!(matches!(r, Err(Error::Failed { .. })), "{r:?}");
    }
    assert_eq!(download(&stream, &output, 0, ones.len()), ones);
}

/// After warm-up, a device all-reduce allocates nothing on the host, on any
/// thread of any rank (progress thread and fabric I/O included), for each
/// algorithm and for one slice and many, with one rank per machine and with
/// two (through NCCL, and the host-staged step).
#[test]
#[ignore = "needs a CUDA device"]
fn no_host_allocation_per_device_all_reduce_on_any_rank() {
    let test = "no_host_allocation_per_device_all_reduce_on_any_rank";
    let Some(comm) = rank_of_job(test) else {
        let env = [
            ("FAIRRING_SLICE_SIZE", "1048576".to_owned()),
            ("FAIRRING_TOTAL_MEMORY", "8388608".to_owned()),
            ("FAIRRING_TIMEOUT", "60".to_owned()),
        ];
        ProcessJob::run(test, 2, 1, &env, JOB_LIMIT);
        for local in [through_nccl(), through_host()] {
            let mut env = env.to_vec();
            env.extend(local);
            ProcessJob::run(test, 1, 2, &env, JOB_LIMIT);
        }
        return;
    };
    let rank = comm.rank();
    let device = device();
    let stream = Stream::new(&device, false).unwrap();
    for elements in [3usize << 20, 1000] {
        for &algorithm in Algorithm::ALL {
            let mut buf = DeviceBuffer::zeroed(&device, elements * 4).unwrap();
            upload(
                &stream,
                &mut buf,
                0,
                &encode(DataType::F32, (0..elements).map(|_| 1)),
            );
            let mut counted = 0;
            for call in 0..20 {
                let before = allocations();
                // SAFETY: each operation is waited for before the next, and
                // nothing else touches `buf`.
                let r = unsafe {
                    comm.start(
                        &Call::all_reduce(
                            buf.raw() as *mut u8,
                            elements as u64,
                            DataType::F32,
                            ReduceOp::Sum,
                        )
                        .on_stream(stream.raw())
                        .with(algorithm),
                    )
                }
                .and_then(|w| finish(&stream, w));
                r.unwrap_or_else(|e| panic!("rank {rank}: {algorithm}: {e}"));
                let after = allocations();
                if call >= 10 {
                    counted += after - before;
                }
            }
            assert_eq!(
                counted, 0,
                "rank {rank}: {counted} allocations in 10 warm {algorithm} device all-reduces of \
                 {elements} elements"
            );
            let want = (comm.world_size() as f32).powi(20);
            let got = download(&stream, &buf, 0, elements * 4);
            let bad = got
                .chunks_exact(4)
                .position(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) != want);
            assert!(
                bad.is_none(),
                "rank {rank} {algorithm}: element {bad:?} is not {want}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn bad_device_arguments_are_refused_naming_the_argument() {
    let results = job(
        1,
        1,
        |b| b,
        |_, comm| {
            let device = device();
            let stream = Stream::new(&device, false).unwrap();
            let buf = DeviceBuffer::zeroed(&device, 4096).unwrap();
            let mut host = vec![0f32; 16];
            let host_ptr = host.as_mut_ptr() as u64;
            let argument = |r: fairring::Result<fairring::Work<'_>>| match r {
                Err(Error::InvalidArgument { argument, .. }) => argument,
                Err(e) => panic!("expected a refusal naming an argument, got {e}"),
                Ok(_) => panic!("bad arguments were taken"),
            };
            let (d, s) = (buf.raw(), stream.raw());
            let (f32_, sum) = (DataType::F32, ReduceOp::Sum);
            // Each call below is refused before anything touches memory,
            // which makes every `unsafe` block sound.
            let mut refusals = Vec::new();
            // SAFETY: refused (host memory).
            let r = unsafe {
                comm.start(&Call::all_reduce(host_ptr as *mut u8, 16, f32_, sum).on_stream(s))
            };
            refusals.push(argument(r));
            // SAFETY: refused (no rank 1).
            let r = unsafe { comm.start(&Call::broadcast(d as *mut u8, 16, f32_, 1).on_stream(s)) };
            refusals.push(argument(r));
            // SAFETY: refused (host memory).
            let r = unsafe {
                comm.start(
                    &Call::all_gather(host_ptr as *const u8, d as *mut u8, 16, f32_).on_stream(s),
                )
            };
            refusals.push(argument(r));
            // SAFETY: refused: the input overlaps the output other than at
            // its place.
            let r = unsafe {
                comm.start(
                    &Call::all_gather((d + 4) as *const u8, d as *mut u8, 16, f32_).on_stream(s),
                )
            };
            refusals.push(argument(r));
            // SAFETY: refused: the output lies inside the input.
            let r = unsafe {
                comm.start(
                    &Call::reduce_scatter(d as *mut u8, (d + 8) as *mut u8, 16, f32_, sum)
                        .on_stream(s),
                )
            };
            refusals.push(argument(r));
            let calls =
                [d, host_ptr].map(|t| Call::all_reduce(t as *mut u8, 4, f32_, sum).on_stream(s));
            // SAFETY: refused (the second call's tensor is host memory).
            let r = unsafe { comm.start_group(&calls) };
            refusals.push(argument(r));
            refusals
        },
    );
    assert_eq!(
        results,
        vec![vec!["data", "root", "input", "input", "output", "calls"]]
    );
}
