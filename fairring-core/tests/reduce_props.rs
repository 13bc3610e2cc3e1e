//! Property tests of the host reduction kernels against scalar references written
//! here, independently of the kernels: every type, every operator, special float
//! values (NaN, infinities, signed zeros, subnormals), lengths across the kernels'
//! block boundaries, typed and byte entry points.

use fairring_core::reduce::{self, Bool, Element, Operand, ReduceError};
use fairring_core::{DataType, ReduceOp};
use half::{bf16, f16};
use proptest::prelude::*;
use std::fmt::Debug;

/// The reference semantics of one element: what the module docs promise.
trait Reference: Element + Debug {
    fn op(op: ReduceOp, a: Self, b: Self) -> Self;
    /// `reduce_many`: combined left to right (half types override: in f32, one rounding).
    fn many(op: ReduceOp, dst: Self, srcs: &[Self]) -> Self {
        srcs.iter().fold(dst, |acc, &s| Self::op(op, acc, s))
    }
    /// `finish_avg`: `x / n`, or `None` for integer types.
    fn avg(x: Self, n: u32) -> Option<Self>;
    /// Bitwise equal, or both NaN (NaN payloads are unspecified).
    fn same(a: Self, b: Self) -> bool;
    fn arbitrary() -> BoxedStrategy<Self>;
}

fn float_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a == 0.0 && b == 0.0 {
        if a.is_sign_negative() || b.is_sign_negative() {
            -0.0
        } else {
            0.0
        }
    } else if a <= b {
        a
    } else {
        b
    }
}

fn float_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else if a == 0.0 && b == 0.0 {
        if a.is_sign_positive() || b.is_sign_positive() {
            0.0
        } else {
            -0.0
        }
    } else if a >= b {
        a
    } else {
        b
    }
}

fn specials_f64() -> Vec<f64> {
    vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::NAN,
        f64::MIN_POSITIVE / 4.0,
        65504.0,
        1e-8,
    ]
}

#[expect(
    clippy::cast_possible_truncation,
    reason = "f64 -> f32 of values that came from f32 (exact)"
)]
impl Reference for f32 {
    fn op(op: ReduceOp, a: f32, b: f32) -> f32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Product => a * b,
            // Min and max of two f32 are exact in f64 and convert back exactly.
            ReduceOp::Min => float_min(a.into(), b.into()) as f32,
            ReduceOp::Max => float_max(a.into(), b.into()) as f32,
            bitwise => unreachable!("{bitwise} is refused on floats"),
        }
    }
    fn avg(x: f32, n: u32) -> Option<f32> {
        Some(x / n as f32)
    }
    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }
    fn arbitrary() -> BoxedStrategy<f32> {
        prop_oneof![
            1 => prop::sample::select(specials_f64()).prop_map(|x| x as f32),
            2 => any::<u32>().prop_map(f32::from_bits),
            3 => -1000.0f32..1000.0,
        ]
        .boxed()
    }
}

impl Reference for f64 {
    fn op(op: ReduceOp, a: f64, b: f64) -> f64 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Product => a * b,
            ReduceOp::Min => float_min(a, b),
            ReduceOp::Max => float_max(a, b),
            bitwise => unreachable!("{bitwise} is refused on floats"),
        }
    }
    fn avg(x: f64, n: u32) -> Option<f64> {
        Some(x / f64::from(n))
    }
    fn same(a: f64, b: f64) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }
    fn arbitrary() -> BoxedStrategy<f64> {
        prop_oneof![
            1 => prop::sample::select(specials_f64()),
            2 => any::<u64>().prop_map(f64::from_bits),
            3 => -1e6f64..1e6,
        ]
        .boxed()
    }
}

