//! `spinfer serve` as a client sees it: the real server on a loopback
//! port, talked to by the official `openai` Python client
//! (`tests/server/openai_client.py`) and by raw HTTP for what a client
//! library would refuse to send. Greedy answers equal `spinfer generate
//! --temp 0`; bad input is a 4xx in OpenAI's error shape and the server
//! keeps serving; 128 concurrent requests (some cancelled mid-stream)
//! each get the answer they get alone, and leave no slot or memory
//! behind; SIGTERM drains and exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

mod support;

use support::{
    KEY, Served, chat_template, cli_generate, cli_generate_with, complete, http, metric, post, python_checks,
    render_chat,
};

#[test]
fn the_openai_client_gets_what_generate_gives() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let prompt = "The capital of France is";
    let want = cli_generate(&model, prompt, 24);
    let text = want["text"].as_str().unwrap().to_string();
    // A stop string from the middle of the greedy text.
    let stop = text.split_whitespace().nth(2).expect("a few words").to_string();

    // The chat prompt, rendered as the server renders it, run by the CLI.
    let question = "What is the capital of France?";
    let chat = cli_generate(&model, &render_chat(&model, question), 32);

    let mut served = Served::start(&model, "slots = 2", "ctx = 1024");
    let expect = json!({
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": prompt, "max_tokens": 24, "text": text, "tokens": want["tokens"],
        "prompt_tokens": want["prompt_tokens"], "stop": stop,
        "chat_question": question, "chat_text": chat["text"], "chat_prompt_tokens": chat["prompt_tokens"],
    });
    python_checks("generate", &served, &expect);
    assert!(served.terminate(Duration::from_secs(30)).success(), "SIGTERM is a clean exit");
}

/// OpenAI's `logit_bias`, `frequency_penalty` and `presence_penalty`
/// answer as `spinfer generate`'s `--logit-bias`, `--frequency-penalty`
/// and `--presence-penalty`, and change the greedy text.
#[test]
fn penalties_and_biases_answer_as_generate_does() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let prompt = "One, two, one, two,";
    let plain = cli_generate(&model, prompt, 16);
    let first = plain["tokens"][0].as_u64().unwrap();
    let flags = ["--frequency-penalty", "1", "--presence-penalty", "0.5", "-l", &format!("{first}-100")];
    let want = cli_generate_with(&model, prompt, 16, &flags);
    assert_ne!(want["text"], plain["text"]);
    assert_ne!(want["tokens"][0].as_u64(), Some(first), "the banned token came first");

    let served = Served::start(&model, "slots = 1", "ctx = 1024");
    let mut bias = serde_json::Map::new();
    bias.insert(first.to_string(), json!(-100));
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "frequency_penalty": 1,
                      "presence_penalty": 0.5, "logit_bias": bias});
    let (st, v) = post(&served.addr, "/v1/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], want["text"]);
    let (st, v) = post(&served.addr, "/v1/completions", &json!({"prompt": prompt, "logit_bias": {"49152": 1}}));
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("logit_bias")), "{v}");

    // vLLM's repetition_penalty: llama.cpp's rule over the whole context.
    let want = cli_generate_with(&model, prompt, 16, &["--repeat-penalty", "1.5", "--repeat-last-n", "100000"]);
    assert_ne!(want["text"], plain["text"]);
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "repetition_penalty": 1.5});
    let (st, v) = post(&served.addr, "/v1/completions", &body);
    assert_eq!((st, &v["choices"][0]["text"]), (200, &want["text"]), "{v}");

    // vLLM's stop_token_ids: the answer ends before the first of them, as
    // at an end-of-generation token.
    let tokens: Vec<u64> = plain["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let k = (1..tokens.len()).find(|&k| !tokens[..k].contains(&tokens[k])).expect("a token new at k");
    let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "stop_token_ids": [tokens[k]]});
    let (st, v) = post(&served.addr, "/v1/completions", &body);
    let cut = cli_generate(&model, prompt, k)["text"].clone();
    assert_eq!((st, &v["choices"][0]["text"], v["choices"][0]["finish_reason"].as_str()), (200, &cut, Some("stop")));
    assert_eq!(v["usage"]["completion_tokens"], k, "{v}");
    let body = json!({"prompt": prompt, "stop_token_ids": [49152]});
    let (st, v) = post(&served.addr, "/v1/completions", &body);
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("stop_token_ids")), "{v}");
}

