//! SmolLM2-135M-Instruct Q4_1 against PyTorch f32 on the dequantised
//! weights (tests/data/reference): last-position logits, top-5, greedy
//! continuations and WikiText-2 perplexity, in precise and fast mode.

use std::ops::ControlFlow;

use spinfer_engine::Engine;
use spinfer_engine::generate::{GenerateParams, generate};
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::sampling::SamplerParams;
use spinfer_tests::{RefPrompt, reference, smollm2, top_k};

fn engine(precision: Precision, ctx: usize) -> Option<Engine> {
    let path = smollm2()?;
    Some(Engine::load(path, ModelOptions { precision, ctx, threads: 2, sparsity: None }).expect("model loads"))
}

fn last_logits(e: &Engine, p: &RefPrompt) -> Vec<f32> {
    let ids = e.tokenizer.encode(&p.text, false).unwrap();
    assert_eq!(ids, p.input_ids, "token ids of {:?}", p.text);
    let mut s = e.new_session();
    e.model.forward_last(&mut s, &ids).unwrap().to_vec()
}

fn greedy(e: &Engine, p: &RefPrompt) -> (Vec<u32>, String) {
    let params = GenerateParams {
        max_tokens: p.greedy_ids.len(),
        sampler: SamplerParams::greedy(),
        stop: vec![],
        add_bos: Some(false),
    };
    let mut s = e.new_session();
    let mut streamed = String::new();
    let g = generate(&e.model, &e.tokenizer, &mut s, &p.text, &params, &mut |t| {
        streamed.push_str(t);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(streamed, g.text, "streamed text equals the final text");
    (g.tokens, g.text)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn precise_mode_matches_pytorch() {
    let Some(e) = engine(Precision::Precise, 512) else { return };
    for p in reference().prompts {
        let got = last_logits(&e, &p);
        let want = p.last_logits();
        let d = max_abs_diff(&got, &want);
        assert!(d <= 0.01, "{:?}: max |Δlogit| {d} > 0.01", p.text);
        // Top-5 in the same order; neighbours closer than 0.01 may swap.
        let (g5, w5) = (top_k(&got, 5), top_k(&want, 5));
        for i in 0..5 {
            if g5[i] != w5[i] {
                let gap = (want[w5[i] as usize] - want[g5[i] as usize]).abs();
                assert!(gap < 0.01, "{:?}: top-5 {g5:?} vs {w5:?}", p.text);
            }
        }
        let (ids, text) = greedy(&e, &p);
        assert_eq!(ids, p.greedy_ids, "{:?}: greedy ids (got {text:?}, want {:?})", p.text, p.greedy_text);
        assert_eq!(text, p.greedy_text);
        eprintln!("precise {:?}: max |Δ| {d:.5}", p.text);
    }
}

/// A quantised-activation mode against the reference: max logit error
/// `tol`, same top-1 (and top-5 set if asked), at least `min_identical`
/// greedy continuations identical.
fn check_quantised_mode(precision: Precision, tol: f32, top5_set: bool, min_identical: usize) {
    let Some(e) = engine(precision, 512) else { return };
    let mut identical = 0;
    let prompts = reference().prompts;
    for p in &prompts {
        let got = last_logits(&e, p);
        let want = p.last_logits();
        let d = max_abs_diff(&got, &want);
        eprintln!("{precision:?} {:?}: max |Δ| {d:.4}", p.text);
        assert!(d <= tol, "{:?}: max |Δlogit| {d} > {tol}", p.text);
        let (mut g5, mut w5) = (top_k(&got, 5), top_k(&want, 5));
        assert_eq!(g5[0], w5[0], "{:?}: top-1", p.text);
        g5.sort();
        w5.sort();
        if top5_set {
            assert_eq!(g5, w5, "{:?}: top-5 set", p.text);
        }
        let (ids, text) = greedy(&e, p);
        if ids == p.greedy_ids {
            identical += 1;
        } else {
            eprintln!("{precision:?} {:?}: continuation differs: {text:?} vs {:?}", p.text, p.greedy_text);
        }
    }
    assert!(identical >= min_identical, "only {identical} of {} greedy continuations identical", prompts.len());
}

/// The default fast mode (integer kernels on two 8-bit activation planes):
/// max |Δlogit| <= 0.3, the same top-5 set, at least 5 of 6 greedy
/// continuations identical. Measured: max |Δ| 0.02-0.07, 6 of 6.
#[test]
fn fast_mode_matches_pytorch() {
    check_quantised_mode(Precision::Fast, 0.3, true, 5);
}

/// Single-plane int8 activations (llama.cpp's numerics): the same top-1 on
/// every prompt and a max logit error of about 1.0, which this bound keeps
/// from regressing. 2 of 6 greedy continuations are identical (the others
/// diverge after 5-15 tokens); the near-tied 5th token of the first prompt
/// can swap.
#[test]
fn int8_mode_stays_within_its_bound() {
    check_quantised_mode(Precision::Int8, 1.2, false, 2);
}

#[test]
fn capital_of_france_is_paris_in_every_mode() {
    for precision in [Precision::Precise, Precision::Fast, Precision::Int8] {
        let Some(e) = engine(precision, 256) else { return };
        let params = GenerateParams { max_tokens: 1, sampler: SamplerParams::greedy(), stop: vec![], add_bos: None };
        let mut s = e.new_session();
        let g = generate(&e.model, &e.tokenizer, &mut s, "The capital of France is", &params, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(g.text, " Paris", "{precision:?}");
    }
}