macro_rules! half_reference {
    ($t:ty, $bits:ty) => {
        impl Reference for $t {
            fn op(op: ReduceOp, a: $t, b: $t) -> $t {
                <$t>::from_f32(<f32 as Reference>::op(op, a.to_f32(), b.to_f32()))
            }
            fn many(op: ReduceOp, dst: $t, srcs: &[$t]) -> $t {
                let acc = srcs.iter().fold(dst.to_f32(), |acc, s| <f32 as Reference>::op(op, acc, s.to_f32()));
                <$t>::from_f32(acc)
            }
            fn avg(x: $t, n: u32) -> Option<$t> {
                Some(<$t>::from_f32(x.to_f32() / n as f32))
            }
            fn same(a: $t, b: $t) -> bool {
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
            }
            fn arbitrary() -> BoxedStrategy<$t> {
                prop_oneof![
                    1 => prop::sample::select(specials_f64()).prop_map(<$t>::from_f64),
                    3 => any::<$bits>().prop_map(<$t>::from_bits),
                ]
                .boxed()
            }
        }
    };
}

half_reference!(f16, u16);
half_reference!(bf16, u16);

macro_rules! int_reference {
    ($t:ty) => {
        impl Reference for $t {
            fn op(op: ReduceOp, a: $t, b: $t) -> $t {
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => a.wrapping_add(b),
                    ReduceOp::Product => a.wrapping_mul(b),
                    ReduceOp::Min => if a < b { a } else { b },
                    ReduceOp::Max => if a > b { a } else { b },
                    ReduceOp::BitAnd => a & b,
                    ReduceOp::BitOr => a | b,
                    ReduceOp::BitXor => a ^ b,
                }
            }
            fn avg(_: $t, _: u32) -> Option<$t> {
                None
            }
            fn same(a: $t, b: $t) -> bool {
                a == b
            }
            fn arbitrary() -> BoxedStrategy<$t> {
                prop_oneof![
                    1 => prop::sample::select(vec![<$t>::MIN, <$t>::MAX, 0 as $t, 1 as $t]),
                    3 => any::<$t>(),
                ]
                .boxed()
            }
        }
    };
}

int_reference!(i32);
int_reference!(i64);
int_reference!(u8);
int_reference!(i8);
int_reference!(i16);

/// `bool`: any non-zero byte is true, every result 0 or 1.
impl Reference for Bool {
    fn op(op: ReduceOp, a: Bool, b: Bool) -> Bool {
        let (a, b) = (a.0 != 0, b.0 != 0);
        Bool(u8::from(match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BitOr => a || b,
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BitAnd => a && b,
            ReduceOp::BitXor => a != b,
            ReduceOp::Avg => unreachable!("avg is refused on bool"),
        }))
    }
    fn avg(_: Bool, _: u32) -> Option<Bool> {
        None
    }
    fn same(a: Bool, b: Bool) -> bool {
        a == b
    }
    fn arbitrary() -> BoxedStrategy<Bool> {
        prop_oneof![
            4 => prop::sample::select(vec![Bool(0), Bool(1)]),
            1 => any::<u8>().prop_map(Bool),
        ]
        .boxed()
    }
}

fn ops_for<T: Element>() -> Vec<ReduceOp> {
    ReduceOp::ALL
        .iter()
        .copied()
        .filter(|op| op.supports(T::DTYPE))
        .collect()
}

/// Lengths around the kernels' 1024-element blocks.
fn len() -> impl Strategy<Value = usize> {
    prop_oneof![3 => 0usize..=40, 1 => 1000usize..=1100, 1 => 2040usize..=2100]
}

fn vectors<T: Reference>(count: usize) -> impl Strategy<Value = Vec<Vec<T>>> {
    len().prop_flat_map(move |n| {
        prop::collection::vec(prop::collection::vec(T::arbitrary(), n), count)
    })
}

