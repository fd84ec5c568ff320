//! Counts and sizes from a file, a config or a flag are checked before
//! anything is allocated from them: each case is refused with an error
//! naming the key or flag (exit 1, no panic, no abort), and the engine
//! still loads the good model afterwards in the same process.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use spinfer_engine::Engine;
use spinfer_engine::generate::GenerateParams;
use spinfer_engine::model::ModelOptions;
use spinfer_engine::sampling::SamplerParams;

fn spinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spinfer")).args(args).output().unwrap()
}

/// Runs `spinfer args...`, asserts exit 1 (not a panic's 101, not an abort's
/// signal) without a panic message, returns stderr.
fn fails(args: &[&str]) -> String {
    let out = spinfer(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "spinfer {args:?}: {:?}; stderr: {stderr}", out.status);
    assert!(!stderr.contains("panicked") && !stderr.contains("memory allocation"), "spinfer {args:?}: {stderr}");
    stderr
}

fn assert_mentions(stderr: &str, parts: &[&str]) {
    for p in parts {
        assert!(stderr.contains(p), "stderr should mention {p:?}: {stderr}");
    }
}

/// A copy of the GGUF at `src` in `dir` with the u32 metadata value of
/// `key` replaced by `value`.
fn patch_u32(src: &Path, dir: &Path, key: &str, value: u32) -> PathBuf {
    let mut bytes = std::fs::read(src).unwrap();
    // Encoded key: u64 length, the bytes, then the u32 type id 4 (u32).
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(key.as_bytes());
    let at = bytes.windows(needle.len()).position(|w| w == needle.as_slice()).expect("key present") + needle.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4, "{key} is not a u32");
    bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
    let out = dir.join(format!("{key}-{value}.gguf"));
    std::fs::write(&out, bytes).unwrap();
    out
}

fn greedy(n: usize) -> GenerateParams {
    GenerateParams { max_tokens: n, sampler: SamplerParams::greedy(), ..Default::default() }
}

/// The good model loads and generates: the engine is usable after a refusal.
fn still_usable(model: &Path) {
    let engine = Engine::load(model, ModelOptions { ctx: 64, threads: 2, ..Default::default() }).unwrap();
    let out = engine.generate("The capital of France is", &greedy(2)).unwrap();
    assert_eq!(out.tokens.len(), 2);
}

#[test]
fn huge_block_count_is_refused_naming_the_key() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bad = patch_u32(&model, dir.path(), "llama.block_count", i32::MAX as u32);
    let bad_s = bad.to_str().unwrap();
    let want = ["llama.block_count", "2147483647", "tensors for 30 blocks"];

    let e = fails(&["generate", "-m", bad_s, "-p", "hi", "-n", "2", "--quiet"]);
    assert_mentions(&e, &want);
    // `inspect` does not print the value as if it were fine.
    assert_mentions(&fails(&["inspect", bad_s]), &want);

    // One block more than the file has: refused the same way.
    let one_more = patch_u32(&model, dir.path(), "llama.block_count", 31);
    let e = fails(&["generate", "-m", one_more.to_str().unwrap(), "-p", "hi", "-n", "2", "--quiet"]);
    assert_mentions(&e, &["llama.block_count", "= 31", "tensors for 30 blocks"]);

    // In the library: an error, then the good model loads in the same process.
    let e = Engine::load(&bad, ModelOptions::default()).unwrap_err().to_string();
    assert_mentions(&e, &want);
    still_usable(&model);
}

#[test]
fn head_count_and_sizes_are_checked_against_tensor_shapes() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("llama.attention.head_count", u32::MAX, "blk.0.attn_q.weight"),
        ("llama.attention.head_count_kv", 1 << 30, "blk.0.attn_k.weight"),
        ("llama.feed_forward_length", u32::MAX, "blk.0.ffn_gate.weight"),
        ("llama.embedding_length", u32::MAX, "token_embd.weight"),
    ];
    for (key, value, tensor) in cases {
        let bad = patch_u32(&model, dir.path(), key, value);
        let e = Engine::load(&bad, ModelOptions::default()).unwrap_err().to_string();
        // Either the key is named against the tensor, or the values are
        // refused as inconsistent before any tensor is looked at.
        assert!(
            (e.contains(key) && e.contains(tensor)) || e.contains("overflows") || e.contains("not a multiple"),
            "{key} = {value}: {e}"
        );
        assert!(e.contains(bad.to_str().unwrap()), "{e}");
    }
    still_usable(&model);
}

