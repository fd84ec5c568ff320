//! The decode path of the 8-bit matmuls of the 32-element formats (Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0 weights × Q8_0/Q8_1 activations) on AMX int8
//! tiles, where the OS grants them: one token, a batch of decode rows, a
//! draft, gathered rows.
//!
//! The tiles' roles are the prompt path's ([`super::amx_int8`]) swapped:
//! 16 weight rows are the `A` operand, a pair of blocks (64 bytes) per
//! row in the pair-interleaved order the AVX-512 kernels unpack to
//! ([`LegacyLayout`] with `interleaved`), so a call's weights are only
//! unpacked, row by row into a panel of 16 rows, never transposed. A group
//! of `N` tokens (1, 2, 4 or 8) is the `B` operand, block-diagonal: column
//! `N·s + t` holds token `t`'s values of the pair's block `s` and zeros
//! where `A` holds the other block, so one `tdpbssd` gives each block's
//! exact integer dots separately, 16 rows × `N` tokens × 2 blocks. The
//! tokens are rearranged once per call. Each output then takes the blocks
//! in order, as in the prompt path:
//!
//! `acc = fma(C[r][t] as f32, dw[r] · da[t], acc)`, then, for the formats
//! with a minimum, `acc = fma(mw[r], s[t], acc)`.
//!
//! That is [`super::amx_int8`]'s `reference_dot`, bit for bit (tested): an
//! output depends only on its own token and weight row, so a decode row
//! gets the same bits alone, batched with other sequences, with a draft,
//! gathered, or in a prompt. A call's tokens are padded with zero tokens
//! up to a whole group, whose outputs are computed and never stored.
//!
//! Under [`TILE_TOKENS`] tokens (a lone decode step, a small batch) a tile
//! operation's fixed cost exceeds the work, and [`vnni`] computes the same
//! integer dots with `vpdpbusd`, ending in the same epilogue.

use std::arch::x86_64::*;

use super::{Job, SyncPtr, broadcast_work, pack_tokens, scratch_aligned};
use crate::dot::{avx512, fmt};
use crate::pool::ThreadPool;
use crate::pool::chunk_aligned;
use crate::quantize::{self, LegacyLayout};
use spinfer_kernel_base::tiles::{Tiles, dpbssd, dpbssd_pair};

mod vnni;

/// Weight rows per panel (the rows of the `A` and `C` tiles).
const R: usize = 16;
/// Calls of fewer tokens compute the tiles' integer dots with `vpdpbusd`
/// instead ([`vnni`]).
const TILE_TOKENS: usize = 8;

/// Lane `l` of the `N` accumulators' vector `z` is the output of row
/// `(16z + l) / N`, token `(16z + l) % N`; `rows` and `toks` are those
/// indices (for the `vpermps` that spread the rows' and the tokens' scales
/// over the lanes), `a` and `b` where the lane's sums of the pair's first
/// and second block are in the `C` tile's vectors `2z`, `2z + 1`
/// (`[16 rows][2N]` int32).
#[repr(C, align(64))]
struct Lanes {
    rows: [[i32; 16]; 8],
    toks: [[i32; 16]; 8],
    a: [i32; 16],
    b: [i32; 16],
}

const fn lanes(n: usize) -> Lanes {
    let mut t = Lanes { rows: [[0; 16]; 8], toks: [[0; 16]; 8], a: [0; 16], b: [0; 16] };
    let mut l = 0;
    while l < 16 {
        let mut z = 0;
        while z < n {
            t.rows[z][l] = ((16 * z + l) / n) as i32;
            t.toks[z][l] = ((16 * z + l) % n) as i32;
            z += 1;
        }
        t.a[l] = ((l / n) * 2 * n + l % n) as i32;
        t.b[l] = t.a[l] + n as i32;
        l += 1;
    }
    t
}

/// Indexed by `log2(N)`.
static LANES: [Lanes; 4] = [lanes(1), lanes(2), lanes(4), lanes(8)];

