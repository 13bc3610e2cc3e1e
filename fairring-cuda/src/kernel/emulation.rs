//! The kernel source run on the CPU: `reduce.cu` compiled as C++ with the host
//! C++ compiler (`c++`, or `$CXX`), every thread of the grid run in turn, with the
//! head/vector/tail split and grid size the launcher computes. It checks the
//! kernels' arithmetic and indexing against fairring-core's host kernels on any
//! machine; what it cannot check is the GPU's own code generation and memory
//! system, nor the f16 conversions, which are PTX `cvt` instructions on the
//! device and the compiler's IEEE `_Float16` conversions here.
#![expect(
    clippy::cast_possible_truncation,
    reason = "element sizes and test lengths are small; random bits are truncated on purpose"
)]

use std::ffi::c_void;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use fairring_core::reduce::{finish_avg_bytes, reduce_bytes, reduce_many_bytes};
use fairring_core::{DataType, ReduceOp};

use super::geometry::{Split, THREADS, blocks};
use super::{MAX_SOURCES, OPERATORS, SOURCE, divide_entry_point, entry_point, many_entry_point};

const SHIM: &str = include_str!("host_emulation.h");

const LAUNCHERS: &str = r#"
extern "C" void fairring_emulate_reduce(void* kernel, void* dst, const void* src,
                                        unsigned long long head, unsigned long long vectors,
                                        unsigned long long tail, unsigned int grid,
                                        unsigned int block) {
    typedef void (*Fn)(void*, const void*, u64, u64, u64);
    Fn f = reinterpret_cast<Fn>(kernel);
    FAIRRING_FOR_EACH_THREAD(grid, block, f(dst, src, head, vectors, tail));
}
extern "C" void fairring_emulate_reduce_many(void* kernel, void* dst, const void* const* srcs,
                                             unsigned int count, unsigned long long head,
                                             unsigned long long vectors, unsigned long long tail,
                                             unsigned int grid, unsigned int block) {
    typedef void (*Fn)(void*, Sources, u32, u64, u64, u64);
    Sources s;
    for (unsigned int k = 0; k < MAX_SOURCES; ++k) s.p[k] = k < count ? srcs[k] : 0;
    Fn f = reinterpret_cast<Fn>(kernel);
    FAIRRING_FOR_EACH_THREAD(grid, block, f(dst, s, count, head, vectors, tail));
}
extern "C" void fairring_emulate_divide(void* kernel, void* dst, unsigned int n,
                                        unsigned long long head, unsigned long long vectors,
                                        unsigned long long tail, unsigned int grid,
                                        unsigned int block) {
    typedef void (*Fn)(void*, u32, u64, u64, u64);
    Fn f = reinterpret_cast<Fn>(kernel);
    FAIRRING_FOR_EACH_THREAD(grid, block, f(dst, n, head, vectors, tail));
}
"#;

type Launch =
    unsafe extern "C" fn(*mut c_void, *mut c_void, *const c_void, u64, u64, u64, u32, u32);
type LaunchMany = unsafe extern "C" fn(
    *mut c_void,
    *mut c_void,
    *const *const c_void,
    u32,
    u64,
    u64,
    u64,
    u32,
    u32,
);
type LaunchDivide = unsafe extern "C" fn(*mut c_void, *mut c_void, u32, u64, u64, u64, u32, u32);

/// The kernels built as a shared library, once per test process.
fn library() -> &'static libloading::Library {
    static LIBRARY: OnceLock<libloading::Library> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        let dir: PathBuf =
            std::env::temp_dir().join(format!("fairring-emulation-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = dir.join("kernels.cpp");
        std::fs::write(&source, format!("{SHIM}\n{SOURCE}\n{LAUNCHERS}")).unwrap();
        let output = dir.join("libkernels.so");
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
        let built = Command::new(&compiler)
            .args([
                "-std=c++17",
                "-O2",
                "-fno-strict-aliasing",
                "-shared",
                "-fPIC",
            ])
            .arg("-DFAIRRING_HOST_EMULATION")
            .arg(&source)
            .arg("-o")
            .arg(&output)
            .output()
            .unwrap_or_else(|e| {
                panic!("the host emulation needs a C++ compiler ({compiler}): {e}")
            });
        assert!(
            built.status.success(),
            "{compiler} could not build the kernels:\n{}",
            String::from_utf8_lossy(&built.stderr)
        );
        // SAFETY: the library was just built from the kernel source and the shim;
        // loading it runs no initialisers beyond static zeroing.
        let library = unsafe { libloading::Library::new(&output) }.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        library
    })
}

