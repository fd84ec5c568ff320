//! Benchmark-driven kernel selection from recorded history.
//!
//! Deterministic given the history: a lone candidate is taken;
//! else the fastest kernel measured on exactly this shape (latest record per
//! kernel); else the fastest current candidate over the nearest recorded
//! shapes (up to [`NEAREST_SHAPES`], by geometric mean of each candidate's
//! time over the fastest on that shape); else the registry's default (first
//! candidate). A kernel whose latest record is a rejection is never chosen
//! by timing.
//!
//! **Near-ties.** Candidates within [`TIE_MARGIN`] of the fastest are tied,
//! and a tie goes to the built-in kernel, then to registry order. Between
//! two copies of one kernel, or two memory-bound kernels, a ranking inside
//! a few percent is measurement noise on a shared machine: it flipped from
//! one tuning pass to the next. A pack kernel has to be measurably faster
//! than the built-in one to displace it, which also spares the pack's
//! per-call cost (the ABI crossing) on small shapes.
//! Pins are the registry's business (`KernelRegistry::resolve` applies
//! them before asking for a selection).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use spinfer_kernels::kernel::{MatmulDesc, MatmulKernel};

use super::bench::{Phase, kernel_id};
use super::history::{HistoryStore, Record};
use crate::op_names::{BUILTIN, describe};
use crate::{Error, Result};

/// Candidates this much slower than the fastest or less are tied with it.
pub const TIE_MARGIN: f64 = 0.05;

/// How many nearby recorded shapes an unseen shape's selection combines.
pub const NEAREST_SHAPES: usize = 3;

/// Why a kernel was selected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Fastest measured on this exact shape on this host.
    Measured,
    /// Fastest over the `shapes` nearest recorded shapes, the nearest being
    /// `from = (rows, cols)`.
    NearestNeighbour { from: (usize, usize), shapes: usize },
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

/// Median of kernel `id`'s latest usable record in `by_kernel`.
fn time_of(by_kernel: &BTreeMap<String, Record>, id: &str) -> Option<u64> {
    by_kernel.get(id).filter(|r| r.rejected.is_none()).and_then(|r| r.median_ns)
}

/// Every candidate with its time in `by_kernel`, fastest first, then the
/// unmeasured ones in kernel-id order.
fn alternatives(ids: &[String], by_kernel: &BTreeMap<String, Record>) -> Vec<(String, Option<u64>)> {
    let mut alts: Vec<(String, Option<u64>)> =
        ids.iter().collect::<BTreeSet<_>>().into_iter().map(|id| (id.clone(), time_of(by_kernel, id))).collect();
    alts.sort_by(|a, b| match (a.1, b.1) {
        (Some(x), Some(y)) => (x, &a.0).cmp(&(y, &b.0)),
        (Some(_), None) => std::cmp::Ordering::Less,
        (None, Some(_)) => std::cmp::Ordering::Greater,
        (None, None) => a.0.cmp(&b.0),
    });
    alts
}

/// The candidate with the lowest `cost` (lower is faster), every candidate
/// within [`TIE_MARGIN`] of it counting as tied: a tie goes to the first
/// built-in candidate, else to the first in registry order.
fn best(builtin: &[bool], cost: &[Option<f64>]) -> Option<usize> {
    let min = cost.iter().flatten().copied().fold(f64::INFINITY, f64::min);
    (0..cost.len())
        .filter(|&i| cost[i].is_some_and(|c| c <= min * (1.0 + TIE_MARGIN)))
        .min_by_key(|&i| (!builtin[i], i))
}

/// Squared distance between two shapes in (log2 rows, log2 cols).
fn shape_dist((r0, c0): (usize, usize), (r1, c1): (usize, usize)) -> f64 {
    let l = |n: usize| (n.max(1) as f64).log2();
    (l(r0) - l(r1)).powi(2) + (l(c0) - l(c1)).powi(2)
}

/// A recorded shape and the latest record per kernel on it.
type ShapeGroup = ((usize, usize), BTreeMap<String, Record>);

