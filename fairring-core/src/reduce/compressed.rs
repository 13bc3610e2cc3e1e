//! Reductions whose values travel compressed: `f32` narrowed to a 16-bit
//! [`WireFormat`] before it leaves a machine, widened back where it lands, and
//! reduced in `f32` with its sources still narrow.
//!
//! Every function takes the format at run time; [`WireFormat::Exact`] makes
//! each of them the plain `f32` operation (a copy, nothing, a reduction), so a
//! caller needs no second path. Narrowing rounds to nearest, ties to even, as
//! the half-precision kernels do; widening is exact.
//!
//! The `f16` conversions run through a [`WireCodec`]'s [`HalfBlocks`]. The free
//! functions use the portable ones, branch-free code the compiler vectorises for
//! the target it builds for. A caller that can use the CPU's conversion
//! instructions (which this crate, with no `unsafe` code and no `std`, can
//! neither detect nor call) builds a codec with its own and calls the same
//! operations as the codec's methods.
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

/// How blocks of `f16` values convert to and from `f32`.
///
/// Both functions take slices of equal length. `narrow` rounds to nearest, ties
/// to even, and `widen` is exact: a replacement must give the same bits as
/// [`HalfBlocks::PORTABLE`] (NaN payloads aside: a quiet NaN of the same sign).
#[derive(Clone, Copy, Debug)]
pub struct HalfBlocks {
    /// `narrow[i] = wide[i]`, rounded.
    pub narrow: fn(wide: &[f32], narrow: &mut [f16]),
    /// `wide[i] = narrow[i]`.
    pub widen: fn(narrow: &[f16], wide: &mut [f32]),
}

impl HalfBlocks {
    /// The portable conversions.
    pub const PORTABLE: HalfBlocks = HalfBlocks {
        narrow: store_each::<f16>,
        widen: load_each::<f16>,
    };
}

/// `narrow[i] = wide[i]`, rounded, an element at a time.
fn store_each<H: Element<Acc = f32>>(wide: &[f32], narrow: &mut [H]) {
    for (h, w) in narrow.iter_mut().zip(wide) {
        *h = H::store(*w);
    }
}

/// `wide[i] = narrow[i]`, an element at a time.
fn load_each<H: Element<Acc = f32>>(narrow: &[H], wide: &mut [f32]) {
    for (w, h) in wide.iter_mut().zip(narrow) {
        *w = h.load();
    }
}

/// The compressed wire's conversions and reduction, with a choice of `f16`
/// block conversions (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct WireCodec {
    half: HalfBlocks,
    /// `half` is not the portable one: the reduction widens a block of each
    /// source at a time instead of an element at a time.
    by_blocks: bool,
}

/// A narrow wire type, converted a block at a time.
trait Narrow: Element<Acc = f32> {
    /// `narrow[i] = wide[i]`, rounded, for equal lengths.
    fn store_block(codec: &WireCodec, wide: &[f32], narrow: &mut [Self]);
    /// `wide[i] = narrow[i]`, for equal lengths.
    fn load_block(codec: &WireCodec, narrow: &[Self], wide: &mut [f32]);
    /// Whether the reduction widens sources a block at a time.
    fn by_blocks(codec: &WireCodec) -> bool;
}

impl Narrow for bf16 {
    fn store_block(_: &WireCodec, wide: &[f32], narrow: &mut [bf16]) {
        store_each(wide, narrow);
    }

    fn load_block(_: &WireCodec, narrow: &[bf16], wide: &mut [f32]) {
        load_each(narrow, wide);
    }

    fn by_blocks(_: &WireCodec) -> bool {
        false
    }
}

impl Narrow for f16 {
    fn store_block(codec: &WireCodec, wide: &[f32], narrow: &mut [f16]) {
        (codec.half.narrow)(wide, narrow);
    }

    fn load_block(codec: &WireCodec, narrow: &[f16], wide: &mut [f32]) {
        (codec.half.widen)(narrow, wide);
    }

    fn by_blocks(codec: &WireCodec) -> bool {
        codec.by_blocks
    }
}

/// Narrows the `f32` values in `src` into `dst`, which holds
/// [`WireFormat::f32_bytes`] per value (a copy for [`WireFormat::Exact`]).
pub fn narrow_bytes(format: WireFormat, src: &[u8], dst: &mut [u8]) -> Result<(), ReduceError> {
    WireCodec::PORTABLE.narrow_bytes(format, src, dst)
}

/// Widens the narrow values in `src` into the `f32` values of `dst` (a copy for
/// [`WireFormat::Exact`]).
pub fn widen_bytes(format: WireFormat, src: &[u8], dst: &mut [u8]) -> Result<(), ReduceError> {
    WireCodec::PORTABLE.widen_bytes(format, src, dst)
}

/// Narrows the `f32` values of `bytes` where they lie: afterwards the first
/// `len / 4 * f32_bytes` bytes hold them narrow, and the rest is unspecified.
/// Nothing changes for [`WireFormat::Exact`].
pub fn narrow_in_place(format: WireFormat, bytes: &mut [u8]) -> Result<(), ReduceError> {
    WireCodec::PORTABLE.narrow_in_place(format, bytes)
}

