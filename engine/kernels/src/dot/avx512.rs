//! AVX-512 (F/BW/VL/VNNI) tile kernels for the 4- and 5-bit 32-element
//! formats in fast mode: Q4_0, Q5_0 × Q8_0 and Q4_1, Q5_1 × Q8_1 (Q8_0
//! weights use [`super::avx512_ymm`]).
//!
//! One step handles a *pair* of blocks (64 weights) per row with a single
//! `vpdpbusd` against the pair-interleaved activation layout
//! ([`LegacyLayout`] with `interleaved = true`). Weights are made unsigned
//! (`q`); the offsets `- 8` (Q4_0) and `- 16` (Q5_0)
//! are applied exactly through the activations' `corr` lanes, which seed
//! the integer accumulator. The per-block scales of 16 blocks are pulled
//! out at once (`vpermt2w` + `vcvtph2ps`), multiplied by the activation scales,
//! and each pair's lane scales come from one `vpermps`. Minimums
//! (`m * s`) of Q4_1/Q5_1 are accumulated 16 blocks at a time. The block
//! scale extraction ([`load_heads`]) is shared with the Q8_0 kernel.
//!
//! A tile is `R` weight rows × `T` tokens: every weight pair is unpacked
//! once and dotted with all `T` tokens (prefill is matrix-matrix work).

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;

use super::fmt;
use crate::quantize::LegacyLayout;

/// `vpermps` indices for pair `p` of a 16-block group: lanes 0-3 and 8-11
/// belong to block `2p`, lanes 4-7 and 12-15 to block `2p + 1`.
#[repr(C, align(64))]
struct PairIdx([[i32; 16]; 8]);

static PAIR_IDX: PairIdx = {
    let mut t = [[0i32; 16]; 8];
    let mut p = 0;
    while p < 8 {
        let mut l = 0;
        while l < 16 {
            t[p][l] = (2 * p + (l / 4) % 2) as i32;
            l += 1;
        }
        p += 1;
    }
    PairIdx(t)
};

/// Word-permute tables that pull the f16 `d` (and `m`) of 16 consecutive
/// blocks out of the group's bytes: output word `k` is block `k`'s `d`,
/// word `16 + k` its `m`. Window `j` covers bytes `128j..128j + 128` (two
/// registers) for one `vpermt2w`.
#[repr(C, align(64))]
struct HeadIdx {
    idx: [[i16; 32]; 5],
    mask: [u32; 5],
    windows: usize,
}

const fn head_idx(bs: usize, has_min: bool) -> HeadIdx {
    let mut t = HeadIdx { idx: [[0; 32]; 5], mask: [0; 5], windows: 0 };
    let mut lane = 0;
    while lane < 32 {
        let (k, which) = (lane % 16, lane / 16);
        if which == 0 || has_min {
            let src = k * bs / 2 + which;
            let win = src / 64;
            t.idx[win][lane] = (src - 64 * win) as i16;
            t.mask[win] |= 1 << lane;
            if win + 1 > t.windows {
                t.windows = win + 1;
            }
        }
        lane += 1;
    }
    t
}

/// Indexed by the `fmt` tag.
static HEADS: [HeadIdx; 5] = [
    head_idx(fmt::block_bytes(fmt::Q4_0), false),
    head_idx(fmt::block_bytes(fmt::Q4_1), true),
    head_idx(fmt::block_bytes(fmt::Q5_0), false),
    head_idx(fmt::block_bytes(fmt::Q5_1), true),
    head_idx(fmt::block_bytes(fmt::Q8_0), false),
];

/// Loads bytes `off..off + 64` of a `len`-byte region at `p`, zero past
/// `len` (masked: nothing past `len` is read).
///
/// # Safety
/// `p..p + len` must be readable.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn load_upto(p: *const u8, off: usize, len: usize) -> __m512i {
    if off >= len {
        return _mm512_setzero_si512();
    }
    let m: __mmask64 = if len - off >= 64 { !0 } else { (1u64 << (len - off)) - 1 };
    // SAFETY: only bytes below `len` are enabled in the mask.
    unsafe { _mm512_maskz_loadu_epi8(m, p.add(off).cast()) }
}

