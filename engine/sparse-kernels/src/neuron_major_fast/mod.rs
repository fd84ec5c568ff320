//! The int8 ("fast") AXPY of [`NeuronMajor`]: the sparse analogue of the
//! dense fast mode, which quantises the activations to 8 bits per block.
//!
//! The coefficients of each run of active neurons sharing one neuron block
//! `B` (32 neurons) are quantised to two int8 planes with one f32 scale per
//! run, like ggml's Q8_0 (`scale = max|coef| / 127`, `c8 = round(coef ·
//! (1 / scale))`, half away from zero) plus the residual in units of
//! `scale / 128` (`r8 = round(128 · (coef / scale − c8))`, in `[−64, 64]`),
//! the sparse counterpart of the dense fast mode's two activation planes.
//! The block sums become exact int32 dot products:
//!
//! ```text
//! S_B[i] = Σ_{j ∈ B active} c8_j · q[i, j]          (exact, int32)
//! T_B[i] = Σ_{j ∈ B active} r8_j · q[i, j]          (exact, int32)
//! H_B    = Σ_{j ∈ B active} coef_j                   (f32, pairwise tree)
//! f      = fma(f32(T_B[i]), 1/128, f32(S_B[i]))
//! acc[i] = fma(m[i, B], H_B, fma(d[i, B], f · scale_B, acc[i]))
//! ```
//!
//! (without a minimum, only the first fma; `H_B` sums the run's
//! coefficients, zero padded to 32, by a fixed pairwise tree). `acc` is
//! accumulated separately over the first and the second half of the runs
//! ([`split_point`]) and the two are added, so that two threads can each
//! read whole rows.
//!
//! The AVX-512 implementation takes the active neurons of a run four at a
//! time (the last quad padded with zero coefficients), interleaves their
//! code bytes with one `vpermt2b` so that dword `e` holds the four codes of
//! one output, and multiplies them by the four int8 coefficients of each
//! plane with `vpdpbusd` (64 multiply-adds per instruction, against 16 for
//! the f32 AXPY). `vpdpbusd` multiplies unsigned bytes by signed ones: the
//! nibbles are unsigned already (Q4_0's `− 8` is folded in as `− 8 Σ c8`),
//! Q8_0 codes are flipped to `q + 128` (`xor 0x80`) and `128 Σ c8` is
//! subtracted (and likewise for `r8`). The corrections are exact integers,
//! preloaded into the int32 sums. It goes run by run, each run's rows read
//! from memory once for all the output tiles.

use std::cell::RefCell;

use super::{GROUP, NeuronMajor};
use crate::shape_err;
use spinfer_kernels::blocks::QK;
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::{GgmlType, Result};

/// One run of active neurons inside one neuron block, quantised.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// The neuron block (`idx / 32`).
    block: usize,
    /// Quads `q0 .. q1` of [`FastCoefs`].
    q0: usize,
    q1: usize,
    /// Active neurons in the run (`4 (q1 - q0)` less the padding).
    n: usize,
    /// `max |coef| / 127` over the run (0 when every coefficient is 0).
    scale: f32,
    /// `Σ coef` over the run, f32, by [`pairwise`] over 32 zero-padded
    /// slots.
    h: f32,
    /// `− bias · Σ c8`: the correction preloaded into the int32 sums (bias
    /// 8 for Q4_0, 128 for Q8_0's flipped codes, 0 for Q4_1).
    init: i32,
    /// The same for the residual plane: `− bias · Σ r8`.
    init_lo: i32,
}

/// The active neurons of one call, quantised per block run and padded to
/// quads (padding: coefficient 0, the quad's first neuron again).
#[derive(Debug, Default)]
struct FastCoefs {
    runs: Vec<Run>,
    /// The first run of the second half ([`split_point`]).
    split: usize,
    /// Four neuron indices per quad.
    rows: Vec<u32>,
    /// Four int8 coefficients per quad, packed little-endian (byte `j` is
    /// the coefficient of `rows[4 q + j]`).
    quads: Vec<i32>,
    /// The residual plane, packed the same way: `r8 = round(128 · (coef /
    /// scale − c8))`, in `[−64, 64]`.
    quads_lo: Vec<i32>,
}

