//! AVX2 (+FMA, F16C) tile kernels for the 32-element formats in fast mode:
//! Q4_0, Q5_0, Q8_0 × Q8_0 and Q4_1, Q5_1 × Q8_1.
//!
//! One step handles one block (32 weights) per row against the natural
//! activation layout ([`LegacyLayout`] with `interleaved = false`):
//! `vpmaddubsw` + `vpmaddwd` give 8 lanes of 4-element sums; Q4_0/Q5_0
//! apply their `- 8`/`- 16` offsets exactly through the activations'
//! `corr` lanes; Q8_0 uses the sign trick (`|w|` · `sign(x, w)`), like
//! llama.cpp. Scales of 8 blocks are loaded and converted at once.

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;

use super::fmt;
use crate::quantize::LegacyLayout;

/// Loads block `p` as 32 bytes in natural element order: unsigned quants
/// for Q4/Q5, signed for Q8_0.
///
/// # Safety
/// `p` must point at one readable block of `F`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn unpack_block<const F: u8>(p: *const u8) -> __m256i {
    if F == fmt::Q8_0 {
        // SAFETY: 32 quants after the 2-byte scale.
        return unsafe { _mm256_loadu_si256(p.add(2).cast()) };
    }
    let (qo, ho) = match F {
        fmt::Q4_0 => (2, 0),
        fmt::Q4_1 => (4, 0),
        fmt::Q5_0 => (6, 2),
        _ => (8, 4),
    };
    // SAFETY: 16 quant bytes at `qo` inside the block.
    let q = unsafe { _mm_loadu_si128(p.add(qo).cast()) };
    let v = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    let v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
    if ho == 0 {
        return v;
    }
    // SAFETY: 4 bytes of `qh` at `ho` inside the block.
    let qh = unsafe { p.add(ho).cast::<u32>().read_unaligned() };
    // Spread bit j of qh to byte j (llama.cpp's bytes_from_bits_32).
    let bits = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303),
    );
    let bits = _mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfeu64 as i64));
    let set = _mm256_cmpeq_epi8(bits, _mm256_set1_epi64x(-1));
    _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)))
}

/// Bytes ahead of the weights in use that each row of a tile prefetches
/// (here per group of 8 blocks; per super-block in `avx2_k`): the
/// hardware prefetcher alone left decode waiting on memory on an AVX2 AMD
/// Zen 3 (docs/benchmarks.md, "Design measurements cited by the code").
pub(super) const PF_AHEAD: usize = 1024;

/// Packs the low 16 bits (`HI == false`) or high 16 bits of 8 u32 lanes
/// into 8 f16 and converts them to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn halves_to_f32<const HI: bool>(raw: __m256i) -> __m256 {
    let shuf = if HI {
        _mm256_setr_epi8(
            2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1, 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1,
            -1, -1, -1,
        )
    } else {
        _mm256_setr_epi8(
            0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1,
            -1, -1,
        )
    };
    let packed = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(raw, shuf));
    _mm256_cvtph_ps(_mm256_castsi256_si128(packed))
}

/// The weight half of a group's start: for the row at `w` and its group
/// of `gn <= 8` blocks from block `b0`, prefetches [`PF_AHEAD`] bytes
/// ahead and returns the blocks' `d` and `m` (zero for formats without a
/// min) as 8 f32 lanes.
///
/// # Safety
/// AVX2, FMA and F16C must be available; blocks `b0..b0 + gn` of the row
/// must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_head<const F: u8>(w: *const u8, b0: usize, gn: usize) -> (__m256, __m256) {
    let bs = fmt::block_bytes(F);
    // The first 4 bytes of each block hold `d` (and `m`); plain loads
    // (gathers are slow on AMD cores).
    let rp = w.wrapping_add(b0 * bs);
    for line in 0..(8 * bs).div_ceil(64) {
        // A hint only: it never faults, even past the matrix.
        _mm_prefetch::<_MM_HINT_T0>(rp.wrapping_add(PF_AHEAD + 64 * line).cast());
    }
    let head = |k: usize| -> i32 {
        if k < gn {
            // SAFETY: block `b0 + k` of the row is readable (the caller).
            unsafe { rp.add(k * bs).cast::<i32>().read_unaligned() }
        } else {
            0
        }
    };
    let raw = _mm256_setr_epi32(head(0), head(1), head(2), head(3), head(4), head(5), head(6), head(7));
    let mw = if fmt::has_min(F) { halves_to_f32::<true>(raw) } else { _mm256_setzero_ps() };
    (halves_to_f32::<false>(raw), mw)
}

