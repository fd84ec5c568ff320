//! The BERT encoder (HF `BertModel`) and sentence-embedding pooling, as
//! sentence-transformers runs it (e.g. all-MiniLM-L6-v2).
//!
//! Reads top to bottom: [`BertConfig`] (from `config.json`), [`Weights`]
//! (every tensor with its shape), [`BertModel::load`] and
//! [`BertModel::forward`], one comment per step, then [`Pooling`] and
//! [`l2_normalize`].
//!
//! A batch is a list of token sequences of different lengths. They are
//! packed one after the other (no padding): every matmul runs over all
//! tokens of the batch at once, and attention is restricted to each token's
//! own sequence. That is the padding mask of a padded batch in ragged form:
//! the result is what PyTorch computes with `attention_mask`, without
//! computing the padding.
//!
//! Tensor names are HF's (`embeddings.word_embeddings.weight`,
//! `encoder.layer.{i}.attention.self.query.weight`, ...), with or without a
//! `bert.` prefix (checkpoints of `BertFor*` heads carry one). Every matmul
//! goes through the kernel registry with f32 activations, so F32, F16 and
//! BF16 weights all work and stay in the file mapping.
//!
//! [`BertModel::prepack`] (what [`crate::embed::Embedder`] does by default
//! on CPUs with AVX2 or AVX-512) packs every weight matrix once for
//! [`gemm_packed`], with the bias (and GELU) fused into the kernel, and
//! Q, K, V fused into one matrix. With bf16 (CPUs with AVX-512 BF16), Q/K/V,
//! the attention output and the FFN's first projection run in bf16 (bf16
//! weights and activations, f32 sums: twice the arithmetic per instruction
//! of f32 and half the bytes), the FFN's down projection in f32. The down
//! projection stays f32 because the sparse FFN
//! ([`crate::experimental::bert_sparse`]) replaces exactly it, with f32
//! weights: the packed f32 kernel sums `b + Σ_j h_j · W[:, j]` in the order
//! of the sparse FFN's accumulation, so keeping every neuron gives the
//! dense result bit for bit. (It has to be bit for bit: the bf16 rounding
//! of the next layer's input turns any difference, however small, into one
//! of bf16's size.) On CPUs with AVX2 but not AVX-512, all four run on
//! int16 weights and activations (exact integer sums, `vpmaddwd`), the down
//! projection too unless a sparse FFN is set; without reduced precision,
//! all four in f32. The packed kernels compute each token's outputs the
//! same way whatever else is in the batch, so [`BertModel::forward`] takes
//! a batch through the layers in runs of sequences of at most
//! `GROUP_TOKENS` (256) tokens, whose activations stay in the caches.

use std::path::PathBuf;
use std::sync::Arc;

