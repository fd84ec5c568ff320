//! The sparse output head: the vocabulary rows as balanced clusters, the
//! clusters scored per token by their mean row, exact logits only for the
//! rows of the best `probes` clusters.
//!
//! Offline ([`HeadIndex::build`], `spinfer calibrate-head`): balanced
//! spherical k-means over the head's rows ([`kmeans`]); the index file
//! ([`file`]) holds each cluster's rows and its mean row, and names the
//! head it was built from (by sha256).
//!
//! Per token ([`crate::model::Model::next_token_logits`]): score the cluster
//! means (a `clusters × dim` Q8_0 matrix through the kernel registry),
//! take the best `probes` clusters, compute their rows' exact logits with
//! the head's gathered-row kernel (reading those rows in place in the
//! model file), and hand the sampler a full logit vector in which every
//! other row carries its cluster's score, the mean of its rows' logits.
//!
//! The distribution sampled is therefore: the dense softmax over all rows,
//! with each unprobed row's logit replaced by its cluster's mean logit
//! (approximated in Q8_0). Every token keeps a non-zero probability where
//! the dense rule gives one, and temperature, top-k, top-p, min-p and the
//! repetition penalty apply to this vector as to the dense one. Greedy
//! decoding picks the best exact logit of the probed rows: an unprobed
//! row's stand-in (its cluster's mean) never exceeds the best probed
//! cluster's score.

pub mod eval;
mod file;
mod kmeans;
mod rows;

pub use rows::rows_path;

pub use file::HeadModel;

use bytemuck::Zeroable;
use sha2::{Digest, Sha256};
use spinfer_kernels::GgmlType;
use spinfer_kernels::blocks::BlockQ8_0;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::quantize::quantize_row_q8_0_ref;

use crate::model::llama::{Linear, Scratch, grow};
use crate::model::{Model, Precision};
use crate::registry::KernelRegistry;
use crate::tensor::TensorData;
use crate::{Error, Result};

/// The clustered vocabulary of one model's output head.
pub struct HeadIndex {
    pub model: HeadModel,
    /// Cluster `c` holds `members[offsets[c]..offsets[c + 1]]`.
    offsets: Vec<u32>, // (clusters + 1)
    members: Vec<u32>, // (vocab) ascending within each cluster
    means: Vec<f32>,   // (clusters, dim) each cluster's mean row
    /// Rows computed exactly for every token whatever the probes: the
    /// calibration text's most frequent tokens, ascending.
    hot: Vec<u32>,
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

impl HeadIndex {
    pub fn clusters(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The rows computed for every token.
    pub fn hot(&self) -> &[u32] {
        &self.hot
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

    /// Clusters `model`'s head rows; `hot` (token ids) are computed for
    /// every token. `progress(done, total)` per round.
    pub fn build(
        model: &Model,
        pool: &ThreadPool,
        o: &HeadBuildOptions,
        hot: &[u32],
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let (vocab, dim) = (model.config.vocab_size, model.config.dim);
        let mut hot = hot.to_vec();
        hot.sort_unstable();
        hot.dedup();
        if let Some(&t) = hot.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!("hot token {t} is outside the vocabulary ({vocab})")));
        }
        if o.cluster_rows == 0 || o.cluster_rows > vocab {
            return Err(Error::InvalidArgument(format!(
                "rows per cluster must be in 1..={vocab}, got {}",
                o.cluster_rows
            )));
        }
        let k = vocab.div_ceil(o.cluster_rows);
        let rows = dequantized_rows(model)?;
        let mut unit = rows.clone();
        kmeans::normalize_rows(&mut unit, dim);
        let assign = kmeans::balanced_kmeans(pool, &unit, dim, k, o.iters, o.seed, progress)?;
        drop(unit);
        // Members grouped by cluster (a counting sort keeps rows ascending).
        let mut offsets = vec![0u32; k + 1];
        assign.iter().for_each(|&c| offsets[c as usize + 1] += 1);
        // Empty clusters are dropped (balanced k-means leaves none in practice).
        let mut keep: Vec<usize> = (0..k).filter(|&c| offsets[c + 1] > 0).collect();
        let mut remap = vec![u32::MAX; k];
        keep.iter().enumerate().for_each(|(i, &c)| remap[c] = i as u32);
        let k2 = keep.len();
        let mut offsets = vec![0u32; k2 + 1];
        assign.iter().for_each(|&c| offsets[remap[c as usize] as usize + 1] += 1);
        for c in 0..k2 {
            offsets[c + 1] += offsets[c];
        }
        let mut next = offsets.clone();
        let mut members = vec![0u32; vocab];
        let mut means = vec![0f32; k2 * dim];
        for (r, &c) in assign.iter().enumerate() {
            let c = remap[c as usize] as usize;
            members[next[c] as usize] = r as u32;
            next[c] += 1;
            means[c * dim..][..dim].iter_mut().zip(&rows[r * dim..][..dim]).for_each(|(m, x)| *m += x);
        }
        for c in 0..k2 {
            let n = (offsets[c + 1] - offsets[c]) as f32;
            means[c * dim..][..dim].iter_mut().for_each(|m| *m /= n);
        }
        keep.clear();
        let model_id = Self::model_of(model);
        Ok(Self {
            model: model_id,
            offsets,
            members,
            means,
            hot,
            rows: None,
            rows_sha256: None,
            iters: o.iters,
            seed: o.seed,
        })
    }

