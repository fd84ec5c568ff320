//! The sparsity sidecar: what `spinfer calibrate` learned about a model,
//! in a file beside it (the model itself is never modified).
//!
//! The file is a safetensors file (`*.spinfer`). Its `__metadata__` holds:
//!
//! | key | value |
//! |---|---|
//! | `format` | `"spinfer-sparsity"` |
//! | `version` | `"1"` |
//! | `predictor` | `"gate-threshold"`, `"top-k"`, `"input-magnitude"`, `"low-rank"` or `"sentence"` |
//! | `target_sparsity` | fraction of FFN neurons skipped per token, e.g. `"0.5"` |
//! | `model` | JSON: `{"arch", "n_layers", "dim", "ffn_dim", "vocab_size", "fingerprint"}` |
//! | `calibration` | JSON: `{"text", "byte_offset", "tokens"}` (informational) |
//! | `lowrank` | optional JSON: `{"rank", "recall_target", "heldout_recall": [per layer], "predicted_fraction": [per layer], "heldout_tokens"}` |
//! | `attn_sparsity` | optional: fraction of the attention output skipped before the output projection, e.g. `"0.4"` |
//!
//! and per layer `l` these F32 tensors:
//!
//! | tensor | shape | meaning |
//! |---|---|---|
//! | `blk.{l}.ffn_gate.threshold` | `[1]` | keep neuron j when `|silu(gate_j)| > threshold` |
//! | `blk.{l}.ffn.keep` | `[1]` | neurons kept per token by the top-K predictor |
//! | `blk.{l}.ffn_down.input_threshold` | `[1]` | input-magnitude: keep neuron j when `|silu(gate_j) · up_j| > threshold` |
//! | `blk.{l}.ffn.active_freq` | `[ffn_dim]` | fraction of calibration tokens on which neuron j was kept (hot/cold) |
//!
//! With `attn_sparsity` present, also (TEAL on the attention output
//! projection):
//!
//! | tensor | shape | meaning |
//! |---|---|---|
//! | `blk.{l}.attn_output.input_threshold` | `[1]` | keep input i of `W_o` when `|attn_i| > threshold` |
//!
//! With a low-rank predictor (`lowrank` metadata present), also:
//!
//! | tensor | shape | meaning |
//! |---|---|---|
//! | `blk.{l}.ffn_pred.p` | `[rank, dim]` | the gate's top right singular vectors |
//! | `blk.{l}.ffn_pred.q` | `[ffn_dim, rank]` | `W_gate · pᵀ` |
//! | `blk.{l}.ffn_pred.threshold` | `[1]` | keep neuron j when `|silu((q·p·x)_j)| > threshold` |
//!
//! `fingerprint` is the SHA-256 (first 16 hex digits) of layer 0's gate
//! weight bytes: a sidecar calibrated on another model (or another
//! quantisation of it) is refused with both identities named.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Error, Result};
use spinfer_formats::Loader;
use spinfer_formats::ModelConfig;

pub const FORMAT: &str = "spinfer-sparsity";
pub const VERSION: &str = "1";

/// How active neurons are predicted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PredictorKind {
    /// CATS: compute the full gate, keep neurons with `|silu(gate)|` above a
    /// calibrated per-layer threshold; up and down only for those.
    GateThreshold,
    /// A fixed number of neurons per layer: the largest `|silu(gate)|`.
    TopK,
    /// TEAL-style on the down projection's input: compute gate and up in
    /// full, keep neurons with `|silu(gate) · up|` above a calibrated
    /// per-layer threshold, and run the down projection on those only.
    InputMagnitude,
    /// Deja Vu / PowerInfer style: a rank-r predictor of the gate picks the
    /// neurons before any FFN projection runs; the gate is computed for
    /// those only and filtered by the gate threshold, then up and down.
    LowRank,
    /// CoreInfer / GRIFFIN style: one mask per request, the `keep` neurons
    /// with the largest mean `|silu(gate)·up|` over the prompt (run dense);
    /// every later token computes only those.
    Sentence,
    /// A pack's predictor (`--predictor pack:<pack>/<name>`): it picks the
    /// neurons from the FFN input before any FFN projection runs; gate, up
    /// and down are computed for those only. Never written to a sidecar.
    #[serde(skip)]
    Pack,
}

