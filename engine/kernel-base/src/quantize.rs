//! Quantisation of f32 activations to Q8_0 / Q8_1 / Q8_K blocks (fast mode).
//!
//! The `*_ref` functions reproduce ggml's `quantize_row_q8_*_ref` exactly
//! (same operation order, same rounding: `roundf`, i.e. half away from zero,
//! for Q8_0/Q8_1 and ggml's `nearest_int`, half to even, for Q8_K). They
//! write GGML block structs and feed the scalar reference kernels.
//!
//! The SIMD kernels read activations in their own packed layouts
//! ([`LegacyLayout`], [`KLayout`]): the same quantised values, but with the
//! int8 quants, the scales and the per-lane sums in separate, 64-byte aligned
//! arrays so that they can be loaded without shuffles. The packers here
//! produce exactly the values of the reference quantisers (the AVX-512
//! packer is bit-identical to the scalar one, which the tests check).

use half::f16;

use crate::blocks::{BlockQ8_0, BlockQ8_1, BlockQ8K, QK};
use crate::types::QK_K;
use crate::{KernelError, Result};

/// `roundf(v)` (half away from zero) for |v| < 2^31, without a libm call.
/// Outside that range (an infinite scale from a denormal block maximum,
/// garbage weights) it saturates instead of overflowing.
#[inline]
pub fn round_half_away(v: f32) -> i32 {
    let t = v as i32;
    let frac = v - t as f32;
    if frac >= 0.5 {
        t.saturating_add(1)
    } else if frac <= -0.5 {
        t.saturating_sub(1)
    } else {
        t
    }
}

/// ggml's `nearest_int`: round half to even via the 1.5 * 2^23 trick
/// (valid for |v| <= 4194303).
#[inline]
pub fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn check_len(op: &'static str, n: usize, block: usize, blocks: usize) -> Result<()> {
    if !n.is_multiple_of(block) || n / block != blocks {
        return Err(KernelError::Shape { op, detail: format!("{n} values do not fill {blocks} blocks of {block}") });
    }
    Ok(())
}

/// Quantises one 32-value block as ggml's Q8_0/Q8_1 reference: returns the
/// unrounded scale `d = amax / 127` and the quants.
#[inline]
fn quantize_block_32(x: &[f32; QK]) -> (f32, [i8; QK]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_half_away(v * id) as i8;
    }
    (d, q)
}

/// ggml's `quantize_row_q8_0_ref`: `x.len()` must equal `32 * y.len()`.
pub fn quantize_row_q8_0_ref(x: &[f32], y: &mut [BlockQ8_0]) -> Result<()> {
    check_len("quantize_row_q8_0", x.len(), QK, y.len())?;
    for (xb, yb) in x.as_chunks::<QK>().0.iter().zip(y.iter_mut()) {
        let (d, q) = quantize_block_32(xb);
        yb.d = f16::from_f32(d);
        yb.qs = q;
    }
    Ok(())
}

/// ggml's `quantize_row_q8_1_ref` (`s = fp16(d * sum(q))`): `x.len()` must
/// equal `32 * y.len()`.
pub fn quantize_row_q8_1_ref(x: &[f32], y: &mut [BlockQ8_1]) -> Result<()> {
    check_len("quantize_row_q8_1", x.len(), QK, y.len())?;
    for (xb, yb) in x.as_chunks::<QK>().0.iter().zip(y.iter_mut()) {
        let (d, q) = quantize_block_32(xb);
        let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
        yb.d = f16::from_f32(d);
        yb.s = f16::from_f32(sum as f32 * d);
        yb.qs = q;
    }
    Ok(())
}

/// Quantises one super-block as ggml's `quantize_row_q8_K_ref`.
#[inline]
fn quantize_block_q8k(x: &[f32; QK_K], y: &mut BlockQ8K) {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        y.d = 0.0;
        y.qs = [0; QK_K];
        y.bsums = [0; QK_K / 16];
        return;
    }
    let iscale = -127.0 / max;
    for (q, &v) in y.qs.iter_mut().zip(x) {
        *q = nearest_int(iscale * v).min(127) as i8;
    }
    for (s, q) in y.bsums.iter_mut().zip(y.qs.chunks_exact(16)) {
        *s = q.iter().map(|&v| i16::from(v)).sum();
    }
    y.d = 1.0 / iscale;
}

