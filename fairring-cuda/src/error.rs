//! Errors of the GPU layer, each naming the call, the library or the argument at
//! fault, with the library's own words where it has some.

use std::ffi::CStr;
use std::fmt;
use std::time::Duration;

use cudarc::driver::sys::{CUresult, cuGetErrorName, cuGetErrorString};
use cudarc::nccl::sys::{ncclGetErrorString, ncclResult_t};

/// A shared library this crate loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Library {
    /// The CUDA driver (`libcuda.so`).
    Cuda,
    /// NCCL (`libnccl.so`).
    Nccl,
    /// The CUDA runtime compiler (`libnvrtc.so`).
    Nvrtc,
}

impl Library {
    /// The name cudarc looks the library up by (`lib<name>.so`, then versioned
    /// names).
    pub const fn file_stem(self) -> &'static str {
        match self {
            Library::Cuda => "cuda",
            Library::Nccl => "nccl",
            Library::Nvrtc => "nvrtc",
        }
    }
}

impl fmt::Display for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Library::Cuda => "the CUDA driver",
            Library::Nccl => "NCCL",
            Library::Nvrtc => "NVRTC",
        })
    }
}

/// Why a GPU operation failed.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// A library is missing, too old, or has no device to drive.
    Unavailable {
        /// The library.
        library: Library,
        /// What is wrong, and what would fix it.
        reason: String,
    },
    /// A CUDA driver call failed.
    Driver {
        /// The driver function.
        call: &'static str,
        /// Its `CUresult` code.
        code: u32,
        /// The driver's name and description of the code.
        message: String,
    },
    /// An NCCL call failed.
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// Its `ncclResult_t` code.
        code: u32,
        /// NCCL's description of the code, and its last error message if it left
        /// one.
        message: String,
    },
    /// NVRTC refused the device reduction kernels.
    Compile {
        /// The architecture compiled for (`sm_90`).
        arch: String,
        /// NVRTC's status and compilation log.
        log: String,
    },
    /// An argument was refused before anything was enqueued.
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// Why.
        reason: String,
    },
    /// An operation did not finish within its bound; it has been abandoned.
    Timeout {
        /// What was waited for.
        what: String,
        /// The bound.
        after: Duration,
    },
    /// The communicator was aborted; it refuses every call.
    Aborted,
    /// A wait was given up before it ended, for the caller's reason (another
    /// rank said it could not join); what it waited for was abandoned.
    GaveUp {
        /// What was waited for.
        what: String,
        /// The caller's reason.
        reason: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Unavailable { library, reason } => {
                write!(f, "{library} is not usable: {reason}")
            }
            Error::Driver {
                call,
                code,
                message,
            } => write!(f, "{call} failed with CUDA error {code} ({message})"),
            Error::Nccl {
                call,
                code,
                message,
            } => write!(f, "{call} failed with NCCL error {code} ({message})"),
            Error::Compile { arch, log } => {
                write!(
                    f,
                    "NVRTC could not compile the reduction kernels for {arch}: {log}"
                )
            }
            Error::InvalidArgument { argument, reason } => {
                write!(f, "invalid {argument}: {reason}")
            }
            Error::Timeout { what, after } => write!(f, "{what} did not finish within {after:?}"),
            Error::Aborted => f.write_str("the NCCL communicator was aborted"),
            Error::GaveUp { what, reason } => write!(f, "gave up waiting for {what}: {reason}"),
        }
    }
}

impl std::error::Error for Error {}

/// The result of a GPU operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Turns a driver status into a result naming `call`.
pub(crate) fn driver(call: &'static str, status: CUresult) -> Result<()> {
    if status == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(Error::Driver {
        call,
        code: status as u32,
        message: driver_message(status),
    })
}

/// The driver's name and description of `status`, e.g. "CUDA_ERROR_OUT_OF_MEMORY:
/// out of memory".
fn driver_message(status: CUresult) -> String {
    let mut name = std::ptr::null();
    let mut text = std::ptr::null();
    // SAFETY: writes a pointer to a static string the driver owns (or leaves it
    // null for an unknown code); the driver is loaded, since `status` came from it.
    let named = unsafe { cuGetErrorName(status, &mut name) };
    // SAFETY: as above.
    let described = unsafe { cuGetErrorString(status, &mut text) };
    let read = |ok: CUresult, ptr: *const std::ffi::c_char| {
        if ok == CUresult::CUDA_SUCCESS && !ptr.is_null() {
            // SAFETY: a non-null pointer from the calls above is a NUL-terminated
            // static string.
            Some(
                unsafe { CStr::from_ptr(ptr) }
                    .to_string_lossy()
                    .into_owned(),
            )
        } else {
            None
        }
    };
    match (read(named, name), read(described, text)) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        (Some(n), None) => n,
        _ => format!("{status:?}"),
    }
}

/// Turns an NCCL status into a result naming `call`; `last` is NCCL's last error
/// message for the communicator, when there is one to ask.
pub(crate) fn nccl(call: &'static str, status: ncclResult_t, last: Option<String>) -> Result<()> {
    match status {
        ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => Ok(()),
        _ => Err(nccl_error(call, status, last)),
    }
}

/// The error for a failed NCCL status.
pub(crate) fn nccl_error(call: &'static str, status: ncclResult_t, last: Option<String>) -> Error {
    // SAFETY: ncclGetErrorString returns a static string for every code; NCCL is
    // loaded, since `status` came from it.
    let text = unsafe { ncclGetErrorString(status) };
    let mut message = if text.is_null() {
        format!("{status:?}")
    } else {
        // SAFETY: non-null, NUL-terminated and static (above).
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{status:?}: {text}")
    };
    if let Some(last) = last.filter(|l| !l.is_empty()) {
        message.push_str("; ");
        message.push_str(&last);
    }
    Error::Nccl {
        call,
        code: status as u32,
        message,
    }
}

pub(crate) fn invalid(argument: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        argument,
        reason: reason.into(),
    }
}
