//! Export of a GGUF model as a Hugging Face checkpoint: `model.safetensors`
//! (HF names, `[rows, cols]` shapes, dequantised to F32 or BF16),
//! `config.json`, `tokenizer.json` and `tokenizer_config.json`.
//!
//! llama.cpp's converter permutes the q/k rows of llama-architecture models
//! so that RoPE can rotate adjacent pairs; the export undoes that, so the
//! result is a genuine HF checkpoint for `rotate_half` (NeoX) RoPE. Qwen2
//! GGUFs are not permuted and are exported as they are.
//!
//! The weights file is written tensor by tensor (one dequantised tensor in
//! memory at a time) to a `.partial` file that is renamed when complete.

mod tokenizer;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use serde::Serialize;
use serde_json::{Value, json};
use spinfer_kernels::dequant::dequantize_row;

use crate::gguf::{GgufFile, TensorInfo};
use crate::model::{Arch, ModelConfig};
use crate::safetensors::{HfLayout, canonical_to_hf_in, offset_norm};
use crate::tensor::TensorView;
use crate::{Error, Result};
use tokenizer::tokenizer_config_json;
pub use tokenizer::tokenizer_json;

/// Element type of the exported weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDType {
    F32,
    BF16,
}

impl OutDType {
    /// The safetensors dtype name.
    pub fn name(self) -> &'static str {
        match self {
            OutDType::F32 => "F32",
            OutDType::BF16 => "BF16",
        }
    }

    fn torch_name(self) -> &'static str {
        match self {
            OutDType::F32 => "float32",
            OutDType::BF16 => "bfloat16",
        }
    }

    fn size(self) -> usize {
        match self {
            OutDType::F32 => 4,
            OutDType::BF16 => 2,
        }
    }
}

/// One tensor of the export.
struct Planned<'a> {
    info: &'a TensorInfo,
    hf_name: String,
    /// HF (row-major) shape: the GGUF dims reversed.
    shape: Vec<usize>,
    /// Head count to un-permute the rows by (llama q/k).
    unpermute_heads: Option<usize>,
    /// A Gemma norm: the file holds `1 + w`, the checkpoint `w`.
    minus_one: bool,
}

/// Converts `src` into an HF checkpoint in `out_dir` (created if needed):
/// `model.safetensors`, `config.json`, `tokenizer.json`,
/// `tokenizer_config.json`. `progress(done, total)` is called after each
/// tensor (and once with `done = 0`).
///
/// Fails before writing anything if the architecture, a tensor or the
/// tokenizer model has no HF equivalent.
pub fn gguf_to_safetensors(
    src: &GgufFile,
    out_dir: &Path,
    dtype: OutDType,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let cfg = ModelConfig::from_gguf(src)?;
    let tokenizer = tokenizer_json(src)?;
    let tokenizer_config = tokenizer_config_json(src, &cfg)?;
    let plan = plan(src, &cfg)?;
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;

    let weights = out_dir.join("model.safetensors");
    let partial = out_dir.join("model.safetensors.partial");
    if let Err(e) = write_weights(src, &plan, &partial, dtype, progress) {
        // Best effort: the error being reported matters more.
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, &weights).map_err(|e| Error::io(&weights, e))?;

    write_file(&out_dir.join("config.json"), &pretty(&config_json(src, &cfg, dtype))?)?;
    write_file(&out_dir.join("tokenizer.json"), &tokenizer)?;
    write_file(&out_dir.join("tokenizer_config.json"), &pretty(&tokenizer_config)?)?;
    Ok(())
}

