//! The bf16 packed GEMM on AMX tiles (Intel Sapphire Rapids and later,
//! where the OS grants the tile data: [`spinfer_kernel_base::cpu::CpuFeatures::amx_bf16`]).
//!
//! The packed panels are already the tiles' weight layout: step `q` of a
//! panel holds one bf16 pair per row, so 16 steps of 16 rows (stride
//! [`NR`] pairs) are one `B` tile, and 16 tokens' rounded activations
//! (stride `steps` pairs) one `A` tile. Each call of `tdpbf16ps` adds
//! 16 tokens × 16 rows × 32 columns of products to an f32 tile; a thread
//! keeps 2 × 2 such tiles (32 tokens × 32 rows) over the whole K, starting
//! from the bias, so an output depends neither on the other tokens nor on
//! the thread count. Products are exact and summed in f32, pair by pair, as
//! `vdpbf16ps` does, but in another order (and with denormals flushed):
//! the results agree with [`super::gemm_packed_scalar`] to f32 rounding,
//! not bit for bit (tested).

use std::arch::asm;

use super::{Epilogue, NR, PackedMatrix, avx512::round_pairs};
use spinfer_kernel_base::kernel::scratch_aligned;
use spinfer_kernel_base::pool::{SyncPtr, ThreadPool, chunk_aligned};
use spinfer_kernel_base::tiles::Tiles;

/// Tokens and rows of one tile; steps (column pairs) per tile product.
const T: usize = 16;

/// Whether the tile kernel takes `w`: whole tiles of K (the packed layout
/// pads rows, not steps).
pub(super) fn fits(w: &PackedMatrix) -> bool {
    w.steps.is_multiple_of(T)
}

/// The tile configuration: eight tiles of 16 rows × 64 bytes.
const TILES: [(u16, u8); 8] = [(64, T as u8); 8];

/// Runs the product (see [`super::gemm_packed`]; operands checked, `n > 0`,
/// the OS granted AMX and [`fits`] holds).
#[allow(clippy::too_many_arguments, reason = "the GEMM operands")]
pub(super) fn run(
    pool: &ThreadPool,
    w: &PackedMatrix,
    x: &[f32],
    n: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    scratch: &mut Vec<u8>,
    epilogue: Option<Epilogue<'_>>,
) {
    let (rows, cols, steps) = (w.rows, w.cols, w.steps);
    // Activations rounded to bf16 pairs, tokens padded with zeros to whole
    // pairs of tiles (the padding's outputs are computed, never stored).
    let padded = n.div_ceil(2 * T) * 2 * T;
    let xb = scratch_aligned(scratch, padded * steps * 4);
    xb[n * steps * 4..].fill(0);
    round_pairs(pool, x, n, cols, xb);
    let xb_ptr = SyncPtr::new(xb.as_mut_ptr());
    let panels = w.panels().as_ptr() as usize;
    let out_ptr = SyncPtr::new(out.as_mut_ptr().cast::<u8>());
    pool.broadcast(&|ti, nt| {
        let rr = chunk_aligned(rows, ti, nt, T);
        if rr.is_empty() {
            return;
        }
        // SAFETY: the OS granted this process the tile data (checked by
        // the caller); eight tiles of 16 × 64 bytes. Released on drop.
        let _tiles = unsafe { Tiles::configure(&TILES) };
        let xs = xb_ptr.get().cast::<u32>().cast_const();
        let out = out_ptr.get().cast::<f32>();
        let mut c = [[0.0f32; 2 * T]; 2 * T];
        let mut r = rr.start;
        while r < rr.end {
            // Two blocks of 16 rows (the second repeats the first past the
            // thread's rows); their weights and bias.
            let r1 = if r + T < rr.end { r + T } else { r };
            let block = |r: usize| (panels as *const u32).wrapping_add(r / NR * steps * NR + r % NR);
            let mut b = [[0.0f32; T]; 2];
            for (bb, r0) in b.iter_mut().zip([r, r1]) {
                for (j, v) in bb.iter_mut().enumerate() {
                    *v = bias.and_then(|bs| bs.get(r0 + j)).copied().unwrap_or(0.0);
                }
            }
            let mut t = 0;
            while t < n {
                // SAFETY: tokens `t..t + 32` of `xs` lie in the padded
                // buffer; each block's 16 rows of `steps` pairs lie in its
                // panel (rows past the matrix are zero padding, and a
                // block starting at a multiple of 16 never crosses a
                // panel of 48); `c` and `b` are local.
                unsafe { tiles_2x2(steps, xs.add(t * steps), [block(r), block(r1)], &b, &mut c) };
                let width = (rr.end - r).min(2 * T);
                for (i, ci) in c.iter().enumerate().take(n - t) {
                    // SAFETY: token `t + i < n`, rows `r..r + width` of this
                    // thread: inside `out` (`n * rows` floats), written by
                    // this thread only.
                    let o = unsafe { std::slice::from_raw_parts_mut(out.add((t + i) * rows + r), width) };
                    o.copy_from_slice(&ci[..width]);
                    if let Some(e) = epilogue {
                        e(o);
                    }
                }
                t += 2 * T;
            }
            r += 2 * T;
        }
    });
}