    /// Writes `model`'s head rows re-ordered by cluster beside the index
    /// that will be saved at `index_path` ([`rows_path`]); [`HeadIndex::save`]
    /// then names them and [`HeadIndex::load`] maps them, so each probed
    /// cluster is one contiguous read.
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

/// A [`HeadIndex`] bound to kernels for one model: what
/// [`Model::next_token_logits`] runs.
pub struct SparseHead {
    pub index: HeadIndex,
    /// The cluster-ordered copy of the head, when the index has one.
    pub rows: Option<Linear>,
    /// The cluster of each row (vocab).
    cluster_of: Vec<u32>,
    /// With the copy: each row's position in it (vocab), and the hot rows'
    /// positions, ascending.
    position_of: Vec<u32>,
    hot_positions: Vec<u32>,
    /// The cluster means as a Q8_0 matrix (clusters × dim).
    pub centroids: Linear,
    /// Clusters whose rows get exact logits, per token.
    pub probes: usize,
}

impl SparseHead {
    /// Binds `index` (checked against `model`'s head by the caller that
    /// loaded it) with `probes` clusters per token.
    pub fn new(
        model: &Model,
        index: HeadIndex,
        probes: usize,
        registry: &KernelRegistry,
        precision: Precision,
    ) -> Result<Self> {
        let (k, dim) = (index.clusters(), model.config.dim);
        if probes == 0 || probes > k {
            return Err(Error::InvalidArgument(format!("head probes must be in 1..={k} (its clusters), got {probes}")));
        }
        // The sha256 was checked when the index was read (HeadIndex::load)
        // or built from this model; the shape is checked again here.
        let m = &index.model;
        let out = &model.weights.output;
        if (m.vocab_size, m.dim, m.tensor.as_str(), m.tensor_type.as_str())
            != (model.config.vocab_size, dim, out.name.as_str(), out.desc.wtype.name())
        {
            return Err(Error::InvalidArgument(format!(
                "the head index was built for a {} x {} {} head ({}), not this model's {} x {} {} ({})",
                m.vocab_size,
                m.dim,
                m.tensor_type,
                m.tensor,
                model.config.vocab_size,
                dim,
                out.desc.wtype.name(),
                out.name
            )));
        }
        if !dim.is_multiple_of(32) {
            return Err(Error::InvalidArgument(format!(
                "the sparse head needs a hidden size divisible by 32, not {dim}"
            )));
        }
        let mut blocks = vec![BlockQ8_0::zeroed(); k * dim / 32];
        quantize_row_q8_0_ref(&index.means, &mut blocks)?;
        let q = bytemuck::cast_slice::<BlockQ8_0, u8>(&blocks).to_vec();
        let centroids =
            Linear::from_tensor(registry, precision, "head.centroids", GgmlType::Q8_0, TensorData::owned(q), k, dim)?;
        // The f32 means are not needed once quantised (10 MB for Gemma 3).
        let mut index = index;
        index.means = Vec::new();
        let mut cluster_of = vec![0u32; index.model.vocab_size];
        for c in 0..k {
            index.members(c).iter().for_each(|&r| cluster_of[r as usize] = c as u32);
        }
        let rows = match index.rows.take() {
            Some(data) => Some(Linear::from_tensor(
                registry,
                precision,
                "head.rows",
                out.desc.wtype,
                data,
                model.config.vocab_size,
                dim,
            )?),
            None => None,
        };
        let (mut position_of, mut hot_positions) = (Vec::new(), Vec::new());
        if rows.is_some() {
            position_of = vec![0u32; index.model.vocab_size];
            index.members.iter().enumerate().for_each(|(p, &r)| position_of[r as usize] = p as u32);
            hot_positions = index.hot.iter().map(|&r| position_of[r as usize]).collect();
            hot_positions.sort_unstable();
        }
        Ok(Self { index, rows, cluster_of, position_of, hot_positions, centroids, probes })
    }

