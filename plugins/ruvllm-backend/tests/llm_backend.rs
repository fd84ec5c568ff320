//! spinfer behind RuvLLM: every check goes through `ruvllm::LlmBackend`
//! (a `Box<dyn LlmBackend>`) and RuvLLM's own types, as RuvLLM would
//! drive it.
//!
//! The model is SmolLM2-135M-Instruct (Q4_1 GGUF): `$SPINFER_MODEL` or
//! `models/SmolLM2-135M-Instruct.Q4_1.gguf`. When it is missing the model
//! tests skip (saying so), except in CI (`CI` set) where they fail.

use std::sync::Mutex;
use std::time::Instant;

use ruvllm::{
    FinishReason, GenerateParams, LlmBackend, ModelArchitecture, ModelConfig, Quantization, RuvLLMError, StreamEvent,
};
use spinfer_ruvllm::{Sparsity, SpinferBackend, SpinferOptions};

const PROMPT: &str = "The capital of France is";

/// Model tests run one at a time: each request uses every core.
static MODEL: Mutex<()> = Mutex::new(());

use spinfer_test_support::smollm2;

fn backend() -> Box<dyn LlmBackend> {
    Box::new(SpinferBackend::new())
}

fn config() -> ModelConfig {
    ModelConfig { max_sequence_length: 512, ..ModelConfig::default() }
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams::default().with_temperature(0.0).with_repetition_penalty(1.0).with_max_tokens(max_tokens)
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[test]
fn smollm2_generates_streams_and_embeds() {
    let Some(model) = smollm2() else { return };
    let _one = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let mut b = backend();
    assert!(!b.is_model_loaded());
    assert!(b.model_info().is_none() && b.tokenizer().is_none());

    let t = Instant::now();
    b.load_model(model.to_str().unwrap(), config()).expect("load SmolLM2");
    eprintln!("load_model: {:?}", t.elapsed());
    assert!(b.is_model_loaded());

    // generate: greedy continuation.
    let t = Instant::now();
    let text = b.generate(PROMPT, greedy(16)).expect("generate");
    eprintln!("generate (16 tokens): {:?} -> {text:?}", t.elapsed());
    assert!(text.starts_with(" Paris"), "{text:?}");

    // generate_stream_v2: the same text, in pieces, then Done.
    let mut streamed = String::new();
    let mut pieces = 0;
    let mut done = None;
    for event in b.generate_stream_v2(PROMPT, greedy(16)).expect("stream") {
        match event.expect("stream event") {
            StreamEvent::Token(t) => {
                assert!(done.is_none(), "token after Done");
                streamed.push_str(&t.text);
                pieces += 1;
            }
            StreamEvent::Done { total_tokens, .. } => done = Some(total_tokens),
            StreamEvent::Error(e) => panic!("stream error: {e}"),
        }
    }
    assert_eq!(streamed, text);
    assert!(pieces > 1, "streamed in {pieces} piece(s)");
    assert!(matches!(done, Some(n) if n >= pieces), "Done: {done:?}, {pieces} pieces");

    // generate_stream (legacy iterator): the same text.
    let legacy: String =
        b.generate_stream(PROMPT, greedy(16)).expect("legacy stream").map(|t| t.expect("token").text).collect();
    assert_eq!(legacy, text);

    // generate_detailed: the same text, exact counts, the finish reason.
    let mut deltas = String::new();
    let out = b
        .generate_detailed(PROMPT, greedy(16), &mut |t| {
            deltas.push_str(&t.text);
            true
        })
        .expect("generate_detailed");
    assert_eq!((out.text.as_str(), deltas.as_str()), (text.as_str(), text.as_str()));
    let prompt_tokens = b.tokenizer().unwrap().encode(PROMPT).unwrap().len();
    assert_eq!(out.prompt_tokens, prompt_tokens);
    match out.finish_reason {
        FinishReason::Length => assert_eq!(out.completion_tokens, 16),
        FinishReason::EndOfSequence => assert!(out.completion_tokens <= 16),
        other => panic!("finish reason {other:?}"),
    }
    // A callback returning false cancels.
    let out = b.generate_detailed(PROMPT, greedy(16), &mut |_| false).expect("cancelled generation");
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(out.completion_tokens < 16);
    // A stop sequence ends the text before it.
    let stopped = b.generate(PROMPT, greedy(16).with_stop_sequence(" Paris")).expect("stop");
    assert_eq!(stopped, "");

    // get_embeddings: hidden_size floats, unit length, similar texts closer.
    let t = Instant::now();
    let cat = b.get_embeddings("The cat sat on the mat.").expect("embeddings");
    eprintln!("get_embeddings: {:?}", t.elapsed());
    assert_eq!(cat.len(), 576);
    assert!((cosine(&cat, &cat) - 1.0).abs() < 1e-4);
    let kitten = b.get_embeddings("A kitten was sitting on the rug.").unwrap();
    let finance = b.get_embeddings("Quarterly revenue rose by eight percent.").unwrap();
    let (near, far) = (cosine(&cat, &kitten), cosine(&cat, &finance));
    eprintln!("cosine: cat/kitten {near:.4}, cat/finance {far:.4}");
    assert!(near > far, "cat/kitten {near} <= cat/finance {far}");
    assert_eq!(b.get_embeddings("The cat sat on the mat.").unwrap(), cat, "embeddings are deterministic");

    // model_info and the tokenizer.
    let info = b.model_info().expect("model_info");
    assert_eq!(info.architecture, ModelArchitecture::Llama);
    assert_eq!((info.hidden_size, info.num_layers, info.vocab_size), (576, 30, 49152));
    assert_eq!(info.max_context_length, 512);
    assert!((130_000_000..140_000_000).contains(&info.num_parameters), "{}", info.num_parameters);
    assert_eq!(info.quantization, Some(Quantization::Q4));
    assert!(info.memory_usage > 50_000_000, "{}", info.memory_usage);
    let tok = b.tokenizer().expect("tokenizer");
    assert_eq!(tok.vocab_size(), 49152);
    let ids = tok.encode(PROMPT).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), PROMPT);
    assert!(tok.special_tokens().eos_token_id.is_some());
    assert_eq!(b.chat_template(), Some(ruvllm::ChatTemplate::ChatML));

    // unload_model: back to the unloaded state.
    b.unload_model();
    assert!(!b.is_model_loaded());
    assert!(b.model_info().is_none() && b.tokenizer().is_none());
    let err = b.generate(PROMPT, greedy(4)).expect_err("generate after unload");
    assert!(matches!(&err, RuvLLMError::InvalidOperation(m) if m.contains("No model loaded")), "{err}");
}

