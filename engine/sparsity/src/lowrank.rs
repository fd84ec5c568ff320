//! The low-rank predictor (Deja Vu / PowerInfer style): scores
//! `ĝ = Q · (P · x)` approximate the gate projection `W_gate · x` before it
//! is computed, so the gate, up and down projections all run on the
//! predicted neurons only.
//!
//! [`fit_to_activations`] trains the factors on real text: given the
//! calibration inputs' second moment `C = Σ x xᵀ`, it solves the
//! reduced-rank regression `min ‖(W_gate − Q P) X‖_F` in closed form
//! (Cholesky `C = L Lᵀ`, the top-`r` right singular vectors `V` of
//! `A = W_gate L`, then `Q = A V` and `P = Vᵀ L⁻¹`): the best rank-`r`
//! predictor of the gate *on the inputs the model actually sees*.
//! [`factors`] is the data-free variant (the gate's own top singular
//! directions). Calibration then sets, per layer, the threshold on
//! `|silu(ĝ)|` that recalls a target fraction of the truly active neurons.
//! At run time both factors are Q8_0 matrices multiplied by the kernels
//! the registry resolves for them at load.

use spinfer_kernel_select::BoundKernel;
use spinfer_kernel_select::registry::KernelRegistry;
use spinfer_kernels::GgmlType;
use spinfer_kernels::blocks::BlockQ8_0;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::quantize::quantize_row_q8_0_ref;
use spinfer_kernels::vec::dot;

use crate::{Error, Result};

/// The top-`r` right singular vectors of `w` (rows × cols, row-major f32),
/// as `r` orthonormal rows of `cols` values: subspace iteration on
/// `A = wᵀw` from a fixed start, so the result is deterministic.
pub fn top_right_singular(w: &[f32], rows: usize, cols: usize, r: usize, iters: usize) -> Result<Vec<f32>> {
    if w.len() != rows * cols {
        return Err(Error::InvalidArgument(format!("low-rank fit: {} values for a {rows}x{cols} matrix", w.len())));
    }
    let r = r.min(cols);
    // wᵀ, so each entry of A is one contiguous dot product.
    let mut wt = vec![0.0f32; cols * rows];
    for i in 0..rows {
        for j in 0..cols {
            wt[j * rows + i] = w[i * cols + j];
        }
    }
    let mut a = vec![0.0f32; cols * cols];
    for i in 0..cols {
        for j in i..cols {
            let v = dot(&wt[i * rows..(i + 1) * rows], &wt[j * rows..(j + 1) * rows]);
            a[i * cols + j] = v;
            a[j * cols + i] = v;
        }
    }
    // Start: a fixed pseudo-random basis.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut v: Vec<f32> = (0..r * cols)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect();
    orthonormalise(&mut v, r, cols);
    let mut next = vec![0.0f32; r * cols];
    for _ in 0..iters {
        // next_k = A v_k (A is symmetric: rows of A dot v_k).
        for k in 0..r {
            let vk = &v[k * cols..(k + 1) * cols];
            for i in 0..cols {
                next[k * cols + i] = dot(&a[i * cols..(i + 1) * cols], vk);
            }
        }
        std::mem::swap(&mut v, &mut next);
        orthonormalise(&mut v, r, cols);
    }
    Ok(v)
}

/// Modified Gram-Schmidt on the `r` rows of `v` (each `n` long).
fn orthonormalise(v: &mut [f32], r: usize, n: usize) {
    for k in 0..r {
        for j in 0..k {
            let (done, rest) = v.split_at_mut(k * n);
            let vj = &done[j * n..(j + 1) * n];
            let vk = &mut rest[..n];
            let p = dot(vj, vk);
            for (a, b) in vk.iter_mut().zip(vj) {
                *a -= p * b;
            }
        }
        let vk = &mut v[k * n..(k + 1) * n];
        let norm = dot(vk, vk).sqrt();
        let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        vk.iter_mut().for_each(|a| *a *= inv);
    }
}

/// A rank-`r` predictor of one layer's gate, ready to run.
pub struct LowRank {
    pub rank: usize,
    /// Keep neurons with `|silu(ĝ)|` above this.
    pub threshold: f32,
    p: Vec<u8>, // (rank, dim) Q8_0
    q: Vec<u8>, // (ffn, rank) Q8_0
    /// The kernels of `P · x` and `Q · t`, resolved at load by the
    /// registry (pins and history apply), each with the built-in kernel
    /// that takes over if a pack's fails.
    kp: BoundKernel,
    kq: BoundKernel,
}

