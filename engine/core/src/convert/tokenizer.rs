//! The tokenizer of a GGUF model as Hugging Face's `tokenizer.json` and
//! `tokenizer_config.json`: byte-level BPE (`tokenizer.ggml.model =
//! "gpt2"`) with its merges and pre-tokenizer, and SentencePiece-style
//! BPE (`"llama"`: Llama 2, Gemma) with merges derived from the pieces'
//! scores, as transformers derives them.

use std::collections::{HashMap, HashSet};

use serde::Serialize;
use serde::ser::SerializeMap;
use serde_json::{Value, json};

use super::{pretty, token_id};
use crate::gguf::GgufFile;
use crate::model::ModelConfig;
use crate::{Error, Result};

/// GGUF token types that become HF added tokens (control, user-defined).
const NORMAL: u64 = 1;
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;

// Pre-tokeniser regexes (as in the HF tokenizer.json files of these models).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SUPPORTED_PRE: &str =
    "default, gpt2, smollm, starcoder, refact, codeshell, exaone, minerva, qwen2, llama-bpe, llama3";

#[derive(Serialize)]
struct TokenizerJson<'a> {
    version: &'static str,
    truncation: Option<()>,
    padding: Option<()>,
    added_tokens: Vec<AddedToken<'a>>,
    normalizer: Value,
    pre_tokenizer: Value,
    post_processor: Value,
    decoder: Value,
    model: BpeModel<'a>,
}

#[derive(Serialize)]
struct AddedToken<'a> {
    id: u32,
    content: &'a str,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

#[derive(Serialize)]
struct BpeModel<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    dropout: Option<f32>,
    unk_token: Option<&'a str>,
    continuing_subword_prefix: Option<&'a str>,
    end_of_word_suffix: Option<&'a str>,
    fuse_unk: bool,
    byte_fallback: bool,
    ignore_merges: bool,
    vocab: Vocab<'a>,
    /// `"a b"` strings (byte-level BPE) or `[a, b]` pairs (pieces may hold spaces).
    merges: Value,
}

/// Token text -> id, serialised in id order.
struct Vocab<'a>(Vec<(&'a str, u32)>);

impl Serialize for Vocab<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (t, id) in &self.0 {
            m.serialize_entry(t, id)?;
        }
        m.end()
    }
}

/// The token types (`tokenizer.ggml.token_type`, all normal when absent).
fn token_types(src: &GgufFile, n: usize) -> Result<Vec<u64>> {
    let key = "tokenizer.ggml.token_type";
    let Some(v) = src.get(key) else {
        return Ok(vec![1; n]);
    };
    let a = v.as_array().ok_or_else(|| src.meta_err(key, "must be an array of integers"))?;
    if a.len() != n {
        return Err(src.meta_err(key, &format!("has {} entries but tokenizer.ggml.tokens has {n}", a.len())).into());
    }
    a.to_u64s().ok_or_else(|| src.meta_err(key, "must be an array of integers").into())
}

/// An HF `tokenizer.json` equivalent to the GGUF's `tokenizer.ggml.*`
/// metadata: `tokenizer.ggml.model` `"gpt2"` (byte-level BPE) or
/// `"llama"` (SentencePiece-style BPE).
pub fn tokenizer_json(src: &GgufFile) -> Result<String> {
    match src.require_str("tokenizer.ggml.model")? {
        "gpt2" => byte_level_json(src),
        "llama" => sentencepiece_json(src),
        model => Err(Error::Tokenizer(format!(
            "{}: tokenizer export is not supported for tokenizer model '{model}' (supported: gpt2, llama)",
            src.path().display()
        ))),
    }
}

fn tokens(src: &GgufFile) -> Result<Vec<&str>> {
    Ok(src
        .str_array("tokenizer.ggml.tokens")?
        .ok_or_else(|| src.meta_err("tokenizer.ggml.tokens", "is missing"))?
        .iter()
        .collect())
}

