//! The x86-64 GEMM: packing, micro-kernels (AVX-512 8 × 48, AVX2 6 × 16)
//! and the blocked loops of [`run`].
#![allow(clippy::needless_range_loop, reason = "micro-kernels index MR x NR register arrays")]

use std::arch::x86_64::*;

use half::f16;

use super::super::{Isa, Job, SyncPtr, scratch_aligned};
use super::{BLayout, KC, pack8};
use crate::GgmlType;
use crate::pool::{ThreadPool, chunk_aligned};

/// Register-tile geometry of one instruction set.
#[derive(Clone, Copy)]
struct Geometry {
    /// Rows per panel.
    nr: usize,
    /// Rows per packed block (a multiple of `nr`).
    mc: usize,
}

fn geometry(isa: Isa) -> Geometry {
    match isa {
        Isa::Avx512 => Geometry { nr: 48, mc: 240 },
        _ => Geometry { nr: 16, mc: 256 },
    }
}

/// Runs `job` (F32/F16/BF16 or [`super::quantised`] block weights, f32
/// activations, any shape) as a packed GEMM with the kernels of `isa`
/// (AVX2 or AVX-512; the caller checked that the CPU supports it).
pub(in crate::matmul) fn run(isa: Isa, pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) {
    let g = geometry(isa);
    let d = job.desc;
    let nt = pool.n_threads();
    // One packed block per thread.
    let per_thread = g.mc * KC;
    let buf = scratch_aligned(scratch, nt * per_thread * 4);
    let packed = SyncPtr::new(buf.as_mut_ptr());
    let (w, x) = (job.w.as_ptr() as usize, job.x.as_ptr() as usize);
    let (rows, cols, n, rb, ty) = (d.rows, d.cols, job.n_tokens, job.row_bytes, d.wtype);
    let out = job.out;
    let quantised = super::quantised(ty);
    pool.broadcast(&|ti, nt| {
        let rr = chunk_aligned(rows, ti, nt, g.nr);
        // SAFETY: index `ti` runs once per broadcast and uses only its own
        // `per_thread` floats of the 64-byte aligned scratch region, which
        // holds `nt * per_thread` floats and outlives the broadcast.
        let pk = unsafe { packed.get().cast::<f32>().add(ti * per_thread) };
        let (w, x) = (w as *const u8, x as *const f32);
        let mut pc = 0;
        while pc < cols {
            let kc = KC.min(cols - pc);
            let mut r0 = rr.start;
            while r0 < rr.end {
                let mr = g.mc.min(rr.end - r0);
                // The next block's weights, fetched into L2 while this
                // one is computed (packing then does not wait on DRAM).
                let next = if r0 + mr < rr.end {
                    Some((pc, r0 + mr, kc))
                } else if pc + kc < cols {
                    Some((pc + kc, rr.start, KC.min(cols - pc - kc)))
                } else {
                    None
                };
                let pf = match next {
                    Some((npc, nr0, nkc)) => Prefetch {
                        base: w.wrapping_add(nr0 * rb + pack8::col_offset(ty, npc)),
                        rb,
                        rows: g.mc.min(rr.end - nr0),
                        bytes: pack8::col_offset(ty, nkc),
                    },
                    None => Prefetch::NONE,
                };
                // SAFETY: rows `r0..r0 + mr` and columns `pc..pc + kc` lie in
                // the validated weight buffer (`rows` rows of `rb` bytes);
                // the packed block (`ceil(mr / nr)` panels of `kc * nr`
                // floats <= `per_thread`) fits this thread's region; the
                // micro-kernels read tokens `0..n` of `x` (`n * cols`
                // floats, validated) and write rows `r0..r0 + mr`, owned by
                // this thread, of `out` (`n * rows` floats, validated); the
                // CPU supports `isa`.
                unsafe {
                    let wb = w.add(r0 * rb);
                    if quantised || isa != Isa::Avx512 {
                        pack8::pack(ty, wb, rb, mr, pc, kc, g.nr, pk);
                    } else {
                        pack_avx512(ty, wb, rb, mr, pc, kc, pk);
                    }
                    match isa {
                        Isa::Avx512 => {
                            block_avx512(x.add(pc), cols, n, pk, kc, mr, out.get().add(r0), rows, pc > 0, pf)
                        }
                        _ => block_avx2(x.add(pc), cols, n, pk, kc, mr, out.get().add(r0), rows, pc > 0, pf),
                    }
                }
                r0 += mr;
            }
            pc += kc;
        }
    });
}

