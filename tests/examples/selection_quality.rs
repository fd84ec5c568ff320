//! How good are the registry's kernel choices, and what does a warm history
//! cost at load? (Issue 3's selection-quality and startup measurements;
//! results in docs/benchmarks.md.)
//!
//! ```sh
//! cargo run --release -p spinfer-tests --example selection_quality -- \
//!     models/SmolLM2-135M-Instruct.Q4_1.gguf [--config spinfer.toml] [--threads 2]
//! ```
//!
//! 1. **Exact shapes**: records a history for the model's own operations
//!    (as `spinfer tune` does), then benchmarks every candidate again, fresh,
//!    and compares the kernel selected from the history with the fastest
//!    of the fresh run (the oracle).
//! 2. **Unseen shapes**: with only that history, selects kernels for other
//!    models' operation shapes (SmolLM2-360M, Qwen2.5-0.5B, a tiny d=64
//!    model) by nearest recorded shape, checking that selection added no
//!    record (nothing was benchmarked), then benchmarks them for the oracle.
//! 3. **Startup**: median load time with the warm history against the dense
//!    engine's load without one (interleaved runs).
//!
//! With `--config`, steps 1 and 2 include the config's packs (pins are
//! ignored here: they would bypass selection).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use spinfer_engine::Engine;
use spinfer_engine::config::Config;
use spinfer_engine::engine::registry_from_config;
use spinfer_engine::model::ModelOptions;
use spinfer_engine::registry::{Choice, KernelRegistry, describe};
use spinfer_engine::tuning::{BenchOptions, HistoryStore, Host, Phase, Reason, benchmark, select, tune_with};
use spinfer_kernels::kernel::MatmulDesc;
use spinfer_kernels::pool::ThreadPool;

struct Args {
    model: PathBuf,
    config: Option<PathBuf>,
    threads: usize,
}

fn parse_args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let mut model = None;
    let mut config = None;
    let mut threads = 2;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => config = Some(PathBuf::from(it.next().context("--config needs a path")?)),
            "--threads" => threads = it.next().context("--threads needs a number")?.parse()?,
            _ if model.is_none() => model = Some(PathBuf::from(a)),
            other => bail!("unexpected argument '{other}'"),
        }
    }
    Ok(Args { model: model.context("usage: selection_quality MODEL [--config F] [--threads N]")?, config, threads })
}

/// A registry with the config's packs (no pins, no history), or the
/// built-in one.
fn registry_for(config: &Option<PathBuf>) -> Result<KernelRegistry> {
    let Some(path) = config else { return Ok(KernelRegistry::builtin()) };
    let mut c = Config::load(path)?;
    c.kernels.pin.clear();
    c.packs.history = None;
    let (registry, packs) = registry_from_config(&c)?;
    if let Some(Err(e)) = packs.into_iter().map(|p| p.outcome).find(Result::is_err) {
        bail!("a pack of {} was skipped: {e}", path.display());
    }
    Ok(registry)
}

/// Selects from `history` for each of `descs`, benchmarks every candidate
/// fresh, and prints one row per operation: chosen / oracle time ratio.
/// Returns the worst ratio.
fn evaluate(
    registry: &KernelRegistry,
    history: &HistoryStore,
    descs: &[MatmulDesc],
    pool: &ThreadPool,
    opts: &BenchOptions,
) -> Result<f64> {
    let host = Host::detect().fingerprint();
    let mut worst = 1.0f64;
    println!("| operation | selected | why | selected µs | fastest | fastest µs | ratio |");
    println!("|---|---|---|---:|---|---:|---:|");
    for desc in descs {
        let cands = registry.candidates(desc);
        let before = history.len();
        let sel = select(desc, Phase::Decode, &cands, history, &host)?;
        assert_eq!(history.len(), before, "selection must not record (benchmark) anything");
        let fresh: Vec<_> = benchmark(desc, &cands, pool, opts, &mut |_, _, _| {})
            .into_iter()
            .filter(|m| m.phase == Phase::Decode)
            .collect();
        let time = |id: &str| fresh.iter().find(|m| m.kernel_id == id).and_then(|m| m.median_ns());
        let Some(best) = fresh.iter().filter(|m| m.median_ns().is_some()).min_by_key(|m| m.median_ns()) else {
            bail!("{}: no candidate could be timed", describe(desc));
        };
        let best_ns = best.median_ns().unwrap_or(1);
        let chosen_ns = time(&sel.kernel_id).context("the selected kernel was rejected by the fresh run")?;
        let ratio = chosen_ns as f64 / best_ns as f64;
        worst = worst.max(ratio);
        let why = match sel.reason {
            Reason::Measured => "measured".to_string(),
            Reason::NearestNeighbour { from: (r, c) } => format!("nearest {r}x{c}"),
            Reason::OnlyCandidate => "only candidate".to_string(),
            Reason::Default => "default".to_string(),
        };
        println!(
            "| {} | {} | {why} | {:.1} | {} | {:.1} | {ratio:.3} |",
            describe(desc),
            sel.kernel_id,
            chosen_ns as f64 / 1e3,
            best.kernel_id,
            best_ns as f64 / 1e3
        );
    }
    Ok(worst)
}

