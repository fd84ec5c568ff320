//! The transformer steps besides the products, on f32 activations already
//! on the device (`src/cu/ops.cu`): RMSNorm (alone or fused with the
//! residual add), RoPE fused with the KV-cache append, attention over the
//! cache, the gated activations, residual adds and the embedding lookup.
//! Positions can come from device memory ([`Position::Device`]) so that a
//! decode step captured as a graph replays at any position.

use crate::backend::{Grid, KArg, Module, int, shape_err};
use crate::buffers::{DeviceBuf, DeviceMatrix, DeviceRows, Slice, SliceMut};
use crate::{CudaBackend, Result};

/// Most positions one attention launch covers: its scores live in shared
/// memory (48 KiB, less the query, the reductions and the partial sums).
pub const MAX_ATTENTION_POSITIONS: usize = 11_520;

/// Most blocks the arg-max's first pass runs, and threads per block.
const ARGMAX_BLOCKS: usize = 256;
const ARGMAX_THREADS: u32 = 256;

/// Values [`CudaBackend::argmax`]'s output holds: the result and the
/// blocks' (value, index) pairs.
pub const ARGMAX_SCRATCH: usize = 1 + 2 * ARGMAX_BLOCKS;

/// Threads per attention block (`ATT_THREADS` in ops.cu).
const ATT_THREADS: usize = 256;

/// Most tokens the decode attention kernel takes in one launch (more run
/// the prompt kernel).
pub const DECODE_TOKENS: usize = 8;

/// Threads per decode attention block (`DEC_WARPS` warps in ops.cu).
const DECODE_THREADS: u32 = 256;

/// Positions per split the decode attention aims at, and the most splits.
const DECODE_CHUNK: usize = 256;
const MAX_SPLITS: usize = 16;

/// Scratch of the decode attention's splits: each split's running softmax
/// (max, sum, hd weighted values) and, per (token, head), a counter of the
/// splits done, which the last one sets back to 0. Owned by a session:
/// launches that share it must run in order (one stream).
pub struct AttentionScratch {
    part: DeviceBuf<f32>,  // (rows, head_dim + 2)
    count: DeviceBuf<i32>, // (tokens x heads), 0 between launches
    rows: usize,
    heads: usize,
    head_dim: usize,
}

impl AttentionScratch {
    /// Splits per (token, head) it holds for `tokens` tokens of `heads`
    /// heads of `head_dim` (0: another shape).
    fn splits(&self, tokens: usize, heads: usize, head_dim: usize) -> usize {
        let fits = heads == self.heads && head_dim <= self.head_dim && tokens * heads <= self.count.len();
        if fits { (self.rows * (self.head_dim + 2) / (tokens * heads * (head_dim + 2))).min(MAX_SPLITS) } else { 0 }
    }
}

fn elementwise(n: usize) -> Result<Grid> {
    Ok(Grid { blocks: (int(n.div_ceil(256), "elements")? as u32, 1), threads: 256, smem: 0 })
}

/// Where the first new token's position comes from.
#[derive(Clone, Copy)]
pub enum Position<'a> {
    /// A value known when the kernel is launched.
    Value(usize),
    /// Read by the kernel from `buf[0]` (so a captured graph replays at
    /// any position). The writer keeps `buf[0] + tokens <= bound + tokens`,
    /// i.e. `buf[0] <= bound`: buffers and shared memory are sized for
    /// `bound`.
    Device { buf: &'a DeviceBuf<i32>, bound: usize },
}

impl Position<'_> {
    fn bound(&self) -> usize {
        match *self {
            Position::Value(p) => p,
            Position::Device { bound, .. } => bound,
        }
    }

    fn value(&self) -> usize {
        match *self {
            Position::Value(p) => p,
            Position::Device { .. } => 0,
        }
    }

    fn device_ptr(&self, be: &CudaBackend) -> u64 {
        match *self {
            Position::Value(_) => 0,
            Position::Device { buf, .. } => be.ptr(buf, 0),
        }
    }
}

impl std::fmt::Debug for Position<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Position::Value(p) => write!(f, "{p}"),
            Position::Device { bound, .. } => write!(f, "device (<= {bound})"),
        }
    }
}

