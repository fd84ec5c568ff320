//! The CLI's output contracts: `--quiet` prints exactly the result,
//! `perplexity` ends with `ppl <value>`, `--json` prints one object with
//! the documented keys, progress and logs stay off stdout.

use std::path::Path;
use std::process::{Command, Output};

use spinfer_engine::tuning::select::TIE_MARGIN;

fn spinfer(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_spinfer")).args(args).output().unwrap();
    assert!(out.status.success(), "spinfer {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn generate_quiet_prints_exactly_the_continuation() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let m = m.to_str().unwrap();
    let o = spinfer(&["generate", "-m", m, "-p", "The capital of France is", "-n", "1", "--temp", "0", "--quiet"]);
    assert_eq!(stdout(&o), " Paris");
    let o = spinfer(&["generate", "-m", m, "-p", "The capital of France is", "-n", "2", "--temp", "0", "--json"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["text"], " Paris.");
    assert_eq!(v["prompt_tokens"], 5);
    assert!(v["decode_tokens_per_second"].is_number());
}

#[test]
fn generate_stops_at_stop_string() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let o = spinfer(&[
        "generate",
        "-m",
        m.to_str().unwrap(),
        "-p",
        "The capital of France is",
        "-n",
        "24",
        "--temp",
        "0",
        "--stop",
        "\n",
        "--quiet",
    ]);
    assert_eq!(stdout(&o), " Paris.");
}

#[test]
fn perplexity_last_line_is_ppl() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let text =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/wikitext-2-raw/wiki.test.head.raw");
    let o = spinfer(&[
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "-c",
        "128",
        "--windows",
        "2",
    ]);
    let out = stdout(&o);
    let last = out.lines().last().unwrap();
    let ppl: f64 = last.strip_prefix("ppl ").expect("last line starts with 'ppl '").parse().unwrap();
    assert!(ppl > 1.0 && ppl < 1000.0, "{ppl}");
    let o = spinfer(&[
        "perplexity",
        "-m",
        m.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "-c",
        "128",
        "--windows",
        "2",
        "--quiet",
    ]);
    assert_eq!(stdout(&o), format!("{last}\n"), "--quiet prints only the figure");
}

#[test]
fn bench_json_has_the_documented_keys() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let o = spinfer(&["bench", "-m", m.to_str().unwrap(), "-t", "1", "-r", "1", "--json", "--int8"]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    for k in ["pp128", "pp512", "tg128"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k} in {v}");
    }
    assert!(v["peak_rss_bytes"].as_u64().is_some_and(|x| x > 0), "{v}");
}