fn to_q8_0(x: &[f32]) -> Result<Vec<u8>> {
    let mut blocks = vec![<BlockQ8_0 as bytemuck::Zeroable>::zeroed(); x.len() / 32];
    quantize_row_q8_0_ref(x, &mut blocks)?;
    Ok(bytemuck::cast_slice(&blocks).to_vec())
}

/// The Q8_0 × Q8_0 kernel of a `rows × cols` factor, from `registry`.
fn kernel(registry: &KernelRegistry, rows: usize, cols: usize) -> Result<BoundKernel> {
    Ok(registry.resolve(&MatmulDesc::dense(GgmlType::Q8_0, ActType::Q8_0, rows, cols))?.into())
}

/// `out = W · x` for one token on `k`.
fn product(
    k: &BoundKernel,
    pool: &ThreadPool,
    w: &[u8],
    x: &[f32],
    out: &mut [f32],
    bytes: &mut Vec<u8>,
) -> Result<()> {
    k.run(pool, "low-rank predictor", MatmulCall::dense(w, x, 1, out, bytes))
        .map_err(|source| Error::Kernel { kernel: k.active().name().into(), source })
}

impl LowRank {
    /// From f32 factors `p` (rank × dim) and `q` (ffn × rank); `rank` and
    /// `dim` must be multiples of 32. Its two products run the kernels
    /// `registry` resolves for them.
    pub fn new(
        p: &[f32],
        q: &[f32],
        (rank, dim, ffn): (usize, usize, usize),
        threshold: f32,
        registry: &KernelRegistry,
    ) -> Result<Self> {
        if rank == 0 || !rank.is_multiple_of(32) || !dim.is_multiple_of(32) {
            return Err(Error::InvalidArgument(format!(
                "low-rank predictor: rank {rank} and dim {dim} must be positive multiples of 32"
            )));
        }
        if p.len() != rank * dim || q.len() != ffn * rank {
            return Err(Error::InvalidArgument(format!(
                "low-rank predictor: factors hold {} and {} values, expected {rank}x{dim} and {ffn}x{rank}",
                p.len(),
                q.len()
            )));
        }
        let (kp, kq) = (kernel(registry, rank, dim)?, kernel(registry, ffn, rank)?);
        Ok(Self { rank, threshold, p: to_q8_0(p)?, q: to_q8_0(q)?, kp, kq })
    }

    /// Predicted gate `ĝ` (ffn) of one token `x` (dim); `t` (rank) and
    /// `bytes` are scratch.
    pub fn scores(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        t: &mut Vec<f32>,
        out: &mut [f32],
        bytes: &mut Vec<u8>,
    ) -> Result<()> {
        t.resize(self.rank, 0.0);
        product(&self.kp, pool, &self.p, x, t, bytes)?;
        product(&self.kq, pool, &self.q, t, out, bytes)
    }

    /// The neurons this predictor keeps for `x`, ascending, into `pred`;
    /// `act` (ffn) gets `silu(ĝ)`. `t` and `bytes` are scratch.
    pub fn predict(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        t: &mut Vec<f32>,
        act: &mut [f32],
        bytes: &mut Vec<u8>,
        pred: &mut Vec<u32>,
    ) -> Result<()> {
        self.scores(pool, x, t, act, bytes)?;
        spinfer_kernels::vec::silu(act);
        pred.clear();
        pred.extend((0..act.len() as u32).filter(|&j| act[j as usize].abs() > self.threshold));
        Ok(())
    }

    /// Bytes read per token.
    pub fn bytes(&self) -> usize {
        self.p.len() + self.q.len()
    }
}

/// The f32 factors `(p, q)` of the rank-`rank` predictor of `w_gate`
/// (ffn × dim, f32).
pub fn factors(w_gate: &[f32], ffn: usize, dim: usize, rank: usize, iters: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    let p = top_right_singular(w_gate, ffn, dim, rank, iters)?;
    let mut q = vec![0.0f32; ffn * rank];
    for j in 0..ffn {
        let row = &w_gate[j * dim..(j + 1) * dim];
        for k in 0..rank {
            q[j * rank + k] = dot(row, &p[k * dim..(k + 1) * dim]);
        }
    }
    Ok((p, q))
}