/// ggml's `quantize_row_q8_K_ref` (`iscale = -127 / max` where `max` is the
/// first element of largest magnitude, quants by `nearest_int`, clamped to
/// 127): `x.len()` must equal `256 * y.len()`. An all-zero block gets `d = 0`
/// and zero quants and sums.
pub fn quantize_row_q8_k_ref(x: &[f32], y: &mut [BlockQ8K]) -> Result<()> {
    check_len("quantize_row_q8_K", x.len(), QK_K, y.len())?;
    for (xb, yb) in x.as_chunks::<QK_K>().0.iter().zip(y.iter_mut()) {
        quantize_block_q8k(xb, yb);
    }
    Ok(())
}

/// Alias with ggml's capitalisation.
#[allow(non_snake_case, reason = "ggml spells the type Q8_K")]
pub fn quantize_row_q8_K_ref(x: &[f32], y: &mut [BlockQ8K]) -> Result<()> {
    quantize_row_q8_k_ref(x, y)
}

/// Byte layout of one token's packed 32-block activations (Q8_0/Q8_1
/// values) for the SIMD kernels. All offsets are multiples of 64 bytes.
///
/// * `qs` (`pairs * 64` bytes): the int8 quants. In the natural order block
///   `b` occupies bytes `32b..32b+32`; in the pair-interleaved order (used by
///   the 512-bit kernels) blocks `2p` and `2p + 1` share 64 bytes as
///   `[b0[0..16], b1[0..16], b0[16..32], b1[16..32]]`, which is how two Q4
///   blocks come out of one nibble split.
/// * `d` (`groups * 16` f32): per-block scales, f16-rounded as in the GGML
///   block; zero-padded.
/// * `s` (`groups * 16` f32): per-block `fp16(d * sum(q))` as Q8_1's `s`.
/// * `corr` (`pairs * 16` i32, only if requested): for every 4-byte lane of
///   `qs`, `-offset * (sum of its 4 quants)`; it lets unsigned-weight dot
///   instructions apply a weight offset (`q - 8`, `q - 16`, `w + 128`)
///   exactly in integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LegacyLayout {
    /// Blocks of 32 per row.
    pub blocks: usize,
    /// `ceil(blocks / 2)`.
    pub pairs: usize,
    /// `ceil(blocks / 16)`.
    pub groups: usize,
    /// Byte offset of the `d` section (after `qs`, which starts at 0).
    pub off_d: usize,
    /// Byte offset of the `s` section.
    pub off_s: usize,
    /// Byte offset of the `corr` section.
    pub off_corr: usize,
    /// Bytes per token (a multiple of 64).
    pub stride: usize,
    /// Whether the pair-interleaved order is used.
    pub interleaved: bool,
    /// The weight offset folded into `corr` (0 = no `corr` section).
    pub offset: i32,
}

impl LegacyLayout {
    /// Layout for rows of `cols` values (`cols % 32 == 0`).
    pub fn new(cols: usize, interleaved: bool, offset: i32) -> Self {
        let blocks = cols / QK;
        let pairs = blocks.div_ceil(2);
        let groups = blocks.div_ceil(16);
        let off_d = pairs * 64;
        let off_s = off_d + groups * 64;
        let off_corr = off_s + groups * 64;
        let stride = off_corr + if offset != 0 { pairs * 64 } else { 0 };
        Self { blocks, pairs, groups, off_d, off_s, off_corr, stride, interleaved, offset }
    }

    /// Position in `qs` of element `j` of block `b`.
    #[inline]
    pub fn pos(&self, b: usize, j: usize) -> usize {
        if self.interleaved { (b / 2) * 64 + (j / 16) * 32 + (b % 2) * 16 + j % 16 } else { b * QK + j }
    }
}

