//! Blocked f32 GEMM for matmuls over many tokens with F32/F16/BF16 or
//! quantised (GGUF block) weights, dequantised as they are packed, and f32
//! activations: `out[t, r] = Σ_c W[r, c] · x[t, c]`.
//!
//! The tile kernels of [`crate::dot::f32simd`] compute dot products (one
//! horizontal reduction per output, two loads per FMA); over many tokens
//! this is the classic packed GEMM instead (BLIS loop order, with the
//! weights as the packed, vectorised operand):
//!
//! * each pool thread owns a contiguous range of output rows (whole panels
//!   of `NR` rows), so threads never share an output element;
//! * over K in blocks of `KC` columns, and over its rows in blocks of `MC`
//!   rows, a thread packs `W[rows, k block]` (converted to f32) into panels
//!   of `NR` rows stored k-major (`NR` consecutive floats per column); the
//!   packed block (`MC × KC` floats) stays in L2;
//! * for every tile of up to `MR` tokens, the micro-kernel walks the panels
//!   of the block: per column, `NR / lanes` vector loads of the panel, `MR`
//!   broadcasts of `x[t, c]` (read in place: the tile's `MR × KC`
//!   activations stay in L1 across the panels) and `MR · NR / lanes` FMAs
//!   into register accumulators, which are then stored to `out[t, r..r+NR]`
//!   (first K block) or added to it; meanwhile the next block's weights are
//!   prefetched into L2, a slice before each micro-kernel call.
//!
//! AVX-512 uses 8 tokens × 48 rows (24 zmm accumulators) and packs with
//! 16 × 16 in-register transposes; AVX2 uses 6 tokens × 16 rows (12 ymm
//! accumulators) and packs eight rows at a time through a staging tile
//! and 8 × 8 transposes (`pack8.rs`, which also dequantises the block
//! formats, for both). Ragged shapes: a token tail runs a micro-kernel
//! instantiated for its size, a row tail (a partial
//! panel, zero-padded when packed) goes through a stack tile, a column
//! tail is just a shorter K block.
//!
//! The result differs from the dot-product kernels only by the order of
//! the f32 additions.
//!
//! [`sgemm`] is the same machinery single-threaded over f32 slices with
//! strides, for the small products of attention (`Q·Kᵀ`, `P·V`).

use crate::GgmlType;

/// Columns per K block (of the packed weights and of each micro-kernel
/// call).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const KC: usize = 256;

/// Fewest tokens for which the GEMM beats the dot-product tiles on F32,
/// F16 or BF16 weights (decode and short prefills keep the existing path):
/// packing costs a pass over the weights that the tiles do not make
/// (docs/benchmarks.md, "Design measurements cited by the code").
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const MIN_TOKENS: usize = 128;

/// Whether `job` runs as the GEMM: F32/F16/BF16 weights from
/// [`MIN_TOKENS`] tokens; quantised weights for a prompt's tokens
/// ([`MatmulCall::prefill`](crate::kernel::MatmulCall)), however many, so
/// that a prompt row's value does not depend on how its prompt was chunked
/// or batched (the GEMM's value of an output is one FMA chain over the
/// columns, whatever the number of tokens); decode rows keep the
/// dot-product tiles. The GEMM dequantises each weight once per call, the
/// tiles once per 4 tokens: it is as fast from 8 tokens, twice as fast from
/// 32 (docs/benchmarks.md, "Prompts as an f32 GEMM over dequantised
/// weights").
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn serves(job: &super::Job<'_>) -> bool {
    let ty = job.desc.wtype;
    let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    job.idx.is_none() && if quantised(ty) { job.prefill } else { float && job.n_tokens >= MIN_TOKENS }
}

/// Whether the GEMM serves quantised weights of type `ty` (dequantised as
/// they are packed).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn quantised(ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    return pack8::serves_quantised(ty);
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = ty;
        false
    }
}