fn symbol<T: Copy>(name: &str) -> T {
    // SAFETY: every name looked up is defined by the library with the type the
    // caller asks for (the launchers above, or a kernel taken by address).
    unsafe {
        *library()
            .get::<T>(name.as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    }
}

fn kernel(name: &str) -> *mut c_void {
    // SAFETY: a kernel's address, passed back to the launcher that calls it with
    // its own signature.
    unsafe {
        let f = library()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        *f as *mut c_void
    }
}

/// A grid as the launcher would size it for a small device (2 multiprocessors, 2
/// resident blocks each), so that large inputs take many grid-stride passes.
fn grid(split: &Split, per_thread: u64) -> u32 {
    blocks(split.work_items(per_thread), 2, 2)
}

/// Bytes of `n` pseudo-random elements, with the special values of float types.
fn elements(dtype: DataType, n: usize, mut seed: u64) -> Vec<u8> {
    let size = dtype.size_bytes() as usize;
    let mut out = Vec::with_capacity(n * size);
    for i in 0..n {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let specials: &[u64] = match dtype {
            DataType::F32 => &[0x7FC0_0000, 0xFF80_0000, 0x8000_0000, 0, 1, 0x8000_0001],
            DataType::F64 => &[0x7FF8 << 48, 0xFFF0 << 48, 1 << 63, 0, 1, (1 << 63) | 7],
            DataType::F16 => &[0x7E00, 0xFC00, 0x8000, 0, 1, 0x83FF],
            DataType::BF16 => &[0x7FC0, 0xFF80, 0x8000, 0, 1, 0x807F],
            _ => &[],
        };
        let bits = if !specials.is_empty() && i % 13 == 4 {
            specials[(seed % specials.len() as u64) as usize]
        } else {
            match dtype {
                // Moderate magnitudes, so that sums and products stay mostly finite.
                DataType::F32 => u64::from((((seed >> 40) as f32) / 1e5 - 80.0).to_bits()),
                DataType::F64 => (((seed >> 11) as f64) / 1e12 - 4000.0).to_bits(),
                DataType::F16 => {
                    u64::from(half::f16::from_f32(((seed >> 40) as f32) / 2e6 - 4.0).to_bits())
                }
                DataType::BF16 => {
                    u64::from(half::bf16::from_f32(((seed >> 40) as f32) / 1e4 - 800.0).to_bits())
                }
                // A third false, the rest true in bytes other than 1 as well.
                DataType::Bool if seed.is_multiple_of(3) => 0,
                DataType::Bool => (seed >> 8) | 1,
                _ => seed,
            }
        };
        out.extend_from_slice(&bits.to_le_bytes()[..size]);
    }
    out
}

fn is_nan(dtype: DataType, e: &[u8]) -> bool {
    let mut b = [0u8; 8];
    b[..e.len()].copy_from_slice(e);
    let bits = u64::from_le_bytes(b);
    match dtype {
        DataType::F32 => f32::from_bits(bits as u32).is_nan(),
        DataType::F64 => f64::from_bits(bits).is_nan(),
        DataType::F16 => bits & 0x7FFF > 0x7C00,
        DataType::BF16 => bits & 0x7FFF > 0x7F80,
        _ => false,
    }
}

fn assert_same(dtype: DataType, got: &[u8], want: &[u8], what: &str) {
    if got == want {
        return;
    }
    let size = dtype.size_bytes() as usize;
    for (i, (g, w)) in got.chunks(size).zip(want.chunks(size)).enumerate() {
        assert!(
            g == w || (is_nan(dtype, g) && is_nan(dtype, w)),
            "{what}: element {i} is {g:02x?}, the host kernel gives {w:02x?}"
        );
    }
}

/// 16-byte aligned scratch space for `bytes` bytes at an element offset.
struct Aligned(Vec<u128>);

impl Aligned {
    fn new(bytes: usize) -> Aligned {
        Aligned(vec![0; bytes.div_ceil(16) + 2])
    }
    fn bytes(&mut self, offset: usize, len: usize) -> &mut [u8] {
        let all: &mut [u8] = bytemuck_bytes(&mut self.0);
        &mut all[offset..offset + len]
    }
}

fn bytemuck_bytes(words: &mut [u128]) -> &mut [u8] {
    let len = words.len() * 16;
    // SAFETY: u128 has no padding and any byte pattern is valid for u8; the
    // slice covers exactly the words' memory and borrows it mutably.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), len) }
}

#[test]
fn every_kernel_matches_the_host_kernels_when_run_on_the_cpu() {
    let launch: Launch = symbol("fairring_emulate_reduce");
    let launch_divide: LaunchDivide = symbol("fairring_emulate_divide");
    let mut ops = OPERATORS.to_vec();
    ops.push(ReduceOp::Avg);
    for dtype in DataType::ALL.iter().copied() {
        let size = dtype.size_bytes() as usize;
        for n in [1usize, 3, 1000, (1 << 20) + 7] {
            let dst_host = elements(dtype, n, 0x1234_5678 ^ n as u64);
            let src_host = elements(dtype, n, 0x9876_5432 ^ n as u64);
            for op in ops.iter().copied().filter(|op| op.supports(dtype)) {
                for (dst_off, src_off) in [(0usize, 0usize), (1, 1), (0, 1), (3, 3)] {
                    if n > 1000 && dst_off != src_off {
                        continue; // the all-scalar path is the same loop at any size
                    }
                    let what = format!("{dtype} {op} n={n} offsets=({dst_off},{src_off})");
                    let mut want = dst_host.clone();
                    reduce_bytes(dtype, op, &mut want, &src_host).unwrap();
                    if op == ReduceOp::Avg {
                        finish_avg_bytes(dtype, &mut want, 3).unwrap();
                    }
                    let mut dst_mem = Aligned::new((n + 4) * size);
                    let mut src_mem = Aligned::new((n + 4) * size);
                    let src = src_mem.bytes(src_off * size, n * size);
                    src.copy_from_slice(&src_host);
                    let src_ptr = src.as_ptr();
                    let dst = dst_mem.bytes(dst_off * size, n * size);
                    dst.copy_from_slice(&dst_host);
                    let split = Split::new(
                        &[dst.as_ptr() as u64, src_ptr as u64],
                        n as u64,
                        size as u64,
                    );
                    // SAFETY: the launcher calls the kernel with `n` elements of
                    // each operand, as split for their addresses.
                    unsafe {
                        launch(
                            kernel(&entry_point(dtype, op)),
                            dst.as_mut_ptr().cast(),
                            src_ptr.cast(),
                            split.head,
                            split.vectors,
                            split.tail,
                            grid(&split, 2),
                            THREADS,
                        );
                    }
                    if op == ReduceOp::Avg {
                        let split = Split::new(&[dst.as_ptr() as u64], n as u64, size as u64);
                        // SAFETY: as above, for the one operand.
                        unsafe {
                            launch_divide(
                                kernel(&divide_entry_point(dtype)),
                                dst.as_mut_ptr().cast(),
                                3,
                                split.head,
                                split.vectors,
                                split.tail,
                                grid(&split, 1),
                                THREADS,
                            );
                        }
                    }
                    assert_same(dtype, dst, &want, &what);
                    let all = dst_mem.bytes(0, (n + 4) * size);
                    assert!(
                        all[..dst_off * size].iter().all(|b| *b == 0),
                        "{what}: wrote before dst"
                    );
                    assert!(
                        all[(dst_off + n) * size..].iter().all(|b| *b == 0),
                        "{what}: wrote after dst"
                    );
                }
            }
        }
    }
}

#[test]
fn the_many_source_kernel_matches_the_host_reduce_many_when_run_on_the_cpu() {
    let launch: LaunchMany = symbol("fairring_emulate_reduce_many");
    let mut ops = OPERATORS.to_vec();
    ops.push(ReduceOp::Avg);
    for dtype in DataType::ALL.iter().copied() {
        let size = dtype.size_bytes() as usize;
        for n in [1usize, 3, 1000, (1 << 16) + 7] {
            for k in [1usize, 3, 7, MAX_SOURCES] {
                let dst_host = elements(dtype, n, 0x1234_5678 ^ n as u64);
                let srcs_host: Vec<Vec<u8>> = (0..k)
                    .map(|j| elements(dtype, n, 0x9876_5432 ^ (n * 31 + j) as u64))
                    .collect();
                for op in ops.iter().copied().filter(|op| op.supports(dtype)) {
                    // Every operand at the same offset (vectors), or one source
                    // off by an element (all scalar).
                    for (dst_off, odd_src) in [(0usize, 0usize), (1, 1), (0, 1)] {
                        if n > 1000 && dst_off != odd_src {
                            continue;
                        }
                        let what =
                            format!("{dtype} {op} n={n} k={k} offsets=({dst_off},{odd_src})");
                        let mut want = dst_host.clone();
                        let views: Vec<&[u8]> = srcs_host.iter().map(Vec::as_slice).collect();
                        reduce_many_bytes(dtype, op, &mut want, &views).unwrap();
                        if op == ReduceOp::Avg {
                            finish_avg_bytes(dtype, &mut want, 3).unwrap();
                        }
                        let mut src_mems: Vec<Aligned> =
                            (0..k).map(|_| Aligned::new((n + 4) * size)).collect();
                        let mut src_ptrs = Vec::with_capacity(k);
                        for (j, (mem, host)) in src_mems.iter_mut().zip(&srcs_host).enumerate() {
                            let off = if j == k / 2 { odd_src } else { dst_off };
                            let src = mem.bytes(off * size, n * size);
                            src.copy_from_slice(host);
                            src_ptrs.push(src.as_ptr().cast::<c_void>());
                        }
                        let mut dst_mem = Aligned::new((n + 4) * size);
                        let dst = dst_mem.bytes(dst_off * size, n * size);
                        dst.copy_from_slice(&dst_host);
                        let mut addresses = vec![dst.as_ptr() as u64];
                        addresses.extend(src_ptrs.iter().map(|p| *p as u64));
                        let split = Split::new(&addresses, n as u64, size as u64);
                        // SAFETY: the launcher calls the kernel with `n` elements
                        // of each operand, as split for their addresses.
                        unsafe {
                            launch(
                                kernel(&many_entry_point(dtype, op)),
                                dst.as_mut_ptr().cast(),
                                src_ptrs.as_ptr(),
                                k as u32,
                                split.head,
                                split.vectors,
                                split.tail,
                                grid(&split, 1),
                                THREADS,
                            );
                        }
                        if op == ReduceOp::Avg {
                            let launch_divide: LaunchDivide = symbol("fairring_emulate_divide");
                            let split = Split::new(&[dst.as_ptr() as u64], n as u64, size as u64);
                            // SAFETY: as above, for the one operand.
                            unsafe {
                                launch_divide(
                                    kernel(&divide_entry_point(dtype)),
                                    dst.as_mut_ptr().cast(),
                                    3,
                                    split.head,
                                    split.vectors,
                                    split.tail,
                                    grid(&split, 1),
                                    THREADS,
                                );
                            }
                        }
                        assert_same(dtype, dst, &want, &what);
                        let all = dst_mem.bytes(0, (n + 4) * size);
                        assert!(
                            all[..dst_off * size].iter().all(|b| *b == 0),
                            "{what}: wrote before dst"
                        );
                        assert!(
                            all[(dst_off + n) * size..].iter().all(|b| *b == 0),
                            "{what}: wrote after dst"
                        );
                    }
                }
            }
        }
    }
}
