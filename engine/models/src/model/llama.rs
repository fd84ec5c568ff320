//! The Llama-family transformer (Llama, SmolLM, Mistral, Qwen2) and Gemma 3,
//! which adds a few steps to the same block.
//!
//! Reads top to bottom: [`Weights`] (every tensor with its shape), the
//! per-request [`Session`] (KV cache and activation buffers), [`Model::load`]
//! and [`Model::forward`], one comment per step. Conventions follow HF
//! `LlamaForCausalLM` / `Gemma3ForCausalLM` and llama.cpp's `llm_build_llama`
//! / `llm_build_gemma3`.

use spinfer_kernels::dequant::dequantize_row;

use super::config::{FfnAct, ModelConfig, RopeStyle};
use super::math::{self, RopeTable};
pub use super::precision::Precision;
use super::{add, check_dims, load_vector};
use crate::head::{HeadIndex, HeadScratch, HeadStats, SparseHead};
use crate::{Error, Result};
use spinfer_formats::loader::Loader;
use spinfer_formats::requant::{Requant, Requantized};
use spinfer_formats::tensor::TensorView;
use spinfer_kernel_select::registry::KernelRegistry;
use spinfer_plugin_api::PredictorSpec;
use spinfer_sparsity::{self as sparse, ModelId, SparseFfn, SparsityOptions};

mod attend;
mod batch;
mod experimental;
mod kv;
mod linear;
mod memory;
#[cfg(test)]
mod pack_fallback_tests;
mod session;
mod sparse_attn;
mod sparse_ffn;

use kv::RowPos;
pub use kv::{KvCache, KvType};
pub use linear::Linear;
pub(crate) use linear::{GatheredRows, Scratch, grow};
pub use memory::{BUDGET_STEP, MemoryPlan};
pub use session::Session;

/// Most tokens one pass through the layers takes in a model with local
/// attention: a longer [`Model::forward`] runs in steps of this many, so
/// a local layer's cache holds `window + UBATCH - 1` positions at most.
pub const UBATCH: usize = 512;

/// Load-time options.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    pub precision: Precision,
    /// Context size (KV-cache length) of each session.
    pub ctx: usize,
    /// Threads per session.
    pub threads: usize,
    /// Run the FFN sparse with a calibration sidecar (`None`: dense).
    pub sparsity: Option<SparsityOptions>,
    /// Hold weights, KV cache and work buffers within this many bytes,
    /// streaming from storage what does not fit (`None`: everything mapped;
    /// see [`crate::placement`]).
    pub mem_budget: Option<u64>,
    /// Element type of the KV cache (`None`: the precision's own,
    /// [`ModelOptions::kv_type`]).
    pub kv_type: Option<KvType>,
    /// Quantise float weight matrices as they load (`None`: as stored).
    pub quantize: Option<Requant>,
}

/// Most worker threads a session may start (`--threads`, `[model] threads`).
pub const MAX_THREADS: usize = 1024;

impl ModelOptions {
    /// The KV cache's element type: the one asked for, else f32 in
    /// precise mode (PyTorch's numbers) and f16 in the integer modes.
    pub fn kv_type(&self) -> KvType {
        self.kv_type.unwrap_or(match self.precision {
            Precision::Precise => KvType::F32,
            Precision::Fast | Precision::Int8 => KvType::F16,
        })
    }

