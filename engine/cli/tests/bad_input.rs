//! Bad input never panics: each case exits non-zero with a message on
//! stderr naming the file, tensor or key at fault.

use std::path::{Path, PathBuf};
use std::process::Command;

use spinfer_formats::fixtures::gguf::{Tensor, Value, build};

/// A GGUF file under construction: metadata and F32 tensors that a test
/// then breaks (written by `spinfer_formats::fixtures::gguf`).
struct Gguf {
    kv: Vec<(String, Value)>,
    tensors: Vec<Tensor>,
}

impl Gguf {
    /// A structurally valid one-layer llama with F32 weights.
    fn tiny_llama() -> Self {
        let kv = vec![
            ("general.architecture".into(), Value::Str("llama".into())),
            ("llama.block_count".into(), Value::U32(1)),
            ("llama.context_length".into(), Value::U32(64)),
            ("llama.embedding_length".into(), Value::U32(32)),
            ("llama.feed_forward_length".into(), Value::U32(64)),
            ("llama.attention.head_count".into(), Value::U32(2)),
            ("llama.attention.head_count_kv".into(), Value::U32(1)),
            ("llama.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-5)),
            ("llama.vocab_size".into(), Value::U32(32)),
        ];
        let tensors = vec![
            Tensor::zeros("token_embd.weight", &[32, 32]),
            Tensor::zeros("blk.0.attn_norm.weight", &[32]),
            Tensor::zeros("blk.0.attn_q.weight", &[32, 32]),
            Tensor::zeros("blk.0.attn_k.weight", &[32, 16]),
            Tensor::zeros("blk.0.attn_v.weight", &[32, 16]),
            Tensor::zeros("blk.0.attn_output.weight", &[32, 32]),
            Tensor::zeros("blk.0.ffn_norm.weight", &[32]),
            Tensor::zeros("blk.0.ffn_gate.weight", &[32, 64]),
            Tensor::zeros("blk.0.ffn_up.weight", &[32, 64]),
            Tensor::zeros("blk.0.ffn_down.weight", &[64, 32]),
            Tensor::zeros("output_norm.weight", &[32]),
        ];
        Gguf { kv, tensors }
    }

    fn bytes(&self) -> Vec<u8> {
        build(&self.kv, &self.tensors)
    }

    fn write(&self, dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, self.bytes()).unwrap();
        p
    }
}

/// Runs `spinfer args...`, asserts failure without a panic, returns stderr.
fn fails(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_spinfer")).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "spinfer {args:?} succeeded; stderr: {stderr}");
    assert_eq!(out.status.code(), Some(1), "spinfer {args:?} should exit 1 (101 = panic); stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "spinfer {args:?} panicked: {stderr}");
    stderr
}

fn generate(model: &Path) -> String {
    fails(&["generate", "-m", model.to_str().unwrap(), "-p", "hi", "-n", "1", "--quiet"])
}

fn assert_mentions(stderr: &str, parts: &[&str]) {
    for p in parts {
        assert!(stderr.contains(p), "stderr should mention {p:?}: {stderr}");
    }
}

#[test]
fn truncated_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = Gguf::tiny_llama().bytes();
    for cut in [10, 200, bytes.len() - 100] {
        let p = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let e = generate(&p);
        assert_mentions(&e, &[p.to_str().unwrap()]);
        assert!(e.contains("truncated") || e.contains("past the end"), "{e}");
    }
}

#[test]
fn wrong_magic() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("model.gguf");
    let mut b = Gguf::tiny_llama().bytes();
    b[..4].copy_from_slice(b"GGML");
    std::fs::write(&p, b).unwrap();
    assert_mentions(&generate(&p), &["model.gguf", "not a GGUF file"]);
}

#[test]
fn unknown_tensor_type() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gguf::tiny_llama();
    g.tensors[2].ty = 99;
    let p = g.write(dir.path(), "m.gguf");
    assert_mentions(&generate(&p), &["m.gguf", "blk.0.attn_q.weight", "#99"]);
}

