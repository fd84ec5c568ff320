//! The Llama-family transformer (Llama, SmolLM, Mistral, Qwen2).
//!
//! Reads top to bottom: [`Weights`] (every tensor with its shape), the
//! per-request [`Session`] (KV cache and activation buffers), [`Model::load`]
//! and [`Model::forward`], one comment per step. Conventions follow HF
//! `LlamaForCausalLM` and llama.cpp's `llm_build_llama`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use spinfer_kernels::KernelError;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::SyncPtr;
use spinfer_kernels::pool::{ThreadPool, chunk};
use spinfer_kernels::split::split_hi_lo;

use super::config::{ModelConfig, RopeStyle};
use super::math::{self, RopeTable};
use super::{add, check_dims, load_vector};
use crate::loader::Loader;
use crate::registry::{Choice, KernelRegistry};
use crate::sparse::{self, ModelId, SparseFfn, SparsityOptions, SparsityStats};
use crate::tensor::{TensorData, TensorView};
use crate::{Error, Result};
use spinfer_plugin_api::PredictorSpec;

mod sentence_ffn;
mod sparse_attn;
mod sparse_ffn;

/// How activations meet quantised weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Integer dot products on two 8-bit activation planes (`x = hi + lo`,
    /// see `spinfer_kernels::split`): near-f32 accuracy, weights streamed
    /// once. The default.
    #[default]
    Fast,
    /// Integer dot products on one 8-bit activation plane: llama.cpp's
    /// numerics, the fastest prefill, max logit error ~1 on SmolLM2.
    Int8,
    /// f32 activations times weights dequantised on the fly: the function
    /// PyTorch computes on the dequantised model.
    Precise,
}

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
}

/// Most worker threads a session may start (`--threads`, `[model] threads`).
pub const MAX_THREADS: usize = 1024;

