//! SmolLM2-135M-Instruct Q4_1 against PyTorch f32 on the dequantised
//! weights (tests/data/reference): last-position logits, top-5, greedy
//! continuations and WikiText-2 perplexity, in precise and fast mode.

use std::ops::ControlFlow;

use spinfer_engine::Engine;
use spinfer_engine::generate::{GenerateParams, generate};
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::sampling::SamplerParams;
use spinfer_tests::{reference, smollm2};

mod refcheck;

fn engine(precision: Precision, ctx: usize) -> Option<Engine> {
    let path = smollm2()?;
    Some(
        Engine::load(path, ModelOptions { precision, ctx, threads: 2, ..ModelOptions::default() })
            .expect("model loads"),
    )
}

#[test]
fn precise_mode_matches_pytorch() {
    let Some(e) = engine(Precision::Precise, 512) else { return };
    refcheck::check_precise(&e, &reference(), false);
}

/// A quantised-activation mode against the reference (no BOS, as the
/// reference ran).
fn check_quantised_mode(precision: Precision, tol: f32, top5_set: bool, min_identical: usize) {
    let Some(e) = engine(precision, 512) else { return };
    refcheck::check_quantised(&e, &reference(), false, precision, tol, top5_set, min_identical);
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
/// from regressing. 1 or 2 of 6 greedy continuations are identical (the
/// others diverge after 5-15 tokens, at near-ties that int8's rounding
/// noise decides: the prompt path's AMX tiles give 1, the `vpdpbusd`
/// tiles 2, with the same logit errors, 0.55-1.11); the near-tied 5th
/// token of the first prompt can swap. With the f16 KV cache (the default
/// outside precise mode, as llama.cpp's) the largest error measured 1.48,
/// one draw of the same rounding noise: int8's one-token decode path
/// measured 1.47 with an f32 cache (docs/benchmarks.md, "One 16-bit
/// activation plane"). The bound is 1.6.
#[test]
fn int8_mode_stays_within_its_bound() {
    check_quantised_mode(Precision::Int8, 1.6, false, 1);
}

#[test]
fn capital_of_france_is_paris_in_every_mode() {
    for precision in [Precision::Precise, Precision::Fast, Precision::Int8] {
        let Some(e) = engine(precision, 256) else { return };
        let params = GenerateParams {
            max_tokens: 1,
            sampler: SamplerParams::greedy(),
            stop: vec![],
            add_bos: None,
            ..Default::default()
        };
        let mut s = e.new_session();
        let g = generate(&e.model, &e.tokenizer, &mut s, "The capital of France is", &params, &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(g.text, " Paris", "{precision:?}");
    }
}
