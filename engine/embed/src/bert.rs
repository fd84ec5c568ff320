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
//! [`BertModel::use_bf16`] (what [`crate::embed::Embedder`] does by default
//! on CPUs with AVX-512 BF16) packs every weight matrix once for
//! [`gemm_packed`], with the bias (and GELU) fused into the kernel:
//! Q, K, V (fused into one matrix), the attention output and the FFN's
//! first projection in bf16 (bf16 weights and activations, f32 sums: twice
//! the arithmetic per instruction of f32 and half the bytes), the FFN's
//! down projection in f32. That one stays f32 because the sparse FFN
//! ([`crate::bert_sparse`]) replaces exactly it, with f32 weights: the
//! packed f32 kernel sums `b + Σ_j h_j · W[:, j]` in the order of the
//! sparse FFN's accumulation, so keeping every neuron gives the dense
//! result bit for bit. (It has to be bit for bit: the bf16 rounding of the
//! next layer's input turns any difference, however small, into one of
//! bf16's size.) The packed kernels compute each token's outputs the same
//! way whatever else is in the batch.

use std::path::PathBuf;
use std::sync::Arc;

use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};
use spinfer_kernels::matmul::gemm_packed::{Epilogue, PackedMatrix, PackedType, gemm_packed, packed_simd_available};
use spinfer_kernels::matmul::{BLayout, sgemm};
use spinfer_kernels::pool::SyncPtr;
use spinfer_kernels::pool::{ThreadPool, chunk};

use crate::{Error, Result};
use spinfer_formats::Error as FileError;
use spinfer_formats::loader::Loader;
use spinfer_formats::loader::{check_dims, load_vector};
use spinfer_formats::tensor::{TensorData, TensorView};
use spinfer_kernel_select::registry::KernelRegistry;
use spinfer_models::model::add;
use spinfer_models::model::math;

pub use spinfer_formats::bert_config::BertConfig;

/// Tokens per matmul call. The f32 GEMM packs the weights once per call and
/// streams the activations per block of packed weights, so large calls are
/// cheaper (each call reads the weight matrix from memory once).
const TOKEN_BLOCK: usize = 2048;

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
    /// [`BertModel::use_bf16`]); `forward` then runs them instead of
    /// `kernel`.
    packed: Option<PackedMatrix>,
    /// Part of its layer's fused bf16 Q/K/V product (reports only).
    fused_bf16: bool,
}

/// Name reported for the matmuls that run [`gemm_packed`].
fn packed_kernel_name(ty: PackedType) -> &'static str {
    match ty {
        PackedType::Bf16 => "avx512bf16/bf16*bf16 (prepacked)",
        PackedType::F32 => "avx512/f32*f32 (prepacked)",
    }
}

impl Dense {
    /// Loads `<module>.weight` (rows, cols) and `<module>.bias` (rows).
    fn load(loader: &dyn Loader, registry: &KernelRegistry, module: &str, rows: usize, cols: usize) -> Result<Self> {
        let name = format!("{module}.weight");
        let t = loader.tensor(&name)?;
        check_dims(loader, &t, &[cols, rows])?;
        let desc = MatmulDesc { wtype: t.ty, act: ActType::F32, rows, cols };
        let kernel = registry.resolve(&desc)?.kernel;
        let bias = load_vector(loader, &format!("{module}.bias"), rows)?;
        Ok(Self { name, w: t.data, bias, desc, kernel, packed: None, fused_bf16: false })
    }

