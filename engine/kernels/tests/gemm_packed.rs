//! The prepacked GEMM (`spinfer_kernels::matmul::gemm_packed`, BF16, F32
//! and I16) against its scalar reference on random data: ragged shapes (rows,
//! columns and tokens that are not multiples of the panels, vectors, pairs
//! or token tiles), fused parts, 1 to 3 threads, bias and epilogue; plus the
//! properties the encoder relies on (an output does not depend on the other
//! tokens of the call; F32 is bit for bit the FMA chain from the bias, I16
//! the quantised arithmetic) and the accuracy of BF16 and I16 against the
//! f32 product.

mod kernels_common;

use kernels_common::*;
use rand::Rng;
use rand::rngs::StdRng;
use spinfer_kernels::GgmlType;
use spinfer_kernels::matmul::gemm_packed::{
    PackedMatrix, PackedType, gemm_packed, gemm_packed_scalar, packed_simd_available,
};
use spinfer_kernels::pool::ThreadPool;

const TYPES: [PackedType; 3] = [PackedType::Bf16, PackedType::F32, PackedType::I16];

fn acts(r: &mut StdRng, n: usize) -> Vec<f32> {
    // Magnitudes over three decades, signs mixed, never all zero.
    (0..n).map(|_| r.random_range(-1.0f32..1.0) * 10f32.powf(r.random_range(-2.0f32..1.0))).collect()
}

/// `Σ_c |W[r, c] · x[t, c]|` of the values the kernel multiplies (bf16 or
/// f32): the scale of an output's rounding error.
fn packed_magnitude(w: &PackedMatrix, x: &[f32], t: usize, r: usize) -> f32 {
    let cols = w.cols();
    (0..cols)
        .map(|c| {
            let xv = x[t * cols + c];
            let xv = if w.ty() == PackedType::Bf16 { half::bf16::from_f32(xv).to_f32() } else { xv };
            (w.weight(r, c) * xv).abs()
        })
        .sum()
}

fn run(pool: &ThreadPool, w: &PackedMatrix, x: &[f32], n: usize, bias: Option<&[f32]>) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * w.rows()];
    let mut scratch = Vec::new();
    gemm_packed(pool, w, x, n, bias, &mut out, &mut scratch, None).unwrap();
    out
}

/// `got` against the scalar reference `want`: F32 and I16 bit for bit
/// (I16's sums are exact integers, then the same f32 operations); BF16 within
/// f32 rounding of the magnitude (`vdpbf16ps` may round its two products
/// differently from two fused adds).
fn assert_close(w: &PackedMatrix, x: &[f32], bias: Option<&[f32]>, got: &[f32], want: &[f32], what: &str) {
    let rows = w.rows();
    for (i, (&g, &e)) in got.iter().zip(want).enumerate() {
        let (t, row) = (i / rows, i % rows);
        if g.is_nan() && e.is_nan() {
            continue; // NaN payloads may differ between SIMD and libm
        }
        if w.ty() == PackedType::I16 || (w.ty() == PackedType::F32 && packed_simd_available(PackedType::F32)) {
            assert_eq!(g.to_bits(), e.to_bits(), "{what}: out[{t}, {row}] = {g}, scalar {e}");
        } else {
            let m = packed_magnitude(w, x, t, row) + bias.map_or(0.0, |b| b[row].abs());
            assert!((g - e).abs() <= 2e-6 * m + 1e-30, "{what}: out[{t}, {row}] = {g}, scalar {e} (magnitude {m})");
        }
    }
}

