//! Unit tests on small synthetic vocabularies (the real SmolLM2 vocabulary is
//! tested in `tests/tests/tokenizer.rs`).

use std::collections::BTreeMap;
use std::path::Path;

use super::bpe::BYTE_TO_CHAR;
use super::*;

fn strs(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().copied().collect()))
}

/// A byte-level BPE vocabulary: 2 control tokens, the 256 byte characters,
/// then merged tokens.
fn bpe_meta(pre: &str) -> BTreeMap<String, Value> {
    let mut tokens: Vec<String> = vec!["<|im_start|>".into(), "<|im_end|>".into()];
    tokens.extend(BYTE_TO_CHAR.iter().map(|c| c.to_string()));
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "a a", "aa aa"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut types = vec![3i32, 3];
    types.resize(tokens.len(), 1);
    let mut md = BTreeMap::new();
    md.insert("tokenizer.ggml.model".into(), Value::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
    md.insert("tokenizer.ggml.tokens".into(), Value::Array(Array::String(tokens.iter().map(String::as_str).collect())));
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(types)));
    md.insert("tokenizer.ggml.merges".into(), strs(&merges));
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(0));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(1));
    md.insert("tokenizer.ggml.add_bos_token".into(), Value::Bool(false));
    md
}

fn load(md: &BTreeMap<String, Value>) -> Result<Tokenizer> {
    Tokenizer::from_gguf_metadata(md, Path::new("synthetic.gguf"))
}

/// Id of a byte's single-character token in [`bpe_meta`].
fn byte(b: u8) -> u32 {
    2 + b as u32
}

#[test]
fn bpe_merges_by_rank_and_matches_specials() {
    let t = load(&bpe_meta("gpt2")).unwrap();
    assert_eq!(t.kind(), "gpt2-bpe (gpt2)");
    assert_eq!(t.vocab_size(), 2 + 256 + 8);
    let (hello, gw, or) = (261, 262, 263);
    assert_eq!(t.encode("hello", false).unwrap(), [hello]);
    assert_eq!(t.encode("hello world", false).unwrap(), [hello, gw, or, byte(b'l'), byte(b'd')]);
    // Equal ranks merge leftmost first; "aa aa" applies after "a a".
    assert_eq!(t.encode("aaa", false).unwrap(), [264, byte(b'a')]);
    assert_eq!(t.encode("aaaa", false).unwrap(), [265]);
    assert_eq!(t.encode("aaaaa", false).unwrap(), [265, byte(b'a')]);
    // Specials written in the text are single tokens; BOS on request.
    assert_eq!(t.encode("<|im_start|>hello<|im_end|>", true).unwrap(), [0, 0, hello, 1]);
    assert_eq!(t.encode("<|im_start", false).unwrap().len(), "<|im_start".len());
    assert_eq!(t.encode("", false).unwrap(), Vec::<u32>::new());
    assert_eq!(t.eog_ids(), [1]);
    assert!(t.is_control(0) && t.is_control(1) && !t.is_control(2) && !t.is_control(265));
    assert!(!t.add_bos_default());
    for s in ["hello world", "héllo 🦀 wörld\n\t  x", "<|im_start|>aaaa<|im_end|>", "2018-01-22 12:1"] {
        assert_eq!(t.decode(&t.encode(s, false).unwrap()).unwrap(), s);
    }
    assert!(t.decode(&[9999]).unwrap_err().to_string().contains("9999"));
}