/// `c[i][j] = b[j / 16][j % 16] + Σ_q x[i, q] ·· w_{j / 16}[q, j % 16]`
/// for 32 tokens `i` and two blocks of 16 rows `j`, over `steps` pairs.
///
/// # Safety
/// The thread's tile configuration (8 tiles of 16 × 64 bytes) must be
/// loaded; `x` must hold 32 rows of `steps` pairs (stride `steps`); each
/// `w` 16 lanes of `steps` rows (stride [`NR`]); `steps` a multiple of 16.
#[inline]
unsafe fn tiles_2x2(steps: usize, x: *const u32, w: [*const u32; 2], b: &[[f32; T]; 2], c: &mut [[f32; 2 * T]; 2 * T]) {
    let (lda, ldb, ldc) = (steps * 4, NR * 4, 2 * T * 4);
    let x1 = x.wrapping_add(T * steps);
    // SAFETY: the caller's contract; tmm0..3 accumulate, tmm4/5 hold the
    // tokens' pairs, tmm6/7 the rows' pairs; the bias rows load with
    // stride 0 (one row repeated 16 times).
    unsafe {
        asm!(
            "tileloadd tmm0, [{b0} + {z}*1]",
            "tileloadd tmm1, [{b1} + {z}*1]",
            "tileloadd tmm2, [{b0} + {z}*1]",
            "tileloadd tmm3, [{b1} + {z}*1]",
            b0 = in(reg) b[0].as_ptr(), b1 = in(reg) b[1].as_ptr(), z = in(reg) 0usize,
            options(nostack, readonly),
        );
        for q in (0..steps).step_by(T) {
            asm!(
                "tileloadd tmm4, [{x0} + {lda}*1]",
                "tileloadd tmm5, [{x1} + {lda}*1]",
                "tileloadd tmm6, [{w0} + {ldb}*1]",
                "tileloadd tmm7, [{w1} + {ldb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                x0 = in(reg) x.add(q), x1 = in(reg) x1.add(q), lda = in(reg) lda,
                w0 = in(reg) w[0].add(q * NR), w1 = in(reg) w[1].add(q * NR), ldb = in(reg) ldb,
                options(nostack, readonly),
            );
        }
        let p = c.as_mut_ptr().cast::<f32>();
        asm!(
            "tilestored [{c00} + {ldc}*1], tmm0",
            "tilestored [{c01} + {ldc}*1], tmm1",
            "tilestored [{c10} + {ldc}*1], tmm2",
            "tilestored [{c11} + {ldc}*1], tmm3",
            c00 = in(reg) p, c01 = in(reg) p.add(T), c10 = in(reg) p.add(T * 2 * T), c11 = in(reg) p.add(T * 2 * T + T),
            ldc = in(reg) ldc,
            options(nostack),
        );
    }
}
