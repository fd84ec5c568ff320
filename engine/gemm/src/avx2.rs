//! The AVX2 kernel of [`super::gemm_packed`] for [`super::PackedType::F32`]
//! (CPUs without AVX-512, such as AMD Zen 3 and earlier, Intel client
//! cores): 6 tokens × 16 rows in 12 ymm accumulators, one FMA per product.
//!
//! A 48-row panel is walked as three sub-panels of 16 rows (64 contiguous
//! bytes per column, one cache line). The tokens go in chunks whose
//! activations fit in the L3 ([`CHUNK_BYTES`]); for each chunk, each thread
//! takes its rows in blocks whose packed weights fit in half an L2
//! ([`BLOCK_BYTES`]) and runs the chunk's token tiles over one block before
//! the next. So the weights are read from the L2 once per token tile, the
//! activations from the L3 once per block, and a tile's activations (6
//! rows of K floats) stay in the L1 or the L2.
//!
//! The order of operations is the crate's: each accumulator starts from the
//! bias and adds `x[c] · w[c]` with a fused multiply-add for `c = 0, 1, ...`,
//! so the results equal [`super::gemm_packed_scalar`] bit for bit.

#![allow(clippy::needless_range_loop, reason = "micro-kernels index M x NV register arrays")]

use std::arch::x86_64::*;

use super::{Epilogue, LANES, NR, PackedMatrix};
use spinfer_kernel_base::cpu::CpuFeatures;
use spinfer_kernel_base::pool::{SyncPtr, ThreadPool, chunk_aligned};

/// Tokens per register tile.
pub(super) const MR: usize = 6;
/// Rows per sub-panel (two vectors of 8 lanes).
pub(super) const SUB: usize = 16;
/// f32 lanes per AVX2 vector.
pub(super) const V: usize = 8;
/// Packed weight bytes per block of a thread's rows: half of a 512 KiB L2,
/// the smallest of the CPUs this kernel runs on, leaving room for the
/// activations and the outputs.
const BLOCK_BYTES: usize = 256 * 1024;

/// Activation bytes per chunk of tokens: well inside the L3 of the CPUs
/// this kernel runs on (8 MiB and more), beside the weights.
const CHUNK_BYTES: usize = 1 << 20;

/// Whether the CPU has this kernel's features: AVX2 and FMA (cached
/// detection, capped by `SPINFER_CPU`).
pub(super) fn available() -> bool {
    CpuFeatures::detect().has_avx2_fma()
}

/// Runs the product (see [`super::gemm_packed`]; operands checked, `w` is
/// f32, [`available`] holds, `n > 0`).
pub(super) fn run(
    pool: &ThreadPool,
    w: &PackedMatrix,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    epilogue: Option<Epilogue<'_>>,
) {
    let (rows, steps) = (w.rows, w.steps);
    debug_assert_eq!(steps, w.cols);
    let (panels, xs) = (w.panels().as_ptr().cast::<f32>() as usize, x.as_ptr() as usize);
    drive(pool, rows, steps, n, out, epilogue, &|t, m, r, width, c| {
        let (p, j0) = (r / NR, r % NR);
        let bp = bias.map_or(std::ptr::null(), |b| b[r..].as_ptr());
        // SAFETY: tokens `t..t + m` of the activations (`steps` floats
        // each) and lanes `j0..j0 + 16 <= NR` of panel `p` (`steps * NR`
        // floats, zero-padded past `rows`) are inside their buffers; `c`
        // is rows `r..r + width` of token `t` (see `drive`); the bias
        // (when present) holds `rows` floats; `available` holds.
        unsafe {
            let pp = (panels as *const f32).add(p * steps * NR + j0);
            pick::<F32Tiles>(m, width)(steps, (xs as *const f32).add(t * steps), steps, pp, c, rows, bp, width);
        }
    });
}

/// The loop nest shared by the AVX2 kernels: tokens in chunks whose
/// activations (`steps` u32 per token) stay in the L3 while every block of
/// rows runs over them; within a chunk, blocks of rows whose packed
/// weights (`steps` u32 per row) stay in the L2 while the chunk's token
/// tiles run. `tile(t, m, r, width, c)` computes tokens `t..t + m` (`m <=
/// MR`) of rows `r..r + width` (`r` a multiple of 16, `width <= 16`) into
/// `c`, which points at `out[t, r]` (row stride `rows`); `epilogue` then
/// runs on each of those tokens' outputs. Each pool thread owns a range
/// of rows.
pub(super) fn drive(
    pool: &ThreadPool,
    rows: usize,
    steps: usize,
    n: usize,
    out: &mut [f32],
    epilogue: Option<Epilogue<'_>>,
    tile: &(dyn Fn(usize, usize, usize, usize, *mut f32) + Sync),
) {
    assert!(out.len() >= n * rows, "gemm_packed: output of {} floats for {n} x {rows}", out.len());
    // Rows per block: a multiple of the sub-panel, at least one; tokens
    // per chunk: a multiple of the tile, at least one.
    let block = (BLOCK_BYTES / (steps * 4 * SUB)).max(1) * SUB;
    let chunk_tokens = (CHUNK_BYTES / (steps * 4 * MR)).max(1) * MR;
    let out_ptr = SyncPtr::new(out.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        let rr = chunk_aligned(rows, ti, nt, LANES);
        let out = out_ptr.get();
        for t0 in (0..n).step_by(chunk_tokens) {
            let t1 = (t0 + chunk_tokens).min(n);
            for r0 in rr.clone().step_by(block) {
                let r1 = (r0 + block).min(rr.end);
                for t in (t0..t1).step_by(MR) {
                    let m = MR.min(t1 - t);
                    for r in (r0..r1).step_by(SUB) {
                        let width = SUB.min(r1 - r);
                        // SAFETY: `out` holds `n * rows` floats (asserted);
                        // rows `r..r + width` of tokens `t..t + m` belong to
                        // this thread's range and to no other call.
                        let c = unsafe { out.add(t * rows + r) };
                        tile(t, m, r, width, c);
                        if let Some(e) = epilogue {
                            for i in 0..m {
                                // SAFETY: as above, one token's row slice.
                                e(unsafe { std::slice::from_raw_parts_mut(c.add(i * rows), width) });
                            }
                        }
                    }
                }
            }
        }
    });
}

