//! AVX-512 VNNI tile kernel for Q8_0 weights × Q8_0 activations (fast
//! mode), one block per 256-bit `vpdpbusd`.
//!
//! On Zen 4, 512-bit operations run as two 256-bit halves, so the cost is
//! the number of operations and shuffles rather than the vector width: one
//! block per step in natural element order needs no cross-lane permutes
//! (the activations use [`LegacyLayout`] with `interleaved = false`), which
//! beats the pair-interleaved 512-bit kernel for Q8_0 (whose blocks need a
//! 128-bit lane shuffle), while the nibble formats, which need an unpack
//! anyway, are faster in pairs ([`super::avx512`]). The
//! block scales of 16 blocks are extracted at once with `vpermt2w`
//! ([`super::avx512::load_heads`]), multiplied by the activation scales and
//! kept on the stack, from where each block's FMA broadcasts its scale.
//! Weights are made unsigned (`w + 128`) and the offset is applied exactly
//! through the activations' `corr` lanes.

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;

use super::avx512::load_heads;
use super::fmt;
use crate::quantize::LegacyLayout;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Scales([f32; 16]);

/// Q8_0 block `p` as 32 unsigned bytes (`w + 128`).
///
/// # Safety
/// `p` must point at one readable Q8_0 block.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_block(p: *const u8) -> __m256i {
    // SAFETY: 32 quants after the 2-byte scale.
    let v = unsafe { _mm256_loadu_si256(p.add(2).cast()) };
    _mm256_xor_si256(v, _mm256_set1_epi8(-128))
}

/// Dots `R` Q8_0 weight rows with `T` packed activation rows (natural
/// layout); conventions as [`super::avx512::legacy_tile`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, F16C and FMA; `w` must hold
/// `R` rows of `l.blocks` Q8_0 blocks; `act` must hold `T` tokens packed
/// with layout `l` (natural, `offset == 128`); `out` must be valid for the
/// `R * T` writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q8_0_tile<const R: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    l: &LegacyLayout,
    act: *const u8,
    out: *mut f32,
    out_stride: usize,
) {
    const F: u8 = fmt::Q8_0;
    let bs = fmt::block_bytes(F);
    let nb = l.blocks;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut sc = [[Scales([0.0; 16]); T]; R];
    let mut wv = [_mm256_setzero_si256(); R];

    macro_rules! group {
        ($g:expr, $gn:expr) => {{
            let g: usize = $g;
            let gn: usize = $gn;
            let b0 = g * 16;
            for r in 0..R {
                // SAFETY: blocks `b0..b0 + gn` of row `r` are readable.
                let heads = unsafe { load_heads::<F>(w.add(r * row_bytes + b0 * bs), gn) };
                let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(heads));
                for t in 0..T {
                    let xa = act.wrapping_add(t * l.stride);
                    // SAFETY: `d` has `groups * 16` f32 per token, 64-byte
                    // aligned; `sc[r][t]` is a 64-byte aligned [f32; 16].
                    unsafe {
                        let xd = _mm512_load_ps(xa.add(l.off_d + b0 * 4).cast());
                        _mm512_store_ps(sc[r][t].0.as_mut_ptr(), _mm512_mul_ps(dw, xd));
                    }
                }
            }
            for k in 0..gn {
                let b = b0 + k;
                for r in 0..R {
                    // SAFETY: block `b < nb` of row `r`.
                    wv[r] = unsafe { unpack_block(w.add(r * row_bytes + b * bs)) };
                }
                for t in 0..T {
                    // SAFETY: token `t` has `pairs * 64 >= (b + 1) * 32`
                    // quant bytes and as many i32 corrections (aligned).
                    let (xv, init) = unsafe {
                        let xa = act.add(t * l.stride);
                        let xv = _mm256_load_si256(xa.add(b * 32).cast());
                        let init = _mm256_load_si256(xa.add(l.off_corr + b * 32).cast());
                        (xv, init)
                    };
                    for r in 0..R {
                        let d = _mm256_dpbusd_epi32(init, wv[r], xv);
                        let s = _mm256_set1_ps(sc[r][t].0[k]);
                        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[r][t]);
                    }
                }
            }
        }};
    }

    let full_groups = nb / 16;
    for g in 0..full_groups {
        group!(g, 16);
    }
    if !nb.is_multiple_of(16) {
        group!(full_groups, nb % 16);
    }
    // SAFETY: the caller guarantees `out` covers the tile.
    unsafe { super::store_tile(&acc, out, out_stride) };
}