impl PredictorKind {
    pub const ALL: [PredictorKind; 5] = [
        PredictorKind::GateThreshold,
        PredictorKind::TopK,
        PredictorKind::InputMagnitude,
        PredictorKind::LowRank,
        PredictorKind::Sentence,
    ];

    /// The accepted names, for messages: `"gate-threshold, top-k, ..."`.
    pub fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    pub fn name(self) -> &'static str {
        match self {
            PredictorKind::GateThreshold => "gate-threshold",
            PredictorKind::TopK => "top-k",
            PredictorKind::InputMagnitude => "input-magnitude",
            PredictorKind::LowRank => "low-rank",
            PredictorKind::Sentence => "sentence",
            PredictorKind::Pack => "pack",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "gate-threshold" | "threshold" | "cats" => Some(PredictorKind::GateThreshold),
            "top-k" | "topk" => Some(PredictorKind::TopK),
            "input-magnitude" | "teal" => Some(PredictorKind::InputMagnitude),
            "low-rank" | "lowrank" => Some(PredictorKind::LowRank),
            "sentence" | "sentence-level" => Some(PredictorKind::Sentence),
            _ => None,
        }
    }
}

/// Which model a sidecar belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelId {
    pub arch: String,
    pub n_layers: usize,
    pub dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub fingerprint: String,
}

impl ModelId {
    /// The identity of a model with configuration `c` read by `loader`.
    pub fn of(c: &ModelConfig, loader: &dyn Loader) -> Result<Self> {
        let gate = loader.tensor("blk.0.ffn_gate.weight")?;
        let digest = Sha256::digest(gate.data.bytes());
        let fingerprint = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        Ok(Self {
            arch: format!("{:?}", c.arch).to_lowercase(),
            n_layers: c.n_layers,
            dim: c.dim,
            ffn_dim: c.ffn_dim,
            vocab_size: c.vocab_size,
            fingerprint,
        })
    }
}

/// Where the calibration statistics came from (informational).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CalibrationInfo {
    pub text: String,
    pub byte_offset: usize,
    pub tokens: usize,
}

/// Per-layer calibration results.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerStats {
    /// Keep neurons with `|silu(gate)|` above this (gate-threshold).
    pub threshold: f32,
    /// Neurons kept per token (top-K).
    pub keep: usize,
    /// Keep neurons with `|silu(gate) · up|` above this (input-magnitude).
    pub input_threshold: f32,
    /// Fraction of calibration tokens each neuron was kept on (ffn_dim).
    pub active_freq: Vec<f32>,
    /// The low-rank predictor's factors, if calibrated with one.
    pub lowrank: Option<LowRankFactors>,
    /// Keep input i of the attention output projection when `|attn_i|`
    /// is above this; `None` unless calibrated with an attention sparsity.
    pub attn_input_threshold: Option<f32>,
}

/// One layer's low-rank predictor.
#[derive(Clone, Debug, PartialEq)]
pub struct LowRankFactors {
    pub rank: usize,
    /// (rank, dim), row-major.
    pub p: Vec<f32>,
    /// (ffn_dim, rank), row-major.
    pub q: Vec<f32>,
    /// Keep neuron j when `|silu(ĝ_j)| > threshold`.
    pub threshold: f32,
}

/// How the low-rank predictor did on held-out calibration text.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LowRankInfo {
    pub rank: usize,
    pub recall_target: f32,
    /// Per layer: fraction of truly active neurons (|silu(gate)| above the
    /// gate threshold) the predictor kept.
    pub heldout_recall: Vec<f32>,
    /// Per layer: fraction of all neurons the predictor kept.
    pub predicted_fraction: Vec<f32>,
    pub heldout_tokens: usize,
}

/// A sparsity sidecar in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Sidecar {
    pub predictor: PredictorKind,
    pub target_sparsity: f32,
    pub model: ModelId,
    pub calibration: CalibrationInfo,
    pub layers: Vec<LayerStats>,
    /// Present when the sidecar holds a low-rank predictor.
    pub lowrank: Option<LowRankInfo>,
    /// Fraction of the attention output skipped before `W_o`, when
    /// calibrated (every layer then has an `attn_input_threshold`).
    pub attn_sparsity: Option<f32>,
}

