//! Logits out of the GPU model: rows of them from the dense head, one row
//! for the sampler (from the sparse head when one is set), or only the
//! greedy token, picked on the device.

use spinfer_formats::Loader;
use spinfer_models::head::{HeadIndex, HeadModel, HeadShape, HeadStats};

use spinfer_kernels_cuda::{CudaBackend, DeviceMatrix, Slice};

use crate::head::{GpuHead, HeadBufs, head_tensor};
use crate::slices::{at, at_mut};
use crate::{GpuError, GpuModel, GpuSession, Result};

impl GpuModel {
    /// Logits of tokens `rows` (indices into the last `forward` call's
    /// tokens), `rows.len() x vocab`, row-major, copied to the host; always
    /// the dense head's.
    ///
    /// # Errors
    ///
    /// Rows outside the last call's tokens; device errors.
    pub fn logits(&self, s: &mut GpuSession, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        self.logits_into(s, rows, &mut out)?;
        Ok(out)
    }

    /// [`GpuModel::logits`] into `out` (resized), reusing its allocation.
    ///
    /// # Errors
    ///
    /// As [`GpuModel::logits`].
    pub fn logits_into(&self, s: &mut GpuSession, rows: std::ops::Range<usize>, out: &mut Vec<f32>) -> Result<()> {
        let (dim, vocab) = (self.config.dim, self.config.vocab_size);
        if rows.is_empty() || rows.end > s.last_tokens {
            return Err(GpuError::InvalidArgument(format!(
                "logits of rows {rows:?}: the last forward call ran {} tokens",
                s.last_tokens
            )));
        }
        let n = rows.len();
        if s.logits.len() < n * vocab {
            s.logits = self.be.alloc(n * vocab)?;
        }
        let head = self.output.as_ref().unwrap_or(&self.token_embd);
        let x = at(&s.hidden, "hidden", rows.start * dim, n * dim)?;
        self.be.gemv_f32(head, x, n, None, at_mut(&mut s.logits, "logits", 0, n * vocab)?)?;
        Ok(self.be.download_slice_into(at(&s.logits, "logits", 0, n * vocab)?, out)?)
    }