/// The group width for `n` tokens: the next of 1, 2, 4, 8.
fn group_width(n: usize) -> usize {
    n.clamp(1, 8).next_power_of_two()
}

/// Runs a job (dense or gathered rows, any number of tokens; the caller
/// checked [`super::amx_int8::available`]).
pub(super) fn run<const F: u8>(pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>) {
    run_from::<F>(pool, job, scratch, TILE_TOKENS);
}

/// [`run`], the tiles taking calls from `tile_tokens` tokens (the tests
/// run every group width on the tiles with 1, so that the threshold can
/// move without untested paths).
fn run_from<const F: u8>(pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>, tile_tokens: usize) {
    match group_width(job.n_tokens) {
        1 => run_n::<F, 1>(pool, job, scratch, tile_tokens),
        2 => run_n::<F, 2>(pool, job, scratch, tile_tokens),
        4 => run_n::<F, 4>(pool, job, scratch, tile_tokens),
        _ => run_n::<F, 8>(pool, job, scratch, tile_tokens),
    }
}

/// Byte offsets of one thread's panel: the rows' signed bytes (`16 ×
/// l.pairs × 64`), two `C` tiles and the outputs of one group (`[16
/// rows][N]`).
struct Panel {
    row: usize,
    c: usize,
    out: usize,
    bytes: usize,
}

impl Panel {
    fn new(l: &LegacyLayout) -> Self {
        let row = l.pairs * 64;
        let c = R * row;
        let out = c + 2 * 1024;
        Self { row, c, out, bytes: out + 1024 }
    }
}

