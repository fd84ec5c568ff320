//! Structured outputs on SmolLM2: `spinfer generate` with a JSON schema, a
//! regular expression or a grammar (Lark, or GBNF as llama.cpp ships it)
//! gives text in that language; the
//! server gives the same text for the same request in each wire shape
//! (OpenAI's `response_format`, vLLM's `guided_*`), alone and batched with
//! other requests; the official `openai` client's `parse` reads its
//! answers; bad specs are errors naming the flag or field.

use std::path::Path;

use serde_json::{Value, json};

mod support;

use support::{Served, cli_generate_with, cli_run, post, python_checks, render_chat};

/// The schema the `openai` SDK sends for `class Person(BaseModel): name:
/// str; age: int` (`chat.completions.parse`), property order included.
fn person_schema() -> Value {
    json!({
        "properties": {"name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
        "required": ["name", "age"], "title": "Person", "type": "object", "additionalProperties": false
    })
}

const QUESTION: &str = "Invent a person and describe them as JSON with their name and age.";

/// `spinfer generate --json` under `extra`'s constraint: (text, stop reason).
fn constrained(model: &Path, prompt: &str, n: usize, extra: &[&str]) -> (String, String) {
    let v = cli_generate_with(model, prompt, n, extra);
    (v["text"].as_str().unwrap().to_string(), v["stop_reason"].as_str().unwrap().to_string())
}

fn refused(model: &Path, extra: &[&str]) -> String {
    let out = cli_run(model, "Hi", 4, extra);
    assert!(!out.status.success(), "{extra:?} was accepted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn generate_follows_a_schema_a_regex_and_a_grammar() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let chat = render_chat(&model, QUESTION);
    let schema = person_schema().to_string();
    let (text, stop) = constrained(&model, &chat, 64, &["-j", &schema]);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v["name"].is_string() && v["age"].is_i64() && v.as_object().unwrap().len() == 2, "{text}");
    assert_eq!(stop, "EndOfGeneration", "a complete object ends the generation: {text:?}");

    // The same schema from a file gives the same text.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("person.json");
    std::fs::write(&file, &schema).unwrap();
    assert_eq!(constrained(&model, &chat, 64, &["--json-schema-file", file.to_str().unwrap()]).0, text);

    let (year, _) = constrained(&model, "The Berlin wall fell in the year", 8, &["--regex", " [12][0-9]{3}"]);
    assert!(year.len() == 5 && year[1..].bytes().all(|b| b.is_ascii_digit()), "{year:?}");

    let lark = "start: \"The answer is \" ANSWER \".\"\nANSWER: \"yes\" | \"no\"";
    let q = render_chat(&model, "Is Paris in France?");
    let (answer, stop) = constrained(&model, &q, 16, &["--grammar", lark]);
    assert!(answer == "The answer is yes." || answer == "The answer is no.", "{answer:?}");
    assert_eq!(stop, "EndOfGeneration");
    // The same language in GBNF, llama.cpp's format: the same answer.
    let gbnf = "root ::= \"The answer is \" answer \".\"\nanswer ::= \"yes\" | \"no\"\n";
    assert_eq!(constrained(&model, &q, 16, &["--grammar", gbnf]), (answer, stop));
    // llama.cpp's own json.gbnf, as it ships: the output parses.
    let json_gbnf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/gbnf/json.gbnf");
    let (json_text, stop) = constrained(&model, &chat, 64, &["--grammar-file", json_gbnf.to_str().unwrap()]);
    if stop == "EndOfGeneration" {
        let v: Value = serde_json::from_str(&json_text).unwrap_or_else(|e| panic!("{json_text:?}: {e}"));
        assert!(v.is_object(), "{json_text}");
    } else {
        assert!(json_text.starts_with('{'), "{json_text:?}");
    }

    // Unconstrained, the model writes prose around its JSON: the schema is
    // what made the text above parse.
    let (free, _) = constrained(&model, &chat, 64, &[]);
    assert_ne!(free, text);
}

#[test]
fn generate_names_what_is_wrong_with_a_constraint() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let e = refused(&model, &["-j", "{}", "--regex", "a"]);
    assert!(e.contains("--json-schema and --regex"), "{e}");
    let e = refused(&model, &["-j", "{not json"]);
    assert!(e.contains("--json-schema is not valid JSON"), "{e}");
    let e = refused(&model, &["-j", "{\"type\": \"frobnicate\"}"]);
    assert!(e.contains("output constraint") && e.contains("frobnicate"), "{e}");
    let e = refused(&model, &["--grammar", "root ::= \"a\" |\n  [b-"]);
    assert!(e.contains("GBNF line 2, column 6: unexpected end") && e.matches("GBNF").count() == 1, "{e}");
    let e = refused(&model, &["--grammar-file", "/no/such/grammar.lark"]);
    assert!(e.contains("--grammar-file") && e.contains("/no/such/grammar.lark"), "{e}");
    let e = refused(&model, &["--regex", "[a-"]);
    assert!(e.contains("output constraint"), "{e}");
}

