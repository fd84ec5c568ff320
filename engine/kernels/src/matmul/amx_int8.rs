//! The prompt path of the 8-bit matmuls of the 32-element formats (Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0 weights × Q8_0/Q8_1 activations) on AMX int8
//! tiles, where the OS grants them ([`crate::cpu::CpuFeatures::amx_int8`]).
//! It serves calls marked [`crate::kernel::MatmulCall::prefill`]; the
//! other calls on such CPUs (decode rows, batches of them, gathered rows)
//! go to [`super::amx_rows`], which computes every output the same way.
//!
//! Per call, the activations are quantised as for the other kernels (the
//! same `d`, `q` and block sums `s`, in block order: [`LegacyLayout`]
//! without interleaving), and each pool thread, for each panel of 16
//! weight rows it owns, unpacks the panel once into the tiles' layout:
//! per block, 8 rows of 16 × 4 signed bytes (`B`, the VNNI order), with
//! the offsets of Q4_0/Q5_0 (8, 16) already subtracted, plus the rows'
//! `d` and `m`. Then for every 16 tokens and every block `b`, one
//! `tdpbssd` gives the exact integer dots `C[t][r]` of 16 tokens × 16 rows
//! over the block's 32 columns, and each output takes the block in order:
//!
//! `acc = fma(C[t][r] as f32, dw[r] · da[t], acc)`, then, for the formats
//! with a minimum, `acc = fma(mw[r], s[t], acc)`.
//!
//! An output therefore depends only on its own token and row (not on the
//! other tokens of the call, the thread count or where a panel starts),
//! and `reference_dot` computes exactly that, bit for bit (tested). It
//! rounds differently from the `vpdpbusd` tiles of CPUs without AMX, which
//! sum lane partials; both agree with the scalar reference to f32 rounding.

use std::arch::x86_64::*;

use super::{Job, SyncPtr, pack_tokens, scratch_aligned};
use crate::dot::fmt;
use crate::pool::ThreadPool;
use crate::pool::chunk_aligned;
use crate::quantize::{self, LegacyLayout};
use spinfer_kernel_base::tiles::{Tiles, dpbssd, dpbssd_pair};

/// Tokens and weight rows per tile.
const T: usize = 16;
/// Values per block.
const QK: usize = 32;
/// Bytes of one block's `B` tile: 8 rows of 16 weight rows × 4 bytes.
const B_TILE: usize = QK * T;

/// Whether the prompt path runs here: AMX int8 granted, and the AVX-512
/// the epilogue and the activation packing use.
pub(super) fn available() -> bool {
    let f = crate::cpu::CpuFeatures::detect();
    f.amx_int8 && f.has_avx512()
}

/// Bytes of one thread's unpacked panel: the `B` tiles of `nb` blocks, then
/// `d` and `m` of the 16 rows (`nb × 16` f32 each).
fn panel_bytes(nb: usize) -> usize {
    nb * (B_TILE + 2 * 4 * T)
}

/// The tile configuration, `(bytes per row, rows)`: tmm0/1 the int32 sums
/// (16 × 64 bytes), tmm2/3 16 tokens' blocks (16 × 32 bytes), tmm4/5 a
/// block of 16 rows (8 × 64 bytes).
const TILES: [(u16, u8); 6] = [(64, 16), (64, 16), (32, 16), (32, 16), (64, 8), (64, 8)];

