//! The library API of `Engine` and the `EmbeddingProvider` trait:
//! concurrency (one shared engine, results equal to single-threaded runs),
//! streaming cancellation, embeddings through `&dyn EmbeddingProvider`,
//! bad input and metrics. Run in release
//! (`cargo test --release -p spinfer-tests --test facade`).

use std::ops::ControlFlow;
use std::sync::{Arc, Barrier, OnceLock};

use spinfer_engine::embed::{Embedder, EmbedderOptions};
use spinfer_engine::generate::{GenerateParams, StopReason};
use spinfer_engine::model::ModelOptions;
use spinfer_engine::provider::EmbeddingProvider;
use spinfer_engine::sampling::SamplerParams;
use spinfer_engine::{Engine, Error};
use spinfer_tests::{minilm, smollm2};

/// One SmolLM2 engine shared by the tests of this binary (`None`: skip).
fn engine() -> Option<Arc<Engine>> {
    static E: OnceLock<Option<Arc<Engine>>> = OnceLock::new();
    E.get_or_init(|| {
        smollm2().map(|p| {
            let options = ModelOptions { ctx: 256, threads: 2, ..ModelOptions::default() };
            Arc::new(Engine::load(p, options).expect("smollm2 loads"))
        })
    })
    .clone()
}

fn embedder() -> Option<Arc<Embedder>> {
    static E: OnceLock<Option<Arc<Embedder>>> = OnceLock::new();
    E.get_or_init(|| {
        minilm().map(|dir| {
            let options = EmbedderOptions { threads: 2, ..EmbedderOptions::default() };
            Arc::new(Embedder::load(&dir, options).expect("minilm loads"))
        })
    })
    .clone()
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams { max_tokens, sampler: SamplerParams::greedy(), ..GenerateParams::default() }
}

fn norm(v: &[f32]) -> f32 {
    v.iter().map(|x| x * x).sum::<f32>().sqrt()
}

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
];

const TEXTS: [&str; 4] = [
    "A man is playing a guitar.",
    "The stock market fell sharply on Monday.",
    "Rust guarantees memory safety without a garbage collector.",
    "Two dogs are running through a field of grass.",
];

#[test]
fn one_engine_serves_eight_threads_with_single_threaded_results() {
    let Some(e) = engine() else { return };
    let params = greedy(16);
    let want_gen: Vec<_> = PROMPTS.iter().map(|p| e.generate(p, &params).unwrap()).collect();
    let want_emb: Vec<_> = TEXTS.iter().map(|t| e.embed(t).unwrap()).collect();
    for g in &want_gen {
        assert!(!g.tokens.is_empty());
    }

    let barrier = Arc::new(Barrier::new(8));
    let gens: Vec<_> = PROMPTS
        .iter()
        .map(|&p| {
            let (e, b, params) = (Arc::clone(&e), Arc::clone(&barrier), params.clone());
            std::thread::spawn(move || {
                b.wait();
                e.generate(p, &params).unwrap()
            })
        })
        .collect();
    let embs: Vec<_> = TEXTS
        .iter()
        .map(|&t| {
            let (e, b) = (Arc::clone(&e), Arc::clone(&barrier));
            std::thread::spawn(move || {
                b.wait();
                // Both entry points: one text, and the text inside a batch.
                let one = e.embed(t).unwrap();
                let batch = e.embed_batch(&["warm-up text", t]).unwrap();
                (one, batch.into_iter().nth(1).unwrap())
            })
        })
        .collect();
    for (h, want) in gens.into_iter().zip(&want_gen) {
        let got = h.join().unwrap();
        assert_eq!((&got.text, &got.tokens, got.stop_reason), (&want.text, &want.tokens, want.stop_reason));
    }
    for (h, want) in embs.into_iter().zip(&want_emb) {
        let (one, in_batch) = h.join().unwrap();
        assert_eq!(&one, want, "concurrent embed differs from the single-threaded one");
        assert_eq!(&in_batch, want, "embed_batch row differs from embed");
    }
    eprintln!("e.g. {:?} -> {:?}", PROMPTS[0], want_gen[0].text);
}

#[test]
fn one_embedder_serves_threads_with_single_threaded_results() {
    let Some(e) = embedder() else { return };
    let sets: Vec<Vec<&'static str>> =
        (0..4).map(|i| TEXTS.iter().copied().cycle().skip(i).take(3 + i).collect()).collect();
    let want: Vec<_> = sets.iter().map(|s| e.embed_batch(s).unwrap()).collect();
    let barrier = Arc::new(Barrier::new(sets.len()));
    let handles: Vec<_> = sets
        .iter()
        .cloned()
        .map(|s| {
            let (e, b) = (Arc::clone(&e), Arc::clone(&barrier));
            std::thread::spawn(move || {
                b.wait();
                e.embed_batch(&s).unwrap()
            })
        })
        .collect();
    for (h, w) in handles.into_iter().zip(&want) {
        assert_eq!(&h.join().unwrap(), w);
    }
}