#[test]
fn sampling_is_seeded() {
    let Some(model) = smollm2() else { return };
    let _one = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let mut b = backend();
    b.load_model(model.to_str().unwrap(), config()).unwrap();
    let p = GenerateParams::default().with_max_tokens(12).with_temperature(0.9).with_seed(42);
    let a = b.generate("Once upon a time", p.clone()).unwrap();
    assert_eq!(b.generate("Once upon a time", p).unwrap(), a);
    // RuvLLM's default parameters are accepted as they are.
    b.generate(PROMPT, GenerateParams::default().with_max_tokens(4)).unwrap();
    // OpenAI's penalties are honoured: a strong presence penalty makes the
    // greedy text repeat fewer of its tokens.
    let tokens =
        |p: GenerateParams| b.tokenizer().unwrap().encode(&b.generate("One, two, one, two,", p).unwrap()).unwrap();
    let distinct = |t: &[u32]| t.iter().collect::<std::collections::HashSet<_>>().len();
    let plain = tokens(greedy(24));
    let penalised = tokens(GenerateParams { presence_penalty: 2.0, frequency_penalty: 1.0, ..greedy(24) });
    assert!(distinct(&penalised) > distinct(&plain), "{plain:?} vs {penalised:?}");
    let invalid = greedy(4).with_temperature(-1.0);
    assert!(matches!(b.generate(PROMPT, invalid), Err(RuvLLMError::Config(_))));
}

#[test]
fn prompt_longer_than_the_context_is_an_error() {
    let Some(model) = smollm2() else { return };
    let _one = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let mut b = backend();
    b.load_model(model.to_str().unwrap(), ModelConfig { max_sequence_length: 8, ..ModelConfig::default() }).unwrap();
    let long = "one two three four five six seven eight nine ten eleven twelve";
    let err = b.generate(long, greedy(4)).expect_err("context overflow");
    assert!(err.to_string().contains("context holds 8"), "{err}");
    // Embeddings cut a long text to the context instead.
    assert_eq!(b.get_embeddings(long).expect("embedding of a cut text").len(), 576);
    // The backend stays usable.
    assert!(b.generate("Hi", greedy(2)).is_ok());
}

#[test]
fn config_hints_must_match_the_file() {
    let Some(model) = smollm2() else { return };
    let _one = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let mut b = backend();
    let wrong = ModelConfig { hidden_size: Some(4096), ..config() };
    let err = b.load_model(model.to_str().unwrap(), wrong).expect_err("hidden_size mismatch");
    assert!(err.to_string().contains("hidden_size is 4096 but the model's is 576"), "{err}");
    assert!(!b.is_model_loaded());
    let right = ModelConfig { hidden_size: Some(576), num_layers: Some(30), ..config() };
    b.load_model(model.to_str().unwrap(), right).unwrap();
    assert!(b.is_model_loaded());
    // A failed load keeps the model that was loaded.
    assert!(b.load_model("/nonexistent/other.gguf", config()).is_err());
    assert!(b.is_model_loaded());
}