    /// The weights packed in `ty` (with `others`, the same width, their rows
    /// after this one's), for [`gemm_packed`].
    fn pack(&self, ty: PackedType, others: &[&Dense]) -> Result<PackedMatrix> {
        let parts: Vec<_> = std::iter::once(self)
            .chain(others.iter().copied())
            .map(|d| (d.desc.wtype, d.w.bytes(), d.desc.rows))
            .collect();
        PackedMatrix::pack(ty, &parts, self.desc.cols)
            .map_err(|source| Error::Kernel { kernel: packed_kernel_name(ty).to_string(), source })
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
                    .run(pool, self.w.bytes(), xb, xb.len() / cols, ob, scratch)
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
        match &self.packed {
            Some(p) => packed_kernel_name(p.ty()),
            None if self.fused_bf16 => packed_kernel_name(PackedType::Bf16),
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
        .map_err(|source| Error::Kernel { kernel: packed_kernel_name(w.ty()).to_string(), source })
}

/// A layer's Q, K and V projections as one bf16 product (`3 · hidden`
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
    /// Q, K, V as one bf16 product ([`BertModel::use_bf16`]).
    pub qkv_bf16: Option<FusedQkv>,
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
    /// The sparse FFN (`bert_sparse.rs`), when a sidecar is set.
    pub sparse: Option<crate::bert_sparse::SparseFfn>,
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
                qkv_bf16: None,
            });
        }
        tracing::debug!(layers = c.n_layers, kernel = layers.first().map(|l| l.query.kernel_name()), "bert loaded");
        let weights =
            Weights { word_embeddings, position_embeddings, token_type_embeddings, embed_norm_w, embed_norm_b, layers };
        Ok(Self { config, weights, path: loader.path().to_path_buf(), sparse: None })
    }

    /// Packs every matrix once for [`gemm_packed`]: Q, K, V (fused), the
    /// attention output and the FFN's first projection in bf16 (weights
    /// and activations), the FFN's down projection in f32 (see the module
    /// docs). The packed copies live next to the file mapping: half the
    /// f32 size for the bf16 matrices, the same size for the f32 one (a
    /// third of the encoder's weights). Returns `false`, changing nothing,
    /// when the CPU lacks AVX-512 BF16: the f32 kernels are then faster than
    /// any emulation.
    ///
    /// Accuracy on all-MiniLM-L6-v2: cosine to the PyTorch (f32) embeddings
    /// above 0.9999, STS-B Spearman within 1e-4 (`tests/tests/minilm.rs`).
    pub fn use_bf16(&mut self) -> Result<bool> {
        if !packed_simd_available(PackedType::Bf16) {
            return Ok(false);
        }
        for l in &mut self.weights.layers {
            if l.qkv_bf16.is_none() {
                let w = l.query.pack(PackedType::Bf16, &[&l.key, &l.value])?;
                let bias = [&l.query.bias, &l.key.bias, &l.value.bias].into_iter().flatten().copied().collect();
                l.qkv_bf16 = Some(FusedQkv { w, bias });
            }
            for d in [&mut l.query, &mut l.key, &mut l.value] {
                d.fused_bf16 = true;
            }
            for (d, ty) in [
                (&mut l.attn_out, PackedType::Bf16),
                (&mut l.ffn_up, PackedType::Bf16),
                (&mut l.ffn_down, PackedType::F32),
            ] {
                if d.packed.is_none() {
                    d.packed = Some(d.pack(ty, &[])?);
                }
            }
        }
        Ok(true)
    }

    /// Whether [`BertModel::use_bf16`] is in effect.
    pub fn uses_bf16(&self) -> bool {
        self.weights.layers.iter().any(|l| l.qkv_bf16.is_some())
    }

    /// The last hidden states of a batch of sequences: `(total tokens,
    /// hidden)`, row-major, the sequences one after the other. Each
    /// sequence is complete (`[CLS] ... [SEP]`), at most `max_positions`
    /// long, and uses token type 0 throughout.
    pub fn forward(&self, pool: &ThreadPool, seqs: &[&[u32]]) -> Result<Vec<f32>> {
        let c = &self.config;
        let (d, hd, heads) = (c.hidden, c.head_dim, c.n_heads);
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
        let mut x = vec![0.0f32; n * d]; // residual stream (n, hidden)
        // The other activations, in one buffer kept by the thread between
        // calls (fresh ones would be page-faulted and zeroed every time);
        // every element is written before it is read.
        let mut buf = FORWARD_BUFFERS.with_borrow_mut(std::mem::take);
        let need = n * (5 * d + c.intermediate);
        if buf.len() < need {
            buf.resize(need, 0.0);
        }
        // Q, K and V (with bf16: side by side, (n, 3 hidden); else one after
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
        layer_norm_rows(pool, &mut x, None, &w.embed_norm_w, &w.embed_norm_b, c.layer_norm_eps);

        for (l, layer) in w.layers.iter().enumerate() {
            // Q, K, V projections (with biases): one bf16 product, or three.
            let (q, k, v, ld) = match &layer.qkv_bf16 {
                Some(f) => {
                    packed_forward(pool, &f.w, &f.bias, &x, n, qkv, None)?;
                    (&qkv[..], &qkv[d..], &qkv[2 * d..], 3 * d)
                }
                None => {
                    let (q, kv) = qkv.split_at_mut(n * d);
                    let (k, v) = kv.split_at_mut(n * d);
                    layer.query.forward(pool, &x, n, q, None)?;
                    layer.key.forward(pool, &x, n, k, None)?;
                    layer.value.forward(pool, &x, n, v, None)?;
                    (&qkv[..], &qkv[n * d..], &qkv[2 * n * d..], d)
                }
            };
            // Bidirectional multi-head attention, each token over the
            // tokens of its own sequence (the padding mask).
            attention(pool, q, k, v, ld, &seq_spans, heads, hd, att);
            // Output projection, residual, LayerNorm (post-LN).
            layer.attn_out.forward(pool, att, n, tmp, None)?;
            layer_norm_rows(pool, &mut x, Some(tmp), &layer.attn_norm_w, &layer.attn_norm_b, c.layer_norm_eps);
            // FFN: down(gelu(up(x))), residual, LayerNorm.
            layer.ffn_up.forward(pool, &x, n, ffn, Some(&gelu_slice))?;
            // With a sparsity sidecar, down runs over the kept neurons only.
            let sparse_done = match &self.sparse {
                Some(sp) => sp.ffn_down(pool, l, &seq_spans, ffn, n, tmp)?,
                None => false,
            };
            if !sparse_done {
                layer.ffn_down.forward(pool, ffn, n, tmp, None)?;
            }
            layer_norm_rows(pool, &mut x, Some(tmp), &layer.out_norm_w, &layer.out_norm_b, c.layer_norm_eps);
        }
        if buf.len() <= KEEP_FORWARD_BUFFERS {
            FORWARD_BUFFERS.with_borrow_mut(|b| {
                if b.len() < buf.len() {
                    *b = buf;
                }
            });
        }
        Ok(x)
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

/// `row[i] = exp(scale · (row[i] − max))` for every element (`max` ≥ every
/// element, `scale > 0`), returning their sum: the unnormalised softmax of
/// `scale · row`. Vectorised with AVX-512 or AVX2 + FMA when the CPU has
/// them (the same code compiled for them: the same values; the sum in 16
/// partial sums either way).
fn softmax_exp(row: &mut [f32], max: f32, scale: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx512f_fma() {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { softmax_exp_avx512(row, max, scale) };
        }
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { softmax_exp_avx2(row, max, scale) };
        }
    }
    softmax_exp_body(row, max, scale)
}

