//! `spinfer kernels` (which kernel serves each operation, and why) and
//! `spinfer tune` (benchmark every candidate on the model's shapes, and
//! with `--synthetic-shapes` on a generic shape grid too, and record the
//! results in the history store).

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Args;
use spinfer_engine::Engine;
use spinfer_engine::registry::describe;
use spinfer_engine::tuning::{HistoryStore, Outcome, tune};
use spinfer_kernels::kernel::MatmulDesc;
use spinfer_registry::synthetic_shapes;

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

/// The generic grid of [`synthetic_shapes`] for each (weight type,
/// activation type) among `descs`, minus the shapes `descs` already holds.
pub fn synthetic_descs(descs: &[MatmulDesc]) -> Vec<MatmulDesc> {
    let mut out: Vec<MatmulDesc> = Vec::new();
    for d in descs {
        if out.iter().any(|o| (o.wtype, o.act) == (d.wtype, d.act)) {
            continue;
        }
        let own: Vec<(usize, usize)> =
            descs.iter().filter(|o| (o.wtype, o.act) == (d.wtype, d.act)).map(|o| (o.rows, o.cols)).collect();
        out.extend(synthetic_shapes(d.wtype.block_size(), &own).into_iter().map(|(rows, cols)| MatmulDesc {
            rows,
            cols,
            ..*d
        }));
    }
    out
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
    print_choices(&engine, a.common.json);
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
    let mut history = HistoryStore::open(&history_path)?;
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
                    "provider": l.provider,
                    "why": l.choice.to_string(),
                    "alternatives": l.alternatives.iter().map(|(k, ns)| serde_json::json!({"kernel": k, "median_ns": ns})).collect::<Vec<_>>(),
                })
            })
            .collect();
        println!("{}", serde_json::Value::Array(v));
        return;
    }
    for l in choices {
        println!("{}", describe(&l.desc));
        println!("  -> {} ({}): {}", l.kernel_name(), l.provider, l.choice);
        for (k, ns) in &l.alternatives {
            match ns {
                Some(ns) => println!("     {k:<48} {:>10.1} µs", *ns as f64 / 1e3),
                None => println!("     {k:<48} {:>10}", "-"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use spinfer_kernels::GgmlType;
    use spinfer_kernels::kernel::ActType;

    use super::*;

    #[test]
    fn synthetic_descs_cover_each_type_once_without_the_model_shapes() {
        let q41 = |rows, cols| MatmulDesc { wtype: GgmlType::Q4_1, act: ActType::Q8_1, rows, cols };
        let q80 = |rows, cols| MatmulDesc { wtype: GgmlType::Q8_0, act: ActType::Q8_0, rows, cols };
        let model = [q41(576, 576), q41(512, 1024), q41(576, 576), q80(49152, 576)];
        let extra = synthetic_descs(&model);
        let grid = synthetic_shapes(32, &[]);
        let of = |w| extra.iter().filter(|d| d.wtype == w).map(|d| (d.rows, d.cols)).collect::<Vec<_>>();
        // The model's own 512x1024 is measured anyway: left out for q4_1 only.
        let want_q41: Vec<_> = grid.iter().copied().filter(|&s| s != (512, 1024)).collect();
        assert_eq!(of(GgmlType::Q4_1), want_q41);
        assert_eq!(of(GgmlType::Q8_0), grid);
        assert_eq!(extra.len(), 2 * grid.len() - 1);
        assert!(extra.iter().all(|d| d.act == ActType::fast_for(d.wtype)));
        assert!(synthetic_descs(&[]).is_empty());
    }
}