/// `ignore_eos` and `min_tokens` hold off the end of generation: the
/// server's `ignore_eos` answers as `generate --ignore-eos`, and
/// `min_tokens` is a floor on the answer's length.
#[test]
fn ignore_eos_and_min_tokens_hold_off_the_end() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let prompt = render_chat(&model, "Say hi.");
    let natural = cli_generate(&model, &prompt, 64);
    let n = natural["tokens"].as_array().unwrap().len();
    assert_eq!(natural["stop_reason"], "EndOfGeneration");
    assert!(n < 60, "the answer should end by itself: {natural}");
    let forced = cli_generate_with(&model, &prompt, 64, &["--ignore-eos"]);
    assert_eq!((forced["tokens"].as_array().unwrap().len(), forced["stop_reason"].as_str()), (64, Some("MaxTokens")));

    let served = Served::start(&model, "slots = 2", "ctx = 1024");
    let ask = |extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 64, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, v) = post(&served.addr, "/v1/completions", &body);
        assert_eq!(st, 200, "{v}");
        v
    };
    let v = ask(json!({"ignore_eos": true}));
    assert_eq!(v["choices"][0]["text"], forced["text"]);
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), v["choices"][0]["finish_reason"].as_str()),
        (Some(64), Some("length"))
    );
    let floor = n + 8;
    let v = ask(json!({"min_tokens": floor}));
    let got = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert!(got >= floor, "{got} tokens under min_tokens {floor}: {v}");
    assert!(v["choices"][0]["text"].as_str().unwrap().starts_with(natural["text"].as_str().unwrap()), "{v}");
}

#[test]
fn the_openai_client_gets_the_embedders_vectors() {
    let Some(dir) = spinfer_test_support::minilm() else { return };
    let inputs = ["A man is playing a guitar.", "The weather is lovely today.", "A person plays an instrument."];
    let e = spinfer_engine::embed::Embedder::load(&dir, Default::default()).unwrap();
    let got = e.embed_batch_detailed(&inputs).unwrap();
    let served = Served::start(&dir, "", "");
    let expect = json!({
        "model": dir.file_name().unwrap().to_str().unwrap(),
        "inputs": inputs,
        "vectors": got.iter().map(|g| g.vector.clone()).collect::<Vec<_>>(),
        "tokens": got.iter().map(|g| g.tokens).sum::<usize>(),
    });
    python_checks("embed", &served, &expect);
}

/// A completion's text and its `usage.prompt_tokens_details.cached_tokens`.
fn complete_cached(addr: &str, prompt: &str, max_tokens: usize) -> (String, u64) {
    let (st, v) = post(addr, "/v1/completions", &json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}));
    assert_eq!(st, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("usage.prompt_tokens_details");
    (v["choices"][0]["text"].as_str().unwrap().to_string(), cached)
}

/// The prompt cache: a request sharing a prefix with the prompt a free
/// slot keeps runs only the rest (usage and metrics count the tokens
/// reused), takes that slot over a less recently used one, and answers
/// what `spinfer generate` answers; with `prompt_cache = false` nothing
/// is reused.
#[test]
fn a_prompt_sharing_a_kept_prefix_runs_only_the_rest_and_answers_the_same() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let engine = spinfer_engine::Engine::load(&model, Default::default()).unwrap();
    let tokens = |p: &str| engine.tokenize(p).unwrap();
    let reusable = |kept: &str, p: &str| {
        let (a, b) = (tokens(kept), tokens(p));
        a.iter().zip(&b).take_while(|(x, y)| x == y).count().min(b.len() - 1) as u64
    };
    let a = "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg";
    let b = "Once upon a time, in a small village by the sea, there lived an old fisherman who";
    let served = Served::start(&model, &format!("api_keys = [\"{KEY}\"]\nslots = 2"), "ctx = 1024");
    let addr = served.addr.clone();
    let (first_a, cached) = complete_cached(&addr, a, 16);
    assert_eq!(cached, 0, "nothing is kept before the first request");
    let (text_b, cached) = complete_cached(&addr, b, 16);
    assert_eq!(cached, 0, "b shares nothing with a");
    // The next turn of b's conversation: b's slot, though a's is the
    // least recently used; then a's prompt again, whole but its last token.
    let b2 = format!("{b}{text_b} And one morning,");
    let (text, cached) = complete_cached(&addr, &b2, 24);
    assert!(cached > 10, "b2 reused {cached} tokens");
    assert_eq!(cached, reusable(b, &b2));
    assert_eq!(text, cli_generate(&model, &b2, 24)["text"].as_str().unwrap(), "{b2:?} with its prefix cached");
    let (again, cached) = complete_cached(&addr, a, 16);
    assert_eq!((again.as_str(), cached), (first_a.as_str(), tokens(a).len() as u64 - 1));
    let total = metric(&addr, "spinfer_cached_prompt_tokens_total");
    assert_eq!(total, (reusable(b, &b2) + tokens(a).len() as u64 - 1) as f64);

    let off = Served::start(&model, &format!("api_keys = [\"{KEY}\"]\nslots = 2\nprompt_cache = false"), "ctx = 1024");
    complete_cached(&off.addr, b, 16);
    let (text_off, cached) = complete_cached(&off.addr, &b2, 24);
    assert_eq!((text_off, cached), (text, 0));
}

