//! SmolLM2's tokenizer, from the GGUF's metadata and from `tokenizer.json`,
//! against the reference token ids, against each other, and round trips.

use std::path::Path;
use std::time::Instant;

use spinfer_engine::gguf::GgufFile;
use spinfer_engine::tokenizer::{StreamDecoder, Tokenizer};
use spinfer_tests::{data, reference, smollm2};

const TRICKY: &[&str] = &[
    "",
    "Hello 👋 world 🦀🦀 — naïve café, Ünïcödé, façade, Ελληνικά, кириллица",
    "日本語のテキスト、中文字符。한국어 텍스트",
    "multiple   spaces    and\ttabs\t\tand\n\nnewlines\r\n end  ",
    "  leading and trailing  ",
    "2018-01-22 12:1",
    "3.14159 1,000,000 0x1F 1969 ½ ² ٣",
    "don't I'LL we've they'RE it's",
    "def f(x):\n\treturn x**2  # comment\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|<|im_end|>>broken <|endoftext|",
    "\u{200b}zero\u{00a0}width\u{3000}ideographic space",
];

fn json_tokenizer() -> Tokenizer {
    Tokenizer::from_json_file(&data("smollm2-135m-instruct/tokenizer.json")).expect("tokenizer.json loads")
}

fn gguf_tokenizer() -> Option<Tokenizer> {
    let path = smollm2()?;
    let g = GgufFile::open(&path).expect("gguf opens");
    Some(Tokenizer::from_gguf(&g).expect("gguf tokenizer"))
}

/// Every string the round-trip checks use: prompts, greedy texts, tricky ones.
fn all_texts() -> Vec<String> {
    let r = reference();
    let mut v: Vec<String> = TRICKY.iter().map(|s| s.to_string()).collect();
    for p in r.prompts {
        v.push(p.text);
        v.push(p.greedy_text);
    }
    v
}

fn check_reference(t: &Tokenizer, what: &str) {
    for p in reference().prompts {
        assert_eq!(t.encode(&p.text, false).unwrap(), p.input_ids, "{what}: input_ids of {:?}", p.text);
        assert_eq!(t.decode(&p.greedy_ids).unwrap(), p.greedy_text, "{what}: decode of greedy_ids");
    }
    for s in all_texts() {
        let ids = t.encode(&s, false).unwrap();
        assert_eq!(t.decode(&ids).unwrap(), s, "{what}: round trip of {s:?}");
    }
    // Specials written in the text are single tokens.
    let ids = t.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap();
    assert_eq!((ids[0], *ids.last().unwrap()), (1, 2), "{what}: {ids:?}");
    assert_eq!(ids.len(), 5, "{what}: {ids:?}");
    assert_eq!(t.vocab_size(), 49152);
    assert!(!t.add_bos_default(), "{what}: SmolLM2 adds no BOS");
    for id in [0, 2] {
        assert!(t.eog_ids().contains(&id), "{what}: eog {:?} lacks {id}", t.eog_ids());
    }
}

#[test]
fn tokenizer_json_matches_reference() {
    let t = json_tokenizer();
    assert_eq!(t.kind(), "tokenizer.json (BPE)");
    check_reference(&t, "tokenizer.json");
}

#[test]
fn gguf_matches_reference_and_tokenizer_json() {
    let Some(g) = gguf_tokenizer() else { return };
    assert_eq!(g.kind(), "gpt2-bpe (smollm)");
    assert_eq!((g.bos_id(), g.eos_id()), (Some(1), Some(2)));
    assert_eq!(g.encode("Hi", true).unwrap()[0], 1);
    check_reference(&g, "gguf");
    let j = json_tokenizer();
    for s in all_texts() {
        assert_eq!(g.encode(&s, false).unwrap(), j.encode(&s, false).unwrap(), "ids of {s:?}");
    }
    for id in 0..g.vocab_size() as u32 {
        assert_eq!(g.token_bytes(id).unwrap(), j.token_bytes(id).unwrap(), "bytes of token {id}");
        assert_eq!(g.is_control(id), j.is_control(id), "whether token {id} is a control token");
    }
    assert!(g.is_control(1) && g.is_control(2) && !g.is_control(100));
    assert!(g.token_bytes(49152).is_err());
}

