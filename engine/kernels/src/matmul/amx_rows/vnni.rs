//! The tiles' integer dots on AVX-512 VNNI, for calls of a few tokens:
//! there a tile product's fixed cost (unpacking the weights to memory,
//! loading them into tiles, storing the sums) exceeds `vpdpbusd`'s work on
//! weights unpacked in registers (docs/benchmarks.md, "Batched decode on
//! AMX tiles").
//!
//! Per pair of blocks, each row's 64 weights are unpacked once (unsigned;
//! the offsets of Q4_0/Q5_0, and 128 for Q8_0, come back exactly through
//! the tokens' `corr` lanes) and dotted with every token of the group: 16
//! lanes of partial sums, of which lanes 0-3 and 8-11 belong to the first
//! block and 4-7, 12-15 to the second. A reduction tree adds them into
//! each block's exact integer dot, in the `C` tile's layout, and the
//! tiles' own epilogue takes them from there. The integer sums are exact
//! whatever the order, so every output is bit for bit the tiles'.

use std::arch::x86_64::*;

use super::{Ctx, Panel, R, epilogue};
use crate::dot::{avx512, fmt};
use crate::quantize::LegacyLayout;

/// The `vpermt2d` indices that take the sums of one block, for the 16
/// lanes of an accumulator, from the two reduction outputs that hold its
/// 16 (row, token) combinations: an output's lanes 0-3 are the first
/// block's sums of its combinations 0-3, 4-7 their second block's, 8-15
/// the same for its combinations 4-7. Row `[s]`: block `s`.
#[repr(C, align(64))]
struct Pick([[i32; 16]; 2]);

static PICK: Pick = {
    let mut o = [[0i32; 16]; 2];
    let mut l = 0;
    while l < 16 {
        let c = l % 8;
        o[0][l] = ((l / 8) * 16 + (c / 4) * 8 + c % 4) as i32;
        o[1][l] = o[0][l] + 4;
        l += 1;
    }
    Pick(o)
};

/// Adds lanes pairwise within 128-bit lanes: `[u0 + u2, v0 + v2, u1 + u3,
/// v1 + v3]` per lane of `u` and `v`.
#[inline(always)]
fn fold32(u: __m512i, v: __m512i) -> __m512i {
    // SAFETY: AVX-512 F is enabled in every caller (inlined into `tile`).
    unsafe { _mm512_add_epi32(_mm512_unpacklo_epi32(u, v), _mm512_unpackhi_epi32(u, v)) }
}

/// Then `[u, v, x, y]` sums per 128-bit lane from two [`fold32`]s.
#[inline(always)]
fn fold64(a: __m512i, b: __m512i) -> __m512i {
    // SAFETY: as for `fold32`.
    unsafe { _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b)) }
}

/// Then 128-bit lanes 0 + 2 and 1 + 3 (the two blocks) of `p`, then of `q`.
#[inline(always)]
fn fold128(p: __m512i, q: __m512i) -> __m512i {
    // SAFETY: as for `fold32`.
    unsafe { _mm512_add_epi32(_mm512_shuffle_i32x4::<0x44>(p, q), _mm512_shuffle_i32x4::<0xEE>(p, q)) }
}

/// The 64 weights of pair `pr` of the row at `src`, unsigned, in the
/// pair-interleaved order.
///
/// # Safety
/// Blocks `2pr` (and `2pr + 1` if it exists) of the row must be readable.
#[inline(always)]
unsafe fn weights<const F: u8>(src: *const u8, pr: usize, nb: usize) -> __m512i {
    let (bs, b) = (fmt::block_bytes(F), 2 * pr);
    let pair = b + 1 < nb;
    // SAFETY: the caller's contract.
    unsafe {
        if F == fmt::Q8_0 {
            // [a 0..32, b 0..32] → [a 0..16, b 0..16, a 16..32, b 16..32], + 128.
            let a = _mm256_loadu_si256(src.add(b * bs + 2).cast());
            let c = if pair { _mm256_loadu_si256(src.add((b + 1) * bs + 2).cast()) } else { _mm256_setzero_si256() };
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), c);
            _mm512_xor_si512(_mm512_shuffle_i64x2::<0b11_01_10_00>(v, v), _mm512_set1_epi8(-128))
        } else {
            avx512::unpack_pair::<F>(src.add(b * bs), pair)
        }
    }
}

/// One group: the outputs of 16 weight rows × `N` tokens (`act`: the
/// group's first token, packed with `l`, `corr` included) over all blocks,
/// into the panel's output section as `[row][token]`, as
/// [`super::tile`] computes them. `N` ≤ 8.
///
/// # Safety
/// The rows `w + w_rows[j] × rb` must hold `l.blocks` blocks of `F`;
/// `act` `N` packed tokens; `x` the context of the same rows and of the
/// group; the CPU must have AVX-512 F/BW/VL/VNNI, F16C and FMA.
#[allow(clippy::too_many_arguments, reason = "the rows, the tokens and the panel")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn tile<const F: u8, const N: usize>(
    w: *const u8,
    rb: usize,
    w_rows: &[usize; R],
    l: &LegacyLayout,
    act: *const u8,
    p: *mut u8,
    panel: &Panel,
    x: &Ctx<'_>,
) {
    let per = 8 / N;
    let mut acc = [_mm512_setzero_ps(); N];
    // SAFETY: 64-byte aligned table rows.
    let pick = unsafe { [0, 1].map(|s| _mm512_load_si512(PICK.0[s].as_ptr().cast())) };
    for pr in 0..l.pairs {
        // The tokens' values and `corr` lanes of the pair.
        let mut xv = [_mm512_setzero_si512(); N];
        let mut init = [_mm512_setzero_si512(); N];
        for t in 0..N {
            // SAFETY: token `t`'s `qs` has `pairs × 64` bytes, `corr`
            // `pairs × 16` i32, 64-byte aligned.
            unsafe {
                let a = act.add(t * l.stride);
                xv[t] = _mm512_load_si512(a.add(pr * 64).cast());
                if l.offset != 0 {
                    init[t] = _mm512_load_si512(a.add(l.off_corr + pr * 64).cast());
                }
            }
        }
        // Reduction output `k`: combinations `8k..8k + 8` (rows `k · per
        // ..`, all tokens), both blocks.
        let mut red = [_mm512_setzero_si512(); 16];
        for (k, red) in red.iter_mut().enumerate().take(2 * N) {
            let mut v = [_mm512_setzero_si512(); 8];
            for rl in 0..per {
                // SAFETY: row `k · per + rl` < 16 is one of the caller's.
                let wv = unsafe { weights::<F>(w.wrapping_add(w_rows[k * per + rl] * rb), pr, l.blocks) };
                for t in 0..N {
                    v[rl * N + t] = _mm512_dpbusd_epi32(init[t], wv, xv[t]);
                }
            }
            *red =
                fold128(fold64(fold32(v[0], v[1]), fold32(v[2], v[3])), fold64(fold32(v[4], v[5]), fold32(v[6], v[7])));
        }
        let sums: [[__m512i; 2]; N] =
            std::array::from_fn(|z| pick.map(|idx| _mm512_permutex2var_epi32(red[2 * z], idx, red[2 * z + 1])));
        // SAFETY: the caller's contract.
        unsafe { epilogue::<F, N>(&mut acc, x, 2 * pr, &sums) };
    }
    for (z, acc) in acc.iter().enumerate() {
        // SAFETY: the output section holds 256 f32; `16z + 16 <= 16N`.
        unsafe { _mm512_storeu_ps(p.add(panel.out).cast::<f32>().add(16 * z), *acc) };
    }
}