/// The projected q, k and v rows a [`CudaBackend::rope_append`] reads:
/// each a slice and its row stride.
#[derive(Clone, Copy)]
pub struct QkvRows<'a> {
    pub q: (Slice<'a, f32>, usize),
    pub k: (Slice<'a, f32>, usize),
    pub v: (Slice<'a, f32>, usize),
}

/// One layer's KV cache: rows of kv_heads × head_dim, row p = position p.
pub struct KvCache<'a> {
    pub keys: SliceMut<'a, f32>,
    pub values: SliceMut<'a, f32>,
}

/// The shape of a [`CudaBackend::rope_append`].
#[derive(Clone, Copy, Debug)]
pub struct RopeShape<'a> {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub pos: Position<'a>,
    pub theta: f32,
    pub pairs: RopePairs,
    /// Gemma's QK-norm: each query and key head RMS-normalised with these
    /// weights (head_dim each) before RoPE.
    pub norms: Option<QkNorm<'a>>,
}

/// The per-head RMSNorm weights of queries and keys, and its epsilon.
#[derive(Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: Slice<'a, f32>,
    pub k: Slice<'a, f32>,
    pub eps: f32,
}

impl std::fmt::Debug for QkNorm<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QkNorm {{ q: {}, k: {}, eps: {} }}", self.q.len, self.k.len, self.eps)
    }
}

/// How RoPE pairs a head's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairs {
    /// `(2i, 2i + 1)`: GGUF Llama (its q/k weights are permuted for it).
    Adjacent,
    /// `(i, i + d/2)`: NeoX, Qwen2, Gemma.
    Halves,
}

