//! AVX2 (+FMA, F16C) tile kernels for K-quant weights × Q8_K activations in
//! fast mode: Q4_K, Q5_K and Q6_K.
//!
//! Each 32-element quarter is unpacked to unsigned bytes in natural order;
//! `vpmaddubsw` multiplies it with the activations and `vpmaddwd` applies
//! the sub-block scales, accumulating an exact i32 sum per super-block.
//! Minimums (Q4_K/Q5_K) and the Q6_K `- 32` offset use the activations'
//! `bsums`. Activations come in the [`KLayout`] packing.

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;

use super::avx512_k::{KQ4, KQ5, KQ6, q4k_scales_mins};
use super::f16_at;
use crate::quantize::KLayout;

const fn sb_bytes(k: u8) -> usize {
    match k {
        KQ4 => 144,
        KQ5 => 176,
        _ => 210,
    }
}

/// Per-row, per-super-block constants.
#[derive(Clone, Copy)]
struct SbRow {
    d: f32,
    dmin: f32,
    /// Scales: Q4/Q5 8 used, Q6 16.
    sc: [i16; 16],
    /// Q4/Q5: mins duplicated per half (16 i16); Q6: scales times -32.
    aux: __m256i,
}

/// # Safety
/// `p` must point at a readable super-block of kind `K`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sb_row<const K: u8>(p: *const u8) -> SbRow {
    let mut sc = [0i16; 16];
    if K == KQ6 {
        // SAFETY: Q6_K scales are 16 i8 at offset 192, d at 208.
        let s16 = _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(p.add(192).cast()) });
        // SAFETY: `sc` is [i16; 16].
        unsafe { _mm256_storeu_si256(sc.as_mut_ptr().cast(), s16) };
        let aux = _mm256_mullo_epi16(s16, _mm256_set1_epi16(-32));
        // SAFETY: d at offset 208 of the super-block.
        let d = unsafe { f16_at(p.add(208)) };
        return SbRow { d, dmin: 0.0, sc, aux };
    }
    // SAFETY: 12 scale bytes at offset 4.
    let v = unsafe { q4k_scales_mins(p.add(4)) };
    let s16 = _mm256_cvtepu8_epi16(v);
    // SAFETY: `sc` is [i16; 16] (scales in 0..8, mins in 8..16).
    unsafe { _mm256_storeu_si256(sc.as_mut_ptr().cast(), s16) };
    let m = _mm256_extracti128_si256::<1>(s16);
    let aux = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
    // SAFETY: d and dmin are the first 4 bytes of the super-block.
    let (d, dmin) = unsafe { (f16_at(p), f16_at(p.add(2))) };
    SbRow { d, dmin, sc, aux }
}

/// Unsigned weight bytes of quarter `q` (elements `32q..32q + 32`).
///
/// # Safety
/// `p` must point at a readable super-block of kind `K`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_quarter<const K: u8>(p: *const u8, q: usize) -> __m256i {
    let nib = _mm256_set1_epi8(0x0F);
    if K == KQ6 {
        let (n, k) = (q / 4, q % 4);
        // SAFETY: ql is 128 bytes at 0, qh 64 bytes at 128.
        let (l, h) = unsafe {
            (_mm256_loadu_si256(p.add(64 * n + 32 * (k % 2)).cast()), _mm256_loadu_si256(p.add(128 + 32 * n).cast()))
        };
        let lo = if k < 2 { l } else { _mm256_srli_epi16::<4>(l) };
        let hb = match k {
            0 => _mm256_slli_epi16::<4>(h),
            1 => _mm256_slli_epi16::<2>(h),
            2 => h,
            _ => _mm256_srli_epi16::<2>(h),
        };
        return _mm256_or_si256(_mm256_and_si256(lo, nib), _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
    }
    let (c, half) = (q / 2, q % 2);
    let qs_off = if K == KQ4 { 16 } else { 48 };
    // SAFETY: 32 bytes of qs for chunk `c`.
    let v = unsafe { _mm256_loadu_si256(p.add(qs_off + 32 * c).cast()) };
    let w = if half == 0 { v } else { _mm256_srli_epi16::<4>(v) };
    let w = _mm256_and_si256(w, nib);
    if K == KQ4 {
        return w;
    }
    // SAFETY: qh is 32 bytes at offset 16.
    let h = unsafe { _mm256_loadu_si256(p.add(16).cast()) };
    let bit = _mm256_set1_epi8((1u8 << (2 * c + half)) as i8);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
    _mm256_or_si256(w, _mm256_and_si256(set, _mm256_set1_epi8(16)))
}

