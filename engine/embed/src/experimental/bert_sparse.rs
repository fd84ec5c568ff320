//! Sparse FFN for the BERT encoder (sentence embeddings): TEAL-style input
//! magnitude on the down projection.
//!
//! BERT's FFN is `out = W2 · GELU(W1 · x + b1) + b2`. With a sidecar, per
//! token and layer, neuron `j` of `h = GELU(W1 · x + b1)` is kept when
//! `|h_j|` exceeds the layer's calibrated threshold, and the down
//! projection runs over the kept neurons only:
//! `out = b2 + Σ_k h_k · W2[:, j_k]`, accumulated over a neuron-major
//! (transposed, exact f32) copy of `W2` made at load. `W1` runs dense: no
//! predictor exists for GELU's input, and GELU is not gated.
//!
//! GELU's small outputs are mostly negative (its tail is `-0.17 ≤ h < 0`),
//! so the skipped terms do not cancel: dropping them shifts every token's
//! output the same way. The sidecar therefore also holds, per neuron, the
//! mean `m_j` of `h_j` over the calibration tokens where it was skipped,
//! and the sparse path computes
//! `out = (b2 + W2 m) + Σ_k (h_k - m_k) · W2[:, j_k]`: the skipped neurons
//! count as their mean instead of zero, at no cost per token (`W2 m` is
//! folded into the bias at load). Without `offsets` the correction is off.
//!
//! Calibration (`Embedder::calibrate_sparsity`, in `crate::experimental::embed_sparsity`) runs the dense model
//! over real text with a recorder in the FFN hook: per layer, a
//! log-histogram of `|h|` (the bins of [`spinfer_sparsity::stats`]), whose
//! `target_sparsity` quantile becomes the layer's threshold (the same
//! fraction of neurons skipped in every layer); a second pass averages each
//! neuron's skipped values (the offsets).
//!
//! The sidecar is a small JSON file, not the safetensors sidecar of the
//! Llama path: that one is keyed by GGUF names (`blk.0.ffn_gate`) and
//! carries per-neuron frequencies and predictors BERT has no use for. Its
//! layout:
//!
//! ```json
//! {"format": "spinfer-bert-sparsity", "version": 1,
//!  "model": {"layers": 6, "hidden": 384, "intermediate": 1536, "fingerprint": "<16 hex>"},
//!  "target_sparsity": 0.5,
//!  "calibration": {"text": "...", "texts": 2000, "tokens": 51234},
//!  "thresholds": [0.031, ...],
//!  "offsets": [[-0.05, ...], ...]}
//! ```
//!
//! (`offsets`: per layer, `intermediate` means; optional.)
//!
//! `fingerprint` is the first 16 hex digits of the SHA-256 of layer 0's
//! `intermediate.dense.weight` bytes. A sidecar for another model, or one
//! that is not valid, is an error naming the file.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::pool::SyncPtr;
use spinfer_kernels::pool::{ThreadPool, chunk};

use crate::{Error, Result};
use spinfer_formats::Error as FileError;
use spinfer_formats::bert_config::BertConfig;
use spinfer_formats::loader::Loader;
use spinfer_sparsity::stats::{BINS, bin_of, quantile};

pub const FORMAT: &str = "spinfer-bert-sparsity";
pub const VERSION: u32 = 1;

/// Which BERT model a sidecar belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BertModelId {
    pub layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    /// First 16 hex digits of the SHA-256 of layer 0's FFN up weight bytes.
    pub fingerprint: String,
}

impl BertModelId {
    /// The identity of the BERT checkpoint `loader` reads.
    pub fn of(loader: &dyn Loader, c: &BertConfig) -> Result<Self> {
        let w1 = loader.tensor(&format!("{}encoder.layer.0.intermediate.dense.weight", prefix(loader)))?;
        let digest = Sha256::digest(w1.data.bytes());
        let fingerprint = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        Ok(Self { layers: c.n_layers, hidden: c.hidden, intermediate: c.intermediate, fingerprint })
    }
}

/// Where the calibration statistics came from (informational).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BertCalibrationInfo {
    /// The text file (or a description of the texts).
    pub text: String,
    /// Texts embedded.
    pub texts: usize,
    /// Tokens seen (per layer).
    pub tokens: usize,
}