/// A completion's text from the server (status 200 asserted).
fn served_text(addr: &str, body: Value) -> String {
    let (st, v) = post(addr, "/v1/completions", &body);
    assert_eq!(st, 200, "{body}: {v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn the_server_constrains_as_generate_does_alone_and_batched() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let chat = render_chat(&model, QUESTION);
    let schema = person_schema();
    let (person, _) = constrained(&model, &chat, 64, &["-j", &schema.to_string()]);
    let (year, _) = constrained(&model, "The Berlin wall fell in the year", 8, &["--regex", " [12][0-9]{3}"]);
    let (free, _) = constrained(&model, "The capital of France is", 24, &[]);

    let served = Served::start(&model, "slots = 4", "ctx = 1024");
    let addr = served.addr.clone();
    let base = |prompt: &str, n: usize| json!({"prompt": prompt, "max_tokens": n, "temperature": 0});
    let with = |mut b: Value, key: &str, v: Value| {
        b[key] = v;
        b
    };
    // Each wire shape of the same schema: the CLI's text.
    let shapes = [
        ("response_format", json!({"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}})),
        ("response_format", json!({"type": "json_object", "schema": schema})),
        ("json_schema", schema.clone()),
        ("guided_json", json!(schema.to_string())),
        ("structured_outputs", json!({"json": schema})),
    ];
    let mut requests: Vec<(Value, String)> =
        shapes.into_iter().map(|(key, v)| (with(base(&chat, 64), key, v), person.clone())).collect();
    requests.push((with(base("The Berlin wall fell in the year", 8), "guided_regex", json!(" [12][0-9]{3}")), year));
    requests.push((base("The capital of France is", 24), free));
    // llama-server's GBNF `grammar` and vLLM's `guided_grammar` in GBNF: the
    // regex's language, the regex's text.
    for key in ["grammar", "guided_grammar"] {
        let gbnf = json!("root ::= \" \" [12] [0-9]{3}");
        requests.push((with(base("The Berlin wall fell in the year", 8), key, gbnf), requests[5].1.clone()));
    }
    for (body, want) in &requests {
        assert_eq!(&served_text(&addr, body.clone()), want, "{body}");
    }
    // All at once: batching does not change a constrained answer.
    std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .map(|(body, want)| {
                let addr = addr.clone();
                s.spawn(move || assert_eq!(&served_text(&addr, body.clone()), want, "batched: {body}"))
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });

    // Bad specs are 400s naming the field; the server keeps serving.
    let bad = [
        ("guided_grammar", json!("start: undefined_rule"), "guided_grammar"),
        ("guided_regex", json!("(unclosed"), "guided_regex"),
        ("json_schema", json!({"type": "frobnicate"}), "json_schema"),
        ("grammar", json!("root ::= \"a"), "grammar"),
        ("guided_choice", json!([]), "guided_choice"),
    ];
    for (key, v, param) in bad {
        let (st, e) = post(&addr, "/v1/completions", &with(base("Hi", 4), key, v));
        assert_eq!(st, 400, "{key}: {e}");
        assert_eq!(e["error"]["param"], param, "{e}");
    }
    assert_eq!(served_text(&addr, requests[5].0.clone()), requests[5].1);

    // Holding off the end (min_tokens past the object's length) cannot
    // break the schema: whitespace pads it, and a complete object ends.
    let mut body = with(base(&chat, 96), "json_schema", schema.clone());
    body["min_tokens"] = json!(90);
    let (st, v) = post(&addr, "/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        let o: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(o["name"].is_string() && o["age"].is_i64(), "{text}");
    } else {
        assert!(text.trim_start().starts_with('{'), "{text}");
    }

    let expect = json!({"model": "SmolLM2-135M-Instruct.Q4_1", "question": QUESTION, "person_text": person});
    python_checks("structured", &served, &expect);
}

/// Gemma 3's SentencePiece vocabulary (262,144 tokens, byte-fallback
/// tokens, whitespace-run tokens): a schema's output parses, and a regex
/// spanning a newline (a byte token) is followed.
#[test]
fn gemma3_follows_a_schema_over_its_sentencepiece_vocabulary() {
    let Some(model) = spinfer_test_support::gemma3() else { return };
    let chat =
        "<start_of_turn>user\nList three fruits as a JSON array of strings.<end_of_turn>\n<start_of_turn>model\n";
    let schema = json!({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3});
    let (text, stop) = constrained(&model, chat, 80, &["-j", &schema.to_string()]);
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v.as_array().is_some_and(|a| a.len() == 3 && a.iter().all(Value::is_string)), "{text}");
    assert_eq!(stop, "EndOfGeneration", "{text:?}");
    let (two_lines, _) = constrained(&model, chat, 24, &["--regex", "[A-Z][a-z]+\n[A-Z][a-z]+"]);
    let lines: Vec<&str> = two_lines.split('\n').collect();
    assert!(lines.len() == 2 && lines.iter().all(|l| l.len() >= 2), "{two_lines:?}");
}
