//! The AVX-512 kernels of [`super::gemm_packed`]: 8 tokens × 48 rows in
//! 24 zmm accumulators, `vdpbf16ps` (bf16) or `vfmadd` (f32), over the
//! whole K from the bias (see the crate docs).

#![allow(clippy::needless_range_loop, reason = "micro-kernels index M x NV register arrays")]

use std::arch::x86_64::*;

use super::{Epilogue, LANES, NR, PackedMatrix, PackedType, to_bf16};
use spinfer_kernel_base::kernel::scratch_aligned;
use spinfer_kernel_base::pool::{SyncPtr, ThreadPool, chunk_aligned};

/// Tokens per register tile.
const MR: usize = 8;

/// Whether the CPU has this file's kernel for `ty`: AVX-512 F/BW, and BF16
/// for [`PackedType::Bf16`] (cached detection, capped by `SPINFER_CPU`).
pub(super) fn available(ty: PackedType) -> bool {
    let f = spinfer_kernel_base::cpu::CpuFeatures::detect();
    f.avx512f
        && f.avx512bw
        && match ty {
            PackedType::F32 => true,
            PackedType::Bf16 => f.avx512bf16,
            PackedType::I16 => false,
        }
}

/// Runs the product (see [`super::gemm_packed`]; operands checked, the
/// CPU has the kernel's features, `n > 0`).
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
    assert!(w.ty != PackedType::I16, "gemm_packed: no AVX-512 kernel for i16 weights");
    let (rows, cols, steps) = (w.rows, w.cols, w.steps);
    // The activations, `steps` u32 per token: bf16 pairs rounded here,
    // or the f32 values in place.
    let (xs, ldx) = match w.ty {
        PackedType::F32 => (x.as_ptr() as usize, cols),
        PackedType::Bf16 | PackedType::I16 => {
            let xb = scratch_aligned(scratch, n * steps * 4);
            round_pairs(pool, x, n, cols, xb);
            (xb.as_ptr() as usize, steps)
        }
    };
    let ty = w.ty;
    let panels = w.panels().as_ptr() as usize;
    let out_ptr = SyncPtr::new(out.as_mut_ptr().cast::<u8>());
    let bias_ptr = bias.map_or(0, |b| b.as_ptr() as usize);
    pool.broadcast(&|ti, nt| {
        let rr = chunk_aligned(rows, ti, nt, LANES);
        let (panels, xs) = (panels as *const u32, xs as *const u32);
        let out = out_ptr.get().cast::<f32>();
        let mut t = 0;
        while t < n {
            let m = MR.min(n - t);
            let mut r = rr.start;
            while r < rr.end {
                // The part of panel `r / NR` from lane `r % NR` on that
                // this thread owns.
                let (p, j0) = (r / NR, r % NR);
                let width = (NR - j0).min(rr.end - r);
                let nv = width.div_ceil(LANES);
                let rem = width - (nv - 1) * LANES;
                let last: __mmask16 = if rem == LANES { 0xffff } else { (1u16 << rem) - 1 };
                // SAFETY: tokens `t..t + m` of the activations (`ldx` u32
                // each) and lanes `j0..j0 + 16 * nv <= NR` of panel `p`
                // (`steps * NR` u32, zero-padded) are inside their
                // buffers; the masked stores write rows `r..r + width`,
                // owned by this thread, of tokens `t..t + m` of `out`
                // (`n * rows` floats); the bias (when present) holds
                // `rows` floats; the CPU has the kernel's features.
                unsafe {
                    let pp = panels.add(p * steps * NR + j0);
                    let bp = if bias_ptr == 0 { std::ptr::null() } else { (bias_ptr as *const f32).add(r) };
                    let ukr = pick(ty, m, nv);
                    ukr(steps, xs.add(t * ldx), ldx, pp, out.add(t * rows + r), rows, bp, last);
                    if let Some(e) = epilogue {
                        for i in 0..m {
                            e(std::slice::from_raw_parts_mut(out.add((t + i) * rows + r), width));
                        }
                    }
                }
                r += width;
            }
            t += m;
        }
    });
}

