//! Whether the CUDA driver, NCCL and NVRTC can be used, asked without panicking.
//!
//! cudarc loads each library on first use and panics when it is missing (or lacks
//! a symbol). Every entry point of this crate calls [`require`] first, which
//! checks that the library opens, calls its version function under a panic guard,
//! and caches the answer, so a machine without a GPU gets an
//! [`Error::Unavailable`] naming the library and what to do, never a panic.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;

use crate::error::{self, Error, Library, Result};

/// The oldest CUDA driver accepted (13.0): the bindings are generated for CUDA 13.0.
pub const MIN_DRIVER_VERSION: u32 = 13_000;

/// The oldest NCCL accepted (2.19.0): non-blocking communicators with
/// `ncclCommGetAsyncError`, `ncclGetLastError` and bf16.
pub const MIN_NCCL_VERSION: u32 = 21_900;

/// What the probe found of the CUDA driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DriverInfo {
    /// The CUDA version the driver supports, as `1000 * major + 10 * minor`.
    pub version: u32,
    /// Devices visible to this process.
    pub devices: u32,
}

/// Everything the probe found, one answer per library.
#[derive(Clone, Debug)]
pub struct Availability {
    /// The CUDA driver, with at least one device.
    pub cuda: Result<DriverInfo>,
    /// NCCL's version code (`10000 * major + 100 * minor + patch`).
    pub nccl: Result<u32>,
    /// NVRTC's version, `(major, minor)`.
    pub nvrtc: Result<(u32, u32)>,
}

/// Probes all three libraries.
pub fn probe() -> Availability {
    Availability {
        cuda: driver_info(),
        nccl: nccl_version(),
        nvrtc: nvrtc_version(),
    }
}

/// Succeeds when `library` can be used (for the driver: at least one device is
/// visible); otherwise names what is missing.
pub fn require(library: Library) -> Result<()> {
    match library {
        Library::Cuda => driver_info().map(drop),
        Library::Nccl => nccl_version().map(drop),
        Library::Nvrtc => nvrtc_version().map(drop),
    }
}

/// The driver's version and device count (cached).
pub fn driver_info() -> Result<DriverInfo> {
    static ANSWER: OnceLock<Result<DriverInfo>> = OnceLock::new();
    ANSWER
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to open the library by its
            // candidate names.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return Err(missing(Library::Cuda, ""));
            }
            guarded(Library::Cuda, || {
                use cudarc::driver::sys;
                // SAFETY: cuInit takes flags 0 and may be called any number of
                // times.
                error::driver("cuInit", unsafe { sys::cuInit(0) })?;
                let mut version = 0;
                // SAFETY: writes one int.
                error::driver("cuDriverGetVersion", unsafe {
                    sys::cuDriverGetVersion(&mut version)
                })?;
                let mut count = 0;
                // SAFETY: writes one int; the driver is initialised above.
                error::driver("cuDeviceGetCount", unsafe {
                    sys::cuDeviceGetCount(&mut count)
                })?;
                let version = u32::try_from(version).unwrap_or(0);
                if version < MIN_DRIVER_VERSION {
                    return Err(Error::Unavailable {
                        library: Library::Cuda,
                        reason: format!(
                            "the driver supports CUDA {}, and fairring-cuda needs {} or newer",
                            cuda_version(version),
                            cuda_version(MIN_DRIVER_VERSION)
                        ),
                    });
                }
                let devices = u32::try_from(count).unwrap_or(0);
                if devices == 0 {
                    return Err(Error::Unavailable {
                        library: Library::Cuda,
                        reason: "the driver loads but sees no device (check CUDA_VISIBLE_DEVICES)"
                            .into(),
                    });
                }
                Ok(DriverInfo { version, devices })
            })
        })
        .clone()
}

