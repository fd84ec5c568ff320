//! BERT's hyper-parameters, read from HF `config.json`: a leaf the model
//! (`bert.rs`) and its sparse FFN (`experimental/bert_sparse.rs`) share.

use std::path::Path;

use serde_json::Value;

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
        // Real configs are a few hundred bytes: refuse a huge file before
        // reading it whole.
        let len = std::fs::metadata(path).map_err(|e| Error::io(path, e))?.len();
        if len > 1 << 20 {
            return Err(Error::format(path, format!("is {len} bytes: too large for a model config (at most 1 MiB)")));
        }
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
