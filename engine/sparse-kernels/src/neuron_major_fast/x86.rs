//! The AVX-512 VNNI form of the integer AXPY (`axpy_fast`): runs of
//! active neurons in tiles of output groups, two int8 coefficient planes.

use std::arch::x86_64::*;

use super::super::{GROUP, NeuronMajor};
use super::{FastCoefs, Run};
use crate::x86::prefetch_tile;
use spinfer_kernels::GgmlType;
use spinfer_kernels::pool::chunk;

/// How far past the current run, in active neurons, the rows are
/// prefetched (their order is data-dependent, so the hardware
/// prefetchers cannot follow).
const AHEAD: usize = 32;

/// Most groups of 32 outputs per tile (`2 G` int32 sums per plane + `2
/// G` f32 accumulators).
const MAX_G: usize = 4;

/// Raw view of a [`NeuronMajor`] for one tile of output groups.
struct View {
    codes: *const u8,
    d: *const u16,
    /// Null without a minimum.
    m: *const u16,
    int8: bool,
    stride: usize,
    opad: usize,
    /// First output of the tile (a multiple of 32).
    off: usize,
    /// Byte offset and length of the tile's codes in a neuron's row.
    coff: usize,
    clen: usize,
}

impl View {
    fn new(nm: &NeuronMajor, off: usize, groups: usize) -> Self {
        let int8 = nm.wtype == GgmlType::Q8_0;
        let m = if nm.has_min { nm.m.as_ptr().cast() } else { std::ptr::null() };
        let (coff, clen) = if int8 { (off, 32 * groups) } else { (off / 2, 16 * groups) };
        View {
            codes: nm.codes.as_ptr(),
            d: nm.d.as_ptr().cast(),
            m,
            int8,
            stride: nm.stride,
            opad: nm.opad,
            off,
            coff,
            clen,
        }
    }
}

/// `vpermt2b` indices over `x = [row0 32 B | row1 32 B]`, `y = [row2 |
/// row3]`: dword `e` = bytes `16 half + e` of rows 0, 1, 2, 3.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
fn perm_idx(half: u8) -> __m512i {
    let mut b = [0u8; 64];
    for e in 0..16u8 {
        let s = 16 * half + e;
        let at = 4 * usize::from(e);
        b[at..at + 4].copy_from_slice(&[s, 32 + s, 64 + s, 96 + s]);
    }
    // SAFETY: `b` holds 64 bytes; unaligned load.
    unsafe { _mm512_loadu_si512(b.as_ptr().cast()) }
}

/// `(x, y)` = 32 bytes at `at` of rows 0, 1 and of rows 2, 3.
///
/// # Safety
/// AVX-512F; `rows[j] + at .. + 32` readable for every `j`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn load_unit(rows: &[*const u8; 4], at: usize) -> (__m512i, __m512i) {
    // SAFETY: the caller guarantees the 32 bytes of every row.
    unsafe {
        let l = |j: usize| _mm256_loadu_si256(rows[j].add(at).cast());
        (
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(l(0)), l(1)),
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(l(2)), l(3)),
        )
    }
}

/// As [`load_unit`] with 16 bytes per row (bytes 16..32 of each half
/// are zero).
///
/// # Safety
/// AVX-512F; `rows[j] + at .. + 16` readable for every `j`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn load_half(rows: &[*const u8; 4], at: usize) -> (__m512i, __m512i) {
    // SAFETY: the caller guarantees the 16 bytes of every row.
    unsafe {
        let l = |j: usize| _mm256_zextsi128_si256(_mm_loadu_si128(rows[j].add(at).cast()));
        (
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(l(0)), l(1)),
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(l(2)), l(3)),
        )
    }
}

/// What the int32 sums of the high half of each group (odd vectors)
/// hold, in units of the codes: 16 for nibbles (the high nibbles are
/// taken in place, `byte & 0xF0` = 16 × nibble, saving a shift), 1 for
/// Q8_0.
#[inline(always)]
fn hi_scale(int8: bool) -> i32 {
    if int8 { 1 } else { 16 }
}

/// The preloaded int32 sums of one run: `init` in the low halves (even
/// vectors), `init · hi_scale` in the high ones.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
fn preload<const V: usize>(init: i32, int8: bool) -> [__m512i; V] {
    let (even, odd) = (_mm512_set1_epi32(init), _mm512_set1_epi32(init * hi_scale(int8)));
    std::array::from_fn(|i| if i % 2 == 0 { even } else { odd })
}

/// The four rows of quad `q`, at the tile's offset.
///
/// # Safety
/// `fc` built from indices `< neurons` of the copy `v` views.
#[inline(always)]
unsafe fn quad_rows(v: &View, fc: &FastCoefs, q: usize) -> [*const u8; 4] {
    // SAFETY: every `rows` entry is an active (validated) neuron `<
    // neurons`, so its row of `stride` bytes lies inside `codes`, and
    // `coff + clen <= stride`.
    std::array::from_fn(|j| unsafe { v.codes.add(fc.rows[4 * q + j] as usize * v.stride + v.coff) })
}