fn run_n<const F: u8, const N: usize>(pool: &ThreadPool, job: &Job<'_>, scratch: &mut Vec<u8>, tile_tokens: usize) {
    let (n, cols, rows) = (job.n_tokens, job.desc.cols, job.out_rows());
    // `corr` lanes for the unsigned weights of the `vpdpbusd` path (Q8_0's
    // made unsigned by adding 128); the tiles take signed weights.
    let offset = if F == fmt::Q8_0 { 128 } else { fmt::offset(F) };
    let l = LegacyLayout::new(cols, true, offset);
    let groups = n.div_ceil(N);
    let tiles = n >= tile_tokens;
    // The tokens packed as for the other kernels (zero tokens up to whole
    // groups), then for the tiles per group and pair the `B` tile (16 rows
    // × 8N bytes), and per group and block the tokens' `d` and `s` (16
    // lanes each, zero past the call's tokens); then one panel per thread.
    let act_bytes = groups * N * l.stride;
    let b_bytes = if tiles { groups * l.pairs * 128 * N } else { 0 };
    let s_bytes = groups * l.blocks * 64;
    let panel = Panel::new(&l);
    let threads = pool.n_threads().max(1);
    let total = act_bytes + b_bytes + 2 * s_bytes.next_multiple_of(64) + threads * panel.bytes;
    let buf = scratch_aligned(scratch, total);
    let (act, rest) = buf.split_at_mut(act_bytes);
    let (b_tiles, rest) = rest.split_at_mut(b_bytes);
    let (da, rest) = rest.split_at_mut(s_bytes.next_multiple_of(64));
    let (sa, panels) = rest.split_at_mut(s_bytes.next_multiple_of(64));
    act[n * l.stride..].fill(0);
    pack_tokens(pool, job.x, cols, n, act, l.stride, &|x, dst| quantize::pack_legacy(&l, x, dst));
    arrange_scales::<N>(&l, act, n, da, sa);
    if tiles {
        arrange_tokens::<N>(&l, act, n, b_tiles);
    }
    let act = act.as_ptr() as usize;
    let (b_tiles, da, sa) = (b_tiles.as_ptr() as usize, da.as_ptr() as usize, sa.as_ptr() as usize);
    let panels = SyncPtr::new(panels.as_mut_ptr());
    let (w, rb) = (job.w.as_ptr() as usize, job.row_bytes);
    let out = job.out;
    broadcast_work(pool, job.macs(), &|ti, nt| {
        let rr = chunk_aligned(rows, ti, nt, R);
        if rr.is_empty() || ti >= threads {
            return;
        }
        let p = panels.get().wrapping_add(ti * panel.bytes);
        // SAFETY: the OS granted this process the tile data (`available`);
        // six tiles within 16 × 64 bytes (`8N` ≤ 64). Released on drop.
        let _tiles = tiles.then(|| unsafe { Tiles::configure(&tile_config(N)) });
        for r0 in rr.clone().step_by(R) {
            let nr = (rr.end - r0).min(R);
            let w_rows: [usize; R] = std::array::from_fn(|j| job.w_row(r0 + j.min(nr - 1)));
            if tiles {
                // SAFETY: the job's weight rows lie in the validated
                // weights; this thread's panel (`panel.bytes`, 64-aligned:
                // the sections before it are multiples of 64) is its own;
                // the CPU has AVX-512 (`available`).
                unsafe { unpack_panel::<F>(w as *const u8, rb, &w_rows, nr, &l, p, &panel) };
            }
            // The next panel's rows load while this one's tiles run.
            for r in (r0 + R..rr.end.min(r0 + 2 * R)).map(|r| job.w_row(r)) {
                prefetch(w as *const u8, r * rb, rb);
            }
            for g in 0..groups {
                let t0 = g * N;
                // SAFETY: group `g`'s `B` tiles and scales lie in the
                // buffers written above; the panel was just unpacked; this
                // thread configured the tiles.
                unsafe {
                    let gd = (da as *const f32).add(g * l.blocks * 16);
                    let gs = (sa as *const f32).add(g * l.blocks * 16);
                    let ctx = Ctx::new::<N>(&l, w as *const u8, &w_rows, rb, gd, gs);
                    if tiles {
                        let gb = (b_tiles as *const u8).add(g * l.pairs * 128 * N);
                        tile::<F, N>(&l, p, &panel, gb, &ctx);
                    } else {
                        let ga = (act as *const u8).add(t0 * l.stride);
                        vnni::tile::<F, N>(w as *const u8, rb, &w_rows, &l, ga, p, &panel, &ctx);
                    }
                }
                let res = p.wrapping_add(panel.out).cast::<f32>().cast_const();
                for t in 0..N.min(n - t0) {
                    for r in 0..nr {
                        // SAFETY: output `r * N + t` of the group (< 128);
                        // token `t0 + t < n`, row `r0 + r` of this thread's
                        // rows: inside `out` (`n × rows`), written only here.
                        unsafe { *out.get().add((t0 + t) * rows + r0 + r) = *res.add(r * N + t) };
                    }
                }
            }
        }
    });
}

/// Asks the CPU to load bytes `at..at + len` of `w` into the caches.
#[inline]
fn prefetch(w: *const u8, at: usize, len: usize) {
    for line in (at..at + len).step_by(64) {
        // SAFETY: a prefetch is only a hint; the address is not dereferenced.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(line).cast()) };
    }
}

/// `(bytes per row, rows)` of tmm0/1 (the int32 sums, 16 rows × `2N`),
/// tmm2/3 (16 weight rows' pairs of blocks, 64 bytes) and tmm4/5 (`N`
/// tokens' pairs, block-diagonal: 16 rows of `2N` × 4 bytes).
fn tile_config(n: usize) -> [(u16, u8); 6] {
    let nb = (8 * n) as u16;
    [(nb, 16), (nb, 16), (64, 16), (64, 16), (nb, 16), (nb, 16)]
}

