//! SIMD matmul drivers (AVX2 and AVX-512): activation packing and the
//! tile loops over the [`crate::dot`] tile kernels.

use super::{Isa, Job, amx_int8, amx_rows, broadcast_work, for_each_job_tile, gemm_f32, pack_tokens, scratch_aligned};
use crate::GgmlType;
use crate::Result;
use crate::dot::avx512_k::{KQ4, KQ5, KQ6};
use crate::dot::f32simd::wt;
use crate::dot::{avx2, avx2_16, avx2_k, avx512, avx512_k, avx512_ymm, f32simd, fmt};
use crate::kernel::ActType;
use crate::pool::ThreadPool;
use crate::q16::{Q16Layout, pack_q16};
use crate::quantize::{self, KLayout, LegacyLayout};

/// Maximum tokens per tile.
const TMAX: usize = 4;

/// Expands to a `match` over the supported `(rows, tokens)` tile shapes,
/// calling `$($f)::+::<$($g,)* R, T>(args)`. Row tiles are `$rmax` or 1.
macro_rules! tiles {
    ($($f:ident)::+, [$($g:expr),*], $rmax:literal, $nr:expr, $nt:expr, ($($a:expr),*)) => {
        match ($nr, $nt) {
            ($rmax, 4) => $($f)::+::<$($g,)* $rmax, 4>($($a),*),
            ($rmax, 3) => $($f)::+::<$($g,)* $rmax, 3>($($a),*),
            ($rmax, 2) => $($f)::+::<$($g,)* $rmax, 2>($($a),*),
            ($rmax, 1) => $($f)::+::<$($g,)* $rmax, 1>($($a),*),
            (_, 4) => $($f)::+::<$($g,)* 1, 4>($($a),*),
            (_, 3) => $($f)::+::<$($g,)* 1, 3>($($a),*),
            (_, 2) => $($f)::+::<$($g,)* 1, 2>($($a),*),
            _ => $($f)::+::<$($g,)* 1, 1>($($a),*),
        }
    };
}

/// Runs `job` with the SIMD kernels of `isa` (the caller checked that the
/// CPU supports it).
pub(super) fn run(isa: Isa, pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) -> Result<()> {
    let d = job.desc;
    match d.act {
        ActType::F32 if gemm_f32::serves(job) => gemm_f32::run(isa, pool, job, scratch),
        ActType::F32 => run_precise(isa, pool, job),
        ActType::Q8_0 | ActType::Q8_1 => {
            let f = match d.wtype {
                GgmlType::Q4_0 => fmt::Q4_0,
                GgmlType::Q4_1 => fmt::Q4_1,
                GgmlType::Q5_0 => fmt::Q5_0,
                GgmlType::Q5_1 => fmt::Q5_1,
                _ => fmt::Q8_0,
            };
            match f {
                fmt::Q4_0 => run_legacy::<{ fmt::Q4_0 }>(isa, pool, job, scratch),
                fmt::Q4_1 => run_legacy::<{ fmt::Q4_1 }>(isa, pool, job, scratch),
                fmt::Q5_0 => run_legacy::<{ fmt::Q5_0 }>(isa, pool, job, scratch),
                fmt::Q5_1 => run_legacy::<{ fmt::Q5_1 }>(isa, pool, job, scratch),
                _ => run_legacy::<{ fmt::Q8_0 }>(isa, pool, job, scratch),
            }
        }
        ActType::Q16 => match d.wtype {
            GgmlType::Q4_0 => run_q16::<{ fmt::Q4_0 }>(pool, job, scratch),
            GgmlType::Q4_1 => run_q16::<{ fmt::Q4_1 }>(pool, job, scratch),
            GgmlType::Q5_0 => run_q16::<{ fmt::Q5_0 }>(pool, job, scratch),
            GgmlType::Q5_1 => run_q16::<{ fmt::Q5_1 }>(pool, job, scratch),
            _ => run_q16::<{ fmt::Q8_0 }>(pool, job, scratch),
        },
        ActType::Q8_K => match d.wtype {
            GgmlType::Q4_K => run_k::<KQ4>(isa, pool, job, scratch),
            GgmlType::Q5_K => run_k::<KQ5>(isa, pool, job, scratch),
            _ => run_k::<KQ6>(isa, pool, job, scratch),
        },
    }
    Ok(())
}

/// Weight rows per tile of the 512-bit legacy kernels. Four rows share
/// each activation load, but four interleaved streams read long rows from
/// memory slower than one row at a time; so dense decode-sized batches (up
/// to `TMAX` tokens) of the nibble formats take one row at a time above 640
/// columns, while Q8_0 and gathered rows (prefetched ahead,
/// `for_each_job_tile`) keep four-row tiles. Measurements:
/// docs/benchmarks.md, "Design measurements cited by the code".
fn nibble_rows(f: u8, job: &Job<'_>) -> usize {
    let dense_decode = job.idx.is_none() && job.n_tokens <= TMAX;
    if f != fmt::Q8_0 && job.desc.cols > 640 && dense_decode { 1 } else { 4 }
}