use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::kernel::{ActType, MatmulCall, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::gemm_packed::{
    Epilogue, PackedMatrix, PackedType, gemm_packed, kernel_name, packed_simd_available, reduced_type,
};
use spinfer_kernels::matmul::{BLayout, sgemm};
use spinfer_kernels::pool::SyncPtr;
use spinfer_kernels::pool::{ThreadPool, chunk};

use crate::{Error, Result};
use spinfer_formats::Error as FileError;
use spinfer_formats::loader::Loader;
use spinfer_formats::loader::{check_dims, load_vector};
use spinfer_formats::tensor::{TensorData, TensorView, release_pages};
use spinfer_kernel_select::registry::KernelRegistry;
use spinfer_models::model::add;
use spinfer_models::model::math;

pub use crate::bert_math::{gelu, gelu_slice};
use crate::bert_math::{layer_norm_rows, max16, par_rows, softmax_exp};
pub use spinfer_formats::bert_config::BertConfig;

/// Tokens per matmul call. The f32 GEMM packs the weights once per call and
/// streams the activations per block of packed weights, so large calls are
/// cheaper (each call reads the weight matrix from memory once).
const TOKEN_BLOCK: usize = 2048;

/// Tokens [`BertModel::forward`] takes through all layers at a time (whole
/// sequences; a longer one alone): a pass's activations (15 KiB per token
/// at BERT-small widths, under 4 MiB here) stay in the caches between one
/// matmul and the next, where a batch of 32 texts of 256 tokens would
/// stream 120 MiB through memory for every step. (256 was the fastest of
/// 128, 256 and 512 for batches of 32 texts of 16 and 64 tokens on a
/// 2-core Zen 3, docs/benchmarks.md.)
const GROUP_TOKENS: usize = 256;

/// A weight matrix with its bias, bound (once, at load) to the kernel the
/// registry resolves for it: `out = W · x + b`.
pub struct Dense {
    /// Tensor name in the file, for errors and reports.
    pub name: String,
    w: TensorData,  // (rows, cols), borrowed from the file mapping
    bias: Vec<f32>, // (rows)
    pub desc: MatmulDesc,
    kernel: Arc<dyn MatmulKernel>,
    /// The weights packed for [`gemm_packed`] (set by
    /// [`BertModel::prepack`]); `forward` then runs them instead of
    /// `kernel`.
    packed: Option<PackedMatrix>,
    /// The precision of its layer's fused Q/K/V product, when it is part
    /// of one (reports only).
    fused: Option<PackedType>,
}

impl Dense {
    /// Loads `<module>.weight` (rows, cols) and `<module>.bias` (rows).
    fn load(loader: &dyn Loader, registry: &KernelRegistry, module: &str, rows: usize, cols: usize) -> Result<Self> {
        let name = format!("{module}.weight");
        let t = loader.tensor(&name)?;
        check_dims(loader, &t, &[cols, rows])?;
        let desc = MatmulDesc::dense(t.ty, ActType::F32, rows, cols);
        let kernel = registry.resolve(&desc)?.kernel;
        let bias = load_vector(loader, &format!("{module}.bias"), rows)?;
        Ok(Self { name, w: t.data, bias, desc, kernel, packed: None, fused: None })
    }

    /// The weights packed in `ty` (with `others`, the same width, their rows
    /// after this one's), for [`gemm_packed`].
    fn pack(&self, ty: PackedType, others: &[&Dense]) -> Result<PackedMatrix> {
        let parts: Vec<_> = std::iter::once(self)
            .chain(others.iter().copied())
            .map(|d| (d.desc.wtype, d.w.bytes(), d.desc.rows))
            .collect();
        let packed = PackedMatrix::pack(ty, &parts, self.desc.cols)
            .map_err(|source| Error::Kernel { kernel: kernel_name(ty).to_string(), source })?;
        // The packed copy serves every product from now on: the file's
        // pages leave the resident set (re-read if anything reads them).
        for d in std::iter::once(self).chain(others.iter().copied()).filter(|d| d.w.is_mapped()) {
            // SAFETY: `d.w` borrows from the read-only file mapping.
            unsafe { release_pages(d.w.bytes()) };
        }
        Ok(packed)
    }

    /// `out[t, :] = W · x[t, :] + b` for the `n` rows of `x`, then
    /// `epilogue` on every output (on the results in cache when packed).
    fn forward(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        epilogue: Option<Epilogue<'_>>,
    ) -> Result<()> {
        let (rows, cols) = (self.desc.rows, self.desc.cols);
        let out = &mut out[..n * rows];
        if let Some(p) = &self.packed {
            return packed_forward(pool, p, &self.bias, &x[..n * cols], n, out, epilogue);
        }
        SCRATCH.with_borrow_mut(|scratch| -> Result<()> {
            for (xb, ob) in x[..n * cols].chunks(TOKEN_BLOCK * cols).zip(out.chunks_mut(TOKEN_BLOCK * rows)) {
                self.kernel
                    .run(pool, MatmulCall::dense(self.w.bytes(), xb, xb.len() / cols, ob, scratch))
                    .map_err(|source| Error::Kernel { kernel: self.kernel.name().to_string(), source })?;
            }
            Ok(())
        })?;
        par_rows(pool, out, rows, &|_, row| {
            for (o, b) in row.iter_mut().zip(&self.bias) {
                *o += b;
            }
            if let Some(e) = epilogue {
                e(row);
            }
        });
        Ok(())
    }

    pub fn kernel_name(&self) -> &str {
        match self.packed.as_ref().map(PackedMatrix::ty).or(self.fused) {
            Some(ty) => kernel_name(ty),
            None => self.kernel.name(),
        }
    }
}

/// Largest [`FORWARD_BUFFERS`] a thread keeps (floats: 32 MiB, about 2300
/// tokens of all-MiniLM-L6-v2); larger batches allocate theirs per call.
const KEEP_FORWARD_BUFFERS: usize = 8 << 20;

thread_local! {
    /// The activation buffers of [`BertModel::forward`] (grown, never
    /// shrunk, up to [`KEEP_FORWARD_BUFFERS`]).
    static FORWARD_BUFFERS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Scratch of the matmul kernels (packed weights, rounded activations),
    /// reused across calls: a fresh one would be zeroed and page-faulted on
    /// every matmul.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out = W x + bias` (then `epilogue`) with the packed weights `w`.
fn packed_forward(
    pool: &ThreadPool,
    w: &PackedMatrix,
    bias: &[f32],
    x: &[f32],
    n: usize,
    out: &mut [f32],
    epilogue: Option<Epilogue<'_>>,
) -> Result<()> {
    SCRATCH
        .with_borrow_mut(|scratch| gemm_packed(pool, w, x, n, Some(bias), out, scratch, epilogue))
        .map_err(|source| Error::Kernel { kernel: kernel_name(w.ty()).to_string(), source })
}

/// A layer's Q, K and V projections as one packed product (`3 · hidden`
/// rows: Q's, then K's, then V's), with their biases.
pub struct FusedQkv {
    w: PackedMatrix,
    bias: Vec<f32>,
}

/// One encoder layer (post-LayerNorm, as in the original BERT).
pub struct Layer {
    pub query: Dense,          // attention.self.query: (hidden, hidden) + (hidden)
    pub key: Dense,            // attention.self.key: (hidden, hidden) + (hidden)
    pub value: Dense,          // attention.self.value: (hidden, hidden) + (hidden)
    pub attn_out: Dense,       // attention.output.dense: (hidden, hidden) + (hidden)
    pub attn_norm_w: Vec<f32>, // attention.output.LayerNorm.weight: (hidden)
    pub attn_norm_b: Vec<f32>, // attention.output.LayerNorm.bias: (hidden)
    pub ffn_up: Dense,         // intermediate.dense: (intermediate, hidden) + (intermediate)
    pub ffn_down: Dense,       // output.dense: (hidden, intermediate) + (hidden)
    pub out_norm_w: Vec<f32>,  // output.LayerNorm.weight: (hidden)
    pub out_norm_b: Vec<f32>,  // output.LayerNorm.bias: (hidden)
    /// Q, K, V as one packed product ([`BertModel::prepack`]).
    pub qkv: Option<FusedQkv>,
}

/// All weights. Matrices stay in the file mapping; embedding rows are
/// converted to f32 on lookup.
pub struct Weights {
    pub word_embeddings: TensorView,       // (vocab_size, hidden)
    pub position_embeddings: TensorView,   // (max_positions, hidden)
    pub token_type_embeddings: TensorView, // (type_vocab_size, hidden)
    pub embed_norm_w: Vec<f32>,            // embeddings.LayerNorm.weight: (hidden)
    pub embed_norm_b: Vec<f32>,            // embeddings.LayerNorm.bias: (hidden)
    pub layers: Vec<Layer>,
    // `pooler.dense` (the [CLS] tanh head) is not used by sentence embeddings.
}

/// A loaded encoder: immutable, `Send + Sync`.
pub struct BertModel {
    pub config: BertConfig,
    pub weights: Weights,
    path: PathBuf,
    /// The sparse FFN (`bert_sparse.rs`), when a sidecar is set
    /// ([`BertModel::set_sparse`]).
    pub(crate) sparse: Option<crate::experimental::bert_sparse::SparseFfn>,
}

impl BertModel {
    /// Binds every weight of `loader` (a BERT checkpoint described by
    /// `config`) to a kernel chosen by `registry`. Every shape is checked;
    /// a wrong one is an error naming the tensor.
    pub fn load(loader: &dyn Loader, registry: &KernelRegistry, config: BertConfig) -> Result<Self> {
        let c = &config;
        let prefix = if loader.has_tensor("bert.embeddings.word_embeddings.weight") { "bert." } else { "" };
        let name = |s: &str| format!("{prefix}{s}");
        let embedding = |s: &str, rows: usize| -> Result<TensorView> {
            let t = loader.tensor(&name(s))?;
            check_dims(loader, &t, &[c.hidden, rows])?;
            Ok(t)
        };
        let word_embeddings = embedding("embeddings.word_embeddings.weight", c.vocab_size)?;
        let position_embeddings = embedding("embeddings.position_embeddings.weight", c.max_positions)?;
        let token_type_embeddings = embedding("embeddings.token_type_embeddings.weight", c.type_vocab_size)?;
        let embed_norm_w = load_vector(loader, &name("embeddings.LayerNorm.weight"), c.hidden)?;
        let embed_norm_b = load_vector(loader, &name("embeddings.LayerNorm.bias"), c.hidden)?;

        // The layer count sizes an allocation: check it against the layers
        // present first (a config claiming 2^31 layers is refused here).
        let present: std::collections::BTreeSet<usize> = loader
            .tensor_names()
            .iter()
            .filter_map(|n| n.strip_prefix(prefix)?.strip_prefix("encoder.layer.")?.split_once('.')?.0.parse().ok())
            .collect();
        if c.n_layers > present.len() || (0..c.n_layers).any(|l| !present.contains(&l)) {
            return Err(FileError::Metadata {
                path: loader.path().to_path_buf(),
                key: "num_hidden_layers".into(),
                detail: format!("= {} but the checkpoint has tensors for {} layers", c.n_layers, present.len()),
            }
            .into());
        }
        let mut layers = Vec::new();
        layers
            .try_reserve_exact(c.n_layers)
            .map_err(|e| Error::InvalidArgument(format!("{} layers: {e}", c.n_layers)))?;
        for l in 0..c.n_layers {
            let m = |s: &str| name(&format!("encoder.layer.{l}.{s}"));
            let dense = |s: &str, rows, cols| Dense::load(loader, registry, &m(s), rows, cols);
            let vector = |s: &str| load_vector(loader, &m(s), c.hidden);
            layers.push(Layer {
                query: dense("attention.self.query", c.hidden, c.hidden)?,
                key: dense("attention.self.key", c.hidden, c.hidden)?,
                value: dense("attention.self.value", c.hidden, c.hidden)?,
                attn_out: dense("attention.output.dense", c.hidden, c.hidden)?,
                attn_norm_w: vector("attention.output.LayerNorm.weight")?,
                attn_norm_b: vector("attention.output.LayerNorm.bias")?,
                ffn_up: dense("intermediate.dense", c.intermediate, c.hidden)?,
                ffn_down: dense("output.dense", c.hidden, c.intermediate)?,
                out_norm_w: vector("output.LayerNorm.weight")?,
                out_norm_b: vector("output.LayerNorm.bias")?,
                qkv: None,
            });
        }
        tracing::debug!(layers = c.n_layers, kernel = layers.first().map(|l| l.query.kernel_name()), "bert loaded");
        let weights =
            Weights { word_embeddings, position_embeddings, token_type_embeddings, embed_norm_w, embed_norm_b, layers };
        Ok(Self { config, weights, path: loader.path().to_path_buf(), sparse: None })
    }

    /// Packs every matrix once for [`gemm_packed`]: Q, K and V as one
    /// matrix, the attention output and the FFN's two projections. With
    /// `reduced` on a CPU with AVX-512 BF16, Q/K/V, the attention output
    /// and the FFN's first projection take bf16 weights and activations,
    /// the FFN's down projection f32 (see the module docs); on CPUs with
    /// AVX2 but not AVX-512, all four take int16 weights and activations
    /// (13- and 14-bit, exact integer sums, [`PackedType::I16`]), the down
    /// projection f32 while a sparse FFN is set ([`BertModel::set_sparse`]);
    /// without `reduced`, all are f32. The packed copies replace the
    /// file's pages in memory (released once packed): half the f32 size
    /// for a bf16 or i16 matrix, the same size for an f32 one. Returns the
    /// precision of the Q/K/V product, or `None`, changing nothing, when
    /// the CPU has no SIMD kernel for the packed f32 product (the
    /// registry's kernels are then faster).
    ///
    /// Accuracy on all-MiniLM-L6-v2: cosine to the PyTorch (f32) embeddings
    /// above 0.9999 with bf16 or i16, STS-B Spearman within 1e-3
    /// (`tests/tests/minilm.rs`); f32 is the f32 product.
    pub fn prepack(&mut self, reduced: bool) -> Result<Option<PackedType>> {
        let ty = match reduced_type() {
            Some(ty) if reduced => ty,
            _ if packed_simd_available(PackedType::F32) => PackedType::F32,
            _ => return Ok(None),
        };
        for l in &mut self.weights.layers {
            if l.qkv.is_none() {
                let w = l.query.pack(ty, &[&l.key, &l.value])?;
                let bias = [&l.query.bias, &l.key.bias, &l.value.bias].into_iter().flatten().copied().collect();
                l.qkv = Some(FusedQkv { w, bias });
            }
            for d in [&mut l.query, &mut l.key, &mut l.value] {
                d.fused = Some(ty);
            }
            for d in [&mut l.attn_out, &mut l.ffn_up] {
                if d.packed.is_none() {
                    d.packed = Some(d.pack(ty, &[])?);
                }
            }
        }
        self.pack_ffn_down()?;
        Ok(Some(ty))
    }

    /// (Re)packs the FFN's down projections for the current settings: i16
    /// when the Q/K/V product is i16 and no sparse FFN replaces the
    /// product (keeping every neuron must give the dense result), else f32.
    fn pack_ffn_down(&mut self) -> Result<()> {
        let Some(qkv) = self.prepacked() else { return Ok(()) };
        let sparse = self.sparse.as_ref().is_some_and(|s| !s.is_recorder());
        let ty = if qkv == PackedType::I16 && !sparse { PackedType::I16 } else { PackedType::F32 };
        for l in &mut self.weights.layers {
            if l.ffn_down.packed.as_ref().is_none_or(|p| p.ty() != ty) {
                l.ffn_down.packed = Some(l.ffn_down.pack(ty, &[])?);
            }
        }
        Ok(())
    }

    /// Sets (or clears) the sparse FFN, repacking the down projections for
    /// it (see [`BertModel::prepack`]); returns the previous one.
    ///
    /// # Errors
    /// If a repacked matrix cannot be read from the file.
    pub fn set_sparse(
        &mut self,
        sparse: Option<crate::experimental::bert_sparse::SparseFfn>,
    ) -> Result<Option<crate::experimental::bert_sparse::SparseFfn>> {
        let previous = std::mem::replace(&mut self.sparse, sparse);
        self.pack_ffn_down()?;
        Ok(previous)
    }

    /// The precision of the Q/K/V product when [`BertModel::prepack`] is
    /// in effect.
    pub fn prepacked(&self) -> Option<PackedType> {
        self.weights.layers.first().and_then(|l| l.qkv.as_ref()).map(|f| f.w.ty())
    }

    /// The last hidden states of a batch of sequences: `(total tokens,
    /// hidden)`, row-major, the sequences one after the other. Each
    /// sequence is complete (`[CLS] ... [SEP]`), at most `max_positions`
    /// long, and uses token type 0 throughout.
    pub fn forward(&self, pool: &ThreadPool, seqs: &[&[u32]]) -> Result<Vec<f32>> {
        let c = &self.config;
        for (i, s) in seqs.iter().enumerate() {
            if s.is_empty() || s.len() > c.max_positions {
                return Err(Error::InvalidArgument(format!(
                    "sequence {i} has {} tokens; the model takes 1 to {}",
                    s.len(),
                    c.max_positions
                )));
            }
            if let Some(&bad) = s.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(Error::InvalidArgument(format!(
                    "token id {bad} is outside the vocabulary (size {})",
                    c.vocab_size
                )));
            }
        }
        // Runs of whole sequences of at most GROUP_TOKENS tokens (or one
        // longer sequence) go through all layers at a time.
        let d = c.hidden;
        let n: usize = seqs.iter().map(|s| s.len()).sum();
        let mut x = vec![0.0f32; n * d]; // residual stream (n, hidden)
        let (mut first, mut t0) = (0, 0);
        while first < seqs.len() {
            let (mut end, mut len) = (first + 1, seqs[first].len());
            while end < seqs.len() && len + seqs[end].len() <= GROUP_TOKENS {
                len += seqs[end].len();
                end += 1;
            }
            self.forward_group(pool, &seqs[first..end], &mut x[t0 * d..(t0 + len) * d])?;
            (first, t0) = (end, t0 + len);
        }
        Ok(x)
    }

    /// [`BertModel::forward`] of checked sequences into `x` (`(tokens,
    /// hidden)`).
    fn forward_group(&self, pool: &ThreadPool, seqs: &[&[u32]], x: &mut [f32]) -> Result<()> {
        let c = &self.config;
        let (d, hd, heads) = (c.hidden, c.head_dim, c.n_heads);
        // Each sequence as (first token, length), for attention.
        let seq_spans: Vec<(usize, usize)> = seqs
            .iter()
            .scan(0, |start, s| {
                let span = (*start, s.len());
                *start += s.len();
                Some(span)
            })
            .collect();
        let n: usize = seqs.iter().map(|s| s.len()).sum();
        // The other activations, in one buffer kept by the thread between
        // calls (fresh ones would be page-faulted and zeroed every time);
        // every element is written before it is read.
        let mut buf = FORWARD_BUFFERS.with_borrow_mut(std::mem::take);
        let need = n * (5 * d + c.intermediate);
        if buf.len() < need {
            buf.resize(need, 0.0);
        }
        // Q, K and V (packed: side by side, (n, 3 hidden); else one after
        // the other, each (n, hidden)); head h in columns h*hd..(h+1)*hd.
        let (qkv, rest) = buf.split_at_mut(n * 3 * d);
        let (att, rest) = rest.split_at_mut(n * d); // attention output, heads concatenated (n, hidden)
        let (tmp, rest) = rest.split_at_mut(n * d); // sub-layer output before the residual add (n, hidden)
        let ffn = &mut rest[..n * c.intermediate]; // (n, intermediate)

        // Embeddings: word + absolute position (from 0 in each sequence) +
        // token type 0.
        let w = &self.weights;
        let mut row = vec![0.0f32; d];
        let mut t = 0;
        for s in seqs {
            for (pos, &id) in s.iter().enumerate() {
                let xr = &mut x[t * d..(t + 1) * d];
                self.embedding_row(&w.word_embeddings, id as usize, xr)?;
                self.embedding_row(&w.position_embeddings, pos, &mut row)?;
                add(xr, &row);
                self.embedding_row(&w.token_type_embeddings, 0, &mut row)?;
                add(xr, &row);
                t += 1;
            }
        }
        // Embedding LayerNorm.
        layer_norm_rows(pool, x, None, &w.embed_norm_w, &w.embed_norm_b, c.layer_norm_eps);

        for (l, layer) in w.layers.iter().enumerate() {
            // Q, K, V projections (with biases): one packed product, or three.
            let (q, k, v, ld) = match &layer.qkv {
                Some(f) => {
                    packed_forward(pool, &f.w, &f.bias, x, n, qkv, None)?;
                    (&qkv[..], &qkv[d..], &qkv[2 * d..], 3 * d)
                }
                None => {
                    let (q, kv) = qkv.split_at_mut(n * d);
                    let (k, v) = kv.split_at_mut(n * d);
                    layer.query.forward(pool, x, n, q, None)?;
                    layer.key.forward(pool, x, n, k, None)?;
                    layer.value.forward(pool, x, n, v, None)?;
                    (&qkv[..], &qkv[n * d..], &qkv[2 * n * d..], d)
                }
            };
            // Bidirectional multi-head attention, each token over the
            // tokens of its own sequence (the padding mask).
            attention(pool, q, k, v, ld, &seq_spans, heads, hd, att);
            // Output projection, residual, LayerNorm (post-LN).
            layer.attn_out.forward(pool, att, n, tmp, None)?;
            layer_norm_rows(pool, x, Some(tmp), &layer.attn_norm_w, &layer.attn_norm_b, c.layer_norm_eps);
            // FFN: down(gelu(up(x))), residual, LayerNorm.
            layer.ffn_up.forward(pool, x, n, ffn, Some(&gelu_slice))?;
            // With a sparsity sidecar, down runs over the kept neurons only.
            let sparse_done = match &self.sparse {
                Some(sp) => sp.ffn_down(pool, l, &seq_spans, ffn, n, tmp)?,
                None => false,
            };
            if !sparse_done {
                layer.ffn_down.forward(pool, ffn, n, tmp, None)?;
            }
            layer_norm_rows(pool, x, Some(tmp), &layer.out_norm_w, &layer.out_norm_b, c.layer_norm_eps);
        }
        if buf.len() <= KEEP_FORWARD_BUFFERS {
            FORWARD_BUFFERS.with_borrow_mut(|b| {
                if b.len() < buf.len() {
                    *b = buf;
                }
            });
        }
        Ok(())
    }

    /// Row `i` of an embedding table as f32.
    fn embedding_row(&self, table: &TensorView, i: usize, out: &mut [f32]) -> Result<()> {
        let d = self.config.hidden;
        let row_bytes = table.ty.row_bytes(d)?;
        let src = &table.data.bytes()[i * row_bytes..(i + 1) * row_bytes];
        dequantize_row(table.ty, src, out).map_err(|e| FileError::TensorType {
            path: self.path.clone(),
            tensor: table.name.clone(),
            ty: table.ty.to_string(),
            what: format!("cannot be read as embeddings: {e}"),
        })?;
        Ok(())
    }

    /// Every matmul with its kernel, for reports.
    pub fn dense_layers(&self) -> impl Iterator<Item = &Dense> {
        self.weights.layers.iter().flat_map(|l| [&l.query, &l.key, &l.value, &l.attn_out, &l.ffn_up, &l.ffn_down])
    }
}

/// `att[t, head h] = softmax(q_t · K_s / sqrt(hd)) · V_s` where `s` is the
/// span of `t`'s sequence; token `t`'s head `h` of `q`, `k`, `v` starts at
/// `t * ld + h * hd`. Work items `(sequence, head)` split over threads;
/// each is two small GEMMs ([`sgemm`]): the scores `S = Q_h · K_hᵀ` (len ×
/// len), each row turned into `exp(scale · (s - max))` ([`softmax_exp`]),
/// then `S · V_h` (len × hd), each output row divided by its row's sum.
#[allow(clippy::too_many_arguments, reason = "the attention operands, named as in the formula")]
fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    ld: usize,
    seqs: &[(usize, usize)],
    heads: usize,
    hd: usize,
    att: &mut [f32],
) {
    let d = heads * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let max_len = seqs.iter().map(|s| s.1).max().unwrap_or(0);
    let att_ptr = SyncPtr::new(att.as_mut_ptr());
    let work = seqs.len() * heads;
    pool.broadcast(&|ti, nt| {
        let items = chunk(work, ti, nt);
        if items.is_empty() {
            return;
        }
        // Per-thread buffers, kept between calls (the pool's threads are
        // persistent): scores, outputs, 1 / row sums, sgemm's packing.
        type Bufs = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);
        thread_local! {
            static BUFS: std::cell::RefCell<Bufs> =
                const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
        }
        BUFS.with_borrow_mut(|(scores, o, inv_sums, scratch)| {
            if scores.len() < max_len * max_len {
                scores.resize(max_len * max_len, 0.0);
            }
            if o.len() < max_len * hd {
                o.resize(max_len * hd, 0.0);
            }
            if inv_sums.len() < max_len {
                inv_sums.resize(max_len, 0.0);
            }
            for item in items {
                let (s, h) = (item / heads, item % heads);
                let (start, len) = seqs[s];
                let base = start * ld + h * hd;
                let sc = &mut scores[..len * len];
                sgemm(len, len, hd, &q[base..], ld, &k[base..], ld, BLayout::Transposed, sc, len, false, scratch);
                for (row, inv) in sc.chunks_exact_mut(len).zip(inv_sums.iter_mut()) {
                    *inv = 1.0 / softmax_exp(row, max16(row), scale);
                }
                let o = &mut o[..len * hd];
                sgemm(len, hd, len, sc, len, &v[base..], ld, BLayout::Normal, o, hd, false, scratch);
                for (i, (orow, &inv)) in o.chunks_exact(hd).zip(inv_sums.iter()).enumerate() {
                    // SAFETY: the head-`h` columns of the rows of sequence `s`
                    // belong to this work item alone (items are disjoint across
                    // threads); `att` holds `n * d` floats and outlives the
                    // broadcast.
                    let dst =
                        unsafe { std::slice::from_raw_parts_mut(att_ptr.get().add((start + i) * d + h * hd), hd) };
                    for (a, &b) in dst.iter_mut().zip(orow) {
                        *a = b * inv;
                    }
                }
            }
        });
    });
}

