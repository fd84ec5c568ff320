//! SmolLM2-135M-Instruct fully on the GPU against PyTorch's reference
//! (tests/data/reference) and the CPU engine: last-position logits of the
//! 6 reference prompts, greedy continuations, WikiText-2 perplexity.
//!
//! Without a device (CI) every test says why it is skipped; with
//! `SPINFER_EXPECT_GPU=1` a missing device fails instead.

mod common;

use common::{check_fused, check_greedy, check_logits, cpu_engine, gpu_model, wikitext2_ppl};
use spinfer_tests::{data, reference, smollm2};

/// Last-position logits within the fast mode's bound of PyTorch's (0.3)
/// and of the CPU engine's precise mode; the same top token everywhere.
#[test]
fn logits_match_pytorch_and_the_cpu_engine() {
    let Some(path) = smollm2() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    eprintln!("device: {}", m.backend().device());
    check_logits(&m, &cpu_engine(&path, 512), &reference(), 0.3);
}

#[test]
fn greedy_continuations_match_the_cpu_engine() {
    let Some(path) = smollm2() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    check_greedy(&m, &cpu_engine(&path, 512), &reference());
}

/// The fused decode steps against the same steps launched one by one.
#[test]
fn fused_steps_match_unfused() {
    let Some(path) = smollm2() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    check_fused(&m, &reference(), 1e-3);
}

/// Within 1% of PyTorch's 28.738.
#[test]
fn wikitext2_perplexity_within_one_percent() {
    let Some(path) = smollm2() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    let ppl = wikitext2_ppl(&m, &cpu_engine(&path, 512), &data("wikitext-2-raw/wiki.test.raw"));
    let want = reference().wikitext2_ppl["ppl"].as_f64().unwrap();
    eprintln!("gpu ppl {ppl:.4} (reference {want:.4}, {:+.3}%)", (ppl / want - 1.0) * 100.0);
    assert!((ppl / want - 1.0).abs() <= 0.01, "gpu ppl {ppl} vs {want}");
}
