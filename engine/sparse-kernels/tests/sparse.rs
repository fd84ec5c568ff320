//! Sparse FFN kernels: gathered-row matvec against the dense kernel,
//! the Q8_0 neuron-major transpose, the row AXPY (SIMD against the
//! scalar reference and against the dense f32 product), and the exact
//! neuron-major form (`NeuronMajor`).

#[path = "../../kernels/tests/kernels_common/mod.rs"]
mod kernels_common;
#[path = "sparse_common/mod.rs"]
mod sparse_common;

use half::f16;
use kernels_common::*;
use rand::Rng;
use rand::rngs::StdRng;
use sparse_common::isas;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel, Select};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::pool::ThreadPool;
use spinfer_sparse_kernels::{
    AxpyIsa, NeuronMajor, axpy_rows_q8_0, axpy_rows_q8_0_scalar, axpy_rows_q8_0_with, gather_rows, transpose_to_q8_0,
};

const TYPES: [GgmlType; 5] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];

fn cols_for(ty: GgmlType) -> usize {
    if ty.block_size() == 32 { 576 } else { 768 }
}

fn matvec(k: &dyn MatmulKernel, pool: &ThreadPool, w: &[u8], x: &[f32], rows: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; rows];
    k.run(pool, MatmulCall::dense(w, x, 1, &mut out, &mut Vec::new())).unwrap();
    out
}

fn dequant_matrix(ty: GgmlType, w: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let rb = ty.row_bytes(cols).unwrap();
    (0..rows).flat_map(|r| dequant(ty, &w[r * rb..(r + 1) * rb], cols)).collect()
}

// === (a) gathered rows + dense kernel ===

#[test]
fn gathered_matvec_is_bitwise_the_dense_matvec() {
    let mut r = rng(11);
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    for ty in TYPES {
        let (rows, cols) = (300, cols_for(ty));
        let rb = ty.row_bytes(cols).unwrap();
        let w = random_weights(&mut r, ty, rows, cols);
        let x = random_acts(&mut r, cols);
        for pool in &pools {
            let dense = matvec(dense_kernel(ty, rows, cols).as_ref(), pool, &w, &x, rows);
            assert!(dense.iter().any(|&v| v != 0.0));

            let all: Vec<u32> = (0..rows as u32).collect();
            let mut g = Vec::new();
            gather_rows(pool, &w, rb, &all, &mut g).unwrap();
            assert_eq!(g, w, "{ty}: gathering every row is the identity");
            let got = matvec(dense_kernel(ty, rows, cols).as_ref(), pool, &g, &x, rows);
            assert_eq!(bits(&got), bits(&dense), "{ty}: all rows");

            for n in [1, 7, 150, 299] {
                let idx = random_subset(&mut r, rows, n);
                gather_rows(pool, &w, rb, &idx, &mut g).unwrap();
                assert_eq!(g.len(), n * rb);
                let got = matvec(dense_kernel(ty, n, cols).as_ref(), pool, &g, &x, n);
                let want: Vec<f32> = idx.iter().map(|&i| dense[i as usize]).collect();
                assert_eq!(bits(&got), bits(&want), "{ty}: {n} rows, {} threads", pool.n_threads());
            }
        }
    }
}

