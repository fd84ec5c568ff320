//! Packing for the f32 GEMM on AVX2, any weight type: eight rows at a
//! time are converted into a row-major staging tile (AVX2 for the
//! 32-element formats, a copy for F32, [`crate::dequant::dequantize_row`]
//! for the others), which is then transposed 8 × 8 in registers into the
//! k-major panels.
//!
//! The values are exactly those of [`crate::dequant`] (same operations in
//! the same order: `q · d + m`, `(q − offset) · d`), so the GEMM over them
//! differs from the precise dot-product kernels only by the order of the
//! f32 additions.

use std::arch::x86_64::*;

use super::KC;
use crate::GgmlType;
use crate::dot::{avx2, fmt};

/// Rows dequantised and transposed together.
const ROWS: usize = 8;

/// The 32-element format of `ty`, if it is one.
fn legacy(ty: GgmlType) -> Option<u8> {
    Some(match ty {
        GgmlType::Q4_0 => fmt::Q4_0,
        GgmlType::Q4_1 => fmt::Q4_1,
        GgmlType::Q5_0 => fmt::Q5_0,
        GgmlType::Q5_1 => fmt::Q5_1,
        GgmlType::Q8_0 => fmt::Q8_0,
        _ => return None,
    })
}

/// Whether [`pack`] serves quantised `ty`: the block formats whose blocks
/// divide [`KC`] (so that every K block is whole blocks). It also serves
/// F32, F16 and BF16.
pub(super) fn serves_quantised(ty: GgmlType) -> bool {
    let bs = ty.block_size();
    bs > 1 && KC.is_multiple_of(bs) && ty != GgmlType::Q8_1
}

/// Byte offset of column `c` in a row of `ty` (any type; for a block
/// format, `c` is a multiple of the block size).
pub(super) fn col_offset(ty: GgmlType, c: usize) -> usize {
    c / ty.block_size() * ty.type_size()
}

/// Dequantises 32 weights of block `p` of format `F` into `dst`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `p` must point at one readable
/// block of `F`; `dst` must hold 32 floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block32<const F: u8>(p: *const u8, dst: *mut f32) {
    // SAFETY: the block is readable (caller); `d` (and `m`) are its first
    // two (four) bytes.
    let (q, d, m) = unsafe {
        let q = avx2::unpack_block::<F>(p);
        let d = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(p.cast::<u16>().read_unaligned())));
        let m = if fmt::has_min(F) {
            _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(p.add(2).cast::<u16>().read_unaligned())))
        } else {
            _mm_setzero_ps()
        };
        (q, d, m)
    };
    let (d, m) = (_mm256_broadcastss_ps(d), _mm256_broadcastss_ps(m));
    let off = _mm256_set1_epi32(if F == fmt::Q8_0 { 0 } else { fmt::offset(F) });
    let halves = [_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q)];
    for (h, half) in halves.into_iter().enumerate() {
        for e in 0..2 {
            let bytes = if e == 0 { half } else { _mm_unpackhi_epi64(half, half) };
            let qi = if F == fmt::Q8_0 { _mm256_cvtepi8_epi32(bytes) } else { _mm256_cvtepu8_epi32(bytes) };
            let v = if fmt::has_min(F) {
                _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(qi), d), m)
            } else {
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(qi, off)), d)
            };
            // SAFETY: `dst` holds 32 floats; this is 8 of them.
            unsafe { _mm256_storeu_ps(dst.add(16 * h + 8 * e), v) };
        }
    }
}