/// [`softmax_exp`] compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn softmax_exp_avx512(row: &mut [f32], max: f32, scale: f32) -> f32 {
    softmax_exp_body(row, max, scale)
}

/// [`softmax_exp`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_exp_avx2(row: &mut [f32], max: f32, scale: f32) -> f32 {
    softmax_exp_body(row, max, scale)
}

/// The body of [`softmax_exp`], branch-free so that it vectorises.
#[inline(always)]
fn softmax_exp_body(row: &mut [f32], max: f32, scale: f32) -> f32 {
    let (chunks, rest) = row.as_chunks_mut::<16>();
    let mut acc = [0.0f32; 16];
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp_nonpositive((*v - max) * scale);
            *a += *v;
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for v in rest {
        *v = exp_nonpositive((*v - max) * scale);
        sum += *v;
    }
    sum
}

/// `exp(y)` for `y ≤ 0` (NaN for NaN), without branches: Cody–Waite
/// reduction `y = n ln2 + r`, `|r| ≤ ln2/2`, the degree-6 polynomial of
/// [`gelu`] for `exp(r)`, an exponent shift. Relative error below 2e-7;
/// `y < −87.3` (results below 1.2e-38) gives `exp(−87.3)`, which softmax
/// sums never notice.
#[inline(always)]
fn exp_nonpositive(y: f32) -> f32 {
    const E: [f32; 7] = [1.0, 1.0, 0.499_999_94, 0.166_664_6, 0.041_668_236, 0.008_371_556, 0.001_382_483_4];
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23
    let y = y.max(-87.3);
    // n ≥ −126, so 2^n is normal.
    let big = y.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = big - ROUND;
    let ni = big.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, y));
    let mut p = E[6];
    for &c in E[..6].iter().rev() {
        p = p.mul_add(r, c);
    }
    p * f32::from_bits(((ni + 127) << 23) as u32)
}

