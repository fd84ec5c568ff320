//! The transformer steps besides the products, on f32 activations already
//! on the device (`src/cu/ops.cu`): RMSNorm, RoPE, attention over a KV
//! cache, the gated activations, residual adds and the embedding lookup.

use crate::backend::{Grid, KArg, Module, int, shape_err};
use crate::buffers::{DeviceMatrix, DeviceRows, Slice, SliceMut};
use crate::{CudaBackend, Result};

/// Most positions one attention launch covers: its scores live in shared
/// memory (48 KiB, less the query and the reductions).
pub const MAX_ATTENTION_POSITIONS: usize = 11_776;

fn elementwise(n: usize) -> Result<Grid> {
    Ok(Grid { blocks: (int(n.div_ceil(256), "elements")? as u32, 1), threads: 256, smem: 0 })
}

/// How RoPE pairs a head's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairs {
    /// `(2i, 2i + 1)`: GGUF Llama (its q/k weights are permuted for it).
    Adjacent,
    /// `(i, i + d/2)`: NeoX, Qwen2, Gemma.
    Halves,
}

/// One attention launch: `n` new tokens at positions `pos0..pos0 + n`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub pos0: usize,
    /// Positions a token attends to, itself included (0: all).
    pub window: usize,
    pub scale: f32,
}

impl CudaBackend {
    fn ptr_of(&self, s: &Slice<'_, f32>) -> u64 {
        self.ptr(s.buf, s.offset)
    }

    fn ptr_mut(&self, s: &SliceMut<'_, f32>) -> u64 {
        self.ptr(s.buf, s.offset)
    }

    /// `out[r] = x[r] / rms(x[r]) * w` for each row of `w.len()` values.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] unless `x` and `out` hold the same whole rows.
    pub fn rms_norm(&self, x: Slice<'_, f32>, w: Slice<'_, f32>, eps: f32, out: SliceMut<'_, f32>) -> Result<()> {
        if w.len == 0 || x.len != out.len || !x.len.is_multiple_of(w.len) {
            return Err(shape_err("rms_norm", format!("{} values into {} in rows of {}", x.len, out.len, w.len)));
        }
        self.rms_norm_ptrs(self.ptr_of(&x), w, eps, self.ptr_mut(&out), x.len)
    }

    /// [`CudaBackend::rms_norm`] in place (Gemma's per-head q/k norms).
    ///
    /// # Errors
    ///
    /// As [`CudaBackend::rms_norm`].
    pub fn rms_norm_in_place(&self, x: SliceMut<'_, f32>, w: Slice<'_, f32>, eps: f32) -> Result<()> {
        if w.len == 0 || !x.len.is_multiple_of(w.len) {
            return Err(shape_err("rms_norm", format!("{} values in rows of {}", x.len, w.len)));
        }
        let p = self.ptr_mut(&x);
        self.rms_norm_ptrs(p, w, eps, p, x.len)
    }

    fn rms_norm_ptrs(&self, x: u64, w: Slice<'_, f32>, eps: f32, out: u64, len: usize) -> Result<()> {
        let rows = len / w.len;
        if rows == 0 {
            return Ok(());
        }
        let args = [KArg::Ptr(x), KArg::Ptr(self.ptr_of(&w)), KArg::F32(eps), KArg::I32(int(w.len, "dim")?), KArg::Ptr(out)];
        let grid = Grid { blocks: (int(rows, "rows")? as u32, 1), threads: 256, smem: 0 };
        // SAFETY: follows rms_norm(x, w, eps, dim, out); x and out hold
        // `rows` rows of `dim` (checked by the callers), w holds `dim`.
        unsafe { self.inner.launch(Module::Ops, "rms_norm", grid, &args) }
    }

    /// RoPE in place on `tokens` rows of `heads` heads of `head_dim` values
    /// (rows `stride` apart), token `t` at position `pos0 + t`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] when the rows do not fit in `x`.
    #[allow(clippy::too_many_arguments, reason = "the shape of the rotated rows; each is a plain count")]
    pub fn rope(
        &self,
        x: SliceMut<'_, f32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
        stride: usize,
        pos0: usize,
        theta: f32,
        pairs: RopePairs,
    ) -> Result<()> {
        let need = tokens.saturating_sub(1) * stride + heads * head_dim;
        if head_dim % 2 != 0 || stride < heads * head_dim || x.len < need {
            return Err(shape_err("rope", format!("{tokens} x {heads} heads of {head_dim} (stride {stride}) in {} values", x.len)));
        }
        let pairs_total = tokens * heads * head_dim / 2;
        if pairs_total == 0 {
            return Ok(());
        }
        let args = [
            KArg::Ptr(self.ptr_mut(&x)),
            KArg::I32(int(tokens, "tokens")?),
            KArg::I32(int(heads, "heads")?),
            KArg::I32(int(head_dim, "head_dim")?),
            KArg::I64(stride as i64),
            KArg::I32(int(pos0, "position")?),
            KArg::F32(theta),
            KArg::I32(i32::from(pairs == RopePairs::Halves)),
        ];
        // SAFETY: follows rope(x, n, heads, hd, stride, pos0, theta, neox);
        // every (token, head, pair) it touches lies within `x` (checked).
        unsafe { self.inner.launch(Module::Ops, "rope", elementwise(pairs_total)?, &args) }
    }

