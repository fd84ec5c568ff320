//! The packed f32 GEMM (F32/F16/BF16 weights from 128 tokens: below that
//! the dot-product tiles run; quantised weights, dequantised as they are
//! packed, for a prompt's tokens) against the scalar reference kernel on
//! random data, ragged shapes included (rows, columns and tokens that are not multiples of the register tiles or the K block),
//! over 1 and 3 threads.

mod kernels_common;

use kernels_common::*;
use rand::Rng;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;

fn run(k: &dyn MatmulKernel, pool: &ThreadPool, w: &[u8], x: &[f32], n: usize, rows: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * rows];
    let mut scratch = Vec::new();
    k.run(pool, MatmulCall::dense(w, x, n, &mut out, &mut scratch).prefill(true)).unwrap();
    out
}

/// Every SIMD kernel against the scalar one on `rows x cols` weights of
/// `ty` and `n` tokens; tolerance: f32 reassociation, relative to
/// `Σ |w · x|`.
fn check_shape(ty: GgmlType, rows: usize, cols: usize, n: usize, seed: u64, pools: &[ThreadPool]) {
    let mut r = rng(seed);
    let w = random_weights(&mut r, ty, rows, cols);
    let x: Vec<f32> = (0..n * cols).map(|_| r.random_range(-1.0f32..1.0)).collect();
    let desc = MatmulDesc::dense(ty, ActType::F32, rows, cols);
    let ks = candidates(&desc, &CpuFeatures::detect());
    let scalar = ks.iter().find(|k| k.name().starts_with("scalar")).expect("a scalar kernel");
    let exp = run(scalar.as_ref(), &pools[0], &w, &x, n, rows);
    let rb = ty.row_bytes(cols).unwrap();
    let wf: Vec<Vec<f32>> = (0..rows).map(|row| dequant(ty, &w[row * rb..(row + 1) * rb], cols)).collect();
    let mag: Vec<f32> = (0..n * rows)
        .map(|i| {
            let (t, row) = (i / rows, i % rows);
            magnitude(&wf[row], &x[t * cols..(t + 1) * cols])
        })
        .collect();
    for k in ks.iter().filter(|k| !k.name().starts_with("scalar")) {
        for pool in pools {
            let got = run(k.as_ref(), pool, &w, &x, n, rows);
            for (i, ((&g, &e), &m)) in got.iter().zip(&exp).zip(&mag).enumerate() {
                assert!(
                    (g - e).abs() <= 2e-6 * m + 1e-30,
                    "{} {ty:?} {rows}x{cols} n={n} threads={}: out[{i}] (token {}, row {}) = {g}, expected {e} \
                     (magnitude {m})",
                    k.name(),
                    pool.n_threads(),
                    i / rows,
                    i % rows
                );
            }
        }
    }
}

#[test]
fn gemm_matches_scalar_on_model_shapes() {
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    for (rows, cols, n) in [(384, 384, 128), (1536, 384, 133), (384, 1536, 160), (384, 384, 257)] {
        check_shape(GgmlType::F32, rows, cols, n, (rows * cols + n) as u64, &pools);
    }
}

#[test]
fn gemm_matches_scalar_on_ragged_shapes() {
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    // Rows not a multiple of 48/16 (partial panels, a partial packed
    // block), columns not a multiple of 16 or of the 256-column K block,
    // tokens not a multiple of 8/6.
    for (i, &(rows, cols, n)) in
        [(1, 1, 128), (7, 5, 129), (47, 33, 133), (49, 17, 128), (250, 300, 143), (97, 513, 131), (481, 271, 150)]
            .iter()
            .enumerate()
    {
        check_shape(GgmlType::F32, rows, cols, n, 100 + i as u64, &pools);
    }
}

#[test]
fn gemm_matches_scalar_for_half_weights() {
    let pools = [ThreadPool::new(2)];
    for ty in [GgmlType::F16, GgmlType::BF16] {
        for (i, &(rows, cols, n)) in [(96, 64, 128), (50, 290, 137), (384, 384, 140)].iter().enumerate() {
            check_shape(ty, rows, cols, n, 200 + i as u64, &pools);
        }
    }
}

