//! The metric the head's rows are clustered in: how far apart two rows'
//! logits fall on the hidden states the model actually produces.
//!
//! Two rows `w`, `v` give logits that differ by `(w - v)·h`; over the
//! hidden states `h` of real text the expected squared difference is
//! `(w - v)ᵀ M (w - v)` with `M = E[h hᵀ]`, the second moment of the
//! final-normed hidden states. Those states are far from isotropic (a few
//! directions carry most of their energy), so rows close in plain cosine
//! terms can give quite different logits. With `M + λI = L Lᵀ` (Cholesky,
//! `λ` a small ridge), the rows mapped to `Lᵀ w` are clustered instead:
//! distances there are expected logit differences, and a cluster's spread
//! there is the expected variance of its rows' logits around its mean
//! row's logit, which the sparse head uses to rank clusters and to stand
//! in for the rows it does not compute (`super::SparseHead`).

use spinfer_kernels::pool::ThreadPool;

use super::kmeans;
use crate::model::{Model, Session};
use crate::{Error, Result};

/// Ridge added to `M`, relative to its mean eigenvalue (`tr M / dim`):
/// keeps the factorisation well defined, and keeps directions the
/// calibration text rarely uses from counting for nothing (hidden states
/// of other text use them). Chosen by measurement (docs/sparsity.md:
/// 0.1 agreed best on WikiText-2 but missed the argmax of two reference
/// prompts at 25% of SmolLM2's rows; 0.5 agrees as well and misses none).
const RIDGE: f64 = 0.5;

/// Longest window of calibration text run at once.
const WINDOW: usize = 512;

/// The second moment of a model's final-normed hidden states over some
/// calibration text.
#[derive(Clone, Debug)]
pub struct HiddenMoment {
    dim: usize,
    /// `dim × dim`, symmetric.
    m: Vec<f64>,
    /// Positions averaged.
    pub positions: usize,
}

impl HiddenMoment {
    /// Runs `tokens` through `model` (windows of up to 512 tokens, each
    /// from an empty cache) and averages `h hᵀ` over every position's
    /// final-normed hidden state `h`.
    pub fn measure(model: &Model, session: &mut Session, tokens: &[u32]) -> Result<Self> {
        let dim = model.config.dim;
        let window = WINDOW.min(session.ctx());
        if tokens.is_empty() || window == 0 {
            return Err(Error::InvalidArgument("the head's metric needs calibration tokens".into()));
        }
        let mut m = vec![0f64; dim * dim];
        let mut row = vec![0f64; dim];
        for win in tokens.chunks(window) {
            session.reset();
            model.forward(session, win)?;
            for h in model.hidden_states(session, 0..win.len()).chunks_exact(dim) {
                row.iter_mut().zip(h).for_each(|(r, &x)| *r = x as f64);
                // The upper triangle (mirrored below at the end).
                for i in 0..dim {
                    let (hi, dst) = (row[i], &mut m[i * dim + i..(i + 1) * dim]);
                    dst.iter_mut().zip(&row[i..]).for_each(|(a, &b)| *a += hi * b);
                }
            }
        }
        session.reset();
        let n = tokens.len() as f64;
        for i in 0..dim {
            for j in i..dim {
                let v = m[i * dim + j] / n;
                m[i * dim + j] = v;
                m[j * dim + i] = v;
            }
        }
        Ok(Self { dim, m, positions: tokens.len() })
    }

    /// The ridge `λ` added to `M`.
    fn ridge(&self) -> f64 {
        RIDGE * (0..self.dim).map(|i| self.m[i * self.dim + i]).sum::<f64>() / self.dim as f64
    }

    /// `Lᵀ` as an f32 `dim × dim` matrix, row-major (row `j` is column `j`
    /// of `L`), where `L Lᵀ = M + λI`.
    fn factor_transposed(&self) -> Result<Vec<f32>> {
        let (d, ridge) = (self.dim, self.ridge());
        if !(ridge.is_finite() && ridge > 0.0) {
            return Err(Error::InvalidArgument(
                "the calibration text's hidden states are all zero or not finite: no metric for the head".into(),
            ));
        }
        let mut l = vec![0f64; d * d];
        for i in 0..d {
            for j in 0..=i {
                let dot: f64 = (0..j).map(|t| l[i * d + t] * l[j * d + t]).sum();
                let s = self.m[i * d + j] + if i == j { ridge } else { 0.0 } - dot;
                // M + λI is positive definite: the pivot stays above λ.
                l[i * d + j] = if i == j { s.max(ridge).sqrt() } else { s / l[j * d + j] };
            }
        }
        Ok((0..d * d).map(|x| l[(x % d) * d + x / d] as f32).collect())
    }

