//! Host reduction kernels: `dst = dst op src`.
//!
//! These run the reduction step wherever it runs on a CPU: the server of a shard in
//! a CPU job, a dedicated reduction server, the tests' reference. There are typed
//! entry points ([`reduce`], [`reduce_many`], [`finish_avg`]) and byte entry points
//! for staging buffers whose type is only known at run time ([`reduce_bytes`],
//! [`reduce_many_bytes`], [`finish_avg_bytes`]), which check length, element
//! boundaries and alignment and then run the same loops.
//!
//! The compressed wire ([`WireFormat`](crate::WireFormat)) adds conversions
//! between `f32` and its 16-bit formats, in place or not, and a reduction of
//! narrow sources into `f32` ([`narrow_bytes`], [`widen_bytes`],
//! [`narrow_in_place`], [`widen_in_place`], [`reduce_many_compressed_bytes`]).
//!
//! # Semantics
//!
//! - **Sum, product**: IEEE arithmetic for floats; wrapping two's-complement
//!   arithmetic for integers (as NCCL and PyTorch do).
//! - **Bitwise and, or, xor**: on integers, on the two's-complement bits;
//!   defined on integers and `bool` only (floats get
//!   [`ReduceError::Unsupported`]).
//! - **bool** ([`Bool`]): 0 is false, any other byte true, every result 0 or
//!   1; sum and max are logical or, product and min logical and (PyTorch's
//!   and NCCL's meaning of them on `torch.bool`).
//! - **Min, max**: for floats, NaN-propagating (if either operand is NaN the result is
//!   NaN) and with `-0 < +0`, so that they commute exactly and a result never depends
//!   on the order contributions arrived in. (`f32::min` ignores NaN, and a plain
//!   `a < b` select returns different zeros depending on the order; neither is
//!   used.) A NaN result's payload is unspecified.
//! - **Avg**: reduces as sum; [`finish_avg`] then divides by the number of
//!   contributors (`x / n`, correctly rounded). Defined for floats only: on integer
//!   types every entry point returns [`ReduceError::Unsupported`].
//! - **f16, bf16**: each element is widened to `f32` (exactly), combined in `f32` and
//!   rounded back to nearest-even. [`reduce_many`] keeps the whole sum of all
//!   sources in `f32` and rounds once per element, which is both faster and more
//!   accurate than reducing pairwise.
//! - **Order**: sources are combined in the order given, element-wise; a sum over
//!   the same sources in the same order is bit-identical on every run.
//!
//! # Cost
//!
//! Each (type, operator) pair is one straight loop over the elements with the
//! operator chosen outside it, which the compiler vectorises (measured in
//! `benches/benches/reduce.rs` against a `copy_from_slice` of the same bytes).
//! [`reduce_many`] works in blocks of 1024 elements so that `dst` is read and
//! written once whatever the number of sources. Nothing allocates; nothing panics.

mod compressed;
mod convert;
mod element;
mod kernel;

pub use compressed::{
    HalfBlocks, WireCodec, narrow_bytes, narrow_in_place, reduce_many_compressed_bytes,
    widen_bytes, widen_in_place,
};
pub use element::{Bool, Element};

use crate::dtype::{DataType, ReduceOp};
use core::fmt;
use element::private::Arith;
use half::{bf16, f16};
use kernel::Sources;

/// Which operand of a kernel an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    /// The destination (`dst`).
    Destination,
    /// The source at this index (0 for the single source of [`reduce`]).
    Source(usize),
}

impl fmt::Display for Operand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Operand::Destination => f.write_str("destination"),
            Operand::Source(i) => write!(f, "source {i}"),
        }
    }
}

/// Why a reduction was refused. Nothing was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReduceError {
    /// The operator is not defined on the type (`Avg` on an integer type).
    Unsupported {
        /// The operator.
        op: ReduceOp,
        /// The type.
        dtype: DataType,
    },
    /// A source's length differs from the destination's.
    LengthMismatch {
        /// The source.
        operand: Operand,
    },
    /// A byte buffer is not aligned for its element type.
    Misaligned {
        /// The buffer.
        operand: Operand,
        /// The alignment the type needs.
        align: usize,
    },
    /// A byte buffer's length is not a whole number of elements.
    PartialElement {
        /// The buffer.
        operand: Operand,
        /// Its length in bytes.
        len: usize,
        /// The element size.
        elem_bytes: usize,
    },
    /// An average over zero contributors.
    ZeroContributors,
}

