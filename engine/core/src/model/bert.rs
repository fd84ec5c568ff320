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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::{ThreadPool, chunk};

use super::math;
use crate::loader::Loader;
use crate::registry::KernelRegistry;
use crate::tensor::{TensorData, TensorView};
use crate::{Error, Result};

/// Hyper-parameters, from HF `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    pub vocab_size: usize,
    /// Width of the residual stream (`hidden_size`).
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    /// `hidden / n_heads`.
    pub head_dim: usize,
    /// FFN width (`intermediate_size`).
    pub intermediate: usize,
    /// Longest sequence the position table covers (`max_position_embeddings`).
    pub max_positions: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f32,
}

impl BertConfig {
    /// Reads `config.json`. Only `hidden_act = "gelu"` (exact erf GELU) and
    /// absolute position embeddings are supported; anything else is an
    /// error naming the key, never a silently different function.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid json: {e}")))?;
        let key_err = |key: &str, detail: String| Error::Metadata { path: path.to_path_buf(), key: key.into(), detail };
        let opt_str = |key: &str| -> Result<Option<&str>> {
            match json.get(key).filter(|v| !v.is_null()) {
                None => Ok(None),
                Some(v) => v.as_str().map(Some).ok_or_else(|| key_err(key, format!("must be a string, got {v}"))),
            }
        };
        let usize_key = |key: &str| -> Result<usize> {
            match json.get(key).filter(|v| !v.is_null()) {
                None => Err(key_err(key, "is missing".into())),
                Some(v) => v
                    .as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .filter(|&x| x > 0)
                    .ok_or_else(|| key_err(key, format!("must be a positive integer, got {v}"))),
            }
        };

        match opt_str("model_type")? {
            None | Some("bert") => {}
            Some(other) => {
                return Err(Error::UnsupportedArch { path: path.to_path_buf(), arch: other.into(), supported: "bert" });
            }
        }
        match opt_str("hidden_act")? {
            Some("gelu") => {}
            Some(other) => return Err(key_err("hidden_act", format!("is '{other}'; only 'gelu' is supported"))),
            None => return Err(key_err("hidden_act", "is missing".into())),
        }
        if let Some(p) = opt_str("position_embedding_type")?.filter(|p| *p != "absolute") {
            return Err(key_err("position_embedding_type", format!("is '{p}'; only 'absolute' is supported")));
        }
        let hidden = usize_key("hidden_size")?;
        let n_heads = usize_key("num_attention_heads")?;
        if !hidden.is_multiple_of(n_heads) {
            return Err(key_err("num_attention_heads", format!("({n_heads}) does not divide hidden_size ({hidden})")));
        }
        let layer_norm_eps = match json.get("layer_norm_eps").filter(|v| !v.is_null()) {
            None => 1e-12,
            Some(v) => v.as_f64().ok_or_else(|| key_err("layer_norm_eps", format!("must be a number, got {v}")))?,
        };
        Ok(Self {
            vocab_size: usize_key("vocab_size")?,
            hidden,
            n_layers: usize_key("num_hidden_layers")?,
            n_heads,
            head_dim: hidden / n_heads,
            intermediate: usize_key("intermediate_size")?,
            max_positions: usize_key("max_position_embeddings")?,
            type_vocab_size: usize_key("type_vocab_size")?,
            layer_norm_eps: layer_norm_eps as f32,
        })
    }
}

/// Tokens per matmul call: the activations of a block (at most
/// `TOKEN_BLOCK x intermediate` f32, 768 KiB for MiniLM) stay in L2 while
/// the kernel walks the weight rows.
const TOKEN_BLOCK: usize = 128;

