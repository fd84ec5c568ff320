//! Two-plane activations: `x = hi + lo`, where `hi` is exactly what the
//! 8-bit activation quantiser reproduces (a fixed point of
//! quantise-then-dequantise) and `lo` is the rounding residual.
//!
//! Running an int8 kernel on the rows `[hi; lo]` as a batch of `2n` tokens
//! and adding the two halves of the output gives `W·x` with the error of
//! quantising only the residual: about 1/254 of the single-plane error,
//! close to f32 accuracy. The weights are streamed once (the tile kernels
//! dot each weight block with every token of the batch), so decode, which
//! is memory-bound, pays little for it; prefill pays for twice the integer
//! work.

use crate::blocks::{BlockQ8_0, BlockQ8K, QK};
use crate::dequant::{dequantize_block_q8_0, dequantize_block_q8_k};
use crate::kernel::ActType;
use crate::quantize::{quantize_row_q8_0_ref, quantize_row_q8_k_ref};
use crate::types::QK_K;
use crate::{KernelError, Result};

/// Splits `x` into `hi` (representable exactly by `act`'s quantiser) and
/// `lo = x - hi`. All three slices have the same length, a multiple of the
/// activation block size. For `ActType::F32` there is nothing to split:
/// `hi = x`, `lo = 0`.
pub fn split_hi_lo(act: ActType, x: &[f32], hi: &mut [f32], lo: &mut [f32]) -> Result<()> {
    if hi.len() != x.len() || lo.len() != x.len() {
        return Err(KernelError::Shape {
            op: "split_hi_lo",
            detail: format!("x has {} elements, hi {}, lo {}", x.len(), hi.len(), lo.len()),
        });
    }
    match act {
        ActType::F32 => {
            hi.copy_from_slice(x);
            lo.fill(0.0);
        }
        // Q8_1 quantises exactly as Q8_0 and adds block sums.
        ActType::Q8_0 | ActType::Q8_1 => {
            check_blocks(x.len(), QK)?;
            let mut b = [BlockQ8_0 { d: half::f16::ZERO, qs: [0; QK] }];
            for ((xb, hb), lb) in x.chunks_exact(QK).zip(hi.chunks_exact_mut(QK)).zip(lo.chunks_exact_mut(QK)) {
                quantize_row_q8_0_ref(xb, &mut b)?;
                let hb: &mut [f32; QK] = hb.try_into().expect("chunk of QK");
                dequantize_block_q8_0(&b[0], hb);
                residual(xb, hb, lb);
            }
        }
        ActType::Q8_K => {
            check_blocks(x.len(), QK_K)?;
            let mut b = [BlockQ8K { d: 0.0, qs: [0; QK_K], bsums: [0; QK_K / 16] }];
            for ((xb, hb), lb) in x.chunks_exact(QK_K).zip(hi.chunks_exact_mut(QK_K)).zip(lo.chunks_exact_mut(QK_K)) {
                quantize_row_q8_k_ref(xb, &mut b)?;
                let hb: &mut [f32; QK_K] = hb.try_into().expect("chunk of QK_K");
                dequantize_block_q8_k(&b[0], hb);
                residual(xb, hb, lb);
            }
        }
    }
    Ok(())
}

fn check_blocks(n: usize, block: usize) -> Result<()> {
    if !n.is_multiple_of(block) {
        return Err(KernelError::Shape {
            op: "split_hi_lo",
            detail: format!("{n} elements is not a multiple of {block}"),
        });
    }
    Ok(())
}

fn residual(x: &[f32], hi: &[f32], lo: &mut [f32]) {
    for ((l, &xv), &h) in lo.iter_mut().zip(x).zip(hi) {
        *l = xv - h;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        // Varied magnitudes with occasional outliers, as in LLM activations.
        (0..n).map(|i| r.random_range(-1.0f32..1.0) * if i % 37 == 0 { 40.0 } else { 1.0 }).collect()
    }

    #[test]
    fn hi_is_a_fixed_point_and_hi_plus_lo_is_x() {
        for act in [ActType::Q8_0, ActType::Q8_1, ActType::Q8_K] {
            let x = random(1024, 7);
            let (mut hi, mut lo) = (vec![0.0; 1024], vec![0.0; 1024]);
            split_hi_lo(act, &x, &mut hi, &mut lo).unwrap();
            // Splitting hi again leaves no residual: the quantiser
            // reproduces hi exactly.
            let (mut hi2, mut lo2) = (vec![0.0; 1024], vec![0.0; 1024]);
            split_hi_lo(act, &hi, &mut hi2, &mut lo2).unwrap();
            assert_eq!(hi, hi2, "{act:?}");
            assert!(lo2.iter().all(|&v| v == 0.0), "{act:?}");
            for i in 0..x.len() {
                assert!((hi[i] + lo[i] - x[i]).abs() <= 1e-6 * x[i].abs().max(1.0), "{act:?} {i}");
            }
            // The residual is at most half a quantisation step.
            assert!(lo.iter().any(|&v| v != 0.0));
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        let x = vec![1.0; 33];
        let (mut h, mut l) = (vec![0.0; 33], vec![0.0; 33]);
        assert!(split_hi_lo(ActType::Q8_0, &x, &mut h, &mut l).is_err());
        assert!(split_hi_lo(ActType::Q8_0, &x, &mut h[..32], &mut l).is_err());
    }
}