/// The f16 scales of blocks `0..gn` (`gn <= 16`) at `p`: words `0..16` are
/// the `d`s, words `16..32` the `m`s (formats with a minimum); lanes of
/// missing blocks are zero. Two 64-byte loads and one `vpermt2w` per
/// 128 bytes, instead of a (slow) gather.
///
/// # Safety
/// `p` must point at `gn` readable blocks of `F`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(crate) unsafe fn load_heads<const F: u8>(p: *const u8, gn: usize) -> __m512i {
    let tab = &HEADS[F as usize];
    let len = gn * fmt::block_bytes(F);
    let mut out = _mm512_setzero_si512();
    for j in 0..tab.windows {
        // SAFETY: `load_upto` reads only below `len`; the table row is a
        // 64-byte aligned [i16; 32].
        unsafe {
            let z0 = load_upto(p, 128 * j, len);
            let z1 = load_upto(p, 128 * j + 64, len);
            let idx = _mm512_load_si512(tab.idx[j].as_ptr().cast());
            out = _mm512_or_si512(out, _mm512_maskz_permutex2var_epi16(tab.mask[j], z0, idx, z1));
        }
    }
    out
}

/// Loads the 64 weights of blocks `b` and `b + 1` (at `p`) as unsigned
/// bytes in pair-interleaved order (Q4_0, Q4_1, Q5_0, Q5_1). With
/// `has_b == false` only block `b` is read and the second block's lanes are
/// zero.
///
/// # Safety
/// `p` must point at one readable block (two if `has_b`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn unpack_pair<const F: u8>(p: *const u8, has_b: bool) -> __m512i {
    let bs = fmt::block_bytes(F);
    let (qo, ho) = match F {
        fmt::Q4_0 => (2, 0),
        fmt::Q4_1 => (4, 0),
        fmt::Q5_0 => (6, 2),
        _ => (8, 4),
    };
    // SAFETY: `qo + 16 <= bs`; the caller guarantees the blocks.
    let (a, b) = unsafe {
        let a = _mm_loadu_si128(p.add(qo).cast());
        let b = if has_b { _mm_loadu_si128(p.add(bs + qo).cast()) } else { _mm_setzero_si128() };
        (a, b)
    };
    let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b);
    let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
    let w = _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
    if ho == 0 {
        return w;
    }
    // SAFETY: `qh` is 4 bytes at `ho` inside each block.
    let (ha, hb) = unsafe {
        let ha = u64::from(p.add(ho).cast::<u32>().read_unaligned());
        let hb = if has_b { u64::from(p.add(bs + ho).cast::<u32>().read_unaligned()) } else { 0 };
        (ha, hb)
    };
    let m = (ha & 0xFFFF) | ((hb & 0xFFFF) << 16) | ((ha >> 16) << 32) | ((hb >> 16) << 48);
    _mm512_mask_add_epi8(w, m, w, _mm512_set1_epi8(16))
}

/// Where the rows of a tile are: one base and a stride (a dense matrix),
/// or one pointer per row (gathered rows, `[*const u8; R]`). The tile is
/// monomorphised for each, so the dense tile addresses its rows as a plain
/// base-plus-stride kernel would.
pub(crate) trait RowAddr: Copy {
    /// The start of row `r`.
    fn row(self, r: usize) -> *const u8;
}

/// Rows `row_bytes` apart from `w`.
#[derive(Clone, Copy)]
pub(crate) struct Strided {
    pub w: *const u8,
    pub row_bytes: usize,
}

impl RowAddr for Strided {
    #[inline(always)]
    fn row(self, r: usize) -> *const u8 {
        self.w.wrapping_add(r * self.row_bytes)
    }
}

impl<const R: usize> RowAddr for [*const u8; R] {
    #[inline(always)]
    fn row(self, r: usize) -> *const u8 {
        self[r]
    }
}

