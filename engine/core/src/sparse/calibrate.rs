//! Calibration: run the dense model over real text, collect per-layer
//! statistics of `|silu(gate)|`, and fit what the predictors need.
//!
//! Pass 1 fills per-layer histograms of `log2 |silu(gate)|` and of the
//! down projection's input `log2 |silu(gate) · up|` (fine bins) and takes
//! each layer's thresholds as their `target_sparsity` quantiles (CATS and
//! TEAL: the same fraction skipped in every layer). Pass 2 counts, per
//! neuron, how often it clears its layer's threshold: the neuron's
//! activation frequency (hot/cold placement). Deterministic: the same model,
//! text and options give the same sidecar.

use std::sync::{Arc, Mutex, PoisonError};

use super::sidecar::{CalibrationInfo, LayerStats, ModelId, PredictorKind, Sidecar};
use crate::loader::Loader;
use crate::model::llama::FfnProbe;
use crate::model::{Model, math};
use crate::{Error, Result};

/// What to calibrate.
#[derive(Clone, Debug)]
pub struct CalibrateOptions {
    /// Fraction of FFN neurons to skip per token, in `[0, 1)`.
    pub target_sparsity: f32,
    /// The predictor recorded in the sidecar (both get their parameters).
    pub predictor: PredictorKind,
    /// Tokens per window (each from an empty cache).
    pub window: usize,
    /// Where the text came from (recorded in the sidecar).
    pub info: CalibrationInfo,
}

/// Histogram bins: `log2 |a|` from `LO` to `HI` in steps of `1/STEPS`;
/// values below `2^LO` (and exact zeros) land in bin 0.
const LO: f32 = -40.0;
const HI: f32 = 16.0;
const STEPS: f32 = 64.0;
const BINS: usize = ((HI - LO) * STEPS) as usize + 1;

fn bin_of(a: f32) -> usize {
    let a = a.abs();
    if a <= 0.0 || !a.is_finite() {
        return if a.is_finite() { 0 } else { BINS - 1 };
    }
    (((a.log2() - LO) * STEPS).max(0.0) as usize).min(BINS - 1)
}

/// The value whose fraction of samples below equals `q` (log-linear
/// interpolation inside the bin).
fn quantile(hist: &[u64], q: f64) -> f32 {
    let total: u64 = hist.iter().sum();
    if total == 0 {
        return 0.0;
    }
    let want = q * total as f64;
    let mut below = 0u64;
    for (b, &count) in hist.iter().enumerate() {
        if count > 0 && (below + count) as f64 >= want {
            let frac = ((want - below as f64) / count as f64).clamp(0.0, 1.0) as f32;
            if b == 0 {
                return 0.0;
            }
            return (LO + (b as f32 + frac) / STEPS).exp2();
        }
        below += count;
    }
    (HI).exp2()
}

/// Runs `tokens` through `model` in windows, calling `probe(layer, gate,
/// up)` for every FFN; `progress(done, total)` after each window.
fn run_windows(
    model: &Model,
    tokens: &[u32],
    window: usize,
    probe: FfnProbe,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let mut s = model.new_session();
    s.set_ffn_probe(Some(probe));
    let windows: Vec<&[u32]> = tokens.chunks(window).filter(|w| w.len() >= 2).collect();
    for (i, w) in windows.iter().enumerate() {
        s.reset();
        model.forward(&mut s, w)?;
        progress(i + 1, windows.len());
    }
    Ok(())
}