/// Gemma 3's local layers keep their keys in rings: a reused prefix
/// answers as `spinfer generate` there too.
#[test]
fn gemma3_reuses_a_kept_prefix_and_answers_the_same() {
    let Some(model) = spinfer_test_support::gemma3() else { return };
    let a = "The history of the printing press begins in the fifteenth century, when";
    let served = Served::start(&model, &format!("api_keys = [\"{KEY}\"]\nslots = 1"), "ctx = 1024");
    let (text_a, _) = complete_cached(&served.addr, a, 12);
    let a2 = format!("{a}{text_a} Later,");
    let (text, cached) = complete_cached(&served.addr, &a2, 12);
    assert!(cached > 10, "a2 reused {cached} tokens");
    assert_eq!(text, cli_generate(&model, &a2, 12)["text"].as_str().unwrap(), "{a2:?} with its prefix cached");
}

/// Log-probabilities: `echo` with `logprobs` on token ids (what
/// lm-evaluation-harness's `local-completions` sends to score a text)
/// gives each prompt token's log-probability, whose sum is the one
/// perplexity's protocol scores on the same window; a generated token's
/// is the largest of its `top_logprobs` under greedy decoding; chat gives
/// one entry per completion token, the same streamed and whole.
#[test]
fn logprobs_score_the_prompt_as_perplexity_does_and_follow_the_tokens_chosen() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let engine = spinfer_engine::Engine::load(&model, Default::default()).unwrap();
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/wikitext-2-raw/wiki.test.head.raw"),
    )
    .unwrap();
    let ids: Vec<u32> = engine.tokenize(&text).unwrap()[..300].to_vec();
    let mut session = engine.model.new_session();
    let want = spinfer_engine::perplexity::perplexity(
        &engine.model,
        &mut session,
        &ids,
        ids.len(),
        Some(1),
        &mut |_, _, _| {},
    )
    .unwrap();

    let served = Served::start(&model, &format!("api_keys = [\"{KEY}\"]\nslots = 2"), "ctx = 1024");
    let a = served.addr.as_str();
    // Twice: the second finds the first's prompt kept, and must not use it.
    for _ in 0..2 {
        let body =
            json!({"prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0, "seed": 1234});
        let (st, v) = post(a, "/v1/completions", &body);
        assert_eq!(st, 200, "{v}");
        let lp = &v["choices"][0]["logprobs"];
        let lps = lp["token_logprobs"].as_array().unwrap();
        assert_eq!(lps.len(), ids.len() + 1, "every prompt token and the one generated");
        assert!(lps[0].is_null() && lp["top_logprobs"][0].is_null(), "nothing predicts the first token");
        let nll: f64 = -lps[1..ids.len()].iter().map(|x| x.as_f64().unwrap()).sum::<f64>();
        eprintln!("echo NLL {nll}, perplexity's {}", want.nll);
        assert!((nll - want.nll).abs() < 1e-6 * want.nll, "echo NLL {nll}, perplexity's {}", want.nll);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        let tops = lp["top_logprobs"].as_array().unwrap();
        let best =
            |i: usize| tops[i].as_object().unwrap().values().map(|x| x.as_f64().unwrap()).fold(f64::MIN, f64::max);
        let last = lps[ids.len()].as_f64().unwrap();
        assert_eq!(last, best(ids.len()), "the greedy token is the most likely");
        assert!((1..ids.len()).all(|i| lps[i].as_f64().unwrap() <= best(i)), "a token above its top-1");
        let offsets = lp["text_offset"].as_array().unwrap();
        assert!(offsets.windows(2).all(|w| w[0].as_u64() <= w[1].as_u64()) && offsets[0] == 0);
        assert!(v["choices"][0]["text"].as_str().unwrap().starts_with(&engine.detokenize(&ids).unwrap()));
    }

    // Streamed, an echo's text and log-probabilities are the whole answer's.
    let body = json!({"prompt": "The capital of France is", "max_tokens": 6, "logprobs": 2, "echo": true,
                      "temperature": 0});
    let (_, whole) = post(a, "/v1/completions", &body);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let auth = format!("Bearer {KEY}");
    let (st, b) = http(a, "POST", "/v1/completions", &[("Authorization", &auth)], streamed.to_string().as_bytes());
    assert_eq!(st, 200);
    let (mut text, mut lps, mut tokens) = (String::new(), Vec::new(), Vec::new());
    for data in String::from_utf8(b).unwrap().lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        if let Some(l) = v["choices"][0]["logprobs"].as_object() {
            lps.extend(l["token_logprobs"].as_array().unwrap().iter().cloned());
            tokens.extend(l["tokens"].as_array().unwrap().iter().cloned());
        }
    }
    let w = &whole["choices"][0];
    assert_eq!(text, w["text"].as_str().unwrap());
    assert!(text.starts_with("The capital of France is"), "{text}");
    assert_eq!(&lps, w["logprobs"]["token_logprobs"].as_array().unwrap());
    assert_eq!(&tokens, w["logprobs"]["tokens"].as_array().unwrap());

    let chat = |stream: bool| {
        let body = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
                          "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 3, "stream": stream,
                          "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }});
        let auth = format!("Bearer {KEY}");
        let (st, b) = http(a, "POST", "/v1/chat/completions", &[("Authorization", &auth)], body.to_string().as_bytes());
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        if !stream {
            let v: Value = serde_json::from_slice(&b).unwrap();
            let n = v["usage"]["completion_tokens"].as_u64().unwrap();
            return (v["choices"][0]["logprobs"]["content"].as_array().unwrap().clone(), n);
        }
        let (mut entries, mut n) = (Vec::new(), 0);
        for data in String::from_utf8(b).unwrap().lines().filter_map(|l| l.strip_prefix("data: ")) {
            let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
            n = v["usage"]["completion_tokens"].as_u64().unwrap_or(n);
            if let Some(c) = v["choices"][0]["logprobs"]["content"].as_array() {
                entries.extend(c.iter().cloned());
            }
        }
        (entries, n)
    };
    let (whole, n) = chat(false);
    assert_eq!(whole.len() as u64, n, "one entry per completion token");
    for e in &whole {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(e["logprob"], top[0]["logprob"], "greedy: {e}");
        assert_eq!(e["token"], top[0]["token"]);
        assert!(e["bytes"].is_array());
    }
    let (streamed, n2) = chat(true);
    assert_eq!((streamed, n2), (whole, n), "streamed and whole log-probabilities differ");
}

