//! Matmul kernels on random data: every SIMD kernel against the scalar
//! reference, fast mode against the f32 dot of the dequantised weights,
//! tiling/threading invariance, and shape errors.

mod kernels_common;

use kernels_common::*;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;

fn kernels(ty: GgmlType, act: ActType, rows: usize, cols: usize) -> Vec<Box<dyn MatmulKernel>> {
    let desc = MatmulDesc::dense(ty, act, rows, cols);
    candidates(&desc, &CpuFeatures::detect())
}

/// Runs `k` and returns `out` (`n_tokens * rows`).
fn run(k: &dyn MatmulKernel, pool: &ThreadPool, w: &[u8], x: &[f32], n: usize, rows: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * rows];
    let mut scratch = Vec::new();
    k.run(pool, MatmulCall::dense(w, x, n, &mut out, &mut scratch)).unwrap();
    out
}

/// Reference results and magnitudes, `[t * rows + r]`.
fn reference(
    ty: GgmlType,
    act: ActType,
    w: &[u8],
    x: &[f32],
    n: usize,
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>) {
    let rb = ty.row_bytes(cols).unwrap();
    let mut exp = vec![0.0; n * rows];
    let mut mag = vec![0.0; n * rows];
    for r in 0..rows {
        let row = &w[r * rb..(r + 1) * rb];
        let wf = dequant(ty, row, cols);
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            exp[t * rows + r] = reference_dot(ty, act, row, xt);
            mag[t * rows + r] = magnitude(&wf, xt);
        }
    }
    (exp, mag)
}

fn check(name: &str, got: &[f32], exp: &[f32], mag: &[f32], ctx: &str) {
    let exact = name.starts_with("scalar");
    for (i, ((&g, &e), &m)) in got.iter().zip(exp).zip(mag).enumerate() {
        let ok = if exact { g == e } else { (g - e).abs() <= 1e-5 * m + 1e-30 };
        assert!(ok, "{name} {ctx}: out[{i}] = {g}, expected {e} (magnitude {m})");
    }
}

#[test]
fn every_kernel_matches_the_scalar_reference() {
    let pool = ThreadPool::new(1);
    let mut r = rng(1);
    let mut simd_seen = 0;
    for (ty, act) in all_pairs() {
        for cols in test_cols(ty) {
            let (rows, n) = (13, 5);
            let w = random_weights(&mut r, ty, rows, cols);
            let x = random_acts(&mut r, n * cols);
            let (exp, mag) = reference(ty, act, &w, &x, n, rows, cols);
            let ks = kernels(ty, act, rows, cols);
            assert!(ks.last().is_some_and(|k| k.name().starts_with("scalar")), "{ty} {act:?}: no scalar kernel");
            for k in &ks {
                simd_seen += usize::from(!k.name().starts_with("scalar"));
                let got = run(k.as_ref(), &pool, &w, &x, n, rows);
                check(k.name(), &got, &exp, &mag, &format!("cols {cols}"));
            }
        }
    }
    let f = CpuFeatures::detect();
    if f.has_avx2() {
        assert!(simd_seen > 0, "no SIMD kernel offered on an AVX2 machine");
    }
}

#[test]
fn expected_isas_are_offered() {
    let f = CpuFeatures::detect();
    for (ty, act) in all_pairs() {
        let names: Vec<String> = kernels(ty, act, 8, test_cols(ty)[0]).iter().map(|k| k.name().to_string()).collect();
        let scalar_only = matches!(ty, GgmlType::Q2_K | GgmlType::Q3_K) && act == ActType::Q8_K;
        // One 16-bit plane is for CPUs without VNNI: AVX2 kernels only.
        let avx512 = f.has_avx512() && !scalar_only && act != ActType::Q16;
        assert_eq!(names.iter().any(|n| n.starts_with("avx512")), avx512, "{names:?}");
        assert_eq!(names.iter().any(|n| n.starts_with("avx2")), f.has_avx2() && !scalar_only, "{names:?}");
        assert_eq!(names.last().map(|n| n.starts_with("scalar")), Some(true));
    }
}

