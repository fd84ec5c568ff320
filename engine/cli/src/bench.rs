//! `spinfer bench`: llama-bench's measurements on spinfer.
//!
//! pp N: prefill N tokens as one batch from an empty cache (logits of the
//! last token included). tg N: decode N tokens one at a time from an empty
//! cache. Tokens are pseudo-random ids, as llama-bench uses. Each figure is
//! the median of `--reps` runs after one warm-up. With `--batch B`, tg N
//! becomes tg NxB: B sequences decode N tokens together, one token each
//! per step in one batched forward (as `spinfer serve` runs its slots, and
//! llama-batched-bench's S_TG), and the figure is their aggregate rate.
//! With `--depth D` (llama-bench's `-d`), every test starts from a cache
//! already holding D tokens (prefilled untimed before each run), so pp
//! and tg measure a long conversation's later turns, where attention over
//! the cache costs as much as the weights.
//!
//! `--vs-dense` (with a sparsity sidecar) answers "is this sparse
//! configuration faster here?": the model is loaded twice, sparse and
//! dense, and tg128 runs on each in turn, `--reps` rounds with the order
//! alternating. Each round's ratio compares runs a second apart, which
//! cancels most of the drift of a shared machine (on a 2-vCPU VM, separate
//! processes minutes apart differ by 10-20%).

use std::time::Instant;

use anyhow::{Result, bail};
use clap::Args;
use spinfer_engine::Engine;
use spinfer_engine::model::{KvCache, Session};

use crate::commands::{CommonArgs, load_config, progress};
use crate::paired::Paired;
use crate::report::peak_rss_bytes;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Repetitions per measurement (the median is reported).
    #[arg(short, long, default_value_t = 3)]
    pub reps: usize,
    /// With --sparsity: time decode (tg128) sparse and dense in the same
    /// process, alternating, and report the per-round ratio (use -r 20 or
    /// more).
    #[arg(long)]
    pub vs_dense: bool,
    /// Which tests to run: any of pp128, pp512, tg (comma-separated;
    /// default all three).
    #[arg(long, value_delimiter = ',')]
    pub tests: Vec<String>,
    /// Tokens the decode test generates (its name is `tg<N>`).
    #[arg(long = "gen", default_value_t = 128)]
    pub gen_tokens: usize,
    /// Sequences the decode test runs together (its name becomes
    /// `tg<N>x<B>`): each step is one batched forward of one token per
    /// sequence, the rate their sum.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Tokens already in the cache when each test starts (llama-bench's
    /// `-d`): prefilled, untimed, before every run.
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    #[arg(skip)]
    pub quiet: bool,
}

/// Most `--reps` accepted (each is a full pp512 + tg128 run).
const MAX_REPS: usize = 10_000;

/// Most tokens `--gen` accepts (the bench session's context is 1024).
const MAX_GEN: usize = 1000;

/// Most sequences `--batch` accepts (each holds a KV cache).
const MAX_BATCH: usize = 64;

/// Most tokens `--depth` accepts (the model's context bounds it too).
const MAX_DEPTH: usize = 1 << 17;

/// The tests `a` asks for: (name, prompt tokens, generated tokens).
fn tests(a: &BenchArgs) -> Result<Vec<(String, usize, usize)>> {
    if !(1..=MAX_GEN).contains(&a.gen_tokens) {
        anyhow::bail!("--gen must be between 1 and {MAX_GEN}, got {}", a.gen_tokens);
    }
    if !(1..=MAX_BATCH).contains(&a.batch) {
        anyhow::bail!("--batch must be between 1 and {MAX_BATCH}, got {}", a.batch);
    }
    if a.depth > MAX_DEPTH {
        anyhow::bail!("--depth must be at most {MAX_DEPTH}, got {}", a.depth);
    }
    let tg = if a.batch > 1 { format!("tg{}x{}", a.gen_tokens, a.batch) } else { format!("tg{}", a.gen_tokens) };
    let all = [("pp128".to_string(), 128, 0), ("pp512".to_string(), 512, 0), (tg, 0, a.gen_tokens)];
    if a.tests.is_empty() {
        return Ok(all.to_vec());
    }
    let mut out = Vec::new();
    for t in &a.tests {
        match t.as_str() {
            "pp128" => out.push(all[0].clone()),
            "pp512" => out.push(all[1].clone()),
            "tg" => out.push(all[2].clone()),
            other => anyhow::bail!("--tests: unknown test '{other}' (pp128, pp512, tg)"),
        }
    }
    Ok(out)
}