fn plan<'a>(src: &'a GgufFile, cfg: &ModelConfig) -> Result<Vec<Planned<'a>>> {
    let layout = if cfg.arch == Arch::Gemma3 { HfLayout::Gemma3 } else { HfLayout::Llama };
    src.tensors
        .iter()
        .map(|info| {
            let hf_name = canonical_to_hf_in(&info.name, layout).ok_or_else(|| {
                Error::format(
                    src.path(),
                    format!("tensor '{}' has no hugging face equivalent; it cannot be exported", info.name),
                )
            })?;
            if info.dims.len() > 2 {
                let d = format!(
                    "tensor '{}' has {} dimensions; only 1-d and 2-d tensors can be exported",
                    info.name,
                    info.dims.len()
                );
                return Err(Error::format(src.path(), d));
            }
            let is = |suffixes: [&str; 2]| suffixes.iter().any(|s| info.name.ends_with(s));
            let unpermute_heads = match cfg.arch {
                Arch::Llama if is([".attn_q.weight", ".attn_q.bias"]) => Some(cfg.n_heads),
                Arch::Llama if is([".attn_k.weight", ".attn_k.bias"]) => Some(cfg.n_kv_heads),
                _ => None,
            };
            let shape: Vec<usize> = info.dims.iter().rev().copied().collect();
            if let Some(h) = unpermute_heads.filter(|&h| h == 0 || !shape[0].is_multiple_of(2 * h)) {
                let d =
                    format!("tensor '{}' has {} rows, which do not split into {h} heads of pairs", info.name, shape[0]);
                return Err(Error::format(src.path(), d));
            }
            Ok(Planned { info, hf_name, shape, unpermute_heads, minus_one: offset_norm(&info.name, layout) })
        })
        .collect()
}

fn write_weights(
    src: &GgufFile,
    plan: &[Planned],
    path: &Path,
    dtype: OutDType,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0usize;
    for p in plan {
        let len = p.shape.iter().product::<usize>() * dtype.size();
        header.insert(
            p.hf_name.clone(),
            json!({ "dtype": dtype.name(), "shape": p.shape, "data_offsets": [offset, offset + len] }),
        );
        offset += len;
    }
    let mut header = serde_json::to_vec(&header).map_err(|e| Error::format(path, format!("header: {e}")))?;
    // Pad with spaces so that tensor data starts 8-byte aligned.
    header.resize(header.len().next_multiple_of(8), b' ');

    let io = |e| Error::io(path, e);
    let mut w = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
    w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&header).map_err(io)?;
    progress(0, plan.len());
    let mut buf = Vec::new();
    for (i, p) in plan.iter().enumerate() {
        let t = src.tensor(&p.info.name)?;
        let mut vals = dequantize(src.path(), &t)?;
        if let Some(heads) = p.unpermute_heads {
            let rows = p.shape[0];
            vals = unpermute_rows(&vals, rows, vals.len() / rows, heads);
        }
        if p.minus_one {
            vals.iter_mut().for_each(|v| *v -= 1.0);
        }
        for chunk in vals.chunks(1 << 16) {
            buf.clear();
            match dtype {
                OutDType::F32 => chunk.iter().for_each(|x| buf.extend_from_slice(&x.to_le_bytes())),
                OutDType::BF16 => {
                    chunk.iter().for_each(|x| buf.extend_from_slice(&half::bf16::from_f32(*x).to_le_bytes()))
                }
            }
            w.write_all(&buf).map_err(io)?;
        }
        progress(i + 1, plan.len());
    }
    w.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
}

/// A tensor's elements as f32, rows dequantised on all cores.
fn dequantize(path: &Path, t: &TensorView) -> Result<Vec<f32>> {
    let cols = t.dims.first().copied().unwrap_or(1);
    t.map_rows(cols, || (), |_, r, d| dequantize_row(t.ty, r, d)).map_err(|detail| Error::TensorType {
        path: path.to_path_buf(),
        tensor: t.name.clone(),
        ty: t.ty.name().into(),
        what: format!("cannot be dequantised: {detail}"),
    })
}