#[test]
fn breaking_the_stream_after_three_pieces_cancels() {
    let Some(e) = engine() else { return };
    let before = e.metrics().cancelled;
    let mut pieces = Vec::new();
    let out = e
        .generate_stream("Here is a long story about a dragon:", &greedy(64), |p| {
            pieces.push(p.to_string());
            if pieces.len() == 3 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
        })
        .unwrap();
    assert_eq!(out.stop_reason, StopReason::Cancelled);
    assert_eq!(pieces.len(), 3);
    assert!(out.tokens.len() <= 4, "{} tokens after cancelling at the third piece", out.tokens.len());
    assert_eq!(out.text, pieces.concat());
    assert_eq!(e.metrics().cancelled, before + 1);
}

#[test]
fn the_stream_iterator_yields_the_generation_and_cancels_when_dropped() {
    let Some(e) = engine() else { return };
    let params = greedy(24);
    let want = e.generate("The capital of France is", &params).unwrap();

    // Run to the end: the pieces make up the text, and the output is there.
    let mut stream = e.stream("The capital of France is", &params);
    let pieces: Vec<String> = stream.by_ref().map(|p| p.unwrap()).collect();
    assert_eq!(pieces.concat(), want.text);
    let out = stream.output().expect("output after the last piece");
    assert_eq!((&out.tokens, out.stop_reason), (&want.tokens, want.stop_reason));

    // Take three pieces and drop: the generation is cancelled (the drop
    // waits for the generating thread, so the counter is already updated).
    let before = e.metrics().cancelled;
    let three: Vec<String> =
        e.stream("Here is a long story about a dragon:", &greedy(200)).take(3).map(|p| p.unwrap()).collect();
    assert_eq!(three.len(), 3);
    assert_eq!(e.metrics().cancelled, before + 1);

    // An error is the last item.
    let mut bad = e.stream("", &params);
    assert!(matches!(bad.next(), Some(Err(Error::InvalidArgument(_)))));
    assert!(bad.next().is_none());
}

#[test]
fn both_engines_are_embedding_providers() {
    let Some(llm) = engine() else { return };
    let Some(minilm) = embedder() else { return };
    let providers: [(&dyn EmbeddingProvider, usize); 2] = [(&*llm, 576), (&*minilm, 384)];
    for (p, dims) in providers {
        assert_eq!(p.dimensions(), dims);
        let batch = p.embed_batch(&TEXTS).unwrap();
        assert_eq!(batch.len(), TEXTS.len());
        for (t, row) in TEXTS.iter().zip(&batch) {
            assert_eq!(row.len(), dims);
            assert!((norm(row) - 1.0).abs() < 1e-5, "norm {} for {t:?}", norm(row));
            let one = p.embed(t).unwrap();
            let d = one.iter().zip(row).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(d <= 1e-5, "{dims}-d: embed and embed_batch differ by {d} for {t:?}");
        }
        assert!(p.embed_batch(&[]).unwrap().is_empty());
    }
    // The decoder's vectors carry meaning: a paraphrase is nearer than an
    // unrelated sentence.
    let v = llm.embed_batch(&["A man plays the guitar.", TEXTS[0], TEXTS[1]]).unwrap();
    let cos = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
    assert!(
        cos(&v[0], &v[1]) > cos(&v[0], &v[2]),
        "paraphrase {} vs unrelated {}",
        cos(&v[0], &v[1]),
        cos(&v[0], &v[2])
    );
    // As a shared trait object.
    let shared: Arc<dyn EmbeddingProvider> = minilm;
    assert_eq!(shared.embed("x").unwrap().len(), 384);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let Some(e) = engine() else { return };
    // SmolLM2 adds no BOS: the empty prompt has no tokens to condition on.
    assert!(e.tokenize("").unwrap().is_empty());
    let err = e.generate("", &greedy(4)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("empty"), "{err}");
    assert!(matches!(e.embed(""), Err(Error::InvalidArgument(_))));
    assert!(matches!(e.embed_batch(&["fine", ""]), Err(Error::InvalidArgument(_))));
    // An over-long text is cut to the context (256 tokens) and counted in
    // the metrics (no other test embeds one).
    let before = e.metrics().truncated_inputs;
    assert!(!e.embed(&"word ".repeat(600)).unwrap().is_empty());
    assert_eq!(e.metrics().truncated_inputs, before + 1);

    let vocab = e.model.config.vocab_size as u32;
    let err = e.logits(&[1, vocab]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)) && err.to_string().contains(&vocab.to_string()), "{err}");
    assert!(matches!(e.logits(&[u32::MAX]), Err(Error::InvalidArgument(_))));
    assert!(matches!(e.logits(&[]), Err(Error::InvalidArgument(_))));
    assert!(matches!(e.logits(&vec![1; 257]), Err(Error::ContextOverflow { .. })));
    assert!(e.detokenize(&[vocab + 5]).is_err());

    // Defined results: no tokens asked for, and a bad sampler parameter.
    let none = e.generate("Hello", &greedy(0)).unwrap();
    assert_eq!((none.text.as_str(), none.tokens.len(), none.stop_reason), ("", 0, StopReason::MaxTokens));
    let mut bad = greedy(4);
    bad.sampler.top_p = 0.0;
    assert!(matches!(e.generate("Hello", &bad), Err(Error::InvalidArgument(_))));
}

