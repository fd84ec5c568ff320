//! Portable reference dot products.
//!
//! Fast mode follows ggml's `ggml_vec_dot_*_generic` (integer dot per block,
//! one float multiply-add per block). Precise mode dequantises the weights
//! block by block (with [`crate::dequant`], bit-exact to ggml) and
//! accumulates `w * x` in eight f32 partial sums.
//!
//! Weight rows are raw GGUF bytes with no alignment requirement; activation
//! rows are GGML blocks as produced by [`crate::quantize`].

use bytemuck::Pod;
use half::f16;

use crate::blocks::{
    BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1,
    BlockQ8K, QK,
};
use crate::dequant::{get_scale_min_k4, q3_k_scales};
use crate::{GgmlType, Result};

/// Iterates over the blocks of a weight row (unaligned bytes).
#[inline]
fn blocks<B: Pod>(w: &[u8]) -> impl Iterator<Item = B> + '_ {
    w.chunks_exact(size_of::<B>()).map(bytemuck::pod_read_unaligned::<B>)
}

#[inline]
fn h(v: f16) -> f32 {
    v.to_f32()
}

/// Q4_0 weights · Q8_0 activations.
pub fn dot_q4_0_q8_0(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ4_0>(w).zip(x) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let v0 = i32::from(b.qs[j] & 0x0F) - 8;
            let v1 = i32::from(b.qs[j] >> 4) - 8;
            sumi += v0 * i32::from(y.qs[j]) + v1 * i32::from(y.qs[j + QK / 2]);
        }
        sumf += sumi as f32 * (h(b.d) * h(y.d));
    }
    sumf
}

/// Q4_1 weights · Q8_1 activations.
pub fn dot_q4_1_q8_1(w: &[u8], x: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ4_1>(w).zip(x) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let v0 = i32::from(b.qs[j] & 0x0F);
            let v1 = i32::from(b.qs[j] >> 4);
            sumi += v0 * i32::from(y.qs[j]) + v1 * i32::from(y.qs[j + QK / 2]);
        }
        sumf += (h(b.d) * h(y.d)) * sumi as f32 + h(b.m) * h(y.s);
    }
    sumf
}

#[inline]
fn q5_values(qs: &[u8; 16], qh: [u8; 4]) -> [i32; QK] {
    let qh = u32::from_le_bytes(qh);
    let mut v = [0i32; QK];
    for j in 0..QK / 2 {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        v[j] = (u32::from(qs[j] & 0x0F) | xh0) as i32;
        v[j + QK / 2] = (u32::from(qs[j] >> 4) | xh1) as i32;
    }
    v
}

/// Q5_0 weights · Q8_0 activations.
pub fn dot_q5_0_q8_0(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ5_0>(w).zip(x) {
        let v = q5_values(&b.qs, b.qh);
        let sumi: i32 = v.iter().zip(&y.qs).map(|(&a, &c)| (a - 16) * i32::from(c)).sum();
        sumf += sumi as f32 * (h(b.d) * h(y.d));
    }
    sumf
}

/// Q5_1 weights · Q8_1 activations.
pub fn dot_q5_1_q8_1(w: &[u8], x: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ5_1>(w).zip(x) {
        let v = q5_values(&b.qs, b.qh);
        let sumi: i32 = v.iter().zip(&y.qs).map(|(&a, &c)| a * i32::from(c)).sum();
        sumf += (h(b.d) * h(y.d)) * sumi as f32 + h(b.m) * h(y.s);
    }
    sumf
}

/// Q8_0 weights · Q8_0 activations.
pub fn dot_q8_0_q8_0(w: &[u8], x: &[BlockQ8_0]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ8_0>(w).zip(x) {
        let sumi: i32 = b.qs.iter().zip(&y.qs).map(|(&a, &c)| i32::from(a) * i32::from(c)).sum();
        sumf += sumi as f32 * (h(b.d) * h(y.d));
    }
    sumf
}