fn err(path: &Path, detail: impl Into<String>) -> Error {
    Error::Sparsity { path: path.to_path_buf(), detail: detail.into() }
}

impl Sidecar {
    /// Refuses a sidecar made for another model, naming both.
    pub fn check_model(&self, model: &ModelId, path: &Path) -> Result<()> {
        if self.model != *model {
            let show = |m: &ModelId| {
                format!(
                    "{} with {} layers, dim {}, ffn {}, vocab {}, fingerprint {}",
                    m.arch, m.n_layers, m.dim, m.ffn_dim, m.vocab_size, m.fingerprint
                )
            };
            return Err(err(
                path,
                format!("was calibrated for {}, but this model is {}", show(&self.model), show(model)),
            ));
        }
        Ok(())
    }

    /// Writes the sidecar to `path` (safetensors layout, see the module docs).
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (l, s) in self.layers.iter().enumerate() {
            tensors.push((format!("blk.{l}.ffn_gate.threshold"), vec![1], s.threshold.to_le_bytes().to_vec()));
            tensors.push((format!("blk.{l}.ffn.keep"), vec![1], (s.keep as f32).to_le_bytes().to_vec()));
            tensors.push((
                format!("blk.{l}.ffn_down.input_threshold"),
                vec![1],
                s.input_threshold.to_le_bytes().to_vec(),
            ));
            let freq: Vec<u8> = s.active_freq.iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((format!("blk.{l}.ffn.active_freq"), vec![s.active_freq.len()], freq));
            if let Some(f) = &s.lowrank {
                let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
                tensors.push((format!("blk.{l}.ffn_pred.p"), vec![f.rank, f.p.len() / f.rank.max(1)], bytes(&f.p)));
                tensors.push((format!("blk.{l}.ffn_pred.q"), vec![f.q.len() / f.rank.max(1), f.rank], bytes(&f.q)));
                tensors.push((format!("blk.{l}.ffn_pred.threshold"), vec![1], f.threshold.to_le_bytes().to_vec()));
            }
            if self.attn_sparsity.is_some() {
                let t = s.attn_input_threshold.ok_or_else(|| {
                    err(path, format!("layer {l} has no attention threshold, but attn_sparsity is set"))
                })?;
                tensors.push((format!("blk.{l}.attn_output.input_threshold"), vec![1], t.to_le_bytes().to_vec()));
            }
        }
        let model = serde_json::to_string(&self.model).map_err(|e| err(path, e.to_string()))?;
        let calibration = serde_json::to_string(&self.calibration).map_err(|e| err(path, e.to_string()))?;
        let mut meta = serde_json::Map::new();
        meta.insert("format".into(), FORMAT.into());
        meta.insert("version".into(), VERSION.into());
        meta.insert("predictor".into(), self.predictor.name().into());
        meta.insert("target_sparsity".into(), self.target_sparsity.to_string().into());
        meta.insert("model".into(), model.into());
        meta.insert("calibration".into(), calibration.into());
        if let Some(info) = &self.lowrank {
            meta.insert("lowrank".into(), serde_json::to_string(info).map_err(|e| err(path, e.to_string()))?.into());
        }
        if let Some(a) = self.attn_sparsity {
            meta.insert("attn_sparsity".into(), a.to_string().into());
        }
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), meta.into());
        let mut off = 0usize;
        for (name, shape, data) in &tensors {
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [off, off + data.len()]}),
            );
            off += data.len();
        }
        let mut h = serde_json::to_vec(&header).map_err(|e| err(path, e.to_string()))?;
        h.resize(h.len().next_multiple_of(8), b' ');
        let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
        bytes.extend(h);
        tensors.iter().for_each(|t| bytes.extend_from_slice(&t.2));
        // Write then rename: a crash never leaves a half-written sidecar.
        let tmp = path.with_extension("spinfer.tmp");
        std::fs::write(&tmp, &bytes).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
    }

    /// Reads and validates a sidecar.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let (_, st_meta) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| err(path, format!("not a readable sparsity file (truncated, or not safetensors: {e})")))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| err(path, format!("corrupt: {e}")))?;
        let meta: HashMap<String, String> = st_meta.metadata().clone().unwrap_or_default();
        let get = |k: &str| {
            meta.get(k).map(String::as_str).ok_or_else(|| err(path, format!("metadata key '{k}' is missing")))
        };
        if get("format")? != FORMAT {
            return Err(err(path, format!("metadata 'format' is '{}', expected '{FORMAT}'", get("format")?)));
        }
        if get("version")? != VERSION {
            return Err(err(
                path,
                format!("version {} is not supported (this build reads {VERSION})", get("version")?),
            ));
        }
        let predictor = PredictorKind::parse(get("predictor")?)
            .ok_or_else(|| err(path, format!("unknown predictor '{}'", get("predictor").unwrap_or_default())))?;
        let target_sparsity: f32 =
            get("target_sparsity")?.parse().map_err(|e| err(path, format!("metadata 'target_sparsity': {e}")))?;
        let model: ModelId =
            serde_json::from_str(get("model")?).map_err(|e| err(path, format!("metadata 'model': {e}")))?;
        let calibration: CalibrationInfo = match meta.get("calibration") {
            Some(c) => serde_json::from_str(c).map_err(|e| err(path, format!("metadata 'calibration': {e}")))?,
            None => CalibrationInfo::default(),
        };
        let lowrank: Option<LowRankInfo> = match meta.get("lowrank") {
            Some(c) => Some(serde_json::from_str(c).map_err(|e| err(path, format!("metadata 'lowrank': {e}")))?),
            None => None,
        };
        let attn_sparsity: Option<f32> = match meta.get("attn_sparsity") {
            Some(a) => Some(a.parse().map_err(|e| err(path, format!("metadata 'attn_sparsity': {e}")))?),
            None => None,
        };
        let tensor = |name: &str, shape: &[usize]| -> Result<Vec<f32>> {
            let t = st.tensor(name).map_err(|_| err(path, format!("tensor '{name}' is missing")))?;
            if t.dtype() != safetensors::Dtype::F32 || t.shape() != shape {
                return Err(err(
                    path,
                    format!("tensor '{name}' is {:?} {:?}, expected F32 {shape:?}", t.dtype(), t.shape()),
                ));
            }
            let v: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            if v.iter().any(|x| !x.is_finite()) {
                return Err(err(path, format!("tensor '{name}' holds a non-finite value")));
            }
            Ok(v)
        };
        let f32s = |name: &str, len: usize| tensor(name, &[len]);
        let per_layer = 4 + if lowrank.is_some() { 3 } else { 0 } + usize::from(attn_sparsity.is_some());
        // The layer count sizes an allocation: check it against the tensors
        // present before anything is sized from it.
        let expected = model.n_layers.checked_mul(per_layer).filter(|&n| n == st.len());
        if expected.is_none() {
            let want = model.n_layers.checked_mul(per_layer).map_or_else(|| "more".to_string(), |n| n.to_string());
            return Err(err(
                path,
                format!("holds {} tensors, expected {want} for {} layers (metadata 'model')", st.len(), model.n_layers),
            ));
        }
        let mut layers = Vec::with_capacity(model.n_layers);
        for l in 0..model.n_layers {
            let threshold = f32s(&format!("blk.{l}.ffn_gate.threshold"), 1)?[0];
            let keep = f32s(&format!("blk.{l}.ffn.keep"), 1)?[0];
            if keep < 0.0 || keep > model.ffn_dim as f32 || keep.fract() != 0.0 {
                return Err(err(
                    path,
                    format!("tensor 'blk.{l}.ffn.keep' is {keep}, not a count in 0..={}", model.ffn_dim),
                ));
            }
            let input_threshold = f32s(&format!("blk.{l}.ffn_down.input_threshold"), 1)?[0];
            let active_freq = f32s(&format!("blk.{l}.ffn.active_freq"), model.ffn_dim)?;
            let lowrank = match &lowrank {
                Some(info) => {
                    let r = info.rank;
                    Some(LowRankFactors {
                        rank: r,
                        p: tensor(&format!("blk.{l}.ffn_pred.p"), &[r, model.dim])?,
                        q: tensor(&format!("blk.{l}.ffn_pred.q"), &[model.ffn_dim, r])?,
                        threshold: f32s(&format!("blk.{l}.ffn_pred.threshold"), 1)?[0],
                    })
                }
                None => None,
            };
            let attn_input_threshold = match attn_sparsity {
                Some(_) => Some(f32s(&format!("blk.{l}.attn_output.input_threshold"), 1)?[0]),
                None => None,
            };
            layers.push(LayerStats {
                threshold,
                keep: keep as usize,
                input_threshold,
                active_freq,
                lowrank,
                attn_input_threshold,
            });
        }
        Ok(Self { predictor, target_sparsity, model, calibration, layers, lowrank, attn_sparsity })
    }
}