pub fn run(mut a: BenchArgs) -> Result<()> {
    a.quiet = a.common.quiet;
    if !(1..=MAX_REPS).contains(&a.reps) {
        anyhow::bail!("--reps must be between 1 and {MAX_REPS}, got {}", a.reps);
    }
    if a.vs_dense {
        return vs_dense(&a);
    }
    let tests = tests(&a)?;
    // The context the tests need (the warm-up's 32 tokens are reset), so
    // a memory budget pays only for the KV cache they use.
    let longest = tests.iter().map(|&(_, pp, tg)| pp + tg).max().unwrap_or(0);
    let ctx = (a.depth + longest).max(32).next_multiple_of(64);
    let engine = crate::commands::load(&a.common, Some(ctx))?;
    let trained = engine.model.config.ctx_train;
    if a.depth + longest > trained {
        bail!(
            "--depth {}: with the longest test's {longest} tokens the cache would pass the {trained} positions the \
             model was trained for",
            a.depth
        );
    }
    let mut session = engine.model.new_session();
    let tokens = bench_tokens(&engine, 0..512);
    let depth = Depth::new(&engine, a.depth);
    warm_up(&engine, &mut session, &tokens)?;
    session.reset_stream_stats();

    let reps = a.reps.max(1);
    let bar = progress(a.common.quiet || a.common.json, (tests.len() * reps) as u64, "runs");
    let mut results = Vec::new();
    let mut decoded = 0;
    for (name, pp, tg) in tests {
        let mut rates = Vec::with_capacity(reps);
        for _ in 0..reps {
            let rate = if pp > 0 {
                prefill(&engine, &mut session, &depth, &tokens[..pp])?
            } else if a.batch > 1 {
                decoded += tg * a.batch;
                decode_batch(&engine, &mut session, &depth, &tokens[..a.batch], tg)?
            } else {
                decoded += tg;
                decode(&engine, &mut session, &depth, tg)?
            };
            rates.push(rate);
            bar.inc(1);
        }
        results.push((name, median(&mut rates)));
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
        obj.insert("depth".into(), serde_json::json!(a.depth));
        let kv = format!("{:?}", engine.model.options.kv_type()).to_lowercase();
        obj.insert("kv_cache".into(), serde_json::json!(kv));
        obj.insert("bytes_per_token".into(), serde_json::json!(bytes_per_token(&engine, &session)));
        if let Some(st) = session.stream_stats() {
            // Every step of every test streamed: per decoded token when
            // only decode ran.
            obj.insert("storage_bytes_read".into(), serde_json::json!(st.bytes_read));
            obj.insert("storage_prefetch_hits".into(), serde_json::json!(st.prefetch_hits));
            obj.insert("storage_stalls".into(), serde_json::json!(st.stalls));
            obj.insert("storage_stall_seconds".into(), serde_json::json!(st.stall_time.as_secs_f64()));
            obj.insert("decoded_tokens".into(), serde_json::json!(decoded));
        }
        if let Some(h) = head_bytes(&engine, &session) {
            obj.insert("head_bytes_per_token".into(), serde_json::json!(h));
            obj.insert("dense_head_bytes".into(), serde_json::json!(engine.model.weights.output.weight_bytes()));
        }
        println!("{}", serde_json::Value::Object(obj));
    } else {
        let m = &engine.model;
        println!(
            "model: {} | threads: {} | precision: {:?} | kv cache: {:?}",
            engine.path().display(),
            m.options.threads,
            m.options.precision,
            m.options.kv_type()
        );
        let at = if a.depth > 0 { format!(" @ d{}", a.depth) } else { String::new() };
        println!("| test  |   tokens/s |");
        println!("|-------|-----------:|");
        for (name, rate) in &results {
            println!("| {name}{at} | {rate:>10.2} |");
        }
        if let Some(rss) = rss {
            println!("peak RSS: {:.1} MiB", rss as f64 / (1 << 20) as f64);
        }
        if let Some(st) = session.stream_stats() {
            println!(
                "read from storage: {:.1} MB ({} prefetch hits, {} stalls, {:.2} s waiting)",
                st.bytes_read as f64 / 1e6,
                st.prefetch_hits,
                st.stalls,
                st.stall_time.as_secs_f64()
            );
        }
        if let Some(h) = head_bytes(&engine, &session) {
            println!(
                "sparse head: {:.1} MB read per token (dense head {:.1} MB)",
                h as f64 / 1e6,
                engine.model.weights.output.weight_bytes() as f64 / 1e6
            );
        }
    }
    Ok(())
}

