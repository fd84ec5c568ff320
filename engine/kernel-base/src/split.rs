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
/// activation block size. For `ActType::F32` and `ActType::Q16` there is
/// nothing to split:
/// `hi = x`, `lo = 0`.
pub fn split_hi_lo(act: ActType, x: &[f32], hi: &mut [f32], lo: &mut [f32]) -> Result<()> {
    if hi.len() != x.len() || lo.len() != x.len() {
        return Err(KernelError::Shape {
            op: "split_hi_lo",
            detail: format!("x has {} elements, hi {}, lo {}", x.len(), hi.len(), lo.len()),
        });
    }
    match act {
        // One 16-bit plane is not split either.
        ActType::F32 | ActType::Q16 => {
            hi.copy_from_slice(x);
            lo.fill(0.0);
        }
        // Q8_1 quantises exactly as Q8_0 and adds block sums.
        ActType::Q8_0 | ActType::Q8_1 => {
            check_blocks(x.len(), QK)?;
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::CpuFeatures::detect().has_avx512() {
                // SAFETY: AVX-512 F/BW/VL, AVX2, FMA and F16C detected; the
                // three slices have the same length, a multiple of 32.
                unsafe { x86::split_q8_0(x, hi, lo) };
                return Ok(());
            }
            #[cfg(target_arch = "x86_64")]
            if crate::cpu::CpuFeatures::detect().has_avx2_fma() {
                // SAFETY: AVX2, FMA and F16C detected; lengths as above.
                unsafe { x86::split_q8_0_avx2(x, hi, lo) };
                return Ok(());
            }
            split_q8_0_scalar(x, hi, lo)?;
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

/// The Q8_0 split by the reference quantiser and dequantiser (the
/// definition the SIMD version reproduces bit for bit).
fn split_q8_0_scalar(x: &[f32], hi: &mut [f32], lo: &mut [f32]) -> Result<()> {
    let mut b = [BlockQ8_0 { d: half::f16::ZERO, qs: [0; QK] }];
    for ((xb, hb), lb) in x.chunks_exact(QK).zip(hi.chunks_exact_mut(QK)).zip(lo.chunks_exact_mut(QK)) {
        quantize_row_q8_0_ref(xb, &mut b)?;
        let hb: &mut [f32; QK] = hb.try_into().expect("chunk of QK");
        dequantize_block_q8_0(&b[0], hb);
        residual(xb, hb, lb);
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::blocks::QK;
    use crate::quantize::avx2::{block_amax, round_away as avx2_round_away};
    use crate::quantize::avx512::round_away;

    /// [`super::split_q8_0_scalar`] on 16 lanes, bit for bit the same for
    /// finite inputs: the same `max |x|`, the same f32 `x · (1 / d)`
    /// rounded half away from zero, `q · f32(f16(d))` and `x − hi`. (It
    /// runs on the calling thread before every fast-mode matmul, where the
    /// scalar version took 1–2% of decode.)
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C; `hi` and `lo` as long as `x`, a
    /// multiple of 32.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn split_q8_0(x: &[f32], hi: &mut [f32], lo: &mut [f32]) {
        assert!(hi.len() == x.len() && lo.len() == x.len() && x.len().is_multiple_of(QK));
        for b in 0..x.len() / QK {
            let at = b * QK;
            // SAFETY: block `b` holds 32 floats of each slice (asserted
            // lengths), read and written as two unaligned 16-lane halves.
            unsafe {
                let (x0, x1) = (_mm512_loadu_ps(x.as_ptr().add(at)), _mm512_loadu_ps(x.as_ptr().add(at + 16)));
                let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
                let d = amax / 127.0;
                let id = _mm512_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
                let dv = _mm512_set1_ps(half::f16::from_f32(d).to_f32());
                for (h, xv) in [(0, x0), (16, x1)] {
                    let q = round_away(_mm512_mul_ps(xv, id));
                    let hv = _mm512_mul_ps(_mm512_cvtepi32_ps(q), dv);
                    _mm512_storeu_ps(hi.as_mut_ptr().add(at + h), hv);
                    _mm512_storeu_ps(lo.as_mut_ptr().add(at + h), _mm512_sub_ps(xv, hv));
                }
            }
        }
    }

    /// [`split_q8_0`] on 8 lanes, for CPUs without AVX-512: bit for bit the
    /// scalar version's, as above.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `hi` and `lo` as long as `x`, a multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn split_q8_0_avx2(x: &[f32], hi: &mut [f32], lo: &mut [f32]) {
        assert!(hi.len() == x.len() && lo.len() == x.len() && x.len().is_multiple_of(QK));
        for b in 0..x.len() / QK {
            let at = b * QK;
            // SAFETY: block `b` holds 32 floats of each slice (asserted
            // lengths), read and written as four unaligned 8-lane quarters.
            unsafe {
                let v = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(x.as_ptr().add(at + o)));
                let d = block_amax(&v) / 127.0;
                let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
                let dv = _mm256_set1_ps(half::f16::from_f32(d).to_f32());
                for (k, xv) in v.into_iter().enumerate() {
                    let q = avx2_round_away(_mm256_mul_ps(xv, id));
                    let hv = _mm256_mul_ps(_mm256_cvtepi32_ps(q), dv);
                    _mm256_storeu_ps(hi.as_mut_ptr().add(at + 8 * k), hv);
                    _mm256_storeu_ps(lo.as_mut_ptr().add(at + 8 * k), _mm256_sub_ps(xv, hv));
                }
            }
        }
    }
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

    /// The SIMD split (taken on AVX-512 machines) equals the reference one
    /// bit for bit: random activations with outliers, exact zeros, and
    /// blocks whose values sit exactly half a step between two codes.
    #[test]
    fn the_split_equals_the_reference_bit_for_bit() {
        let mut x = random(64 * 32, 11);
        x[32..64].fill(0.0);
        // Block 2: max 127, so `x · (1/d)` = x and ±k.5 are exact ties.
        for (i, v) in x[64..96].iter_mut().enumerate() {
            *v = if i == 0 { 127.0 } else { (i as f32 - 16.0) + 0.5 };
        }
        let (mut hi, mut lo) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        let (mut hi_ref, mut lo_ref) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        split_hi_lo(ActType::Q8_0, &x, &mut hi, &mut lo).unwrap();
        split_q8_0_scalar(&x, &mut hi_ref, &mut lo_ref).unwrap();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&hi), bits(&hi_ref));
        assert_eq!(bits(&lo), bits(&lo_ref));
        assert!(hi[65..96].iter().zip(&x[65..96]).all(|(h, x)| *h == x.signum() * x.abs().ceil()), "ties round away");
        // The AVX2 version too, wherever it can run (also on AVX-512
        // machines, where the dispatch above takes the wider one).
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::CpuFeatures::detect().has_avx2_fma() {
            // SAFETY: AVX2, FMA and F16C detected; equal lengths, 64 blocks.
            unsafe { x86::split_q8_0_avx2(&x, &mut hi, &mut lo) };
            assert_eq!(bits(&hi), bits(&hi_ref), "avx2");
            assert_eq!(bits(&lo), bits(&lo_ref), "avx2");
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
