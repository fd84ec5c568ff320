//! `spinfer inspect`: what a model file holds.

use std::fmt::Write;
use std::path::Path;

use serde::Serialize;

use crate::Result;
use crate::engine::is_safetensors;
use crate::gguf::{GgufFile, Value};
use crate::loader::Loader;
use crate::safetensors::SafetensorsModel;
use crate::tokenizer::Tokenizer;

#[derive(Serialize)]
pub struct ModelInfo {
    pub path: String,
    pub format: String,
    pub file_size: usize,
    pub architecture: String,
    pub hyper_parameters: Vec<(String, String)>,
    pub tokenizer: TokenizerInfo,
    /// Metadata keys and short renderings of their values (GGUF only).
    pub metadata: Vec<(String, String)>,
    pub tensors: Vec<TensorInfo>,
}

#[derive(Serialize)]
pub struct TokenizerInfo {
    pub kind: String,
    pub vocab_size: usize,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
}

#[derive(Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    /// GGML order (innermost first).
    pub dims: Vec<usize>,
    pub bytes: usize,
}

/// Reads everything `inspect` shows.
pub fn inspect(path: &Path) -> Result<ModelInfo> {
    type Opened = (Box<dyn Loader>, Tokenizer, String, Vec<(String, String)>);
    let (loader, tokenizer, format, metadata): Opened = if is_safetensors(path) {
        let st = SafetensorsModel::open(path)?;
        let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new(".")) };
        let tok = Tokenizer::from_json_file(&dir.join("tokenizer.json"))?;
        (Box::new(st), tok, "safetensors".into(), Vec::new())
    } else {
        let g = GgufFile::open(path)?;
        let tok = Tokenizer::from_gguf(&g)?;
        let meta = g.metadata.iter().map(|(k, v)| (k.clone(), render(v))).collect();
        let format = format!("gguf v{}", g.version);
        (Box::new(g), tok, format, meta)
    };
    let c = loader.config()?;
    let hp = vec![
        ("layers", c.n_layers.to_string()),
        ("hidden size", c.dim.to_string()),
        ("heads", c.n_heads.to_string()),
        ("kv heads", c.n_kv_heads.to_string()),
        ("head dim", c.head_dim.to_string()),
        ("ffn size", c.ffn_dim.to_string()),
        ("vocab size", c.vocab_size.to_string()),
        ("context (trained)", c.ctx_train.to_string()),
        ("rope theta", c.rope_theta.to_string()),
        ("rope style", format!("{:?}", c.rope_style)),
        ("rms eps", c.rms_eps.to_string()),
        ("tied embeddings", c.tied_embeddings.to_string()),
        ("qkv bias", c.qkv_bias.to_string()),
        ("ffn activation", format!("{:?}", c.ffn_act)),
    ];
    let mut hp = hp;
    if let Some(w) = &c.sliding_window {
        let global: Vec<String> = (0..c.n_layers).filter(|&l| !w.is_local(l)).map(|l| l.to_string()).collect();
        hp.push(("sliding window", w.window.to_string()));
        hp.push(("global layers", global.join(", ")));
        hp.push(("local rope theta", w.rope_theta.to_string()));
    }
    let mut tensors = Vec::new();
    for name in loader.tensor_names() {
        let t = loader.tensor(&name)?;
        tensors.push(TensorInfo { name, dtype: t.ty.to_string(), dims: t.dims, bytes: t.data.bytes().len() });
    }
    Ok(ModelInfo {
        path: path.display().to_string(),
        format,
        file_size: loader.file_size(),
        architecture: format!("{:?}", c.arch).to_lowercase(),
        hyper_parameters: hp.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        tokenizer: TokenizerInfo {
            kind: tokenizer.kind().to_string(),
            vocab_size: tokenizer.vocab_size(),
            bos: tokenizer.bos_id(),
            eos: tokenizer.eos_id(),
        },
        metadata,
        tensors,
    })
}

impl ModelInfo {
    /// The human-readable report.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "file:         {} ({}, {:.1} MB)", self.path, self.format, self.file_size as f64 / 1e6);
        let _ = writeln!(s, "architecture: {}", self.architecture);
        for (k, v) in &self.hyper_parameters {
            let _ = writeln!(s, "  {k:<18} {v}");
        }
        let t = &self.tokenizer;
        let _ = writeln!(s, "tokenizer:    {} ({} tokens, bos {:?}, eos {:?})", t.kind, t.vocab_size, t.bos, t.eos);
        if !self.metadata.is_empty() {
            let _ = writeln!(s, "metadata:");
            for (k, v) in &self.metadata {
                let _ = writeln!(s, "  {k:<40} {v}");
            }
        }
        let total: usize = self.tensors.iter().map(|t| t.bytes).sum();
        let _ = writeln!(s, "tensors:      {} ({:.1} MB)", self.tensors.len(), total as f64 / 1e6);
        for t in &self.tensors {
            let _ = writeln!(s, "  {:<32} {:<6} {:?}", t.name, t.dtype, t.dims);
        }
        s
    }
}

/// A short rendering of a metadata value (long arrays summarised).
fn render(v: &Value) -> String {
    match v {
        Value::String(s) if s.len() > 60 => format!("{:?}… ({} bytes)", &s[..s.floor_char_boundary(60)], s.len()),
        Value::String(s) => format!("{s:?}"),
        Value::Array(a) if a.len() > 8 => {
            format!("{} (first: {})", v.type_name(), a.render_at(0).unwrap_or_default())
        }
        Value::Array(a) => format!("[{}]", (0..a.len()).filter_map(|i| a.render_at(i)).collect::<Vec<_>>().join(", ")),
        other => match other.as_f64() {
            Some(_) if matches!(other, Value::F32(_) | Value::F64(_)) => {
                format!("{}", other.as_f64().unwrap_or_default())
            }
            _ => other
                .as_i64()
                .map(|i| i.to_string())
                .or_else(|| other.as_bool().map(|b| b.to_string()))
                .unwrap_or_default(),
        },
    }
}