/// The integer values (the quants minus the format's offset), scale and
/// min of one block of a 32-element-format weight row.
fn legacy_block(ty: GgmlType, blk: &[u8]) -> ([i32; QK], f32, f32) {
    let nib = |qs: &[u8; 16], off: i32| -> [i32; QK] {
        std::array::from_fn(|j| i32::from(if j < 16 { qs[j] & 0x0F } else { qs[j - 16] >> 4 }) - off)
    };
    match ty {
        GgmlType::Q4_0 => {
            let b: BlockQ4_0 = bytemuck::pod_read_unaligned(blk);
            (nib(&b.qs, 8), h(b.d), 0.0)
        }
        GgmlType::Q4_1 => {
            let b: BlockQ4_1 = bytemuck::pod_read_unaligned(blk);
            (nib(&b.qs, 0), h(b.d), h(b.m))
        }
        GgmlType::Q5_0 => {
            let b: BlockQ5_0 = bytemuck::pod_read_unaligned(blk);
            (q5_values(&b.qs, b.qh).map(|v| v - 16), h(b.d), 0.0)
        }
        GgmlType::Q5_1 => {
            let b: BlockQ5_1 = bytemuck::pod_read_unaligned(blk);
            (q5_values(&b.qs, b.qh), h(b.d), h(b.m))
        }
        _ => {
            let b: BlockQ8_0 = bytemuck::pod_read_unaligned(blk);
            (b.qs.map(i32::from), h(b.d), 0.0)
        }
    }
}

/// Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights · one 16-bit activation plane
/// (`v`, `d`, `s`: a token's sections of [`crate::q16::Q16Layout`]): per
/// block, an exact integer dot, then `(dw * d) * sum + mw * s`.
pub fn dot_q16(ty: GgmlType, w: &[u8], v: &[i16], d: &[f32], s: &[f32]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, blk) in w.chunks_exact(ty.type_size()).enumerate() {
        let (q, dw, mw) = legacy_block(ty, blk);
        let sumi: i32 = q.iter().zip(&v[b * QK..(b + 1) * QK]).map(|(&a, &c)| a * i32::from(c)).sum();
        sumf += (dw * d[b]) * sumi as f32 + mw * s[b];
    }
    sumf
}

/// Q2_K weights · Q8_K activations.
pub fn dot_q2_k_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ2K>(w).zip(x) {
        let summs: i32 = (0..16).map(|j| i32::from(y.bsums[j]) * i32::from(b.scales[j] >> 4)).sum();
        let dall = y.d * h(b.d);
        let dmin = y.d * h(b.dmin);
        let mut isum = 0i32;
        let mut is = 0;
        for k in 0..2 {
            let q2 = &b.qs[32 * k..32 * k + 32];
            for j in 0..4 {
                let shift = 2 * j;
                let q8 = &y.qs[128 * k + 32 * j..128 * k + 32 * j + 32];
                for half in 0..2 {
                    let d = i32::from(b.scales[is] & 0x0F);
                    is += 1;
                    let isuml: i32 =
                        (16 * half..16 * half + 16).map(|l| i32::from(q8[l]) * i32::from((q2[l] >> shift) & 3)).sum();
                    isum += d * isuml;
                }
            }
        }
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

/// Q3_K weights · Q8_K activations.
pub fn dot_q3_k_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ3K>(w).zip(x) {
        let scales = q3_k_scales(&b.scales);
        let mut isum = 0i32;
        let mut m = 1u8;
        let mut is = 0;
        for n in 0..2 {
            let q = &b.qs[32 * n..32 * n + 32];
            for j in 0..4 {
                let shift = 2 * j;
                let q8 = &y.qs[128 * n + 32 * j..128 * n + 32 * j + 32];
                for half in 0..2 {
                    let mut s = 0i32;
                    for l in 16 * half..16 * half + 16 {
                        let low = i32::from((q[l] >> shift) & 3);
                        let sub = if b.hmask[l] & m != 0 { 0 } else { 4 };
                        s += (low - sub) * i32::from(q8[l]);
                    }
                    isum += i32::from(scales[is]) * s;
                    is += 1;
                }
                m <<= 1;
            }
        }
        sumf += h(b.d) * y.d * isum as f32;
    }
    sumf
}

/// Q4_K weights · Q8_K activations.
pub fn dot_q4_k_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ4K>(w).zip(x) {
        let mut isum = 0i32;
        let mut summ = 0i32;
        for j in 0..4 {
            let q = &b.qs[32 * j..32 * j + 32];
            let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
            let q8 = &y.qs[64 * j..64 * j + 64];
            let (mut s1, mut s2) = (0i32, 0i32);
            for l in 0..32 {
                s1 += i32::from(q[l] & 0x0F) * i32::from(q8[l]);
                s2 += i32::from(q[l] >> 4) * i32::from(q8[l + 32]);
            }
            isum += i32::from(sc1) * s1 + i32::from(sc2) * s2;
            let bs = |k: usize| i32::from(y.bsums[k]);
            summ += i32::from(m1) * (bs(4 * j) + bs(4 * j + 1)) + i32::from(m2) * (bs(4 * j + 2) + bs(4 * j + 3));
        }
        sumf += h(b.d) * y.d * isum as f32 - h(b.dmin) * y.d * summ as f32;
    }
    sumf
}