/// a gathered-row call (`Select::Rows`, rows read in place, no copy) gives, for every
/// kernel of every instruction set, in fast and precise mode, for 1, 2
/// (fast mode's two planes) and 5 tokens, exactly the dense product's rows:
/// sorted subsets with runs, unsorted and repeated indices.
#[test]
fn run_rows_is_bitwise_the_dense_rows() {
    let mut r = rng(13);
    let pools = [ThreadPool::new(1), ThreadPool::new(2), ThreadPool::new(3)];
    for ty in TYPES {
        let (rows, cols) = (300, cols_for(ty));
        let w = random_weights(&mut r, ty, rows, cols);
        for act in [ActType::fast_for(ty), ActType::F32] {
            let desc = MatmulDesc::dense(ty, act, rows, cols);
            for k in candidates(&desc, &CpuFeatures::detect()) {
                for n_tokens in [1, 2, 5] {
                    let x = random_acts(&mut r, n_tokens * cols);
                    let pool = &pools[n_tokens % pools.len()];
                    let mut dense = vec![f32::NAN; n_tokens * rows];
                    k.run(pool, MatmulCall::dense(&w, &x, n_tokens, &mut dense, &mut Vec::new())).unwrap();
                    let mut shuffled: Vec<u32> = (0..40).map(|_| r.random_range(0..rows as u32)).collect();
                    shuffled.extend([0, rows as u32 - 1, 0]);
                    let mut sets: Vec<Vec<u32>> = [1, 7, 150, 299].map(|n| random_subset(&mut r, rows, n)).into();
                    sets.push((0..rows as u32).collect());
                    sets.push(shuffled);
                    for idx in &sets {
                        let mut got = vec![f32::NAN; n_tokens * idx.len()];
                        k.run(
                            pool,
                            MatmulCall {
                                w: &w,
                                select: Select::Rows(idx),
                                x: &x,
                                n_tokens,
                                out: &mut got,
                                scratch: &mut Vec::new(),
                                prefill: false,
                            },
                        )
                        .unwrap();
                        let want: Vec<f32> = (0..n_tokens)
                            .flat_map(|t| idx.iter().map(move |&i| t * rows + i as usize))
                            .map(|p| dense[p])
                            .collect();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{} {ty}: {} rows, {n_tokens} tokens, {} threads",
                            k.name(),
                            idx.len(),
                            pool.n_threads()
                        );
                    }
                }
                // Bad input is an error, not a panic or a short write.
                let x = random_acts(&mut r, cols);
                let mut out = vec![0f32; 2];
                let err = k.run(
                    &pools[1],
                    MatmulCall {
                        w: &w,
                        select: Select::Rows(&[0, rows as u32]),
                        x: &x,
                        n_tokens: 1,
                        out: &mut out,
                        scratch: &mut Vec::new(),
                        prefill: false,
                    },
                );
                assert!(err.unwrap_err().to_string().contains("out of range"), "{}", k.name());
                let err = k.run(
                    &pools[1],
                    MatmulCall {
                        w: &w,
                        select: Select::Rows(&[0, 1, 2]),
                        x: &x,
                        n_tokens: 1,
                        out: &mut out,
                        scratch: &mut Vec::new(),
                        prefill: false,
                    },
                );
                assert!(err.unwrap_err().to_string().contains("output holds 2 values"), "{}", k.name());
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Large copies take the multi-threaded path; unsorted and repeated
/// indices are copied in order.
#[test]
fn gather_large_unsorted_and_repeated() {
    let mut r = rng(12);
    let ty = GgmlType::Q4_1;
    let (rows, cols) = (1536, 576);
    let rb = ty.row_bytes(cols).unwrap();
    let w = random_weights(&mut r, ty, rows, cols);
    let mut idx: Vec<u32> = (0..1200).map(|_| r.random_range(0..rows as u32)).collect();
    idx.push(0);
    idx.push(rows as u32 - 1);
    idx.push(0);
    let want: Vec<u8> = idx.iter().flat_map(|&i| w[i as usize * rb..(i as usize + 1) * rb].iter().copied()).collect();
    for t in [1, 2, 3] {
        let pool = ThreadPool::new(t);
        let mut g = vec![0xAB; 5];
        gather_rows(&pool, &w, rb, &idx, &mut g).unwrap();
        assert!(g == want, "{t} threads");
        // Reuse with fewer rows shrinks the length, keeps the allocation.
        let cap = g.capacity();
        gather_rows(&pool, &w, rb, &idx[..3], &mut g).unwrap();
        assert_eq!(g, want[..3 * rb]);
        assert_eq!(g.capacity(), cap);
        gather_rows(&pool, &w, rb, &[], &mut g).unwrap();
        assert!(g.is_empty());
    }
}

// === (d) transpose round trip ===

/// Dequantised row `j` of the transpose equals column `j` of the
/// dequantised `W` within Q8_0 rounding: per element at most half a step
/// of the unrounded block scale `d = amax / 127`, plus the f16 rounding of
/// the stored scale (`127 |f16(d) - d|`).
#[test]
fn transpose_round_trips_within_q8_0_rounding() {
    let mut r = rng(13);
    for ty in TYPES.into_iter().chain([GgmlType::F32, GgmlType::F16, GgmlType::Q5_1]) {
        let (rows, cols) = (96, if ty.block_size() == 256 { 512 } else { 160 });
        let w = random_weights(&mut r, ty, rows, cols);
        let wd = dequant_matrix(ty, &w, rows, cols);
        let t = transpose_to_q8_0(ty, &w, rows, cols).unwrap();
        let rbt = GgmlType::Q8_0.row_bytes(rows).unwrap();
        assert_eq!(t.len(), cols * rbt);
        let mut worst = 0.0f32;
        for j in 0..cols {
            let got = dequant(GgmlType::Q8_0, &t[j * rbt..(j + 1) * rbt], rows);
            for b in 0..rows / 32 {
                let col: Vec<f32> = (b * 32..b * 32 + 32).map(|i| wd[i * cols + j]).collect();
                let amax = col.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let tol = 0.5 * d * (1.0 + 1e-5) + 127.0 * (f16::from_f32(d).to_f32() - d).abs() + 1e-30;
                for (i, &c) in col.iter().enumerate() {
                    let e = (got[b * 32 + i] - c).abs();
                    worst = worst.max(e / tol);
                    assert!(e <= tol, "{ty}: W[{}, {j}] = {c}, transposed {} (tol {tol})", b * 32 + i, got[b * 32 + i]);
                }
            }
        }
        assert!(worst > 0.0, "{ty}: suspiciously exact");
    }
}

#[test]
fn transpose_of_q8_0_aligned_values_is_exact() {
    // Values that are exactly representable with a power-of-two scale per
    // column block come back bit-exact.
    let (rows, cols) = (64, 32);
    let mut w = Vec::new();
    for i in 0..rows {
        for j in 0..cols {
            let q = ((i * 7 + j * 3) % 255) as f32 - 127.0;
            let q = if i % 32 == 0 { 127.0 } else { q };
            w.extend_from_slice(&(q * 0.25f32).to_le_bytes());
        }
    }
    let t = transpose_to_q8_0(GgmlType::F32, &w, rows, cols).unwrap();
    let rbt = GgmlType::Q8_0.row_bytes(rows).unwrap();
    let wd = dequant_matrix(GgmlType::F32, &w, rows, cols);
    for j in 0..cols {
        let got = dequant(GgmlType::Q8_0, &t[j * rbt..(j + 1) * rbt], rows);
        for i in 0..rows {
            assert_eq!(got[i], wd[i * cols + j]);
        }
    }
}

// === (b) SIMD against the scalar reference ===

/// `(scalar result, Σ_k |coef_k · Wt[idx_k, c]|)` per column.
fn axpy_reference(wt: &[u8], cols: usize, idx: &[u32], coef: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut out = vec![f32::NAN; cols];
    axpy_rows_q8_0_scalar(wt, cols, idx, coef, &mut out).unwrap();
    let rb = GgmlType::Q8_0.row_bytes(cols).unwrap();
    let mut mag = vec![0.0f32; cols];
    for (&i, &c) in idx.iter().zip(coef) {
        let row = dequant(GgmlType::Q8_0, &wt[i as usize * rb..(i as usize + 1) * rb], cols);
        for (m, v) in mag.iter_mut().zip(row) {
            *m += (c * v).abs();
        }
    }
    (out, mag)
}

fn random_coef(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0) * 10f32.powf(r.random_range(-2.0f32..1.0))).collect()
}

#[test]
fn axpy_simd_matches_scalar() {
    let mut r = rng(21);
    let pools: Vec<ThreadPool> = [1, 2, 3].into_iter().map(ThreadPool::new).collect();
    let available = isas();
    eprintln!("axpy isas: {available:?}, default {:?}", AxpyIsa::select(&CpuFeatures::detect()));
    for cols in [32, 64, 96, 288, 544, 576, 1024] {
        let n_rows = 200;
        let wt = random_weights(&mut r, GgmlType::Q8_0, n_rows, cols);
        let mut cases: Vec<Vec<u32>> = vec![
            vec![],
            vec![5],
            vec![n_rows as u32 - 1],
            (0..n_rows as u32).collect(),
            random_subset(&mut r, n_rows, 60),
        ];
        // Unsorted with duplicates.
        cases.push((0..150).map(|_| r.random_range(0..n_rows as u32)).collect());
        cases.push(vec![3, 3, 3, 1, 0, 3]);
        for idx in &cases {
            let coef = random_coef(&mut r, idx.len());
            let (exp, mag) = axpy_reference(&wt, cols, idx, &coef);
            if idx.is_empty() {
                assert!(exp.iter().all(|&v| v == 0.0));
            }
            for &isa in &available {
                for pool in &pools {
                    let mut got = vec![f32::NAN; cols];
                    axpy_rows_q8_0_with(pool, isa, &wt, cols, idx, &coef, &mut got).unwrap();
                    for c in 0..cols {
                        let ok = if isa == AxpyIsa::Scalar {
                            got[c] == exp[c]
                        } else {
                            (got[c] - exp[c]).abs() <= 1e-5 * mag[c] + 1e-30
                        };
                        assert!(
                            ok,
                            "{isa:?} cols {cols} n {} threads {}: out[{c}] = {}, scalar {} (magnitude {})",
                            idx.len(),
                            pool.n_threads(),
                            got[c],
                            exp[c],
                            mag[c]
                        );
                    }
                }
            }
            // The default entry point agrees too.
            let mut got = vec![f32::NAN; cols];
            axpy_rows_q8_0(&pools[1], &wt, cols, idx, &coef, &mut got).unwrap();
            for c in 0..cols {
                assert!((got[c] - exp[c]).abs() <= 1e-5 * mag[c] + 1e-30);
            }
        }
    }
}

#[test]
fn axpy_overwrites_output() {
    let mut r = rng(22);
    let cols = 96;
    let wt = random_weights(&mut r, GgmlType::Q8_0, 10, cols);
    let pool = ThreadPool::new(2);
    for isa in isas() {
        let mut out = vec![123.0f32; cols];
        axpy_rows_q8_0_with(&pool, isa, &wt, cols, &[], &[], &mut out).unwrap();
        assert!(out.iter().all(|&v| v == 0.0), "{isa:?}");
        let mut a = vec![7.0f32; cols];
        let mut b = vec![-1.0f32; cols];
        axpy_rows_q8_0_with(&pool, isa, &wt, cols, &[2, 4], &[0.5, -2.0], &mut a).unwrap();
        axpy_rows_q8_0_with(&pool, isa, &wt, cols, &[2, 4], &[0.5, -2.0], &mut b).unwrap();
        assert_eq!(a, b, "{isa:?}");
    }
}

// === (c) sparse down projection against the dense product ===

/// With every neuron active, `axpy(transpose(W), h)` is `W · h` up to the
/// Q8_0 requantisation of `W`. Per output `i`, each weight is off by at
/// most half a quantisation step of its block of the transpose (plus the
/// f16 rounding of the scale), so `|err_i| <= Σ_k |h_k| · tol(k, i) +
/// 1e-5 · Σ_k |h_k W[i, k]|`. The relative L2 error over all outputs is
/// also required to be below 2e-2 (these weights have wildly varying
/// block scales) and below 6e-3 for uniformly distributed weights.
#[test]
fn all_neurons_axpy_equals_dense_product() {
    let mut r = rng(31);
    let pool = ThreadPool::new(2);
    for ty in TYPES {
        // W_down: dim rows x ffn cols.
        let (dim, ffn) = if ty.block_size() == 256 { (256, 512) } else { (96, 320) };
        let w = random_weights(&mut r, ty, dim, ffn);
        let wd = dequant_matrix(ty, &w, dim, ffn);
        let h = random_acts(&mut r, ffn);
        let wt = transpose_to_q8_0(ty, &w, dim, ffn).unwrap();
        let rbt = GgmlType::Q8_0.row_bytes(dim).unwrap();
        let all: Vec<u32> = (0..ffn as u32).collect();
        for isa in isas() {
            let mut got = vec![f32::NAN; dim];
            axpy_rows_q8_0_with(&pool, isa, &wt, dim, &all, &h, &mut got).unwrap();
            let (mut err2, mut ref2) = (0.0f64, 0.0f64);
            for i in 0..dim {
                let mut exact = 0.0f64;
                let mut bound = 0.0f64;
                let mut mag = 0.0f64;
                for k in 0..ffn {
                    let wv = f64::from(wd[i * ffn + k]);
                    exact += wv * f64::from(h[k]);
                    mag += (wv * f64::from(h[k])).abs();
                    // The Q8_0 block of row k of the transpose holding column i.
                    let blk = &wt[k * rbt + (i / 32) * 34..][..2];
                    let d_stored = f64::from(f16::from_le_bytes([blk[0], blk[1]]).to_f32());
                    let b0 = i / 32 * 32;
                    let amax = (b0..b0 + 32).map(|ii| f64::from(wd[ii * ffn + k].abs())).fold(0.0, f64::max);
                    let d = amax / 127.0;
                    bound += f64::from(h[k]).abs() * (0.5 * d * (1.0 + 1e-5) + 127.0 * (d_stored - d).abs());
                }
                let g = f64::from(got[i]);
                let tol = bound + 1e-5 * mag + 1e-30;
                assert!((g - exact).abs() <= tol, "{ty} {isa:?}: out[{i}] = {g}, dense {exact}, tol {tol}");
                err2 += (g - exact).powi(2);
                ref2 += exact * exact;
            }
            let rel = (err2 / ref2).sqrt();
            // `random_weights` draws every block scale independently over
            // ~2.5 decades, and one Q8_0 block of the transpose mixes 32
            // rows of W: the worst case for requantisation (observed
            // 0.4-1.1%); realistic weights are checked below.
            assert!(rel < 2e-2, "{ty} {isa:?}: relative L2 error {rel}");
            assert!(rel > 0.0);
        }
    }
}

/// Uniform weights in [-1, 1]: Q8_0 requantisation adds an error of
/// rms `d / sqrt(12)` to values of rms `amax / sqrt(3)`, i.e. `1/254` ~ 0.4%
/// relative, and so does the product.
#[test]
fn all_neurons_axpy_on_uniform_weights_is_within_half_a_percent() {
    let mut r = rng(32);
    let pool = ThreadPool::new(2);
    let (dim, ffn) = (576, 1536);
    let wd: Vec<f32> = (0..dim * ffn).map(|_| r.random_range(-1.0f32..1.0)).collect();
    let w: Vec<u8> = wd.iter().flat_map(|v| v.to_le_bytes()).collect();
    let h = random_acts(&mut r, ffn);
    let wt = transpose_to_q8_0(GgmlType::F32, &w, dim, ffn).unwrap();
    let all: Vec<u32> = (0..ffn as u32).collect();
    let mut got = vec![f32::NAN; dim];
    axpy_rows_q8_0(&pool, &wt, dim, &all, &h, &mut got).unwrap();
    let (mut err2, mut ref2) = (0.0f64, 0.0f64);
    for i in 0..dim {
        let exact: f64 = (0..ffn).map(|k| f64::from(wd[i * ffn + k]) * f64::from(h[k])).sum();
        err2 += (f64::from(got[i]) - exact).powi(2);
        ref2 += exact * exact;
    }
    let rel = (err2 / ref2).sqrt();
    assert!(rel < 6e-3 && rel > 1e-4, "relative L2 error {rel}");
}

// === (e) bad input ===

#[test]
fn bad_input_is_an_error() {
    let mut r = rng(41);
    let pool = ThreadPool::new(2);
    let ty = GgmlType::Q4_1;
    let (rows, cols) = (8, 64);
    let rb = ty.row_bytes(cols).unwrap();
    let w = random_weights(&mut r, ty, rows, cols);
    let mut g = vec![1u8, 2, 3];
    assert!(gather_rows(&pool, &w, rb, &[0, 8], &mut g).is_err(), "index out of range");
    assert!(gather_rows(&pool, &w, rb, &[u32::MAX], &mut g).is_err(), "index u32::MAX");
    assert!(gather_rows(&pool, &w[..w.len() - 1], rb, &[0], &mut g).is_err(), "partial row");
    assert!(gather_rows(&pool, &w, 0, &[0], &mut g).is_err(), "zero row size");
    assert!(gather_rows(&pool, &[], rb, &[0], &mut g).is_err(), "empty matrix");
    assert_eq!(g, [1, 2, 3], "dst untouched on error");
    assert!(gather_rows(&pool, &[], rb, &[], &mut g).is_ok());

    // Transpose.
    assert!(transpose_to_q8_0(ty, &w, rows, cols).is_err(), "rows not a multiple of 32");
    let w32 = random_weights(&mut r, ty, 32, cols);
    assert!(transpose_to_q8_0(ty, &w32, 32, cols).is_ok());
    assert!(transpose_to_q8_0(ty, &w32[..w32.len() - 1], 32, cols).is_err(), "short w");
    assert!(transpose_to_q8_0(ty, &w32, 32, cols - 1).is_err(), "cols not block aligned");
    assert!(transpose_to_q8_0(ty, &w32, 64, cols).is_err(), "too many rows");
    assert!(transpose_to_q8_0(ty, &w32, usize::MAX / 32 * 32, cols).is_err(), "overflow");
    assert!(transpose_to_q8_0(GgmlType::Q4_K, &w32, 32, cols).is_err(), "cols not a K block");

    // AXPY.
    let cols = 64;
    let wt = random_weights(&mut r, GgmlType::Q8_0, 10, cols);
    let mut out = vec![0.0f32; cols];
    for isa in isas() {
        let call = |wt: &[u8], cols: usize, idx: &[u32], coef: &[f32], out: &mut [f32]| {
            let a = axpy_rows_q8_0_with(&pool, isa, wt, cols, idx, coef, out);
            let b = axpy_rows_q8_0_scalar(wt, cols, idx, coef, out);
            assert_eq!(a.is_err(), b.is_err());
            a.is_err()
        };
        assert!(call(&wt, cols, &[10], &[1.0], &mut out), "index out of range");
        assert!(call(&wt, cols, &[0, u32::MAX], &[1.0, 1.0], &mut out), "index u32::MAX");
        assert!(call(&wt, 48, &[0], &[1.0], &mut out[..48]), "cols not a multiple of 32");
        assert!(call(&wt, 0, &[], &[], &mut out[..0]), "zero cols");
        assert!(call(&wt, 96, &[0], &[1.0], &mut vec![0.0; 96]), "wt not whole rows");
        assert!(call(&wt[..wt.len() - 1], cols, &[0], &[1.0], &mut out), "short wt");
        assert!(call(&wt, cols, &[0, 1], &[1.0], &mut out), "coef shorter than idx");
        assert!(call(&wt, cols, &[0], &[1.0, 2.0], &mut out), "coef longer than idx");
        assert!(call(&wt, cols, &[0], &[1.0], &mut out[..32]), "short out");
        assert!(call(&wt, cols, &[0], &[1.0], &mut vec![0.0; 96]), "long out");
        assert!(!call(&wt, cols, &[9, 0], &[1.0, 1.0], &mut out), "valid call");
    }
}

// === (f) exact neuron-major form ===

const NM_TYPES: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

/// `(outputs, neurons)` = `(dim, ffn)`: the SmolLM2 shape, small ones, and
/// output counts that are not a multiple of 16 (padded code rows).
const NM_SHAPES: [(usize, usize); 6] = [(576, 1536), (40, 64), (17, 96), (1, 32), (16, 32), (200, 320)];

/// Random weights with the sign of some block scales flipped (so that
/// `d * 0` is `-0.0` somewhere).
fn nm_weights(r: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let mut w = random_weights(r, ty, rows, cols);
    for blk in w.chunks_exact_mut(ty.type_size()) {
        if r.random_bool(0.3) {
            blk[1] ^= 0x80;
        }
    }
    w
}

#[test]
fn neuron_major_reconstructs_dequantize_row_bitwise() {
    let mut r = rng(61);
    for ty in NM_TYPES {
        for (rows, cols) in NM_SHAPES {
            let w = nm_weights(&mut r, ty, rows, cols);
            let nm = NeuronMajor::from_weights(ty, &w, rows, cols).unwrap();
            assert_eq!((nm.outputs(), nm.neurons(), nm.wtype()), (rows, cols, ty));
            assert_eq!(nm.has_min(), ty == GgmlType::Q4_1);
            // As many bytes as the GGUF matrix (codes stay 4- or 8-bit, scales
            // f16), plus the padding of the outputs to a multiple of 32.
            let payload = nm.bytes() - std::mem::size_of::<NeuronMajor>();
            assert!(payload >= w.len(), "{ty} {rows}x{cols}: {payload} bytes for {} GGUF bytes", w.len());
            if rows % 32 == 0 {
                assert_eq!(payload, w.len(), "{ty} {rows}x{cols}");
            }
            let wd = dequant_matrix(ty, &w, rows, cols);
            let mut neg_zero = 0;
            for i in 0..rows {
                for j in 0..cols {
                    let q = nm.code(i, j);
                    let (d, m) = nm.block_scale(i, j / 32);
                    let v = d * f32::from(q) + m;
                    let want = wd[i * cols + j];
                    assert_eq!(v.to_bits(), want.to_bits(), "{ty} {rows}x{cols}: W[{i}, {j}] = {want}, d*q+m = {v}");
                    assert_eq!(nm.weight(i, j).to_bits(), want.to_bits());
                    match ty {
                        GgmlType::Q4_0 => assert!((-8..8).contains(&q)),
                        GgmlType::Q4_1 => assert!((0..16).contains(&q)),
                        _ => {}
                    }
                    neg_zero += usize::from(want.to_bits() == (-0.0f32).to_bits());
                }
            }
            if rows * cols >= 1536 {
                assert!(neg_zero > 0 || ty == GgmlType::Q4_1, "{ty}: no -0.0 weight exercised");
            }
        }
    }
}

/// `(f64 Σ_k coef_k W[i, idx_k], scale)` per output, where `scale` is the
/// error scale of the factorised sum `Σ_B d·S_B + m·H_B`:
/// `Σ_k |coef_k| (|d q| + |m|)`, i.e. `Σ_k |coef_k W[i, idx_k]|` for types
/// without a minimum. (For Q4_1 a weight `d q + m` can cancel to exactly 0
/// while `d S` and `m H` round separately.)
fn nm_exact(nm: &NeuronMajor, idx: &[u32], coef: &[f32]) -> (Vec<f64>, Vec<f64>) {
    (0..nm.outputs())
        .map(|i| {
            idx.iter().zip(coef).fold((0.0, 0.0), |(s, mag), (&j, &c)| {
                let j = j as usize;
                let (d, m) = nm.block_scale(i, j / 32);
                let dq = f64::from(d) * f64::from(nm.code(i, j));
                let c = f64::from(c);
                (s + f64::from(nm.weight(i, j)) * c, mag + c.abs() * (dq.abs() + f64::from(m).abs()))
            })
        })
        .unzip()
}

/// With every neuron active, the AXPY is the dense product of the
/// dequantised `W` up to f32 rounding: no requantisation.
#[test]
fn neuron_major_all_neurons_equals_dense_product() {
    let mut r = rng(62);
    let pools: Vec<ThreadPool> = [1, 2, 3].into_iter().map(ThreadPool::new).collect();
    for ty in NM_TYPES {
        for (dim, ffn) in NM_SHAPES {
            let w = nm_weights(&mut r, ty, dim, ffn);
            let wd = dequant_matrix(ty, &w, dim, ffn);
            let nm = NeuronMajor::from_weights(ty, &w, dim, ffn).unwrap();
            let h = random_acts(&mut r, ffn);
            let all: Vec<u32> = (0..ffn as u32).collect();
            let mut worst = 0.0f64;
            for isa in isas() {
                for pool in &pools {
                    let mut got = vec![f32::NAN; dim];
                    nm.axpy_with(pool, isa, &all, &h, &mut got).unwrap();
                    for i in 0..dim {
                        let (mut exact, mut mag) = (0.0f64, 0.0f64);
                        for j in 0..ffn {
                            let t = f64::from(wd[i * ffn + j]) * f64::from(h[j]);
                            exact += t;
                            mag += t.abs();
                        }
                        let e = (f64::from(got[i]) - exact).abs();
                        worst = worst.max(e / mag);
                        assert!(
                            e <= 1e-5 * mag + 1e-30,
                            "{ty} {dim}x{ffn} {isa:?} {}t: out[{i}] = {}, dense {exact} (magnitude {mag})",
                            pool.n_threads(),
                            got[i]
                        );
                    }
                }
            }
            if dim == 576 {
                eprintln!("{ty} {dim}x{ffn}: worst |err| / Σ|terms| = {worst:.2e}");
            }
        }
    }
}

#[test]
fn neuron_major_simd_matches_scalar() {
    let mut r = rng(63);
    let pools: Vec<ThreadPool> = [1, 2, 3].into_iter().map(ThreadPool::new).collect();
    for ty in NM_TYPES {
        for (dim, ffn) in NM_SHAPES {
            let w = nm_weights(&mut r, ty, dim, ffn);
            let nm = NeuronMajor::from_weights(ty, &w, dim, ffn).unwrap();
            let mut cases: Vec<Vec<u32>> = vec![
                vec![],
                vec![0],
                vec![ffn as u32 - 1],
                vec![r.random_range(0..ffn as u32)],
                (0..ffn as u32).collect(),
                random_subset(&mut r, ffn, ffn * 3 / 10),
                random_subset(&mut r, ffn, ffn / 2),
                random_subset(&mut r, ffn, ffn.div_ceil(10)),
            ];
            // One whole neuron block, and its first and last neurons.
            cases.push((0..32).collect());
            let mut ends = vec![0, 31, ffn as u32 - 32, ffn as u32 - 1];
            ends.sort_unstable();
            ends.dedup();
            cases.push(ends);
            for idx in &cases {
                let coef = random_coef(&mut r, idx.len());
                let mut exp = vec![f32::NAN; dim];
                nm.axpy_scalar(idx, &coef, &mut exp).unwrap();
                let (exact, mag) = nm_exact(&nm, idx, &coef);
                for i in 0..dim {
                    assert!(
                        (f64::from(exp[i]) - exact[i]).abs() <= 1e-5 * mag[i] + 1e-30,
                        "{ty} {dim}x{ffn} n {}: scalar out[{i}] = {}, exact {}",
                        idx.len(),
                        exp[i],
                        exact[i]
                    );
                }
                if idx.is_empty() {
                    assert!(exp.iter().all(|&v| v == 0.0));
                }
                for &isa in &isas() {
                    for pool in &pools {
                        let mut got = vec![f32::NAN; dim];
                        nm.axpy_with(pool, isa, idx, &coef, &mut got).unwrap();
                        for i in 0..dim {
                            let ok = if isa == AxpyIsa::Scalar {
                                got[i].to_bits() == exp[i].to_bits()
                            } else {
                                f64::from((got[i] - exp[i]).abs()) <= 1e-5 * mag[i] + 1e-30
                            };
                            assert!(
                                ok,
                                "{ty} {dim}x{ffn} {isa:?} n {} threads {}: out[{i}] = {}, scalar {} (magnitude {})",
                                idx.len(),
                                pool.n_threads(),
                                got[i],
                                exp[i],
                                mag[i]
                            );
                        }
                    }
                }
                let mut got = vec![f32::NAN; dim];
                nm.axpy(&pools[1], idx, &coef, &mut got).unwrap();
                for i in 0..dim {
                    assert!(f64::from((got[i] - exp[i]).abs()) <= 1e-5 * mag[i] + 1e-30);
                }
            }
        }
    }
}

#[test]
fn neuron_major_bad_input_is_an_error() {
    let mut r = rng(64);
    let pool = ThreadPool::new(2);
    let pool1 = ThreadPool::new(1);
    let (rows, cols) = (40, 96);
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::F32, GgmlType::F16] {
        let c = if ty.block_size() == 256 { 256 } else { cols };
        let w = random_weights(&mut r, ty, rows, c);
        assert!(NeuronMajor::from_weights(ty, &w, rows, c).is_err(), "{ty} is unsupported");
    }
    let ty = GgmlType::Q4_1;
    let w = random_weights(&mut r, ty, rows, cols);
    assert!(NeuronMajor::from_weights(ty, &w[..w.len() - 1], rows, cols).is_err(), "short w");
    assert!(NeuronMajor::from_weights(ty, &w, rows + 1, cols).is_err(), "too many rows");
    assert!(NeuronMajor::from_weights(ty, &w, rows - 1, cols).is_err(), "too few rows");
    assert!(NeuronMajor::from_weights(ty, &w, rows, cols - 16).is_err(), "cols not a multiple of 32");
    assert!(NeuronMajor::from_weights(ty, &w, usize::MAX / 2, cols).is_err(), "overflow");
    assert!(NeuronMajor::from_weights(ty, &[], 0, cols).is_ok_and(|nm| nm.outputs() == 0));

    let nm = NeuronMajor::from_weights(ty, &w, rows, cols).unwrap();
    let mut out = vec![5.0f32; rows];
    let n = cols as u32;
    let bad: [(&str, Vec<u32>, usize, usize); 9] = [
        ("unsorted", vec![3, 1], 2, rows),
        ("duplicate", vec![2, 2], 2, rows),
        ("duplicate after others", vec![0, 7, 9, 9, 12], 5, rows),
        ("index out of range", vec![0, n], 2, rows),
        ("index u32::MAX", vec![u32::MAX], 1, rows),
        ("coef shorter than idx", vec![0, 1], 1, rows),
        ("coef longer than idx", vec![0], 2, rows),
        ("short out", vec![0], 1, rows - 1),
        ("long out", vec![0], 1, rows + 1),
    ];
    for (what, idx, nc, no) in bad {
        let coef = vec![1.0f32; nc];
        let mut o = vec![5.0f32; no];
        assert!(nm.axpy_scalar(&idx, &coef, &mut o).is_err(), "scalar: {what}");
        assert!(nm.axpy(&pool, &idx, &coef, &mut o).is_err(), "{what}");
        assert!(nm.axpy_fast_scalar(&idx, &coef, &mut o).is_err(), "fast scalar: {what}");
        for p in [&pool1, &pool] {
            assert!(nm.axpy_fast(p, &idx, &coef, &mut o).is_err(), "fast {}t: {what}", p.n_threads());
        }
        for isa in isas() {
            assert!(nm.axpy_with(&pool, isa, &idx, &coef, &mut o).is_err(), "{isa:?}: {what}");
        }
        assert!(o.iter().all(|&v| v == 5.0), "{what}: out untouched on error");
    }
    assert!(nm.axpy(&pool, &[0, n - 1], &[1.0, 1.0], &mut out).is_ok(), "valid call");
    assert!(nm.axpy(&pool, &[], &[], &mut out).is_ok() && out.iter().all(|&v| v == 0.0), "empty overwrites");
    out.fill(5.0);
    assert!(nm.axpy_fast(&pool, &[], &[], &mut out).is_ok() && out.iter().all(|&v| v == 0.0), "fast: empty overwrites");
    out.fill(5.0);
    assert!(nm.axpy_fast_scalar(&[], &[], &mut out).is_ok() && out.iter().all(|&v| v == 0.0), "fast scalar: empty");
}

