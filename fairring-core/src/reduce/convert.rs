//! Branch-free conversions between `f32` and the half-precision types.
//!
//! `half` converts element by element through branches when it cannot use the
//! CPU's conversion instructions (which it detects only with `std`), and such a loop
//! does not vectorise: an f16 sum ran at about 0.4 GB/s. These functions compute
//! every case and select the answer, which the compiler turns into straight vector
//! code. They agree with `half` bit for bit on every input (NaN payloads aside:
//! both produce a quiet NaN of the same sign), which the tests below check
//! exhaustively for the widening conversions and at every rounding boundary for
//! the narrowing ones.

/// Smallest normal f16, 2^-14, as f32 bits.
const F16_MIN_NORMAL: u32 = 0x3880_0000;
/// 65520 as f32 bits: the midpoint between f16's largest finite value (65504) and
/// 2^16. It and everything above round to infinity (ties go to the even side, 2^16).
const F16_OVERFLOW: u32 = 0x477F_F000;
/// f32 exponent bias minus f16 exponent bias, in the f32 exponent field.
const REBIAS: u32 = (127 - 15) << 23;
const F32_INFINITY: u32 = 0x7F80_0000;

/// f16 bits to f32, exactly.
#[inline(always)]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    let magnitude = h & 0x7FFF;
    let shifted = magnitude << 13;
    let exponent = magnitude & 0x7C00;
    let mantissa = magnitude & 0x03FF;
    // Normal: move the exponent from bias 15 to bias 127.
    let normal = shifted + REBIAS;
    // Infinity and NaN: exponent all ones; NaNs come out quiet.
    let quiet = if mantissa != 0 { 0x0040_0000 } else { 0 };
    let special = (shifted + 2 * REBIAS) | quiet;
    // Zero and subnormal: m * 2^-24, computed exactly as (1 + m/1024) * 2^-14 - 2^-14.
    let subnormal = (f32::from_bits(shifted + REBIAS + (1 << 23))
        - f32::from_bits(REBIAS + (1 << 23)))
    .to_bits();
    let magnitude = if exponent == 0x7C00 {
        special
    } else if exponent == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(magnitude | sign)
}

/// f32 to f16 bits, rounding to nearest, ties to even.
#[inline(always)]
pub(super) fn f32_to_f16(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = (bits >> 16) & 0x8000;
    let abs = bits & 0x7FFF_FFFF;
    // Normal: rebias, then drop 13 mantissa bits rounding to nearest even (a carry
    // out of the mantissa correctly bumps the exponent). Computed for every input and
    // used only for normal ones, hence the wrapping arithmetic.
    let normal = abs
        .wrapping_sub(REBIAS)
        .wrapping_add(0x0FFF + ((abs >> 13) & 1))
        >> 13;
    // Subnormal: adding 0.5, whose ulp is 2^-24, makes the FPU round |x| to a
    // multiple of 2^-24 (ties to even); the low bits are then the f16 mantissa. A
    // value that rounds up to 2^-14 yields 0x400, the smallest normal: still right.
    let subnormal = (f32::from_bits(abs) + 0.5)
        .to_bits()
        .wrapping_sub(0.5f32.to_bits());
    // Overflow rounds to infinity; NaN stays NaN, quiet, with its top mantissa bits.
    let special = if abs > F32_INFINITY {
        0x7E00 | ((abs >> 13) & 0x03FF)
    } else {
        0x7C00
    };
    let magnitude = if abs >= F16_OVERFLOW {
        special
    } else if abs < F16_MIN_NORMAL {
        subnormal
    } else {
        normal
    };
    #[expect(
        clippy::cast_possible_truncation,
        reason = "every case is below 0x10000"
    )]
    let h = (magnitude | sign) as u16;
    h
}