#[test]
fn offset_past_end_of_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = Gguf::tiny_llama().bytes();
    // Drop the last tensor's data: its offset now points past the end.
    b.truncate(b.len() - 128);
    let p = dir.path().join("short.gguf");
    std::fs::write(&p, b).unwrap();
    assert_mentions(&generate(&p), &["short.gguf", "output_norm.weight", "past the end"]);
}

#[test]
fn missing_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gguf::tiny_llama();
    g.tensors.retain(|t| t.name != "blk.0.ffn_up.weight");
    let p = g.write(dir.path(), "m.gguf");
    assert_mentions(&generate(&p), &["m.gguf", "blk.0.ffn_up.weight", "not found"]);
}

#[test]
fn shape_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gguf::tiny_llama();
    g.tensors[8].dims = vec![32, 48];
    let p = g.write(dir.path(), "m.gguf");
    assert_mentions(&generate(&p), &["m.gguf", "blk.0.ffn_up.weight", "[32, 48]", "[32, 64]"]);
}

#[test]
fn unsupported_architecture() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gguf::tiny_llama();
    g.kv[0].1 = Value::Str("mamba".into());
    let p = g.write(dir.path(), "m.gguf");
    assert_mentions(&generate(&p), &["m.gguf", "unsupported architecture 'mamba'"]);
}

#[test]
fn missing_metadata_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut g = Gguf::tiny_llama();
    g.kv.retain(|k| k.0 != "llama.block_count");
    let p = g.write(dir.path(), "m.gguf");
    assert_mentions(&generate(&p), &["m.gguf", "llama.block_count", "missing"]);
}

#[test]
fn missing_model_file() {
    let e = generate(Path::new("/nonexistent/model.gguf"));
    assert_mentions(&e, &["/nonexistent/model.gguf", "no such file"]);
}

#[test]
fn non_utf8_prompt_file() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, b"caf\xe9 au lait").unwrap();
    let model = Gguf::tiny_llama().write(dir.path(), "m.gguf");
    let e = fails(&["generate", "-m", model.to_str().unwrap(), "-f", prompt.to_str().unwrap(), "--quiet"]);
    assert_mentions(&e, &["prompt.txt", "not valid UTF-8"]);
}

#[test]
fn context_overflow() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let long = "word ".repeat(100);
    let e = fails(&["generate", "-m", model.to_str().unwrap(), "-p", &long, "-c", "16", "-n", "4", "--quiet"]);
    assert_mentions(&e, &["context overflow", "16"]);
}

#[test]
fn bad_sampling_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let model = Gguf::tiny_llama().write(dir.path(), "m.gguf");
    let e = fails(&["generate", "-m", model.to_str().unwrap(), "-p", "x", "--top-p", "0", "--quiet"]);
    assert_mentions(&e, &["top-p"]);
}

#[test]
fn bad_head_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let model = Gguf::tiny_llama().write(dir.path(), "m.gguf");
    let m = model.to_str().unwrap();
    let e = fails(&["generate", "-m", m, "-p", "x", "--head", "sparse", "--quiet"]);
    assert_mentions(&e, &["--head sparse", "--head-index"]);
    let junk = dir.path().join("junk.spinfer-head");
    std::fs::write(&junk, b"not a head index at all").unwrap();
    let e = fails(&["generate", "-m", m, "-p", "x", "--head-index", junk.to_str().unwrap(), "--head-probes", "0"]);
    assert_mentions(&e, &["--head-probes"]);
    let out = dir.path().join("out.spinfer-head");
    let out = out.to_str().unwrap();
    for (flag, value) in [("--target-ppl", "-0.5"), ("--target-ppl", "inf"), ("--target-tv", "0")] {
        let arg = format!("{flag}={value}");
        let e = fails(&["calibrate-head", "-m", m, "--text", m, "--out", out, &arg, "--quiet"]);
        assert_mentions(&e, &[flag]);
    }
    // Index files are read once the model has loaded.
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let m = model.to_str().unwrap();
    let missing = dir.path().join("none.spinfer-head");
    let e = fails(&["generate", "-m", m, "-p", "x", "--head-index", missing.to_str().unwrap(), "--quiet"]);
    assert_mentions(&e, &["none.spinfer-head"]);
    let e = fails(&["generate", "-m", m, "-p", "x", "--head-index", junk.to_str().unwrap(), "--quiet"]);
    assert_mentions(&e, &["junk.spinfer-head", "bad magic"]);
}