/// The int32 sums of one run for a tile of `G` groups of 4-bit codes:
/// the main plane and the residual plane. Vector `2 g` holds outputs
/// `32 g .. 32 g + 16` of the tile (low nibbles), `2 g + 1` the next 16
/// (high nibbles, × 16). One loop per code width, every index a
/// constant after unrolling, so that the `4 G` accumulators stay in
/// registers (a shared loop with a run-time width spilled them).
///
/// # Safety
/// As [`tile_run`], for a nibble copy.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn sums_nibbles<const G: usize, const V: usize>(
    v: &View,
    fc: &FastCoefs,
    run: &Run,
) -> ([__m512i; V], [__m512i; V]) {
    let (p0, p1) = (perm_idx(0), perm_idx(1));
    let low = _mm512_set1_epi8(0x0F);
    let (mut s, mut t) = (preload::<V>(run.init, false), preload::<V>(run.init_lo, false));
    for q in run.q0..run.q1 {
        let (cq, cl) = (_mm512_set1_epi32(fc.quads[q]), _mm512_set1_epi32(fc.quads_lo[q]));
        // SAFETY: as this function's contract.
        let rp = unsafe { quad_rows(v, fc, q) };
        // Unit `u`: 32 bytes of each row = 64 outputs = groups 2u, 2u+1
        // (the last one 16 bytes when G is odd).
        for u in 0..G.div_ceil(2) {
            let whole = 2 * u + 1 < G;
            // SAFETY: bytes `32 u .. 32 u + 32` (or `+ 16` for a half
            // unit) `<= 16 G = clen` of each row.
            let (x, y) = unsafe { if whole { load_unit(&rp, 32 * u) } else { load_half(&rp, 32 * u) } };
            for h in 0..if whole { 2 } else { 1 } {
                let p = _mm512_permutex2var_epi8(x, if h == 0 { p0 } else { p1 }, y);
                let (lo, hi) = (_mm512_and_si512(p, low), _mm512_andnot_si512(low, p));
                let i = 4 * u + 2 * h;
                s[i] = _mm512_dpbusd_epi32(s[i], lo, cq);
                s[i + 1] = _mm512_dpbusd_epi32(s[i + 1], hi, cq);
                t[i] = _mm512_dpbusd_epi32(t[i], lo, cl);
                t[i + 1] = _mm512_dpbusd_epi32(t[i + 1], hi, cl);
            }
        }
    }
    (s, t)
}

/// As [`sums_nibbles`] for Q8_0 codes (flipped to `q + 128`): vector
/// `2 g` holds outputs `32 g .. 32 g + 16`, `2 g + 1` the next 16.
///
/// # Safety
/// As [`tile_run`], for a Q8_0 copy.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn sums_q8<const G: usize, const V: usize>(v: &View, fc: &FastCoefs, run: &Run) -> ([__m512i; V], [__m512i; V]) {
    let (p0, p1) = (perm_idx(0), perm_idx(1));
    let flip = _mm512_set1_epi8(0x80u8 as i8);
    let (mut s, mut t) = (preload::<V>(run.init, true), preload::<V>(run.init_lo, true));
    for q in run.q0..run.q1 {
        let (cq, cl) = (_mm512_set1_epi32(fc.quads[q]), _mm512_set1_epi32(fc.quads_lo[q]));
        // SAFETY: as this function's contract.
        let rp = unsafe { quad_rows(v, fc, q) };
        for g in 0..G {
            // SAFETY: bytes `32 g .. 32 g + 32 <= clen` of each row.
            let (x, y) = unsafe { load_unit(&rp, 32 * g) };
            let (x, y) = (_mm512_xor_si512(x, flip), _mm512_xor_si512(y, flip));
            let a = _mm512_permutex2var_epi8(x, p0, y);
            let b = _mm512_permutex2var_epi8(x, p1, y);
            s[2 * g] = _mm512_dpbusd_epi32(s[2 * g], a, cq);
            s[2 * g + 1] = _mm512_dpbusd_epi32(s[2 * g + 1], b, cq);
            t[2 * g] = _mm512_dpbusd_epi32(t[2 * g], a, cl);
            t[2 * g + 1] = _mm512_dpbusd_epi32(t[2 * g + 1], b, cl);
        }
    }
    (s, t)
}