/// Head bytes the sparse head read per token, on average over the
/// session (`None` with the dense head).
fn head_bytes(engine: &Engine, session: &Session) -> Option<u64> {
    let h = session.head_stats();
    (engine.model.head.is_some() && h.tokens > 0).then(|| h.bytes / h.tokens)
}

/// Weights read per decoded token: every matmul's, the dense head's
/// replaced by what the sparse head read on average.
fn bytes_per_token(engine: &Engine, session: &Session) -> u64 {
    let m = &engine.model;
    let all = m.bytes_per_token() as u64;
    match head_bytes(engine, session) {
        Some(h) => {
            let centroids = m.head.as_ref().map_or(0, |hd| hd.centroids.weight_bytes() as u64);
            all - m.weights.output.weight_bytes() as u64 - centroids + h
        }
        None => all,
    }
}

/// Pseudo-random token ids `ids` of one sequence, as llama-bench uses.
fn bench_tokens(engine: &Engine, ids: std::ops::Range<u64>) -> Vec<u32> {
    let vocab = engine.model.config.vocab_size as u64;
    ids.map(|i| ((i * 2_654_435_761 + 12_345) % vocab) as u32).collect()
}

/// The tokens every test finds in its cache (`--depth`).
struct Depth(Vec<u32>);

impl Depth {
    fn new(engine: &Engine, depth: usize) -> Self {
        // Different ids from the tests' own (further along the sequence).
        Self(bench_tokens(engine, 1000..1000 + depth as u64))
    }

    /// Empties `s` and fills it with the depth's tokens, as a prompt.
    fn fill(&self, engine: &Engine, s: &mut Session) -> Result<()> {
        s.reset();
        if !self.0.is_empty() {
            engine.model.forward(s, &self.0)?;
        }
        Ok(())
    }

    /// Fills one sequence of a batch (`work` lends its buffers) in steps
    /// of at most the model's batch size.
    fn fill_kv(&self, engine: &Engine, work: &mut Session, kv: &mut KvCache) -> Result<()> {
        let m = &engine.model;
        for chunk in self.0.chunks(m.max_batch_tokens()) {
            m.forward_batch(work, &mut [&mut *kv], chunk, &[chunk.len()], &[true])?;
        }
        Ok(())
    }
}

/// Pages in the weights and starts the pool's threads.
fn warm_up(engine: &Engine, session: &mut Session, tokens: &[u32]) -> Result<()> {
    engine.model.forward(session, &tokens[..32])?;
    engine.model.next_token_logits(session)?;
    session.reset();
    Ok(())
}

