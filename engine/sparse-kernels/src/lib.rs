//! `spinfer-sparse-kernels`: the kernels of activation-sparse SwiGLU FFNs,
//! on top of `spinfer-kernels` (its block formats, quantisers, pool and CPU
//! detection; its `KernelError` is this crate's error too).
//!
//! For `out = W_down · (silu(W_gate x) ⊙ (W_up x))` the engine computes the
//! full gate, keeps a set of active neurons `idx` and then:
//!
//! - **up**: [`gather_rows`] copies the active rows of the quantised `W_up`
//!   (`ffn × dim`, GGUF block layout) into a compact buffer, on which the
//!   existing dense matvec kernel runs unchanged ("gathered-row matvec");
//! - **down**: `W_down` (`dim × ffn`) is transposed once, at load time, by
//!   [`transpose_to_q8_0`] into a neuron-major Q8_0 matrix (`ffn × dim`), and
//!   [`axpy_rows_q8_0`] accumulates `Σ_k coef[k] · row(idx[k])` over the
//!   active neurons only (an AXPY over selected rows).
//!
//! [`axpy_rows_q8_0_scalar`] is the scalar reference of the AXPY; the AVX2
//! and AVX-512 versions are chosen at run time and tested against it.
//!
//! The Q8_0 transpose requantises `W_down`. For Q4_0 / Q4_1 / Q8_0 weights,
//! [`NeuronMajor`] is an exact neuron-major form instead (integer codes plus
//! the original block scales and minimums), with its own AXPY
//! ([`NeuronMajor::axpy`]); [`NeuronMajorSplit`] keeps one such copy per
//! thread, each of a range of the outputs, which streams faster.

use spinfer_kernels::blocks::{BlockQ8_0, QK};
use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::kernel::check_indices;
use spinfer_kernels::pool::{SyncPtr, ThreadPool, chunk};
use spinfer_kernels::quantize::quantize_row_q8_0_ref;
use spinfer_kernels::{GgmlType, KernelError, Result};

mod neuron_major;
mod neuron_major_split;

pub use neuron_major::{NeuronMajor, QuantisedCoefs, QuantisedRun};
pub use neuron_major_split::NeuronMajorSplit;

/// Bytes of one Q8_0 block (`f16` scale + 32 int8).
const Q8_0_BYTES: usize = std::mem::size_of::<BlockQ8_0>();

/// Below this many bytes, [`gather_rows`] copies on the calling thread.
const GATHER_PAR_BYTES: usize = 64 * 1024;

/// Below this many multiply-adds (`idx.len() * cols`), [`axpy_rows_q8_0`]
/// runs on the calling thread (a broadcast costs about a microsecond).
const AXPY_PAR_MACS: usize = 32 * 1024;

fn shape_err(op: &'static str, detail: String) -> KernelError {
    KernelError::Shape { op, detail }
}

// ---------------------------------------------------------------------------
// Gathered rows (sparse up projection)
// ---------------------------------------------------------------------------

/// Copies rows `idx` (in `idx` order; repeats allowed) of the row-major
/// matrix `w` (`row_bytes` bytes per row, e.g. `GgmlType::row_bytes(cols)`)
/// contiguously into `dst`, which is resized to `idx.len() * row_bytes`
/// (it only reallocates when it has to grow). Large copies are split over
/// the pool's threads.
///
/// Errors ([`KernelError::Shape`]): `row_bytes == 0`, `w.len()` not a
/// multiple of `row_bytes`, or an index past the last row. `dst` is left
/// untouched on error.
pub fn gather_rows(pool: &ThreadPool, w: &[u8], row_bytes: usize, idx: &[u32], dst: &mut Vec<u8>) -> Result<()> {
    const OP: &str = "gather_rows";
    if row_bytes == 0 || !w.len().is_multiple_of(row_bytes) {
        return Err(shape_err(OP, format!("{} bytes are not whole rows of {row_bytes} bytes", w.len())));
    }
    let n_rows = w.len() / row_bytes;
    check_indices(OP, idx, n_rows)?;
    let total = idx.len() * row_bytes;
    dst.resize(total, 0);
    let nt = pool.n_threads();
    if nt == 1 || total < GATHER_PAR_BYTES {
        for (d, &i) in dst.chunks_exact_mut(row_bytes).zip(idx) {
            let i = i as usize;
            d.copy_from_slice(&w[i * row_bytes..(i + 1) * row_bytes]);
        }
        return Ok(());
    }
    let base = SyncPtr::new(dst.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        let r = chunk(idx.len(), ti, nt);
        if r.is_empty() {
            return;
        }
        // SAFETY: rows `r` of `dst` (`r.start * row_bytes .. r.end *
        // row_bytes`) lie inside `dst` (`idx.len() * row_bytes` bytes) and
        // `chunk` hands every thread a disjoint range of rows.
        let d = unsafe { std::slice::from_raw_parts_mut(base.get().add(r.start * row_bytes), r.len() * row_bytes) };
        for (d, &i) in d.chunks_exact_mut(row_bytes).zip(&idx[r]) {
            let i = i as usize;
            d.copy_from_slice(&w[i * row_bytes..(i + 1) * row_bytes]);
        }
    });
    Ok(())
}