impl FastCoefs {
    /// `idx` strictly ascending and `< neurons`, `coef.len() == idx.len()`
    /// (validated by the caller); `bias` as in [`Run::init`]; runs of at
    /// least `whole_from` active neurons cover their whole block (see
    /// [`WHOLE_FROM`]).
    fn new(idx: &[u32], coef: &[f32], neurons: usize, bias: i32, whole_from: usize) -> Self {
        let mut fc = Self::default();
        fc.fill(idx, coef, neurons, bias, whole_from);
        fc
    }

    /// [`FastCoefs::fill`] compiled for AVX-512 (vectorised by the
    /// compiler): bit for bit the same, as it runs the same IEEE operations
    /// in the same order (Rust never contracts or reassociates them).
    ///
    /// # Safety
    /// AVX-512F/BW/VL, AVX2, FMA, F16C; arguments as [`FastCoefs::new`].
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn fill_avx512(&mut self, idx: &[u32], coef: &[f32], neurons: usize, bias: i32, whole_from: usize) {
        self.fill(idx, coef, neurons, bias, whole_from)
    }

    /// Replaces the contents with the runs of `idx`, reusing the buffers
    /// (arguments as [`FastCoefs::new`]).
    #[inline(always)]
    fn fill(&mut self, idx: &[u32], coef: &[f32], neurons: usize, bias: i32, whole_from: usize) {
        // At most one partial quad per run (or a whole block, 8 quads, for
        // at least 16 neurons), and one run per neuron block.
        let max_quads = 2 * idx.len() / 4 + idx.len().min(neurons / QK);
        self.runs.clear();
        self.runs.reserve(idx.len().min(neurons / QK));
        self.rows.clear();
        self.rows.reserve(4 * max_quads);
        self.quads.clear();
        self.quads.reserve(max_quads);
        self.quads_lo.clear();
        self.quads_lo.reserve(max_quads);
        let mut k = 0;
        while k < idx.len() {
            let block = idx[k] as usize / QK;
            // `idx` is strictly ascending: the run is the indices below the
            // block's end among the next 32 (a count that vectorises).
            let end = ((block + 1) * QK) as u64;
            let n = idx[k..(k + QK).min(idx.len())].iter().filter(|&&j| u64::from(j) < end).count();
            let whole = n >= whole_from && (block + 1) * QK <= neurons;
            self.push_run(block, &idx[k..k + n], &coef[k..k + n], bias, whole);
            k += n;
        }
        self.split = split_point(self.runs.iter().map(|r| r.n), idx.len());
    }

