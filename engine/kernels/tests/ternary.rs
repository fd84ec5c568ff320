//! Ternary kernels (TQ1_0, TQ2_0, I2_S × Q8_K) on random data: SIMD
//! against the scalar reference, the scalar reference against ggml's
//! semantics (the f32 dot of the dequantised weights, within the activation
//! quantisation error), the I2_S repack, matmuls through `candidates()`,
//! and shape errors. `ternary_speed` (ignored) prints timings.

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use spinfer_kernels::GgmlType;
use spinfer_kernels::blocks::BlockQ8K;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::dot::ternary::{
    dequantize_row_i2s, dot_i2s_q8_k, dot_tq1_0_q8_k, dot_tq2_0_q8_k, i2s_candidates, i2s_row_bytes, i2s_row_scale,
    repack_tq2_0_to_i2s,
};
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::quantize::quantize_row_q8_k_ref;

mod kernels_common;
use kernels_common::ternary::{TYPES, kernels, name, random_i2s, random_tq, weights};

fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// Signed activations with magnitudes varying per 256-block and a few
/// outliers; never all zero.
fn random_acts(r: &mut StdRng, n: usize) -> Vec<f32> {
    let mut scale = 1.0;
    let mut x: Vec<f32> = (0..n)
        .map(|i| {
            if i % 256 == 0 {
                scale = 10f32.powf(r.random_range(-2.0f32..1.5));
            }
            let v = r.random_range(-1.0f32..1.0) * scale;
            if r.random_bool(0.01) { v * 20.0 } else { v }
        })
        .collect();
    x[0] = 0.75;
    x
}

fn q8k(x: &[f32]) -> Vec<BlockQ8K> {
    let mut q = vec![BlockQ8K { d: 0.0, qs: [0; 256], bsums: [0; 16] }; x.len() / 256];
    quantize_row_q8_k_ref(x, &mut q).unwrap();
    q
}

/// The scalar reference dot of one row of `ty` (`None`: I2_S).
fn ref_dot(ty: Option<GgmlType>, row: &[u8], x: &[f32]) -> f32 {
    let q = q8k(x);
    match ty {
        Some(GgmlType::TQ1_0) => dot_tq1_0_q8_k(row, &q),
        Some(GgmlType::TQ2_0) => dot_tq2_0_q8_k(row, &q),
        None => dot_i2s_q8_k(row, &q),
        Some(t) => unreachable!("{t}"),
    }
}

fn dequant(ty: Option<GgmlType>, row: &[u8], cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; cols];
    match ty {
        Some(t) => dequantize_row(t, row, &mut out).unwrap(),
        None => dequantize_row_i2s(row, &mut out).unwrap(),
    }
    out
}

fn row_bytes(ty: Option<GgmlType>, cols: usize) -> usize {
    ty.map_or_else(|| i2s_row_bytes(cols).unwrap(), |t| t.row_bytes(cols).unwrap())
}

fn run(k: &dyn MatmulKernel, pool: &ThreadPool, w: &[u8], x: &[f32], n: usize, rows: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * rows];
    k.run(pool, MatmulCall::dense(w, x, n, &mut out, &mut Vec::new())).unwrap();
    out
}

/// Expected outputs (scalar reference dots) and magnitudes `sum |w x|`.
fn reference(ty: Option<GgmlType>, w: &[u8], x: &[f32], n: usize, rows: usize, cols: usize) -> (Vec<f32>, Vec<f32>) {
    let rb = row_bytes(ty, cols);
    let (mut exp, mut mag) = (vec![0.0; n * rows], vec![0.0; n * rows]);
    for r in 0..rows {
        let row = &w[r * rb..(r + 1) * rb];
        let wf = dequant(ty, row, cols);
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            exp[t * rows + r] = ref_dot(ty, row, xt);
            mag[t * rows + r] = wf.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
        }
    }
    (exp, mag)
}

/// Scalar kernels are bit-exact with the reference dot; SIMD kernels sum
/// the same exact per-block integers in another float order: within
/// `1e-5` of the magnitude.
fn check(name: &str, got: &[f32], exp: &[f32], mag: &[f32], ctx: &str) {
    let exact = name.starts_with("scalar");
    for (i, ((&g, &e), &m)) in got.iter().zip(exp).zip(mag).enumerate() {
        let ok = if exact { g == e } else { (g - e).abs() <= 1e-5 * m + 1e-30 };
        assert!(ok, "{name} {ctx}: out[{i}] = {g}, expected {e} (magnitude {m})");
    }
}