/// Rearranges `n` packed tokens (pair-interleaved) into groups of `N`:
/// pair `p` of group `g` as the `B` tile at `(g · pairs + p) · 128N`
/// (byte `4c + i` of row `k`: for column `c = N·s + t`, token `gN + t`'s
/// byte `4k + i` of the pair if it belongs to block `s`, else 0).
fn arrange_tokens<const N: usize>(l: &LegacyLayout, act: &[u8], n: usize, b_tiles: &mut [u8]) {
    b_tiles.fill(0);
    for t in 0..n {
        let (g, tg) = (t / N, t % N);
        let tok = &act[t * l.stride..t * l.stride + l.pairs * 64];
        for (p, pair) in tok.chunks_exact(64).enumerate() {
            let tile = &mut b_tiles[(g * l.pairs + p) * 128 * N..][..128 * N];
            for (k, quad) in pair.chunks_exact(4).enumerate() {
                // Bytes 0..16 and 32..48 of a pair are its first block's.
                let s = (k / 4) % 2;
                tile[k * 8 * N + 4 * (s * N + tg)..][..4].copy_from_slice(quad);
            }
        }
    }
}

/// The `n` packed tokens' `d` and `s` of block `b`, group `g`, as 16
/// lanes at `(g · blocks + b) · 16` (zero past the call's tokens).
fn arrange_scales<const N: usize>(l: &LegacyLayout, act: &[u8], n: usize, da: &mut [u8], sa: &mut [u8]) {
    let nb = l.blocks;
    da.fill(0);
    sa.fill(0);
    for t in 0..n {
        let (g, tg) = (t / N, t % N);
        let tok = &act[t * l.stride..(t + 1) * l.stride];
        let (d, s) = (&tok[l.off_d..l.off_d + 4 * nb], &tok[l.off_s..l.off_s + 4 * nb]);
        // The f32s' bytes as they are.
        for (b, (db, sb)) in d.chunks_exact(4).zip(s.chunks_exact(4)).enumerate() {
            let lane = ((g * nb + b) * 16 + tg) * 4;
            da[lane..lane + 4].copy_from_slice(db);
            sa[lane..lane + 4].copy_from_slice(sb);
        }
    }
}

/// Unpacks weight rows `w_rows[..nr]` (`l.blocks` blocks of `F`, at `w +
/// row × rb`) into the panel at `p`: row `j`'s signed bytes at `j ×
/// panel.row`, pair-interleaved; rows from `nr` on are zero.
///
/// # Safety
/// Every listed row must be readable; `p` must be valid for
/// `panel.bytes` writes and 64-byte aligned; the CPU must have AVX-512
/// F/BW/VL/VNNI, F16C and FMA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack_panel<const F: u8>(
    w: *const u8,
    rb: usize,
    w_rows: &[usize; R],
    nr: usize,
    l: &LegacyLayout,
    p: *mut u8,
    panel: &Panel,
) {
    let (bs, nb) = (fmt::block_bytes(F), l.blocks);
    let off = _mm512_set1_epi8(fmt::offset(F) as i8);
    for (j, &row) in w_rows.iter().enumerate() {
        // SAFETY: row `j` of the panel.
        let q = unsafe { p.add(j * panel.row) };
        if j >= nr {
            // SAFETY: as above.
            unsafe { std::ptr::write_bytes(q, 0, panel.row) };
            continue;
        }
        let src = w.wrapping_add(row * rb);
        for pr in 0..l.pairs {
            let b = 2 * pr;
            let pair = b + 1 < nb;
            // SAFETY: blocks `b` (and `b + 1`) of the row are readable; the
            // panel row has `pairs × 64` bytes.
            unsafe {
                let v = if F == fmt::Q8_0 {
                    // [a 0..32, b 0..32] → [a 0..16, b 0..16, a 16..32, b 16..32].
                    let a = _mm256_loadu_si256(src.add(b * bs + 2).cast());
                    let c = if pair {
                        _mm256_loadu_si256(src.add((b + 1) * bs + 2).cast())
                    } else {
                        _mm256_setzero_si256()
                    };
                    let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), c);
                    _mm512_shuffle_i64x2::<0b11_01_10_00>(v, v)
                } else if fmt::offset(F) != 0 {
                    let v = avx512::unpack_pair::<F>(src.add(b * bs), pair);
                    let v = _mm512_sub_epi8(v, off);
                    if pair { v } else { _mm512_maskz_mov_epi8(0x0000_FFFF_0000_FFFF, v) }
                } else {
                    avx512::unpack_pair::<F>(src.add(b * bs), pair)
                };
                _mm512_store_si512(q.add(pr * 64).cast(), v);
            }
        }
    }
}

