//! `spinfer bench`: llama-bench's measurements on spinfer.
//!
//! pp N: prefill N tokens as one batch from an empty cache (logits of the
//! last token included). tg N: decode N tokens one at a time from an empty
//! cache. Tokens are pseudo-random ids, as llama-bench uses. Each figure is
//! the median of `--reps` runs after one warm-up.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use spinfer_engine::Engine;
use spinfer_engine::model::Session;

use crate::commands::{CommonArgs, progress};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Repetitions per measurement (the median is reported).
    #[arg(short, long, default_value_t = 3)]
    pub reps: usize,
    #[arg(skip)]
    pub quiet: bool,
}

/// (name, prompt tokens, generated tokens)
const TESTS: [(&str, usize, usize); 3] = [("pp128", 128, 0), ("pp512", 512, 0), ("tg128", 0, 128)];

pub fn run(mut a: BenchArgs) -> Result<()> {
    a.quiet = a.common.quiet;
    let engine = crate::commands::load(&a.common, Some(1024))?;
    let mut session = engine.model.new_session();
    let vocab = engine.model.config.vocab_size as u64;
    let tokens: Vec<u32> = (0..512u64).map(|i| ((i * 2_654_435_761 + 12_345) % vocab) as u32).collect();

    // Warm-up: page in the weights and start the pool's threads.
    engine.model.forward_last(&mut session, &tokens[..32])?;
    session.reset();

    let reps = a.reps.max(1);
    let bar = progress(a.common.quiet || a.common.json, (TESTS.len() * reps) as u64, "runs");
    let mut results = Vec::new();
    for (name, pp, tg) in TESTS {
        let mut rates = Vec::with_capacity(reps);
        for _ in 0..reps {
            let rate = if pp > 0 {
                prefill(&engine, &mut session, &tokens[..pp])?
            } else {
                decode(&engine, &mut session, tg)?
            };
            rates.push(rate);
            bar.inc(1);
        }
        rates.sort_by(f64::total_cmp);
        results.push((name, rates[rates.len() / 2]));
    }
    bar.finish_and_clear();
    let rss = peak_rss_bytes();

    if a.common.json {
        let mut obj = serde_json::Map::new();
        for (name, rate) in &results {
            obj.insert(name.to_string(), serde_json::json!(rate));
        }
        obj.insert("peak_rss_bytes".into(), serde_json::json!(rss));
        obj.insert("threads".into(), serde_json::json!(engine.model.options.threads));
        obj.insert("bytes_per_token".into(), serde_json::json!(engine.model.bytes_per_token()));
        println!("{}", serde_json::Value::Object(obj));
    } else {
        let m = &engine.model;
        println!(
            "model: {} | threads: {} | precision: {:?}",
            engine.path().display(),
            m.options.threads,
            m.options.precision
        );
        println!("| test  |   tokens/s |");
        println!("|-------|-----------:|");
        for (name, rate) in &results {
            println!("| {name} | {rate:>10.2} |");
        }
        if let Some(rss) = rss {
            println!("peak RSS: {:.1} MiB", rss as f64 / (1 << 20) as f64);
        }
    }
    Ok(())
}

fn prefill(engine: &Engine, s: &mut Session, tokens: &[u32]) -> Result<f64> {
    s.reset();
    let t = Instant::now();
    engine.model.forward_last(s, tokens)?;
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

fn decode(engine: &Engine, s: &mut Session, n: usize) -> Result<f64> {
    s.reset();
    let vocab = engine.model.config.vocab_size as u32;
    let mut tok = 1 % vocab;
    let t = Instant::now();
    for i in 0..n {
        let logits = engine.model.forward_last(s, &[tok])?;
        // Feed back the argmax so every step depends on the previous one.
        tok = argmax(logits).unwrap_or((i as u32) % vocab);
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

fn argmax(x: &[f32]) -> Option<u32> {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32)
}

/// Peak resident set size of this process (Linux `VmHWM`).
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