/// Llama-shaped operations of a model with these dimensions, with the
/// weight/activation types of `like` (attention/FFN) and `out` (lm_head).
fn llama_shapes(like: MatmulDesc, out: MatmulDesc, dim: usize, kv: usize, ffn: usize, vocab: usize) -> Vec<MatmulDesc> {
    let d = |rows, cols| MatmulDesc { rows, cols, ..like };
    vec![d(dim, dim), d(kv, dim), d(ffn, dim), d(dim, ffn), MatmulDesc { rows: vocab, cols: dim, ..out }]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let registry = registry_for(&args.config)?;
    let pool = ThreadPool::new(args.threads);
    // More runs than `spinfer tune` takes: the candidates being compared are
    // often within a few percent of each other.
    let opts = BenchOptions { runs: 31, warmup: 5, ..BenchOptions::default() };
    let options = ModelOptions { threads: args.threads, ..ModelOptions::default() };

    // The model's operations.
    let engine = Engine::load_with(&args.model, options.clone(), &registry)?;
    let descs: Vec<MatmulDesc> = engine.model.kernel_choices().iter().map(|l| l.desc).collect();
    drop(engine);

    let dir = tempfile::tempdir()?;
    let hist_path = dir.path().join("history.redb");
    let mut history = HistoryStore::open(&hist_path)?;
    let t = Instant::now();
    tune_with(&registry, &descs, &pool, &mut history, &opts, &mut |_, _, _| {})?;
    eprintln!("tuned {} operations ({} records) in {:.1} s", descs.len(), history.len(), t.elapsed().as_secs_f64());

    println!("## Exact shapes ({})\n", args.model.display());
    let worst = evaluate(&registry, &history, &descs, &pool, &opts)?;
    println!("\nworst selected/fastest: {worst:.3}\n");

    // Other models' shapes, selected from this history only.
    let (like, out) = (descs[0], *descs.last().context("model has no matmul")?);
    let unseen: Vec<MatmulDesc> = [
        ("SmolLM2-360M", 960, 320, 2560, 49152),
        ("Qwen2.5-0.5B", 896, 128, 4864, 151_936),
        ("tiny d=64", 64, 32, 128, 512),
    ]
    .iter()
    .flat_map(|&(_, dim, kv, ffn, vocab)| llama_shapes(like, out, dim, kv, ffn, vocab))
    .collect();
    println!("## Unseen shapes (history of the model above only)\n");
    let worst = evaluate(&registry, &history, &unseen, &pool, &opts)?;
    println!("\nworst selected/fastest: {worst:.3}\n");
    drop(history);

    // Warm-history startup (with the config's packs, verified at load)
    // against the dense engine's plain load.
    let warm_load = || -> Result<Engine> {
        let mut r = registry_for(&args.config)?;
        r.set_history(HistoryStore::open(&hist_path)?);
        Ok(Engine::load_with(&args.model, options.clone(), &r)?)
    };
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        let t = Instant::now();
        let e = Engine::load(&args.model, options.clone())?;
        cold.push(t.elapsed().as_secs_f64() * 1e3);
        drop(e);
        let t = Instant::now();
        let e = warm_load()?;
        warm.push(t.elapsed().as_secs_f64() * 1e3);
        if !e.model.kernel_choices().iter().all(|l| matches!(l.choice, Choice::Measured)) {
            bail!("a warm-history load chose a kernel without its measurement");
        }
    }
    let (c, w) = (median(cold), median(warm));
    println!("## Startup\n");
    println!("dense load {c:.1} ms, with packs and warm history {w:.1} ms: +{:.1} ms", w - c);
    Ok(())
}
