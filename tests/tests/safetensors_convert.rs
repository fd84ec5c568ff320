//! GGUF -> Hugging Face safetensors export, checked on SmolLM2-135M-Instruct
//! (Q4_1): the exported checkpoint reopens with the same configuration and
//! tensor shapes, its weights are the GGUF's dequantised weights (q/k rows
//! un-permuted), and its `tokenizer.json` tokenises like the GGUF vocabulary.
//!
//! The model comes from `SPINFER_MODEL` or `<workspace>/models/`; every test
//! prints a note and passes when it is absent. Conversions are made once per
//! test binary ([`exported`]) and shared, so a model-level comparison (e.g.
//! logits of the F32 export against the GGUF in precise mode) can be added as
//! one more test using [`exported`] and [`Exported::dir`]
//! ([`exported_logits_match_gguf`] does this for the last position).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use spinfer_engine::convert::{OutDType, gguf_to_safetensors};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::loader::Loader;
use spinfer_engine::model::RopeStyle;
use spinfer_engine::safetensors::open_model;
use spinfer_engine::tensor::TensorView;
use spinfer_kernels::GgmlType;
use spinfer_kernels::dequant::dequantize_row;

fn model_path() -> Option<PathBuf> {
    let p = match std::env::var_os("SPINFER_MODEL") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if p.exists() {
        Some(p)
    } else {
        eprintln!("note: skipping, {} not found (set SPINFER_MODEL)", p.display());
        None
    }
}

/// The GGUF and its F32 and BF16 exports.
struct Exported {
    gguf: GgufFile,
    _tmp: tempfile::TempDir,
    f32: PathBuf,
    bf16: PathBuf,
}

impl Exported {
    fn dir(&self, dtype: OutDType) -> &Path {
        match dtype {
            OutDType::F32 => &self.f32,
            OutDType::BF16 => &self.bf16,
        }
    }
}

/// Converts the model once per test binary; `None` when it is absent.
fn exported() -> Option<&'static Exported> {
    static CELL: OnceLock<Option<Exported>> = OnceLock::new();
    CELL.get_or_init(|| {
        let path = model_path()?;
        let gguf = GgufFile::open(&path).expect("open gguf");
        let tmp = tempfile::tempdir().expect("tempdir");
        let (f32, bf16) = (tmp.path().join("f32"), tmp.path().join("bf16"));
        for (dtype, dir) in [(OutDType::F32, &f32), (OutDType::BF16, &bf16)] {
            let mut last = (0, 0);
            gguf_to_safetensors(&gguf, dir, dtype, &mut |d, n| last = (d, n)).expect("export");
            assert!(last.0 == last.1 && last.1 == gguf.tensors.len(), "progress ended at {last:?}");
        }
        Some(Exported { gguf, _tmp: tmp, f32, bf16 })
    })
    .as_ref()
}

/// A tensor's elements as f32 (rows of `dims[0]`).
fn to_f32(t: &TensorView) -> Vec<f32> {
    let cols = t.dims[0];
    let row_bytes = t.ty.row_bytes(cols).unwrap();
    let mut out = vec![0f32; t.n_elements()];
    for (dst, src) in out.chunks_mut(cols).zip(t.data.bytes().chunks(row_bytes)) {
        dequantize_row(t.ty, src, dst).unwrap();
    }
    out
}

/// llama.cpp's converter permutation, as numpy writes it:
/// `w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)`.
fn permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src = (h * 2 + j) * half + i;
                out.extend_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// f32 -> bf16 -> f32 with round-to-nearest-even (NaNs quieted).
fn bf16_round(v: f32) -> f32 {
    let x = v.to_bits();
    let b = if x & 0x7fff_ffff > 0x7f80_0000 { (x >> 16) | 0x40 } else { (x + 0x7fff + ((x >> 16) & 1)) >> 16 };
    f32::from_bits(b << 16)
}

#[test]
fn config_matches_gguf() {
    let Some(e) = exported() else { return };
    let mut want = e.gguf.config().unwrap();
    assert_eq!(want.rope_style, RopeStyle::Interleaved);
    want.rope_style = RopeStyle::NeoX;
    for dtype in [OutDType::F32, OutDType::BF16] {
        let st = open_model(e.dir(dtype)).unwrap();
        assert_eq!(st.config().unwrap(), want, "{dtype:?}");
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(e.dir(dtype).join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["tie_word_embeddings"], true);
        assert_eq!(cfg["model_type"], "llama");
    }
}

