//! The Llama-family block (and Gemma 3's additions) on the GPU. Reads top to
//! bottom: weights (shapes in comments), session state, load, forward, one
//! comment per step; the same steps, in the same order, as the CPU engine's
//! `model/llama.rs`.

use spinfer_engine::loader::Loader;
use spinfer_engine::model::{FfnAct, ModelConfig, RopeStyle};
use spinfer_engine::tensor::TensorView;
use spinfer_kernels::GgmlType;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels_cuda::{AttentionShape, CudaBackend, DeviceBuf, DeviceMatrix, RopePairs, Slice, SliceMut, WeightFormat};

use crate::{GpuError, Result};

/// Most tokens one pass through the layers takes; a longer
/// [`GpuModel::forward`] runs in steps of this many (it bounds the
/// activation buffers).
pub const UBATCH: usize = 512;

/// One transformer block's weights on the device.
struct Layer {
    attn_norm: DeviceBuf<f32>, // (dim)
    wq: DeviceMatrix,          // (n_heads * head_dim, dim)
    wk: DeviceMatrix,          // (n_kv_heads * head_dim, dim)
    wv: DeviceMatrix,          // (n_kv_heads * head_dim, dim)
    wo: DeviceMatrix,          // (dim, n_heads * head_dim)
    ffn_norm: DeviceBuf<f32>,  // (dim)
    w_gate: DeviceMatrix,      // (ffn_dim, dim)
    w_up: DeviceMatrix,        // (ffn_dim, dim)
    w_down: DeviceMatrix,      // (dim, ffn_dim)
    // Gemma only:
    q_norm: Option<DeviceBuf<f32>>,         // (head_dim)
    k_norm: Option<DeviceBuf<f32>>,         // (head_dim)
    post_attn_norm: Option<DeviceBuf<f32>>, // (dim)
    post_ffn_norm: Option<DeviceBuf<f32>>,  // (dim)
}

/// A model on the GPU: configuration, device and weights. Each request runs
/// in its own [`GpuSession`].
pub struct GpuModel {
    pub config: ModelConfig,
    be: CudaBackend,
    token_embd: DeviceMatrix, // (vocab, dim); also the head when tied
    layers: Vec<Layer>,
    output_norm: DeviceBuf<f32>,    // (dim)
    output: Option<DeviceMatrix>,   // (vocab, dim); None when tied to token_embd
    ctx: usize,
}

/// Per-request state on the device: the KV cache (every layer holds all
/// `ctx` positions; row p is position p) and activation buffers for
/// [`UBATCH`] tokens.
pub struct GpuSession {
    pos: usize,
    keys: Vec<DeviceBuf<f32>>,   // per layer (ctx, kv_dim)
    values: Vec<DeviceBuf<f32>>, // per layer (ctx, kv_dim)
    x: DeviceBuf<f32>,           // residual stream (UBATCH, dim)
    xn: DeviceBuf<f32>,          // normalised input of the current step (UBATCH, dim)
    q: DeviceBuf<f32>,           // (UBATCH, n_heads * head_dim)
    att: DeviceBuf<f32>,         // attention output (UBATCH, n_heads * head_dim)
    gate: DeviceBuf<f32>,        // (UBATCH, ffn_dim)
    up: DeviceBuf<f32>,          // (UBATCH, ffn_dim)
    tmp: DeviceBuf<f32>,         // block output before the residual add (UBATCH, dim)
    hidden: DeviceBuf<f32>,      // final-normed hidden states of the last forward call (tokens, dim)
    last_tokens: usize,
    logits: DeviceBuf<f32>, // (rows requested, vocab)
}

impl GpuSession {
    /// Tokens currently in the KV cache.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Forgets the cached tokens (the buffers are kept).
    pub fn reset(&mut self) {
        self.pos = 0;
    }
}

fn internal(what: &str, off: usize, len: usize, have: usize) -> GpuError {
    GpuError::InvalidArgument(format!("{what}: {off}..{} is past its {have} values", off + len))
}

fn at<'a>(b: &'a DeviceBuf<f32>, what: &str, off: usize, len: usize) -> Result<Slice<'a, f32>> {
    b.at(off, len).ok_or_else(|| internal(what, off, len, b.len()))
}

fn at_mut<'a>(b: &'a mut DeviceBuf<f32>, what: &str, off: usize, len: usize) -> Result<SliceMut<'a, f32>> {
    let have = b.len();
    b.at_mut(off, len).ok_or_else(|| internal(what, off, len, have))
}

