//! The pieces every matmul driver shares (the dense kernels here, the
//! ternary ones in `crate::dot::ternary`): the instruction-set tag, output
//! and scratch pointers shared by pool threads, activation packing and the
//! tile walk. A leaf: it imports no other matmul or dot module.

use std::ops::Range;

use crate::cpu::CpuFeatures;
use crate::pool::{ThreadPool, chunk_aligned};

/// Instruction set a kernel is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
}

impl Isa {
    /// Whether the running CPU supports the instruction set (cached
    /// detection).
    pub(crate) fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => CpuFeatures::detect().has_avx2(),
            Isa::Avx512 => CpuFeatures::detect().has_avx512(),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// Output pointer shared by the pool threads; each thread writes only the
/// elements of its own rows.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub *mut f32);

impl OutPtr {
    /// The pointer (a method, so closures capture the `Sync` wrapper).
    pub fn ptr(&self) -> *mut f32 {
        self.0
    }
}

// SAFETY: threads write disjoint elements (distinct rows), and the
// pointer outlives the broadcast that uses it.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// Mutable byte buffer shared by the pool threads for per-token writes to
/// disjoint regions.
#[derive(Clone, Copy)]
pub(crate) struct SharedBuf(pub *mut u8);

impl SharedBuf {
    /// The pointer (a method, so closures capture the `Sync` wrapper).
    pub fn ptr(&self) -> *mut u8 {
        self.0
    }
}

// SAFETY: threads write disjoint per-token regions of the buffer, which
// outlives the broadcast.
unsafe impl Send for SharedBuf {}
// SAFETY: as above.
unsafe impl Sync for SharedBuf {}

/// Quantises/packs `n_tokens` rows of `x` (`cols` each) into `dst` (`stride`
/// bytes per token) with `pack`, spreading tokens over the pool when there
/// are several.
pub(crate) fn pack_tokens(
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
    let base = SharedBuf(dst.as_mut_ptr());
    pool.broadcast(&|ti, nt| {
        for t in crate::pool::chunk(n_tokens, ti, nt) {
            // SAFETY: token `t`'s region `t * stride .. (t + 1) * stride`
            // lies inside `dst` and is written by this thread only.
            let dt = unsafe { std::slice::from_raw_parts_mut(base.ptr().add(t * stride), stride) };
            pack(&x[t * cols..(t + 1) * cols], dt);
        }
    });
}

/// Below this many multiply-adds a matmul runs on the calling thread
/// alone: waking the pool's workers costs about a microsecond, as long as
/// such a product takes on one core (the smallest matmul of a real model,
/// SmolLM2's 192x576 k/v projection, is 110 K).
const INLINE_MACS: usize = 32 * 1024;

/// `pool.broadcast(f)`, or `f(0, 1)` on this thread for a job of fewer than
/// [`INLINE_MACS`] multiply-adds.
pub(crate) fn broadcast_work(pool: &ThreadPool, macs: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    if macs < INLINE_MACS { f(0, 1) } else { pool.broadcast(f) }
}

/// Calls `tile(row0, n_rows, tok0, n_toks)` over the rows of thread `ti`
/// (tiles of `rmax` rows, then single rows) and all tokens (groups of up to
/// `tmax`).
pub(crate) fn for_each_tile(
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
