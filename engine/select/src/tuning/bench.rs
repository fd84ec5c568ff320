//! Benchmarking of candidate kernels on one operation's real shape.
//!
//! Every candidate is first checked against the scalar reference kernel of
//! `spinfer-kernels` on random weights and activations; a candidate that
//! errors or disagrees is [`Outcome::Rejected`] (reported, never selected).
//! The others are timed: warm-up runs, then the median of `runs` runs.

use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, Form, MatmulCall, MatmulDesc, MatmulKernel, Select};
use spinfer_kernels::pool::ThreadPool;

/// Which inference phase a measurement represents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// One token at a time (matrix-vector).
    Decode,
    /// A batch of prompt tokens (matrix-matrix).
    Prefill,
}

impl Phase {
    pub const ALL: [Phase; 2] = [Phase::Decode, Phase::Prefill];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Decode => "decode",
            Phase::Prefill => "prefill",
        }
    }
}

/// Benchmark settings.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Untimed runs before timing.
    pub warmup: usize,
    /// Timed runs per candidate per round; each round contributes its median.
    pub runs: usize,
    /// Interleaved rounds over all candidates; the median of the round
    /// medians is reported.
    pub rounds: usize,
    /// Tokens per run in the prefill phase (see [`BenchOptions::tokens`]
    /// for decode).
    pub prefill_tokens: usize,
    /// Seed of the random weights and activations.
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self { warmup: 2, runs: 5, rounds: 5, prefill_tokens: 64, seed: 0x5eed }
    }
}

impl BenchOptions {
    /// Activation rows per timed run. Decode is timed as the default
    /// precision runs one token: integer activations as two 8-bit planes
    /// (`Precision::Fast` passes `hi` and `lo` as a batch of 2, so the
    /// kernel's split over threads is the batch-2 one), f32 activations as
    /// one row. `Precision::Int8` decodes one plane with the same kernels and
    /// uses the same records.
    pub fn tokens(&self, phase: Phase, act: ActType) -> usize {
        match phase {
            Phase::Decode if act == ActType::F32 => 1,
            Phase::Decode => 2,
            Phase::Prefill => self.prefill_tokens.max(1),
        }
    }
}

/// Result of benchmarking one kernel in one phase.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Agreed with the reference; median wall time of one run.
    Timed { median_ns: u64 },
    /// Errored or disagreed with the reference.
    Rejected { reason: String },
}

/// One (kernel, phase) measurement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Measurement {
    /// `"<provider>/<kernel name>"`.
    pub kernel_id: String,
    pub phase: Phase,
    pub n_tokens: usize,
    pub outcome: Outcome,
}

impl Measurement {
    pub fn median_ns(&self) -> Option<u64> {
        match self.outcome {
            Outcome::Timed { median_ns } => Some(median_ns),
            Outcome::Rejected { .. } => None,
        }
    }
}

/// The id history and selection use for a kernel: `"<provider>/<name>"`.
pub fn kernel_id(provider: &str, kernel: &dyn MatmulKernel) -> String {
    format!("{provider}/{}", kernel.name())
}