impl ModelOptions {
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
        let needed = session_bytes(c, ctx, self.threads.max(1)).ok_or_else(|| {
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

/// Bytes a session of `ctx` positions and `threads` threads holds for the
/// model `c` beyond its activations: the KV cache (`2 x layers x ctx x
/// kv_dim` f32), the attention scores (`threads x ctx` f32) and the
/// model's RoPE table (`ctx x head_dim` f32). `None` if it overflows.
pub fn session_bytes(c: &ModelConfig, ctx: usize, threads: usize) -> Option<u64> {
    let f32s = |a: usize, b: usize| (a as u64).checked_mul(b as u64)?.checked_mul(4);
    let kv = f32s(c.n_layers.checked_mul(c.n_kv_heads)?.checked_mul(c.head_dim)?, ctx)?.checked_mul(2)?;
    let total = kv.checked_add(f32s(threads, ctx)?)?.checked_add(f32s(ctx, c.head_dim)?)?;
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
        }
    }
}

/// A weight matrix bound to the kernel that multiplies by it.
pub struct Linear {
    /// Canonical tensor name, for errors and reports.
    pub name: String,
    w: TensorData,
    pub desc: MatmulDesc,
    kernel: Arc<dyn MatmulKernel>,
    /// The built-in kernel that takes over if a pack kernel fails.
    fallback: Option<Arc<dyn MatmulKernel>>,
    /// Set once the pack kernel has failed: later calls go straight to the
    /// fallback.
    failed: AtomicBool,
    pub provider: String,
    pub choice: Choice,
    /// The other candidates and their recorded decode medians (ns).
    pub alternatives: Vec<(String, Option<u64>)>,
    bias: Option<Vec<f32>>,
    /// Feed activations as two 8-bit planes (see [`Precision::Fast`]).
    two_planes: bool,
    /// The kernel of the gathered-row products (the sparse gate and up
    /// projections read their kept rows in place): the gathered-row form
    /// of `kernel` when its pack offers one, else the built-in kernel
    /// ([`KernelRegistry::resolve_rows`]).
    rows_kernel: Option<Arc<dyn MatmulKernel>>,
    /// Who provides `rows_kernel`.
    pub rows_provider: String,
    /// For a pack's `rows_kernel`: the built-in kernel that takes over if
    /// it fails.
    rows_fallback: Option<Arc<dyn MatmulKernel>>,
    /// Set once the pack's gathered-row kernel has failed.
    rows_failed: AtomicBool,
}

/// One matmul call: `(x, n tokens, out, kernel scratch)`.
type RunFn<'a> = dyn Fn(&[f32], usize, &mut [f32], &mut Vec<u8>) -> Result<()> + 'a;

/// A hook called in each dense FFN with the layer, its input (`n × dim`)
/// and its gate and up projections (`n × ffn_dim` each), before the
/// activation.
pub type FfnProbe = Box<dyn FnMut(usize, &[f32], &[f32], &[f32]) + Send>;

/// A hook called in each layer with the layer and the attention output
/// (`n × n_heads·head_dim`), the input of the output projection.
pub type AttnProbe = Box<dyn FnMut(usize, &[f32]) + Send>;

/// Reusable buffers of the matmul calls.
#[derive(Default)]
pub(crate) struct Scratch {
    /// The kernels' quantised activations.
    bytes: Vec<u8>,
    /// Two-plane activations `[hi; lo]` (2n, cols).
    planes: Vec<f32>,
    /// Their outputs (2n, rows).
    planes_out: Vec<f32>,
    /// Rows gathered for a sparse product.
    gathered: Vec<u8>,
}

impl Linear {
    fn load(
        loader: &dyn Loader,
        registry: &KernelRegistry,
        precision: Precision,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let t = loader.tensor(name)?;
        check_dims(loader, &t, &[cols, rows])?;
        let act = match precision {
            Precision::Fast | Precision::Int8 => ActType::fast_for(t.ty),
            Precision::Precise => ActType::F32,
        };
        let two_planes = precision == Precision::Fast && act != ActType::F32;
        let desc = MatmulDesc { wtype: t.ty, act, rows, cols };
        let r = registry.resolve(&desc)?;
        let (rows_provider, rows_kernel) = registry.resolve_rows(&desc, &r).unzip();
        let rows_fallback = (rows_provider.as_deref().is_some_and(|p| p != crate::registry::BUILTIN))
            .then(|| crate::registry::builtin_kernel(&desc).ok().map(Arc::from))
            .flatten();
        let bias_name = name.replace(".weight", ".bias");
        let bias = if bias_name != name && loader.has_tensor(&bias_name) {
            Some(load_vector(loader, &bias_name, rows)?)
        } else {
            None
        };
        Ok(Self {
            name: name.to_string(),
            w: t.data,
            desc,
            kernel: r.kernel,
            fallback: r.fallback,
            failed: AtomicBool::new(false),
            provider: r.provider,
            choice: r.choice,
            alternatives: r.alternatives,
            rows_kernel,
            rows_provider: rows_provider.unwrap_or_default(),
            rows_fallback,
            rows_failed: AtomicBool::new(false),
            bias,
            two_planes,
        })
    }

    /// `out[t, :] = W · x[t, :] (+ b)` for `n` tokens.
    fn forward(&self, pool: &ThreadPool, x: &[f32], n: usize, out: &mut [f32], scratch: &mut Scratch) -> Result<()> {
        let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>| {
            let w = self.w.bytes();
            let err = |k: &dyn MatmulKernel, source| Error::Kernel { kernel: k.name().to_string(), source };
            match &self.fallback {
                Some(fb) if self.failed.load(Ordering::Relaxed) => {
                    fb.run(pool, w, x, n, out, bytes).map_err(|e| err(&**fb, e))
                }
                Some(fb) => self.kernel.run(pool, w, x, n, out, bytes).or_else(|e| {
                    // A failing pack disables itself; its operations move to
                    // the built-in kernels for the rest of the process.
                    tracing::error!(tensor = %self.name, kernel = self.kernel.name(), "{e}; falling back to {}", fb.name());
                    self.failed.store(true, Ordering::Relaxed);
                    fb.run(pool, w, x, n, out, bytes).map_err(|e| err(&**fb, e))
                }),
                None => self.kernel.run(pool, w, x, n, out, bytes).map_err(|e| err(&*self.kernel, e)),
            }
        };
        let rows = self.desc.rows;
        self.matmul(&run, rows, x, n, &mut out[..n * rows], scratch)?;
        if let Some(b) = &self.bias {
            for row in out[..n * rows].chunks_exact_mut(rows) {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            }
        }
        Ok(())
    }