/// A weight matrix with its bias, bound (once, at load) to the kernel the
/// registry resolves for it: `out = W · x + b`.
pub struct Dense {
    /// Tensor name in the file, for errors and reports.
    pub name: String,
    w: TensorData,  // (rows, cols), borrowed from the file mapping
    bias: Vec<f32>, // (rows)
    pub desc: MatmulDesc,
    kernel: Arc<dyn MatmulKernel>,
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
        Ok(Self { name, w: t.data, bias, desc, kernel })
    }

    /// `out[t, :] = W · x[t, :] + b` for the `n` rows of `x`.
    fn forward(&self, pool: &ThreadPool, x: &[f32], n: usize, out: &mut [f32]) -> Result<()> {
        let (rows, cols) = (self.desc.rows, self.desc.cols);
        let out = &mut out[..n * rows];
        let mut scratch = Vec::new();
        // The kernels stream every token's activations once per tile of
        // weight rows: blocks of TOKEN_BLOCK tokens keep them in cache.
        for (xb, ob) in x[..n * cols].chunks(TOKEN_BLOCK * cols).zip(out.chunks_mut(TOKEN_BLOCK * rows)) {
            self.kernel
                .run(pool, self.w.bytes(), xb, xb.len() / cols, ob, &mut scratch)
                .map_err(|source| Error::Kernel { kernel: self.kernel.name().to_string(), source })?;
        }
        par_rows(pool, out, rows, &|_, row| {
            for (o, b) in row.iter_mut().zip(&self.bias) {
                *o += b;
            }
        });
        Ok(())
    }

    pub fn kernel_name(&self) -> &str {
        self.kernel.name()
    }
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

        let mut layers = Vec::with_capacity(c.n_layers);
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
            });
        }
        tracing::debug!(layers = c.n_layers, kernel = layers.first().map(|l| l.query.kernel_name()), "bert loaded");
        let weights =
            Weights { word_embeddings, position_embeddings, token_type_embeddings, embed_norm_w, embed_norm_b, layers };
        Ok(Self { config, weights, path: loader.path().to_path_buf() })
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
        // Each token's sequence as (first token, length), for attention.
        let spans: Vec<(usize, usize)> = seqs
            .iter()
            .scan(0, |start, s| {
                let span = (*start, s.len());
                *start += s.len();
                Some(std::iter::repeat_n(span, s.len()))
            })
            .flatten()
            .collect();
        let n = spans.len();
        let mut x = vec![0.0f32; n * d]; // residual stream (n, hidden)
        let mut q = vec![0.0f32; n * d]; // (n, hidden), head h in columns h*hd..(h+1)*hd
        let mut k = vec![0.0f32; n * d];
        let mut v = vec![0.0f32; n * d];
        let mut att = vec![0.0f32; n * d]; // attention output, heads concatenated (n, hidden)
        let mut tmp = vec![0.0f32; n * d]; // sub-layer output before the residual add (n, hidden)
        let mut ffn = vec![0.0f32; n * c.intermediate]; // (n, intermediate)

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

        for layer in &w.layers {
            // Q, K, V projections (with biases).
            layer.query.forward(pool, &x, n, &mut q)?;
            layer.key.forward(pool, &x, n, &mut k)?;
            layer.value.forward(pool, &x, n, &mut v)?;
            // Bidirectional multi-head attention, each token over the
            // tokens of its own sequence (the padding mask).
            attention(pool, &q, &k, &v, &spans, heads, hd, &mut att);
            // Output projection, residual, LayerNorm (post-LN).
            layer.attn_out.forward(pool, &att, n, &mut tmp)?;
            layer_norm_rows(pool, &mut x, Some(&tmp), &layer.attn_norm_w, &layer.attn_norm_b, c.layer_norm_eps);
            // FFN: down(gelu(up(x))), residual, LayerNorm.
            layer.ffn_up.forward(pool, &x, n, &mut ffn)?;
            par_rows(pool, &mut ffn, c.intermediate, &|_, r| r.iter_mut().for_each(|f| *f = gelu(*f)));
            layer.ffn_down.forward(pool, &ffn, n, &mut tmp)?;
            layer_norm_rows(pool, &mut x, Some(&tmp), &layer.out_norm_w, &layer.out_norm_b, c.layer_norm_eps);
        }
        Ok(x)
    }

    /// Row `i` of an embedding table as f32.
    fn embedding_row(&self, table: &TensorView, i: usize, out: &mut [f32]) -> Result<()> {
        let d = self.config.hidden;
        let row_bytes = table.ty.row_bytes(d)?;
        let src = &table.data.bytes()[i * row_bytes..(i + 1) * row_bytes];
        dequantize_row(table.ty, src, out).map_err(|e| Error::TensorType {
            path: self.path.clone(),
            tensor: table.name.clone(),
            ty: table.ty.to_string(),
            what: format!("cannot be read as embeddings: {e}"),
        })
    }

    /// Every matmul with its kernel, for reports.
    pub fn dense_layers(&self) -> impl Iterator<Item = &Dense> {
        self.weights.layers.iter().flat_map(|l| [&l.query, &l.key, &l.value, &l.attn_out, &l.ffn_up, &l.ffn_down])
    }
}