    /// One run (at most 32 neurons: one block), zero padded to 32 slots so
    /// that every loop has a fixed trip count and vectorises. With `whole`,
    /// its quads cover the block's 32 neurons in order, the inactive ones
    /// with coefficient 0; the integer sums, the scale and `h` (from the
    /// run's own coefficients) are the same, so are the results.
    #[inline(always)]
    fn push_run(&mut self, block: usize, ids: &[u32], cs: &[f32], bias: i32, whole: bool) {
        let n = cs.len();
        debug_assert!(n <= QK && ids.len() == n);
        let mut c = [0.0f32; QK];
        c[..n].copy_from_slice(cs);
        // (Plain loops: `array::map` may not inline into the AVX-512 clone.)
        let mut a = [0.0f32; QK];
        for (a, c) in a.iter_mut().zip(&c) {
            *a = c.abs();
        }
        let scale = pairwise(a, f32::max) / 127.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        let (mut bytes, mut bytes_lo) = ([0u8; QK], [0u8; QK]);
        let (mut sum, mut sum_lo) = (0i32, 0i32);
        for ((b, bl), &c) in bytes.iter_mut().zip(&mut bytes_lo).zip(&c) {
            let q = quantize(c, inv);
            // The residual, in units of scale / 128 (|r| <= 64.5).
            let r = quantize((c * inv - f32::from(q)) * 128.0, 1.0);
            sum += i32::from(q);
            sum_lo += i32::from(r);
            *b = q as u8;
            *bl = r as u8;
        }
        let q0 = self.quads.len();
        if whole && n < QK {
            // The whole block, the skipped neurons with coefficient 0: its
            // rows are read in order, without gaps.
            let (mut wb, mut wl) = ([0u8; QK], [0u8; QK]);
            for (k, &j) in ids.iter().enumerate() {
                let slot = j as usize - block * QK;
                wb[slot] = bytes[k];
                wl[slot] = bytes_lo[k];
            }
            (bytes, bytes_lo) = (wb, wl);
        }
        let nq = if whole { QK / 4 } else { n.div_ceil(4) };
        self.quads.extend(bytes.as_chunks::<4>().0[..nq].iter().map(|b| i32::from_le_bytes(*b)));
        self.quads_lo.extend(bytes_lo.as_chunks::<4>().0[..nq].iter().map(|b| i32::from_le_bytes(*b)));
        if whole {
            self.rows.extend((block * QK) as u32..((block + 1) * QK) as u32);
        } else {
            self.rows.extend_from_slice(ids);
            // The last quad's padding: coefficient 0 on its first neuron.
            let first = ids[(nq - 1) * 4];
            self.rows.resize(self.rows.len() + 4 * nq - n, first);
        }
        self.runs.push(Run {
            block,
            q0,
            q1: self.quads.len(),
            n,
            scale,
            h: pairwise(c, |a, b| a + b),
            init: -bias * sum,
            init_lo: -bias * sum_lo,
        });
    }

    /// The int8 coefficient of slot `s` (`4 q + j`) in `plane` (`quads` or
    /// `quads_lo`).
    fn c8(plane: &[i32], s: usize) -> i8 {
        (plane[s / 4] >> (8 * (s % 4))) as i8
    }
}

/// Runs with at least this many of their block's 32 neurons active read
/// the whole block, the others with coefficient 0: rows skipped at random
/// break the hardware prefetch streams and cost more than reading them
/// (docs/benchmarks.md, "Design measurements cited by the code").
pub(super) const WHOLE_FROM: usize = 16;

/// Where the active neurons are cut in two halves, each summed on its own
/// and then added (`out = Σ_{first half} + Σ_{second half}`), so that two
/// threads can each read whole rows: the first run `r` with at least half
/// of the `total` active neurons before it (0 when there are none). It
/// depends on the runs only, never on the thread count, so the result does
/// not either.
fn split_point(lens: impl Iterator<Item = usize>, total: usize) -> usize {
    let (mut before, mut runs) = (0, 0);
    for n in lens {
        if 2 * before >= total {
            break;
        }
        before += n;
        runs += 1;
    }
    runs
}

/// `round(c · inv)` (half away from zero, as ggml's `roundf`), clamped to
/// `±127`.
#[inline(always)]
fn quantize(c: f32, inv: f32) -> i8 {
    let x = f64::from(c * inv);
    // `|x| + 0.5` is exact in f64 and truncation is `floor` for it: `round`
    // without a libm call. `min` maps NaN to 127 too.
    let a = (x.abs() + 0.5).min(127.0);
    // SAFETY: `a` is finite and in `[0.5, 127]`, so it fits an `i32`.
    let r = unsafe { a.to_int_unchecked::<i32>() };
    (if x < 0.0 { -r } else { r }) as i8
}

/// `op` over `c` by a fixed pairwise tree (`op(c[i], c[i + 16])`, then
/// `+ 8`, `+ 4`, `+ 2`, `+ 1`): for `Σ c` (f32) and `max |c|`.
#[inline(always)]
fn pairwise(c: [f32; QK], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut v = c;
    let mut w = QK / 2;
    while w > 0 {
        for i in 0..w {
            v[i] = op(v[i], v[i + w]);
        }
        w /= 2;
    }
    v[0]
}

