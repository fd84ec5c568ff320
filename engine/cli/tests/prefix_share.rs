//! Prompt prefixes shared between slots: the `n` choices of a request read
//! their prompt once (the others wait for it, then copy its keys and
//! values), and requests sharing a long opening copy it from a slot that
//! holds it; every answer is what `spinfer generate` gives alone, on
//! SmolLM2 and on Gemma 3, whose local layers keep rings.

use std::path::Path;

use serde_json::{Value, json};

mod support;

use support::{Served, cli_generate, metric, post};

fn wiki(chars: usize) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/wikitext-2-raw/wiki.test.head.raw");
    let text = std::fs::read_to_string(p).unwrap();
    text.chars().take(chars).collect()
}

fn completion(addr: &str, body: &Value) -> Value {
    let (st, v) = post(addr, "/v1/completions", body);
    assert_eq!(st, 200, "{v}");
    v
}

/// `n` greedy choices on a fresh server: all the lone answer, and the
/// prompt read once: the other choices copy all of it but its last token.
fn choices_share_their_prompt(model: &Path, prompt: &str, n: usize) {
    let engine = spinfer_engine::Engine::load(model, Default::default()).unwrap();
    let len = engine.tokenize(prompt).unwrap().len() as f64;
    let want = cli_generate(model, prompt, 12)["text"].as_str().unwrap().to_string();
    let served = Served::start(model, &format!("slots = {n}"), "ctx = 1024");
    let v = completion(&served.addr, &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "n": n}));
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["text"].as_str().unwrap(), want, "choice {}", c["index"]);
    }
    let copied = metric(&served.addr, "spinfer_cached_prompt_tokens_total");
    assert_eq!(copied, (n - 1) as f64 * (len - 1.0), "{n} choices of {len} prompt tokens");
}

#[test]
fn the_choices_of_a_request_read_their_prompt_once() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    choices_share_their_prompt(&model, &wiki(1200), 4);
}

/// Gemma 3's local layers (a 512-position window) keep rings: a prompt
/// past the window is copied ring and all.
#[test]
fn gemma3_choices_share_a_prompt_longer_than_the_window() {
    let Some(model) = spinfer_test_support::gemma3() else { return };
    choices_share_their_prompt(&model, &wiki(3000), 2);
}

/// Requests with one long opening and their own questions, sent at once:
/// each answers as alone, and the opening is read fewer times than sent.
#[test]
fn requests_sharing_an_opening_copy_it_and_answer_as_alone() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let opening = wiki(1000);
    let prompts: Vec<String> = ["Question: who wrote it?", "Question: when?", "Summary:", "In short,"]
        .iter()
        .map(|q| format!("{opening}\n{q}"))
        .collect();
    let want: Vec<String> =
        prompts.iter().map(|p| cli_generate(&model, p, 12)["text"].as_str().unwrap().to_string()).collect();
    let served = Served::start(&model, "slots = 4", "ctx = 1024");
    std::thread::scope(|s| {
        for (p, w) in prompts.iter().zip(&want) {
            let addr = served.addr.clone();
            s.spawn(move || {
                let v = completion(&addr, &json!({"prompt": p, "max_tokens": 12, "temperature": 0}));
                assert_eq!(v["choices"][0]["text"].as_str().unwrap(), w, "{p:?}");
            });
        }
    });
    assert!(metric(&served.addr, "spinfer_cached_prompt_tokens_total") > 200.0, "the opening was not shared");
}
