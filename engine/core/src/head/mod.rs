//! The sparse output head: the vocabulary rows as balanced clusters, the
//! clusters ranked per token from their mean row, exact logits only for a
//! hot set of frequent tokens and the rows of the best `probes` clusters.
//!
//! Offline ([`HeadIndex::build`], `spinfer calibrate-head`), from some
//! calibration text ([`HeadCalibration`]): its most frequent tokens become
//! the hot rows, computed for every token; the other rows are clustered by
//! balanced spherical k-means ([`kmeans`]) in the metric of the text's
//! hidden states ([`metric`]), so a cluster holds rows whose logits stay
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

pub mod eval;
mod file;
mod kmeans;
mod metric;
mod rows;
mod sparse;

pub use file::HeadModel;
pub use metric::HiddenMoment;
pub use rows::rows_path;
pub use sparse::{HeadScratch, HeadStats, SparseHead};

use sha2::{Digest, Sha256};
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::pool::ThreadPool;

use crate::model::{Model, Session};
use crate::tensor::TensorData;
use crate::{Error, Result};

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

impl HeadCalibration {
    /// The `hot` most frequent of `tokens` as hot rows, and the hidden
    /// states' moment over their first `positions` (run through `model`).
    pub fn from_tokens(
        model: &Model,
        session: &mut Session,
        tokens: &[u32],
        hot: usize,
        positions: usize,
    ) -> Result<Self> {
        let moment = HiddenMoment::measure(model, session, &tokens[..positions.min(tokens.len())])?;
        Ok(Self { hot: frequent_tokens(tokens, model.config.vocab_size, hot), moment })
    }
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

    /// Which head `model` has: its shape, tensor and the sha256 of its
    /// bytes. Reading them all for the hash would leave the whole head in
    /// the resident set, which a sparse head exists to avoid: a mapped
    /// head's pages are released as they are hashed (re-read when touched).
    pub fn model_of(model: &Model) -> HeadModel {
        let out = &model.weights.output;
        // Hashed in slices of 8 MiB, each released after (the peak
        // resident set grows by one slice, not the whole head).
        let mut hasher = Sha256::new();
        for part in out.raw_weights().chunks(8 << 20) {
            hasher.update(part);
            if out.w.is_mapped() {
                crate::sparse::bundle::release_pages(part);
            }
        }
        let digest = hasher.finalize();
        HeadModel {
            arch: format!("{:?}", model.config.arch).to_lowercase(),
            vocab_size: model.config.vocab_size,
            dim: model.config.dim,
            tensor: out.name.clone(),
            tensor_type: out.desc.wtype.name().to_string(),
            sha256: digest.iter().map(|b| format!("{b:02x}")).collect(),
        }
    }

