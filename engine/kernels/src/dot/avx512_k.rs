//! AVX-512 (F/BW/VL/VNNI) tile kernels for K-quant weights × Q8_K
//! activations in fast mode: Q4_K, Q5_K and Q6_K.
//!
//! Each 64-element chunk of a super-block is unpacked to unsigned bytes in
//! natural order, multiplied with the activations by `vpmaddubsw` (pairs of
//! products fit i16: at most 2·63·127) and scaled by the sub-block scales
//! with `vpdpwssd`, so a whole super-block is one exact i32 sum per lane.
//! Q4_K/Q5_K minimums and the Q6_K `- 32` offset use the activations'
//! `bsums`. Activations come in the [`KLayout`] packing.

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;

use super::f16_at;
use crate::quantize::KLayout;

/// Q4_K/Q5_K super-block size in bytes.
const Q4K_BYTES: usize = 144;
const Q5K_BYTES: usize = 176;
const Q6K_BYTES: usize = 210;

/// Tags for the K-quant tile kernel.
pub(crate) const KQ4: u8 = 0;
pub(crate) const KQ5: u8 = 1;
pub(crate) const KQ6: u8 = 2;

#[repr(C, align(64))]
struct Idx16([[i16; 32]; 4]);

/// `vpermw` indices: chunk `j` of Q4_K/Q5_K takes scale `2j` for its first
/// 32 elements (16 i16 lanes) and `2j + 1` for the rest.
static IDX_K4: Idx16 = {
    let mut t = [[0i16; 32]; 4];
    let mut j = 0;
    while j < 4 {
        let mut l = 0;
        while l < 32 {
            t[j][l] = (2 * j + l / 16) as i16;
            l += 1;
        }
        j += 1;
    }
    Idx16(t)
};

/// `vpermw` indices: chunk `c` of Q6_K takes scales `4c..4c + 4`, one per
/// 16 elements (8 i16 lanes).
static IDX_K6: Idx16 = {
    let mut t = [[0i16; 32]; 4];
    let mut c = 0;
    while c < 4 {
        let mut l = 0;
        while l < 32 {
            t[c][l] = (4 * c + l / 8) as i16;
            l += 1;
        }
        c += 1;
    }
    Idx16(t)
};

const fn sb_bytes(k: u8) -> usize {
    match k {
        KQ4 => Q4K_BYTES,
        KQ5 => Q5K_BYTES,
        _ => Q6K_BYTES,
    }
}

/// Per-row, per-super-block constants.
#[derive(Clone, Copy)]
struct SbRow {
    /// Weight scale (`d`, f32).
    d: f32,
    /// `dmin` for Q4_K/Q5_K.
    dmin: f32,
    /// i16 scales in the low 128 (Q4/Q5: 8 lanes) or low 256 bits (Q6: 16).
    sc: __m512i,
    /// Q4/Q5: mins duplicated per 16-element half (16 i16 lanes);
    /// Q6: scales times -32 (16 i16 lanes).
    aux: __m256i,
}

/// # Safety
/// `p` must point at a readable super-block of kind `K`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn sb_row<const K: u8>(p: *const u8) -> SbRow {
    if K == KQ6 {
        // SAFETY: Q6_K: ql 128, qh 64, scales 16 (i8) at 192, d at 208.
        let s8 = unsafe { _mm_loadu_si128(p.add(192).cast()) };
        let s16 = _mm256_cvtepi8_epi16(s8);
        let aux = _mm256_mullo_epi16(s16, _mm256_set1_epi16(-32));
        // SAFETY: d at offset 208 of the super-block.
        let d = unsafe { f16_at(p.add(208)) };
        return SbRow { d, dmin: 0.0, sc: _mm512_castsi256_si512(s16), aux };
    }
    // Q4_K/Q5_K: d, dmin, scales[12], ...
    // SAFETY: 12 scale bytes at offset 4.
    let v = unsafe { q4k_scales_mins(p.add(4)) };
    let s16 = _mm256_cvtepu8_epi16(v);
    let dup = _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    let aux = _mm256_permutexvar_epi16(dup, s16);
    // SAFETY: d and dmin are the first 4 bytes of the super-block.
    let (d, dmin) = unsafe { (f16_at(p), f16_at(p.add(2))) };
    SbRow { d, dmin, sc: _mm512_castsi256_si512(s16), aux }
}

/// The eight 6-bit scales (bytes 0..8) and mins (bytes 8..16) of a
/// Q4_K/Q5_K super-block, unpacked branch-free from the 12 packed bytes at
/// `p` (the `utmp` shuffle of ggml's SIMD kernels; equal to
/// [`crate::dequant::get_scale_min_k4`] for every `j`).
///
/// # Safety
/// `p..p + 12` must be readable.
#[inline]
pub(crate) unsafe fn q4k_scales_mins(p: *const u8) -> __m128i {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    // SAFETY: the caller guarantees 12 readable bytes.
    let (u0, u1, u2) = unsafe {
        (
            p.cast::<u32>().read_unaligned(),
            p.add(4).cast::<u32>().read_unaligned(),
            p.add(8).cast::<u32>().read_unaligned(),
        )
    };
    let u3 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let mins_lo = u1 & KMASK1;
    let sc_hi = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let sc_lo = u0 & KMASK1;
    // SAFETY: SSE2 is part of the x86-64 baseline.
    unsafe { _mm_setr_epi32(sc_lo as i32, sc_hi as i32, mins_lo as i32, u3 as i32) }
}