/// `x[t] = LayerNorm(x[t] + residual[t])` (or of `x[t]` alone), each row
/// `(x - mean) / sqrt(var + eps) * w + b` with the population variance.
fn layer_norm_rows(pool: &ThreadPool, x: &mut [f32], residual: Option<&[f32]>, w: &[f32], b: &[f32], eps: f32) {
    let d = w.len();
    par_rows(pool, x, d, &|t, row| {
        if let Some(r) = residual {
            add(row, &r[t * d..(t + 1) * d]);
        }
        let mean = sum16(row, |v| v) / d as f32;
        let var = sum16(row, |v| (v - mean) * (v - mean)) / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &wi), &bi) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * wi + bi;
        }
    });
}

/// The largest element (−∞ for an empty slice; NaNs ignored), with 16
/// partial maxima (so that the loop vectorises).
#[inline]
fn max16(x: &[f32]) -> f32 {
    let (chunks, rest) = x.as_chunks::<16>();
    let mut acc = [f32::NEG_INFINITY; 16];
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    acc.iter().chain(rest).fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a })
}

/// `Σ f(x[i])` with 16 partial sums (so that the loop vectorises).
#[inline]
fn sum16(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let (chunks, rest) = x.as_chunks::<16>();
    let mut acc = [0.0f32; 16];
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f(v);
        }
    }
    acc.iter().sum::<f32>() + rest.iter().map(|&v| f(v)).sum::<f32>()
}

/// GELU in its exact form, `x/2 · (1 + erf(x/√2))` (PyTorch's default
/// `gelu`, BERT's `hidden_act = "gelu"`), in f32.
///
/// Written as `relu(x) − |x|/2 · erfc(|x|/√2)`, with `erfc(a/√2) =
/// exp(−a²/2) · g(a)`: `a²` is split exactly into `h + l` with an FMA, so
/// `exp(−a²/2) = exp(−h/2) · (1 − l/2)` keeps full relative precision far
/// into the tail (Cody–Waite reduction, a degree-6 polynomial, an exponent
/// shift), and the scaled complementary error function `g(a) = erfcx(a/√2)`
/// is a (5, 6) rational fit with positive coefficients on `[0, 13.5]`
/// (relative error 7e-11 in exact arithmetic). No branches: the loop over
/// a slice vectorises ([`gelu_slice`]). Relative error against the exact
/// function, measured on a dense grid of `[−13, 13]`: 7.6e-8 RMS, 3.3e-7 at
/// most for `|x| < 2`, 5.1e-7 at most in the far negative tail (the f64
/// formula this replaces: 5.2e-8 RMS, 1.6e-7 at most). For `x < −13`
/// (`|gelu(x)| < 1e-37`) the result is −0.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    const P: [f32; 6] = [1.0, 1.009_671_2, 0.496_346_65, 0.140_587_8, 0.022_829_548, 0.001_731_541];
    const Q: [f32; 7] = [1.0, 1.807_555_8, 1.438_567_6, 0.650_581_7, 0.178_377_15, 0.028_612_375, 0.002_170_169];
    let a = x.abs().min(13.0);
    // a² = h + l exactly; y = −h/2 exactly.
    let h = a * a;
    let l = a.mul_add(a, -h);
    // exp(−h/2) (h ≤ 169, inside exp_nonpositive's clamp), then · exp(−l/2).
    let e = exp_nonpositive(-0.5 * h);
    let e = e.mul_add(-0.5 * l, e);
    // |x|/2 · g(|x|) = (a/2 · P(a)) / Q(a).
    let (mut pp, mut qq) = (P[5], Q[6]);
    for &c in P[..5].iter().rev() {
        pp = pp.mul_add(a, c);
    }
    for &c in Q[..6].iter().rev() {
        qq = qq.mul_add(a, c);
    }
    let tail = e * ((0.5 * a * pp) / qq);
    let tail = if x.abs() > 13.0 { 0.0 } else { tail };
    let g = if x > 0.0 { x - tail } else { -tail };
    if x.is_nan() { x } else { g }
}