/// `--batch B` turns tg N into tg NxB, B sequences decoding together.
#[test]
fn bench_batch_reports_the_batched_decode() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let args = ["bench", "-m", m.to_str().unwrap(), "-t", "1", "-r", "1", "--json", "--tests", "tg"];
    let o = spinfer(&[&args[..], &["--gen", "4", "--batch", "3"]].concat());
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(v["tg4x3"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    assert!(v.get("tg4").is_none(), "{v}");
}

/// `--depth D` starts every test from a cache holding D tokens, alone
/// and batched, and says so.
#[test]
fn bench_depth_starts_from_a_filled_cache() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let args =
        ["bench", "-m", m.to_str().unwrap(), "-t", "1", "-r", "1", "--tests", "tg", "--gen", "4", "--depth", "40"];
    let v: serde_json::Value =
        serde_json::from_str(stdout(&spinfer(&[&args[..], &["--json", "--batch", "2"]].concat())).trim()).unwrap();
    assert_eq!(v["depth"], 40, "{v}");
    assert!(v["tg4x2"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    let text = stdout(&spinfer(&args));
    assert!(text.contains("| tg4 @ d40 |"), "{text}");
}

/// The KV cache is f16 unless precise mode or `--kv-cache` says f32, and
/// the bench says which it ran.
#[test]
fn bench_reports_the_kv_cache_type() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let args = ["bench", "-m", m.to_str().unwrap(), "-t", "1", "-r", "1", "--json", "--tests", "tg", "--gen", "2"];
    for (flags, want) in [(&[][..], "f16"), (&["--precise"][..], "f32"), (&["--kv-cache", "f32"][..], "f32")] {
        let v: serde_json::Value = serde_json::from_str(stdout(&spinfer(&[&args[..], flags].concat())).trim()).unwrap();
        assert_eq!(v["kv_cache"], want, "{flags:?}: {v}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_spinfer")).args(args).args(["--kv-cache", "q8_0"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--kv-cache") && err.contains("q8_0"), "{err}");
}

/// `--quantize q8_0` on a bf16 checkpoint (SmolLM2 exported by `spinfer
/// convert`): the weight matrices are read as Q8_0 (34 bytes per 32
/// weights instead of 64), and with a memory budget it is refused.
#[test]
fn quantize_on_load_reads_q8_0_bytes() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let out = dir.path().join("bf16");
    spinfer(&["convert", "-m", m.to_str().unwrap(), "-o", out.to_str().unwrap(), "--dtype", "bf16"]);
    let args = ["bench", "-m", out.to_str().unwrap(), "-t", "2", "-r", "1", "--json", "--tests", "tg", "--gen", "2"];
    let bytes = |flags: &[&str]| {
        let v: serde_json::Value = serde_json::from_str(stdout(&spinfer(&[&args[..], flags].concat())).trim()).unwrap();
        v["bytes_per_token"].as_f64().unwrap()
    };
    let (bf16, q8) = (bytes(&[]), bytes(&["--quantize", "q8_0"]));
    assert!((q8 / bf16 - 34.0 / 64.0).abs() < 0.01, "{q8} / {bf16}");
    let o = Command::new(env!("CARGO_BIN_EXE_spinfer"))
        .args(args)
        .args(["--quantize", "q8_0", "--mem-budget-mb", "400"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("memory budget") && err.contains("q8_0"), "{err}");
}

#[test]
fn inspect_lists_hyper_parameters_and_tensors() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let out = stdout(&spinfer(&["inspect", m.to_str().unwrap()]));
    for needle in ["architecture: llama", "layers             30", "gpt2-bpe", "blk.0.ffn_down.weight", "q4_1"] {
        assert!(out.contains(needle), "inspect output lacks {needle:?}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&stdout(&spinfer(&["inspect", m.to_str().unwrap(), "--json"]))).unwrap();
    assert_eq!(v["tensors"].as_array().unwrap().len(), 272);
}

#[test]
fn help_exists_for_every_command() {
    for cmd in ["generate", "perplexity", "bench", "inspect", "convert"] {
        let out = stdout(&spinfer(&[cmd, "--help"]));
        assert!(out.contains("Usage:"), "{cmd} --help");
    }
}

#[test]
fn tune_records_history_that_kernels_then_uses() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let m = m.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let hist = dir.path().join("history");
    let h = hist.to_str().unwrap();
    let before: serde_json::Value = serde_json::from_str(&stdout(&spinfer(&["kernels", "-m", m, "--json"]))).unwrap();
    assert!(before.as_array().unwrap().iter().all(|op| op["why"].as_str().unwrap().starts_with("default")), "{before}");
    spinfer(&["tune", "-m", m, "--history", h, "-t", "1", "--quiet"]);
    let after: serde_json::Value =
        serde_json::from_str(&stdout(&spinfer(&["kernels", "-m", m, "--history", h, "--json"]))).unwrap();
    let ops = after.as_array().unwrap();
    assert_eq!(ops.len(), 5, "{after}");
    for op in ops {
        assert_eq!(op["why"], "measured", "{op}");
        let alts = op["alternatives"].as_array().unwrap();
        assert!(alts.len() >= 2 && alts.iter().all(|a| a["median_ns"].as_u64().is_some()), "{op}");
        // The chosen kernel is the fastest measured one, or tied with it:
        // within the selection's margin (5%), a tie goes to registry order,
        // since rankings that close flip between runs on a shared machine.
        let fastest = alts.iter().map(|a| a["median_ns"].as_u64().unwrap()).min().unwrap();
        let chosen = alts
            .iter()
            .find(|a| a["kernel"].as_str().unwrap().ends_with(op["kernel"].as_str().unwrap()))
            .and_then(|a| a["median_ns"].as_u64())
            .unwrap_or_else(|| panic!("the chosen kernel is not among the measured alternatives: {op}"));
        assert!(chosen as f64 <= fastest as f64 * (1.0 + TIE_MARGIN), "{op}");
    }
}

#[test]
fn bench_vs_dense_reports_the_paired_ratio() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let m = m.to_str().unwrap();
    // Without a sidecar there is nothing to compare: a clear error.
    let o =
        Command::new(env!("CARGO_BIN_EXE_spinfer")).args(["bench", "-m", m, "--vs-dense", "-t", "1"]).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("give --sparsity"), "{o:?}");

    let dir = tempfile::tempdir().unwrap();
    let sidecar = dir.path().join("im.spinfer");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/wikitext-2-raw/wiki.test.raw");
    spinfer(&[
        "calibrate",
        "-m",
        m,
        "--text",
        text.to_str().unwrap(),
        "--offset",
        "800000",
        "--tokens",
        "512",
        "--target-sparsity",
        "0.3",
        "--predictor-kind",
        "input-magnitude",
        "-t",
        "2",
        "--quiet",
        "-o",
        sidecar.to_str().unwrap(),
    ]);
    let o = spinfer(&[
        "bench",
        "-m",
        m,
        "--sparsity",
        sidecar.to_str().unwrap(),
        "--vs-dense",
        "-r",
        "2",
        "-t",
        "2",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(v["rounds"], 2, "{v}");
    assert_eq!(v["test"], "tg128", "{v}");
    for k in ["dense", "sparse", "ratio_median", "ratio_min", "ratio_max"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0 && x.is_finite()), "{k} in {v}");
    }
    let (lo, mid, hi) =
        (v["ratio_min"].as_f64().unwrap(), v["ratio_median"].as_f64().unwrap(), v["ratio_max"].as_f64().unwrap());
    assert!(lo <= mid && mid <= hi, "{v}");
    assert!(v["rounds_sparse_faster"].as_u64().is_some_and(|x| x <= 2), "{v}");
}

/// `spinfer kernels` lists the CUDA provider with its score and, where it
/// cannot run (CI: no build feature or no driver), score 0 and the reason.
#[test]
fn kernels_lists_the_cuda_provider_with_its_score() {
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let out = stdout(&spinfer(&["kernels", "-m", m.to_str().unwrap()]));
    let line = out.lines().find(|l| l.starts_with("cuda (spinfer-kernels-cuda): score ")).expect("a cuda line");
    match spinfer_kernels_cuda::probe() {
        Ok(dev) => assert!(line.contains(&dev.name), "{line}"),
        Err(why) => assert_eq!(line, format!("cuda (spinfer-kernels-cuda): score 0: {why}")),
    }
}

/// A reader that has gone (`spinfer inspect MODEL | head -0`) ends the
/// process by SIGPIPE, as it ends `cat`, not with a panic message.
#[test]
fn closed_stdout_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let Some(m) = spinfer_test_support::smollm2() else { return };
    let mut child = Command::new(env!("CARGO_BIN_EXE_spinfer"))
        .args(["inspect", m.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}: {stderr}", out.status);
}