    /// Checks the context size and thread count against the model and this
    /// machine before anything is sized from them: a context or thread
    /// count of 0 or above [`MAX_THREADS`] is refused, a context above the
    /// one the model was trained for is allowed with a warning (as
    /// llama.cpp does), and the memory one session needs for it (KV cache,
    /// attention scores, RoPE table: [`session_bytes`]) must be available
    /// ([`super::available_memory`]). Errors name the flag and config key.
    pub fn check(&self, c: &ModelConfig) -> Result<()> {
        let ctx = self.ctx;
        if ctx == 0 {
            return Err(Error::InvalidArgument("context size (--ctx / [model] ctx) must be at least 1".into()));
        }
        if self.threads > MAX_THREADS {
            return Err(Error::InvalidArgument(format!(
                "{} threads (--threads / [model] threads) is more than the {MAX_THREADS} allowed",
                self.threads
            )));
        }
        let needed = session_bytes(c, ctx, self.threads.max(1), self.kv_type()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "context size {ctx} (--ctx / [model] ctx): the KV cache size overflows (the model was trained for {} positions)",
                c.ctx_train
            ))
        })?;
        if let Some(available) = super::available_memory()
            && needed > available
        {
            return Err(Error::InvalidArgument(format!(
                "context size {ctx} (--ctx / [model] ctx) needs {needed} bytes ({}) for the KV cache, attention \
                 scores and RoPE table, but only {available} bytes ({}) of memory are available; lower --ctx (the \
                 model was trained for {} positions)",
                super::human_bytes(needed),
                super::human_bytes(available),
                c.ctx_train
            )));
        }
        if ctx > c.ctx_train {
            tracing::warn!(
                "context size {ctx} (--ctx / [model] ctx) exceeds the {} positions the model was trained for: \
                 output past them may degrade",
                c.ctx_train
            );
        }
        Ok(())
    }
}

/// Positions layer `l`'s KV cache holds in a session of `ctx` positions:
/// `ctx` for a global layer; for a local (sliding-window) one, the window
/// plus the positions of one step ([`UBATCH`]) less one, a ring indexed by
/// position modulo its size.
pub fn kv_positions(c: &ModelConfig, l: usize, ctx: usize) -> usize {
    match &c.sliding_window {
        Some(w) if w.is_local(l) => ctx.min(w.window.saturating_add(UBATCH - 1)),
        _ => ctx,
    }
}

/// Bytes a session of `ctx` positions and `threads` threads holds for the
/// model `c` beyond its activations: the KV cache (`2 x kv_dim` values of
/// `kv` per position of every layer's [`kv_positions`]), the attention
/// scratch (per thread, a block of prompt rows' scores and outputs:
/// `attend::scratch_floats` f32) and the model's RoPE tables (`ctx x
/// head_dim` f32 each). `None` if it overflows.
pub fn session_bytes(c: &ModelConfig, ctx: usize, threads: usize, kv: KvType) -> Option<u64> {
    let f32s = |a: usize, b: usize| (a as u64).checked_mul(b as u64)?.checked_mul(4);
    let positions = (0..c.n_layers).try_fold(0usize, |acc, l| acc.checked_add(kv_positions(c, l, ctx)))?;
    let values = (positions as u64).checked_mul(c.n_kv_heads.checked_mul(c.head_dim)? as u64)?;
    let kv = values.checked_mul(2 * kv.bytes() as u64)?;
    let tables = if c.sliding_window.is_some() { 2 } else { 1 };
    let scratch = f32s(threads, attend::scratch_floats(ctx, c.head_dim))?;
    let total = kv.checked_add(scratch)?.checked_add(f32s(ctx, c.head_dim)?.checked_mul(tables)?)?;
    // One Vec holds a layer-major cache: it must stay under isize::MAX.
    (total <= isize::MAX as u64).then_some(total)
}

impl Default for ModelOptions {
    fn default() -> Self {
        Self {
            precision: Precision::Fast,
            ctx: 2048,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            sparsity: None,
            mem_budget: None,
            kv_type: None,
            quantize: None,
        }
    }
}

/// A hook called in each dense FFN with the layer, its input (`n × dim`)
/// and its gate and up projections (`n × ffn_dim` each), before the
/// activation.
pub type FfnProbe = Box<dyn FnMut(usize, &[f32], &[f32], &[f32]) + Send>;

/// A hook called in each layer with the layer and the attention output
/// (`n × n_heads·head_dim`), the input of the output projection.
pub type AttnProbe = Box<dyn FnMut(usize, &[f32]) + Send>;

