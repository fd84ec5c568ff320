//! Shared helpers for the kernel tests: random weights/activations and
//! reference results.
#![allow(dead_code, unused_imports, reason = "each test binary uses a subset")]

pub mod ternary;

use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use spinfer_kernels::GgmlType;
use spinfer_kernels::blocks::{BlockQ8_0, BlockQ8_1, BlockQ8K};
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::dot::scalar as dot;
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::candidates;
use spinfer_kernels::q16::{Q16Layout, pack_q16_scalar};
use spinfer_kernels::quantize;

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `rows` random rows of `cols` elements of `ty` (the kernels' one
/// generator, which the registry's check of pack kernels also uses).
pub use spinfer_kernels::random::weights as random_weights;

/// `n` random activations: signed, magnitudes varying per 32-block, a few
/// outliers, never all zero.
pub fn random_acts(r: &mut StdRng, n: usize) -> Vec<f32> {
    random_acts_with(r, n, 32)
}

/// As [`random_acts`], with the magnitude changing every `scale_block`
/// values.
pub fn random_acts_with(r: &mut StdRng, n: usize, scale_block: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n);
    let mut scale = 1.0f32;
    for i in 0..n {
        if i % scale_block == 0 {
            scale = 10f32.powf(r.random_range(-2.0f32..1.5));
        }
        let mut v = r.random_range(-1.0f32..1.0) * scale;
        if r.random_bool(0.01) {
            v *= 20.0;
        }
        x.push(v);
    }
    x[0] = 0.75;
    x
}

/// Dequantised row (f32) via the crate's reference dequantiser.
pub fn dequant(ty: GgmlType, row: &[u8], cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; cols];
    dequantize_row(ty, row, &mut out).unwrap();
    out
}

/// The reference result of one (row, token) for `(ty, act)`: the scalar
/// dot of the reference-quantised activations (fast) or the precise dot.
pub fn reference_dot(ty: GgmlType, act: ActType, row: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    match act {
        ActType::F32 => dot::dot_f32(ty, row, x).unwrap(),
        ActType::Q8_0 => {
            let mut q = vec![BlockQ8_0 { d: f16::ZERO, qs: [0; 32] }; n / 32];
            quantize::quantize_row_q8_0_ref(x, &mut q).unwrap();
            match ty {
                GgmlType::Q4_0 => dot::dot_q4_0_q8_0(row, &q),
                GgmlType::Q5_0 => dot::dot_q5_0_q8_0(row, &q),
                _ => dot::dot_q8_0_q8_0(row, &q),
            }
        }
        ActType::Q8_1 => {
            let mut q = vec![BlockQ8_1 { d: f16::ZERO, s: f16::ZERO, qs: [0; 32] }; n / 32];
            quantize::quantize_row_q8_1_ref(x, &mut q).unwrap();
            match ty {
                GgmlType::Q4_1 => dot::dot_q4_1_q8_1(row, &q),
                _ => dot::dot_q5_1_q8_1(row, &q),
            }
        }
        ActType::Q8_K => {
            let mut q = vec![BlockQ8K { d: 0.0, qs: [0; 256], bsums: [0; 16] }; n / 256];
            quantize::quantize_row_q8_k_ref(x, &mut q).unwrap();
            match ty {
                GgmlType::Q2_K => dot::dot_q2_k_q8_k(row, &q),
                GgmlType::Q3_K => dot::dot_q3_k_q8_k(row, &q),
                GgmlType::Q4_K => dot::dot_q4_k_q8_k(row, &q),
                GgmlType::Q5_K => dot::dot_q5_k_q8_k(row, &q),
                _ => dot::dot_q6_k_q8_k(row, &q),
            }
        }
        ActType::Q16 => {
            let l = Q16Layout::new(n);
            let mut buf = vec![0u8; l.stride];
            pack_q16_scalar(&l, x, &mut buf);
            let (v, d, s) = l.sections(&buf);
            dot::dot_q16(ty, row, v, d, s)
        }
    }
}

/// `sum |w * x|` with dequantised weights: the scale for relative errors.
pub fn magnitude(w: &[f32], x: &[f32]) -> f32 {
    w.iter().zip(x).map(|(a, b)| (a * b).abs()).sum()
}

/// Every supported (weight, activation) pair.
pub fn all_pairs() -> Vec<(GgmlType, ActType)> {
    use GgmlType::*;
    let mut v = vec![
        (Q4_0, ActType::Q8_0),
        (Q5_0, ActType::Q8_0),
        (Q8_0, ActType::Q8_0),
        (Q4_1, ActType::Q8_1),
        (Q5_1, ActType::Q8_1),
        (Q2_K, ActType::Q8_K),
        (Q3_K, ActType::Q8_K),
        (Q4_K, ActType::Q8_K),
        (Q5_K, ActType::Q8_K),
        (Q6_K, ActType::Q8_K),
    ];
    for t in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0] {
        v.push((t, ActType::Q16));
    }
    for t in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
        v.push((t, ActType::F32));
    }
    v
}

/// Column counts to test for a weight type (odd block counts, a group
/// tail past 16 blocks, and for F32-like types a non-multiple of 16).
pub fn test_cols(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![7, 100, 576],
        32 => vec![32, 96, 544, 576],
        _ => vec![256, 768],
    }
}

/// The best (first) dense kernel for `ty` in fast mode.
pub fn dense_kernel(ty: GgmlType, rows: usize, cols: usize) -> Box<dyn MatmulKernel> {
    let desc = MatmulDesc::dense(ty, ActType::fast_for(ty), rows, cols);
    candidates(&desc, &CpuFeatures::detect()).into_iter().next().expect("no kernel")
}

/// `n` distinct sorted indices out of `0..total`.
pub fn random_subset(r: &mut StdRng, total: usize, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..total as u32).collect();
    for i in 0..n {
        let j = r.random_range(i..total);
        all.swap(i, j);
    }
    let mut v = all[..n].to_vec();
    v.sort_unstable();
    v
}
