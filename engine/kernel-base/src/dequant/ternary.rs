//! The ternary formats TQ1_0 and TQ2_0 (256 elements, values in {-1, 0, 1}
//! times an f16 scale).

use crate::blocks::{BlockTQ1_0, BlockTQ2_0};
use crate::types::QK_K;

/// Powers of three used to extract base-3 digits: multiplying a packed byte
/// by `3^n` (wrapping mod 256) moves digit `n` into the top "trit", which
/// `(q * 3) >> 8` then reads out.
const POW3: [u8; 5] = [1, 3, 9, 27, 81];

#[inline]
fn trit(q: u8, pow: u8) -> f32 {
    let q = q.wrapping_mul(pow);
    let xi = ((u16::from(q) * 3) >> 8) as i16;
    f32::from(xi - 1)
}

/// TQ1_0: 5 trits per byte in `qs` (first 32 bytes: 5 x 32 elements, next 16
/// bytes: 5 x 16 elements) then 4 trits per byte in `qh` (4 x 4 elements).
#[inline]
pub fn dequantize_block_tq1_0(b: &BlockTQ1_0, out: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    let (qs0, qs1) = b.qs.split_at(32);
    let (y0, rest) = out.split_at_mut(5 * 32);
    let (y1, y2) = rest.split_at_mut(5 * 16);
    for (y, &p) in y0.chunks_exact_mut(32).zip(&POW3) {
        for (o, &q) in y.iter_mut().zip(qs0) {
            *o = trit(q, p) * d;
        }
    }
    for (y, &p) in y1.chunks_exact_mut(16).zip(&POW3) {
        for (o, &q) in y.iter_mut().zip(qs1) {
            *o = trit(q, p) * d;
        }
    }
    for (y, &p) in y2.chunks_exact_mut(4).zip(&POW3[..4]) {
        for (o, &q) in y.iter_mut().zip(&b.qh) {
            *o = trit(q, p) * d;
        }
    }
}

/// TQ2_0: 2 bits per element, `x = (q - 1) * d`; each 32 bytes of `qs` hold
/// 128 elements, bit pair `l` of byte `m` being element `32 * l + m`.
#[inline]
pub fn dequantize_block_tq2_0(b: &BlockTQ2_0, out: &mut [f32; QK_K]) {
    let d = b.d.to_f32();
    for (y, qs) in out.chunks_exact_mut(128).zip(b.qs.chunks_exact(32)) {
        for (l, y) in y.chunks_exact_mut(32).enumerate() {
            for (o, &q) in y.iter_mut().zip(qs) {
                let q = ((q >> (2 * l)) & 3) as i8;
                *o = f32::from(q - 1) * d;
            }
        }
    }
}
