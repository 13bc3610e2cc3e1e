//! The device reduction kernels: `dst op= src`, the many-source `dst op= src_0
//! op ... op src_k` that reads and writes `dst` once, and the average's
//! division, for every type and operator of [`fairring_core::reduce`], with its
//! semantics.
//!
//! The source (`reduce.cu`) is compiled by NVRTC to machine code for the device's
//! architecture the first time a process loads it, then loaded once per device.
//! NVRTC rather than embedded PTX: PTX embedded at build time would need nvcc on
//! every build machine (this crate builds without CUDA), would be JIT-compiled by
//! the driver anyway, and fails to load on a driver older than the PTX ISA;
//! machine code compiled for the exact device needs neither.
//!
//! Each kernel loads and stores 16-byte vectors, two per thread per pass, over a
//! grid of at most the blocks the device keeps resident, walking the rest
//! grid-stride.

mod compile;
#[cfg(test)]
mod emulation;
mod geometry;

use std::ffi::CString;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUfunction, CUmodule};
use fairring_core::{DataType, ReduceOp};

pub use compile::{Compiled, SOURCE, compile};

use crate::buffers::{DeviceSlice, DeviceSliceMut};
use crate::device::Device;
use crate::error::{self, Result};
use crate::stream::Stream;
use geometry::{Split, THREADS, blocks};

/// The operators with kernels of their own (`Avg` reduces with `Sum`'s); the
/// bitwise ones exist for integer types and `bool` only.
const OPERATORS: [ReduceOp; 7] = [
    ReduceOp::Sum,
    ReduceOp::Product,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::BitAnd,
    ReduceOp::BitOr,
    ReduceOp::BitXor,
];

/// The number of element types.
const TYPES: usize = DataType::ALL.len();

/// The name a kernel of `reduce.cu` is defined under.
pub fn entry_point(dtype: DataType, op: ReduceOp) -> String {
    let op = match op {
        ReduceOp::Sum | ReduceOp::Avg => "sum",
        ReduceOp::Product => "product",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        ReduceOp::BitAnd => "band",
        ReduceOp::BitOr => "bor",
        ReduceOp::BitXor => "bxor",
    };
    format!("fairring_reduce_{op}_{}", type_name(dtype))
}

/// The name of the many-source kernel for `dtype` and `op` (`Avg` as `Sum`).
pub fn many_entry_point(dtype: DataType, op: ReduceOp) -> String {
    entry_point(dtype, op).replacen("fairring_reduce_", "fairring_reduce_many_", 1)
}

/// The most sources one many-source launch takes (`MAX_SOURCES` in
/// `reduce.cu`); [`ReductionKernels::reduce_many`] folds more in several.
const MAX_SOURCES: usize = 15;

/// The many-source kernel's parameter: the sources' addresses, the unused
/// ones zero (`Sources` in `reduce.cu`).
#[repr(C)]
struct Sources([u64; MAX_SOURCES]);

/// The name of the division kernel for a float type.
pub fn divide_entry_point(dtype: DataType) -> String {
    format!("fairring_divide_{}", type_name(dtype))
}

fn type_name(dtype: DataType) -> &'static str {
    match dtype {
        DataType::F32 => "F32",
        DataType::F64 => "F64",
        DataType::F16 => "F16",
        DataType::BF16 => "BF16",
        DataType::I32 => "I32",
        DataType::I64 => "I64",
        DataType::U8 => "U8",
        DataType::I8 => "I8",
        DataType::I16 => "I16",
        DataType::Bool => "BOOL",
    }
}

/// A kernel and the blocks of it the device keeps resident per multiprocessor.
#[derive(Clone, Copy, Debug)]
struct Kernel {
    function: CUfunction,
    blocks_per_sm: u32,
}

/// The reduction kernels, loaded on one device.
#[derive(Debug)]
pub struct ReductionKernels {
    device: Arc<Device>,
    module: CUmodule,
    /// Per type and operator index; a null function where the operator is
    /// not defined on the type (refused before any launch).
    reduce: [[Kernel; OPERATORS.len()]; TYPES],
    reduce_many: [[Kernel; OPERATORS.len()]; TYPES],
    divide: [Option<Kernel>; TYPES],
}

// SAFETY: module and function handles are context-wide and usable from any thread
// once the context is current (every method binds it).
unsafe impl Send for ReductionKernels {}
// SAFETY: as above; launching is thread-safe in the driver.
unsafe impl Sync for ReductionKernels {}

