//! `spinfer calibrate-head` (cluster the output head's rows into a head
//! index) and `spinfer head-eval` (how the sparse head agrees with the
//! dense one, per probe count, on real text).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use spinfer_engine::head::eval::evaluate;
use spinfer_engine::head::{HeadBuildOptions, HeadIndex};

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
    #[arg(long, default_value_t = 0, requires = "text")]
    pub hot: usize,
    /// Calibration text for --hot (UTF-8; CRLF read as LF). Keep it
    /// disjoint from evaluation text (see --offset).
    #[arg(long)]
    pub text: Option<PathBuf>,
    /// Start reading --text at this byte (e.g. 800000 for WikiText-2's test
    /// split, whose start is used for evaluation).
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// Do not write the head's rows re-ordered by cluster beside the index
    /// (`<out>.rows`, as large as the head): probed clusters are then read
    /// row by row in place in the model file.
    #[arg(long)]
    pub no_rows: bool,
    /// Output head index (never the model file).
    #[arg(short, long)]
    pub out: PathBuf,
}

pub fn calibrate_head(a: CalibrateHeadArgs) -> Result<()> {
    if a.common.head.is_some() || a.common.head_index.is_some() {
        bail!("calibrate-head builds a head index from the dense model: drop --head and --head-index");
    }
    let config = a.common.config(Some(1))?;
    if config.model.path == a.out {
        bail!("--out {} is the model file; write the head index beside it", a.out.display());
    }
    if a.iters == 0 || a.iters > 100 {
        bail!("--iters must be in 1..=100, got {}", a.iters);
    }
    let engine = crate::commands::load_config(&a.common, &config)?;
    let hot = match &a.text {
        Some(path) if a.hot > 0 => frequent_tokens(&engine, path, a.offset, a.hot)?,
        _ => Vec::new(),
    };
    let o = HeadBuildOptions { cluster_rows: a.cluster_rows, iters: a.iters, seed: a.seed };
    let bar = progress(a.common.quiet || a.common.json, a.iters as u64, "k-means rounds");
    let session = engine.new_session();
    let t = std::time::Instant::now();
    let mut index =
        HeadIndex::build(&engine.model, session.pool(), &o, &hot, &mut |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();
    if !a.no_rows {
        index.write_rows(&engine.model, &a.out)?;
    }
    index.save(&a.out)?;
    let secs = t.elapsed().as_secs_f64();
    if a.common.json {
        println!(
            "{}",
            serde_json::json!({"out": a.out, "clusters": index.clusters(), "cluster_rows": a.cluster_rows,
                "iters": a.iters, "seconds": secs, "head": index.model})
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
        }
        println!("{}", a.out.display());
    }
    Ok(())
}

/// The `n` most frequent tokens of `path` from byte `offset` (ties to the
/// lower id).
fn frequent_tokens(engine: &spinfer_engine::Engine, path: &PathBuf, offset: usize, n: usize) -> Result<Vec<u32>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if offset >= bytes.len() {
        bail!("--offset {offset} is past the end of {} ({} bytes)", path.display(), bytes.len());
    }
    let text = String::from_utf8_lossy(&bytes[offset..]).replace("\r\n", "\n");
    let tokens = engine.tokenizer.encode(&text, false)?;
    Ok(spinfer_engine::head::frequent_tokens(&tokens, engine.model.config.vocab_size, n))
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
            serde_json::json!({"probes": q.probes, "clusters": head.index.clusters(), "row_fraction": q.row_fraction,
                "argmax_agreement": q.agreement(), "positions": q.tv.len(), "tv_mean": q.mean_tv(),
                "tv_p99": q.tv_quantile(0.99)})
        })
        .collect();
    if a.common.json {
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    println!(
        "{} clusters, {} positions ({windows} windows of {})",
        head.index.clusters(),
        q.first().map_or(0, |q| q.tv.len()),
        a.ctx
    );
    println!("{:>7} {:>9} {:>10} {:>9} {:>9}", "probes", "rows %", "argmax %", "TV mean", "TV p99");
    for q in &q {
        println!(
            "{:>7} {:>9.2} {:>10.2} {:>9.4} {:>9.4}",
            q.probes,
            100.0 * q.row_fraction,
            100.0 * q.agreement(),
            q.mean_tv(),
            q.tv_quantile(0.99)
        );
    }
    Ok(())
}
