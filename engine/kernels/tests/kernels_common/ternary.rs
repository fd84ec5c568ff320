//! Ternary weights for the ternary kernels' tests and timings: TQ1_0/TQ2_0
//! blocks with random codes and scales, I2_S by exact repack.

use half::f16;
use rand::Rng;
use rand::rngs::StdRng;
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::dot::ternary::{i2s_candidates, repack_tq2_0_to_i2s};
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::candidates;

/// Offset of the f16 scale in a block.
pub fn scale_offset(ty: GgmlType) -> usize {
    match ty {
        GgmlType::TQ1_0 => 52,
        GgmlType::TQ2_0 => 64,
        _ => unreachable!("{ty}"),
    }
}

/// Random TQ weights: random code bytes (every byte decodes; TQ2_0 code 3
/// included) and a random finite scale per block, or one scale per row
/// when `per_row` (as BitNet checkpoints have).
pub fn random_tq(r: &mut StdRng, ty: GgmlType, rows: usize, cols: usize, per_row: bool) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut w: Vec<u8> = (0..rows * rb).map(|_| r.random()).collect();
    let off = scale_offset(ty);
    for row in w.chunks_exact_mut(rb) {
        let mut s = f16::from_f32(10f32.powf(r.random_range(-3.0f32..-0.5)));
        for blk in row.chunks_exact_mut(ty.type_size()) {
            if !per_row {
                s = f16::from_f32(
                    10f32.powf(r.random_range(-3.0f32..-0.5)) * if r.random_bool(0.2) { -1.0 } else { 1.0 },
                );
            }
            blk[off..off + 2].copy_from_slice(&s.to_le_bytes());
        }
    }
    w
}

/// TQ2_0 weights with values only in {-1, 0, 1} (codes 0..=2) and one scale
/// per row, repacked to I2_S.
pub fn random_i2s(r: &mut StdRng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let mut tq = random_tq(r, GgmlType::TQ2_0, rows, cols, true);
    for blk in tq.chunks_exact_mut(66) {
        for q in &mut blk[..64] {
            *q = (0..4).fold(0u8, |a, l| a | (r.random_range(0u8..3) << (2 * l)));
        }
    }
    let i2s = repack_tq2_0_to_i2s(&tq, rows, cols).unwrap();
    (tq, i2s)
}

pub fn kernels(ty: Option<GgmlType>, rows: usize, cols: usize) -> Vec<Box<dyn MatmulKernel>> {
    let f = CpuFeatures::detect();
    match ty {
        Some(t) => candidates(&MatmulDesc::dense(t, ActType::Q8_K, rows, cols), &f),
        None => i2s_candidates(rows, cols, &f),
    }
}

pub const TYPES: [Option<GgmlType>; 3] = [Some(GgmlType::TQ1_0), Some(GgmlType::TQ2_0), None];

pub fn name(ty: Option<GgmlType>) -> &'static str {
    ty.map_or("i2_s", GgmlType::name)
}

pub fn weights(r: &mut StdRng, ty: Option<GgmlType>, rows: usize, cols: usize) -> Vec<u8> {
    match ty {
        Some(t) => random_tq(r, t, rows, cols, false),
        None => random_i2s(r, rows, cols).1,
    }
}
