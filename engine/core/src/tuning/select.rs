//! Benchmark-driven kernel selection from recorded history.
//!
//! Deterministic given the history: a lone candidate is taken;
//! else the fastest kernel measured on exactly this shape (latest record per
//! kernel, ties by kernel id); else the fastest current candidate on the
//! nearest recorded shape; else the registry's default (first candidate).
//! A kernel whose latest record is a rejection is never chosen by timing.
//! Pins are the registry's business ([`KernelRegistry::resolve`] applies
//! them before asking for a selection).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use spinfer_kernels::kernel::{MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::ThreadPool;

use super::bench::{BenchOptions, Measurement, Outcome, Phase, benchmark, kernel_id};
use super::history::{HistoryStore, Host, Record, make_record, now};
use crate::registry::{KernelRegistry, describe};
use crate::{Error, Result};

/// Why a kernel was selected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Fastest measured on this exact shape on this host.
    Measured,
    /// Fastest on the nearest recorded shape `(rows, cols)`.
    NearestNeighbour { from: (usize, usize) },
    /// The only candidate.
    OnlyCandidate,
    /// No usable history: the registry's default (first candidate).
    Default,
}

/// The outcome of [`select`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// `"<provider>/<kernel name>"` of the chosen candidate.
    pub kernel_id: String,
    /// Index of the chosen kernel in the candidate list.
    pub index: usize,
    pub reason: Reason,
    /// Every candidate (the chosen one included) with its median on the
    /// shape the decision was based on (`None`: unmeasured or rejected),
    /// fastest first, then unmeasured ones in kernel-id order.
    pub alternatives: Vec<(String, Option<u64>)>,
}

/// Latest record per kernel id.
fn latest(records: impl IntoIterator<Item = Record>) -> BTreeMap<String, Record> {
    let mut m: BTreeMap<String, Record> = BTreeMap::new();
    for r in records {
        match m.get(&r.kernel_id) {
            Some(old) if old.date > r.date => {}
            _ => {
                m.insert(r.kernel_id.clone(), r);
            }
        }
    }
    m
}

/// The fastest timed candidate of `by_kernel`, and the alternatives list.
fn fastest(ids: &[String], by_kernel: &BTreeMap<String, Record>) -> (Option<usize>, Vec<(String, Option<u64>)>) {
    let time = |id: &String| by_kernel.get(id).filter(|r| r.rejected.is_none()).and_then(|r| r.median_ns);
    let mut best: Option<(u64, &String, usize)> = None;
    for (i, id) in ids.iter().enumerate() {
        if let Some(t) = time(id)
            && best.is_none_or(|(bt, bid, _)| (t, id) < (bt, bid))
        {
            best = Some((t, id, i));
        }
    }
    let mut alts: Vec<(String, Option<u64>)> =
        ids.iter().collect::<BTreeSet<_>>().into_iter().map(|id| (id.clone(), time(id))).collect();
    alts.sort_by(|a, b| match (a.1, b.1) {
        (Some(x), Some(y)) => (x, &a.0).cmp(&(y, &b.0)),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => a.0.cmp(&b.0),
    });
    (best.map(|b| b.2), alts)
}

/// Picks the kernel for `desc` in `phase` among `candidates` (as from
/// [`KernelRegistry::candidates`]) using `history` measured on `host`
/// ([`Host::fingerprint`]).
pub fn select(
    desc: &MatmulDesc,
    phase: Phase,
    candidates: &[(String, Arc<dyn MatmulKernel>)],
    history: &HistoryStore,
    host: &str,
) -> Result<Selection> {
    if candidates.is_empty() {
        return Err(Error::NoKernel { op: describe(desc) });
    }
    let ids: Vec<String> = candidates.iter().map(|(p, k)| kernel_id(p, k.as_ref())).collect();
    let exact = latest(history.records_for(host, desc, phase));
    let pick = |index: usize, reason: Reason, alternatives| Selection {
        kernel_id: ids[index].clone(),
        index,
        reason,
        alternatives,
    };

    if candidates.len() == 1 {
        return Ok(pick(0, Reason::OnlyCandidate, fastest(&ids, &exact).1));
    }
    if let (Some(i), alts) = fastest(&ids, &exact) {
        return Ok(pick(i, Reason::Measured, alts));
    }
    // Nearest recorded shapes, nearest first; the first with a usable
    // current candidate decides.
    let near = history.nearest(host, desc, phase, 64);
    let mut shapes: Vec<(usize, usize)> = Vec::new();
    for r in &near {
        if !shapes.contains(&(r.rows, r.cols)) {
            shapes.push((r.rows, r.cols));
        }
    }
    for shape in shapes {
        let group = latest(near.iter().filter(|r| (r.rows, r.cols) == shape).cloned());
        if let (Some(i), alts) = fastest(&ids, &group) {
            return Ok(pick(i, Reason::NearestNeighbour { from: shape }, alts));
        }
    }
    Ok(pick(0, Reason::Default, fastest(&ids, &exact).1))
}