/// `wiki.test.raw` (or a slice of it) with CRLF replaced by LF, as the
/// perplexity protocol reads it.
fn wikitext(path: &Path) -> String {
    let raw = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    String::from_utf8(raw).expect("utf-8").replace("\r\n", "\n")
}

fn compare_on(text: &str) {
    let j = json_tokenizer();
    let t0 = Instant::now();
    let jids = j.encode(text, false).unwrap();
    let tj = t0.elapsed();
    assert_eq!(j.decode(&jids).unwrap(), text);
    let Some(g) = gguf_tokenizer() else { return };
    let t0 = Instant::now();
    let gids = g.encode(text, false).unwrap();
    let tg = t0.elapsed();
    eprintln!(
        "{} bytes -> {} tokens; gguf encode {:.1} ms, tokenizer.json encode {:.1} ms",
        text.len(),
        gids.len(),
        tg.as_secs_f64() * 1e3,
        tj.as_secs_f64() * 1e3
    );
    if let Some(i) = gids.iter().zip(&jids).position(|(a, b)| a != b) {
        panic!(
            "first difference at token {i}: gguf {:?} vs json {:?}",
            &gids[i..(i + 8).min(gids.len())],
            &jids[i..(i + 8).min(jids.len())]
        );
    }
    assert_eq!(gids.len(), jids.len());
    assert_eq!(g.decode(&gids).unwrap(), text);
}

#[test]
fn gguf_and_tokenizer_json_agree_on_wikitext_head() {
    compare_on(&wikitext(&data("wikitext-2-raw/wiki.test.head.raw")));
}

/// The whole test file (1.29 MB); run with `--ignored`. Uses
/// `$SPINFER_WIKITEXT` or `tests/data/wikitext-2-raw/wiki.test.raw`.
#[test]
#[ignore = "whole WikiText-2 test file: slow in debug builds"]
fn gguf_and_tokenizer_json_agree_on_all_of_wikitext() {
    let path =
        std::env::var_os("SPINFER_WIKITEXT").map(Into::into).unwrap_or_else(|| data("wikitext-2-raw/wiki.test.raw"));
    compare_on(&wikitext(&path));
}

fn check_stream(t: &Tokenizer, what: &str) {
    let text = "Crab: 🦀🦀, 日本語のテキスト, naïve – done 👋🏽!";
    let ids = t.encode(text, false).unwrap();
    let mut d = StreamDecoder::new(t);
    let (mut out, mut held) = (String::new(), 0);
    for &id in &ids {
        let piece = d.push(id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "{what}: replacement char mid-stream after token {id}: {piece:?}");
        held += piece.is_empty() as usize;
        out.push_str(&piece);
    }
    assert!(held > 0, "{what}: no token ended mid-character, the test proves nothing");
    out.push_str(&d.finish());
    assert_eq!(out, text, "{what}");
}

#[test]
fn stream_decoder_yields_exact_text() {
    check_stream(&json_tokenizer(), "tokenizer.json");
    if let Some(g) = gguf_tokenizer() {
        check_stream(&g, "gguf");
    }
}

#[test]
fn missing_tokenizer_json_names_the_path() {
    let p = data("smollm2-135m-instruct/no-such-tokenizer.json");
    let e = Tokenizer::from_json_file(&p).unwrap_err().to_string();
    assert!(e.contains("no-such-tokenizer.json"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("tokenizer.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let e = Tokenizer::from_json_file(&bad).unwrap_err().to_string();
    assert!(e.contains(&bad.display().to_string()), "{e}");
}