    /// The gathered-row product: `out[t, k] = W[idx[k], :] · x[t, :] (+ b)`,
    /// only the rows `idx` (the sparse gate and up projections). The
    /// built-in kernel of the same operation reads the rows in place
    /// (`MatmulKernel::run_rows`), so the numbers equal the dense product's
    /// rows; a kernel that cannot address single rows gets a compact copy.
    pub(crate) fn forward_rows(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        idx: &[u32],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let k = idx.len();
        if k == 0 {
            return Ok(());
        }
        let pack_failed = self.rows_failed.load(Ordering::Relaxed);
        let kernels = [(!pack_failed).then_some(self.rows_kernel.as_ref()).flatten(), self.rows_fallback.as_ref()];
        for kernel in kernels.into_iter().flatten() {
            let w = self.w.bytes();
            let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>| {
                kernel
                    .run_rows(pool, w, idx, x, n, out, bytes)
                    .map_err(|source| Error::Kernel { kernel: kernel.name().into(), source })
            };
            match self.matmul(&run, k, x, n, &mut out[..n * k], scratch) {
                Ok(()) => {
                    self.add_row_bias(idx, n, out);
                    return Ok(());
                }
                Err(Error::Kernel { source: KernelError::NotOffered { .. }, .. }) => break,
                // A pack's kernel failed: the built-in one from now on
                // (the pack kernel logged why).
                Err(Error::Kernel { source: KernelError::Pack { .. }, .. }) if self.rows_fallback.is_some() => {
                    self.rows_failed.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let row_bytes = self.w.bytes().len() / self.desc.rows;
        let mut rows = std::mem::take(&mut scratch.gathered);
        spinfer_kernels::sparse::gather_rows(pool, self.w.bytes(), row_bytes, idx, &mut rows)?;
        let r = self.forward_gathered(pool, x, n, &rows, idx, out, scratch);
        scratch.gathered = rows;
        r
    }

    /// [`Linear::forward_rows`] on rows already gathered: `rows` holds
    /// `W[idx[k], :]` for each `k`, in this matrix's format (e.g. from the
    /// FFN bundle under a memory budget; this matrix's own bytes are not
    /// read).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_gathered(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        rows: &[u8],
        idx: &[u32],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let k = idx.len();
        if k == 0 {
            return Ok(());
        }
        let desc = MatmulDesc { rows: k, ..self.desc };
        let kernel = crate::registry::builtin_kernel(&desc)?;
        let rows = &rows[..desc.wtype.row_bytes(desc.cols)? * k];
        let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>| {
            kernel
                .run(pool, rows, x, n, out, bytes)
                .map_err(|source| Error::Kernel { kernel: kernel.name().into(), source })
        };
        self.matmul(&run, k, x, n, &mut out[..n * k], scratch)?;
        self.add_row_bias(idx, n, out);
        Ok(())
    }

    /// Adds the bias of rows `idx` to `out` (`n × idx.len()`).
    fn add_row_bias(&self, idx: &[u32], n: usize, out: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in out[..n * idx.len()].chunks_exact_mut(idx.len()) {
                for (o, &j) in row.iter_mut().zip(idx) {
                    *o += b[j as usize];
                }
            }
        }
    }

    /// Runs `run` on `x` (n tokens) into `out` (n × rows), as two 8-bit
    /// planes in fast mode.
    fn matmul(
        &self,
        run: &RunFn,
        rows: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let cols = self.desc.cols;
        let x = &x[..n * cols];
        if !self.two_planes {
            return run(x, n, out, &mut scratch.bytes);
        }
        // Rows [hi; lo] as one batch of 2n tokens: the weights are streamed
        // once, and W·x = W·hi + W·lo.
        grow(&mut scratch.planes, 2 * n * cols);
        grow(&mut scratch.planes_out, 2 * n * rows);
        let (hi, lo) = scratch.planes[..2 * n * cols].split_at_mut(n * cols);
        split_hi_lo(self.desc.act, x, hi, lo)?;
        run(&scratch.planes[..2 * n * cols], 2 * n, &mut scratch.planes_out[..2 * n * rows], &mut scratch.bytes)?;
        let (a, b) = scratch.planes_out[..2 * n * rows].split_at(n * rows);
        for ((o, &u), &v) in out.iter_mut().zip(a).zip(b) {
            *o = u + v;
        }
        Ok(())
    }

    pub fn kernel_name(&self) -> &str {
        self.kernel.name()
    }

    /// The weight bytes, in the file's format.
    pub(crate) fn raw_weights(&self) -> &[u8] {
        self.w.bytes()
    }

    /// Whether the chosen (pack) kernel failed and the built-in fallback
    /// now serves this matrix.
    pub fn fell_back(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Bytes of weights read per token.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes().len()
    }
}

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
}

/// Per-request state: the KV cache, the position, and reusable activation
/// buffers (grown on demand, never shrunk, so decode allocates nothing).
pub struct Session {
    pool: ThreadPool,
    /// Number of tokens already in the cache.
    pos: usize,
    ctx: usize,
    kv_dim: usize,
    key_cache: Vec<f32>,   // (layer, ctx, kv_dim)
    value_cache: Vec<f32>, // (layer, ctx, kv_dim)
    x: Vec<f32>,           // residual stream (n, dim)
    xn: Vec<f32>,          // normalised input of the current step (n, dim)
    q: Vec<f32>,           // (n, n_heads * head_dim)
    k: Vec<f32>,           // (n, kv_dim)
    v: Vec<f32>,           // (n, kv_dim)
    att: Vec<f32>,         // attention output (n, n_heads * head_dim)
    scores: Vec<f32>,      // per-thread attention scores (threads, ctx)
    gate: Vec<f32>,        // (n, ffn_dim)
    up: Vec<f32>,          // (n, ffn_dim)
    tmp: Vec<f32>,         // projection output before the residual add (n, dim)
    logits: Vec<f32>,      // (rows requested, vocab)
    scratch: Scratch,      // matmul buffers
    sparse: SparseScratch, // sparse FFN buffers and counters
    /// Called in each dense FFN with `(layer, input, gate, up)`
    /// (calibration collects its statistics here).
    ffn_probe: Option<FfnProbe>,
    /// Called in each layer with `(layer, attention output)`.
    attn_probe: Option<AttnProbe>,
}

/// Buffers and counters of the sparse FFN.
#[derive(Default)]
struct SparseScratch {
    idx: Vec<u32>,                             // kept neurons of the current token, ascending
    pred: Vec<u32>,                            // neurons the low-rank predictor keeps (before the gate)
    mask: Vec<u8>,                             // a pack predictor's mask (ffn_dim)
    measure_truth: bool,                       // compute the full gate to judge the predictor
    truth: Vec<f32>,                           // |silu(gate)| in full (ffn_dim), when measuring
    mags: Vec<f32>,                            // |activations| (top-K selection)
    up: Vec<f32>,                              // up projection of the kept neurons (k)
    h: Vec<f32>,                               // silu(gate) * up of the kept neurons (k)
    keep: Vec<u32>,                            // positions in `pred` of the kept neurons (under a budget)
    gathered: sparse::bundle::Gathered,        // records from the FFN bundle (under a budget)
    sentence: Vec<sentence_ffn::SentenceMask>, // per layer: this request's mask (sentence-level)
    stats: SparsityStats,
}

impl Session {
    /// Tokens currently in the KV cache.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// The session's context size.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Forgets the cached tokens (the buffers are kept).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Drops cached tokens after `pos` (e.g. to re-run a suffix).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// What the sparse FFN did in this session (empty when dense).
    pub fn sparsity_stats(&self) -> &SparsityStats {
        &self.sparse.stats
    }

