//! Work handles: operations in flight, waited on, tested, called back, freed.

use std::ffi::c_void;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{JoinHandle, ThreadId};
use std::time::Duration;

use fairring::OwnedWork;

use crate::status::{FR_OK, FR_PENDING, boundary, fail, fr_status, invalid};

/// Called once when an operation finishes, from a fairring thread, with
/// `FR_OK` or its error code (`fr_last_error()` on that thread has the
/// message). It must return promptly and must not destroy the communicator.
pub type fr_work_callback = Option<unsafe extern "C" fn(user: *mut c_void, status: fr_status)>;

/// A started call (or group of calls) in flight: collectives, sends and
/// receives alike. Opaque.
pub struct fr_work {
    pub(crate) work: Arc<OwnedWork>,
    pub(crate) completions: Arc<Completions>,
}

/// What the completion thread does with a work: wait for it, then call back
/// (if asked) and let go of it.
struct Job {
    work: Arc<OwnedWork>,
    callback: Option<(unsafe extern "C" fn(*mut c_void, fr_status), *mut c_void)>,
}

// SAFETY: the `user` pointer is the caller's, handed to its callback on the
// completion thread as `fr_work_on_complete` documents.
unsafe impl Send for Job {}

/// A communicator's completion thread: it waits for works that have a callback
/// or were freed while running, in the order they were handed over.
pub(crate) struct Completions {
    queue: Mutex<Option<Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    thread_id: ThreadId,
}

impl Completions {
    pub(crate) fn start(rank: u32) -> std::io::Result<Arc<Completions>> {
        let (tx, rx) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("fairring-completion-{rank}"))
            .spawn(move || complete(&rx))?;
        Ok(Arc::new(Completions {
            thread_id: thread.thread().id(),
            queue: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Hands `job` to the thread; gives it back if the communicator is destroyed.
    fn hand_over(&self, job: Job) -> Result<(), Job> {
        let queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        match queue.as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        }
    }

    /// Stops taking works, lets the thread finish those it has, and joins it
    /// (unless called from it).
    pub(crate) fn close(&self) {
        drop(
            self.queue
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        if std::thread::current().id() == self.thread_id {
            return;
        }
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

fn complete(rx: &Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        let status = finish(&job.work);
        if let Some((callback, user)) = job.callback {
            // SAFETY: the callback and `user` were given together to
            // `fr_work_on_complete`, whose contract covers this call.
            unsafe { callback(user, status) };
        }
    }
}

/// Waits until `work` has finished (a failure finishes it too); its status,
/// with this thread's message set on failure.
fn finish(work: &OwnedWork) -> fr_status {
    loop {
        match work.wait_timeout(Duration::from_secs(1)) {
            Ok(()) => return FR_OK,
            Err(e) => match work.test() {
                Ok(false) => {}
                Ok(true) => return FR_OK,
                Err(_) => return fail(&e),
            },
        }
    }
}

/// Borrows the work behind a handle, or reports the null.
///
/// # Safety
///
/// `work` is null or a live handle from this library.
unsafe fn handle<'a>(work: *const fr_work) -> Result<&'a fr_work, fr_status> {
    // SAFETY: per the contract, a non-null `work` is a live handle.
    unsafe { work.as_ref() }.ok_or_else(|| invalid("work", "null"))
}

/// Whether the operation has finished: `FR_OK` with `*done` set, or its
/// error if it failed (then `*done` is true too).
///
/// # Safety
///
/// `work` is a live handle; `done` is null or points to a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_work_test(work: *const fr_work, done: *mut bool) -> fr_status {
    boundary(|| {
        // SAFETY: forwarded.
        let w = match unsafe { handle(work) } {
            Ok(w) => w,
            Err(s) => return s,
        };
        let (finished, status) = match w.work.test() {
            Ok(f) => (f, FR_OK),
            Err(e) => (true, fail(&e)),
        };
        if !done.is_null() {
            // SAFETY: non-null and a valid `bool` place per the contract.
            unsafe { done.write(finished) };
        }
        status
    })
}

/// Waits for the operation, up to the communicator's timeout
/// (`FAIRRING_TIMEOUT`): `FR_OK`, its error, or `FR_TIMEOUT`.
///
/// # Safety
///
/// `work` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_work_wait(work: *const fr_work) -> fr_status {
    boundary(|| {
        // SAFETY: forwarded.
        match unsafe { handle(work) } {
            Ok(w) => w.work.wait().map_or_else(|e| fail(&e), |()| FR_OK),
            Err(s) => s,
        }
    })
}

/// Waits up to `timeout_ms`: `FR_OK`, its error, or `FR_PENDING` if it is
/// still running (not an error: wait again, or abort).
///
/// # Safety
///
/// `work` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_work_wait_timeout(work: *const fr_work, timeout_ms: u64) -> fr_status {
    boundary(|| {
        // SAFETY: forwarded.
        let w = match unsafe { handle(work) } {
            Ok(w) => w,
            Err(s) => return s,
        };
        match w.work.wait_timeout(Duration::from_millis(timeout_ms)) {
            Ok(()) => FR_OK,
            Err(_) => match w.work.test() {
                Ok(false) => FR_PENDING,
                Ok(true) => FR_OK,
                Err(failed) => fail(&failed),
            },
        }
    })
}

/// Calls `callback(user, status)` once the operation has finished, from the
/// communicator's completion thread (at once if it already has). The handle may
/// be freed before then.
///
/// # Safety
///
/// `work` is a live handle; `callback` may be called with `user` from another
/// thread until the communicator is destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_work_on_complete(
    work: *const fr_work,
    callback: fr_work_callback,
    user: *mut c_void,
) -> fr_status {
    boundary(|| {
        // SAFETY: forwarded.
        let w = match unsafe { handle(work) } {
            Ok(w) => w,
            Err(s) => return s,
        };
        let Some(callback) = callback else {
            return invalid("callback", "null");
        };
        let job = Job {
            work: Arc::clone(&w.work),
            callback: Some((callback, user)),
        };
        match w.completions.hand_over(job) {
            Ok(()) => FR_OK,
            Err(_) => invalid("work", "its communicator has been destroyed"),
        }
    })
}

/// Frees a work handle without waiting: a finished operation is released at
/// once, a running one by the completion thread when it finishes (after the
/// communicator is destroyed, by this call, which then waits). Null is
/// ignored. Its memory stays the engine's until the operation finishes.
///
/// # Safety
///
/// `work` is null or a live handle, not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fr_work_free(work: *mut fr_work) {
    let _ = boundary(|| {
        if work.is_null() {
            return FR_OK;
        }
        // SAFETY: a live handle made by `Box::into_raw`, given up by the caller.
        let w = unsafe { Box::from_raw(work) };
        if matches!(w.work.test(), Ok(false)) {
            let job = Job {
                work: Arc::clone(&w.work),
                callback: None,
            };
            // A destroyed communicator's thread is gone: release it here.
            drop(w.completions.hand_over(job));
        }
        FR_OK
    });
}