/// Byte-level BPE with the file's merges and pre-tokenizer.
fn byte_level_json(src: &GgufFile) -> Result<String> {
    let tokens = tokens(src)?;
    let merges: Vec<&str> = src
        .str_array("tokenizer.ggml.merges")?
        .ok_or_else(|| src.meta_err("tokenizer.ggml.merges", "is missing"))?
        .iter()
        .collect();
    let types = token_types(src, tokens.len())?;
    let pre = match src.get("tokenizer.ggml.pre") {
        None => "default",
        Some(_) => src.require_str("tokenizer.ggml.pre")?,
    };

    let byte_level = |trim_offsets: bool, use_regex: bool| json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim_offsets, "use_regex": use_regex });
    let split =
        |re: &str| json!({ "type": "Split", "pattern": { "Regex": re }, "behavior": "Isolated", "invert": false });
    let (normalizer, pre_tokenizer, ignore_merges) = match pre {
        "default" | "gpt2" => (Value::Null, byte_level(true, true), false),
        "smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva" => {
            let digits = json!({ "type": "Digits", "individual_digits": true });
            (Value::Null, json!({ "type": "Sequence", "pretokenizers": [digits, byte_level(true, true)] }), false)
        }
        "qwen2" => {
            let seq = json!({ "type": "Sequence", "pretokenizers": [split(QWEN2), byte_level(false, false)] });
            (json!({ "type": "NFC" }), seq, false)
        }
        "llama-bpe" | "llama3" => (
            Value::Null,
            json!({ "type": "Sequence", "pretokenizers": [split(LLAMA3), byte_level(true, false)] }),
            true,
        ),
        other => {
            let d = format!(
                "names pre-tokenizer '{other}', which tokenizer export does not support (supported: {SUPPORTED_PRE})"
            );
            return Err(src.meta_err("tokenizer.ggml.pre", &d).into());
        }
    };

    let post_processor = bos_template(src, &tokens);
    let vocab = vocab(src, &tokens);
    let added_tokens = added_tokens(&tokens, &types);
    let tj = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens,
        normalizer,
        pre_tokenizer,
        post_processor,
        decoder: json!({ "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true }),
        model: BpeModel {
            kind: "BPE",
            dropout: None,
            unk_token: None,
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: false,
            byte_fallback: false,
            ignore_merges,
            vocab: Vocab(vocab),
            merges: json!(merges),
        },
    };
    pretty(&tj)
}

/// SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`), as
/// transformers writes it: spaces normalised to `▁` (and one put first
/// with `add_space_prefix`), unknown characters as `<0xNN>` byte tokens,
/// and merges derived from the pieces' scores ([`spm_merges`]).
fn sentencepiece_json(src: &GgufFile) -> Result<String> {
    let tokens = tokens(src)?;
    let types = token_types(src, tokens.len())?;
    let key = "tokenizer.ggml.scores";
    let scores = src.get(key).and_then(|v| v.as_array()).ok_or_else(|| src.meta_err(key, "is missing"))?;
    if scores.len() != tokens.len() {
        let d = format!("has {} entries but tokenizer.ggml.tokens has {}", scores.len(), tokens.len());
        return Err(src.meta_err(key, &d).into());
    }
    let scores: Vec<f64> = (0..scores.len())
        .map(|i| scores.f64_at(i))
        .collect::<Option<_>>()
        .ok_or_else(|| src.meta_err(key, "must be an array of numbers"))?;
    let space_prefix = src.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.as_bool()).unwrap_or(true);
    let replace = |from: &str, to: &str| json!({ "type": "Replace", "pattern": { "String": from }, "content": to });
    let normalizer = match space_prefix {
        true => {
            json!({ "type": "Sequence", "normalizers": [{ "type": "Prepend", "prepend": "▁" }, replace(" ", "▁")] })
        }
        false => replace(" ", "▁"),
    };
    let mut decoders = vec![replace("▁", " "), json!({ "type": "ByteFallback" }), json!({ "type": "Fuse" })];
    if space_prefix {
        decoders.push(json!({ "type": "Strip", "content": " ", "start": 1, "stop": 0 }));
    }
    let unk = token_id(src, "tokenizer.ggml.unknown_token_id").and_then(|id| tokens.get(id as usize).copied());
    let merges: Vec<[&str; 2]> = spm_merges(&tokens, &scores, &types);
    let tj = TokenizerJson {
        version: "1.0",
        truncation: None,
        padding: None,
        added_tokens: added_tokens(&tokens, &types),
        normalizer,
        pre_tokenizer: json!({ "type": "Split", "pattern": { "String": " " }, "behavior": "MergedWithPrevious", "invert": false }),
        post_processor: bos_template(src, &tokens),
        decoder: json!({ "type": "Sequence", "decoders": decoders }),
        model: BpeModel {
            kind: "BPE",
            dropout: None,
            unk_token: unk,
            continuing_subword_prefix: None,
            end_of_word_suffix: None,
            fuse_unk: true,
            byte_fallback: true,
            ignore_merges: false,
            vocab: Vocab(vocab(src, &tokens)),
            merges: json!(merges),
        },
    };
    pretty(&tj)
}