/// `--device cuda` on a machine (or build) without CUDA says why, and flags
/// the GPU path does not support are refused by name before anything loads.
#[test]
fn cuda_device_without_cuda_or_with_cpu_only_flags() {
    let dir = tempfile::tempdir().unwrap();
    let model = Gguf::tiny_llama().write(dir.path(), "tiny.gguf");
    let m = model.to_str().unwrap();
    let err = fails(&["generate", "-m", m, "-p", "hi", "-n", "2", "--device", "cuda", "--sparsity", "x.json"]);
    assert_mentions(&err, &["--sparsity", "--device cuda"]);
    let err = fails(&["generate", "-m", m, "-p", "hi", "-n", "2", "--device", "cuda", "--precise"]);
    assert_mentions(&err, &["--precise", "--device cuda"]);
    // The hybrid split's budget: only on the GPU, only with frequencies.
    let err = fails(&["generate", "-m", m, "-p", "hi", "-n", "2", "--gpu-budget-mb", "50"]);
    assert_mentions(&err, &["--gpu-budget-mb", "--device cuda"]);
    let err = fails(&["generate", "-m", m, "-p", "hi", "-n", "2", "--device", "cuda", "--gpu-budget-mb", "50"]);
    assert_mentions(&err, &["--gpu-budget-mb", "--sparsity"]);
    // An operator config: the settings the GPU path does not honour are
    // refused by name.
    let config = |extra: &str| {
        let p = dir.path().join("spinfer.toml");
        std::fs::write(&p, format!("[model]\npath = {:?}\n{extra}", model.to_str().unwrap())).unwrap();
        p
    };
    for (extra, named) in [
        ("precision = \"precise\"\n", "[model] precision"),
        ("[sparsity]\nfile = \"x.json\"\nlookahead = true\n", "[sparsity] lookahead"),
        ("[memory]\nbudget_mb = 50\n", "[memory]"),
        ("[sparsity]\nfile = \"x.json\"\npredictor = \"top-k\"\n", "[sparsity] predictor"),
    ] {
        let c = config(extra);
        let err = fails(&["generate", "--config", c.to_str().unwrap(), "-p", "hi", "-n", "2", "--device", "cuda"]);
        assert_mentions(&err, &[named, "--device cuda"]);
    }
    // The sparse head runs on the GPU too, but needs its index (named
    // before the device is looked for).
    let err = fails(&["generate", "-m", m, "-p", "hi", "-n", "2", "--device", "cuda", "--head", "sparse"]);
    assert_mentions(&err, &["--head-index"]);
    if spinfer_kernels_cuda::probe().is_err() {
        // No device here (CI): the reason, whichever it is, with a flag or
        // a config ([cuda] budget_mb) naming the model.
        let err = fails(&["generate", "-m", m, "-p", "hi", "-n", "2", "--device", "cuda"]);
        assert!(err.contains("cuda"), "{err}");
        let c = config("[cuda]\nbudget_mb = 50\n");
        let err = fails(&["generate", "--config", c.to_str().unwrap(), "-p", "hi", "-n", "2", "--device", "cuda"]);
        assert!(err.contains("cuda"), "{err}");
    }
}