/// One group: the outputs of the panel's 16 rows × `N` tokens (`bt`: the
/// group's `B` tiles, `ctx`: its scales) over all blocks, into the
/// panel's output section as `[row][token]`.
///
/// # Safety
/// The thread's tile configuration ([`tile_config`]`(N)`) must be loaded;
/// the panel must hold an [`unpack_panel`] output; `bt`, `da`, `sa` one
/// group of [`arrange_tokens`], `ctx` of the panel and the group; the CPU
/// must have AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn tile<const F: u8, const N: usize>(l: &LegacyLayout, p: *mut u8, panel: &Panel, bt: *const u8, ctx: &Ctx<'_>) {
    let mut acc = [_mm512_setzero_ps(); N];
    // SAFETY: sections of the caller's panel.
    let (c0, c1) = unsafe { (p.add(panel.c), p.add(panel.c + 1024)) };
    let (lda, ldb, pb) = (panel.row, 8 * N, 128 * N);
    let mut pr = 0;
    while pr + 1 < l.pairs {
        // SAFETY: the caller's contract; tmm0/1 take the sums of pairs `pr`
        // and `pr + 1`, tmm2/3 the rows' pairs, tmm4/5 the tokens'; then
        // their shares.
        unsafe {
            let (a2, b2) = ([p.add(pr * 64), p.add((pr + 1) * 64)], [bt.add(pr * pb), bt.add((pr + 1) * pb)]);
            dpbssd_pair(a2.map(<*mut u8>::cast_const), lda, b2, ldb, [c0, c1], ldb);
            epilogue::<F, N>(&mut acc, ctx, 2 * pr, &tile_sums::<N>(ctx, c0));
            epilogue::<F, N>(&mut acc, ctx, 2 * pr + 2, &tile_sums::<N>(ctx, c1));
        }
        pr += 2;
    }
    if pr < l.pairs {
        // SAFETY: as above, one pair.
        unsafe {
            dpbssd(p.add(pr * 64), lda, bt.add(pr * pb), ldb, c0, ldb);
            epilogue::<F, N>(&mut acc, ctx, 2 * pr, &tile_sums::<N>(ctx, c0));
        }
    }
    for (z, acc) in acc.iter().enumerate() {
        // SAFETY: the output section holds 256 f32; `16z + 16 <= 16N`.
        unsafe { _mm512_storeu_ps(p.add(panel.out).cast::<f32>().add(16 * z), *acc) };
    }
}

/// What [`epilogue`] reads besides the sums: the lane tables, the panel's
/// rows (`heads`: their byte offsets from `w`, two vectors of 8 i64, from
/// which their blocks' scales are gathered) and the group's scales.
struct Ctx<'a> {
    lanes: &'a Lanes,
    w: *const u8,
    heads: [__m512i; 2],
    da: *const f32,
    sa: *const f32,
    nb: usize,
}

impl Ctx<'static> {
    /// The context of the weight rows `w_rows` (`rb` bytes each from `w`)
    /// and a group's scales `da`, `sa` (`N` is the group width).
    #[target_feature(enable = "avx512f")]
    fn new<const N: usize>(
        l: &LegacyLayout,
        w: *const u8,
        w_rows: &[usize; R],
        rb: usize,
        da: *const f32,
        sa: *const f32,
    ) -> Self {
        let offsets = w_rows.map(|r| (r * rb) as i64);
        // SAFETY: 8 i64 each.
        let heads = unsafe { [0, 8].map(|i| _mm512_loadu_si512(offsets[i..].as_ptr().cast())) };
        Self { lanes: &LANES[N.trailing_zeros() as usize], w, heads, da, sa, nb: l.blocks }
    }
}