/// Runs a dense prompt-path job (no row list; the caller checked
/// [`available`]).
pub(super) fn run<const F: u8>(pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) {
    debug_assert!(job.idx.is_none());
    let (n, rows, cols) = (job.n_tokens, job.desc.rows, job.desc.cols);
    let l = LegacyLayout::new(cols, false, 0);
    let nb = l.blocks;
    // Tokens padded with zeros to whole tiles (their outputs are computed,
    // never stored); then one unpacked panel per thread.
    let padded = n.div_ceil(T) * T;
    let act_bytes = padded * l.stride;
    let pb = panel_bytes(nb);
    let threads = pool.n_threads().max(1);
    let buf = scratch_aligned(scratch, act_bytes + threads * pb);
    let (act, panels) = buf.split_at_mut(act_bytes);
    act[n * l.stride..].fill(0);
    pack_tokens(pool, job.x, cols, n, act, l.stride, &|x, dst| quantize::pack_legacy(&l, x, dst));
    let act = act.as_ptr() as usize;
    let panels = SyncPtr::new(panels.as_mut_ptr());
    let (w, rb) = (job.w.as_ptr() as usize, job.row_bytes);
    let out = job.out;
    pool.broadcast(&|ti, nt| {
        let rr = chunk_aligned(rows, ti, nt, T);
        if rr.is_empty() || ti >= threads {
            return;
        }
        let panel = panels.get().wrapping_add(ti * pb);
        // SAFETY: the OS granted this process the tile data (`available`);
        // six tiles within 16 × 64 bytes. Released on drop.
        let _tiles = unsafe { Tiles::configure(&TILES) };
        let mut sums = Sums([[0; T * T]; 2]);
        let mut c = [[0.0f32; T]; T];
        for r0 in rr.clone().step_by(T) {
            let nr = (rr.end - r0).min(T);
            // SAFETY: rows `r0..r0 + nr` of `rb` bytes lie in the validated
            // weights; this thread's panel (`pb` bytes, 64-aligned: `pb`
            // and `act_bytes` are multiples of 64) is its own.
            unsafe { unpack_panel::<F>((w as *const u8).add(r0 * rb), rb, nr, nb, panel) };
            for t0 in (0..n).step_by(T) {
                // SAFETY: tokens `t0..t0 + 16` lie in the padded activation
                // buffer; the panel was just written; the CPU has AVX-512
                // (`available`) and this thread configured the tiles.
                unsafe { tile::<F>(&l, (act as *const u8).add(t0 * l.stride), panel, &mut sums, &mut c) };
                for (i, ci) in c.iter().enumerate().take(n - t0) {
                    // SAFETY: token `t0 + i < n`, rows `r0..r0 + nr` of this
                    // thread: inside `out` (`n × rows`), written only here.
                    let o = unsafe { std::slice::from_raw_parts_mut(out.get().add((t0 + i) * rows + r0), nr) };
                    o.copy_from_slice(&ci[..nr]);
                }
            }
        }
    });
}

/// The 32 weights of a block as signed bytes (offsets subtracted), its `d`
/// and its `m` (0 for the formats without a minimum).
///
/// # Safety
/// `p` must point at one readable block of `F`.
#[inline]
unsafe fn unpack_block<const F: u8>(p: *const u8) -> ([i8; QK], f32, f32) {
    // SAFETY: every offset below is inside the block (`fmt::block_bytes`).
    let bytes = unsafe { std::slice::from_raw_parts(p, fmt::block_bytes(F)) };
    let f16 = |o: usize| half::f16::from_le_bytes([bytes[o], bytes[o + 1]]).to_f32();
    let d = f16(0);
    let mut q = [0i8; QK];
    if F == fmt::Q8_0 {
        for (qj, &b) in q.iter_mut().zip(&bytes[2..2 + QK]) {
            *qj = b as i8;
        }
        return (q, d, 0.0);
    }
    let (m, qs, qh) = match F {
        fmt::Q4_0 => (0.0, 2, None),
        fmt::Q4_1 => (f16(2), 4, None),
        fmt::Q5_0 => (0.0, 6, Some(2)),
        _ => (f16(2), 8, Some(4)),
    };
    let qh = qh.map_or(0, |o| u32::from_le_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]));
    let off = fmt::offset(F);
    for j in 0..QK / 2 {
        let b = bytes[qs + j];
        let lo = i32::from(b & 0x0F) | ((((qh >> j) & 1) as i32) << 4);
        let hi = i32::from(b >> 4) | ((((qh >> (j + 16)) & 1) as i32) << 4);
        q[j] = (lo - off) as i8;
        q[j + QK / 2] = (hi - off) as i8;
    }
    (q, d, m)
}