fn run_legacy<const F: u8>(isa: Isa, pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) {
    // On AMX int8 tiles where the OS grants them: a prompt's tokens with
    // the tokens as the tiles' rows, anything else (decode rows, gathered
    // rows) with the weights as the tiles' rows. Both compute every output
    // in the same order (bit for bit the same).
    if isa == Isa::Avx512 && amx_int8::available() {
        if job.prefill && job.idx.is_none() {
            amx_int8::run::<F>(pool, job, scratch);
        } else {
            amx_rows::run::<F>(pool, job, scratch);
        }
        return;
    }
    let d = job.desc;
    let avx512 = isa == Isa::Avx512;
    // On Zen 4 the 256-bit VNNI kernel is faster for Q8_0 (no cross-lane
    // shuffles in the inner loop), the 512-bit pair kernel for the nibble
    // formats.
    let ymm = avx512 && F == fmt::Q8_0;
    // The AVX2 Q8_0 kernel uses the sign trick and needs no corrections.
    let offset = if !avx512 && F == fmt::Q8_0 { 0 } else { fmt::offset(F) };
    let l = LegacyLayout::new(d.cols, avx512 && !ymm, offset);
    let buf = scratch_aligned(scratch, l.stride * job.n_tokens);
    pack_tokens(pool, job.x, d.cols, job.n_tokens, buf, l.stride, &|x, dst| {
        quantize::pack_legacy(&l, x, dst);
    });
    let act = buf.as_ptr() as usize;
    let (w, rb, rows) = (job.w.as_ptr() as usize, job.row_bytes, job.out_rows());
    let out = job.out;
    let rmax = if avx512 { nibble_rows(F, job) } else { 2 };
    broadcast_work(pool, job.macs(), &|ti, nt| {
        let (w, act) = (w as *const u8, act as *const u8);
        let tile = |r: usize, wr: usize, nr: usize, t: usize, ntk: usize| {
            let (wp, ap, op) =
                (w.wrapping_add(wr * rb), act.wrapping_add(t * l.stride), out.get().wrapping_add(t * rows + r));
            // SAFETY: the CPU supports `isa` (checked by `candidates`);
            // weight rows `wr..wr + nr`, output rows `r..r + nr` and tokens
            // `t..t + ntk` are inside the validated weight, packed-activation
            // and output buffers; this thread owns the output rows.
            unsafe {
                if ymm {
                    tiles!(avx512_ymm::q8_0_tile, [], 4, nr, ntk, (wp, rb, &l, ap, op, rows));
                } else if avx512 {
                    let wp = avx512::Strided { w: wp, row_bytes: rb };
                    tiles!(avx512::legacy_tile, [F], 4, nr, ntk, (wp, &l, ap, op, rows));
                } else {
                    tiles!(avx2::legacy_tile, [F], 2, nr, ntk, (wp, rb, &l, ap, op, rows));
                }
            }
        };
        // The 512-bit nibble kernel also takes four scattered rows.
        let mut scattered = |r: usize, wr: [usize; 4], t: usize, ntk: usize| {
            let (w, ap, op) = (
                wr.map(|i| w.wrapping_add(i * rb)),
                act.wrapping_add(t * l.stride),
                out.get().wrapping_add(t * rows + r),
            );
            // SAFETY: as for `tile`, with weight rows `wr`; only used when
            // `avx512 && !ymm`.
            unsafe {
                match ntk {
                    4 => avx512::legacy_tile::<F, 4, 4>(w, &l, ap, op, rows),
                    3 => avx512::legacy_tile::<F, 4, 3>(w, &l, ap, op, rows),
                    2 => avx512::legacy_tile::<F, 4, 2>(w, &l, ap, op, rows),
                    _ => avx512::legacy_tile::<F, 4, 1>(w, &l, ap, op, rows),
                }
            }
        };
        let scattered: Option<&mut dyn FnMut(_, _, _, _)> = if avx512 && !ymm { Some(&mut scattered) } else { None };
        for_each_job_tile(job, ti, nt, rmax, TMAX, tile, scattered);
    });
}

