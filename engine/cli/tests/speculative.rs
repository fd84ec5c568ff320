//! `[speculative]` in `spinfer serve`: drafts from the context's n-grams
//! change no answer (text, log-probabilities, finish reason, usage; greedy
//! and seeded sampling; streamed or not; requests alone or decoding
//! together), and on a text that repeats its prompt they are accepted.

use serde_json::{Value, json};

mod support;

use support::{Served, metric, post};

/// Asks to copy a paragraph back: most of the answer repeats the prompt.
const COPY: &str = "Fix the spelling mistakes in this text and write it out again in full:\n\nThe printing press was \
    invented by Johannes Gutenberg around 1440. It used movable metal type, oil-based inks and a wooden press \
    adapted from those used to make wine. The invention spread quickly across Europe.";

fn requests() -> Vec<Value> {
    let chat = |content: &str, extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 60});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    vec![
        chat(COPY, json!({"temperature": 0, "logprobs": true, "top_logprobs": 3})),
        chat(COPY, json!({"temperature": 0.8, "seed": 5, "top_p": 0.9})),
        chat("Write the word 'spin' ten times, separated by spaces.", json!({"temperature": 0})),
        chat("Name three rivers in Europe.", json!({"temperature": 0, "stop": ["Danube"]})),
    ]
}

/// The parts of an answer that must not depend on drafts (nor on what
/// the prompt cache held, which the order of requests decides).
fn answer(v: &Value) -> Value {
    let c = &v["choices"][0];
    json!({"message": c["message"], "logprobs": c["logprobs"], "finish_reason": c["finish_reason"],
           "tokens": [v["usage"]["prompt_tokens"], v["usage"]["completion_tokens"]]})
}

fn ask(addr: &str, body: &Value) -> Value {
    let (st, v) = post(addr, "/v1/chat/completions", body);
    assert_eq!(st, 200, "{v}");
    answer(&v)
}

/// The requests one at a time, then all at once.
fn answers(addr: &str) -> (Vec<Value>, Vec<Value>) {
    let alone: Vec<Value> = requests().iter().map(|b| ask(addr, b)).collect();
    let together = std::thread::scope(|s| {
        let hs: Vec<_> = requests().into_iter().map(|b| s.spawn(move || ask(addr, &b))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    (alone, together)
}

#[test]
fn drafts_change_no_answer() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let plain = Served::start(&model, "slots = 4", "ctx = 1024");
    let (want_alone, want_together) = answers(&plain.addr);
    assert!(want_alone == want_together, "batching changes no answer");
    assert_eq!(metric(&plain.addr, "spinfer_draft_tokens_total"), 0.0);

    let speculative = "ctx = 1024\n[speculative]\nnum_speculative_tokens = 4\ndisable_by_batch_size = 4";
    let drafted = Served::start(&model, "slots = 4", speculative);
    let (alone, together) = answers(&drafted.addr);
    for (i, (a, w)) in alone.iter().zip(&want_alone).enumerate() {
        assert!(a == w, "request {i} alone: {} vs {}", a["message"], w["message"]);
    }
    for (i, (a, w)) in together.iter().zip(&want_alone).enumerate() {
        assert!(a == w, "request {i} among others: {} vs {}", a["message"], w["message"]);
    }
    let (drafts, accepted) = (
        metric(&drafted.addr, "spinfer_draft_tokens_total"),
        metric(&drafted.addr, "spinfer_draft_accepted_tokens_total"),
    );
    eprintln!("drafted {drafts}, accepted {accepted}");
    assert!(accepted > 40.0 && accepted <= drafts, "drafted {drafts}, accepted {accepted}");
    // Streamed, the text is the same too.
    let mut body = requests()[0].clone();
    body["stream"] = json!(true);
    let (st, b) = support::http(
        &drafted.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", &format!("Bearer {}", support::KEY))],
        body.to_string().as_bytes(),
    );
    assert_eq!(st, 200);
    let text: String = String::from_utf8(b)
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"].as_str().map(String::from)
        })
        .collect();
    assert_eq!(text, want_alone[0]["message"]["content"].as_str().unwrap());
}

/// With `disable_by_batch_size = 1`, two requests decoding together make
/// no drafts (and still answer as alone).
#[test]
fn no_drafts_past_the_batch_size() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let speculative = "ctx = 1024\n[speculative]\nnum_speculative_tokens = 4\ndisable_by_batch_size = 1";
    let served = Served::start(&model, "slots = 2", speculative);
    let body =
        |content: &str| json!({"messages": [{"role": "user", "content": content}], "max_tokens": 40, "temperature": 0});
    let alone = ask(&served.addr, &body(COPY));
    let drafts_alone = metric(&served.addr, "spinfer_draft_tokens_total");
    assert!(drafts_alone > 0.0, "one request alone drafts");
    // The same request twice at once: both decode in every step.
    let both: Vec<Value> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2).map(|_| s.spawn(|| ask(&served.addr, &body(COPY)))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(both.iter().all(|a| *a == alone), "{both:?} vs {alone}");
    let drafts = metric(&served.addr, "spinfer_draft_tokens_total") - drafts_alone;
    // Steps where one of them still reads its prompt (or has finished) may draft for the other.
    assert!(drafts < drafts_alone, "drafted {drafts} tokens together, {drafts_alone} alone");
}
