//! A device and its primary context: what every stream, event, buffer and kernel
//! of this crate belongs to.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdevice_attribute};

use crate::error::{self, Library, Result};
use crate::probe;

/// One CUDA device, holding a reference on its primary context (the context the
/// CUDA runtime, and so PyTorch, uses too: pointers and streams a host runtime
/// hands over are valid in it).
#[derive(Debug)]
pub struct Device {
    ordinal: u32,
    device: CUdevice,
    context: CUcontext,
    name: String,
    multiprocessors: u32,
    compute_capability: (u32, u32),
    /// `cuStreamWaitValue64` and `cuStreamWriteValue64` work on this device.
    stream_memory_ops_64: bool,
    multicast: bool,
    /// The device's UUID: the same GPU whatever ordinal a process sees it
    /// at (`CUDA_VISIBLE_DEVICES` renumbers).
    uuid: [u8; 16],
}

// SAFETY: a CUdevice is an integer and a CUcontext a handle the driver lets any
// thread make current; the device holds no thread-affine state.
unsafe impl Send for Device {}
// SAFETY: as above; every method only reads the handles.
unsafe impl Sync for Device {}

impl Device {
    /// The device a rank with this local rank drives: device `local_rank` of
    /// those visible (torchrun's convention). An error names the local rank and the
    /// number of visible devices when there are too few.
    pub fn for_local_rank(local_rank: u32) -> Result<Arc<Device>> {
        let info = probe::driver_info()?;
        if local_rank >= info.devices {
            return Err(error::invalid(
                "local rank",
                format!(
                    "local rank {local_rank} needs device {local_rank}, and this process sees \
                     {} device(s) (check CUDA_VISIBLE_DEVICES and LOCAL_RANK)",
                    info.devices
                ),
            ));
        }
        Device::open(local_rank)
    }

