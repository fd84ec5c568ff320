//! GEMVs with the step before them fused into their staging of x: the
//! gated activation before the down projection, the residual add and
//! RMSNorm before the next block's projections. A decode step then launches
//! three kernels fewer per layer, the same arithmetic (`gemv.cu`,
//! `PRO_*`).

use crate::backend::{FusedArgs, shape_err};
use crate::buffers::{DeviceMatrix, Slice, SliceMut};
use crate::{ActType, CudaBackend, GEMV_BATCHES, Result};

/// The gated activation of a fused down projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GluAct {
    /// `silu(gate) * up`.
    Silu,
    /// `gelu_tanh(gate) * up`.
    GeluTanh,
}

/// The step a fused GEMV takes into its staging of `x`.
pub enum Prologue<'a> {
    /// `act(x) * up`: `x` holds the gate rows, `up` the up rows (same
    /// stride).
    Glu { up: Slice<'a, f32>, act: GluAct },
    /// `r = x + delta` (the residual add), staged as `r / rms(r) * weight`
    /// (the RMSNorm, `weight` of the matrix's columns); `r` is also written
    /// to `residual_out` (same stride as `x`; another buffer). With `post`
    /// (Gemma's post-norms), `delta` is first normalised by its own RMSNorm
    /// with those weights: `r = x + delta / rms(delta) * post`.
    AddNorm {
        delta: Slice<'a, f32>,
        post: Option<Slice<'a, f32>>,
        weight: Slice<'a, f32>,
        eps: f32,
        residual_out: SliceMut<'a, f32>,
    },
}

impl CudaBackend {
    /// `y[t] = W · p(x[t])` for `tokens` tokens (at most the largest of
    /// [`GEMV_BATCHES`]), `p` the [`Prologue`]: token `t`'s activations at
    /// `x[t * x_stride..][..cols]`, its outputs at `y[t * rows..][..rows]`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] naming the operand that is too short, a
    /// stride below the columns, or too many tokens; driver and compile
    /// errors.
    pub fn gemv_fused(
        &self,
        w: &DeviceMatrix,
        x: Slice<'_, f32>,
        x_stride: usize,
        tokens: usize,
        prologue: Prologue<'_>,
        y: SliceMut<'_, f32>,
    ) -> Result<()> {
        let max = GEMV_BATCHES[GEMV_BATCHES.len() - 1];
        if tokens == 0 || tokens > max || x_stride < w.cols {
            return Err(shape_err(
                "gemv_fused",
                format!("{tokens} tokens (1..={max}) at a stride of {x_stride} for {} columns", w.cols),
            ));
        }
        // Values a token-strided operand must hold.
        let need = (tokens - 1) * x_stride + w.cols;
        let short = |what: &str, len: usize| {
            (len < need).then(|| {
                shape_err("gemv_fused", format!("{what} holds {len} values, {tokens} tokens at {x_stride} need {need}"))
            })
        };
        if let Some(e) = short("x", x.len) {
            return Err(e);
        }
        if y.len < tokens * w.rows {
            return Err(shape_err("gemv_fused", format!("{tokens} x {} outputs into {} values", w.rows, y.len)));
        }
        let args = match prologue {
            Prologue::Glu { up, act } => {
                if let Some(e) = short("up", up.len) {
                    return Err(e);
                }
                let mode = match act {
                    GluAct::Silu => 1,
                    GluAct::GeluTanh => 2,
                };
                FusedArgs { mode, aux: self.ptr(up.buf, up.offset), nw: 0, eps: 0.0, x_out: 0, pw: 0 }
            }
            Prologue::AddNorm { delta, post, weight, eps, residual_out } => {
                if let Some(e) = short("delta", delta.len).or_else(|| short("residual_out", residual_out.len)) {
                    return Err(e);
                }
                if weight.len != w.cols || post.is_some_and(|p| p.len != w.cols) {
                    return Err(shape_err(
                        "gemv_fused",
                        format!(
                            "norm weight of {} (post-norm {:?}) for {} columns",
                            weight.len,
                            post.map(|p| p.len),
                            w.cols
                        ),
                    ));
                }
                FusedArgs {
                    mode: if post.is_some() { 4 } else { 3 },
                    pw: post.map_or(0, |p| self.ptr(p.buf, p.offset)),
                    aux: self.ptr(delta.buf, delta.offset),
                    nw: self.ptr(weight.buf, weight.offset),
                    eps,
                    x_out: self.ptr(residual_out.buf, residual_out.offset),
                }
            }
        };
        let (x_ptr, y_ptr) = (self.ptr(x.buf, x.offset), self.ptr(y.buf, y.offset));
        self.gemv_launches(w, ActType::F32, x_ptr, x_stride, tokens, 0, w.rows, y_ptr, Some(&args))
    }
}
