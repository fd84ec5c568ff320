//! AVX2 tile kernels for fast mode's one 16-bit activation plane
//! ([`crate::q16`]): Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights widened to
//! int16 and multiplied with `vpmaddwd`, the instruction the 8-bit kernels
//! ([`super::avx2`]) finish with, so one 16-bit plane takes one 8-bit
//! plane's integer instructions on CPUs without VNNI.
//!
//! Per block and (row, token): two `vpmaddwd` give 8 lanes of exact
//! 4-element sums, then one multiply-add by `dw * d`; the mins of Q4_1 and
//! Q5_1 add `mw * s` once per 8 blocks. A row's value is the same whatever
//! the tile shape (rows, tokens) it is computed in: [`q16_tile`] keeps a
//! tile of up to 4 tokens in registers and widens each block per tile;
//! [`q16_rows`] widens each block once for up to 16 tokens and runs the
//! same operations in the same order.

#![allow(clippy::needless_range_loop, reason = "tile kernels index R x T register arrays")]

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::avx2::{group_scales, row_head, token_scales, unpack_block};
use super::fmt;
use super::hsum8;
use crate::q16::Q16Layout;

/// Block `p` of `F` as two vectors of 16 int16 weight values (elements
/// 0..16 and 16..32, the format's offset subtracted).
///
/// # Safety
/// `p` must point at one readable block of `F`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_block<const F: u8>(p: *const u8) -> [__m256i; 2] {
    // SAFETY: forwarded from the caller.
    let v = unsafe { unpack_block::<F>(p) };
    let (lo, hi) = (_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    if F == fmt::Q8_0 {
        return [_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi)];
    }
    let off = _mm256_set1_epi16(fmt::offset(F) as i16);
    let w = [_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi)];
    if fmt::offset(F) == 0 { w } else { w.map(|w| _mm256_sub_epi16(w, off)) }
}

/// Dots `R` weight rows with `T` tokens of packed Q16 activations (`act`,
/// `l.stride` bytes per token), writing `out[t * out_stride + r]`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `R` rows of
/// `l.blocks` blocks of `F`, `row_bytes` apart; `act` must hold `T` tokens
/// packed with layout `l`; `out` must be valid for the `R * T` writes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q16_tile<const F: u8, const R: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    l: &Q16Layout,
    act: *const u8,
    out: *mut f32,
    out_stride: usize,
) {
    let bs = fmt::block_bytes(F);
    let nb = l.blocks;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut sc = [[[0.0f32; 8]; T]; R];
    let mut b0 = 0;
    while b0 < nb {
        let gn = (nb - b0).min(8);
        // SAFETY: as this function's contract; `d`/`s` hold
        // `ceil(blocks / 16) * 16 >= b0 + 8` f32 per token.
        unsafe {
            group_scales::<F, R, T>(w, row_bytes, b0, gn, act, (l.stride, l.off_d, l.off_s), &mut sc, &mut acc);
        }
        for k in 0..gn {
            let b = b0 + k;
            let mut wv = [[_mm256_setzero_si256(); 2]; R];
            for r in 0..R {
                // SAFETY: block `b < nb` of row `r`.
                wv[r] = unsafe { widen_block::<F>(w.add(r * row_bytes + b * bs)) };
            }
            // SAFETY: every token holds `blocks * 32` int16 values.
            unsafe { block_products(&wv, act, l.stride, b, &sc, k, &mut acc) };
        }
        b0 += 8;
    }
    // SAFETY: the caller guarantees `out` covers the tile.
    unsafe { super::store_tile(&acc, out, out_stride) };
}

/// Adds one block's products to a tile: for each of the `T` tokens
/// (`stride` bytes apart) its int16 values of block `b` against the `R`
/// rows' widened weights `wv`, two `vpmaddwd`, then
/// `acc[r][t] += sums * sc[r][t][k]`.
///
/// # Safety
/// AVX2, FMA and F16C; every token at `act` holds block `b`'s 64 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, reason = "the tile's operands and its accumulators")]
unsafe fn block_products<const R: usize, const T: usize>(
    wv: &[[__m256i; 2]; R],
    act: *const u8,
    stride: usize,
    b: usize,
    sc: &[[[f32; 8]; T]; R],
    k: usize,
    acc: &mut [[__m256; T]; R],
) {
    for t in 0..T {
        // SAFETY: token `t` holds block `b` (the caller).
        let (a0, a1) = unsafe {
            let xa = act.add(t * stride + b * 64);
            (_mm256_loadu_si256(xa.cast()), _mm256_loadu_si256(xa.add(32).cast()))
        };
        for r in 0..R {
            let d = _mm256_add_epi32(_mm256_madd_epi16(wv[r][0], a0), _mm256_madd_epi16(wv[r][1], a1));
            let s = _mm256_broadcast_ss(&sc[r][t][k]);
            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, acc[r][t]);
        }
    }
}

/// Tokens one [`q16_rows`] call takes: its accumulators (`R * 16`
/// vectors) live on the stack, loaded into registers `TILE` tokens at a
/// time.
pub(crate) const Q16_TOKENS: usize = 16;