#[test]
fn unloaded_backend_refuses_requests() {
    let mut b = backend();
    assert!(!b.is_model_loaded());
    let not_loaded = |r: Result<(), RuvLLMError>| match r {
        Err(RuvLLMError::InvalidOperation(m)) => assert!(m.contains("No model loaded"), "{m}"),
        other => panic!("expected the not-loaded error, got {other:?}"),
    };
    not_loaded(b.generate(PROMPT, greedy(4)).map(drop));
    not_loaded(b.generate_stream(PROMPT, greedy(4)).map(drop));
    not_loaded(b.generate_stream_v2(PROMPT, greedy(4)).map(drop));
    not_loaded(b.generate_detailed(PROMPT, greedy(4), &mut |_| true).map(drop));
    not_loaded(b.get_embeddings(PROMPT).map(drop));
    assert!(b.tokenizer().is_none() && b.model_info().is_none() && b.chat_template().is_none());
    b.unload_model(); // harmless
    assert!(!b.is_model_loaded());
}

#[test]
fn missing_model_is_an_error_naming_it() {
    let mut b = backend();
    let missing = "/nonexistent/dir/SmolLM2-missing.gguf";
    let err = b.load_model(missing, ModelConfig::default()).expect_err("missing model");
    assert!(matches!(err, RuvLLMError::NotFound(_)), "{err:?}");
    assert!(err.to_string().contains(missing), "{err}");
    assert!(!b.is_model_loaded());
}

#[test]
fn invalid_model_file_is_an_error_naming_it() {
    let dir = std::env::temp_dir().join(format!("spinfer-ruvllm-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("garbage.gguf");
    std::fs::write(&bad, b"not a gguf file at all").unwrap();
    let mut b = backend();
    let err = b.load_model(bad.to_str().unwrap(), ModelConfig::default()).expect_err("garbage model");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(err.to_string().contains("garbage.gguf"), "{err}");
    assert!(!b.is_model_loaded());
}

#[test]
fn sparsity_sidecar_beside_the_model_is_used() {
    let Some(model) = smollm2() else { return };
    let _one = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    // The model linked into a directory with a (broken) `<model>.spinfer`
    // beside it: `Sparsity::Auto` must pick that sidecar up, and a sidecar
    // that does not fit fails the load naming it.
    let dir = std::env::temp_dir().join(format!("spinfer-ruvllm-sidecar-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let linked = dir.join("smollm2.gguf");
    let _ = std::fs::remove_file(&linked);
    std::os::unix::fs::symlink(std::fs::canonicalize(&model).unwrap(), &linked).unwrap();
    std::fs::write(dir.join("smollm2.spinfer"), b"not a sidecar").unwrap();
    let mut b = backend();
    let err = b.load_model(linked.to_str().unwrap(), config()).expect_err("broken sidecar");
    assert!(matches!(&err, RuvLLMError::Config(m) if m.contains("smollm2.spinfer")), "{err:?}");
    // Dense ignores it.
    let mut dense: Box<dyn LlmBackend> = Box::new(SpinferBackend::with_options(SpinferOptions {
        sparsity: Sparsity::Dense,
        ..SpinferOptions::default()
    }));
    dense.load_model(linked.to_str().unwrap(), config()).expect("dense load");
    assert!(dense.generate(PROMPT, greedy(3)).unwrap().starts_with(" Paris"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `SpinferOptions::draft`: speculative decoding from the context's
/// n-grams for every generation changes no text (greedy and seeded), and
/// on a prompt the answer repeats, drafts are accepted.
#[test]
fn drafts_change_no_text() {
    let Some(model) = smollm2() else { return };
    let _one = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let draft = spinfer_engine::generate::DraftParams { max_tokens: 4, ..Default::default() };
    let mut drafted = SpinferBackend::with_options(SpinferOptions { draft: Some(draft), ..Default::default() });
    let mut plain = backend();
    drafted.load_model(model.to_str().unwrap(), config()).unwrap();
    plain.load_model(model.to_str().unwrap(), config()).unwrap();
    let prompt = "<|im_start|>user\nFix the spelling mistakes in this text and write it out again in full:\n\nThe \
                  printing press was invented by Johannes Gutenberg around 1440. It used movable metal type, oil-based \
                  inks and a wooden press.<|im_end|>\n<|im_start|>assistant\n";
    for p in [greedy(40), GenerateParams::default().with_max_tokens(40).with_temperature(0.8).with_seed(9)] {
        assert_eq!(drafted.generate(prompt, p.clone()).unwrap(), plain.generate(prompt, p).unwrap());
    }
    let m = drafted.engine().unwrap().metrics();
    assert!(m.draft_accepted_tokens > 10 && m.draft_accepted_tokens <= m.draft_tokens, "{m:?}");
    // Out of bounds: refused at load, naming the option.
    let bad = spinfer_engine::generate::DraftParams { max_tokens: 99, ..Default::default() };
    let mut b = SpinferBackend::with_options(SpinferOptions { draft: Some(bad), ..Default::default() });
    let e = b.load_model(model.to_str().unwrap(), config()).unwrap_err().to_string();
    assert!(e.contains("SpinferOptions::draft"), "{e}");
}
