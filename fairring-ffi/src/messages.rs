//! Point-to-point messages: `fr_send` and `fr_recv` (conveniences for
//! `fr_start` of an `FR_COLLECTIVE_SEND` or `FR_COLLECTIVE_RECV` call) and
//! `fr_all_to_all`, each a work handle like any operation's (waited, tested,
//! called back and freed alike).
//!
//! A message is an operation of the communicator's engine; the call returns
//! at once (a peer first named is connected to in the background). Messages
//! from one rank to another of one tag match that rank's receives of that
//! tag in the order both were posted; a receive of another size or type
//! fails both messages with `FR_MISMATCH`, each naming both ranks, except
//! that a send of at most 16 KiB over the fabric (between machines, or
//! between ranks of one that may not read each other's memory) goes eagerly
//! (done once its bytes have left) and only its receive fails.

use std::ffi::c_void;

use fairring::Call;

use crate::call::{Calls, dtype_of, start_export};
use crate::comm::{begin, fr_comm, hand_out};
use crate::status::{boundary, fr_status, invalid};
use crate::work_handles::fr_work;

/// Posts a send of `count` elements of `dtype` at `data` to rank `peer`,
/// with tag `tag`. `*out` receives the work handle.
///
/// # Safety
///
/// `comm` is a live handle; `data` is valid for reads and writes of `count`
/// elements, aligned for `dtype`, and not written by the caller until the
/// work finishes (freeing the handle does not end that); `out` is valid for
/// a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_send(
    comm: *const fr_comm,
    peer: u32,
    tag: u32,
    data: *mut c_void,
    count: u64,
    dtype: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    // SAFETY: forwarded.
    unsafe { post(comm, peer, tag, true, data, count, dtype, out) }
}

/// Posts a receive of `count` elements of `dtype` into `data` from rank
/// `peer`: the next message of tag `tag` that rank sends this one. `*out`
/// receives the work handle.
///
/// # Safety
///
/// As `fr_send`; the caller neither reads nor writes `data` until the work
/// finishes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_recv(
    comm: *const fr_comm,
    peer: u32,
    tag: u32,
    data: *mut c_void,
    count: u64,
    dtype: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    // SAFETY: forwarded.
    unsafe { post(comm, peer, tag, false, data, count, dtype, out) }
}

/// A send or a receive as a call, started through `fr_start`'s path.
///
/// # Safety
///
/// As `fr_send`.
#[expect(
    clippy::too_many_arguments,
    reason = "a message's complete description"
)]
unsafe fn post(
    comm: *const fr_comm,
    peer: u32,
    tag: u32,
    sending: bool,
    data: *mut c_void,
    count: u64,
    dtype: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    start_export!(comm, out, {
        let dtype = dtype_of(dtype)?;
        Ok(Calls::One(if sending {
            Call::send(peer, tag, data.cast_const().cast(), count, dtype)
        } else {
            Call::recv(peer, tag, data.cast(), count, dtype)
        }))
    })
}

/// Posts an all-to-all of `dtype` elements: `input_counts[j]` elements of
/// `input` (the blocks in rank order) to rank `j`, `output_counts[j]` of
/// `output` from it; each array holds one count per rank. This rank's own
/// block is copied before the call returns; every other one is a message
/// to or from its rank. A rank whose block to another disagrees with that
/// rank's count fails both with `FR_MISMATCH`, naming both. `*out` receives
/// one work handle for all of them.
///
/// # Safety
///
/// `comm` is a live handle; `input_counts` and `output_counts` point to
/// `world_size` counts each; `input` and `output` are valid for reads and
/// writes of their counts' sums of elements, aligned for `dtype`, apart from
/// each other, and not written (`output` not read either) by the caller
/// until the work finishes; `out` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_all_to_all(
    comm: *const fr_comm,
    input: *mut c_void,
    input_counts: *const u64,
    output: *mut c_void,
    output_counts: *const u64,
    dtype: i32,
    out: *mut *mut fr_work,
) -> fr_status {
    boundary(|| {
        // SAFETY: forwarded.
        let (c, dtype) = match unsafe { begin_typed(comm, out, dtype) } {
            Ok(both) => both,
            Err(s) => return s,
        };
        let world = c.comm.world_size() as usize;
        // SAFETY: per the contract, each array holds `world` counts.
        let ins = unsafe { counted(input_counts, world) };
        // SAFETY: as above.
        let outs = unsafe { counted(output_counts, world) };
        let counts = (ins, outs);
        let (ins, outs) = match counts {
            (Some(i), Some(o)) => (i, o),
            (None, _) => return invalid("input_counts", "null"),
            (_, None) => return invalid("output_counts", "null"),
        };
        // SAFETY: the memory contract is the caller's, as documented.
        let message = unsafe {
            c.comm
                .post_all_to_all(input.cast(), ins, output.cast(), outs, dtype)
        };
        // SAFETY: `begin` checked `out`, valid for a write per the contract.
        unsafe { hand_out(c, out, message) }
    })
}

/// The communicator behind `comm` and the type `dtype` names, once `out` is
/// known to be writable; or the status naming what was wrong.
///
/// # Safety
///
/// `comm` is null or a live handle.
unsafe fn begin_typed<'a>(
    comm: *const fr_comm,
    out: *mut *mut fr_work,
    dtype: i32,
) -> Result<(&'a fr_comm, fairring::DataType), fr_status> {
    // SAFETY: forwarded.
    let c = unsafe { begin(comm, out) }?;
    Ok((c, dtype_of(dtype)?))
}

/// `len` counts at `counts`, or `None` for a null pointer.
///
/// # Safety
///
/// `counts` is null or points to `len` readable counts that outlive `'a`.
unsafe fn counted<'a>(counts: *const u64, len: usize) -> Option<&'a [u64]> {
    // SAFETY: non-null, and `len` readable counts per the contract.
    (!counts.is_null()).then(|| unsafe { std::slice::from_raw_parts(counts, len) })
}
