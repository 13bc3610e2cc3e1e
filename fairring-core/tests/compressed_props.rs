//! Property tests of the compressed wire: narrowing against `half`'s rounding,
//! the in-place forms against the out-of-place ones across block boundaries,
//! and the widening reduction against widening first and reducing in `f32`.

use fairring_core::reduce::{
    self, HalfBlocks, Operand, ReduceError, WireCodec, narrow_bytes, narrow_in_place,
    reduce_many_compressed_bytes, widen_bytes, widen_in_place,
};
use fairring_core::{DataType, ReduceOp, WireFormat};
use half::{bf16, f16};
use proptest::prelude::*;

const COMPRESSED: [WireFormat; 2] = [WireFormat::Bf16, WireFormat::F16];

/// `half`'s rounding of `x` into `format`, as bits.
fn narrow_reference(format: WireFormat, x: f32) -> u16 {
    match format {
        WireFormat::Bf16 => bf16::from_f32(x).to_bits(),
        WireFormat::F16 => f16::from_f32(x).to_bits(),
        WireFormat::Exact => unreachable!("only compressed formats narrow"),
    }
}

fn widen_reference(format: WireFormat, h: u16) -> f32 {
    match format {
        WireFormat::Bf16 => bf16::from_bits(h).to_f32(),
        WireFormat::F16 => f16::from_bits(h).to_f32(),
        WireFormat::Exact => unreachable!("only compressed formats widen"),
    }
}

/// Bitwise equal, or both NaN (payloads are unspecified).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn same_half(format: WireFormat, a: u16, b: u16) -> bool {
    a == b || (widen_reference(format, a).is_nan() && widen_reference(format, b).is_nan())
}

fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -1.0e6f32..1.0e6,
        2 => any::<u32>().prop_map(f32::from_bits),
        1 => prop::sample::select(vec![
            0.0f32, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65504.0, 65520.0,
            6.1e-5, 5.96e-8, 1.0e-40, f32::MAX, f32::MIN_POSITIVE,
        ]),
    ]
}

/// Lengths around the conversions' 512-element blocks.
fn len() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..20, 500usize..530, 1020usize..1030, 1530usize..1540]
}

fn values(n: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(value(), n)
}

