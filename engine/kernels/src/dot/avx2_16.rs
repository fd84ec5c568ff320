//! AVX2 tile kernels for fast mode's one 16-bit activation plane
//! ([`crate::q16`]): Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights widened to
//! int16 and multiplied with `vpmaddwd`, the instruction the 8-bit kernels
//! ([`super::avx2`]) finish with, so one 16-bit plane takes one 8-bit
//! plane's integer instructions on CPUs without VNNI.
//!
//! Per block and (row, token): two `vpmaddwd` give 8 lanes of exact
//! 4-element sums, then one multiply-add by `dw * d`; the mins of Q4_1 and
//! Q5_1 add `mw * s` once per 8 blocks. A row's value is the same whatever
//! the tile shape (rows, tokens) it is computed in.

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;

use super::avx2::{group_scales, unpack_block};
use super::fmt;
use crate::q16::Q16Layout;

/// Block `p` of `F` as two vectors of 16 int16 weight values (elements
/// 0..16 and 16..32, the format's offset subtracted).
///
/// # Safety
/// `p` must point at one readable block of `F`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_block<const F: u8>(p: *const u8) -> [__m256i; 2] {
    // SAFETY: forwarded from the caller.
    let v = unsafe { unpack_block::<F>(p) };
    let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    if F == fmt::Q8_0 {
        return [_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)];
    }
    let off = _mm256_set1_epi16(fmt::offset(F) as i16);
    let w = [_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)];
    if fmt::offset(F) == 0 { w } else { w.map(|w| _mm256_sub_epi16(w, off)) }
}

/// Dots `R` weight rows with `T` tokens of packed Q16 activations (`act`,
/// `l.stride` bytes per token), writing `out[t * out_stride + r]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `R` rows of
/// `l.blocks` blocks of `F`, `row_bytes` apart; `act` must hold `T` tokens
/// packed with layout `l`; `out` must be valid for the `R * T` writes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q16_tile<const F: u8, const R: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    l: &Q16Layout,
    act: *const u8,
    out: *mut f32,
    out_stride: usize,
) {
    let bs = fmt::block_bytes(F);
    let nb = l.blocks;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut sc = [[[0.0f32; 8]; T]; R];
    let mut b0 = 0;
    while b0 < nb {
        let gn = (nb - b0).min(8);
        // SAFETY: as this function's contract; `d`/`s` hold
        // `ceil(blocks / 16) * 16 >= b0 + 8` f32 per token.
        unsafe {
            group_scales::<F, R, T>(w, row_bytes, b0, gn, act, (l.stride, l.off_d, l.off_s), &mut sc, &mut acc);
        }
        for k in 0..gn {
            let b = b0 + k;
            let mut wv = [[_mm256_setzero_si256(); 2]; R];
            for r in 0..R {
                // SAFETY: block `b < nb` of row `r`.
                wv[r] = unsafe { widen_block::<F>(w.add(r * row_bytes + b * bs)) };
            }
            for t in 0..T {
                // SAFETY: token `t` holds `blocks * 32` int16 values.
                let (a0, a1) = unsafe {
                    let xa = act.add(t * l.stride + b * 64);
                    (_mm256_loadu_si256(xa.cast()), _mm256_loadu_si256(xa.add(32).cast()))
                };
                for r in 0..R {
                    let d = _mm256_add_epi32(_mm256_madd_epi16(wv[r][0], a0), _mm256_madd_epi16(wv[r][1], a1));
                    let s = _mm256_broadcast_ss(&sc[r][t][k]);
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[r][t]);
                }
            }
        }
        b0 += 8;
    }
    // SAFETY: the caller guarantees `out` covers the tile.
    unsafe { super::store_tile(&acc, out, out_stride) };
}
