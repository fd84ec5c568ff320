//! The sparse output head: the vocabulary rows as balanced clusters, the
//! clusters ranked per token from their mean row, exact logits only for a
//! hot set of frequent tokens and the rows of the best `probes` clusters.
//!
//! Offline ([`HeadIndex::build`], `spinfer calibrate-head`), from some
//! calibration text ([`HeadCalibration`]): its most frequent tokens become
//! the hot rows, computed for every token; the other rows are clustered by
//! balanced spherical k-means (`kmeans.rs`) in the metric of the text's
//! hidden states (`metric.rs`), so a cluster holds rows whose logits stay
//! close on the hidden states the model produces. The index file ([`file`])
//! holds the hot rows, each cluster's rows, its mean row and its spread
//! (the expected variance of its rows' logits around the mean row's), and
//! names the head it was built from (by sha256).
//!
//! Per token ([`crate::model::Model::next_token_logits`], [`SparseHead`]):
//! score the cluster means (a `clusters × dim` Q8_0 matrix through the
//! kernel registry), rank the clusters by score plus three standard
//! deviations of their spread (the likely best row of each), and compute
//! the exact logits of the hot rows and of the best `probes` clusters'
//! rows with the head's gathered-row kernel.
//!
//! The distribution sampled is the dense softmax with each unprobed row's
//! logit replaced by a stand-in: its cluster's score plus half its spread
//! (the log of the cluster's mean `exp(logit)` if its logits were normal
//! around the score: the stand-ins keep about the cluster's probability
//! mass), held just below the best exact logit. Every token keeps a
//! non-zero probability where the dense rule gives one, and temperature,
//! top-k, top-p, min-p and the repetition penalty apply to this vector as
//! to the dense one. Greedy decoding picks the best exact logit, since no
//! stand-in reaches it.

mod build;
mod file;
mod kmeans;
mod metric;
mod rows;
mod rule;
mod sparse;

pub use file::HeadModel;
pub use metric::HiddenMoment;
pub use rows::rows_path;
pub use rule::{HeadRule, HeadScratch, HeadShape, HeadStats};
pub use sparse::SparseHead;

use crate::{Error, Result};
use spinfer_formats::tensor::TensorData;

/// The clustered vocabulary of one model's output head.
pub struct HeadIndex {
    pub model: HeadModel,
    /// `members[..offsets[0]]` are the hot rows, computed for every token
    /// (ascending); cluster `c` holds `members[offsets[c]..offsets[c + 1]]`
    /// (ascending). Every vocabulary row appears once.
    offsets: Vec<u32>, // (clusters + 1)
    members: Vec<u32>, // (vocab)
    means: Vec<f32>,   // (clusters, dim) each cluster's mean row
    /// Each cluster's spread: the expected variance of its rows' logits
    /// around its mean row's logit on calibration hidden states.
    spread: Vec<f32>, // (clusters)
    /// Calibration positions the metric was measured on.
    metric_positions: usize,
    /// Clusters probed per token unless the operator says otherwise.
    default_probes: usize,
    /// The head's rows in member order (`rows.rs`), when written, and
    /// their sha256.
    rows: Option<TensorData>,
    rows_sha256: Option<String>,
    iters: usize,
    seed: u64,
}

/// How [`HeadIndex::build`] clusters.
#[derive(Clone, Copy, Debug)]
pub struct HeadBuildOptions {
    /// Rows per cluster (the last clusters may hold one fewer).
    pub cluster_rows: usize,
    /// k-means rounds.
    pub iters: usize,
    pub seed: u64,
}

impl Default for HeadBuildOptions {
    fn default() -> Self {
        Self { cluster_rows: 64, iters: 6, seed: 0x5eed }
    }
}

/// What [`HeadIndex::build`] learns from calibration text: which rows are
/// hot and the metric the others are clustered in.
pub struct HeadCalibration {
    /// Token ids computed for every token.
    pub hot: Vec<u32>,
    pub moment: HiddenMoment,
}

impl HeadIndex {
    pub fn clusters(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Clusters probed per token when the operator names no count: an
    /// eighth of them, or what [`HeadIndex::set_default_probes`] chose
    /// (`spinfer calibrate-head` measures it).
    pub fn default_probes(&self) -> usize {
        self.default_probes
    }

    pub fn set_default_probes(&mut self, probes: usize) -> Result<()> {
        if probes == 0 || probes > self.clusters() {
            return Err(Error::InvalidArgument(format!(
                "head probes must be in 1..={} (its clusters), got {probes}",
                self.clusters()
            )));
        }
        self.default_probes = probes;
        Ok(())
    }

    /// The rows computed for every token, ascending.
    pub fn hot(&self) -> &[u32] {
        &self.members[..self.offsets[0] as usize]
    }

    /// The rows of cluster `c`.
    pub fn members(&self, c: usize) -> &[u32] {
        &self.members[self.offsets[c] as usize..self.offsets[c + 1] as usize]
    }

    /// Whether the cluster-ordered copy of the head is loaded.
    pub fn has_rows(&self) -> bool {
        self.rows.is_some()
    }
}

/// The `n` most frequent of `tokens` (ties to the lower id): the hot rows
/// of [`HeadIndex::build`], from calibration text.
pub fn frequent_tokens(tokens: &[u32], vocab: usize, n: usize) -> Vec<u32> {
    let mut counts = vec![0u64; vocab];
    for &t in tokens.iter().filter(|&&t| (t as usize) < vocab) {
        counts[t as usize] += 1;
    }
    let mut ids: Vec<u32> = (0..vocab as u32).filter(|&t| counts[t as usize] > 0).collect();
    ids.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
    ids.truncate(n);
    ids
}
