//! How good are the registry's kernel choices, and what does a warm history
//! cost at load? (Issue 3's selection-quality and startup measurements;
//! results in docs/benchmarks.md.)
//!
//! ```sh
//! cargo run --release -p spinfer-tests --example selection_quality -- \
//!     models/SmolLM2-135M-Instruct.Q4_1.gguf [--config spinfer.toml] [--threads 2] \
//!     [--synthetic-shapes] [--dispatch]
//! ```
//!
//! 1. **Exact shapes**: records a history for the model's own operations
//!    (as `spinfer tune` does), then compares the kernel selected from it
//!    with the oracle: every candidate timed again, fresh, in interleaved
//!    rounds (see [`oracle`]).
//! 2. **Unseen shapes**: with only that history, selects kernels for other
//!    models' operation shapes (SmolLM2-360M, Qwen2.5-0.5B, a tiny d=64
//!    model) by nearest recorded shape, checking that selection added no
//!    record (nothing was benchmarked), then times the oracle. With
//!    `--synthetic-shapes`, a second history holds the model's records plus
//!    the generic grid `spinfer tune --synthetic-shapes` measures
//!    (`spinfer_registry::synthetic_shapes`, which contains none of these
//!    shapes), and both selections are compared with the same oracle.
//! 3. **Startup**: median load time with the warm history against the dense
//!    engine's load without one (interleaved runs).
//!
//! With `--config`, steps 1 and 2 include the config's packs (pins are
//! ignored here: they would bypass selection).
//!
//! `--dispatch` only times, in interleaved rounds, each built-in kernel
//! against the native pack's copy of the same kernel (cpu-simd ships the
//! AVX-512/AVX2 kernels of `spinfer-kernels`): the same code behind the two
//! dispatch paths (the kernel's own split over the host pool, and the
//! host's split of the rows over its pool with the pack running each part).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use spinfer_engine::Engine;
use spinfer_engine::config::Config;
use spinfer_engine::engine::registry_from_config;
use spinfer_engine::model::ModelOptions;
use spinfer_engine::registry::{Choice, KernelRegistry, describe};
use spinfer_engine::tuning::{
    BenchOptions, HistoryStore, Host, Phase, Reason, Selection, benchmark, kernel_id, select, synthetic_descs,
    tune_with,
};
use spinfer_kernels::kernel::{MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::ThreadPool;

struct Args {
    model: PathBuf,
    config: Option<PathBuf>,
    threads: usize,
    synthetic: bool,
    dispatch: bool,
}

const USAGE: &str = "usage: selection_quality MODEL [--config F] [--threads N] [--synthetic-shapes] [--dispatch]";

fn parse_args() -> Result<Args> {
    let mut it = std::env::args().skip(1);
    let mut model = None;
    let mut config = None;
    let mut threads = 2;
    let (mut synthetic, mut dispatch) = (false, false);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--config" => config = Some(PathBuf::from(it.next().context("--config needs a path")?)),
            "--threads" => threads = it.next().context("--threads needs a number")?.parse()?,
            "--synthetic-shapes" => synthetic = true,
            "--dispatch" => dispatch = true,
            _ if model.is_none() && !a.starts_with('-') => model = Some(PathBuf::from(a)),
            other => bail!("unexpected argument '{other}'\n{USAGE}"),
        }
    }
    Ok(Args { model: model.context(USAGE)?, config, threads, synthetic, dispatch })
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

type Candidates = [(String, Arc<dyn MatmulKernel>)];

/// The oracle: every candidate's decode time, fresh, in interleaved rounds.
/// Round 0 times every candidate ([`benchmark`], which checks each against
/// the scalar reference first); the contenders (within 1.5x of the fastest
/// of round 0) and the kernels in `keep` (the selections being judged) then
/// run 14 more rounds, the order rotated by one each round, so that a
/// disturbance (another process, a descheduled pool thread, the shared
/// host's memory bandwidth) hits different candidates in different rounds.
/// Per candidate: the median over its rounds of the per-round median.
/// Rejected candidates are left out.
fn oracle(desc: &MatmulDesc, cands: &Candidates, pool: &ThreadPool, keep: &[&str]) -> BTreeMap<String, u64> {
    const ROUNDS: usize = 15;
    let opts = BenchOptions { warmup: 3, runs: 11, rounds: 1, prefill_tokens: 1, ..BenchOptions::default() };
    let mut times: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let run = |order: &Candidates, times: &mut BTreeMap<String, Vec<u64>>| {
        for m in benchmark(desc, order, pool, &opts, &mut |_, _, _| {}) {
            if let (Phase::Decode, Some(ns)) = (m.phase, m.median_ns()) {
                times.entry(m.kernel_id).or_default().push(ns);
            }
        }
    };
    run(cands, &mut times);
    let best = times.values().map(|v| v[0]).min().unwrap_or(0);
    let mut contenders: Vec<_> = cands
        .iter()
        .filter(|(p, k)| {
            let id = kernel_id(p, k.as_ref());
            keep.contains(&id.as_str()) || times.get(&id).is_some_and(|v| v[0] as f64 <= 1.5 * best as f64)
        })
        .cloned()
        .collect();
    for _ in 1..ROUNDS {
        contenders.rotate_left(1);
        run(&contenders, &mut times);
    }
    times
        .into_iter()
        .map(|(id, mut v)| {
            v.sort_unstable();
            (id, v[v.len() / 2])
        })
        .collect()
}