/// The rank-`rank` factors `(p, q)` of the gate `w_gate` (ffn × dim, f32)
/// that best predict `w_gate · x` in least squares over inputs with second
/// moment `c` (dim × dim, `Σ x xᵀ`, f64): reduced-rank regression, solved
/// in closed form (see the module docs). A ridge of `1e-6 · trace(c) / dim`
/// keeps `c` positive definite when some input directions never vary; when
/// rounding still defeats the factorisation (fewer calibration tokens than
/// dimensions), the ridge grows a hundredfold at a time, up to the mean
/// variance itself.
pub fn fit_to_activations(
    w_gate: &[f32],
    c: &[f64],
    ffn: usize,
    dim: usize,
    rank: usize,
    iters: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    if w_gate.len() != ffn * dim || c.len() != dim * dim {
        return Err(Error::InvalidArgument(format!(
            "low-rank fit: {} gate values and a {}-entry moment for ffn {ffn}, dim {dim}",
            w_gate.len(),
            c.len()
        )));
    }
    let l = cholesky(c, dim)?;
    // A = W L (ffn × dim); L is lower triangular.
    let mut a = vec![0.0f32; ffn * dim];
    for (row, out) in w_gate.chunks_exact(dim).zip(a.chunks_exact_mut(dim)) {
        for (j, o) in out.iter_mut().enumerate() {
            // Σ_k w[k] L[k, j] over k >= j.
            *o = (j..dim).map(|k| f64::from(row[k]) * l[k * dim + j]).sum::<f64>() as f32;
        }
    }
    let v = top_right_singular(&a, ffn, dim, rank, iters)?;
    let rank = v.len() / dim;
    // Q = A V (ffn × rank).
    let mut q = vec![0.0f32; ffn * rank];
    for (row, out) in a.chunks_exact(dim).zip(q.chunks_exact_mut(rank)) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = dot(row, &v[k * dim..(k + 1) * dim]);
        }
    }
    // P = Vᵀ L⁻¹: row k of P solves Lᵀ pₖ = vₖ (back substitution).
    let mut p = vec![0.0f32; rank * dim];
    for k in 0..rank {
        let vk = &v[k * dim..(k + 1) * dim];
        let mut x = vec![0.0f64; dim];
        for i in (0..dim).rev() {
            let s: f64 = (i + 1..dim).map(|j| l[j * dim + i] * x[j]).sum();
            x[i] = (f64::from(vk[i]) - s) / l[i * dim + i];
        }
        for (o, &xi) in p[k * dim..(k + 1) * dim].iter_mut().zip(&x) {
            *o = xi as f32;
        }
    }
    Ok((p, q))
}

/// The lower-triangular `L` with `L Lᵀ = c + ridge·I` (`n × n`, row-major)
/// for the smallest ridge in `1e-6, 1e-4, 1e-2, 1` times the mean diagonal
/// that factorises.
fn cholesky(c: &[f64], n: usize) -> Result<Vec<f64>> {
    let mean = (0..n).map(|i| c[i * n + i]).sum::<f64>() / n.max(1) as f64;
    let mut last = None;
    for rel in [1e-6, 1e-4, 1e-2, 1.0] {
        match cholesky_with(c, n, rel * mean + f64::MIN_POSITIVE) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| Error::InvalidArgument("low-rank fit: empty input moment".into())))
}

