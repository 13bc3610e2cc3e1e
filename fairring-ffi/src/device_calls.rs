//! Collectives on CUDA device memory, ordered on the caller's stream (the
//! `cuda` feature; the header declares them when `FAIRRING_CUDA` is defined).
//!
//! Each takes a device pointer (`void *`, as `cudaMalloc` and
//! `torch.Tensor.data_ptr()` give it) and a stream (`cudaStream_t` or
//! `CUstream`, passed as `void *`; null is the legacy default stream) of the
//! device's primary context, which the CUDA runtime and PyTorch use. The
//! operation starts after everything already enqueued on the stream, and the
//! call never waits for the GPU. `fr_work_enqueue_wait` makes a stream wait for
//! the operation on the device; `fr_work_wait` and `fr_work_test` wait and test
//! on the host.
//!
//! The memory must stay valid, and no stream or thread may touch it, until
//! the operation completes (work ordered after `fr_work_enqueue_wait` may).
//! One communicator drives one GPU. With several ranks per machine, the
//! machine's step runs as NCCL's collectives or through its shared segment
//! (`FAIRRING_DEVICE_LOCAL`).

use std::ffi::c_void;

use fairring::Call;
use fairring::cuda::sys::CUstream;

use crate::call::{Calls, dtype_of, lists, op_of, start_export};
use crate::comm::fr_comm;
use crate::status::{FR_OK, boundary, fail, fr_status, invalid};
use crate::work_handles::fr_work;

/// Starts an all-reduce of `count` elements of `dtype` at device address
/// `data`, in place, with `op`, ordered on `stream`. `*out` receives the work
/// handle.
///
/// # Safety
///
/// `comm` is a live handle; `data` is device memory valid for reads and writes
/// of `count` elements, aligned for `dtype`, untouched by the caller and by
/// every stream until the work finishes; `stream` is null or a live stream of
/// that device's primary context, alive until the work finishes; `out` is
/// valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_all_reduce_device(
    comm: *const fr_comm,
    data: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    stream: *mut c_void,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::all_reduce(data.cast(), count, dtype_of(dtype)?, op_of(op)?);
        Ok(Calls::One(call.on_stream(stream as CUstream)))
    })
}

/// Starts an all-reduce of each of the `n` device tensors `data[i]` of
/// `counts[i]` elements, all of `dtype`, ordered on `stream`; one work covers
/// them all. Every tensor is checked before any starts.
///
/// # Safety
///
/// As `fr_all_reduce_device`, for every tensor; `data` and `counts` hold `n`
/// entries each (read during the call); no two tensors overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_all_reduce_coalesced_device(
    comm: *const fr_comm,
    data: *const *mut c_void,
    counts: *const u64,
    n: usize,
    dtype: i32,
    op: i32,
    stream: *mut c_void,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        // SAFETY: the lists' contract is the caller's, as documented.
        let (data, counts) = unsafe { lists(data, counts, n) }?;
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let calls = data
            .iter()
            .zip(counts)
            .map(|(&d, &c)| Call::all_reduce(d.cast(), c, dtype, op).on_stream(stream as CUstream));
        Ok(Calls::Group(calls.collect(), "data"))
    })
}

/// Starts a broadcast of `count` elements of `dtype` at device address `data`
/// from rank `root`, ordered on `stream` (bit-exact for every type).
///
/// # Safety
///
/// As `fr_all_reduce_device`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_broadcast_device(
    comm: *const fr_comm,
    data: *mut c_void,
    count: u64,
    dtype: i32,
    root: u32,
    stream: *mut c_void,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::broadcast(data.cast(), count, dtype_of(dtype)?, root);
        Ok(Calls::One(call.on_stream(stream as CUstream)))
    })
}

