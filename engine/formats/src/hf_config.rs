//! Hugging Face `config.json` of a checkpoint: the hyper-parameters of a
//! Llama, Mistral or Qwen2 model (`LlamaForCausalLM`…) or of a Gemma 3
//! text model (`Gemma3ForCausalLM`, `model_type = "gemma3_text"`), and
//! which tensor layout its names follow ([`HfLayout`]).

use std::path::Path;

use serde_json::Value;

use crate::config::{Arch, FfnAct, ModelConfig, RopeStyle, SUPPORTED_HF_ARCHS, SlidingWindow};
use crate::{Error, Result};

/// How a checkpoint names and stores its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfLayout {
    /// `LlamaForCausalLM` and its relatives: `post_attention_layernorm`
    /// is the norm before the FFN.
    Llama,
    /// `Gemma3ForCausalLM`: norms before and after attention and the FFN,
    /// QK-norms, and every RMSNorm weight stored as `w` of `x · (1 + w)`.
    Gemma3,
}

impl HfLayout {
    /// The layout of the checkpoint whose `config.json` is `json`
    /// (Llama's where the architecture is not one spinfer reads: the
    /// configuration then names it).
    pub fn of(json: &serde_json::Map<String, Value>) -> Self {
        match arch_name(json) {
            Some(n) if GEMMA3.contains(&n) => HfLayout::Gemma3,
            _ => HfLayout::Llama,
        }
    }
}

const GEMMA3: [&str; 2] = ["gemma3_text", "Gemma3ForCausalLM"];

/// `model_type`, else the first of `architectures`.
fn arch_name(json: &serde_json::Map<String, Value>) -> Option<&str> {
    match json.get("model_type").filter(|v| !v.is_null()) {
        Some(v) => v.as_str(),
        None => json.get("architectures")?.as_array()?.first()?.as_str(),
    }
}

fn arch_of(config_path: &Path, json: &serde_json::Map<String, Value>) -> Result<Arch> {
    let c = Cfg { path: config_path, j: json };
    let Some(name) = arch_name(json) else {
        return Err(match (c.get("model_type"), c.get("architectures")) {
            (Some(v), _) => c.err("model_type", &format!("must be a string, got {v}")),
            (None, None) => c.err("model_type", "is missing (and so is 'architectures')"),
            (None, Some(_)) => c.err("architectures", "must be a non-empty array of strings"),
        });
    };
    Ok(match name {
        "llama" | "mistral" | "LlamaForCausalLM" | "MistralForCausalLM" => Arch::Llama,
        "qwen2" | "Qwen2ForCausalLM" => Arch::Qwen2,
        n if GEMMA3.contains(&n) => Arch::Gemma3,
        other => {
            return Err(Error::UnsupportedArch {
                path: config_path.to_path_buf(),
                arch: other.to_string(),
                supported: SUPPORTED_HF_ARCHS,
            });
        }
    })
}

/// Refuses a RoPE scaling other than none: running plain RoPE would
/// silently compute another function.
fn plain_rope(c: &Cfg, key: &str, v: Option<&Value>) -> Result<()> {
    let kind = v.and_then(|v| v.get("rope_type").or_else(|| v.get("type"))).and_then(Value::as_str);
    match kind.filter(|k| *k != "default") {
        Some(kind) => Err(c.err(key, &format!("uses rope scaling type '{kind}', which is not supported yet"))),
        None => Ok(()),
    }
}

