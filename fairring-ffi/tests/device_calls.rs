//! The device calls of the C ABI on a GPU: a 2x1 job of processes (this test
//! binary re-executed as each rank, from torchrun's variables, each rank a
//! machine of its own) sharing GPU 0, all-reducing, broadcasting, gathering
//! and scattering device memory ordered on a stream, as a runtime calls them.
//!
//! Ignored without a GPU; run with `cargo test -p fairring-ffi --features cuda
//! --test device_calls -- --include-ignored` where one exists.
#![cfg(feature = "cuda")]
#![expect(
    clippy::cast_possible_truncation,
    reason = "device addresses fit a pointer on the 64-bit machines CUDA runs on; counts are small"
)]

use std::ffi::{CStr, c_void};
use std::time::Duration;

use fairring::cuda::{Device, DeviceBuffer, Stream};
use fairring_ffi::{
    FR_DTYPE_F32, FR_OK, FR_OP_SUM, fr_all_gather_device, fr_all_reduce_device,
    fr_broadcast_device, fr_comm, fr_comm_destroy, fr_comm_from_env, fr_comm_rank, fr_last_error,
    fr_reduce_scatter_device, fr_status, fr_work, fr_work_enqueue_wait, fr_work_free, fr_work_wait,
};

/// Set in a rank's environment.
const RANK_OF: &str = "FAIRRING_FFI_DEVICE_TEST_RANK";

fn check(what: &str, status: fr_status) {
    if status != FR_OK {
        // SAFETY: never null; valid until the next call on this thread.
        let message = unsafe { CStr::from_ptr(fr_last_error()) }.to_string_lossy();
        panic!("{what}: status {status}: {message}");
    }
}

/// Waits for `work` on `stream` and on the host, then frees it.
fn finish(what: &str, work: *mut fr_work, stream: &Stream) {
    // SAFETY: a live work handle and a live stream of GPU 0.
    check(what, unsafe {
        fr_work_enqueue_wait(work, stream.raw() as *mut c_void)
    });
    // SAFETY: a live work handle.
    check(what, unsafe { fr_work_wait(work) });
    // SAFETY: a live handle, not used after this.
    unsafe { fr_work_free(work) };
}

fn f32s(values: impl Iterator<Item = f32>) -> Vec<u8> {
    values.flat_map(f32::to_le_bytes).collect()
}

fn download(stream: &Stream, buf: &DeviceBuffer, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    stream
        .download_blocking(&mut out, buf.slice().range(0..len).unwrap())
        .unwrap();
    out
}

