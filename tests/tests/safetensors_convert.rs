//! GGUF -> Hugging Face safetensors export, checked on SmolLM2-135M-Instruct
//! (Q4_1): the exported checkpoint reopens with the same configuration and
//! tensor shapes, its weights are the GGUF's dequantised weights (q/k rows
//! un-permuted), its `tokenizer.json` tokenises like the GGUF vocabulary, and
//! it computes the GGUF's logits.
//!
//! The model comes from `SPINFER_MODEL` or `<workspace>/models/`; every test
//! prints a note and passes when it is absent. An export is 540 MB (F32) or
//! 270 MB (BF16), so each test makes its own under the target directory's
//! scratch space, one at a time ([`export`]), and deletes it when done.

use std::path::Path;
use std::sync::Mutex;

use spinfer_engine::convert::{OutDType, gguf_to_safetensors};
use spinfer_engine::gguf::GgufFile;
use spinfer_engine::loader::Loader;
use spinfer_engine::model::RopeStyle;
use spinfer_engine::safetensors::open_model;
use spinfer_engine::tensor::TensorView;
use spinfer_kernels::GgmlType;
use spinfer_kernels::dequant::dequantize_row;

use spinfer_tests::smollm2 as model_path;

/// The GGUF and one export of it; the export is deleted on drop.
struct Exported {
    gguf: GgufFile,
    tmp: tempfile::TempDir,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

impl Exported {
    fn dir(&self) -> &Path {
        self.tmp.path()
    }
}

/// Exports the model as `dtype`; `None` when the model is absent. Holds a
/// lock for the export's lifetime so that at most one export is on disk.
fn export(dtype: OutDType) -> Option<Exported> {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let path = model_path()?;
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let gguf = GgufFile::open(&path).expect("open gguf");
    let tmp = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let mut last = (0, 0);
    gguf_to_safetensors(&gguf, tmp.path(), dtype, &mut |d, n| last = (d, n)).expect("export");
    assert!(last.0 == last.1 && last.1 == gguf.tensors.len(), "progress ended at {last:?}");
    Some(Exported { gguf, tmp, _one_at_a_time: guard })
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

/// The configuration round-trips (RoPE style becomes NeoX: q/k rows are
/// un-permuted).
fn check_config(e: &Exported) {
    let mut want = e.gguf.config().unwrap();
    assert_eq!(want.rope_style, RopeStyle::Interleaved);
    want.rope_style = RopeStyle::NeoX;
    assert_eq!(open_model(e.dir()).unwrap().config().unwrap(), want);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(e.dir().join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["tie_word_embeddings"], true);
    assert_eq!(cfg["model_type"], "llama");
}

/// Every GGUF tensor is there with its dims, as `ty`; the tied head is not.
fn check_tensors(e: &Exported, ty: GgmlType) {
    let st = open_model(e.dir()).unwrap();
    for info in &e.gguf.tensors {
        let t = st.tensor(&info.name).unwrap_or_else(|err| panic!("{ty:?}: {err}"));
        assert_eq!(t.dims, info.dims, "{}", info.name);
        assert_eq!(t.ty, ty, "{}", info.name);
    }
    assert!(!st.has_tensor("output.weight"), "tied model must not export lm_head");
}

/// Weights are the GGUF's dequantised weights (q/k rows un-permuted), passed
/// through `round` (identity for F32, round-to-nearest-even for BF16).
fn check_weights(e: &Exported, round: fn(f32) -> f32) {
    let c = e.gguf.config().unwrap();
    let st = open_model(e.dir()).unwrap();
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
        let want: Vec<f32> = to_f32(&g).into_iter().map(round).collect();
        let mut got = to_f32(&st.tensor(name).unwrap());
        if let Some(h) = heads {
            let (rows, cols) = g.rows_cols();
            assert_ne!(got, want, "{name} should have been un-permuted");
            got = permute(&got, rows, cols, h);
        }
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{name} differs from the gguf");
    }
}

/// Quantised to Q4_1 on load, the f32 export gives back the GGUF's own
/// Q4_1 blocks: ggml's quantiser puts each block's minimum at 0 and its
/// maximum at 15, so a block dequantised and quantised again lands on the
/// same grid (the 4-bit quantiser checked against a model's real blocks).
fn check_requant_q4_1(e: &Exported) {
    use spinfer_formats::requant::{Requant, Requantized};
    let st = open_model(e.dir()).unwrap();
    let q = Requantized::new(st.as_ref(), Requant::Q4_1);
    let (mut blocks, mut same) = (0usize, 0usize);
    for name in ["blk.0.attn_v.weight", "blk.0.attn_output.weight", "blk.7.ffn_gate.weight", "blk.29.ffn_down.weight"] {
        let (g, t) = (e.gguf.tensor(name).unwrap(), q.tensor(name).unwrap());
        assert_eq!((g.ty, t.ty), (GgmlType::Q4_1, GgmlType::Q4_1), "{name}");
        for (a, b) in g.data.bytes().chunks(20).zip(t.data.bytes().chunks(20)) {
            blocks += 1;
            same += usize::from(a == b);
        }
    }
    assert!(same == blocks, "{same} of {blocks} Q4_1 blocks came back as the gguf's");
    assert_eq!(q.tensor("token_embd.weight").unwrap().ty, GgmlType::Q8_0, "the embedding stays 8-bit");
}

/// The exported `tokenizer.json` tokenises like the GGUF vocabulary.
fn check_tokenizer(e: &Exported) {
    use spinfer_engine::tokenizer::Tokenizer;
    let ours = Tokenizer::from_gguf(&e.gguf).unwrap();
    let hf = Tokenizer::from_json_file(&e.dir().join("tokenizer.json")).unwrap();
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

/// The export computes the GGUF's function (precise mode: f32 activations,
/// weights dequantised on the fly) through NeoX RoPE instead of the GGUF's
/// interleaved RoPE: last-position logits within `tol`, same argmax.
fn check_logits(e: &Exported, tol: f32) {
    use spinfer_engine::model::{Model, ModelOptions, Precision};
    use spinfer_engine::registry::KernelRegistry;
    use spinfer_engine::tokenizer::Tokenizer;
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
    let got = logits(e.dir());
    let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    let max = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("max |logit difference| {max}");
    assert!(max <= tol, "max |logit difference| {max} > {tol}");
    assert_eq!(argmax(&got), argmax(&want));
}

#[test]
fn f32_export_is_the_gguf() {
    let Some(e) = export(OutDType::F32) else { return };
    check_config(&e);
    check_tensors(&e, GgmlType::F32);
    check_weights(&e, |v| v);
    check_requant_q4_1(&e);
    check_tokenizer(&e);
    check_logits(&e, 1e-3);
}

#[test]
fn bf16_export_is_the_gguf_rounded() {
    let Some(e) = export(OutDType::BF16) else { return };
    check_config(&e);
    check_tensors(&e, GgmlType::BF16);
    check_weights(&e, bf16_round);
    check_tokenizer(&e);
    check_logits(&e, 0.5);
}
