//! Model hyper-parameters, read from GGUF metadata or HF `config.json`.

use std::collections::BTreeSet;

use crate::gguf::GgufFile;
use crate::{Error, Result};

/// Supported architectures (all share the Llama block structure).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama, SmolLM, Mistral (GGUF `llama`/`mistral`, HF `LlamaForCausalLM`/`MistralForCausalLM`).
    Llama,
    /// Qwen2: Llama plus biases on the q/k/v projections.
    Qwen2,
    /// Gemma 3 text models (GGUF `gemma3`, HF `Gemma3ForCausalLM`): embeddings scaled by √dim,
    /// QK-norm, norms after attention and FFN as well as before, GeGLU
    /// (tanh GELU), local sliding-window layers between global ones
    /// ([`SlidingWindow`]). RMSNorm weights in GGUF already hold Gemma's
    /// `1 + w`; a safetensors checkpoint's `w` is served as `1 + w`.
    Gemma3,
}

/// Architectures read from GGUF.
pub const SUPPORTED_ARCHS: &str = "llama, mistral, qwen2, gemma3";
/// Architectures read from safetensors checkpoints (HF `config.json`).
pub const SUPPORTED_HF_ARCHS: &str = "llama, mistral, qwen2, gemma3_text";

/// The activation of the gated FFN: `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnAct {
    /// `silu` (SwiGLU): Llama, Qwen2.
    Silu,
    /// GELU, tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

/// Interleaved local attention (Gemma 3): most layers attend to the last
/// `window` positions only, with their own RoPE base; every `pattern`-th
/// layer (1-based) is global.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a local layer's token attends to, itself included.
    pub window: usize,
    /// Layer `l` is global when `(l + 1) % pattern == 0`.
    pub pattern: usize,
    /// RoPE base of the local layers (global layers use `rope_theta`).
    pub rope_theta: f32,
}

impl SlidingWindow {
    /// Whether layer `l` attends over a sliding window.
    pub fn is_local(&self, l: usize) -> bool {
        !(l + 1).is_multiple_of(self.pattern)
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: GGUF llama files, whose q/k weights
    /// the converter permuted into this layout.
    Interleaved,
    /// Halves `(x[i], x[i + d/2])`: HF checkpoints (`rotate_half`) and GGUF
    /// qwen2.
    NeoX,
}

/// Maps a field of [`ModelConfig::check_tensors`] to the key that set it.
pub type KeyName<'a> = dyn Fn(&str) -> String + 'a;

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    /// Hidden size.
    pub dim: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// FFN inner size.
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub rms_eps: f32,
    /// Context length the model was trained for.
    pub ctx_train: usize,
    /// True if the output projection reuses the token embedding.
    pub tied_embeddings: bool,
    /// Optional q/k/v biases (Qwen2).
    pub qkv_bias: bool,
    pub ffn_act: FfnAct,
    /// Local attention layers (Gemma 3); `None`: every layer is global.
    pub sliding_window: Option<SlidingWindow>,
}

impl ModelConfig {
    /// Gemma's extras: embeddings × √dim, per-head RMSNorm of q and k,
    /// RMSNorm of the attention and FFN outputs before the residual add.
    pub fn is_gemma(&self) -> bool {
        self.arch == Arch::Gemma3
    }
}

