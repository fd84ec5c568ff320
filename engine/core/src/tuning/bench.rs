//! Benchmarking of candidate kernels on one operation's real shape.
//!
//! Every candidate is first checked against the scalar reference kernel of
//! `spinfer-kernels` on random weights and activations; a candidate that
//! errors or disagrees is [`Outcome::Rejected`] (reported, never selected).
//! The others are timed: warm-up runs, then the median of `runs` runs.

use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use spinfer_kernels::GgmlType;
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};
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
    /// Timed runs; the median is reported.
    pub runs: usize,
    /// Tokens per run in the prefill phase (decode is always 1).
    pub prefill_tokens: usize,
    /// Seed of the random weights and activations.
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self { warmup: 2, runs: 7, prefill_tokens: 64, seed: 0x5eed }
    }
}

impl BenchOptions {
    pub fn tokens(&self, phase: Phase) -> usize {
        match phase {
            Phase::Decode => 1,
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
    let mut out = Vec::with_capacity(total);
    let reference = spinfer_kernels::kernel::candidates(desc, &CpuFeatures::default()).pop();
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let w = random_weights(&mut rng, desc.wtype, desc.rows, desc.cols);
    let mut scratch = Vec::new();
    for phase in Phase::ALL {
        let n_tokens = opts.tokens(phase);
        let x = random_acts(&mut rng, n_tokens * desc.cols);
        // The reference result; if the reference itself cannot run, every
        // candidate is rejected (nothing can be verified).
        let want = match &reference {
            None => Err("no scalar reference kernel serves this operation".to_string()),
            Some(r) => {
                let mut y = vec![0.0f32; n_tokens * desc.rows];
                r.run(pool, &w, &x, n_tokens, &mut y, &mut scratch).map(|()| y).map_err(|e| format!("reference: {e}"))
            }
        };
        for (provider, kernel) in candidates {
            let id = kernel_id(provider, kernel.as_ref());
            let outcome = match &want {
                Err(e) => Outcome::Rejected { reason: e.clone() },
                Ok(want) => measure(kernel.as_ref(), desc.act, pool, &w, &x, n_tokens, want, opts, &mut scratch),
            };
            out.push(Measurement { kernel_id: id.clone(), phase, n_tokens, outcome });
            progress(out.len(), total, &id);
        }
    }
    out
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

/// Runs `kernel` once on random data of `desc`'s shape (one token) and
/// compares it with the scalar reference; `Err` says how it disagreed.
pub fn verify(desc: &MatmulDesc, kernel: &dyn MatmulKernel, pool: &ThreadPool) -> Result<(), String> {
    let reference = spinfer_kernels::kernel::candidates(desc, &CpuFeatures::default())
        .pop()
        .ok_or_else(|| "no scalar reference kernel serves this operation".to_string())?;
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let w = random_weights(&mut rng, desc.wtype, desc.rows, desc.cols);
    let x = random_acts(&mut rng, desc.cols);
    let mut scratch = Vec::new();
    let mut want = vec![0.0f32; desc.rows];
    reference.run(pool, &w, &x, 1, &mut want, &mut scratch).map_err(|e| format!("reference: {e}"))?;
    let mut got = vec![f32::NAN; desc.rows];
    kernel.run(pool, &w, &x, 1, &mut got, &mut scratch).map_err(|e| format!("error: {e}"))?;
    compare(&got, &want, desc.act)
}

/// Verifies then times one kernel.
#[allow(clippy::too_many_arguments, reason = "internal helper")]
fn measure(
    kernel: &dyn MatmulKernel,
    act: ActType,
    pool: &ThreadPool,
    w: &[u8],
    x: &[f32],
    n_tokens: usize,
    want: &[f32],
    opts: &BenchOptions,
    scratch: &mut Vec<u8>,
) -> Outcome {
    let mut y = vec![f32::NAN; want.len()];
    if let Err(e) = kernel.run(pool, w, x, n_tokens, &mut y, scratch) {
        return Outcome::Rejected { reason: format!("error: {e}") };
    }
    if let Err(reason) = compare(&y, want, act) {
        return Outcome::Rejected { reason };
    }
    for _ in 0..opts.warmup {
        if let Err(e) = kernel.run(pool, w, x, n_tokens, &mut y, scratch) {
            return Outcome::Rejected { reason: format!("error: {e}") };
        }
    }
    let mut times = Vec::with_capacity(opts.runs.max(1));
    for _ in 0..opts.runs.max(1) {
        let t = Instant::now();
        if let Err(e) = kernel.run(pool, w, x, n_tokens, &mut y, scratch) {
            return Outcome::Rejected { reason: format!("error: {e}") };
        }
        times.push(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
    }
    times.sort_unstable();
    Outcome::Timed { median_ns: times[times.len() / 2] }
}

/// Offsets of the f16 scale fields inside one block of `ty`.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        _ => &[],
    }
}

/// `rows` random rows of `cols` elements of `ty`: random quant bytes with
/// finite, moderate f16 scales (random finite floats for F32/F16/BF16).
pub(crate) fn random_weights(r: &mut StdRng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols;
    let val = |r: &mut StdRng| r.random_range(-1.0f32..1.0) * 10f32.powf(r.random_range(-2.0f32..0.5));
    match ty {
        GgmlType::F32 => (0..n).flat_map(|_| val(r).to_le_bytes()).collect(),
        GgmlType::F16 => (0..n).flat_map(|_| f16::from_f32(val(r)).to_le_bytes()).collect(),
        GgmlType::BF16 => (0..n).flat_map(|_| bf16::from_f32(val(r)).to_le_bytes()).collect(),
        _ => {
            let Ok(rb) = ty.row_bytes(cols) else { return Vec::new() };
            let mut w: Vec<u8> = (0..rows * rb).map(|_| r.random()).collect();
            for blk in w.chunks_exact_mut(ty.type_size()) {
                for (i, &off) in scale_offsets(ty).iter().enumerate() {
                    // Minimums (second field) and Q6_K scales may be negative.
                    let mag = 10f32.powf(r.random_range(-3.5f32..-1.0));
                    let neg = (i == 1 || ty == GgmlType::Q6_K) && r.random_bool(0.3);
                    let s = f16::from_f32(if neg { -mag } else { mag });
                    blk[off..off + 2].copy_from_slice(&s.to_le_bytes());
                }
            }
            w
        }
    }
}

/// `n` random activations in [-1, 1) with a magnitude per 32-block.
pub(crate) fn random_acts(r: &mut StdRng, n: usize) -> Vec<f32> {
    let mut scale = 1.0f32;
    (0..n)
        .map(|i| {
            if i % 32 == 0 {
                scale = 10f32.powf(r.random_range(-1.0f32..0.5));
            }
            r.random_range(-1.0f32..1.0) * scale
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::KernelRegistry;

    /// A deliberately wrong kernel: writes zeros.
    struct Zeros;
    impl MatmulKernel for Zeros {
        fn name(&self) -> &str {
            "zeros"
        }
        fn run(
            &self,
            _: &ThreadPool,
            _: &[u8],
            _: &[f32],
            _: usize,
            out: &mut [f32],
            _: &mut Vec<u8>,
        ) -> spinfer_kernels::Result<()> {
            out.fill(0.0);
            Ok(())
        }
    }

    fn quick() -> BenchOptions {
        BenchOptions { warmup: 1, runs: 3, prefill_tokens: 8, seed: 7 }
    }

    #[test]
    fn rejects_wrong_kernel_and_times_real_ones() {
        let pool = ThreadPool::new(2);
        let desc = MatmulDesc { wtype: GgmlType::Q4_1, act: ActType::Q8_1, rows: 64, cols: 256 };
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
    }

    #[test]
    fn every_builtin_pair_agrees_with_reference() {
        use GgmlType::*;
        let pool = ThreadPool::new(1);
        let reg = KernelRegistry::builtin();
        let opts = BenchOptions { warmup: 0, runs: 1, prefill_tokens: 4, seed: 3 };
        for wtype in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
            for act in [ActType::F32, ActType::fast_for(wtype)] {
                let desc = MatmulDesc { wtype, act, rows: 16, cols: 256 };
                let m = benchmark(&desc, &reg.candidates(&desc), &pool, &opts, &mut |_, _, _| {});
                assert!(!m.is_empty());
                for x in m {
                    assert!(x.median_ns().is_some(), "{desc:?}: {x:?}");
                }
            }
        }
    }
}