/// Benchmarks every candidate for `desc` in both phases. `progress` is
/// called after each (kernel, phase) with `(done, total, kernel id)`.
pub fn benchmark(
    desc: &MatmulDesc,
    candidates: &[(String, Arc<dyn MatmulKernel>)],
    pool: &ThreadPool,
    opts: &BenchOptions,
    progress: &mut dyn FnMut(usize, usize, &str),
) -> Vec<Measurement> {
    let total = candidates.len() * Phase::ALL.len();
    let mut done = 0;
    let mut tick = |i: usize| {
        done += 1;
        progress(done, total, &kernel_id(&candidates[i].0, candidates[i].1.as_ref()));
    };
    let reference = spinfer_kernels::matmul::candidates(&desc.with_form(Form::Dense), &CpuFeatures::default()).pop();
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let w = spinfer_kernels::random::weights(&mut rng, desc.wtype, desc.rows, desc.cols);
    let mut out = Vec::with_capacity(total);
    for phase in Phase::ALL {
        let n_tokens = opts.tokens(phase, desc.act);
        let mut run = Run {
            pool,
            w: &w,
            x: spinfer_kernels::random::acts(&mut rng, n_tokens * desc.cols),
            n_tokens,
            scratch: Vec::new(),
        };
        // The reference result; if the reference itself cannot run, every
        // candidate is rejected (nothing can be verified).
        let want = match &reference {
            None => Err("no scalar reference kernel serves this operation".to_string()),
            Some(r) => run.output(r.as_ref(), desc.rows).map_err(|e| format!("reference: {e}")),
        };
        let outcomes = measure_phase(desc.act, candidates, &mut run, &want, opts, &mut tick);
        for ((provider, kernel), outcome) in candidates.iter().zip(outcomes) {
            out.push(Measurement { kernel_id: kernel_id(provider, kernel.as_ref()), phase, n_tokens, outcome });
        }
    }
    out
}

/// One phase's inputs, shared by every candidate.
struct Run<'a> {
    pool: &'a ThreadPool,
    w: &'a [u8],
    x: Vec<f32>,
    n_tokens: usize,
    scratch: Vec<u8>,
}

impl Run<'_> {
    /// Runs `kernel` once into `y`.
    fn once(&mut self, kernel: &dyn MatmulKernel, y: &mut [f32]) -> Result<(), String> {
        kernel
            .run(self.pool, MatmulCall::dense(self.w, &self.x, self.n_tokens, y, &mut self.scratch))
            .map_err(|e| format!("error: {e}"))
    }

    /// `kernel`'s output for `rows` output rows.
    fn output(&mut self, kernel: &dyn MatmulKernel, rows: usize) -> Result<Vec<f32>, String> {
        let mut y = vec![f32::NAN; self.n_tokens * rows];
        self.once(kernel, &mut y).map(|()| y)
    }

    /// The median wall time of `runs` runs (at least one). Before each
    /// run this thread rewrites the activations, as inference does (the
    /// previous layer just wrote them): a kernel whose worker threads read
    /// them then fetches them from this core's cache, not from a copy of
    /// its own left by the previous run. Unchanged activations favoured the
    /// packs' copies, whose threads each quantise the input themselves.
    fn time(&mut self, kernel: &dyn MatmulKernel, y: &mut [f32], runs: usize) -> Result<u64, String> {
        let mut times = Vec::with_capacity(runs.max(1));
        for _ in 0..runs.max(1) {
            for v in &mut self.x {
                *v = std::hint::black_box(*v);
            }
            let t = Instant::now();
            self.once(kernel, y)?;
            times.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
        Ok(median(&mut times))
    }
}