/// Undoes llama.cpp's q/k permutation of a `[rows, cols]` row-major matrix
/// (or a bias, `cols = 1`): `permute(w, n_head)` is
/// `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)`,
/// so permuted row `h*hd + 2i + j` is original row `h*hd + j*hd/2 + i`.
pub fn unpermute_rows(data: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    assert!(n_head > 0 && rows.is_multiple_of(2 * n_head) && data.len() == rows * cols, "unpermute_rows: bad geometry");
    let (hd, half) = (rows / n_head, rows / n_head / 2);
    let mut out = vec![0f32; data.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let (src, dst) = (h * hd + 2 * i + j, h * hd + j * half + i);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

pub(crate) fn token_id(src: &GgufFile, key: &str) -> Option<u64> {
    src.get(key).and_then(|v| v.as_u64()).filter(|&v| v < u64::from(u32::MAX))
}

/// HF `config.json` for `LlamaForCausalLM`, `Qwen2ForCausalLM` or
/// `Gemma3ForCausalLM`.
fn config_json(src: &GgufFile, cfg: &ModelConfig, dtype: OutDType) -> Value {
    let (arch, model_type) = match cfg.arch {
        Arch::Llama => ("LlamaForCausalLM", "llama"),
        Arch::Qwen2 => ("Qwen2ForCausalLM", "qwen2"),
        Arch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
    };
    let mut c = json!({
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.ctx_train,
        "rms_norm_eps": cfg.rms_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": null,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tied_embeddings,
        "torch_dtype": dtype.torch_name(),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": true,
    });
    let o = c.as_object_mut().expect("object literal");
    match cfg.arch {
        Arch::Llama => {
            o.insert("attention_bias".into(), json!(cfg.qkv_bias));
            o.insert("mlp_bias".into(), json!(false));
        }
        Arch::Gemma3 => {
            o.remove("hidden_act");
            o.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
            o.insert("query_pre_attn_scalar".into(), json!(cfg.head_dim));
            o.insert("attn_logit_softcapping".into(), Value::Null);
            o.insert("final_logit_softcapping".into(), Value::Null);
            o.insert("attention_bias".into(), json!(false));
            if let Some(w) = cfg.sliding_window {
                let types: Vec<&str> = (0..cfg.n_layers)
                    .map(|l| if w.is_local(l) { "sliding_attention" } else { "full_attention" })
                    .collect();
                o.insert("sliding_window".into(), json!(w.window));
                o.insert("layer_types".into(), json!(types));
                o.insert("rope_local_base_freq".into(), json!(w.rope_theta));
            }
        }
        Arch::Qwen2 => {
            o.insert("use_sliding_window".into(), json!(false));
            o.insert("sliding_window".into(), json!(cfg.ctx_train));
            o.insert("max_window_layers".into(), json!(cfg.n_layers));
        }
    }
    for (key, gguf_key) in [
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(id) = token_id(src, gguf_key) {
            o.insert(key.into(), json!(id));
        }
    }
    c
}

pub(crate) fn pretty<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string_pretty(v).map_err(|e| Error::InvalidArgument(format!("json serialisation failed: {e}")))
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::Loader;
    use crate::safetensors::SafetensorsModel;
    use spinfer_formats::fixtures::gguf::{Tensor, Value as Kv, build};

    fn vals(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7 + seed * 13) % 23) as f32 * 0.37 - 3.1).collect()
    }

    const TOKENS: [&str; 10] = ["<|endoftext|>", "a", "b", "Ġ", "ab", "Ġa", "Ġab", "1", "2", "12"];

    /// A one-layer model (hidden 8, 2 heads, 1 kv head, ffn 16, vocab 10)
    /// with a byte-level BPE vocabulary; qwen2 gets q/k/v biases.
    fn tiny_gguf(arch: &'static str, tok_model: &'static str) -> tempfile::NamedTempFile {
        let a = |k: &str| format!("{arch}.{k}");
        let kv = [
            ("general.architecture".into(), Kv::Str(arch.into())),
            (a("block_count"), Kv::U32(1)),
            (a("context_length"), Kv::U32(64)),
            (a("embedding_length"), Kv::U32(8)),
            (a("feed_forward_length"), Kv::U32(16)),
            (a("attention.head_count"), Kv::U32(2)),
            (a("attention.head_count_kv"), Kv::U32(1)),
            (a("rope.freq_base"), Kv::F32(100000.0)),
            (a("attention.layer_norm_rms_epsilon"), Kv::F32(1e-5)),
            ("tokenizer.ggml.model".into(), Kv::Str(tok_model.into())),
            ("tokenizer.ggml.pre".into(), Kv::Str("smollm".into())),
            ("tokenizer.ggml.tokens".into(), Kv::Strs(TOKENS.iter().map(|t| t.to_string()).collect())),
            ("tokenizer.ggml.token_type".into(), Kv::I32s(vec![3, 1, 1, 1, 1, 1, 1, 1, 1, 1])),
            ("tokenizer.ggml.merges".into(), Kv::Strs(["a b", "Ġ a", "Ġ ab", "1 2"].map(String::from).to_vec())),
            ("tokenizer.ggml.bos_token_id".into(), Kv::U32(0)),
            ("tokenizer.ggml.eos_token_id".into(), Kv::U32(0)),
            ("tokenizer.ggml.add_bos_token".into(), Kv::Bool(false)),
        ];
        let t = |name: &'static str, dims: Vec<u64>, seed| {
            let n = dims.iter().product::<u64>() as usize;
            Tensor::f32(name, &dims, &vals(n, seed))
        };
        let mut tensors = vec![
            t("token_embd.weight", vec![8, 10], 0),
            t("blk.0.attn_norm.weight", vec![8], 1),
            t("blk.0.attn_q.weight", vec![8, 8], 2),
            t("blk.0.attn_k.weight", vec![8, 4], 3),
            t("blk.0.attn_v.weight", vec![8, 4], 4),
            t("blk.0.attn_output.weight", vec![8, 8], 5),
            t("blk.0.ffn_norm.weight", vec![8], 6),
            t("blk.0.ffn_gate.weight", vec![8, 16], 7),
            t("blk.0.ffn_up.weight", vec![8, 16], 8),
            t("blk.0.ffn_down.weight", vec![16, 8], 9),
            t("output_norm.weight", vec![8], 10),
        ];
        if arch == "qwen2" {
            tensors.push(t("blk.0.attn_q.bias", vec![8], 11));
            tensors.push(t("blk.0.attn_k.bias", vec![4], 12));
            tensors.push(t("blk.0.attn_v.bias", vec![4], 13));
        }
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), build(&kv, &tensors)).unwrap();
        f
    }

    fn f32_of(t: &TensorView) -> Vec<f32> {
        dequantize(Path::new("x"), t).unwrap()
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // numpy: permute(arange(6)[:, None], 1) = [0, 3, 1, 4, 2, 5].
        assert_eq!(unpermute_rows(&[0., 3., 1., 4., 2., 5.], 6, 1, 1), [0., 1., 2., 3., 4., 5.]);
        // Two heads of four rows, two columns.
        let p = [0., 0., 2., 2., 1., 1., 3., 3., 4., 4., 6., 6., 5., 5., 7., 7.];
        let want: Vec<f32> = (0..8).flat_map(|i| [i as f32; 2]).collect();
        assert_eq!(unpermute_rows(&p, 8, 2, 2), want);
    }

    #[test]
    fn tiny_round_trip() {
        for (arch, n_tensors) in [("llama", 11), ("qwen2", 14)] {
            let f = tiny_gguf(arch, "gpt2");
            let g = GgufFile::open(f.path()).unwrap();
            for dtype in [OutDType::F32, OutDType::BF16] {
                let dir = tempfile::tempdir().unwrap();
                let mut calls = Vec::new();
                gguf_to_safetensors(&g, dir.path(), dtype, &mut |d, n| calls.push((d, n))).unwrap();
                assert_eq!((calls.first(), calls.last()), (Some(&(0, n_tensors)), Some(&(n_tensors, n_tensors))));
                check_export(&g, dir.path(), dtype);
            }
        }
    }

    /// The export in `dir` reopens with `g`'s config and (un-permuted,
    /// rounded) weights and tokenises as `g`'s vocabulary does.
    fn check_export(g: &GgufFile, dir: &Path, dtype: OutDType) {
        let st = SafetensorsModel::open(dir).unwrap();
        let mut want = g.config().unwrap();
        let llama = want.arch == Arch::Llama;
        want.rope_style = crate::model::RopeStyle::NeoX;
        assert_eq!(st.config().unwrap(), want);
        assert_eq!(st.tensor_names().len(), g.tensors.len());
        for info in &g.tensors {
            let (a, b) = (g.tensor(&info.name).unwrap(), st.tensor(&info.name).unwrap());
            assert_eq!(a.dims, b.dims, "{}", info.name);
            let (mut a, b) = (f32_of(&a), f32_of(&b));
            let heads = if info.name.contains("attn_q") { 2 } else { 1 };
            if llama && (info.name.contains("attn_q") || info.name.contains("attn_k")) {
                let (rows, cols) = match info.dims[..] {
                    [n] => (n, 1),
                    [c, r] => (r, c),
                    _ => unreachable!(),
                };
                let unpermuted = unpermute_rows(&a, rows, cols, heads);
                assert_ne!(a, unpermuted, "{}", info.name);
                a = unpermuted;
            }
            let round = |x: f32| {
                if dtype == OutDType::BF16 { half::bf16::from_f32(x).to_f32() } else { x }
            };
            assert_eq!(a.into_iter().map(round).collect::<Vec<_>>(), b, "{}", info.name);
        }
        let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["torch_dtype"], if dtype == OutDType::F32 { "float32" } else { "bfloat16" });
        assert_eq!(cfg["architectures"][0], if llama { "LlamaForCausalLM" } else { "Qwen2ForCausalLM" });

        let text = "ab ab12<|endoftext|>b";
        let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids, [4, 6, 7, 8, 0, 2]);
        let gguf_tok = crate::tokenizer::Tokenizer::from_gguf(g).unwrap();
        assert_eq!(gguf_tok.encode(text, false).unwrap(), ids);
        let ours = crate::tokenizer::Tokenizer::from_json_file(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(ours.encode(text, false).unwrap(), ids);
    }

    #[test]
    fn unsupported_inputs_fail_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        for (model, says) in [
            ("bert", "tokenizer export is not supported for tokenizer model 'bert'"),
            ("llama", "'tokenizer.ggml.scores' is missing"),
        ] {
            let f = tiny_gguf("llama", model);
            let g = GgufFile::open(f.path()).unwrap();
            let e = gguf_to_safetensors(&g, dir.path(), OutDType::F32, &mut |_, _| {}).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
            assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        }
        let f = tiny_gguf("gpt2", "gpt2");
        let e = gguf_to_safetensors(&GgufFile::open(f.path()).unwrap(), dir.path(), OutDType::F32, &mut |_, _| {});
        assert!(e.unwrap_err().to_string().contains("unsupported architecture 'gpt2'"));
    }

    /// The tokenizer exported from the SmolLM2 GGUF matches the model's own
    /// `tokenizer.json` (skipped when either file is absent).
    #[test]
    fn smollm2_tokenizer_matches_reference() {
        let Some(model) = spinfer_test_support::smollm2() else { return };
        // The model's tokenizer.json, copied into the repository with its
        // licence (tests/data/README.md).
        let reference = spinfer_test_support::data("smollm2-135m-instruct/tokenizer.json");
        let ours = tokenizer_json(&GgufFile::open(&model).unwrap()).unwrap();
        let theirs = std::fs::read_to_string(reference).unwrap();
        let (o, t): (Value, Value) = (serde_json::from_str(&ours).unwrap(), serde_json::from_str(&theirs).unwrap());
        for key in ["added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder", "model"] {
            assert_eq!(o[key], t[key], "{key}");
        }
        let (o, t): (tokenizers::Tokenizer, tokenizers::Tokenizer) = (ours.parse().unwrap(), theirs.parse().unwrap());
        for text in ["Hello world! 12345", "<|im_start|>user\nWhat's 2+2?<|im_end|>", "  tabs\tand ünïcödé 日本語"]
        {
            assert_eq!(o.encode(text, false).unwrap().get_ids(), t.encode(text, false).unwrap().get_ids(), "{text}");
        }
    }
}
