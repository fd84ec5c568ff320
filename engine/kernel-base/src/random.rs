//! Random operands with the statistics of real ones, for checking a kernel
//! against the scalar reference (the registry's check of a pack kernel,
//! the tuner, and the kernel tests): random quant bytes with finite,
//! moderate scales, and activations whose magnitude changes per block.

use half::{bf16, f16};
use rand::Rng;
use rand::rngs::StdRng;

use crate::GgmlType;

/// Offsets of the f16 scale fields inside one block of `ty`.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// `rows` random rows of `cols` elements of `ty`: random quant bytes with
/// finite, moderate f16 scales (random finite floats for F32/F16/BF16).
pub fn weights(r: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    let val = |r: &mut StdRng| r.random_range(-1.0f32..1.0) * 10f32.powf(r.random_range(-2.0f32..0.5));
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| val(r).to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| f16::from_f32(val(r)).to_le_bytes()).collect(),
        GgmlType::BF16 => (0..n).flat_map(|_| bf16::from_f32(val(r)).to_le_bytes()).collect(),
        _ => {
            let Ok(rb) = ty.row_bytes(cols) else { return Vec::new() };
            let mut w: Vec<u8> = (0..rows * rb).map(|_| r.random()).collect();
            if matches!(ty, GgmlType::TQ1_0 | GgmlType::TQ2_0) {
                // Ternary: one scale per row, in the f16 that ends each
                // block (a BitNet tensor's scale is per tensor), so the
                // rows also repack exactly to I2_S.
                for row in w.chunks_exact_mut(rb) {
                    let d = f16::from_f32(10f32.powf(r.random_range(-2.0f32..0.0))).to_le_bytes();
                    row.chunks_exact_mut(ty.type_size()).for_each(|b| b[ty.type_size() - 2..].copy_from_slice(&d));
                }
                return w;
            }
            for blk in w.chunks_exact_mut(ty.type_size()) {
                for (i, &off) in scale_offsets(ty).iter().enumerate() {
                    // Minimums (second field) and Q6_K scales may be negative.
                    let mag = 10f32.powf(r.random_range(-3.5f32..-1.0));
                    let neg = (i == 1 || ty == GgmlType::Q6_K) && r.random_bool(0.3);
                    let s = f16::from_f32(if neg { -mag } else { mag });
                    blk[off..off + 2].copy_from_slice(&s.to_le_bytes());
                }
            }
            w
        }
    }
}

/// `n` random activations in [-1, 1) with a magnitude per 32-block.
pub fn acts(r: &mut StdRng, n: usize) -> Vec<f32> {
    let mut scale = 1.0f32;
    (0..n)
        .map(|i| {
            if i % 32 == 0 {
                scale = 10f32.powf(r.random_range(-1.0f32..0.5));
            }
            r.random_range(-1.0f32..1.0) * scale
        })
        .collect()
}