/// The merges that rebuild SentencePiece's BPE from its scored pieces, as
/// transformers' `SentencePieceExtractor` derives them: every split of a
/// normal piece into two pieces of the vocabulary, ranked by the whole
/// piece's score (highest first), splits of one piece by their halves' ids.
/// Merging by these ranks is SentencePiece's merging of the adjacent pair
/// whose concatenation scores highest.
fn spm_merges<'a>(tokens: &[&'a str], scores: &[f64], types: &[u64]) -> Vec<[&'a str; 2]> {
    let id: HashMap<&str, usize> = tokens.iter().enumerate().rev().map(|(i, t)| (*t, i)).collect();
    let mut merges: Vec<(f64, usize, usize, [&str; 2])> = Vec::new();
    for (i, piece) in tokens.iter().enumerate().filter(|(i, _)| types[*i] == NORMAL) {
        let start = merges.len();
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&a), Some(&b)) = (id.get(l), id.get(r)) {
                merges.push((scores[i], a, b, [l, r]));
            }
        }
        merges[start..].sort_by_key(|m| (m.1, m.2));
    }
    // Stable: a piece's splits keep their order among equal scores.
    merges.sort_by(|x, y| y.0.total_cmp(&x.0));
    merges.into_iter().map(|m| m.3).collect()
}

/// `<bos>` first when the file adds it (`TemplateProcessing`).
fn bos_template(src: &GgufFile, tokens: &[&str]) -> Value {
    let bos = token_id(src, "tokenizer.ggml.bos_token_id").filter(|&b| (b as usize) < tokens.len());
    let add_bos = src.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
    match bos.filter(|_| add_bos) {
        None => Value::Null,
        Some(id) => {
            let b = tokens[id as usize];
            json!({
                "type": "TemplateProcessing",
                "single": [{ "SpecialToken": { "id": b, "type_id": 0 } }, { "Sequence": { "id": "A", "type_id": 0 } }],
                "pair": [
                    { "SpecialToken": { "id": b, "type_id": 0 } }, { "Sequence": { "id": "A", "type_id": 0 } },
                    { "SpecialToken": { "id": b, "type_id": 1 } }, { "Sequence": { "id": "B", "type_id": 1 } }
                ],
                "special_tokens": { b: { "id": b, "ids": [id], "tokens": [b] } }
            })
        }
    }
}

/// Token text -> id; a text repeated keeps its first id.
fn vocab<'a>(src: &GgufFile, tokens: &[&'a str]) -> Vec<(&'a str, u32)> {
    let mut seen = HashSet::with_capacity(tokens.len());
    let mut vocab = Vec::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        if seen.insert(*t) {
            vocab.push((*t, id as u32));
        } else {
            tracing::warn!(
                "{}: token {id} '{t}' repeats an earlier token; tokenizer.json keeps the first",
                src.path().display()
            );
        }
    }
    vocab
}

/// Control and user-defined tokens, matched before the model runs.
fn added_tokens<'a>(tokens: &[&'a str], types: &[u64]) -> Vec<AddedToken<'a>> {
    (0..tokens.len())
        .filter(|&i| matches!(types[i], CONTROL | USER_DEFINED))
        .map(|i| AddedToken {
            id: i as u32,
            content: tokens[i],
            single_word: false,
            lstrip: false,
            rstrip: false,
            normalized: false,
            special: types[i] == CONTROL,
        })
        .collect()
}

/// `tokenizer_config.json`: special tokens, BOS policy, chat template.
pub(super) fn tokenizer_config_json(src: &GgufFile, cfg: &ModelConfig) -> Result<Value> {
    let tokens: Vec<&str> = src.str_array("tokenizer.ggml.tokens")?.map(|t| t.iter().collect()).unwrap_or_default();
    let mut c = serde_json::Map::new();
    let add_bos = src.get("tokenizer.ggml.add_bos_token").and_then(|v| v.as_bool()).unwrap_or(false);
    c.insert("add_bos_token".into(), json!(add_bos));
    c.insert("add_eos_token".into(), json!(false));
    for (key, gguf_key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
    ] {
        if let Some(t) = token_id(src, gguf_key).and_then(|id| tokens.get(id as usize)) {
            c.insert(key.into(), json!(t));
        }
    }
    if let Some(t) = src.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
        c.insert("chat_template".into(), json!(t));
    }
    c.insert("clean_up_tokenization_spaces".into(), json!(false));
    c.insert("model_max_length".into(), json!(cfg.ctx_train));
    c.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    Ok(Value::Object(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_the_merged_pieces_scores_then_the_halves_ids() {
        let tokens = ["<unk>", "<s>", "▁", "a", "b", "ab", "▁a", "▁ab", "<0x41>"];
        let scores = [0.0, 0.0, -5.0, -6.0, -7.0, -1.0, -2.0, -3.0, 0.0];
        let types = [2, CONTROL, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL, 6];
        let merges = spm_merges(&tokens, &scores, &types);
        assert_eq!(merges, [["a", "b"], ["▁", "a"], ["▁", "ab"], ["▁a", "b"]]);
    }
}