/// Widens the narrow values in the first half of `bytes` where they lie:
/// afterwards `bytes` holds them as `f32`. Nothing changes for
/// [`WireFormat::Exact`].
pub fn widen_in_place(format: WireFormat, bytes: &mut [u8]) -> Result<(), ReduceError> {
    WireCodec::PORTABLE.widen_in_place(format, bytes)
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
    WireCodec::PORTABLE.reduce_many_compressed_bytes(op, format, dst, srcs)
}

impl WireCodec {
    /// The portable conversions: what the free functions use.
    pub const PORTABLE: WireCodec = WireCodec {
        half: HalfBlocks::PORTABLE,
        by_blocks: false,
    };

    /// A codec whose `f16` blocks convert through `half`.
    pub const fn with_half(half: HalfBlocks) -> WireCodec {
        WireCodec {
            half,
            by_blocks: true,
        }
    }

    /// Whether it converts with the portable functions.
    pub const fn is_portable(&self) -> bool {
        !self.by_blocks
    }

    /// As [`narrow_bytes`].
    pub fn narrow_bytes(
        &self,
        format: WireFormat,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), ReduceError> {
        let wide = view::<f32>(src, Operand::Source(0))?;
        with_format!(format, {
            let dst = view_mut::<f32>(dst)?;
            dst.copy_from_slice(checked_len(wide, dst.len())?);
            Ok(())
        }, H => {
            let narrow = view_mut::<H>(dst)?;
            let wide = checked_len(wide, narrow.len())?;
            H::store_block(self, wide, narrow);
            Ok(())
        })
    }

    /// As [`widen_bytes`].
    pub fn widen_bytes(
        &self,
        format: WireFormat,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<(), ReduceError> {
        let wide = view_mut::<f32>(dst)?;
        with_format!(format, {
            let src = view::<f32>(src, Operand::Source(0))?;
            wide.copy_from_slice(checked_len(src, wide.len())?);
            Ok(())
        }, H => {
            let narrow = view::<H>(src, Operand::Source(0))?;
            let narrow = checked_len(narrow, wide.len())?;
            H::load_block(self, narrow, wide);
            Ok(())
        })
    }

    /// As [`narrow_in_place`].
    pub fn narrow_in_place(&self, format: WireFormat, bytes: &mut [u8]) -> Result<(), ReduceError> {
        let n = view::<f32>(bytes, Operand::Destination)?.len();
        with_format!(format, Ok(()), H => {
            let mut narrow = [H::default(); BLOCK];
            let mut i = 0;
            while i < n {
                let k = BLOCK.min(n - i);
                // Block [i, i + k) is read before its narrow form goes to bytes
                // [2i, 2i + 2k), which lie below every later block's bytes (from 4(i + k)).
                let wide = view::<f32>(&bytes[4 * i..4 * (i + k)], Operand::Destination)?;
                H::store_block(self, wide, &mut narrow[..k]);
                view_mut::<H>(&mut bytes[2 * i..2 * (i + k)])?.copy_from_slice(&narrow[..k]);
                i += k;
            }
            Ok(())
        })
    }

    /// As [`widen_in_place`].
    pub fn widen_in_place(&self, format: WireFormat, bytes: &mut [u8]) -> Result<(), ReduceError> {
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
                H::load_block(self, &narrow[..k], wide);
                if start == 0 {
                    return Ok(());
                }
                start -= BLOCK;
            }
        })
    }

    /// As [`reduce_many_compressed_bytes`].
    pub fn reduce_many_compressed_bytes(
        &self,
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
                ReduceOp::Sum | ReduceOp::Avg => widening::<H>(self, dst, srcs, <f32 as Arith>::sum),
                ReduceOp::Product => widening::<H>(self, dst, srcs, <f32 as Arith>::product),
                ReduceOp::Min => widening::<H>(self, dst, srcs, <f32 as Arith>::min),
                ReduceOp::Max => widening::<H>(self, dst, srcs, <f32 as Arith>::max),
                // Refused on floats by `supported` above.
                ReduceOp::BitAnd | ReduceOp::BitOr | ReduceOp::BitXor => {
                    Err(ReduceError::Unsupported { op, dtype: DataType::F32 })
                }
            }
        })
    }
}

/// The widening loop: each block of `dst` stays in cache while every source
/// is folded into it.
#[inline(always)]
fn widening<H: Narrow>(
    codec: &WireCodec,
    dst: &mut [f32],
    srcs: &[&[u8]],
    f: impl Fn(f32, f32) -> f32 + Copy,
) -> Result<(), ReduceError> {
    let by_blocks = H::by_blocks(codec);
    let mut wide = [0f32; BLOCK];
    let mut start = 0;
    for block in dst.chunks_mut(BLOCK) {
        let n = block.len();
        for (i, s) in srcs.iter().enumerate() {
            let s = view::<H>(s, Operand::Source(i))?;
            let s = s.get(start..start + n).ok_or(ReduceError::LengthMismatch {
                operand: Operand::Source(i),
            })?;
            if by_blocks {
                let wide = &mut wide[..n];
                H::load_block(codec, s, wide);
                for (d, w) in block.iter_mut().zip(wide.iter()) {
                    *d = f(*d, *w);
                }
            } else {
                for (d, h) in block.iter_mut().zip(s) {
                    *d = f(*d, h.load());
                }
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
