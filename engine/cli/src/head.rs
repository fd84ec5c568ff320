//! `spinfer calibrate-head` (cluster the output head's rows into a head
//! index) and `spinfer head-eval` (how the sparse head agrees with the
//! dense one, per probe count, on real text).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use spinfer_engine::head::eval::{HeadQuality, evaluate};
use spinfer_engine::head::{HeadBuildOptions, HeadCalibration, HeadIndex};
use spinfer_engine::registry::KernelRegistry;

use crate::commands::{CommonArgs, load, progress};

#[derive(Args)]
pub struct CalibrateHeadArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Vocabulary rows per cluster (the cluster count is the vocabulary
    /// size over this).
    #[arg(long, default_value_t = 64)]
    pub cluster_rows: usize,
    /// k-means rounds.
    #[arg(long, default_value_t = 6)]
    pub iters: usize,
    #[arg(long, default_value_t = HeadBuildOptions::default().seed)]
    pub seed: u64,
    /// Rows computed for every token: this many of the most frequent tokens
    /// of --text (0: none).
    #[arg(long, default_value_t = 4096)]
    pub hot: usize,
    /// Calibration text (UTF-8; CRLF read as LF): its most frequent tokens
    /// are the hot rows, and its hidden states give the metric the other
    /// rows are clustered in. Keep it disjoint from evaluation text (see
    /// --offset).
    #[arg(long)]
    pub text: PathBuf,
    /// Positions of --text run through the model for the metric.
    #[arg(long, default_value_t = 16384)]
    pub positions: usize,
    /// Start reading --text at this byte (e.g. 800000 for WikiText-2's test
    /// split, whose start is used for evaluation).
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// Do not write the head's rows re-ordered by cluster beside the index
    /// (`<out>.rows`, as large as the head): probed clusters are then read
    /// row by row in place in the model file.
    #[arg(long)]
    pub no_rows: bool,
    /// Clusters probed per token by default (stored in the index;
    /// `--head-probes` overrides it at run time). Without it the count is
    /// measured: the smallest of a grid of counts whose greedy choice equals
    /// the dense head's at >= 99.5% of the held-out positions of --text
    /// (the 4 windows after --positions), with mean sampling distance
    /// within --target-tv and perplexity within --target-ppl of the dense
    /// head's.
    #[arg(long)]
    pub probes: Option<usize>,
    /// Mean total-variation distance (temperature 1, top-p 0.95) the
    /// measured default probe count must reach on held-out text.
    #[arg(long, default_value_t = 0.006)]
    pub target_tv: f64,
    /// Relative perplexity increase over the dense head (under the sparse
    /// head's full softmax, on the same held-out text) the measured default
    /// probe count may cost: 0.01 is 1%.
    #[arg(long, default_value_t = 0.01)]
    pub target_ppl: f64,
    /// Output head index (never the model file).
    #[arg(short, long)]
    pub out: PathBuf,
}