/// `"<provider>/<kernel>"` without the pack's version and hash.
fn short(id: &str) -> String {
    match id.split_once('/') {
        Some(("cpu-builtin", k)) => format!("builtin {k}"),
        Some((_, k)) => k.to_string(),
        None => id.to_string(),
    }
}

fn why(s: &Selection) -> String {
    match s.reason {
        Reason::Measured => "measured".to_string(),
        Reason::NearestNeighbour { from: (r, c), shapes } => format!("nearest {r}x{c} (of {shapes})"),
        Reason::OnlyCandidate => "only candidate".to_string(),
        Reason::Default => "default".to_string(),
    }
}

/// Selects from each of `histories` for each of `descs` (checking that
/// selection records nothing), times the oracle, and prints one row per
/// operation: per history the selection and its time over the fastest
/// candidate's. Returns the worst ratio per history.
fn evaluate(
    registry: &KernelRegistry,
    histories: &[(&str, &HistoryStore)],
    descs: &[MatmulDesc],
    pool: &ThreadPool,
) -> Result<Vec<f64>> {
    let host = Host::detect().fingerprint();
    let mut worst = vec![1.0f64; histories.len()];
    let mut head = "| operation | fastest | fastest µs |".to_string();
    let mut rule = "|---|---|---:|".to_string();
    for (name, _) in histories {
        head += &format!(" selected ({name}) | why | µs | ratio |");
        rule += "---|---|---:|---:|";
    }
    println!("{head}\n{rule}");
    for desc in descs {
        let cands = registry.candidates(desc);
        let mut sels = Vec::new();
        for (name, h) in histories {
            let before = h.len();
            sels.push(select(desc, Phase::Decode, &cands, h, &host)?);
            assert_eq!(h.len(), before, "selection from the {name} history recorded (benchmarked) something");
        }
        let keep: Vec<&str> = sels.iter().map(|s| s.kernel_id.as_str()).collect();
        let times = oracle(desc, &cands, pool, &keep);
        let Some((best, &best_ns)) = times.iter().min_by_key(|(id, ns)| (**ns, (*id).clone())) else {
            bail!("{}: no candidate could be timed", describe(desc));
        };
        let mut row = format!("| {} | {} | {:.1} |", describe(desc), short(best), best_ns as f64 / 1e3);
        for (i, sel) in sels.iter().enumerate() {
            let ns = *times.get(&sel.kernel_id).context("the selected kernel was rejected by the oracle")?;
            let ratio = ns as f64 / best_ns as f64;
            worst[i] = worst[i].max(ratio);
            row += &format!(" {} | {} | {:.1} | {ratio:.3} |", short(&sel.kernel_id), why(sel), ns as f64 / 1e3);
        }
        println!("{row}");
    }
    Ok(worst)
}

/// Llama-shaped operations of a model with these dimensions, with the
/// weight/activation types of `like` (attention/FFN) and `out` (lm_head).
fn llama_shapes(like: MatmulDesc, out: MatmulDesc, dim: usize, kv: usize, ffn: usize, vocab: usize) -> Vec<MatmulDesc> {
    let d = |rows, cols| MatmulDesc { rows, cols, ..like };
    vec![d(dim, dim), d(kv, dim), d(ffn, dim), d(dim, ffn), MatmulDesc { rows: vocab, cols: dim, ..out }]
}