#[test]
fn huge_ctx_is_refused_with_the_flag_and_the_bytes() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let m = model.to_str().unwrap();
    for ctx in ["4294967296", "18446744073709551615", "100000000"] {
        let t = std::time::Instant::now();
        let e = fails(&["generate", "-m", m, "-p", "hi", "-n", "2", "-c", ctx, "--quiet"]);
        assert_mentions(&e, &["--ctx", ctx, "8192"]);
        assert!(e.contains("bytes") || e.contains("overflows"), "{e}");
        // Refused before allocating: no time spent filling a RoPE table.
        assert!(t.elapsed().as_secs() < 30, "ctx {ctx} took {:?}", t.elapsed());
    }
    // perplexity's window is the context too.
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "hello world ".repeat(50)).unwrap();
    let e = fails(&["perplexity", "-m", m, "-f", text.to_str().unwrap(), "-c", "4294967296", "--quiet"]);
    assert_mentions(&e, &["--ctx", "4294967296"]);
    // A config's [model] ctx is checked the same way.
    let cfg = dir.path().join("spinfer.toml");
    std::fs::write(&cfg, format!("[model]\npath = {:?}\nctx = 100000000\n", m)).unwrap();
    let e = fails(&["generate", "--config", cfg.to_str().unwrap(), "-p", "hi", "-n", "2", "--quiet"]);
    assert_mentions(&e, &["[model] ctx", "100000000"]);

    // In the library: errors, then the good model still loads.
    for ctx in [1usize << 32, usize::MAX, 100_000_000] {
        let o = ModelOptions { ctx, ..Default::default() };
        let e = Engine::load(&model, o).unwrap_err().to_string();
        assert_mentions(&e, &["--ctx", &ctx.to_string()]);
    }
    still_usable(&model);
}

#[test]
fn ctx_above_the_trained_context_is_allowed_with_a_warning() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let out =
        spinfer(&["generate", "-m", model.to_str().unwrap(), "-p", "hi", "-n", "1", "-c", "16384", "--temp", "0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.matches("exceeds the 8192 positions the model was trained for").count(), 1, "{stderr}");
}

#[test]
fn sizing_flags_are_validated() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let m = model.to_str().unwrap();
    let gen_with = |extra: &[&str]| {
        let mut args = vec!["generate", "-m", m, "-p", "hi", "-n", "1", "--quiet"];
        args.extend_from_slice(extra);
        fails(&args)
    };
    assert_mentions(&gen_with(&["-c", "0"]), &["--ctx", "at least 1"]);
    assert_mentions(&gen_with(&["-t", "0"]), &["--threads", "at least 1"]);
    assert_mentions(&gen_with(&["-t", "1000000"]), &["--threads", "1000000", "1024"]);
    // Values that are not counts at all are usage errors (clap: exit 2).
    for bad in [["--ctx=-5"], ["--n-predict=-1"], ["--threads=1e9"]] {
        let mut args = vec!["generate", "-m", m, "-p", "hi", "--quiet"];
        args.extend_from_slice(&bad);
        let out = spinfer(&args);
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {e}");
        assert_mentions(&e, &["invalid value", bad[0].split('=').nth(1).unwrap()]);
    }
    assert_mentions(&fails(&["bench", "-m", m, "--reps", "1000000000000", "--quiet"]), &["--reps"]);
    assert_mentions(&fails(&["bench", "-m", m, "--batch", "100000", "--quiet"]), &["--batch", "100000"]);
    assert_mentions(&fails(&["bench", "-m", m, "--depth", "1000000000", "--quiet"]), &["--depth", "1000000000"]);
    // Past the 8192 positions SmolLM2 was trained for: refused before any
    // prefill.
    assert_mentions(&fails(&["bench", "-m", m, "--depth", "8100", "--tests", "tg", "--quiet"]), &["--depth", "8192"]);
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "hello world ".repeat(50)).unwrap();
    let out = dir.path().join("s.spinfer");
    let (t, o) = (text.to_str().unwrap(), out.to_str().unwrap());
    assert_mentions(&fails(&["calibrate", "-m", m, "--text", t, "-o", o, "--window", "0", "--quiet"]), &["--window"]);
    let e = fails(&["calibrate", "-m", m, "--text", t, "-o", o, "--rank", "1048576", "--quiet"]);
    assert_mentions(&e, &["--rank", "1048576"]);
}

#[test]
fn huge_bert_layer_count_is_refused_naming_the_key() {
    let Some(minilm) = spinfer_test_support::minilm() else { return };
    // The model directory with every file linked but config.json, whose
    // layer count claims 2^31 - 1.
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&minilm).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "config.json" {
            std::os::unix::fs::symlink(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(minilm.join("config.json")).unwrap()).unwrap();
    config["num_hidden_layers"] = serde_json::json!(i32::MAX);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let e = fails(&["embed", "-m", dir.path().to_str().unwrap(), "hello", "-q"]);
    assert_mentions(&e, &["num_hidden_layers", "2147483647", "tensors for 6 layers"]);
    // The good model still embeds.
    let out = spinfer(&["embed", "-m", minilm.to_str().unwrap(), "hello", "-q"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