/// One phase: checks every candidate against `want` and warms it up, then
/// times the survivors in interleaved rounds. `tick(i)` is called once per
/// candidate, when its outcome is final.
fn measure_phase(
    act: ActType,
    candidates: &[(String, Arc<dyn MatmulKernel>)],
    run: &mut Run<'_>,
    want: &Result<Vec<f32>, String>,
    opts: &BenchOptions,
    tick: &mut dyn FnMut(usize),
) -> Vec<Outcome> {
    let mut outcomes: Vec<Option<Outcome>> = vec![None; candidates.len()];
    // (candidate, its per-round medians)
    let mut timed: Vec<(usize, Vec<u64>)> = Vec::new();
    for (i, (_, kernel)) in candidates.iter().enumerate() {
        let check = want.as_ref().map_err(Clone::clone).and_then(|want| {
            let got = run.output(kernel.as_ref(), want.len() / run.n_tokens)?;
            compare(&got, want, act)?;
            let mut y = got;
            (0..opts.warmup).try_for_each(|_| run.once(kernel.as_ref(), &mut y))
        });
        match check {
            Ok(()) => timed.push((i, Vec::new())),
            Err(reason) => {
                outcomes[i] = Some(Outcome::Rejected { reason });
                tick(i);
            }
        }
    }
    let mut y = vec![0.0f32; want.as_ref().map_or(0, Vec::len)];
    let rounds = opts.rounds.max(1);
    for round in 0..rounds {
        // After the first round only the contenders go on: a kernel more
        // than `CONTENDER` times slower than the fastest cannot be chosen,
        // and timing it again (the scalar or WASM kernels on the lm_head)
        // would dominate the tuning time.
        if round == 1 {
            let fastest = timed.iter().filter_map(|(_, m)| m.first()).min().copied().unwrap_or(0);
            let contends = |m: &Vec<u64>| m.first().is_some_and(|&t| t as f64 <= CONTENDER * fastest as f64);
            let (go_on, out_of_it): (Vec<_>, Vec<_>) = timed.into_iter().partition(|(_, m)| contends(m));
            for (i, mut medians) in out_of_it {
                finish(&mut outcomes[i], &mut medians);
                tick(i);
            }
            timed = go_on;
        }
        // The order rotates by one each round.
        let n = timed.len();
        for j in 0..n {
            let (i, medians) = &mut timed[(j + round) % n];
            // A kernel that failed in an earlier round is not run again.
            if outcomes[*i].is_none() {
                match run.time(candidates[*i].1.as_ref(), &mut y, opts.runs) {
                    Ok(ns) => medians.push(ns),
                    Err(reason) => outcomes[*i] = Some(Outcome::Rejected { reason }),
                }
            }
            if round + 1 == rounds {
                tick(*i);
            }
        }
    }
    for (i, mut medians) in timed {
        finish(&mut outcomes[i], &mut medians);
    }
    outcomes.into_iter().map(|o| o.unwrap_or(Outcome::Rejected { reason: "not measured".to_string() })).collect()
}

/// Candidates slower than this multiple of the fastest after the first
/// round are not timed again.
const CONTENDER: f64 = 2.0;

/// Sets a timed candidate's outcome from its round medians (unless it was
/// rejected on the way).
fn finish(outcome: &mut Option<Outcome>, medians: &mut [u64]) {
    if outcome.is_none() {
        *outcome = Some(Outcome::Timed { median_ns: median(medians) });
    }
}

/// The median of `v` (which it sorts); 0 for an empty slice.
fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Checks `got` against the scalar reference `want` with the tolerance of
/// activation format `act`.
fn compare(got: &[f32], want: &[f32], act: ActType) -> Result<(), String> {
    let tol = match act {
        ActType::F32 => 1e-3,
        _ => 2e-2,
    };
    for (i, (&g, &r)) in got.iter().zip(want).enumerate() {
        // Written so that a NaN output fails the check.
        let close = (g - r).abs() <= tol * (1.0 + r.abs());
        if !close {
            return Err(format!("output {i} is {g}, reference {r} (tolerance {tol}·(1+|ref|))"));
        }
    }
    Ok(())
}

/// Random weights, one token of activations, and the scalar reference's
/// dense product of them.
type ReferenceCase = (Vec<u8>, Vec<f32>, Vec<f32>);

/// A [`ReferenceCase`] of `desc`'s shape, the activations zero outside
/// the columns `keep` accepts.
fn reference_case(
    desc: &MatmulDesc,
    seed: u64,
    pool: &ThreadPool,
    keep: impl Fn(usize) -> bool,
) -> Result<ReferenceCase, String> {
    let reference = spinfer_kernels::matmul::candidates(&desc.with_form(Form::Dense), &CpuFeatures::default())
        .pop()
        .ok_or_else(|| "no scalar reference kernel serves this operation".to_string())?;
    let mut rng = StdRng::seed_from_u64(seed);
    let w = spinfer_kernels::random::weights(&mut rng, desc.wtype, desc.rows, desc.cols);
    let mut x = spinfer_kernels::random::acts(&mut rng, desc.cols);
    for (c, v) in x.iter_mut().enumerate() {
        if !keep(c) {
            *v = 0.0;
        }
    }
    let mut want = vec![0.0f32; desc.rows];
    reference
        .run(pool, MatmulCall::dense(&w, &x, 1, &mut want, &mut Vec::new()))
        .map_err(|e| format!("reference: {e}"))?;
    Ok((w, x, want))
}