// === NeuronMajor int8 ("fast") AXPY ===

/// Index sets for the fast AXPY: empty, single neurons, all, random subsets
/// of several densities, whole blocks and runs whose length is not a
/// multiple of 4 (padded quads).
fn fast_cases(r: &mut StdRng, ffn: usize) -> Vec<Vec<u32>> {
    let n = ffn as u32;
    let mut cases: Vec<Vec<u32>> = vec![
        vec![],
        vec![0],
        vec![n - 1],
        vec![r.random_range(0..n)],
        (0..n).collect(),
        (0..32).collect(),
        (0..5).collect(),
        (1..4).collect(),
        (n - 7..n).collect(),
    ];
    for pct in [10, 30, 50, 70, 90] {
        cases.push(random_subset(r, ffn, (ffn * pct / 100).max(1)));
    }
    if ffn >= 64 {
        // Runs of 7, 1 and 6 neurons in consecutive blocks.
        let mut v: Vec<u32> = (25..32).chain([40]).chain(58..64).collect();
        v.dedup();
        cases.push(v);
    }
    cases
}

/// Random coefficients for `idx`, never all zero: mixed signs and
/// magnitudes, some exact zeros, a large outlier per case and, when there
/// are several blocks, one block whose coefficients are all zero.
fn fast_coef(r: &mut StdRng, idx: &[u32]) -> Vec<f32> {
    let mut c = random_coef(r, idx.len());
    for v in c.iter_mut() {
        if r.random_bool(0.05) {
            *v = 0.0;
        }
    }
    if let Some(v) = c.first_mut() {
        *v = if r.random_bool(0.5) { 25.0 } else { -25.0 };
    }
    if let (Some(&first), Some(&last)) = (idx.first(), idx.last())
        && last / 32 > first / 32
    {
        for (v, _) in c.iter_mut().zip(idx).filter(|(_, j)| **j / 32 == last / 32) {
            *v = 0.0;
        }
    }
    c
}

