//! GGUF -> Hugging Face export of Gemma 3 270M (Q4_K_M): `Gemma3ForCausalLM`'s
//! names and `config.json`, its norms as `w` (the GGUF holds `1 + w`), and a
//! SentencePiece `tokenizer.json` whose merges come from the pieces'
//! scores. The export reopens with the GGUF's configuration and computes
//! its logits, and its `tokenizer.json` tokenises as the GGUF's tokenizer.
//! (transformers loads it too and matches PyTorch's reference: README.md, Formats.)
//!
//! The model comes from `SPINFER_GEMMA_MODEL` or `<workspace>/models/`; the
//! test prints a note and passes when it is absent. The export (1 GB, f32)
//! lives under the target directory's scratch space and is deleted after.

use spinfer_engine::convert::{OutDType, gguf_to_safetensors};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::loader::Loader;
use spinfer_engine::model::{Model, ModelConfig, ModelOptions, Precision};
use spinfer_engine::registry::KernelRegistry;
use spinfer_engine::safetensors::{SafetensorsModel, open_model};
use spinfer_engine::tokenizer::Tokenizer;
use spinfer_tests::gemma3;

#[test]
fn gemma3_export_is_the_gguf() {
    let Some(path) = gemma3() else { return };
    let gguf = GgufFile::open(&path).unwrap();
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    gguf_to_safetensors(&gguf, tmp.path(), OutDType::F32, &mut |_, _| {}).unwrap();
    let st = SafetensorsModel::open(tmp.path()).unwrap();
    assert_eq!(st.config().unwrap(), ModelConfig::from_gguf(&gguf).unwrap());
    assert_eq!(st.file_name_of("blk.3.ffn_norm.weight"), Some("model.layers.3.pre_feedforward_layernorm.weight"));
    // A norm is served back as the GGUF's 1 + w, to f32 rounding.
    let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
    for name in ["blk.0.attn_q_norm.weight", "blk.5.post_ffw_norm.weight", "output_norm.weight"] {
        let (a, b) = (f32s(gguf.tensor(name).unwrap().data.bytes()), f32s(st.tensor(name).unwrap().data.bytes()));
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-6, "{name}: {d}");
    }

    let ours = Tokenizer::from_gguf(&gguf).unwrap();
    let hf = Tokenizer::from_json_file(&tmp.path().join("tokenizer.json")).unwrap();
    let wiki = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/data/wikitext-2-raw/wiki.test.head.raw"))
        .unwrap();
    for text in [
        "Hello, world!",
        "a  b    c\t\td\n\n\ne",
        "<start_of_turn>user\nWhat is 12345 + 678?<end_of_turn>\n<start_of_turn>model\n",
        "  leading spaces, tabs\tand naïve café 日本語 🙂",
        "def f():\n    return {\"x\": 1_000_000}\n",
        &wiki,
    ] {
        for bos in [false, true] {
            let (a, b) = (hf.encode(text, bos).unwrap(), ours.encode(text, bos).unwrap());
            assert!(a == b, "{:?} (bos {bos}): {} vs {} tokens", &text[..text.len().min(40)], a.len(), b.len());
        }
    }

    // The export computes the GGUF's function (precise: f32 activations).
    let ids = ours.encode("The capital of France is Paris, and the capital of Italy is", true).unwrap();
    let opts = ModelOptions { precision: Precision::Precise, ctx: 64, ..ModelOptions::default() };
    let registry = KernelRegistry::builtin();
    let logits = |p: &std::path::Path| {
        let model = Model::load(open_model(p).unwrap().as_ref(), &registry, opts.clone()).unwrap();
        let mut s = model.new_session();
        model.forward_last(&mut s, &ids).unwrap().to_vec()
    };
    let (want, got) = (logits(&path), logits(tmp.path()));
    let d = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    eprintln!("max |Δlogit| export vs GGUF: {d}");
    assert!(d < 1e-3 && argmax(&want) == argmax(&got), "max |Δlogit| {d}");
}