/// Rounds `n` tokens of `cols` activations to bf16 pairs into `dst`
/// (`ceil(cols / 2)` u32 per token, 64-byte aligned), over the pool
/// when there are enough of them.
///
/// # Panics
/// If `dst` holds fewer than `n` tokens' pairs, or the CPU lacks
/// AVX-512 F/BW.
pub(super) fn round_pairs(pool: &ThreadPool, x: &[f32], n: usize, cols: usize, dst: &mut [u8]) {
    let steps = cols.div_ceil(2);
    assert!(dst.len() >= n * steps * 4 && x.len() >= n * cols && available(PackedType::F32));
    let dst = SyncPtr::new(dst.as_mut_ptr());
    let convert = |tokens: std::ops::Range<usize>| {
        for t in tokens {
            // SAFETY: token `t`'s `steps` pairs lie inside `dst`
            // (asserted) and are written by this call only; the CPU has
            // AVX-512 F/BW (asserted).
            unsafe { convert_row(&x[t * cols..(t + 1) * cols], dst.get().cast::<u32>().add(t * steps)) };
        }
    };
    super::convert_tokens(pool, n, n * cols, &convert);
}

/// Rounds one row of activations to bf16 pairs (`ceil(x.len() / 2)` u32
/// at `dst`), bit for bit as [`to_bf16`].
///
/// # Safety
/// AVX-512 F/BW must be available; `dst` must hold `ceil(x.len() / 2)`
/// u32.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn convert_row(x: &[f32], dst: *mut u32) {
    // u16 element 2j + 1 of (a, b): the high halves of 32 floats, in order.
    let mut idx = [0u16; 32];
    for (j, v) in idx.iter_mut().enumerate() {
        *v = (2 * j + 1) as u16;
    }
    // SAFETY: `idx` is 64 bytes.
    let idx = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    let round = |v: __m512| -> __m512i {
        let b = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000)))
    };
    let mut c = 0;
    while c + 32 <= x.len() {
        // SAFETY: floats `c..c + 32` are inside `x`; pairs `c / 2..c / 2 +
        // 16` inside `dst`.
        unsafe {
            let a = round(_mm512_loadu_ps(x.as_ptr().add(c)));
            let b = round(_mm512_loadu_ps(x.as_ptr().add(c + 16)));
            _mm512_storeu_si512(dst.add(c / 2).cast(), _mm512_permutex2var_epi16(a, idx, b));
        }
        c += 32;
    }
    while c < x.len() {
        let lo = u32::from(to_bf16(x[c]));
        let hi = x.get(c + 1).map_or(0, |&v| u32::from(to_bf16(v)));
        // SAFETY: pair `c / 2 < ceil(x.len() / 2)` is inside `dst`.
        unsafe { *dst.add(c / 2) = lo | (hi << 16) };
        c += 2;
    }
}

/// Signature of the micro-kernels.
type Ukr = unsafe fn(usize, *const u32, usize, *const u32, *mut f32, usize, *const f32, __mmask16);

/// The micro-kernel of `ty` for `m` tokens and `nv` vectors.
fn pick(ty: PackedType, m: usize, nv: usize) -> Ukr {
    fn by_nv<const M: usize, const BF16: bool>(nv: usize) -> Ukr {
        match (nv, BF16) {
            (3, true) => ukr_bf16::<M, 3>,
            (2, true) => ukr_bf16::<M, 2>,
            (_, true) => ukr_bf16::<M, 1>,
            (3, false) => ukr_f32::<M, 3>,
            (2, false) => ukr_f32::<M, 2>,
            (_, false) => ukr_f32::<M, 1>,
        }
    }
    fn by_m<const BF16: bool>(m: usize, nv: usize) -> Ukr {
        match m {
            8 => by_nv::<8, BF16>(nv),
            7 => by_nv::<7, BF16>(nv),
            6 => by_nv::<6, BF16>(nv),
            5 => by_nv::<5, BF16>(nv),
            4 => by_nv::<4, BF16>(nv),
            3 => by_nv::<3, BF16>(nv),
            2 => by_nv::<2, BF16>(nv),
            _ => by_nv::<1, BF16>(nv),
        }
    }
    match ty {
        PackedType::Bf16 | PackedType::I16 => by_m::<true>(m, nv),
        PackedType::F32 => by_m::<false>(m, nv),
    }
}

