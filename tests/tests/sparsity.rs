//! Activation sparsity on SmolLM2: calibration writes a deterministic
//! sidecar, a model loaded with it runs sparse and still answers, a
//! keep-everything sidecar reproduces the dense model, and a sidecar of
//! another model is refused.

use std::path::Path;

use spinfer_engine::Engine;
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::model::{ModelOptions, Precision};
use spinfer_engine::sparse::calibrate::{CalibrateOptions, calibrate};
use spinfer_engine::sparse::{CalibrationInfo, PredictorKind, Sidecar, SparsityOptions};
use spinfer_tests::{data, reference, smollm2, top_k};

fn options(sparsity: Option<SparsityOptions>) -> ModelOptions {
    ModelOptions { precision: Precision::Fast, ctx: 512, threads: 2, sparsity }
}

/// Calibration tokens: WikiText-2 test after byte 800,000 (the evaluation
/// uses the start of the file).
fn calibration_tokens(e: &Engine, n: usize) -> Vec<u32> {
    let text = std::fs::read(data("wikitext-2-raw/wiki.test.raw")).unwrap();
    let text = String::from_utf8_lossy(&text[800_000..]).replace("\r\n", "\n");
    let mut t = e.tokenizer.encode(&text, false).unwrap();
    t.truncate(n);
    t
}

fn calibrated(model: &Path, e: &Engine, target: f32, predictor: PredictorKind) -> Sidecar {
    calibrated_with_attn(model, e, target, predictor, 0.0)
}

fn calibrated_with_attn(model: &Path, e: &Engine, target: f32, predictor: PredictorKind, attn: f32) -> Sidecar {
    let g = GgufFile::open(model).unwrap();
    let rank = if predictor == PredictorKind::LowRank { 32 } else { 0 };
    let opts = CalibrateOptions {
        target_sparsity: target,
        predictor,
        window: 256,
        info: CalibrationInfo::default(),
        rank,
        recall_target: 0.95,
        attn_sparsity: attn,
    };
    calibrate(&e.model, &g, &calibration_tokens(e, 1024), &opts, &mut |_, _, _| {}).unwrap()
}

fn last_logits(e: &Engine, text: &str) -> Vec<f32> {
    let ids = e.tokenizer.encode(text, false).unwrap();
    let mut s = e.new_session();
    e.model.forward_last(&mut s, &ids).unwrap().to_vec()
}

fn greedy(e: &Engine, prompt: &str, n: usize) -> Vec<u32> {
    let mut ids = e.tokenizer.encode(prompt, false).unwrap();
    let mut s = e.new_session();
    let mut out = Vec::new();
    let mut step = ids.clone();
    for _ in 0..n {
        let logits = e.model.forward_last(&mut s, &step).unwrap();
        let next = top_k(logits, 1)[0];
        out.push(next);
        ids.push(next);
        step = vec![next];
    }
    out
}

#[test]
fn calibrated_sparse_model_runs_and_keeps_its_answer() {
    let Some(model) = smollm2() else { return };
    let dense = Engine::load(&model, options(None)).unwrap();
    let dir = tempfile::tempdir().unwrap();

    // Deterministic: two calibrations write identical files.
    let sidecar = calibrated(&model, &dense, 0.3, PredictorKind::GateThreshold);
    let (a, b) = (dir.path().join("a.spinfer"), dir.path().join("b.spinfer"));
    sidecar.write(&a).unwrap();
    calibrated(&model, &dense, 0.3, PredictorKind::GateThreshold).write(&b).unwrap();
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    assert_eq!(Sidecar::read(&a).unwrap(), sidecar);
    assert_eq!(sidecar.layers.len(), 30);
    assert!(sidecar.layers.iter().all(|l| l.threshold > 0.0 && l.input_threshold > 0.0 && l.keep == 1075));

    for predictor in [PredictorKind::GateThreshold, PredictorKind::TopK, PredictorKind::InputMagnitude] {
        let mut so = SparsityOptions::new(&a);
        so.predictor = Some(predictor);
        let sparse = Engine::load(&model, options(Some(so))).unwrap();
        let ids = sparse.tokenizer.encode("The capital of France is", false).unwrap();
        let mut s = sparse.new_session();
        let logits = sparse.model.forward_last(&mut s, &ids).unwrap().to_vec();
        assert_eq!(sparse.tokenizer.decode(&top_k(&logits, 1)).unwrap(), " Paris", "{predictor:?}");
        // About 70% of the neurons kept (calibrated on other text).
        let kept = s.sparsity_stats().mean_active_fraction();
        assert!((0.5..0.85).contains(&kept), "{predictor:?}: kept {kept}");
        assert!(s.sparsity_stats().layers.iter().all(|c| c.tokens == ids.len() as u64));
    }
}