pub fn calibrate_head(a: CalibrateHeadArgs) -> Result<()> {
    if a.common.head.is_some() || a.common.head_index.is_some() {
        bail!("calibrate-head builds a head index from the dense model: drop --head and --head-index");
    }
    // Windows of 512 tokens of --text give the metric's hidden states.
    let config = a.common.config(Some(512))?;
    if config.model.path == a.out {
        bail!("--out {} is the model file; write the head index beside it", a.out.display());
    }
    if a.iters == 0 || a.iters > 100 {
        bail!("--iters must be in 1..=100, got {}", a.iters);
    }
    if a.positions == 0 || a.positions > 1 << 20 {
        bail!("--positions must be in 1..=1048576, got {}", a.positions);
    }
    if !(a.target_tv > 0.0 && a.target_tv < 1.0) {
        bail!("--target-tv must be in (0, 1), got {}", a.target_tv);
    }
    if !(a.target_ppl >= 0.0 && a.target_ppl.is_finite()) {
        bail!("--target-ppl must be a finite relative increase >= 0, got {}", a.target_ppl);
    }
    let mut engine = crate::commands::load_config(&a.common, &config)?;
    let t = std::time::Instant::now();
    let tokens = calibration_tokens(&engine, &a.text, a.offset)?;
    let mut session = engine.new_session();
    let calib = HeadCalibration::from_tokens(&engine.model, &mut session, &tokens, a.hot, a.positions)?;
    let o = HeadBuildOptions { cluster_rows: a.cluster_rows, iters: a.iters, seed: a.seed };
    let bar = progress(a.common.quiet || a.common.json, a.iters as u64, "k-means rounds");
    let mut index =
        HeadIndex::build(&engine.model, session.pool(), &o, &calib, &mut |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    if !a.no_rows {
        index.write_rows(&engine.model, &a.out)?;
    }
    index.save(&a.out)?;
    let chosen = match a.probes {
        Some(p) => {
            index.set_default_probes(p)?;
            None
        }
        None => {
            let q = choose_probes(
                &mut engine,
                &a.out,
                &tokens[a.positions.min(tokens.len())..],
                Targets { tv: a.target_tv, ppl: a.target_ppl },
                a.common.quiet || a.common.json,
            )?;
            index.set_default_probes(q.probes)?;
            Some(q)
        }
    };
    index.save(&a.out)?;
    let secs = t.elapsed().as_secs_f64();
    if a.common.json {
        println!(
            "{}",
            serde_json::json!({"out": a.out, "clusters": index.clusters(), "cluster_rows": a.cluster_rows,
                "iters": a.iters, "hot": index.hot().len(), "metric_positions": calib.moment.positions,
                "probes": index.default_probes(), "held_out": chosen.as_ref().map(|q| serde_json::json!({
                    "positions": q.tv.len(), "argmax_agreement": q.agreement(), "tv_mean": q.mean_tv(),
                    "ppl": q.ppl(), "dense_ppl": q.dense_ppl()})),
                "seconds": secs, "head": index.model})
        );
    } else {
        if !a.common.quiet {
            eprintln!(
                "{} clusters of up to {} rows of {} ({} {}) in {secs:.1} s",
                index.clusters(),
                a.cluster_rows,
                index.model.tensor,
                index.model.vocab_size,
                index.model.tensor_type
            );
            match &chosen {
                Some(q) => eprintln!(
                    "default probes {} ({:.1}% of rows): greedy agreement {:.2}%, mean TV {:.4}, perplexity {:.4} \
                     (dense {:.4}) on {} held-out positions",
                    q.probes,
                    100.0 * q.row_fraction,
                    100.0 * q.agreement(),
                    q.mean_tv(),
                    q.ppl(),
                    q.dense_ppl(),
                    q.tv.len()
                ),
                None => eprintln!("default probes {}", index.default_probes()),
            }
        }
        println!("{}", a.out.display());
    }
    Ok(())
}

/// Held-out windows measured to choose the default probe count.
const CHECK_WINDOWS: usize = 4;

/// What the default probe count must reach on held-out text besides 99.5%
/// greedy agreement: a mean sampling distance, and a relative perplexity
/// increase over the dense head.
struct Targets {
    tv: f64,
    ppl: f64,
}

/// The smallest of a grid of probe counts (multiples of clusters / 32) for
/// the index at `path` whose greedy agreement with the dense head is at
/// least 99.5% and that meets `targets`, measured on `held_out` (all
/// clusters, which is the dense head, if none does, with a warning).
fn choose_probes(
    engine: &mut spinfer_engine::Engine,
    path: &std::path::Path,
    held_out: &[u32],
    targets: Targets,
    quiet: bool,
) -> Result<HeadQuality> {
    let ctx = 512;
    let windows = (held_out.len() / ctx).min(CHECK_WINDOWS);
    if windows == 0 {
        bail!("--text has no {ctx} tokens past --positions to measure the default probes on: give --probes N");
    }
    let index = HeadIndex::load(path, &HeadIndex::model_of(&engine.model))?;
    let k = index.clusters();
    let mut grid: Vec<usize> = (1..=16).map(|j| (k * j).div_ceil(32)).chain([k]).collect();
    grid.dedup();
    engine.model.set_sparse_head(Some(index), 1, &KernelRegistry::builtin())?;
    let bar = progress(quiet, windows as u64, "measuring probes");
    let mut session = engine.new_session();
    let head = engine.model.head.as_ref().expect("just set");
    let q = evaluate(&engine.model, head, &mut session, held_out, ctx, windows, &grid, &mut |d, _| {
        bar.set_position(d as u64)
    })?;
    bar.finish_and_clear();
    engine.model.set_sparse_head(None, 1, &KernelRegistry::builtin())?;
    let fits = |q: &HeadQuality| {
        q.agreement() >= 0.995 && q.mean_tv() <= targets.tv && q.ppl() <= q.dense_ppl() * (1.0 + targets.ppl)
    };
    match q.iter().find(|q| fits(q)) {
        Some(q) => Ok(q.clone()),
        None => {
            tracing::warn!("no probe count reached the target on held-out text; the default probes every cluster");
            Ok(q.last().expect("a grid of at least one count").clone())
        }
    }
}

/// The tokens of `path` from byte `offset`.
fn calibration_tokens(engine: &spinfer_engine::Engine, path: &PathBuf, offset: usize) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if offset >= bytes.len() {
        bail!("--offset {offset} is past the end of {} ({} bytes)", path.display(), bytes.len());
    }
    let text = String::from_utf8_lossy(&bytes[offset..]).replace("\r\n", "\n");
    let tokens = engine.tokenizer.encode(&text, false)?;
    if tokens.is_empty() {
        bail!("{} holds no text past --offset {offset}", path.display());
    }
    Ok(tokens)
}