#[test]
fn every_kernel_matches_the_scalar_reference() {
    let f = CpuFeatures::detect();
    let pools: Vec<ThreadPool> = [1, 2, 3].into_iter().map(ThreadPool::new).collect();
    let mut r = rng(1);
    for ty in TYPES {
        for (rows, cols) in [(13, 256), (37, 768), (4, 2048)] {
            let w = weights(&mut r, ty, rows, cols);
            let ks = kernels(ty, rows, cols);
            let names: Vec<&str> = ks.iter().map(|k| k.name()).collect();
            assert_eq!(names.iter().any(|n| n.starts_with("avx512/")), f.has_avx512(), "{names:?}");
            assert_eq!(names.iter().any(|n| n.starts_with("avx2/")), f.has_avx2(), "{names:?}");
            assert!(names.last().unwrap().starts_with("scalar/"), "{names:?}");
            assert!(names.iter().all(|n| n.ends_with(&format!("/{}*q8_K", name(ty)))), "{names:?}");
            for n in [1, 2, 3, 4, 5, 9] {
                let x = random_acts(&mut r, n * cols);
                let (exp, mag) = reference(ty, &w, &x, n, rows, cols);
                assert!(exp.iter().all(|v| v.is_finite()) && exp.iter().any(|&v| v != 0.0));
                for k in &ks {
                    for pool in &pools {
                        let got = run(k.as_ref(), pool, &w, &x, n, rows);
                        let ctx = format!("{rows}x{cols}, {n} tokens, {} threads", pool.n_threads());
                        check(k.name(), &got, &exp, &mag, &ctx);
                    }
                }
            }
        }
    }
}