impl fmt::Display for ReduceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ReduceError::Unsupported { op, dtype } => {
                write!(f, "reduce op {op} is not supported on {dtype}")
            }
            ReduceError::LengthMismatch { operand } => {
                write!(f, "{operand} has a different length than the destination")
            }
            ReduceError::Misaligned { operand, align } => {
                write!(f, "{operand} is not aligned to {align} bytes")
            }
            ReduceError::PartialElement {
                operand,
                len,
                elem_bytes,
            } => write!(
                f,
                "{operand} has {len} bytes, not a whole number of {elem_bytes}-byte elements"
            ),
            ReduceError::ZeroContributors => {
                f.write_str("an average needs at least one contributor")
            }
        }
    }
}

impl core::error::Error for ReduceError {}

/// `dst[i] = dst[i] op src[i]` (`Avg` reduces as `Sum`; see [`finish_avg`]).
pub fn reduce<T: Element>(op: ReduceOp, dst: &mut [T], src: &[T]) -> Result<(), ReduceError> {
    supported(op, T::DTYPE)?;
    if src.len() != dst.len() {
        return Err(ReduceError::LengthMismatch {
            operand: Operand::Source(0),
        });
    }
    match op {
        ReduceOp::Sum | ReduceOp::Avg => kernel::pair(dst, src, T::Acc::sum),
        ReduceOp::Product => kernel::pair(dst, src, T::Acc::product),
        ReduceOp::Min => kernel::pair(dst, src, T::Acc::min),
        ReduceOp::Max => kernel::pair(dst, src, T::Acc::max),
        ReduceOp::BitAnd => kernel::pair(dst, src, T::Acc::bit_and),
        ReduceOp::BitOr => kernel::pair(dst, src, T::Acc::bit_or),
        ReduceOp::BitXor => kernel::pair(dst, src, T::Acc::bit_xor),
    }
    Ok(())
}

/// `dst[i] = dst[i] op srcs[0][i] op srcs[1][i] ...`, combined left to right, with
/// one pass over `dst`. For [`f16`](struct@half::f16) and [`bf16`] the whole combination is kept in
/// `f32` and rounded once.
pub fn reduce_many<T: Element>(
    op: ReduceOp,
    dst: &mut [T],
    srcs: &[&[T]],
) -> Result<(), ReduceError> {
    supported(op, T::DTYPE)?;
    if let Some(i) = srcs.iter().position(|s| s.len() != dst.len()) {
        return Err(ReduceError::LengthMismatch {
            operand: Operand::Source(i),
        });
    }
    many(op, dst, srcs)
}

/// Finishes an average: `dst[i] = dst[i] / contributors`.
pub fn finish_avg<T: Element>(dst: &mut [T], contributors: u32) -> Result<(), ReduceError> {
    supported(ReduceOp::Avg, T::DTYPE)?;
    if contributors == 0 {
        return Err(ReduceError::ZeroContributors);
    }
    kernel::divide(dst, contributors)
}

/// Evaluates `$body` with the type alias `$t` naming the element type of `$dtype`.
macro_rules! with_element {
    ($dtype:expr, $t:ident => $body:expr) => {
        with_element!(@arms $dtype, $t, $body,
            F32 f32, F64 f64, F16 f16, BF16 bf16, I32 i32, I64 i64, U8 u8, I8 i8,
            I16 i16, Bool Bool)
    };
    (@arms $dtype:expr, $t:ident, $body:expr, $($variant:ident $ty:ty),+) => {
        match $dtype {
            $(DataType::$variant => {
                type $t = $ty;
                $body
            })+
        }
    };
}

/// [`reduce`] over byte buffers holding elements of `dtype`.
pub fn reduce_bytes(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    src: &[u8],
) -> Result<(), ReduceError> {
    supported(op, dtype)?;
    with_element!(dtype, T => {
        let src = view::<T>(src, Operand::Source(0))?;
        reduce(op, view_mut::<T>(dst)?, src)
    })
}