    /// Rows `ids` of `rows` (`vocab × dim`) mapped to `Lᵀ w`, in that
    /// order: plain distances there are expected logit differences.
    pub(crate) fn transform(&self, pool: &ThreadPool, rows: &[f32], ids: &[u32]) -> Result<Vec<f32>> {
        let d = self.dim;
        let lt = self.factor_transposed()?;
        let mut out = Vec::new();
        out.try_reserve_exact(ids.len() * d)
            .map_err(|e| Error::InvalidArgument(format!("{} x {d} mapped head rows: {e}", ids.len())))?;
        out.resize(ids.len() * d, 0.0);
        // Gathered a batch at a time (no second copy of all the rows).
        let mut batch = Vec::with_capacity(4096 * d);
        for (b, part) in ids.chunks(4096).enumerate() {
            batch.clear();
            part.iter().for_each(|&r| batch.extend_from_slice(&rows[r as usize * d..][..d]));
            let dst = &mut out[b * 4096 * d..];
            kmeans::score_all(pool, &batch, &lt, d, d, &mut |r, u| dst[r * d..(r + 1) * d].copy_from_slice(u))?;
        }
        Ok(out)
    }

    /// The hidden size.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The expected variance of a cluster's logits around its mean row's
    /// logit, `mean_r (w_r - m)ᵀ M (w_r - m)`, from its rows `rows` and
    /// their images `mapped` under [`HiddenMoment::transform`] (the ridge's
    /// share taken out again).
    pub(crate) fn spread(&self, rows: &[&[f32]], mapped: &[&[f32]]) -> f32 {
        let n = rows.len().max(1) as f64;
        let mean = |v: &[&[f32]]| -> Vec<f64> {
            let mut m = vec![0f64; self.dim];
            v.iter().for_each(|r| m.iter_mut().zip(*r).for_each(|(a, &b)| *a += b as f64));
            m.iter_mut().for_each(|a| *a /= n);
            m
        };
        let sq = |v: &[&[f32]], m: &[f64]| -> f64 {
            v.iter().map(|r| r.iter().zip(m).map(|(&x, c)| (x as f64 - c).powi(2)).sum::<f64>()).sum::<f64>() / n
        };
        let (mw, mu) = (mean(rows), mean(mapped));
        (sq(mapped, &mu) - self.ridge() * sq(rows, &mw)).max(0.0) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Lᵀ` factors `M + λI`, and a cluster's spread is the mean of
    /// `δᵀ M δ` over its rows, computed directly.
    #[test]
    fn factor_and_spread_match_the_definitions() {
        let d = 4;
        // A positive semi-definite M of rank 2 (so the ridge matters).
        let a = [[1.0, 2.0, 0.5, -1.0], [0.0, -1.0, 3.0, 0.5]];
        let mut m = vec![0f64; d * d];
        for v in a {
            (0..d * d).for_each(|x| m[x] += v[x / d] * v[x % d]);
        }
        let hm = HiddenMoment { dim: d, m: m.clone(), positions: 2 };
        let lt = hm.factor_transposed().unwrap();
        let ridge = hm.ridge();
        for i in 0..d {
            for j in 0..d {
                let llt: f64 = (0..d).map(|t| lt[t * d + i] as f64 * lt[t * d + j] as f64).sum();
                let want = m[i * d + j] + if i == j { ridge } else { 0.0 };
                assert!((llt - want).abs() < 1e-4 * (1.0 + want.abs()), "({i},{j}): {llt} vs {want}");
            }
        }
        let rows = [[0.3f32, -1.0, 2.0, 0.1], [1.0, 0.5, -0.5, 2.0], [-0.7, 0.2, 0.9, -1.1]];
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let pool = ThreadPool::new(1);
        let flat: Vec<f32> = rows.concat();
        let mapped = hm.transform(&pool, &flat, &[0, 1, 2]).unwrap();
        let mrefs: Vec<&[f32]> = mapped.chunks_exact(d).collect();
        let mean: Vec<f64> = (0..d).map(|i| rows.iter().map(|r| r[i] as f64).sum::<f64>() / 3.0).collect();
        let want = rows
            .iter()
            .map(|r| {
                let del: Vec<f64> = (0..d).map(|i| r[i] as f64 - mean[i]).collect();
                (0..d * d).map(|x| del[x / d] * m[x] * del[x % d]).sum::<f64>()
            })
            .sum::<f64>()
            / 3.0;
        let got = hm.spread(&refs, &mrefs) as f64;
        assert!((got - want).abs() < 1e-3 * want, "{got} vs {want}");
    }
}
