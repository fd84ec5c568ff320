//! Weights shared by the kernel benches and the `down_rounds` example
//! (included with `#[path]`; each user takes what it needs).
#![allow(dead_code, reason = "each bench binary uses part of the support module")]

use half::f16;
use spinfer_kernels::GgmlType;

/// `n` deterministic pseudo-random bytes (xorshift) from `seed`.
pub fn xorshift_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect()
}

/// `n` deterministic pseudo-random floats in [-0.5, 0.5) from
/// [`xorshift_bytes`].
pub fn xorshift_f32(n: usize, seed: u64) -> Vec<f32> {
    xorshift_bytes(4 * n, seed)
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32 / 4_294_967_296.0 - 0.5)
        .collect()
}

/// `rows × cols` Q4_1 bytes with random codes, scale 0.01 and minimum
/// −0.05 in every block (SmolLM2's `W_down` is 576 × 1536).
pub fn q4_1(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let ty = GgmlType::Q4_1;
    let mut w = xorshift_bytes(rows * ty.row_bytes(cols).unwrap(), seed);
    for blk in w.chunks_exact_mut(ty.type_size()) {
        blk[0..2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        blk[2..4].copy_from_slice(&f16::from_f32(-0.05).to_le_bytes());
    }
    w
}