/// Q5_K weights · Q8_K activations.
pub fn dot_q5_k_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ5K>(w).zip(x) {
        let mut isum = 0i32;
        let mut summ = 0i32;
        for j in 0..4 {
            let q = &b.qs[32 * j..32 * j + 32];
            let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
            let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
            let q8 = &y.qs[64 * j..64 * j + 64];
            let (mut s1, mut s2) = (0i32, 0i32);
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                s1 += (i32::from(q[l] & 0x0F) + h1) * i32::from(q8[l]);
                s2 += (i32::from(q[l] >> 4) + h2) * i32::from(q8[l + 32]);
            }
            isum += i32::from(sc1) * s1 + i32::from(sc2) * s2;
            let bs = |k: usize| i32::from(y.bsums[k]);
            summ += i32::from(m1) * (bs(4 * j) + bs(4 * j + 1)) + i32::from(m2) * (bs(4 * j + 2) + bs(4 * j + 3));
        }
        sumf += h(b.d) * y.d * isum as f32 - h(b.dmin) * y.d * summ as f32;
    }
    sumf
}

/// Q6_K weights · Q8_K activations.
pub fn dot_q6_k_q8_k(w: &[u8], x: &[BlockQ8K]) -> f32 {
    let mut sumf = 0.0f32;
    for (b, y) in blocks::<BlockQ6K>(w).zip(x) {
        let mut isum = 0i32;
        for n in 0..2 {
            let ql = &b.ql[64 * n..64 * n + 64];
            let qh = &b.qh[32 * n..32 * n + 32];
            let sc = &b.scales[8 * n..8 * n + 8];
            let q8 = &y.qs[128 * n..128 * n + 128];
            // Quarter k (32 elements): nibble k / 2 of ql[32 * (k % 2)..],
            // high bits at 2k of qh; scales 2k and 2k + 1 (16 elements each).
            for k in 0..4 {
                let l0 = 32 * (k % 2);
                for s in 0..2 {
                    let mut acc = 0i32;
                    for l in 16 * s..16 * s + 16 {
                        let lo = (ql[l0 + l] >> (4 * (k / 2))) & 0x0F;
                        let hi = (qh[l] >> (2 * k)) & 3;
                        let q = i32::from(lo | (hi << 4)) - 32;
                        acc += q * i32::from(q8[32 * k + l]);
                    }
                    isum += i32::from(sc[2 * k + s]) * acc;
                }
            }
        }
        sumf += h(b.d) * y.d * isum as f32;
    }
    sumf
}

/// Elements dequantised per step in precise mode.
pub const PRECISE_CHUNK: usize = 256;

/// Precise mode: `sum(dequant(w) * x)` with f32 accumulation in eight
/// partial sums. `w` is one row of `ty` covering `x.len()` elements.
pub fn dot_f32(ty: GgmlType, w: &[u8], x: &[f32]) -> Result<f32> {
    let mut buf = [0.0f32; PRECISE_CHUNK];
    let mut acc = [0.0f32; 8];
    let bytes_per = ty.row_bytes(PRECISE_CHUNK)?;
    let n_chunks = x.len().div_ceil(PRECISE_CHUNK);
    for c in 0..n_chunks {
        let xs = &x[c * PRECISE_CHUNK..x.len().min((c + 1) * PRECISE_CHUNK)];
        let n = xs.len();
        let start = c * bytes_per;
        let src = &w[start..start + ty.row_bytes(n)?];
        crate::dequant::dequantize_row(ty, src, &mut buf[..n])?;
        for (wv, xv) in buf[..n].as_chunks::<8>().0.iter().zip(xs.as_chunks::<8>().0) {
            for l in 0..8 {
                acc[l] = wv[l].mul_add(xv[l], acc[l]);
            }
        }
        let tail = n - n % 8;
        for (i, (wv, xv)) in buf[tail..n].iter().zip(&xs[tail..]).enumerate() {
            acc[i] = wv.mul_add(*xv, acc[i]);
        }
    }
    Ok(((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])))
}