/// ggml's semantics: the integer dot of the quantised activations stays
/// within the activation quantisation error (half a step, amax / 254, per
/// element, plus f32 rounding) of the f32 dot of the dequantised weights.
#[test]
fn kernels_are_close_to_the_dequantised_f32_dot() {
    let mut r = rng(2);
    let pool = ThreadPool::new(2);
    for ty in TYPES {
        let (rows, cols) = (9, 1024);
        let w = weights(&mut r, ty, rows, cols);
        let x = random_acts(&mut r, cols);
        let rb = row_bytes(ty, cols);
        let mut want = Vec::new();
        let mut tols = Vec::new();
        for row in w.chunks_exact(rb) {
            let wf = dequant(ty, row, cols);
            let exact: f64 = wf.iter().zip(&x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
            let mut tol = 1e-6f64;
            for (wb, xb) in wf.chunks(256).zip(x.chunks(256)) {
                let amax = f64::from(xb.iter().fold(0.0f32, |m, v| m.max(v.abs())));
                let wsum: f64 = wb.iter().map(|v| f64::from(v.abs())).sum();
                tol += wsum * amax * (1.0 / 254.0 + 1e-5);
            }
            let mag: f64 = wf.iter().zip(&x).map(|(&a, &b)| f64::from((a * b).abs())).sum();
            assert!(tol < 0.5 * mag, "{}: tolerance {tol} vs magnitude {mag}", name(ty));
            want.push(exact);
            tols.push(tol);
        }
        for k in kernels(ty, rows, cols) {
            let got = run(k.as_ref(), &pool, &w, &x, 1, rows);
            for ((&g, &e), &tol) in got.iter().zip(&want).zip(&tols) {
                assert!((f64::from(g) - e).abs() <= tol, "{}: {g} vs f32 dot {e} (tol {tol})", k.name());
            }
        }
    }
}

#[test]
fn tq_matmul_through_candidates_fast_and_precise() {
    let f = CpuFeatures::detect();
    let mut r = rng(3);
    let pool = ThreadPool::new(2);
    for ty in [GgmlType::TQ1_0, GgmlType::TQ2_0] {
        assert_eq!(ActType::fast_for(ty), ActType::Q8_K);
        let (rows, cols, n) = (24, 512, 3);
        let w = random_tq(&mut r, ty, rows, cols, false);
        let x = random_acts(&mut r, n * cols);
        // Fast mode: the ternary kernels, best first.
        let desc = MatmulDesc::dense(ty, ActType::Q8_K, rows, cols);
        let ks = candidates(&desc, &f);
        let best = if f.has_avx512() {
            "avx512"
        } else if f.has_avx2() {
            "avx2"
        } else {
            "scalar"
        };
        assert_eq!(ks[0].name(), format!("{best}/{}*q8_K", ty.name()));
        let (exp, mag) = reference(Some(ty), &w, &x, n, rows, cols);
        check(ks[0].name(), &run(ks[0].as_ref(), &pool, &w, &x, n, rows), &exp, &mag, "candidates()[0]");
        // Precise mode: f32 activations through the generic dequantising path.
        let desc = MatmulDesc::dense(ty, ActType::F32, rows, cols);
        let ks = candidates(&desc, &f);
        assert!(!ks.is_empty(), "no precise kernel for {ty}");
        let rb = ty.row_bytes(cols).unwrap();
        for k in &ks {
            let got = run(k.as_ref(), &pool, &w, &x, n, rows);
            for t in 0..n {
                for (i, row) in w.chunks_exact(rb).enumerate() {
                    let wf = dequant(Some(ty), row, cols);
                    let xt = &x[t * cols..(t + 1) * cols];
                    let e: f32 = wf.iter().zip(xt).map(|(a, b)| a * b).sum();
                    let m: f32 = wf.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                    let g = got[t * rows + i];
                    assert!((g - e).abs() <= 1e-5 * m, "{}: {g} vs {e}", k.name());
                }
            }
        }
    }
    // Ternary weights pair with Q8_K only.
    for act in [ActType::Q8_0, ActType::Q8_1] {
        assert!(candidates(&MatmulDesc::dense(GgmlType::TQ2_0, act, 4, 256), &f).is_empty());
    }
    assert!(candidates(&MatmulDesc::dense(GgmlType::TQ1_0, ActType::Q8_K, 4, 320), &f).is_empty());
    // A CPU without SIMD still gets the scalar kernel.
    let ks = candidates(&MatmulDesc::dense(GgmlType::TQ1_0, ActType::Q8_K, 4, 256), &CpuFeatures::default());
    assert_eq!(ks.len(), 1);
    assert_eq!(ks[0].name(), "scalar/tq1_0*q8_K");
}

#[test]
fn i2s_repack_is_exact_and_checked() {
    let mut r = rng(4);
    let (rows, cols) = (5, 768);
    let (tq, i2s) = random_i2s(&mut r, rows, cols);
    assert_eq!(i2s.len(), rows * (cols / 4 + 4));
    let rb_tq = GgmlType::TQ2_0.row_bytes(cols).unwrap();
    let rb = i2s_row_bytes(cols).unwrap();
    let x = random_acts(&mut r, cols);
    for (a, b) in tq.chunks_exact(rb_tq).zip(i2s.chunks_exact(rb)) {
        let (da, db) = (dequant(Some(GgmlType::TQ2_0), a, cols), dequant(None, b, cols));
        assert_eq!(da, db);
        assert_eq!(i2s_row_scale(b).unwrap(), f16::from_le_bytes([a[64], a[65]]).to_f32());
        assert!(db.iter().any(|&v| v > 0.0) && db.iter().any(|&v| v < 0.0) && db.contains(&0.0));
        // The same integer sums, scaled per block or once per row.
        let (ya, yb) = (ref_dot(Some(GgmlType::TQ2_0), a, &x), ref_dot(None, b, &x));
        let m: f32 = da.iter().zip(&x).map(|(w, v)| (w * v).abs()).sum();
        assert!((ya - yb).abs() <= 1e-5 * m, "tq2_0 {ya} vs i2_s {yb}");
    }
    // Code 3 survives the repack (and reads as +2 in both formats).
    let mut tq3 = tq.clone();
    tq3[0] = 0xFF;
    let i3 = repack_tq2_0_to_i2s(&tq3, rows, cols).unwrap();
    assert_eq!(dequant(Some(GgmlType::TQ2_0), &tq3[..rb_tq], cols), dequant(None, &i3[..rb], cols));

    // Rows whose blocks have different scales cannot be I2_S.
    let mut bad = tq.clone();
    bad[rb_tq + 66 + 64] ^= 1;
    let e = repack_tq2_0_to_i2s(&bad, rows, cols).unwrap_err().to_string();
    assert!(e.contains("row 1"), "{e}");
    assert!(repack_tq2_0_to_i2s(&tq[1..], rows, cols).is_err());
    assert!(repack_tq2_0_to_i2s(&tq, rows, 320).is_err());
    assert!(i2s_row_bytes(128).is_err());
    assert!(i2s_candidates(4, 384, &CpuFeatures::detect()).is_empty());
}

#[test]
fn wrong_sizes_are_errors() {
    let pool = ThreadPool::new(2);
    let mut r = rng(5);
    for ty in TYPES {
        let (rows, cols) = (8, 256);
        let w = weights(&mut r, ty, rows, cols);
        let x = random_acts(&mut r, 2 * cols);
        for k in kernels(ty, rows, cols) {
            let name = k.name().to_string();
            let mut s = Vec::new();
            let mut out = vec![0.0; 2 * rows];
            assert!(
                k.run(&pool, MatmulCall::dense(&w[..w.len() - 1], &x, 2, &mut out, &mut s)).is_err(),
                "{name}: short w"
            );
            let mut longer = w.clone();
            longer.push(0);
            assert!(k.run(&pool, MatmulCall::dense(&longer, &x, 2, &mut out, &mut s)).is_err(), "{name}: long w");
            assert!(k.run(&pool, MatmulCall::dense(&w, &x[..cols], 2, &mut out, &mut s)).is_err(), "{name}: short x");
            assert!(k.run(&pool, MatmulCall::dense(&w, &x, 2, &mut out[..rows], &mut s)).is_err(), "{name}: short out");
            let mut none: Vec<f32> = Vec::new();
            assert!(k.run(&pool, MatmulCall::dense(&w, &[], 0, &mut none, &mut s)).is_ok(), "{name}: zero tokens");
            // Scratch is reused without growth.
            k.run(&pool, MatmulCall::dense(&w, &x, 2, &mut out, &mut s)).unwrap();
            let (cap, ptr, first) = (s.capacity(), s.as_ptr(), out.clone());
            k.run(&pool, MatmulCall::dense(&w, &x, 2, &mut out, &mut s)).unwrap();
            assert_eq!((s.capacity(), s.as_ptr()), (cap, ptr), "{name}");
            assert_eq!(out, first, "{name}: not deterministic");
        }
    }
}