/// `--vs-dense`: tg128 on the sparse and the dense model (sparse FFN,
/// sparse head or both against neither), alternating.
fn vs_dense(a: &BenchArgs) -> Result<()> {
    const TG: usize = 128;
    let config = a.common.config(Some(1024))?;
    let sparse_head = config.head.as_ref().is_some_and(|h| h.mode == spinfer_engine::config::HeadMode::Sparse);
    if config.sparsity.is_none() && !sparse_head {
        bail!(
            "--vs-dense compares a sparse run with the dense one: give --sparsity or --head-index (or [sparsity] / \
             [head] in --config)"
        );
    }
    let mut dense_config = config.clone();
    dense_config.sparsity = None;
    dense_config.head = None;
    let sparse = load_config(&a.common, &config)?;
    let quiet = CommonArgs { quiet: true, ..a.common.clone() };
    let dense = load_config(&quiet, &dense_config)?;
    let engines = [&dense, &sparse];
    let mut sessions = [dense.model.new_session(), sparse.model.new_session()];
    for (e, s) in engines.iter().zip(&mut sessions) {
        warm_up(e, s, &bench_tokens(e, 0..512))?;
    }
    let rounds = a.reps.max(1);
    let bar = progress(a.common.quiet || a.common.json, rounds as u64, "rounds");
    let mut rates = [Vec::with_capacity(rounds), Vec::with_capacity(rounds)];
    let mut ratios = Vec::with_capacity(rounds);
    for r in 0..rounds {
        let mut rate = [0.0; 2];
        for k in [r % 2, 1 - r % 2] {
            rate[k] = decode(engines[k], &mut sessions[k], &Depth(Vec::new()), TG)?;
            rates[k].push(rate[k]);
        }
        ratios.push(rate[1] / rate[0]);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let [dense_tps, sparse_tps] = rates.map(|mut v| median(&mut v));
    let p = Paired::of(&ratios);
    let threads = sparse.model.options.threads;
    if a.common.json {
        println!(
            "{}",
            serde_json::json!({
                "test": format!("tg{TG}"),
                "rounds": rounds,
                "dense": dense_tps,
                "sparse": sparse_tps,
                "ratio_median": p.median,
                "ratio_min": p.min,
                "ratio_max": p.max,
                "ratio_median_ci95": p.ci95.map(|(lo, hi)| [lo, hi]),
                "rounds_sparse_faster": p.faster,
                "sign_test_p": p.sign_p,
                "threads": threads,
            })
        );
    } else if a.common.quiet {
        println!("{:.3}", p.median);
    } else {
        println!("model: {} | threads: {threads} | tg{TG}, {rounds} alternating rounds", sparse.path().display());
        println!("dense {dense_tps:.2} tok/s | sparse {sparse_tps:.2} tok/s (medians)");
        let ci = p
            .ci95
            .map_or_else(|| "95% interval needs 6+ rounds".to_string(), |(lo, hi)| format!("95% CI {lo:.3}-{hi:.3}"));
        println!(
            "sparse/dense per round: median {:.3} ({ci}; min {:.3}, max {:.3}); sparse faster in {}/{rounds} \
             (sign test p = {:.2e})",
            p.median, p.min, p.max, p.faster, p.sign_p
        );
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn prefill(engine: &Engine, s: &mut Session, depth: &Depth, tokens: &[u32]) -> Result<f64> {
    depth.fill(engine, s)?;
    let t = Instant::now();
    // As generation does: the next token's logits from the configured head.
    engine.model.forward(s, tokens)?;
    engine.model.next_token_logits(s)?;
    Ok(tokens.len() as f64 / t.elapsed().as_secs_f64())
}

fn decode(engine: &Engine, s: &mut Session, depth: &Depth, n: usize) -> Result<f64> {
    depth.fill(engine, s)?;
    let vocab = engine.model.config.vocab_size as u32;
    let mut tok = 1 % vocab;
    let t = Instant::now();
    for i in 0..n {
        engine.model.forward(s, &[tok])?;
        let logits = engine.model.next_token_logits(s)?;
        // Feed back the argmax so every step depends on the previous one.
        tok = argmax(logits).unwrap_or((i as u32) % vocab);
    }
    Ok(n as f64 / t.elapsed().as_secs_f64())
}

/// `firsts.len()` sequences, one starting from each of `firsts`, decode
/// `n` tokens together: per step one batched forward of one token each,
/// then each one's logits and argmax. Returns the aggregate tokens/s.
fn decode_batch(engine: &Engine, work: &mut Session, depth: &Depth, firsts: &[u32], n: usize) -> Result<f64> {
    let m = &engine.model;
    let b = firsts.len();
    if b > m.max_batch_tokens() {
        bail!("--batch {b}: a batch step of this model takes at most {} tokens", m.max_batch_tokens());
    }
    let vocab = m.config.vocab_size;
    let mut kvs: Vec<_> = (0..b).map(|_| m.new_kv_cache()).collect();
    for kv in &mut kvs {
        depth.fill_kv(engine, work, kv)?;
    }
    let mut toks = firsts.to_vec();
    let (lens, prompt, rows) = (vec![1; b], vec![false; b], (0..b).collect::<Vec<_>>());
    let mut seqs: Vec<_> = kvs.iter_mut().collect();
    let t = Instant::now();
    for i in 0..n {
        m.forward_batch(work, &mut seqs, &toks, &lens, &prompt)?;
        let logits = m.logits_of_rows(work, &rows)?;
        for (k, tok) in toks.iter_mut().enumerate() {
            *tok = argmax(&logits[k * vocab..(k + 1) * vocab]).unwrap_or((i % vocab) as u32);
        }
    }
    Ok((n * b) as f64 / t.elapsed().as_secs_f64())
}

fn argmax(x: &[f32]) -> Option<u32> {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32)
}
