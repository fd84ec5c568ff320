//! The quality and speed curve of the sparse FFN on all-MiniLM-L6-v2
//! (`engine/embed/src/experimental/bert_sparse.rs`).
//!
//! ```sh
//! cargo run --release -p spinfer-tests --example minilm_sparse_curve -- \
//!     [models/all-MiniLM-L6-v2] [--levels 0.3,0.5,0.7,0.8,0.9] [--lines 2000] [--threads 2] [--speed 256]
//! ```
//!
//! Calibrates once (WikiText-2 test lines after byte 800,000, the same text
//! selection as `spinfer calibrate-embed`), then per target sparsity: min
//! and mean cosine to the dense embeddings of the 16 reference sentences,
//! STS-B test Spearman (dense: 0.8205), the measured kept fraction on STS-B,
//! and speed in sentences/s at batch 1 and 32 over the first `--speed`
//! STS-B sentences, dense and sparse timed back to back (dense, sparse,
//! dense, sparse; best of the two runs each).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use spinfer_engine::embed::{Embedder, EmbedderOptions, cosine, sts};
use spinfer_tests::{data, minilm};

fn main() -> Result<()> {
    let mut model: Option<PathBuf> = None;
    let mut levels = vec![0.3f32, 0.5, 0.7, 0.8, 0.9];
    let (mut lines, mut threads, mut speed) = (2000usize, 2usize, 256usize);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = || it.next().context("missing value");
        match a.as_str() {
            "--levels" => levels = val()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--lines" => lines = val()?.parse()?,
            "--threads" => threads = val()?.parse()?,
            "--speed" => speed = val()?.parse()?,
            s if s.starts_with("--") => bail!("unknown option {s}"),
            s => model = Some(PathBuf::from(s)),
        }
    }
    let Some(dir) = model.or_else(minilm) else { bail!("no model") };
    let mk = |batch_size| {
        Embedder::load(&dir, EmbedderOptions { threads, batch_size, ..EmbedderOptions::default() })
            .context("load embedder")
    };
    let mut e = mk(32)?;

    let raw = std::fs::read(data("wikitext-2-raw/wiki.test.raw"))?;
    let texts = e.calibration_texts(&raw, 800_000, lines)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let t0 = Instant::now();
    let sidecars = e.calibrate_sparsity_targets(&refs, &levels, "wiki.test.raw after byte 800000")?;
    eprintln!(
        "calibrated on {} texts, {} tokens in {:.1} s",
        sidecars[0].calibration.texts,
        sidecars[0].calibration.tokens,
        t0.elapsed().as_secs_f64()
    );

    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data("reference/all-MiniLM-L6-v2.json"))?)?;
    let ref_texts: Vec<String> = reference["sentences"]
        .as_array()
        .context("sentences")?
        .iter()
        .map(|s| s["text"].as_str().unwrap_or_default().to_string())
        .collect();
    let ref_refs: Vec<&str> = ref_texts.iter().map(String::as_str).collect();
    let pairs = sts::read(&data("stsbenchmark/sts-test.csv"))?;
    let sts_texts: Vec<&str> = pairs.iter().flat_map(|p| [p.sentence1.as_str(), p.sentence2.as_str()]).collect();
    let gold: Vec<f64> = pairs.iter().map(|p| p.score).collect();
    let spearman = |e: &Embedder| -> Result<f64> {
        let v = e.embed_batch(&sts_texts)?;
        let sims: Vec<f64> = v.chunks_exact(2).map(|v| f64::from(cosine(&v[0], &v[1]))).collect();
        Ok(sts::spearman(&sims, &gold))
    };
    let speed_texts = &sts_texts[..speed.min(sts_texts.len())];
    let rate = |e: &Embedder, batch: usize| -> Result<f64> {
        let t0 = Instant::now();
        for c in speed_texts.chunks(batch) {
            e.embed_batch(c)?;
        }
        Ok(speed_texts.len() as f64 / t0.elapsed().as_secs_f64())
    };

    let dense16 = e.embed_batch(&ref_refs)?;
    let dense_rho = spearman(&e)?;
    println!(
        "dense: STS-B Spearman {dense_rho:.5}; {threads} threads; speed over {} STS-B sentences",
        speed_texts.len()
    );
    println!();
    println!(
        "| target | thresholds (layers 0-5) | kept (STS-B) | min cos | mean cos | Spearman | Δ | b1 dense | b1 sparse | \
         b1 × | b32 dense | b32 sparse | b32 × |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for s in sidecars {
        let target = s.target_sparsity;
        let th: Vec<String> = s.thresholds.iter().map(|t| format!("{t:.3}")).collect();
        e.set_sparsity(Some(s), &PathBuf::from(format!("<target {target}>")))?;
        let sparse16 = e.embed_batch(&ref_refs)?;
        let cos: Vec<f32> = sparse16.iter().zip(&dense16).map(|(a, b)| cosine(a, b)).collect();
        let min = cos.iter().copied().fold(1.0f32, f32::min);
        let mean = cos.iter().sum::<f32>() / cos.len() as f32;
        e.sparse_ffn().context("sparse")?.reset_stats();
        let rho = spearman(&e)?;
        let kept = e.sparse_ffn().context("sparse")?.kept_fraction();
        let sidecar = e.sparse_ffn().and_then(|s| s.sidecar.clone());
        // Speed: dense and sparse back to back, twice, best of each.
        let mut best = [[0.0f64; 2]; 2]; // [batch 1, batch 32] x [dense, sparse]
        for _ in 0..2 {
            for (bi, batch) in [1usize, 32].into_iter().enumerate() {
                e.set_sparsity(None, &PathBuf::new())?;
                best[bi][0] = best[bi][0].max(rate(&e, batch)?);
                e.set_sparsity(sidecar.clone(), &PathBuf::from("<sparse>"))?;
                best[bi][1] = best[bi][1].max(rate(&e, batch)?);
            }
        }
        println!(
            "| {target} | {} | {kept:.3} | {min:.5} | {mean:.5} | {rho:.5} | {:+.5} | {:.1} | {:.1} | {:.2} | {:.1} | {:.1} | \
             {:.2} |",
            th.join(" "),
            rho - dense_rho,
            best[0][0],
            best[0][1],
            best[0][1] / best[0][0],
            best[1][0],
            best[1][1],
            best[1][1] / best[1][0],
        );
    }
    Ok(())
}