/// How token states become one sentence vector (sentence-transformers'
/// `Pooling` module). Several modes may be on: their vectors are
/// concatenated in the order cls, max, mean, mean_sqrt_len, as
/// sentence-transformers does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pooling {
    /// The first token's state (`[CLS]`).
    pub cls: bool,
    /// Element-wise maximum over the sequence's tokens.
    pub max: bool,
    /// Mean over the sequence's tokens (padding excluded).
    pub mean: bool,
    /// Sum over the tokens divided by sqrt(token count).
    pub mean_sqrt_len: bool,
}

impl Pooling {
    /// Number of modes on (the output is `modes() * hidden` wide).
    pub fn modes(&self) -> usize {
        [self.cls, self.max, self.mean, self.mean_sqrt_len].iter().filter(|&&m| m).count()
    }

    /// Pools the hidden states of one sequence (`(len, hidden)`, len ≥ 1).
    pub fn apply(&self, states: &[f32], hidden: usize) -> Vec<f32> {
        let len = states.len() / hidden;
        let mut out = Vec::with_capacity(self.modes() * hidden);
        if self.cls {
            out.extend_from_slice(&states[..hidden]);
        }
        if self.max {
            let mut m = states[..hidden].to_vec();
            for row in states.chunks_exact(hidden).skip(1) {
                for (a, &b) in m.iter_mut().zip(row) {
                    *a = a.max(b);
                }
            }
            out.extend(m);
        }
        if self.mean || self.mean_sqrt_len {
            let mut sum = vec![0.0f32; hidden];
            for row in states.chunks_exact(hidden) {
                add(&mut sum, row);
            }
            if self.mean {
                out.extend(sum.iter().map(|s| s / len as f32));
            }
            if self.mean_sqrt_len {
                out.extend(sum.iter().map(|s| s / (len as f32).sqrt()));
            }
        }
        out
    }
}

/// Scales `v` to unit L2 norm (sentence-transformers' `Normalize`: divides
/// by max(norm, 1e-12)).
pub fn l2_normalize(v: &mut [f32]) {
    let norm = math::dot(v, v).sqrt().max(1e-12);
    v.iter_mut().for_each(|x| *x /= norm);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_modes() {
        // Two tokens, hidden 2.
        let s = [1.0, -2.0, 3.0, 4.0];
        let mean = Pooling { mean: true, ..Default::default() };
        assert_eq!(mean.apply(&s, 2), vec![2.0, 1.0]);
        let all = Pooling { cls: true, max: true, mean: true, mean_sqrt_len: true };
        let r2 = 2f32.sqrt();
        assert_eq!(all.apply(&s, 2), vec![1.0, -2.0, 3.0, 4.0, 2.0, 1.0, 4.0 / r2, 2.0 / r2]);
        assert_eq!(all.modes(), 4);
        let mut v = [3.0, 4.0];
        l2_normalize(&mut v);
        assert_eq!(v, [0.6, 0.8]);
        let mut z = [0.0, 0.0];
        l2_normalize(&mut z);
        assert_eq!(z, [0.0, 0.0]);
    }
}
