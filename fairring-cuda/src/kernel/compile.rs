//! Compiling the kernel source with NVRTC, once per process and architecture.

use std::ffi::{CString, c_char};
use std::sync::{Arc, Mutex};

use cudarc::nvrtc::sys::{self, nvrtcProgram, nvrtcResult};

use crate::error::{Error, Library, Result};
use crate::probe;

/// The kernels' CUDA C++ source.
pub const SOURCE: &str = include_str!("reduce.cu");

/// What NVRTC produced for one architecture.
#[derive(Debug)]
pub struct Compiled {
    /// The architecture, e.g. `sm_90`.
    pub arch: String,
    /// Machine code for it (an ELF image `cuModuleLoadData` takes).
    pub cubin: Vec<u8>,
    /// The PTX it went through (kept for inspection: the tests check that the
    /// loads are 16-byte vectors).
    pub ptx: String,
}

/// The kernels compiled for compute capability `(major, minor)`: machine code,
/// so that loading needs no PTX JIT and works on any driver of the toolkit's major
/// version. Compiled once per process and architecture; later calls share it.
pub fn compile(compute_capability: (u32, u32)) -> Result<Arc<Compiled>> {
    type ByCapability = Vec<((u32, u32), Arc<Compiled>)>;
    static CACHE: Mutex<ByCapability> = Mutex::new(Vec::new());
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, compiled)) = cache.iter().find(|(cc, _)| *cc == compute_capability) {
        return Ok(Arc::clone(compiled));
    }
    probe::require(Library::Nvrtc)?;
    let arch = format!("sm_{}{}", compute_capability.0, compute_capability.1);
    let compiled = Arc::new(run_nvrtc(&arch)?);
    cache.push((compute_capability, Arc::clone(&compiled)));
    Ok(compiled)
}

/// A program handle, destroyed on drop.
struct Program(nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed once.
        let status = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
        if status != nvrtcResult::NVRTC_SUCCESS {
            log::warn!("nvrtcDestroyProgram: {status:?}");
        }
    }
}

fn run_nvrtc(arch: &str) -> Result<Compiled> {
    let failed = |what: &str, status: nvrtcResult, log: String| Error::Compile {
        arch: arch.to_owned(),
        log: format!(
            "{what} returned {status:?}{}{log}",
            if log.is_empty() { "" } else { ":\n" }
        ),
    };
    let source = CString::new(SOURCE).map_err(|_| {
        failed(
            "the source",
            nvrtcResult::NVRTC_ERROR_INVALID_INPUT,
            String::new(),
        )
    })?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: `source` and the name are NUL-terminated and outlive the call; no
    // headers are passed.
    let status = unsafe {
        sys::nvrtcCreateProgram(
            &mut raw,
            source.as_ptr(),
            c"fairring_reduce.cu".as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if status != nvrtcResult::NVRTC_SUCCESS {
        return Err(failed("nvrtcCreateProgram", status, String::new()));
    }
    let program = Program(raw);
    // IEEE semantics, spelled out: the host kernels' results depend on them.
    let options = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_owned(),
        "--ftz=false".to_owned(),
        "--prec-div=true".to_owned(),
        "--prec-sqrt=true".to_owned(),
        "--fmad=false".to_owned(),
    ];
    let options: Vec<CString> = options
        .into_iter()
        .map(|o| CString::new(o).unwrap_or_default())
        .collect();
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let count = i32::try_from(pointers.len()).unwrap_or(0);
    // SAFETY: `pointers` holds `count` NUL-terminated strings that outlive the
    // call.
    let status = unsafe { sys::nvrtcCompileProgram(program.0, count, pointers.as_ptr()) };
    if status != nvrtcResult::NVRTC_SUCCESS {
        return Err(failed("nvrtcCompileProgram", status, log(&program)));
    }
    let cubin = output(&program, sys::nvrtcGetCUBINSize, sys::nvrtcGetCUBIN)
        .map_err(|status| failed("nvrtcGetCUBIN", status, String::new()))?;
    let ptx = output(&program, sys::nvrtcGetPTXSize, sys::nvrtcGetPTX)
        .map_err(|status| failed("nvrtcGetPTX", status, String::new()))?;
    Ok(Compiled {
        arch: arch.to_owned(),
        cubin,
        ptx: String::from_utf8_lossy(ptx.strip_suffix(&[0]).unwrap_or(&ptx)).into_owned(),
    })
}

type SizeFn = unsafe fn(nvrtcProgram, *mut usize) -> nvrtcResult;
type GetFn = unsafe fn(nvrtcProgram, *mut c_char) -> nvrtcResult;

/// One of the program's outputs (CUBIN or PTX), by its size and copy functions.
fn output(program: &Program, size: SizeFn, get: GetFn) -> Result<Vec<u8>, nvrtcResult> {
    let mut len = 0;
    // SAFETY: writes one size for a compiled program.
    let status = unsafe { size(program.0, &mut len) };
    if status != nvrtcResult::NVRTC_SUCCESS {
        return Err(status);
    }
    let mut bytes = vec![0u8; len];
    // SAFETY: `bytes` has the `len` bytes NVRTC said it writes.
    let status = unsafe { get(program.0, bytes.as_mut_ptr().cast()) };
    if status != nvrtcResult::NVRTC_SUCCESS {
        return Err(status);
    }
    Ok(bytes)
}

/// The program's compilation log.
fn log(program: &Program) -> String {
    output(
        program,
        sys::nvrtcGetProgramLogSize,
        sys::nvrtcGetProgramLog,
    )
    .map(|bytes| {
        String::from_utf8_lossy(bytes.strip_suffix(&[0]).unwrap_or(&bytes))
            .trim()
            .to_owned()
    })
    .unwrap_or_default()
}