// ---------------------------------------------------------------------------
// Neuron-major Q8_0 transpose (load time)
// ---------------------------------------------------------------------------

/// Transposes the `rows × cols` matrix `w` of `wtype` (any type
/// [`dequantize_row`] supports) into a row-major GGUF Q8_0 matrix of `cols`
/// rows and `rows` columns: row `j` of the result is column `j` of `W`,
/// quantised per 32 consecutive elements with ggml's reference Q8_0
/// quantiser (the bytes are GGUF Q8_0 blocks,
/// `GgmlType::Q8_0.row_bytes(rows)` per row).
///
/// Works on 32 source rows at a time (one output block column), so the
/// working set is `32 × cols` floats.
///
/// Errors: `rows` not a multiple of 32 or `w` not `rows` rows of `cols`
/// elements of `wtype`.
pub fn transpose_to_q8_0(wtype: GgmlType, w: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>> {
    const OP: &str = "transpose_to_q8_0";
    if !rows.is_multiple_of(QK) {
        return Err(shape_err(OP, format!("{rows} rows are not a multiple of {QK}")));
    }
    let rb = wtype.row_bytes(cols)?;
    let want = rows.checked_mul(rb).ok_or_else(|| shape_err(OP, format!("{rows} x {cols} overflows")))?;
    if w.len() != want {
        return Err(KernelError::BufferSize { ty: wtype, n: rows * cols, want, got: w.len() });
    }
    let nb_out = rows / QK;
    let rb_out = nb_out * Q8_0_BYTES;
    let mut out = vec![0u8; cols * rb_out];
    if cols == 0 || rows == 0 {
        return Ok(out);
    }
    let mut tmp = vec![0f32; QK * cols];
    let mut col = [0f32; QK];
    let mut blk = [BlockQ8_0 { d: half::f16::ZERO, qs: [0; QK] }];
    // Columns per inner tile: the 32 rows' slices of a tile stay in L1.
    const TILE: usize = 64;
    for b in 0..nb_out {
        for (i, dst) in tmp.chunks_exact_mut(cols).enumerate() {
            let r = b * QK + i;
            dequantize_row(wtype, &w[r * rb..(r + 1) * rb], dst)?;
        }
        for j0 in (0..cols).step_by(TILE) {
            for j in j0..(j0 + TILE).min(cols) {
                for (i, c) in col.iter_mut().enumerate() {
                    *c = tmp[i * cols + j];
                }
                quantize_row_q8_0_ref(&col, &mut blk)?;
                let off = j * rb_out + b * Q8_0_BYTES;
                out[off..off + Q8_0_BYTES].copy_from_slice(bytemuck::bytes_of(&blk[0]));
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// AXPY over selected rows of a Q8_0 matrix (sparse down projection)
// ---------------------------------------------------------------------------

/// Which implementation [`axpy_rows_q8_0`] uses; ordered from the least
/// to the most capable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum AxpyIsa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512F (+ AVX2, FMA, F16C).
    Avx512,
}

impl AxpyIsa {
    /// The best implementation for `features` that the running CPU also
    /// supports (so a caller can restrict, never extend, the choice).
    pub fn select(features: &CpuFeatures) -> Self {
        let cpu = CpuFeatures::detect();
        let avx2 = features.has_avx2() && cpu.has_avx2();
        if avx2 && features.avx512f && cpu.avx512f {
            AxpyIsa::Avx512
        } else if avx2 {
            AxpyIsa::Avx2
        } else {
            AxpyIsa::Scalar
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            AxpyIsa::Scalar => "scalar",
            AxpyIsa::Avx2 => "avx2",
            AxpyIsa::Avx512 => "avx512",
        }
    }
}

/// Validates an AXPY call; returns the row size of `wt` in bytes.
fn check_axpy(wt: &[u8], cols: usize, idx: &[u32], coef: &[f32], out: &[f32]) -> Result<usize> {
    const OP: &str = "axpy_rows_q8_0";
    let rb = GgmlType::Q8_0.row_bytes(cols)?;
    if cols == 0 || !wt.len().is_multiple_of(rb) {
        return Err(shape_err(OP, format!("{} bytes are not whole q8_0 rows of {cols} columns", wt.len())));
    }
    if coef.len() != idx.len() {
        return Err(shape_err(OP, format!("{} coefficients for {} indices", coef.len(), idx.len())));
    }
    if out.len() != cols {
        return Err(shape_err(OP, format!("output of {} floats for {cols} columns", out.len())));
    }
    check_indices(OP, idx, wt.len() / rb)?;
    Ok(rb)
}

/// `out[c] = Σ_k coef[k] · Wt[idx[k], c]` for `c in 0..cols`, overwriting
/// `out`: the sparse down projection over a neuron-major Q8_0 matrix `wt`
/// (from [`transpose_to_q8_0`]; `cols` columns, a multiple of 32, per row).
/// Indices need not be sorted or distinct. The output columns are split
/// over the pool's threads in 32-column blocks.
///
/// Errors ([`KernelError::Shape`] / [`KernelError::RowNotBlockAligned`]):
/// `cols` not a positive multiple of 32, `wt` not whole rows,
/// `coef.len() != idx.len()`, `out.len() != cols`, an index past the last
/// row.
pub fn axpy_rows_q8_0(
    pool: &ThreadPool,
    wt: &[u8],
    cols: usize,
    idx: &[u32],
    coef: &[f32],
    out: &mut [f32],
) -> Result<()> {
    axpy_rows_q8_0_with(pool, AxpyIsa::select(&CpuFeatures::detect()), wt, cols, idx, coef, out)
}

/// [`axpy_rows_q8_0`] with an explicit implementation; `isa` is lowered to
/// what the running CPU supports (see [`AxpyIsa::select`]), so any value
/// is safe.
pub fn axpy_rows_q8_0_with(
    pool: &ThreadPool,
    isa: AxpyIsa,
    wt: &[u8],
    cols: usize,
    idx: &[u32],
    coef: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let rb = check_axpy(wt, cols, idx, coef, out)?;
    let cpu = CpuFeatures::detect();
    let isa = match isa {
        AxpyIsa::Avx512 => AxpyIsa::select(&cpu),
        AxpyIsa::Avx2 if cpu.has_avx2() => AxpyIsa::Avx2,
        _ => AxpyIsa::Scalar,
    };
    let nb = cols / QK;
    let nt = pool.n_threads();
    if nt == 1 || idx.len() * cols < AXPY_PAR_MACS || nb == 1 {
        axpy_blocks(isa, wt, rb, 0, nb, idx, coef, out);
        return Ok(());
    }
    let base = SyncPtr::new(out.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        let r = chunk(nb, ti, nt);
        if r.is_empty() {
            return;
        }
        // SAFETY: blocks `r` of `out` (floats `32 * r.start .. 32 * r.end`)
        // lie inside `out` (`32 * nb` floats) and `chunk_aligned` hands every
        // thread a disjoint range of blocks.
        let o = unsafe { std::slice::from_raw_parts_mut(base.get().add(r.start * QK), r.len() * QK) };
        axpy_blocks(isa, wt, rb, r.start, r.len(), idx, coef, o);
    });
    Ok(())
}

/// One thread's share: output blocks `b0 .. b0 + nb` into `out`
/// (`32 * nb` floats). Arguments are validated by the caller.
#[allow(clippy::too_many_arguments, reason = "internal helper over validated arguments")]
fn axpy_blocks(isa: AxpyIsa, wt: &[u8], rb: usize, b0: usize, nb: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
    debug_assert_eq!(out.len(), nb * QK);
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `AxpyIsa::Avx512` is only produced by `select` on a CPU
        // with AVX-512F, AVX2, FMA and F16C; the caller validated every index
        // against `wt` and the block range against the row size.
        AxpyIsa::Avx512 => unsafe { x86::axpy_avx512(wt, rb, b0, nb, idx, coef, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX2, FMA and F16C detected.
        AxpyIsa::Avx2 => unsafe { x86::axpy_avx2(wt, rb, b0, nb, idx, coef, out) },
        _ => axpy_blocks_scalar(wt, rb, b0, idx, coef, out),
    }
}

/// Scalar reference of [`axpy_rows_q8_0`] (single-threaded): per Q8_0
/// block, `scale = f32(d) * coef[k]`, then `out[c] += scale * q[c]`, with
/// `k` in order.
pub fn axpy_rows_q8_0_scalar(wt: &[u8], cols: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) -> Result<()> {
    let rb = check_axpy(wt, cols, idx, coef, out)?;
    axpy_blocks_scalar(wt, rb, 0, idx, coef, out);
    Ok(())
}

fn axpy_blocks_scalar(wt: &[u8], rb: usize, b0: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (&i, &c) in idx.iter().zip(coef) {
        let row = &wt[i as usize * rb + b0 * Q8_0_BYTES..];
        for (o, blk) in out.chunks_exact_mut(QK).zip(row.chunks_exact(Q8_0_BYTES)) {
            let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let s = d * c;
            for (o, &q) in o.iter_mut().zip(&blk[2..]) {
                *o += s * f32::from(q as i8);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Q8_0_BYTES;
    use spinfer_kernels::pool::chunk;

    /// `f32(d) * c` for the f16 scale at `blk`, broadcast to every lane of
    /// an `__m128` (lane 0 is what callers broadcast further).
    ///
    /// # Safety
    /// F16C must be available; `blk` must point at two readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_scale(blk: *const u8, c: __m128) -> __m128 {
        // SAFETY: the caller guarantees two readable bytes at `blk`.
        let bits = unsafe { blk.cast::<u16>().read_unaligned() };
        _mm_mul_ss(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))), c)
    }

    /// Distance, in neurons, of the software prefetch of the next rows'
    /// tiles (their order is data-dependent, so the hardware prefetchers
    /// cannot follow).
    pub(super) const PREFETCH: usize = 8;

    /// Prefetches the `len` bytes at offset `off` of row `idx[k]`, if any.
    #[inline(always)]
    pub(super) fn prefetch_tile(base: *const u8, rb: usize, off: usize, len: usize, idx: &[u32], k: usize) {
        if let Some(&i) = idx.get(k) {
            let p = base.wrapping_add(i as usize * rb + off);
            let mut o = 0;
            while o < len + 63 {
                // SAFETY: a prefetch is only a hint: it never faults and
                // does not dereference the pointer in the abstract machine.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o.min(len - 1)).cast()) };
                o += 64;
            }
        }
    }

    /// Accumulates `NB` blocks (starting at byte offset `off` of each row)
    /// over all `k` into 2·NB zmm registers and stores them to `out`.
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA, F16C; every `idx[k] * rb + off + NB * 34` within
    /// `wt`; `out` holds `32 * NB` floats.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn tile512<const NB: usize>(wt: &[u8], rb: usize, off: usize, idx: &[u32], coef: &[f32], out: *mut f32) {
        let mut acc = [_mm512_setzero_ps(); 16];
        let base = wt.as_ptr();
        for (k, (&i, &c)) in idx.iter().zip(coef).enumerate() {
            prefetch_tile(base, rb, off, NB * Q8_0_BYTES, idx, k + PREFETCH);
            let vc = _mm_set_ss(c);
            // SAFETY: the caller guarantees the tile lies inside `wt`.
            let row = unsafe { base.add(i as usize * rb + off) };
            for b in 0..NB {
                // SAFETY: block `b` of the tile (34 bytes at `row + 34 b`)
                // lies inside `wt`; the quants are bytes 2..18 and 18..34.
                unsafe {
                    let blk = row.add(b * Q8_0_BYTES);
                    let s = _mm512_broadcastss_ps(block_scale(blk, vc));
                    let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(2).cast())));
                    let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(18).cast())));
                    acc[2 * b] = _mm512_fmadd_ps(s, q0, acc[2 * b]);
                    acc[2 * b + 1] = _mm512_fmadd_ps(s, q1, acc[2 * b + 1]);
                }
            }
        }
        for (j, a) in acc.iter().take(2 * NB).enumerate() {
            // SAFETY: `out` holds `32 * NB` floats; `j < 2 NB`.
            unsafe { _mm512_storeu_ps(out.add(16 * j), *a) };
        }
    }

    /// AVX-512 twin of `axpy_blocks_scalar`: output blocks `b0 .. b0 + nb`,
    /// in register tiles of up to 8 blocks (16 zmm accumulators).
    ///
    /// # Safety
    /// AVX-512F, AVX2, FMA, F16C; every `idx[k]` a valid row of `wt` (rows
    /// of `rb` bytes), `(b0 + nb) * 34 <= rb`, `out.len() == 32 * nb`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn axpy_avx512(wt: &[u8], rb: usize, b0: usize, nb: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        // Tiles of near-equal size (at most 8 blocks).
        let tiles = nb.div_ceil(8);
        for t in 0..tiles {
            let r = chunk(nb, t, tiles);
            let (b, n) = (r.start, r.len());
            let off = (b0 + b) * Q8_0_BYTES;
            // SAFETY: `b + n <= nb`, so the 32 n floats at `out + 32 b` are
            // inside `out`; the tile's blocks are inside every row (caller).
            unsafe {
                let o = out.as_mut_ptr().add(b * 32);
                match n {
                    8 => tile512::<8>(wt, rb, off, idx, coef, o),
                    7 => tile512::<7>(wt, rb, off, idx, coef, o),
                    6 => tile512::<6>(wt, rb, off, idx, coef, o),
                    5 => tile512::<5>(wt, rb, off, idx, coef, o),
                    4 => tile512::<4>(wt, rb, off, idx, coef, o),
                    3 => tile512::<3>(wt, rb, off, idx, coef, o),
                    2 => tile512::<2>(wt, rb, off, idx, coef, o),
                    _ => tile512::<1>(wt, rb, off, idx, coef, o),
                }
            }
        }
    }

    /// As [`tile512`] with ymm registers: 4·NB accumulators.
    ///
    /// # Safety
    /// AVX2, FMA, F16C; as [`tile512`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile256<const NB: usize>(wt: &[u8], rb: usize, off: usize, idx: &[u32], coef: &[f32], out: *mut f32) {
        let mut acc = [_mm256_setzero_ps(); 12];
        let base = wt.as_ptr();
        for (k, (&i, &c)) in idx.iter().zip(coef).enumerate() {
            prefetch_tile(base, rb, off, NB * Q8_0_BYTES, idx, k + PREFETCH);
            let vc = _mm_set_ss(c);
            // SAFETY: the caller guarantees the tile lies inside `wt`.
            let row = unsafe { base.add(i as usize * rb + off) };
            for b in 0..NB {
                // SAFETY: block `b` of the tile (34 bytes at `row + 34 b`)
                // lies inside `wt`; the quants are bytes 2..34, read 8 at a
                // time.
                unsafe {
                    let blk = row.add(b * Q8_0_BYTES);
                    let s = _mm256_broadcastss_ps(block_scale(blk, vc));
                    for h in 0..4 {
                        let q = _mm_loadl_epi64(blk.add(2 + 8 * h).cast());
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                        acc[4 * b + h] = _mm256_fmadd_ps(s, q, acc[4 * b + h]);
                    }
                }
            }
        }
        for (j, a) in acc.iter().take(4 * NB).enumerate() {
            // SAFETY: `out` holds `32 * NB` floats; `j < 4 NB`.
            unsafe { _mm256_storeu_ps(out.add(8 * j), *a) };
        }
    }

    /// AVX2 twin of `axpy_blocks_scalar`, in register tiles of up to 3
    /// blocks (12 ymm accumulators).
    ///
    /// # Safety
    /// AVX2, FMA, F16C; as [`axpy_avx512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn axpy_avx2(wt: &[u8], rb: usize, b0: usize, nb: usize, idx: &[u32], coef: &[f32], out: &mut [f32]) {
        // Tiles of near-equal size (at most 3 blocks).
        let tiles = nb.div_ceil(3);
        for t in 0..tiles {
            let r = chunk(nb, t, tiles);
            let (b, n) = (r.start, r.len());
            let off = (b0 + b) * Q8_0_BYTES;
            // SAFETY: `b + n <= nb`, so the 32 n floats at `out + 32 b` are
            // inside `out`; the tile's blocks are inside every row (caller).
            unsafe {
                let o = out.as_mut_ptr().add(b * 32);
                match n {
                    3 => tile256::<3>(wt, rb, off, idx, coef, o),
                    2 => tile256::<2>(wt, rb, off, idx, coef, o),
                    _ => tile256::<1>(wt, rb, off, idx, coef, o),
                }
            }
        }
    }
}
