//! Dequantisation of GGML blocks to f32: the reference semantics of every
//! format this crate supports.
//!
//! Each format follows ggml's `dequantize_row_*` (ggml-quants.c) in both
//! element order and floating-point operation order, so results are
//! bit-identical to ggml and to the `gguf` Python package's numpy code
//! (checked against fixtures in `tests/dequant_fixtures.rs`). The per-block
//! helpers are public so that fused kernels (embedding lookup, precise-mode
//! matvec) can dequantise on the fly without going through a row.
//!
//! Byte layouts are little-endian, as in GGUF files.

mod kquants;
mod legacy;
mod ternary;

use bytemuck::Pod;
use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::blocks::QK;
use crate::types::QK_K;
use crate::{GgmlType, KernelError, Result};

pub use kquants::{
    dequantize_block_q2_k, dequantize_block_q3_k, dequantize_block_q4_k, dequantize_block_q5_k, dequantize_block_q6_k,
    dequantize_block_q8_k, get_scale_min_k4, q3_k_scales,
};
pub use legacy::{
    dequantize_block_q4_0, dequantize_block_q4_1, dequantize_block_q5_0, dequantize_block_q5_1, dequantize_block_q8_0,
    dequantize_block_q8_1,
};
pub use ternary::{dequantize_block_tq1_0, dequantize_block_tq2_0};

/// Dequantises one row: `src` holds whole blocks of `ty`, `dst` receives
/// `dst.len()` elements (a multiple of the block size).
///
/// Errors: [`KernelError::RowNotBlockAligned`] if `dst.len()` is not a
/// multiple of the block size, [`KernelError::BufferSize`] if `src` is not
/// exactly the row's byte size. `src` needs no particular alignment.
///
/// F16 signalling NaNs come out quieted (as ggml's F16C path does); every
/// other bit pattern of every format is converted exactly.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let n = dst.len();
    let want = ty.row_bytes(n)?;
    if src.len() != want {
        return Err(KernelError::BufferSize { ty, n, want, got: src.len() });
    }
    match ty {
        GgmlType::F32 => match bytemuck::try_cast_slice::<u8, f32>(src) {
            Ok(s) => dst.copy_from_slice(s),
            Err(_) => {
                for (o, c) in dst.iter_mut().zip(src.as_chunks::<4>().0) {
                    *o = f32::from_le_bytes(*c);
                }
            }
        },
        GgmlType::F16 => match bytemuck::try_cast_slice::<u8, f16>(src) {
            Ok(s) => s.convert_to_f32_slice(dst),
            Err(_) => {
                for (o, c) in dst.iter_mut().zip(src.as_chunks::<2>().0) {
                    *o = f16::from_le_bytes(*c).to_f32();
                }
            }
        },
        // A plain shift, as ggml's `ggml_compute_bf16_to_fp32` (NaN payloads
        // are kept unchanged; `half::bf16::to_f32` would quiet them).
        GgmlType::BF16 => {
            for (o, c) in dst.iter_mut().zip(src.as_chunks::<2>().0) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes(*c)) << 16);
            }
        }
        GgmlType::Q4_0 => for_each_block::<_, QK>(src, dst, dequantize_block_q4_0),
        GgmlType::Q4_1 => for_each_block::<_, QK>(src, dst, dequantize_block_q4_1),
        GgmlType::Q5_0 => for_each_block::<_, QK>(src, dst, dequantize_block_q5_0),
        GgmlType::Q5_1 => for_each_block::<_, QK>(src, dst, dequantize_block_q5_1),
        GgmlType::Q8_0 => for_each_block::<_, QK>(src, dst, dequantize_block_q8_0),
        GgmlType::Q8_1 => for_each_block::<_, QK>(src, dst, dequantize_block_q8_1),
        GgmlType::Q2_K => for_each_block::<_, QK_K>(src, dst, dequantize_block_q2_k),
        GgmlType::Q3_K => for_each_block::<_, QK_K>(src, dst, dequantize_block_q3_k),
        GgmlType::Q4_K => for_each_block::<_, QK_K>(src, dst, dequantize_block_q4_k),
        GgmlType::Q5_K => for_each_block::<_, QK_K>(src, dst, dequantize_block_q5_k),
        GgmlType::Q6_K => for_each_block::<_, QK_K>(src, dst, dequantize_block_q6_k),
        GgmlType::Q8_K => for_each_block::<_, QK_K>(src, dst, dequantize_block_q8_k),
        GgmlType::TQ1_0 => for_each_block::<_, QK_K>(src, dst, dequantize_block_tq1_0),
        GgmlType::TQ2_0 => for_each_block::<_, QK_K>(src, dst, dequantize_block_tq2_0),
    }
    Ok(())
}

