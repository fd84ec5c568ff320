//! `spinfer kernels` (which kernel serves each operation, and why) and
//! `spinfer tune` (benchmark every candidate on the model's shapes, and
//! with `--synthetic-shapes` on a generic shape grid too, and record the
//! results in the history store).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use spinfer_engine::Engine;
use spinfer_engine::registry::describe;
use spinfer_engine::sparse::ColumnAxpy;
use spinfer_engine::tuning::{HistoryStore, Outcome, synthetic_descs, tune};

use crate::commands::{CommonArgs, load_config, progress};

#[derive(Args)]
pub struct KernelsArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Kernel history store (overrides the config's `packs.history`).
    #[arg(long)]
    pub history: Option<PathBuf>,
    /// `tune` only: also benchmark a generic grid of shapes (32..8192 rows x
    /// 256..4096 columns) for each weight/activation type of the model, so
    /// that models with other dimensions pick kernels from a nearby measured
    /// shape without being tuned themselves.
    #[arg(long)]
    pub synthetic_shapes: bool,
}

pub fn kernels(a: KernelsArgs) -> Result<()> {
    if a.synthetic_shapes {
        bail!("--synthetic-shapes is for `spinfer tune` (it benchmarks); `spinfer kernels` only reports");
    }
    let mut config = a.common.config(None)?;
    if a.history.is_some() {
        config.packs.history = a.history.clone();
    }
    let engine = load_config(&a.common, &config)?;
    if !a.common.json {
        print_providers(&config)?;
    }
    print_choices(&engine, a.common.json);
    Ok(())
}

/// The kernel providers the config registers (built-in and packs), with
/// their scores and what the scores rest on; and the packs skipped, why.
fn print_providers(config: &spinfer_engine::config::Config) -> Result<()> {
    // The history does not change the providers: not read a second time.
    let mut config = config.clone();
    config.packs.history = None;
    let (registry, status) = spinfer_engine::engine::registry_from_config(&config)?;
    for (name, score, detail, excluded) in registry.providers() {
        let note = if excluded { " (excluded by [kernels] exclude)" } else { "" };
        let detail = if detail.is_empty() { String::new() } else { format!(": {detail}") };
        println!("provider {name}: score {score}{detail}{note}");
    }
    for s in status {
        if let Err(why) = s.outcome {
            println!("pack {} skipped: {why}", s.dir.display());
        }
    }
    Ok(())
}

pub fn tune_cmd(a: KernelsArgs) -> Result<()> {
    let mut config = a.common.config(None)?;
    let Some(history_path) = a.history.clone().or(config.packs.history.clone()) else {
        bail!("give --history PATH (or packs.history in the config) to record measurements");
    };
    // Resolve candidates without history, measure, then reload with it.
    config.packs.history = None;
    let engine = load_config(&a.common, &config)?;
    let (registry, _) = spinfer_engine::engine::registry_from_config(&config)?;
    let mut descs: Vec<_> = engine.model.kernel_choices().iter().map(|l| l.desc).collect();
    if a.synthetic_shapes {
        let extra = synthetic_descs(&descs);
        if !(a.common.quiet || a.common.json) {
            eprintln!("tuning {} synthetic shapes besides the model's {}", extra.len(), descs.len());
        }
        descs.extend(extra);
    }
    let n_candidates: usize = descs.iter().map(|d| registry.candidates(d).len()).sum();
    let bar = progress(a.common.quiet || a.common.json, n_candidates as u64, "kernels");
    let mut history = HistoryStore::open_writer(&history_path)?;
    let session = engine.new_session();
    let results = tune(&registry, &descs, session.pool(), &mut history, &mut |done, total, what| {
        // (kernel, phase) pairs of the distinct operations.
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(what.to_string());
    })?;
    bar.finish_and_clear();
    for (desc, ms) in &results {
        for m in ms {
            if let Outcome::Rejected { reason } = &m.outcome {
                eprintln!("{}: {} rejected: {reason}", describe(desc), m.kernel_id);
            }
        }
    }
    drop(history);
    drop(engine);
    config.packs.history = Some(history_path);
    let engine = load_config(&a.common, &config)?;
    print_choices(&engine, a.common.json);
    Ok(())
}

fn print_choices(engine: &Engine, json: bool) {
    let choices = engine.model.kernel_choices();
    if json {
        let v: Vec<_> = choices
            .iter()
            .map(|l| {
                serde_json::json!({
                    "op": describe(&l.desc),
                    "kernel": l.kernel_name(),
                    "provider": l.provider(),
                    "rows_provider": l.rows_provider(),
                    "why": l.choice().to_string(),
                    "alternatives": l.alternatives().iter().map(|(k, ns)| serde_json::json!({"kernel": k, "median_ns": ns})).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
        return;
    }
    // The CUDA provider: score 0 and why where it cannot run (no build
    // feature, no driver, no device); `generate --device cuda` uses it.
    let (score, why) = spinfer_kernels_cuda::score();
    println!("cuda (spinfer-kernels-cuda): score {score}: {why}");
    for l in choices {
        println!("{}", describe(&l.desc));
        println!("  -> {} ({}): {}", l.kernel_name(), l.provider(), l.choice());
        if l.rows_provider() != l.provider() {
            println!("     gathered rows (sparse FFN): {}", l.rows_provider());
        }
        for (k, ns) in l.alternatives() {
            match ns {
                Some(ns) => println!("     {k:<48} {:>10.1} µs", *ns as f64 / 1e3),
                None => println!("     {k:<48} {:>10}", "-"),
            }
        }
    }
    if let Some(h) = &engine.model.head {
        let c = &h.centroids;
        println!(
            "sparse head cluster scores ({}x{} means): {} ({})",
            c.desc.rows,
            c.desc.cols,
            c.kernel_name(),
            c.provider()
        );
        let rows = h.rows.as_ref().unwrap_or(&engine.model.weights.output);
        println!(
            "sparse head rows ({} of {} clusters, {}): gathered rows by {}",
            h.rule.probes,
            h.rule.index.clusters(),
            if h.rows.is_some() { "cluster-ordered copy" } else { "in place" },
            rows.rows_provider()
        );
    }
    if let Some(sp) = &engine.model.sparse {
        let providers = |it: &mut dyn Iterator<Item = &ColumnAxpy>| {
            let mut p: Vec<&str> = it.map(ColumnAxpy::provider).collect();
            p.dedup();
            p.join(", ")
        };
        let down = providers(&mut sp.layers.iter().map(|l| &l.down));
        println!("sparse FFN down projection (gathered-column axpy): {down}");
        let wo = providers(&mut sp.layers.iter().filter_map(|l| Some(&l.attn_o.as_ref()?.w)));
        if !wo.is_empty() {
            println!("sparse attention output (gathered-column axpy): {wo}");
        }
    }
}