#[test]
fn keeping_every_neuron_matches_the_dense_model() {
    let Some(model) = smollm2() else { return };
    let dense = Engine::load(&model, options(None)).unwrap();
    let mut all = calibrated(&model, &dense, 0.0, PredictorKind::GateThreshold);
    for l in &mut all.layers {
        l.threshold = -1.0; // |silu(g)| > -1 for every neuron
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("all.spinfer");
    all.write(&path).unwrap();
    let mut so = SparsityOptions::new(&path);
    so.dense_above = 1.0; // never fall back: exercise the sparse kernels
    let sparse = Engine::load(&model, options(Some(so))).unwrap();
    // The only difference is W_down requantised to Q8_0 (neuron-major):
    // the same top-5 on every reference prompt, logits within 0.1.
    for p in &reference().prompts {
        let (want, got) = (last_logits(&dense, &p.text), last_logits(&sparse, &p.text));
        let diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff < 0.1, "{:?}: max |Δlogit| {diff}", p.text);
        assert_eq!(top_k(&want, 5), top_k(&got, 5), "{:?}", p.text);
    }
    assert_eq!(greedy(&dense, "The capital of France is", 8), greedy(&sparse, "The capital of France is", 8));
}

/// TEAL on the attention output projection: calibrated thresholds skip
/// about the asked fraction of W_o's inputs and keep the answer; with every
/// input (and neuron) kept, both the prefill path (masked dense kernel) and
/// the decode path (AXPY over the input-major W_o) reproduce the dense model.
#[test]
fn attention_output_sparsity_runs_and_keeping_everything_matches_dense() {
    let Some(model) = smollm2() else { return };
    let dense = Engine::load(&model, options(None)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sidecar = calibrated_with_attn(&model, &dense, 0.3, PredictorKind::InputMagnitude, 0.4);
    assert_eq!(sidecar.attn_sparsity, Some(0.4));
    assert!(sidecar.layers.iter().all(|l| l.attn_input_threshold.is_some_and(|t| t > 0.0)));
    let path = dir.path().join("attn.spinfer");
    sidecar.write(&path).unwrap();
    assert_eq!(Sidecar::read(&path).unwrap(), sidecar);

    let sparse = Engine::load(&model, options(Some(SparsityOptions::new(&path)))).unwrap();
    let ids = sparse.tokenizer.encode("The capital of France is", false).unwrap();
    let mut s = sparse.new_session();
    let logits = sparse.model.forward_last(&mut s, &ids).unwrap().to_vec();
    assert_eq!(sparse.tokenizer.decode(&top_k(&logits, 1)).unwrap(), " Paris");
    sparse.model.forward_last(&mut s, &top_k(&logits, 1)).unwrap();
    let st = s.sparsity_stats();
    let kept = st.mean_attn_active_fraction();
    assert!((0.4..0.8).contains(&kept), "kept {kept} of the attention output");
    assert!(st.layers.iter().all(|c| c.attn_tokens == ids.len() as u64 + 1));

    // Keep everything, never fall back to dense.
    let mut all = sidecar;
    for l in &mut all.layers {
        l.input_threshold = -1.0;
        l.attn_input_threshold = Some(-1.0);
    }
    let all_path = dir.path().join("all.spinfer");
    all.write(&all_path).unwrap();
    let mut so = SparsityOptions::new(&all_path);
    so.dense_above = 1.0;
    let sparse = Engine::load(&model, options(Some(so))).unwrap();
    for p in &reference().prompts {
        let (want, got) = (last_logits(&dense, &p.text), last_logits(&sparse, &p.text));
        let diff = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(diff < 0.1, "{:?}: max |Δlogit| {diff}", p.text);
        assert_eq!(top_k(&want, 5), top_k(&got, 5), "{:?}", p.text);
    }
    // Decode runs one token at a time: the AXPY paths.
    assert_eq!(greedy(&dense, "Once upon a time, there was a", 8), greedy(&sparse, "Once upon a time, there was a", 8));
}

/// The error of loading `model` with the sidecar `sidecar`.
fn load_err(model: &Path, sidecar: &Path) -> String {
    match Engine::load(model, options(Some(SparsityOptions::new(sidecar)))) {
        Ok(_) => panic!("{} was accepted", sidecar.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_sidecar_of_another_model_or_a_corrupt_one_is_refused() {
    let Some(model) = smollm2() else { return };
    let dense = Engine::load(&model, options(None)).unwrap();
    let mut other = calibrated(&model, &dense, 0.5, PredictorKind::TopK);
    let dir = tempfile::tempdir().unwrap();

    other.model.n_layers = 24;
    other.layers.truncate(24);
    let path = dir.path().join("other.spinfer");
    other.write(&path).unwrap();
    let e = load_err(&model, &path);
    assert!(e.contains("other.spinfer") && e.contains("24 layers") && e.contains("30 layers"), "{e}");

    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&model, &path);
    assert!(e.contains("other.spinfer") && e.contains("truncated"), "{e}");

    let missing = dir.path().join("missing.spinfer");
    let e = load_err(&model, &missing);
    assert!(e.contains("missing.spinfer"), "{e}");
}

#[test]
fn low_rank_predictor_recalls_its_target_and_runs() {
    let Some(model) = smollm2() else { return };
    let dense = Engine::load(&model, options(None)).unwrap();
    let sidecar = calibrated(&model, &dense, 0.3, PredictorKind::LowRank);
    let info = sidecar.lowrank.as_ref().expect("low-rank metadata");
    assert_eq!((info.rank, info.heldout_recall.len()), (32, 30));
    // Held out (the last eighth of the calibration text): near the target.
    let mean = info.heldout_recall.iter().sum::<f32>() / 30.0;
    assert!(mean > 0.9, "mean held-out recall {mean}");
    assert!(info.predicted_fraction.iter().all(|&k| k > 0.0 && k <= 1.0));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lr.spinfer");
    sidecar.write(&path).unwrap();
    assert_eq!(Sidecar::read(&path).unwrap(), sidecar);

    let sparse = Engine::load(&model, options(Some(SparsityOptions::new(&path)))).unwrap();
    let ids = sparse.tokenizer.encode("The capital of France is", false).unwrap();
    let mut s = sparse.new_session();
    let logits = sparse.model.forward_last(&mut s, &ids).unwrap().to_vec();
    assert_eq!(sparse.tokenizer.decode(&top_k(&logits, 1)).unwrap(), " Paris");
    let st = s.sparsity_stats();
    // Gate rows computed only for predicted neurons, and fewer kept after
    // the gate threshold.
    assert!(st.layers.iter().all(|c| c.active <= c.predicted && c.predicted < c.tokens * 1536));

    // A sidecar without factors cannot run the low-rank predictor.
    let plain = dir.path().join("plain.spinfer");
    calibrated(&model, &dense, 0.3, PredictorKind::GateThreshold).write(&plain).unwrap();
    let mut so = SparsityOptions::new(&plain);
    so.predictor = Some(PredictorKind::LowRank);
    let e = Engine::load(&model, options(Some(so))).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("plain.spinfer") && e.contains("--rank"), "{e}");
}

/// Under a memory budget the FFN runs from the bundle (hot neurons in RAM,
/// cold ones read from `<sidecar>.ffn`): the same arithmetic on the same
/// weights as the unbudgeted low-rank path (the bundle's AXPY follows
/// `NeuronMajor::axpy`'s order and fused multiply-adds on this CPU), so
/// the same logits, bit for bit. (A different summation order is not
/// harmless here: threshold decisions flip and the difference grows.)
#[test]
fn a_memory_budget_gives_the_unbudgeted_logits() {
    let Some(model) = smollm2() else { return };
    let dense = Engine::load(&model, options(None)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lr.spinfer");
    calibrated(&model, &dense, 0.5, PredictorKind::LowRank).write(&path).unwrap();
    drop(dense);
    let mut so = SparsityOptions::new(&path);
    so.predictor = Some(PredictorKind::LowRank);
    let free = Engine::load(&model, options(Some(so.clone()))).unwrap();
    so.ffn_budget_bytes = Some(12_000_000);
    let budgeted = Engine::load(&model, options(Some(so.clone()))).unwrap();
    let bundle = budgeted.model.sparse.as_ref().unwrap().bundle.as_ref().expect("bundle");
    let r = bundle.report();
    assert!(r.hot_neurons > 0 && r.cache_slots > 0 && r.hot_neurons < r.total_neurons, "{r:?}");
    assert!(r.fixed + r.hot + r.cache <= r.budget, "{r:?}");

    // Prefill, then decode the unbudgeted model's greedy tokens in both.
    let mut ids = free.tokenizer.encode("The capital of France is Paris, and the capital of Italy is", false).unwrap();
    let (mut sf, mut sb) = (free.new_session(), budgeted.new_session());
    let mut worst = 0f32;
    for step in 0..8 {
        let feed = if step == 0 { ids.clone() } else { vec![*ids.last().unwrap()] };
        let a = free.model.forward_last(&mut sf, &feed).unwrap().to_vec();
        let b = budgeted.model.forward_last(&mut sb, &feed).unwrap().to_vec();
        let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        worst = worst.max(diff / scale);
        assert_eq!(top_k(&a, 1), top_k(&b, 1), "step {step}: different greedy token (max diff {diff})");
        ids.push(top_k(&a, 1)[0]);
    }
    // Same bits: the bundle's AXPY (integer or f32, as the precision says)
    // follows NeuronMajor's on this CPU.
    assert_eq!(worst, 0.0, "max relative logit difference {worst}");
    let st = sb.sparsity_stats();
    assert_eq!(st.layers, sf.sparsity_stats().layers, "same neurons predicted and kept");
    assert!(st.cache.hot > 0 && st.cache.misses > 0 && st.cache.bytes_read > 0, "{:?}", st.cache);
    // The bundle is reused by the next load.
    assert!(dir.path().join("lr.spinfer.ffn").exists());

    // Other predictors read the whole gate: refused under a budget.
    so.predictor = Some(PredictorKind::GateThreshold);
    let e = Engine::load(&model, options(Some(so))).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("low-rank"), "{e}");
}
