//! Tokenizers: byte-level BPE and SentencePiece-style vocabularies read from
//! GGUF metadata (as llama.cpp does), and Hugging Face `tokenizer.json` files
//! through the `tokenizers` crate.
//!
//! - `tokenizer.ggml.model = "gpt2"`: GPT-2 byte-level BPE (`bpe.rs`) with the
//!   pre-tokeniser named by `tokenizer.ggml.pre`.
//! - `tokenizer.ggml.model = "llama"`: SentencePiece-style (`spm.rs`): scores,
//!   `▁` for spaces, `<0xNN>` byte fallback, optional space prefix.
//! - `tokenizer.json`: anything the `tokenizers` crate reads (`hf.rs`).
//!
//! Control and user-defined tokens written literally in the text (e.g.
//! `<|im_start|>`) are matched as single tokens, longest first, as llama.cpp
//! does with `parse_special = true` (the `tokenizers` crate does the same for
//! its added tokens).

mod bpe;
mod error;
mod hf;
mod spm;
mod stream;
#[cfg(test)]
mod tests;
mod vocab;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use spinfer_formats::gguf::{Array, GgufFile, StrList, Value};

pub use error::{Error, Result};

pub use stream::{Held, StopWatcher, StreamDecoder};

/// GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp numbers them.
pub(crate) mod token_type {
    pub const NORMAL: u8 = 1;
    pub const UNKNOWN: u8 = 2;
    pub const CONTROL: u8 = 3;
    pub const USER_DEFINED: u8 = 4;
    pub const UNUSED: u8 = 5;
    pub const BYTE: u8 = 6;
}

/// Token texts that end a generation when present as control tokens (the
/// list llama.cpp uses).
const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end▁of▁sentence|>",
    "<|return|>",
    "<|call|>",
];

/// A text tokenizer. Cheap to share between threads (`Send + Sync`).
pub struct Tokenizer {
    kind: String,
    backend: Backend,
    /// The raw bytes of every token, as streamed and decoded.
    bytes: vocab::Table,
    /// Tokens matched literally in the text (GGUF backends only; the
    /// `tokenizers` crate matches its own added tokens).
    specials: Specials,
    /// Ids of the tokens that stand for no text (control, unknown and
    /// unused tokens; `tokenizer.json`'s special added tokens), sorted.
    control: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
}