#[test]
fn every_tensor_present_with_same_dims() {
    let Some(e) = exported() else { return };
    for (dtype, ty) in [(OutDType::F32, GgmlType::F32), (OutDType::BF16, GgmlType::BF16)] {
        let st = open_model(e.dir(dtype)).unwrap();
        for info in &e.gguf.tensors {
            let t = st.tensor(&info.name).unwrap_or_else(|err| panic!("{dtype:?}: {err}"));
            assert_eq!(t.dims, info.dims, "{dtype:?} {}", info.name);
            assert_eq!(t.ty, ty, "{}", info.name);
        }
        assert!(!st.has_tensor("output.weight"), "tied model must not export lm_head");
    }
}

#[test]
fn weights_are_dequantised_gguf_weights() {
    let Some(e) = exported() else { return };
    let c = e.gguf.config().unwrap();
    let (f32s, bf16s) = (open_model(&e.f32).unwrap(), open_model(&e.bf16).unwrap());
    let cases = [
        ("blk.0.attn_q.weight", Some(c.n_heads)),
        ("blk.0.attn_k.weight", Some(c.n_kv_heads)),
        ("blk.29.attn_k.weight", Some(c.n_kv_heads)),
        ("blk.0.attn_v.weight", None),
        ("blk.3.ffn_down.weight", None),
        ("token_embd.weight", None),
        ("output_norm.weight", None),
    ];
    for (name, heads) in cases {
        let g = e.gguf.tensor(name).unwrap();
        let want = to_f32(&g);
        let x = f32s.tensor(name).unwrap();
        let mut got = to_f32(&x);
        if let Some(h) = heads {
            let (rows, cols) = g.rows_cols();
            assert_ne!(got, want, "{name} should have been un-permuted");
            got = permute(&got, rows, cols, h);
        }
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{name} differs from the gguf");
        // BF16 is the F32 export rounded to nearest even.
        let b = to_f32(&bf16s.tensor(name).unwrap());
        let rounded: Vec<f32> = to_f32(&x).into_iter().map(bf16_round).collect();
        assert_eq!(b, rounded, "{name} bf16");
    }
}

#[test]
fn tokenizer_matches_gguf() {
    use spinfer_engine::tokenizer::Tokenizer;
    let Some(e) = exported() else { return };
    let ours = Tokenizer::from_gguf(&e.gguf).unwrap();
    for dtype in [OutDType::F32, OutDType::BF16] {
        let hf = Tokenizer::from_json_file(&e.dir(dtype).join("tokenizer.json")).unwrap();
        assert_eq!(hf.vocab_size(), ours.vocab_size());
        for text in [
            "Hello, world!",
            "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n<|im_start|>assistant\n",
            "  leading spaces, tabs\tand naïve café 日本語 🙂",
            "fn main() { println!(\"{}\", 1_000_000); }",
        ] {
            assert_eq!(hf.encode(text, false).unwrap(), ours.encode(text, false).unwrap(), "{text:?}");
        }
    }
}

/// The F32 export computes the GGUF's function (precise mode: f32
/// activations, weights dequantised on the fly), through NeoX RoPE instead of
/// the GGUF's interleaved RoPE; the BF16 export stays close.
#[test]
fn exported_logits_match_gguf() {
    use spinfer_engine::model::{Model, ModelOptions, Precision};
    use spinfer_engine::registry::KernelRegistry;
    use spinfer_engine::tokenizer::Tokenizer;
    let Some(e) = exported() else { return };
    let opts = ModelOptions { precision: Precision::Precise, ctx: 64, ..ModelOptions::default() };
    let registry = KernelRegistry::builtin();
    let tokens = Tokenizer::from_gguf(&e.gguf)
        .unwrap()
        .encode("The capital of France is Paris, and the capital of", false)
        .unwrap();
    let logits = |path: &Path| {
        let model = Model::load(open_model(path).unwrap().as_ref(), &registry, opts.clone()).unwrap();
        let mut session = model.new_session();
        model.forward_last(&mut session, &tokens).unwrap().to_vec()
    };
    let want = logits(e.gguf.path());
    let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    for (dtype, tol) in [(OutDType::F32, 1e-3), (OutDType::BF16, 0.5)] {
        let got = logits(e.dir(dtype));
        let max = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{dtype:?} export: max |logit difference| {max}");
        assert!(max <= tol, "{dtype:?}: max |logit difference| {max} > {tol}");
        assert_eq!(argmax(&got), argmax(&want), "{dtype:?}");
    }
}