/// `att[t, head h] = softmax(q_t · K_s / sqrt(hd)) · V_s` where `s` is the
/// span of `t`'s sequence; work items `(token, head)` split over threads.
#[allow(clippy::too_many_arguments, reason = "the attention operands, named as in the formula")]
fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    spans: &[(usize, usize)],
    heads: usize,
    hd: usize,
    att: &mut [f32],
) {
    let d = heads * hd;
    let n = spans.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let max_len = spans.iter().map(|s| s.1).max().unwrap_or(0);
    let mut scores = vec![0.0f32; pool.n_threads() * max_len];
    let scores_ptr = SyncPtr(scores.as_mut_ptr());
    let att_ptr = SyncPtr(att.as_mut_ptr());
    let work = n * heads;
    pool.broadcast(&|ti, nt| {
        // SAFETY: index `ti` runs exactly once per broadcast and uses only
        // row `ti` of `scores` (`max_len` floats; the buffer holds
        // `n_threads * max_len`), which outlives the broadcast.
        let sc = unsafe { std::slice::from_raw_parts_mut(scores_ptr.get().add(ti * max_len), max_len) };
        for item in chunk(work, ti, nt) {
            let (t, h) = (item / heads, item % heads);
            let (start, len) = spans[t];
            let qv = &q[t * d + h * hd..t * d + (h + 1) * hd];
            let sc = &mut sc[..len];
            for (j, s) in sc.iter_mut().enumerate() {
                let kr = (start + j) * d + h * hd;
                *s = math::dot(qv, &k[kr..kr + hd]) * scale;
            }
            math::softmax(sc);
            // SAFETY: the `(t, h)` slice of `att` belongs to this work item
            // alone (items are disjoint across threads); `att` holds `n * d`
            // floats and outlives the broadcast.
            let out = unsafe { std::slice::from_raw_parts_mut(att_ptr.get().add(t * d + h * hd), hd) };
            out.fill(0.0);
            for (j, &p) in sc.iter().enumerate() {
                let vr = (start + j) * d + h * hd;
                math::axpy(p, &v[vr..vr + hd], out);
            }
        }
    });
}

/// `x[t] = LayerNorm(x[t] + residual[t])` (or of `x[t]` alone), each row
/// `(x - mean) / sqrt(var + eps) * w + b` with the population variance.
fn layer_norm_rows(pool: &ThreadPool, x: &mut [f32], residual: Option<&[f32]>, w: &[f32], b: &[f32], eps: f32) {
    let d = w.len();
    par_rows(pool, x, d, &|t, row| {
        if let Some(r) = residual {
            add(row, &r[t * d..(t + 1) * d]);
        }
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, &wi), &bi) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * inv * wi + bi;
        }
    });
}

/// GELU in its exact form, `x/2 · (1 + erf(x/√2)) = x/2 · erfc(-x/√2)`
/// (PyTorch's default `gelu`, BERT's `hidden_act = "gelu"`).
pub fn gelu(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * erfc(-x * std::f64::consts::FRAC_1_SQRT_2)) as f32
}

/// The complementary error function with a relative error below 1.2e-7
/// everywhere (the Chebyshev fit `erfcc` of Numerical Recipes, 2nd ed.,
/// §6.2), i.e. at f32 precision. (`f64::erf` is not stable yet.)
fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98 + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
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
    let ptr = SyncPtr(data.as_mut_ptr());
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

/// A raw pointer that may be shared with the pool's threads; users
/// guarantee disjoint writes.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: the pointer is only dereferenced under the disjointness argument
// stated at each use.
unsafe impl Sync for SyncPtr {}
// SAFETY: as above.
unsafe impl Send for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

fn check_dims(loader: &dyn Loader, t: &TensorView, want: &[usize]) -> Result<()> {
    if t.dims != want {
        return Err(Error::TensorShape {
            path: loader.path().to_path_buf(),
            tensor: t.name.clone(),
            got: t.dims.clone(),
            want: want.to_vec(),
        });
    }
    Ok(())
}

/// A 1-D tensor of `len` elements as f32 (LayerNorm weights, biases).
fn load_vector(loader: &dyn Loader, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = loader.tensor(name)?;
    check_dims(loader, &t, &[len])?;
    let mut out = vec![0.0; len];
    dequantize_row(t.ty, t.data.bytes(), &mut out).map_err(|e| Error::TensorType {
        path: loader.path().to_path_buf(),
        tensor: name.into(),
        ty: t.ty.to_string(),
        what: format!("cannot be read as a vector: {e}"),
    })?;
    Ok(out)
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