impl ModelConfig {
    /// Reads `<arch>.*` keys as llama.cpp does.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.require_str("general.architecture")?;
        let arch = match arch_name {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "gemma3" => Arch::Gemma3,
            other => {
                return Err(Error::UnsupportedArch {
                    path: g.path().to_path_buf(),
                    arch: other.to_string(),
                    supported: SUPPORTED_ARCHS,
                });
            }
        };
        let key = |k: &str| format!("{arch_name}.{k}");
        let usize_key = |k: &str| -> Result<usize> {
            let v = g.require_u64(&key(k))?;
            usize::try_from(v).map_err(|_| g.meta_err(&key(k), "is too large"))
        };
        let dim = usize_key("embedding_length")?;
        let n_heads = usize_key("attention.head_count")?;
        let n_kv_heads = match g.get(&key("attention.head_count_kv")) {
            Some(_) => usize_key("attention.head_count_kv")?,
            None => n_heads,
        };
        let head_dim = match g.get(&key("attention.key_length")) {
            Some(_) => usize_key("attention.key_length")?,
            None if n_heads > 0 => dim / n_heads,
            None => 0,
        };
        let vocab_size = match g.get(&key("vocab_size")) {
            Some(_) => usize_key("vocab_size")?,
            None => g.str_array("tokenizer.ggml.tokens")?.map(|t| t.len()).unwrap_or(0),
        };
        // Scaled RoPE computes another function than the plain one: refuse
        // it rather than run it wrong.
        if let Some(kind) = g.get(&key("rope.scaling.type")).and_then(|v| v.as_str())
            && kind != "none"
        {
            return Err(g.meta_err(&key("rope.scaling.type"), &format!("'{kind}' is not supported yet")));
        }
        let rope_theta = match g.get(&key("rope.freq_base")) {
            Some(_) => g.require_f64(&key("rope.freq_base"))? as f32,
            None => 10_000.0,
        };
        // Gemma 3: the window from the metadata; the layer pattern and the
        // local RoPE base where the file states them, else Gemma 3's (every
        // 6th layer global, base 10,000; as llama.cpp assumes).
        let sliding_window = match arch {
            Arch::Gemma3 => Some(SlidingWindow {
                window: usize_key("attention.sliding_window")?,
                pattern: match g.get(&key("attention.sliding_window_pattern")) {
                    Some(_) => usize_key("attention.sliding_window_pattern")?,
                    None => 6,
                },
                rope_theta: match g.get(&key("rope.local.freq_base")) {
                    Some(_) => g.require_f64(&key("rope.local.freq_base"))? as f32,
                    None => 10_000.0,
                },
            }),
            _ => None,
        };
        let cfg = ModelConfig {
            arch,
            n_layers: usize_key("block_count")?,
            dim,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: usize_key("feed_forward_length")?,
            vocab_size,
            rope_theta,
            // llama.cpp's converter permutes q/k of llama files only.
            rope_style: if arch == Arch::Llama { RopeStyle::Interleaved } else { RopeStyle::NeoX },
            rms_eps: g.require_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            ctx_train: usize_key("context_length")?,
            tied_embeddings: g.tensor_info("output.weight").is_none(),
            qkv_bias: g.tensor_info("blk.0.attn_q.bias").is_some(),
            ffn_act: if arch == Arch::Gemma3 { FfnAct::GeluTanh } else { FfnAct::Silu },
            sliding_window,
        };
        let names: Vec<String> = g.tensors.iter().map(|t| t.name.clone()).collect();
        let dims = |n: &str| g.tensor_info(n).is_some().then(|| g.tensor(n).map(|t| t.dims)).transpose();
        cfg.check_tensors(&names, &dims, g.path(), &|field| match field {
            "vocab_size" if g.get(&key("vocab_size")).is_none() => "tokenizer.ggml.tokens".into(),
            "block_count" | "embedding_length" | "feed_forward_length" | "vocab_size" => key(field),
            _ => key(&format!("attention.{field}")),
        })?;
        cfg.validate().map_err(|d| Error::format(g.path(), d))?;
        Ok(cfg)
    }

    /// Checks every count and size that later becomes an allocation against
    /// the tensors the file actually holds (`names`, and `dims` of a tensor
    /// or `None` when it is absent): the layer count against the
    /// `blk.N.*` blocks present, and the hidden size, head counts, head dim,
    /// FFN size and vocabulary against the shapes of the token embedding and
    /// of block 0's projections. `key` names the metadata key (or
    /// `config.json` field) of a field (`block_count`, `embedding_length`,
    /// `head_count`, `head_count_kv`, `feed_forward_length`,
    /// `vocab_size`) for the error, which is reported against `path`.
    ///
    /// A file whose metadata claims 2^31 layers is refused here, naming the
    /// key, before anything is sized from it.
    pub fn check_tensors(
        &self,
        names: &[String],
        dims: &dyn Fn(&str) -> Result<Option<Vec<usize>>>,
        path: &std::path::Path,
        key: &KeyName,
    ) -> Result<()> {
        let err = |field: &str, detail: String| Error::Metadata { path: path.to_path_buf(), key: key(field), detail };
        let blocks: BTreeSet<usize> =
            names.iter().filter_map(|n| n.strip_prefix("blk.")?.split_once('.')?.0.parse::<usize>().ok()).collect();
        // Every block 0..n_layers must have tensors (checked only once the
        // count is known to be no larger than the number of blocks present,
        // so a huge count costs nothing).
        if self.n_layers > blocks.len() {
            let have = match blocks.len() {
                0 => "no block tensors (blk.N.*)".to_string(),
                1 => "tensors for 1 block".to_string(),
                n => format!("tensors for {n} blocks"),
            };
            return Err(err("block_count", format!("= {} but the file has {have}", self.n_layers)));
        }
        if let Some(l) = (0..self.n_layers).find(|l| !blocks.contains(l)) {
            let detail = format!("= {} but the file has no tensors for block {l} (blk.{l}.*)", self.n_layers);
            return Err(err("block_count", detail));
        }
        let q_dim = self.n_heads.checked_mul(self.head_dim);
        let kv_dim = self.n_kv_heads.checked_mul(self.head_dim);
        if let Some(d) = dims("token_embd.weight")?
            && d.len() == 2
        {
            if d[0] != self.dim {
                let detail = format!("= {} but token_embd.weight has shape {d:?} (hidden size first)", self.dim);
                return Err(err("embedding_length", detail));
            }
            if d[1] != self.vocab_size {
                let detail = format!("= {} but token_embd.weight has {} rows (one per token)", self.vocab_size, d[1]);
                return Err(err("vocab_size", detail));
            }
        }
        // (tensor, field checked against its rows, its value, expected rows)
        let rows = [
            ("blk.0.attn_q.weight", "head_count", self.n_heads, q_dim),
            ("blk.0.attn_k.weight", "head_count_kv", self.n_kv_heads, kv_dim),
            ("blk.0.ffn_gate.weight", "feed_forward_length", self.ffn_dim, Some(self.ffn_dim)),
        ];
        for (tensor, field, value, want) in rows {
            let Some(d) = dims(tensor)? else { continue };
            if d.len() != 2 || Some(d[1]) == want {
                continue;
            }
            let detail = if field == "feed_forward_length" {
                format!("= {value} but {tensor} has {} rows", d[1])
            } else {
                format!("= {value} but {tensor} has {} rows, not {value} heads x head dim {}", d[1], self.head_dim)
            };
            return Err(err(field, detail));
        }
        Ok(())
    }

    /// Checks the values are usable together; returns a description of
    /// the first problem.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let nonzero = [
            ("layer count", self.n_layers),
            ("hidden size", self.dim),
            ("head count", self.n_heads),
            ("kv head count", self.n_kv_heads),
            ("head dim", self.head_dim),
            ("ffn size", self.ffn_dim),
            ("vocab size", self.vocab_size),
        ];
        for (what, v) in nonzero {
            if v == 0 {
                return Err(format!("{what} is 0"));
            }
        }
        let products = [
            ("head count x head dim", self.n_heads.checked_mul(self.head_dim)),
            ("kv head count x head dim", self.n_kv_heads.checked_mul(self.head_dim)),
            ("vocab size x hidden size", self.vocab_size.checked_mul(self.dim)),
            ("ffn size x hidden size", self.ffn_dim.checked_mul(self.dim)),
            ("layer count x hidden size", self.n_layers.checked_mul(self.dim)),
        ];
        for (what, v) in products {
            if v.is_none_or(|v| v > isize::MAX as usize / 4) {
                return Err(format!("{what} overflows"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!("head count {} is not a multiple of kv head count {}", self.n_heads, self.n_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head dim {} is odd (RoPE needs pairs)", self.head_dim));
        }
        if !(self.rms_eps > 0.0 && self.rope_theta > 0.0) {
            return Err(format!("rms epsilon {} and rope theta {} must be positive", self.rms_eps, self.rope_theta));
        }
        if let Some(w) = &self.sliding_window {
            if w.window == 0 || w.pattern == 0 {
                return Err(format!(
                    "sliding window {} and its layer pattern {} must be at least 1",
                    w.window, w.pattern
                ));
            }
            if w.rope_theta.is_nan() || w.rope_theta <= 0.0 {
                return Err(format!("local rope theta {} must be positive", w.rope_theta));
            }
        }
        Ok(())
    }
}