#[derive(Args)]
pub struct HeadEvalArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Text file (UTF-8; CRLF read as LF), tokenised as `perplexity` does
    /// by default (the tokenizer's BOS rule).
    #[arg(short, long)]
    pub file: PathBuf,
    /// Window size in tokens.
    #[arg(short = 'c', long, default_value_t = 512)]
    pub ctx: usize,
    /// Windows to measure.
    #[arg(long, default_value_t = 40)]
    pub windows: usize,
    /// Probe counts to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,256,512")]
    pub probes: Vec<usize>,
}

pub fn head_eval(a: HeadEvalArgs) -> Result<()> {
    if a.common.head_index.is_none() {
        bail!("head-eval measures a head index: give --head-index FILE");
    }
    let text = crate::commands::read_text(&a.file)?;
    let mut common = a.common.clone();
    common.head_probes = Some(1);
    let engine = load(&common, Some(a.ctx))?;
    let Some(head) = &engine.model.head else { bail!("--head dense: nothing to evaluate") };
    let tokens = engine.tokenizer.encode(&text, engine.tokenizer.add_bos_default())?;
    let windows = a.windows.min(tokens.len() / a.ctx.max(1));
    let bar = progress(a.common.quiet || a.common.json, windows as u64, "windows");
    let mut session = engine.new_session();
    let q = evaluate(&engine.model, head, &mut session, &tokens, a.ctx, windows, &a.probes, &mut |d, _| {
        bar.set_position(d as u64)
    })?;
    bar.finish_and_clear();
    let rows: Vec<_> = q
        .iter()
        .map(|q| {
            serde_json::json!({"probes": q.probes, "clusters": head.rule.index.clusters(), "row_fraction": q.row_fraction,
                "argmax_agreement": q.agreement(), "positions": q.tv.len(), "tv_mean": q.mean_tv(),
                "tv_p99": q.tv_quantile(0.99), "ppl": q.ppl(), "dense_ppl": q.dense_ppl()})
        })
        .collect();
    if a.common.json {
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    println!(
        "{} clusters, {} positions ({windows} windows of {})",
        head.rule.index.clusters(),
        q.first().map_or(0, |q| q.tv.len()),
        a.ctx
    );
    if let Some(q) = q.first() {
        println!("dense head perplexity {:.4}", q.dense_ppl());
    }
    println!("{:>7} {:>9} {:>10} {:>9} {:>9} {:>10}", "probes", "rows %", "argmax %", "TV mean", "TV p99", "ppl");
    for q in &q {
        println!(
            "{:>7} {:>9.2} {:>10.2} {:>9.4} {:>9.4} {:>10.4}",
            q.probes,
            100.0 * q.row_fraction,
            100.0 * q.agreement(),
            q.mean_tv(),
            q.tv_quantile(0.99),
            q.ppl()
        );
    }
    Ok(())
}