impl ReductionKernels {
    /// The most sources [`reduce_many`](Self::reduce_many) folds in one
    /// launch (one read and write of the destination).
    pub const MAX_SOURCES: usize = MAX_SOURCES;

    /// Compiles the kernels for `device`'s architecture (once per process) and
    /// loads them on it.
    pub fn load(device: &Arc<Device>) -> Result<ReductionKernels> {
        let compiled = compile(device.compute_capability())?;
        let _bound = device.bind()?;
        let mut module = std::ptr::null_mut();
        // SAFETY: `cubin` is a complete ELF image for this architecture; the
        // driver copies what it needs before returning.
        error::driver("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, compiled.cubin.as_ptr().cast())
        })?;
        let none = Kernel {
            function: std::ptr::null_mut(),
            blocks_per_sm: 0,
        };
        let mut kernels = ReductionKernels {
            device: Arc::clone(device),
            module,
            reduce: [[none; OPERATORS.len()]; TYPES],
            reduce_many: [[none; OPERATORS.len()]; TYPES],
            divide: [None; TYPES],
        };
        for (t, dtype) in DataType::ALL.iter().copied().enumerate() {
            for (o, op) in OPERATORS.into_iter().enumerate() {
                if !op.supports(dtype) {
                    continue;
                }
                kernels.reduce[t][o] = kernels.function(&entry_point(dtype, op))?;
                kernels.reduce_many[t][o] = kernels.function(&many_entry_point(dtype, op))?;
            }
            if dtype.is_float() {
                kernels.divide[t] = Some(kernels.function(&divide_entry_point(dtype))?);
            }
        }
        Ok(kernels)
    }

    fn function(&self, name: &str) -> Result<Kernel> {
        let c_name =
            CString::new(name).map_err(|_| error::invalid("kernel name", name.to_owned()))?;
        let mut function = std::ptr::null_mut();
        // SAFETY: the module is loaded; the name is NUL-terminated.
        error::driver("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(&mut function, self.module, c_name.as_ptr())
        })?;
        let mut resident = 0;
        // SAFETY: writes one int for a valid function; no dynamic shared memory.
        error::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut resident,
                function,
                THREADS as i32,
                0,
            )
        })?;
        Ok(Kernel {
            function,
            blocks_per_sm: u32::try_from(resident).unwrap_or(1).max(1),
        })
    }

    /// The device the kernels are loaded on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Enqueues `dst[i] = dst[i] op src[i]` over elements of `dtype` on `stream`
    /// (`Avg` as `Sum`; finish it with [`finish_avg`](Self::finish_avg)).
    ///
    /// Refused, with nothing enqueued: `Avg` on an integer type, lengths that
    /// differ or are not whole elements, operands not aligned to their element,
    /// overlapping operands, and operands or a stream of another device.
    pub fn reduce(
        &self,
        stream: &Stream,
        dtype: DataType,
        op: ReduceOp,
        dst: &mut DeviceSliceMut<'_>,
        src: DeviceSlice<'_>,
    ) -> Result<()> {
        let count = self.check_destination(stream, dtype, op, dst)?;
        self.check_source(dtype, dst, &src)?;
        let (d, s) = (dst.raw(), src.raw());
        if count == 0 {
            return Ok(());
        }
        let (t, o) = (dtype as usize, operator_index(op));
        let split = Split::new(&[d, s], count, dtype.size_bytes());
        let (mut dst_arg, mut src_arg) = (d, s);
        let (mut head, mut vectors, mut tail) = (split.head, split.vectors, split.tail);
        let mut params = [
            (&raw mut dst_arg).cast(),
            (&raw mut src_arg).cast(),
            (&raw mut head).cast(),
            (&raw mut vectors).cast(),
            (&raw mut tail).cast(),
        ];
        // SAFETY: the parameters match the kernel (two pointers, three u64); the
        // operands are whole, aligned, disjoint element ranges of this device
        // (checked above), valid until the kernel completes (the views' contracts).
        unsafe { self.launch(stream, self.reduce[t][o], split.work_items(2), &mut params) }
    }

    /// Enqueues `dst[i] = dst[i] op srcs[0][i] op srcs[1][i] ...` over elements
    /// of `dtype` on `stream`, combined left to right and stored once (`Avg` as
    /// `Sum`): `dst` is read and written once for every [`Self::MAX_SOURCES`]
    /// sources, where pairwise passes would read and write it once per source.
    /// For f16 and bf16 each launch keeps its combination in f32 and rounds
    /// once, as `fairring_core::reduce::reduce_many` does (more than
    /// [`Self::MAX_SOURCES`] sources round once per launch). No sources: nothing to
    /// do.
    ///
    /// Refused, with nothing enqueued, as [`reduce`](Self::reduce) refuses,
    /// for any source; sources may overlap each other but not `dst`.
    pub fn reduce_many(
        &self,
        stream: &Stream,
        dtype: DataType,
        op: ReduceOp,
        dst: &mut DeviceSliceMut<'_>,
        srcs: &[DeviceSlice<'_>],
    ) -> Result<()> {
        let count = self.check_destination(stream, dtype, op, dst)?;
        for src in srcs {
            self.check_source(dtype, dst, src)?;
        }
        let d = dst.raw();
        if count == 0 {
            return Ok(());
        }
        let kernel = self.reduce_many[dtype as usize][operator_index(op)];
        for group in srcs.chunks(MAX_SOURCES) {
            let mut addresses = [d; MAX_SOURCES + 1];
            for (a, src) in addresses[1..].iter_mut().zip(group) {
                *a = src.raw();
            }
            let split = Split::new(&addresses[..=group.len()], count, dtype.size_bytes());
            let mut sources = Sources([0; MAX_SOURCES]);
            for (slot, src) in sources.0.iter_mut().zip(group) {
                *slot = src.raw();
            }
            let mut dst_arg = d;
            let mut n = u32::try_from(group.len()).unwrap_or(0);
            let (mut head, mut vectors, mut tail) = (split.head, split.vectors, split.tail);
            let mut params = [
                (&raw mut dst_arg).cast(),
                (&raw mut sources).cast(),
                (&raw mut n).cast(),
                (&raw mut head).cast(),
                (&raw mut vectors).cast(),
                (&raw mut tail).cast(),
            ];
            // SAFETY: parameters match the kernel (pointer, sources block, u32,
            // three u64); operands are whole aligned ranges of this device apart
            // from `dst` (checked above), valid until it completes; `n` are set.
            unsafe { self.launch(stream, kernel, split.work_items(1), &mut params)? };
        }
        Ok(())
    }

    /// Enqueues `dst[i] = dst[i] / contributors` over elements of a float type:
    /// the last step of an average.
    pub fn finish_avg(
        &self,
        stream: &Stream,
        dtype: DataType,
        dst: &mut DeviceSliceMut<'_>,
        contributors: u32,
    ) -> Result<()> {
        let Some(kernel) = self.divide[dtype as usize] else {
            return Err(error::invalid(
                "reduce op",
                format!("avg is not defined on {dtype}"),
            ));
        };
        if contributors == 0 {
            return Err(error::invalid(
                "contributors",
                "an average needs at least one",
            ));
        }
        self.check_stream(stream)?;
        self.device.check_same("destination", dst.device())?;
        let elements = elements(dtype, "destination", dst.raw(), dst.len())?;
        if elements == 0 {
            return Ok(());
        }
        let split = Split::new(&[dst.raw()], elements, dtype.size_bytes());
        let mut dst_arg = dst.raw();
        let mut n = contributors;
        let (mut head, mut vectors, mut tail) = (split.head, split.vectors, split.tail);
        let mut params = [
            (&raw mut dst_arg).cast(),
            (&raw mut n).cast(),
            (&raw mut head).cast(),
            (&raw mut vectors).cast(),
            (&raw mut tail).cast(),
        ];
        // SAFETY: the parameters match the kernel's signature (a pointer, a u32,
        // three u64); `dst` is a whole, aligned element range of this device,
        // valid until the kernel completes (the view's contract).
        unsafe { self.launch(stream, kernel, split.work_items(1), &mut params) }
    }

    /// Checks an operator, a stream and a destination for a reduction; the
    /// destination's elements.
    fn check_destination(
        &self,
        stream: &Stream,
        dtype: DataType,
        op: ReduceOp,
        dst: &DeviceSliceMut<'_>,
    ) -> Result<u64> {
        if !op.supports(dtype) {
            return Err(error::invalid(
                "reduce op",
                format!("{op} is not defined on {dtype}"),
            ));
        }
        self.check_stream(stream)?;
        self.device.check_same("destination", dst.device())?;
        elements(dtype, "destination", dst.raw(), dst.len())
    }

    /// Checks a source against its destination: this device, the same whole,
    /// aligned elements, no overlap (the kernels read sources through the
    /// read-only cache).
    fn check_source(
        &self,
        dtype: DataType,
        dst: &DeviceSliceMut<'_>,
        src: &DeviceSlice<'_>,
    ) -> Result<()> {
        self.device.check_same("source", src.device())?;
        if dst.len() != src.len() {
            return Err(error::invalid(
                "source",
                format!(
                    "it has {} bytes and the destination {}",
                    src.len(),
                    dst.len()
                ),
            ));
        }
        elements(dtype, "source", src.raw(), src.len())?;
        let (d, s, len) = (dst.raw(), src.raw(), dst.len() as u64);
        if d < s + len && s < d + len {
            return Err(error::invalid(
                "source",
                "it overlaps the destination (the kernel reads it through the read-only cache)",
            ));
        }
        Ok(())
    }

    fn check_stream(&self, stream: &Stream) -> Result<()> {
        self.device.check_same("stream", stream.device().ordinal())
    }

    /// # Safety
    ///
    /// `params` must point at values matching `kernel`'s parameters, and the
    /// memory they name must be valid for the kernel.
    unsafe fn launch(
        &self,
        stream: &Stream,
        kernel: Kernel,
        work_items: u64,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        let _bound = self.device.bind()?;
        let grid = blocks(
            work_items,
            self.device.multiprocessors(),
            kernel.blocks_per_sm,
        );
        // SAFETY: the function belongs to this device's loaded module; the caller
        // vouches for the parameters.
        error::driver("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                kernel.function,
                grid,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream.raw(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}

impl Drop for ReductionKernels {
    fn drop(&mut self) {
        let _bound = match self.device.bind() {
            Ok(bound) => bound,
            Err(e) => {
                log::warn!("unloading the reduction kernels: {e}");
                return;
            }
        };
        // SAFETY: loaded in `load`, unloaded once.
        let status = unsafe { sys::cuModuleUnload(self.module) };
        if let Err(e) = error::driver("cuModuleUnload", status) {
            log::warn!("unloading the reduction kernels: {e}");
        }
    }
}

/// The index of `op`'s kernels (`Avg` reduces with `Sum`'s).
fn operator_index(op: ReduceOp) -> usize {
    let op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    OPERATORS.iter().position(|x| *x == op).unwrap_or(0)
}

/// The number of `dtype` elements in `bytes` bytes at `address`, or an error
/// naming `operand` when they are not whole, aligned elements.
fn elements(dtype: DataType, operand: &'static str, address: u64, bytes: usize) -> Result<u64> {
    let size = dtype.size_bytes();
    if !address.is_multiple_of(size) {
        return Err(error::invalid(
            operand,
            format!("address {address:#x} is not aligned to its {size}-byte {dtype} elements"),
        ));
    }
    if !(bytes as u64).is_multiple_of(size) {
        return Err(error::invalid(
            operand,
            format!("{bytes} bytes is not a whole number of {size}-byte {dtype} elements"),
        ));
    }
    Ok(bytes as u64 / size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_source_defines_every_entry_point_the_host_launches() {
        for dtype in DataType::ALL.iter().copied() {
            for op in OPERATORS {
                let name = entry_point(dtype, op);
                let group = if op.is_bitwise() {
                    "REDUCE_BITWISE"
                } else {
                    "REDUCE_ALL"
                };
                let defined = SOURCE.contains(&format!("{group}({})", type_name(dtype)));
                assert_eq!(defined, op.supports(dtype), "{name}");
            }
            let defines_divide = SOURCE.contains(&format!("DIVIDE({})", type_name(dtype)));
            assert_eq!(defines_divide, dtype.is_float(), "{dtype}");
        }
        assert_eq!(
            entry_point(DataType::BF16, ReduceOp::Avg),
            "fairring_reduce_sum_BF16"
        );
        assert_eq!(
            many_entry_point(DataType::I8, ReduceOp::Max),
            "fairring_reduce_many_max_I8"
        );
        assert!(SOURCE.contains("fairring_reduce_many_##NAME##_##TYPE"));
        assert!(SOURCE.contains(&format!("#define MAX_SOURCES {MAX_SOURCES}\n")));
    }

    #[test]
    fn types_are_indexed_by_their_discriminant() {
        for (i, t) in DataType::ALL.iter().copied().enumerate() {
            assert_eq!(t as usize, i);
        }
    }

    #[test]
    fn operands_must_be_whole_aligned_elements() {
        assert_eq!(
            elements(DataType::F32, "destination", 0x1000, 12).unwrap(),
            3
        );
        let e = elements(DataType::F64, "source", 0x1004, 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("source") && e.contains("0x1004"), "{e}");
        let e = elements(DataType::BF16, "destination", 0x1000, 5)
            .unwrap_err()
            .to_string();
        assert!(e.contains("5 bytes") && e.contains("bf16"), "{e}");
    }
}