/// Unpacks `nr` (≤ 16) rows of `nb` blocks (`rb` bytes apart from `w`)
/// into `panel`: block `b`'s tile at `b × B_TILE` (byte `4 k + i` of row
/// `j` at `64 k + 4 j + i`), then `d` and `m` as `[nb][16]` f32; rows past
/// `nr` are zero.
///
/// # Safety
/// `w` must hold `nr` rows of `nb` blocks of `F`; `panel` must be valid for
/// [`panel_bytes`]`(nb)` writes and 4-byte aligned.
unsafe fn unpack_panel<const F: u8>(w: *const u8, rb: usize, nr: usize, nb: usize, panel: *mut u8) {
    let bs = fmt::block_bytes(F);
    // SAFETY: the caller's contract; the three sections do not overlap.
    let (tiles, d, m) = unsafe {
        (
            std::slice::from_raw_parts_mut(panel, nb * B_TILE),
            std::slice::from_raw_parts_mut(panel.add(nb * B_TILE).cast::<f32>(), nb * T),
            std::slice::from_raw_parts_mut(panel.add(nb * (B_TILE + 4 * T)).cast::<f32>(), nb * T),
        )
    };
    for j in 0..T {
        for b in 0..nb {
            let (q, dj, mj) = if j < nr {
                // SAFETY: row `j < nr`, block `b < nb`: inside the caller's rows.
                unsafe { unpack_block::<F>(w.add(j * rb + b * bs)) }
            } else {
                ([0; QK], 0.0, 0.0)
            };
            d[b * T + j] = dj;
            m[b * T + j] = mj;
            let tile = &mut tiles[b * B_TILE..(b + 1) * B_TILE];
            for (k, quad) in q.chunks_exact(4).enumerate() {
                for (i, &v) in quad.iter().enumerate() {
                    tile[64 * k + 4 * j + i] = v as u8;
                }
            }
        }
    }
}

/// Two blocks' int32 sums (16 tokens × 16 rows each), 64-byte aligned.
#[repr(C, align(64))]
struct Sums([[i32; T * T]; 2]);

/// `c[t][r]` = the outputs of 16 tokens (`a`, `l.stride` apart) × the 16
/// rows of `panel`, over all blocks (see the module comment).
///
/// # Safety
/// The thread's tile configuration ([`TILES`]) must be loaded; `a`
/// must hold 16 tokens packed with `l`; `panel` one [`unpack_panel`]
/// output of `l.blocks` blocks; the CPU must have AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn tile<const F: u8>(l: &LegacyLayout, a: *const u8, panel: *const u8, sums: &mut Sums, c: &mut [[f32; T]; T]) {
    let nb = l.blocks;
    let mut acc = [_mm512_setzero_ps(); T];
    let s0 = sums.0[0].as_mut_ptr();
    let s1 = sums.0[1].as_mut_ptr();
    let (lda, ldb) = (l.stride, 64usize);
    let mut b = 0;
    while b + 1 < nb {
        // SAFETY: the caller's contract; tmm0/1 take the sums of blocks `b`
        // and `b + 1`, tmm2/3 the tokens' blocks, tmm4/5 the rows'; then
        // their shares.
        unsafe {
            let a2 = [a.add(b * QK), a.add((b + 1) * QK)];
            let b2 = [panel.add(b * B_TILE), panel.add((b + 1) * B_TILE)];
            dpbssd_pair(a2, lda, b2, ldb, [s0.cast(), s1.cast()], ldb);
            epilogue::<F>(&mut acc, l, a, panel, b, s0);
            epilogue::<F>(&mut acc, l, a, panel, b + 1, s1);
        }
        b += 2;
    }
    if b < nb {
        // SAFETY: as above, one block.
        unsafe {
            dpbssd(a.add(b * QK), lda, panel.add(b * B_TILE), ldb, s0.cast(), ldb);
            epilogue::<F>(&mut acc, l, a, panel, b, s0);
        }
    }
    for (ct, acc) in c.iter_mut().zip(acc) {
        // SAFETY: `ct` holds 16 f32.
        unsafe { _mm512_storeu_ps(ct.as_mut_ptr(), acc) };
    }
}

