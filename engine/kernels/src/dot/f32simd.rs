//! Precise-mode tile kernels (f32 activations), AVX-512 and AVX2.
//!
//! Weights are dequantised on the fly, 256 columns at a time, into an
//! aligned stack buffer (F32/F16/BF16 are read directly), then multiplied
//! into per-lane f32 accumulators with FMA: every (row, token) pair keeps a
//! SIMD-width set of partial sums, reduced once at the end. Q4_0, Q4_1 and
//! Q8_0 are dequantised with SIMD (same operations as the scalar reference:
//! a multiply, then an add for Q4_1, so the values are bit-identical); the
//! other formats go through [`crate::dequant::dequantize_row`].

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;

use half::f16;

use crate::GgmlType;

/// Weight tags for the precise kernels.
pub(crate) mod wt {
    pub const F32: u8 = 0;
    pub const F16: u8 = 1;
    pub const BF16: u8 = 2;
    pub const Q4_0: u8 = 3;
    pub const Q4_1: u8 = 4;
    pub const Q8_0: u8 = 5;
    /// Any other type, dequantised by `crate::dequant`.
    pub const OTHER: u8 = 6;
}

/// Columns dequantised per step.
const CHUNK: usize = 256;

#[repr(C, align(64))]
struct Buf([f32; CHUNK]);

/// Scalar weight value `i` of a row of a directly-read type.
#[inline]
fn direct_at<const W: u8>(row: *const u8, i: usize) -> f32 {
    // SAFETY: callers only ask for columns inside the row.
    unsafe {
        match W {
            wt::F32 => row.add(4 * i).cast::<f32>().read_unaligned(),
            wt::F16 => f16::from_bits(row.add(2 * i).cast::<u16>().read_unaligned()).to_f32(),
            // A plain shift, as `crate::dequant` (keeps NaN payloads).
            _ => f32::from_bits(u32::from(row.add(2 * i).cast::<u16>().read_unaligned()) << 16),
        }
    }
}

const fn direct(w: u8) -> bool {
    matches!(w, wt::F32 | wt::F16 | wt::BF16)
}

/// Dequantises `n` columns (a multiple of the block size) of a quantised
/// row starting at byte `src` into `dst`.
///
/// # Safety
/// AVX-512 F/BW/VL must be available; `src` must hold the blocks.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dequant_avx512<const W: u8>(ty: GgmlType, src: *const u8, n: usize, dst: &mut Buf) {
    let bs = ty.type_size();
    match W {
        wt::Q4_0 | wt::Q4_1 | wt::Q8_0 => {
            for b in 0..n / 32 {
                // SAFETY: block `b` of the chunk is readable; `dst` has
                // room for 32 values at `32 * b` (n <= CHUNK).
                unsafe {
                    let p = src.add(b * bs);
                    let d = _mm512_set1_ps(super::f16_at(p));
                    let (v0, v1) = if W == wt::Q8_0 {
                        let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(2).cast()));
                        let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(18).cast()));
                        (_mm512_mul_ps(_mm512_cvtepi32_ps(q0), d), _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d))
                    } else {
                        let qo = if W == wt::Q4_0 { 2 } else { 4 };
                        let q = _mm_loadu_si128(p.add(qo).cast());
                        let nib = _mm_set1_epi8(0x0F);
                        let lo = _mm512_cvtepu8_epi32(_mm_and_si128(q, nib));
                        let hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16::<4>(q), nib));
                        if W == wt::Q4_0 {
                            let eight = _mm512_set1_epi32(8);
                            (
                                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)), d),
                                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)), d),
                            )
                        } else {
                            let m = _mm512_set1_ps(super::f16_at(p.add(2)));
                            (
                                _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), d), m),
                                _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), d), m),
                            )
                        }
                    };
                    _mm512_store_ps(dst.0.as_mut_ptr().add(32 * b), v0);
                    _mm512_store_ps(dst.0.as_mut_ptr().add(32 * b + 16), v1);
                }
            }
        }
        _ => dequant_other(ty, src, n, dst),
    }
}