/// One run of [`QuantisedCoefs`]: the active neurons of one 32-neuron block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantisedRun {
    /// The neuron block (`idx / 32`).
    pub block: usize,
    /// Positions `start .. start + len` of the run in `idx`.
    pub start: usize,
    pub len: usize,
    /// `max |coef| / 127` over the run.
    pub scale: f32,
    /// `Σ coef` over the run (f32, the fixed pairwise tree).
    pub h: f32,
}

/// The coefficients exactly as [`NeuronMajor::axpy_fast`] quantises them,
/// for an AXPY over codes held elsewhere (the memory-budget bundle): per
/// position `k` of `idx`, `coef[k] ≈ scale · (c8[k] + r8[k] / 128)` with the
/// scale of its run. Summing `Σ c8·q` and `Σ r8·q` in integers and flushing
/// each run per output as `acc = fma(d, fma(f32(Σ r8·q), 1/128,
/// f32(Σ c8·q)) · scale, acc)`, then `acc = fma(m, h, acc)` with a minimum,
/// gives [`NeuronMajor::axpy_fast_scalar`]'s bits, when the runs before
/// `split` and the runs from `split` on are summed separately (each from
/// zero) and the two sums then added.
#[derive(Clone, Debug, Default)]
pub struct QuantisedCoefs {
    pub runs: Vec<QuantisedRun>,
    /// The first run of the second half.
    pub split: usize,
    pub c8: Vec<i8>,
    pub r8: Vec<i8>,
}

impl QuantisedCoefs {
    /// Errors ([`crate::KernelError::Shape`]): `coef.len() != idx.len()`,
    /// `idx` not strictly ascending.
    pub fn new(idx: &[u32], coef: &[f32]) -> Result<Self> {
        const OP: &str = "QuantisedCoefs::new";
        if coef.len() != idx.len() {
            return Err(shape_err(OP, format!("{} coefficients for {} indices", coef.len(), idx.len())));
        }
        if let Some(k) = idx.windows(2).position(|w| w[0] >= w[1]) {
            return Err(shape_err(OP, format!("indices not strictly ascending at position {}", k + 1)));
        }
        // Compact runs: `c8`/`r8` are read back by position in `idx`.
        let fc = FastCoefs::new(idx, coef, usize::MAX, 0, usize::MAX);
        let mut out =
            QuantisedCoefs { runs: Vec::with_capacity(fc.runs.len()), split: fc.split, c8: Vec::new(), r8: Vec::new() };
        let mut start = 0;
        for run in &fc.runs {
            let len = idx[start..].iter().take_while(|&&j| j as usize / QK == run.block).count();
            for j in 0..len {
                out.c8.push(FastCoefs::c8(&fc.quads, 4 * run.q0 + j));
                out.r8.push(FastCoefs::c8(&fc.quads_lo, 4 * run.q0 + j));
            }
            out.runs.push(QuantisedRun { block: run.block, start, len, scale: run.scale, h: run.h });
            start += len;
        }
        Ok(out)
    }
}