/// Block `b`'s share of 16 tokens × 16 rows from its sums `s`: each
/// token's row of sums times `dw · da`, plus `mw · s` for the formats with
/// a minimum.
///
/// # Safety
/// As for [`tile`]; `s` must hold 16 rows of 16 int32, 64-byte aligned.
/// Only called from [`tile`], into which it is inlined (so that the
/// accumulators stay in registers and the intrinsics see its AVX-512).
#[inline(always)]
unsafe fn epilogue<const F: u8>(
    acc: &mut [__m512; T],
    l: &LegacyLayout,
    a: *const u8,
    panel: *const u8,
    b: usize,
    s: *const i32,
) {
    let nb = l.blocks;
    // SAFETY: the offsets stay inside the activation rows and the panel,
    // per the caller's contract.
    unsafe {
        let dwv = _mm512_loadu_ps(panel.add(nb * B_TILE).cast::<f32>().add(b * T));
        let mwv = _mm512_loadu_ps(panel.add(nb * (B_TILE + 4 * T)).cast::<f32>().add(b * T));
        for (t, acc) in acc.iter_mut().enumerate() {
            let row = a.add(t * l.stride);
            let da = row.add(l.off_d + 4 * b).cast::<f32>().read();
            let ci = _mm512_cvtepi32_ps(_mm512_load_si512(s.add(t * T).cast()));
            *acc = _mm512_fmadd_ps(ci, _mm512_mul_ps(dwv, _mm512_set1_ps(da)), *acc);
            if fmt::has_min(F) {
                let sa = row.add(l.off_s + 4 * b).cast::<f32>().read();
                *acc = _mm512_fmadd_ps(mwv, _mm512_set1_ps(sa), *acc);
            }
        }
    }
}

/// What the prompt path computes for one output, in scalar code: the dot
/// of a weight row (`w`, `nb` blocks of `F`) with one token packed with
/// `l` (from [`quantize::pack_legacy`]). For the tests.
#[cfg(test)]
pub(super) fn reference_dot<const F: u8>(l: &LegacyLayout, w: &[u8], act: &[u8]) -> f32 {
    let bs = fmt::block_bytes(F);
    let mut acc = 0.0f32;
    for b in 0..l.blocks {
        // SAFETY: block `b` of the row is inside `w` (checked by the slice).
        let (q, dw, mw) = unsafe { unpack_block::<F>(w[b * bs..(b + 1) * bs].as_ptr()) };
        let qa = &act[b * QK..(b + 1) * QK];
        let isum: i32 = q.iter().zip(qa).map(|(&x, &y)| i32::from(x) * i32::from(y as i8)).sum();
        let f = |o: usize| f32::from_le_bytes(act[o..o + 4].try_into().expect("4 bytes"));
        let (da, sa) = (f(l.off_d + 4 * b), f(l.off_s + 4 * b));
        acc = (isum as f32).mul_add(dw * da, acc);
        if fmt::has_min(F) {
            acc = mw.mul_add(sa, acc);
        }
    }
    acc
}