/// [`super::sgemm`] with the kernels of `isa`.
///
/// # Safety
/// The CPU must support `isa` (AVX2 or AVX-512); the operands must hold
/// their strided shapes (see [`super::sgemm`]); `k > 0`.
#[allow(clippy::too_many_arguments, reason = "the BLAS operands")]
pub(in crate::matmul) unsafe fn sgemm(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    layout: BLayout,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    scratch: &mut Vec<f32>,
) {
    let g = geometry(isa);
    let avx512 = isa == Isa::Avx512;
    if scratch.len() < g.mc * KC {
        scratch.resize(g.mc * KC, 0.0);
    }
    let pk = scratch.as_mut_ptr();
    let mut pc = 0;
    while pc < k {
        let kc = KC.min(k - pc);
        let mut r0 = 0;
        while r0 < n {
            let mr = g.mc.min(n - r0);
            let acc = accumulate || pc > 0;
            // SAFETY: columns `r0..r0 + mr` of B and `pc..pc + kc` of its
            // summed index are inside `b`; the packed block fits `scratch`
            // (`ceil(mr / nr) * kc * nr <= mc * KC` floats); rows `0..m` of
            // `a` (from column `pc`) and `c` (from column `r0`) are inside
            // their slices; the CPU supports `isa`.
            unsafe {
                match layout {
                    BLayout::Transposed => {
                        let bb = b.add(r0 * ldb).cast::<u8>();
                        if avx512 {
                            pack_avx512(GgmlType::F32, bb, ldb * 4, mr, pc, kc, pk);
                        } else {
                            pack8::pack(GgmlType::F32, bb, ldb * 4, mr, pc, kc, g.nr, pk);
                        }
                    }
                    BLayout::Normal => pack_normal(b.add(pc * ldb + r0), ldb, mr, kc, g.nr, pk),
                }
                if avx512 {
                    block_avx512(a.add(pc), lda, m, pk, kc, mr, c.add(r0), ldc, acc, Prefetch::NONE);
                } else {
                    block_avx2(a.add(pc), lda, m, pk, kc, mr, c.add(r0), ldc, acc, Prefetch::NONE);
                }
            }
            r0 += mr;
        }
        pc += kc;
    }
}

/// Packs `kc` rows of `mr` columns of a row-major `b` (stride `ldb`) into
/// panels of `nr` columns (zero-padded), as [`pack8::pack`] lays them out.
///
/// # Safety
/// `b` must hold the `kc × mr` block; `dst` `ceil(mr / nr) * kc * nr`
/// floats.
unsafe fn pack_normal(b: *const f32, ldb: usize, mr: usize, kc: usize, nr: usize, dst: *mut f32) {
    for p in 0..mr.div_ceil(nr) {
        let valid = (mr - p * nr).min(nr);
        for k in 0..kc {
            // SAFETY: row `k < kc`, columns `p * nr..p * nr + valid` of the
            // block; the panel row is inside `dst`.
            unsafe {
                let src = b.add(k * ldb + p * nr);
                let d = dst.add(p * kc * nr + k * nr);
                std::ptr::copy_nonoverlapping(src, d, valid);
                std::ptr::write_bytes(d.add(valid), 0, nr - valid);
            }
        }
    }
}

/// A block of weight rows to prefetch into L2: `rows` rows of `bytes`
/// bytes from `base`, `rb` bytes apart.
#[derive(Clone, Copy)]
struct Prefetch {
    base: *const u8,
    rb: usize,
    rows: usize,
    bytes: usize,
}

impl Prefetch {
    const NONE: Prefetch = Prefetch { base: std::ptr::null(), rb: 0, rows: 0, bytes: 0 };

    /// Cache lines in the block.
    fn lines(&self) -> usize {
        self.rows * self.bytes.div_ceil(64)
    }

    /// Prefetches lines `from..to` (row-major order).
    #[inline]
    fn issue(&self, from: usize, to: usize) {
        let per_row = self.bytes.div_ceil(64);
        for l in from..to {
            let p = self.base.wrapping_add(l / per_row * self.rb + l % per_row * 64);
            // SAFETY: a prefetch is a hint: it never faults and has no
            // effect on memory contents.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
        }
    }
}

