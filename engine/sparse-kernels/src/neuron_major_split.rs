//! [`NeuronMajorSplit`]: a [`NeuronMajor`] copy per thread, each of one
//! range of the outputs.
//!
//! One copy split by outputs has every thread read a part of every active
//! neuron's row (`opad / 2` bytes for 4-bit codes, 288 for `W_down` of
//! SmolLM2-135M), so each thread's reads jump by the row stride. With a
//! copy per thread, each thread reads whole, shorter rows of its own
//! copy, one after the other, which streams faster (docs/benchmarks.md,
//! "Design measurements cited by the code").
//!
//! The copies together hold the same bytes as one copy (the outputs are
//! padded to 32 per copy, and every range starts at a multiple of 32, so
//! no padding is added for a matrix whose outputs are a multiple of 32).
//! Each output's value is computed exactly as [`NeuronMajor`] computes it,
//! whatever the split: the results equal one copy's bit for bit.

use super::{AXPY_PAR_MACS, SyncPtr};
use crate::{AxpyIsa, NeuronMajor};
use spinfer_kernels::pool::{ThreadPool, chunk_aligned};
use spinfer_kernels::{GgmlType, KernelError, Result};

/// One copy's AXPY: `(copy, pool, its outputs)`.
type PartFn<'a> = dyn Fn(&NeuronMajor, &ThreadPool, &mut [f32]) -> Result<()> + Sync + 'a;

/// Outputs per alignment unit of the ranges.
const GROUP: usize = 32;

/// A matrix `W` (`outputs` x `neurons`) as one [`NeuronMajor`] per range of
/// its outputs, for a pool of as many threads.
pub struct NeuronMajorSplit {
    /// (first output, the copy of the outputs from there), ascending.
    parts: Vec<(usize, NeuronMajor)>,
    outputs: usize,
    neurons: usize,
    /// The pool each thread runs its own copy with (the caller's thread).
    one: ThreadPool,
}

impl NeuronMajorSplit {
    /// From `W` (`rows × cols`, row-major GGUF bytes of Q4_0, Q4_1 or
    /// Q8_0), split for a pool of `threads` threads (ranges of whole 32-row
    /// groups; fewer parts when there are fewer groups).
    ///
    /// Errors: as [`NeuronMajor::from_weights`].
    pub fn from_weights(wtype: GgmlType, w: &[u8], rows: usize, cols: usize, threads: usize) -> Result<Self> {
        let rb = wtype.row_bytes(cols)?;
        if w.len() != rows.saturating_mul(rb) {
            return Err(KernelError::BufferSize {
                ty: wtype,
                n: rows.saturating_mul(cols),
                want: rows * rb,
                got: w.len(),
            });
        }
        let threads = threads.clamp(1, rows.div_ceil(GROUP).max(1));
        let mut parts = Vec::with_capacity(threads);
        for t in 0..threads {
            let r = chunk_aligned(rows, t, threads, GROUP);
            if !r.is_empty() || rows == 0 {
                parts.push((r.start, NeuronMajor::from_weights(wtype, &w[r.start * rb..r.end * rb], r.len(), cols)?));
            }
        }
        Ok(Self { parts, outputs: rows, neurons: cols, one: ThreadPool::new(1) })
    }

    /// Number of copies (the thread count it was built for, at most one
    /// per 32 outputs).
    pub fn parts(&self) -> usize {
        self.parts.len()
    }

    /// Number of neurons: the columns of `W`.
    pub fn neurons(&self) -> usize {
        self.neurons
    }

    /// Number of outputs: the rows of `W`.
    pub fn outputs(&self) -> usize {
        self.outputs
    }

