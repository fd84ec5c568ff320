//! Specs driven by random logits over SmolLM2's real vocabulary: whatever
//! the "model" prefers, the output must be in the spec's language.

use std::path::Path;
use std::sync::OnceLock;

use serde_json::{Value, json};
use spinfer_sampling::TokenConstraint;
use spinfer_tokenizer::Tokenizer;

use super::*;

pub(crate) fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/smollm2-135m-instruct/tokenizer.json");
        Tokenizer::from_json_file(&p).expect("tokenizer.json loads")
    })
}

pub(crate) fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(tokenizer(), tokenizer().vocab_size()).expect("the vocabulary takes grammars"))
}

/// A xorshift stream of logits in [0, 8).
struct Noise(u64);

impl Noise {
    fn logits(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 8.0
            })
            .collect()
    }
}

/// Generates under `spec` with random logits (the arg-max after masking)
/// until the guide completes or an end token wins; returns the text and
/// whether it ended by itself within `max` tokens.
pub(crate) fn walk(spec: &Spec, seed: u64, max: usize) -> (String, bool) {
    let t = tokenizer();
    let mut guide = grammars().compile(spec).expect("compiles").guide();
    let mut noise = Noise(seed | 1);
    let mut ids = Vec::new();
    for _ in 0..max {
        let mut logits = noise.logits(t.vocab_size());
        guide.mask(&mut logits).expect("a token is allowed");
        let next = spinfer_sampling::argmax_logits(&logits);
        assert!(logits[next as usize].is_finite());
        if t.is_eog(next) {
            {
                eprintln!("{:?}", t.decode(&ids).unwrap());
                return (t.decode(&ids).unwrap(), true);
            }
        }
        assert!(!t.is_control(next), "control token {next} allowed inside the text");
        ids.push(next);
        if guide.commit(next).expect("an allowed token commits") {
            {
                eprintln!("{:?}", t.decode(&ids).unwrap());
                return (t.decode(&ids).unwrap(), true);
            }
        }
    }
    eprintln!("NOT DONE");
    (t.decode(&ids).unwrap(), false)
}

#[test]
fn regex_output_matches_in_full() {
    for seed in 1..=8 {
        let (text, done) = walk(&Spec::Regex(r"[0-9]{3}-[a-z]{2,4}".into()), seed, 64);
        assert!(done, "{text:?}");
        let (digits, letters) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!(digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
        assert!((2..=4).contains(&letters.len()) && letters.bytes().all(|b| b.is_ascii_lowercase()), "{text:?}");
    }
}

#[test]
fn choice_output_is_one_of_them() {
    let choices = vec!["yes".to_string(), "no".into(), "not sure (ask again)".into(), "<|im_end|> as text".into()];
    let mut seen = std::collections::HashSet::new();
    for seed in 1..=24 {
        let (text, done) = walk(&Spec::Choice(choices.clone()), seed, 32);
        assert!(done && choices.contains(&text), "{text:?}");
        seen.insert(text);
    }
    assert!(seen.len() >= 2, "random logits should reach more than one choice: {seen:?}");
}

/// A schema with every kind of value; random logits must still produce an
/// instance of it.
#[test]
fn json_schema_output_is_an_instance() {
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "where": {"$ref": "#/$defs/place"}
        },
        "required": ["name", "n", "ok", "tags", "where"],
        "additionalProperties": false,
        "$defs": {"place": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
                            "additionalProperties": false}}
    });
    for seed in 1..=8 {
        let (text, done) = walk(&Spec::JsonSchema(schema.clone()), seed, 400);
        assert!(done, "{text:?}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let o = v.as_object().unwrap();
        assert_eq!(o.len(), 5, "{text}");
        assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 8), "{text}");
        assert!(o["n"].as_u64().is_some_and(|n| n <= 99), "{text}");
        assert!(o["ok"].is_boolean(), "{text}");
        let tags = o["tags"].as_array().unwrap();
        assert!(tags.len() <= 3 && tags.iter().all(|t| t == "a" || t == "b"), "{text}");
        assert!(o["where"]["x"].is_number(), "{text}");
    }
    let (text, done) = walk(&Spec::JsonObject, 5, 400);
    if done {
        assert!(serde_json::from_str::<Value>(&text).unwrap().is_object(), "{text}");
    } else {
        assert!(text.trim_start().starts_with('{'), "{text}");
    }
}