#[test]
fn decode_is_lossy_only_at_the_end() {
    let t = load(&bpe_meta("gpt2")).unwrap();
    // "é" is C3 A9: cut short at the end it becomes one U+FFFD.
    assert_eq!(t.decode(&[byte(b'a'), byte(0xC3)]).unwrap(), "a\u{FFFD}");
    assert_eq!(t.decode(&[byte(0xC3), byte(0xA9)]).unwrap(), "é");
    assert_eq!(t.token_bytes(byte(0xC3)).unwrap(), [0xC3]);
    assert_eq!(t.token_bytes(0).unwrap(), b"<|im_start|>");
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let t = load(&bpe_meta("gpt2")).unwrap();
    let text = "añ🦀 €x";
    let ids = t.encode(text, false).unwrap();
    assert!(ids.len() > text.chars().count(), "multi-byte chars are split into byte tokens");
    let mut d = StreamDecoder::new(&t);
    let mut out = String::new();
    let mut empty = 0;
    for &id in &ids {
        let piece = d.push(id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "replacement char mid-stream: {piece:?}");
        empty += piece.is_empty() as usize;
        out.push_str(&piece);
    }
    assert!(empty > 0, "some tokens ended mid-character");
    out.push_str(&d.finish());
    assert_eq!(out, text);

    // Genuinely invalid bytes come out as U+FFFD, an unfinished tail at finish().
    let mut d = StreamDecoder::new(&t);
    assert_eq!(d.push(byte(0xFF)).unwrap(), "\u{FFFD}");
    assert_eq!(d.push(byte(0xE2)).unwrap(), "");
    assert_eq!(d.push(byte(b'a')).unwrap(), "\u{FFFD}a");
    assert_eq!(d.push(byte(0xE2)).unwrap(), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

#[test]
fn pre_tokenizers_by_name() {
    // smollm splits digits one by one, gpt2 keeps runs, llama-bpe takes up to three.
    let md = bpe_meta("smollm");
    let digits = |md: &BTreeMap<String, Value>| load(md).unwrap().encode("12345", false).unwrap().len();
    assert_eq!(digits(&md), 5);
    for (pre, kind) in
        [("smollm", "gpt2-bpe (smollm)"), ("qwen2", "gpt2-bpe (qwen2)"), ("llama-bpe", "gpt2-bpe (llama-bpe)")]
    {
        assert_eq!(load(&bpe_meta(pre)).unwrap().kind(), kind);
    }
    let t = load(&bpe_meta("default")).unwrap();
    assert_eq!(t.decode(&t.encode("x 12345 y", false).unwrap()).unwrap(), "x 12345 y");
}

fn err(md: &BTreeMap<String, Value>) -> String {
    load(md).unwrap_err().to_string()
}

#[test]
fn bad_metadata_names_the_key() {
    let mut md = bpe_meta("gpt2");
    md.remove("tokenizer.ggml.tokens");
    let e = err(&md);
    assert!(e.contains("synthetic.gguf") && e.contains("'tokenizer.ggml.tokens'") && e.contains("missing"), "{e}");

    let mut md = bpe_meta("gpt2");
    md.insert("tokenizer.ggml.merges".into(), strs(&["h e", "x zz"]));
    let e = err(&md);
    assert!(e.contains("'tokenizer.ggml.merges'") && e.contains("'zz'") && e.contains("not in the vocabulary"), "{e}");

    let mut md = bpe_meta("gpt2");
    md.insert("tokenizer.ggml.merges".into(), strs(&["he"]));
    assert!(err(&md).contains("'tokenizer.ggml.merges'"));

    let mut md = bpe_meta("gpt2");
    md.remove("tokenizer.ggml.merges");
    assert!(err(&md).contains("'tokenizer.ggml.merges' is missing"));

    let mut md = bpe_meta("gpt2");
    md.insert("tokenizer.ggml.model".into(), Value::String("bert".into()));
    let e = err(&md);
    assert!(e.contains("'tokenizer.ggml.model'") && e.contains("'bert'"), "{e}");

    let mut md = bpe_meta("gpt2");
    md.remove("tokenizer.ggml.model");
    assert!(err(&md).contains("'tokenizer.ggml.model' is missing"));

    let e = err(&bpe_meta("klingon"));
    assert!(e.contains("'tokenizer.ggml.pre'") && e.contains("klingon"), "{e}");

    let mut md = bpe_meta("gpt2");
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(vec![1])));
    assert!(err(&md).contains("'tokenizer.ggml.token_type'"));

    let mut md = bpe_meta("gpt2");
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(100_000));
    assert!(err(&md).contains("'tokenizer.ggml.eos_token_id'"));

    let mut md = bpe_meta("gpt2");
    md.insert("tokenizer.ggml.tokens".into(), Value::U32(3));
    assert!(err(&md).contains("'tokenizer.ggml.tokens' must be an array"));
}

