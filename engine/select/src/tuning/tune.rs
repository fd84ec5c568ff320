//! `spinfer tune`: benchmark every candidate the kernel registry offers
//! for a model's operations and record the results in the history. Above
//! both the registry and the selection it feeds (the registry never calls
//! it).

use spinfer_kernels::kernel::MatmulDesc;
use spinfer_kernels::pool::ThreadPool;

use super::bench::{BenchOptions, Measurement, Outcome, Phase, benchmark};
use super::history::{HistoryStore, Host, make_record, now};
use crate::Result;
use crate::op_names::describe;
use crate::registry::KernelRegistry;

/// Benchmarks every distinct operation of `descs` with every candidate the
/// registry offers (default [`BenchOptions`]), records the results in
/// `history` for this host, and returns the measurements.
pub fn tune(
    registry: &KernelRegistry,
    descs: &[MatmulDesc],
    pool: &ThreadPool,
    history: &mut HistoryStore,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<(MatmulDesc, Vec<Measurement>)>> {
    tune_with(registry, descs, pool, history, &BenchOptions::default(), progress)
}

/// As [`tune`] with explicit benchmark options.
pub fn tune_with(
    registry: &KernelRegistry,
    descs: &[MatmulDesc],
    pool: &ThreadPool,
    history: &mut HistoryStore,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Result<Vec<(MatmulDesc, Vec<Measurement>)>> {
    let host = Host::detect().fingerprint();
    let mut unique: Vec<MatmulDesc> = Vec::new();
    for d in descs {
        if !unique.contains(d) {
            unique.push(*d);
        }
    }
    let work: Vec<_> = unique.into_iter().map(|d| (d, registry.candidates(&d))).collect();
    let total: usize = work.iter().map(|(_, c)| c.len() * Phase::ALL.len()).sum();
    let mut base = 0;
    let mut out = Vec::with_capacity(work.len());
    for (desc, cands) in work {
        let op = describe(&desc);
        let ms = benchmark(&desc, &cands, pool, opts, &mut |d, _, id| progress(base + d, total, &format!("{op} {id}")));
        base += cands.len() * Phase::ALL.len();
        let date = now();
        for m in &ms {
            let (median, rejected) = match &m.outcome {
                Outcome::Timed { median_ns } => (Some(*median_ns), None),
                Outcome::Rejected { reason } => (None, Some(reason.clone())),
            };
            history.record(&make_record(&host, &desc, m.phase, m.n_tokens, &m.kernel_id, median, rejected, date))?;
        }
        out.push((desc, ms));
    }
    Ok(out)
}
