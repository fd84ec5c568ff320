//! The AVX2 kernel of [`super::gemm_packed`] for [`super::PackedType::I16`]:
//! 6 tokens × 16 rows in 12 ymm i32 accumulators, one `vpmaddwd` per two
//! products (a broadcast pair of activations times 8 rows' weight pairs,
//! both products of a lane added into one i32), over the loop nest of the
//! f32 kernel (`avx2::drive`).
//!
//! Every [`BLOCK`] columns (32 pairs) the i32 sums, exact, are converted to
//! f32 and added with the block's activation scale into f32 accumulators;
//! the row scales and the bias come last: the arithmetic of
//! [`super::int16::dot`], so the results equal the scalar reference bit
//! for bit. The activations are quantised on every call into the caller's
//! scratch (`quantize_row`, equal to [`super::int16::Quantized`]).

#![allow(clippy::needless_range_loop, reason = "micro-kernels index M x NV register arrays")]

use std::arch::x86_64::*;

use super::avx2::{MR, SUB, Tiles, V, drive, pick};
use super::int16::{A_MAX, BLOCK, scale_inverse};
use super::{Epilogue, NR, PackedMatrix};
use spinfer_kernel_base::kernel::scratch_aligned;
use spinfer_kernel_base::pool::{SyncPtr, ThreadPool};

/// Runs the product (see [`super::gemm_packed`]; operands checked, `w` is
/// i16, `avx2::available` holds, `n > 0`).
#[allow(clippy::too_many_arguments, reason = "the GEMM operands")]
pub(super) fn run(
    pool: &ThreadPool,
    w: &PackedMatrix,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    scratch: &mut Vec<u8>,
    epilogue: Option<Epilogue<'_>>,
) {
    let (rows, cols, steps) = (w.rows, w.cols, w.steps);
    let nb = cols.div_ceil(BLOCK);
    // The quantised activations (`steps` i16 pairs per token), then their
    // scales (`nb` per token).
    let buf = scratch_aligned(scratch, n * (steps + nb) * 4);
    quantize_tokens(pool, x, n, cols, buf);
    let (xs, sa) = (buf.as_ptr() as usize, buf[n * steps * 4..].as_ptr() as usize);
    let (panels, sw) = (w.panels().as_ptr() as usize, w.scales.as_ptr() as usize);
    drive(pool, rows, steps, n, out, epilogue, &|t, m, r, width, c| {
        let (p, j0) = (r / NR, r % NR);
        let bp = bias.map_or(std::ptr::null(), |b| b[r..].as_ptr());
        // SAFETY: tokens `t..t + m` of the quantised activations (`steps`
        // pairs and `nb` scales each) and lanes `j0..j0 + 16 <= NR` of
        // panel `p` (`steps * NR` pairs, zero-padded past `rows`) are
        // inside their buffers, as are the row scales `r..r + 16` (padded
        // to whole panels); `c` is rows `r..r + width` of token `t` (see
        // `drive`); the bias (when present) holds `rows` floats; AVX2 and
        // FMA are available.
        unsafe {
            let pp = (panels as *const i32).add(p * steps * NR + j0);
            let (xt, st) = ((xs as *const i32).add(t * steps), (sa as *const f32).add(t * nb));
            let swr = (sw as *const f32).add(r);
            pick::<I16Tiles>(m, width)(steps, xt, st, nb, pp, c, rows, bp, swr, width);
        }
    });
}

/// Quantises `n` tokens of `cols` activations into `dst`: `ceil(cols / 2)`
/// i16 pairs per token, then `ceil(cols / BLOCK)` scales per token; over
/// the pool when there are enough of them.
///
/// # Panics
/// If `dst` is too short, or the CPU lacks AVX2.
fn quantize_tokens(pool: &ThreadPool, x: &[f32], n: usize, cols: usize, dst: &mut [u8]) {
    let (steps, nb) = (cols.div_ceil(2), cols.div_ceil(BLOCK));
    assert!(dst.len() >= n * (steps + nb) * 4 && x.len() >= n * cols && super::avx2::available());
    let base = SyncPtr::new(dst.as_mut_ptr());
    let convert = |tokens: std::ops::Range<usize>| {
        for t in tokens {
            // SAFETY: token `t`'s pairs and scales lie inside `dst`
            // (asserted) and are written by this call only; AVX2 is
            // available (asserted).
            unsafe {
                let q = base.get().add(t * steps * 4).cast::<i16>();
                let s = base.get().add((n * steps + t * nb) * 4).cast::<f32>();
                quantize_row(&x[t * cols..(t + 1) * cols], q, s);
            }
        }
    };
    super::convert_tokens(pool, n, n * cols, &convert);
}

