//! `spinfer embed` and `spinfer eval-sts`: output contracts and bad input.

use std::process::{Command, Output};

use spinfer_test_support::{minilm, workspace};

fn spinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spinfer")).args(args).output().unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = spinfer(args);
    assert!(out.status.success(), "spinfer {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Row `i` of the sentence-transformers reference embeddings.
fn reference_row(i: usize) -> Vec<f32> {
    let bytes = std::fs::read(workspace().join("tests/data/reference/all-MiniLM-L6-v2.embeddings.f32")).unwrap();
    bytes[i * 384 * 4..(i + 1) * 384 * 4].chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (n(a) * n(b))
}

#[test]
fn embed_jsonl_gives_one_object_per_line_in_order() {
    let Some(m) = minilm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("lines.txt");
    // Line 2 is empty: an empty input, not skipped. The trailing newline
    // ends line 3 and adds no input.
    std::fs::write(&f, "Hello world\n\nA man is playing a guitar.\n").unwrap();
    let out = ok(&["embed", "-m", m.to_str().unwrap(), "--file", f.to_str().unwrap(), "--format", "jsonl", "-q"]);
    let rows: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 3, "{out}");
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["index"], i);
        assert_eq!(r["embedding"].as_array().unwrap().len(), 384);
        assert_eq!(r["truncated"], false);
    }
    assert_eq!((rows[0]["tokens"].as_u64(), rows[1]["tokens"].as_u64()), (Some(4), Some(2)));
    let third: Vec<f32> = rows[2]["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert!(cosine(&third, &reference_row(0)) >= 0.9999);

    // Texts on the command line, and the .npy format.
    let npy = dir.path().join("e.npy");
    ok(&["embed", "-m", m.to_str().unwrap(), "--format", "npy", "-o", npy.to_str().unwrap(), "-q", "a", "b c"]);
    let bytes = std::fs::read(&npy).unwrap();
    assert!(bytes.starts_with(b"\x93NUMPY\x01\x00"));
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("'descr': '<f4'") && header.contains("'shape': (2, 384)"), "{header}");
    assert_eq!((10 + header_len) % 64, 0);
    assert_eq!(bytes.len(), 10 + header_len + 2 * 384 * 4);
    let out = spinfer(&["embed", "-m", m.to_str().unwrap(), "--format", "npy", "x"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("-o"));

    // Without --quiet the summary on stderr names the matmuls' kernels,
    // so the precision they ran in shows: f32 alone when reduced precision
    // is off.
    for reduced in ["1", "0"] {
        let out = Command::new(env!("CARGO_BIN_EXE_spinfer"))
            .args(["embed", "-m", m.to_str().unwrap(), "hello"])
            .env("SPINFER_EMBED_REDUCED", reduced)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let kernels = err.split("| matmuls: ").nth(1).and_then(|k| k.split(']').next()).unwrap_or_default();
        assert!(!kernels.trim().is_empty(), "no kernels named in {err}");
        if reduced == "0" {
            assert!(kernels.contains("f32*f32") && !kernels.contains("bf16") && !kernels.contains("i16"), "{err}");
        }
    }
}

#[test]
fn eval_sts_quiet_prints_a_single_number() {
    let Some(m) = minilm() else { return };
    let sts = workspace().join("tests/data/stsbenchmark/sts-test.csv");
    let out = ok(&["eval-sts", "-m", m.to_str().unwrap(), "--file", sts.to_str().unwrap(), "--quiet"]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 1, "{out}");
    let rho: f64 = lines[0].parse().expect("a number");
    assert!((rho - 0.8205).abs() < 0.002, "{rho}");
}

#[test]
fn invalid_utf8_input_file_is_named() {
    let Some(m) = minilm() else { return };
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad-lines.txt");
    std::fs::write(&f, b"fine\nnot \xff utf-8\n").unwrap();
    let out = spinfer(&["embed", "-m", m.to_str().unwrap(), "--file", f.to_str().unwrap(), "-q"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad-lines.txt") && err.contains("line 2") && err.contains("UTF-8"), "{err}");
    assert!(out.stdout.is_empty());
}
