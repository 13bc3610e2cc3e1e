//! The value model: every rank's inputs, the exactly known results, and
//! the checks that count wrong elements.

use super::*;

/// Element types the benchmark can fill and check.
pub(crate) trait Value: Element + Copy + PartialEq + Default + Send {
    fn from_small(v: i64) -> Self;
}

macro_rules! value_int {
    ($($t:ty),*) => {$(
        impl Value for $t {
            #[allow(clippy::cast_possible_truncation, reason = "wrapping, as the reduction")]
            fn from_small(v: i64) -> Self { v as $t }
        }
    )*};
}
value_int!(i32, i64, u8, i8, i16);

/// A `bool` holds the parity of the small value: odd is true.
impl Value for Bool {
    fn from_small(v: i64) -> Self {
        Bool(u8::from(v % 2 != 0))
    }
}

impl Value for f32 {
    #[expect(clippy::cast_precision_loss, reason = "small integers are exact")]
    fn from_small(v: i64) -> Self {
        v as f32
    }
}
impl Value for f64 {
    #[expect(clippy::cast_precision_loss, reason = "small integers are exact")]
    fn from_small(v: i64) -> Self {
        v as f64
    }
}
impl Value for f16 {
    fn from_small(v: i64) -> Self {
        f16::from_f64(i32::try_from(v).map_or(f64::NAN, f64::from))
    }
}
impl Value for bf16 {
    fn from_small(v: i64) -> Self {
        bf16::from_f64(i32::try_from(v).map_or(f64::NAN, f64::from))
    }
}

/// Rank `rank`'s input at element `i`: 1..=4, so sums over 256 ranks stay exact
/// in every type but u8/i8 (which wrap identically on every side). For `avg`,
/// a value shared by every rank (2..=5) moved by +1 and -1 in pairs of ranks (the
/// last of an odd world keeps it), so the sum is `world` times it and the average
/// is a whole number in every type.
pub(crate) fn input(op: ReduceOp, rank: u32, world: u32, i: u64) -> i64 {
    let v = (u64::from(rank) * 7 + i * 3) % 4;
    #[expect(clippy::cast_possible_wrap, reason = "below 4")]
    let (v, shared) = (v as i64, ((i * 3) % 4) as i64);
    match op {
        ReduceOp::Product => 1 + v % 2,
        ReduceOp::Avg => {
            let deviation = if !world.is_multiple_of(2) && rank + 1 == world {
                0
            } else if rank.is_multiple_of(2) {
                1
            } else {
                -1
            };
            2 + shared + deviation
        }
        _ => 1 + v,
    }
}

/// The result at element `i` of reducing every rank's input with `op`, as a
/// small value; for `bool` (`dtype`), of reducing the inputs' parities
/// logically (sum and max are or, product and min and), as 0 or 1.
pub(crate) fn expected(dtype: DataType, op: ReduceOp, world: u32, i: u64) -> i64 {
    let vals = (0..world).map(|r| input(op, r, world, i));
    if dtype == DataType::Bool {
        let mut truths = vals.map(|v| v % 2 != 0);
        return i64::from(match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BitOr => truths.any(|t| t),
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BitAnd => truths.all(|t| t),
            ReduceOp::BitXor => truths.filter(|&t| t).count() % 2 == 1,
            ReduceOp::Avg => false,
        });
    }
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<i64>() / i64::from(world),
        ReduceOp::Product => vals.fold(1i64, i64::wrapping_mul),
        ReduceOp::Min => vals.min().unwrap_or(0),
        ReduceOp::Max => vals.max().unwrap_or(0),
        ReduceOp::BitAnd => vals.fold(-1i64, |a, b| a & b),
        ReduceOp::BitOr => vals.fold(0i64, |a, b| a | b),
        ReduceOp::BitXor => vals.fold(0i64, |a, b| a ^ b),
    }
}

/// Fills the buffers with every rank's known inputs for `o.collective`.
pub(crate) fn fill<T: Value>(
    o: &Options,
    rank: u32,
    bufs: &mut [Vec<T>],
    parts: &mut [Vec<T>],
    n: usize,
    world: u32,
) {
    let k = n / world as usize;
    for (b, p) in bufs.iter_mut().zip(
        parts
            .iter_mut()
            .map(Some)
            .chain(std::iter::repeat_with(|| None)),
    ) {
        match (o.collective, p) {
            (Timed::AllGather | Timed::Gather, Some(p)) => {
                for (i, v) in p[..k].iter_mut().enumerate() {
                    *v = T::from_small(input(o.op, rank, world, i as u64));
                }
            }
            _ => {
                for (i, v) in b[..n].iter_mut().enumerate() {
                    *v = T::from_small(input(o.op, rank, world, i as u64));
                }
            }
        }
    }
}

/// Elements that differ from the exactly known result, summed over ranks.
pub(crate) fn count_wrong<T: Value>(
    o: &Options,
    rank: u32,
    bufs: &[Vec<T>],
    parts: &[Vec<T>],
    n: usize,
    world: u32,
) -> u64 {
    let k = n / world as usize;
    let mut wrong = 0u64;
    for (j, b) in bufs.iter().enumerate() {
        let (got, want): (&[T], Box<dyn Fn(usize) -> i64>) = match o.collective {
            // The rooted collectives define results at their root only, but
            // for a scatter's parts.
            Timed::Reduce | Timed::Gather if rank != 0 => continue,
            Timed::AllReduce => (
                &b[..n],
                Box::new(|i| expected(T::DTYPE, o.op, world, i as u64)),
            ),
            Timed::Broadcast => (&b[..n], Box::new(|i| input(o.op, 0, world, i as u64))),
            // Block `r` of the output from rank `r`: that rank's block for
            // this one.
            Timed::AllToAll => (
                &parts[j][..n],
                Box::new(move |i| {
                    let (from, at) = (i / k.max(1), i % k.max(1));
                    let from = u32::try_from(from).unwrap_or(0);
                    input(o.op, from, world, (rank as usize * k + at) as u64)
                }),
            ),
            // Each pair's even rank's buffer, there and back (an idle odd
            // last rank keeps its own, which is the same).
            Timed::SendRecv => (
                &b[..n],
                Box::new(move |i| input(o.op, rank & !1, world, i as u64)),
            ),
            Timed::AllGather | Timed::Gather => (
                &b[..n],
                Box::new(|i| {
                    let (r, at) = (i / k.max(1), i % k.max(1));
                    input(o.op, u32::try_from(r).unwrap_or(0), world, at as u64)
                }),
            ),
            Timed::ReduceScatter => (
                &parts[j][..k],
                Box::new(move |i| expected(T::DTYPE, o.op, world, (rank as usize * k + i) as u64)),
            ),
            Timed::Reduce => (
                &parts[j][..n],
                Box::new(|i| expected(T::DTYPE, o.op, world, i as u64)),
            ),
            Timed::Scatter => (
                &parts[j][..k],
                Box::new(move |i| input(o.op, 0, world, (rank as usize * k + i) as u64)),
            ),
        };
        wrong += got
            .iter()
            .enumerate()
            .filter(|&(i, v)| *v != T::from_small(want(i)))
            .count() as u64;
    }
    wrong
}