/// `x = gelu(x)` for every element, vectorised with AVX-512 or AVX2 + FMA
/// when the CPU has them (the same formula; FMAs round once).
pub fn gelu_slice(xs: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx512f_fma() {
            // SAFETY: the CPU has AVX-512F and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { gelu_avx512(xs) };
        }
        if spinfer_kernels::cpu::CpuFeatures::detect().has_avx2_fma() {
            // SAFETY: the CPU has AVX2 and FMA (checked just above, by `CpuFeatures::detect`).
            return unsafe { gelu_avx2(xs) };
        }
    }
    xs.iter_mut().for_each(|v| *v = gelu(*v));
}

/// [`gelu_slice`] compiled for AVX-512.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn gelu_avx512(xs: &mut [f32]) {
    xs.iter_mut().for_each(|v| *v = gelu(*v));
}

/// [`gelu_slice`] compiled for AVX2.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_avx2(xs: &mut [f32]) {
    xs.iter_mut().for_each(|v| *v = gelu(*v));
}

/// How token states become one sentence vector (sentence-transformers'
/// `Pooling` module). Several modes may be on: their vectors are
/// concatenated in the order cls, max, mean, mean_sqrt_len, as
/// sentence-transformers does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pooling {
    /// The first token's state ([CLS]).
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

