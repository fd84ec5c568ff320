//! The Llama-family block (and Gemma 3's additions) on the GPU. Reads top to
//! bottom: weights (shapes in comments), session state, load, forward, one
//! comment per step; the same steps, in the same order, as the CPU engine's
//! `model/llama.rs`.

use spinfer_formats::loader::check_dims;
use spinfer_formats::tensor::TensorView;
use spinfer_formats::{FfnAct, Loader, ModelConfig, RopeStyle};
use spinfer_kernels::GgmlType;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels_cuda::{
    ARGMAX_SCRATCH, AttentionScratch, AttentionShape, CudaBackend, DeviceBuf, DeviceGraph, DeviceMatrix, DeviceRows,
    GEMV_BATCHES, GluAct, HostBuf, KvCache, Position, Prologue, QkNorm, QkvRows, RopePairs, RopeShape,
};

use crate::ffn::Ffn;
use crate::fused::Input;
use crate::head::{GpuHead, HeadBufs, head_tensor};
use crate::hybrid::HostBufs;
use crate::placement::FfnPlacement;
use crate::proj::{Part, Proj};
use crate::slices::{at, at_mut, format_of, internal};
use crate::{GpuError, Result};

pub use crate::slices::UBATCH;

/// One transformer block's weights on the device.
struct Layer {
    attn_norm: DeviceBuf<f32>, // (dim)
    qkv: Proj,                 // q (n_heads * head_dim), k, v (n_kv_heads * head_dim each) x dim
    wo: DeviceMatrix,          // (dim, n_heads * head_dim)
    ffn_norm: DeviceBuf<f32>,  // (dim)
    ffn: Ffn,
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
    pub(crate) be: CudaBackend,
    pub(crate) token_embd: DeviceMatrix, // (vocab, dim); also the head when tied
    layers: Vec<Layer>,
    output_norm: DeviceBuf<f32>,             // (dim)
    pub(crate) output: Option<DeviceMatrix>, // (vocab, dim); None when tied to token_embd
    pub(crate) head_type: GgmlType,          // the head tensor's GGUF type
    pub(crate) head: Option<GpuHead>,        // the sparse head, when set
    ctx: usize,
    cpu: Option<ThreadPool>, // the cold neurons' threads (hybrid only)
}

/// Per-request state on the device: the KV cache (every layer holds all
/// `ctx` positions; row p is position p), activation buffers for [`UBATCH`]
/// tokens, and the decode step captured as a graph (after its first run).
pub struct GpuSession {
    pos: usize,
    keys: Vec<DeviceBuf<f32>>,         // per layer (ctx, kv_dim)
    values: Vec<DeviceBuf<f32>>,       // per layer (ctx, kv_dim)
    ids: DeviceRows,                   // token ids of the current step (UBATCH)
    dpos: DeviceBuf<i32>,              // the decode step's position, read by the graph (1)
    x: DeviceBuf<f32>,                 // residual stream (UBATCH, dim)
    x2: DeviceBuf<f32>,                // its other copy: fused steps write the sum there (UBATCH, dim)
    xn: DeviceBuf<f32>,                // normalised input of the current block (UBATCH, dim)
    qkv: DeviceBuf<f32>,               // projected q, k, v (UBATCH, q_dim + 2 kv_dim)
    q: DeviceBuf<f32>,                 // roped queries (UBATCH, q_dim)
    att: DeviceBuf<f32>,               // attention output (UBATCH, q_dim)
    gate_up: DeviceBuf<f32>,           // projected gate and up (UBATCH, 2 ffn_dim)
    act: DeviceBuf<f32>,               // act(gate) * up (UBATCH, ffn_dim)
    tmp: DeviceBuf<f32>,               // block output before the residual add (UBATCH, dim)
    cold: DeviceBuf<f32>,              // the CPU's share of a split FFN's output (UBATCH, dim)
    host: HostBufs,                    // the cold side's host buffers
    pub(crate) hidden: DeviceBuf<f32>, // final-normed hidden states of the last forward call (tokens, dim)
    pub(crate) last_tokens: usize,
    pub(crate) logits: DeviceBuf<f32>,    // (rows requested, vocab)
    pub(crate) host_logits: HostBuf<f32>, // page-locked (vocab): one row's logits for the sampler
    pub(crate) best: DeviceBuf<i32>,      // the greedy token, picked on the device, then its scratch
    pub(crate) head: Option<HeadBufs>,    // the sparse head's buffers, once used
    att_scratch: AttentionScratch,        // the decode attention's splits
    graph: Option<DeviceGraph>,           // one decode step (1 token, position from `dpos`)
    use_graph: bool,
    fused: bool,
}