    /// Clusters `model`'s head rows other than `calib`'s hot ones, in
    /// `calib`'s metric. `progress(done, total)` per round.
    pub fn build(
        model: &Model,
        pool: &ThreadPool,
        o: &HeadBuildOptions,
        calib: &HeadCalibration,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let (vocab, dim) = (model.config.vocab_size, model.config.dim);
        if calib.moment.dim() != dim {
            return Err(Error::InvalidArgument(format!(
                "the head's metric is {0} x {0}, the model's hidden size {dim}",
                calib.moment.dim()
            )));
        }
        // Hot rows first, then the others (each ascending).
        let mut is_hot = vec![false; vocab];
        for &t in &calib.hot {
            *is_hot.get_mut(t as usize).ok_or_else(|| {
                Error::InvalidArgument(format!("hot token {t} is outside the vocabulary ({vocab})"))
            })? = true;
        }
        let hot: Vec<u32> = (0..vocab as u32).filter(|&t| is_hot[t as usize]).collect();
        let rest: Vec<u32> = (0..vocab as u32).filter(|&t| !is_hot[t as usize]).collect();
        drop(is_hot);
        if o.cluster_rows == 0 || o.cluster_rows > rest.len() {
            return Err(Error::InvalidArgument(format!(
                "rows per cluster must be in 1..={} (the rows not hot), got {}",
                rest.len(),
                o.cluster_rows
            )));
        }
        let k = rest.len().div_ceil(o.cluster_rows);
        let rows = dequantized_rows(model)?;
        // The rows to cluster in the hidden states' metric, as unit vectors
        // (their lengths kept to undo it).
        let mut mapped = calib.moment.transform(pool, &rows, &rest)?;
        let lengths = kmeans::normalize_rows(&mut mapped, dim);
        let assign = kmeans::balanced_kmeans(pool, &mapped, dim, k, o.iters, o.seed, progress)?;
        mapped.chunks_exact_mut(dim).zip(&lengths).for_each(|(r, &n)| r.iter_mut().for_each(|x| *x *= n));
        // Each cluster's positions in `rest` (ascending, so its members are
        // too); empty clusters dropped (balanced k-means leaves none in
        // practice).
        let mut at: Vec<Vec<usize>> = vec![Vec::new(); k];
        assign.iter().enumerate().for_each(|(i, &c)| at[c as usize].push(i));
        at.retain(|a| !a.is_empty());
        let k2 = at.len();
        let mut offsets = Vec::with_capacity(k2 + 1);
        offsets.push(hot.len() as u32);
        let mut members = hot;
        for a in &at {
            members.extend(a.iter().map(|&i| rest[i]));
            offsets.push(members.len() as u32);
        }
        let (mut means, mut spread) = (vec![0f32; k2 * dim], vec![0f32; k2]);
        for (c, at) in at.iter().enumerate() {
            let row = |i: usize| &rows[rest[i] as usize * dim..][..dim];
            let mean = &mut means[c * dim..][..dim];
            at.iter().for_each(|&i| mean.iter_mut().zip(row(i)).for_each(|(m, x)| *m += x));
            mean.iter_mut().for_each(|m| *m /= at.len() as f32);
            let own: Vec<&[f32]> = at.iter().map(|&i| row(i)).collect();
            let images: Vec<&[f32]> = at.iter().map(|&i| &mapped[i * dim..][..dim]).collect();
            spread[c] = calib.moment.spread(&own, &images);
        }
        Ok(Self {
            model: Self::model_of(model),
            offsets,
            members,
            means,
            spread,
            metric_positions: calib.moment.positions,
            default_probes: k2.div_ceil(8),
            rows: None,
            rows_sha256: None,
            iters: o.iters,
            seed: o.seed,
        })
    }

    /// Writes `model`'s head rows in member order (hot rows, then cluster
    /// by cluster) beside the index that will be saved at `index_path`
    /// ([`rows_path`]); [`HeadIndex::save`] then names them and
    /// [`HeadIndex::load`] maps them, so the hot rows and each probed
    /// cluster are one contiguous read each.
    pub fn write_rows(&mut self, model: &Model, index_path: &std::path::Path) -> Result<()> {
        self.rows_sha256 = Some(rows::write(model, self, &rows_path(index_path))?);
        Ok(())
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

/// Every row of `model`'s head as f32 (`vocab × dim`).
fn dequantized_rows(model: &Model) -> Result<Vec<f32>> {
    let out = &model.weights.output;
    let (vocab, dim) = (model.config.vocab_size, model.config.dim);
    let row_bytes = out.desc.wtype.row_bytes(dim)?;
    let mut rows = Vec::new();
    rows.try_reserve_exact(vocab * dim)
        .map_err(|e| Error::InvalidArgument(format!("{vocab} x {dim} head rows in f32: {e}")))?;
    rows.resize(vocab * dim, 0.0);
    for (r, dst) in rows.chunks_exact_mut(dim).enumerate() {
        dequantize_row(out.desc.wtype, &out.raw_weights()[r * row_bytes..][..row_bytes], dst)?;
    }
    Ok(rows)
}