/// The CUDA format of a GGUF type, or an error naming the tensor.
fn format_of(t: &TensorView) -> Result<WeightFormat> {
    let f = match t.ty {
        GgmlType::Q4_0 => WeightFormat::Q4_0,
        GgmlType::Q4_1 => WeightFormat::Q4_1,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        GgmlType::Q4_K => WeightFormat::Q4_K,
        GgmlType::Q5_K => WeightFormat::Q5_K,
        GgmlType::Q6_K => WeightFormat::Q6_K,
        GgmlType::TQ1_0 => WeightFormat::TQ1_0,
        GgmlType::TQ2_0 => WeightFormat::TQ2_0,
        other => {
            let supported: Vec<&str> = WeightFormat::ALL.iter().map(|f| f.name()).collect();
            return Err(GpuError::UnsupportedType {
                tensor: t.name.clone(),
                ty: other.to_string(),
                supported: supported.join(", "),
            });
        }
    };
    Ok(f)
}

impl GpuModel {
    /// Uploads every weight of the model `loader` reads to device 0, with
    /// sessions of `ctx` positions.
    ///
    /// # Errors
    ///
    /// No usable device, a tensor of the wrong shape or of a type without
    /// CUDA kernels (named), a context the attention kernel cannot hold.
    pub fn load(loader: &dyn Loader, ctx: usize) -> Result<Self> {
        let c = loader.config()?;
        if ctx == 0 || ctx > spinfer_kernels_cuda::MAX_ATTENTION_POSITIONS {
            return Err(GpuError::InvalidArgument(format!(
                "context size {ctx}: the CUDA backend runs 1..={} positions",
                spinfer_kernels_cuda::MAX_ATTENTION_POSITIONS
            )));
        }
        let be = CudaBackend::new()?;
        tracing::info!(device = %be.device(), "loading the model onto the gpu");
        let (dim, q_dim, kv_dim) = (c.dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<DeviceMatrix> {
            let t = loader.tensor(name)?;
            if t.dims != [cols, rows] {
                return Err(spinfer_engine::Error::TensorShape {
                    path: loader.path().to_path_buf(),
                    tensor: name.to_string(),
                    got: t.dims.clone(),
                    want: vec![cols, rows],
                }
                .into());
            }
            Ok(be.upload_matrix(format_of(&t)?, rows, cols, t.data.bytes())?)
        };
        let vector = |name: &str, len: usize| -> Result<DeviceBuf<f32>> {
            let t = loader.tensor(name)?;
            if t.dims != [len] {
                return Err(spinfer_engine::Error::TensorShape {
                    path: loader.path().to_path_buf(),
                    tensor: name.to_string(),
                    got: t.dims.clone(),
                    want: vec![len],
                }
                .into());
            }
            let mut v = vec![0f32; len];
            dequantize_row(t.ty, t.data.bytes(), &mut v).map_err(spinfer_engine::Error::from)?;
            Ok(be.upload(&v)?)
        };

        let token_embd = matrix("token_embd.weight", c.vocab_size, dim)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            let gemma = |name: &str, len| c.is_gemma().then(|| vector(&p(name), len)).transpose();
            layers.push(Layer {
                attn_norm: vector(&p("attn_norm"), dim)?,
                wq: matrix(&p("attn_q"), q_dim, dim)?,
                wk: matrix(&p("attn_k"), kv_dim, dim)?,
                wv: matrix(&p("attn_v"), kv_dim, dim)?,
                wo: matrix(&p("attn_output"), dim, q_dim)?,
                ffn_norm: vector(&p("ffn_norm"), dim)?,
                w_gate: matrix(&p("ffn_gate"), c.ffn_dim, dim)?,
                w_up: matrix(&p("ffn_up"), c.ffn_dim, dim)?,
                w_down: matrix(&p("ffn_down"), dim, c.ffn_dim)?,
                q_norm: gemma("attn_q_norm", c.head_dim)?,
                k_norm: gemma("attn_k_norm", c.head_dim)?,
                post_attn_norm: gemma("post_attention_norm", dim)?,
                post_ffn_norm: gemma("post_ffw_norm", dim)?,
            });
        }
        let output_norm = vector("output_norm.weight", dim)?;
        let output = (!c.tied_embeddings).then(|| matrix("output.weight", c.vocab_size, dim)).transpose()?;
        Ok(Self { config: c, be, token_embd, layers, output_norm, output, ctx })
    }