/// Unsigned weight bytes of chunk `c` (elements `64c..64c + 64`).
///
/// # Safety
/// `p` must point at a readable super-block of kind `K`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_chunk<const K: u8>(p: *const u8, c: usize) -> __m512i {
    let lo_nib = _mm512_set1_epi8(0x0F);
    match K {
        KQ4 | KQ5 => {
            let qs_off = if K == KQ4 { 16 } else { 48 };
            // SAFETY: 32 bytes of qs for chunk `c` (qs is 128 bytes).
            let q = unsafe { _mm256_loadu_si256(p.add(qs_off + 32 * c).cast()) };
            let v = _mm512_broadcast_i64x4(q);
            let cnt = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
            let w = _mm512_and_si512(_mm512_srlv_epi16(v, cnt), lo_nib);
            if K == KQ4 {
                return w;
            }
            // SAFETY: qh is 32 bytes at offset 16.
            let h = _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(p.add(16).cast()) });
            let bit = _mm512_inserti64x4::<1>(_mm512_set1_epi8(1 << (2 * c)), _mm256_set1_epi8(2 << (2 * c)));
            let k = _mm512_test_epi8_mask(h, bit);
            _mm512_mask_add_epi8(w, k, w, _mm512_set1_epi8(16))
        }
        _ => {
            let n = c / 2;
            // SAFETY: ql is 128 bytes at 0, qh 64 bytes at 128.
            let (l, h) = unsafe {
                (
                    _mm512_loadu_si512(p.add(64 * n).cast()),
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(128 + 32 * n).cast())),
                )
            };
            let (lo, hb) = if c.is_multiple_of(2) {
                let cnt = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
                (l, _mm512_sllv_epi16(h, cnt))
            } else {
                let cnt = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
                (_mm512_srli_epi16::<4>(l), _mm512_srlv_epi16(h, cnt))
            };
            // (lo & 0x0F) | (hb & 0x30)
            let hb = _mm512_and_si512(hb, _mm512_set1_epi8(0x30));
            _mm512_ternarylogic_epi32::<0xF8>(hb, lo, lo_nib)
        }
    }
}

/// Dots `R` K-quant weight rows (kind `K`) with `T` packed Q8_K activation
/// rows; conventions as [`super::avx512::legacy_tile`].
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, F16C and FMA; `w` must hold
/// `R` rows of `l.blocks` super-blocks of kind `K`; `act` must hold `T`
/// tokens packed with `l`; `out` must be valid for the `R * T` writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn k_tile<const K: u8, const R: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    l: &KLayout,
    act: *const u8,
    out: *mut f32,
    out_stride: usize,
) {
    let bsz = sb_bytes(K);
    let mut facc = [[_mm512_setzero_ps(); T]; R];
    for sb in 0..l.blocks {
        let mut rows = [SbRow { d: 0.0, dmin: 0.0, sc: _mm512_setzero_si512(), aux: _mm256_setzero_si256() }; R];
        for (r, row) in rows.iter_mut().enumerate() {
            // SAFETY: super-block `sb` of row `r` is inside the caller's rows.
            *row = unsafe { sb_row::<K>(w.add(r * row_bytes + sb * bsz)) };
        }
        let mut iacc = [[_mm512_setzero_si512(); T]; R];
        let mut dx = [0.0f32; T];
        for t in 0..T {
            let xa = act.wrapping_add(t * l.stride);
            // SAFETY: `d` holds `blocks` f32 and `bsums` 16 i16 per
            // super-block for token `t`.
            let bs = unsafe {
                dx[t] = xa.add(l.off_d + 4 * sb).cast::<f32>().read();
                _mm256_load_si256(xa.add(l.off_bsums + 32 * sb).cast())
            };
            for r in 0..R {
                if K == KQ6 {
                    // -32 * sum(sc * bsums), exact in i32.
                    iacc[r][t] = _mm512_zextsi256_si512(_mm256_madd_epi16(rows[r].aux, bs));
                } else {
                    let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(rows[r].aux, bs));
                    let f = _mm256_set1_ps(-rows[r].dmin * dx[t]);
                    facc[r][t] = _mm512_fmadd_ps(_mm512_zextps256_ps512(m), _mm512_zextps256_ps512(f), facc[r][t]);
                }
            }
        }
        for c in 0..4 {
            let idx = if K == KQ6 { &IDX_K6.0[c] } else { &IDX_K4.0[c] };
            // SAFETY: 64-byte aligned [i16; 32].
            let idx = unsafe { _mm512_load_si512(idx.as_ptr().cast()) };
            let mut wv = [_mm512_setzero_si512(); R];
            let mut sv = [_mm512_setzero_si512(); R];
            for r in 0..R {
                // SAFETY: super-block `sb` of row `r`.
                wv[r] = unsafe { unpack_chunk::<K>(w.add(r * row_bytes + sb * bsz), c) };
                sv[r] = _mm512_permutexvar_epi16(idx, rows[r].sc);
            }
            for t in 0..T {
                // SAFETY: token `t` has 256 quants per super-block, aligned.
                let xv = unsafe { _mm512_load_si512(act.add(t * l.stride + sb * 256 + 64 * c).cast()) };
                for r in 0..R {
                    let p16 = _mm512_maddubs_epi16(wv[r], xv);
                    iacc[r][t] = _mm512_dpwssd_epi32(iacc[r][t], p16, sv[r]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                let s = _mm512_set1_ps(rows[r].d * dx[t]);
                facc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r][t]), s, facc[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            // SAFETY: the caller guarantees `out` covers these positions.
            unsafe { *out.add(t * out_stride + r) = _mm512_reduce_add_ps(facc[r][t]) };
        }
    }
}
