//! Status codes, the thread-local error message, and the panic boundary every
//! export runs behind.

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use fairring::Error;

/// What a call returns: `FR_OK`, `FR_PENDING` or an error code. On an error,
/// `fr_last_error()` on the same thread describes it.
pub type fr_status = i32;

/// Success.
pub const FR_OK: fr_status = 0;
/// Not an error: the operation is still running (`fr_work_test`,
/// `fr_work_wait_timeout`).
pub const FR_PENDING: fr_status = 1;
/// An argument is invalid (null, misaligned, out of range, wrong shape); nothing
/// was done.
pub const FR_INVALID_ARGUMENT: fr_status = 2;
/// A configuration value (an environment variable) is invalid.
pub const FR_CONFIG: fr_status = 3;
/// The rendezvous store failed or refused a request.
pub const FR_STORE: fr_status = 4;
/// The ranks do not form a job this engine can run.
pub const FR_TOPOLOGY: fr_status = 5;
/// Something did not happen in time (a peer fell silent, a rendezvous key
/// never came).
pub const FR_TIMEOUT: fr_status = 6;
/// A peer failed, left or broke the protocol; the message names its rank.
pub const FR_PEER: fr_status = 7;
/// The fabric failed.
pub const FR_FABRIC: fr_status = 8;
/// An operating-system call failed.
pub const FR_IO: fr_status = 9;
/// Ranks issued different operations under one sequence number.
pub const FR_MISMATCH: fr_status = 10;
/// fairring found one of its own invariants broken (a bug).
pub const FR_INTERNAL: fr_status = 11;
/// The communicator was aborted.
pub const FR_ABORTED: fr_status = 12;
/// A panic inside fairring was caught at the boundary; the communicator it
/// happened in should be aborted.
pub const FR_PANIC: fr_status = 13;
/// A CUDA call made for a device tensor failed, or no usable CUDA driver or
/// device was found; the message names the call.
pub const FR_GPU: fr_status = 14;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error.
pub(crate) fn set_message(message: &str) {
    let clean: Vec<u8> = message.bytes().filter(|&b| b != 0).collect();
    let text = CString::new(clean).unwrap_or_default();
    LAST_ERROR.with(|m| *m.borrow_mut() = text);
}

/// The code of `e`; a communicator that failed earlier reports its first error's.
pub(crate) fn code_of(e: &Error) -> fr_status {
    match e {
        Error::Config { .. } => FR_CONFIG,
        Error::InvalidArgument { .. } => FR_INVALID_ARGUMENT,
        Error::Store { .. } => FR_STORE,
        Error::Topology { .. } => FR_TOPOLOGY,
        Error::Timeout { .. } => FR_TIMEOUT,
        Error::Peer { .. } => FR_PEER,
        Error::Fabric(_) => FR_FABRIC,
        Error::Io { .. } => FR_IO,
        Error::Mismatch { .. } => FR_MISMATCH,
        Error::Aborted => FR_ABORTED,
        Error::Gpu(_) => FR_GPU,
        Error::Failed { first } => code_of(first),
        _ => FR_INTERNAL,
    }
}

/// Records `e` as this thread's last error and returns its code.
pub(crate) fn fail(e: &Error) -> fr_status {
    set_message(&e.to_string());
    code_of(e)
}

/// An invalid argument: records the message and returns `FR_INVALID_ARGUMENT`.
pub(crate) fn invalid(argument: &str, reason: &str) -> fr_status {
    set_message(&format!("invalid argument `{argument}`: {reason}"));
    FR_INVALID_ARGUMENT
}

/// Runs `body` behind the panic boundary: a panic becomes `FR_PANIC` with its
/// message, never an unwind into the caller.
pub(crate) fn boundary(body: impl FnOnce() -> fr_status) -> fr_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(status) => status,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            set_message(&format!("fairring panicked: {what}"));
            FR_PANIC
        }
    }
}

/// The message of the last error on this thread: valid until the next fairring
/// call on this thread; empty if there was none. Never null.
#[unsafe(no_mangle)]
pub extern "C" fn fr_last_error() -> *const c_char {
    // Reading a thread-local cannot panic once initialised; the boundary keeps
    // the contract if it ever did.
    let mut out: *const c_char = c"fairring panicked while reading the last error".as_ptr();
    let _ = boundary(|| {
        out = LAST_ERROR.with(|m| m.borrow().as_ptr());
        FR_OK
    });
    out
}

/// A static description of `status` (`"ok"`, `"timeout"`, ...). Never null.
#[unsafe(no_mangle)]
pub extern "C" fn fr_status_name(status: fr_status) -> *const c_char {
    let name: &'static std::ffi::CStr = match status {
        FR_OK => c"ok",
        FR_PENDING => c"pending",
        FR_INVALID_ARGUMENT => c"invalid argument",
        FR_CONFIG => c"configuration",
        FR_STORE => c"store",
        FR_TOPOLOGY => c"topology",
        FR_TIMEOUT => c"timeout",
        FR_PEER => c"peer",
        FR_FABRIC => c"fabric",
        FR_IO => c"i/o",
        FR_MISMATCH => c"mismatch",
        FR_INTERNAL => c"internal",
        FR_ABORTED => c"aborted",
        FR_PANIC => c"panic",
        FR_GPU => c"gpu",
        _ => c"unknown status",
    };
    name.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn message() -> String {
        // SAFETY: never null, NUL-terminated, valid until the next call here.
        unsafe { CStr::from_ptr(fr_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message_not_an_unwind() {
        let status = boundary(|| panic!("the {} invariant", "staging"));
        assert_eq!(status, FR_PANIC);
        assert_eq!(message(), "fairring panicked: the staging invariant");
        assert_eq!(boundary(|| std::panic::panic_any(7u8)), FR_PANIC);
        assert!(message().contains("(no message)"));
    }

    #[test]
    fn errors_map_to_their_codes_and_a_failed_communicator_to_its_first() {
        let peer = Error::Peer {
            rank: 3,
            reason: "closed the connection".into(),
        };
        assert_eq!(fail(&peer), FR_PEER);
        assert!(message().contains("rank 3"), "{}", message());
        let later = Error::Failed {
            first: Box::new(peer),
        };
        assert_eq!(code_of(&later), FR_PEER);
        assert_eq!(code_of(&Error::Aborted), FR_ABORTED);
        // SAFETY: never null, static.
        let name = unsafe { CStr::from_ptr(fr_status_name(FR_PEER)) };
        assert_eq!(name.to_str(), Ok("peer"));
        // SAFETY: as above.
        let unknown = unsafe { CStr::from_ptr(fr_status_name(99)) };
        assert_eq!(unknown.to_str(), Ok("unknown status"));
    }

    #[test]
    fn a_message_with_a_nul_byte_is_kept_without_it() {
        set_message("a\0b");
        assert_eq!(message(), "ab");
    }
}
