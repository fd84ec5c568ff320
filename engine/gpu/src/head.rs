//! The sparse output head on the GPU (`spinfer_models::head`): per token
//! the cluster means are scored by a Q8_0 GEMV on the device, the clusters
//! ranked and the rows to compute chosen on the host by the CPU engine's
//! rule ([`HeadRule`]), those rows of the model's own head computed by the
//! gathered-row GEMV, and the stand-ins filled in on the host. Two small
//! copies come back per token (the cluster scores and the exact logits)
//! and the row list goes up; the head's other rows are never read.

use spinfer_formats::ModelConfig;
use spinfer_kernels_cuda::{CudaBackend, DeviceBuf, DeviceMatrix, DeviceRows, Slice, WeightFormat};
use spinfer_models::head::{HeadIndex, HeadRule, HeadScratch, HeadShape, HeadStats};

use crate::Result;
use crate::slices::{at, at_mut};

/// The head tensor of a model: `output.weight`, or the token embeddings
/// when tied.
pub(crate) fn head_tensor(c: &ModelConfig) -> &'static str {
    if c.tied_embeddings { "token_embd.weight" } else { "output.weight" }
}

/// A [`HeadIndex`] bound to a model on the device.
pub(crate) struct GpuHead {
    rule: HeadRule,
    centroids: DeviceMatrix, // (clusters, dim) Q8_0
}

/// A session's buffers for the sparse head.
pub(crate) struct HeadBufs {
    scores: DeviceBuf<f32>, // (clusters) the cluster means' logits
    rows: DeviceRows,       // the rows computed exactly this token (up to vocab)
    exact: DeviceBuf<f32>,  // their logits (vocab)
    host: HeadScratch,
    logits: Vec<f32>, // (vocab) what the sampler reads
}

impl GpuHead {
    /// Binds `index` to the head `shape` with `probes` clusters per token;
    /// the cluster means go to the device. The index's cluster-ordered
    /// copy of the head, if it has one, is dropped: the device reads the
    /// model's rows in place.
    pub(crate) fn new(be: &CudaBackend, shape: HeadShape<'_>, index: HeadIndex, probes: usize) -> Result<Self> {
        let k = index.clusters();
        let (mut rule, q8) = HeadRule::new(shape, index, probes)?;
        drop(rule.take_rows());
        let centroids = be.upload_matrix(WeightFormat::Q8_0, k, shape.dim, &q8)?;
        Ok(Self { rule, centroids })
    }

    /// Buffers for one session of a model of `vocab` rows.
    pub(crate) fn buffers(&self, be: &CudaBackend, vocab: usize) -> Result<HeadBufs> {
        Ok(HeadBufs {
            scores: be.alloc(self.rule.index.clusters())?,
            rows: be.upload_rows(&vec![0; vocab], vocab)?,
            exact: be.alloc(vocab)?,
            host: HeadScratch::default(),
            logits: vec![0.0; vocab],
        })
    }

    /// Bytes on the device: the cluster means.
    pub(crate) fn device_bytes(&self) -> usize {
        self.centroids.bytes()
    }

    /// The next-token logits of the final-normed hidden state `x` (`dim`)
    /// through `head` (`vocab × dim`): exact for the hot rows and the rows
    /// of the best clusters, stand-ins elsewhere (the CPU engine's rule).
    pub(crate) fn logits<'b>(
        &self,
        be: &CudaBackend,
        head: &DeviceMatrix,
        x: Slice<'_, f32>,
        b: &'b mut HeadBufs,
    ) -> Result<&'b [f32]> {
        let bytes = self.exact_rows(be, head, x, b)?;
        // Stand-ins for the rest, the exact logits over them.
        self.rule.fill(&mut b.host, false, &mut b.logits, bytes);
        Ok(&b.logits)
    }

    /// The greedy token of [`GpuHead::logits`]' vector, from the exact rows
    /// alone (no vector filled).
    pub(crate) fn greedy(
        &self,
        be: &CudaBackend,
        head: &DeviceMatrix,
        x: Slice<'_, f32>,
        b: &mut HeadBufs,
    ) -> Result<u32> {
        let bytes = self.exact_rows(be, head, x, b)?;
        Ok(self.rule.pick(&mut b.host, false, bytes))
    }

    /// Scores the cluster means on the device, ranks them and chooses the
    /// rows on the host, computes those rows of `head` on the device and
    /// brings their logits back (into `b.host`); the bytes read.
    fn exact_rows(&self, be: &CudaBackend, head: &DeviceMatrix, x: Slice<'_, f32>, b: &mut HeadBufs) -> Result<usize> {
        let k = self.rule.index.clusters();
        be.gemv_f32(&self.centroids, x, 1, None, b.scores.all_mut())?;
        be.download_to(b.scores.all(), b.host.scores_mut(k))?;
        self.rule.select(&mut b.host, false);
        be.write_rows(&mut b.rows, b.host.rows())?;
        let n = b.rows.len();
        be.gemv_f32(head, x, 1, Some(&b.rows), at_mut(&mut b.exact, "exact", 0, n)?)?;
        be.download_to(at(&b.exact, "exact", 0, n)?, b.host.exact_mut())?;
        Ok(n * head.bytes() / head.shape().0 + self.centroids.bytes())
    }
}

impl HeadBufs {
    /// Whether these buffers were made for `head` (its cluster count).
    pub(crate) fn fits(&self, head: &GpuHead) -> bool {
        self.scores.len() == head.rule.index.clusters()
    }

    /// What the sparse head did in this session.
    pub(crate) fn stats(&self) -> HeadStats {
        self.host.stats
    }
}
