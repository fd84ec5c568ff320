//! Semantic search over the STS benchmark's sentences: every distinct
//! sentence of `tests/data/stsbenchmark/sts-test.csv` is embedded with the
//! MiniLM sentence embedder, inserted into a ruvector-core `VectorDB`
//! (HNSW, cosine distance, stored in a temporary directory), and a few
//! queries print their five nearest sentences.
//!
//! ```sh
//! cargo run --release -p spinfer-engine --example semantic_search -- \
//!     [MODEL_DIR] [--csv FILE] [--limit N] [QUERY...]
//! ```
//!
//! MODEL_DIR defaults to `models/all-MiniLM-L6-v2` (fetched by
//! `scripts/fetch-models.sh`). The example checks that a sentence of the
//! index, used as a query, comes back first.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Instant;

use ruvector_core::VectorDB;
use ruvector_core::types::{DbOptions, DistanceMetric, HnswConfig, SearchQuery, VectorEntry};
use spinfer_engine::embed::{Embedder, EmbedderOptions};
use spinfer_engine::provider::EmbeddingProvider;

type BoxError = Box<dyn std::error::Error>;

fn main() -> Result<(), BoxError> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut model = root.join("models/all-MiniLM-L6-v2");
    let mut csv = root.join("tests/data/stsbenchmark/sts-test.csv");
    let mut limit = usize::MAX;
    let mut queries: Vec<String> = Vec::new();
    let mut args = std::env::args().skip(1);
    let mut model_given = false;
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--csv" => csv = value()?.into(),
            "--limit" => limit = value()?.parse()?,
            "-h" | "--help" => {
                eprintln!("usage: semantic_search [MODEL_DIR] [--csv FILE] [--limit N] [QUERY...]");
                return Ok(());
            }
            _ if !model_given && std::path::Path::new(&a).is_dir() => {
                model = a.into();
                model_given = true;
            }
            _ => queries.push(a),
        }
    }

    // Every distinct sentence (columns 6 and 7, 1-based, tab-separated).
    let text = std::fs::read_to_string(&csv).map_err(|e| format!("{}: {e}", csv.display()))?;
    let mut seen = HashSet::new();
    let mut sentences: Vec<String> = Vec::new();
    for line in text.lines() {
        let cols: Vec<&str> = line.split('\t').collect();
        for s in cols.iter().skip(5).take(2) {
            let s = s.trim();
            if !s.is_empty() && seen.insert(s.to_string()) {
                sentences.push(s.to_string());
            }
        }
    }
    sentences.truncate(limit);
    println!("{} distinct sentences from {}", sentences.len(), csv.display());

    let embedder = Embedder::load(&model, EmbedderOptions::default())?;
    let provider: &dyn EmbeddingProvider = &embedder;
    let t = Instant::now();
    let refs: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let vectors = provider.embed_batch(&refs)?;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "embedded in {secs:.2} s ({:.0} sentences/s), {} dimensions",
        sentences.len() as f64 / secs,
        provider.dimensions()
    );

    // The index: ruvector-core's VectorDB (redb storage + HNSW), cosine distance.
    let dir = tempfile::tempdir()?;
    let db = VectorDB::new(DbOptions {
        dimensions: provider.dimensions(),
        distance_metric: DistanceMetric::Cosine,
        storage_path: dir.path().join("sentences.db").to_string_lossy().into_owned(),
        hnsw_config: Some(HnswConfig { m: 16, ef_construction: 100, ef_search: 64, max_elements: 100_000 }),
        quantization: None,
    })?;
    let t = Instant::now();
    let entries: Vec<VectorEntry> = sentences
        .iter()
        .zip(&vectors)
        .enumerate()
        .map(|(i, (s, v))| VectorEntry {
            id: Some(format!("s{i}")),
            vector: v.clone(),
            metadata: Some(HashMap::from([("text".to_string(), serde_json::Value::String(s.clone()))])),
        })
        .collect();
    db.insert_batch(&entries)?;
    println!("indexed {} vectors in {:.2} s", db.len()?, t.elapsed().as_secs_f64());

    if queries.is_empty() {
        queries = vec![
            "A man is playing a guitar.".into(),
            "Stock markets fell sharply today.".into(),
            "Someone is cooking food in a kitchen.".into(),
            "A cat sits on a mat.".into(),
            sentences[sentences.len() / 2].clone(),
        ];
    }
    let exact = sentences[sentences.len() / 2].clone();
    let mut exact_ok = false;
    for q in &queries {
        let qv = provider.embed(q)?;
        let t = Instant::now();
        let hits = db.search(SearchQuery { vector: qv.clone(), k: 5, filter: None, ef_search: Some(64) })?;
        let us = t.elapsed().as_micros();
        println!("\nquery: {q}  ({us} µs)");
        for (rank, h) in hits.iter().enumerate() {
            let i: usize = h.id.trim_start_matches('s').parse()?;
            // The index's score is a cosine distance; the similarity is recomputed from the vectors.
            let cos: f32 = qv.iter().zip(&vectors[i]).map(|(a, b)| a * b).sum();
            println!("  {}. {:.4}  (distance {:.4})  {}", rank + 1, cos, h.score, sentences[i]);
        }
        if *q == exact {
            exact_ok = hits.first().is_some_and(|h| {
                sentences[h.id.trim_start_matches('s').parse::<usize>().unwrap_or(usize::MAX)] == exact
            });
        }
    }
    if queries.contains(&exact) {
        if !exact_ok {
            return Err(format!("the exact query {exact:?} did not come back first").into());
        }
        println!("\nok: the sentence {exact:?} used as a query came back first");
    }
    Ok(())
}
