//! all-MiniLM-L6-v2 sentence embeddings against the sentence-transformers
//! reference (`tests/data/reference/all-MiniLM-L6-v2.*`) and the STS-B test
//! set. Run in release (`cargo test --release -p spinfer-tests --test minilm`).

use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use serde::Deserialize;
use spinfer_engine::embed::{Embedder, EmbedderOptions, cosine, sts};
use spinfer_tests::{data, minilm};

#[derive(Deserialize)]
struct Reference {
    max_len: usize,
    sentences: Vec<RefSentence>,
}

#[derive(Deserialize)]
struct RefSentence {
    text: String,
    input_ids: Vec<u32>,
}

fn reference() -> (Reference, Vec<Vec<f32>>) {
    let s = std::fs::read_to_string(data("reference/all-MiniLM-L6-v2.json")).expect("reference json");
    let r: Reference = serde_json::from_str(&s).expect("reference json parses");
    let bytes = std::fs::read(data("reference/all-MiniLM-L6-v2.embeddings.f32")).expect("reference embeddings");
    let all: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    assert_eq!(all.len(), r.sentences.len() * 384, "reference embeddings are 16 x 384");
    let rows = all.chunks_exact(384).map(<[f32]>::to_vec).collect();
    (r, rows)
}

/// One embedder shared by the tests of this binary (`None`: skip).
fn embedder() -> Option<&'static Embedder> {
    static E: OnceLock<Option<Embedder>> = OnceLock::new();
    E.get_or_init(|| minilm().map(|dir| Embedder::load(&dir, EmbedderOptions::default()).expect("minilm loads")))
        .as_ref()
}

#[test]
fn token_ids_and_embeddings_match_the_reference() {
    let Some(e) = embedder() else { return };
    let (r, want) = reference();
    assert_eq!((e.dimensions(), e.max_tokens(), e.normalizes()), (384, r.max_len, true));
    for s in &r.sentences {
        let t = e.tokenize(&s.text).unwrap();
        assert_eq!(t.ids, s.input_ids, "token ids of {:?}", s.text);
    }
    let texts: Vec<&str> = r.sentences.iter().map(|s| s.text.as_str()).collect();
    let got = e.embed_batch(&texts).unwrap();
    let mut worst = (1.0f32, 0.0f32);
    for ((s, g), w) in r.sentences.iter().zip(&got).zip(&want) {
        let c = cosine(g, w);
        let d = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        worst = (worst.0.min(c), worst.1.max(d));
        assert!(c >= 0.9999, "cosine {c} for {:?}", s.text);
    }
    eprintln!("min cosine vs reference {:.7}, max abs diff {:.2e}", worst.0, worst.1);
}

/// STS-B test Spearman of cosine similarity. The reference README gives
/// 0.8184 for this protocol (mean pooling, L2 norm, 1379 pairs), but that is
/// not what the reference model computes on this file: the embeddings here
/// match the reference ones to cosine 0.9999999, and an independent f64
/// NumPy implementation of the same model gives 0.820471 as well (padded
/// batches, Python `csv` quoting, CLS/max/pooler pooling give 0.8199,
/// 0.8208, 0.735, 0.788, 0.731: none 0.8184). So the test pins 0.8205.
const STS_SPEARMAN: f64 = 0.8205;

#[test]
fn sts_benchmark_spearman() {
    let Some(e) = embedder() else { return };
    let pairs = sts::read(&data("stsbenchmark/sts-test.csv")).unwrap();
    assert_eq!(pairs.len(), 1379);
    let t0 = Instant::now();
    let a = e.embed_batch(&pairs.iter().map(|p| p.sentence1.as_str()).collect::<Vec<_>>()).unwrap();
    let b = e.embed_batch(&pairs.iter().map(|p| p.sentence2.as_str()).collect::<Vec<_>>()).unwrap();
    let sims: Vec<f64> = a.iter().zip(&b).map(|(x, y)| f64::from(cosine(x, y))).collect();
    let gold: Vec<f64> = pairs.iter().map(|p| p.score).collect();
    let rho = sts::spearman(&sims, &gold);
    eprintln!("STS-B test Spearman {rho:.5} ({} sentences in {:.1} s)", 2 * pairs.len(), t0.elapsed().as_secs_f64());
    assert!((rho - STS_SPEARMAN).abs() <= 0.001, "Spearman {rho}");
}

#[test]
fn a_batch_of_mixed_lengths_equals_one_at_a_time() {
    let Some(e) = embedder() else { return };
    let long = "word ".repeat(120);
    let longer = "other words ".repeat(100);
    // 350 tokens in all: the forward pass takes them in two runs of
    // sequences (at most 256 tokens each, the last text alone).
    let texts =
        ["Hi", "", "A much longer sentence, with several clauses, commas and words in it.", &long, "x y", &longer];
    let batch = e.embed_batch(&texts).unwrap();
    for (t, b) in texts.iter().zip(&batch) {
        let one = e.embed(t).unwrap();
        let d = one.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(d <= 1e-5, "{t:?}: batch and single differ by {d}");
        // The packed kernels compute a token the same way in any batch.
        if e.model().prepacked().is_some() {
            assert_eq!(&one, b, "{t:?}: batch and single differ");
        }
    }
}

#[test]
fn overlong_input_is_truncated_and_flagged() {
    let Some(e) = embedder() else { return };
    let text = "lorem ipsum dolor ".repeat(200);
    let t = e.tokenize(&text).unwrap();
    assert!(t.truncated && t.original_len > 256);
    assert_eq!(t.ids.len(), 256);
    assert_eq!((t.ids[0], t.ids[255]), (101, 102), "[CLS] first, [SEP] last");
    let r = e.embed_batch_detailed(&[&text, "short"]).unwrap();
    assert_eq!((r[0].truncated, r[0].tokens, r[1].truncated, r[1].tokens), (true, 256, false, 3));
}

#[test]
fn empty_string_is_cls_sep() {
    let Some(e) = embedder() else { return };
    assert_eq!(e.tokenize("").unwrap().ids, vec![101, 102]);
    let v = e.embed("").unwrap();
    assert_eq!(v.len(), 384);
    let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
}

/// A copy of the model directory (files symlinked) without `drop`.
fn model_dir_without(dir: &Path, drop: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if name == drop {
            continue;
        }
        if name == "1_Pooling" {
            std::fs::create_dir(tmp.path().join("1_Pooling")).unwrap();
            if drop != "1_Pooling/config.json" {
                std::os::unix::fs::symlink(entry.path().join("config.json"), tmp.path().join("1_Pooling/config.json"))
                    .unwrap();
            }
            continue;
        }
        std::os::unix::fs::symlink(entry.path(), tmp.path().join(&name)).unwrap();
    }
    tmp
}

#[test]
fn missing_files_are_named() {
    let Some(dir) = minilm() else { return };
    for missing in ["tokenizer.json", "1_Pooling/config.json", "config.json", "model.safetensors"] {
        let tmp = model_dir_without(&dir, missing);
        let e = Embedder::load(tmp.path(), EmbedderOptions::default()).expect_err(missing).to_string();
        assert!(e.contains(missing), "error for missing {missing}: {e}");
    }
}