/// One attention launch: `tokens` new tokens from position `pos`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape<'a> {
    pub tokens: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub pos: Position<'a>,
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
        let args =
            [KArg::Ptr(x), KArg::Ptr(self.ptr_of(&w)), KArg::F32(eps), KArg::I32(int(w.len, "dim")?), KArg::Ptr(out)];
        let grid = Grid { blocks: (int(rows, "rows")? as u32, 1), threads: 256, smem: 0 };
        // SAFETY: follows rms_norm(x, w, eps, dim, out); x and out hold
        // `rows` rows of `dim` (checked by the callers), w holds `dim`.
        unsafe { self.inner.launch(Module::Ops, "rms_norm", grid, &args) }
    }

    /// The step after the Q/K/V projections, for `r.tokens` tokens: RoPE
    /// on the queries (`q`, rows `q_stride` apart) into `q_out` (rows of
    /// heads × head_dim), RoPE on the keys (`k`, rows `k_stride` apart)
    /// into the key cache at their positions, and the values (`v`, rows
    /// `v_stride` apart) copied into the value cache.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] when a row or a cache position falls
    /// outside its buffer.
    pub fn rope_append(
        &self,
        src: QkvRows<'_>,
        r: RopeShape<'_>,
        q_out: SliceMut<'_, f32>,
        cache: KvCache<'_>,
    ) -> Result<()> {
        let (hd, n) = (r.head_dim, r.tokens);
        let (q_dim, kv_dim) = (r.heads * hd, r.kv_heads * hd);
        let rows_fit =
            |s: &Slice<'_, f32>, stride: usize, width: usize| stride >= width && s.len >= (n - 1) * stride + width;
        let norms_fit = r.norms.is_none_or(|w| w.q.len == hd && w.k.len == hd);
        if n == 0 || hd % 2 != 0 || hd > 2048 || r.heads == 0 || r.kv_heads == 0 || !norms_fit {
            return Err(shape_err("rope_append", format!("{r:?}")));
        }
        let end = r.pos.bound() + n;
        if !rows_fit(&src.q.0, src.q.1, q_dim)
            || !rows_fit(&src.k.0, src.k.1, kv_dim)
            || !rows_fit(&src.v.0, src.v.1, kv_dim)
            || q_out.len < n * q_dim
            || cache.keys.len < end * kv_dim
            || cache.values.len < end * kv_dim
        {
            return Err(shape_err(
                "rope_append",
                format!(
                    "{r:?}: q/k/v of {}/{}/{}, q_out {}, caches {}/{}",
                    src.q.0.len, src.k.0.len, src.v.0.len, q_out.len, cache.keys.len, cache.values.len
                ),
            ));
        }
        let norm_ptr = |w: Option<Slice<'_, f32>>| w.map_or(0, |w| self.ptr_of(&w));
        let args = [
            KArg::Ptr(self.ptr_of(&src.q.0)),
            KArg::I64(src.q.1 as i64),
            KArg::Ptr(self.ptr_of(&src.k.0)),
            KArg::I64(src.k.1 as i64),
            KArg::Ptr(self.ptr_of(&src.v.0)),
            KArg::I64(src.v.1 as i64),
            KArg::Ptr(self.ptr_mut(&q_out)),
            KArg::Ptr(self.ptr_mut(&cache.keys)),
            KArg::Ptr(self.ptr_mut(&cache.values)),
            KArg::I32(int(n, "tokens")?),
            KArg::I32(int(r.heads, "heads")?),
            KArg::I32(int(r.kv_heads, "kv_heads")?),
            KArg::I32(int(hd, "head_dim")?),
            KArg::I32(int(r.pos.value(), "position")?),
            KArg::Ptr(r.pos.device_ptr(self)),
            KArg::F32(r.theta),
            KArg::I32(i32::from(r.pairs == RopePairs::Halves)),
            KArg::Ptr(norm_ptr(r.norms.map(|w| w.q))),
            KArg::Ptr(norm_ptr(r.norms.map(|w| w.k))),
            KArg::F32(r.norms.map_or(0.0, |w| w.eps)),
        ];
        // One block per (token, head), a thread per pair (whole warps).
        let blocks = int(n * (r.heads + r.kv_heads), "blocks")? as u32;
        let grid = Grid { blocks: (blocks, 1), threads: (hd / 2).next_multiple_of(32) as u32, smem: 0 };
        // SAFETY: follows rope_append(q, qs, k, ks, v, vs, q_out, kc, vc,
        // n, heads, kv_heads, hd, pos0, dpos, theta, neox, qn, kn, eps);
        // every row read lies in its slice, every cache row written is below
        // the position bound (checked; a device position is kept below it by
        // its writer, see `Position::Device`), the norms hold head_dim
        // (checked) or are null.
        unsafe { self.inner.launch(Module::Ops, "rope_append", grid, &args) }
    }

    /// Causal attention of `a.tokens` queries (`q`: tokens × heads ×
    /// head_dim) over this layer's cache (`keys`, `values`: at least
    /// `pos0 + tokens` rows of kv_heads × head_dim) into `out` (like `q`).
    ///
    /// Up to [`DECODE_TOKENS`] tokens with a head_dim that is a multiple of
    /// 32 run the decode kernel (a warp per position, coalesced rows), its
    /// positions split across blocks as `scratch` allows (flash-decoding;
    /// without scratch one block per head); more tokens run one block per
    /// (token, head) with a thread per position.
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
        a: AttentionShape<'_>,
        scratch: Option<&mut AttentionScratch>,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        let (q_dim, kv_dim, end) = (a.heads * a.head_dim, a.kv_heads * a.head_dim, a.pos.bound() + a.tokens);
        if a.kv_heads == 0
            || !a.heads.is_multiple_of(a.kv_heads)
            || q.len < a.tokens * q_dim
            || out.len < a.tokens * q_dim
            || keys.len < end * kv_dim
            || values.len < end * kv_dim
            || a.head_dim > 256
        {
            return Err(shape_err(
                "attention",
                format!("{a:?} with q {}, cache {}/{}, out {}", q.len, keys.len, values.len, out.len),
            ));
        }
        if end > MAX_ATTENTION_POSITIONS {
            return Err(shape_err(
                "attention",
                format!(
                    "{end} positions: the CUDA attention kernel handles at most {MAX_ATTENTION_POSITIONS} (lower --ctx)"
                ),
            ));
        }
        let mut args = vec![
            KArg::Ptr(self.ptr_of(&q)),
            KArg::Ptr(self.ptr_of(&keys)),
            KArg::Ptr(self.ptr_of(&values)),
            KArg::Ptr(self.ptr_mut(&out)),
            KArg::I32(int(a.heads, "heads")?),
            KArg::I32(int(a.kv_heads, "kv_heads")?),
            KArg::I32(int(a.head_dim, "head_dim")?),
            KArg::I32(int(a.pos.value(), "position")?),
            KArg::Ptr(a.pos.device_ptr(self)),
            KArg::I32(int(a.window, "window")?),
            KArg::F32(a.scale),
        ];
        let blocks = int(a.tokens * a.heads, "blocks")? as u32;
        if a.tokens <= DECODE_TOKENS && a.head_dim.is_multiple_of(32) {
            // Splits of about DECODE_CHUNK positions, as many as the scratch
            // holds for this shape (1 without it).
            let want = end.div_ceil(DECODE_CHUNK).clamp(1, MAX_SPLITS);
            let (splits, part, count) = match scratch {
                Some(sc) if want > 1 => {
                    let splits = sc.splits(a.tokens, a.heads, a.head_dim).min(want);
                    (splits, self.ptr(&sc.part, 0), self.ptr(&sc.count, 0))
                }
                _ => (1, 0, 0),
            };
            let splits = if part == 0 { 1 } else { splits.max(1) };
            args.extend([KArg::I32(int(splits, "splits")?), KArg::Ptr(part), KArg::Ptr(count)]);
            let grid = Grid { blocks: (blocks, splits as u32), threads: DECODE_THREADS, smem: 0 };
            // SAFETY: follows attention_dec(q, kc, vc, out, heads, kv_heads,
            // hd, pos0, dpos, window, scale, splits, part, count); q/out hold
            // tokens x heads x hd, the caches bound + tokens rows (checked);
            // hd is a multiple of 32 and at most 256; with splits > 1 the
            // scratch holds tokens x heads x splits rows of hd + 2 floats and
            // tokens x heads counters, all 0 between launches
            // (`AttentionScratch::splits`).
            return unsafe { self.inner.launch(Module::Ops, "attention_dec", grid, &args) };
        }
        let smem = int((a.head_dim + 32 + ATT_THREADS + end) * 4, "shared memory")? as u32;
        let grid = Grid { blocks: (blocks, 1), threads: ATT_THREADS as u32, smem };
        // SAFETY: follows attention(q, kc, vc, out, heads, kv_heads, hd,
        // pos0, dpos, window, scale); q/out hold tokens x heads x hd, the
        // caches bound + tokens rows (checked); the shared memory holds the
        // query, the reductions and the scores of bound + tokens positions.
        unsafe { self.inner.launch(Module::Ops, "attention", grid, &args) }
    }

    /// Scratch for [`CudaBackend::attention`] to split the positions of up
    /// to `tokens` tokens of `heads` heads of `head_dim` across blocks.
    ///
    /// # Errors
    ///
    /// Out of device memory.
    pub fn attention_scratch(&self, tokens: usize, heads: usize, head_dim: usize) -> Result<AttentionScratch> {
        let tokens = tokens.clamp(1, DECODE_TOKENS);
        let rows = tokens * heads * MAX_SPLITS;
        Ok(AttentionScratch {
            part: self.alloc(rows * (head_dim + 2))?,
            count: self.alloc(tokens * heads)?,
            rows,
            heads,
            head_dim,
        })
    }

    /// `x += y / rms(y) * post`, then `out = x / rms(x) * w`, per row of
    /// `w.len()`: Gemma's post-norm of a block's output, the residual add
    /// and the next RMSNorm in one kernel.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] unless all hold the same whole rows.
    pub fn post_add_rms_norm(
        &self,
        x: SliceMut<'_, f32>,
        y: Slice<'_, f32>,
        post: Slice<'_, f32>,
        w: Slice<'_, f32>,
        eps: f32,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        if w.len == 0 || post.len != w.len || x.len != y.len || x.len != out.len || !x.len.is_multiple_of(w.len) {
            return Err(shape_err(
                "post_add_rms_norm",
                format!("{} + {} into {} in rows of {} (post-norm {})", x.len, y.len, out.len, w.len, post.len),
            ));
        }
        let rows = x.len / w.len;
        let args = [
            KArg::Ptr(self.ptr_mut(&x)),
            KArg::Ptr(self.ptr_of(&y)),
            KArg::Ptr(self.ptr_of(&post)),
            KArg::Ptr(self.ptr_of(&w)),
            KArg::F32(eps),
            KArg::I32(int(w.len, "dim")?),
            KArg::Ptr(self.ptr_mut(&out)),
        ];
        let grid = Grid { blocks: (int(rows, "rows")? as u32, 1), threads: 256, smem: 0 };
        // SAFETY: follows post_add_rms_norm(x, y, wp, w, eps, dim, out): x,
        // y and out hold `rows` rows of `dim`, wp and w hold `dim` (checked).
        unsafe { self.inner.launch(Module::Ops, "post_add_rms_norm", grid, &args) }
    }

    fn gated(
        &self,
        kernel: &str,
        gate: (Slice<'_, f32>, usize),
        up: (Slice<'_, f32>, usize),
        f: usize,
        tokens: usize,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        let fits = |s: &Slice<'_, f32>, stride: usize| stride >= f && s.len >= tokens.saturating_sub(1) * stride + f;
        if tokens == 0 || f == 0 || !fits(&gate.0, gate.1) || !fits(&up.0, up.1) || out.len < tokens * f {
            return Err(shape_err(
                "gated activation",
                format!(
                    "{tokens} x {f} from gate {} (stride {}) and up {} (stride {}) into {}",
                    gate.0.len, gate.1, up.0.len, up.1, out.len
                ),
            ));
        }
        let args = [
            KArg::Ptr(self.ptr_of(&gate.0)),
            KArg::I64(gate.1 as i64),
            KArg::Ptr(self.ptr_of(&up.0)),
            KArg::I64(up.1 as i64),
            KArg::Ptr(self.ptr_mut(&out)),
            KArg::I32(int(f, "width")?),
            KArg::I32(int(tokens, "tokens")?),
        ];
        // SAFETY: follows swiglu/geglu(gate, gs, up, us, out, f, n): every
        // row read lies in its slice, out holds n x f (checked).
        unsafe { self.inner.launch(Module::Ops, kernel, elementwise(tokens * f)?, &args) }
    }

    /// `out = silu(gate) * up` for `tokens` rows of `f` values (gate and up
    /// given with their row strides: the two halves of a stacked
    /// projection, or two buffers).
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] when a row falls outside its slice.
    pub fn swiglu(
        &self,
        gate: (Slice<'_, f32>, usize),
        up: (Slice<'_, f32>, usize),
        f: usize,
        tokens: usize,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        self.gated("swiglu", gate, up, f, tokens, out)
    }

    /// `out = gelu_tanh(gate) * up`, as [`CudaBackend::swiglu`].
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] when a row falls outside its slice.
    pub fn geglu(
        &self,
        gate: (Slice<'_, f32>, usize),
        up: (Slice<'_, f32>, usize),
        f: usize,
        tokens: usize,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        self.gated("geglu", gate, up, f, tokens, out)
    }

    /// `x += y`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] on different lengths.
    pub fn add(&self, x: SliceMut<'_, f32>, y: Slice<'_, f32>) -> Result<()> {
        if x.len != y.len {
            return Err(shape_err("add", format!("{} values plus {}", x.len, y.len)));
        }
        let n = int(x.len, "elements")?;
        let args = [KArg::Ptr(self.ptr_mut(&x)), KArg::Ptr(self.ptr_of(&y)), KArg::I32(n)];
        // SAFETY: follows add(x, y, n): both hold n values.
        unsafe { self.inner.launch(Module::Ops, "add", elementwise(x.len)?, &args) }
    }

    /// `x += y`, then `out = x / rms(x) * w` per row of `w.len()` (the
    /// residual add and the next RMSNorm in one kernel).
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] unless all three hold the same whole rows.
    pub fn add_rms_norm(
        &self,
        x: SliceMut<'_, f32>,
        y: Slice<'_, f32>,
        w: Slice<'_, f32>,
        eps: f32,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        if w.len == 0 || x.len != y.len || x.len != out.len || !x.len.is_multiple_of(w.len) {
            return Err(shape_err(
                "add_rms_norm",
                format!("{} + {} into {} in rows of {}", x.len, y.len, out.len, w.len),
            ));
        }
        let rows = x.len / w.len;
        let args = [
            KArg::Ptr(self.ptr_mut(&x)),
            KArg::Ptr(self.ptr_of(&y)),
            KArg::Ptr(self.ptr_of(&w)),
            KArg::F32(eps),
            KArg::I32(int(w.len, "dim")?),
            KArg::Ptr(self.ptr_mut(&out)),
        ];
        let grid = Grid { blocks: (int(rows, "rows")? as u32, 1), threads: 256, smem: 0 };
        // SAFETY: follows add_rms_norm(x, y, w, eps, dim, out): x, y and
        // out hold `rows` rows of `dim`, w holds `dim` (checked).
        unsafe { self.inner.launch(Module::Ops, "add_rms_norm", grid, &args) }
    }

    /// `out[0]` = the first index of the largest value of `x` (NaN never
    /// wins; 0 when none is above -inf): the host sampler's greedy pick,
    /// made on the device so that 4 bytes come back instead of the logits.
    /// `out` also holds the blocks' partial results: at least
    /// [`ARGMAX_SCRATCH`] values.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] when `x` is empty or `out` is short.
    pub fn argmax(&self, x: Slice<'_, f32>, out: SliceMut<'_, i32>) -> Result<()> {
        if x.len == 0 || out.len < ARGMAX_SCRATCH {
            return Err(shape_err("argmax", format!("{} values into {} (at least {ARGMAX_SCRATCH})", x.len, out.len)));
        }
        // Blocks of at least 4 elements per thread, at most ARGMAX_BLOCKS.
        let chunk = x.len.div_ceil(ARGMAX_BLOCKS).max(4 * ARGMAX_THREADS as usize);
        let blocks = x.len.div_ceil(chunk);
        let (out_ptr, part_ptr) = (self.ptr(out.buf, out.offset), self.ptr(out.buf, out.offset + 1));
        let args = [
            KArg::Ptr(self.ptr_of(&x)),
            KArg::I32(int(x.len, "elements")?),
            KArg::I32(int(chunk, "chunk")?),
            KArg::Ptr(part_ptr),
        ];
        let grid = Grid { blocks: (blocks as u32, 1), threads: ARGMAX_THREADS, smem: 0 };
        // SAFETY: follows argmax_part(x, n, chunk, part): x holds n values;
        // part (out from element 1) holds 2 per block, blocks <= ARGMAX_BLOCKS.
        unsafe { self.inner.launch(Module::Ops, "argmax_part", grid, &args)? };
        let args = [KArg::Ptr(part_ptr), KArg::I32(blocks as i32), KArg::Ptr(out_ptr)];
        let grid = Grid { blocks: (1, 1), threads: ARGMAX_THREADS, smem: 0 };
        // SAFETY: follows argmax_final(part, blocks, out): part holds the
        // pairs argmax_part wrote, out one value before them.
        unsafe { self.inner.launch(Module::Ops, "argmax_final", grid, &args) }
    }

    /// `out[t] = s · W[ids[t]]` for the first `n` indices (the embedding
    /// lookup), `out` holding `n` rows of `cols`.
    ///
    /// # Errors
    ///
    /// [`crate::CudaError::Shape`] on mismatched lengths or indices.
    pub fn embed_rows(
        &self,
        w: &DeviceMatrix,
        ids: &DeviceRows,
        n: usize,
        s: f32,
        out: SliceMut<'_, f32>,
    ) -> Result<()> {
        if ids.bound > w.rows || n > ids.len() || out.len != n * w.cols {
            return Err(shape_err(
                "embed_rows",
                format!("{n} rows of {} (indices below {}) into {}", w.cols, ids.bound, out.len),
            ));
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