/// The sparsity sidecar of a BERT model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BertSparsity {
    pub format: String,
    pub version: u32,
    pub model: BertModelId,
    /// The fraction of FFN neurons calibration aimed to skip per token.
    pub target_sparsity: f32,
    #[serde(default)]
    pub calibration: BertCalibrationInfo,
    /// Per layer: keep neuron `j` when `|GELU(W1 x + b1)_j|` is above this.
    pub thresholds: Vec<f32>,
    /// Per layer and neuron: the mean of `h_j` where it was skipped during
    /// calibration, counted in place of the skipped values (empty: zero).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub offsets: Vec<Vec<f32>>,
}

impl BertSparsity {
    /// A sidecar with the given per-layer thresholds (e.g. `-1` everywhere:
    /// keep every neuron).
    pub fn new(model: BertModelId, target_sparsity: f32, thresholds: Vec<f32>) -> Self {
        Self {
            format: FORMAT.into(),
            version: VERSION,
            model,
            target_sparsity,
            calibration: BertCalibrationInfo::default(),
            thresholds,
            offsets: Vec::new(),
        }
    }

    /// Reads and validates a sidecar (not yet against a model: see
    /// [`BertSparsity::check`]).
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let s: Self = serde_json::from_str(&text)
            .map_err(|e| err(path, format!("is not a BERT sparsity sidecar ({FORMAT} JSON): {e}")))?;
        if s.format != FORMAT {
            return Err(err(path, format!("format is '{}', expected '{FORMAT}'", s.format)));
        }
        if s.version != VERSION {
            return Err(err(path, format!("version {} is not supported (this build reads {VERSION})", s.version)));
        }
        if s.thresholds.len() != s.model.layers {
            let d = format!("holds {} thresholds for a model of {} layers", s.thresholds.len(), s.model.layers);
            return Err(err(path, d));
        }
        if let Some(l) = s.thresholds.iter().position(|t| !t.is_finite()) {
            return Err(err(path, format!("threshold of layer {l} is not a finite number")));
        }
        if !s.offsets.is_empty() {
            if s.offsets.len() != s.model.layers {
                let d = format!("holds offsets for {} layers, the model has {}", s.offsets.len(), s.model.layers);
                return Err(err(path, d));
            }
            for (l, o) in s.offsets.iter().enumerate() {
                if o.len() != s.model.intermediate || o.iter().any(|v| !v.is_finite()) {
                    let d = format!("offsets of layer {l}: need {} finite numbers", s.model.intermediate);
                    return Err(err(path, d));
                }
            }
        }
        Ok(s)
    }

    /// Writes the sidecar as pretty JSON (deterministic).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut text = serde_json::to_string_pretty(self).map_err(|e| err(path, format!("cannot serialise: {e}")))?;
        text.push('\n');
        std::fs::write(path, text).map_err(|e| Error::io(path, e))
    }

    /// An error naming `path` unless the sidecar was made for model `id`.
    pub fn check(&self, id: &BertModelId, path: &Path) -> Result<()> {
        if self.model != *id {
            let m = &self.model;
            return Err(err(
                path,
                format!(
                    "was calibrated for another model (layers {}, hidden {}, intermediate {}, fingerprint {}), \
                     not this one (layers {}, hidden {}, intermediate {}, fingerprint {})",
                    m.layers,
                    m.hidden,
                    m.intermediate,
                    m.fingerprint,
                    id.layers,
                    id.hidden,
                    id.intermediate,
                    id.fingerprint
                ),
            ));
        }
        Ok(())
    }
}

/// One layer's down projection, neuron-major.
struct SparseDown {
    threshold: f32,
    /// `W2` transposed: `(intermediate, hidden)`, row `j` is neuron `j`'s
    /// output column, exactly the f32 values the dense kernel uses.
    wt: Vec<f32>,
    /// `b2 + W2 m`.
    bias: Vec<f32>,
    /// `m`: the skipped neurons' calibrated means (empty: zero).
    offset: Vec<f32>,
}

/// Per neuron, the sum and count of the skipped values.
type SumCount = (Vec<f64>, Vec<u64>);