    /// Row `token` of the head in the cluster-ordered copy (`None` without
    /// one): the same bytes as the model's row.
    pub(crate) fn row_bytes(&self, token: u32) -> Option<&[u8]> {
        let copy = self.rows.as_ref()?;
        let p = *self.position_of.get(token as usize)? as usize;
        let n = copy.weight_bytes() / self.position_of.len();
        Some(&copy.raw_weights()[p * n..(p + 1) * n])
    }

    /// Fraction of the vocabulary's rows read per token at `probes`, on
    /// average over clusters.
    pub fn row_fraction(&self) -> f64 {
        self.probes as f64 / self.index.clusters() as f64
    }
}

/// A session's buffers and counters for the sparse head.
#[derive(Default)]
pub struct HeadScratch {
    scores: Vec<f32>,
    order: Vec<u32>,
    /// One bit per row: computed exactly for this token.
    bits: Vec<u64>,

    rows: Vec<u32>,
    exact: Vec<f32>,
    /// Hot rows outside the probed clusters (positions in the copy).
    hot: Vec<u32>,
    hot_exact: Vec<f32>,
    pub stats: HeadStats,
}

/// What the sparse head did in a session.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HeadStats {
    /// Tokens whose logits came from the sparse head.
    pub tokens: u64,
    /// Head rows computed exactly, summed over those tokens.
    pub rows: u64,
    /// Head bytes read (rows plus cluster means), summed.
    pub bytes: u64,
}

impl SparseHead {
    /// [`SparseHead::logits`] with the cluster-ordered copy: each probed
    /// cluster one contiguous range of it, the hot rows outside them at
    /// their positions in it.
    #[allow(clippy::too_many_arguments, reason = "the buffers of one call")]
    fn logits_from_copy(
        &self,
        copy: &Linear,
        output: &Linear,
        pool: &ThreadPool,
        x: &[f32],
        logits: &mut [f32],
        hs: &mut HeadScratch,
        scratch: &mut Scratch,
    ) -> Result<()> {
        let k = self.index.clusters();
        let probed = &mut hs.order[..self.probes];
        probed.sort_unstable();
        hs.rows.clear();
        hs.bits.clear();
        hs.bits.resize(k.div_ceil(64), 0);
        for &c in probed.iter() {
            hs.rows.extend(self.index.offsets[c as usize]..self.index.offsets[c as usize + 1]);
            hs.bits[c as usize / 64] |= 1 << (c % 64);
        }
        // The hot rows outside the probed clusters, from the copy too (the
        // model file's head pages are never touched).
        let probed_has = |p: u32| {
            let c = self.cluster_of[self.index.members[p as usize] as usize] as usize;
            hs.bits[c / 64] & (1 << (c % 64)) != 0
        };
        hs.hot.clear();
        hs.hot.extend(self.hot_positions.iter().copied().filter(|&p| !probed_has(p)));
        let (n, hot) = (hs.rows.len(), &hs.hot);
        grow(&mut hs.exact, n);
        grow(&mut hs.hot_exact, hot.len());
        copy.forward_rows(pool, x, 1, &hs.rows, &mut hs.exact[..n], scratch)?;
        copy.forward_rows(pool, x, 1, hot, &mut hs.hot_exact[..hot.len()], scratch)?;
        let exact = hs.rows.iter().zip(&hs.exact[..n]).chain(hot.iter().zip(&hs.hot_exact[..hot.len()]));
        let exact = exact.map(|(&p, &v)| (self.index.members[p as usize], v));
        self.assemble(output, logits, &hs.scores[..k], exact, n + hot.len(), &mut hs.stats);
        Ok(())
    }