    /// The device the model runs on.
    pub fn backend(&self) -> &CudaBackend {
        &self.be
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down].iter().map(|m| m.bytes()).sum::<usize>())
            .sum();
        l + self.token_embd.bytes() + self.output.as_ref().map_or(0, DeviceMatrix::bytes)
    }

    /// A fresh session with an empty KV cache of the model's context.
    ///
    /// # Errors
    ///
    /// Out of device memory.
    pub fn new_session(&self) -> Result<GpuSession> {
        let c = &self.config;
        let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let buf = |n: usize| self.be.alloc::<f32>(n);
        let mut keys = Vec::with_capacity(c.n_layers);
        let mut values = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            keys.push(buf(self.ctx * kv_dim)?);
            values.push(buf(self.ctx * kv_dim)?);
        }
        Ok(GpuSession {
            pos: 0,
            keys,
            values,
            x: buf(UBATCH * c.dim)?,
            xn: buf(UBATCH * c.dim)?,
            q: buf(UBATCH * q_dim)?,
            att: buf(UBATCH * q_dim)?,
            gate: buf(UBATCH * c.ffn_dim)?,
            up: buf(UBATCH * c.ffn_dim)?,
            tmp: buf(UBATCH * c.dim)?,
            hidden: buf(UBATCH * c.dim)?,
            last_tokens: 0,
            logits: buf(c.vocab_size)?,
        })
    }

    /// Runs `tokens` at the session's next positions and appends them to
    /// its KV cache; their final-normed hidden states are then ready for
    /// [`GpuModel::logits`].
    ///
    /// # Errors
    ///
    /// No tokens, a token outside the vocabulary, the context full, or a
    /// device error.
    pub fn forward(&self, s: &mut GpuSession, tokens: &[u32]) -> Result<()> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(GpuError::InvalidArgument("forward needs at least one token".into()));
        }
        if s.pos + n > self.ctx {
            return Err(spinfer_engine::Error::ContextOverflow { needed: s.pos + n, ctx: self.ctx }.into());
        }
        if s.hidden.len() < n * c.dim {
            s.hidden = self.be.alloc(n * c.dim)?;
        }
        s.last_tokens = n;
        for (i, part) in tokens.chunks(UBATCH).enumerate() {
            self.forward_step(s, part, i * UBATCH)?;
        }
        Ok(())
    }

    /// One pass of up to [`UBATCH`] tokens through the layers; their
    /// final-normed hidden states go to `s.hidden` from row `row`.
    fn forward_step(&self, s: &mut GpuSession, tokens: &[u32], row: usize) -> Result<()> {
        let (c, be) = (&self.config, &self.be);
        let n = tokens.len();
        let (dim, hd, pos) = (c.dim, c.head_dim, s.pos);
        let (q_dim, kv_dim, ffn) = (c.n_heads * hd, c.n_kv_heads * hd, c.ffn_dim);
        let pairs = if c.rope_style == RopeStyle::NeoX { RopePairs::Halves } else { RopePairs::Adjacent };

        // Token embeddings into the residual stream (Gemma: times √dim).
        // Token ids are checked against the vocabulary on upload.
        let ids = be.upload_rows(tokens, c.vocab_size)?;
        let scale = if c.is_gemma() { (dim as f32).sqrt() } else { 1.0 };
        be.embed_rows(&self.token_embd, &ids, scale, at_mut(&mut s.x, "x", 0, n * dim)?)?;

        for (l, layer) in self.layers.iter().enumerate() {
            let local = c.sliding_window.filter(|w| w.is_local(l));
            let theta = local.map_or(c.rope_theta, |w| w.rope_theta);
            // Attention RMSNorm.
            be.rms_norm(at(&s.x, "x", 0, n * dim)?, layer.attn_norm.all(), c.rms_eps, at_mut(&mut s.xn, "xn", 0, n * dim)?)?;
            // Q, K, V projections; k and v straight into the cache rows of
            // positions pos..pos + n.
            let xn = at(&s.xn, "xn", 0, n * dim)?;
            be.gemv_f32(&layer.wq, xn, n, None, at_mut(&mut s.q, "q", 0, n * q_dim)?)?;
            be.gemv_f32(&layer.wk, xn, n, None, at_mut(&mut s.keys[l], "keys", pos * kv_dim, n * kv_dim)?)?;
            be.gemv_f32(&layer.wv, xn, n, None, at_mut(&mut s.values[l], "values", pos * kv_dim, n * kv_dim)?)?;
            // QK-norm (Gemma): RMSNorm of every query and key head.
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                be.rms_norm_in_place(at_mut(&mut s.q, "q", 0, n * q_dim)?, qn.all(), c.rms_eps)?;
                be.rms_norm_in_place(at_mut(&mut s.keys[l], "keys", pos * kv_dim, n * kv_dim)?, kn.all(), c.rms_eps)?;
            }
            // RoPE on q and k at their absolute positions (a local layer
            // with its own base).
            be.rope(at_mut(&mut s.q, "q", 0, n * q_dim)?, n, c.n_heads, hd, q_dim, pos, theta, pairs)?;
            be.rope(at_mut(&mut s.keys[l], "keys", pos * kv_dim, n * kv_dim)?, n, c.n_kv_heads, hd, kv_dim, pos, theta, pairs)?;
            // Causal attention over positions 0..pos + n (a local layer
            // over its window only).
            let shape = AttentionShape {
                tokens: n,
                heads: c.n_heads,
                kv_heads: c.n_kv_heads,
                head_dim: hd,
                pos0: pos,
                window: local.map_or(0, |w| w.window),
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let end = (pos + n) * kv_dim;
            be.attention(
                at(&s.q, "q", 0, n * q_dim)?,
                at(&s.keys[l], "keys", 0, end)?,
                at(&s.values[l], "values", 0, end)?,
                shape,
                at_mut(&mut s.att, "att", 0, n * q_dim)?,
            )?;
            // Output projection, its RMSNorm (Gemma), and residual.
            be.gemv_f32(&layer.wo, at(&s.att, "att", 0, n * q_dim)?, n, None, at_mut(&mut s.tmp, "tmp", 0, n * dim)?)?;
            self.residual(s, layer.post_attn_norm.as_ref(), n)?;

            // FFN RMSNorm.
            be.rms_norm(at(&s.x, "x", 0, n * dim)?, layer.ffn_norm.all(), c.rms_eps, at_mut(&mut s.xn, "xn", 0, n * dim)?)?;
            // Gated FFN: down(act(gate(x)) * up(x)), SwiGLU or GeGLU.
            let xn = at(&s.xn, "xn", 0, n * dim)?;
            be.gemv_f32(&layer.w_gate, xn, n, None, at_mut(&mut s.gate, "gate", 0, n * ffn)?)?;
            be.gemv_f32(&layer.w_up, xn, n, None, at_mut(&mut s.up, "up", 0, n * ffn)?)?;
            let (gate, up) = (at_mut(&mut s.gate, "gate", 0, n * ffn)?, at(&s.up, "up", 0, n * ffn)?);
            match c.ffn_act {
                FfnAct::Silu => be.swiglu(gate, up)?,
                FfnAct::GeluTanh => be.geglu(gate, up)?,
            }
            be.gemv_f32(&layer.w_down, at(&s.gate, "gate", 0, n * ffn)?, n, None, at_mut(&mut s.tmp, "tmp", 0, n * dim)?)?;
            // Its RMSNorm (Gemma), and residual.
            self.residual(s, layer.post_ffn_norm.as_ref(), n)?;
        }

        // Final RMSNorm; logits are computed on request.
        let out = at_mut(&mut s.hidden, "hidden", row * dim, n * dim)?;
        be.rms_norm(at(&s.x, "x", 0, n * dim)?, self.output_norm.all(), c.rms_eps, out)?;
        s.pos += n;
        Ok(())
    }

    /// Adds the block's output `s.tmp` to the residual stream, through the
    /// RMSNorm `norm` first when there is one (Gemma's post-norms).
    fn residual(&self, s: &mut GpuSession, norm: Option<&DeviceBuf<f32>>, n: usize) -> Result<()> {
        let (be, len) = (&self.be, n * self.config.dim);
        let src = match norm {
            Some(w) => {
                be.rms_norm(at(&s.tmp, "tmp", 0, len)?, w.all(), self.config.rms_eps, at_mut(&mut s.xn, "xn", 0, len)?)?;
                at(&s.xn, "xn", 0, len)?
            }
            None => at(&s.tmp, "tmp", 0, len)?,
        };
        be.add(at_mut(&mut s.x, "x", 0, len)?, src)?;
        Ok(())
    }

    /// Logits of tokens `rows` (indices into the last `forward` call's
    /// tokens), `rows.len() x vocab`, row-major, copied to the host.
    ///
    /// # Errors
    ///
    /// Rows outside the last call's tokens; device errors.
    pub fn logits(&self, s: &mut GpuSession, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
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
        Ok(self.be.download_slice(at(&s.logits, "logits", 0, n * vocab)?)?)
    }

    /// Runs `tokens` and returns the logits of the last one.
    ///
    /// # Errors
    ///
    /// As [`GpuModel::forward`].
    pub fn forward_last(&self, s: &mut GpuSession, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward(s, tokens)?;
        self.logits(s, tokens.len() - 1..tokens.len())
    }
}