/// Quantises one token's activations as [`super::int16::Quantized`]
/// does: `2 · ceil(x.len() / 2)` i16 at `q` (a zero past an odd length),
/// one scale per [`BLOCK`] columns at `s`.
///
/// # Safety
/// AVX2 must be available; `q` must hold `2 · ceil(x.len() / 2)` i16 and
/// `s` `ceil(x.len() / BLOCK)` floats.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_row(x: &[f32], q: *mut i16, s: *mut f32) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let inf = _mm256_set1_ps(f32::INFINITY);
    for (b, blk) in x.chunks(BLOCK).enumerate() {
        let full = blk.len() / V * V;
        // SAFETY: the loads read `blk[..full]`; the stores write the
        // block's `blk.len()` values at `q + b * BLOCK` and its scale at
        // `s + b`, inside the buffers (caller's contract).
        unsafe {
            // The largest magnitude, and whether any value is NaN or
            // infinite (`!(|v| < inf)`).
            let (mut vm, mut bad) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for c in (0..full).step_by(V) {
                let a = _mm256_and_ps(_mm256_loadu_ps(blk.as_ptr().add(c)), abs_mask);
                vm = _mm256_max_ps(vm, a);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
            }
            let mut lanes = [0.0f32; V];
            _mm256_storeu_ps(lanes.as_mut_ptr(), vm);
            let mut m = lanes.iter().fold(0.0f32, |m, &v| m.max(v));
            let mut finite = _mm256_movemask_ps(bad) == 0;
            for &v in &blk[full..] {
                finite &= v.is_finite();
                m = m.max(v.abs());
            }
            let qb = q.add(b * BLOCK);
            if !finite {
                std::ptr::write_bytes(qb, 0, blk.len());
                *s.add(b) = f32::NAN;
                continue;
            }
            let inv = scale_inverse(m, A_MAX);
            *s.add(b) = if inv == 0.0 { 0.0 } else { m / A_MAX };
            let vinv = _mm256_set1_ps(inv);
            for c in (0..full).step_by(V) {
                // Round to nearest even (the default MXCSR mode), then
                // narrow: |values| <= A_MAX, so no saturation.
                let i = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(blk.as_ptr().add(c)), vinv));
                let h = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256::<1>(i));
                _mm_storeu_si128(qb.add(c).cast(), h);
            }
            for (c, &v) in blk.iter().enumerate().skip(full) {
                *qb.add(c) = (v * inv).round_ties_even() as i16;
            }
        }
    }
    if x.len() % 2 == 1 {
        // SAFETY: `q` holds `x.len() + 1` values for an odd length.
        unsafe { *q.add(x.len()) = 0 };
    }
}

/// Signature of the micro-kernels.
type Ukr = unsafe fn(usize, *const i32, *const f32, usize, *const i32, *mut f32, usize, *const f32, *const f32, usize);

/// The i16 kernel's tiles, for [`pick`].
struct I16Tiles;

impl Tiles for I16Tiles {
    type Ukr = Ukr;
    fn ukr<const M: usize, const NV: usize>() -> Ukr {
        ukr::<M, NV>
    }
}

const _: () = assert!(MR == 6 && SUB == 2 * V);

/// `c[i, 0..width] = bias + sw · Σ_b sa[i, b] · Σ_{q in b} x[i, q] ·
/// p[q, 0..width]` for `i < M` over `steps` pairs (`x` row stride
/// `steps`, `sa` row stride `nb`, panel row stride `NR`, `c` row stride
/// `ldc`); a null `bias` is zero; lanes past `width` (of the last of the
/// `NV` vectors) are neither loaded from the bias nor stored.
///
/// # Safety
/// AVX2 and FMA must be available; `x` must hold `M` rows of `steps`
/// pairs, `sa` `M` rows of `nb = ceil(steps / 32)` floats, `p` `steps`
/// rows of `8 · NV` pairs (stride `NR`), `sw` `8 · NV` floats, `c` `M`
/// rows of `width` floats; `bias` is null or holds `width` floats; `8 ·
/// (NV - 1) < width <= 8 · NV`.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments, reason = "the micro-kernel operands")]
unsafe fn ukr<const M: usize, const NV: usize>(
    steps: usize,
    x: *const i32,
    sa: *const f32,
    nb: usize,
    p: *const i32,
    c: *mut f32,
    ldc: usize,
    bias: *const f32,
    sw: *const f32,
    width: usize,
) {
    const PAIRS: usize = BLOCK / 2;
    // Lanes of the last vector: all 8, or the first `rem` under `mask`.
    let rem = width - V * (NV - 1);
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    // SAFETY: all addresses are inside the buffers described above; the
    // masked loads and stores touch only the first `rem` lanes.
    unsafe {
        let mut facc = [[_mm256_setzero_ps(); NV]; M];
        for b in 0..nb {
            // The block's exact sums.
            let mut iacc = [[_mm256_setzero_si256(); NV]; M];
            for q in b * PAIRS..((b + 1) * PAIRS).min(steps) {
                let pq = p.add(q * NR);
                let mut wv = [_mm256_setzero_si256(); NV];
                for j in 0..NV {
                    wv[j] = _mm256_loadu_si256(pq.add(V * j).cast());
                }
                for i in 0..M {
                    let a = _mm256_set1_epi32(x.add(i * steps + q).read_unaligned());
                    for j in 0..NV {
                        iacc[i][j] = _mm256_add_epi32(iacc[i][j], _mm256_madd_epi16(a, wv[j]));
                    }
                }
            }
            // Into f32 with the block's activation scale.
            for i in 0..M {
                let s = _mm256_set1_ps(*sa.add(i * nb + b));
                for j in 0..NV {
                    facc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iacc[i][j]), s, facc[i][j]);
                }
            }
        }
        for j in 0..NV {
            let partial = j + 1 == NV && rem < V;
            let swv = _mm256_loadu_ps(sw.add(V * j));
            let bv = if bias.is_null() {
                _mm256_setzero_ps()
            } else if partial {
                _mm256_maskload_ps(bias.add(V * j), mask)
            } else {
                _mm256_loadu_ps(bias.add(V * j))
            };
            for i in 0..M {
                let v = _mm256_fmadd_ps(facc[i][j], swv, bv);
                let dst = c.add(i * ldc + V * j);
                if partial {
                    _mm256_maskstore_ps(dst, mask, v);
                } else {
                    _mm256_storeu_ps(dst, v);
                }
            }
        }
    }
}