/// Quantised weights, dequantised into the panels (the 32-element formats
/// eight rows at a time on AVX2, the K-quants through `dequantize_row`):
/// rows that leave a partial 8-row group and a partial panel, columns that
/// leave a partial K block (whole blocks of the format).
#[test]
fn gemm_matches_scalar_for_quantised_weights() {
    let pools = [ThreadPool::new(1), ThreadPool::new(3)];
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0] {
        for (i, &(rows, cols, n)) in [(576, 576, 128), (53, 288, 131), (5, 32, 1), (100, 1536, 7)].iter().enumerate() {
            check_shape(ty, rows, cols, n, 300 + i as u64, &pools);
        }
    }
    for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q2_K, GgmlType::Q3_K] {
        for (i, &(rows, cols, n)) in [(40, 512, 128), (17, 768, 3)].iter().enumerate() {
            check_shape(ty, rows, cols, n, 400 + i as u64, &pools);
        }
    }
}

/// A prompt row's value does not depend on how many tokens share the call
/// (a server chunks and batches prompts as load dictates): each token
/// alone, and a few tokens, give exactly the rows of one 133-token call,
/// over 1 and 2 threads.
#[test]
fn gemm_rows_do_not_depend_on_the_batch() {
    let (rows, cols, n) = (100, 576, 133);
    let mut r = rng(9);
    for ty in [GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q6_K] {
        let cols = if ty == GgmlType::Q6_K { 768 } else { cols };
        let w = random_weights(&mut r, ty, rows, cols);
        let x: Vec<f32> = (0..n * cols).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let desc = MatmulDesc::dense(ty, ActType::F32, rows, cols);
        let ks = candidates(&desc, &CpuFeatures::detect());
        for k in ks.iter().filter(|k| !k.name().starts_with("scalar")) {
            let all = run(k.as_ref(), &ThreadPool::new(2), &w, &x, n, rows);
            let pool = ThreadPool::new(1);
            for (t0, len) in [(0, 1), (5, 1), (7, 3), (132, 1), (40, 17)] {
                let part = run(k.as_ref(), &pool, &w, &x[t0 * cols..(t0 + len) * cols], len, rows);
                assert_eq!(part, all[t0 * rows..(t0 + len) * rows], "{} {ty:?}: tokens {t0}..+{len}", k.name());
            }
        }
    }
}

/// The single-threaded strided `sgemm` (attention's products) against its
/// scalar reference: both layouts of `B`, with and without accumulation,
/// strides wider than the rows, ragged sizes.
#[test]
fn sgemm_matches_scalar() {
    use spinfer_kernels::matmul::{BLayout, sgemm, sgemm_scalar};
    let mut r = rng(7);
    let mut scratch = Vec::new();
    for &(m, n, k) in
        &[(1, 1, 1), (16, 16, 32), (64, 64, 32), (64, 32, 64), (37, 53, 32), (9, 100, 300), (256, 32, 256)]
    {
        for layout in [BLayout::Transposed, BLayout::Normal] {
            for accumulate in [false, true] {
                let (lda, ldc) = (k + 3, n + 5);
                let (br, bc) = if layout == BLayout::Transposed { (n, k) } else { (k, n) };
                let ldb = bc + 7;
                let a: Vec<f32> = (0..m * lda).map(|_| r.random_range(-1.0f32..1.0)).collect();
                let b: Vec<f32> = (0..br * ldb).map(|_| r.random_range(-1.0f32..1.0)).collect();
                let c0: Vec<f32> = (0..m * ldc).map(|_| r.random_range(-1.0f32..1.0)).collect();
                let mut want = c0.clone();
                sgemm_scalar(m, n, k, &a, lda, &b, ldb, layout, &mut want, ldc, accumulate);
                let mut got = c0.clone();
                sgemm(m, n, k, &a, lda, &b, ldb, layout, &mut got, ldc, accumulate, &mut scratch);
                for i in 0..m {
                    for j in 0..ldc {
                        let (g, w) = (got[i * ldc + j], want[i * ldc + j]);
                        if j >= n {
                            assert_eq!(g, c0[i * ldc + j], "padding column {j} written");
                            continue;
                        }
                        let mag: f32 = (0..k)
                            .map(|p| {
                                let bv = if layout == BLayout::Transposed { b[j * ldb + p] } else { b[p * ldb + j] };
                                (a[i * lda + p] * bv).abs()
                            })
                            .sum::<f32>()
                            + if accumulate { c0[i * ldc + j].abs() } else { 0.0 };
                        assert!(
                            (g - w).abs() <= 2e-6 * mag + 1e-30,
                            "{m}x{n}x{k} {layout:?} acc={accumulate}: c[{i}, {j}] = {g}, expected {w}"
                        );
                    }
                }
            }
        }
    }
}
