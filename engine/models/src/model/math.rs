//! Small f32 building blocks of the forward pass: normalisation, RoPE,
//! activation, attention. The heavy matmuls go through the kernel seam; these
//! are O(n·d) (attention O(n²·d)); the vector primitives they use come
//! from `spinfer_kernels::vec` (SIMD with a scalar reference).

/// `out = x / sqrt(mean(x²) + eps) * w` (RMSNorm), for one row.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = dot(x, x);
    let scale = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * scale * wi;
    }
}

/// [`rms_norm`] of each `dim`-wide row of `x` (`n` rows) into `out`.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32], n: usize) {
    let dim = w.len();
    for (xr, or) in x[..n * dim].chunks_exact(dim).zip(out[..n * dim].chunks_exact_mut(dim)) {
        rms_norm(xr, w, eps, or);
    }
}

/// [`rms_norm`] of `x` in place.
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = *xi * scale * wi;
    }
}

pub use spinfer_kernels::vec::{axpy, dot, geglu, silu, softmax, swiglu};

/// Precomputed RoPE rotation table: `cos`/`sin` of `pos * theta^(-2i/d)`
/// for every position up to the context size and every pair `i < d/2`.
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// The table for `n_pos` positions; an error (never an abort) when its
    /// size overflows or the memory cannot be had.
    pub fn new(head_dim: usize, theta: f32, n_pos: usize) -> crate::Result<Self> {
        let half = head_dim / 2;
        let len = n_pos.checked_mul(half).filter(|&n| n <= isize::MAX as usize / 4);
        let too_big = || {
            crate::Error::InvalidArgument(format!(
                "a RoPE table of {n_pos} positions x {half} frequencies does not fit in memory (lower the context size)"
            ))
        };
        let len = len.ok_or_else(too_big)?;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        cos.try_reserve_exact(len).map_err(|_| too_big())?;
        sin.try_reserve_exact(len).map_err(|_| too_big())?;
        // Frequencies as HF computes them (f32 inverse frequencies), angles
        // in f64 so large positions keep their precision.
        let inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        for p in 0..n_pos {
            for &f in &inv_freq {
                let a = p as f64 * f as f64;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok(Self { half, cos, sin })
    }

    /// Rotates one head vector at position `pos`; `neox` pairs `(i, i+d/2)`,
    /// otherwise adjacent pairs `(2i, 2i+1)`.
    pub fn apply(&self, x: &mut [f32], pos: usize, neox: bool) {
        let h = self.half;
        let (cos, sin) = (&self.cos[pos * h..(pos + 1) * h], &self.sin[pos * h..(pos + 1) * h]);
        if neox {
            let (a, b) = x.split_at_mut(h);
            for i in 0..h {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * cos[i] - x1 * sin[i];
                b[i] = x0 * sin[i] + x1 * cos[i];
            }
        } else {
            for i in 0..h {
                let (x0, x1) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = x0 * cos[i] - x1 * sin[i];
                x[2 * i + 1] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }

    pub fn n_pos(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let t = RopeTable::new(4, 10_000.0, 8).unwrap();
        let mut a = [1.0, 2.0, 3.0, 4.0];
        t.apply(&mut a, 0, false);
        assert_eq!(a, [1.0, 2.0, 3.0, 4.0]);
        for neox in [false, true] {
            let mut b = [0.3, -1.2, 2.5, 0.7];
            let n0 = dot(&b, &b);
            t.apply(&mut b, 5, neox);
            assert!((dot(&b, &b) - n0).abs() < 1e-5);
        }
        // First pair rotates by angle pos * 1.
        let mut c = [1.0, 0.0, 0.0, 0.0];
        t.apply(&mut c, 1, false);
        assert!((c[0] - 1f32.cos()).abs() < 1e-6 && (c[1] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn softmax_and_norm() {
        let mut x = [1.0, 2.0, 3.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[2] > x[1] && x[1] > x[0]);
        let mut out = [0.0; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let s = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / s).abs() < 1e-6 && (out[1] - 8.0 / s).abs() < 1e-6);
    }
}