#[test]
fn logits_tokenize_and_metrics_agree_with_generation() {
    let Some(e) = engine() else { return };
    let prompt = "The capital of France is";
    let ids = e.tokenize(prompt).unwrap();
    assert_eq!(e.detokenize(&ids).unwrap(), prompt);
    let logits = e.logits(&ids).unwrap();
    assert_eq!(logits.len(), e.model.config.vocab_size);
    let argmax = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap() as u32;

    let before = e.metrics();
    let out = e.generate(prompt, &greedy(8)).unwrap();
    assert_eq!(out.tokens[0], argmax, "the first greedy token is the logits' argmax");
    assert_eq!(e.detokenize(&out.tokens).unwrap(), out.text);
    assert_eq!((out.metrics.prompt_tokens, out.metrics.generated_tokens), (ids.len(), out.tokens.len()));
    assert!(out.metrics.total >= out.metrics.timings.prefill);
    assert!(out.metrics.sparse_kept_fraction.is_none());

    let after = e.metrics();
    assert!(after.generate_requests > before.generate_requests);
    assert!(after.generated_tokens >= before.generated_tokens + out.tokens.len() as u64);
    assert!(after.prompt_tokens >= before.prompt_tokens + ids.len() as u64);
    assert!(after.timings.prefill > before.timings.prefill);
    assert!(after.decode_tokens_per_second() > 0.0 && after.prefill_tokens_per_second() > 0.0);
    assert!(after.sparse_kept_fraction.is_none(), "the model runs dense");
    assert!(!after.kernels.is_empty());
    assert!(after.kernels.iter().all(|k| !k.kernel.is_empty() && k.op.starts_with("matmul")));
}

/// An output constraint through the library: every sampled text, at
/// several seeds and temperatures, is one of the choices, and the one
/// compiled source serves threads at once; a bad spec is `Error::Grammar`.
#[test]
fn a_constraint_holds_for_sampled_text_across_threads() {
    use spinfer_engine::grammar::Spec;
    let Some(e) = engine() else { return };
    let choices: Vec<String> = ["red", "green", "blue", "a colour I cannot name"].map(String::from).to_vec();
    let source = e.constraint(&Spec::Choice(choices.clone())).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (e, source, choices) = (e.clone(), source.clone(), &choices);
            s.spawn(move || {
                for seed in 0..4 {
                    let sampler = SamplerParams {
                        temperature: 1.5,
                        top_k: 0,
                        top_p: 1.0,
                        min_p: 0.0,
                        seed: t * 10 + seed,
                        ..SamplerParams::default()
                    };
                    let params =
                        GenerateParams { max_tokens: 16, sampler, constraint: Some(source.clone()), ..greedy(16) };
                    let out = e.generate("My favourite colour is", &params).unwrap();
                    assert!(choices.contains(&out.text), "{:?}", out.text);
                    assert_eq!(out.stop_reason, StopReason::EndOfGeneration, "{:?}", out.text);
                }
            });
        }
    });
    match e.constraint(&Spec::Lark("start: missing_rule".into())) {
        Err(Error::Grammar(g)) => assert!(!g.to_string().is_empty()),
        other => panic!("a bad grammar gave {other:?}"),
    }
}

/// `GenerateParams::stop_tokens` (vLLM's `stop_token_ids`) end the
/// generation before the first of them, even with `ignore_eos`; `min_tokens`
/// holds them off.
#[test]
fn stop_tokens_end_the_generation_and_min_tokens_holds_them_off() {
    let Some(e) = engine() else { return };
    let plain = e.generate(PROMPTS[1], &greedy(16)).unwrap();
    let t = &plain.tokens;
    let k = (1..t.len()).find(|&k| !t[..k].contains(&t[k])).expect("a token new at k");
    for ignore_eos in [false, true] {
        let p = GenerateParams { stop_tokens: vec![t[k]], ignore_eos, ..greedy(16) };
        let out = e.generate(PROMPTS[1], &p).unwrap();
        assert_eq!((&out.tokens[..], out.stop_reason), (&t[..k], StopReason::EndOfGeneration), "{ignore_eos}");
    }
    let p = GenerateParams { stop_tokens: vec![t[k]], min_tokens: k + 1, ..greedy(16) };
    let out = e.generate(PROMPTS[1], &p).unwrap();
    assert!(out.tokens.len() > k && !out.tokens[..=k].contains(&t[k]), "{:?} vs {t:?}", out.tokens);
}