    /// Every row its cluster's score, then the `n` exact `(row, logit)`
    /// pairs over them; counts the token's work in `stats`.
    fn assemble(
        &self,
        output: &Linear,
        logits: &mut [f32],
        scores: &[f32],
        exact: impl Iterator<Item = (u32, f32)>,
        n: usize,
        stats: &mut HeadStats,
    ) {
        for (l, &c) in logits.iter_mut().zip(&self.cluster_of) {
            *l = scores[c as usize];
        }
        for (r, v) in exact {
            logits[r as usize] = v;
        }
        let row_bytes = output.weight_bytes() / self.index.model.vocab_size;
        stats.tokens += 1;
        stats.rows += n as u64;
        stats.bytes += (n * row_bytes + self.centroids.weight_bytes()) as u64;
    }

    /// The next-token logits of hidden state `x` (`dim`) into `logits`
    /// (`vocab`): exact for the rows of the best `probes` clusters, each
    /// other row its cluster's score (see the module docs).
    pub(crate) fn logits(
        &self,
        output: &Linear,
        pool: &ThreadPool,
        x: &[f32],
        logits: &mut [f32],
        hs: &mut HeadScratch,
        scratch: &mut Scratch,
    ) -> Result<()> {
        let k = self.index.clusters();
        grow(&mut hs.scores, k);
        self.centroids.forward(pool, x, 1, &mut hs.scores, scratch)?;
        let scores = &hs.scores[..k];
        // The best `probes` clusters.
        hs.order.clear();
        hs.order.extend(0..k as u32);
        let by_score = |a: &u32, b: &u32| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b));
        if self.probes < k {
            hs.order.select_nth_unstable_by(self.probes - 1, by_score);
        }
        if let Some(copy) = &self.rows {
            return self.logits_from_copy(copy, output, pool, x, logits, hs, scratch);
        }
        // The hot rows and the probed clusters' rows, ascending and once
        // each (a bitmap over the vocabulary, read word by word).
        let vocab = self.cluster_of.len();
        hs.bits.clear();
        hs.bits.resize(vocab.div_ceil(64), 0);
        let mut set = |r: u32| hs.bits[r as usize / 64] |= 1 << (r % 64);
        self.index.hot.iter().for_each(|&r| set(r));
        for &c in &hs.order[..self.probes] {
            self.index.members(c as usize).iter().for_each(|&r| set(r));
        }
        hs.rows.clear();
        for (w, &word) in hs.bits.iter().enumerate() {
            let mut b = word;
            while b != 0 {
                hs.rows.push((w * 64) as u32 + b.trailing_zeros());
                b &= b - 1;
            }
        }
        // Their exact logits, rows read in place.
        let n = hs.rows.len();
        grow(&mut hs.exact, n);
        output.forward_rows(pool, x, 1, &hs.rows, &mut hs.exact[..n], scratch)?;
        let exact = hs.rows.iter().copied().zip(hs.exact[..n].iter().copied());
        self.assemble(output, logits, &hs.scores[..k], exact, n, &mut hs.stats);
        Ok(())
    }
}