/// The conventional sidecar path of a model: `model.gguf` → `model.spinfer`.
pub fn default_path(model: &Path) -> PathBuf {
    model.with_extension("spinfer")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n_layers: usize, ffn: usize) -> Sidecar {
        Sidecar {
            predictor: PredictorKind::GateThreshold,
            target_sparsity: 0.5,
            model: ModelId {
                arch: "llama".into(),
                n_layers,
                dim: 8,
                ffn_dim: ffn,
                vocab_size: 10,
                fingerprint: "0123456789abcdef".into(),
            },
            calibration: CalibrationInfo { text: "wiki.test.raw".into(), byte_offset: 800_000, tokens: 4096 },
            layers: (0..n_layers)
                .map(|l| LayerStats {
                    threshold: 0.1 * (l + 1) as f32,
                    keep: ffn / 2,
                    input_threshold: 0.01 * (l + 1) as f32,
                    lowrank: (l == 0 || n_layers > 0).then(|| LowRankFactors {
                        rank: 32,
                        p: (0..32 * 8).map(|i| i as f32).collect(),
                        q: (0..ffn * 32).map(|i| -(i as f32)).collect(),
                        threshold: 0.25,
                    }),
                    active_freq: (0..ffn).map(|j| j as f32 / ffn as f32).collect(),
                    attn_input_threshold: Some(0.02 * (l + 1) as f32),
                })
                .collect(),
            lowrank: Some(LowRankInfo {
                rank: 32,
                recall_target: 0.95,
                heldout_recall: vec![0.96; n_layers],
                predicted_fraction: vec![0.7; n_layers],
                heldout_tokens: 512,
            }),
            attn_sparsity: Some(0.4),
        }
    }

    #[test]
    fn round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.spinfer");
        let s = sample(3, 64);
        s.write(&path).unwrap();
        assert_eq!(Sidecar::read(&path).unwrap(), s);
        assert!(!path.with_extension("spinfer.tmp").exists());
        // Without attention thresholds.
        let mut s = s;
        s.attn_sparsity = None;
        s.layers.iter_mut().for_each(|l| l.attn_input_threshold = None);
        s.write(&path).unwrap();
        assert_eq!(Sidecar::read(&path).unwrap(), s);
    }

    #[test]
    fn corrupt_or_foreign_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.spinfer");
        sample(2, 32).write(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let read_err = |b: &[u8]| {
            std::fs::write(&path, b).unwrap();
            let e = Sidecar::read(&path).unwrap_err().to_string();
            assert!(e.contains("m.spinfer"), "{e}");
            e
        };
        assert!(read_err(&bytes[..bytes.len() - 10]).contains("truncated"));
        assert!(read_err(&bytes[..4]).contains("not a readable sparsity file"));
        assert!(read_err(b"").contains("not a readable sparsity file"));
        // Same-length edits of the header.
        let edit = |from: &str, to: &str| {
            let at = bytes.windows(from.len()).position(|w| w == from.as_bytes()).expect("header text present");
            let mut b = bytes.clone();
            b[at..at + to.len()].copy_from_slice(to.as_bytes());
            b
        };
        assert!(read_err(&edit(FORMAT, "spinfer-sparsitX")).contains("'format'"));
        assert!(read_err(&edit("\"version\":\"1\"", "\"version\":\"9\"")).contains("version 9"));

        // Another model: both identities named.
        let s = sample(2, 32);
        let mut other = s.model.clone();
        other.n_layers = 30;
        other.fingerprint = "ffffffffffffffff".into();
        let e = s.check_model(&other, &path).unwrap_err().to_string();
        assert!(e.contains("2 layers") && e.contains("30 layers") && e.contains("ffffffffffffffff"), "{e}");
        assert!(s.check_model(&s.model, &path).is_ok());
    }
}
