//! A Gemma 3 text checkpoint in Hugging Face's layout (`Gemma3ForCausalLM`,
//! safetensors): tests/data/tiny-gemma3, tiny and random, written by
//! `scripts/make-tiny-gemma3.py` with PyTorch's logits at every position.
//! Its norms are stored as `w` of `x · (1 + w)`, its config in
//! transformers v5's form (`layer_types`, `rope_parameters` per layer
//! type), and its window (4) is shorter than the sequence (12), so local
//! and global layers both matter. spinfer computes the same logits.

use std::path::Path;

use spinfer_engine::model::{Model, ModelOptions, Precision, Requant};
use spinfer_engine::registry::KernelRegistry;
use spinfer_engine::safetensors::{HfLayout, SafetensorsModel, canonical_to_hf_in};

fn dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/data/tiny-gemma3"))
}

fn reference() -> (Vec<u32>, Vec<Vec<f32>>) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap();
    (serde_json::from_value(v["input_ids"].clone()).unwrap(), serde_json::from_value(v["logits"].clone()).unwrap())
}

fn logits(precision: Precision, ids: &[u32]) -> Vec<Vec<f32>> {
    logits_with(ModelOptions { precision, ..ModelOptions::default() }, ids)
}

fn logits_with(opts: ModelOptions, ids: &[u32]) -> Vec<Vec<f32>> {
    let loader = SafetensorsModel::open(dir()).unwrap();
    let opts = ModelOptions { ctx: 32, threads: 2, ..opts };
    let model = Model::load(&loader, &KernelRegistry::builtin(), opts).unwrap();
    let c = &model.config;
    let w = c.sliding_window.expect("a local window");
    assert_eq!((c.n_layers, c.head_dim, w.window, w.pattern, w.rope_theta, c.rope_theta), (4, 32, 4, 2, 1e4, 1e6));
    let mut s = model.new_session();
    model.forward(&mut s, ids).unwrap();
    let vocab = c.vocab_size;
    model.logits(&mut s, 0..ids.len()).unwrap().chunks_exact(vocab).map(<[f32]>::to_vec).collect()
}

#[test]
fn a_hugging_face_gemma3_checkpoint_gives_pytorchs_logits() {
    let (ids, want) = reference();
    for (precision, tol) in [(Precision::Precise, 2e-4), (Precision::Fast, 2e-2)] {
        let got = logits(precision, &ids);
        let d = got.iter().flatten().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{precision:?}: max |Δlogit| {d} over {} positions", ids.len());
        assert!(d < tol, "{precision:?}: max |Δlogit| {d}");
    }
}