#[test]
fn simd_matches_the_scalar_reference_on_ragged_shapes() {
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut seed = 1;
    for &(rows, cols) in &[(48, 32), (16, 2), (1, 1), (17, 33), (100, 65), (384, 384), (200, 130), (95, 1536)] {
        for &n in &[1usize, 3, 8, 9, 17, 40] {
            seed += 1;
            let mut r = rng(seed);
            let w = random_weights(&mut r, GgmlType::F32, rows, cols);
            let x = acts(&mut r, n * cols);
            let bias: Vec<f32> = (0..rows).map(|_| r.random_range(-1.0f32..1.0)).collect();
            for ty in TYPES {
                let packed = PackedMatrix::pack(ty, &[(GgmlType::F32, &w, rows)], cols).unwrap();
                let mut want = vec![0.0f32; n * rows];
                gemm_packed_scalar(&packed, &x, n, Some(&bias), &mut want).unwrap();
                assert!(want.iter().any(|&v| v != 0.0));
                for pool in &pools {
                    let got = run(pool, &packed, &x, n, Some(&bias));
                    let what = format!("{ty:?} {rows}x{cols} n={n} threads={}", pool.n_threads());
                    assert_close(&packed, &x, Some(&bias), &got, &want, &what);
                }
            }
        }
    }
}

#[test]
fn fused_parts_of_f32_f16_bf16_weights_without_bias() {
    let pool = ThreadPool::new(2);
    let mut r = rng(77);
    let cols = 96;
    let parts_rows = [40usize, 24, 70];
    let types = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];
    let ws: Vec<Vec<u8>> = parts_rows.iter().zip(types).map(|(&n, ty)| random_weights(&mut r, ty, n, cols)).collect();
    let parts: Vec<(GgmlType, &[u8], usize)> =
        types.iter().zip(&ws).zip(parts_rows).map(|((&ty, w), n)| (ty, w.as_slice(), n)).collect();
    let n = 13;
    let x = acts(&mut r, n * cols);
    for ty in TYPES {
        let fused = PackedMatrix::pack(ty, &parts, cols).unwrap();
        assert_eq!((fused.rows(), fused.cols()), (134, 96));
        let got = run(&pool, &fused, &x, n, None);
        // Each part alone gives the same outputs, bit for bit (same order
        // of operations, rows independent).
        let mut row0 = 0;
        for &(wt, w, rows) in &parts {
            let alone = PackedMatrix::pack(ty, &[(wt, w, rows)], cols).unwrap();
            let a = run(&pool, &alone, &x, n, None);
            for t in 0..n {
                for j in 0..rows {
                    let (g, e) = (got[t * 134 + row0 + j], a[t * rows + j]);
                    assert_eq!(g.to_bits(), e.to_bits(), "{ty:?} {wt:?} token {t} row {j}");
                }
            }
            row0 += rows;
        }
        let mut want = vec![0.0f32; n * 134];
        gemm_packed_scalar(&fused, &x, n, None, &mut want).unwrap();
        assert_close(&fused, &x, None, &got, &want, &format!("{ty:?} fused"));
    }
}

#[test]
fn an_output_does_not_depend_on_the_other_tokens_or_threads() {
    let mut r = rng(5);
    let (rows, cols, n) = (150, 200, 21);
    let w = random_weights(&mut r, GgmlType::F32, rows, cols);
    let x = acts(&mut r, n * cols);
    for ty in TYPES {
        let packed = PackedMatrix::pack(ty, &[(GgmlType::F32, &w, rows)], cols).unwrap();
        let all = run(&ThreadPool::new(3), &packed, &x, n, None);
        let pool = ThreadPool::new(2);
        for t in [0, 7, 8, 20] {
            let one = run(&pool, &packed, &x[t * cols..(t + 1) * cols], 1, None);
            for j in 0..rows {
                assert_eq!(one[j].to_bits(), all[t * rows + j].to_bits(), "{ty:?} token {t} row {j}");
            }
        }
    }
}