#[test]
fn neuron_major_fast_simd_matches_scalar() {
    let mut r = rng(65);
    // 3 threads leave one idle (the threads work in pairs), 4 make two pairs.
    let pools: Vec<ThreadPool> = [1, 2, 3, 4].into_iter().map(ThreadPool::new).collect();
    let int8 = NeuronMajor::axpy_fast_is_int8();
    eprintln!("axpy_fast int8 implementation: {int8}");
    for ty in NM_TYPES {
        for (dim, ffn) in NM_SHAPES {
            let w = nm_weights(&mut r, ty, dim, ffn);
            let nm = NeuronMajor::from_weights(ty, &w, dim, ffn).unwrap();
            for idx in fast_cases(&mut r, ffn) {
                let coef = fast_coef(&mut r, &idx);
                let mut exp = vec![f32::NAN; dim];
                if int8 {
                    nm.axpy_fast_scalar(&idx, &coef, &mut exp).unwrap();
                } else {
                    // Without VNNI + VBMI, `axpy_fast` is the f32 `axpy`.
                    nm.axpy(&pools[0], &idx, &coef, &mut exp).unwrap();
                }
                if idx.is_empty() {
                    assert!(exp.iter().all(|&v| v == 0.0));
                }
                let (_, mag) = nm_exact(&nm, &idx, &coef);
                for pool in &pools {
                    let mut got = vec![f32::NAN; dim];
                    nm.axpy_fast(pool, &idx, &coef, &mut got).unwrap();
                    for i in 0..dim {
                        // Exact integer sums and the same flush order: bit for
                        // bit, which implies the 1e-5 relative tolerance.
                        let close = f64::from((got[i] - exp[i]).abs()) <= 1e-5 * mag[i] + 1e-30;
                        assert!(
                            got[i].to_bits() == exp[i].to_bits() && close,
                            "{ty} {dim}x{ffn} n {} threads {}: fast out[{i}] = {}, scalar {} (magnitude {})",
                            idx.len(),
                            pool.n_threads(),
                            got[i],
                            exp[i],
                            mag[i]
                        );
                    }
                }
            }
        }
    }
}