/// How the right-hand operand `B` (`k × n`) of [`sgemm`] is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BLayout {
    /// One row per output column: `B(p, j) = b[j * ldb + p]` (like a weight
    /// matrix, or `K` in `Q·Kᵀ`).
    Transposed,
    /// One row per summed index: `B(p, j) = b[p * ldb + j]` (like `V` in
    /// `P·V`).
    Normal,
}

/// `c[i * ldc + j] = (accumulate ? c[i * ldc + j] : 0) + Σ_p a[i * lda + p]
/// · B(p, j)` for `i < m`, `j < n`, `p < k`, on the calling thread, with
/// AVX-512 or AVX2 when the CPU has them (else [`sgemm_scalar`]). `scratch`
/// holds the packed `B` blocks (grown as needed, never shrunk).
///
/// # Panics
/// If a slice is too short for its shape and stride.
#[allow(clippy::too_many_arguments, reason = "the BLAS operands")]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    layout: BLayout,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    scratch: &mut Vec<f32>,
) {
    check_operands(m, n, k, a, lda, b, ldb, layout, c, ldc);
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::CpuFeatures::detect();
        if k > 0 && (f.has_avx512() || f.has_avx2()) {
            let isa = if f.has_avx512() { super::Isa::Avx512 } else { super::Isa::Avx2 };
            // SAFETY: the CPU has `isa`; `check_operands` verified that every
            // slice holds its strided shape.
            unsafe {
                simd::sgemm(
                    isa,
                    m,
                    n,
                    k,
                    a.as_ptr(),
                    lda,
                    b.as_ptr(),
                    ldb,
                    layout,
                    c.as_mut_ptr(),
                    ldc,
                    accumulate,
                    scratch,
                )
            };
            return;
        }
    }
    let _ = scratch;
    sgemm_scalar(m, n, k, a, lda, b, ldb, layout, c, ldc, accumulate);
}

/// The scalar reference of [`sgemm`] (sums in order of `p`).
///
/// # Panics
/// If a slice is too short for its shape and stride.
#[allow(clippy::too_many_arguments, reason = "the BLAS operands")]
pub fn sgemm_scalar(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    layout: BLayout,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    check_operands(m, n, k, a, lda, b, ldb, layout, c, ldc);
    for i in 0..m {
        for j in 0..n {
            let mut s = if accumulate { c[i * ldc + j] } else { 0.0 };
            for p in 0..k {
                let bv = match layout {
                    BLayout::Transposed => b[j * ldb + p],
                    BLayout::Normal => b[p * ldb + j],
                };
                s = a[i * lda + p].mul_add(bv, s);
            }
            c[i * ldc + j] = s;
        }
    }
}

/// Panics unless every operand of an `m × n × k` product fits its slice.
#[allow(clippy::too_many_arguments, reason = "the BLAS operands")]
fn check_operands(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    layout: BLayout,
    c: &[f32],
    ldc: usize,
) {
    let need = |rows: usize, cols: usize, ld: usize| if rows == 0 || cols == 0 { 0 } else { (rows - 1) * ld + cols };
    let (br, bc) = match layout {
        BLayout::Transposed => (n, k),
        BLayout::Normal => (k, n),
    };
    assert!(
        lda >= k && a.len() >= need(m, k, lda),
        "sgemm: a holds {} floats, too few for {m} x {k} (lda {lda})",
        a.len()
    );
    assert!(
        ldb >= bc && b.len() >= need(br, bc, ldb),
        "sgemm: b holds {} floats, too few for {br} x {bc} (ldb {ldb})",
        b.len()
    );
    assert!(
        ldc >= n && c.len() >= need(m, n, ldc),
        "sgemm: c holds {} floats, too few for {m} x {n} (ldc {ldc})",
        c.len()
    );
}

#[cfg(target_arch = "x86_64")]
pub(super) use simd::run;

#[cfg(target_arch = "x86_64")]
mod pack8;
#[cfg(target_arch = "x86_64")]
mod simd;