/// What calibration records in the FFN hook.
pub(crate) enum Recorder {
    /// Pass 1: per layer, a histogram of `log2 |h|`.
    Histograms(Mutex<Vec<Vec<u64>>>),
    /// Pass 2: per target and layer, thresholds, and per neuron the sum and
    /// count of `h` where `|h|` is at most the threshold.
    Means { thresholds: Vec<Vec<f32>>, acc: Mutex<Vec<Vec<SumCount>>> },
}

/// What the FFN hook of [`crate::bert::BertModel::forward`] runs.
pub struct SparseFfn {
    /// The sidecar file (empty for an in-memory sidecar or a recorder).
    pub path: PathBuf,
    pub sidecar: Option<BertSparsity>,
    hidden: usize,
    intermediate: usize,
    layers: Vec<SparseDown>,
    /// Per layer: neurons kept, tokens seen.
    counters: Vec<[AtomicU64; 2]>,
    /// Calibration: per-layer histograms of `log2 |h|`; the down
    /// projection then runs dense.
    pub(crate) recorder: Option<Recorder>,
}

impl std::fmt::Debug for SparseFfn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SparseFfn")
            .field("path", &self.path)
            .field("recording", &self.recorder.is_some())
            .field("thresholds", &self.layers.iter().map(|l| l.threshold).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl SparseFfn {
    /// Checks `sidecar` against the model `loader` reads and builds the
    /// neuron-major copies of every `W2`. `path` names the sidecar in errors.
    pub fn build(loader: &dyn Loader, c: &BertConfig, sidecar: BertSparsity, path: &Path) -> Result<Self> {
        sidecar.check(&BertModelId::of(loader, c)?, path)?;
        let (d, f) = (c.hidden, c.intermediate);
        let p = prefix(loader);
        let mut layers = Vec::with_capacity(c.n_layers);
        let mut row = vec![0.0f32; f];
        for (l, &threshold) in sidecar.thresholds.iter().enumerate() {
            let name = format!("{p}encoder.layer.{l}.output.dense.weight");
            let t = loader.tensor(&name)?;
            if t.dims != [f, d] {
                return Err(FileError::TensorShape {
                    path: loader.path().to_path_buf(),
                    tensor: name,
                    got: t.dims.clone(),
                    want: vec![f, d],
                }
                .into());
            }
            let row_bytes = t.ty.row_bytes(f)?;
            let mut wt = vec![0.0f32; f * d];
            for (o, src) in t.data.bytes().chunks_exact(row_bytes).enumerate() {
                dequantize_row(t.ty, src, &mut row).map_err(|e| FileError::TensorType {
                    path: loader.path().to_path_buf(),
                    tensor: name.clone(),
                    ty: t.ty.to_string(),
                    what: format!("cannot be read as f32: {e}"),
                })?;
                for (j, &w) in row.iter().enumerate() {
                    wt[j * d + o] = w;
                }
            }
            let bname = format!("{p}encoder.layer.{l}.output.dense.bias");
            let b = loader.tensor(&bname)?;
            let mut bias = vec![0.0f32; d];
            if b.dims != [d] {
                return Err(FileError::TensorShape {
                    path: loader.path().to_path_buf(),
                    tensor: bname,
                    got: b.dims.clone(),
                    want: vec![d],
                }
                .into());
            }
            dequantize_row(b.ty, b.data.bytes(), &mut bias).map_err(|e| FileError::TensorType {
                path: loader.path().to_path_buf(),
                tensor: bname.clone(),
                ty: b.ty.to_string(),
                what: format!("cannot be read as f32: {e}"),
            })?;
            let offset = sidecar.offsets.get(l).cloned().unwrap_or_default();
            for (j, &m) in offset.iter().enumerate() {
                for (b, &w) in bias.iter_mut().zip(&wt[j * d..(j + 1) * d]) {
                    *b += m * w;
                }
            }
            layers.push(SparseDown { threshold, wt, bias, offset });
        }
        tracing::debug!(path = %path.display(), target = sidecar.target_sparsity, "bert sparse FFN built");
        Ok(Self {
            path: path.to_path_buf(),
            sidecar: Some(sidecar),
            hidden: d,
            intermediate: f,
            layers,
            counters: counters(c.n_layers),
            recorder: None,
        })
    }

    /// Whether this is a calibration recorder (which runs dense).
    pub(crate) fn is_recorder(&self) -> bool {
        self.recorder.is_some()
    }

    /// A calibration recorder (runs dense).
    pub(crate) fn recorder(c: &BertConfig, recorder: Recorder) -> Self {
        Self {
            path: PathBuf::new(),
            sidecar: None,
            hidden: c.hidden,
            intermediate: c.intermediate,
            layers: Vec::new(),
            counters: counters(c.n_layers),
            recorder: Some(recorder),
        }
    }

    /// The FFN hook: given `h = GELU(W1 x + b1)` (`n` rows of
    /// `intermediate`), writes `out = W2 h + b2` over the kept neurons and
    /// returns `true`; a recorder records and returns `false` (the caller
    /// then runs the dense down projection). `seqs` holds each sequence
    /// as (first token, length): the first and last token of every
    /// sequence (`[CLS]` and `[SEP]`) keep all their neurons. Their activations
    /// are outliers, and for a short text they are most of the input (the
    /// empty text is only these two tokens).
    pub fn ffn_down(
        &self,
        pool: &ThreadPool,
        layer: usize,
        seqs: &[(usize, usize)],
        h: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<bool> {
        let (d, f) = (self.hidden, self.intermediate);
        if h.len() < n * f || out.len() < n * d {
            return Err(Error::InvalidArgument(format!("sparse FFN of layer {layer}: buffers too short")));
        }
        if let Some(Recorder::Means { thresholds, acc }) = &self.recorder {
            pool.broadcast(&|ti, nt| {
                let rows = chunk(n, ti, nt);
                let mut local: Vec<(Vec<f64>, Vec<u64>)> =
                    thresholds.iter().map(|_| (vec![0.0; f], vec![0; f])).collect();
                for row in h[rows.start * f..rows.end * f].chunks_exact(f) {
                    for (th, (sum, count)) in thresholds.iter().zip(local.iter_mut()) {
                        let t = th[layer];
                        for (j, &a) in row.iter().enumerate() {
                            if a.abs() <= t {
                                sum[j] += f64::from(a);
                                count[j] += 1;
                            }
                        }
                    }
                }
                let mut g = acc.lock().unwrap_or_else(PoisonError::into_inner);
                for (per_layer, (sum, count)) in g.iter_mut().zip(&local) {
                    let (gs, gc) = &mut per_layer[layer];
                    gs.iter_mut().zip(sum).for_each(|(a, b)| *a += b);
                    gc.iter_mut().zip(count).for_each(|(a, b)| *a += b);
                }
            });
            return Ok(false);
        }
        if let Some(Recorder::Histograms(rec)) = &self.recorder {
            let merged = Mutex::new(vec![0u64; BINS]);
            pool.broadcast(&|ti, nt| {
                let mut local = vec![0u64; BINS];
                let rows = chunk(n, ti, nt);
                for &a in &h[rows.start * f..rows.end * f] {
                    local[bin_of(a)] += 1;
                }
                let mut m = merged.lock().unwrap_or_else(PoisonError::into_inner);
                m.iter_mut().zip(&local).for_each(|(a, b)| *a += b);
            });
            let merged = merged.into_inner().unwrap_or_else(PoisonError::into_inner);
            let mut r = rec.lock().unwrap_or_else(PoisonError::into_inner);
            r[layer].iter_mut().zip(&merged).for_each(|(a, b)| *a += b);
            self.counters[layer][1].fetch_add(n as u64, Ordering::Relaxed);
            return Ok(false);
        }
        let sd = self.layers.get(layer).ok_or_else(|| {
            Error::InvalidArgument(format!("sparse FFN has {} layers, asked for layer {layer}", self.layers.len()))
        })?;
        let mut boundary = vec![false; n];
        for &(start, len) in seqs {
            for t in [start, start + len.max(1) - 1] {
                if let Some(b) = boundary.get_mut(t) {
                    *b = true;
                }
            }
        }
        let out_ptr = SyncPtr::new(out.as_mut_ptr());
        let kept_total = AtomicU64::new(0);
        pool.broadcast(&|ti, nt| {
            let mut idx: Vec<u32> = Vec::with_capacity(f);
            let mut coef: Vec<f32> = Vec::with_capacity(f);
            let mut kept = 0u64;
            for t in chunk(n, ti, nt) {
                idx.clear();
                coef.clear();
                let row = &h[t * f..(t + 1) * f];
                if boundary[t] {
                    idx.extend(0..f as u32);
                    coef.extend_from_slice(row);
                    coef.iter_mut().zip(&sd.offset).for_each(|(c, m)| *c -= m);
                } else if sd.offset.is_empty() {
                    for (j, &a) in row.iter().enumerate() {
                        if a.abs() > sd.threshold {
                            idx.push(j as u32);
                            coef.push(a);
                        }
                    }
                } else {
                    for (j, (&a, &m)) in row.iter().zip(&sd.offset).enumerate() {
                        if a.abs() > sd.threshold {
                            idx.push(j as u32);
                            coef.push(a - m);
                        }
                    }
                }
                kept += idx.len() as u64;
                // SAFETY: `chunk` gives each thread a disjoint range of
                // tokens; row `t` of `out` (n * d floats, checked above)
                // belongs to this thread alone and outlives the broadcast.
                let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(t * d), d) };
                o.copy_from_slice(&sd.bias);
                accumulate(&sd.wt, d, &idx, &coef, o);
            }
            kept_total.fetch_add(kept, Ordering::Relaxed);
        });
        self.counters[layer][0].fetch_add(kept_total.into_inner(), Ordering::Relaxed);
        self.counters[layer][1].fetch_add(n as u64, Ordering::Relaxed);
        Ok(true)
    }

    /// Per layer: the fraction of FFN neurons kept since the last reset.
    pub fn kept_fractions(&self) -> Vec<f64> {
        self.counters
            .iter()
            .map(|[k, t]| {
                let t = t.load(Ordering::Relaxed);
                if t == 0 { 1.0 } else { k.load(Ordering::Relaxed) as f64 / (t * self.intermediate as u64) as f64 }
            })
            .collect()
    }

    /// The fraction of FFN neurons kept over all layers since the last reset.
    pub fn kept_fraction(&self) -> f64 {
        let (mut k, mut t) = (0u64, 0u64);
        for [kk, tt] in &self.counters {
            k += kk.load(Ordering::Relaxed);
            t += tt.load(Ordering::Relaxed);
        }
        if t == 0 { 1.0 } else { k as f64 / (t * self.intermediate as u64) as f64 }
    }

    pub fn reset_stats(&self) {
        for c in self.counters.iter().flatten() {
            c.store(0, Ordering::Relaxed);
        }
    }

    /// Per layer, the `q` quantile of the recorded `|h|` (pass 1 only).
    pub(crate) fn thresholds(&self, q: f64) -> Vec<f32> {
        let Some(Recorder::Histograms(rec)) = &self.recorder else { return Vec::new() };
        let r = rec.lock().unwrap_or_else(PoisonError::into_inner);
        r.iter().map(|h| quantile(h, q)).collect()
    }

    /// Per target, layer and neuron: the mean skipped value (pass 2 only).
    pub(crate) fn means(&self) -> Vec<Vec<Vec<f32>>> {
        let Some(Recorder::Means { acc, .. }) = &self.recorder else { return Vec::new() };
        let g = acc.lock().unwrap_or_else(PoisonError::into_inner);
        g.iter()
            .map(|layers| {
                layers
                    .iter()
                    .map(|(sum, count)| {
                        sum.iter().zip(count).map(|(&s, &c)| if c == 0 { 0.0 } else { (s / c as f64) as f32 }).collect()
                    })
                    .collect()
            })
            .collect()
    }
}