/// Starts an all-gather on device memory, ordered on `stream`: every rank's
/// `count` elements at `input` land, in rank order, in `output`
/// (`world_size * count` elements). `input` may be this rank's place in
/// `output`, and may not otherwise overlap it.
///
/// # Safety
///
/// As `fr_all_reduce_device`, for `output` (`world_size * count` elements);
/// `input` is device memory of the same GPU valid for reads of `count`
/// elements, which no stream writes until the work finishes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_all_gather_device(
    comm: *const fr_comm,
    input: *const c_void,
    output: *mut c_void,
    count: u64,
    dtype: i32,
    stream: *mut c_void,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let call = Call::all_gather(input.cast(), output.cast(), count, dtype_of(dtype)?);
        Ok(Calls::One(call.on_stream(stream as CUstream)))
    })
}

/// Starts a reduce-scatter on device memory, ordered on `stream`: `input`
/// (`world_size * count` elements) is reduced with `op` across ranks, and this
/// rank's `count` elements of the result are copied into `output`. `input` is
/// workspace, as in `fr_reduce_scatter`.
///
/// # Safety
///
/// As `fr_all_reduce_device`, for `input` and for `output`, which must not
/// overlap.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_reduce_scatter_device(
    comm: *const fr_comm,
    input: *mut c_void,
    output: *mut c_void,
    count: u64,
    dtype: i32,
    op: i32,
    stream: *mut c_void,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let (dtype, op) = (dtype_of(dtype)?, op_of(op)?);
        let call = Call::reduce_scatter(input.cast(), output.cast(), count, dtype, op);
        Ok(Calls::One(call.on_stream(stream as CUstream)))
    })
}

/// Makes `stream` wait, on the device, until the work has finished: what is
/// enqueued on `stream` afterwards sees its result; the host does not wait. A
/// failed operation releases the stream too, once nothing of it touches its
/// tensors any more (`fr_work_wait` reports its error). Its messages (sends,
/// receives, a host gather's or scatter's) live on the host: the host waits
/// for them here.
///
/// Every device step of an operation was enqueued when it was started, so
/// the stream drains without a CUDA call still to be made: any thread may
/// make any CUDA call meanwhile, one that waits for the whole device
/// included.
///
/// # Safety
///
/// `work` is a live handle; `stream` is null or a live stream of the primary
/// context of the GPU the communicator's device operations run on.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_work_enqueue_wait(
    work: *const fr_work,
    stream: *mut c_void,
) -> fr_status {
    boundary(|| {
        // SAFETY: per the contract, a non-null `work` is a live handle.
        let Some(w) = (unsafe { work.as_ref() }) else {
            return invalid("work", "null");
        };
        // SAFETY: the stream contract is the caller's, as documented.
        match unsafe { w.work.enqueue_wait_raw(stream as CUstream) } {
            Ok(()) => FR_OK,
            Err(e) => fail(&e),
        }
    })
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;
    use crate::fr_last_error;
    use crate::status::FR_INVALID_ARGUMENT;

    fn last_error() -> String {
        // SAFETY: `fr_last_error` never returns null, and the text stays valid
        // until the next call on this thread.
        unsafe { CStr::from_ptr(fr_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn null_handles_are_refused_naming_them() {
        let mut out: *mut fr_work = std::ptr::null_mut();
        let null = std::ptr::null_mut();
        // SAFETY: a null handle is refused before anything is touched.
        let s = unsafe { fr_all_reduce_device(std::ptr::null(), null, 4, 0, 0, null, &mut out) };
        assert_eq!(s, FR_INVALID_ARGUMENT);
        assert!(last_error().contains("`comm`"), "{}", last_error());
        assert!(out.is_null());
        // SAFETY: as above.
        let s = unsafe { fr_work_enqueue_wait(std::ptr::null(), null) };
        assert_eq!(s, FR_INVALID_ARGUMENT);
        assert!(last_error().contains("`work`"), "{}", last_error());
        // SAFETY: as above; the lists are null with a length of one.
        let s = unsafe {
            fr_all_reduce_coalesced_device(
                std::ptr::null(),
                std::ptr::null(),
                std::ptr::null(),
                1,
                0,
                0,
                null,
                &mut out,
            )
        };
        assert_eq!(s, FR_INVALID_ARGUMENT);
        assert!(last_error().contains("`data`"), "{}", last_error());
    }

    #[test]
    fn the_library_says_it_was_built_with_the_device_calls() {
        assert!(crate::fr_cuda_built());
    }
}