impl GpuSession {
    /// Tokens currently in the KV cache.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Forgets the cached tokens (the buffers and the captured graph are
    /// kept).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Whether single-token steps replay a captured graph (the default) or
    /// launch every kernel (for comparison).
    pub fn set_graphs(&mut self, on: bool) {
        self.use_graph = on;
    }

    /// Whether steps of a few tokens fuse the gated activation into the
    /// down projection and the residual add and RMSNorm into the next
    /// projections (the default), or launch each step on its own (for
    /// comparison). The results agree to rounding.
    pub fn set_fused(&mut self, on: bool) {
        if self.fused != on {
            self.fused = on;
            self.graph = None; // captured with the other setting
        }
    }
}

/// The step's first position: `pos`, or (a step being captured) read from
/// `dpos`, which its writer keeps at most `bound`.
fn position(dpos: &DeviceBuf<i32>, pos: usize, device: bool, bound: usize) -> Position<'_> {
    if device { Position::Device { buf: dpos, bound } } else { Position::Value(pos) }
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
        Self::load_with(loader, ctx, None)
    }

    /// [`GpuModel::load`] with each layer's FFN split (PowerInfer's
    /// hybrid): the neuron groups `placement` marks hot on the device, the
    /// others on the CPU, run by `threads` threads. Decode steps then
    /// launch kernel by kernel (two host copies per split layer).
    ///
    /// # Errors
    ///
    /// As [`GpuModel::load`]; a placement for another layer count or with
    /// groups past a layer's neurons.
    pub fn load_hybrid(loader: &dyn Loader, ctx: usize, placement: &FfnPlacement, threads: usize) -> Result<Self> {
        Self::load_with(loader, ctx, Some((placement, threads)))
    }

    fn load_with(loader: &dyn Loader, ctx: usize, split: Option<(&FfnPlacement, usize)>) -> Result<Self> {
        let c = loader.config()?;
        if let Some((p, _)) = split.filter(|(p, _)| p.hot.len() != c.n_layers) {
            return Err(GpuError::InvalidArgument(format!(
                "a placement of {} layers for a model of {}",
                p.hot.len(),
                c.n_layers
            )));
        }
        if ctx == 0 || ctx > spinfer_kernels_cuda::MAX_ATTENTION_POSITIONS {
            return Err(GpuError::InvalidArgument(format!(
                "context size {ctx}: the CUDA backend runs 1..={} positions",
                spinfer_kernels_cuda::MAX_ATTENTION_POSITIONS
            )));
        }
        let be = CudaBackend::new()?;
        tracing::info!(device = %be.device(), "loading the model onto the gpu");
        let (dim, q_dim, kv_dim) = (c.dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        // A weight matrix with its shape checked: GGUF dims are (cols, rows).
        let tensor = |name: &str, rows: usize, cols: usize| -> Result<TensorView> {
            let t = loader.tensor(name)?;
            check_dims(loader, &t, &[cols, rows])?;
            Ok(t)
        };
        let matrix = |name: &str, rows: usize, cols: usize| -> Result<DeviceMatrix> {
            let t = tensor(name, rows, cols)?;
            Ok(be.upload_matrix(format_of(&t)?, rows, cols, t.data.bytes())?)
        };
        // Projections of one input: consecutive parts of one format
        // stacked into one matrix.
        let proj = |parts: &[(String, usize)], cols: usize| -> Result<Proj> {
            let views = parts.iter().map(|(n, rows)| tensor(n, *rows, cols)).collect::<Result<Vec<_>>>()?;
            let parts = views
                .iter()
                .zip(parts)
                .map(|(v, (_, rows))| Ok(Part { format: format_of(v)?, rows: *rows, bytes: v.data.bytes() }))
                .collect::<Result<Vec<_>>>()?;
            Proj::upload(&be, &parts, cols, true)
        };
        let vector = |name: &str, len: usize| -> Result<DeviceBuf<f32>> {
            let t = loader.tensor(name)?;
            check_dims(loader, &t, &[len])?;
            let mut v = vec![0f32; len];
            dequantize_row(t.ty, t.data.bytes(), &mut v).map_err(spinfer_models::Error::from)?;
            Ok(be.upload(&v)?)
        };

        let token_embd = matrix("token_embd.weight", c.vocab_size, dim)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            let gemma = |name: &str, len| c.is_gemma().then(|| vector(&p(name), len)).transpose();
            let qkv = [(p("attn_q"), q_dim), (p("attn_k"), kv_dim), (p("attn_v"), kv_dim)];
            let gate_up = [(p("ffn_gate"), c.ffn_dim), (p("ffn_up"), c.ffn_dim)];
            let ffn = match split {
                Some((p, _)) => crate::ffn::split_ffn(&be, loader, &c, l, &p.hot[l])?,
                None => None,
            };
            let ffn = match ffn {
                Some(f) => f,
                None => Ffn::Gpu { gate_up: proj(&gate_up, dim)?, w_down: matrix(&p("ffn_down"), dim, c.ffn_dim)? },
            };
            layers.push(Layer {
                attn_norm: vector(&p("attn_norm"), dim)?,
                qkv: proj(&qkv, dim)?,
                wo: matrix(&p("attn_output"), dim, q_dim)?,
                ffn_norm: vector(&p("ffn_norm"), dim)?,
                ffn,
                q_norm: gemma("attn_q_norm", c.head_dim)?,
                k_norm: gemma("attn_k_norm", c.head_dim)?,
                post_attn_norm: gemma("post_attention_norm", dim)?,
                post_ffn_norm: gemma("post_ffw_norm", dim)?,
            });
        }
        let output_norm = vector("output_norm.weight", dim)?;
        let output = (!c.tied_embeddings).then(|| matrix("output.weight", c.vocab_size, dim)).transpose()?;
        let head_type = loader.tensor(head_tensor(&c))?.ty;
        let any_split = layers.iter().any(|l| matches!(l.ffn, Ffn::Split { .. }));
        let cpu = split.filter(|_| any_split).map(|(_, threads)| ThreadPool::new(threads));
        Ok(Self { config: c, be, token_embd, layers, output_norm, output, head_type, head: None, ctx, cpu })
    }

    /// The device the model runs on.
    pub fn backend(&self) -> &CudaBackend {
        &self.be
    }

    /// Positions each session holds.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let proj = Proj::bytes;
        let ffn = |f: &Ffn| match f {
            Ffn::Gpu { gate_up, w_down } => proj(gate_up) + w_down.bytes(),
            Ffn::Split { hot, .. } => hot.as_ref().map_or(0, |(g, d)| proj(g) + d.bytes()),
        };
        let layers: usize = self.layers.iter().map(|l| proj(&l.qkv) + l.wo.bytes() + ffn(&l.ffn)).sum();
        layers
            + self.token_embd.bytes()
            + self.output.as_ref().map_or(0, DeviceMatrix::bytes)
            + self.head.as_ref().map_or(0, GpuHead::device_bytes)
    }

    /// Bytes of the cold FFN weights kept on the CPU (0 without a split),
    /// and the bytes copied between host and device per token (the FFN
    /// input down and the cold share up, for every split layer).
    pub fn cpu_split(&self) -> (usize, usize) {
        let dim = self.config.dim;
        self.layers.iter().fold((0, 0), |(w, t), l| match &l.ffn {
            Ffn::Split { cold, .. } => (w + cold.gate.bytes() + cold.up.bytes() + cold.down.bytes(), t + 2 * dim * 4),
            Ffn::Gpu { .. } => (w, t),
        })
    }

    /// A fresh session with an empty KV cache of the model's context.
    ///
    /// # Errors
    ///
    /// Out of device memory.
    pub fn new_session(&self) -> Result<GpuSession> {
        let c = &self.config;
        let (q_dim, kv_dim, be) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, &self.be);
        let buf = |n: usize| be.alloc::<f32>(n);
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
            ids: be.upload_rows(&[0; UBATCH], c.vocab_size)?,
            dpos: be.alloc(1)?,
            x: buf(UBATCH * c.dim)?,
            x2: buf(UBATCH * c.dim)?,
            xn: buf(UBATCH * c.dim)?,
            qkv: buf(UBATCH * (q_dim + 2 * kv_dim))?,
            q: buf(UBATCH * q_dim)?,
            att: buf(UBATCH * q_dim)?,
            gate_up: buf(UBATCH * 2 * c.ffn_dim)?,
            act: buf(UBATCH * c.ffn_dim)?,
            tmp: buf(UBATCH * c.dim)?,
            cold: buf(if self.cpu.is_some() { UBATCH * c.dim } else { 1 })?,
            host: HostBufs::default(),
            hidden: buf(UBATCH * c.dim)?,
            last_tokens: 0,
            logits: buf(c.vocab_size)?,
            host_logits: be.alloc_host(c.vocab_size)?,
            best: be.alloc(ARGMAX_SCRATCH)?,
            head: None,
            att_scratch: be.attention_scratch(GEMV_BATCHES[GEMV_BATCHES.len() - 1], c.n_heads, c.head_dim)?,
            graph: None,
            use_graph: true,
            fused: true,
        })
    }

    /// Runs `tokens` at the session's next positions and appends them to
    /// its KV cache; their final-normed hidden states are then ready for
    /// [`GpuModel::logits`]. A single token replays the session's captured
    /// decode graph (captured on the first one).
    ///
    /// # Errors
    ///
    /// No tokens, a token outside the vocabulary, the context full, or a
    /// device error.
    pub fn forward(&self, s: &mut GpuSession, tokens: &[u32]) -> Result<()> {
        let (c, be) = (&self.config, &self.be);
        let n = tokens.len();
        if n == 0 {
            return Err(GpuError::InvalidArgument("forward needs at least one token".into()));
        }
        if s.pos + n > self.ctx {
            return Err(spinfer_models::Error::ContextOverflow { needed: s.pos + n, ctx: self.ctx }.into());
        }
        if s.hidden.len() < n * c.dim {
            s.hidden = be.alloc(n * c.dim)?;
            s.graph = None; // it wrote to the old buffer
        }
        s.last_tokens = n;
        if n == 1 && s.use_graph && self.cpu.is_none() {
            // The graph reads the token and the position from the device.
            be.write_rows(&mut s.ids, tokens)?;
            be.write(s.dpos.all_mut(), &[s.pos as i32])?;
            let graph = match s.graph.take() {
                Some(g) => g,
                None => {
                    // Run the step once uncaptured (it loads every module
                    // and function it needs, which must not happen
                    // mid-capture; its writes are the ones the graph
                    // repeats), then capture it.
                    self.forward_step(s, 1, 0, false)?;
                    be.begin_capture()?;
                    let step = self.forward_step(s, 1, 0, true);
                    let graph = be.end_capture();
                    step?;
                    graph?
                }
            };
            be.launch_graph(s.graph.insert(graph))?;
            s.pos += 1;
            return Ok(());
        }
        for (i, part) in tokens.chunks(UBATCH).enumerate() {
            be.write_rows(&mut s.ids, part)?;
            self.forward_step(s, part.len(), i * UBATCH, false)?;
            s.pos += part.len();
        }
        Ok(())
    }

    /// One pass of `n` (at most [`UBATCH`]) tokens, whose ids are in
    /// `s.ids`, through the layers at positions `s.pos..`, or with
    /// `device_pos` at the position in `s.dpos` (a step being captured);
    /// their final-normed hidden states go to `s.hidden` from row `row`.
    /// Only launches kernels (so it can be captured).
    fn forward_step(&self, s: &mut GpuSession, n: usize, row: usize, device_pos: bool) -> Result<()> {
        let (c, be) = (&self.config, &self.be);
        let (dim, hd) = (c.dim, c.head_dim);
        let (q_dim, kv_dim, ffn) = (c.n_heads * hd, c.n_kv_heads * hd, c.ffn_dim);
        let pairs = if c.rope_style == RopeStyle::NeoX { RopePairs::Halves } else { RopePairs::Adjacent };
        // The first token's position: s.pos, or read from s.dpos.
        let (device, bound) = (device_pos, self.ctx - 1);
        // A few tokens (the GEMV path) fuse the gated activation into the
        // down projection and each residual add (after Gemma's post-norm)
        // and RMSNorm into the projections after it; the sum then
        // alternates between s.x and s.x2 (`flip`: s.x2 holds it).
        let fused = s.fused && n <= GEMV_BATCHES[GEMV_BATCHES.len() - 1];
        let add_norm = fused && self.cpu.is_none();
        let mut flip = false;

        // Token embeddings into the residual stream (Gemma: times √dim),
        // and the first block's attention RMSNorm.
        let scale = if c.is_gemma() { (dim as f32).sqrt() } else { 1.0 };
        be.embed_rows(&self.token_embd, &s.ids, n, scale, at_mut(&mut s.x, "x", 0, n * dim)?)?;
        be.rms_norm(
            at(&s.x, "x", 0, n * dim)?,
            self.layers[0].attn_norm.all(),
            c.rms_eps,
            at_mut(&mut s.xn, "xn", 0, n * dim)?,
        )?;

        for (l, layer) in self.layers.iter().enumerate() {
            let local = c.sliding_window.filter(|w| w.is_local(l));
            // Q, K, V projections: (offset, row stride) of each in s.qkv;
            // fused, of the previous block's residual add and this block's
            // RMSNorm (layer 0's input was normalised after the embedding).
            let fuse = (add_norm && l > 0).then_some(&layer.attn_norm);
            let post = l.checked_sub(1).and_then(|p| self.layers[p].post_ffn_norm.as_ref());
            let (cur, other) = if flip { (&s.x2, &mut s.x) } else { (&s.x, &mut s.x2) };
            let (delta, eps, len) = (&s.tmp, c.rms_eps, n * dim);
            let mut input = Input { xn: &s.xn, cur, other, delta, norm: fuse, post, eps, len };
            layer.qkv.project(be, &mut input, n, &mut s.qkv, "qkv")?;
            let (qr, kr, vr) = (layer.qkv.place(0), layer.qkv.place(1), layer.qkv.place(2));
            flip ^= input.flips();
            // RoPE on q (into s.q) and k (into the cache at their
            // positions), after Gemma's QK-norm of every query and key head;
            // v into the cache; a local layer with its own base.
            let rows = |(off, stride): (usize, usize), width| at(&s.qkv, "qkv", off, (n - 1) * stride + width);
            let src =
                QkvRows { q: (rows(qr, q_dim)?, qr.1), k: (rows(kr, kv_dim)?, kr.1), v: (rows(vr, kv_dim)?, vr.1) };
            let theta = local.map_or(c.rope_theta, |w| w.rope_theta);
            let pos = position(&s.dpos, s.pos, device, bound);
            let norms = match (&layer.q_norm, &layer.k_norm) {
                (Some(q), Some(k)) => Some(QkNorm { q: q.all(), k: k.all(), eps: c.rms_eps }),
                _ => None,
            };
            let shape = RopeShape {
                tokens: n,
                heads: c.n_heads,
                kv_heads: c.n_kv_heads,
                head_dim: hd,
                pos,
                theta,
                pairs,
                norms,
            };
            let cache = KvCache { keys: s.keys[l].all_mut(), values: s.values[l].all_mut() };
            be.rope_append(src, shape, at_mut(&mut s.q, "q", 0, n * q_dim)?, cache)?;
            // Causal attention over the cache (a local layer over its
            // window only).
            let shape = AttentionShape {
                tokens: n,
                heads: c.n_heads,
                kv_heads: c.n_kv_heads,
                head_dim: hd,
                pos: position(&s.dpos, s.pos, device, bound),
                window: local.map_or(0, |w| w.window),
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let q = at(&s.q, "q", 0, n * q_dim)?;
            let (keys, values, scratch) = (s.keys[l].all(), s.values[l].all(), Some(&mut s.att_scratch));
            be.attention(q, keys, values, shape, scratch, at_mut(&mut s.att, "att", 0, n * q_dim)?)?;
            // Output projection; its RMSNorm (Gemma), the residual and the
            // FFN RMSNorm.
            be.gemv_f32(&layer.wo, at(&s.att, "att", 0, n * q_dim)?, n, None, at_mut(&mut s.tmp, "tmp", 0, n * dim)?)?;
            if !add_norm {
                self.residual_norm(s, layer.post_attn_norm.as_ref(), &layer.ffn_norm, n, None, flip)?;
            }

            // Gated FFN into s.tmp: all on the device, or (hybrid) the hot
            // neurons there and the cold ones on the CPU from a copy of the
            // normalised input, their shares added on the device.
            let fuse = add_norm.then_some((&layer.ffn_norm, layer.post_attn_norm.as_ref()));
            match &layer.ffn {
                Ffn::Gpu { gate_up, w_down } => flip ^= self.ffn_gpu(s, gate_up, w_down, ffn, n, fused, fuse, flip)?,
                Ffn::Split { hot, hot_neurons, cold } => {
                    be.download_slice_into(at(&s.xn, "xn", 0, n * dim)?, &mut s.host.xn)?;
                    if let Some((gate_up, w_down)) = hot {
                        self.ffn_gpu(s, gate_up, w_down, *hot_neurons, n, fused, None, flip)?;
                    }
                    let pool = self.cpu.as_ref().ok_or_else(|| internal("cpu threads", 0, 0, 0))?;
                    cold.run(pool, c.ffn_act, dim, n, &mut s.host)?;
                    let y = &s.host.y[..n * dim];
                    if hot.is_some() {
                        be.write(at_mut(&mut s.cold, "cold", 0, n * dim)?, y)?;
                        be.add(at_mut(&mut s.tmp, "tmp", 0, n * dim)?, at(&s.cold, "cold", 0, n * dim)?)?;
                    } else {
                        be.write(at_mut(&mut s.tmp, "tmp", 0, n * dim)?, y)?;
                    }
                }
            }
            // Its RMSNorm (Gemma), the residual, and the next RMSNorm: the
            // next block's (fused into its projections), or the final one
            // into s.hidden.
            match self.layers.get(l + 1) {
                Some(_) if add_norm => {}
                Some(next) => self.residual_norm(s, layer.post_ffn_norm.as_ref(), &next.attn_norm, n, None, flip)?,
                None => self.residual_norm(s, layer.post_ffn_norm.as_ref(), &self.output_norm, n, Some(row), flip)?,
            }
        }
        Ok(())
    }

    /// `s.tmp = w_down · act(gate · x) * (up · x)` over `ffn` neurons
    /// (SwiGLU or GeGLU), x being `s.xn`, or with `fuse` = (norm, post) the
    /// residual add (after the post-norm) and this RMSNorm computed in the
    /// gate/up GEMVs' staging (see [`Input`]); `fused`: the activation
    /// inside the down projection.
    /// Returns whether the residual stream moved to its other buffer.
    #[allow(clippy::too_many_arguments, reason = "one step's operands, all from forward_step")]
    fn ffn_gpu(
        &self,
        s: &mut GpuSession,
        gate_up: &Proj,
        w_down: &DeviceMatrix,
        ffn: usize,
        n: usize,
        fused: bool,
        fuse: Option<(&DeviceBuf<f32>, Option<&DeviceBuf<f32>>)>,
        flip: bool,
    ) -> Result<bool> {
        let (c, be, dim) = (&self.config, &self.be, self.config.dim);
        let (cur, other) = if flip { (&s.x2, &mut s.x) } else { (&s.x, &mut s.x2) };
        let (norm, post) = (fuse.map(|f| f.0), fuse.and_then(|f| f.1));
        let (delta, eps, len) = (&s.tmp, c.rms_eps, n * dim);
        let mut input = Input { xn: &s.xn, cur, other, delta, norm, post, eps, len };
        gate_up.project(be, &mut input, n, &mut s.gate_up, "gate_up")?;
        let (gr, ur) = (gate_up.place(0), gate_up.place(1));
        let flipped = input.flips();
        let rows = |(off, stride): (usize, usize)| at(&s.gate_up, "gate_up", off, (n - 1) * stride + ffn);
        let tmp = at_mut(&mut s.tmp, "tmp", 0, n * dim)?;
        if fused {
            // gr.1 == ur.1: one stride for both.
            let act = match c.ffn_act {
                FfnAct::Silu => GluAct::Silu,
                FfnAct::GeluTanh => GluAct::GeluTanh,
            };
            let glu = Prologue::Glu { up: rows(ur)?, act };
            be.gemv_fused(w_down, rows(gr)?, gr.1, n, glu, tmp)?;
        } else {
            let (gate, up, act) = ((rows(gr)?, gr.1), (rows(ur)?, ur.1), at_mut(&mut s.act, "act", 0, n * ffn)?);
            match c.ffn_act {
                FfnAct::Silu => be.swiglu(gate, up, ffn, n, act)?,
                FfnAct::GeluTanh => be.geglu(gate, up, ffn, n, act)?,
            }
            be.gemv_f32(w_down, at(&s.act, "act", 0, n * ffn)?, n, None, tmp)?;
        }
        Ok(flipped)
    }

    /// Adds the block's output `s.tmp` (through the RMSNorm `post` first,
    /// Gemma's post-norms) to the residual stream and normalises the result
    /// with `norm` into `s.xn`, or into `s.hidden` from row `hidden_row`;
    /// the residual stream is `s.x`, or `s.x2` when `flip`.
    fn residual_norm(
        &self,
        s: &mut GpuSession,
        post: Option<&DeviceBuf<f32>>,
        norm: &DeviceBuf<f32>,
        n: usize,
        hidden_row: Option<usize>,
        flip: bool,
    ) -> Result<()> {
        let (be, dim, eps) = (&self.be, self.config.dim, self.config.rms_eps);
        let len = n * dim;
        let y = at(&s.tmp, "tmp", 0, len)?;
        let out = match hidden_row {
            Some(row) => at_mut(&mut s.hidden, "hidden", row * dim, len)?,
            None => at_mut(&mut s.xn, "xn", 0, len)?,
        };
        let x = at_mut(if flip { &mut s.x2 } else { &mut s.x }, "x", 0, len)?;
        match post {
            Some(w) => be.post_add_rms_norm(x, y, w.all(), norm.all(), eps, out)?,
            None => be.add_rms_norm(x, y, norm.all(), eps, out)?,
        }
        Ok(())
    }
}