/// `/tokenize`, `/detokenize` and `/tokenizer_info` in vLLM's shapes (what
/// lm-evaluation-harness's remote tokenizer asks): the model's tokens and
/// text, its special tokens and template, behind the API key.
#[test]
fn the_tokenizer_endpoints_give_the_models_tokens() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let engine = spinfer_engine::Engine::load(&model, Default::default()).unwrap();
    let served = Served::start(&model, &format!("api_keys = [\"{KEY}\"]"), "ctx = 512");
    let a = served.addr.as_str();
    let text = "Tokenizers split text into pieces: naïve café, 123 + 456.";
    let (st, v) = post(a, "/tokenize", &json!({"prompt": text, "add_special_tokens": false}));
    assert_eq!(st, 200, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, engine.tokenizer.encode(text, false).unwrap());
    assert_eq!((v["count"].as_u64(), v["max_model_len"].as_u64()), (Some(ids.len() as u64), Some(512)));
    let (st, v) = post(a, "/tokenize", &json!({"content": text}));
    assert_eq!((st, v["tokens"].as_array().map(Vec::len)), (200, Some(engine.tokenize(text).unwrap().len())));
    let (st, v) = post(a, "/detokenize", &json!({"tokens": ids}));
    assert_eq!((st, v["prompt"].as_str()), (200, Some(text)));
    let auth = format!("Bearer {KEY}");
    let (st, b) = http(a, "GET", "/tokenizer_info", &[("Authorization", &auth)], b"");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!((st, v["eos_token"].as_str()), (200, Some("<|im_end|>")), "{v}");
    assert_eq!(v["chat_template"].as_str(), engine.chat_template());
    let (st, _) = http(a, "POST", "/tokenize", &[], json!({"prompt": "x"}).to_string().as_bytes());
    assert_eq!(st, 401, "the tokenizer endpoints need the key");
    for (path, body, param) in [
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        ("/tokenize", json!({"prompt": "x", "frobnicate": 1}), "frobnicate"),
        ("/detokenize", json!({"tokens": [1, -1]}), "tokens"),
        ("/detokenize", json!({"tokens": [4_000_000_000u32]}), "tokens"),
    ] {
        let (st, v) = post(a, path, &body);
        assert_eq!((st, v["error"]["param"].as_str()), (400, Some(param)), "{path} {body}: {v}");
    }
}