/// Splits a 64-byte aligned token buffer into its sections.
fn legacy_sections<'a>(
    l: &LegacyLayout,
    dst: &'a mut [u8],
) -> (&'a mut [i8], &'a mut [f32], &'a mut [f32], &'a mut [i32]) {
    let (qs, rest) = dst[..l.stride].split_at_mut(l.off_d);
    let (d, rest) = rest.split_at_mut(l.off_s - l.off_d);
    let (s, corr) = rest.split_at_mut(l.off_corr - l.off_s);
    (
        bytemuck::cast_slice_mut(qs),
        bytemuck::cast_slice_mut(d),
        bytemuck::cast_slice_mut(s),
        bytemuck::cast_slice_mut(corr),
    )
}

/// [`legacy_sections`] with their padding zeroed (the odd block of the
/// last pair, the scales' tails), for the SIMD packers, which write every
/// block in full.
#[cfg(target_arch = "x86_64")]
fn padded_sections<'a>(
    l: &LegacyLayout,
    dst: &'a mut [u8],
) -> (&'a mut [i8], &'a mut [f32], &'a mut [f32], &'a mut [i32]) {
    let (qs, d, s, corr) = legacy_sections(l, dst);
    if l.blocks % 2 == 1 {
        qs[(l.pairs - 1) * 64..].fill(0);
        if l.offset != 0 {
            corr[(l.pairs - 1) * 16..].fill(0);
        }
    }
    d[l.blocks..].fill(0.0);
    s[l.blocks..].fill(0.0);
    (qs, d, s, corr)
}

