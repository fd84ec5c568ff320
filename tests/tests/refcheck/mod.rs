//! Checks shared by the reference tests of each model (reference_*.rs):
//! last-position logits, top-5 and greedy continuations against
//! PyTorch's, in precise and quantised-activation modes.

use std::ops::ControlFlow;

use spinfer_engine::Engine;
use spinfer_engine::generate::{GenerateParams, generate};
use spinfer_engine::model::Precision;
use spinfer_engine::sampling::SamplerParams;
use spinfer_tests::{RefPrompt, Reference, top_k};

/// The last-position logits of `p` (its ids checked against the
/// reference's, BOS added when `add_bos`).
pub fn last_logits(e: &Engine, p: &RefPrompt, add_bos: bool) -> Vec<f32> {
    let ids = e.tokenizer.encode(&p.text, add_bos).unwrap();
    assert_eq!(ids, p.input_ids, "token ids of {:?}", p.text);
    let mut s = e.new_session();
    e.model.forward_last(&mut s, &ids).unwrap().to_vec()
}

/// `p`'s greedy continuation, as many tokens as the reference's.
pub fn greedy(e: &Engine, p: &RefPrompt, add_bos: bool) -> (Vec<u32>, String) {
    let params = GenerateParams {
        max_tokens: p.greedy_ids.len(),
        sampler: SamplerParams::greedy(),
        stop: vec![],
        add_bos: Some(add_bos),
        ..Default::default()
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

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Precise mode: max |Δlogit| ≤ 0.01, the same top-5 order (neighbours
/// closer than 0.01 may swap), identical greedy continuations.
pub fn check_precise(e: &Engine, r: &Reference, add_bos: bool) {
    for p in &r.prompts {
        let got = last_logits(e, p, add_bos);
        let want = p.last_logits();
        let d = max_abs_diff(&got, &want);
        assert!(d <= 0.01, "{:?}: max |Δlogit| {d} > 0.01", p.text);
        let (g5, w5) = (top_k(&got, 5), top_k(&want, 5));
        for i in 0..5 {
            if g5[i] != w5[i] {
                let gap = (want[w5[i] as usize] - want[g5[i] as usize]).abs();
                assert!(gap < 0.01, "{:?}: top-5 {g5:?} vs {w5:?}", p.text);
            }
        }
        let (ids, text) = greedy(e, p, add_bos);
        assert_eq!(ids, p.greedy_ids, "{:?}: greedy ids (got {text:?}, want {:?})", p.text, p.greedy_text);
        assert_eq!(text, p.greedy_text);
        eprintln!("precise {:?}: max |Δ| {d:.5}", p.text);
    }
}

/// A quantised-activation mode: max logit error `tol`, the same top-1 (and
/// top-5 set if asked), at least `min_identical` greedy continuations
/// identical.
pub fn check_quantised(
    e: &Engine,
    r: &Reference,
    add_bos: bool,
    precision: Precision,
    tol: f32,
    top5_set: bool,
    min_identical: usize,
) {
    let mut identical = 0;
    for p in &r.prompts {
        let got = last_logits(e, p, add_bos);
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
        let (ids, text) = greedy(e, p, add_bos);
        if ids == p.greedy_ids {
            identical += 1;
        } else {
            eprintln!("{precision:?} {:?}: continuation differs: {text:?} vs {:?}", p.text, p.greedy_text);
        }
    }
    assert!(identical >= min_identical, "only {identical} of {} greedy continuations identical", r.prompts.len());
}