/// `<unk> <s> </s>`, 256 byte tokens, then pieces with scores.
fn spm_parts() -> (Vec<String>, Vec<f32>, Vec<u8>) {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut scores = vec![0.0; 3];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    let pieces = [
        ("▁", -10.0),
        ("h", -10.0),
        ("e", -10.0),
        ("l", -10.0),
        ("o", -10.0),
        ("w", -10.0),
        ("r", -10.0),
        ("d", -10.0),
        ("ll", -1.0),
        ("he", -2.0),
        ("▁he", -3.0),
        ("llo", -4.0),
        ("▁hello", -5.0),
        ("▁w", -6.0),
        ("or", -7.0),
        ("▁wor", -8.0),
    ];
    for (p, s) in pieces {
        tokens.push(p.into());
        scores.push(s);
        types.push(1);
    }
    (tokens, scores, types)
}

#[test]
fn spm_merges_by_score_with_byte_fallback() {
    let (tokens, scores, types) = spm_parts();
    let id = |s: &str| tokens.iter().position(|t| t == s).unwrap() as u32;
    let t = Tokenizer::from_spm_parts(tokens.clone(), scores, types, Some(1), Some(2), true).unwrap();
    assert_eq!(t.kind(), "spm");
    assert_eq!(t.encode("hello", false).unwrap(), [id("▁hello")]);
    assert_eq!(t.encode("hello world", true).unwrap(), [1, id("▁hello"), id("▁wor"), id("l"), id("d")]);
    // '€' (E2 82 AC) has no piece: byte fallback.
    let euro = t.encode("hello €", false).unwrap();
    assert_eq!(euro, [id("▁hello"), id("▁"), id("<0xE2>"), id("<0x82>"), id("<0xAC>")]);
    assert_eq!(t.decode(&euro).unwrap(), "hello €");
    // A special token in the text, and the space prefix after it.
    assert_eq!(t.encode("</s>hello", false).unwrap(), [2, id("▁hello")]);
    assert_eq!(t.decode(&t.encode("hello world", true).unwrap()).unwrap(), "<s> hello world");
    for s in ["hello world", "  héllo\n€ 🦀", "dr. who"] {
        assert_eq!(t.decode(&t.encode(s, false).unwrap()).unwrap(), s);
    }
    assert_eq!(t.token_bytes(id("<0xE2>")).unwrap(), [0xE2]);
    assert_eq!(t.token_bytes(id("▁he")).unwrap(), b" he");
    // Streaming keeps the leading space of the first piece.
    let mut d = StreamDecoder::new(&t);
    let mut out: String = euro.iter().map(|&i| d.push(i).unwrap()).collect();
    out.push_str(&d.finish());
    assert_eq!(out, " hello €");

    // Without the space prefix.
    let (tokens, scores, types) = spm_parts();
    let t = Tokenizer::from_spm_parts(tokens, scores, types, Some(1), Some(2), false).unwrap();
    assert_eq!(t.encode("hello", false).unwrap(), [id("he"), id("llo")]);
    assert_eq!(t.decode(&t.encode(" hello", false).unwrap()).unwrap(), " hello");

    let e = Tokenizer::from_spm_parts(vec!["a".into()], vec![], vec![1], None, None, true).unwrap_err();
    assert!(e.to_string().contains("spm parts"), "{e}");
}

