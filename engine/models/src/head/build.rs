//! Building a head index from a loaded model: its calibration (hot rows,
//! the hidden states' metric), the clustering, the hash that names the
//! head, the cluster-ordered copy of its rows. Kept apart from the index
//! the model runs with, so the model's code does not depend on this.

use sha2::{Digest, Sha256};
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::pool::ThreadPool;

use super::{
    HeadBuildOptions, HeadCalibration, HeadIndex, HeadModel, HiddenMoment, frequent_tokens, kmeans, rows, rows_path,
};
use crate::model::{Model, ModelConfig, Session};
use crate::{Error, Result};
use spinfer_formats::tensor::TensorData;

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

impl HeadModel {
    /// The head tensor `tensor` (GGML type `tensor_type`, bytes `data`)
    /// of a model with hyper-parameters `config`, as an index names it.
    /// Bytes borrowed from the file mapping have their pages released as
    /// they are hashed (re-read when touched).
    pub fn of_tensor(config: &ModelConfig, tensor: &str, tensor_type: &str, data: &TensorData) -> Self {
        // Hashed in slices of 8 MiB, each released after (the peak
        // resident set grows by one slice, not the whole head).
        let mut hasher = Sha256::new();
        for part in data.bytes().chunks(8 << 20) {
            hasher.update(part);
            if data.is_mapped() {
                // SAFETY: `is_mapped`: the bytes borrow the model's
                // read-only file mapping.
                unsafe { spinfer_formats::tensor::release_pages(part) };
            }
        }
        let digest = hasher.finalize();
        Self {
            arch: format!("{:?}", config.arch).to_lowercase(),
            vocab_size: config.vocab_size,
            dim: config.dim,
            tensor: tensor.to_string(),
            tensor_type: tensor_type.to_string(),
            sha256: digest.iter().map(|b| format!("{b:02x}")).collect(),
        }
    }
}

impl HeadIndex {
    /// Which head `model` has: its shape, tensor and the sha256 of its
    /// bytes. Reading them all for the hash would leave the whole head in
    /// the resident set, which a sparse head exists to avoid: a mapped
    /// head's pages are released as they are hashed (re-read when touched).
    pub fn model_of(model: &Model) -> HeadModel {
        let out = &model.weights.output;
        HeadModel::of_tensor(&model.config, &out.name, out.desc.wtype.name(), &out.w)
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
        self.rows_sha256 = Some({
            let out = &model.weights.output;
            let row_bytes = out.desc.wtype.row_bytes(model.config.dim)?;
            rows::write(out.raw_weights(), row_bytes, self, &rows_path(index_path))?
        });
        Ok(())
    }
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