fn cholesky_with(c: &[f64], n: usize, ridge: f64) -> Result<Vec<f64>> {
    let mut l = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i * n + k] * l[j * n + k]).sum();
            if i == j {
                let d = c[i * n + i] + ridge - s;
                if !(d > 0.0 && d.is_finite()) {
                    return Err(Error::InvalidArgument(format!(
                        "low-rank fit: the input moment is not positive definite (pivot {i} is {d})"
                    )));
                }
                l[i * n + i] = d.sqrt();
            } else {
                l[i * n + j] = (c[i * n + j] - s) / l[j * n + j];
            }
        }
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On inputs confined to a few directions, the activation fit predicts
    /// the gate far better than the data-free fit of the same rank.
    #[test]
    fn activation_fit_beats_the_weight_fit_on_structured_inputs() {
        let (ffn, dim, rank, n) = (64, 32, 4, 400);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let w: Vec<f32> = (0..ffn * dim).map(|_| rnd()).collect();
        // Inputs: 4 random directions with large weights plus small noise.
        let dirs: Vec<f32> = (0..4 * dim).map(|_| rnd()).collect();
        let xs: Vec<Vec<f32>> = (0..n)
            .map(|_| {
                let coef: Vec<f32> = (0..4).map(|_| 4.0 * rnd()).collect();
                (0..dim).map(|j| (0..4).map(|d| coef[d] * dirs[d * dim + j]).sum::<f32>() + 0.01 * rnd()).collect()
            })
            .collect();
        let mut c = vec![0.0f64; dim * dim];
        for x in &xs {
            for i in 0..dim {
                for j in 0..dim {
                    c[i * dim + j] += f64::from(x[i]) * f64::from(x[j]);
                }
            }
        }
        let err = |p: &[f32], q: &[f32]| {
            let (mut e, mut norm) = (0.0f64, 0.0f64);
            for x in &xs {
                let t: Vec<f32> = (0..rank).map(|k| dot(&p[k * dim..(k + 1) * dim], x)).collect();
                for i in 0..ffn {
                    let g = dot(&w[i * dim..(i + 1) * dim], x);
                    let gh = dot(&q[i * rank..(i + 1) * rank], &t);
                    e += f64::from(g - gh).powi(2);
                    norm += f64::from(g).powi(2);
                }
            }
            e / norm
        };
        let (p, q) = fit_to_activations(&w, &c, ffn, dim, rank, 60).unwrap();
        let (pw, qw) = factors(&w, ffn, dim, rank, 60).unwrap();
        let (fit, free) = (err(&p, &q), err(&pw, &qw));
        assert!(fit < 1e-3, "activation fit: relative error {fit}");
        assert!(free > 10.0 * fit, "weight fit {free} vs activation fit {fit}");
        // A singular moment (an input direction that never varies) is handled.
        let mut c0 = c.clone();
        for j in 0..dim {
            c0[j] = 0.0;
            c0[j * dim] = 0.0;
        }
        assert!(fit_to_activations(&w, &c0, ffn, dim, rank, 60).is_ok());
        // So is one from fewer samples than dimensions (rank-deficient).
        let mut c2 = vec![0.0f64; dim * dim];
        for x in &xs[..3] {
            for i in 0..dim {
                for j in 0..dim {
                    c2[i * dim + j] += f64::from(x[i]) * f64::from(x[j]);
                }
            }
        }
        assert!(fit_to_activations(&w, &c2, ffn, dim, rank, 60).is_ok());
        assert!(fit_to_activations(&w, &c[1..], ffn, dim, rank, 60).is_err());
    }

    #[test]
    fn recovers_the_dominant_subspace_of_a_low_rank_matrix() {
        // w = Σ_k s_k u_k v_kᵀ with s = 10, 5, 0.01: rank 2 captures it.
        let (rows, cols) = (40, 64);
        let basis = |n: usize, k: usize, i: usize| ((i * (k + 3) * 7 + k) % 13) as f32 - 6.0 + (n as f32) * 0.0;
        let mut w = vec![0.0f32; rows * cols];
        for (k, s) in [10.0f32, 5.0, 0.01].iter().enumerate() {
            for i in 0..rows {
                for j in 0..cols {
                    w[i * cols + j] += s * basis(rows, k, i) * basis(cols, k + 5, j);
                }
            }
        }
        let (p, q) = factors(&w, rows, cols, 2, 100).unwrap();
        // p rows orthonormal.
        assert!((dot(&p[..cols], &p[..cols]) - 1.0).abs() < 1e-4);
        assert!(dot(&p[..cols], &p[cols..2 * cols]).abs() < 1e-4);
        // q p ≈ w: relative error tiny.
        let (mut err, mut norm) = (0.0f64, 0.0f64);
        for i in 0..rows {
            for j in 0..cols {
                let approx: f32 = (0..2).map(|k| q[i * 2 + k] * p[k * cols + j]).sum();
                err += f64::from(approx - w[i * cols + j]).powi(2);
                norm += f64::from(w[i * cols + j]).powi(2);
            }
        }
        assert!(err / norm < 1e-4, "relative error {}", err / norm);
    }
}
