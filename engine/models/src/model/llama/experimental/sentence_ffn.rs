//! The sentence-level sparse FFN (CoreInfer / GRIFFIN style): one mask per
//! request. The first forward of a session (the prompt) runs the FFN dense
//! and ranks each layer's neurons by their mean contribution
//! `|silu(gate)·up|` over the prompt's tokens; the `keep` strongest form
//! the request's mask. Their gate and up rows are copied into compact
//! matrices once, so every later token (decode) runs the dense kernels on
//! those rows and the down projection over those neurons only: no
//! per-token prediction, no per-token gathering.

use crate::Result;
use crate::model::llama::{GatheredRows, Model, Session, grow};
use crate::model::math;
use spinfer_sparsity::SparseFfn;

/// One layer's mask for the current request.
#[derive(Default)]
pub(in crate::model::llama) struct SentenceMask {
    /// Kept neurons, ascending.
    idx: Vec<u32>,
    /// Their gate rows and up rows, compact (k rows each, file format).
    gate: Vec<u8>,
    up: Vec<u8>,
    /// Mean |silu(gate)·up| per neuron over the prompt (ffn_dim).
    score: Vec<f32>,
}

impl Model {
    /// Sentence-level FFN of layer `l` for the `n` tokens of this step,
    /// from `s.xn` into `s.tmp`.
    pub(in crate::model::llama) fn sentence_ffn(
        &self,
        s: &mut Session,
        l: usize,
        n: usize,
        sp: &SparseFfn,
    ) -> Result<()> {
        let (dim, ffn) = (self.config.dim, self.config.ffn_dim);
        let layer = &self.weights.layers[l];
        let keep = sp.layers[l].keep.min(ffn);
        if s.sparse.sentence.len() < self.config.n_layers {
            s.sparse.sentence.resize_with(self.config.n_layers, SentenceMask::default);
        }
        let counters = &mut s.sparse.stats.layers[l];
        counters.tokens += n as u64;
        if s.at_start {
            // The prompt: dense, and it chooses the request's neurons.
            counters.active += (n * ffn) as u64;
            counters.dense += n as u64;
            grow(&mut s.gate, n * ffn);
            grow(&mut s.up, n * ffn);
            layer.w_gate.forward(&s.pool, &s.xn, n, &mut s.gate, &mut s.scratch)?;
            layer.w_up.forward(&s.pool, &s.xn, n, &mut s.up, &mut s.scratch)?;
            math::swiglu(&mut s.gate[..n * ffn], &s.up[..n * ffn]);
            let m = &mut s.sparse.sentence[l];
            m.score.clear();
            m.score.resize(ffn, 0.0);
            for row in s.gate[..n * ffn].chunks_exact(ffn) {
                for (sc, h) in m.score.iter_mut().zip(row) {
                    *sc += h.abs();
                }
            }
            // The `keep` largest scores, in index order (ties by index).
            let mut order: Vec<u32> = (0..ffn as u32).collect();
            order.sort_by(|&a, &b| m.score[b as usize].total_cmp(&m.score[a as usize]).then(a.cmp(&b)));
            order.truncate(keep);
            order.sort_unstable();
            m.idx = order;
            let rb = layer.w_gate.raw_weights().len() / ffn;
            let gather = |w: &[u8], dst: &mut Vec<u8>| spinfer_sparse_kernels::gather_rows(&s.pool, w, rb, &m.idx, dst);
            gather(layer.w_gate.raw_weights(), &mut m.gate)?;
            gather(layer.w_up.raw_weights(), &mut m.up)?;
            return layer.w_down.forward(&s.pool, &s.gate, n, &mut s.tmp, &mut s.scratch);
        }
        // Later tokens: the request's neurons only.
        let m = &s.sparse.sentence[l];
        let k = m.idx.len();
        counters.active += (n * k) as u64;
        grow(&mut s.gate, n * k);
        grow(&mut s.up, n * k);
        let gate = GatheredRows { x: &s.xn, n, rows: &m.gate, idx: &m.idx };
        layer.w_gate.forward_gathered(&s.pool, gate, &mut s.gate[..n * k], &mut s.scratch)?;
        let up = GatheredRows { x: &s.xn, n, rows: &m.up, idx: &m.idx };
        layer.w_up.forward_gathered(&s.pool, up, &mut s.up[..n * k], &mut s.scratch)?;
        math::swiglu(&mut s.gate[..n * k], &s.up[..n * k]);
        for t in 0..n {
            let out = &mut s.tmp[t * dim..(t + 1) * dim];
            sp.layers[l].down.axpy(
                &s.pool,
                dim,
                layer.w_down.raw_weights(),
                &m.idx,
                &s.gate[t * k..(t + 1) * k],
                out,
                sp.axpy,
            )?;
        }
        if s.sparse.measure_truth {
            let sc = &mut s.sparse;
            for x in s.xn[..n * dim].chunks_exact(dim) {
                let (m, c) = (&sc.sentence[l], &mut sc.stats.layers[l]);
                let th = sp.layers[l].threshold;
                crate::model::llama::sparse_ffn::count_truth(
                    &layer.w_gate,
                    &s.pool,
                    x,
                    th,
                    &m.idx,
                    &mut sc.truth,
                    &mut s.scratch,
                    c,
                )?;
            }
        }
        Ok(())
    }
}
