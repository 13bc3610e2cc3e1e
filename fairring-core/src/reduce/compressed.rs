//! Reductions whose values travel compressed: `f32` narrowed to a 16-bit
//! [`WireFormat`] before it leaves a machine, widened back where it lands, and
//! reduced in `f32` with its sources still narrow.
//!
//! Every function takes the format at run time; [`WireFormat::Exact`] makes
//! each of them the plain `f32` operation (a copy, nothing, a reduction), so a
//! caller needs no second path. Narrowing rounds to nearest, ties to even, as
//! the half-precision kernels do; widening is exact.
//!
//! The in-place forms let a staging buffer convert a range where it lies: the
//! narrow values occupy the first half of the range's bytes. They work a block
//! at a time through a buffer on the stack, in the order that never overwrites
//! a value before it is read (narrowing from the front, widening from the
//! back), with no `unsafe` and no allocation.

use super::element::Element;
use super::element::private::Arith;
use super::{Operand, ReduceError, supported, view, view_mut};
use crate::dtype::{DataType, ReduceOp, WireFormat};
use half::{bf16, f16};

/// Elements per block of the in-place conversions and the reduction.
const BLOCK: usize = 512;

/// Evaluates `$exact` for [`WireFormat::Exact`], else `$body` with `$h` naming
/// the narrow element type.
macro_rules! with_format {
    ($format:expr, $exact:expr, $h:ident => $body:expr) => {
        match $format {
            WireFormat::Exact => $exact,
            WireFormat::Bf16 => {
                type $h = bf16;
                $body
            }
            WireFormat::F16 => {
                type $h = f16;
                $body
            }
        }
    };
}

/// Narrows the `f32` values in `src` into `dst`, which holds
/// [`WireFormat::f32_bytes`] per value (a copy for [`WireFormat::Exact`]).
pub fn narrow_bytes(format: WireFormat, src: &[u8], dst: &mut [u8]) -> Result<(), ReduceError> {
    let wide = view::<f32>(src, Operand::Source(0))?;
    with_format!(format, {
        let dst = view_mut::<f32>(dst)?;
        dst.copy_from_slice(checked_len(wide, dst.len())?);
        Ok(())
    }, H => {
        let narrow = view_mut::<H>(dst)?;
        let wide = checked_len(wide, narrow.len())?;
        for (h, w) in narrow.iter_mut().zip(wide) {
            *h = H::store(*w);
        }
        Ok(())
    })
}

/// Widens the narrow values in `src` into the `f32` values of `dst` (a copy for
/// [`WireFormat::Exact`]).
pub fn widen_bytes(format: WireFormat, src: &[u8], dst: &mut [u8]) -> Result<(), ReduceError> {
    let wide = view_mut::<f32>(dst)?;
    with_format!(format, {
        let src = view::<f32>(src, Operand::Source(0))?;
        wide.copy_from_slice(checked_len(src, wide.len())?);
        Ok(())
    }, H => {
        let narrow = view::<H>(src, Operand::Source(0))?;
        let narrow = checked_len(narrow, wide.len())?;
        for (w, h) in wide.iter_mut().zip(narrow) {
            *w = h.load();
        }
        Ok(())
    })
}

/// Narrows the `f32` values of `bytes` where they lie: afterwards the first
/// `len / 4 * f32_bytes` bytes hold them narrow, and the rest is unspecified.
/// Nothing changes for [`WireFormat::Exact`].
pub fn narrow_in_place(format: WireFormat, bytes: &mut [u8]) -> Result<(), ReduceError> {
    let n = view::<f32>(bytes, Operand::Destination)?.len();
    with_format!(format, Ok(()), H => {
        let mut narrow = [H::default(); BLOCK];
        let mut i = 0;
        while i < n {
            let k = BLOCK.min(n - i);
            // Block [i, i + k) is read before its narrow form goes to bytes
            // [2i, 2i + 2k), which lie below every later block's bytes (from 4(i + k)).
            let wide = view::<f32>(&bytes[4 * i..4 * (i + k)], Operand::Destination)?;
            for (h, w) in narrow.iter_mut().zip(wide) {
                *h = H::store(*w);
            }
            view_mut::<H>(&mut bytes[2 * i..2 * (i + k)])?.copy_from_slice(&narrow[..k]);
            i += k;
        }
        Ok(())
    })
}