/// `axpy_fast_scalar` against the exact f64 product: the error is at most
/// the int8 rounding of the coefficients, `Σ_B (scale_B / 2) |d[i, B]|
/// Σ_{j ∈ B} |q[i, j]|` (`|coef − scale · c8| <= scale / 2` for every
/// neuron), plus f32 rounding of the sums. The same bound holds against
/// the f32 `axpy_scalar` (plus its own rounding), which it must not equal
/// everywhere (it quantises). (A plain relative tolerance such as 1e-2 of
/// `Σ |coef · W|` does not hold: one large coefficient sets the scale of
/// its whole block run, see `fast_coef`.)
#[test]
fn neuron_major_fast_scalar_is_within_int8_error() {
    let mut r = rng(66);
    for ty in NM_TYPES {
        for (dim, ffn) in NM_SHAPES {
            let w = nm_weights(&mut r, ty, dim, ffn);
            let nm = NeuronMajor::from_weights(ty, &w, dim, ffn).unwrap();
            let (mut worst, mut rel, mut differ, mut total) = (0.0f64, 0.0f64, 0usize, 0usize);
            for idx in fast_cases(&mut r, ffn) {
                let coef = fast_coef(&mut r, &idx);
                let mut got = vec![f32::NAN; dim];
                nm.axpy_fast_scalar(&idx, &coef, &mut got).unwrap();
                let mut f32_ref = vec![f32::NAN; dim];
                nm.axpy_scalar(&idx, &coef, &mut f32_ref).unwrap();
                let (exact, mag) = nm_exact(&nm, &idx, &coef);
                // Per block: the int8 scale of its run.
                let mut scale = vec![0.0f64; ffn / 32];
                for (&j, &c) in idx.iter().zip(&coef) {
                    let b = j as usize / 32;
                    scale[b] = scale[b].max(f64::from(c.abs()) / 127.0);
                }
                for i in 0..dim {
                    let qerr: f64 = idx
                        .iter()
                        .map(|&j| {
                            let j = j as usize;
                            let (d, _) = nm.block_scale(i, j / 32);
                            0.5 * scale[j / 32] * f64::from(d).abs() * f64::from(nm.code(i, j)).abs()
                        })
                        .sum();
                    let bound = qerr * (1.0 + 1e-4) + 2e-5 * mag[i] + 1e-30;
                    let e = (f64::from(got[i]) - exact[i]).abs();
                    assert!(
                        e <= bound,
                        "{ty} {dim}x{ffn} n {}: fast scalar out[{i}] = {}, exact {} (|err| {e:.3e} > bound {bound:.3e})",
                        idx.len(),
                        got[i],
                        exact[i]
                    );
                    if qerr > 0.0 {
                        worst = worst.max(e / bound);
                    }
                    // The f32 AXPY is within 1e-5 of `mag` of the exact sum.
                    let e32 = f64::from((got[i] - f32_ref[i]).abs());
                    assert!(
                        e32 <= bound + 1e-5 * mag[i],
                        "{ty} {dim}x{ffn}: out[{i}] {} vs f32 {}",
                        got[i],
                        f32_ref[i]
                    );
                    rel = rel.max(e32 / mag[i].max(1e-30));
                    differ += usize::from(got[i] != f32_ref[i]);
                    total += 1;
                }
            }
            assert!(differ > 0, "{ty} {dim}x{ffn}: the int8 AXPY never differed from the f32 one");
            if dim == 576 {
                eprintln!(
                    "{ty} {dim}x{ffn}: worst |err| / int8 bound = {worst:.3}; vs f32 worst |diff| / Σ|terms| = {rel:.2e}; {differ}/{total} differ"
                );
            }
        }
    }
}