    /// The logits of token `row` of the last `forward` call for choosing
    /// the next token: the sparse head's when one is set (exact for its
    /// probed rows, as the CPU engine's), else the dense head's copied into
    /// the session's page-locked host buffer (no allocation, no second
    /// host copy).
    ///
    /// # Errors
    ///
    /// A row outside the last call's tokens; device errors.
    pub fn row_logits<'s>(&self, s: &'s mut GpuSession, row: usize) -> Result<&'s [f32]> {
        self.through_head(
            s,
            row,
            |h, head, x, bufs| h.logits(&self.be, head, x, bufs),
            |s| {
                let GpuSession { logits, host_logits, .. } = s;
                Ok(self.be.download_to_host(at(logits, "logits", 0, self.config.vocab_size)?, host_logits)?)
            },
        )
    }

    /// The greedy next token after token `row` of the last `forward` call:
    /// what the sampler picks at temperature 0 from [`GpuModel::row_logits`]
    /// (the first largest logit), with the dense head picked on the device
    /// so that 4 bytes come back instead of the logits.
    ///
    /// # Errors
    ///
    /// As [`GpuModel::row_logits`].
    pub fn greedy_token(&self, s: &mut GpuSession, row: usize) -> Result<u32> {
        self.through_head(
            s,
            row,
            |h, head, x, bufs| h.greedy(&self.be, head, x, bufs),
            |s| {
                self.be.argmax(at(&s.logits, "logits", 0, self.config.vocab_size)?, s.best.all_mut())?;
                let mut best = [0i32];
                let first = s.best.at(0, 1).ok_or_else(|| GpuError::InvalidArgument("no arg-max buffer".into()))?;
                self.be.download_to(first, &mut best)?;
                u32::try_from(best[0])
                    .map_err(|_| GpuError::InvalidArgument(format!("arg-max {} from the device", best[0])))
            },
        )
    }

    /// Token `row`'s final hidden state through the head for the next
    /// token: `sparse` with the sparse head and the session's buffers for
    /// it, when one is set; else the dense head's row of logits computed
    /// into `s.logits`, then `dense`.
    fn through_head<'s, T>(
        &self,
        s: &'s mut GpuSession,
        row: usize,
        sparse: impl FnOnce(&GpuHead, &DeviceMatrix, Slice<'_, f32>, &'s mut HeadBufs) -> Result<T>,
        dense: impl FnOnce(&'s mut GpuSession) -> Result<T>,
    ) -> Result<T> {
        let (dim, vocab) = (self.config.dim, self.config.vocab_size);
        self.check_row(s, row)?;
        let head = self.output.as_ref().unwrap_or(&self.token_embd);
        if let Some(h) = &self.head {
            let GpuSession { hidden, head: slot, .. } = s;
            let x = at(hidden, "hidden", row * dim, dim)?;
            return sparse(h, head, x, Self::head_bufs(&self.be, h, slot, vocab)?);
        }
        let x = at(&s.hidden, "hidden", row * dim, dim)?;
        self.be.gemv_f32(head, x, 1, None, at_mut(&mut s.logits, "logits", 0, vocab)?)?;
        dense(s)
    }

    /// The session's buffers for sparse head `h`, made on first use (or
    /// for another index).
    fn head_bufs<'b>(
        be: &CudaBackend,
        h: &GpuHead,
        slot: &'b mut Option<HeadBufs>,
        vocab: usize,
    ) -> Result<&'b mut HeadBufs> {
        if !slot.as_ref().is_some_and(|b| b.fits(h)) {
            *slot = Some(h.buffers(be, vocab)?);
        }
        slot.as_mut().ok_or_else(|| GpuError::InvalidArgument("no sparse head buffers".into()))
    }

    fn check_row(&self, s: &GpuSession, row: usize) -> Result<()> {
        if row >= s.last_tokens {
            return Err(GpuError::InvalidArgument(format!(
                "logits of row {row}: the last forward call ran {} tokens",
                s.last_tokens
            )));
        }
        Ok(())
    }

    /// Runs `tokens` and returns the (dense) logits of the last one.
    ///
    /// # Errors
    ///
    /// As [`GpuModel::forward`].
    pub fn forward_last(&self, s: &mut GpuSession, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward(s, tokens)?;
        self.logits(s, tokens.len() - 1..tokens.len())
    }

    /// Which head the model `loader` reads has, as a head index names it
    /// (shape, tensor, sha256 of its bytes): what [`HeadIndex::load`]
    /// checks an index against before [`GpuModel::set_sparse_head`].
    ///
    /// # Errors
    ///
    /// The model's metadata or head tensor cannot be read.
    pub fn head_model(loader: &dyn Loader) -> Result<HeadModel> {
        let c = loader.config()?;
        let t = loader.tensor(head_tensor(&c))?;
        Ok(HeadModel::of_tensor(&c, &t.name, t.ty.name(), &t.data))
    }

    /// Uses `index` as the sparse output head of [`GpuModel::row_logits`]
    /// and [`GpuModel::greedy_token`], with `probes` clusters per token
    /// (`None`: back to the dense head). [`GpuModel::logits`] stays dense.
    ///
    /// # Errors
    ///
    /// An index of another head (shape, tensor or type), a probe count
    /// outside 1..=its clusters; device errors.
    pub fn set_sparse_head(&mut self, index: Option<HeadIndex>, probes: usize) -> Result<()> {
        self.head = None;
        let Some(index) = index else { return Ok(()) };
        let c = &self.config;
        let shape =
            HeadShape { vocab: c.vocab_size, dim: c.dim, tensor: head_tensor(c), tensor_type: self.head_type.name() };
        self.head = Some(GpuHead::new(&self.be, shape, index, probes)?);
        Ok(())
    }
}

impl GpuSession {
    /// What the sparse head did in this session (zero without one).
    pub fn head_stats(&self) -> HeadStats {
        self.head.as_ref().map_or_else(HeadStats::default, |h| h.stats())
    }
}