/// A request that must fail: its status and the error's `param`.
struct Case {
    what: &'static str,
    path: &'static str,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    status: u16,
    param: Option<&'static str>,
}

#[test]
fn bad_input_is_a_4xx_in_openais_shape_and_the_server_keeps_serving() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let served = Served::start(
        &model,
        &format!("api_keys = [\"{KEY}\"]\nmax_body_kb = 4\nmax_tokens = 64\nslots = 2"),
        "ctx = 256",
    );
    let a = served.addr.as_str();
    let auth = format!("Bearer {KEY}");
    let ok_chat = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let long_prompt = "word ".repeat(400);
    let chat = "/v1/chat/completions";
    let text = "/v1/completions";
    let key = [("Authorization", auth.as_str())];
    let case = |what, path, headers: &[(&'static str, &str)], body: &[u8], status, param| Case {
        what,
        path,
        headers: headers.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        body: body.to_vec(),
        status,
        param,
    };
    let ok = ok_chat.to_string();
    let over_ctx = json!({"prompt": long_prompt, "max_tokens": 4}).to_string();
    let too_big = json!({"prompt": "y".repeat(5000)}).to_string();
    let cases = [
        case("no key", chat, &[], ok.as_bytes(), 401, None),
        case("wrong key", chat, &[("Authorization", "Bearer sk-wrong-key")], ok.as_bytes(), 401, None),
        case("malformed JSON", chat, &key, b"{\"messages\": [", 400, None),
        case("invalid UTF-8", text, &key, b"{\"prompt\": \"\xff\xfe\"}", 400, None),
        case("wrong type", chat, &key, br#"{"messages": "hi"}"#, 400, Some("messages")),
        case(
            "wrong type",
            chat,
            &key,
            br#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#,
            400,
            Some("temperature"),
        ),
        case(
            "unknown model",
            chat,
            &key,
            br#"{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}"#,
            404,
            Some("model"),
        ),
        case("empty messages", chat, &key, br#"{"messages": []}"#, 400, Some("messages")),
        case("prompt over the context", text, &key, over_ctx.as_bytes(), 400, Some("prompt")),
        case("max_tokens 0", text, &key, br#"{"prompt": "x", "max_tokens": 0}"#, 400, Some("max_tokens")),
        case("max_tokens -1", text, &key, br#"{"prompt": "x", "max_tokens": -1}"#, 400, Some("max_tokens")),
        case("max_tokens over the cap", text, &key, br#"{"prompt": "x", "max_tokens": 65}"#, 400, Some("max_tokens")),
        case("unsupported field", text, &key, br#"{"prompt": "x", "best_of": 2}"#, 400, Some("best_of")),
        case(
            "bias outside the vocabulary",
            text,
            &key,
            br#"{"prompt": "x", "logit_bias": {"49152": 1}}"#,
            400,
            Some("logit_bias"),
        ),
        case("too many choices", text, &key, br#"{"prompt": "x", "n": 17}"#, 400, Some("n")),
        case(
            "a grammar that does not compile",
            text,
            &key,
            br#"{"prompt": "x", "guided_grammar": "start: x"}"#,
            400,
            Some("guided_grammar"),
        ),
        case("unknown field", text, &key, br#"{"prompt": "x", "frobnicate": 1}"#, 400, Some("frobnicate")),
        case("embeddings on a generator", "/v1/embeddings", &key, br#"{"input": "x"}"#, 400, Some("model")),
        case(
            "top_logprobs without logprobs",
            chat,
            &key,
            br#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
            400,
            Some("top_logprobs"),
        ),
        case("logprobs over 20", text, &key, br#"{"prompt": "x", "logprobs": 21}"#, 400, Some("logprobs")),
        case("token id outside the vocabulary", text, &key, br#"{"prompt": [1, 49152]}"#, 400, Some("prompt")),
        case("negative token id", text, &key, br#"{"prompt": [[1, -2]]}"#, 400, Some("prompt")),
        case("two prompts", text, &key, br#"{"prompt": [[1, 2], [3]]}"#, 400, Some("prompt")),
        case("body over the limit", text, &key, too_big.as_bytes(), 413, None),
    ];
    for c in cases {
        let headers: Vec<(&str, &str)> = c.headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (st, b) = http(a, "POST", c.path, &headers, &c.body);
        let what = c.what;
        let v: Value =
            serde_json::from_slice(&b).unwrap_or_else(|_| panic!("{what}: not JSON: {}", String::from_utf8_lossy(&b)));
        assert_eq!(st, c.status, "{what}: {v}");
        let e = &v["error"];
        let shaped =
            e["message"].is_string() && e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some();
        assert!(shaped, "{what}: not OpenAI's error shape: {v}");
        if let Some(p) = c.param {
            assert_eq!(e["param"], p, "{what}: {v}");
        }
    }
    let (st, _) = http(a, "GET", "/nowhere", &[("Authorization", &auth)], b"");
    assert_eq!(st, 404);
    // Still serving, and /health and /metrics need no key.
    let (st, v) = post(a, "/v1/chat/completions", &ok_chat);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant", "{v}");
    assert_eq!(http(a, "GET", "/health", &[], b"").0, 200);
    let (st, m) = http(a, "GET", "/metrics", &[], b"");
    assert_eq!(st, 200);
    let m = String::from_utf8(m).unwrap();
    assert!(m.contains("spinfer_requests_total{endpoint=\"/v1/completions\",status=\"400\"}"), "{m}");
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 =
        status.lines().find(|l| l.starts_with("VmRSS:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

/// 32 clients × 4 requests of mixed lengths, streamed and not, one in 8
/// clients cancelling a stream after its first pieces: every completed
/// answer equals the one its request gets alone (batching changes no
/// output), none is lost, every slot is free afterwards and memory is back
/// within 10% of its level at rest.
#[test]
fn concurrent_requests_batch_without_changing_answers() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let served = Served::start(&model, &format!("api_keys = [\"{KEY}\"]\nslots = 8\nqueue = 256"), "ctx = 512");
    let addr = served.addr.clone();
    let prompts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):",
        "The three primary colours are",
        "In 1969, the first humans",
        "A recipe for pancakes: first,",
        "The mitochondria is",
        "Rust is a programming language that",
    ];
    let lens = [6, 24, 48];
    let alone: Vec<Vec<String>> =
        prompts.iter().map(|p| lens.iter().map(|&n| complete(&addr, p, n, false)).collect()).collect();
    // At rest after a first burst, which sizes the step's buffers (they
    // are kept for the next steps; a leak grows with every burst).
    let burst: Vec<_> = (0..16)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || complete(&addr, prompts[i % prompts.len()], lens[i % lens.len()], true))
        })
        .collect();
    burst.into_iter().for_each(|t| drop(t.join().unwrap()));
    let idle = rss_bytes(served.pid());

    let threads: Vec<_> = (0..32)
        .map(|i| {
            let (addr, alone) = (addr.clone(), alone.clone());
            std::thread::spawn(move || {
                let mut done = 0;
                for k in 0..4 {
                    let (p, l) = ((i + k) % prompts.len(), (i * 7 + k) % lens.len());
                    let stream = (i + k) % 2 == 0;
                    if i % 8 == 3 && k == 1 {
                        cancel_mid_stream(&addr, prompts[p]);
                        continue;
                    }
                    let got = complete(&addr, prompts[p], lens[l], stream);
                    assert_eq!(
                        got, alone[p][l],
                        "client {i} request {k} ({:?}, {} tokens, stream {stream})",
                        prompts[p], lens[l]
                    );
                    done += 1;
                }
                done
            })
        })
        .collect();
    let completed: usize = threads.into_iter().map(|t| t.join().expect("a client failed")).sum();
    assert_eq!(completed, 32 * 4 - 4);

    // Cancelled requests leave at the next step: wait for the slots.
    let t = Instant::now();
    while metric(&addr, "spinfer_active_slots") != 0.0 && t.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(metric(&addr, "spinfer_active_slots"), 0.0, "a slot leaked");
    assert_eq!(metric(&addr, "spinfer_queue_depth"), 0.0);
    assert!(metric(&addr, "spinfer_cancelled_requests_total") >= 1.0, "no cancellation was seen");
    let after = rss_bytes(served.pid());
    eprintln!("RSS idle {} MB, after the load {} MB", idle / 1_000_000, after / 1_000_000);
    assert!(after as f64 <= idle as f64 * 1.10, "RSS {after} after the load, {idle} idle before it");
}

/// Opens a long stream, reads its first pieces and hangs up.
fn cancel_mid_stream(addr: &str, prompt: &str) {
    let body = json!({"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": true}).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut pieces = 0;
    let mut line = String::new();
    while pieces < 3 && r.read_line(&mut line).unwrap() > 0 {
        pieces += usize::from(line.starts_with("data: "));
        line.clear();
    }
    assert_eq!(pieces, 3, "the stream ended early");
}

/// SIGTERM with a stream in flight: the stream still ends with `[DONE]`,
/// new requests are refused meanwhile, and the process exits 0.
#[test]
fn sigterm_drains_the_requests_in_flight() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let mut served = Served::start(&model, &format!("api_keys = [\"{KEY}\"]\nslots = 2"), "ctx = 512");
    let addr = served.addr.clone();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 120, "temperature": 0, "stream": true}).to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "the stream ended before its first piece");
    }
    // The first piece arrived: stop the server while the rest is coming.
    let pid = served.pid().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    std::thread::sleep(Duration::from_millis(300));
    let refused = TcpStream::connect(&addr).map(|_| {
        let (st, _) = http(&addr, "GET", "/health", &[], b"");
        st
    });
    assert!(refused.as_ref().map_or(true, |&st| st == 503), "while draining, /health answered {refused:?}");
    let mut rest = String::new();
    r.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("data: [DONE]"), "the stream in flight was cut: {rest}");
    let status = served.terminate_wait(Duration::from_secs(30));
    assert!(status.success(), "exit status {status:?}");
}

/// vLLM's rendering fields: `continue_final_message` continues the
/// assistant's last message (the prompt ends with its text), as `spinfer
/// generate` continues that prompt; `chat_template_kwargs` may not set
/// the server's own variables.
#[test]
fn continue_final_message_continues_the_assistants_text() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let (template, _) = chat_template(&model);
    let chat = [
        spinfer_server::chat::Message { role: "user".into(), content: "What is the capital of France?".into() },
        spinfer_server::chat::Message { role: "assistant".into(), content: "The capital of France is".into() },
    ];
    let options = spinfer_server::chat::RenderOptions { continue_final_message: true, ..Default::default() };
    let prompt = template.render_with(&chat, &options).unwrap();
    assert!(prompt.ends_with("<|im_start|>assistant\nThe capital of France is"), "{prompt}");
    let want = cli_generate(&model, &prompt, 12)["text"].clone();

    let served = Served::start(&model, "slots = 1", "ctx = 1024");
    let body = json!({"messages": chat.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
                      "continue_final_message": true, "add_generation_prompt": false, "max_tokens": 12,
                      "temperature": 0, "chat_template_kwargs": {"enable_thinking": false}});
    let (st, v) = post(&served.addr, "/v1/chat/completions", &body);
    assert_eq!((st, &v["choices"][0]["message"]["content"]), (200, &want), "{v}");
    let mut bad = body.clone();
    bad["chat_template_kwargs"] = json!({"bos_token": "x"});
    let (st, v) = post(&served.addr, "/v1/chat/completions", &bad);
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("chat_template_kwargs")), "{v}");
    let mut bad = body;
    bad["messages"] = json!([{"role": "user", "content": "Hi"}]);
    let (st, v) = post(&served.addr, "/v1/chat/completions", &bad);
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("continue_final_message")), "{v}");
}