/// The generic grid of [`spinfer_registry::synthetic_shapes`] (what
/// `spinfer tune --synthetic-shapes` measures) for each (weight type,
/// activation type) among `descs`, minus the shapes `descs` already holds.
pub fn synthetic_descs(descs: &[MatmulDesc]) -> Vec<MatmulDesc> {
    let mut out: Vec<MatmulDesc> = Vec::new();
    for d in descs {
        if out.iter().any(|o| (o.wtype, o.act) == (d.wtype, d.act)) {
            continue;
        }
        let own: Vec<(usize, usize)> =
            descs.iter().filter(|o| (o.wtype, o.act) == (d.wtype, d.act)).map(|o| (o.rows, o.cols)).collect();
        out.extend(
            spinfer_registry::synthetic_shapes(d.wtype.block_size(), &own).into_iter().map(|(rows, cols)| MatmulDesc {
                rows,
                cols,
                ..*d
            }),
        );
    }
    out
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use spinfer_kernels::GgmlType;
    use spinfer_kernels::kernel::ActType;

    #[test]
    fn synthetic_descs_cover_each_type_once_without_the_model_shapes() {
        let q41 = |rows, cols| MatmulDesc { wtype: GgmlType::Q4_1, act: ActType::Q8_1, rows, cols };
        let q80 = |rows, cols| MatmulDesc { wtype: GgmlType::Q8_0, act: ActType::Q8_0, rows, cols };
        let model = [q41(576, 576), q41(512, 1024), q41(576, 576), q80(49152, 576)];
        let extra = synthetic_descs(&model);
        let grid = spinfer_registry::synthetic_shapes(32, &[]);
        let of = |w| extra.iter().filter(|d| d.wtype == w).map(|d| (d.rows, d.cols)).collect::<Vec<_>>();
        // The model's own 512x1024 is measured anyway: left out for q4_1 only.
        let want_q41: Vec<_> = grid.iter().copied().filter(|&s| s != (512, 1024)).collect();
        assert_eq!(of(GgmlType::Q4_1), want_q41);
        assert_eq!(of(GgmlType::Q8_0), grid);
        assert_eq!(extra.len(), 2 * grid.len() - 1);
        assert!(extra.iter().all(|d| d.act == ActType::fast_for(d.wtype)));
        assert!(synthetic_descs(&[]).is_empty());
    }

    struct Named(&'static str);
    impl MatmulKernel for Named {
        fn name(&self) -> &str {
            self.0
        }
        fn run(
            &self,
            _: &ThreadPool,
            _: &[u8],
            _: &[f32],
            _: usize,
            _: &mut [f32],
            _: &mut Vec<u8>,
        ) -> spinfer_kernels::Result<()> {
            Ok(())
        }
    }

    fn cands(names: &[&'static str]) -> Vec<(String, Arc<dyn MatmulKernel>)> {
        names.iter().map(|n| ("p".to_string(), Arc::new(Named(n)) as Arc<dyn MatmulKernel>)).collect()
    }

    fn desc(rows: usize, cols: usize) -> MatmulDesc {
        MatmulDesc { wtype: GgmlType::Q4_0, act: ActType::Q8_0, rows, cols }
    }

    fn rec(d: &MatmulDesc, id: &str, ns: Option<u64>, date: u64) -> Record {
        let rej = ns.is_none().then(|| "wrong".to_string());
        make_record("h", d, Phase::Decode, 1, id, ns, rej, date)
    }

    #[test]
    fn prefers_faster_measured_and_is_deterministic() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = HistoryStore::open(dir.path().join("h.redb")).unwrap();
        let c = cands(&["a", "b", "c", "d"]);
        let d = desc(256, 256);
        // Nothing recorded: the default.
        let s = select(&d, Phase::Decode, &c, &h, "h").unwrap();
        assert_eq!((s.kernel_id.as_str(), &s.reason), ("p/a", &Reason::Default));
        h.record(&rec(&d, "p/a", Some(500), 1)).unwrap();
        h.record(&rec(&d, "p/b", Some(300), 1)).unwrap();
        h.record(&rec(&d, "p/c", Some(300), 1)).unwrap();
        h.record(&rec(&d, "p/d", None, 1)).unwrap(); // rejected
        h.record(&rec(&d, "gone/x", Some(1), 1)).unwrap(); // no longer offered
        h.record(&rec(&d, "p/a", Some(200), 0)).unwrap(); // older: superseded
        let s = select(&d, Phase::Decode, &c, &h, "h").unwrap();
        assert_eq!(s.kernel_id, "p/b"); // tie with p/c broken by id
        assert_eq!((s.index, &s.reason), (1, &Reason::Measured));
        let ids: Vec<_> = s.alternatives.iter().map(|(i, t)| (i.as_str(), *t)).collect();
        assert_eq!(ids, vec![("p/b", Some(300)), ("p/c", Some(300)), ("p/a", Some(500)), ("p/d", None)]);
        for _ in 0..5 {
            assert_eq!(select(&d, Phase::Decode, &c, &h, "h").unwrap(), s);
        }
        // A newer, faster measurement of p/a wins.
        h.record(&rec(&d, "p/a", Some(100), 2)).unwrap();
        assert_eq!(select(&d, Phase::Decode, &c, &h, "h").unwrap().kernel_id, "p/a");
        // Other host or phase: no exact history.
        assert_eq!(select(&d, Phase::Prefill, &c, &h, "h").unwrap().reason, Reason::Default);
        assert_eq!(select(&d, Phase::Decode, &c, &h, "h2").unwrap().reason, Reason::Default);
    }

    #[test]
    fn nearest_shape_and_single_candidate() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = HistoryStore::open(dir.path().join("h.redb")).unwrap();
        let c = cands(&["a", "b"]);
        let (small, big) = (desc(64, 64), desc(4096, 4096));
        h.record(&rec(&small, "p/a", Some(10), 1)).unwrap();
        h.record(&rec(&small, "p/b", Some(20), 1)).unwrap();
        h.record(&rec(&big, "p/a", Some(900), 1)).unwrap();
        h.record(&rec(&big, "p/b", Some(800), 1)).unwrap();
        let s = select(&desc(3072, 4096), Phase::Decode, &c, &h, "h").unwrap();
        assert_eq!((s.kernel_id.as_str(), &s.reason), ("p/b", &Reason::NearestNeighbour { from: (4096, 4096) }));
        let s = select(&desc(128, 64), Phase::Decode, &c, &h, "h").unwrap();
        assert_eq!((s.kernel_id.as_str(), &s.reason), ("p/a", &Reason::NearestNeighbour { from: (64, 64) }));

        let one = cands(&["b"]);
        assert_eq!(select(&small, Phase::Decode, &one, &h, "h").unwrap().reason, Reason::OnlyCandidate);
        assert!(select(&small, Phase::Decode, &[], &h, "h").is_err());
    }

    #[test]
    fn tune_records_and_selection_uses_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = HistoryStore::open(dir.path().join("h.redb")).unwrap();
        let reg = KernelRegistry::builtin();
        let pool = ThreadPool::new(2);
        let d = MatmulDesc { wtype: GgmlType::Q8_0, act: ActType::Q8_0, rows: 64, cols: 256 };
        let opts = BenchOptions { warmup: 1, runs: 3, prefill_tokens: 8, seed: 1 };
        let mut last = (0, 0);
        let out = tune_with(&reg, &[d, d], &pool, &mut h, &opts, &mut |done, total, _| last = (done, total)).unwrap();
        assert_eq!(out.len(), 1);
        let n = reg.candidates(&d).len();
        assert_eq!(last, (2 * n, 2 * n));
        assert_eq!(h.len(), 2 * n);
        let host = Host::detect().fingerprint();
        let s = select(&d, Phase::Decode, &reg.candidates(&d), &h, &host).unwrap();
        if n > 1 {
            assert_eq!(s.reason, Reason::Measured);
            let best = out[0]
                .1
                .iter()
                .filter(|m| m.phase == Phase::Decode)
                .min_by_key(|m| (m.median_ns(), m.kernel_id.clone()));
            assert_eq!(Some(&s.kernel_id), best.map(|m| &m.kernel_id));
        }
    }
}