/// Fallback dequantisation through `crate::dequant`.
#[inline]
fn dequant_other(ty: GgmlType, src: *const u8, n: usize, dst: &mut Buf) {
    let bytes = n / ty.block_size() * ty.type_size();
    // SAFETY: the caller guarantees `src` holds the `n` columns' blocks.
    let src = unsafe { std::slice::from_raw_parts(src, bytes) };
    let res = crate::dequant::dequantize_row(ty, src, &mut dst.0[..n]);
    debug_assert!(res.is_ok(), "dequantize_row failed on a validated shape");
}

/// Precise tile: `out[t * out_stride + r] = sum_c W[r, c] * x[t, c]` for
/// `R` rows and `T` tokens, AVX-512.
///
/// # Safety
/// AVX-512 F/BW/VL, FMA and F16C must be available; `w` must hold `R` rows
/// of `cols` elements of `ty` (`row_bytes` apart, `cols` a multiple of the
/// block size); `x` must hold `T` rows of `cols` f32 (`x_stride` apart);
/// `out` must be valid for the `R * T` writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, reason = "a raw-pointer kernel entry point")]
pub(crate) unsafe fn tile_avx512<const W: u8, const R: usize, const T: usize>(
    ty: GgmlType,
    w: *const u8,
    row_bytes: usize,
    cols: usize,
    x: *const f32,
    x_stride: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut tail = [[0.0f32; T]; R];
    let mut bufs: [Buf; R] = std::array::from_fn(|_| Buf([0.0; CHUNK]));
    let chunk_bytes = if direct(W) { 0 } else { CHUNK / ty.block_size() * ty.type_size() };
    let mut c0 = 0;
    while c0 < cols {
        let n = (cols - c0).min(CHUNK);
        if !direct(W) {
            for (r, buf) in bufs.iter_mut().enumerate() {
                // SAFETY: chunk `c0 / CHUNK` of row `r` is inside the row.
                unsafe { dequant_avx512::<W>(ty, w.add(r * row_bytes + c0 / CHUNK * chunk_bytes), n, buf) };
            }
        }
        let nv = n / 16 * 16;
        let mut k = 0;
        while k < nv {
            let mut wv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let row = w.wrapping_add(r * row_bytes);
                let col = c0 + k;
                // SAFETY: columns `col..col + 16` are inside row `r`; the
                // buffer holds `n >= k + 16` values.
                wv[r] = unsafe {
                    match W {
                        wt::F32 => _mm512_loadu_ps(row.add(4 * col).cast()),
                        wt::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * col).cast())),
                        wt::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                            _mm256_loadu_si256(row.add(2 * col).cast()),
                        ))),
                        _ => _mm512_load_ps(bufs[r].0.as_ptr().add(k)),
                    }
                };
            }
            for t in 0..T {
                // SAFETY: token `t`'s columns `c0 + k .. + 16` are in `x`.
                let xv = unsafe { _mm512_loadu_ps(x.add(t * x_stride + c0 + k)) };
                for r in 0..R {
                    acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
                }
            }
            k += 16;
        }
        for kk in nv..n {
            for r in 0..R {
                let wvs =
                    if direct(W) { direct_at::<W>(w.wrapping_add(r * row_bytes), c0 + kk) } else { bufs[r].0[kk] };
                for t in 0..T {
                    // SAFETY: column `c0 + kk` of token `t` is in `x`.
                    tail[r][t] += wvs * unsafe { *x.add(t * x_stride + c0 + kk) };
                }
            }
        }
        c0 += n;
    }
    for r in 0..R {
        for t in 0..T {
            // SAFETY: the caller guarantees `out` covers these positions.
            unsafe { *out.add(t * out_stride + r) = _mm512_reduce_add_ps(acc[r][t]) + tail[r][t] };
        }
    }
}

