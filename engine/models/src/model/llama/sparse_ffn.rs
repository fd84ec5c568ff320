//! The sparse SwiGLU FFN: per token, keep the neurons the predictor picks,
//! run the up projection on their rows only and accumulate only their
//! down-projection columns. Under a memory budget the same arithmetic runs
//! on records gathered from the FFN bundle (see [`spinfer_sparsity::bundle`]).

use super::{GatheredRows, Linear, Model, Scratch, Session, grow};
use crate::model::math;
use crate::{Error, Result};
use spinfer_kernel_select::registry::Found;
use spinfer_kernels::pool::ThreadPool;
use spinfer_plugin_api::PredictorBox;
use spinfer_plugin_api::abi_stable::std_types::RSliceMut;
use spinfer_sparsity::bundle::FfnBundle;
use spinfer_sparsity::{LayerCounters, Predictor, PredictorKind, SparseFfn, select_neurons};

impl Model {
    /// FFN of layer `l` for the `n` tokens of this step, from `s.xn` into
    /// `s.tmp`.
    pub(super) fn sparse_ffn(&self, s: &mut Session, l: usize, n: usize, sp: &SparseFfn) -> Result<()> {
        if matches!(sp.predictor, Predictor::Sentence) {
            return self.sentence_ffn(s, l, n, sp);
        }
        if let Some(b) = &sp.bundle {
            return self.budgeted_ffn(s, l, n, sp, b);
        }
        let (dim, ffn) = (self.config.dim, self.config.ffn_dim);
        let layer = &self.weights.layers[l];
        let sl = &sp.layers[l];
        let dense_above = (sp.dense_above * ffn as f32) as usize;
        grow(&mut s.gate, n * ffn);
        grow(&mut s.up, n * ffn);
        grow(&mut s.sparse.up, ffn);
        grow(&mut s.sparse.h, ffn);
        let predictor = sp.predictor.kind();
        match predictor {
            // The mask comes before the gate: computed per token below.
            // (Sentence-level masks are handled by `sentence_ffn`.)
            PredictorKind::LowRank | PredictorKind::Sentence | PredictorKind::Pack => {}
            // The down projection's input in full: h = silu(gate) * up.
            PredictorKind::InputMagnitude => {
                layer.w_gate.forward(&s.pool, &s.xn, n, &mut s.gate, &mut s.scratch)?;
                layer.w_up.forward(&s.pool, &s.xn, n, &mut s.up, &mut s.scratch)?;
                math::swiglu(&mut s.gate[..n * ffn], &s.up[..n * ffn]);
                if n > 1 {
                    // Several tokens (prefill): zero the skipped inputs and
                    // run the dense kernel, which reads W_down once for all
                    // of them; the same masked product as the AXPY below.
                    let counters = &mut s.sparse.stats.layers[l];
                    for act in s.gate[..n * ffn].chunks_exact_mut(ffn) {
                        let k = act.iter().filter(|a| a.abs() > sl.input_threshold).count();
                        counters.tokens += 1;
                        counters.active += k as u64;
                        if k > dense_above {
                            counters.dense += 1;
                        } else {
                            act.iter_mut().filter(|a| a.abs() <= sl.input_threshold).for_each(|a| *a = 0.0);
                        }
                    }
                    return layer.w_down.forward(&s.pool, &s.gate, n, &mut s.tmp, &mut s.scratch);
                }
            }
            PredictorKind::GateThreshold | PredictorKind::TopK => {
                layer.w_gate.forward(&s.pool, &s.xn, n, &mut s.gate, &mut s.scratch)?;
            }
        }
        for t in 0..n {
            let x = &s.xn[t * dim..(t + 1) * dim];
            let out = &mut s.tmp[t * dim..(t + 1) * dim];
            let act = &mut s.gate[t * ffn..(t + 1) * ffn];
            let sc = &mut s.sparse;
            // The neurons to keep, and act[j] = silu(gate_j) (or h_j) for them.
            match predictor {
                PredictorKind::LowRank | PredictorKind::Pack => {
                    // The neurons chosen before the gate: a pack's mask, or
                    // the low-rank prediction of the gate.
                    let pack = predictor == PredictorKind::Pack;
                    if let Predictor::Pack(pp) = &sp.predictor {
                        pack_mask(pp, l, x, ffn, &mut sc.mask, &mut sc.pred)?;
                    } else if let Predictor::LowRank(lr) = &sp.predictor {
                        lr[l].predict(&s.pool, x, &mut sc.mags, act, &mut s.scratch.bytes, &mut sc.pred)?;
                    }
                    if sc.measure_truth {
                        let c = &mut sc.stats.layers[l];
                        count_truth(
                            &layer.w_gate,
                            &s.pool,
                            x,
                            sl.threshold,
                            &sc.pred,
                            &mut sc.truth,
                            &mut s.scratch,
                            c,
                        )?;
                    }
                    // Their exact gate values; a pack's choice is kept
                    // whole, the low-rank one filtered by the gate
                    // threshold (CATS).
                    let k = sc.pred.len();
                    layer.w_gate.forward_rows(&s.pool, x, 1, &sc.pred, &mut sc.up[..k], &mut s.scratch)?;
                    math::silu(&mut sc.up[..k]);
                    sc.idx.clear();
                    for (&j, &a) in sc.pred.iter().zip(&sc.up[..k]) {
                        act[j as usize] = a;
                        if pack || a.abs() > sl.threshold {
                            sc.idx.push(j);
                        }
                    }
                    sc.stats.layers[l].predicted += k as u64;
                }
                PredictorKind::InputMagnitude | PredictorKind::Sentence => {
                    select_neurons(predictor, sl, act, &mut sc.idx, &mut sc.mags)
                }
                PredictorKind::GateThreshold | PredictorKind::TopK => {
                    math::silu(act);
                    select_neurons(predictor, sl, act, &mut sc.idx, &mut sc.mags);
                }
            }
            let k = sc.idx.len();
            let counters = &mut sc.stats.layers[l];
            counters.tokens += 1;
            counters.active += k as u64;
            if predictor == PredictorKind::InputMagnitude {
                // Down projection over the kept inputs only.
                for (h, &j) in sc.h[..k].iter_mut().zip(&sc.idx) {
                    *h = act[j as usize];
                }
                if k > dense_above {
                    counters.dense += 1;
                    layer.w_down.forward(&s.pool, act, 1, out, &mut s.scratch)?;
                } else {
                    sl.down.axpy(&s.pool, dim, layer.w_down.raw_weights(), &sc.idx, &sc.h[..k], out, sp.axpy)?;
                }
                continue;
            }
            // (Not when a predictor chose before the gate: the gate was
            // computed for the chosen neurons only.)
            if k > dense_above && !matches!(predictor, PredictorKind::LowRank | PredictorKind::Pack) {
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
            sl.down.axpy(&s.pool, dim, layer.w_down.raw_weights(), &sc.idx, &sc.h[..k], out, sp.axpy)?;
        }
        Ok(())
    }

    /// The low-rank sparse FFN of layer `l` under a memory budget: the
    /// predictor's neurons are gathered from the bundle (hot records in RAM,
    /// cold ones from the cache or the file), then gate, up and down run on
    /// those records exactly as [`Model::sparse_ffn`] runs them on the
    /// model's matrices, which are never read here.
    fn budgeted_ffn(&self, s: &mut Session, l: usize, n: usize, sp: &SparseFfn, b: &FfnBundle) -> Result<()> {
        let (dim, ffn) = (self.config.dim, self.config.ffn_dim);
        let layer = &self.weights.layers[l];
        let sl = &sp.layers[l];
        let Predictor::LowRank(lr) = &sp.predictor else {
            return Err(Error::InvalidArgument("an FFN memory budget runs the low-rank predictor".into()));
        };
        let (_, up_row, down_col) = b.row_sizes();
        grow(&mut s.gate, n * ffn);
        grow(&mut s.sparse.up, ffn);
        grow(&mut s.sparse.h, ffn);
        for t in 0..n {
            let x = &s.xn[t * dim..(t + 1) * dim];
            let out = &mut s.tmp[t * dim..(t + 1) * dim];
            let act = &mut s.gate[t * ffn..(t + 1) * ffn];
            let sc = &mut s.sparse;
            lr[l].predict(&s.pool, x, &mut sc.mags, act, &mut s.scratch.bytes, &mut sc.pred)?;
            let k = sc.pred.len();
            b.gather(l, &sc.pred, &mut sc.gathered, &mut sc.stats.cache)?;
            // Look-ahead: the next layer's neurons, predicted from this
            // layer's residual stream under the next FFN norm, are read
            // into the cold cache while this layer computes.
            if b.lookahead && t + 1 == n && l + 1 < self.weights.layers.len() {
                let next = &self.weights.layers[l + 1];
                grow(&mut sc.ahead_x, dim);
                grow(&mut sc.ahead_act, ffn);
                let resid = &s.x[t * dim..(t + 1) * dim];
                math::rms_norm(resid, &next.ffn_norm, self.config.rms_eps, &mut sc.ahead_x[..dim]);
                let (xa, aa) = (&sc.ahead_x[..dim], &mut sc.ahead_act[..ffn]);
                lr[l + 1].predict(&s.pool, xa, &mut sc.mags, aa, &mut s.scratch.bytes, &mut sc.ahead)?;
                b.prefetch(l + 1, &sc.ahead);
            }
            // Exact gate values of the predicted neurons, filtered by the
            // gate threshold.
            let gate = GatheredRows { x, n: 1, rows: &sc.gathered.gate, idx: &sc.pred };
            layer.w_gate.forward_gathered(&s.pool, gate, &mut sc.up[..k], &mut s.scratch)?;
            math::silu(&mut sc.up[..k]);
            sc.idx.clear();
            sc.keep.clear();
            for (p, (&j, &a)) in sc.pred.iter().zip(&sc.up[..k]).enumerate() {
                act[j as usize] = a;
                if a.abs() > sl.threshold {
                    sc.idx.push(j);
                    sc.keep.push(p as u32);
                }
            }
            sc.stats.layers[l].predicted += k as u64;
            let k = sc.idx.len();
            let counters = &mut sc.stats.layers[l];
            counters.tokens += 1;
            counters.active += k as u64;
            sc.gathered.compact(&sc.keep, up_row, down_col);
            // Up projection on the kept records.
            let up = GatheredRows { x, n: 1, rows: &sc.gathered.up, idx: &sc.idx };
            layer.w_up.forward_gathered(&s.pool, up, &mut sc.up[..k], &mut s.scratch)?;
            for ((h, &j), &u) in sc.h[..k].iter_mut().zip(&sc.idx).zip(&sc.up[..k]) {
                *h = act[j as usize] * u;
            }
            // Down projection from the kept records' codes.
            b.axpy(&s.pool, l, &sc.idx, &sc.gathered.down, &sc.h[..k], out, sp.axpy)?;
        }
        Ok(())
    }
}

/// Asks a pack predictor for layer `l`'s mask from the FFN input `x`
/// (`ffn` entries in `mask`) and lists the marked neurons, ascending, in
/// `idx`.
///
/// # Errors
///
/// [`Error::Pack`] naming the predictor when the pack returns an error or
/// its count disagrees with the mask it wrote.
fn pack_mask(
    pp: &Found<PredictorBox>,
    l: usize,
    x: &[f32],
    ffn: usize,
    mask: &mut Vec<u8>,
    idx: &mut Vec<u32>,
) -> Result<()> {
    let err = |detail: String| Error::Pack {
        pack: pp.provider.clone(),
        detail: format!("predictor {}: layer {l}: {detail}", pp.name),
    };
    mask.clear();
    mask.resize(ffn, 0);
    let layer = u32::try_from(l).map_err(|_| err("layer index out of range".into()))?;
    let said = pp
        .object
        .predict(layer, x.into(), RSliceMut::from_mut_slice(mask))
        .into_result()
        .map_err(|e| err(e.to_string()))?;
    idx.clear();
    idx.extend(mask.iter().enumerate().filter(|&(_, &m)| m != 0).map(|(j, _)| j as u32));
    if said != idx.len() {
        return Err(err(format!("reported {said} active neurons but marked {}", idx.len())));
    }
    Ok(())
}

/// Judges a predictor on one token (`Session::set_measure_recall`): the
/// full gate of `x` into `truth`, and in `c` how many neurons are truly
/// active (`|silu(gate)| > threshold`) and how many of `predicted` are.
#[allow(clippy::too_many_arguments, reason = "the session's disjoint buffers")]
pub(super) fn count_truth(
    w_gate: &Linear,
    pool: &ThreadPool,
    x: &[f32],
    threshold: f32,
    predicted: &[u32],
    truth: &mut Vec<f32>,
    scratch: &mut Scratch,
    c: &mut LayerCounters,
) -> Result<()> {
    truth.resize(w_gate.desc.rows, 0.0);
    w_gate.forward(pool, x, 1, truth, scratch)?;
    math::silu(truth);
    c.truth_tokens += 1;
    c.truly_active += truth.iter().filter(|a| a.abs() > threshold).count() as u64;
    c.truth_predicted += predicted.len() as u64;
    c.truth_hits += predicted.iter().filter(|&&j| truth[j as usize].abs() > threshold).count() as u64;
    Ok(())
}
