//! The sparse SwiGLU FFN: per token, keep the neurons the predictor picks
//! from `silu(gate)`, run the up projection on their rows only and
//! accumulate only their down-projection columns.

use super::{Model, Session, grow};
use crate::Result;
use crate::model::math;
use crate::sparse::{PredictorKind, SparseFfn, select_neurons};

impl Model {
    /// FFN of layer `l` for the `n` tokens of this step: `s.gate` holds the
    /// gate projection of `s.xn`; the FFN output goes to `s.tmp`.
    pub(super) fn sparse_ffn(&self, s: &mut Session, l: usize, n: usize, sp: &SparseFfn) -> Result<()> {
        let (dim, ffn) = (self.config.dim, self.config.ffn_dim);
        let layer = &self.weights.layers[l];
        let sl = &sp.layers[l];
        let dense_above = (sp.dense_above * ffn as f32) as usize;
        grow(&mut s.up, ffn);
        grow(&mut s.sparse.up, ffn);
        grow(&mut s.sparse.h, ffn);
        let input_magnitude = sp.predictor == PredictorKind::InputMagnitude;
        if input_magnitude {
            // The down projection's input in full: h = silu(gate) * up.
            layer.w_up.forward(&s.pool, &s.xn, n, &mut s.up, &mut s.scratch)?;
            math::swiglu(&mut s.gate[..n * ffn], &s.up[..n * ffn]);
        }
        for t in 0..n {
            // Activations (silu(gate), or h) and the neurons to keep.
            let act = &mut s.gate[t * ffn..(t + 1) * ffn];
            if !input_magnitude {
                math::silu(act);
            }
            let sc = &mut s.sparse;
            select_neurons(sp.predictor, sl, act, &mut sc.idx, &mut sc.mags);
            let k = sc.idx.len();
            let counters = &mut sc.stats.layers[l];
            counters.tokens += 1;
            counters.active += k as u64;
            let x = &s.xn[t * dim..(t + 1) * dim];
            let out = &mut s.tmp[t * dim..(t + 1) * dim];
            if input_magnitude {
                // Down projection over the kept inputs only.
                for (h, &j) in sc.h[..k].iter_mut().zip(&sc.idx) {
                    *h = act[j as usize];
                }
                if k > dense_above {
                    counters.dense += 1;
                    layer.w_down.forward(&s.pool, act, 1, out, &mut s.scratch)?;
                } else {
                    sl.down.axpy(&s.pool, dim, &sc.idx, &sc.h[..k], out)?;
                }
                continue;
            }
            if k > dense_above {
                // Too many to gain from: dense for this token.
                counters.dense += 1;
                layer.w_up.forward(&s.pool, x, 1, &mut s.up[..ffn], &mut s.scratch)?;
                for (a, u) in act.iter_mut().zip(&s.up[..ffn]) {
                    *a *= u;
                }
                layer.w_down.forward(&s.pool, act, 1, out, &mut s.scratch)?;
                continue;
            }
            // Up projection on the kept rows only.
            layer.w_up.forward_rows(&s.pool, x, 1, &sc.idx, &mut sc.up[..k], &mut s.scratch)?;
            // h = silu(gate) * up on the kept neurons.
            for ((h, &j), &u) in sc.h[..k].iter_mut().zip(&sc.idx).zip(&sc.up[..k]) {
                *h = act[j as usize] * u;
            }
            // Down projection: out = Σ_k h_k · W_down[:, idx_k].
            sl.down.axpy(&s.pool, dim, &sc.idx, &sc.h[..k], out)?;
        }
        Ok(())
    }
}