/// `rows` random rows of `cols` weights of `F` for the tests: random
/// quants, scales of either sign in a realistic range.
#[cfg(test)]
pub(super) fn test_weights<const F: u8>(r: &mut rand::rngs::StdRng, rows: usize, cols: usize) -> Vec<u8> {
    use rand::Rng;
    let bs = fmt::block_bytes(F);
    let mut w: Vec<u8> = (0..rows * cols / QK * bs).map(|_| r.random()).collect();
    for block in w.chunks_exact_mut(bs) {
        let d = half::f16::from_f32(r.random_range(-0.05..0.05)).to_le_bytes();
        block[..2].copy_from_slice(&d);
        if fmt::has_min(F) {
            let m = half::f16::from_f32(r.random_range(-0.5..0.5)).to_le_bytes();
            block[2..4].copy_from_slice(&m);
        }
    }
    w
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::GgmlType;
    use crate::cpu::CpuFeatures;
    use crate::kernel::{ActType, MatmulCall, MatmulDesc};
    use crate::matmul::candidates;

    fn check<const F: u8>(ty: GgmlType, act: ActType) {
        let mut r = StdRng::seed_from_u64(u64::from(F) + 7);
        let pool = ThreadPool::new(2);
        for (rows, cols, n) in [(16, 32, 1), (45, 96, 17), (40, 576, 40), (7, 64, 3)] {
            let w = test_weights::<F>(&mut r, rows, cols);
            let x: Vec<f32> = (0..n * cols).map(|_| r.random_range(-2.0..2.0)).collect();
            let desc = MatmulDesc::dense(ty, act, rows, cols);
            let k = candidates(&desc, &CpuFeatures::detect()).into_iter().next().expect("a kernel");
            let run = |w: &[u8], x: &[f32], n: usize, rows: usize, prefill: bool| {
                let mut out = vec![f32::NAN; n * rows];
                let mut scratch = Vec::new();
                k.run(&pool, MatmulCall::dense(w, x, n, &mut out, &mut scratch).prefill(prefill)).expect("runs");
                out
            };
            let got = run(&w, &x, n, rows, true);
            let decode = run(&w, &x, n, rows, false);
            // Bit for bit the scalar model of the tile arithmetic.
            let l = LegacyLayout::new(cols, false, 0);
            let rb = w.len() / rows;
            let mut packed = vec![0u8; l.stride + 64];
            let off = packed.as_ptr().align_offset(64);
            for t in 0..n {
                quantize::pack_legacy(&l, &x[t * cols..(t + 1) * cols], &mut packed[off..off + l.stride]);
                for j in 0..rows {
                    let (g, dec) = (got[t * rows + j], decode[t * rows + j]);
                    if available() {
                        let want = reference_dot::<F>(&l, &w[j * rb..(j + 1) * rb], &packed[off..off + l.stride]);
                        assert_eq!(
                            g.to_bits(),
                            want.to_bits(),
                            "{ty} {rows}x{cols}, {n} tokens: out[{t}, {j}] = {g}, model {want}"
                        );
                    }
                    // Both paths round the same integer dots differently.
                    assert!((g - dec).abs() <= 1e-4 * (1.0 + dec.abs()), "{ty}: prompt path {g}, decode path {dec}");
                }
            }
            // A row's value does not depend on the other tokens or rows.
            let alone = run(&w[rb..2 * rb], &x[(n - 1) * cols..], 1, 1, true);
            assert_eq!(alone[0].to_bits(), got[(n - 1) * rows + 1].to_bits(), "{ty}: row 1 of the last token alone");
        }
    }

    #[test]
    fn prompt_path_matches_its_model_bit_for_bit() {
        if !available() {
            eprintln!("skipped the bit-exact check: AMX int8 is not granted here (the prompt path is the decode path)");
        }
        check::<{ fmt::Q4_0 }>(GgmlType::Q4_0, ActType::Q8_0);
        check::<{ fmt::Q4_1 }>(GgmlType::Q4_1, ActType::Q8_1);
        check::<{ fmt::Q5_0 }>(GgmlType::Q5_0, ActType::Q8_0);
        check::<{ fmt::Q5_1 }>(GgmlType::Q5_1, ActType::Q8_1);
        check::<{ fmt::Q8_0 }>(GgmlType::Q8_0, ActType::Q8_0);
    }
}