/// Fast mode (quantised activations) stays within the activation
/// quantisation error of the f32 dot of the dequantised weights.
#[test]
fn fast_mode_is_close_to_dequantised_f32_dot() {
    let mut r = rng(2);
    for (ty, act) in all_pairs().into_iter().filter(|(_, a)| *a != ActType::F32) {
        let block = if act == ActType::Q8_K { 256 } else { 32 };
        for cols in test_cols(ty) {
            let rows = 9;
            let w = random_weights(&mut r, ty, rows, cols);
            let x = random_acts_with(&mut r, cols, block);
            let rb = ty.row_bytes(cols).unwrap();
            for row in w.chunks_exact(rb) {
                let wf = dequant(ty, row, cols);
                let exact: f64 = wf.iter().zip(&x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
                // Each quantised activation is off by at most half a step
                // (amax / 254), plus f16 rounding of the block scale/sum;
                // with one 16-bit plane half of amax / 32767, plus f32
                // rounding.
                let step = if act == ActType::Q16 { 1.0 / 65534.0 + 1e-6 } else { 1.0 / 254.0 + 1.0 / 1000.0 };
                let mut tol = 1e-6f64;
                for (wb, xb) in wf.chunks(block).zip(x.chunks(block)) {
                    let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
                    let wsum: f64 = wb.iter().map(|v| f64::from(v.abs())).sum();
                    tol += wsum * amax * step;
                }
                let got = f64::from(reference_dot(ty, act, row, &x));
                assert!((got - exact).abs() <= tol, "{ty}*{act:?} cols {cols}: fast {got}, f32 {exact}, tol {tol}");
                // And the tolerance is meaningful: well below the magnitude.
                let mag: f64 = wf.iter().zip(&x).map(|(&a, &b)| f64::from((a * b).abs())).sum();
                assert!(tol < 0.5 * mag, "{ty}: tolerance {tol} vs magnitude {mag}");
            }
        }
    }
}

/// Token counts that exercise full and partial token tiles (and both
/// activation packings: per thread up to 4 tokens, shared above), thread
/// counts that split rows unevenly, and odd row counts (row-tile tails);
/// 301 rows put even one token above the single-thread threshold.
#[test]
fn tiles_and_threads_do_not_change_results() {
    let mut r = rng(3);
    let pools: Vec<ThreadPool> = [1, 2, 3].into_iter().map(ThreadPool::new).collect();
    for ((ty, act), rows) in all_pairs().into_iter().flat_map(|p| [(p, 37), (p, 301)]) {
        let cols = *test_cols(ty).last().unwrap();
        let w = random_weights(&mut r, ty, rows, cols);
        for n in [1, 3, 8, 17] {
            let x = random_acts(&mut r, n * cols);
            let (exp, mag) = reference(ty, act, &w, &x, n, rows, cols);
            for k in kernels(ty, act, rows, cols) {
                for pool in &pools {
                    let got = run(k.as_ref(), pool, &w, &x, n, rows);
                    check(k.name(), &got, &exp, &mag, &format!("n {n} threads {}", pool.n_threads()));
                }
            }
        }
    }
}

/// Batched decode must not change outputs (the server's promise): a
/// token's results are the same bits whether it comes alone or as one of
/// 17 (a 16-token batch kernel plus a tail), for every quantised-activation
/// kernel.
#[test]
fn a_tokens_result_does_not_depend_on_its_batch() {
    let mut r = rng(7);
    let pool = ThreadPool::new(2);
    for (ty, act) in all_pairs().into_iter().filter(|&(_, act)| act != ActType::F32) {
        let (rows, cols) = (37, *test_cols(ty).last().unwrap());
        let w = random_weights(&mut r, ty, rows, cols);
        let n = 17;
        let x = random_acts(&mut r, n * cols);
        for k in kernels(ty, act, rows, cols) {
            let batched = run(k.as_ref(), &pool, &w, &x, n, rows);
            for t in 0..n {
                let alone = run(k.as_ref(), &pool, &w, &x[t * cols..(t + 1) * cols], 1, rows);
                let same =
                    alone.iter().zip(&batched[t * rows..(t + 1) * rows]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{} ({ty}*{act:?}): token {t} of {n} differs from the token alone", k.name());
            }
        }
    }
}

#[test]
fn more_threads_than_rows() {
    let mut r = rng(6);
    let pool = ThreadPool::new(3);
    for (ty, act) in [(GgmlType::Q4_1, ActType::Q8_1), (GgmlType::Q8_0, ActType::Q8_0), (GgmlType::F16, ActType::F32)] {
        let (rows, cols) = (2, 64);
        let w = random_weights(&mut r, ty, rows, cols);
        let x = random_acts(&mut r, 5 * cols);
        let (exp, mag) = reference(ty, act, &w, &x, 5, rows, cols);
        for k in kernels(ty, act, rows, cols) {
            let got = run(k.as_ref(), &pool, &w, &x, 5, rows);
            check(k.name(), &got, &exp, &mag, "2 rows, 3 threads");
        }
    }
}

#[test]
fn scratch_is_reused_without_growth() {
    let mut r = rng(4);
    let pool = ThreadPool::new(2);
    for (ty, act) in [(GgmlType::Q4_1, ActType::Q8_1), (GgmlType::Q6_K, ActType::Q8_K)] {
        let (rows, cols) = (64, 512);
        let w = random_weights(&mut r, ty, rows, cols);
        let x = random_acts(&mut r, 4 * cols);
        for k in kernels(ty, act, rows, cols) {
            let mut out = vec![0.0; 4 * rows];
            let mut scratch = Vec::new();
            k.run(&pool, MatmulCall::dense(&w, &x, 4, &mut out, &mut scratch)).unwrap();
            let (cap, ptr) = (scratch.capacity(), scratch.as_ptr());
            let first = out.clone();
            for _ in 0..3 {
                k.run(&pool, MatmulCall::dense(&w, &x, 4, &mut out, &mut scratch)).unwrap();
                assert_eq!(out, first, "{}: not deterministic", k.name());
            }
            assert_eq!((scratch.capacity(), scratch.as_ptr()), (cap, ptr), "{}", k.name());
        }
    }
}

#[test]
fn wrong_sizes_are_errors() {
    let pool = ThreadPool::new(2);
    let mut r = rng(5);
    for (ty, act) in all_pairs() {
        let cols = test_cols(ty)[0];
        let rows = 8;
        let w = random_weights(&mut r, ty, rows, cols);
        let x = random_acts(&mut r, 2 * cols);
        for k in kernels(ty, act, rows, cols) {
            let mut s = Vec::new();
            let mut out = vec![0.0; 2 * rows];
            let name = k.name().to_string();
            assert!(
                k.run(&pool, MatmulCall::dense(&w[..w.len() - 1], &x, 2, &mut out, &mut s)).is_err(),
                "{name}: short w"
            );
            let mut longer = w.clone();
            longer.push(0);
            assert!(k.run(&pool, MatmulCall::dense(&longer, &x, 2, &mut out, &mut s)).is_err(), "{name}: long w");
            assert!(k.run(&pool, MatmulCall::dense(&w, &x[..cols], 2, &mut out, &mut s)).is_err(), "{name}: short x");
            assert!(k.run(&pool, MatmulCall::dense(&w, &x, 1, &mut out, &mut s)).is_err(), "{name}: x/n mismatch");
            assert!(k.run(&pool, MatmulCall::dense(&w, &x, 2, &mut out[..rows], &mut s)).is_err(), "{name}: short out");
            let mut big = vec![0.0; 3 * rows];
            assert!(k.run(&pool, MatmulCall::dense(&w, &x, 2, &mut big, &mut s)).is_err(), "{name}: long out");
            let mut none: Vec<f32> = Vec::new();
            assert!(k.run(&pool, MatmulCall::dense(&w, &[], 0, &mut none, &mut s)).is_ok(), "{name}: zero tokens");
        }
    }
}

#[test]
fn unsupported_pairs_have_no_candidates() {
    use GgmlType::*;
    let f = CpuFeatures::detect();
    for (ty, act, cols) in [
        (Q4_0, ActType::Q8_1, 64),
        (Q4_1, ActType::Q8_0, 64),
        (F32, ActType::Q8_0, 64),
        (Q4_K, ActType::Q8_0, 256),
        (Q8_K, ActType::F32, 256),
        (TQ1_0, ActType::Q8_0, 256),
        (Q8_1, ActType::Q8_1, 64),
        (Q4_0, ActType::Q8_0, 40),
        (Q4_K, ActType::Q8_K, 320),
    ] {
        let desc = MatmulDesc::dense(ty, act, 4, cols);
        assert!(candidates(&desc, &f).is_empty(), "{ty} {act:?} {cols}");
    }
    // A CPU without SIMD still gets the scalar kernel.
    let desc = MatmulDesc::dense(Q4_1, ActType::Q8_1, 4, 64);
    let ks = candidates(&desc, &CpuFeatures::default());
    assert_eq!(ks.len(), 1);
    assert!(ks[0].name().starts_with("scalar"));
}