/// Runs `f(row index, row)` for every `width`-wide row of `data`, the rows
/// split into contiguous ranges over the pool's threads.
fn par_rows(pool: &ThreadPool, data: &mut [f32], width: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
    let n = data.len() / width;
    let ptr = SyncPtr::new(data.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        for r in chunk(n, ti, nt) {
            // SAFETY: `chunk` gives each index a disjoint range of rows,
            // each index runs once, and `data` (n * width floats) outlives
            // the broadcast.
            let row = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r * width), width) };
            f(r, row);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_matches_erf_values() {
        // x/2 (1 + erf(x/√2)) from high-precision erf values.
        for (x, want) in [
            (0.0f32, 0.0f64),
            (1.0, 0.841_344_746_068_542_9),
            (-1.0, -0.158_655_253_931_457_07),
            (2.5, 2.484_475_836_685_559_7),
            (-3.0, -0.004_049_694_094_890_287),
            (-8.0, -4.976_768_459_417_455_5e-15),
        ] {
            let got = f64::from(gelu(x));
            assert!((got - want).abs() <= 3e-7 * want.abs(), "gelu({x}) = {got}, want {want}");
        }
    }

    /// The f64 formula `gelu` replaced (Numerical Recipes' `erfcc`, relative
    /// error below 1.2e-7), as a reference on a dense grid.
    fn gelu_f64(x: f32) -> f32 {
        let x = f64::from(x);
        let u = -x * std::f64::consts::FRAC_1_SQRT_2;
        let z = u.abs();
        let t = 1.0 / (1.0 + 0.5 * z);
        let c = [1.000_023_68, 0.374_091_96, 0.096_784_18, -0.186_288_06, 0.278_868_07, -1.135_203_98, 1.488_515_87];
        let tail = c.iter().rev().fold(-0.822_152_23 + t * 0.170_872_77, |acc, &ci| ci + t * acc);
        let r = t * (-z * z - 1.265_512_23 + t * tail).exp();
        (0.5 * x * if u >= 0.0 { r } else { 2.0 - r }) as f32
    }

    #[test]
    fn gelu_matches_the_f64_formula_on_a_dense_grid() {
        let mut xs: Vec<f32> = (-1_300_000..=1_300_000).map(|i| i as f32 * 1e-5).collect();
        xs.extend((0..2000).flat_map(|i| {
            let m = 10f32.powf(-30.0 + i as f32 * 0.015);
            [m, -m]
        }));
        let mut v = xs.clone();
        gelu_slice(&mut v);
        let mut worst = 0.0f64;
        for (&x, &g) in xs.iter().zip(&v) {
            // The vectorised loop computes the same correctly rounded
            // operations as the scalar function.
            assert_eq!(g.to_bits(), gelu(x).to_bits(), "gelu_slice({x}) = {g}, gelu({x}) = {}", gelu(x));
            let want = f64::from(gelu_f64(x));
            if want.abs() > 1e-35 {
                let rel = (f64::from(g) - want).abs() / want.abs();
                worst = worst.max(rel);
                assert!(rel <= 8e-7, "gelu({x}) = {g}, f64 formula {want} (relative {rel:e})");
            } else {
                assert!(f64::from(g).abs() <= 1e-35, "gelu({x}) = {g}, f64 formula {want}");
            }
        }
        assert!(worst > 0.0);
        for (x, want) in [(20.0f32, 20.0f32), (-20.0, 0.0), (f32::INFINITY, f32::INFINITY), (-f32::INFINITY, 0.0)] {
            assert_eq!(gelu(x), want, "gelu({x})");
        }
        assert!(gelu(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_exp_matches_the_scalar_code_and_exp() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        for len in [1usize, 7, 16, 33, 256, 300] {
            let row: Vec<f32> = (0..len).map(|_| (rand() - 0.5) * 60.0).collect();
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let scale = 0.176_776_7;
            let (mut fast, mut slow) = (row.clone(), row.clone());
            let s_fast = softmax_exp(&mut fast, max, scale);
            let s_slow = softmax_exp_body(&mut slow, max, scale);
            // The same operations, dispatched or not (FMAs round once).
            assert_eq!(s_fast.to_bits(), s_slow.to_bits(), "sum, len {len}");
            for (i, ((&f, &s), &x)) in fast.iter().zip(&slow).zip(&row).enumerate() {
                assert_eq!(f.to_bits(), s.to_bits(), "element {i} of {len}");
                let want = (f64::from((x - max) * scale)).exp();
                assert!((f64::from(f) - want).abs() <= 2e-7 * want, "exp({}) = {f}, want {want}", (x - max) * scale);
            }
            let total: f64 = row.iter().map(|&x| (f64::from((x - max) * scale)).exp()).sum();
            assert!((f64::from(s_fast) - total).abs() <= 1e-6 * total, "sum {s_fast}, want {total}");
        }
        let v: Vec<f32> = (0..37).map(|i| ((i * 7919) % 101) as f32 - 50.0).collect();
        assert_eq!(max16(&v), 50.0);
        assert_eq!(max16(&v[..5]), v[..5].iter().copied().fold(f32::NEG_INFINITY, f32::max));
        // Far below the maximum: tiny, never NaN or negative.
        let mut r = [0.0f32, -1000.0, -100.0];
        let s = softmax_exp(&mut r, 0.0, 1.0);
        assert_eq!(r[0], 1.0);
        assert!(r[1] >= 0.0 && r[1] < 1e-37 && r[2] >= 0.0 && r[2] < 1e-37 && s == 1.0 + r[1] + r[2]);
    }

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
