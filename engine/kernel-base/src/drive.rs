//! The pieces every matmul driver shares (the dense kernels of
//! `spinfer-kernels`, the ternary ones of `spinfer-ternary`): the
//! instruction-set tag, activation packing, the tile walk, and the scalar
//! helpers of the x86 tile kernels (f16 scales, the lane sum). Pointers the
//! pool's threads share are [`crate::pool::SyncPtr`]. It knows no weight
//! format.

use std::ops::Range;

use crate::cpu::CpuFeatures;
use crate::pool::{SyncPtr, ThreadPool, chunk_aligned};

/// Instruction set a kernel is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
}

impl Isa {
    /// Whether the running CPU supports the instruction set (cached
    /// detection).
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => CpuFeatures::detect().has_avx2(),
            Isa::Avx512 => CpuFeatures::detect().has_avx512(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// Quantises/packs `n_tokens` rows of `x` (`cols` each) into `dst` (`stride`
/// bytes per token) with `pack`, spreading tokens over the pool when there
/// are several.
pub fn pack_tokens(
    pool: &ThreadPool,
    x: &[f32],
    cols: usize,
    n_tokens: usize,
    dst: &mut [u8],
    stride: usize,
    pack: &(dyn Fn(&[f32], &mut [u8]) + Sync),
) {
    debug_assert!(dst.len() >= n_tokens * stride);
    if n_tokens < 4 || pool.n_threads() == 1 {
        for (xt, dt) in x.chunks_exact(cols).zip(dst.chunks_exact_mut(stride)) {
            pack(xt, dt);
        }
        return;
    }
    let base = SyncPtr::new(dst.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        for t in crate::pool::chunk(n_tokens, ti, nt) {
            // SAFETY: token `t`'s region `t * stride .. (t + 1) * stride`
            // lies inside `dst` and is written by this thread only.
            let dt = unsafe { std::slice::from_raw_parts_mut(base.get().add(t * stride), stride) };
            pack(&x[t * cols..(t + 1) * cols], dt);
        }
    });
}

/// Below this many multiply-adds a matmul runs on the calling thread
/// alone: waking the pool's workers costs about a microsecond, as long as
/// such a product takes on one core (the smallest matmul of a real model,
/// SmolLM2's 192x576 k/v projection, is 110 K).
pub const INLINE_MACS: usize = 32 * 1024;

/// `pool.broadcast(f)`, or `f(0, 1)` on this thread for a job of fewer than
/// [`INLINE_MACS`] multiply-adds.
pub fn broadcast_work(pool: &ThreadPool, macs: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    if macs < INLINE_MACS { f(0, 1) } else { pool.broadcast(f) }
}

/// Calls `tile(row0, n_rows, tok0, n_toks)` over the rows of thread `ti`
/// (tiles of `rmax` rows, then single rows) and all tokens (groups of up to
/// `tmax`).
pub fn for_each_tile(
    rows: usize,
    n_tokens: usize,
    ti: usize,
    nt: usize,
    rmax: usize,
    tmax: usize,
    mut tile: impl FnMut(usize, usize, usize, usize),
) {
    let Range { start, end } = chunk_aligned(rows, ti, nt, rmax);
    let mut r = start;
    while r < end {
        let nr = if end - r >= rmax { rmax } else { 1 };
        let mut t = 0;
        while t < n_tokens {
            let ntk = (n_tokens - t).min(tmax);
            tile(r, nr, t, ntk);
            t += ntk;
        }
        r += nr;
    }
}

/// f16 → f32 with the F16C instruction (half's `to_f32` checks CPU
/// features at run time on every call).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Reads the little-endian f16 at `p` and converts it (F16C).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `p..p + 2` must be readable.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes.
    f16_bits_to_f32(unsafe { p.cast::<u16>().read_unaligned() })
}

/// The sum of the 8 lanes of `v`, in the order every tile kernel uses
/// (halves, then pairs, then the last two lanes).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub fn hsum8(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
}
