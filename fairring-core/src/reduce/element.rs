//! The element types the kernels reduce, and their arithmetic.

use super::convert;
use crate::dtype::DataType;
use half::{bf16, f16};

/// An element type the kernels reduce: `f32`, `f64`, [`f16`](struct@half::f16), [`bf16`], `i32`, `i64`,
/// `u8`, `i8`, `i16` and [`Bool`]. Sealed: the set matches [`DataType`].
pub trait Element: bytemuck::Pod + private::Sealed {
    /// The type's name in [`DataType`].
    const DTYPE: DataType;
    /// The type arithmetic happens in: `f32` for [`f16`](struct@half::f16) and [`bf16`], else `Self`.
    #[doc(hidden)]
    type Acc: private::Arith;
    /// Whether `Acc` is wider than `Self` (loads and stores convert).
    #[doc(hidden)]
    const WIDENS: bool;
    /// Widens to the arithmetic type (exact).
    #[doc(hidden)]
    fn load(self) -> Self::Acc;
    /// Narrows from the arithmetic type (round to nearest, ties to even).
    #[doc(hidden)]
    fn store(acc: Self::Acc) -> Self;
}

pub(crate) mod private {
    /// Seals [`Element`](super::Element).
    pub trait Sealed {}

    /// The arithmetic of one accumulator type. Everything is written branch-free
    /// enough for the compiler to vectorise it.
    pub trait Arith: Copy + Default {
        fn sum(a: Self, b: Self) -> Self;
        fn product(a: Self, b: Self) -> Self;
        fn min(a: Self, b: Self) -> Self;
        fn max(a: Self, b: Self) -> Self;
        /// Bitwise and. Reached for integers and [`Bool`](super::Bool) only
        /// ([`ReduceOp::supports`](crate::ReduceOp::supports) refuses floats);
        /// on floats it is defined on the bits, never used.
        fn bit_and(a: Self, b: Self) -> Self;
        /// Bitwise or (as `bit_and`).
        fn bit_or(a: Self, b: Self) -> Self;
        /// Bitwise exclusive or (as `bit_and`).
        fn bit_xor(a: Self, b: Self) -> Self;
        /// `a / n`; `None` for integer types, which have no average.
        fn divide(a: Self, n: u32) -> Option<Self>;
    }
}

use private::{Arith, Sealed};

// Float min and max propagate NaN and order -0 below +0, so that they commute
// exactly: the result never depends on which machine's contribution came first.
// `a < b` and `b < a` are both false only for equal values (including +0 and -0)
// and for NaN. For min, OR-ing the bits then gives the value itself, -0 for a pair
// of zeros of different sign, and a NaN when either is NaN (all-ones exponent, a
// non-zero mantissa). For max, AND-ing gives +0 for mixed zeros; NaN takes the OR.
macro_rules! float_arith {
    ($t:ty, $bits:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn sum(a: $t, b: $t) -> $t {
                a + b
            }
            #[inline(always)]
            fn product(a: $t, b: $t) -> $t {
                a * b
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                let tie = <$t>::from_bits(a.to_bits() | b.to_bits());
                if a < b {
                    a
                } else if b < a {
                    b
                } else {
                    tie
                }
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                let (x, y): ($bits, $bits) = (a.to_bits(), b.to_bits());
                let tie = <$t>::from_bits(if a == b { x & y } else { x | y });
                if a > b {
                    a
                } else if b > a {
                    b
                } else {
                    tie
                }
            }
            #[inline(always)]
            fn bit_and(a: $t, b: $t) -> $t {
                <$t>::from_bits(a.to_bits() & b.to_bits())
            }
            #[inline(always)]
            fn bit_or(a: $t, b: $t) -> $t {
                <$t>::from_bits(a.to_bits() | b.to_bits())
            }
            #[inline(always)]
            fn bit_xor(a: $t, b: $t) -> $t {
                <$t>::from_bits(a.to_bits() ^ b.to_bits())
            }
            #[inline(always)]
            fn divide(a: $t, n: u32) -> Option<$t> {
                Some(a / (n as $t))
            }
        }
    };
}

