//! Hugging Face `tokenizer.json` through the `tokenizers` crate.

use std::path::Path;
use std::str::FromStr;

use serde_json::Value as Json;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::processors::template::TemplateProcessing;

use super::{EOG_NAMES, bpe, spm};
use crate::{Error, Result};

pub(crate) struct Hf {
    tk: tokenizers::Tokenizer,
    /// The file has a post-processor (it adds BOS/CLS itself when asked).
    has_post_processor: bool,
}

/// What [`load`] reads.
pub(crate) struct Loaded {
    pub tokenizer: Hf,
    pub kind: String,
    pub bytes: Vec<Vec<u8>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eog: Vec<u32>,
    /// Special added tokens' ids, sorted.
    pub control: Vec<u32>,
    pub add_bos: bool,
}

fn tk_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(format!("{}: {e}", path.display()))
}

pub(crate) fn load(path: &Path) -> Result<Loaded> {
    let text =
        spinfer_formats::bounded::read_text(path, spinfer_formats::bounded::MAX_TOKENIZER_BYTES, "a tokenizer.json")?;
    // The few fields read here, not a tree of the whole file (vocabulary
    // and merges are most of it: Gemma 3's is 33 MB).
    let json: Head = serde_json::from_str(&text).map_err(|e| tk_err(path, format!("cannot be read: {e}")))?;
    if json.model.continuing_subword_prefix.as_deref().is_some_and(|p| !p.is_empty()) {
        let merges: MergesOnly = serde_json::from_str(&text).map_err(|e| tk_err(path, format!("model: {e}")))?;
        check_bpe_merges(&merges.model).map_err(|e| tk_err(path, format!("model: {e}")))?;
    }
    let mut tk = tokenizers::Tokenizer::from_str(&text).map_err(|e| tk_err(path, e))?;
    if let Some(pp) = tk.get_post_processor() {
        check_post_processor(pp).map_err(|e| tk_err(path, format!("post_processor: {e}")))?;
    }
    tk.with_padding(None);
    tk.with_truncation(None).map_err(|e| tk_err(path, e))?;

    let model_type = json.model.kind.unwrap_or_else(|| "unknown".into());
    let byte_level = contains_type(&json.decoder, "ByteLevel");
    let byte_fallback = json.model.byte_fallback.unwrap_or(false);
    let word_piece = model_type == "WordPiece";
    let added = tk.get_added_tokens_decoder();

    let n = tk.get_vocab_size(true);
    let mut bytes = Vec::with_capacity(n);
    for id in 0..n as u32 {
        let b = if let Some(a) = added.get(&id) {
            a.content.as_bytes().to_vec()
        } else if let Some(t) = tk.id_to_token(id) {
            if byte_level {
                bpe::byte_level_decode(&t)
            } else if let Some(b) = spm::parse_byte_token(&t).filter(|_| byte_fallback) {
                vec![b]
            } else if word_piece {
                match t.strip_prefix("##") {
                    Some(rest) => rest.as_bytes().to_vec(),
                    None => format!(" {t}").into_bytes(),
                }
            } else {
                t.replace('▁', " ").into_bytes()
            }
        } else {
            Vec::new()
        };
        bytes.push(b);
    }

    // BOS/EOS: tokenizer_config.json, then config.json, then common names.
    let dir = path.parent().unwrap_or(Path::new("."));
    let read = |name: &str| -> Option<Json> {
        let s = spinfer_formats::bounded::read_text(
            &dir.join(name),
            spinfer_formats::bounded::MAX_CONFIG_BYTES,
            "a JSON config",
        )
        .ok()?;
        serde_json::from_str(&s).ok()
    };
    let tcfg = read("tokenizer_config.json");
    let cfg = read("config.json");
    let by_name = |v: &Json| -> Option<u32> {
        let s = v.as_str().or_else(|| v["content"].as_str())?;
        tk.token_to_id(s)
    };
    let by_id = |v: &Json| -> Option<u32> {
        let id = v.as_u64().or_else(|| v.as_array()?.first()?.as_u64())?;
        (id < n as u64).then_some(id as u32)
    };
    let guess = |names: &[&str]| names.iter().find_map(|s| tk.token_to_id(s));
    let bos = tcfg
        .as_ref()
        .and_then(|c| by_name(&c["bos_token"]))
        .or_else(|| cfg.as_ref().and_then(|c| by_id(&c["bos_token_id"])))
        .or_else(|| guess(&["<s>", "<|begin_of_text|>", "<bos>", "[CLS]"]));
    let eos = tcfg
        .as_ref()
        .and_then(|c| by_name(&c["eos_token"]))
        .or_else(|| cfg.as_ref().and_then(|c| by_id(&c["eos_token_id"])))
        .or_else(|| guess(&["</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]"]));
    let has_post_processor = json.post_processor.is_some();
    let add_bos =
        tcfg.as_ref().and_then(|c| c["add_bos_token"].as_bool()).unwrap_or(has_post_processor && bos.is_some());

    let mut eog: Vec<u32> =
        added.iter().filter(|(_, a)| a.special && EOG_NAMES.contains(&a.content.as_str())).map(|(&id, _)| id).collect();
    eog.sort_unstable();
    // config.json may list several end ids.
    if let Some(a) = cfg.as_ref().and_then(|c| c["eos_token_id"].as_array()) {
        eog.extend(a.iter().filter_map(|v| v.as_u64()).filter(|&v| v < n as u64).map(|v| v as u32));
    }

    let mut control: Vec<u32> = added.iter().filter(|(_, a)| a.special).map(|(&id, _)| id).collect();
    control.sort_unstable();

    Ok(Loaded {
        tokenizer: Hf { tk, has_post_processor },
        kind: format!("tokenizer.json ({model_type})"),
        bytes,
        bos,
        eos,
        eog,
        control,
        add_bos,
    })
}