#[test]
fn lark_grammar_and_end_tokens() {
    let spec = Spec::Lark("start: \"Answer: \" ANSWER\nANSWER: /[A-D]/".into());
    for seed in 1..=4 {
        let (text, done) = walk(&spec, seed, 16);
        assert!(done, "{text:?}");
        assert!(["A", "B", "C", "D"].iter().any(|c| text == format!("Answer: {c}")), "{text:?}");
    }
    // Mid-way no end token is allowed; once complete only end tokens are.
    let t = tokenizer();
    let mut g = grammars().compile(&Spec::Regex("ab?".into())).unwrap().guide();
    let mut logits = vec![0.0; t.vocab_size()];
    g.mask(&mut logits).unwrap();
    assert!(t.eog_ids().iter().all(|&e| logits[e as usize] == f32::NEG_INFINITY));
    let a = t.encode("a", false).unwrap()[0];
    assert!(!g.commit(a).unwrap(), "\"a\" may go on with \"b\"");
    let mut logits = vec![0.0; t.vocab_size()];
    g.mask(&mut logits).unwrap();
    assert!(t.eog_ids().iter().all(|&e| logits[e as usize] == 0.0), "the output may end after \"a\"");
    let allowed: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] == 0.0).collect();
    assert!(allowed.iter().all(|&i| t.is_eog(i as u32) || t.token_bytes(i as u32).unwrap() == b"b"), "{allowed:?}");
}

#[test]
fn control_tokens_are_never_text() {
    let t = tokenizer();
    let mut g = grammars().compile(&Spec::Regex(r"(?s:.{0,40})".into())).unwrap().guide();
    let mut logits = vec![0.0; t.vocab_size()];
    g.mask(&mut logits).unwrap();
    let controls: Vec<u32> = (0..t.vocab_size() as u32).filter(|&i| t.is_control(i) && !t.is_eog(i)).collect();
    assert!(!controls.is_empty());
    assert!(controls.iter().all(|&i| logits[i as usize] == f32::NEG_INFINITY));
    let lt = t.encode("<", false).unwrap()[0];
    assert_eq!(logits[lt as usize], 0.0);
}

#[test]
fn extra_output_rows_are_never_allowed() {
    let t = tokenizer();
    let g = Grammars::new(t, t.vocab_size() + 64).unwrap();
    let mut guide = g.compile(&Spec::Regex(r"(?s:.{0,8})".into())).unwrap().guide();
    let mut logits = vec![0.0; t.vocab_size() + 64];
    guide.mask(&mut logits).unwrap();
    assert!(logits[t.vocab_size()..].iter().all(|&l| l == f32::NEG_INFINITY));
    let e = Grammars::new(t, t.vocab_size() - 1).err().expect("fewer rows than tokens is refused");
    assert!(e.to_string().contains("output rows"), "{e}");
}

#[test]
fn bad_specs_are_named_errors() {
    let g = grammars();
    let bad = [
        Spec::Lark("start: foo".into()),
        Spec::Lark("root ::= \"a\"".into()),
        Spec::Regex("[a-".into()),
        Spec::Choice(vec![]),
        Spec::JsonSchema(json!({"type": "frobnicate"})),
        Spec::JsonSchema(json!({"$ref": "#/$defs/missing"})),
    ];
    for spec in bad {
        let e = g.compile(&spec).err().unwrap_or_else(|| panic!("{spec:?} compiled"));
        assert!(!e.to_string().is_empty(), "{spec:?}");
    }
    // A keyword it cannot enforce is refused, not ignored.
    let e = g.compile(&Spec::JsonSchema(json!({"type": "string", "not": {"const": "a"}}))).err().unwrap();
    assert!(e.to_string().contains("Unimplemented keys") && e.to_string().contains("not"), "{e}");
    let many = Spec::Choice((0..=MAX_CHOICES).map(|i| i.to_string()).collect());
    assert!(g.compile(&many).err().unwrap().to_string().contains("choices"));
}

/// A grammar whose language is a single very long string runs into
/// llguidance's limits or completes; it never hangs.
#[test]
fn huge_repetition_is_bounded() {
    let g = grammars();
    match g.compile(&Spec::Regex("(a|b|ab|ba){1000000}".into())) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(gr) => {
            let mut guide = gr.guide();
            let mut logits = vec![0.0; tokenizer().vocab_size()];
            let _ = guide.mask(&mut logits);
        }
    }
}