/// Packs one token (`x.len() == 32 * l.blocks`) into `dst` (`l.stride`
/// bytes, 64-byte aligned). Padding is zeroed.
pub fn pack_legacy(l: &LegacyLayout, x: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::CpuFeatures::detect().has_avx512() {
        // SAFETY: `has_avx512` implies AVX-512 F/BW/VL/VNNI, AVX2, FMA, F16C.
        unsafe { avx512::pack_legacy(l, x, dst) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::CpuFeatures::detect().has_avx2_fma() {
        // SAFETY: `has_avx2_fma` implies AVX2, FMA and F16C.
        unsafe { avx2::pack_legacy(l, x, dst) };
        return;
    }
    pack_legacy_scalar(l, x, dst);
}

/// Portable version of [`pack_legacy`].
pub fn pack_legacy_scalar(l: &LegacyLayout, x: &[f32], dst: &mut [u8]) {
    assert_eq!(x.len(), l.blocks * QK, "pack_legacy: length mismatch");
    let (qs, d, s, corr) = legacy_sections(l, dst);
    qs.fill(0);
    d.fill(0.0);
    s.fill(0.0);
    corr.fill(0);
    for (b, xb) in x.as_chunks::<QK>().0.iter().enumerate() {
        let (db, q) = quantize_block_32(xb);
        let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
        d[b] = f16::from_f32(db).to_f32();
        s[b] = f16::from_f32(sum as f32 * db).to_f32();
        for (j, &v) in q.iter().enumerate() {
            qs[l.pos(b, j)] = v;
        }
        if l.offset != 0 {
            for j in (0..QK).step_by(4) {
                let lane_sum: i32 = q[j..j + 4].iter().map(|&v| i32::from(v)).sum();
                corr[l.pos(b, j) / 4] = -l.offset * lane_sum;
            }
        }
    }
}

/// Byte layout of one token's packed Q8_K activations: `qs` (`256 * sb`
/// int8), `d` (`sb` f32 padded to 16), `bsums` (`16 * sb` i16). All offsets
/// are multiples of 64 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KLayout {
    /// Super-blocks of 256 per row.
    pub blocks: usize,
    /// Byte offset of the `d` section (after `qs`, which starts at 0).
    pub off_d: usize,
    /// Byte offset of the `bsums` section.
    pub off_bsums: usize,
    /// Bytes per token (a multiple of 64).
    pub stride: usize,
}

impl KLayout {
    /// Layout for rows of `cols` values (`cols % 256 == 0`).
    pub fn new(cols: usize) -> Self {
        let blocks = cols / QK_K;
        let off_d = blocks * QK_K;
        let off_bsums = off_d + blocks.div_ceil(16) * 64;
        let stride = off_bsums + (blocks * 32).div_ceil(64) * 64;
        Self { blocks, off_d, off_bsums, stride }
    }
}

/// Packs one token (`x.len() == 256 * l.blocks`) into `dst` (`l.stride`
/// bytes, 64-byte aligned) with exactly the values of
/// [`quantize_row_q8_k_ref`].
pub fn pack_k(l: &KLayout, x: &[f32], dst: &mut [u8]) {
    assert_eq!(x.len(), l.blocks * QK_K, "pack_k: length mismatch");
    let (qs, rest) = dst[..l.stride].split_at_mut(l.off_d);
    let (d, bsums) = rest.split_at_mut(l.off_bsums - l.off_d);
    let qs: &mut [i8] = bytemuck::cast_slice_mut(qs);
    let d: &mut [f32] = bytemuck::cast_slice_mut(d);
    let bsums: &mut [i16] = bytemuck::cast_slice_mut(bsums);
    d.fill(0.0);
    bsums.fill(0);
    let mut blk = BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] };
    for (b, xb) in x.as_chunks::<QK_K>().0.iter().enumerate() {
        quantize_block_q8k(xb, &mut blk);
        d[b] = blk.d;
        qs[b * QK_K..(b + 1) * QK_K].copy_from_slice(&blk.qs);
        bsums[b * 16..(b + 1) * 16].copy_from_slice(&blk.bsums);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{LegacyLayout, QK, padded_sections};
    use std::arch::x86_64::*;

    /// `roundf` on 8 lanes: truncate, then step away from zero when the
    /// dropped fraction is at least one half (as `avx512::round_away`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn round_away(v: __m256) -> __m256i {
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let frac = _mm256_sub_ps(v, t);
        // Compare masks are all ones (-1) where true.
        let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5)));
        let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(frac, _mm256_set1_ps(-0.5)));
        _mm256_add_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(t), up), down)
    }

    /// The largest `|x|` of a block's 32 values (four 8-lane vectors).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn block_amax(v: &[__m256; 4]) -> f32 {
        let m = v.map(|v| _mm256_andnot_ps(_mm256_set1_ps(-0.0), v));
        let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    /// The sum of 8 i32 lanes (exact: quantised values are small).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) fn sum_epi32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    }

    /// AVX2 version of `pack_legacy_scalar`, bit-identical to it.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn pack_legacy(l: &LegacyLayout, x: &[f32], dst: &mut [u8]) {
        assert_eq!(x.len(), l.blocks * QK, "pack_legacy: length mismatch");
        let (qs, d, s, corr) = padded_sections(l, dst);
        let neg_off = _mm_set1_epi32(-l.offset);
        // packs_epi32 then packs_epi16 leave the 4-byte groups of the four
        // vectors interleaved by 128-bit lane; this puts them back in order.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for (b, xb) in x.as_chunks::<QK>().0.iter().enumerate() {
            // SAFETY: `xb` holds 32 f32, read as four unaligned 8-lane loads.
            let v = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xb.as_ptr().add(o))) };
            let db = block_amax(&v) / 127.0;
            let id = if db != 0.0 { 1.0 / db } else { 0.0 };
            let idv = _mm256_set1_ps(id);
            let q = v.map(|v| round_away(_mm256_mul_ps(v, idv)));
            let sum = sum_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
            // Round d and s through f16 (round to nearest even, as
            // `half::f16::from_f32`) with F16C.
            let ds =
                _mm_cvtph_ps(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm_setr_ps(db, sum as f32 * db, 0.0, 0.0)));
            d[b] = _mm_cvtss_f32(ds);
            s[b] = _mm_cvtss_f32(_mm_movehdup_ps(ds));
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, order);
            let (p0, p1) = (l.pos(b, 0), l.pos(b, 16));
            assert!(p0 + 16 <= qs.len() && p1 + 16 <= qs.len());
            // SAFETY: both 16-byte stores are in bounds of `qs` (asserted).
            unsafe {
                _mm_storeu_si128(qs.as_mut_ptr().add(p0).cast(), _mm256_castsi256_si128(bytes));
                _mm_storeu_si128(qs.as_mut_ptr().add(p1).cast(), _mm256_extracti128_si256::<1>(bytes));
            }
            if l.offset != 0 {
                // Sums of each 4 consecutive values: two horizontal adds
                // give, per 128-bit lane, the groups of 0..4 and 4..8 of
                // each input vector.
                let group = |a: __m256i, b: __m256i| {
                    let h = _mm256_hadd_epi32(a, b);
                    let h = _mm256_hadd_epi32(h, h);
                    let (lo, hi) = (_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
                    _mm_mullo_epi32(_mm_unpacklo_epi32(lo, hi), neg_off)
                };
                let (c0, c1) = (group(q[0], q[1]), group(q[2], q[3]));
                assert!(p0 / 4 + 4 <= corr.len() && p1 / 4 + 4 <= corr.len());
                // SAFETY: 4-lane stores at p0/4 and p1/4, in bounds (asserted).
                unsafe {
                    _mm_storeu_si128(corr.as_mut_ptr().add(p0 / 4).cast(), c0);
                    _mm_storeu_si128(corr.as_mut_ptr().add(p1 / 4).cast(), c1);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{LegacyLayout, QK, padded_sections};
    use std::arch::x86_64::*;

    /// `roundf` on 16 lanes: truncate, then step away from zero when the
    /// dropped fraction is at least one half (exact for |v| < 2^23).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(crate) fn round_away(v: __m512) -> __m512i {
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let frac = _mm512_sub_ps(v, t);
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
        let down = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, _mm512_set1_ps(-0.5));
        let ti = _mm512_cvttps_epi32(t);
        let ti = _mm512_mask_add_epi32(ti, up, ti, _mm512_set1_epi32(1));
        _mm512_mask_sub_epi32(ti, down, ti, _mm512_set1_epi32(1))
    }

    /// AVX-512 version of `pack_legacy_scalar`, bit-identical to it.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn pack_legacy(l: &LegacyLayout, x: &[f32], dst: &mut [u8]) {
        assert_eq!(x.len(), l.blocks * QK, "pack_legacy: length mismatch");
        let (qs, d, s, corr) = padded_sections(l, dst);
        let ones = _mm_set1_epi8(1);
        let neg_off = _mm_set1_epi32(-l.offset);
        for (b, xb) in x.as_chunks::<QK>().0.iter().enumerate() {
            // SAFETY: `xb` holds 32 f32, read as two unaligned 16-lane loads.
            let (x0, x1) = unsafe { (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16))) };
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            let db = amax / 127.0;
            let id = if db != 0.0 { 1.0 / db } else { 0.0 };
            let idv = _mm512_set1_ps(id);
            let q0 = round_away(_mm512_mul_ps(x0, idv));
            let q1 = round_away(_mm512_mul_ps(x1, idv));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            // Round d and s through f16 (round to nearest even, as
            // `half::f16::from_f32`) with F16C.
            let ds =
                _mm_cvtph_ps(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm_setr_ps(db, sum as f32 * db, 0.0, 0.0)));
            d[b] = _mm_cvtss_f32(ds);
            s[b] = _mm_cvtss_f32(_mm_movehdup_ps(ds));
            let b0 = _mm512_cvtepi32_epi8(q0);
            let b1 = _mm512_cvtepi32_epi8(q1);
            let p0 = l.pos(b, 0);
            let p1 = l.pos(b, 16);
            assert!(p1 + 16 <= qs.len());
            // SAFETY: both 16-byte stores are in bounds of `qs` (p0 < p1,
            // asserted above).
            unsafe {
                _mm_storeu_si128(qs.as_mut_ptr().add(p0).cast(), b0);
                _mm_storeu_si128(qs.as_mut_ptr().add(p1).cast(), b1);
            }
            if l.offset != 0 {
                let c0 = _mm_mullo_epi32(_mm_dpbusd_epi32(_mm_setzero_si128(), ones, b0), neg_off);
                let c1 = _mm_mullo_epi32(_mm_dpbusd_epi32(_mm_setzero_si128(), ones, b1), neg_off);
                assert!(p1 / 4 + 4 <= corr.len());
                // SAFETY: 4-lane stores at p0/4 and p1/4 < p1/4 + 4 <= len.
                unsafe {
                    _mm_storeu_si128(corr.as_mut_ptr().add(p0 / 4).cast(), c0);
                    _mm_storeu_si128(corr.as_mut_ptr().add(p1 / 4).cast(), c1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_helpers_match_libm() {
        for v in [0.5f32, -0.5, 1.5, -1.5, 2.5, 0.49999997, -0.49999997, 126.5, -127.0, 3.2] {
            assert_eq!(round_half_away(v), v.round() as i32, "{v}");
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
        // Out of range (an infinite 1/d): saturated, not an overflow.
        assert_eq!(round_half_away(f32::INFINITY), i32::MAX);
        assert_eq!(round_half_away(f32::NEG_INFINITY), i32::MIN);
        assert_eq!(round_half_away(f32::NAN), 0);
    }

    /// A block whose maximum is a denormal (1/d overflows to infinity):
    /// quantised without a panic (found by the gguf fuzz target).
    #[test]
    fn denormal_block_maximum_quantises() {
        let mut x = [0f32; 32];
        x[0] = f32::from_bits(1);
        x[1] = -f32::from_bits(1);
        let mut out = vec![<BlockQ8_0 as bytemuck::Zeroable>::zeroed(); 1];
        quantize_row_q8_0_ref(&x, &mut out).unwrap();
    }

    /// Each SIMD packer the CPU has gives the scalar packer's bytes, on
    /// random values, exact halves (the rounding's edge), a zero block and
    /// a denormal maximum.
    #[test]
    fn simd_pack_matches_scalar() {
        let cpu = crate::cpu::CpuFeatures::detect();
        type Packer = unsafe fn(&LegacyLayout, &[f32], &mut [u8]);
        let mut packers: Vec<(&str, Packer)> = Vec::new();
        if cpu.has_avx2_fma() {
            packers.push(("avx2", avx2::pack_legacy));
        }
        if cpu.has_avx512() {
            packers.push(("avx512", avx512::pack_legacy));
        }
        if packers.is_empty() {
            eprintln!("simd_pack_matches_scalar: no AVX2 here, nothing to compare");
        }
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        for (cols, inter, off) in [(576, true, 0), (96, true, 8), (96, false, 128), (1536, true, 16), (160, true, 8)] {
            let l = LegacyLayout::new(cols, inter, off);
            let mut x: Vec<f32> = (0..cols).map(|i| next() * (1 + i % 5) as f32 * 3.0).collect();
            // Block 1: halves after scaling (max 127 -> id = 1); block 2: zeros;
            // block 0 of the wide rows keeps its random values.
            for (j, v) in x[32..64].iter_mut().enumerate() {
                *v = if j == 0 { 127.0 } else { j as f32 - 15.5 };
            }
            x[64..96].fill(0.0);
            if cols > 96 {
                x[96] = f32::from_bits(1);
                x[97..128].fill(0.0);
            }
            let mut a = vec![0xAAu8; l.stride + 64];
            let oa = a.as_ptr().align_offset(64);
            pack_legacy_scalar(&l, &x, &mut a[oa..oa + l.stride]);
            for (name, pack) in &packers {
                let mut b = vec![0x55u8; l.stride + 64];
                let ob = b.as_ptr().align_offset(64);
                // SAFETY: the CPU has the packer's features (checked above).
                unsafe { pack(&l, &x, &mut b[ob..ob + l.stride]) };
                assert_eq!(a[oa..oa + l.stride], b[ob..ob + l.stride], "{name}: {cols} {inter} {off}");
            }
        }
    }
}