/// Signature of the micro-kernels.
type Ukr = unsafe fn(usize, *const f32, usize, *const f32, *mut f32, usize, *const f32, usize);

/// An AVX2 kernel's micro-kernels, one per tile shape: `M` tokens × `NV`
/// vectors of 8 rows.
pub(super) trait Tiles {
    /// The micro-kernels' function type.
    type Ukr;
    /// The micro-kernel for `M` tokens and `NV` vectors.
    fn ukr<const M: usize, const NV: usize>() -> Self::Ukr;
}

/// The micro-kernel of `T` for `m` tokens (1 to [`MR`]) and `width` rows
/// (1 to 16).
pub(super) fn pick<T: Tiles>(m: usize, width: usize) -> T::Ukr {
    fn by_nv<T: Tiles, const M: usize>(width: usize) -> T::Ukr {
        if width > V { T::ukr::<M, 2>() } else { T::ukr::<M, 1>() }
    }
    match m {
        6 => by_nv::<T, 6>(width),
        5 => by_nv::<T, 5>(width),
        4 => by_nv::<T, 4>(width),
        3 => by_nv::<T, 3>(width),
        2 => by_nv::<T, 2>(width),
        _ => by_nv::<T, 1>(width),
    }
}

/// The f32 kernel's tiles.
struct F32Tiles;

impl Tiles for F32Tiles {
    type Ukr = Ukr;
    fn ukr<const M: usize, const NV: usize>() -> Ukr {
        ukr::<M, NV>
    }
}

/// `c[i, 0..width] = bias + Σ_q x[i, q] · p[q, 0..width]` for `i < M` over
/// `steps` columns, in order of `q`, from the bias (zero when null); `x`
/// row stride `ldx`, panel row stride `NR`, `c` row stride `ldc`; lanes
/// past `width` (of the last of the `NV` vectors) are neither loaded from
/// the bias nor stored.
///
/// # Safety
/// AVX2 and FMA must be available; `x` must hold `M` rows of `steps`
/// floats, `p` `steps` rows of `8 · NV` floats (stride `NR`), `c` `M` rows
/// of `width` floats; `bias` is null or holds `width` floats; `8 · (NV - 1)
/// < width <= 8 · NV`.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments, reason = "the micro-kernel operands")]
unsafe fn ukr<const M: usize, const NV: usize>(
    steps: usize,
    x: *const f32,
    ldx: usize,
    p: *const f32,
    c: *mut f32,
    ldc: usize,
    bias: *const f32,
    width: usize,
) {
    // Lanes of the last vector: all 8, or the first `rem` under `mask`.
    let rem = width - V * (NV - 1);
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    // SAFETY: all addresses are inside the buffers described above; the
    // masked loads and stores touch only the first `rem` lanes.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NV]; M];
        if !bias.is_null() {
            for j in 0..NV {
                let bv = if j + 1 == NV && rem < V {
                    _mm256_maskload_ps(bias.add(V * j), mask)
                } else {
                    _mm256_loadu_ps(bias.add(V * j))
                };
                for row in acc.iter_mut() {
                    row[j] = bv;
                }
            }
        }
        for q in 0..steps {
            let pq = p.add(q * NR);
            let mut b = [_mm256_setzero_ps(); NV];
            for j in 0..NV {
                b[j] = _mm256_loadu_ps(pq.add(V * j));
            }
            for i in 0..M {
                let a = _mm256_broadcast_ss(&*x.add(i * ldx + q));
                for j in 0..NV {
                    acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
                }
            }
        }
        for j in 0..NV {
            for i in 0..M {
                let dst = c.add(i * ldc + V * j);
                if j + 1 == NV && rem < V {
                    _mm256_maskstore_ps(dst, mask, acc[i][j]);
                } else {
                    _mm256_storeu_ps(dst, acc[i][j]);
                }
            }
        }
    }
}