/// [`reduce_many`] over byte buffers holding elements of `dtype`.
pub fn reduce_many_bytes(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    srcs: &[&[u8]],
) -> Result<(), ReduceError> {
    supported(op, dtype)?;
    with_element!(dtype, T => reduce_many_bytes_as::<T>(op, dst, srcs))
}

/// [`finish_avg`] over a byte buffer holding elements of `dtype`.
pub fn finish_avg_bytes(
    dtype: DataType,
    dst: &mut [u8],
    contributors: u32,
) -> Result<(), ReduceError> {
    supported(ReduceOp::Avg, dtype)?;
    with_element!(dtype, T => finish_avg::<T>(view_mut(dst)?, contributors))
}

fn reduce_many_bytes_as<T: Element>(
    op: ReduceOp,
    dst: &mut [u8],
    srcs: &[&[u8]],
) -> Result<(), ReduceError> {
    // Check every source before writing anything.
    for (i, s) in srcs.iter().enumerate() {
        view::<T>(s, Operand::Source(i))?;
        if s.len() != dst.len() {
            return Err(ReduceError::LengthMismatch {
                operand: Operand::Source(i),
            });
        }
    }
    many(op, view_mut::<T>(dst)?, &ByteSources(srcs))
}

fn supported(op: ReduceOp, dtype: DataType) -> Result<(), ReduceError> {
    if op.supports(dtype) {
        Ok(())
    } else {
        Err(ReduceError::Unsupported { op, dtype })
    }
}

fn many<T: Element, S: Sources<T> + ?Sized>(
    op: ReduceOp,
    dst: &mut [T],
    srcs: &S,
) -> Result<(), ReduceError> {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => kernel::many(dst, srcs, T::Acc::sum),
        ReduceOp::Product => kernel::many(dst, srcs, T::Acc::product),
        ReduceOp::Min => kernel::many(dst, srcs, T::Acc::min),
        ReduceOp::Max => kernel::many(dst, srcs, T::Acc::max),
        ReduceOp::BitAnd => kernel::many(dst, srcs, T::Acc::bit_and),
        ReduceOp::BitOr => kernel::many(dst, srcs, T::Acc::bit_or),
        ReduceOp::BitXor => kernel::many(dst, srcs, T::Acc::bit_xor),
    }
}

/// Byte buffers viewed as `T`, a block at a time (each already checked by
/// [`view`], so a block view cannot fail).
struct ByteSources<'a>(&'a [&'a [u8]]);

impl<T: Element> Sources<T> for ByteSources<'_> {
    fn count(&self) -> usize {
        self.0.len()
    }

    fn source(&self, i: usize, start: usize, len: usize) -> Result<&[T], ReduceError> {
        let size = size_of::<T>();
        let bytes = self
            .0
            .get(i)
            .and_then(|s| s.get(start * size..(start + len) * size))
            .ok_or(ReduceError::LengthMismatch {
                operand: Operand::Source(i),
            })?;
        view(bytes, Operand::Source(i))
    }
}

fn view<T: Element>(bytes: &[u8], operand: Operand) -> Result<&[T], ReduceError> {
    bytemuck::try_cast_slice(bytes).map_err(|e| cast_error::<T>(e, operand, bytes.len()))
}

fn view_mut<T: Element>(bytes: &mut [u8]) -> Result<&mut [T], ReduceError> {
    let len = bytes.len();
    bytemuck::try_cast_slice_mut(bytes).map_err(|e| cast_error::<T>(e, Operand::Destination, len))
}

fn cast_error<T>(e: bytemuck::PodCastError, operand: Operand, len: usize) -> ReduceError {
    match e {
        bytemuck::PodCastError::TargetAlignmentGreaterAndInputNotAligned => {
            ReduceError::Misaligned {
                operand,
                align: align_of::<T>(),
            }
        }
        _ => ReduceError::PartialElement {
            operand,
            len,
            elem_bytes: size_of::<T>(),
        },
    }
}