/// Weight `(r, c)` of a row-major matrix of `ty` with `rb` bytes per row.
///
/// # Safety
/// The element must lie inside the matrix.
#[inline]
unsafe fn weight_at(ty: GgmlType, w: *const u8, rb: usize, r: usize, c: usize) -> f32 {
    // SAFETY: the caller guarantees the element is inside the matrix.
    unsafe {
        let row = w.add(r * rb);
        match ty {
            GgmlType::F32 => row.add(4 * c).cast::<f32>().read_unaligned(),
            GgmlType::F16 => f16::from_bits(row.add(2 * c).cast::<u16>().read_unaligned()).to_f32(),
            // A plain shift, as `crate::dequant` (keeps NaN payloads).
            _ => f32::from_bits(u32::from(row.add(2 * c).cast::<u16>().read_unaligned()) << 16),
        }
    }
}

/// Loads 16 weights of row `r`, columns `c..c + 16`, as f32.
///
/// # Safety
/// AVX-512F must be available and the 16 elements inside the matrix.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn load16(ty: GgmlType, w: *const u8, rb: usize, r: usize, c: usize) -> __m512 {
    // SAFETY: the caller guarantees the 16 elements are inside the matrix.
    unsafe {
        let row = w.add(r * rb);
        match ty {
            GgmlType::F32 => _mm512_loadu_ps(row.add(4 * c).cast()),
            GgmlType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * c).cast())),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
                row.add(2 * c).cast(),
            )))),
        }
    }
}

/// Transposes the 16 × 16 matrix held in `r` (row `i` in `r[i]`).
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &mut [__m512; 16]) {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let lo = |a: __m512, b: __m512| _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    let hi = |a: __m512, b: __m512| _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    for i in 0..4 {
        let b = 4 * i;
        r[b] = lo(t[b], t[b + 2]);
        r[b + 1] = hi(t[b], t[b + 2]);
        r[b + 2] = lo(t[b + 1], t[b + 3]);
        r[b + 3] = hi(t[b + 1], t[b + 3]);
    }
    for h in 0..2 {
        let b = 8 * h;
        for i in 0..4 {
            t[b + i] = _mm512_shuffle_f32x4::<0x88>(r[b + i], r[b + 4 + i]);
            t[b + 4 + i] = _mm512_shuffle_f32x4::<0xdd>(r[b + i], r[b + 4 + i]);
        }
    }
    for i in 0..8 {
        r[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
        r[8 + i] = _mm512_shuffle_f32x4::<0xdd>(t[i], t[8 + i]);
    }
}

/// As [`pack8::pack`] with `nr = 48` (F32, F16, BF16), 16 × 16 blocks transposed in
/// registers.
///
/// # Safety
/// As [`pack8::pack`]; AVX-512 F/BW must be available.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn pack_avx512(ty: GgmlType, w: *const u8, rb: usize, mr: usize, pc: usize, kc: usize, dst: *mut f32) {
    const NR: usize = 48;
    /// Prefetch distance in columns.
    const PF: usize = 128;
    let esize = if ty == GgmlType::F32 { 4 } else { 2 };
    let k16 = kc / 16 * 16;
    for p in 0..mr.div_ceil(NR) {
        // SAFETY: panel `p` (`kc * NR` floats) is inside `dst`.
        let pd = unsafe { dst.add(p * kc * NR) };
        for g in 0..NR / 16 {
            let r0 = p * NR + g * 16;
            let valid = mr.saturating_sub(r0).min(16);
            let mut k = 0;
            while k < k16 {
                let mut v = [_mm512_setzero_ps(); 16];
                // The weights usually come from DRAM: prefetch each row
                // `PF` columns ahead (within the block) to keep more
                // misses in flight than the hardware prefetcher does for
                // 16 interleaved streams.
                let pf = (k + PF < kc).then(|| (pc + k + PF) * esize);
                for i in 0..valid {
                    // SAFETY: row `r0 + i < mr`, columns `pc + k..pc + k + 16`
                    // with `k + 16 <= kc` are inside the matrix; the
                    // prefetched column is too (a prefetch never faults).
                    unsafe {
                        if let Some(off) = pf {
                            _mm_prefetch::<_MM_HINT_T0>(w.add((r0 + i) * rb + off).cast());
                        }
                        v[i] = load16(ty, w, rb, r0 + i, pc + k);
                    }
                }
                transpose16(&mut v);
                for (i, vi) in v.iter().enumerate() {
                    // SAFETY: column `k + i < kc`, rows `g * 16..g * 16 + 16`
                    // of the panel: inside `pd`.
                    unsafe { _mm512_storeu_ps(pd.add((k + i) * NR + g * 16), *vi) };
                }
                k += 16;
            }
            for k in k16..kc {
                for j in 0..16 {
                    // SAFETY: row `r0 + j < mr` and column `pc + k` are inside
                    // the matrix; the index is inside the panel.
                    unsafe {
                        let v = if j < valid { weight_at(ty, w, rb, r0 + j, pc + k) } else { 0.0 };
                        *pd.add(k * NR + g * 16 + j) = v;
                    }
                }
            }
        }
    }
}