#[test]
fn bf16_is_close_to_the_f32_product_and_the_epilogue_runs_once_per_output() {
    let pool = ThreadPool::new(2);
    let mut r = rng(11);
    let (rows, cols, n) = (70, 384, 10);
    let wf: Vec<f32> = (0..rows * cols).map(|_| r.random_range(-0.1f32..0.1)).collect();
    let x = acts(&mut r, n * cols);
    let packed = PackedMatrix::from_f32(PackedType::Bf16, &wf, rows, cols).unwrap();
    let mut out = vec![0.0f32; n * rows];
    let mut scratch = Vec::new();
    let epi = |s: &mut [f32]| s.iter_mut().for_each(|v| *v = *v * 2.0 + 1.0);
    gemm_packed(&pool, &packed, &x, n, None, &mut out, &mut scratch, Some(&epi)).unwrap();
    let mut worst = 0.0f64;
    for t in 0..n {
        for j in 0..rows {
            let exact: f64 = (0..cols).map(|c| f64::from(wf[j * cols + c]) * f64::from(x[t * cols + c])).sum();
            let mag: f64 = (0..cols).map(|c| f64::from((wf[j * cols + c] * x[t * cols + c]).abs())).sum();
            let got = (f64::from(out[t * rows + j]) - 1.0) / 2.0;
            // Two roundings to 8 significant bits: at most 2⁻⁸ of the
            // magnitude (far less on average).
            assert!((got - exact).abs() <= mag / 256.0, "token {t} row {j}: {got} vs f32 {exact} (magnitude {mag})");
            worst = worst.max((got - exact).abs() / mag);
        }
    }
    assert!(worst > 0.0, "bf16 rounding must show");
}

#[test]
fn shape_errors_are_reported() {
    let pool = ThreadPool::new(1);
    for ty in TYPES {
        let packed = PackedMatrix::from_f32(ty, &[1.0; 12], 3, 4).unwrap();
        let mut out = vec![0.0f32; 6];
        let mut s = Vec::new();
        assert!(gemm_packed(&pool, &packed, &[0.0; 7], 2, None, &mut out, &mut s, None).is_err());
        assert!(gemm_packed(&pool, &packed, &[0.0; 8], 2, Some(&[0.0; 2]), &mut out, &mut s, None).is_err());
        assert!(gemm_packed(&pool, &packed, &[0.0; 8], 2, None, &mut out[..5], &mut s, None).is_err());
        gemm_packed(&pool, &packed, &[1.0; 8], 2, Some(&[0.5, 0.0, -1.0]), &mut out, &mut s, None).unwrap();
        // I16: 4 · 8191 · 4095 in f32 times the two scales, within a few
        // roundings of 4.
        let tol = if ty == PackedType::I16 { 1e-6 } else { 0.0 };
        for (g, e) in out.iter().zip([4.5, 4.0, 3.0, 4.5, 4.0, 3.0]) {
            assert!((g - e).abs() <= tol, "{ty:?}: {out:?}");
        }
    }
}

/// The encoder's shapes (all-MiniLM-L6-v2: K of 384 and 1536, QKV fused)
/// on the AMX tile kernel where the OS grants the tiles (else the same
/// check runs the `vdpbf16ps` kernel, and says so).
#[test]
fn bf16_tiles_match_the_scalar_reference_on_encoder_shapes() {
    use spinfer_kernels::matmul::gemm_packed::amx_available;
    if !amx_available() {
        eprintln!("AMX tiles not granted here (or SPINFER_CPU caps them): the vdpbf16ps kernel runs this check");
    }
    let pool = ThreadPool::new(2);
    let mut r = rng(1234);
    for &(rows, cols, n) in &[(1152, 384, 37), (384, 1536, 64), (1536, 384, 5), (100, 32, 33)] {
        let w = random_weights(&mut r, GgmlType::F32, rows, cols);
        let x = acts(&mut r, n * cols);
        let bias: Vec<f32> = (0..rows).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let packed = PackedMatrix::pack(PackedType::Bf16, &[(GgmlType::F32, &w, rows)], cols).unwrap();
        let mut want = vec![0.0f32; n * rows];
        gemm_packed_scalar(&packed, &x, n, Some(&bias), &mut want).unwrap();
        let got = run(&pool, &packed, &x, n, Some(&bias));
        assert_close(&packed, &x, Some(&bias), &got, &want, &format!("{rows}x{cols} n={n}"));
    }
}