fn check_pair<T: Reference>(op: ReduceOp, v: &[Vec<T>]) -> Result<(), TestCaseError> {
    let (a, b) = (&v[0], &v[1]);
    let mut dst = a.clone();
    reduce::reduce(op, &mut dst, b).unwrap();
    for i in 0..a.len() {
        let want = T::op(op, a[i], b[i]);
        prop_assert!(
            T::same(dst[i], want),
            "{:?} {op}: {:?} op {:?} = {:?}, expected {:?}",
            T::DTYPE,
            a[i],
            b[i],
            dst[i],
            want
        );
    }
    // Min and max commute exactly (up to NaN payloads).
    if matches!(op, ReduceOp::Min | ReduceOp::Max) {
        let mut swapped = b.clone();
        reduce::reduce(op, &mut swapped, a).unwrap();
        for i in 0..a.len() {
            prop_assert!(
                T::same(dst[i], swapped[i]),
                "{op} does not commute on {:?}, {:?}",
                a[i],
                b[i]
            );
        }
    }
    // The byte entry point runs the same loop.
    let mut bytes = a.clone();
    reduce::reduce_bytes(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(&mut bytes),
        bytemuck::cast_slice(b),
    )
    .unwrap();
    for i in 0..a.len() {
        prop_assert!(T::same(bytes[i], dst[i]));
    }
    Ok(())
}

/// `reduce_many` combines left to right; half types round once at the end.
fn check_many<T: Reference>(op: ReduceOp, v: &[Vec<T>]) -> Result<(), TestCaseError> {
    let (dst0, srcs) = v.split_first().unwrap();
    let views: Vec<&[T]> = srcs.iter().map(Vec::as_slice).collect();
    let mut dst = dst0.clone();
    reduce::reduce_many(op, &mut dst, &views).unwrap();
    for i in 0..dst.len() {
        let column: Vec<T> = srcs.iter().map(|s| s[i]).collect();
        let want = T::many(op, dst0[i], &column);
        prop_assert!(
            T::same(dst[i], want),
            "{:?} {op} many at {i}: {:?}, expected {:?}",
            T::DTYPE,
            dst[i],
            want
        );
    }
    let byte_views: Vec<&[u8]> = srcs
        .iter()
        .map(|s| bytemuck::cast_slice(s.as_slice()))
        .collect();
    let mut bytes = dst0.clone();
    reduce::reduce_many_bytes(
        T::DTYPE,
        op,
        bytemuck::cast_slice_mut(&mut bytes),
        &byte_views,
    )
    .unwrap();
    for i in 0..dst.len() {
        prop_assert!(T::same(bytes[i], dst[i]));
    }
    Ok(())
}

fn check_avg<T: Reference>(v: &[Vec<T>], n: u32) -> Result<(), TestCaseError> {
    let mut dst = v[0].clone();
    let r = reduce::finish_avg(&mut dst, n);
    if T::avg(v[0].first().copied().unwrap_or(T::zeroed()), 1).is_none() {
        prop_assert_eq!(
            r,
            Err(ReduceError::Unsupported {
                op: ReduceOp::Avg,
                dtype: T::DTYPE
            })
        );
        prop_assert!(
            dst.iter().zip(&v[0]).all(|(a, b)| T::same(*a, *b)),
            "refused average wrote"
        );
        return Ok(());
    }
    r.unwrap();
    for (i, &x) in v[0].iter().enumerate() {
        let want = T::avg(x, n).unwrap();
        prop_assert!(
            T::same(dst[i], want),
            "{:?} avg of {:?} over {n}: {:?}, expected {:?}",
            T::DTYPE,
            x,
            dst[i],
            want
        );
    }
    Ok(())
}

macro_rules! kernel_props {
    ($name:ident, $t:ty) => {
        mod $name {
            use super::*;
            proptest! {
                #![proptest_config(ProptestConfig::with_cases(64))]

                #[test]
                fn pairwise(v in vectors::<$t>(2)) {
                    for op in ops_for::<$t>() {
                        check_pair::<$t>(op, &v)?;
                    }
                }

                #[test]
                fn many(v in (1usize..=5).prop_flat_map(vectors::<$t>)) {
                    for op in ops_for::<$t>() {
                        check_many::<$t>(op, &v)?;
                    }
                }

                #[test]
                fn average(v in vectors::<$t>(1), n in 1u32..=4096) {
                    check_avg::<$t>(&v, n)?;
                }
            }
        }
    };
}

