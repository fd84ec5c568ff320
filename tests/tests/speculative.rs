//! Speculative decoding from the context's n-grams (`DraftParams`): the
//! output is the same with drafts as without, for greedy, seeded sampling,
//! penalties, constraints, stop strings and token budgets, on SmolLM2 and
//! on Gemma 3 (whose local layers' rings are rolled back after a miss);
//! and on a text that repeats its prompt, drafts are made and accepted.

use std::path::Path;

use spinfer_engine::Engine;
use spinfer_engine::generate::{DraftParams, GenerateParams, Generation};
use spinfer_engine::grammar::Spec;
use spinfer_engine::model::ModelOptions;
use spinfer_engine::sampling::SamplerParams;
use spinfer_tests::{gemma3, smollm2};

/// A request to copy a paragraph back (most of the answer repeats the
/// prompt), in SmolLM2's chat format; Gemma 3 reads it as plain text.
const COPY: &str = "<|im_start|>user\nFix the spelling mistakes in this text and write it out again in full:\n\n\
    The printing press was invented by Johannes Gutenberg around 1440. It used movable metal type, oil-based \
    inks and a wooden press adapted from those used to make wine. The invention spread quickly across Europe, \
    and by 1500 printing presses in operation throughout Western Europe had already produced more than twenty \
    million volumes.<|im_end|>\n<|im_start|>assistant\n";

fn load(path: &Path) -> Engine {
    Engine::load(path, ModelOptions { ctx: 1024, threads: 2, ..ModelOptions::default() }).unwrap()
}

fn run(e: &Engine, prompt: &str, params: &GenerateParams, draft: usize) -> Generation {
    let params =
        GenerateParams { draft: DraftParams { max_tokens: draft, ..DraftParams::default() }, ..params.clone() };
    let mut session = e.model.new_session();
    spinfer_engine::generate::generate(&e.model, &e.tokenizer, &mut session, prompt, &params, &mut |_| {
        std::ops::ControlFlow::Continue(())
    })
    .unwrap()
}

/// `params` with drafts of 1, 3 and 8 tokens gives what it gives without;
/// returns the tokens accepted from drafts over the three.
fn same_with_drafts(e: &Engine, prompt: &str, params: &GenerateParams, what: &str) -> usize {
    let want = run(e, prompt, params, 0);
    assert_eq!(want.draft.drafts, 0);
    let mut accepted = 0;
    for draft in [1, 3, 8] {
        let got = run(e, prompt, params, draft);
        assert_eq!(got.tokens, want.tokens, "{what}, drafts of {draft}: tokens differ");
        assert_eq!((&got.text, got.stop_reason), (&want.text, want.stop_reason), "{what}, drafts of {draft}");
        assert!(got.draft.accepted <= got.draft.drafted, "{what}: {:?}", got.draft);
        eprintln!("{what}, drafts of {draft}: {:?} over {} tokens", got.draft, got.tokens.len());
        accepted += got.draft.accepted;
    }
    accepted
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams { max_tokens, sampler: SamplerParams::greedy(), ..GenerateParams::default() }
}

fn drafts_never_change_the_output(e: &Engine) {
    // Greedy: most of the answer comes from drafts.
    let accepted = same_with_drafts(e, COPY, &greedy(120), "greedy");
    assert!(accepted > 60, "a copied paragraph accepted only {accepted} drafted tokens over three runs");
    // Seeded sampling with penalties: each token is still drawn from its
    // own logits, with the same draws.
    let sampler = SamplerParams {
        temperature: 0.7,
        top_k: 40,
        top_p: 0.95,
        repeat_penalty: 1.1,
        frequency_penalty: 0.3,
        seed: 11,
        ..SamplerParams::default()
    };
    same_with_drafts(e, COPY, &GenerateParams { max_tokens: 100, sampler, ..GenerateParams::default() }, "sampled");
    // A stop string, and budgets that end inside a draft.
    let stop = GenerateParams { stop: vec!["Europe".into()], ..greedy(120) };
    same_with_drafts(e, COPY, &stop, "stop string");
    for n in [1, 2, 17, 33] {
        same_with_drafts(e, COPY, &greedy(n), &format!("{n} tokens"));
    }
    // An output constraint masks each row in turn.
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"]
    });
    let constraint = Some(e.constraint(&Spec::JsonSchema(schema)).unwrap());
    same_with_drafts(e, COPY, &GenerateParams { constraint, ..greedy(80) }, "JSON schema");
}