/// Widens the narrow values in the first half of `bytes` where they lie:
/// afterwards `bytes` holds them as `f32`. Nothing changes for
/// [`WireFormat::Exact`].
pub fn widen_in_place(format: WireFormat, bytes: &mut [u8]) -> Result<(), ReduceError> {
    let n = view::<f32>(bytes, Operand::Destination)?.len();
    with_format!(format, Ok(()), H => {
        let mut narrow = [H::default(); BLOCK];
        // Blocks start at multiples of BLOCK and go from the last to the first:
        // block [i, i + k) writes bytes [4i, 4i + 4k), which hold the narrow
        // values [2i, 2i + 2k); for i > 0 those are at or past i + BLOCK, in blocks
        // already widened, and block 0 reads its own before writing.
        let mut start = n - n % BLOCK;
        if start == n && n > 0 {
            start -= BLOCK;
        }
        loop {
            let k = BLOCK.min(n - start);
            narrow[..k].copy_from_slice(view::<H>(&bytes[2 * start..2 * (start + k)], Operand::Destination)?);
            let wide = view_mut::<f32>(&mut bytes[4 * start..4 * (start + k)])?;
            for (w, h) in wide.iter_mut().zip(&narrow[..k]) {
                *w = h.load();
            }
            if start == 0 {
                return Ok(());
            }
            start -= BLOCK;
        }
    })
}

/// `dst[i] = dst[i] op srcs[0][i] op srcs[1][i] ...` for `f32` values in `dst`
/// and sources that hold them narrow in `format` (`Avg` reduces as `Sum`; a
/// plain `f32` reduction for [`WireFormat::Exact`]). Each source is widened
/// exactly; the arithmetic is `f32`'s, as in
/// [`reduce_many`](super::reduce_many).
pub fn reduce_many_compressed_bytes(
    op: ReduceOp,
    format: WireFormat,
    dst: &mut [u8],
    srcs: &[&[u8]],
) -> Result<(), ReduceError> {
    supported(op, DataType::F32)?;
    with_format!(format, super::reduce_many_bytes(DataType::F32, op, dst, srcs), H => {
        let dst = view_mut::<f32>(dst)?;
        for (i, s) in srcs.iter().enumerate() {
            let s = view::<H>(s, Operand::Source(i))?;
            if s.len() != dst.len() {
                return Err(ReduceError::LengthMismatch { operand: Operand::Source(i) });
            }
        }
        match op {
            ReduceOp::Sum | ReduceOp::Avg => widening::<H>(dst, srcs, <f32 as Arith>::sum),
            ReduceOp::Product => widening::<H>(dst, srcs, <f32 as Arith>::product),
            ReduceOp::Min => widening::<H>(dst, srcs, <f32 as Arith>::min),
            ReduceOp::Max => widening::<H>(dst, srcs, <f32 as Arith>::max),
        }
    })
}

/// The widening loop: each block of `dst` stays in cache while every source
/// is folded into it.
#[inline(always)]
fn widening<H: Element<Acc = f32>>(
    dst: &mut [f32],
    srcs: &[&[u8]],
    f: impl Fn(f32, f32) -> f32 + Copy,
) -> Result<(), ReduceError> {
    let mut start = 0;
    for block in dst.chunks_mut(BLOCK) {
        let n = block.len();
        for (i, s) in srcs.iter().enumerate() {
            let s = view::<H>(s, Operand::Source(i))?;
            let s = s.get(start..start + n).ok_or(ReduceError::LengthMismatch {
                operand: Operand::Source(i),
            })?;
            for (d, h) in block.iter_mut().zip(s) {
                *d = f(*d, h.load());
            }
        }
        start += n;
    }
    Ok(())
}

/// `values` if it holds exactly `len` elements.
fn checked_len<T>(values: &[T], len: usize) -> Result<&[T], ReduceError> {
    if values.len() == len {
        Ok(values)
    } else {
        Err(ReduceError::LengthMismatch {
            operand: Operand::Source(0),
        })
    }
}