/// One transformer block.
pub struct Layer {
    pub attn_norm: Vec<f32>, // (dim)
    pub wq: Linear,          // (n_heads * head_dim, dim)
    pub wk: Linear,          // (n_kv_heads * head_dim, dim)
    pub wv: Linear,          // (n_kv_heads * head_dim, dim)
    pub wo: Linear,          // (dim, n_heads * head_dim)
    pub ffn_norm: Vec<f32>,  // (dim)
    pub w_gate: Linear,      // (ffn_dim, dim)
    pub w_up: Linear,        // (ffn_dim, dim)
    pub w_down: Linear,      // (dim, ffn_dim)
    // Gemma only:
    pub q_norm: Option<Vec<f32>>,         // (head_dim) RMSNorm of each query head
    pub k_norm: Option<Vec<f32>>,         // (head_dim) RMSNorm of each key head
    pub post_attn_norm: Option<Vec<f32>>, // (dim) RMSNorm of the attention output
    pub post_ffn_norm: Option<Vec<f32>>,  // (dim) RMSNorm of the FFN output
}

/// All weights, borrowed from the file mapping where the format allows.
pub struct Weights {
    pub token_embd: TensorView, // (vocab, dim); rows dequantised on lookup
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>, // (dim)
    pub output: Linear,        // (vocab, dim); the token embedding when tied
}

/// A loaded model: configuration, weights and kernels. Immutable and
/// `Send + Sync`; each request runs in its own [`Session`].
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    pub options: ModelOptions,
    /// The sparse FFN, when running with a sparsity sidecar.
    pub sparse: Option<SparseFfn>,
    rope: RopeTable,
    /// The local layers' RoPE (their own base), with a sliding window.
    rope_local: Option<RopeTable>,
    /// The sparse output head for next-token logits ([`Model::set_sparse_head`]).
    pub head: Option<SparseHead>,
    /// Under a memory budget: what is resident and what is streamed.
    pub memory: Option<MemoryPlan>,
}