/// Fast mode's one 16-bit activation plane, AVX2 only (`simd_supported`):
/// up to [`TMAX`] tokens in one register tile ([`avx2_16::q16_tile`]);
/// more, up to [`avx2_16::Q16_TOKENS`] at a time, through
/// [`avx2_16::q16_rows`], which widens each weight block once for all of
/// them. Both give the same bits (`kernels_simd.rs`).
fn run_q16<const F: u8>(pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) {
    let l = Q16Layout::new(job.desc.cols);
    let buf = scratch_aligned(scratch, l.stride * job.n_tokens);
    pack_tokens(pool, job.x, job.desc.cols, job.n_tokens, buf, l.stride, &|x, dst| pack_q16(&l, x, dst));
    let act = buf.as_ptr() as usize;
    let (w, rb, rows) = (job.w.as_ptr() as usize, job.row_bytes, job.out_rows());
    let out = job.out;
    broadcast_work(pool, job.macs(), &|ti, nt| {
        let (w, act) = (w as *const u8, act as *const u8);
        let tile = |r: usize, wr: usize, nr: usize, t: usize, ntk: usize| {
            let (wp, ap, op) =
                (w.wrapping_add(wr * rb), act.wrapping_add(t * l.stride), out.get().wrapping_add(t * rows + r));
            // SAFETY: as in `run_legacy`.
            unsafe {
                if ntk <= TMAX {
                    tiles!(avx2_16::q16_tile, [F], 2, nr, ntk, (wp, rb, &l, ap, op, rows));
                } else if nr == 2 {
                    avx2_16::q16_rows::<F, 2>(wp, rb, &l, ap, ntk, op, rows);
                } else {
                    avx2_16::q16_rows::<F, 1>(wp, rb, &l, ap, ntk, op, rows);
                }
            }
        };
        for_each_job_tile(job, ti, nt, 2, avx2_16::Q16_TOKENS, tile, None);
    });
}

fn run_k<const K: u8>(isa: Isa, pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) {
    let d = job.desc;
    let l = KLayout::new(d.cols);
    let buf = scratch_aligned(scratch, l.stride * job.n_tokens);
    pack_tokens(pool, job.x, d.cols, job.n_tokens, buf, l.stride, &|x, dst| {
        quantize::pack_k(&l, x, dst);
    });
    let act = buf.as_ptr() as usize;
    let (w, rb, rows) = (job.w.as_ptr() as usize, job.row_bytes, job.out_rows());
    let out = job.out;
    let avx512 = isa == Isa::Avx512;
    broadcast_work(pool, job.macs(), &|ti, nt| {
        let (w, act) = (w as *const u8, act as *const u8);
        let tile = |r: usize, wr: usize, nr: usize, t: usize, ntk: usize| {
            let (wp, ap, op) =
                (w.wrapping_add(wr * rb), act.wrapping_add(t * l.stride), out.get().wrapping_add(t * rows + r));
            // SAFETY: as in `run_legacy`.
            unsafe {
                if avx512 {
                    tiles!(avx512_k::k_tile, [K], 2, nr, ntk, (wp, rb, &l, ap, op, rows));
                } else {
                    tiles!(avx2_k::k_tile, [K], 2, nr, ntk, (wp, rb, &l, ap, op, rows));
                }
            }
        };
        for_each_job_tile(job, ti, nt, 2, TMAX, tile, None);
    });
}

fn run_precise(isa: Isa, pool: &ThreadPool, job: &Job<'_>) {
    match job.desc.wtype {
        GgmlType::F32 => precise::<{ wt::F32 }>(isa, pool, job),
        GgmlType::F16 => precise::<{ wt::F16 }>(isa, pool, job),
        GgmlType::BF16 => precise::<{ wt::BF16 }>(isa, pool, job),
        GgmlType::Q4_0 => precise::<{ wt::Q4_0 }>(isa, pool, job),
        GgmlType::Q4_1 => precise::<{ wt::Q4_1 }>(isa, pool, job),
        GgmlType::Q8_0 => precise::<{ wt::Q8_0 }>(isa, pool, job),
        _ => precise::<{ wt::OTHER }>(isa, pool, job),
    }
}

fn precise<const W: u8>(isa: Isa, pool: &ThreadPool, job: &Job<'_>) {
    let d = job.desc;
    let ty = d.wtype;
    let (w, rb, rows, cols) = (job.w.as_ptr() as usize, job.row_bytes, job.out_rows(), d.cols);
    let x = job.x.as_ptr() as usize;
    let out = job.out;
    let avx512 = isa == Isa::Avx512;
    broadcast_work(pool, job.macs(), &|ti, nt| {
        let (w, x) = (w as *const u8, x as *const f32);
        // Rows per tile: AVX-512 has the registers for 4.
        let rmax = if avx512 { 4 } else { 2 };
        let tile = |r: usize, wr: usize, nr: usize, t: usize, ntk: usize| {
            let (wp, xp, op) =
                (w.wrapping_add(wr * rb), x.wrapping_add(t * cols), out.get().wrapping_add(t * rows + r));
            // SAFETY: as in `run_legacy`; `x` holds `n * cols` floats.
            unsafe {
                if avx512 {
                    tiles!(f32simd::tile_avx512, [W], 4, nr, ntk, (ty, wp, rb, cols, xp, cols, op, rows));
                } else {
                    tiles!(f32simd::tile_avx2, [W], 2, nr, ntk, (ty, wp, rb, cols, xp, cols, op, rows));
                }
            }
        };
        for_each_job_tile(job, ti, nt, rmax, TMAX, tile, None);
    });
}
