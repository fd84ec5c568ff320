//! The K-quant super-block formats (256 elements): Q2_K, Q3_K, Q4_K, Q5_K,
//! Q6_K and Q8_K. Each function mirrors ggml's `dequantize_row_*` loop
//! structure and arithmetic order, so results are bit-identical.

use crate::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};
use crate::types::QK_K;

/// Unpacks the 6-bit scale and min of sub-block `j` (0..8) from the 12-byte
/// `scales` field of Q4_K/Q5_K, as ggml's `get_scale_min_k4`.
///
/// Layout: bytes 0..4 hold scales 0..4 (low 6 bits) and the top 2 bits of
/// scales 4..8; bytes 4..8 likewise for the mins; bytes 8..12 hold the low
/// nibbles of scales 4..8 (low half) and mins 4..8 (high half).
///
/// # Panics
/// If `j >= 8`.
#[inline]
pub fn get_scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        let d = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        let m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        (d, m)
    }
}

/// Unpacks the sixteen 6-bit Q3_K scales (already offset by -32, so in
/// -32..32). Scale `k` has its low nibble in `scales[k % 8]` (low nibble for
/// k < 8, high nibble otherwise) and its top two bits in
/// `scales[8 + k % 4]` at bit `2 * (k / 4)`.
#[inline]
pub fn q3_k_scales(scales: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let low = if k < 8 { scales[k] & 0x0F } else { scales[k - 8] >> 4 };
        let high = (scales[8 + k % 4] >> (2 * (k / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Q2_K: 16 sub-blocks of 16; `x = (d * sc) * q - dmin * m`, q in 0..4.
#[inline]
pub fn dequantize_block_q2_k(b: &BlockQ2K, out: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let min = b.dmin.to_f32();
    // Each 128-element half uses 32 bytes of `qs`; its 32-element quarter
    // `j` takes the 2 bits at shift `2 * j`, split into two sub-blocks of 16
    // with their own scale byte.
    let mut sc = b.scales.iter();
    for (y, q) in out.chunks_exact_mut(128).zip(b.qs.chunks_exact(32)) {
        for (j, y) in y.chunks_exact_mut(32).enumerate() {
            let shift = 2 * j;
            for ((y, q), &sc) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).zip(sc.by_ref()) {
                let dl = d * f32::from(sc & 0x0F);
                let ml = min * f32::from(sc >> 4);
                for (o, &q) in y.iter_mut().zip(q) {
                    *o = dl * f32::from((q >> shift) & 3) - ml;
                }
            }
        }
    }
}

/// Q3_K: 16 sub-blocks of 16; `x = (d * sc) * (q - (hbit ? 0 : 4))`,
/// q the 2 low bits in 0..4.
#[inline]
pub fn dequantize_block_q3_k(b: &BlockQ3K, out: &mut [f32; QK_K]) {
    let d_all = b.d.to_f32();
    let scales = q3_k_scales(&b.scales);
    let mut sc = scales.iter();
    // Low bits laid out as Q2_K; the high bit of sub-block pair `4 * n + j`
    // is that bit of `hmask[0..32]` (the mask does not advance per half).
    for (n, (y, q)) in out.chunks_exact_mut(128).zip(b.qs.chunks_exact(32)).enumerate() {
        for (j, y) in y.chunks_exact_mut(32).enumerate() {
            let shift = 2 * j;
            let m = 1u8 << (4 * n + j);
            let subs = y.chunks_exact_mut(16).zip(q.chunks_exact(16)).zip(b.hmask.chunks_exact(16));
            for (((y, q), hm), &sc) in subs.zip(sc.by_ref()) {
                let dl = d_all * f32::from(sc);
                for ((o, &q), &h) in y.iter_mut().zip(q).zip(hm) {
                    let low = ((q >> shift) & 3) as i8;
                    let sub = if h & m != 0 { 0 } else { 4 };
                    *o = dl * f32::from(low - sub);
                }
            }
        }
    }
}

/// Q4_K: 8 sub-blocks of 32; `x = (d * sc) * q - dmin * m`, q in 0..16.
#[inline]
pub fn dequantize_block_q4_k(b: &BlockQ4K, out: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let min = b.dmin.to_f32();
    // Each 64-element chunk uses 32 bytes of `qs`: low nibbles first.
    for (j, (y, q)) in out.chunks_exact_mut(64).zip(b.qs.chunks_exact(32)).enumerate() {
        let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
        let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let (lo, hi) = y.split_at_mut(32);
        for ((l, h), &q) in lo.iter_mut().zip(hi).zip(q) {
            *l = d1 * f32::from(q & 0x0F) - m1;
            *h = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// Q5_K: as Q4_K with a fifth bit: sub-block `s` takes bit `s` of
/// `qh[0..32]`.
#[inline]
pub fn dequantize_block_q5_k(b: &BlockQ5K, out: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let min = b.dmin.to_f32();
    for (j, (y, ql)) in out.chunks_exact_mut(64).zip(b.qs.chunks_exact(32)).enumerate() {
        let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
        let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
        let (d1, m1) = (d * f32::from(sc1), min * f32::from(m1));
        let (d2, m2) = (d * f32::from(sc2), min * f32::from(m2));
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let (lo, hi) = y.split_at_mut(32);
        for (((l, h), &q), &qh) in lo.iter_mut().zip(hi).zip(ql).zip(&b.qh) {
            let h1 = if qh & u1 != 0 { 16 } else { 0 };
            let h2 = if qh & u2 != 0 { 16 } else { 0 };
            *l = d1 * f32::from((q & 0x0F) + h1) - m1;
            *h = d2 * f32::from((q >> 4) + h2) - m2;
        }
    }
}

/// Q6_K: 16 sub-blocks of 16; `x = (d * sc) * (q - 32)`, q 6-bit from 4
/// low bits in `ql` and 2 high bits in `qh`.
#[inline]
pub fn dequantize_block_q6_k(b: &BlockQ6K, out: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    // Each 128-element half uses 64 bytes of `ql`, 32 of `qh`, 8 scales.
    // Quarter k (32 elements) of a half: `ql[32 * (k % 2) ..]`, nibble
    // `k / 2`, `qh` bits at `2 * k`; scales `2 * k` and `2 * k + 1`.
    let halves = out.chunks_exact_mut(128).zip(b.ql.chunks_exact(64)).zip(b.qh.chunks_exact(32));
    for (n, ((y, ql), qh)) in halves.enumerate() {
        let sc = &b.scales[8 * n..8 * n + 8];
        for (k, yq) in y.chunks_exact_mut(32).enumerate() {
            let ql = &ql[32 * (k % 2)..32 * (k % 2) + 32];
            let lshift = 4 * (k / 2);
            let hshift = 2 * k;
            for (s, ((ys, ql), qh)) in
                yq.chunks_exact_mut(16).zip(ql.chunks_exact(16)).zip(qh.chunks_exact(16)).enumerate()
            {
                let dl = d * f32::from(sc[2 * k + s]);
                for ((o, &l), &h) in ys.iter_mut().zip(ql).zip(qh) {
                    let q = ((l >> lshift) & 0x0F) | (((h >> hshift) & 3) << 4);
                    *o = dl * f32::from(q as i8 - 32);
                }
            }
        }
    }
}

/// Q8_K: `x = d * q` (f32 scale; `bsums` is redundant here).
#[inline]
pub fn dequantize_block_q8_k(b: &BlockQ8K, out: &mut [f32; QK_K]) {
    let d = b.d;
    for (&q, o) in b.qs.iter().zip(out.iter_mut()) {
        *o = d * f32::from(q);
    }
}