enum Backend {
    Bpe(bpe::Bpe),
    Spm(spm::Spm),
    Hf(Box<hf::Hf>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*`
    /// metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        Self::from_gguf_metadata(&g.metadata, g.path())
    }

    /// As [`Tokenizer::from_gguf`], from the metadata map alone; `path` only
    /// names the source in error messages.
    pub fn from_gguf_metadata(metadata: &BTreeMap<String, Value>, path: &Path) -> Result<Self> {
        let m = Meta { md: metadata, path };
        let model = m.str("tokenizer.ggml.model")?;
        let tokens: Vec<&str> = m.str_array("tokenizer.ggml.tokens")?.iter().collect();
        if tokens.is_empty() {
            return Err(m.err("tokenizer.ggml.tokens", "is empty"));
        }
        let n = tokens.len();
        let types: Vec<u8> = match m.opt_array("tokenizer.ggml.token_type")? {
            None => vec![token_type::NORMAL; n],
            Some(a) => {
                if a.len() != n {
                    let d = format!("has {} entries but tokenizer.ggml.tokens has {n}", a.len());
                    return Err(m.err("tokenizer.ggml.token_type", &d));
                }
                let t = (0..n).map(|i| a.u64_at(i).and_then(|x| u8::try_from(x).ok())).collect::<Option<Vec<_>>>();
                t.ok_or_else(|| m.err("tokenizer.ggml.token_type", "must be an array of small integers"))?
            }
        };
        let id = |key: &str| -> Result<Option<u32>> {
            match m.md.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(x) if (x as usize) < n => Ok(Some(x as u32)),
                    // llama.cpp writes -1 / u32::MAX for "none".
                    Some(x) if x == u32::MAX as u64 || x == u64::MAX => Ok(None),
                    None if v.as_i64() == Some(-1) => Ok(None),
                    _ => Err(m.err(key, &format!("must be a token id below the vocabulary size {n}, got {v:?}"))),
                },
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let unk = id("tokenizer.ggml.unknown_token_id")?;
        let mut extra_eog = vec![id("tokenizer.ggml.eot_token_id")?, id("tokenizer.ggml.eom_token_id")?];

        let (kind, backend, bytes, default_add_bos) = match model {
            "gpt2" => {
                let pre = m.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
                let merges: Vec<&str> = m.str_array("tokenizer.ggml.merges")?.iter().collect();
                let b = bpe::Bpe::new(&tokens, &merges, pre).map_err(|(k, d)| m.err(k, &d))?;
                let bytes = bpe::token_bytes(&tokens, &types);
                (format!("gpt2-bpe ({pre})"), Backend::Bpe(b), bytes, false)
            }
            "llama" => {
                let scores = match m.opt_array("tokenizer.ggml.scores")? {
                    None => vec![0.0; n],
                    Some(a) if a.len() == n => (0..n)
                        .map(|i| a.f64_at(i).map(|x| x as f32))
                        .collect::<Option<Vec<_>>>()
                        .ok_or_else(|| m.err("tokenizer.ggml.scores", "must be an array of numbers"))?,
                    Some(a) => {
                        let d = format!("has {} entries but tokenizer.ggml.tokens has {n}", a.len());
                        return Err(m.err("tokenizer.ggml.scores", &d));
                    }
                };
                let prefix = m.opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                let s = spm::Spm::new(&tokens, scores, &types, unk, prefix);
                let bytes = spm::token_bytes(&tokens, &types);
                ("spm".to_string(), Backend::Spm(s), bytes, true)
            }
            other => {
                let d = format!("names unsupported tokenizer model '{other}' (supported: gpt2, llama)");
                return Err(m.err("tokenizer.ggml.model", &d));
            }
        };
        let add_bos = m.opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        if add_bos && bos.is_none() {
            return Err(m.err("tokenizer.ggml.add_bos_token", "is true but tokenizer.ggml.bos_token_id is missing"));
        }
        let specials = Specials::from_vocab(&tokens, &types);
        let control = control_ids(&types);
        let named = tokens.iter().zip(&types).enumerate().filter_map(|(i, (t, &ty))| {
            let special = matches!(ty, token_type::CONTROL | token_type::USER_DEFINED);
            (special && EOG_NAMES.contains(t)).then_some(i as u32)
        });
        extra_eog.extend(named.map(Some));
        Ok(Self { kind, backend, bytes, specials, control, bos, eos, eog: eog_list(eos, extra_eog), add_bos })
    }

    /// A SentencePiece-style tokenizer from plain vectors (as GGUF stores
    /// them): token texts with `▁` for spaces, scores, GGUF token types
    /// (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    /// `<0xNN>`).
    pub fn from_spm_parts(
        tokens: Vec<String>,
        scores: Vec<f32>,
        token_types: Vec<u8>,
        bos: Option<u32>,
        eos: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<Self> {
        let n = tokens.len();
        if n == 0 || scores.len() != n || token_types.len() != n {
            return Err(Error::Tokenizer(format!(
                "spm parts: {n} tokens, {} scores and {} token types must be equal in number and non-zero",
                scores.len(),
                token_types.len()
            )));
        }
        for (what, v) in [("bos", bos), ("eos", eos)] {
            if let Some(v) = v.filter(|&v| v as usize >= n) {
                return Err(Error::Tokenizer(format!("spm parts: {what} id {v} is outside the vocabulary of {n}")));
            }
        }
        let refs: Vec<&str> = tokens.iter().map(String::as_str).collect();
        let unk = token_types.iter().position(|&t| t == token_type::UNKNOWN).map(|i| i as u32);
        let spm = spm::Spm::new(&refs, scores, &token_types, unk, add_space_prefix);
        let bytes = spm::token_bytes(&refs, &token_types);
        let specials = Specials::from_vocab(&refs, &token_types);
        Ok(Self {
            kind: "spm".into(),
            backend: Backend::Spm(spm),
            bytes,
            specials,
            control: control_ids(&token_types),
            bos,
            eos,
            eog: eog_list(eos, vec![]),
            add_bos: bos.is_some(),
        })
    }

    /// Loads a Hugging Face `tokenizer.json` (padding and truncation off).
    /// BOS/EOS come from a `tokenizer_config.json` or `config.json` beside
    /// it when present, else from the usual special-token names.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let h = hf::load(path)?;
        Ok(Self {
            kind: h.kind,
            bytes: h.bytes.iter().map(Vec::as_slice).collect(),
            specials: Specials::default(),
            control: h.control,
            bos: h.bos,
            eos: h.eos,
            eog: eog_list(h.eos, h.eog.into_iter().map(Some).collect()),
            add_bos: h.add_bos,
            backend: Backend::Hf(Box::new(h.tokenizer)),
        })
    }

    /// Token ids of `text`, with BOS first when `add_bos`.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        if let Backend::Hf(h) = &self.backend {
            return h.encode(text, add_bos, self.bos);
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos {
            out.push(
                self.bos.ok_or_else(|| Error::Tokenizer("BOS requested but the vocabulary has no bos token".into()))?,
            );
        }
        let frags = self.specials.split(text);
        match &self.backend {
            Backend::Bpe(b) => {
                for f in frags {
                    match f {
                        Frag::Text(t) => b.encode(t, &mut out)?,
                        Frag::Token(id) => out.push(id),
                    }
                }
            }
            Backend::Spm(s) => s.encode(&frags, &mut out),
            Backend::Hf(_) => unreachable!("handled above"),
        }
        Ok(out)
    }

    /// Text of `ids`. Invalid UTF-8 (e.g. a character cut short at the end)
    /// is replaced by U+FFFD once, after all token bytes are joined.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        match &self.backend {
            Backend::Hf(h) => h.decode(ids),
            backend => {
                let mut buf = Vec::with_capacity(ids.len() * 4);
                for (i, &id) in ids.iter().enumerate() {
                    let b = self.bytes.get(id as usize);
                    // SentencePiece: the space added in front of the text is not part of it.
                    let strip =
                        i == 0 && matches!(backend, Backend::Spm(s) if s.add_space_prefix) && b.first() == Some(&b' ');
                    buf.extend_from_slice(if strip { &b[1..] } else { b });
                }
                Ok(String::from_utf8(buf).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
            }
        }
    }

    /// The raw bytes of one token (possibly part of a UTF-8 character).
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        Ok(self.bytes_of(id)?.to_vec())
    }

    pub(crate) fn bytes_of(&self, id: u32) -> Result<&[u8]> {
        self.check_id(id)?;
        Ok(self.bytes.get(id as usize))
    }

    fn check_id(&self, id: u32) -> Result<()> {
        if (id as usize) < self.bytes.len() {
            Ok(())
        } else {
            Err(Error::Tokenizer(format!("token id {id} is outside the vocabulary of {}", self.bytes.len())))
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-generation ids: EOS plus end-of-turn tokens such as
    /// `<|im_end|>` or `<|endoftext|>` when the vocabulary has them as
    /// control tokens.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// Whether `id` stands for no text of its own: a control, unknown or
    /// unused token (`tokenizer.json`: a special added token), such as
    /// `<|im_start|>`. Its bytes are its name, never text a model writes.
    pub fn is_control(&self, id: u32) -> bool {
        self.control.binary_search(&id).is_ok()
    }

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }

    /// Short description for `inspect`, e.g. `gpt2-bpe (smollm)`.
    pub fn kind(&self) -> &str {
        &self.kind
    }
}

/// The ids of a GGUF vocabulary's control, unknown and unused tokens.
fn control_ids(types: &[u8]) -> Vec<u32> {
    let control = |ty: u8| matches!(ty, token_type::CONTROL | token_type::UNKNOWN | token_type::UNUSED);
    types.iter().enumerate().filter(|&(_, &ty)| control(ty)).map(|(i, _)| i as u32).collect()
}

fn eog_list(eos: Option<u32>, extra: Vec<Option<u32>>) -> Vec<u32> {
    let mut v: Vec<u32> = Vec::new();
    for id in std::iter::once(eos).chain(extra).flatten() {
        if !v.contains(&id) {
            v.push(id);
        }
    }
    v
}

/// A piece of input text: plain text or a special token written literally.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Frag<'t> {
    Text(&'t str),
    Token(u32),
}

/// Literal special tokens, longest first.
#[derive(Default)]
pub(crate) struct Specials {
    list: Vec<(String, u32)>,
}

impl Specials {
    /// The control, user-defined and unknown tokens of a GGUF vocabulary.
    fn from_vocab(tokens: &[&str], types: &[u8]) -> Self {
        let special = |ty: u8| matches!(ty, token_type::CONTROL | token_type::USER_DEFINED | token_type::UNKNOWN);
        let mut list: Vec<(String, u32)> = (tokens.iter().zip(types).enumerate())
            .filter(|(_, (t, ty))| special(**ty) && !t.is_empty())
            .map(|(i, (t, _))| (t.to_string(), i as u32))
            .collect();
        list.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Self { list }
    }

    /// Splits `text` at every occurrence of a special token, taking the
    /// tokens longest first over the whole text (llama.cpp's order).
    pub(crate) fn split<'t>(&self, text: &'t str) -> Vec<Frag<'t>> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Frag::Text(text));
        for (s, id) in &self.list {
            if !text.contains(s.as_str()) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Frag::Text(mut rest) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(p) = rest.find(s.as_str()) {
                    if p > 0 {
                        next.push(Frag::Text(&rest[..p]));
                    }
                    next.push(Frag::Token(*id));
                    rest = &rest[p + s.len()..];
                }
                if !rest.is_empty() {
                    next.push(Frag::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }
}

/// Typed access to GGUF metadata with errors naming the key.
struct Meta<'a> {
    md: &'a BTreeMap<String, Value>,
    path: &'a Path,
}

impl<'a> Meta<'a> {
    fn err(&self, key: &str, detail: &str) -> Error {
        spinfer_formats::Error::Metadata { path: PathBuf::from(self.path), key: key.into(), detail: detail.into() }
            .into()
    }

    fn str(&self, key: &str) -> Result<&'a str> {
        self.opt_str(key)?.ok_or_else(|| self.err(key, "is missing"))
    }

    fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.md.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_str().map(Some).ok_or_else(|| self.err(key, &format!("must be a string, got {}", v.type_name())))
            }
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.md.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_bool().map(Some).ok_or_else(|| self.err(key, &format!("must be a bool, got {}", v.type_name())))
            }
        }
    }

    fn opt_array(&self, key: &str) -> Result<Option<&'a Array>> {
        match self.md.get(key) {
            None => Ok(None),
            Some(v) => {
                v.as_array().map(Some).ok_or_else(|| self.err(key, &format!("must be an array, got {}", v.type_name())))
            }
        }
    }

    fn str_array(&self, key: &str) -> Result<&'a StrList> {
        let a = self.opt_array(key)?.ok_or_else(|| self.err(key, "is missing"))?;
        a.as_strs().ok_or_else(|| self.err(key, &format!("must be an array of strings, got [{}]", a.elem_type_name())))
    }
}