/// One rank's part.
fn rank_body() {
    let mut comm: *mut fr_comm = std::ptr::null_mut();
    // SAFETY: `comm` is valid for a write.
    check("fr_comm_from_env", unsafe { fr_comm_from_env(&mut comm) });
    let (mut rank, mut world) = (0u32, 0u32);
    // SAFETY: a live handle; both outputs are valid for writes.
    check("fr_comm_rank", unsafe {
        fr_comm_rank(comm, &mut rank, &mut world)
    });
    let device = Device::open(0).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"));
    let stream = Stream::new(&device, false).unwrap();
    let raw_stream = stream.raw() as *mut c_void;
    let n = 100_003usize;
    let mut a = DeviceBuffer::zeroed(&device, n * 4 * world as usize).unwrap();
    let mut b = DeviceBuffer::zeroed(&device, n * 4 * world as usize).unwrap();
    let mine = |r: u32| f32s((0..n).map(move |i| ((i + r as usize * 5) % 17) as f32));
    let mut work: *mut fr_work = std::ptr::null_mut();

    // All-reduce.
    stream
        .upload_blocking(&mut a.slice_mut().range(0..n * 4).unwrap(), &mine(rank))
        .unwrap();
    // SAFETY: `a` holds `n` f32 on GPU 0, untouched until `finish`.
    check("fr_all_reduce_device", unsafe {
        fr_all_reduce_device(
            comm,
            a.raw() as usize as *mut c_void,
            n as u64,
            FR_DTYPE_F32,
            FR_OP_SUM,
            raw_stream,
            &mut work,
        )
    });
    finish("all-reduce", work, &stream);
    let sum = f32s((0..n).map(|i| (0..world).map(|r| ((i + r as usize * 5) % 17) as f32).sum()));
    assert!(
        download(&stream, &a, n * 4) == sum,
        "rank {rank}: all-reduce"
    );

    // Broadcast from rank 1.
    stream
        .upload_blocking(&mut a.slice_mut().range(0..n * 4).unwrap(), &mine(rank))
        .unwrap();
    // SAFETY: as above.
    check("fr_broadcast_device", unsafe {
        fr_broadcast_device(
            comm,
            a.raw() as usize as *mut c_void,
            n as u64,
            FR_DTYPE_F32,
            1,
            raw_stream,
            &mut work,
        )
    });
    finish("broadcast", work, &stream);
    assert!(
        download(&stream, &a, n * 4) == mine(1),
        "rank {rank}: broadcast"
    );

    // All-gather from `b` into `a`.
    stream
        .upload_blocking(&mut b.slice_mut().range(0..n * 4).unwrap(), &mine(rank))
        .unwrap();
    // SAFETY: `b` holds the input and `a` room for every rank's, untouched
    // until `finish`.
    check("fr_all_gather_device", unsafe {
        fr_all_gather_device(
            comm,
            b.raw() as usize as *const c_void,
            a.raw() as usize as *mut c_void,
            n as u64,
            FR_DTYPE_F32,
            raw_stream,
            &mut work,
        )
    });
    finish("all-gather", work, &stream);
    let all: Vec<u8> = (0..world).flat_map(mine).collect();
    assert!(
        download(&stream, &a, all.len()) == all,
        "rank {rank}: all-gather"
    );

    // Reduce-scatter of `a` (every rank's inputs, as gathered) into `b`.
    // SAFETY: `a` holds `world * n` f32 and `b` room for `n`, apart, untouched
    // until `finish`.
    check("fr_reduce_scatter_device", unsafe {
        fr_reduce_scatter_device(
            comm,
            a.raw() as usize as *mut c_void,
            b.raw() as usize as *mut c_void,
            n as u64,
            FR_DTYPE_F32,
            FR_OP_SUM,
            raw_stream,
            &mut work,
        )
    });
    finish("reduce-scatter", work, &stream);
    let share = f32s((0..n).map(|i| ((i + rank as usize * 5) % 17) as f32 * world as f32));
    assert!(
        download(&stream, &b, n * 4) == share,
        "rank {rank}: reduce-scatter"
    );

    // SAFETY: a live handle, not used after this.
    unsafe { fr_comm_destroy(comm) };
}

/// Runs `test` as a job of two ranks, as two machines (`machines`) or two
/// ranks of one machine, sharing GPU 0.
fn two_ranks(test: &str, machines: bool) {
    let exe = std::env::current_exe().unwrap();
    let (m, d) = if machines { (2, 1) } else { (1, 2) };
    let job = fairring_local_job::LocalJob::new("ffi-device", m, d).unwrap();
    let mut ranks = job
        .spawn(|rank| {
            let mut c = job.command(&exe, rank);
            c.args([test, "--exact", "--include-ignored", "--nocapture"])
                .env(RANK_OF, "1")
                .env("FAIRRING_TIMEOUT", "60");
            c
        })
        .unwrap();
    if let Err(e) = ranks.wait(Some(Duration::from_secs(180))) {
        panic!("{test}: {e}; each rank's panic is above");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_device_call_of_the_c_abi_is_exact_on_two_ranks() {
    if std::env::var_os(RANK_OF).is_some() {
        rank_body();
        return;
    }
    two_ranks("every_device_call_of_the_c_abi_is_exact_on_two_ranks", true);
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_device_call_of_the_c_abi_is_exact_on_two_ranks_of_one_machine() {
    if std::env::var_os(RANK_OF).is_some() {
        rank_body();
        return;
    }
    two_ranks(
        "every_device_call_of_the_c_abi_is_exact_on_two_ranks_of_one_machine",
        false,
    );
}
