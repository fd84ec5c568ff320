//! Model hyper-parameters, read from GGUF metadata or HF `config.json`.

use crate::gguf::GgufFile;
use crate::{Error, Result};

/// Supported architectures (all share the Llama block structure).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama, SmolLM, Mistral (GGUF `llama`/`mistral`, HF `LlamaForCausalLM`/`MistralForCausalLM`).
    Llama,
    /// Qwen2: Llama plus biases on the q/k/v projections.
    Qwen2,
}

pub const SUPPORTED_ARCHS: &str = "llama, mistral, qwen2";

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
}

impl ModelConfig {
    /// Reads `<arch>.*` keys as llama.cpp does.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch_name = g.require_str("general.architecture")?;
        let arch = match arch_name {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
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
        let rope_theta = match g.get(&key("rope.freq_base")) {
            Some(_) => g.require_f64(&key("rope.freq_base"))? as f32,
            None => 10_000.0,
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
            rope_style: if arch == Arch::Qwen2 { RopeStyle::NeoX } else { RopeStyle::Interleaved },
            rms_eps: g.require_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            ctx_train: usize_key("context_length")?,
            tied_embeddings: g.tensor_info("output.weight").is_none(),
            qkv_bias: g.tensor_info("blk.0.attn_q.bias").is_some(),
        };
        cfg.validate().map_err(|d| Error::format(g.path(), d))?;
        Ok(cfg)
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
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!("head count {} is not a multiple of kv head count {}", self.n_heads, self.n_kv_heads));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head dim {} is odd (RoPE needs pairs)", self.head_dim));
        }
        if !(self.rms_eps > 0.0 && self.rope_theta > 0.0) {
            return Err(format!("rms epsilon {} and rope theta {} must be positive", self.rms_eps, self.rope_theta));
        }
        Ok(())
    }
}