/// Quantised to Q8_0 as it loads (`[model] quantize`): every weight
/// matrix reads 34/128 of its f32 bytes, and the logits stay near
/// PyTorch's; with a memory budget it is refused.
#[test]
fn a_checkpoint_quantised_on_load_reads_a_quarter_and_stays_close() {
    let (ids, want) = reference();
    let plain = SafetensorsModel::open(dir()).unwrap();
    let registry = KernelRegistry::builtin();
    let q8 = ModelOptions { quantize: Some(Requant::Q8_0), ctx: 32, threads: 2, ..ModelOptions::default() };
    let f32_bytes: usize = Model::load(&plain, &registry, ModelOptions { quantize: None, ..q8.clone() })
        .unwrap()
        .linears()
        .map(|l| l.weight_bytes())
        .sum();
    let q8_bytes: usize = Model::load(&plain, &registry, q8.clone()).unwrap().linears().map(|l| l.weight_bytes()).sum();
    assert_eq!(q8_bytes * 32 * 4, f32_bytes * 34, "Q8_0 is 34 bytes per 32 weights");
    for precision in [Precision::Precise, Precision::Fast] {
        let got = logits_with(ModelOptions { precision, ..q8.clone() }, &ids);
        let d = got.iter().flatten().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|m| m.0);
        let same = got.iter().zip(&want).filter(|(g, w)| argmax(g) == argmax(w)).count();
        eprintln!("q8_0 on load, {precision:?}: max |Δlogit| {d}, top-1 equal at {same}/{}", ids.len());
        // Random weights amplify rounding more than trained ones: the
        // logits span ±2.5, the measured error is 0.10.
        assert!(d < 0.25 && same + 2 >= ids.len(), "{precision:?}: {d}, {same}");
    }
    // The 4-bit types: 18 (Q4_0) or 20 (Q4_1) bytes per 32 weights in the
    // layers, and logits further off but still the same function (the
    // random weights' logits span ±2.5).
    for (to, block) in [(Requant::Q4_1, 20), (Requant::Q4_0, 18)] {
        let o = ModelOptions { quantize: Some(to), ..q8.clone() };
        let m = Model::load(&plain, &registry, o.clone()).unwrap();
        let layer_bytes: usize = m.linears().filter(|l| l.name.starts_with("blk.")).map(|l| l.weight_bytes()).sum();
        let layer_f32: usize = Model::load(&plain, &registry, ModelOptions { quantize: None, ..o.clone() })
            .unwrap()
            .linears()
            .filter(|l| l.name.starts_with("blk."))
            .map(|l| l.weight_bytes())
            .sum();
        assert_eq!(layer_bytes * 32 * 4, layer_f32 * block, "{to:?}");
        let got = logits_with(o, &ids);
        let d = got.iter().flatten().zip(want.iter().flatten()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{to:?} on load: max |Δlogit| {d}");
        assert!(d < 1.5, "{to:?}: {d}");
    }
    let budget = ModelOptions { mem_budget: Some(64 << 20), ..q8 };
    let err = Model::load(&plain, &registry, budget).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("q8_0") && err.contains("memory budget"), "{err}");
}

/// Gemma's names map both ways, its norms arrive as `1 + w`, and a
/// layout spinfer cannot run is refused naming its key.
#[test]
fn gemma3_names_norms_and_refusals() {
    let st = SafetensorsModel::open(dir()).unwrap();
    use spinfer_engine::loader::Loader;
    for (canonical, hf) in [
        ("blk.1.post_attention_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.pre_feedforward_layernorm.weight"),
        ("blk.0.attn_k_norm.weight", "model.layers.0.self_attn.k_norm.weight"),
    ] {
        assert_eq!(canonical_to_hf_in(canonical, HfLayout::Gemma3).as_deref(), Some(hf));
        assert_eq!(st.file_name_of(canonical), Some(hf));
    }
    let norm = st.tensor("output_norm.weight").unwrap();
    let stored = safetensors::SafeTensors::deserialize(&std::fs::read(dir().join("model.safetensors")).unwrap())
        .unwrap()
        .tensor("model.norm.weight")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect::<Vec<_>>();
    let served: Vec<f32> =
        norm.data.bytes().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert!(served.iter().zip(&stored).all(|(s, w)| *s == 1.0 + w), "norms are served as 1 + w");

    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir().join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("config.json")).unwrap()).unwrap();
    for (key, value, says) in [
        ("final_logit_softcapping", serde_json::json!(30.0), "soft-capping"),
        ("query_pre_attn_scalar", serde_json::json!(64), "query scale"),
        (
            "layer_types",
            serde_json::json!(["full_attention", "sliding_attention", "full_attention", "sliding_attention"]),
            "one global layer in every",
        ),
        ("rope_parameters", serde_json::json!({"full_attention": {"rope_type": "linear", "factor": 8.0}}), "linear"),
        ("hidden_activation", serde_json::json!("relu"), "gelu_pytorch_tanh"),
    ] {
        let mut c = config.clone();
        c[key] = value.clone();
        std::fs::write(tmp.path().join("config.json"), c.to_string()).unwrap();
        let err = match SafetensorsModel::open(tmp.path()).and_then(|m| m.config()) {
            Ok(_) => panic!("{key} = {value} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(key) && err.contains(says), "{key}: {err}");
    }
}