/// What [`load`] reads of a `tokenizer.json` itself (`tokenizers` reads
/// the rest); `null` and absent fields alike are `None`.
#[derive(serde::Deserialize)]
struct Head {
    #[serde(default)]
    model: ModelHead,
    #[serde(default)]
    decoder: Json,
    #[serde(default)]
    post_processor: Option<serde::de::IgnoredAny>,
}

#[derive(Default, serde::Deserialize)]
struct ModelHead {
    #[serde(rename = "type")]
    kind: Option<String>,
    byte_fallback: Option<bool>,
    continuing_subword_prefix: Option<String>,
}

/// The model with its merges, read only when a subword prefix needs them
/// checked.
#[derive(serde::Deserialize)]
struct MergesOnly {
    #[serde(default)]
    model: Json,
}

/// Refuses a `TemplateProcessing` (also inside a `Sequence`) whose templates
/// name a special token it does not define: `tokenizers` checks that only
/// when a template is built in code, not when one is read from JSON, and
/// then panics at the first encode (found by the `safetensors` fuzz target).
fn check_post_processor(pp: &PostProcessorWrapper) -> std::result::Result<(), String> {
    match pp {
        PostProcessorWrapper::Template(t) => TemplateProcessing::builder()
            .single(t.single.clone())
            .pair(t.get_pair().clone())
            .special_tokens(t.get_special_tokens().clone())
            .build()
            .map(drop)
            .map_err(|e| e.to_string()),
        PostProcessorWrapper::Sequence(s) => (0..).map_while(|i| s.get(i)).try_for_each(check_post_processor),
        _ => Ok(()),
    }
}

/// Refuses BPE merges whose second token does not start with the model's
/// `continuing_subword_prefix`: `tokenizers` strips that many bytes from it
/// unchecked while building the merge table (a subtraction that underflows,
/// or a cut inside a UTF-8 character; found by the `safetensors` fuzz target).
/// Checked whatever the model's `type` says: `tokenizers` also reads a model
/// without a `type` as BPE when it has merges.
fn check_bpe_merges(model: &Json) -> std::result::Result<(), String> {
    let Some(prefix) = model.get("continuing_subword_prefix").and_then(Json::as_str).filter(|p| !p.is_empty()) else {
        return Ok(());
    };
    let Some(merges) = model.get("merges").and_then(Json::as_array) else { return Ok(()) };
    for (i, m) in merges.iter().enumerate() {
        let second = match m {
            Json::String(s) => s.split_once(' ').map(|(_, b)| b),
            Json::Array(a) => a.get(1).and_then(Json::as_str),
            _ => None,
        };
        if let Some(b) = second.filter(|b| !b.starts_with(prefix)) {
            let b: String = b.chars().take(32).collect();
            return Err(format!(
                "merge #{i}: second token '{b}' does not start with continuing_subword_prefix '{}'",
                prefix.chars().take(32).collect::<String>()
            ));
        }
    }
    Ok(())
}

/// Whether a component (or a `Sequence` of them) has the given `type`.
fn contains_type(v: &Json, ty: &str) -> bool {
    match v {
        Json::Object(o) => {
            o.get("type").and_then(Json::as_str) == Some(ty)
                || o.values().any(|x| matches!(x, Json::Array(_)) && contains_type(x, ty))
        }
        Json::Array(a) => a.iter().any(|x| contains_type(x, ty)),
        _ => false,
    }
}

impl Hf {
    pub(crate) fn encode(&self, text: &str, add_bos: bool, bos: Option<u32>) -> Result<Vec<u32>> {
        let enc = self
            .tk
            .encode_fast(text, add_bos && self.has_post_processor)
            .map_err(|e| Error::Tokenizer(format!("encoding failed: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        if add_bos && !self.has_post_processor {
            let b = bos.ok_or_else(|| Error::Tokenizer("BOS requested but the vocabulary has no bos token".into()))?;
            ids.insert(0, b);
        }
        Ok(ids)
    }

    pub(crate) fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tk.decode(ids, false).map_err(|e| Error::Tokenizer(format!("decoding failed: {e}")))
    }
}