    /// Also computes, for the predictors that choose before the gate
    /// (low-rank, pack, sentence-level), every token's full gate and counts
    /// how many truly active neurons (`|silu(gate)|` above the sidecar's
    /// gate threshold) the predictor selected: `SparsityStats::recall` and
    /// `precision`. Costs a dense gate projection per token and layer
    /// (`generate --stats`); never changes the output.
    pub fn set_measure_recall(&mut self, on: bool) {
        self.sparse.measure_truth = on;
    }

    /// Resets the sparse FFN counters.
    pub fn reset_sparsity_stats(&mut self) {
        self.sparse.stats.layers.iter_mut().for_each(|c| *c = Default::default());
        self.sparse.stats.cache = Default::default();
    }

    /// Installs (or removes) a probe called in every dense FFN with
    /// `(layer, input, gate, up)` before the activation. Not called when
    /// the model runs sparse.
    pub fn set_ffn_probe(&mut self, probe: Option<FfnProbe>) {
        self.ffn_probe = probe;
    }

    /// Installs (or removes) a probe called in every layer with `(layer,
    /// attention output)` before the output projection.
    pub fn set_attn_probe(&mut self, probe: Option<AttnProbe>) {
        self.attn_probe = probe;
    }
}

impl Model {
    /// Binds every weight to a kernel chosen by `registry`.
    pub fn load(loader: &dyn Loader, registry: &KernelRegistry, options: ModelOptions) -> Result<Self> {
        let c = loader.config()?;
        options.check(&c)?;
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
            });
        }
        let output_norm = load_vector(loader, "output_norm.weight", dim)?;
        let output_name = if c.tied_embeddings { "token_embd.weight" } else { "output.weight" };
        let output = linear(output_name, c.vocab_size, dim)?;
        tracing::debug!(layers = c.n_layers, output = output.kernel_name(), "model loaded");

        // The AXPYs follow the model's precision, as the dense kernels'
        // activations do.
        let axpy = sparse::AxpyMode::for_precision(options.precision);
        let mut sparse = match &options.sparsity {
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
                Some(sparse::build_budgeted(o, registry, &id, &src, dim, c.ffn_dim)?)
            }
            Some(o) => {
                let id = ModelId::of(&c, loader)?;
                let weights: Vec<_> = layers
                    .iter()
                    .map(|l| sparse::LayerWeights {
                        down: (l.w_down.desc.wtype, l.w_down.w.bytes()),
                        // The pack that serves the dense product serves the
                        // sparse one too, if it has the column form.
                        down_pack: registry
                            .resolve_columns(&MatmulDesc { act: axpy.act(), ..l.w_down.desc }, &l.w_down.provider),
                        wo: (l.wo.desc.wtype, l.wo.w.bytes()),
                        wo_pack: registry.resolve_columns(&MatmulDesc { act: axpy.act(), ..l.wo.desc }, &l.wo.provider),
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
                Some(sparse::build(o, pack_predictor, &id, weights, dim, q_dim, c.ffn_dim, axpy, threads)?)
            }
            None => None,
        };
        if let Some(sp) = &mut sparse {
            sp.axpy = axpy;
        }
        let rope = RopeTable::new(c.head_dim, c.rope_theta, options.ctx)?;
        Ok(Self { weights: Weights { token_embd, layers, output_norm, output }, config: c, options, sparse, rope })
    }

    /// A fresh session with an empty KV cache of `options.ctx` positions.
    pub fn new_session(&self) -> Session {
        let c = &self.config;
        let kv_dim = c.n_kv_heads * c.head_dim;
        let ctx = self.options.ctx;
        let threads = self.options.threads.max(1);
        // The caches are zero-initialised allocations: the OS maps their
        // pages lazily, so memory is only committed for positions used.
        Session {
            pool: ThreadPool::new(threads),
            pos: 0,
            ctx,
            kv_dim,
            key_cache: vec![0.0; c.n_layers * ctx * kv_dim],
            value_cache: vec![0.0; c.n_layers * ctx * kv_dim],
            x: Vec::new(),
            xn: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            att: Vec::new(),
            scores: vec![0.0; threads * ctx],
            gate: Vec::new(),
            up: Vec::new(),
            tmp: Vec::new(),
            logits: Vec::new(),
            scratch: Scratch::default(),
            sparse: SparseScratch {
                stats: SparsityStats {
                    ffn_dim: c.ffn_dim,
                    attn_dim: c.n_heads * c.head_dim,
                    layers: vec![Default::default(); c.n_layers],
                    ..Default::default()
                },
                ..Default::default()
            },
            ffn_probe: None,
            attn_probe: None,
        }
    }

    /// Runs `tokens` through the model at the session's next positions and
    /// appends them to its KV cache. Afterwards the final-normed hidden
    /// states of these tokens are ready for [`Model::logits`].
    pub fn forward(&self, s: &mut Session, tokens: &[u32]) -> Result<()> {
        let c = &self.config;
        let n = tokens.len();
        if n == 0 {
            return Err(Error::InvalidArgument("forward needs at least one token".into()));
        }
        if s.pos + n > s.ctx {
            return Err(Error::ContextOverflow { needed: s.pos + n, ctx: s.ctx });
        }
        let (dim, hd, q_dim, kv_dim) = (c.dim, c.head_dim, c.n_heads * c.head_dim, s.kv_dim);
        grow(&mut s.x, n * dim);
        grow(&mut s.xn, n * dim);
        grow(&mut s.q, n * q_dim);
        grow(&mut s.k, n * kv_dim);
        grow(&mut s.v, n * kv_dim);
        grow(&mut s.att, n * q_dim);
        grow(&mut s.gate, n * c.ffn_dim);
        grow(&mut s.up, n * c.ffn_dim);
        grow(&mut s.tmp, n * dim);

        // Token embeddings into the residual stream.
        let embd = &self.weights.token_embd;
        let row_bytes = embd.ty.row_bytes(dim)?;
        for (t, &tok) in tokens.iter().enumerate() {
            let id = tok as usize;
            if id >= c.vocab_size {
                return Err(Error::InvalidArgument(format!(
                    "token id {tok} is outside the vocabulary (size {})",
                    c.vocab_size
                )));
            }
            let src = &embd.data.bytes()[id * row_bytes..(id + 1) * row_bytes];
            dequantize_row(embd.ty, src, &mut s.x[t * dim..(t + 1) * dim])?;
        }

        let neox = c.rope_style == RopeStyle::NeoX;
        for (l, layer) in self.weights.layers.iter().enumerate() {
            // Attention RMSNorm.
            math::rms_norm_rows(&s.x, &layer.attn_norm, c.rms_eps, &mut s.xn, n);
            // Q, K, V projections.
            layer.wq.forward(&s.pool, &s.xn, n, &mut s.q, &mut s.scratch)?;
            layer.wk.forward(&s.pool, &s.xn, n, &mut s.k, &mut s.scratch)?;
            layer.wv.forward(&s.pool, &s.xn, n, &mut s.v, &mut s.scratch)?;
            // RoPE on q and k at their absolute positions.
            for t in 0..n {
                let p = s.pos + t;
                for h in s.q[t * q_dim..(t + 1) * q_dim].chunks_exact_mut(hd) {
                    self.rope.apply(h, p, neox);
                }
                for h in s.k[t * kv_dim..(t + 1) * kv_dim].chunks_exact_mut(hd) {
                    self.rope.apply(h, p, neox);
                }
            }
            // Append k and v to this layer's cache.
            let base = (l * s.ctx + s.pos) * kv_dim;
            s.key_cache[base..base + n * kv_dim].copy_from_slice(&s.k[..n * kv_dim]);
            s.value_cache[base..base + n * kv_dim].copy_from_slice(&s.v[..n * kv_dim]);
            // Causal multi-head attention over the cache (GQA: each kv head
            // serves n_heads / n_kv_heads query heads).
            self.attention(s, l, n);
            // Output projection (input-sparse with attention thresholds)
            // and residual.
            self.attn_output(s, l, n)?;
            add(&mut s.x[..n * dim], &s.tmp[..n * dim]);

            // FFN RMSNorm.
            math::rms_norm_rows(&s.x, &layer.ffn_norm, c.rms_eps, &mut s.xn, n);
            // SwiGLU FFN: down(silu(gate(x)) * up(x)), and residual; sparse
            // when a sidecar is loaded (only the neurons kept per token).
            if let Some(sp) = &self.sparse {
                self.sparse_ffn(s, l, n, sp)?;
            } else {
                layer.w_gate.forward(&s.pool, &s.xn, n, &mut s.gate, &mut s.scratch)?;
                layer.w_up.forward(&s.pool, &s.xn, n, &mut s.up, &mut s.scratch)?;
                if let Some(probe) = s.ffn_probe.as_mut() {
                    probe(l, &s.xn[..n * dim], &s.gate[..n * c.ffn_dim], &s.up[..n * c.ffn_dim]);
                }
                math::swiglu(&mut s.gate[..n * c.ffn_dim], &s.up[..n * c.ffn_dim]);
                layer.w_down.forward(&s.pool, &s.gate, n, &mut s.tmp, &mut s.scratch)?;
            }
            add(&mut s.x[..n * dim], &s.tmp[..n * dim]);
        }

        // Final RMSNorm; logits are computed on request.
        math::rms_norm_rows(&s.x, &self.weights.output_norm, c.rms_eps, &mut s.xn, n);
        s.pos += n;
        Ok(())
    }

    /// Logits of tokens `rows` (indices into the last `forward` call's
    /// tokens), `rows.len() x vocab`, row-major.
    pub fn logits<'s>(&self, s: &'s mut Session, rows: std::ops::Range<usize>) -> Result<&'s [f32]> {
        let (dim, vocab) = (self.config.dim, self.config.vocab_size);
        let n = rows.len();
        grow(&mut s.logits, n * vocab);
        let x = &s.xn[rows.start * dim..rows.end * dim];
        self.weights.output.forward(&s.pool, x, n, &mut s.logits, &mut s.scratch)?;
        Ok(&s.logits[..n * vocab])
    }

    /// Runs `tokens` and returns the logits of the last one.
    pub fn forward_last<'s>(&self, s: &'s mut Session, tokens: &[u32]) -> Result<&'s [f32]> {
        self.forward(s, tokens)?;
        self.logits(s, tokens.len() - 1..tokens.len())
    }

    /// Attention for the `n` newest tokens of layer `l`, into `s.att`.
    fn attention(&self, s: &mut Session, l: usize, n: usize) {
        let c = &self.config;
        let (hd, n_heads, kv_dim, ctx, pos0) = (c.head_dim, c.n_heads, s.kv_dim, s.ctx, s.pos);
        let group = n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let keys = &s.key_cache[l * ctx * kv_dim..(l + 1) * ctx * kv_dim];
        let values = &s.value_cache[l * ctx * kv_dim..(l + 1) * ctx * kv_dim];
        let q = &s.q[..n * n_heads * hd];
        let att = SyncPtr::new(s.att.as_mut_ptr());
        let scores = SyncPtr::new(s.scores.as_mut_ptr());
        let work = n * n_heads;
        s.pool.broadcast(&|ti, nt| {
            // SAFETY: thread `ti` writes only its own row of `scores`
            // (`ctx` floats at `ti * ctx`; the buffer holds `threads * ctx`)
            // and the `att` head slices of its own work items; work items
            // are disjoint across threads, and both buffers outlive the
            // broadcast, which returns only when every thread is done.
            let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ti * ctx), ctx) };
            for item in chunk(work, ti, nt) {
                let (t, h) = (item / n_heads, item % n_heads);
                let qv = &q[(t * n_heads + h) * hd..(t * n_heads + h + 1) * hd];
                let kv_off = (h / group) * hd;
                let len = pos0 + t + 1;
                for (j, sj) in sc[..len].iter_mut().enumerate() {
                    *sj = math::dot(qv, &keys[j * kv_dim + kv_off..j * kv_dim + kv_off + hd]) * scale;
                }
                math::softmax(&mut sc[..len]);
                // SAFETY: see above; this (t, h) slice belongs to this item.
                let out = unsafe { std::slice::from_raw_parts_mut(att.get().add((t * n_heads + h) * hd), hd) };
                out.fill(0.0);
                for (j, &p) in sc[..len].iter().enumerate() {
                    math::axpy(p, &values[j * kv_dim + kv_off..j * kv_dim + kv_off + hd], out);
                }
            }
        });
    }

    /// Every matmul with its kernel, for reports.
    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        self.weights
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain(std::iter::once(&self.weights.output))
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
        &s.xn[rows.start * dim..rows.end * dim]
    }
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}