/// Selection for an unseen shape from `near` (records of nearby shapes):
/// the nearest shapes with a usable current candidate, at most
/// [`NEAREST_SHAPES`] and none more than twice as far (in log2 rows and
/// cols) as the nearest; per candidate the geometric mean, over those
/// shapes it was timed on, of its time over the fastest candidate's; only
/// candidates timed on the nearest shape compete. Returns the pick, how
/// many shapes were combined, and the nearest one with its latest records.
fn nearest_pick(
    desc: &MatmulDesc,
    ids: &[String],
    builtin: &[bool],
    near: &[Record],
) -> Option<(usize, usize, ShapeGroup)> {
    let mut shapes: Vec<(usize, usize)> = Vec::new();
    for r in near {
        if !shapes.contains(&(r.rows, r.cols)) {
            shapes.push((r.rows, r.cols));
        }
    }
    let groups: Vec<ShapeGroup> = shapes
        .into_iter()
        .map(|shape| (shape, latest(near.iter().filter(|r| (r.rows, r.cols) == shape).cloned())))
        .filter(|(_, g)| ids.iter().any(|id| time_of(g, id).is_some()))
        .collect();
    let here = (desc.rows, desc.cols);
    let nearest = shape_dist(groups.first()?.0, here);
    let used: Vec<&ShapeGroup> = groups
        .iter()
        .take(NEAREST_SHAPES)
        // Squared distances: twice as far is four times the square.
        .take_while(|(shape, _)| shape_dist(*shape, here) <= 4.0 * nearest + 1e-9)
        .collect();
    // The fastest usable time on each shape used (every used shape has one).
    let fastest: Vec<u64> =
        used.iter().map(|(_, g)| ids.iter().filter_map(|i| time_of(g, i)).min().unwrap_or(1).max(1)).collect();
    let cost: Vec<Option<f64>> = ids
        .iter()
        .map(|id| {
            time_of(&used[0].1, id)?;
            let logs: Vec<f64> = used
                .iter()
                .zip(&fastest)
                .filter_map(|((_, g), &f)| Some((time_of(g, id)? as f64 / f as f64).ln()))
                .collect();
            Some((logs.iter().sum::<f64>() / logs.len() as f64).exp())
        })
        .collect();
    let pick = best(builtin, &cost)?;
    Some((pick, used.len(), used[0].clone()))
}