    /// Causal attention of `a.tokens` queries (`q`: tokens × heads ×
    /// head_dim) over this layer's cache (`keys`, `values`: at least
    /// `pos0 + tokens` rows of kv_heads × head_dim) into `out` (like `q`).
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] on mismatched lengths or more than
    /// [`MAX_ATTENTION_POSITIONS`] positions.
    pub fn attention(
        &self,
        q: Slice<'_, f32>,
        keys: Slice<'_, f32>,
        values: Slice<'_, f32>,
        a: AttentionShape,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        let (q_dim, kv_dim, end) = (a.heads * a.head_dim, a.kv_heads * a.head_dim, a.pos0 + a.tokens);
        if a.kv_heads == 0
            || !a.heads.is_multiple_of(a.kv_heads)
            || q.len < a.tokens * q_dim
            || out.len < a.tokens * q_dim
            || keys.len < end * kv_dim
            || values.len < end * kv_dim
            || a.head_dim > 256
        {
            return Err(shape_err("attention", format!("{a:?} with q {}, cache {}/{}, out {}", q.len, keys.len, values.len, out.len)));
        }
        if end > MAX_ATTENTION_POSITIONS {
            return Err(shape_err(
                "attention",
                format!("{end} positions: the CUDA attention kernel handles at most {MAX_ATTENTION_POSITIONS} (lower --ctx)"),
            ));
        }
        let smem = int((a.head_dim + 32 + end) * 4, "shared memory")? as u32;
        let args = [
            KArg::Ptr(self.ptr_of(&q)),
            KArg::Ptr(self.ptr_of(&keys)),
            KArg::Ptr(self.ptr_of(&values)),
            KArg::Ptr(self.ptr_mut(&out)),
            KArg::I32(int(a.heads, "heads")?),
            KArg::I32(int(a.kv_heads, "kv_heads")?),
            KArg::I32(int(a.head_dim, "head_dim")?),
            KArg::I32(int(a.pos0, "position")?),
            KArg::I32(int(a.window, "window")?),
            KArg::F32(a.scale),
        ];
        let grid = Grid { blocks: (int(a.tokens * a.heads, "blocks")? as u32, 1), threads: 128, smem };
        // SAFETY: follows attention(q, kc, vc, out, heads, kv_heads, hd,
        // pos0, window, scale); q/out hold tokens x heads x hd, the caches
        // pos0 + tokens rows (checked); the shared memory holds the query,
        // the reductions and every position's score.
        unsafe { self.inner.launch(Module::Ops, "attention", grid, &args) }
    }

    fn gated(&self, kernel: &str, gate: SliceMut<'_, f32>, up: Slice<'_, f32>) -> Result<()> {
        if gate.len != up.len {
            return Err(shape_err("gated activation", format!("gate of {} and up of {}", gate.len, up.len)));
        }
        let n = int(gate.len, "elements")?;
        let args = [KArg::Ptr(self.ptr_mut(&gate)), KArg::Ptr(self.ptr_of(&up)), KArg::I32(n)];
        // SAFETY: follows swiglu/geglu/add(x, y, n): both hold n values.
        unsafe { self.inner.launch(Module::Ops, kernel, elementwise(gate.len)?, &args) }
    }

    /// `gate = silu(gate) * up`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] on different lengths.
    pub fn swiglu(&self, gate: SliceMut<'_, f32>, up: Slice<'_, f32>) -> Result<()> {
        self.gated("swiglu", gate, up)
    }

    /// `gate = gelu_tanh(gate) * up`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] on different lengths.
    pub fn geglu(&self, gate: SliceMut<'_, f32>, up: Slice<'_, f32>) -> Result<()> {
        self.gated("geglu", gate, up)
    }

    /// `x += y`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] on different lengths.
    pub fn add(&self, x: SliceMut<'_, f32>, y: Slice<'_, f32>) -> Result<()> {
        self.gated("add", x, y)
    }

    /// `out[t] = s · W[ids[t]]` (the embedding lookup), `out` holding
    /// `ids.len()` rows of `cols`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] on mismatched lengths or indices.
    pub fn embed_rows(&self, w: &DeviceMatrix, ids: &DeviceRows, s: f32, out: SliceMut<'_, f32>) -> Result<()> {
        let n = ids.len();
        if ids.bound > w.rows || out.len != n * w.cols {
            return Err(shape_err("embed_rows", format!("{n} rows of {} (indices below {}) into {}", w.cols, ids.bound, out.len)));
        }
        if n == 0 {
            return Ok(());
        }
        let args = [
            KArg::Ptr(self.ptr(&w.buf, 0)),
            KArg::I64(w.row_bytes as i64),
            KArg::I32(int(w.cols, "cols")?),
            KArg::Ptr(self.ptr(&ids.buf, 0)),
            KArg::I32(int(n, "rows")?),
            KArg::F32(s),
            KArg::Ptr(self.ptr_mut(&out)),
        ];
        let name = format!("dequant_rows_{}", w.format.name());
        // SAFETY: follows dequant_rows_*(w, row_bytes, cols, ids, n, s,
        // out); every index is below the matrix's rows, out holds n rows.
        unsafe { self.inner.launch(Module::Format(w.format), &name, elementwise(n * w.cols / 32)?, &args) }
    }
}
