//! The input of a block's projections when the residual add and RMSNorm
//! before them are fused into their GEMVs (`Prologue::AddNorm`).

use spinfer_kernels_cuda::{CudaBackend, DeviceBuf, DeviceMatrix, Prologue, SliceMut};

use crate::Result;
use crate::slices::{at, at_mut};

/// The input of a block's projections: `xn` (normalised), or with `norm`
/// the residual stream `cur` plus the last block output `delta` (first
/// normalised by `post`, Gemma's post-norm, when set), normalised in the
/// GEMV's staging, the sum written to `other` (the stream's next buffer).
pub(crate) struct Input<'a> {
    pub xn: &'a DeviceBuf<f32>,
    pub cur: &'a DeviceBuf<f32>,
    pub other: &'a mut DeviceBuf<f32>,
    pub delta: &'a DeviceBuf<f32>,
    pub norm: Option<&'a DeviceBuf<f32>>,
    pub post: Option<&'a DeviceBuf<f32>>,
    pub eps: f32,
    pub len: usize, // tokens x dim
}

impl Input<'_> {
    /// `y = m · input` for `n` tokens.
    pub(crate) fn project(&mut self, be: &CudaBackend, m: &DeviceMatrix, n: usize, y: SliceMut<'_, f32>) -> Result<()> {
        let len = self.len;
        let Some(norm) = self.norm else {
            return Ok(be.gemv_f32(m, at(self.xn, "xn", 0, len)?, n, None, y)?);
        };
        let prologue = Prologue::AddNorm {
            delta: at(self.delta, "tmp", 0, len)?,
            post: self.post.map(DeviceBuf::all),
            weight: norm.all(),
            eps: self.eps,
            residual_out: at_mut(self.other, "x", 0, len)?,
        };
        Ok(be.gemv_fused(m, at(self.cur, "x", 0, len)?, len / n, n, prologue, y)?)
    }

    /// Whether the residual stream moved to the other buffer.
    pub(crate) fn flips(&self) -> bool {
        self.norm.is_some()
    }
}