    /// Bytes held (codes, scales, minimums) by all copies.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|(_, nm)| nm.bytes()).sum()
    }

    /// [`NeuronMajor::axpy`] (f32 coefficients, the best implementation
    /// for this CPU): same contract, errors and results.
    pub fn axpy(&self, pool: &ThreadPool, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
        let isa = AxpyIsa::select(&spinfer_kernels::cpu::CpuFeatures::detect());
        self.run(pool, idx.len(), out, &|nm, p, o| nm.axpy_with(p, isa, idx, coef, o))
    }

    /// [`NeuronMajor::axpy_fast`] (int8 coefficients where the CPU has
    /// AVX-512 VNNI and VBMI): same contract, errors and results.
    pub fn axpy_fast(&self, pool: &ThreadPool, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
        self.run(pool, idx.len(), out, &|nm, p, o| nm.axpy_fast(p, idx, coef, o))
    }

    /// Runs `f(copy, pool, its outputs)` for every copy: each on its own
    /// thread when the pool has one per copy and the work (`active`
    /// neurons times the outputs) is worth a broadcast, else one after the
    /// other on the caller (each then using `pool` itself).
    fn run(&self, pool: &ThreadPool, active: usize, out: &mut [f32], f: &PartFn<'_>) -> Result<()> {
        if out.len() != self.outputs {
            return Err(KernelError::Shape {
                op: "NeuronMajorSplit::axpy",
                detail: format!("output of {} floats for {} outputs", out.len(), self.outputs),
            });
        }
        let spread = pool.n_threads() == self.parts.len() && self.parts.len() > 1;
        if !spread || active * self.outputs < AXPY_PAR_MACS {
            let sub = if spread { &self.one } else { pool };
            // The copies check the same indices and coefficients, so the
            // first one fails before anything is written.
            for (o0, nm) in &self.parts {
                f(nm, sub, &mut out[*o0..*o0 + nm.outputs()])?;
            }
            return Ok(());
        }
        let base = SyncPtr::new(out.as_mut_ptr());
        let first = std::sync::Mutex::new(None);
        pool.broadcast(&|t, _| {
            let (o0, nm) = &self.parts[t];
            // SAFETY: the copies' output ranges are disjoint and lie inside
            // `0..outputs` = `0..out.len()`, which outlives the broadcast.
            let o = unsafe { std::slice::from_raw_parts_mut(base.get().add(*o0), nm.outputs()) };
            if let Err(e) = f(nm, &self.one, o) {
                first.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
            }
        });
        match first.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// Random Q4_1 bytes with finite scales and minimums.
    fn q4_1(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut w: Vec<u8> = (0..rows * GgmlType::Q4_1.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        for blk in w.chunks_exact_mut(GgmlType::Q4_1.type_size()) {
            let d = f16::from_f32((next() % 100) as f32 * 1e-4 + 1e-3);
            let m = f16::from_f32(-((next() % 100) as f32) * 1e-4);
            blk[0..2].copy_from_slice(&d.to_le_bytes());
            blk[2..4].copy_from_slice(&m.to_le_bytes());
        }
        w
    }

    #[test]
    fn a_copy_per_thread_gives_one_copys_bits() {
        let (rows, cols) = (200, 256);
        let w = q4_1(rows, cols, 7);
        let whole = NeuronMajor::from_weights(GgmlType::Q4_1, &w, rows, cols).unwrap();
        let idx: Vec<u32> = (0..cols as u32).filter(|j| j % 3 != 1).collect();
        let coef: Vec<f32> = idx.iter().map(|&j| (j as f32 * 0.37).sin()).collect();
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for parts in [1, 2, 3, 64] {
                let split = NeuronMajorSplit::from_weights(GgmlType::Q4_1, &w, rows, cols, parts).unwrap();
                assert_eq!(split.parts(), parts.min(rows.div_ceil(32)));
                assert_eq!((split.outputs(), split.neurons()), (rows, cols));
                for fast in [false, true] {
                    let (mut want, mut got) = (vec![0.0; rows], vec![f32::NAN; rows]);
                    if fast {
                        whole.axpy_fast(&pool, &idx, &coef, &mut want).unwrap();
                        split.axpy_fast(&pool, &idx, &coef, &mut got).unwrap();
                    } else {
                        whole.axpy(&pool, &idx, &coef, &mut want).unwrap();
                        split.axpy(&pool, &idx, &coef, &mut got).unwrap();
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert!(want.iter().any(|&v| v != 0.0));
                    assert_eq!(bits(&got), bits(&want), "threads {threads}, parts {parts}, fast {fast}");
                }
            }
        }
    }

    #[test]
    fn bad_arguments_are_errors_and_leave_the_output_alone() {
        let (rows, cols) = (96, 64);
        let w = q4_1(rows, cols, 3);
        let split = NeuronMajorSplit::from_weights(GgmlType::Q4_1, &w, rows, cols, 2).unwrap();
        let pool = ThreadPool::new(2);
        let mut out = vec![5.0; rows];
        assert!(split.axpy(&pool, &[3, 1], &[1.0, 1.0], &mut out).is_err());
        assert!(split.axpy(&pool, &[64], &[1.0], &mut out).is_err());
        assert!(split.axpy(&pool, &[1], &[1.0, 2.0], &mut out).is_err());
        assert!(out.iter().all(|&v| v == 5.0));
        assert!(split.axpy(&pool, &[1], &[1.0], &mut out[1..]).is_err());
        assert!(NeuronMajorSplit::from_weights(GgmlType::Q4_1, &w[1..], rows, cols, 2).is_err());
        assert!(NeuronMajorSplit::from_weights(GgmlType::Q4_K, &w, rows, cols, 2).is_err());
    }
}
