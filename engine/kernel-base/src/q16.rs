//! Fast mode's one 16-bit activation plane ([`crate::kernel::ActType::Q16`]):
//! each block of 32 values quantised to int16 with an f32 scale.
//!
//! For a block `x` with largest magnitude `amax`: `d = amax / 32767`,
//! `v[j] = round_half_away(x[j] / d)` (the reciprocal multiplied, as the
//! 8-bit quantisers do), `s = d * Σ v`. A weight block with integer values
//! `w[j]` (the quants minus the format's offset), scale `dw` and min `mw`
//! (Q4_1, Q5_1) contributes `(dw * d) * Σ w[j] v[j] + mw * s`.
//!
//! This is as fine a grid as fast mode's two 8-bit planes (their second
//! plane quantises the first one's rounding error, a step of about
//! `amax / 32258`), in one plane: on CPUs without VNNI, `vpmaddwd` takes
//! int16 pairs at the rate `vpmaddubsw` + `vpmaddwd` take int8 quads, so
//! one 16-bit plane takes one 8-bit plane's integer instructions, half the
//! two planes' (measured: 1.4–1.7x the two planes' rate from 4 tokens;
//! docs/benchmarks.md, "One 16-bit activation plane").
//!
//! One token packs into a [`Q16Layout`]: the int16 values (64 bytes a
//! block), then the `d` and the `s` of every block as f32, each section
//! padded to a multiple of 16 values and 64-byte aligned.

use crate::quantize::round_half_away;

/// Values per block.
pub const QK16: usize = 32;

/// Byte layout of one token's packed Q16 activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Q16Layout {
    /// Blocks of 32 per row.
    pub blocks: usize,
    /// Byte offset of the `d` section (after the values, which start at 0).
    pub off_d: usize,
    /// Byte offset of the `s` section.
    pub off_s: usize,
    /// Bytes per token (a multiple of 64).
    pub stride: usize,
}

impl Q16Layout {
    /// Layout for rows of `cols` values (`cols % 32 == 0`).
    pub fn new(cols: usize) -> Self {
        let blocks = cols / QK16;
        let off_d = blocks * QK16 * 2;
        let off_s = off_d + blocks.div_ceil(16) * 64;
        let stride = off_s + blocks.div_ceil(16) * 64;
        Self { blocks, off_d, off_s, stride }
    }

    /// The sections of a packed token: values, `d`, `s`.
    pub fn sections<'a>(&self, t: &'a [u8]) -> (&'a [i16], &'a [f32], &'a [f32]) {
        let (v, rest) = t[..self.stride].split_at(self.off_d);
        let (d, s) = rest.split_at(self.off_s - self.off_d);
        (bytemuck::cast_slice(v), bytemuck::cast_slice(d), bytemuck::cast_slice(s))
    }

    fn sections_mut<'a>(&self, t: &'a mut [u8]) -> (&'a mut [i16], &'a mut [f32], &'a mut [f32]) {
        let (v, rest) = t[..self.stride].split_at_mut(self.off_d);
        let (d, s) = rest.split_at_mut(self.off_s - self.off_d);
        (bytemuck::cast_slice_mut(v), bytemuck::cast_slice_mut(d), bytemuck::cast_slice_mut(s))
    }
}

/// The scale of a block whose largest magnitude is `amax`, and the
/// multiplier that quantises it.
#[inline]
fn scale(amax: f32) -> (f32, f32) {
    let d = amax / 32767.0;
    (d, if d != 0.0 { 1.0 / d } else { 0.0 })
}

/// Packs one token (`x.len() == 32 * l.blocks`) into `dst` (`l.stride`
/// bytes, 64-byte aligned). Padding is zeroed.
pub fn pack_q16(l: &Q16Layout, x: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::CpuFeatures::detect().has_avx2_fma() {
        // SAFETY: `has_avx2_fma` implies AVX2, FMA and F16C.
        unsafe { avx2::pack_q16(l, x, dst) };
        return;
    }
    pack_q16_scalar(l, x, dst);
}