/// Calibrates `model` (loaded dense from `loader`) on `tokens`.
/// `progress(pass, done, total)` reports both passes.
pub fn calibrate(
    model: &Model,
    loader: &dyn Loader,
    tokens: &[u32],
    opts: &CalibrateOptions,
    progress: &mut dyn FnMut(usize, usize, usize),
) -> Result<Sidecar> {
    let c = &model.config;
    if model.sparse.is_some() {
        return Err(Error::InvalidArgument("calibrate a model loaded dense (without --sparsity)".into()));
    }
    if !(0.0..1.0).contains(&opts.target_sparsity) {
        return Err(Error::InvalidArgument(format!("target sparsity must be in [0, 1), got {}", opts.target_sparsity)));
    }
    if tokens.len() < 2 || opts.window < 2 {
        return Err(Error::InvalidArgument("calibration needs at least 2 tokens and a window of at least 2".into()));
    }
    let (n_layers, ffn) = (c.n_layers, c.ffn_dim);

    // Pass 1: per layer, histograms of log2 |silu(gate)| and of the down
    // projection's input log2 |silu(gate) * up|.
    let hist = Arc::new(Mutex::new(vec![[vec![0u64; BINS], vec![0u64; BINS]]; n_layers]));
    let h = Arc::clone(&hist);
    let mut act = Vec::new();
    let probe = move |l: usize, gate: &[f32], up: &[f32]| {
        act.clear();
        act.extend_from_slice(gate);
        math::silu(&mut act);
        let mut h = h.lock().unwrap_or_else(PoisonError::into_inner);
        let [g, d] = &mut h[l];
        for (&a, &u) in act.iter().zip(up) {
            g[bin_of(a)] += 1;
            d[bin_of(a * u)] += 1;
        }
    };
    run_windows(model, tokens, opts.window, Box::new(probe), &mut |d, t| progress(1, d, t))?;
    let hist = std::mem::take(&mut *hist.lock().unwrap_or_else(PoisonError::into_inner));
    let q = f64::from(opts.target_sparsity);
    let thresholds: Vec<f32> = hist.iter().map(|[g, _]| quantile(g, q)).collect();
    let input_thresholds: Vec<f32> = hist.iter().map(|[_, d]| quantile(d, q)).collect();

    // Pass 2: how often each neuron is kept by the sidecar's predictor
    // (top-K counted by the equivalent threshold).
    let counts = Arc::new(Mutex::new((vec![vec![0u64; ffn]; n_layers], vec![0u64; n_layers])));
    let by_input = opts.predictor == PredictorKind::InputMagnitude;
    let th = if by_input { input_thresholds.clone() } else { thresholds.clone() };
    let cn = Arc::clone(&counts);
    let mut act = Vec::new();
    let probe = move |l: usize, gate: &[f32], up: &[f32]| {
        act.clear();
        act.extend_from_slice(gate);
        if by_input {
            math::swiglu(&mut act, up);
        } else {
            math::silu(&mut act);
        }
        let mut g = cn.lock().unwrap_or_else(PoisonError::into_inner);
        let (per_neuron, tokens) = &mut *g;
        for row in act.chunks_exact(ffn) {
            tokens[l] += 1;
            for (c, a) in per_neuron[l].iter_mut().zip(row) {
                *c += u64::from(a.abs() > th[l]);
            }
        }
    };
    run_windows(model, tokens, opts.window, Box::new(probe), &mut |d, t| progress(2, d, t))?;
    let (per_neuron, seen) = std::mem::take(&mut *counts.lock().unwrap_or_else(PoisonError::into_inner));

    let keep = ((1.0 - opts.target_sparsity) * ffn as f32).round() as usize;
    let layers = (0..n_layers)
        .map(|l| LayerStats {
            threshold: thresholds[l],
            keep,
            input_threshold: input_thresholds[l],
            active_freq: per_neuron[l].iter().map(|&k| (k as f64 / seen[l].max(1) as f64) as f32).collect(),
        })
        .collect();
    let mut info = opts.info.clone();
    info.tokens = tokens.len();
    Ok(Sidecar {
        predictor: opts.predictor,
        target_sparsity: opts.target_sparsity,
        model: ModelId::of(c, loader)?,
        calibration: info,
        layers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_of_a_known_distribution() {
        let mut h = vec![0u64; BINS];
        // 1000 samples at each of 2^-4, 2^-2, 2^0, 2^2.
        for e in [-4.0f32, -2.0, 0.0, 2.0] {
            h[bin_of(e.exp2())] += 1000;
        }
        let q = |p| quantile(&h, p);
        assert!(q(0.25) <= 2f32.powf(-4.0 + 1.0 / STEPS) && q(0.25) >= 2f32.powf(-4.0));
        assert!(q(0.5) >= 0.25 && q(0.5) < 0.25 * 1.02);
        assert!(q(0.99) >= 4.0 && q(0.99) < 4.0 * 1.02);
        assert_eq!(quantile(&vec![0; BINS], 0.5), 0.0);
        assert_eq!(bin_of(0.0), 0);
        assert_eq!(bin_of(f32::INFINITY), BINS - 1);
    }
}