/// Calls large enough that the AVX2 kernel splits them: tokens in chunks
/// (about 1 MiB of activations each: 30 tokens at K = 8000, 168 at 1536),
/// rows in blocks (256 KiB of weights: 16 rows at K = 8000), over 1 to 3
/// threads; still the scalar reference bit for bit, epilogue once per
/// output.
#[test]
fn large_calls_split_into_token_chunks_and_row_blocks() {
    let mut r = rng(4321);
    for &(rows, cols, n) in &[(70, 8000, 71), (50, 1536, 200)] {
        let w = random_weights(&mut r, GgmlType::F32, rows, cols);
        let x = acts(&mut r, n * cols);
        let bias: Vec<f32> = (0..rows).map(|_| r.random_range(-1.0f32..1.0)).collect();
        for ty in [PackedType::F32, PackedType::I16] {
            let packed = PackedMatrix::pack(ty, &[(GgmlType::F32, &w, rows)], cols).unwrap();
            let mut want = vec![0.0f32; n * rows];
            gemm_packed_scalar(&packed, &x, n, Some(&bias), &mut want).unwrap();
            for threads in 1..=3 {
                let mut got = vec![f32::NAN; n * rows];
                let epi = |s: &mut [f32]| s.iter_mut().for_each(|v| *v = -*v);
                gemm_packed(
                    &ThreadPool::new(threads),
                    &packed,
                    &x,
                    n,
                    Some(&bias),
                    &mut got,
                    &mut Vec::new(),
                    Some(&epi),
                )
                .unwrap();
                got.iter_mut().for_each(|v| *v = -*v);
                let what = format!("{ty:?} {rows}x{cols} n={n} threads={threads}");
                assert_close(&packed, &x, Some(&bias), &got, &want, &what);
            }
        }
    }
}

/// I16 against the exact (f64) product of the f32 operands: 13-bit
/// weights per row and 14-bit activations per 64 columns, each within half
/// a step of its row's or block's largest value, bound the error by
/// `Σ_c |w| · |x| · (2⁻¹³ + 2⁻¹⁴)` relative to those largest values; on
/// random data it is far below 2⁻¹¹ of `Σ_c max|w| · max|x|`. NaN in an
/// activation block makes that token's outputs NaN, as in f32.
#[test]
fn i16_is_close_to_the_f32_product_and_propagates_nan() {
    let pool = ThreadPool::new(2);
    let mut r = rng(12);
    let (rows, cols, n) = (70, 1536, 9);
    let wf: Vec<f32> = (0..rows * cols).map(|_| r.random_range(-0.1f32..0.1)).collect();
    let mut x = acts(&mut r, n * cols);
    let packed = PackedMatrix::from_f32(PackedType::I16, &wf, rows, cols).unwrap();
    let out = run(&pool, &packed, &x, n, None);
    let mut worst = 0.0f64;
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        for j in 0..rows {
            let wr = &wf[j * cols..(j + 1) * cols];
            let exact: f64 = wr.iter().zip(xt).map(|(&w, &v)| f64::from(w) * f64::from(v)).sum();
            let wmax = wr.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let bound: f64 = xt
                .chunks(64)
                .map(|b| {
                    let xmax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    f64::from(wmax) * f64::from(xmax) * b.len() as f64
                })
                .sum();
            let err = (f64::from(out[t * rows + j]) - exact).abs();
            assert!(err <= bound / 2048.0, "token {t} row {j}: {} vs f32 {exact} (bound {bound})", out[t * rows + j]);
            worst = worst.max(err / bound);
        }
    }
    assert!(worst > 0.0, "the quantisation must show");
    // A block too small to scale (zeros), one just large enough, and a
    // NaN: the SIMD quantisation still equals the scalar one.
    x[5 * cols..5 * cols + 64].iter_mut().for_each(|v| *v *= 1e-37);
    x[6 * cols + 64..6 * cols + 128].iter_mut().for_each(|v| *v *= 1e-33);
    x[3 * cols + 100] = f32::NAN;
    let out = run(&pool, &packed, &x, n, None);
    let mut want = vec![0.0f32; n * rows];
    gemm_packed_scalar(&packed, &x, n, None, &mut want).unwrap();
    assert_close(&packed, &x, None, &out, &want, "tiny blocks and NaN");
    assert!(out[3 * rows..4 * rows].iter().all(|v| v.is_nan()));
    assert!(out[..3 * rows].iter().chain(&out[4 * rows..]).all(|v| v.is_finite()));
}