/// The hyper-parameters of a Hugging Face `config.json` (`json`, read from
/// `config_path`) for a checkpoint whose tensors are `names` (canonical),
/// `dims` giving a tensor's GGML-order dims or `None` when it is absent: the
/// safetensors loader's, and that of any loader pack serving a `config.json`.
///
/// # Errors
///
/// [`Error::Metadata`] naming a key that is missing, mistyped or
/// contradicted by the tensors; [`Error::UnsupportedArch`].
pub fn config_from_hf(
    config_path: &Path,
    json: &serde_json::Map<String, Value>,
    names: &[String],
    dims: &dyn Fn(&str) -> Result<Option<Vec<usize>>>,
) -> Result<ModelConfig> {
    let c = Cfg { path: config_path, j: json };
    let has_tensor = |n: &str| names.iter().any(|t| t == n);
    let arch = arch_of(config_path, json)?;
    let dim = c.usize("hidden_size")?;
    let n_layers = c.usize("num_hidden_layers")?;
    let n_heads = c.usize("num_attention_heads")?;
    let n_kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(n_heads);
    let head_dim = match c.opt_usize("head_dim")? {
        Some(h) => h,
        None => dim.checked_div(n_heads).unwrap_or(0),
    };
    let rope_params = c.get("rope_parameters");
    // transformers v5 moved `rope_theta` under `rope_parameters`, and
    // under its `full_attention` entry for models with several layer types.
    let nested = |path: &[&str]| path.iter().try_fold(rope_params?, |v, k| v.get(*k)).filter(|v| !v.is_null());
    let rope_theta = match c.opt_f64("rope_theta")? {
        Some(t) => t,
        None => {
            match [&["rope_theta"][..], &["full_attention", "rope_theta"]].iter().find_map(|p| Some((p, nested(p)?))) {
                Some((p, v)) => {
                    let key = format!("rope_parameters.{}", p.join("."));
                    v.as_f64().ok_or_else(|| c.err(&key, "must be a number"))?
                }
                None => 10_000.0,
            }
        }
    };
    for (key, v) in [("rope_scaling", c.get("rope_scaling")), ("rope_parameters", rope_params)] {
        plain_rope(&c, key, v)?;
    }
    // Gemma 3: per layer type RoPE (transformers v5 nests it by type).
    for t in ["full_attention", "sliding_attention"] {
        plain_rope(&c, &format!("rope_parameters.{t}"), rope_params.and_then(|p| p.get(t)))?;
    }
    let tie = c.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    let cfg = ModelConfig {
        arch,
        n_layers,
        dim,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_dim: c.usize("intermediate_size")?,
        vocab_size: c.usize("vocab_size")?,
        rope_theta: rope_theta as f32,
        rope_style: RopeStyle::NeoX,
        rms_eps: c.f64("rms_norm_eps")? as f32,
        ctx_train: c.usize("max_position_embeddings")?,
        tied_embeddings: tie || !has_tensor("output.weight"),
        qkv_bias: has_tensor("blk.0.attn_q.bias"),
        ffn_act: if arch == Arch::Gemma3 { FfnAct::GeluTanh } else { FfnAct::Silu },
        sliding_window: if arch == Arch::Gemma3 { Some(gemma3::sliding_window(&c, n_layers)?) } else { None },
    };
    if arch == Arch::Gemma3 {
        gemma3::check_function(&c, head_dim)?;
    }
    cfg.check_tensors(names, dims, config_path, &|field| {
        match field {
            "block_count" => "num_hidden_layers",
            "embedding_length" => "hidden_size",
            "head_count" => "num_attention_heads",
            "head_count_kv" if c.get("num_key_value_heads").is_some() => "num_key_value_heads",
            "head_count_kv" => "num_attention_heads",
            "feed_forward_length" => "intermediate_size",
            _ => "vocab_size",
        }
        .into()
    })?;
    cfg.validate().map_err(|d| Error::format(config_path, d))?;
    Ok(cfg)
}

/// Typed access to `config.json` keys; `null` counts as absent.
pub(crate) struct Cfg<'a> {
    path: &'a Path,
    j: &'a serde_json::Map<String, Value>,
}

impl Cfg<'_> {
    fn err(&self, key: &str, detail: &str) -> Error {
        Error::Metadata { path: self.path.to_path_buf(), key: key.into(), detail: detail.into() }
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.j.get(key).filter(|v| !v.is_null())
    }

    fn typed<T>(&self, key: &str, what: &str, f: impl Fn(&Value) -> Option<T>) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| self.err(key, &format!("must be {what}, got {v}"))),
        }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.typed(key, "an unsigned integer", |v| v.as_u64().and_then(|x| usize::try_from(x).ok()))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.err(key, "is missing"))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", Value::as_f64)
    }

    fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?.ok_or_else(|| self.err(key, "is missing"))
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a boolean", Value::as_bool)
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.err(key, &format!("must be a string, got {v}"))),
        }
    }
}