/// bf16 bits to f32, exactly (bf16 is the top half of an f32).
#[inline(always)]
pub(super) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 to bf16 bits, rounding to nearest, ties to even.
#[inline(always)]
pub(super) fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    // NaN: keep the sign and top mantissa bits, set the quiet bit (rounding could
    // otherwise carry a NaN into infinity).
    let nan = (bits >> 16) | 0x0040;
    let out = if bits & 0x7FFF_FFFF > F32_INFINITY {
        nan
    } else {
        rounded
    };
    #[expect(
        clippy::cast_possible_truncation,
        reason = "both cases are below 0x10000"
    )]
    let b = out as u16;
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    fn same_f32(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits()
            || (a.is_nan() && b.is_nan() && a.is_sign_negative() == b.is_sign_negative())
    }

    #[test]
    fn every_f16_widens_like_half() {
        for h in 0..=u16::MAX {
            let want = f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            assert!(
                same_f32(got, want),
                "f16 {h:#06x}: {got:e} ({:#010x}), half says {want:e}",
                got.to_bits()
            );
        }
    }

    #[test]
    fn every_bf16_widens_like_half() {
        for b in 0..=u16::MAX {
            assert!(
                same_f32(bf16_to_f32(b), bf16::from_bits(b).to_f32()),
                "bf16 {b:#06x}"
            );
        }
    }

    /// A stride through all 2^32 f32 bit patterns (about a million values).
    fn stride() -> impl Iterator<Item = f32> {
        (0..=u32::MAX).step_by(4099).map(f32::from_bits)
    }

    fn same_half(got: u16, want: u16, nan: impl Fn(u16) -> bool) -> bool {
        got == want || (nan(got) && nan(want) && (got & 0x8000) == (want & 0x8000))
    }

    /// Every f16 value's neighbourhood: the value, the next one up, the exact
    /// midpoint between them (where ties go to even), and one f32 ulp either side.
    /// Then a stride through every f32.
    #[test]
    fn f32_narrows_to_f16_like_half() {
        let mut checked = 0u64;
        for h in 0..0x7C00u16 {
            let lo = f16::from_bits(h).to_f32();
            // Above the largest finite f16 the next step is 2^16, which is infinity.
            let hi = if h == 0x7BFF {
                65536.0
            } else {
                f16::from_bits(h + 1).to_f32()
            };
            // Both neighbours and their midpoint are exact in f32 (12 significant bits).
            #[expect(
                clippy::cast_possible_truncation,
                reason = "the midpoint is exact in f32"
            )]
            let mid = ((f64::from(lo) + f64::from(hi)) / 2.0) as f32;
            let (lo, hi, mid) = (lo.to_bits(), hi.to_bits(), mid.to_bits());
            for x in [lo, lo + 1, mid - 1, mid, mid + 1, hi - 1, hi] {
                for sign in [0, 0x8000_0000] {
                    let v = f32::from_bits(x | sign);
                    let (got, want) = (f32_to_f16(v), f16::from_f32(v).to_bits());
                    assert_eq!(
                        got,
                        want,
                        "{v:e} ({:#010x}): {got:#06x}, half says {want:#06x}",
                        v.to_bits()
                    );
                    checked += 1;
                }
            }
        }
        for v in stride() {
            let (got, want) = (f32_to_f16(v), f16::from_f32(v).to_bits());
            assert!(
                same_half(got, want, |h| f16::from_bits(h).is_nan()),
                "{v:e} ({:#010x}): {got:#06x}, half says {want:#06x}",
                v.to_bits()
            );
            checked += 1;
        }
        assert!(checked > 1_000_000);
    }

    /// bf16 values are the top 16 bits of f32: around every one of them, and a stride.
    #[test]
    fn f32_narrows_to_bf16_like_half() {
        let boundaries = (0..=u16::MAX).flat_map(|b| {
            let lo = u32::from(b) << 16;
            let mid = lo | 0x8000;
            [lo, lo.wrapping_sub(1), mid - 1, mid, mid + 1]
        });
        for v in boundaries.map(f32::from_bits).chain(stride()) {
            let (got, want) = (f32_to_bf16(v), bf16::from_f32(v).to_bits());
            assert!(
                same_half(got, want, |b| bf16::from_bits(b).is_nan()),
                "{v:e} ({:#010x}): {got:#06x}, half says {want:#06x}",
                v.to_bits()
            );
        }
    }
}