/// The token half of a group's start for one row: for each of the `T`
/// tokens (`stride` bytes apart, their block scales at `off_d`, their
/// scaled sums at `off_s`) and the row's `(dw, mw)` from [`row_head`],
/// stores `sc[t] = dw * d` and adds `mw * s` to `acc[t]`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; 8 f32 from block `b0` of both
/// sections of each token must be readable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn token_scales<const F: u8, const T: usize>(
    (dw, mw): (__m256, __m256),
    b0: usize,
    act: *const u8,
    (stride, off_d, off_s): (usize, usize, usize),
    sc: &mut [[f32; 8]; T],
    acc: &mut [__m256; T],
) {
    for t in 0..T {
        // SAFETY: 8 f32 of each section of token `t` (the caller).
        let (xd, xs) = unsafe {
            let xa = act.add(t * stride);
            (_mm256_loadu_ps(xa.add(off_d + b0 * 4).cast()), _mm256_loadu_ps(xa.add(off_s + b0 * 4).cast()))
        };
        // SAFETY: `sc[t]` is an [f32; 8].
        unsafe { _mm256_storeu_ps(sc[t].as_mut_ptr(), _mm256_mul_ps(dw, xd)) };
        if fmt::has_min(F) {
            acc[t] = _mm256_fmadd_ps(mw, xs, acc[t]);
        }
    }
}

/// The start of a group of `gn <= 8` blocks from block `b0` in the tiles
/// of the 32-element formats: [`row_head`] and [`token_scales`] for each
/// of the `R` rows (`row_bytes` apart) of a tile of `T` tokens.
///
/// # Safety
/// As [`row_head`] for each row and [`token_scales`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, reason = "the tile's pointers and its accumulators")]
pub(super) unsafe fn group_scales<const F: u8, const R: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    b0: usize,
    gn: usize,
    act: *const u8,
    layout: (usize, usize, usize),
    sc: &mut [[[f32; 8]; T]; R],
    acc: &mut [[__m256; T]; R],
) {
    for r in 0..R {
        // SAFETY: forwarded from the caller.
        unsafe {
            let head = row_head::<F>(w.wrapping_add(r * row_bytes), b0, gn);
            token_scales::<F, T>(head, b0, act, layout, &mut sc[r], &mut acc[r]);
        }
    }
}

/// Dots `R` weight rows with `T` packed activation rows (see
/// [`super::avx512::legacy_tile`] for the argument conventions; here the
/// layout is natural and Q8_0 has no `corr`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `R` rows of
/// `l.blocks` blocks of `F`; `act` must hold `T` tokens packed with layout
/// `l`; `out` must be valid for the `R * T` writes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn legacy_tile<const F: u8, const R: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    l: &LegacyLayout,
    act: *const u8,
    out: *mut f32,
    out_stride: usize,
) {
    let bs = fmt::block_bytes(F);
    let nb = l.blocks;
    let use_corr = F != fmt::Q8_0 && fmt::offset(F) != 0;
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut sc = [[[0.0f32; 8]; T]; R];
    let mut wv = [_mm256_setzero_si256(); R];
    let mut b0 = 0;
    while b0 < nb {
        let gn = (nb - b0).min(8);
        // SAFETY: as this function's contract; `d`/`s` have
        // `groups * 16 >= b0 + 8` f32 per token.
        unsafe {
            group_scales::<F, R, T>(w, row_bytes, b0, gn, act, (l.stride, l.off_d, l.off_s), &mut sc, &mut acc);
        }
        for k in 0..gn {
            let b = b0 + k;
            for r in 0..R {
                // SAFETY: block `b < nb` of row `r`.
                wv[r] = unsafe { unpack_block::<F>(w.add(r * row_bytes + b * bs)) };
            }
            for t in 0..T {
                // SAFETY: token `t` has `blocks * 32` quant bytes and (with
                // corr) `blocks * 8` i32 lane corrections.
                let (xv, init) = unsafe {
                    let xa = act.add(t * l.stride);
                    let xv = _mm256_load_si256(xa.add(b * 32).cast());
                    let init = if use_corr {
                        _mm256_load_si256(xa.add(l.off_corr + b * 32).cast())
                    } else {
                        _mm256_setzero_si256()
                    };
                    (xv, init)
                };
                for r in 0..R {
                    let p16 = if F == fmt::Q8_0 {
                        _mm256_maddubs_epi16(_mm256_sign_epi8(wv[r], wv[r]), _mm256_sign_epi8(xv, wv[r]))
                    } else {
                        _mm256_maddubs_epi16(wv[r], xv)
                    };
                    let d = _mm256_add_epi32(_mm256_madd_epi16(p16, ones), init);
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