/// `--dispatch`: each built-in kernel against the native pack's copy of the
/// same kernel, in interleaved rounds (order alternating), decode medians,
/// median over the rounds.
fn compare_dispatch(registry: &KernelRegistry, descs: &[MatmulDesc], pool: &ThreadPool) -> Result<()> {
    let opts = BenchOptions { runs: 21, warmup: 3, rounds: 1, prefill_tokens: 1, ..BenchOptions::default() };
    println!("| operation | kernel | built-in µs | pack µs | built-in/pack |");
    println!("|---|---|---:|---:|---:|");
    for desc in descs {
        let cands = registry.candidates(desc);
        let Some((bp, bk)) = cands.iter().find(|(p, _)| p == "cpu-builtin") else { continue };
        let name = bk.name().to_string();
        let suffix = format!(":{name}");
        let Some(pack) = cands.iter().find(|(_, k)| k.name().ends_with(&suffix)) else { continue };
        let pair = [(bp.clone(), Arc::clone(bk)), pack.clone()];
        let mut t = [Vec::new(), Vec::new()];
        for round in 0..11 {
            for j in 0..2 {
                let i = if round % 2 == 0 { j } else { 1 - j };
                let m = benchmark(desc, &pair[i..=i], pool, &opts, &mut |_, _, _| {});
                let ns = m
                    .iter()
                    .find(|m| m.phase == Phase::Decode)
                    .and_then(|m| m.median_ns())
                    .context("a kernel was rejected")?;
                t[i].push(ns as f64);
            }
        }
        let [a, b] = t.map(median);
        println!("| {} | {name} | {:.2} | {:.2} | {:.3} |", describe(desc), a / 1e3, b / 1e3, a / b);
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let registry = registry_for(&args.config)?;
    let pool = ThreadPool::new(args.threads);
    // What `spinfer tune` does: interleaved rounds with the default counts.
    let opts = BenchOptions::default();
    let options = ModelOptions { threads: args.threads, ..ModelOptions::default() };

    // The model's operations, and other models' (never measured here).
    let engine = Engine::load_with(&args.model, options.clone(), &registry)?;
    let descs: Vec<MatmulDesc> = engine.model.kernel_choices().iter().map(|l| l.desc).collect();
    drop(engine);
    let (like, out) = (descs[0], *descs.last().context("model has no matmul")?);
    let unseen: Vec<MatmulDesc> = [
        ("SmolLM2-360M", 960, 320, 2560, 49152),
        ("Qwen2.5-0.5B", 896, 128, 4864, 151_936),
        ("tiny d=64", 64, 32, 128, 512),
    ]
    .iter()
    .flat_map(|&(_, dim, kv, ffn, vocab)| llama_shapes(like, out, dim, kv, ffn, vocab))
    .collect();

    if args.dispatch {
        let mut all = descs.clone();
        all.extend(unseen.iter().filter(|d| d.rows * d.cols < 10_000_000));
        return compare_dispatch(&registry, &all, &pool);
    }

    let dir = tempfile::tempdir()?;
    let hist_path = dir.path().join("history.redb");
    let mut history = HistoryStore::open(&hist_path)?;
    let t = Instant::now();
    tune_with(&registry, &descs, &pool, &mut history, &opts, &mut |_, _, _| {})?;
    eprintln!("tuned {} operations ({} records) in {:.1} s", descs.len(), history.len(), t.elapsed().as_secs_f64());

    // The model's records plus the synthetic grid, in a second store.
    let grid_history = if args.synthetic {
        let mut h = HistoryStore::open(dir.path().join("history-grid.redb"))?;
        for r in history.records().cloned().collect::<Vec<_>>() {
            h.record(&r)?;
        }
        let grid = synthetic_descs(&descs);
        assert!(!grid.iter().any(|d| unseen.contains(d)), "the grid holds an unseen shape");
        let t = Instant::now();
        tune_with(&registry, &grid, &pool, &mut h, &opts, &mut |_, _, _| {})?;
        eprintln!(
            "tuned {} synthetic shapes ({} records in all) in {:.1} s",
            grid.len(),
            h.len(),
            t.elapsed().as_secs_f64()
        );
        Some(h)
    } else {
        None
    };

    println!("## Exact shapes ({})\n", args.model.display());
    let worst = evaluate(&registry, &[("history", &history)], &descs, &pool)?;
    println!("\nworst selected/fastest: {:.3}\n", worst[0]);

    println!("## Unseen shapes (selected from the history above, nothing benchmarked at selection)\n");
    let mut hs: Vec<(&str, &HistoryStore)> = vec![("model", &history)];
    if let Some(h) = &grid_history {
        hs.push(("model + grid", h));
    }
    let worst = evaluate(&registry, &hs, &unseen, &pool)?;
    for ((name, _), w) in hs.iter().zip(&worst) {
        println!("\nworst selected/fastest, {name} history: {w:.3}");
    }
    println!();
    drop(hs);
    drop(grid_history);
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
        if !e.model.kernel_choices().iter().all(|l| matches!(l.choice(), Choice::Measured)) {
            bail!("a warm-history load chose a kernel without its measurement");
        }
    }
    let (c, w) = (median(cold), median(warm));
    println!("## Startup\n");
    println!("dense load {c:.1} ms, with packs and warm history {w:.1} ms: +{:.1} ms", w - c);
    Ok(())
}
