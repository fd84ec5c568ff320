//! The embedder's sparse FFN from the outside: calibrating it (which runs
//! the dense model, so it sits above both `embed` and `model::bert_sparse`)
//! and setting or loading a sidecar.

use std::path::Path;
use std::sync::Mutex;

use crate::embed::{Embedder, Embedding};
use crate::experimental::bert_sparse::{BertCalibrationInfo, BertModelId, BertSparsity, Recorder, SparseFfn};
use crate::{Error, Result};
use spinfer_formats::safetensors::SafetensorsModel;
use spinfer_sparsity::stats::BINS;

impl Embedder {
    /// Calibrates sparse-FFN thresholds on `texts`: runs the dense model
    /// (whatever sparsity is set, it is restored afterwards), collects
    /// per-layer histograms of `|GELU(W1 x + b1)|` and takes their
    /// `target_sparsity` quantiles. `source` is recorded in the sidecar.
    pub fn calibrate_sparsity(&mut self, texts: &[&str], target_sparsity: f32, source: &str) -> Result<BertSparsity> {
        let mut v = self.calibrate_sparsity_targets(texts, &[target_sparsity], source)?;
        Ok(v.remove(0))
    }

    /// As [`Embedder::calibrate_sparsity`], one sidecar per target from a
    /// single pass over the texts.
    pub fn calibrate_sparsity_targets(
        &mut self,
        texts: &[&str],
        targets: &[f32],
        source: &str,
    ) -> Result<Vec<BertSparsity>> {
        if let Some(t) = targets.iter().find(|t| !(0.0..1.0).contains(*t)) {
            return Err(Error::InvalidArgument(format!("target sparsity must be in [0, 1), got {t}")));
        }
        if texts.is_empty() || targets.is_empty() {
            return Err(Error::InvalidArgument("calibration needs at least one text and one target".into()));
        }
        let loader = SafetensorsModel::open(self.model_dir())?;
        let config = self.model().config.clone();
        let id = BertModelId::of(&loader, &config)?;
        // Pass 1: histograms of |h|, thresholds per target.
        let hist = Recorder::Histograms(Mutex::new(vec![vec![0u64; BINS]; config.n_layers]));
        let (embeddings, recorder) = self.record(texts, SparseFfn::recorder(&config, hist))?;
        let thresholds: Vec<Vec<f32>> = targets.iter().map(|&t| recorder.thresholds(f64::from(t))).collect();
        // Pass 2: per neuron, the mean of the values each target skips.
        let zero = || (0..config.n_layers).map(|_| (vec![0.0; config.intermediate], vec![0; config.intermediate]));
        let acc = Mutex::new(targets.iter().map(|_| zero().collect()).collect());
        let means = Recorder::Means { thresholds: thresholds.clone(), acc };
        let (_, recorder) = self.record(texts, SparseFfn::recorder(&config, means))?;
        let offsets = recorder.means();
        let calibration = BertCalibrationInfo {
            text: source.into(),
            texts: texts.len(),
            tokens: embeddings.iter().map(|e| e.tokens).sum(),
        };
        Ok(targets
            .iter()
            .zip(thresholds)
            .zip(offsets)
            .map(|((&t, th), off)| {
                let mut s = BertSparsity::new(id.clone(), t, th);
                s.calibration = calibration.clone();
                s.offsets = off;
                s
            })
            .collect())
    }

    /// Embeds `texts` with `recorder` in the FFN hook, restoring whatever
    /// sparsity was set.
    fn record(&mut self, texts: &[&str], recorder: SparseFfn) -> Result<(Vec<Embedding>, SparseFfn)> {
        let previous = self.model_mut().set_sparse(Some(recorder))?;
        let result = self.embed_batch_detailed(texts);
        let recorder = self.model_mut().set_sparse(previous)?;
        let recorder = recorder.ok_or_else(|| Error::InvalidArgument("the calibration recorder vanished".into()))?;
        Ok((result?, recorder))
    }

    /// Calibration texts from a raw text file's bytes (e.g. WikiText-2):
    /// the lines after byte `offset` (from the next line start), trimmed,
    /// without empty lines, WikiText headings (` = Title = `) and lines
    /// longer than [`Embedder::max_tokens`] (so nothing is truncated); at
    /// most `max` of them.
    pub fn calibration_texts(&self, raw: &[u8], offset: usize, max: usize) -> Result<Vec<String>> {
        let rest = raw.get(offset..).unwrap_or_default();
        let rest =
            if offset == 0 { rest } else { rest.iter().position(|&b| b == b'\n').map_or(&[][..], |p| &rest[p + 1..]) };
        let mut out = Vec::new();
        for line in String::from_utf8_lossy(rest).lines() {
            if out.len() >= max {
                break;
            }
            let line = line.trim();
            if line.is_empty() || line.starts_with('=') {
                continue;
            }
            if self.tokenizer().encode(line, true)?.len() <= self.max_tokens() {
                out.push(line.to_string());
            }
        }
        Ok(out)
    }

    /// Runs the FFN sparse with `sidecar` (checked against this model;
    /// `path` names it in errors), or dense with `None`.
    pub fn set_sparsity(&mut self, sidecar: Option<BertSparsity>, path: &Path) -> Result<()> {
        let sparse = match sidecar {
            None => None,
            Some(s) => {
                let loader = SafetensorsModel::open(self.model_dir())?;
                Some(SparseFfn::build(&loader, &self.model().config, s, path)?)
            }
        };
        self.model_mut().set_sparse(sparse)?;
        Ok(())
    }

    /// Reads a sidecar written by `spinfer calibrate-embed` and runs sparse.
    pub fn load_sparsity(&mut self, path: &Path) -> Result<()> {
        let s = BertSparsity::read(path)?;
        self.set_sparsity(Some(s), path)
    }

    /// The sparse FFN, when one is set (kept fractions, thresholds).
    pub fn sparse_ffn(&self) -> Option<&SparseFfn> {
        self.model().sparse.as_ref().filter(|s| s.recorder.is_none())
    }
}