/// Dequantises columns `pc..pc + kc` of the row at `row` into `dst`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `pc` and `kc` must be multiples
/// of `ty`'s block size and the columns inside the row; `dst` must hold
/// `kc` floats.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row(ty: GgmlType, row: *const u8, pc: usize, kc: usize, dst: &mut [f32]) {
    let (bs, bb) = (ty.block_size(), ty.type_size());
    // SAFETY: the row holds the blocks of columns `pc..pc + kc` (caller).
    let src = unsafe { row.add(col_offset(ty, pc)) };
    let mut each = |f: unsafe fn(*const u8, *mut f32)| {
        for b in 0..kc / bs {
            // SAFETY: block `b` is inside the row; 32 floats at `32 b` are
            // inside `dst`.
            unsafe { f(src.add(b * bb), dst.as_mut_ptr().add(b * bs)) };
        }
    };
    match legacy(ty) {
        Some(fmt::Q4_0) => each(block32::<{ fmt::Q4_0 }>),
        Some(fmt::Q4_1) => each(block32::<{ fmt::Q4_1 }>),
        Some(fmt::Q5_0) => each(block32::<{ fmt::Q5_0 }>),
        Some(fmt::Q5_1) => each(block32::<{ fmt::Q5_1 }>),
        Some(_) => each(block32::<{ fmt::Q8_0 }>),
        None => {
            // SAFETY: `kc / bs` whole blocks from `src` (caller).
            let bytes = unsafe { std::slice::from_raw_parts(src, kc / bs * bb) };
            crate::dequant::dequantize_row(ty, bytes, &mut dst[..kc])
                .expect("whole blocks of a supported type (checked by the caller)");
        }
    }
}

/// Transposes the 8 × 8 matrix held in `r` (row `i` in `r[i]`).
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 { _mm256_unpacklo_ps(a, b) } else { _mm256_unpackhi_ps(a, b) }
    });
    // s[4h + j]: from t[4h..4h + 4], columns j (of each 128-bit lane).
    let s: [__m256; 8] = std::array::from_fn(|i| {
        let (h, j) = (i / 4, i % 4);
        let (a, b) = (t[4 * h + j / 2], t[4 * h + 2 + j / 2]);
        if j % 2 == 0 { _mm256_shuffle_ps::<0x44>(a, b) } else { _mm256_shuffle_ps::<0xEE>(a, b) }
    });
    std::array::from_fn(|i| {
        if i < 4 {
            _mm256_permute2f128_ps::<0x20>(s[i], s[4 + i])
        } else {
            _mm256_permute2f128_ps::<0x31>(s[i - 4], s[i])
        }
    })
}

/// Packs rows `0..mr` (relative to `w`), columns `pc..pc + kc` of a matrix
/// of `ty` blocks into panels of `nr` rows, as the f32 packers do: panel
/// `p`, column `k`, row `j` at `dst[p * kc * nr + k * nr + j]`; rows past
/// `mr` in the last panel are zero.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `ty` F32, F16, BF16 or
/// [`serves_quantised`]; `nr` a multiple of 8; `pc` and `kc` multiples
/// of the block size, `kc <= KC`, the rows and columns inside the matrix
/// (`rb` bytes per row); `dst` must hold `ceil(mr / nr) * kc * nr` floats.
#[allow(clippy::too_many_arguments, reason = "the block's coordinates")]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pack(
    ty: GgmlType,
    w: *const u8,
    rb: usize,
    mr: usize,
    pc: usize,
    kc: usize,
    nr: usize,
    dst: *mut f32,
) {
    debug_assert!(nr.is_multiple_of(ROWS) && kc <= KC);
    let mut stage = [[0.0f32; KC]; ROWS];
    let mut r0 = 0;
    while r0 < mr.div_ceil(nr) * nr {
        let valid = mr.saturating_sub(r0).min(ROWS);
        for (i, s) in stage.iter_mut().enumerate() {
            if i < valid {
                // SAFETY: row `r0 + i < mr` is inside the matrix (caller).
                unsafe { row(ty, w.add((r0 + i) * rb), pc, kc, s) };
            } else {
                s[..kc].fill(0.0);
            }
        }
        let (p, g) = (r0 / nr, r0 % nr);
        let k8 = kc / ROWS * ROWS;
        for k in (0..k8).step_by(ROWS) {
            // SAFETY: `k + 8 <= kc <= KC` floats of each staging row.
            let cols = transpose8(std::array::from_fn(|i| unsafe { _mm256_loadu_ps(stage[i].as_ptr().add(k)) }));
            for (j, c) in cols.into_iter().enumerate() {
                // SAFETY: panel `p`, column `k + j < kc`, rows `g..g + 8` of
                // the panel (`g + 8 <= nr`): inside `dst`.
                unsafe { _mm256_storeu_ps(dst.add(p * kc * nr + (k + j) * nr + g), c) };
            }
        }
        for k in k8..kc {
            for (i, s) in stage.iter().enumerate() {
                // SAFETY: as above, one float.
                unsafe { *dst.add(p * kc * nr + k * nr + g + i) = s[k] };
            }
        }
        r0 += ROWS;
    }
}