float_arith!(f32, u32);
float_arith!(f64, u64);

// Integers wrap on overflow (two's complement), as NCCL and PyTorch do.
macro_rules! int_arith {
    ($t:ty) => {
        impl Arith for $t {
            #[inline(always)]
            fn sum(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn product(a: $t, b: $t) -> $t {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: $t, b: $t) -> $t {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn max(a: $t, b: $t) -> $t {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn bit_and(a: $t, b: $t) -> $t {
                a & b
            }
            #[inline(always)]
            fn bit_or(a: $t, b: $t) -> $t {
                a | b
            }
            #[inline(always)]
            fn bit_xor(a: $t, b: $t) -> $t {
                a ^ b
            }
            #[inline(always)]
            fn divide(_: $t, _: u32) -> Option<$t> {
                None
            }
        }
    };
}

int_arith!(i32);
int_arith!(i64);
int_arith!(u8);
int_arith!(i8);
int_arith!(i16);

/// A boolean in one byte, as PyTorch's `torch.bool` stores it: 0 is false,
/// any other value true. Every result is 0 or 1: sum, max and `BitOr` are
/// logical or; product, min and `BitAnd` logical and; `BitXor` logical
/// exclusive or.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct Bool(pub u8);

impl Bool {
    /// Whether the value is true (its byte is not 0).
    #[inline(always)]
    pub const fn get(self) -> bool {
        self.0 != 0
    }

    #[inline(always)]
    const fn of(value: bool) -> Bool {
        Bool(value as u8)
    }
}

impl Arith for Bool {
    #[inline(always)]
    fn sum(a: Bool, b: Bool) -> Bool {
        Bool::of(a.get() | b.get())
    }
    #[inline(always)]
    fn product(a: Bool, b: Bool) -> Bool {
        Bool::of(a.get() & b.get())
    }
    #[inline(always)]
    fn min(a: Bool, b: Bool) -> Bool {
        Bool::of(a.get() & b.get())
    }
    #[inline(always)]
    fn max(a: Bool, b: Bool) -> Bool {
        Bool::of(a.get() | b.get())
    }
    #[inline(always)]
    fn bit_and(a: Bool, b: Bool) -> Bool {
        Bool::of(a.get() & b.get())
    }
    #[inline(always)]
    fn bit_or(a: Bool, b: Bool) -> Bool {
        Bool::of(a.get() | b.get())
    }
    #[inline(always)]
    fn bit_xor(a: Bool, b: Bool) -> Bool {
        Bool::of(a.get() ^ b.get())
    }
    #[inline(always)]
    fn divide(_: Bool, _: u32) -> Option<Bool> {
        None
    }
}

macro_rules! native_element {
    ($t:ty, $dtype:expr) => {
        impl Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = $dtype;
            type Acc = $t;
            const WIDENS: bool = false;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(acc: $t) -> $t {
                acc
            }
        }
    };
}

native_element!(f32, DataType::F32);
native_element!(f64, DataType::F64);
native_element!(i32, DataType::I32);
native_element!(i64, DataType::I64);
native_element!(u8, DataType::U8);
native_element!(i8, DataType::I8);
native_element!(i16, DataType::I16);
native_element!(Bool, DataType::Bool);

macro_rules! half_element {
    ($t:ty, $dtype:expr, $widen:path, $narrow:path) => {
        impl Sealed for $t {}
        impl Element for $t {
            const DTYPE: DataType = $dtype;
            type Acc = f32;
            const WIDENS: bool = true;
            #[inline(always)]
            fn load(self) -> f32 {
                $widen(self.to_bits())
            }
            #[inline(always)]
            fn store(acc: f32) -> $t {
                <$t>::from_bits($narrow(acc))
            }
        }
    };
}

half_element!(f16, DataType::F16, convert::f16_to_f32, convert::f32_to_f16);
half_element!(
    bf16,
    DataType::BF16,
    convert::bf16_to_f32,
    convert::f32_to_bf16
);
