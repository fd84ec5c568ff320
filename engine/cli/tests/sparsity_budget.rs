//! A memory budget below the model's FFN size: generation works from the
//! hot/cold FFN bundle; the peak RSS of the `spinfer` process stays under
//! budget + non-FFN weights + 80 MB, and at least the cold FFN bytes below
//! the unbudgeted run's, measured in the same test.

use std::path::Path;
use std::process::Command;

/// SmolLM2-135M Q4_1: everything in the file except the 30 layers' gate,
/// up and down matrices (3 × 552,960 bytes each): token embedding (also
/// the tied output projection, read in full every token), attention,
/// norms.
const FFN_BYTES: u64 = 30 * 3 * 552_960;

fn generate(model: &Path, sidecar: &Path, budget: Option<&str>) -> serde_json::Value {
    generate_with(model, sidecar, budget, &[])
}

fn generate_with(model: &Path, sidecar: &Path, budget: Option<&str>, extra: &[&str]) -> serde_json::Value {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spinfer"));
    cmd.args(["generate", "-m", model.to_str().unwrap(), "--sparsity", sidecar.to_str().unwrap()])
        .args(["--predictor", "low-rank", "-p", "The history of the city is long and complicated.", "-n", "32"])
        .args(["--temp", "0", "-c", "512", "-t", "2", "--json"]);
    if let Some(b) = budget {
        cmd.args(["--ffn-budget-mb", b]);
    }
    cmd.args(extra);
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_20mb_ffn_budget_holds_in_peak_rss() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let sidecar = dir.path().join("s.spinfer");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/wikitext-2-raw/wiki.test.raw");
    let out = Command::new(env!("CARGO_BIN_EXE_spinfer"))
        .args(["calibrate", "-m", model.to_str().unwrap(), "--text", text.to_str().unwrap()])
        .args(["--offset", "800000", "--tokens", "1024", "--rank", "64", "--target-sparsity", "0.5", "-t", "2"])
        .args(["--out", sidecar.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // First budgeted run writes the bundle (streaming), the second reuses it.
    let first = generate(&model, &sidecar, Some("20"));
    assert!(dir.path().join("s.spinfer.ffn").exists());
    let v = generate(&model, &sidecar, Some("20"));
    let free = generate(&model, &sidecar, None);
    let rss = |v: &serde_json::Value| v["peak_rss_bytes"].as_u64().expect("peak_rss_bytes reported");
    assert_eq!(v["tokens"].as_array().unwrap().len(), 32, "{v}");
    assert_eq!(v["tokens"], free["tokens"], "the budget changes where weights live, not the result");
    let b = &v["sparsity"]["budget"];
    assert!(b["hot_neurons"].as_u64().unwrap() < b["total_neurons"].as_u64().unwrap(), "{b}");
    assert!(b["session"]["misses"].as_u64().unwrap() > 0, "{b}");

    let file = std::fs::metadata(&model).unwrap().len();
    let non_ffn = file - FFN_BYTES;
    let budget = 20_000_000;
    // The absolute bound: budget + non-FFN weights + 80 MB for the rest of
    // the process (binary and libraries, allocator, KV cache of a 512
    // context = 30 × 512 × 192 × 4 × 2 = 23.6 MB, the low-rank predictor,
    // activations). That rest measured 27 MB on an Intel Xeon with AMX
    // here and 52 MB on another Xeon (120.5 MB peak: how much of the
    // mapped file a touched page brings with it, fault-around and large
    // page-cache folios, and transparent huge pages differ by kernel and
    // machine); 80 MB is 1.5× the worst measured.
    let bound = budget + non_ffn + 80_000_000;
    eprintln!(
        "peak RSS: budget 20 MB {:.1} MB (first run, writing the bundle: {:.1} MB), no budget {:.1} MB; bound {:.1} MB; \
         decode {:.1} vs {:.1} tok/s",
        rss(&v) as f64 / 1e6,
        rss(&first) as f64 / 1e6,
        rss(&free) as f64 / 1e6,
        bound as f64 / 1e6,
        v["decode_tokens_per_second"].as_f64().unwrap(),
        free["decode_tokens_per_second"].as_f64().unwrap(),
    );
    assert!(rss(&v) < bound, "peak RSS {} above {bound}", rss(&v));
    assert!(rss(&first) < bound, "peak RSS {} above {bound} while writing the bundle", rss(&first));
    // Against the baseline taken in this test, on this machine (whatever
    // its page-cache and allocator behaviour): the budget keeps at least
    // the cold FFN bytes (all FFN bytes minus the budget) out of memory.
    // Measured: 66 MB saved here against the 29.8 MB asked.
    assert!(
        rss(&v) + (FFN_BYTES - budget) < rss(&free),
        "budgeted {} vs unbudgeted {}: less than the {} cold FFN bytes saved",
        rss(&v),
        rss(&free),
        FFN_BYTES - budget
    );

    // One memory budget for everything (--mem-budget-mb): the FFN bundle
    // takes its share, attention and head stream what does not fit; the
    // tokens are still the unbudgeted run's, and the RSS stays within the
    // whole budget plus the same 80 MB for the rest of the process.
    let whole = generate_with(&model, &sidecar, None, &["--mem-budget-mb", "60"]);
    assert_eq!(whole["tokens"], free["tokens"], "one memory budget changes where weights live, not the result");
    assert!(rss(&whole) < 60_000_000 + 80_000_000, "peak RSS {} under --mem-budget-mb 60", rss(&whole));
}
