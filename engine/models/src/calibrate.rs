//! Calibration: run the dense model over real text, collect per-layer
//! statistics of `|silu(gate)|`, and fit what the predictors need.
//!
//! Pass 1 fills per-layer histograms of `log2 |silu(gate)|` and of the
//! down projection's input `log2 |silu(gate) · up|` (fine bins) and takes
//! each layer's thresholds as their `target_sparsity` quantiles (CATS and
//! TEAL: the same fraction skipped in every layer). With an attention
//! sparsity, pass 1 also histograms the attention output `|attn|` (the
//! input of `W_o`) and takes that quantile per layer. Pass 2 counts, per
//! neuron, how often it clears its layer's threshold: the neuron's
//! activation frequency (hot/cold placement). Deterministic: the same model,
//! text and options give the same sidecar.

use std::sync::{Arc, Mutex, PoisonError};

use spinfer_kernels::matmul::{BLayout, sgemm};
use spinfer_kernels::pool::ThreadPool;

use crate::model::llama::{AttnProbe, FfnProbe};
use crate::model::{Model, math};
use crate::{Error, Result};
use spinfer_formats::loader::Loader;
use spinfer_kernel_select::registry::KernelRegistry;
use spinfer_sparsity::lowrank::{self, LowRank};
use spinfer_sparsity::sidecar::{
    CalibrationInfo, LayerStats, LowRankFactors, LowRankInfo, ModelId, PredictorKind, Sidecar,
};
use spinfer_sparsity::stats::{BINS, bin_of, quantile};

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
    /// Rank of the low-rank predictor (a multiple of 32); 0: none.
    pub rank: usize,
    /// Fraction of truly active neurons the low-rank predictor must keep.
    pub recall_target: f32,
    /// Fraction of the attention output to skip before the output
    /// projection, in `[0, 1)`; 0: the attention output stays dense.
    pub attn_sparsity: f32,
}