/// NCCL's version code (cached).
pub fn nccl_version() -> Result<u32> {
    static ANSWER: OnceLock<Result<u32>> = OnceLock::new();
    ANSWER
        .get_or_init(|| {
            // SAFETY: only tries to open the library by its candidate names.
            if !unsafe { cudarc::nccl::sys::is_culib_present() } {
                return Err(missing(
                    Library::Nccl,
                    " The nvidia-nccl-cu13 wheel ships only libnccl.so.2: link libnccl.so to \
                     it in a folder on LD_LIBRARY_PATH.",
                ));
            }
            guarded(Library::Nccl, || {
                let mut version = 0;
                // SAFETY: writes one int.
                let status = unsafe { cudarc::nccl::sys::ncclGetVersion(&mut version) };
                error::nccl("ncclGetVersion", status, None)?;
                let version = u32::try_from(version).unwrap_or(0);
                if version < MIN_NCCL_VERSION {
                    return Err(Error::Unavailable {
                        library: Library::Nccl,
                        reason: format!(
                            "NCCL {} is loaded, and fairring-cuda needs {} or newer",
                            nccl_version_name(version),
                            nccl_version_name(MIN_NCCL_VERSION)
                        ),
                    });
                }
                Ok(version)
            })
        })
        .clone()
}

/// NVRTC's `(major, minor)` version (cached).
pub fn nvrtc_version() -> Result<(u32, u32)> {
    static ANSWER: OnceLock<Result<(u32, u32)>> = OnceLock::new();
    ANSWER
        .get_or_init(|| {
            // SAFETY: only tries to open the library by its candidate names.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(missing(
                    Library::Nvrtc,
                    " It ships with the CUDA toolkit and in the nvidia-cuda-nvrtc wheel.",
                ));
            }
            guarded(Library::Nvrtc, || {
                let (mut major, mut minor) = (0, 0);
                // SAFETY: writes two ints.
                let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
                if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
                    return Err(Error::Unavailable {
                        library: Library::Nvrtc,
                        reason: format!("nvrtcVersion failed ({status:?})"),
                    });
                }
                Ok((
                    u32::try_from(major).unwrap_or(0),
                    u32::try_from(minor).unwrap_or(0),
                ))
            })
        })
        .clone()
}

/// "12.4" for 12040.
fn cuda_version(code: u32) -> String {
    format!("{}.{}", code / 1000, code % 1000 / 10)
}

/// "2.19.3" for 21903.
pub(crate) fn nccl_version_name(code: u32) -> String {
    format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
}

fn missing(library: Library, hint: &str) -> Error {
    let names = cudarc::get_lib_name_candidates(library.file_stem());
    let prefix = format!("lib{}.so", library.file_stem());
    let shown: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| n.starts_with(&prefix))
        .collect();
    Error::Unavailable {
        library,
        reason: format!(
            "none of {} (or the other names cudarc tries) opens with the dynamic loader; \
             put the folder holding it on LD_LIBRARY_PATH.{hint}",
            shown.join(", ")
        ),
    }
}

/// Runs the first calls into a library with cudarc's panics (a missing symbol)
/// turned into an error.
fn guarded<T>(library: Library, f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let reason = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("the library panicked while loading");
        Err(Error::Unavailable {
            library,
            reason: reason.to_owned(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_names_read_like_the_libraries_print_them() {
        assert_eq!(cuda_version(13_000), "13.0");
        assert_eq!(cuda_version(12_040), "12.4");
        assert_eq!(nccl_version_name(21_903), "2.19.3");
        assert_eq!(nccl_version_name(23_203), "2.32.3");
    }

    #[test]
    fn a_missing_library_is_named_with_the_file_names_tried() {
        let e = missing(Library::Nccl, " hint.");
        let text = e.to_string();
        assert!(text.starts_with("NCCL is not usable"), "{text}");
        assert!(text.contains("libnccl.so"), "{text}");
        assert!(text.ends_with("hint."), "{text}");
    }

    #[test]
    fn a_panic_while_loading_becomes_an_error() {
        let r: Result<()> = guarded(Library::Nvrtc, || panic!("Missing symbol nvrtcX"));
        match r {
            Err(Error::Unavailable { library, reason }) => {
                assert_eq!(library, Library::Nvrtc);
                assert!(reason.contains("nvrtcX"), "{reason}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}