/// Gemma 3's keys beyond Llama's.
mod gemma3 {
    use super::*;

    /// The local layers: `sliding_window`, which layers are local
    /// (`layer_types`, or every `sliding_window_pattern`-th global) and
    /// their RoPE base (`rope_local_base_freq`, or transformers v5's
    /// `rope_parameters.sliding_attention.rope_theta`).
    pub(super) fn sliding_window(c: &Cfg, n_layers: usize) -> Result<SlidingWindow> {
        let window = c.usize("sliding_window")?;
        let pattern = match c.get("layer_types") {
            Some(v) => pattern_of(c, v, n_layers)?,
            None => match c.opt_usize("sliding_window_pattern")? {
                Some(p) => p,
                None => c.opt_usize("_sliding_window_pattern")?.unwrap_or(6),
            },
        };
        let local = c.get("rope_parameters").and_then(|p| p.get("sliding_attention")).and_then(|p| p.get("rope_theta"));
        let rope_theta = match (c.opt_f64("rope_local_base_freq")?, local) {
            (Some(t), _) => t,
            (None, Some(v)) => v.as_f64().ok_or_else(|| {
                c.err("rope_parameters.sliding_attention.rope_theta", &format!("must be a number, got {v}"))
            })?,
            (None, None) => 10_000.0,
        };
        Ok(SlidingWindow { window, pattern, rope_theta: rope_theta as f32 })
    }

    /// The period of `layer_types` (every `p`-th layer `full_attention`,
    /// the others `sliding_attention`): the layouts spinfer runs.
    fn pattern_of(c: &Cfg, v: &Value, n_layers: usize) -> Result<usize> {
        let bad = |d: &str| c.err("layer_types", d);
        let types = v.as_array().ok_or_else(|| bad("must be an array of layer types"))?;
        if types.len() != n_layers {
            return Err(bad(&format!("has {} entries for {n_layers} layers", types.len())));
        }
        let full: Vec<bool> = types
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(true),
                Some("sliding_attention") => Ok(false),
                _ => Err(bad(&format!("holds {t}: each must be \"full_attention\" or \"sliding_attention\""))),
            })
            .collect::<Result<_>>()?;
        let pattern = full.iter().position(|&f| f).map_or(n_layers + 1, |i| i + 1);
        if full.iter().enumerate().any(|(l, &f)| f != (l + 1).is_multiple_of(pattern)) {
            let d = format!(
                "is not one global layer in every {pattern} (the others local), the only interleaving supported"
            );
            return Err(bad(&d));
        }
        Ok(pattern)
    }

    /// Keys that would change the function where they leave Gemma 3's
    /// defaults, which spinfer computes: refused by name otherwise.
    pub(super) fn check_function(c: &Cfg, head_dim: usize) -> Result<()> {
        if let Some(act) = c.opt_str("hidden_activation")?.filter(|a| *a != "gelu_pytorch_tanh") {
            return Err(c.err("hidden_activation", &format!("is '{act}': only gelu_pytorch_tanh is supported")));
        }
        if let Some(s) = c.opt_f64("query_pre_attn_scalar")?.filter(|&s| s != head_dim as f64) {
            let d = format!("is {s}: only a query scale of 1/sqrt(head_dim = {head_dim}) is supported yet");
            return Err(c.err("query_pre_attn_scalar", &d));
        }
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if c.get(key).is_some() {
                return Err(c.err(key, "is set: logit soft-capping is not supported yet"));
            }
        }
        for key in ["use_bidirectional_attention", "attention_bias"] {
            if c.opt_bool(key)? == Some(true) {
                return Err(c.err(key, "is true, which is not supported yet"));
            }
        }
        Ok(())
    }
}
