//! Joining by id: `fr_job_id_new` and `fr_comm_from_id`, as NCCL's
//! `ncclGetUniqueId` and `ncclCommInitRank` (see `fairring::JobId`).

use std::time::Duration;

use fairring::{Communicator, JobId};

use crate::comm::{fr_comm, give};
use crate::status::{FR_OK, boundary, fail, fr_status, invalid};

/// A job's id: 128 bytes one process makes (`fr_job_id_new`) and the host
/// runtime hands to every rank by any means (`MPI_Bcast`, a file, a
/// key-value store). It names where the job's rendezvous store serves (in
/// the maker's process), the job's secret and its run.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fr_job_id {
    /// The id's bytes, copied as they are.
    pub bytes: [u8; 128],
}

/// Makes a job's id into `*out` and starts serving the job's rendezvous
/// store in this process (until it exits, or until its own communicator of
/// the job, if it joins, is destroyed).
///
/// # Safety
///
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_job_id_new(out: *mut fr_job_id) -> fr_status {
    boundary(|| {
        if out.is_null() {
            return invalid("out", "null");
        }
        match JobId::new() {
            Ok(id) => {
                // SAFETY: non-null and valid for a write per the contract.
                unsafe {
                    out.write(fr_job_id {
                        bytes: *id.as_bytes(),
                    });
                }
                FR_OK
            }
            Err(e) => fail(&e),
        }
    })
}

/// Joins the job of `*id` as rank `rank` of `world_size`. `timeout_ms`,
/// unless 0, replaces `FAIRRING_TIMEOUT`; the other knobs come from the
/// environment. Collective: every rank of the job calls it. A changed id
/// fails at once (`FR_INVALID_ARGUMENT`, naming `id`); one whose maker has
/// exited fails within the timeout, naming the id. On success `*out` holds
/// the communicator.
///
/// # Safety
///
/// `id` is null or points to an `fr_job_id`; `out` is null or valid for a
/// write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_comm_from_id(
    id: *const fr_job_id,
    rank: u32,
    world_size: u32,
    timeout_ms: u64,
    out: *mut *mut fr_comm,
) -> fr_status {
    boundary(|| {
        if out.is_null() {
            return invalid("out", "null");
        }
        // SAFETY: per the contract, a non-null `id` points to an `fr_job_id`.
        let Some(id) = (unsafe { id.as_ref() }) else {
            return invalid("id", "null");
        };
        let timeout = (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms));
        let joined = JobId::from_bytes(&id.bytes)
            .and_then(|id| Communicator::from_id(&id, rank, world_size, timeout))
            .map_err(|e| fail(&e))
            .and_then(fr_comm::new);
        match joined {
            // SAFETY: checked non-null; valid for a write per the contract.
            Ok(c) => unsafe { give(out, c) },
            Err(s) => s,
        }
    })
}