/// Dots `R` weight rows with `T` packed activation rows.
///
/// `w` locates the rows ([`Strided`] for a matrix, one pointer per row for
/// gathered rows, computed exactly alike), `act` points at the first
/// token's packed activations (`l.stride` apart, 64-byte aligned), and
/// `out[t * out_stride + r]` receives the results.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, F16C and FMA; each
/// `w.row(r)`, `r < R`, must hold a row of `l.blocks` blocks of `F`; `act`
/// must hold `T` tokens packed with layout `l` (interleaved, `offset ==
/// fmt::offset(F)`); `out` must be valid for the `R * T` writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn legacy_tile<const F: u8, const R: usize, const T: usize>(
    w: impl RowAddr,
    l: &LegacyLayout,
    act: *const u8,
    out: *mut f32,
    out_stride: usize,
) {
    debug_assert!(F != fmt::Q8_0, "Q8_0 weights use avx512_ymm::q8_0_tile");
    let bs = fmt::block_bytes(F);
    let nb = l.blocks;
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut sc = [[_mm512_setzero_ps(); T]; R];
    let mut wv = [_mm512_setzero_si512(); R];

    // One pair step: unpack R rows, dot with T tokens.
    macro_rules! pair {
        ($pair:expr, $p_in_group:expr, $has_b:expr) => {{
            let pair: usize = $pair;
            // SAFETY: `PAIR_IDX.0[p]` is a 64-byte aligned [i32; 16].
            let idx = unsafe { _mm512_load_si512(PAIR_IDX.0[$p_in_group].as_ptr().cast()) };
            for r in 0..R {
                // SAFETY: block `2 * pair` (and `+ 1` if `has_b`) of row `r`
                // is inside the `R` rows the caller vouched for.
                wv[r] = unsafe { unpack_pair::<F>(w.row(r).add(2 * pair * bs), $has_b) };
            }
            for t in 0..T {
                // SAFETY: token `t`'s `qs` has `pairs * 64` bytes and `corr`
                // `pairs * 16` i32, 64-byte aligned.
                let (xv, init) = unsafe {
                    let xa = act.add(t * l.stride);
                    let xv = _mm512_load_si512(xa.add(pair * 64).cast());
                    let init = if fmt::offset(F) != 0 {
                        _mm512_load_si512(xa.add(l.off_corr + pair * 64).cast())
                    } else {
                        _mm512_setzero_si512()
                    };
                    (xv, init)
                };
                for r in 0..R {
                    let d = _mm512_dpbusd_epi32(init, wv[r], xv);
                    let s = _mm512_permutexvar_ps(idx, sc[r][t]);
                    acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[r][t]);
                }
            }
        }};
    }

    // One group of up to 16 blocks: scales, then the pairs. Full groups
    // use the literal 16 so that loads and loop bounds are constants.
    macro_rules! group {
        ($g:expr, $gn:expr) => {{
            let g: usize = $g;
            let gn: usize = $gn;
            let b0 = g * 16;
            for r in 0..R {
                // SAFETY: blocks `b0..b0 + gn` of row `r` are readable.
                let heads = unsafe { load_heads::<F>(w.row(r).add(b0 * bs), gn) };
                let dw = _mm512_cvtph_ps(_mm512_castsi512_si256(heads));
                for t in 0..T {
                    let off = t * l.stride + l.off_d + b0 * 4;
                    // SAFETY: `d` has `groups * 16` f32 per token, aligned.
                    let xd = unsafe { _mm512_load_ps(act.add(off).cast()) };
                    sc[r][t] = _mm512_mul_ps(dw, xd);
                }
                if fmt::has_min(F) {
                    let mw = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(heads));
                    for t in 0..T {
                        // SAFETY: `s` has `groups * 16` f32 per token, aligned.
                        let xs = unsafe { _mm512_load_ps(act.add(t * l.stride + l.off_s + b0 * 4).cast()) };
                        acc[r][t] = _mm512_fmadd_ps(mw, xs, acc[r][t]);
                    }
                }
            }
            let full = gn / 2;
            for p in 0..full {
                pair!(g * 8 + p, p, true);
            }
            if gn % 2 == 1 {
                pair!(g * 8 + full, full, false);
            }
        }};
    }

    let full_groups = nb / 16;
    for g in 0..full_groups {
        group!(g, 16);
    }
    if !nb.is_multiple_of(16) {
        group!(full_groups, nb % 16);
    }
    for r in 0..R {
        for t in 0..T {
            // SAFETY: the caller guarantees `out` covers these positions.
            unsafe { *out.add(t * out_stride + r) = _mm512_reduce_add_ps(acc[r][t]) };
        }
    }
}