/// A run's largest coefficient is exactly `±127 · scale`: with one active
/// neuron the fast AXPY is `d · (f32(127 q) · (|c| / 127)) (+ m c)`.
#[test]
fn neuron_major_fast_single_neuron_is_nearly_exact() {
    let mut r = rng(67);
    for ty in NM_TYPES {
        let (dim, ffn) = (200, 320);
        let w = nm_weights(&mut r, ty, dim, ffn);
        let nm = NeuronMajor::from_weights(ty, &w, dim, ffn).unwrap();
        for j in [0u32, 31, 32, 77, 319] {
            let c = r.random_range(0.01f32..5.0) * if r.random_bool(0.5) { -1.0 } else { 1.0 };
            let mut got = vec![f32::NAN; dim];
            nm.axpy_fast_scalar(&[j], &[c], &mut got).unwrap();
            for (i, &g) in got.iter().enumerate() {
                let want = f64::from(nm.weight(i, j as usize)) * f64::from(c);
                let (d, m) = nm.block_scale(i, j as usize / 32);
                let mag =
                    f64::from(c.abs()) * (f64::from(d * f32::from(nm.code(i, j as usize))).abs() + f64::from(m).abs());
                assert!(
                    (f64::from(g) - want).abs() <= 1e-6 * mag + 1e-30,
                    "{ty} neuron {j} out[{i}] = {g}, want {want}"
                );
            }
        }
    }
}