/// Runs `kernel` once on random data of `desc`'s shape (one token), in
/// `desc`'s form, and compares it with the scalar reference; `Err` says how
/// it disagreed.
///
/// * dense: every row;
/// * gathered rows: every third row, in reverse order, with one repeated,
///   against those rows of the reference's dense product;
/// * gathered columns: every third column, against the reference's exact
///   dense product of an input that is zero outside those columns (so
///   `desc.act` only sets the tolerance).
pub fn verify(desc: &MatmulDesc, kernel: &dyn MatmulKernel, pool: &ThreadPool) -> Result<(), String> {
    let scratch = &mut Vec::new();
    match desc.form {
        Form::Dense => {
            let (w, x, want) = reference_case(desc, 0x5eed, pool, |_| true)?;
            let mut got = vec![f32::NAN; desc.rows];
            kernel.run(pool, MatmulCall::dense(&w, &x, 1, &mut got, scratch)).map_err(|e| format!("error: {e}"))?;
            compare(&got, &want, desc.act)
        }
        Form::GatheredRows => {
            let (w, x, dense) = reference_case(desc, 0x5eed + 1, pool, |_| true)?;
            let mut idx: Vec<u32> = (0..desc.rows as u32).rev().step_by(3).collect();
            idx.push(idx[0]);
            let want: Vec<f32> = idx.iter().map(|&i| dense[i as usize]).collect();
            let mut got = vec![f32::NAN; idx.len()];
            let call = MatmulCall {
                w: &w,
                select: Select::Rows(&idx),
                x: &x,
                n_tokens: 1,
                out: &mut got,
                scratch,
                prefill: false,
            };
            kernel.run(pool, call).map_err(|e| format!("error: {e}"))?;
            compare(&got, &want, desc.act)
        }
        Form::GatheredColumns => {
            let exact = MatmulDesc { act: ActType::F32, ..*desc };
            let (w, x, want) = reference_case(&exact, 0x5eed + 2, pool, |c| c % 3 == 1)?;
            let idx: Vec<u32> = (0..desc.cols as u32).filter(|c| c % 3 == 1).collect();
            let coef: Vec<f32> = idx.iter().map(|&c| x[c as usize]).collect();
            let mut got = vec![f32::NAN; desc.rows];
            let call = MatmulCall {
                w: &w,
                select: Select::Columns(&idx),
                x: &coef,
                n_tokens: 1,
                out: &mut got,
                scratch,
                prefill: false,
            };
            kernel.run(pool, call).map_err(|e| format!("error: {e}"))?;
            compare(&got, &want, desc.act)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::KernelRegistry;
    use spinfer_kernels::GgmlType;

    /// A deliberately wrong kernel: writes zeros.
    struct Zeros;
    impl MatmulKernel for Zeros {
        fn name(&self) -> &str {
            "zeros"
        }
        fn run(&self, _: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
            let MatmulCall { out, .. } = call;
            out.fill(0.0);
            Ok(())
        }
    }

    fn quick() -> BenchOptions {
        BenchOptions { warmup: 1, runs: 3, rounds: 2, prefill_tokens: 8, seed: 7 }
    }

    #[test]
    fn rejects_wrong_kernel_and_times_real_ones() {
        let pool = ThreadPool::new(2);
        let desc = MatmulDesc::dense(GgmlType::Q4_1, ActType::Q8_1, 64, 256);
        let mut cands = KernelRegistry::builtin().candidates(&desc);
        let n_real = cands.len();
        cands.push(("fake".to_string(), Arc::new(Zeros)));
        let mut calls = Vec::new();
        let m = benchmark(&desc, &cands, &pool, &quick(), &mut |d, t, id| calls.push((d, t, id.to_string())));
        assert_eq!(m.len(), 2 * (n_real + 1));
        assert_eq!(calls.len(), m.len());
        assert_eq!(calls.last().unwrap().0, calls.last().unwrap().1);
        for x in &m {
            if x.kernel_id == "fake/zeros" {
                assert!(matches!(x.outcome, Outcome::Rejected { .. }), "{x:?}");
            } else {
                assert!(x.median_ns().is_some_and(|t| t > 0), "{x:?}");
            }
        }
        assert!(m.iter().any(|x| x.phase == Phase::Prefill && x.n_tokens == 8));
        // Decode with integer activations is timed as fast mode runs it:
        // two 8-bit planes, a batch of 2.
        assert!(m.iter().filter(|x| x.phase == Phase::Decode).all(|x| x.n_tokens == 2));
        assert_eq!(quick().tokens(Phase::Decode, ActType::F32), 1);
    }

    /// A real kernel that counts its runs and optionally sleeps in each.
    struct Counted(Arc<dyn MatmulKernel>, std::time::Duration, std::sync::atomic::AtomicUsize);
    impl MatmulKernel for Counted {
        fn name(&self) -> &str {
            if self.1.is_zero() { "fast" } else { "slow" }
        }
        fn run(&self, pool: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
            self.2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::thread::sleep(self.1);
            self.0.run(pool, call)
        }
    }

    #[test]
    fn rounds_time_contenders_only_after_the_first() {
        let pool = ThreadPool::new(1);
        let desc = MatmulDesc::dense(GgmlType::Q8_0, ActType::Q8_0, 32, 64);
        let real: Arc<dyn MatmulKernel> = KernelRegistry::builtin().candidates(&desc).remove(0).1;
        let fast = Arc::new(Counted(Arc::clone(&real), std::time::Duration::ZERO, 0.into()));
        let slow = Arc::new(Counted(real, std::time::Duration::from_millis(2), 0.into()));
        let cands: Vec<(String, Arc<dyn MatmulKernel>)> =
            vec![("p".to_string(), slow.clone()), ("p".to_string(), fast.clone())];
        let opts = BenchOptions { warmup: 1, runs: 2, rounds: 3, prefill_tokens: 4, seed: 1 };
        let m = benchmark(&desc, &cands, &pool, &opts, &mut |_, _, _| {});
        let calls = |k: &Counted| k.2.load(std::sync::atomic::Ordering::Relaxed);
        // Per phase: one checked run, one warm-up, then 2 runs per round;
        // the slow kernel (more than twice the fast one) stops after round 0.
        assert_eq!(calls(&fast), 2 * (1 + 1 + 2 * 3));
        assert_eq!(calls(&slow), 2 * (1 + 1 + 2));
        assert!(m.iter().all(|x| x.median_ns().is_some()), "{m:?}");
        let t =
            |id: &str| m.iter().find(|x| x.kernel_id == id && x.phase == Phase::Decode).unwrap().median_ns().unwrap();
        assert!(t("p/slow") > 2 * t("p/fast"));
    }

    #[test]
    fn every_builtin_pair_agrees_with_reference() {
        use GgmlType::*;
        let pool = ThreadPool::new(1);
        let reg = KernelRegistry::builtin();
        let opts = BenchOptions { warmup: 0, runs: 1, rounds: 1, prefill_tokens: 4, seed: 3 };
        for wtype in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
            let sixteen = matches!(wtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0).then_some(ActType::Q16);
            for act in [ActType::F32, ActType::fast_for(wtype)].into_iter().chain(sixteen) {
                let desc = MatmulDesc::dense(wtype, act, 16, 256);
                let m = benchmark(&desc, &reg.candidates(&desc), &pool, &opts, &mut |_, _, _| {});
                assert!(!m.is_empty());
                for x in m {
                    assert!(x.median_ns().is_some(), "{desc:?}: {x:?}");
                }
            }
        }
    }
}
