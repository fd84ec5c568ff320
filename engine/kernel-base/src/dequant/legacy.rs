//! The 32-element ("legacy") formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//!
//! Element order follows ggml: byte `j` of `qs` holds element `j` in its low
//! nibble and element `j + 16` in its high nibble; for the 5-bit formats the
//! fifth bit of element `j` is bit `j` of the little-endian `u32` `qh`.

use crate::blocks::{BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1, QK};

/// Q4_0: `x = (q - 8) * d`.
#[inline]
pub fn dequantize_block_q4_0(b: &BlockQ4_0, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
        *l = f32::from((q & 0x0F) as i8 - 8) * d;
        *h = f32::from((q >> 4) as i8 - 8) * d;
    }
}

/// Q4_1: `x = q * d + m`.
#[inline]
pub fn dequantize_block_q4_1(b: &BlockQ4_1, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    let m = b.m.to_f32();
    let (lo, hi) = out.split_at_mut(QK / 2);
    for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
        *l = f32::from(q & 0x0F) * d + m;
        *h = f32::from(q >> 4) * d + m;
    }
}

/// Q5_0: `x = (q - 16) * d`, q = 4 low bits from `qs` | fifth bit from `qh`.
#[inline]
pub fn dequantize_block_q5_0(b: &BlockQ5_0, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    let qh = u32::from_le_bytes(b.qh);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for (j, ((&q, l), h)) in b.qs.iter().zip(lo).zip(hi).enumerate() {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        *l = ((u32::from(q & 0x0F) | xh0) as i32 - 16) as f32 * d;
        *h = ((u32::from(q >> 4) | xh1) as i32 - 16) as f32 * d;
    }
}

/// Q5_1: `x = q * d + m`, q = 4 low bits from `qs` | fifth bit from `qh`.
#[inline]
pub fn dequantize_block_q5_1(b: &BlockQ5_1, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    let m = b.m.to_f32();
    let qh = u32::from_le_bytes(b.qh);
    let (lo, hi) = out.split_at_mut(QK / 2);
    for (j, ((&q, l), h)) in b.qs.iter().zip(lo).zip(hi).enumerate() {
        let xh0 = ((qh >> j) << 4) & 0x10;
        let xh1 = (qh >> (j + 12)) & 0x10;
        *l = (u32::from(q & 0x0F) | xh0) as f32 * d + m;
        *h = (u32::from(q >> 4) | xh1) as f32 * d + m;
    }
}

/// Q8_0: `x = q * d`.
#[inline]
pub fn dequantize_block_q8_0(b: &BlockQ8_0, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (&q, o) in b.qs.iter().zip(out.iter_mut()) {
        *o = f32::from(q) * d;
    }
}

/// Q8_1: `x = q * d` (the stored sum `s` is redundant for dequantisation).
/// ggml has no `dequantize_row_q8_1`; this is the obvious inverse of its
/// quantiser.
#[inline]
pub fn dequantize_block_q8_1(b: &BlockQ8_1, out: &mut [f32; QK]) {
    let d = b.d.to_f32();
    for (&q, o) in b.qs.iter().zip(out.iter_mut()) {
        *o = f32::from(q) * d;
    }
}