/// Dots `R` K-quant weight rows (kind `K`) with `T` packed Q8_K activation
/// rows; conventions as [`super::avx512::legacy_tile`].
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `R` rows of
/// `l.blocks` super-blocks of kind `K`; `act` must hold `T` tokens packed
/// with `l`; `out` must be valid for the `R * T` writes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn k_tile<const K: u8, const R: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    l: &KLayout,
    act: *const u8,
    out: *mut f32,
    out_stride: usize,
) {
    let bsz = sb_bytes(K);
    let mut facc = [[_mm256_setzero_ps(); T]; R];
    for sb in 0..l.blocks {
        let mut rows = [SbRow { d: 0.0, dmin: 0.0, sc: [0; 16], aux: _mm256_setzero_si256() }; R];
        for (r, row) in rows.iter_mut().enumerate() {
            let p = w.wrapping_add(r * row_bytes + sb * bsz);
            for line in 0..bsz.div_ceil(64) {
                // A hint only: it never faults, even past the matrix.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(super::avx2::PF_AHEAD + 64 * line).cast());
            }
            // SAFETY: super-block `sb` of row `r`.
            *row = unsafe { sb_row::<K>(p) };
        }
        let mut iacc = [[_mm256_setzero_si256(); T]; R];
        let mut dx = [0.0f32; T];
        for t in 0..T {
            let xa = act.wrapping_add(t * l.stride);
            // SAFETY: `d` and `bsums` of token `t`, super-block `sb`.
            let bs = unsafe {
                dx[t] = xa.add(l.off_d + 4 * sb).cast::<f32>().read();
                _mm256_load_si256(xa.add(l.off_bsums + 32 * sb).cast())
            };
            for r in 0..R {
                let m = _mm256_madd_epi16(rows[r].aux, bs);
                if K == KQ6 {
                    iacc[r][t] = m;
                } else {
                    let f = _mm256_set1_ps(-rows[r].dmin * dx[t]);
                    facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), f, facc[r][t]);
                }
            }
        }
        for q in 0..8 {
            let mut wv = [_mm256_setzero_si256(); R];
            let mut sv = [_mm256_setzero_si256(); R];
            for r in 0..R {
                // SAFETY: super-block `sb` of row `r`.
                wv[r] = unsafe { unpack_quarter::<K>(w.add(r * row_bytes + sb * bsz), q) };
                sv[r] = if K == KQ6 {
                    _mm256_set_m128i(_mm_set1_epi16(rows[r].sc[2 * q + 1]), _mm_set1_epi16(rows[r].sc[2 * q]))
                } else {
                    _mm256_set1_epi16(rows[r].sc[q])
                };
            }
            for t in 0..T {
                // SAFETY: token `t` has 256 quants per super-block, aligned.
                let xv = unsafe { _mm256_load_si256(act.add(t * l.stride + sb * 256 + 32 * q).cast()) };
                for r in 0..R {
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[r], xv), sv[r]);
                    iacc[r][t] = _mm256_add_epi32(iacc[r][t], p);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                let s = _mm256_set1_ps(rows[r].d * dx[t]);
                facc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[r][t]), s, facc[r][t]);
            }
        }
    }
    // SAFETY: the caller guarantees `out` covers the tile.
    unsafe { super::store_tile(&facc, out, out_stride) };
}