kernel_props!(kernels_f32, f32);
kernel_props!(kernels_f64, f64);
kernel_props!(kernels_f16, f16);
kernel_props!(kernels_bf16, bf16);
kernel_props!(kernels_i32, i32);
kernel_props!(kernels_i64, i64);
kernel_props!(kernels_u8, u8);
kernel_props!(kernels_i8, i8);
kernel_props!(kernels_i16, i16);
kernel_props!(kernels_bool, Bool);

#[test]
fn each_operator_is_offered_where_pytorch_defines_it() {
    for &dtype in DataType::ALL {
        for &op in ReduceOp::ALL {
            let want = match op {
                ReduceOp::Avg => dtype.is_float(),
                ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => !dtype.is_float(),
                _ => true,
            };
            assert_eq!(op.supports(dtype), want, "{op} on {dtype}");
        }
    }
    assert_eq!(DataType::ALL.len(), 10);
    assert_eq!(DataType::I16.size_bytes(), 2);
    assert_eq!(DataType::Bool.size_bytes(), 1);
}

#[test]
fn bad_buffers_are_refused_without_writing() {
    let mut backing = [0u64; 9];
    let src = [1u64; 9];
    let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut backing);
    let src: &[u8] = bytemuck::cast_slice(&src);
    // Misaligned destination and source.
    assert_eq!(
        reduce::reduce_bytes(DataType::F32, ReduceOp::Sum, &mut dst[1..33], &src[..32]),
        Err(ReduceError::Misaligned {
            operand: Operand::Destination,
            align: 4
        })
    );
    assert_eq!(
        reduce::reduce_bytes(DataType::F64, ReduceOp::Sum, &mut dst[..32], &src[4..36]),
        Err(ReduceError::Misaligned {
            operand: Operand::Source(0),
            align: 8
        })
    );
    // Not a whole number of elements.
    assert_eq!(
        reduce::reduce_bytes(DataType::I32, ReduceOp::Max, &mut dst[..30], &src[..30]),
        Err(ReduceError::PartialElement {
            operand: Operand::Source(0),
            len: 30,
            elem_bytes: 4
        })
    );
    // Lengths that differ.
    assert_eq!(
        reduce::reduce_bytes(DataType::U8, ReduceOp::Min, &mut dst[..8], &src[..9]),
        Err(ReduceError::LengthMismatch {
            operand: Operand::Source(0)
        })
    );
    assert_eq!(
        reduce::reduce_many_bytes(
            DataType::U8,
            ReduceOp::Sum,
            &mut dst[..8],
            &[&src[..8], &src[..7]]
        ),
        Err(ReduceError::LengthMismatch {
            operand: Operand::Source(1)
        })
    );
    // Average on integers.
    assert_eq!(
        reduce::reduce_bytes(DataType::I64, ReduceOp::Avg, &mut dst[..8], &src[..8]),
        Err(ReduceError::Unsupported {
            op: ReduceOp::Avg,
            dtype: DataType::I64
        })
    );
    // Bitwise operators on floats.
    assert_eq!(
        reduce::reduce_bytes(DataType::BF16, ReduceOp::BitXor, &mut dst[..8], &src[..8]),
        Err(ReduceError::Unsupported {
            op: ReduceOp::BitXor,
            dtype: DataType::BF16
        })
    );
    assert_eq!(
        reduce::reduce_many_bytes(DataType::F32, ReduceOp::BitOr, &mut dst[..8], &[&src[..8]]),
        Err(ReduceError::Unsupported {
            op: ReduceOp::BitOr,
            dtype: DataType::F32
        })
    );
    assert_eq!(
        reduce::finish_avg_bytes(DataType::F32, &mut dst[..8], 0),
        Err(ReduceError::ZeroContributors)
    );
    assert!(backing.iter().all(|&x| x == 0), "a refused reduction wrote");
}