/// Picks the kernel for `desc` in `phase` among `candidates` (as from
/// `KernelRegistry::candidates`) using `history` measured on `host`
/// (`Host::fingerprint`).
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
    let builtin: Vec<bool> = candidates.iter().map(|(p, _)| p == BUILTIN).collect();
    let exact = latest(history.records_for(host, desc, phase));
    let pick = |index: usize, reason: Reason, alternatives| Selection {
        kernel_id: ids[index].clone(),
        index,
        reason,
        alternatives,
    };

    if candidates.len() == 1 {
        return Ok(pick(0, Reason::OnlyCandidate, alternatives(&ids, &exact)));
    }
    let cost: Vec<Option<f64>> = ids.iter().map(|id| time_of(&exact, id).map(|t| t as f64)).collect();
    if let Some(i) = best(&builtin, &cost) {
        return Ok(pick(i, Reason::Measured, alternatives(&ids, &exact)));
    }
    let near = history.nearest(host, desc, phase, 64);
    if let Some((i, shapes, (from, group))) = nearest_pick(desc, &ids, &builtin, &near) {
        let reason = Reason::NearestNeighbour { from, shapes };
        return Ok(pick(i, reason, alternatives(&ids, &group)));
    }
    Ok(pick(0, Reason::Default, alternatives(&ids, &exact)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::KernelRegistry;
    use crate::tuning::bench::BenchOptions;
    use crate::tuning::history::{Host, make_record};
    use crate::tuning::tune::tune_with;
    use spinfer_kernels::GgmlType;
    use spinfer_kernels::kernel::ActType;
    use spinfer_kernels::pool::ThreadPool;

    #[test]
    fn synthetic_descs_cover_each_type_once_without_the_model_shapes() {
        let q41 = |rows, cols| MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, rows, cols);
        let q80 = |rows, cols| MatmulDesc::dense(GgmlType::Q8_0, ActType::Q8_0, rows, cols);
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
        fn run(&self, _: &ThreadPool, _: spinfer_kernels::kernel::MatmulCall<'_>) -> spinfer_kernels::Result<()> {
            Ok(())
        }
    }

    fn cands(names: &[&'static str]) -> Vec<(String, Arc<dyn MatmulKernel>)> {
        names.iter().map(|n| ("p".to_string(), Arc::new(Named(n)) as Arc<dyn MatmulKernel>)).collect()
    }

    fn desc(rows: usize, cols: usize) -> MatmulDesc {
        MatmulDesc::dense(GgmlType::Q4_0, ActType::Q8_0, rows, cols)
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
        assert_eq!(
            (s.kernel_id.as_str(), &s.reason),
            ("p/b", &Reason::NearestNeighbour { from: (4096, 4096), shapes: 1 })
        );
        let s = select(&desc(128, 64), Phase::Decode, &c, &h, "h").unwrap();
        assert_eq!((s.kernel_id.as_str(), &s.reason), ("p/a", &Reason::NearestNeighbour { from: (64, 64), shapes: 1 }));

        let one = cands(&["b"]);
        assert_eq!(select(&small, Phase::Decode, &one, &h, "h").unwrap().reason, Reason::OnlyCandidate);
        assert!(select(&small, Phase::Decode, &[], &h, "h").is_err());
    }

    #[test]
    fn near_ties_go_to_the_builtin_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = HistoryStore::open(dir.path().join("h.redb")).unwrap();
        // A pack scores higher than the built-in provider, so it comes first.
        let mut c = cands(&["x"]);
        c[0].0 = "pack@1.0.0#abc".to_string();
        c.push((BUILTIN.to_string(), Arc::new(Named("y"))));
        let d = desc(256, 256);
        h.record(&rec(&d, "pack@1.0.0#abc/x", Some(100), 1)).unwrap();
        h.record(&rec(&d, "cpu-builtin/y", Some(104), 1)).unwrap();
        assert_eq!(select(&d, Phase::Decode, &c, &h, "h").unwrap().kernel_id, "cpu-builtin/y");
        // Measurably faster (more than the margin): the pack.
        h.record(&rec(&d, "pack@1.0.0#abc/x", Some(90), 2)).unwrap();
        assert_eq!(select(&d, Phase::Decode, &c, &h, "h").unwrap().kernel_id, "pack@1.0.0#abc/x");
        // Without a built-in among the tied, registry order decides.
        let c = cands(&["a", "b"]);
        h.record(&rec(&d, "p/a", Some(104), 1)).unwrap();
        h.record(&rec(&d, "p/b", Some(100), 1)).unwrap();
        assert_eq!(select(&d, Phase::Decode, &c, &h, "h").unwrap().kernel_id, "p/a");
    }

    #[test]
    fn unseen_shape_combines_the_nearest_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = HistoryStore::open(dir.path().join("h.redb")).unwrap();
        let c = cands(&["a", "b"]);
        // The nearest shape says b by 8%; the next two say a by 30%; a far
        // shape (beyond twice the nearest distance) says b by a lot.
        for (rows, cols, a, b) in
            [(1024, 1024, 108, 100), (1024, 2048, 100, 130), (2048, 1024, 100, 130), (64, 64, 500, 1)]
        {
            h.record(&rec(&desc(rows, cols), "p/a", Some(a), 1)).unwrap();
            h.record(&rec(&desc(rows, cols), "p/b", Some(b), 1)).unwrap();
        }
        let s = select(&desc(1300, 1300), Phase::Decode, &c, &h, "h").unwrap();
        assert_eq!(
            (s.kernel_id.as_str(), &s.reason),
            ("p/a", &Reason::NearestNeighbour { from: (1024, 1024), shapes: 3 })
        );
        // The alternatives are the nearest shape's times.
        assert_eq!(s.alternatives, vec![("p/b".to_string(), Some(100)), ("p/a".to_string(), Some(108))]);
        // Alone, the nearest shape decides.
        let s = select(&desc(1024, 1030), Phase::Decode, &c, &h, "h").unwrap();
        assert_eq!(
            (s.kernel_id.as_str(), &s.reason),
            ("p/b", &Reason::NearestNeighbour { from: (1024, 1024), shapes: 1 })
        );
    }

    #[test]
    fn tune_records_and_selection_uses_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut h = HistoryStore::open(dir.path().join("h.redb")).unwrap();
        let reg = KernelRegistry::builtin();
        let pool = ThreadPool::new(2);
        let d = MatmulDesc::dense(GgmlType::Q8_0, ActType::Q8_0, 64, 256);
        let opts = BenchOptions { warmup: 1, runs: 3, rounds: 2, prefill_tokens: 8, seed: 1 };
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
            // The fastest, or one within the tie margin of it.
            let decode: Vec<_> = out[0].1.iter().filter(|m| m.phase == Phase::Decode).collect();
            let fastest = decode.iter().filter_map(|m| m.median_ns()).min().unwrap();
            let chosen = decode.iter().find(|m| m.kernel_id == s.kernel_id).and_then(|m| m.median_ns()).unwrap();
            assert!(chosen as f64 <= fastest as f64 * (1.0 + TIE_MARGIN), "{chosen} vs {fastest}");
        }
    }
}