fn counters(layers: usize) -> Vec<[AtomicU64; 2]> {
    (0..layers).map(|_| [AtomicU64::new(0), AtomicU64::new(0)]).collect()
}

/// `out += Σ_k coef[k] · wt[idx[k], :]` (`wt` is `(_, d)` row-major).
fn accumulate(wt: &[f32], d: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if spinfer_kernels::cpu::CpuFeatures::detect().has_avx2_fma() {
        // SAFETY: AVX2 and FMA were detected at run time (`CpuFeatures::detect`).
        return unsafe { accumulate_avx2(wt, d, idx, coef, out) };
    }
    accumulate_generic::<false>(wt, d, idx, coef, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn accumulate_avx2(wt: &[f32], d: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
    accumulate_generic::<true>(wt, d, idx, coef, out)
}

/// Output columns per pass: 8 AVX2 accumulators held in registers while
/// the kept neurons stream by.
const COLS: usize = 64;

/// The accumulation, blocked over output columns (`FMA`: fused
/// multiply-add, only where the CPU has it; otherwise `mul_add` would be a
/// libm call).
#[inline(always)]
fn accumulate_generic<const FMA: bool>(wt: &[f32], d: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
    let mut cb = 0;
    while cb < d {
        let w = COLS.min(d - cb);
        if w == COLS {
            let mut acc = [0f32; COLS];
            acc.copy_from_slice(&out[cb..cb + COLS]);
            for (&j, &c) in idx.iter().zip(coef) {
                let row: &[f32; COLS] = wt[j as usize * d + cb..][..COLS].try_into().expect("COLS floats");
                for (a, &r) in acc.iter_mut().zip(row) {
                    *a = if FMA { c.mul_add(r, *a) } else { *a + c * r };
                }
            }
            out[cb..cb + COLS].copy_from_slice(&acc);
        } else {
            let o = &mut out[cb..cb + w];
            for (&j, &c) in idx.iter().zip(coef) {
                for (a, &r) in o.iter_mut().zip(&wt[j as usize * d + cb..][..w]) {
                    *a = if FMA { c.mul_add(r, *a) } else { *a + c * r };
                }
            }
        }
        cb += w;
    }
}

/// `"bert."` when the checkpoint's tensor names carry it (`BertFor*` heads).
fn prefix(loader: &dyn Loader) -> &'static str {
    if loader.has_tensor("bert.embeddings.word_embeddings.weight") { "bert." } else { "" }
}

fn err(path: &Path, detail: impl Into<String>) -> Error {
    Error::Sparsity { path: path.to_path_buf(), detail: detail.into() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulate_matches_the_dense_product() {
        // d = 100: one full 64-column block and a 36-column tail.
        let (d, f) = (100, 37);
        let wt: Vec<f32> = (0..d * f).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0).collect();
        let h: Vec<f32> = (0..f).map(|j| ((j * 31 % 17) as f32 - 8.0) / 4.0).collect();
        let idx: Vec<u32> = (0..f as u32).filter(|j| j % 3 != 1).collect();
        let coef: Vec<f32> = idx.iter().map(|&j| h[j as usize]).collect();
        let mut want = vec![0.5f32; d];
        for (&j, &c) in idx.iter().zip(&coef) {
            for o in 0..d {
                want[o] += c * wt[j as usize * d + o];
            }
        }
        for fma in [false, true] {
            let mut got = vec![0.5f32; d];
            if fma {
                accumulate(&wt, d, &idx, &coef, &mut got);
            } else {
                accumulate_generic::<false>(&wt, d, &idx, &coef, &mut got);
            }
            let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(diff < 1e-4, "fma {fma}: {diff}");
        }
    }

    #[test]
    fn sidecar_round_trip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.json");
        let id = BertModelId { layers: 2, hidden: 4, intermediate: 8, fingerprint: "0123456789abcdef".into() };
        let s = BertSparsity::new(id.clone(), 0.5, vec![0.1, 0.2]);
        s.write(&p).unwrap();
        assert_eq!(BertSparsity::read(&p).unwrap(), s);
        s.check(&id, &p).unwrap();
        let other = BertModelId { fingerprint: "ffffffffffffffff".into(), ..id };
        let e = s.check(&other, &p).unwrap_err().to_string();
        assert!(e.contains("s.json") && e.contains("another model") && e.contains("ffffffffffffffff"), "{e}");
        std::fs::write(&p, "{not json").unwrap();
        let e = BertSparsity::read(&p).unwrap_err().to_string();
        assert!(e.contains("s.json") && e.contains(FORMAT), "{e}");
        let bad = serde_json::to_string(&BertSparsity { thresholds: vec![0.1], ..s.clone() }).unwrap();
        std::fs::write(&p, bad).unwrap();
        assert!(BertSparsity::read(&p).unwrap_err().to_string().contains("1 thresholds"));
        let bad = serde_json::to_string(&BertSparsity { format: "x".into(), ..s }).unwrap();
        std::fs::write(&p, bad).unwrap();
        assert!(BertSparsity::read(&p).unwrap_err().to_string().contains("format is 'x'"));
    }
}