    /// Device `ordinal`, with its primary context retained.
    pub fn open(ordinal: u32) -> Result<Arc<Device>> {
        let info = probe::driver_info()?;
        if ordinal >= info.devices {
            return Err(error::invalid(
                "device ordinal",
                format!("device {ordinal} does not exist ({} visible)", info.devices),
            ));
        }
        let mut device = 0;
        let index =
            i32::try_from(ordinal).map_err(|_| error::invalid("device ordinal", "too large"))?;
        // SAFETY: writes one CUdevice; the driver is initialised (probe).
        error::driver("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut device, index)
        })?;
        let attribute = |attribute| -> Result<u32> {
            let mut value = 0;
            // SAFETY: writes one int for a valid device.
            error::driver("cuDeviceGetAttribute", unsafe {
                sys::cuDeviceGetAttribute(&mut value, attribute, device)
            })?;
            Ok(u32::try_from(value).unwrap_or(0))
        };
        let multiprocessors =
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let major = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let stream_memory_ops_64 =
            attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)? != 0;
        // A driver older than the attribute refuses it: no multicast there.
        let multicast = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED)
            .is_ok_and(|v| v != 0);
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: writes at most `len` bytes, NUL-terminated, into `name`.
        error::driver("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), 256, device)
        })?;
        // SAFETY: the driver NUL-terminated the name inside the array.
        let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut raw_uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: writes one UUID for a valid device.
        error::driver("cuDeviceGetUuid", unsafe {
            sys::cuDeviceGetUuid_v2(&mut raw_uuid, device)
        })?;
        let uuid = raw_uuid.bytes.map(|b| b as u8);
        let mut context = std::ptr::null_mut();
        // SAFETY: retains (and creates on first use) the device's primary context;
        // released in Drop.
        error::driver("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut context, device)
        })?;
        let device = Device {
            ordinal,
            device,
            context,
            name,
            multiprocessors,
            compute_capability: (major, minor),
            stream_memory_ops_64,
            multicast,
            uuid,
        };
        Ok(Arc::new(device))
    }

    /// Makes this device's context current on the calling thread until the
    /// returned guard drops, which makes the thread's previous context current
    /// again (nothing changes when this one already is). Every method of this
    /// crate that calls the driver holds one while it does, so callers need
    /// not, and a host runtime's current device (PyTorch's
    /// `torch.cuda.current_device()`) is the same after any call as before.
    pub fn bind(&self) -> Result<Bound<'_>> {
        let mut current = std::ptr::null_mut();
        // SAFETY: writes one context handle (null when none is current).
        error::driver("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        if current == self.context {
            return Ok(Bound {
                pushed: false,
                _device: std::marker::PhantomData,
            });
        }
        // SAFETY: the context is retained for as long as `self` lives, which
        // the guard borrows.
        error::driver("cuCtxPushCurrent", unsafe {
            sys::cuCtxPushCurrent_v2(self.context)
        })?;
        Ok(Bound {
            pushed: true,
            _device: std::marker::PhantomData,
        })
    }

    /// The device's UUID, which names the same GPU in every process whatever
    /// ordinal each sees it at.
    pub fn uuid(&self) -> [u8; 16] {
        self.uuid
    }

    /// Whether the device takes 64-bit stream memory operations
    /// (`cuStreamWaitValue64`), which [`HostFlags`](crate::HostFlags) waits
    /// with.
    pub fn supports_64_bit_stream_memory_ops(&self) -> bool {
        self.stream_memory_ops_64
    }

    /// Whether the device takes multicast objects: its NVLink reaches an
    /// NVSwitch that reduces (NVLink SHARP), which NCCL's NVLS algorithms
    /// use (NCCL reads the same attribute to enable them).
    pub fn supports_multicast(&self) -> bool {
        self.multicast
    }

    /// The device's ordinal among the visible devices.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Streaming multiprocessors on the device.
    pub fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    /// `(major, minor)` compute capability, e.g. `(9, 0)` for Hopper.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// Bytes `(free, total)` of device memory.
    pub fn memory(&self) -> Result<(usize, usize)> {
        let _bound = self.bind()?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: writes two sizes for the current context.
        error::driver("cuMemGetInfo", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    /// Waits for all work on the device to finish.
    pub fn synchronize(&self) -> Result<()> {
        let _bound = self.bind()?;
        // SAFETY: no arguments; the context is current.
        error::driver("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// The raw driver context, for interoperation.
    pub fn raw_context(&self) -> CUcontext {
        self.context
    }

    /// Checks that `other` is this device, naming `argument` if not.
    pub(crate) fn check_same(&self, argument: &'static str, other: u32) -> Result<()> {
        if other == self.ordinal {
            Ok(())
        } else {
            Err(error::invalid(
                argument,
                format!(
                    "it lives on device {other}, and this operation runs on device {}",
                    self.ordinal
                ),
            ))
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: releases the reference taken in `open`, once.
        let status = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
        if let Err(e) = error::driver("cuDevicePrimaryCtxRelease", status) {
            log::warn!("releasing device {}: {e}", self.ordinal);
        }
    }
}

/// A device's context made current on this thread by [`Device::bind`]; the
/// thread's previous context is current again when it drops.
#[must_use = "the context is current only while the guard lives"]
#[derive(Debug)]
pub struct Bound<'d> {
    pushed: bool,
    /// Not `Send`: the context stack is the thread's.
    _device: std::marker::PhantomData<(&'d Device, *const ())>,
}

impl Drop for Bound<'_> {
    fn drop(&mut self) {
        if !self.pushed {
            return;
        }
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context `bind` pushed on this thread (the guard is
        // not `Send`, and guards drop in reverse order of their making).
        let status = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if let Err(e) = error::driver("cuCtxPopCurrent", status) {
            log::warn!("restoring the thread's CUDA context: {e}");
        }
    }
}

/// How this process's CUDA driver loads the kernels of a module; it reads
/// `CUDA_MODULE_LOADING` when it starts, and loads lazily by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModuleLoading {
    /// Every kernel when its module loads.
    Eager,
    /// Each kernel at its first use. That first launch waits, holding the
    /// context's lock, until every stream of the context has drained: a
    /// stream waiting for work that other threads enqueue later (a
    /// [`HostFlags`](crate::HostFlags) word the host sets after more CUDA
    /// calls) then deadlocks the process.
    Lazy,
}

/// How this process's CUDA driver loads modules (`cuModuleGetLoadingMode`).
pub fn module_loading() -> Result<ModuleLoading> {
    probe::require(Library::Cuda)?;
    let mut raw: u32 = 0;
    // SAFETY: writes one `CUmoduleLoadingMode`, a 32-bit enumeration, into a
    // `u32`, so a value the bindings do not know is still a valid integer; the
    // driver is initialised (probe).
    error::driver("cuModuleGetLoadingMode", unsafe {
        sys::cuModuleGetLoadingMode((&raw mut raw).cast())
    })?;
    let lazy = sys::CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING as u32;
    Ok(if raw == lazy {
        ModuleLoading::Lazy
    } else {
        ModuleLoading::Eager
    })
}

/// Whether a CUDA device can be used here: the driver loads and sees at least one
/// device. Tests that need one check this and fail loudly when they were asked to
/// run without it.
pub fn cuda_available() -> bool {
    probe::require(Library::Cuda).is_ok()
}
