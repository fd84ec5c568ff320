//! The int16 format of [`super::PackedType::I16`] and its scalar
//! arithmetic, which the AVX2 kernel (`avx2_i16.rs`) reproduces bit for bit.
//!
//! * A weight row is scaled by its largest magnitude to integers in
//!   `[-W_MAX, W_MAX]`: `W[r, c] ≈ sw[r] · qw[r, c]`.
//! * A token's activations are scaled per block of [`BLOCK`] columns to
//!   integers in `[-A_MAX, A_MAX]`: `x[t, c] ≈ sa[t, b] · qx[t, c]`.
//! * `out[t, r] = bias[r] + sw[r] · Σ_b sa[t, b] · Σ_{c in b} qx · qw`: the
//!   inner sums are exact in i32 (`BLOCK · A_MAX · W_MAX < 2^31`), the outer
//!   ones f32 fused multiply-adds in block order, from zero.
//!
//! `vpmaddwd` multiplies 16 pairs of i16 and adds each pair into an i32
//! lane: twice the products per instruction of an f32 FMA. The quantisation
//! keeps 13 bits per weight and 14 per activation relative to their
//! row's or block's largest value, more than bf16's 8-bit mantissa for
//! values within a factor 32 of it.

/// Columns per activation scale (32 column pairs).
pub const BLOCK: usize = 64;
/// Largest quantised activation.
pub const A_MAX: f32 = 8191.0;
/// Largest quantised weight.
pub const W_MAX: f32 = 4095.0;

const _: () = assert!((BLOCK as f64) * (A_MAX as f64) * (W_MAX as f64) < 2_147_483_648.0);

/// Quantises `v` into `dst` (same length) to integers in `[-max, max]` and
/// returns the scale (`v ≈ scale · dst`): `max / m` times each value
/// rounded to nearest even, `m` the largest magnitude. An all-zero `v`
/// has scale 0, and so has one whose values are all too small for `max /
/// m` to be finite (below about 2.4e-35 for activations: their products
/// are below f32's resolution of any sum they could change); one with a
/// NaN or an infinity has scale NaN and zeros, so the products it enters
/// are NaN, as in f32.
pub fn quantize(v: &[f32], max: f32, dst: &mut [i16]) -> f32 {
    let mut m = 0.0f32;
    let mut finite = true;
    for &x in v {
        finite &= x.is_finite();
        m = m.max(x.abs());
    }
    if !finite {
        dst.fill(0);
        return f32::NAN;
    }
    let inv = scale_inverse(m, max);
    if inv == 0.0 {
        dst.fill(0);
        return 0.0;
    }
    for (d, &x) in dst.iter_mut().zip(v) {
        *d = (x * inv).round_ties_even() as i16;
    }
    m / max
}

/// `max / m`, or 0 when `m` is 0 or so small that the quotient is not
/// finite (the block then quantises to zeros with scale 0).
pub(crate) fn scale_inverse(m: f32, max: f32) -> f32 {
    let inv = max / m;
    if inv.is_finite() { inv } else { 0.0 }
}

/// The activations of `n` tokens quantised per block of [`BLOCK`] columns.
pub struct Quantized {
    /// `2 · ceil(cols / 2)` values per token (a zero past an odd `cols`).
    q: Vec<i16>,
    /// `ceil(cols / BLOCK)` scales per token.
    s: Vec<f32>,
    cols: usize,
}

impl Quantized {
    /// Quantises `n` tokens of `cols` columns (`x` is `n × cols`).
    pub fn new(x: &[f32], n: usize, cols: usize) -> Self {
        let (lq, nb) = (cols.div_ceil(2) * 2, cols.div_ceil(BLOCK));
        let (mut q, mut s) = (vec![0i16; n * lq], vec![0.0f32; n * nb]);
        for t in 0..n {
            for b in 0..nb {
                let c = b * BLOCK..((b + 1) * BLOCK).min(cols);
                s[t * nb + b] = quantize(&x[t * cols..][c.clone()], A_MAX, &mut q[t * lq..][c]);
            }
        }
        Self { q, s, cols }
    }

    /// Token `t`'s values (`cols` of them) and block scales.
    pub fn token(&self, t: usize) -> (&[i16], &[f32]) {
        let (lq, nb) = (self.cols.div_ceil(2) * 2, self.cols.div_ceil(BLOCK));
        (&self.q[t * lq..t * lq + self.cols], &self.s[t * nb..(t + 1) * nb])
    }
}

/// `bias + sw · Σ_b sa[b] · Σ_{c in b} qx[c] · qw[c]` in the kernel's
/// order (`qw(c)` gives the row's quantised weight of column `c`).
pub fn dot(qx: &[i16], sa: &[f32], qw: impl Fn(usize) -> i16, sw: f32, bias: f32) -> f32 {
    let mut acc = 0.0f32;
    for (b, &s) in sa.iter().enumerate() {
        let c = b * BLOCK..((b + 1) * BLOCK).min(qx.len());
        let sum: i32 = c.map(|c| i32::from(qx[c]) * i32::from(qw(c))).sum();
        acc = (sum as f32).mul_add(s, acc);
    }
    acc.mul_add(sw, bias)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantisation_bounds_and_special_values() {
        let v = [0.5f32, -2.0, 1e-3, 2.0];
        let mut q = [0i16; 4];
        let s = quantize(&v, A_MAX, &mut q);
        assert_eq!(q[1], -8191);
        assert_eq!(q[3], 8191);
        for (&x, &qv) in v.iter().zip(&q) {
            assert!((x - s * f32::from(qv)).abs() <= s * 0.5001, "{x} vs {}", s * f32::from(qv));
        }
        assert_eq!(quantize(&[0.0; 3], A_MAX, &mut q[..3]), 0.0);
        assert_eq!(q[..3], [0, 0, 0]);
        assert!(quantize(&[1.0, f32::NAN], A_MAX, &mut q[..2]).is_nan());
        // Too small for A_MAX / m: zeros, scale 0 (never the saturated
        // garbage an infinite factor would give); just above: exact steps.
        assert_eq!(quantize(&[1e-40, -3e-39], A_MAX, &mut q[..2]), 0.0);
        assert_eq!(q[..2], [0, 0]);
        let s = quantize(&[1e-34, -5e-35], A_MAX, &mut q[..2]);
        assert!(s > 0.0 && q[0] == 8191 && q[1] == -4096, "{s:e} {:?}", &q[..2]);
        assert!(quantize(&[1.0, f32::INFINITY], W_MAX, &mut q[..2]).is_nan());
    }
}