/// Dequantises `n` columns with AVX2 (see [`dequant_avx512`]).
///
/// # Safety
/// AVX2 must be available; `src` must hold the blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_avx2<const W: u8>(ty: GgmlType, src: *const u8, n: usize, dst: &mut Buf) {
    let bs = ty.type_size();
    match W {
        wt::Q4_0 | wt::Q4_1 | wt::Q8_0 => {
            for b in 0..n / 32 {
                // SAFETY: block `b` is readable; `dst` has room at `32 * b`.
                unsafe {
                    let p = src.add(b * bs);
                    let d = _mm256_set1_ps(super::f16_at(p));
                    let mut q = [_mm256_setzero_si256(); 4];
                    if W == wt::Q8_0 {
                        for (i, qi) in q.iter_mut().enumerate() {
                            *qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(2 + 8 * i).cast()));
                        }
                    } else {
                        let qo = if W == wt::Q4_0 { 2 } else { 4 };
                        let raw = _mm_loadu_si128(p.add(qo).cast());
                        let nib = _mm_set1_epi8(0x0F);
                        let lo = _mm_and_si128(raw, nib);
                        let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), nib);
                        q[0] = _mm256_cvtepu8_epi32(lo);
                        q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(lo));
                        q[2] = _mm256_cvtepu8_epi32(hi);
                        q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(hi));
                    }
                    let m = if W == wt::Q4_1 { _mm256_set1_ps(super::f16_at(p.add(2))) } else { _mm256_setzero_ps() };
                    for (i, qi) in q.iter().enumerate() {
                        let qi = if W == wt::Q4_0 { _mm256_sub_epi32(*qi, _mm256_set1_epi32(8)) } else { *qi };
                        let mut v = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d);
                        if W == wt::Q4_1 {
                            v = _mm256_add_ps(v, m);
                        }
                        _mm256_store_ps(dst.0.as_mut_ptr().add(32 * b + 8 * i), v);
                    }
                }
            }
        }
        _ => dequant_other(ty, src, n, dst),
    }
}

/// Precise tile, AVX2 (see [`tile_avx512`]).
///
/// # Safety
/// AVX2, FMA and F16C must be available; otherwise as [`tile_avx512`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, reason = "a raw-pointer kernel entry point")]
pub(crate) unsafe fn tile_avx2<const W: u8, const R: usize, const T: usize>(
    ty: GgmlType,
    w: *const u8,
    row_bytes: usize,
    cols: usize,
    x: *const f32,
    x_stride: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut tail = [[0.0f32; T]; R];
    let mut bufs: [Buf; R] = std::array::from_fn(|_| Buf([0.0; CHUNK]));
    let chunk_bytes = if direct(W) { 0 } else { CHUNK / ty.block_size() * ty.type_size() };
    let mut c0 = 0;
    while c0 < cols {
        let n = (cols - c0).min(CHUNK);
        if !direct(W) {
            for (r, buf) in bufs.iter_mut().enumerate() {
                // SAFETY: chunk `c0 / CHUNK` of row `r` is inside the row.
                unsafe { dequant_avx2::<W>(ty, w.add(r * row_bytes + c0 / CHUNK * chunk_bytes), n, buf) };
            }
        }
        let nv = n / 8 * 8;
        let mut k = 0;
        while k < nv {
            let mut wv = [_mm256_setzero_ps(); R];
            for r in 0..R {
                let row = w.wrapping_add(r * row_bytes);
                let col = c0 + k;
                // SAFETY: columns `col..col + 8` are inside row `r`; the
                // buffer holds `n >= k + 8` values.
                wv[r] = unsafe {
                    match W {
                        wt::F32 => _mm256_loadu_ps(row.add(4 * col).cast()),
                        wt::F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * col).cast())),
                        wt::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                            _mm_loadu_si128(row.add(2 * col).cast()),
                        ))),
                        _ => _mm256_load_ps(bufs[r].0.as_ptr().add(k)),
                    }
                };
            }
            for t in 0..T {
                // SAFETY: token `t`'s columns `c0 + k .. + 8` are in `x`.
                let xv = unsafe { _mm256_loadu_ps(x.add(t * x_stride + c0 + k)) };
                for r in 0..R {
                    acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
                }
            }
            k += 8;
        }
        for kk in nv..n {
            for r in 0..R {
                let wvs =
                    if direct(W) { direct_at::<W>(w.wrapping_add(r * row_bytes), c0 + kk) } else { bufs[r].0[kk] };
                for t in 0..T {
                    // SAFETY: column `c0 + kk` of token `t` is in `x`.
                    tail[r][t] += wvs * unsafe { *x.add(t * x_stride + c0 + kk) };
                }
            }
        }
        c0 += n;
    }
    for r in 0..R {
        for t in 0..T {
            // SAFETY: the caller guarantees `out` covers these positions.
            unsafe { *out.add(t * out_stride + r) = super::hsum8(acc[r][t]) + tail[r][t] };
        }
    }
}