impl Model {
    /// Binds every weight to a kernel chosen by `registry`.
    pub fn load(loader: &dyn Loader, registry: &KernelRegistry, options: ModelOptions) -> Result<Self> {
        let requantized;
        let loader = match options.quantize {
            // Quantised copies live in memory: a budget streams file bytes.
            Some(q) if options.mem_budget.is_some() => {
                let d = format!("quantising to {} on load is not supported with a memory budget yet", q.name());
                return Err(Error::InvalidArgument(d));
            }
            Some(q) => {
                requantized = Requantized::new(loader, q);
                &requantized as &dyn Loader
            }
            None => loader,
        };
        let c = loader.config()?;
        options.check(&c)?;
        if options.sparsity.is_some() && c.ffn_act != FfnAct::Silu {
            return Err(Error::InvalidArgument(format!(
                "{}: the sparse FFN is not supported for {:?} models yet (its predictors and sidecars assume a \
                 SwiGLU FFN); run without --sparsity",
                loader.path().display(),
                c.arch
            )));
        }
        let (dim, q_dim, kv_dim) = (c.dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let linear = |name: &str, rows, cols| Linear::load(loader, registry, options.precision, name, rows, cols);

        let token_embd = loader.tensor("token_embd.weight")?;
        check_dims(loader, &token_embd, &[dim, c.vocab_size])?;
        // `n_layers` was checked against the blocks present (ModelConfig).
        let mut layers = Vec::new();
        layers
            .try_reserve_exact(c.n_layers)
            .map_err(|e| Error::InvalidArgument(format!("{} layers: {e}", c.n_layers)))?;
        for l in 0..c.n_layers {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            let gemma_norm = |name: &str, len| c.is_gemma().then(|| load_vector(loader, &p(name), len)).transpose();
            layers.push(Layer {
                attn_norm: load_vector(loader, &p("attn_norm"), dim)?,
                wq: linear(&p("attn_q"), q_dim, dim)?,
                wk: linear(&p("attn_k"), kv_dim, dim)?,
                wv: linear(&p("attn_v"), kv_dim, dim)?,
                wo: linear(&p("attn_output"), dim, q_dim)?,
                ffn_norm: load_vector(loader, &p("ffn_norm"), dim)?,
                w_gate: linear(&p("ffn_gate"), c.ffn_dim, dim)?,
                w_up: linear(&p("ffn_up"), c.ffn_dim, dim)?,
                w_down: linear(&p("ffn_down"), dim, c.ffn_dim)?,
                q_norm: gemma_norm("attn_q_norm", c.head_dim)?,
                k_norm: gemma_norm("attn_k_norm", c.head_dim)?,
                post_attn_norm: gemma_norm("post_attention_norm", dim)?,
                post_ffn_norm: gemma_norm("post_ffw_norm", dim)?,
            });
        }
        let output_norm = load_vector(loader, "output_norm.weight", dim)?;
        let output_name = if c.tied_embeddings { "token_embd.weight" } else { "output.weight" };
        let output = linear(output_name, c.vocab_size, dim)?;
        tracing::debug!(layers = c.n_layers, output = output.kernel_name(), "model loaded");

        // The AXPYs follow the model's precision, as the dense kernels'
        // activations do.
        // The AXPYs follow the model's precision, as the dense kernels'
        // activations do: exact in precise mode, integer otherwise.
        let axpy =
            if options.precision == Precision::Precise { sparse::AxpyMode::Exact } else { sparse::AxpyMode::Int8 };
        // Under a memory budget a sparse FFN is served from its bundle,
        // with a share of the budget.
        let split = memory::split_budget(&c, &options, &layers, &output)?;
        let sparsity = match &split {
            Some((o, _)) => Some(o),
            None => options.sparsity.as_ref(),
        };
        let mut sparse = match sparsity {
            Some(o) if o.ffn_budget_bytes.is_some() => {
                // Under a memory budget the FFN matrices are read once, to
                // write the bundle (if missing), and their pages released:
                // no neuron-major copy, no dense read at run time.
                let id = ModelId::of(&c, loader)?;
                let src: Vec<_> = layers
                    .iter()
                    .map(|l| sparse::bundle::FfnSource {
                        gate: (l.w_gate.desc.wtype, l.w_gate.w.bytes()),
                        up: (l.w_up.desc.wtype, l.w_up.w.bytes()),
                        down: (l.w_down.desc.wtype, l.w_down.w.bytes()),
                        mapped: l.w_gate.w.is_mapped() && l.w_up.w.is_mapped() && l.w_down.w.is_mapped(),
                    })
                    .collect();
                let built = sparse::build_budgeted(o, registry, &id, &src, dim, c.ffn_dim);
                Some(built.map_err(|e| match (&split, options.mem_budget) {
                    (Some(_), Some(b)) => Error::InvalidArgument(format!(
                        "{e} (the FFN's share of the memory budget of {:.1} MB: raise --mem-budget-mb, or give \
                         the FFN its own with --ffn-budget-mb)",
                        b as f64 / 1e6
                    )),
                    _ => e.into(),
                })?)
            }
            Some(o) => {
                let id = ModelId::of(&c, loader)?;
                let weights: Vec<_> = layers
                    .iter()
                    .map(|l| sparse::LayerWeights {
                        down: (l.w_down.desc.wtype, l.w_down.w.bytes()),
                        // The pack that serves the dense product serves the
                        // sparse one too, if it has the column form.
                        down_pack: l.w_down.columns_kernel(registry, axpy.act()),
                        wo: (l.wo.desc.wtype, l.wo.w.bytes()),
                        wo_pack: l.wo.columns_kernel(registry, axpy.act()),
                    })
                    .collect();
                // A pack's predictor, built for this model.
                let pack_predictor = match &o.pack_predictor {
                    Some(name) => {
                        let spec = PredictorSpec {
                            arch: id.arch.as_str().into(),
                            model_dir: loader
                                .path()
                                .parent()
                                .map(|d| d.display().to_string())
                                .unwrap_or_default()
                                .into(),
                            n_layers: c.n_layers as u32,
                            hidden_dim: dim as u32,
                            ffn_dim: c.ffn_dim as u32,
                        };
                        Some(registry.predictor(name, &spec)?)
                    }
                    None => None,
                };
                let (q_dim, threads) = (c.n_heads * c.head_dim, options.threads.max(1));
                Some(sparse::build(o, pack_predictor, registry, &id, weights, dim, q_dim, c.ffn_dim, axpy, threads)?)
            }
            None => None,
        };
        if let Some(sp) = &mut sparse {
            sp.axpy = axpy;
        }
        let rope = RopeTable::new(c.head_dim, c.rope_theta, options.ctx)?;
        let rope_local = c.sliding_window.map(|w| RopeTable::new(c.head_dim, w.rope_theta, options.ctx)).transpose()?;
        let mut weights = Weights { token_embd, layers, output_norm, output };
        // Under a memory budget: what stays in memory, what is read per step.
        let memory = match (options.mem_budget, &split) {
            (Some(_), Some((_, rest))) => Some(Self::place(&mut weights, &c, &options, *rest, true)?),
            (Some(b), None) => Some(Self::place(&mut weights, &c, &options, b, false)?),
            (None, _) => None,
        };
        Ok(Self { weights, config: c, options, sparse, rope, rope_local, head: None, memory })
    }

    /// Runs `tokens` through the model at the session's next positions and
    /// appends them to its KV cache. Afterwards the final-normed hidden
    /// states of these tokens are ready for [`Model::logits`]. A model with
    /// local attention takes them in steps of at most [`UBATCH`], one under a
    /// memory budget in steps of [`BUDGET_STEP`] (which bounds its buffers).
    pub fn forward(&self, s: &mut Session, tokens: &[u32]) -> Result<()> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::InvalidArgument("forward needs at least one token".into()));
        }
        if s.kv.pos() + n > s.kv.ctx() {
            return Err(Error::ContextOverflow { needed: s.kv.pos() + n, ctx: s.kv.ctx() });
        }
        self.check_tokens(tokens)?;
        grow(&mut s.hidden, n * self.config.dim);
        s.last_tokens = n;
        let step = match (&self.memory, self.config.sliding_window) {
            (Some(_), _) => BUDGET_STEP,
            (None, Some(_)) => UBATCH,
            (None, None) => n,
        };
        // The session's own cache is lent to the step (which takes the
        // caches of a batch's sequences apart from the session's buffers).
        // A call of several tokens is a prompt's: the kernels may take
        // their prompt path (`forward_batch` callers say so per sequence).
        let mut kv = std::mem::take(&mut s.kv);
        let prompt = [n > 1];
        let result = tokens
            .chunks(step)
            .enumerate()
            .try_for_each(|(i, part)| self.forward_step(s, &mut [&mut kv], part, &[part.len()], &prompt, i * step));
        s.kv = kv;
        s.scratch.roles.clear();
        result
    }

    /// Every token id must index the vocabulary.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(tok) => {
                Err(Error::InvalidArgument(format!("token id {tok} is outside the vocabulary (size {vocab})")))
            }
            None => Ok(()),
        }
    }

    /// One pass through the layers of `tokens`: the first `lens[0]` of
    /// sequence `seqs[0]`, the next `lens[1]` of `seqs[1]`, and so on, each
    /// at its sequence's next positions. Their final-normed hidden states
    /// go to `s.hidden` from row `row`. The rows of sequences marked
    /// `prompt` may run on the kernels' prompt path.
    fn forward_step(
        &self,
        s: &mut Session,
        seqs: &mut [&mut KvCache],
        tokens: &[u32],
        lens: &[usize],
        prompt: &[bool],
        row: usize,
    ) -> Result<()> {
        let c = &self.config;
        let n = tokens.len();
        let (dim, hd, q_dim, kv_dim) = (c.dim, c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        grow(&mut s.x, n * dim);
        grow(&mut s.xn, n * dim);
        grow(&mut s.q, n * q_dim);
        grow(&mut s.k, n * kv_dim);
        grow(&mut s.v, n * kv_dim);
        grow(&mut s.att, n * q_dim);
        grow(&mut s.gate, n * c.ffn_dim);
        grow(&mut s.up, n * c.ffn_dim);
        grow(&mut s.tmp, n * dim);
        // Each row's sequence and absolute position.
        s.rows.clear();
        for (seq, (kv, &len)) in seqs.iter().zip(lens).enumerate() {
            s.rows.extend((0..len).map(|o| RowPos { seq, pos: kv.pos() + o }));
        }
        s.at_start = s.rows.first().is_some_and(|r| r.pos == 0);
        s.scratch.set_roles(lens, prompt);

        // Token embeddings into the residual stream (Gemma: times √dim).
        let embd = &self.weights.token_embd;
        let row_bytes = embd.ty.row_bytes(dim)?;
        // With a tied head re-ordered by the sparse head, its copy serves
        // the rows too, so the model file's head pages stay untouched.
        let copy = self.head.as_ref().filter(|_| c.tied_embeddings);
        for (t, &tok) in tokens.iter().enumerate() {
            let id = tok as usize;
            let from_storage = self.embedding_row_from_storage(s, id, row_bytes)?;
            let src = match copy.and_then(|h| h.row_bytes(tok)) {
                _ if from_storage => &s.embd_row[..],
                Some(row) => row,
                None => &embd.data.bytes()[id * row_bytes..(id + 1) * row_bytes],
            };
            dequantize_row(embd.ty, src, &mut s.x[t * dim..(t + 1) * dim])?;
        }
        if c.is_gemma() {
            let scale = (dim as f32).sqrt();
            s.x[..n * dim].iter_mut().for_each(|v| *v *= scale);
        }

        let neox = c.rope_style == RopeStyle::NeoX;
        for (l, layer) in self.weights.layers.iter().enumerate() {
            // Attention RMSNorm.
            math::rms_norm_rows(&s.x, &layer.attn_norm, c.rms_eps, &mut s.xn, n);
            // Q, K, V projections.
            layer.wq.forward(&s.pool, &s.xn, n, &mut s.q, &mut s.scratch)?;
            layer.wk.forward(&s.pool, &s.xn, n, &mut s.k, &mut s.scratch)?;
            layer.wv.forward(&s.pool, &s.xn, n, &mut s.v, &mut s.scratch)?;
            // QK-norm (Gemma): RMSNorm of every query and key head.
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                s.q[..n * q_dim].chunks_exact_mut(hd).for_each(|h| math::rms_norm_in_place(h, qn, c.rms_eps));
                s.k[..n * kv_dim].chunks_exact_mut(hd).for_each(|h| math::rms_norm_in_place(h, kn, c.rms_eps));
            }
            // RoPE on q and k at their absolute positions (a local layer
            // with its own base).
            let local = c.sliding_window.is_some_and(|w| w.is_local(l));
            let rope = if local { self.rope_local.as_ref().unwrap_or(&self.rope) } else { &self.rope };
            for (t, r) in s.rows.iter().enumerate() {
                for h in s.q[t * q_dim..(t + 1) * q_dim].chunks_exact_mut(hd) {
                    rope.apply(h, r.pos, neox);
                }
                for h in s.k[t * kv_dim..(t + 1) * kv_dim].chunks_exact_mut(hd) {
                    rope.apply(h, r.pos, neox);
                }
            }
            // Append k and v to each row's sequence cache.
            for (t, r) in s.rows.iter().enumerate() {
                let (k, v) = (&s.k[t * kv_dim..(t + 1) * kv_dim], &s.v[t * kv_dim..(t + 1) * kv_dim]);
                seqs[r.seq].store(l, r.pos, k, v);
            }
            // Causal multi-head attention, each row over its sequence's
            // cache (a local layer over its window only).
            let attention = attend::Attention {
                pool: &s.pool,
                seqs,
                rows: &s.rows,
                roles: &s.scratch.roles,
                q: &s.q[..n * q_dim],
                att: &mut s.att,
                scores: &mut s.scores,
                score_len: s.ctx,
                items: &mut s.attn_items,
            };
            self.attention(attention, l, local);
            // Output projection (input-sparse with attention thresholds),
            // its RMSNorm (Gemma), and residual.
            self.attn_output(s, l, n)?;
            self.post_norm(s, layer.post_attn_norm.as_deref(), n);

            // FFN RMSNorm.
            math::rms_norm_rows(&s.x, &layer.ffn_norm, c.rms_eps, &mut s.xn, n);
            // Gated FFN: down(act(gate(x)) * up(x)) with SiLU (SwiGLU) or
            // tanh-GELU (GeGLU); sparse when a sidecar is loaded (only the
            // neurons kept per token).
            if let Some(sp) = &self.sparse {
                self.sparse_ffn(s, l, n, sp)?;
            } else {
                layer.w_gate.forward(&s.pool, &s.xn, n, &mut s.gate, &mut s.scratch)?;
                layer.w_up.forward(&s.pool, &s.xn, n, &mut s.up, &mut s.scratch)?;
                if let Some(probe) = s.ffn_probe.as_mut() {
                    probe(l, &s.xn[..n * dim], &s.gate[..n * c.ffn_dim], &s.up[..n * c.ffn_dim]);
                }
                match c.ffn_act {
                    FfnAct::Silu => math::swiglu(&mut s.gate[..n * c.ffn_dim], &s.up[..n * c.ffn_dim]),
                    FfnAct::GeluTanh => math::geglu(&mut s.gate[..n * c.ffn_dim], &s.up[..n * c.ffn_dim]),
                }
                layer.w_down.forward(&s.pool, &s.gate, n, &mut s.tmp, &mut s.scratch)?;
            }
            // Its RMSNorm (Gemma), and residual.
            self.post_norm(s, layer.post_ffn_norm.as_deref(), n);
        }

        // Final RMSNorm; logits are computed on request.
        let out = &mut s.hidden[row * dim..(row + n) * dim];
        math::rms_norm_rows(&s.x, &self.weights.output_norm, c.rms_eps, out, n);
        for (kv, &len) in seqs.iter_mut().zip(lens) {
            kv.advance(len);
        }
        Ok(())
    }

    /// Adds the block's output `s.tmp` to the residual stream, through the
    /// RMSNorm `norm` first when there is one (Gemma's post-norms).
    fn post_norm(&self, s: &mut Session, norm: Option<&[f32]>, n: usize) {
        let dim = self.config.dim;
        match norm {
            Some(w) => {
                math::rms_norm_rows(&s.tmp, w, self.config.rms_eps, &mut s.xn, n);
                add(&mut s.x[..n * dim], &s.xn[..n * dim]);
            }
            None => add(&mut s.x[..n * dim], &s.tmp[..n * dim]),
        }
    }

    /// Logits of tokens `rows` (indices into the last `forward` call's
    /// tokens), `rows.len() x vocab`, row-major.
    pub fn logits<'s>(&self, s: &'s mut Session, rows: std::ops::Range<usize>) -> Result<&'s [f32]> {
        let (dim, vocab) = (self.config.dim, self.config.vocab_size);
        let n = rows.len();
        grow(&mut s.logits, n * vocab);
        let x = &s.hidden[rows.start * dim..rows.end * dim];
        self.weights.output.forward(&s.pool, x, n, &mut s.logits, &mut s.scratch)?;
        Ok(&s.logits[..n * vocab])
    }

    /// The logits for choosing the next token: those of the last token of
    /// the last [`Model::forward`] call, from the sparse head when one is
    /// set (exact for its probed rows, see [`crate::head`]), else the
    /// dense head's. [`Model::logits`] is always dense.
    pub fn next_token_logits<'s>(&self, s: &'s mut Session) -> Result<&'s [f32]> {
        let Some(head) = &self.head else {
            let last = s.last_tokens - 1;
            return self.logits(s, last..last + 1);
        };
        let (dim, vocab) = (self.config.dim, self.config.vocab_size);
        grow(&mut s.logits, vocab);
        let x = &s.hidden[(s.last_tokens - 1) * dim..s.last_tokens * dim];
        head.logits(&self.weights.output, &s.pool, x, &mut s.logits[..vocab], &mut s.head, &mut s.scratch)?;
        Ok(&s.logits[..vocab])
    }

    /// Under a memory budget, takes the dense head out of the plan (its
    /// memory is freed; dense logits read it through the file mapping) ahead
    /// of loading a sparse head's index, so the index's tables take the
    /// dense head's room instead of sitting on top of a full budget.
    /// [`Model::set_sparse_head`] does it too; call this first when the
    /// index is loaded after the model.
    pub fn release_dense_head(&mut self) {
        if let Some(plan) = &mut self.memory {
            plan.release_output(&mut self.weights);
        }
    }

    /// Uses `index` as the sparse output head for next-token logits, with
    /// `probes` clusters per token (`None`: back to the dense head).
    pub fn set_sparse_head(
        &mut self,
        index: Option<HeadIndex>,
        probes: usize,
        registry: &KernelRegistry,
    ) -> Result<()> {
        // Under a memory budget the dense head leaves the streamed cycle
        // (next-token logits come from the sparse head) before the sparse
        // head is built, so its tables take the dense head's room; what is
        // left of that room then goes to the rest.
        if index.is_some() {
            self.release_dense_head();
        }
        self.head = index
            .map(|i| SparseHead::new(&self.config, &self.weights.output, i, probes, registry, self.options.precision))
            .transpose()?;
        if let (Some(head), Some(plan)) = (&self.head, &mut self.memory) {
            plan.promote(&mut self.weights, head.resident_bytes() as u64)?;
        }
        Ok(())
    }

    /// Runs `tokens` and returns the logits of the last one.
    pub fn forward_last<'s>(&self, s: &'s mut Session, tokens: &[u32]) -> Result<&'s [f32]> {
        self.forward(s, tokens)?;
        self.logits(s, tokens.len() - 1..tokens.len())
    }

    /// Every matmul with its kernel, for reports.
    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.weights
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain(std::iter::once(&self.weights.output))
            .chain(self.head.as_ref().map(|h| &h.centroids))
    }

    /// One entry per distinct operation (first use order): the kernel
    /// chosen for it, why, and the alternatives.
    pub fn kernel_choices(&self) -> Vec<&Linear> {
        let mut seen = std::collections::HashSet::new();
        self.linears().filter(|l| seen.insert(l.desc)).collect()
    }

    /// Bytes of weights read to decode one token (all matmuls plus one
    /// embedding row).
    pub fn bytes_per_token(&self) -> usize {
        self.linears().map(Linear::weight_bytes).sum()
    }

    /// The final-normed hidden states (`rows.len() x dim`, row-major) of
    /// tokens `rows` (indices into the last [`Model::forward`] call's
    /// tokens): the input of the output projection. `rows` must lie within
    /// that call's tokens (past them: stale values, or a panic past the
    /// buffer).
    pub fn hidden_states<'s>(&self, s: &'s Session, rows: std::ops::Range<usize>) -> &'s [f32] {
        let dim = self.config.dim;
        &s.hidden[rows.start * dim..rows.end * dim]
    }
}
