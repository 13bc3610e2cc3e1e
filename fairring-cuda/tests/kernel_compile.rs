//! NVRTC compiles the reduction kernels, on any machine that has libnvrtc (no
//! device needed). `.ci/run` installs it from the nvidia-cuda-nvrtc wheel and runs
//! these with `--ignored`; without the library they fail, naming it.

use fairring_core::{DataType, ReduceOp};
use fairring_cuda::kernel::{compile, divide_entry_point, entry_point, many_entry_point};

/// The PTX body of one entry point.
fn body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} is not in the PTX"));
    let rest = &ptx[start..];
    let end = rest[1..].find(".entry ").map_or(rest.len(), |e| e + 1);
    &rest[..end]
}

/// Whether some instruction starting with `op` moves 16 bytes: four 32-bit
/// lanes or two 64-bit ones.
fn moves_16_bytes(ptx: &str, op: &str) -> bool {
    ptx.lines().map(str::trim).any(|line| {
        line.strip_prefix(op).is_some_and(|rest| {
            ["v4.u32", "v4.b32", "v4.f32", "v2.u64", "v2.b64", "v2.f64"]
                .iter()
                .any(|shape| rest.starts_with(shape))
        })
    })
}

#[test]
#[ignore = "needs libnvrtc on the loader path (no device)"]
fn every_kernel_compiles_for_hopper_and_ampere() {
    for cc in [(9, 0), (8, 0)] {
        let compiled = compile(cc).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(compiled.arch, format!("sm_{}{}", cc.0, cc.1));
        assert_eq!(
            &compiled.cubin[..4],
            b"\x7fELF",
            "the CUBIN is an ELF image"
        );
        for dtype in DataType::ALL.iter().copied() {
            for op in [
                ReduceOp::Sum,
                ReduceOp::Product,
                ReduceOp::Min,
                ReduceOp::Max,
            ] {
                body(&compiled.ptx, &entry_point(dtype, op));
                body(&compiled.ptx, &many_entry_point(dtype, op));
            }
            if dtype.is_float() {
                body(&compiled.ptx, &divide_entry_point(dtype));
            }
        }
    }
}

#[test]
#[ignore = "needs libnvrtc on the loader path (no device)"]
fn the_kernels_move_16_byte_vectors_through_the_read_only_path() {
    let compiled = compile((9, 0)).unwrap_or_else(|e| panic!("{e}"));
    for dtype in DataType::ALL.iter().copied() {
        for name in [ReduceOp::Sum, ReduceOp::Min]
            .into_iter()
            .flat_map(|op| [entry_point(dtype, op), many_entry_point(dtype, op)])
        {
            let ptx = body(&compiled.ptx, &name);
            assert!(
                moves_16_bytes(ptx, "ld.global.nc."),
                "{name} has no 16-byte read-only load"
            );
            assert!(
                moves_16_bytes(ptx, "ld.global."),
                "{name} has no 16-byte load of dst"
            );
            assert!(
                moves_16_bytes(ptx, "st.global."),
                "{name} has no 16-byte store"
            );
            assert!(!ptx.contains(".local"), "{name} spills to local memory");
        }
    }
}

#[test]
#[ignore = "needs libnvrtc on the loader path (no device)"]
fn float_arithmetic_keeps_ieee_semantics() {
    let compiled = compile((9, 0)).unwrap_or_else(|e| panic!("{e}"));
    let sum = body(&compiled.ptx, &entry_point(DataType::F32, ReduceOp::Sum));
    assert!(
        sum.contains("add.rn.f32") || sum.contains("add.f32"),
        "f32 sum adds"
    );
    assert!(!sum.contains(".ftz"), "f32 sum must not flush subnormals");
    let divide = body(&compiled.ptx, &divide_entry_point(DataType::F32));
    assert!(
        divide.contains("div.rn.f32"),
        "the average divides correctly rounded"
    );
    let half = body(&compiled.ptx, &entry_point(DataType::F16, ReduceOp::Sum));
    assert!(
        half.contains("cvt.rn.f16.f32"),
        "f16 rounds to nearest even"
    );
}