fn bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn narrowing_rounds_as_half_does(v in len().prop_flat_map(values)) {
        for format in COMPRESSED {
            let mut out = vec![0u16; v.len()];
            narrow_bytes(format, bytes(&v), bytemuck::cast_slice_mut(&mut out)).unwrap();
            for (x, h) in v.iter().zip(&out) {
                prop_assert!(same_half(format, *h, narrow_reference(format, *x)),
                    "{format}: {x:e} narrowed to {h:#06x}");
            }
            let mut wide = vec![0f32; v.len()];
            widen_bytes(format, bytemuck::cast_slice(&out), bytemuck::cast_slice_mut(&mut wide)).unwrap();
            for (h, w) in out.iter().zip(&wide) {
                prop_assert!(same(*w, widen_reference(format, *h)));
            }
        }
    }

    #[test]
    fn in_place_conversions_match_the_out_of_place_ones(v in len().prop_flat_map(values)) {
        for format in COMPRESSED {
            let mut expected = vec![0u16; v.len()];
            narrow_bytes(format, bytes(&v), bytemuck::cast_slice_mut(&mut expected)).unwrap();
            let mut buffer = v.clone();
            narrow_in_place(format, bytemuck::cast_slice_mut(&mut buffer)).unwrap();
            let narrow: &[u16] = &bytemuck::cast_slice(&buffer)[..v.len()];
            prop_assert_eq!(narrow, &expected[..]);

            let mut widened = vec![0f32; v.len()];
            widen_bytes(format, bytemuck::cast_slice(&expected), bytemuck::cast_slice_mut(&mut widened)).unwrap();
            widen_in_place(format, bytemuck::cast_slice_mut(&mut buffer)).unwrap();
            prop_assert_eq!(
                bytemuck::cast_slice::<f32, u32>(&buffer),
                bytemuck::cast_slice::<f32, u32>(&widened)
            );
        }
    }

    #[test]
    fn compressed_sources_reduce_as_their_widened_values(
        (dst, srcs) in len().prop_flat_map(|n| (values(n), prop::collection::vec(values(n), 0..5))),
        op in prop::sample::select(vec![ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max, ReduceOp::Avg]),
    ) {
        for format in COMPRESSED {
            let narrow: Vec<Vec<u16>> = srcs.iter().map(|s| {
                let mut h = vec![0u16; s.len()];
                narrow_bytes(format, bytes(s), bytemuck::cast_slice_mut(&mut h)).unwrap();
                h
            }).collect();
            let widened: Vec<Vec<f32>> = narrow.iter().map(|h| h.iter().map(|&b| widen_reference(format, b)).collect()).collect();
            let mut expected = dst.clone();
            let refs: Vec<&[f32]> = widened.iter().map(Vec::as_slice).collect();
            reduce::reduce_many(op, &mut expected, &refs).unwrap();

            let mut got = dst.clone();
            let sources: Vec<&[u8]> = narrow.iter().map(|h| bytemuck::cast_slice(h)).collect();
            reduce_many_compressed_bytes(op, format, bytemuck::cast_slice_mut(&mut got), &sources).unwrap();
            for (g, e) in got.iter().zip(&expected) {
                prop_assert!(same(*g, *e), "{format} {op}: {g:e} vs {e:e}");
            }
            // A codec with block conversions of its own widens a block at a time.
            let mut blocks = dst.clone();
            WireCodec::with_half(HalfBlocks::PORTABLE)
                .reduce_many_compressed_bytes(op, format, bytemuck::cast_slice_mut(&mut blocks), &sources)
                .unwrap();
            for (b, e) in blocks.iter().zip(&expected) {
                prop_assert!(same(*b, *e), "{format} {op} by blocks: {b:e} vs {e:e}");
            }
        }
    }
}

/// A codec converts `f16` blocks through the functions it was given, in every
/// operation, and `bf16` portably.
#[test]
fn a_codec_converts_f16_through_its_half_blocks() {
    // Conversions that tell themselves apart: every value becomes 1.0 (0x3C00).
    let ones = WireCodec::with_half(HalfBlocks {
        narrow: |_, narrow| narrow.fill(f16::ONE),
        widen: |_, wide| wide.fill(1.0),
    });
    assert!(!ones.is_portable() && WireCodec::PORTABLE.is_portable());
    let v = vec![3.0f32; 1030];
    let mut h = vec![0u16; v.len()];
    ones.narrow_bytes(WireFormat::F16, bytes(&v), bytemuck::cast_slice_mut(&mut h))
        .unwrap();
    assert!(h.iter().all(|&b| b == 0x3C00));
    let mut w = vec![0f32; v.len()];
    ones.widen_bytes(
        WireFormat::F16,
        bytemuck::cast_slice(&h),
        bytemuck::cast_slice_mut(&mut w),
    )
    .unwrap();
    assert!(w.iter().all(|&x| x == 1.0));
    let mut in_place = v.clone();
    ones.narrow_in_place(WireFormat::F16, bytemuck::cast_slice_mut(&mut in_place))
        .unwrap();
    let narrowed: &[u16] = bytemuck::cast_slice(&in_place);
    assert!(narrowed[..v.len()].iter().all(|&b| b == 0x3C00));
    let mut in_place = vec![0f32; 1030];
    ones.widen_in_place(WireFormat::F16, bytemuck::cast_slice_mut(&mut in_place))
        .unwrap();
    assert!(in_place.iter().all(|&x| x == 1.0));
    let mut sum = vec![0.5f32; 1030];
    ones.reduce_many_compressed_bytes(
        ReduceOp::Sum,
        WireFormat::F16,
        bytemuck::cast_slice_mut(&mut sum),
        &[bytemuck::cast_slice(&h), bytemuck::cast_slice(&h)],
    )
    .unwrap();
    assert!(sum.iter().all(|&x| x == 2.5));
    // bf16 ignores them.
    let mut b = vec![0u16; v.len()];
    ones.narrow_bytes(
        WireFormat::Bf16,
        bytes(&v),
        bytemuck::cast_slice_mut(&mut b),
    )
    .unwrap();
    assert!(b.iter().all(|&x| x == bf16::from_f32(3.0).to_bits()));
}