/// Portable version of [`pack_q16`], the reference.
pub fn pack_q16_scalar(l: &Q16Layout, x: &[f32], dst: &mut [u8]) {
    assert_eq!(x.len(), l.blocks * QK16, "pack_q16: length mismatch");
    let (v, d, s) = l.sections_mut(dst);
    d.fill(0.0);
    s.fill(0.0);
    for (b, xb) in x.as_chunks::<QK16>().0.iter().enumerate() {
        let (db, id) = scale(xb.iter().fold(0.0f32, |m, v| m.max(v.abs())));
        let mut sum = 0i32;
        for (q, &xv) in v[b * QK16..(b + 1) * QK16].iter_mut().zip(xb) {
            // Saturates as `vpackssdw` does (only NaN or infinite inputs
            // reach the bounds).
            *q = round_half_away(xv * id).clamp(i32::from(i16::MIN), i32::from(i16::MAX)) as i16;
            sum += i32::from(*q);
        }
        d[b] = db;
        s[b] = db * sum as f32;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Q16Layout, QK16, scale};
    use crate::quantize::avx2::{block_amax, round_away, sum_epi32};
    use std::arch::x86_64::*;

    /// AVX2 version of [`super::pack_q16_scalar`], bit-identical to it for
    /// finite inputs (a NaN quantises to 0 there and to -32768 here; the
    /// 8-bit packers behave alike).
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn pack_q16(l: &Q16Layout, x: &[f32], dst: &mut [u8]) {
        assert_eq!(x.len(), l.blocks * QK16, "pack_q16: length mismatch");
        let (v, d, s) = l.sections_mut(dst);
        d.fill(0.0);
        s.fill(0.0);
        for (b, xb) in x.as_chunks::<QK16>().0.iter().enumerate() {
            // SAFETY: `xb` holds 32 f32, read as four unaligned 8-lane loads.
            let xv = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xb.as_ptr().add(o))) };
            let (db, id) = scale(block_amax(&xv));
            let idv = _mm256_set1_ps(id);
            let q = xv.map(|x| round_away(_mm256_mul_ps(x, idv)));
            // `packs_epi32` interleaves its operands by 128-bit lane; the
            // permute puts the 64-bit groups back in element order.
            let lo = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(q[0], q[1]));
            let hi = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(q[2], q[3]));
            let out = &mut v[b * QK16..(b + 1) * QK16];
            // SAFETY: `out` holds 32 i16: two 32-byte stores.
            unsafe {
                _mm256_storeu_si256(out.as_mut_ptr().cast(), lo);
                _mm256_storeu_si256(out.as_mut_ptr().add(16).cast(), hi);
            }
            // The sum of the saturated values, as the scalar packer's.
            let ones = _mm256_set1_epi16(1);
            let sum = sum_epi32(_mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)));
            d[b] = db;
            s[b] = db * sum as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let v = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                // Blocks of very different magnitudes, an all-zero block.
                if (i / 32) % 5 == 4 { 0.0 } else { v * 10f32.powi((i / 32 % 7) as i32 - 3) }
            })
            .collect()
    }

    #[test]
    fn values_reconstruct_the_input_to_a_16_bit_step() {
        let x = random(32 * 9, 7);
        let l = Q16Layout::new(x.len());
        let mut buf = vec![0u8; l.stride];
        pack_q16_scalar(&l, &x, &mut buf);
        let (v, d, s) = l.sections(&buf);
        for (b, xb) in x.chunks_exact(32).enumerate() {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let sum: i32 = v[b * 32..(b + 1) * 32].iter().map(|&q| i32::from(q)).sum();
            assert_eq!(s[b], d[b] * sum as f32);
            for (j, &xv) in xb.iter().enumerate() {
                let back = f32::from(v[b * 32 + j]) * d[b];
                assert!((back - xv).abs() <= amax / 32767.0 * 0.5001, "block {b} value {j}: {xv} -> {back}");
            }
        }
        // Padding of the scale sections is zero.
        assert!(d[9..].iter().chain(&s[9..]).all(|&v| v == 0.0));
    }

    #[test]
    fn simd_pack_matches_scalar() {
        for (cols, seed) in [(32, 1), (576, 2), (1536, 3), (32 * 17, 4)] {
            let mut x = random(cols, seed);
            // Exact halves, which round away from zero.
            x[3] = 0.5 * x[0].abs() / 32767.0;
            let l = Q16Layout::new(cols);
            let (mut a, mut b) = (vec![0xAAu8; l.stride], vec![0x55u8; l.stride]);
            pack_q16_scalar(&l, &x, &mut a);
            pack_q16(&l, &x, &mut b);
            assert_eq!(a, b, "{cols} columns");
        }
    }
}