/// Adds run `run` to `G` groups of 32 outputs (`V = 2 G` vectors from
/// `v.off`), whose accumulators are the `32 G` floats at `acc`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI/VBMI, AVX2, FMA, F16C; `fc` built from indices
/// `< neurons`, `run` one of its runs; `v.off + 32 G <= opad`; `acc`
/// valid for `32 G` floats.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn tile_run<const G: usize, const V: usize>(v: &View, fc: &FastCoefs, run: &Run, acc: *mut f32) {
    debug_assert_eq!(V, 2 * G);
    // SAFETY: as this function's contract.
    let (s, t) = unsafe { if v.int8 { sums_q8::<G, V>(v, fc, run) } else { sums_nibbles::<G, V>(v, fc, run) } };
    let sc = _mm512_set1_ps(run.scale);
    let hv = _mm512_set1_ps(run.h);
    // SAFETY: block `run.block < neurons / 32`, so the `32 G` f16 at
    // `block * opad + off` (`off + 32 G <= opad`) lie inside `d` (and
    // `m`, when not null); `acc` holds `32 G = 16 V` floats.
    unsafe {
        let dp = v.d.add(run.block * v.opad + v.off);
        let mp = v.m.wrapping_add(run.block * v.opad + v.off);
        for (i, (s, t)) in s.iter().zip(&t).enumerate() {
            let mut a = _mm512_loadu_ps(acc.add(16 * i));
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(dp.add(16 * i).cast()));
            // Both planes: S + T / 128 (one rounding, as the scalar).
            let mut f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*t), _mm512_set1_ps(1.0 / 128.0), _mm512_cvtepi32_ps(*s));
            if i % 2 == 1 && !v.int8 {
                // Exact: `f` is 16 × what the scalar rounds (a power
                // of two commutes with the rounding).
                f = _mm512_mul_ps(f, _mm512_set1_ps(1.0 / 16.0));
            }
            a = _mm512_fmadd_ps(d, _mm512_mul_ps(f, sc), a);
            if !v.m.is_null() {
                let m = _mm512_cvtph_ps(_mm256_loadu_si256(mp.add(16 * i).cast()));
                a = _mm512_fmadd_ps(m, hv, a);
            }
            _mm512_storeu_ps(acc.add(16 * i), a);
        }
    }
}

/// Int8 AVX-512 implementation for outputs `o0 .. o0 + out.len()`
/// summed over `runs`: run by run, and within a run in tiles of up to
/// [`MAX_G`] groups of 32 outputs, so that the run's rows are read from
/// memory once (by the first tile) and stay in L1 for the other tiles.
/// Before each run, the slice's bytes of the rows up to [`AHEAD`]
/// neurons past it are prefetched, outside the inner loops. Per output
/// the runs are still added in order, so the loop order changes no bit.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI/VBMI, AVX2, FMA, F16C; `o0` a multiple of 32,
/// `o0 + out.len() <= outputs`, `fc` built from indices `< neurons`,
/// `runs` some of its runs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
pub(super) unsafe fn axpy_fast_avx512(nm: &NeuronMajor, o0: usize, fc: &FastCoefs, runs: &[Run], out: &mut [f32]) {
    let ng = out.len().div_ceil(GROUP);
    let tiles = ng.div_ceil(MAX_G);
    // `o0 + 32 ng <= opad`: both are multiples of 32 and the slice ends
    // inside the padded row.
    let whole = View::new(nm, o0, ng);
    // The accumulators: `out` itself when it is whole groups.
    let mut padded = Vec::new();
    let acc: &mut [f32] = if out.len() == GROUP * ng {
        out.fill(0.0);
        &mut *out
    } else {
        padded.resize(GROUP * ng, 0.0);
        &mut padded
    };
    // The next row slot (of `fc.rows`) not yet prefetched.
    let mut pf = runs.first().map_or(0, |r| 4 * r.q0);
    for run in runs {
        let ahead = (4 * run.q1 + AHEAD).min(fc.rows.len());
        while pf < ahead {
            prefetch_tile(whole.codes, whole.stride, whole.coff, whole.clen, &fc.rows, pf);
            pf += 1;
        }
        for ti in 0..tiles {
            let g = chunk(ng, ti, tiles);
            let v = View::new(nm, o0 + GROUP * g.start, g.len());
            // SAFETY: the tile's groups `g` are inside the `ng` groups of
            // `acc`; codes and scales are in range as argued above and by
            // the caller.
            unsafe {
                let a = acc.as_mut_ptr().add(GROUP * g.start);
                match g.len() {
                    4 => tile_run::<4, 8>(&v, fc, run, a),
                    3 => tile_run::<3, 6>(&v, fc, run, a),
                    2 => tile_run::<2, 4>(&v, fc, run, a),
                    _ => tile_run::<1, 2>(&v, fc, run, a),
                }
            }
        }
    }
    if !padded.is_empty() {
        let n = out.len();
        out.copy_from_slice(&padded[..n]);
    }
}