/// AVX-512 micro-kernel: `c[i, 0..16·NV] (+)= Σ_k x[i, k] · p[k, 0..16·NV]`
/// for `i < M`, with `x` row stride `ldx`, panel row stride 48 and `c` row
/// stride `ldc`.
///
/// # Safety
/// AVX-512F must be available; `x` must hold `M` rows of `kc` floats, `p`
/// `kc` rows of 48 floats, `c` `M` rows of `16 · NV` floats.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn ukr_avx512<const M: usize, const NV: usize>(
    kc: usize,
    x: *const f32,
    ldx: usize,
    p: *const f32,
    c: *mut f32,
    ldc: usize,
    acc_in: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; M];
    // SAFETY: all addresses are inside the buffers described above.
    unsafe {
        if acc_in {
            for i in 0..M {
                for j in 0..NV {
                    acc[i][j] = _mm512_loadu_ps(c.add(i * ldc + 16 * j));
                }
            }
        }
        for k in 0..kc {
            let pk = p.add(k * 48);
            let mut b = [_mm512_setzero_ps(); NV];
            for j in 0..NV {
                b[j] = _mm512_loadu_ps(pk.add(16 * j));
            }
            for i in 0..M {
                let a = _mm512_set1_ps(*x.add(i * ldx + k));
                for j in 0..NV {
                    acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
                }
            }
        }
        for i in 0..M {
            for j in 0..NV {
                _mm512_storeu_ps(c.add(i * ldc + 16 * j), acc[i][j]);
            }
        }
    }
}

/// AVX2 micro-kernel: as [`ukr_avx512`] with `8 · NV` columns and panel
/// row stride 16.
///
/// # Safety
/// AVX2 and FMA must be available; `x` must hold `M` rows of `kc` floats,
/// `p` `kc` rows of 16 floats, `c` `M` rows of `8 · NV` floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn ukr_avx2<const M: usize, const NV: usize>(
    kc: usize,
    x: *const f32,
    ldx: usize,
    p: *const f32,
    c: *mut f32,
    ldc: usize,
    acc_in: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); NV]; M];
    // SAFETY: all addresses are inside the buffers described above.
    unsafe {
        if acc_in {
            for i in 0..M {
                for j in 0..NV {
                    acc[i][j] = _mm256_loadu_ps(c.add(i * ldc + 8 * j));
                }
            }
        }
        for k in 0..kc {
            let pk = p.add(k * 16);
            let mut b = [_mm256_setzero_ps(); NV];
            for j in 0..NV {
                b[j] = _mm256_loadu_ps(pk.add(8 * j));
            }
            for i in 0..M {
                let a = _mm256_set1_ps(*x.add(i * ldx + k));
                for j in 0..NV {
                    acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
                }
            }
        }
        for i in 0..M {
            for j in 0..NV {
                _mm256_storeu_ps(c.add(i * ldc + 8 * j), acc[i][j]);
            }
        }
    }
}

/// Signature of the micro-kernels.
type Ukr = unsafe fn(usize, *const f32, usize, *const f32, *mut f32, usize, bool);