impl NeuronMajor {
    /// Whether [`NeuronMajor::axpy_fast`] runs the int8 implementation on
    /// this CPU (AVX-512 F/BW/VL/VNNI/VBMI with AVX2, FMA and F16C); when
    /// not, it is [`NeuronMajor::axpy`] (exact f32 coefficients).
    pub fn axpy_fast_is_int8() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let f = spinfer_kernels::cpu::CpuFeatures::detect();
            f.has_avx512() && f.avx512vbmi
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `out[i] ≈ Σ_k coef[k] · W[i, idx[k]]` with the coefficients quantised
    /// to two int8 planes per run of active neurons in one neuron block (one
    /// f32 scale per run, `max |coef| / 127`, and the residual in units of
    /// `scale / 128`), integer block sums (exact) and the minimum term
    /// `m · Σ coef` from the f32 coefficients; see the module
    /// documentation. Overwrites `out`; same contract and errors as
    /// [`NeuronMajor::axpy`]. The active neurons are summed in two halves
    /// (split by count at a run boundary) that are then added; with two
    /// threads or more, each thread of a pair takes one half over its
    /// slice of the outputs, so that it reads whole rows (see
    /// `split_halves`). The halves do not depend on the thread count, and
    /// neither does the result.
    ///
    /// When [`NeuronMajor::axpy_fast_is_int8`] is false (no AVX-512 VNNI +
    /// VBMI), this is [`NeuronMajor::axpy`]: exact f32 coefficients, no
    /// quantisation. Otherwise the result is bit for bit
    /// [`NeuronMajor::axpy_fast_scalar`]'s. Non-finite coefficients give
    /// unspecified (but memory-safe) results.
    pub fn axpy_fast(&self, pool: &ThreadPool, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
        if !Self::axpy_fast_is_int8() {
            return self.axpy(pool, idx, coef, out);
        }
        self.check(idx, coef, out)?;
        thread_local! {
            /// The calling thread's coefficient buffers, reused every call.
            static COEFS: RefCell<FastCoefs> = RefCell::default();
        }
        COEFS.with_borrow_mut(|fc| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `axpy_fast_is_int8` detected AVX-512F/BW/VL, AVX2, FMA
            // and F16C; `check` validated the arguments.
            unsafe {
                fc.fill_avx512(idx, coef, self.neurons, self.code_bias(), WHOLE_FROM)
            };
            #[cfg(not(target_arch = "x86_64"))]
            fc.fill(idx, coef, self.neurons, self.code_bias(), WHOLE_FROM);
            let fc = &*fc;
            let halves = fc.runs.split_at(fc.split);
            self.split_halves(pool, idx.len(), out, &|h, o0, o| {
                self.run_fast(o0, fc, if h == 0 { halves.0 } else { halves.1 }, o)
            });
        });
        Ok(())
    }

    /// Scalar reference of the int8 arithmetic of [`NeuronMajor::axpy_fast`]
    /// (single-threaded, on any CPU): the same quantisation, the exact
    /// integer sums `S = Σ c8 · q` and `T = Σ r8 · q`, and per output, per
    /// run in order, `acc = fma(d, fma(f32(T), 1/128, f32(S)) · scale, acc)`,
    /// then `acc = fma(m, H, acc)` for Q4_1 (`H` = the run's f32
    /// coefficients summed by a fixed pairwise tree); one `acc` for each
    /// half of the runs, then their sum. Same errors as
    /// [`NeuronMajor::axpy`].
    pub fn axpy_fast_scalar(&self, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
        self.check(idx, coef, out)?;
        let fc = FastCoefs::new(idx, coef, self.neurons, self.code_bias(), WHOLE_FROM);
        let (first, second) = fc.runs.split_at(fc.split);
        self.run_fast_scalar(0, &fc, first, out);
        let mut rest = vec![0.0; out.len()];
        self.run_fast_scalar(0, &fc, second, &mut rest);
        for (o, r) in out.iter_mut().zip(&rest) {
            *o += r;
        }
        Ok(())
    }

    /// What the SIMD code adds to a true code to make it an unsigned byte.
    fn code_bias(&self) -> i32 {
        match self.wtype {
            GgmlType::Q4_0 => 8,
            GgmlType::Q8_0 => 128,
            _ => 0,
        }
    }

    /// Outputs `o0 .. o0 + out.len()` (`o0` a multiple of 32) summed over
    /// `runs` (some of `fc`'s), int8 SIMD; only called when
    /// [`NeuronMajor::axpy_fast_is_int8`].
    fn run_fast(&self, o0: usize, fc: &FastCoefs, runs: &[Run], out: &mut [f32]) {
        debug_assert!(o0.is_multiple_of(GROUP) && o0 + out.len() <= self.outputs);
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `axpy_fast` only gets here when `axpy_fast_is_int8`
            // detected every feature `axpy_fast_avx512` enables; `fc` was
            // built from validated indices (all `< neurons`) and the output
            // range lies inside `0..outputs`.
            unsafe { x86::axpy_fast_avx512(self, o0, fc, runs, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.run_fast_scalar(o0, fc, runs, out);
    }

    fn run_fast_scalar(&self, o0: usize, fc: &FastCoefs, runs: &[Run], out: &mut [f32]) {
        for (o, out) in out.iter_mut().enumerate() {
            let i = o0 + o;
            let mut acc = 0.0f32;
            for run in runs {
                let sum = |plane: &[i32]| -> i32 {
                    (4 * run.q0..4 * run.q1)
                        .map(|s| i32::from(FastCoefs::c8(plane, s)) * i32::from(self.code(i, fc.rows[s] as usize)))
                        .sum()
                };
                let s = (sum(&fc.quads_lo) as f32).mul_add(1.0 / 128.0, sum(&fc.quads) as f32);
                let at = run.block * self.opad + i;
                acc = self.d[at].to_f32().mul_add(s * run.scale, acc);
                if self.has_min {
                    acc = self.m[at].to_f32().mul_add(run.h, acc);
                }
            }
            *out = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// Runs read whole (inactive neurons with coefficient 0) give the bits
    /// of compact runs: blocks with 0, 5, 16, 31 and 32 active neurons, in
    /// the scalar reference and in `axpy_fast`.
    #[test]
    fn whole_block_runs_give_the_compact_runs_bits() {
        let (rows, cols) = (96, 5 * QK);
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let ty = GgmlType::Q4_1;
        let mut w: Vec<u8> = (0..rows * ty.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        for blk in w.chunks_exact_mut(ty.type_size()) {
            blk[0..2].copy_from_slice(&f16::from_f32((next() % 100) as f32 * 1e-4 + 1e-3).to_le_bytes());
            blk[2..4].copy_from_slice(&f16::from_f32(-((next() % 100) as f32) * 1e-4).to_le_bytes());
        }
        let nm = NeuronMajor::from_weights(ty, &w, rows, cols).unwrap();
        let active = [0usize, 5, 16, 31, 32];
        let idx: Vec<u32> = active
            .iter()
            .enumerate()
            .flat_map(|(b, &n)| (0..n as u32).map(move |j| (b * QK) as u32 + (j * 7) % 32))
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect();
        let coef: Vec<f32> = idx.iter().map(|&j| ((j as f32) * 0.77).sin()).collect();
        let sums = |whole_from: usize| {
            let fc = FastCoefs::new(&idx, &coef, cols, nm.code_bias(), whole_from);
            let (first, second) = fc.runs.split_at(fc.split);
            let (mut a, mut b) = (vec![0.0f32; rows], vec![0.0f32; rows]);
            nm.run_fast_scalar(0, &fc, first, &mut a);
            nm.run_fast_scalar(0, &fc, second, &mut b);
            (fc.rows.len(), a.iter().zip(&b).map(|(x, y)| (x + y).to_bits()).collect::<Vec<_>>())
        };
        let (compact_rows, compact) = sums(usize::MAX);
        let (whole_rows, whole) = sums(WHOLE_FROM);
        assert!(whole_rows > compact_rows, "some runs were read whole");
        assert_eq!(whole, compact);
        assert!(compact.iter().any(|&b| f32::from_bits(b) != 0.0));
        // `axpy_fast` (int8 SIMD where the CPU has it) uses WHOLE_FROM.
        let mut out = vec![0.0f32; rows];
        nm.axpy_fast_scalar(&idx, &coef, &mut out).unwrap();
        if NeuronMajor::axpy_fast_is_int8() {
            let mut simd = vec![f32::NAN; rows];
            nm.axpy_fast(&spinfer_kernels::pool::ThreadPool::new(2), &idx, &coef, &mut simd).unwrap();
            assert_eq!(simd.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), compact);
        }
        assert_eq!(out.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), compact);
    }
}
