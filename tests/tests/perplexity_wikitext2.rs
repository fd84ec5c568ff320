//! WikiText-2 perplexity by the reference protocol (40 windows of 512
//! tokens, tokens 2..512 of each scored): within 0.5% of PyTorch's 28.738 in
//! precise mode and 1% in fast mode; the same weights converted to BF16
//! safetensors within 1%.

use spinfer_engine::Engine;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::perplexity::perplexity;
use spinfer_tests::{data, reference, smollm2};

fn ppl(precision: Precision) -> Option<(f64, usize)> {
    ppl_of(&smollm2()?, precision)
}

fn ppl_of(model: &std::path::Path, precision: Precision) -> Option<(f64, usize)> {
    let e = Engine::load(model, ModelOptions { precision, ctx: 512, threads: 2, sparsity: None, mem_budget: None })
        .unwrap();
    let text = std::fs::read_to_string(data("wikitext-2-raw/wiki.test.raw")).unwrap().replace("\r\n", "\n");
    let tokens = e.tokenizer.encode(&text, false).unwrap();
    let mut s = e.new_session();
    let r = perplexity(&e.model, &mut s, &tokens, 512, Some(40), &mut |_, _, _| {}).unwrap();
    Some((r.ppl, r.scored_tokens))
}

fn reference_ppl() -> f64 {
    reference().wikitext2_ppl["ppl"].as_f64().unwrap()
}

#[test]
fn precise_perplexity_within_half_percent() {
    let Some((p, scored)) = ppl(Precision::Precise) else { return };
    assert_eq!(scored, 20_440);
    let want = reference_ppl();
    eprintln!("precise ppl {p:.4} (reference {want:.4})");
    assert!((p / want - 1.0).abs() <= 0.005, "precise ppl {p} vs {want}");
}

#[test]
fn fast_perplexity_within_one_percent() {
    let Some((p, _)) = ppl(Precision::Fast) else { return };
    let want = reference_ppl();
    eprintln!("fast ppl {p:.4} (reference {want:.4})");
    assert!((p / want - 1.0).abs() <= 0.01, "fast ppl {p} vs {want}");
}

#[test]
fn bf16_safetensors_perplexity_within_one_percent() {
    use spinfer_engine::convert::{OutDType, gguf_to_safetensors};
    let Some(src) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let g = spinfer_engine::gguf::GgufFile::open(&src).unwrap();
    gguf_to_safetensors(&g, dir.path(), OutDType::BF16, &mut |_, _| {}).unwrap();
    // BF16 weights run with f32 activations in every mode.
    let (p, _) = ppl_of(dir.path(), Precision::Fast).unwrap();
    let want = reference_ppl();
    eprintln!("bf16 safetensors ppl {p:.4} (reference {want:.4})");
    assert!((p / want - 1.0).abs() <= 0.01, "bf16 ppl {p} vs {want}");
}