/// The 16 rows' `d` and `m` (0 for the formats without a minimum) of block
/// `b`, gathered from the blocks' first four bytes.
///
/// # Safety
/// Block `b` of each of the context's rows must be readable; the CPU must
/// have AVX-512 F and F16C.
#[inline(always)]
unsafe fn row_scales<const F: u8>(x: &Ctx<'_>, b: usize) -> [__m512; 2] {
    let base = x.w.wrapping_add(b * fmt::block_bytes(F));
    // SAFETY: the caller's contract (the function is inlined into the
    // tile functions, whose AVX-512 it uses).
    unsafe {
        let lo = _mm512_i64gather_epi32::<1>(x.heads[0], base.cast());
        let hi = _mm512_i64gather_epi32::<1>(x.heads[1], base.cast());
        let g = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
        let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        let m = if fmt::has_min(F) {
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)))
        } else {
            _mm512_setzero_ps()
        };
        [d, m]
    }
}

/// The pair's sums of a `C` tile at `c` (`[16][2N]` int32), in the
/// accumulators' lanes: `[z][s]` holds block `s`'s sums of vector `z`.
///
/// # Safety
/// `c` must hold `2N` vectors; the CPU must have AVX-512 F.
#[inline(always)]
unsafe fn tile_sums<const N: usize>(x: &Ctx<'_>, c: *const u8) -> [[__m512i; 2]; N] {
    // SAFETY: the caller's contract; the tables are 64-byte aligned.
    unsafe {
        let ia = _mm512_load_si512(x.lanes.a.as_ptr().cast());
        let ib = _mm512_load_si512(x.lanes.b.as_ptr().cast());
        std::array::from_fn(|z| {
            let lo = _mm512_loadu_si512(c.add(128 * z).cast());
            let hi = _mm512_loadu_si512(c.add(128 * z + 64).cast());
            [_mm512_permutex2var_epi32(lo, ia, hi), _mm512_permutex2var_epi32(lo, ib, hi)]
        })
    }
}

