//! Gemma 3 270M Q4_K_M fully on the GPU (q5_0, q8_0, q4_K and q6_K weights;
//! QK-norm, post-norms, GeGLU, local attention layers) against PyTorch's
//! reference and the CPU engine, as `smollm2.rs` does for SmolLM2. Skipped,
//! saying why, without a device or without the model file.

mod common;

use common::{check_fused, check_greedy, check_logits, cpu_engine, gpu_model, wikitext2_ppl};
use spinfer_tests::{data, gemma3, gemma3_reference};

#[test]
fn logits_match_pytorch_and_the_cpu_engine() {
    let Some(path) = gemma3() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    check_logits(&m, &cpu_engine(&path, 512), &gemma3_reference(), 0.3);
}

#[test]
fn greedy_continuations_match_the_cpu_engine() {
    let Some(path) = gemma3() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    check_greedy(&m, &cpu_engine(&path, 512), &gemma3_reference());
}

/// The fused steps (GeGLU inside the down projection; each post-norm,
/// residual add and RMSNorm inside the next projections) against the same
/// steps one by one.
#[test]
fn fused_steps_match_unfused() {
    let Some(path) = gemma3() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    check_fused(&m, &gemma3_reference(), 1e-3);
}

/// The reference protocol with the file's one `<bos>`: within 1% of
/// PyTorch's 62.215.
#[test]
fn wikitext2_perplexity_within_one_percent() {
    let Some(path) = gemma3() else { return };
    let Some(m) = gpu_model(&path, 512) else { return };
    let ppl = wikitext2_ppl(&m, &cpu_engine(&path, 512), &data("wikitext-2-raw/wiki.test.raw"));
    let want = gemma3_reference().wikitext2_ppl["ppl"].as_f64().unwrap();
    eprintln!("gpu ppl {ppl:.4} (reference {want:.4}, {:+.3}%)", (ppl / want - 1.0) * 100.0);
    assert!((ppl / want - 1.0).abs() <= 0.01, "gpu ppl {ppl} vs {want}");
}