/// Applies a per-block dequantiser to every block of `src`, writing `N`
/// elements per block into `dst`. Casts in place when `src` is aligned for
/// `B`, otherwise copies each block out first. Sizes are checked by the
/// caller; a mismatch would only shorten the loop.
#[inline]
fn for_each_block<B: Pod, const N: usize>(src: &[u8], dst: &mut [f32], f: impl Fn(&B, &mut [f32; N])) {
    let outs = dst.as_chunks_mut::<N>().0;
    match bytemuck::try_cast_slice::<u8, B>(src) {
        Ok(blocks) => {
            for (b, o) in blocks.iter().zip(outs) {
                f(b, o);
            }
        }
        Err(_) => {
            for (raw, o) in src.chunks_exact(size_of::<B>()).zip(outs) {
                f(&bytemuck::pod_read_unaligned::<B>(raw), o);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{BlockQ4_0, BlockQ8_0, BlockQ8_1, BlockQ8K};

    fn f16b(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q8_0_hand_computed() {
        // d = 0.5, q = -16..16
        let mut src = f16b(0.5).to_vec();
        src.extend((-16i8..16).map(|q| q as u8));
        let mut dst = [0f32; 32];
        dequantize_row(GgmlType::Q8_0, &src, &mut dst).unwrap();
        for (j, &x) in dst.iter().enumerate() {
            assert_eq!(x, (j as f32 - 16.0) * 0.5, "element {j}");
        }
        // Extremes of the signed byte.
        let mut src = f16b(-2.0).to_vec();
        src.extend([0x80u8, 0x7F].iter().cycle().take(32));
        dequantize_row(GgmlType::Q8_0, &src, &mut dst).unwrap();
        assert_eq!(dst[0], 256.0);
        assert_eq!(dst[1], -254.0);
    }

    #[test]
    fn q4_0_hand_computed() {
        // d = 0.25; byte j = (hi << 4) | lo with lo = j, hi = 15 - j.
        let mut src = f16b(0.25).to_vec();
        src.extend((0u8..16).map(|j| ((15 - j) << 4) | j));
        let mut dst = [0f32; 32];
        dequantize_row(GgmlType::Q4_0, &src, &mut dst).unwrap();
        for j in 0..16 {
            assert_eq!(dst[j], (j as f32 - 8.0) * 0.25, "low nibble {j}");
            assert_eq!(dst[j + 16], (7.0 - j as f32) * 0.25, "high nibble {j}");
        }
        // Two blocks: the second starts at element 32.
        let mut two = src.clone();
        two.extend(f16b(1.0));
        two.extend([0x0Fu8; 16]);
        let mut dst = [0f32; 64];
        dequantize_row(GgmlType::Q4_0, &two, &mut dst).unwrap();
        assert_eq!(&dst[32..48], &[7.0; 16]);
        assert_eq!(&dst[48..64], &[-8.0; 16]);
    }

    #[test]
    fn block_helpers_match_row() {
        let b = BlockQ4_0 { d: f16::from_f32(3.0), qs: [0x9A; 16] };
        let mut out = [0f32; 32];
        dequantize_block_q4_0(&b, &mut out);
        assert_eq!(out[0], 6.0); // (10 - 8) * 3
        assert_eq!(out[16], 3.0); // (9 - 8) * 3
        let b = BlockQ8_0 { d: f16::from_f32(0.125), qs: [-8; 32] };
        dequantize_block_q8_0(&b, &mut out);
        assert_eq!(out, [-1.0; 32]);
    }

    #[test]
    fn q8_1_and_q8_k() {
        let b = BlockQ8_1 { d: f16::from_f32(0.5), s: f16::from_f32(123.0), qs: [6; 32] };
        let mut dst = [0f32; 32];
        dequantize_row(GgmlType::Q8_1, bytemuck::bytes_of(&b), &mut dst).unwrap();
        assert_eq!(dst, [3.0; 32]);

        let mut qs = [0i8; QK_K];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = (j as i32 - 128) as i8;
        }
        let b = BlockQ8K { d: 0.1, qs, bsums: [0; 16] };
        let mut dst = vec![0f32; QK_K];
        dequantize_row(GgmlType::Q8_K, bytemuck::bytes_of(&b), &mut dst).unwrap();
        for (j, &x) in dst.iter().enumerate() {
            assert_eq!(x.to_bits(), (0.1f32 * (j as f32 - 128.0)).to_bits());
        }
    }

    #[test]
    fn scale_min_k4_unpacks_six_bits() {
        // Scales 0..8 = 1..=8 + 50, mins = 60 - j: exercise the split bits.
        let sc: [u8; 8] = core::array::from_fn(|j| 51 + j as u8);
        let mn: [u8; 8] = core::array::from_fn(|j| 60 - j as u8);
        let mut q = [0u8; 12];
        for j in 0..4 {
            q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            q[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            q[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
        }
        for j in 0..8 {
            assert_eq!(get_scale_min_k4(j, &q), (sc[j], mn[j]), "sub-block {j}");
        }
    }

    #[test]
    fn q3_k_scales_unpack() {
        let want: [i8; 16] = core::array::from_fn(|k| (k as i8) * 4 - 32);
        let mut packed = [0u8; 12];
        for (k, &w) in want.iter().enumerate() {
            let u = (w + 32) as u8;
            packed[k % 8] |= (u & 0x0F) << (4 * (k / 8));
            packed[8 + k % 4] |= (u >> 4) << (2 * (k / 4));
        }
        assert_eq!(q3_k_scales(&packed), want);
    }

    #[test]
    fn bf16_is_a_shift() {
        let src = [0x80u8, 0x3F, 0x81, 0x7F]; // 1.0, signalling NaN
        let mut dst = [0f32; 2];
        dequantize_row(GgmlType::BF16, &src, &mut dst).unwrap();
        assert_eq!(dst[0], 1.0);
        assert_eq!(dst[1].to_bits(), 0x7F81_0000);
    }

    #[test]
    fn unaligned_source_matches_aligned() {
        for ty in GgmlType::ALL {
            let n = 2 * ty.block_size().max(8);
            let bytes = ty.row_bytes(n).unwrap();
            // Deterministic bytes with small f16/f32 scales (0x3C3C ~ 1.06).
            let mut buf: Vec<u8> = (0..bytes + 1).map(|i| (i * 37 % 251) as u8 & 0x3C).collect();
            let mut a = vec![0f32; n];
            let mut b = vec![0f32; n];
            buf.copy_within(0..bytes, 1);
            dequantize_row(ty, &buf[1..], &mut a).unwrap();
            buf.copy_within(1..bytes + 1, 0);
            dequantize_row(ty, &buf[..bytes], &mut b).unwrap();
            let (a, b): (Vec<u32>, Vec<u32>) =
                (a.iter().map(|x| x.to_bits()).collect(), b.iter().map(|x| x.to_bits()).collect());
            assert_eq!(a, b, "{ty}");
        }
    }

    #[test]
    fn bad_sizes_are_errors() {
        let mut dst = [0f32; 33];
        let err = dequantize_row(GgmlType::Q4_0, &[0; 18], &mut dst).unwrap_err();
        assert!(matches!(err, KernelError::RowNotBlockAligned { n: 33, block: 32, .. }));
        let mut dst = [0f32; 32];
        let err = dequantize_row(GgmlType::Q4_0, &[0; 17], &mut dst).unwrap_err();
        assert!(matches!(err, KernelError::BufferSize { want: 18, got: 17, .. }));
        let err = dequantize_row(GgmlType::F16, &[0; 65], &mut dst).unwrap_err();
        assert!(matches!(err, KernelError::BufferSize { want: 64, got: 65, .. }));
        // Empty rows are fine.
        dequantize_row(GgmlType::Q6_K, &[], &mut []).unwrap();
    }
}