/// `c[i, 0..16·NV] = bias + Σ_q x[i, q] ·· p[q, 0..16·NV]` for `i < M`
/// over `steps` column pairs (`··`: `vdpbf16ps`, both products of a
/// pair), in order of `q`, from the bias (zero when null); `x` row
/// stride `ldx` pairs, panel row stride `NR`, `c` row stride `ldc`; the
/// last vector's bias loads and stores under `last`.
///
/// # Safety
/// AVX-512 F/BW/BF16 must be available; `x` must hold `M` rows of
/// `steps` pairs, `p` `steps` rows of `16 · NV` pairs (stride `NR`), `c`
/// `M` rows of the lanes `last` selects; `bias` is null or holds those
/// lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[allow(clippy::too_many_arguments, reason = "the micro-kernel operands")]
unsafe fn ukr_bf16<const M: usize, const NV: usize>(
    steps: usize,
    x: *const u32,
    ldx: usize,
    p: *const u32,
    c: *mut f32,
    ldc: usize,
    bias: *const f32,
    last: __mmask16,
) {
    // SAFETY: all addresses are inside the buffers described above;
    // `__m512i` and `__m512bh` are both 64-byte vectors (the transmutes
    // reinterpret 16 u32 lanes as 32 bf16 values).
    unsafe {
        let mut acc = init::<M, NV>(bias, last);
        for q in 0..steps {
            let pq = p.add(q * NR);
            let mut b = [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); NV];
            for j in 0..NV {
                b[j] = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(pq.add(LANES * j).cast()));
            }
            for i in 0..M {
                let a = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*x.add(i * ldx + q) as i32));
                for j in 0..NV {
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
                }
            }
        }
        store::<M, NV>(&acc, c, ldc, last);
    }
}

/// As [`ukr_bf16`] with f32 weights and activations (`steps` columns,
/// one FMA per product).
///
/// # Safety
/// As [`ukr_bf16`], with AVX-512 F/BW; `x` holds f32 values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
#[allow(clippy::too_many_arguments, reason = "the micro-kernel operands")]
unsafe fn ukr_f32<const M: usize, const NV: usize>(
    steps: usize,
    x: *const u32,
    ldx: usize,
    p: *const u32,
    c: *mut f32,
    ldc: usize,
    bias: *const f32,
    last: __mmask16,
) {
    let x = x.cast::<f32>();
    // SAFETY: all addresses are inside the buffers described above.
    unsafe {
        let mut acc = init::<M, NV>(bias, last);
        for q in 0..steps {
            let pq = p.add(q * NR).cast::<f32>();
            let mut b = [_mm512_setzero_ps(); NV];
            for j in 0..NV {
                b[j] = _mm512_loadu_ps(pq.add(LANES * j));
            }
            for i in 0..M {
                let a = _mm512_set1_ps(*x.add(i * ldx + q));
                for j in 0..NV {
                    acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
                }
            }
        }
        store::<M, NV>(&acc, c, ldc, last);
    }
}

/// Accumulators holding the bias (zero when null), the last vector's
/// lanes under `last`.
///
/// # Safety
/// AVX-512F must be available; `bias` is null or holds the lanes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn init<const M: usize, const NV: usize>(bias: *const f32, last: __mmask16) -> [[__m512; NV]; M] {
    let mut acc = [[_mm512_setzero_ps(); NV]; M];
    if !bias.is_null() {
        for j in 0..NV {
            let mask = if j + 1 == NV { last } else { 0xffff };
            // SAFETY: the lanes `mask` selects are inside `bias`.
            let bv = unsafe { _mm512_maskz_loadu_ps(mask, bias.add(LANES * j)) };
            for row in acc.iter_mut() {
                row[j] = bv;
            }
        }
    }
    acc
}

/// Stores the accumulators to `c` (row stride `ldc`), the last vector
/// under `last`.
///
/// # Safety
/// AVX-512F must be available; `c` holds `M` rows of the lanes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store<const M: usize, const NV: usize>(acc: &[[__m512; NV]; M], c: *mut f32, ldc: usize, last: __mmask16) {
    for j in 0..NV {
        let mask = if j + 1 == NV { last } else { 0xffff };
        for i in 0..M {
            // SAFETY: the lanes `mask` selects of row `i` are inside `c`.
            unsafe { _mm512_mask_storeu_ps(c.add(i * ldc + LANES * j), mask, acc[i][j]) };
        }
    }
}