#[test]
fn spm_from_gguf_metadata() {
    let (tokens, scores, types) = spm_parts();
    let mut md = BTreeMap::new();
    md.insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
    md.insert("tokenizer.ggml.tokens".into(), Value::Array(Array::String(tokens.iter().map(String::as_str).collect())));
    md.insert("tokenizer.ggml.scores".into(), Value::Array(Array::F32(scores)));
    md.insert("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(types.into_iter().map(i32::from).collect())));
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
    let t = load(&md).unwrap();
    assert!(t.add_bos_default(), "SentencePiece vocabularies add BOS unless told otherwise");
    assert_eq!((t.bos_id(), t.eos_id(), t.eog_ids()), (Some(1), Some(2), &[2u32][..]));
    let ids = t.encode("hello €", true).unwrap();
    assert_eq!(ids.len(), 6);
    assert_eq!(t.decode(&ids[1..]).unwrap(), "hello €");

    md.insert("tokenizer.ggml.scores".into(), Value::Array(Array::F32(vec![0.0])));
    assert!(err(&md).contains("'tokenizer.ggml.scores'"));
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    // Shared between threads, the word cache gives the same ids.
    let t = load(&bpe_meta("smollm")).unwrap();
    let want = t.encode("hello world aaaa 123", false).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| assert_eq!(t.encode("hello world aaaa 123", false).unwrap(), want));
        }
    });
}

/// A `TemplateProcessing` post-processor naming a special token it does not
/// define is refused at load: `tokenizers` would panic at the first encode
/// (found by the `safetensors` fuzz target, tests/fuzz).
#[test]
fn template_with_undefined_special_token_is_refused() {
    let json = |single: &str| {
        format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{{"type":"Whitespace"}},
            "post_processor":{{"type":"Sequence","processors":[{{"type":"TemplateProcessing",
              "single":[{{"SpecialToken":{{"id":"{single}","type_id":0}}}},{{"Sequence":{{"id":"A","type_id":0}}}}],
              "pair":[{{"Sequence":{{"id":"A","type_id":0}}}},{{"Sequence":{{"id":"B","type_id":1}}}}],
              "special_tokens":{{"[CLS]":{{"id":"[CLS]","ids":[0],"tokens":["[CLS]"]}}}}}}]}},
            "decoder":null,
            "model":{{"type":"WordLevel","vocab":{{"[CLS]":0,"[UNK]":1,"hi":2}},"unk_token":"[UNK]"}}}}"#
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json("[CLS]")).unwrap();
    let t = Tokenizer::from_json_file(&path).expect("a valid template loads");
    assert_eq!(t.encode("hi", true).unwrap(), vec![0, 2]);
    std::fs::write(&path, json("[MISSING]")).unwrap();
    let e = Tokenizer::from_json_file(&path).unwrap_err().to_string();
    assert!(e.contains("post_processor") && e.contains("[MISSING]"), "{e}");
}

/// BPE merges whose second token lacks the `continuing_subword_prefix` are
/// refused at load: `tokenizers` would strip the prefix's length from them
/// unchecked and panic, or cut a UTF-8 character (found by the
/// `safetensors` fuzz target, tests/fuzz).
#[test]
fn bpe_merge_without_subword_prefix_is_refused() {
    let json = |second: &str| {
        format!(
            r###"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{{"type":"BPE","continuing_subword_prefix":"##","vocab":{{"a":0,"b":1,"##b":2,"ab":3,"é":4}},
              "merges":["a {second}"]}}}}"###
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    std::fs::write(&path, json("##b")).unwrap();
    Tokenizer::from_json_file(&path).expect("a prefixed merge loads");
    for bad in ["b", "é"] {
        std::fs::write(&path, json(bad)).unwrap();
        let e = Tokenizer::from_json_file(&path).unwrap_err().to_string();
        assert!(e.contains("continuing_subword_prefix"), "{e}");
    }
}