#[test]
fn the_exact_format_copies_and_reduces_in_f32() {
    let v: Vec<f32> = (0..1500).map(|i| i as f32 * 0.3 - 7.0).collect();
    let mut copy = vec![0f32; v.len()];
    narrow_bytes(
        WireFormat::Exact,
        bytes(&v),
        bytemuck::cast_slice_mut(&mut copy),
    )
    .unwrap();
    assert_eq!(copy, v);
    let mut back = vec![0f32; v.len()];
    widen_bytes(
        WireFormat::Exact,
        bytes(&copy),
        bytemuck::cast_slice_mut(&mut back),
    )
    .unwrap();
    assert_eq!(back, v);
    let mut same_place = v.clone();
    narrow_in_place(WireFormat::Exact, bytemuck::cast_slice_mut(&mut same_place)).unwrap();
    widen_in_place(WireFormat::Exact, bytemuck::cast_slice_mut(&mut same_place)).unwrap();
    assert_eq!(same_place, v);
    let mut got = v.clone();
    reduce_many_compressed_bytes(
        ReduceOp::Sum,
        WireFormat::Exact,
        bytemuck::cast_slice_mut(&mut got),
        &[bytes(&v)],
    )
    .unwrap();
    let doubled: Vec<f32> = v.iter().map(|x| x + x).collect();
    assert_eq!(got, doubled);
}

#[test]
fn bad_buffers_are_refused_naming_the_operand() {
    let v = vec![1.0f32; 8];
    let mut short = vec![0u16; 7];
    assert_eq!(
        narrow_bytes(
            WireFormat::Bf16,
            bytes(&v),
            bytemuck::cast_slice_mut(&mut short)
        ),
        Err(ReduceError::LengthMismatch {
            operand: Operand::Source(0)
        })
    );
    let mut dst = vec![0f32; 8];
    let h = vec![0u16; 9];
    assert_eq!(
        reduce_many_compressed_bytes(
            ReduceOp::Sum,
            WireFormat::F16,
            bytemuck::cast_slice_mut(&mut dst),
            &[bytemuck::cast_slice(&h[..8]), bytemuck::cast_slice(&h)]
        ),
        Err(ReduceError::LengthMismatch {
            operand: Operand::Source(1)
        })
    );
    let mut words = [0u32; 4];
    let partial = &mut bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..6];
    assert_eq!(
        narrow_in_place(WireFormat::Bf16, partial),
        Err(ReduceError::PartialElement {
            operand: Operand::Destination,
            len: 6,
            elem_bytes: 4
        })
    );
    let mut aligned = vec![0f32; 4];
    let misaligned = &mut bytemuck::cast_slice_mut::<f32, u8>(&mut aligned)[1..13];
    assert!(matches!(
        widen_in_place(WireFormat::F16, misaligned),
        Err(ReduceError::Misaligned {
            operand: Operand::Destination,
            align: 4
        })
    ));
}

#[test]
fn only_f32_travels_compressed() {
    for format in WireFormat::ALL {
        for &dtype in DataType::ALL {
            assert_eq!(
                format.carries(dtype),
                *format == WireFormat::Exact || dtype == DataType::F32,
                "{format} {dtype}"
            );
        }
    }
    assert_eq!(
        WireFormat::Bf16.f32_bytes() * 2,
        WireFormat::Exact.f32_bytes()
    );
    assert_eq!(WireFormat::from_name("f16"), Some(WireFormat::F16));
}