/// Runs `tokens` through `model` in windows, calling `probe(layer, gate,
/// up)` for every FFN (and `attn(layer, attention output)` for every
/// attention, if given); `progress(done, total)` after each window.
fn run_windows(
    model: &Model,
    tokens: &[u32],
    window: usize,
    probe: FfnProbe,
    attn: Option<AttnProbe>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let mut s = model.new_session();
    s.set_ffn_probe(Some(probe));
    s.set_attn_probe(attn);
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
    if c.ffn_act != crate::model::FfnAct::Silu {
        return Err(Error::InvalidArgument(format!(
            "the sparse FFN's calibration is not supported for {:?} models yet (it measures SwiGLU activations)",
            c.arch
        )));
    }
    if !(0.0..1.0).contains(&opts.target_sparsity) {
        return Err(Error::InvalidArgument(format!("target sparsity must be in [0, 1), got {}", opts.target_sparsity)));
    }
    if !(0.0..1.0).contains(&opts.attn_sparsity) {
        return Err(Error::InvalidArgument(format!(
            "attention sparsity must be in [0, 1), got {}",
            opts.attn_sparsity
        )));
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
    let probe = move |l: usize, _x: &[f32], gate: &[f32], up: &[f32]| {
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
    // And of the attention output log2 |attn|, when asked for.
    let attn_hist = Arc::new(Mutex::new(vec![vec![0u64; BINS]; n_layers]));
    let attn_probe: Option<AttnProbe> = (opts.attn_sparsity > 0.0).then(|| {
        let h = Arc::clone(&attn_hist);
        Box::new(move |l: usize, att: &[f32]| {
            let mut h = h.lock().unwrap_or_else(PoisonError::into_inner);
            for &a in att {
                h[l][bin_of(a)] += 1;
            }
        }) as AttnProbe
    });
    run_windows(model, tokens, opts.window, Box::new(probe), attn_probe, &mut |d, t| progress(1, d, t))?;
    let hist = std::mem::take(&mut *hist.lock().unwrap_or_else(PoisonError::into_inner));
    let attn_thresholds: Option<Vec<f32>> = (opts.attn_sparsity > 0.0).then(|| {
        let h = attn_hist.lock().unwrap_or_else(PoisonError::into_inner);
        h.iter().map(|h| quantile(h, f64::from(opts.attn_sparsity))).collect()
    });
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
    let probe = move |l: usize, _x: &[f32], gate: &[f32], up: &[f32]| {
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
    run_windows(model, tokens, opts.window, Box::new(probe), None, &mut |d, t| progress(2, d, t))?;
    let (per_neuron, seen) = std::mem::take(&mut *counts.lock().unwrap_or_else(PoisonError::into_inner));

    let keep = ((1.0 - opts.target_sparsity) * ffn as f32).round() as usize;
    let layers: Vec<LayerStats> = (0..n_layers)
        .map(|l| LayerStats {
            threshold: thresholds[l],
            keep,
            input_threshold: input_thresholds[l],
            active_freq: per_neuron[l].iter().map(|&k| (k as f64 / seen[l].max(1) as f64) as f32).collect(),
            lowrank: None,
            attn_input_threshold: attn_thresholds.as_ref().map(|t| t[l]),
        })
        .collect();
    let (lowrank_factors, lowrank) = if opts.rank > 0 {
        let (f, info) = fit_lowrank(model, tokens, opts, &thresholds, progress)?;
        (f.into_iter().map(Some).collect(), Some(info))
    } else {
        (vec![None; n_layers], None)
    };
    let mut layers = layers;
    for (l, f) in layers.iter_mut().zip(lowrank_factors) {
        l.lowrank = f;
    }
    let mut info = opts.info.clone();
    info.tokens = tokens.len();
    Ok(Sidecar {
        predictor: opts.predictor,
        target_sparsity: opts.target_sparsity,
        model: ModelId::of(c, loader)?,
        calibration: info,
        layers,
        lowrank,
        attn_sparsity: (opts.attn_sparsity > 0.0).then_some(opts.attn_sparsity),
    })
}

/// Fits the low-rank predictor of every layer: (pass 3, on the first 7/8
/// of the windows) the FFN inputs' second moment and from it the factors
/// that best predict the gate on those inputs, then (pass 4, the same
/// windows) the threshold on
/// `|silu(ĝ)|` that keeps `recall_target` of the truly active neurons
/// (`|silu(gate)| > gate_thresholds[l]`), and (pass 4, the last 1/8, held
/// out) the recall and kept fraction it achieves.
fn fit_lowrank(
    model: &Model,
    tokens: &[u32],
    opts: &CalibrateOptions,
    gate_thresholds: &[f32],
    progress: &mut dyn FnMut(usize, usize, usize),
) -> Result<(Vec<LowRankFactors>, LowRankInfo)> {
    let c = &model.config;
    let (dim, ffn, rank) = (c.dim, c.ffn_dim, opts.rank);
    if !(0.0..=1.0).contains(&opts.recall_target) {
        return Err(Error::InvalidArgument(format!("recall target must be in [0, 1], got {}", opts.recall_target)));
    }
    // Windows: 7/8 to fit the factors and thresholds, the rest held out.
    let n_windows = tokens.len().div_ceil(opts.window);
    let split = (n_windows * 7 / 8).max(1).min(n_windows) * opts.window;
    let (train, heldout) = tokens.split_at(split.min(tokens.len()));

    // Per layer, C = Σ x xᵀ over the FFN inputs of the training windows.
    let moments = Arc::new(Mutex::new(vec![vec![0.0f64; dim * dim]; c.n_layers]));
    let probe = {
        let moments = Arc::clone(&moments);
        let (mut xt, mut cw, mut scratch) = (Vec::new(), vec![0.0f32; dim * dim], Vec::new());
        move |l: usize, x: &[f32], _gate: &[f32], _up: &[f32]| {
            let n = x.len() / dim;
            xt.resize(dim * n, 0.0);
            for (t, row) in x.chunks_exact(dim).enumerate() {
                for (i, &v) in row.iter().enumerate() {
                    xt[i * n + t] = v;
                }
            }
            sgemm(dim, dim, n, &xt, n, x, dim, BLayout::Normal, &mut cw, dim, false, &mut scratch);
            let mut m = moments.lock().unwrap_or_else(PoisonError::into_inner);
            for (a, &b) in m[l].iter_mut().zip(&cw) {
                *a += f64::from(b);
            }
        }
    };
    run_windows(model, train, opts.window, Box::new(probe), None, &mut |d, t| progress(3, d, t))?;
    let moments = std::mem::take(&mut *moments.lock().unwrap_or_else(PoisonError::into_inner));
    let mut factors = Vec::with_capacity(c.n_layers);
    let mut predictors = Vec::with_capacity(c.n_layers);
    for (l, layer) in model.weights.layers.iter().enumerate() {
        let mut w = vec![0.0f32; ffn * dim];
        let ty = layer.w_gate.desc.wtype;
        let row_bytes = ty.row_bytes(dim)?;
        for (row, out) in layer.w_gate.raw_weights().chunks_exact(row_bytes).zip(w.chunks_exact_mut(dim)) {
            spinfer_kernels::dequant::dequantize_row(ty, row, out)?;
        }
        let (p, q) = lowrank::fit_to_activations(&w, &moments[l], ffn, dim, rank, 30)?;
        // Calibration measures the predictor with the built-in kernels (its
        // factors do not depend on which kernel later runs them).
        predictors.push(LowRank::new(&p, &q, (rank, dim, ffn), 0.0, &KernelRegistry::builtin())?);
        factors.push(LowRankFactors { rank, p, q, threshold: 0.0 });
        progress(3, l + 1, c.n_layers);
    }
    let predictors = Arc::new(predictors);

    // |silu(ĝ)| of the truly active neurons, per layer.
    let hist = Arc::new(Mutex::new(vec![vec![0u64; BINS]; c.n_layers]));
    let probe = predictor_probe(&predictors, gate_thresholds, ffn, {
        let hist = Arc::clone(&hist);
        move |l, pred: &[f32], act: &[f32], th: f32| {
            let mut h = hist.lock().unwrap_or_else(PoisonError::into_inner);
            for (&p, &a) in pred.iter().zip(act) {
                if a.abs() > th {
                    h[l][bin_of(p)] += 1;
                }
            }
        }
    });
    run_windows(model, train, opts.window, probe, None, &mut |d, t| progress(4, d, t))?;
    let hist = std::mem::take(&mut *hist.lock().unwrap_or_else(PoisonError::into_inner));
    let q = f64::from(1.0 - opts.recall_target);
    for (f, h) in factors.iter_mut().zip(&hist) {
        f.threshold = quantile(h, q);
    }
    // Held-out recall with the fitted thresholds.
    let fitted: Vec<LowRank> = factors
        .iter()
        .map(|f| LowRank::new(&f.p, &f.q, (rank, dim, ffn), f.threshold, &KernelRegistry::builtin()))
        .collect::<spinfer_sparsity::Result<_>>()?;
    let fitted = Arc::new(fitted);
    // (truly active, truly active and kept, kept, all) per layer.
    let counts = Arc::new(Mutex::new(vec![[0u64; 4]; c.n_layers]));
    let probe = predictor_probe(&fitted, gate_thresholds, ffn, {
        let counts = Arc::clone(&counts);
        let fitted = Arc::clone(&fitted);
        move |l, pred: &[f32], act: &[f32], th: f32| {
            let t = fitted[l].threshold;
            let mut g = counts.lock().unwrap_or_else(PoisonError::into_inner);
            for (&p, &a) in pred.iter().zip(act) {
                let (active, kept) = (a.abs() > th, p.abs() > t);
                g[l][0] += u64::from(active);
                g[l][1] += u64::from(active && kept);
                g[l][2] += u64::from(kept);
                g[l][3] += 1;
            }
        }
    });
    let heldout_tokens = if heldout.len() >= 2 { heldout } else { train };
    run_windows(model, heldout_tokens, opts.window, probe, None, &mut |d, t| progress(5, d, t))?;
    let counts = std::mem::take(&mut *counts.lock().unwrap_or_else(PoisonError::into_inner));
    let ratio = |a: u64, b: u64| if b == 0 { 1.0 } else { (a as f64 / b as f64) as f32 };
    let info = LowRankInfo {
        rank,
        recall_target: opts.recall_target,
        heldout_recall: counts.iter().map(|c| ratio(c[1], c[0])).collect(),
        predicted_fraction: counts.iter().map(|c| ratio(c[2], c[3])).collect(),
        heldout_tokens: heldout_tokens.len(),
    };
    Ok((factors, info))
}

/// A probe computing, per token of layer `l`, the predictor's `|silu(ĝ)|`
/// and the true `silu(gate)`, handed to `f(l, pred, act, gate_threshold)`.
fn predictor_probe(
    predictors: &Arc<Vec<LowRank>>,
    gate_thresholds: &[f32],
    ffn: usize,
    mut f: impl FnMut(usize, &[f32], &[f32], f32) + Send + 'static,
) -> FfnProbe {
    let predictors = Arc::clone(predictors);
    let th = gate_thresholds.to_vec();
    let pool = ThreadPool::new(1);
    let (mut pred, mut act, mut t, mut bytes) = (vec![0.0f32; ffn], Vec::new(), Vec::new(), Vec::new());
    Box::new(move |l: usize, x: &[f32], gate: &[f32], _up: &[f32]| {
        let dim = x.len() / (gate.len() / ffn).max(1);
        for (xt, gt) in x.chunks_exact(dim).zip(gate.chunks_exact(ffn)) {
            if predictors[l].scores(&pool, xt, &mut t, &mut pred, &mut bytes).is_err() {
                return;
            }
            math::silu(&mut pred);
            act.clear();
            act.extend_from_slice(gt);
            math::silu(&mut act);
            f(l, &pred, &act, th[l]);
        }
    })
}