#[test]
fn smollm2_drafts_never_change_the_output() {
    let Some(path) = smollm2() else { return };
    drafts_never_change_the_output(&load(&path));
}

#[test]
fn gemma3_drafts_never_change_the_output() {
    let Some(path) = gemma3() else { return };
    drafts_never_change_the_output(&load(&path));
}

/// Draft settings out of bounds are an error naming them, before any
/// token is generated.
#[test]
fn draft_settings_out_of_bounds_are_an_error() {
    let Some(path) = smollm2() else { return };
    let e = load(&path);
    let params = GenerateParams { draft: DraftParams { max_tokens: 4, ngram_min: 0, ngram_max: 0 }, ..greedy(8) };
    let mut session = e.model.new_session();
    let err = spinfer_engine::generate::generate(&e.model, &e.tokenizer, &mut session, COPY, &params, &mut |_| {
        std::ops::ControlFlow::Continue(())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("ngram_min"), "{err}");
}

/// A context near its end: drafts stop at the last position, and the
/// generation ends as it does without them.
#[test]
fn drafts_stop_at_the_end_of_the_context() {
    let Some(path) = smollm2() else { return };
    let e = Engine::load(&path, ModelOptions { ctx: 160, threads: 2, ..ModelOptions::default() }).unwrap();
    let prompt_len = e.tokenize(COPY).unwrap().len();
    assert!(prompt_len < 150, "{prompt_len}");
    let want = run(&e, COPY, &greedy(400), 0);
    assert_eq!(want.stop_reason, spinfer_engine::generate::StopReason::ContextFull);
    same_with_drafts(&e, COPY, &greedy(400), "context end");
}

/// With a sparse FFN (input-magnitude, 30% of neurons skipped) and under a
/// memory budget that reads weights from storage every step, drafts still
/// change nothing: each row keeps its own neurons and reads.
#[test]
fn drafts_change_nothing_sparse_or_under_a_memory_budget() {
    use spinfer_engine::gguf::GgufFile;
    use spinfer_engine::sparse::calibrate::{CalibrateOptions, calibrate};
    use spinfer_engine::sparse::{CalibrationInfo, PredictorKind, SparsityOptions};
    let Some(path) = smollm2() else { return };
    let dense = load(&path);
    let text = std::fs::read(spinfer_tests::data("wikitext-2-raw/wiki.test.raw")).unwrap();
    let text = String::from_utf8_lossy(&text[800_000..]).replace("\r\n", "\n");
    let mut tokens = dense.tokenizer.encode(&text, false).unwrap();
    tokens.truncate(512);
    let opts = CalibrateOptions {
        target_sparsity: 0.3,
        predictor: PredictorKind::InputMagnitude,
        window: 256,
        info: CalibrationInfo::default(),
        rank: 0,
        recall_target: 0.95,
        attn_sparsity: 0.0,
    };
    let sidecar = calibrate(&dense.model, &GgufFile::open(&path).unwrap(), &tokens, &opts, &mut |_, _, _| {}).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("im30.spinfer");
    sidecar.write(&file).unwrap();
    let mut sparsity = SparsityOptions::new(&file);
    sparsity.predictor = Some(PredictorKind::InputMagnitude);
    let sparse = ModelOptions { ctx: 1024, threads: 2, sparsity: Some(sparsity), ..ModelOptions::default() };
    let e = Engine::load(&path, sparse).unwrap();
    assert!(same_with_drafts(&e, COPY, &greedy(60), "sparse FFN") > 20);
    let budget = ModelOptions { ctx: 256, threads: 2, mem_budget: Some(40 << 20), ..ModelOptions::default() };
    let e = Engine::load(&path, budget).unwrap();
    assert!(same_with_drafts(&e, COPY, &greedy(60), "memory budget") > 20);
}