/// The share of blocks `b` and `b + 1` (if it exists) of the group, from
/// the pair's exact integer sums (`sums[z][s]`: block `s`'s, in the lanes
/// of accumulator `z`): each sum times `dw · da`, plus `mw · s` for the
/// formats with a minimum, block `b` first. Both ways of computing the
/// sums end here, so their outputs are the same bits.
///
/// # Safety
/// As for [`tile`]. Only called from the tile functions, into which it is
/// inlined (so that the accumulators stay in registers and the intrinsics
/// see their AVX-512).
#[inline(always)]
unsafe fn epilogue<const F: u8, const N: usize>(
    acc: &mut [__m512; N],
    x: &Ctx<'_>,
    b: usize,
    sums: &[[__m512i; 2]; N],
) {
    // SAFETY: blocks `b` (and `b + 1`) of the rows and of the group's
    // scales, per the caller's contract.
    unsafe {
        for (half, bb) in (b..(b + 2).min(x.nb)).enumerate() {
            let [dwv, mwv] = row_scales::<F>(x, bb);
            let dav = _mm512_loadu_ps(x.da.add(bb * 16));
            let sav = if fmt::has_min(F) { _mm512_loadu_ps(x.sa.add(bb * 16)) } else { _mm512_setzero_ps() };
            for (z, acc) in acc.iter_mut().enumerate() {
                let ri = _mm512_load_si512(x.lanes.rows[z].as_ptr().cast());
                let ti = _mm512_load_si512(x.lanes.toks[z].as_ptr().cast());
                let ci = _mm512_cvtepi32_ps(sums[z][half]);
                let s = _mm512_mul_ps(_mm512_permutexvar_ps(ri, dwv), _mm512_permutexvar_ps(ti, dav));
                *acc = _mm512_fmadd_ps(ci, s, *acc);
                if fmt::has_min(F) {
                    *acc = _mm512_fmadd_ps(_mm512_permutexvar_ps(ri, mwv), _mm512_permutexvar_ps(ti, sav), *acc);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::super::amx_int8::{available, reference_dot, test_weights};
    use super::*;
    use crate::GgmlType;
    use crate::kernel::{MatmulCall, MatmulKernel, Select};
    use crate::matmul::{Isa, Kernel};

    fn check<const F: u8>(ty: GgmlType) {
        let act = if fmt::has_min(F) { crate::kernel::ActType::Q8_1 } else { crate::kernel::ActType::Q8_0 };
        let mut r = StdRng::seed_from_u64(u64::from(F) + 11);
        let pool = ThreadPool::new(2);
        for (rows, cols, ns) in
            [(16, 32, &[1, 2][..]), (45, 96, &[1, 3, 5, 17]), (70, 576, &[2, 16, 33]), (7, 64, &[4, 9])]
        {
            let w = test_weights::<F>(&mut r, rows, cols);
            let rb = w.len() / rows;
            let desc = crate::kernel::MatmulDesc::dense(ty, act, rows, cols);
            let k = Kernel::new(desc, Isa::Avx512);
            let idx: Vec<u32> = (0..rows as u32).rev().step_by(2).collect();
            for &n in ns {
                let x: Vec<f32> = (0..n * cols).map(|_| r.random_range(-2.0..2.0)).collect();
                let run = |select: Select<'_>, out_rows: usize| {
                    let mut out = vec![f32::NAN; n * out_rows];
                    let mut scratch = Vec::new();
                    let call = MatmulCall {
                        w: &w,
                        select,
                        x: &x,
                        n_tokens: n,
                        out: &mut out,
                        scratch: &mut scratch,
                        prefill: false,
                    };
                    k.run(&pool, call).expect("runs");
                    out
                };
                let dense = run(Select::All, rows);
                let gathered = run(Select::Rows(&idx), idx.len());
                // Every group width on the tiles, as any `TILE_TOKENS`
                // would run them.
                let mut tiled = vec![f32::NAN; n * rows];
                let job = Job {
                    desc,
                    row_bytes: rb,
                    w: &w,
                    idx: None,
                    x: &x,
                    n_tokens: n,
                    out: SyncPtr::new(tiled.as_mut_ptr()),
                    prefill: false,
                };
                run_from::<F>(&pool, &job, &mut Vec::new(), 1);
                for (t, (a, b)) in tiled.iter().zip(&dense).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty} {rows}x{cols}, {n} tokens on the tiles: output {t}");
                }
                let l = LegacyLayout::new(cols, false, 0);
                let mut packed = vec![0u8; l.stride + 64];
                let off = packed.as_ptr().align_offset(64);
                for t in 0..n {
                    quantize::pack_legacy(&l, &x[t * cols..(t + 1) * cols], &mut packed[off..off + l.stride]);
                    for j in 0..rows {
                        let want = reference_dot::<F>(&l, &w[j * rb..(j + 1) * rb], &packed[off..off + l.stride]);
                        let got = dense[t * rows + j];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{ty} {rows}x{cols}, {n} tokens: out[{t}, {j}] = {got}, model {want}"
                        );
                    }
                    for (i, &j) in idx.iter().enumerate() {
                        let (g, d) = (gathered[t * idx.len() + i], dense[t * rows + j as usize]);
                        assert_eq!(g.to_bits(), d.to_bits(), "{ty}: gathered row {j} of token {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn decode_path_matches_the_prompt_model_bit_for_bit() {
        if !available() {
            eprintln!("skipped: AMX int8 is not granted here (decode runs on the vpdpbusd tiles)");
            return;
        }
        check::<{ fmt::Q4_0 }>(GgmlType::Q4_0);
        check::<{ fmt::Q4_1 }>(GgmlType::Q4_1);
        check::<{ fmt::Q5_0 }>(GgmlType::Q5_0);
        check::<{ fmt::Q5_1 }>(GgmlType::Q5_1);
        check::<{ fmt::Q8_0 }>(GgmlType::Q8_0);
    }
}
