//! The loops. Each takes the operator as a function chosen outside the loop, so
//! that every (type, operator) pair compiles to its own straight loop.

use super::ReduceError;
use super::element::Element;
use super::element::private::Arith;

/// Bytes of `dst` per block of [`many`]. Measured on a 2-core EPYC with 7 sources
/// (`benches/benches/reduce.rs`): 2 KiB blocks beat pairwise reduction by 1.4x at
/// 8 MiB and 1.7x at 64 MiB per source; 4 KiB and larger blocks lose to pairwise at
/// 8 MiB, as the blocks of eight equally aligned streams start to evict each other
/// from L1.
const BLOCK_BYTES: usize = 2048;

/// Accumulators per block for half-precision types (2-byte elements).
const HALF_BLOCK: usize = BLOCK_BYTES / 2;

/// `dst[i] = f(dst[i], src[i])`; the lengths are equal (checked by the caller).
#[inline(always)]
pub(super) fn pair<T: Element>(dst: &mut [T], src: &[T], f: impl Fn(T::Acc, T::Acc) -> T::Acc) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = T::store(f(d.load(), s.load()));
    }
}

/// Where [`many`] gets its sources: typed slices, or byte slices viewed as `T`.
pub(super) trait Sources<T> {
    fn count(&self) -> usize;
    /// Elements `start..start + len` of source `i`.
    fn source(&self, i: usize, start: usize, len: usize) -> Result<&[T], ReduceError>;
}

impl<T> Sources<T> for [&[T]] {
    fn count(&self) -> usize {
        self.len()
    }

    fn source(&self, i: usize, start: usize, len: usize) -> Result<&[T], ReduceError> {
        self.get(i)
            .and_then(|s| s.get(start..start + len))
            .ok_or(ReduceError::LengthMismatch {
                operand: super::Operand::Source(i),
            })
    }
}

/// `dst[i] = f(...f(f(dst[i], s0[i]), s1[i])..., sn[i])`, a block at a time, so
/// that each block of `dst` stays in cache while every source is folded into it:
/// `dst` is read and written once, each source read once.
///
/// Types whose arithmetic is in their own precision fold straight into `dst`;
/// half-precision types fold into an `f32` block and are rounded once per element,
/// not once per source.
#[inline(always)]
pub(super) fn many<T: Element, S: Sources<T> + ?Sized>(
    dst: &mut [T],
    srcs: &S,
    f: impl Fn(T::Acc, T::Acc) -> T::Acc + Copy,
) -> Result<(), ReduceError> {
    let block_len = (BLOCK_BYTES / size_of::<T>()).clamp(1, HALF_BLOCK);
    if T::WIDENS {
        let mut acc = [T::Acc::default(); HALF_BLOCK];
        let mut start = 0;
        for block in dst.chunks_mut(block_len) {
            let n = block.len();
            let acc = &mut acc[..n];
            for (a, d) in acc.iter_mut().zip(block.iter()) {
                *a = d.load();
            }
            for i in 0..srcs.count() {
                let src = srcs.source(i, start, n)?;
                for (a, s) in acc.iter_mut().zip(src) {
                    *a = f(*a, s.load());
                }
            }
            for (d, a) in block.iter_mut().zip(acc.iter()) {
                *d = T::store(*a);
            }
            start += n;
        }
    } else {
        let mut start = 0;
        for block in dst.chunks_mut(block_len) {
            let n = block.len();
            for i in 0..srcs.count() {
                pair(block, srcs.source(i, start, n)?, f);
            }
            start += n;
        }
    }
    Ok(())
}

/// `dst[i] = dst[i] / n`, for types that divide.
#[inline(always)]
pub(super) fn divide<T: Element>(dst: &mut [T], n: u32) -> Result<(), ReduceError> {
    if <T::Acc as Arith>::divide(T::Acc::default(), 1).is_none() {
        return Err(ReduceError::Unsupported {
            op: crate::dtype::ReduceOp::Avg,
            dtype: T::DTYPE,
        });
    }
    for d in dst.iter_mut() {
        if let Some(q) = <T::Acc as Arith>::divide(d.load(), n) {
            *d = T::store(q);
        }
    }
    Ok(())
}
