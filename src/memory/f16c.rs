//! The compressed wire's `f16` conversions through the CPU's F16C instructions,
//! eight values per instruction, where the CPU has them.
//!
//! fairring-core converts portably (it has no `unsafe` code and cannot ask the
//! CPU what it supports); [`wire_codec`] hands it these instead when the CPU
//! has F16C and AVX. They give the same bits: F16C narrows with round to
//! nearest, ties to even (the rounding is given in the instruction, not taken
//! from MXCSR), and widens exactly. The tests below compare both on every `f16`
//! value and at every rounding boundary.

use fairring_core::reduce::{HalfBlocks, WireCodec};

/// The codec host memory converts with: F16C where the CPU has it.
pub(crate) fn wire_codec() -> WireCodec {
    if has_f16c() {
        WireCodec::with_half(HalfBlocks {
            narrow: x86::narrow,
            widen: x86::widen,
        })
    } else {
        WireCodec::PORTABLE
    }
}

/// Whether this CPU has F16C and AVX.
fn has_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{
        __m128i, _MM_FROUND_TO_NEAREST_INT, _mm_loadu_si128, _mm_storeu_si128, _mm256_cvtph_ps,
        _mm256_cvtps_ph, _mm256_loadu_ps, _mm256_storeu_ps,
    };

    use fairring_core::reduce::HalfBlocks;
    use half::f16;

    /// `narrow[i] = wide[i]`, rounded to nearest even (portably on a CPU
    /// without F16C: the check is a cached load).
    pub(super) fn narrow(wide: &[f32], narrow: &mut [f16]) {
        if super::has_f16c() {
            // SAFETY: the CPU has F16C and AVX (checked just above).
            unsafe { narrow_f16c(wide, narrow) }
        } else {
            (HalfBlocks::PORTABLE.narrow)(wide, narrow);
        }
    }

    /// `wide[i] = narrow[i]` (portably on a CPU without F16C).
    pub(super) fn widen(narrow: &[f16], wide: &mut [f32]) {
        if super::has_f16c() {
            // SAFETY: as in `narrow`.
            unsafe { widen_f16c(narrow, wide) }
        } else {
            (HalfBlocks::PORTABLE.widen)(narrow, wide);
        }
    }

    /// # Safety
    ///
    /// The CPU has F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    unsafe fn narrow_f16c(wide: &[f32], narrow: &mut [f16]) {
        let n = wide.len().min(narrow.len());
        let mut i = 0;
        while i + 8 <= n {
            let src = &wide[i..i + 8];
            // SAFETY: `src` holds eight `f32` (32 bytes); the load is unaligned.
            let w = unsafe { _mm256_loadu_ps(src.as_ptr()) };
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(w);
            let dst = &mut narrow[i..i + 8];
            // SAFETY: `dst` holds eight `f16` (16 plain bytes); the store is
            // unaligned.
            unsafe { _mm_storeu_si128(dst.as_mut_ptr().cast::<__m128i>(), h) };
            i += 8;
        }
        (HalfBlocks::PORTABLE.narrow)(&wide[i..n], &mut narrow[i..n]);
    }

    /// # Safety
    ///
    /// The CPU has F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    unsafe fn widen_f16c(narrow: &[f16], wide: &mut [f32]) {
        let n = wide.len().min(narrow.len());
        let mut i = 0;
        while i + 8 <= n {
            let src = &narrow[i..i + 8];
            // SAFETY: `src` holds eight `f16` (16 bytes); the load is unaligned.
            let h = unsafe { _mm_loadu_si128(src.as_ptr().cast::<__m128i>()) };
            let w = _mm256_cvtph_ps(h);
            let dst = &mut wide[i..i + 8];
            // SAFETY: `dst` holds eight `f32` (32 bytes); the store is unaligned.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), w) };
            i += 8;
        }
        (HalfBlocks::PORTABLE.widen)(&narrow[i..n], &mut wide[i..n]);
    }
}

/// Elsewhere no CPU has F16C: the portable conversions (never chosen).
#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use fairring_core::reduce::HalfBlocks;
    use half::f16;

    pub(super) fn narrow(wide: &[f32], narrow: &mut [f16]) {
        (HalfBlocks::PORTABLE.narrow)(wide, narrow);
    }

    pub(super) fn widen(narrow: &[f16], wide: &mut [f32]) {
        (HalfBlocks::PORTABLE.widen)(narrow, wide);
    }
}

#[cfg(test)]
mod tests {
    use fairring_core::reduce::HalfBlocks;
    use half::f16;

    use super::*;

    /// The codec in use on this machine, and the F16C conversions if it has them.
    fn f16c() -> HalfBlocks {
        assert!(
            has_f16c(),
            "these tests need a CPU with F16C and AVX (every x86-64 CPU since 2013)"
        );
        HalfBlocks {
            narrow: x86::narrow,
            widen: x86::widen,
        }
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits()
            || (a.is_nan() && b.is_nan() && a.is_sign_negative() == b.is_sign_negative())
    }

    #[test]
    #[cfg_attr(not(target_arch = "x86_64"), ignore = "F16C is an x86-64 extension")]
    fn every_f16_widens_to_the_portable_bits() {
        let f16c = f16c();
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let (mut fast, mut portable) = (vec![0f32; all.len()], vec![0f32; all.len()]);
        (f16c.widen)(&all, &mut fast);
        (HalfBlocks::PORTABLE.widen)(&all, &mut portable);
        let differ = fast
            .iter()
            .zip(&portable)
            .filter(|(a, b)| !same(**a, **b))
            .count();
        assert_eq!(differ, 0);
    }

    #[test]
    #[cfg_attr(not(target_arch = "x86_64"), ignore = "F16C is an x86-64 extension")]
    fn f32_narrows_to_the_portable_bits_at_every_boundary() {
        let f16c = f16c();
        // Every f16 value, the midpoints between neighbours (ties) and one f32
        // ulp either side of them, both signs, the overflow edge, infinities,
        // NaNs, f32 subnormals, and a lengthy odd tail the vector loop leaves.
        let mut wide = Vec::new();
        for h in 0..0x7C00u16 {
            let lo = f16::from_bits(h).to_f32();
            let hi = f16::from_bits(h + 1).to_f32();
            let mid = f32::midpoint(lo, hi);
            for v in [
                lo,
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                wide.push(v);
                wide.push(-v);
            }
        }
        wide.extend([
            65504.0,
            65519.99,
            65520.0,
            1e10,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ]);
        wide.extend([
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001),
            1e-45,
            1e-40,
            0.0,
            -0.0,
        ]);
        wide.extend((0..13).map(|i| 0.1 * i as f32));
        let (mut fast, mut portable) = (vec![f16::ZERO; wide.len()], vec![f16::ZERO; wide.len()]);
        (f16c.narrow)(&wide, &mut fast);
        (HalfBlocks::PORTABLE.narrow)(&wide, &mut portable);
        let differ = fast
            .iter()
            .zip(&portable)
            .filter(|(a, b)| !same(a.to_f32(), b.to_f32()))
            .count();
        assert_eq!(differ, 0, "of {} values", wide.len());
    }

    #[test]
    fn the_codec_uses_f16c_where_the_cpu_has_it() {
        assert_eq!(wire_codec().is_portable(), !has_f16c());
    }
}