/// Runs all token tiles of `n` tokens against every panel of a packed
/// block of `mr` rows. `c` points at `out[0, r0]` (row stride `ldc`).
///
/// # Safety
/// `x` holds `n` rows (stride `ldx`) of `kc` floats; `p` the packed block;
/// `c` `n` rows (stride `ldc`) of at least `mr` floats; `ukr(m, v)` is a
/// micro-kernel for `m` tokens of `v` vectors of `lanes` columns (panel row
/// stride `nr`) whose features the CPU has.
#[allow(clippy::too_many_arguments, reason = "the GEMM operands")]
#[inline]
unsafe fn block(
    mrt: usize,
    nr: usize,
    lanes: usize,
    ukr: &dyn Fn(usize, usize) -> Ukr,
    x: *const f32,
    ldx: usize,
    n: usize,
    p: *const f32,
    kc: usize,
    mr: usize,
    c: *mut f32,
    ldc: usize,
    acc_in: bool,
    pf: Prefetch,
) {
    let calls = n.div_ceil(mrt) * mr.div_ceil(nr);
    let lines = pf.lines();
    let mut call = 0;
    let mut t = 0;
    while t < n {
        let m = mrt.min(n - t);
        // SAFETY: tokens `t..t + m` are inside `x` and `c`.
        let (xt, ct) = unsafe { (x.add(t * ldx), c.add(t * ldc)) };
        let mut r = 0;
        while r < mr {
            let nv = nr.min(mr - r);
            let f = ukr(m, nv.div_ceil(lanes));
            pf.issue(call * lines / calls, (call + 1) * lines / calls);
            call += 1;
            // SAFETY: panel `r / nr` is inside the packed block.
            let pp = unsafe { p.add(r / nr * kc * nr) };
            if nv.is_multiple_of(lanes) {
                // SAFETY: whole vectors: columns `r..r + nv` of the `m`
                // output rows are inside `c`.
                unsafe { f(kc, xt, ldx, pp, ct.add(r), ldc, acc_in) };
            } else {
                // A ragged panel: through a stack tile of `m × nr`.
                let mut tile = [0.0f32; 8 * 48];
                for i in 0..m {
                    for j in 0..nv {
                        // SAFETY: row `i < m`, column `r + j < mr`.
                        tile[i * nr + j] = if acc_in { unsafe { *ct.add(i * ldc + r + j) } } else { 0.0 };
                    }
                }
                // SAFETY: `tile` holds `m <= 8` rows of `nr <= 48` floats.
                unsafe { f(kc, xt, ldx, pp, tile.as_mut_ptr(), nr, true) };
                for i in 0..m {
                    for j in 0..nv {
                        // SAFETY: as above.
                        unsafe { *ct.add(i * ldc + r + j) = tile[i * nr + j] };
                    }
                }
            }
            r += nr;
        }
        t += m;
    }
}

/// [`block`] with the AVX-512 micro-kernels.
///
/// # Safety
/// As [`block`]; AVX-512F must be available.
#[allow(clippy::too_many_arguments, reason = "the GEMM operands")]
unsafe fn block_avx512(
    x: *const f32,
    ldx: usize,
    n: usize,
    p: *const f32,
    kc: usize,
    mr: usize,
    c: *mut f32,
    ldc: usize,
    acc_in: bool,
    pf: Prefetch,
) {
    fn pick<const M: usize>(v: usize) -> Ukr {
        match v {
            3 => ukr_avx512::<M, 3>,
            2 => ukr_avx512::<M, 2>,
            _ => ukr_avx512::<M, 1>,
        }
    }
    let ukr = |m: usize, v: usize| -> Ukr {
        match m {
            8 => pick::<8>(v),
            7 => pick::<7>(v),
            6 => pick::<6>(v),
            5 => pick::<5>(v),
            4 => pick::<4>(v),
            3 => pick::<3>(v),
            2 => pick::<2>(v),
            _ => pick::<1>(v),
        }
    };
    // SAFETY: forwarded from the caller.
    unsafe { block(8, 48, 16, &ukr, x, ldx, n, p, kc, mr, c, ldc, acc_in, pf) }
}

/// [`block`] with the AVX2 micro-kernels.
///
/// # Safety
/// As [`block`]; AVX2 and FMA must be available.
#[allow(clippy::too_many_arguments, reason = "the GEMM operands")]
unsafe fn block_avx2(
    x: *const f32,
    ldx: usize,
    n: usize,
    p: *const f32,
    kc: usize,
    mr: usize,
    c: *mut f32,
    ldc: usize,
    acc_in: bool,
    pf: Prefetch,
) {
    fn pick<const M: usize>(v: usize) -> Ukr {
        if v >= 2 { ukr_avx2::<M, 2> } else { ukr_avx2::<M, 1> }
    }
    let ukr = |m: usize, v: usize| -> Ukr {
        match m {
            6 => pick::<6>(v),
            5 => pick::<5>(v),
            4 => pick::<4>(v),
            3 => pick::<3>(v),
            2 => pick::<2>(v),
            _ => pick::<1>(v),
        }
    };
    // SAFETY: forwarded from the caller.
    unsafe { block(6, 16, 8, &ukr, x, ldx, n, p, kc, mr, c, ldc, acc_in, pf) }
}
