//! Experimental per-token predictors: measured not to pay on the models
//! here (docs/sparsity.md, "Design measurements"), kept for their quality
//! curves and out of the default path (`--predictor low-rank` and
//! `input-magnitude` are the ones to use).
//!
//! * gate threshold (CATS): the whole gate is computed densely, then its
//!   neurons above a calibrated threshold are kept — the gate matrix is
//!   read in full every token, so only up and down are saved;
//! * top-k: a fixed number of neurons per layer by gate magnitude.

use crate::SparseLayer;

/// CATS: the neurons whose `|silu(gate)|` is above the layer's calibrated
/// threshold, ascending.
pub fn gate_threshold(layer: &SparseLayer, act: &[f32], idx: &mut Vec<u32>) {
    crate::select_above(layer.threshold, act, idx);
}

/// The layer's `keep` neurons of largest `|act|`, ascending (ties beyond
/// `keep` dropped from the end). `mags` is scratch.
pub fn top_k(layer: &SparseLayer, act: &[f32], idx: &mut Vec<u32>, mags: &mut Vec<f32>) {
    idx.clear();
    let k = layer.keep.min(act.len());
    if k == 0 {
        return;
    }
    if k == act.len() {
        idx.extend(0..act.len() as u32);
        return;
    }
    // The k-th largest magnitude; neurons at or above it in index order.
    mags.clear();
    mags.extend(act.iter().map(|a| a.abs()));
    let (_, kth, _) = mags.select_nth_unstable_by(act.len() - k, f32::total_cmp);
    let kth = *kth;
    for (j, a) in act.iter().enumerate() {
        if a.abs() >= kth && idx.len() < k {
            idx.push(j as u32);
        }
    }
}