/// Tokens per register tile inside [`q16_rows`].
const TILE: usize = 4;

/// Dots `R` weight rows with `n <= Q16_TOKENS` tokens of packed Q16
/// activations (`act`, `l.stride` bytes per token), writing
/// `out[t * out_stride + r]`.
///
/// Each group of 8 blocks is widened once for all `n` tokens (the
/// widening costs as much as two tokens' multiplies), then runs through
/// register tiles of up to 4 tokens whose accumulators wait on the stack
/// between groups.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must hold `R` rows of
/// `l.blocks` blocks of `F`, `row_bytes` apart; `act` must hold `n` tokens
/// packed with layout `l`; `out` must be valid for the `R * n` writes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q16_rows<const F: u8, const R: usize>(
    w: *const u8,
    row_bytes: usize,
    l: &Q16Layout,
    act: *const u8,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
    debug_assert!(n <= Q16_TOKENS);
    let bs = fmt::block_bytes(F);
    let mut acc = [[_mm256_setzero_ps(); Q16_TOKENS]; R];
    // Left uninitialised (each group writes the blocks it reads): zeroing
    // it was a `memset` call per row pair (docs/benchmarks.md).
    let mut wv = [[MaybeUninit::<[__m256i; 2]>::uninit(); R]; 8];
    let mut b0 = 0;
    while b0 < l.blocks {
        let gn = (l.blocks - b0).min(8);
        let mut heads = [(_mm256_setzero_ps(), _mm256_setzero_ps()); R];
        for r in 0..R {
            // SAFETY: blocks `b0..b0 + gn` of row `r` are readable (this
            // function's contract).
            heads[r] = unsafe { row_head::<F>(w.wrapping_add(r * row_bytes), b0, gn) };
            for k in 0..gn {
                // SAFETY: as above, block `b0 + k`.
                wv[k][r].write(unsafe { widen_block::<F>(w.add(r * row_bytes + (b0 + k) * bs)) });
            }
        }
        let g = Group { wv: &wv, heads: &heads, b0, gn };
        let mut t = 0;
        while t < n {
            let tn = (n - t).min(TILE);
            // SAFETY: tokens `t..t + tn < n` of `act` (the contract).
            unsafe {
                let a = act.add(t * l.stride);
                match tn {
                    4 => g.tile::<F, 4>(l, a, &mut acc, t),
                    3 => g.tile::<F, 3>(l, a, &mut acc, t),
                    2 => g.tile::<F, 2>(l, a, &mut acc, t),
                    _ => g.tile::<F, 1>(l, a, &mut acc, t),
                }
            }
            t += tn;
        }
        b0 += 8;
    }
    for (r, row) in acc.iter().enumerate() {
        for (t, &v) in row[..n].iter().enumerate() {
            // SAFETY: the caller guarantees `out` covers the `R * n` results.
            unsafe { *out.add(t * out_stride + r) = hsum8(v) };
        }
    }
}

/// One group of up to 8 blocks of `R` rows, widened ([`widen_block`]),
/// with the rows' block scales and mins.
struct Group<'a, const R: usize> {
    /// Block `k`'s rows at `wv[k]`, written for every `k < gn`.
    wv: &'a [[MaybeUninit<[__m256i; 2]>; R]; 8],
    heads: &'a [(__m256, __m256); R],
    b0: usize,
    gn: usize,
}

impl<const R: usize> Group<'_, R> {
    /// Adds the group's products with `T` tokens from `act` to
    /// `acc[r][t0..t0 + T]`: the mins' term first, then block by block, the
    /// same operations in the same order whatever `T` and `t0`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `act` must hold `T` tokens of layout `l` and
    /// `t0 + T <= Q16_TOKENS`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const F: u8, const T: usize>(
        &self,
        l: &Q16Layout,
        act: *const u8,
        acc: &mut [[__m256; Q16_TOKENS]; R],
        t0: usize,
    ) {
        let mut a = [[_mm256_setzero_ps(); T]; R];
        for r in 0..R {
            a[r].copy_from_slice(&acc[r][t0..t0 + T]);
        }
        let mut sc = [[[0.0f32; 8]; T]; R];
        let layout = (l.stride, l.off_d, l.off_s);
        for r in 0..R {
            // SAFETY: `d`/`s` hold `ceil(blocks / 16) * 16 >= b0 + 8` f32
            // per token (the layout).
            unsafe { token_scales::<F, T>(self.heads[r], self.b0, act, layout, &mut sc[r], &mut a[r]) };
        }
        for k in 0..self.gn {
            // SAFETY: `wv[k]`, `k < gn`, was written for every row (the
            // field's invariant), and `MaybeUninit<X>` has `X`'s layout;
            // every token holds `blocks * 32` int16 values.
            unsafe {
                let wv = &*self.wv[k].as_ptr().cast::<[[__m256i; 2]; R]>();
                block_products(wv, act, l.stride, self.b0 + k, &sc, k, &mut a);
            }
        }
        for r in 0..R {
            acc[r][t0..t0 + T].copy_from_slice(&a[r]);
        }
    }
}
