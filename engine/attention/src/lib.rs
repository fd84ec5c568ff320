//! Causal attention over one layer's KV cache of one sequence, where
//! position `p` sits in slot `p % slots` (a ring for a local layer).
//!
//! A decode row's head ([`attend_row`]) is dot products, a softmax and
//! weighted sums of values. A block of a prompt's consecutive rows
//! ([`attend_block`]) is two GEMMs per head (`Q·Kᵀ`, then `P·V`) over the
//! block's keys, each row masked to its own span. A GEMM output is one FMA
//! chain in key order, and a masked key adds an exact zero, so a prompt
//! row gets the same numbers whatever block it falls in: however its
//! prompt was chunked or batched with others.
//!
//! The cache's rows may be f32 or f16 ([`KvElem`]): each value is widened
//! exactly, so attention over an f16 cache is the f32 attention over the
//! cache's values as stored.

use std::cell::RefCell;
use std::ops::Range;

use spinfer_kernels::elem::{KvElem, widen_rows};
use spinfer_kernels::matmul::{BLayout, sgemm};
use spinfer_kernels::vec::{axpy_rows, dot_rows, softmax};

/// One layer's cache: position `p` in slot `p % slots`.
pub struct Cache<'a, E: KvElem = f32> {
    pub keys: &'a [E],   // (slots, kv_dim)
    pub values: &'a [E], // (slots, kv_dim)
    pub slots: usize,
    pub kv_dim: usize,
    /// The local layers' window (0: every layer is global).
    pub window: usize,
}

impl<E: KvElem> Cache<'_, E> {
    /// The positions a query at `p` attends to: all up to `p`, or the last
    /// `window` of them in a `local` layer.
    pub fn span(&self, p: usize, local: bool) -> Range<usize> {
        let window = if local && self.window > 0 { self.window } else { usize::MAX };
        (p + 1).saturating_sub(window)..p + 1
    }

    /// The rows of contiguous `slots` of `m` (the keys or the values), from
    /// column `kv_off`, the last one cut at `hd` floats: a strided matrix
    /// of `slots.len()` rows `kv_dim` apart.
    fn run<'m, T>(&self, m: &'m [T], slots: &Range<usize>, kv_off: usize, hd: usize) -> &'m [T] {
        &m[slots.start * self.kv_dim + kv_off..][..(slots.len() - 1) * self.kv_dim + hd]
    }
}

/// Keys per block of [`attend_group`]: the block's rows of one kv head
/// (256 bytes each at 64 dims) stay in L1 while every query head of the
/// group reads them.
const KEY_BLOCK: usize = 64;

/// [`attend_row`] for the query heads that share one kv head (GQA): `q`
/// holds their queries and `out` receives their outputs, `hd` floats
/// each, back to back; `sc` needs `heads × span` floats. Keys and values
/// are read once per block of 64 positions (`KEY_BLOCK`) for all the heads
/// instead of once per head (the cache is the largest read of a decode
/// step at long contexts), and each head's output is [`attend_row`]'s bit
/// for bit: every score is the same dot product, and every output element
/// the same FMA chain in position order.
#[allow(clippy::too_many_arguments, reason = "the cache, the row's position and its heads' operands")]
pub fn attend_group<E: KvElem>(
    kv: &Cache<'_, E>,
    p: usize,
    local: bool,
    kv_off: usize,
    hd: usize,
    q: &[f32],
    sc: &mut [f32],
    out: &mut [f32],
) {
    let heads = q.len() / hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let span = kv.span(p, local);
    let n = span.len();
    let sc = &mut sc[..heads * n];
    let out = &mut out[..heads * hd];
    for (cols, slots) in blocks(&span, kv.slots) {
        let k = kv.run(kv.keys, &slots, kv_off, hd);
        for h in 0..heads {
            dot_rows(&q[h * hd..(h + 1) * hd], k, kv.kv_dim, &mut sc[h * n..][cols.clone()]);
        }
    }
    for s in sc.chunks_exact_mut(n) {
        s.iter_mut().for_each(|s| *s *= scale);
        softmax(s);
    }
    out.fill(0.0);
    for (cols, slots) in blocks(&span, kv.slots) {
        let v = kv.run(kv.values, &slots, kv_off, hd);
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            axpy_rows(&sc[h * n..][cols.clone()], v, kv.kv_dim, o);
        }
    }
}

/// [`pieces`] cut into runs of at most [`KEY_BLOCK`] slots, in position
/// order.
fn blocks(keys: &Range<usize>, slots: usize) -> impl Iterator<Item = (Range<usize>, Range<usize>)> {
    pieces(keys, slots).flat_map(|(cols, sl)| {
        (0..cols.len()).step_by(KEY_BLOCK).map(move |i| {
            let len = KEY_BLOCK.min(cols.len() - i);
            (cols.start + i..cols.start + i + len, sl.start + i..sl.start + i + len)
        })
    })
}

/// One head of one row at position `p`: `out = softmax(q·Kᵀ · scale) · V`
/// over the row's span, keys and values at column `kv_off` of the cache.
pub fn attend_row<E: KvElem>(
    kv: &Cache<'_, E>,
    p: usize,
    local: bool,
    kv_off: usize,
    q: &[f32],
    sc: &mut [f32],
    out: &mut [f32],
) {
    attend_group(kv, p, local, kv_off, q.len(), q, sc, out);
}

/// The query heads of one kv head for a block of prompt rows at
/// positions `first..first + len`.
pub struct Block {
    pub first: usize,
    pub len: usize,
    /// Column of the kv head's keys and values in the cache.
    pub kv_off: usize,
    pub hd: usize,
    /// Query heads (consecutive, `hd` floats apart in a row's query).
    pub heads: usize,
    /// Stride between the rows' queries.
    pub ld_q: usize,
}

thread_local! {
    /// The packed operand of this thread's attention GEMMs.
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// An f16 cache's keys and values of one block, widened to f32.
    static WIDE: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// [`attend_row`] for every row and head of `b`, each head as two GEMMs:
/// `scores (len × keys) = Q·Kᵀ` over the union of the rows' spans, each
/// row's span scaled and softmaxed and the rest zeroed, then `outs (len ×
/// hd) = P·V`, handed to `emit(head, outs)`. `q` starts at the first
/// row's first head (rows `b.ld_q` apart). A span that wraps around a
/// local layer's ring is two pieces, in position order. An f16 cache's
/// keys and values are widened to f32 once for all the heads.
pub fn attend_block<E: KvElem>(
    kv: &Cache<'_, E>,
    b: &Block,
    local: bool,
    q: &[f32],
    scores: &mut [f32],
    outs: &mut [f32],
    emit: &mut dyn FnMut(usize, &[f32]),
) {
    let hd = b.hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let last = b.first + b.len - 1;
    let keys = kv.span(b.first, local).start..last + 1;
    let n = keys.len();
    let outs = &mut outs[..b.len * hd];
    PACKED.with_borrow_mut(|packed| {
        let (mut wide_k, mut wide_v) = WIDE.take();
        let k_pieces = f32_pieces(kv, kv.keys, &keys, b.kv_off, hd, &mut wide_k);
        let v_pieces = f32_pieces(kv, kv.values, &keys, b.kv_off, hd, &mut wide_v);
        for h in 0..b.heads {
            let q = &q[h * hd..][..(b.len - 1) * b.ld_q + hd];
            // Scores, piece by piece of contiguous rows.
            for (cols, k, ld) in k_pieces.iter().flatten() {
                let c = &mut scores[cols.start..][..(b.len - 1) * n + cols.len()];
                sgemm(b.len, cols.len(), hd, q, b.ld_q, k, *ld, BLayout::Transposed, c, n, false, packed);
            }
            // Each row's own span: scaled and softmaxed; the rest weighs 0.
            for i in 0..b.len {
                let span = kv.span(b.first + i, local);
                let row = &mut scores[i * n..(i + 1) * n];
                let own = span.start - keys.start..span.end - keys.start;
                row[..own.start].fill(0.0);
                row[own.end..].fill(0.0);
                row[own.clone()].iter_mut().for_each(|s| *s *= scale);
                softmax(&mut row[own]);
            }
            // Weighted values, accumulated piece by piece in position order.
            for (i, (cols, v, ld)) in v_pieces.iter().flatten().enumerate() {
                let p = &scores[cols.start..][..(b.len - 1) * n + cols.len()];
                sgemm(b.len, hd, cols.len(), p, n, v, *ld, BLayout::Normal, outs, hd, i > 0, packed);
            }
            emit(h, outs);
        }
        WIDE.set((wide_k, wide_v));
    });
}

/// One piece of a block's keys or values as f32: the block's score
/// columns it covers, its rows and their stride.
type Piece<'a> = (Range<usize>, &'a [f32], usize);

/// The rows of the positions `keys` of `m` (keys or values) at column
/// `kv_off`, as f32 pieces in position order: an f32 cache's own ring
/// [`pieces`]; an f16 cache's rows widened into `buf`, one piece.
fn f32_pieces<'a, E: KvElem>(
    kv: &Cache<'a, E>,
    m: &'a [E],
    keys: &Range<usize>,
    kv_off: usize,
    hd: usize,
    buf: &'a mut Vec<f32>,
) -> [Option<Piece<'a>>; 2] {
    let mut out = [None, None];
    if let Some(m) = E::as_f32(m) {
        for (o, (cols, slots)) in out.iter_mut().zip(pieces(keys, kv.slots)) {
            *o = Some((cols, kv.run(m, &slots, kv_off, hd), kv.kv_dim));
        }
        return out;
    }
    buf.clear();
    for (_, slots) in pieces(keys, kv.slots) {
        widen_rows(kv.run(m, &slots, kv_off, hd), slots.len(), kv.kv_dim, hd, buf);
    }
    out[0] = Some((0..keys.len(), &buf[..], hd));
    out
}

/// The positions `keys` as at most two runs of contiguous ring slots:
/// `(columns of the block's scores, slots)`.
fn pieces(keys: &Range<usize>, slots: usize) -> impl Iterator<Item = (Range<usize>, Range<usize>)> {
    let start = keys.start % slots;
    let first = keys.len().min(slots - start);
    [(0..first, start..start + first), (first..keys.len(), 0..keys.len() - first)]
        .into_iter()
        .filter(|(c, _)| !c.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A random cache of `slots` positions (a ring when `window > 0`) of 2
    /// kv heads of 16 dims.
    fn cache(slots: usize, window: usize, seed: u64) -> (Vec<f32>, Vec<f32>, usize, usize) {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        let kv_dim = 32;
        let mut v = || (0..slots * kv_dim).map(|_| r.random_range(-2.0f32..2.0)).collect::<Vec<_>>();
        (v(), v(), slots, window)
    }

    /// Rows at positions `first..first + len` of one head (queries
    /// `ld_q = 48` apart), by blocks of `split` rows.
    fn by_blocks<E: KvElem>(
        kv: &Cache<'_, E>,
        q: &[f32],
        first: usize,
        len: usize,
        split: usize,
        local: bool,
    ) -> Vec<f32> {
        let (hd, ld_q) = (16, 48);
        let mut out = vec![0.0; len * hd];
        let mut scores = vec![f32::NAN; 12 * 256];
        let mut outs = vec![f32::NAN; 12 * hd];
        for b0 in (0..len).step_by(split) {
            let n = split.min(len - b0);
            let b = Block { first: first + b0, len: n, kv_off: 16, hd, heads: 1, ld_q };
            let mut emit = |_: usize, o: &[f32]| out[b0 * hd..(b0 + n) * hd].copy_from_slice(o);
            attend_block(kv, &b, local, &q[b0 * ld_q..], &mut scores, &mut outs, &mut emit);
        }
        out
    }

    /// A block's rows agree with the row-by-row path (within f32
    /// reassociation) and do not depend on how the rows are blocked, bit
    /// for bit: global layers, and a local layer whose keys wrap around
    /// its ring.
    #[test]
    fn blocks_match_rows_and_each_other() {
        let mut r = rand::rngs::StdRng::seed_from_u64(5);
        let q: Vec<f32> = (0..12 * 48).map(|_| r.random_range(-1.0f32..1.0)).collect();
        for (slots, window, local, first) in
            [(40, 0, false, 0), (40, 0, false, 17), (20, 8, true, 30), (20, 8, true, 7)]
        {
            let (keys, values, slots, window) = cache(slots, window, first as u64);
            let kv = Cache { keys: &keys, values: &values, slots, kv_dim: 32, window };
            let len = 12;
            let whole = by_blocks(&kv, &q, first, len, 12, local);
            for split in [1, 5, 7] {
                assert_eq!(
                    by_blocks(&kv, &q, first, len, split, local),
                    whole,
                    "slots {slots} first {first} split {split}"
                );
            }
            let mut sc = vec![0.0; 64];
            for i in 0..len {
                let mut row = vec![0.0; 16];
                attend_row(&kv, first + i, local, 16, &q[i * 48..i * 48 + 16], &mut sc, &mut row);
                for (d, (&a, &b)) in row.iter().zip(&whole[i * 16..(i + 1) * 16]).enumerate() {
                    assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "row {i} dim {d}: {a} vs {b}");
                }
            }
        }
    }

    /// The heads of a group get exactly [`attend_row`]'s outputs, over
    /// spans of several key blocks: a global layer, and a local layer
    /// whose window wraps around its ring.
    #[test]
    fn a_group_of_heads_equals_each_head_alone() {
        let mut r = rand::rngs::StdRng::seed_from_u64(9);
        let (hd, heads) = (16, 3);
        let q: Vec<f32> = (0..heads * hd).map(|_| r.random_range(-1.0f32..1.0)).collect();
        for (slots, window, local, p) in
            [(200, 0, false, 170), (200, 0, false, 0), (100, 90, true, 250), (100, 90, true, 40)]
        {
            let (keys, values, slots, window) = cache(slots, window, p as u64);
            let kv = Cache { keys: &keys, values: &values, slots, kv_dim: 32, window };
            let mut sc = vec![f32::NAN; heads * 200];
            let mut group = vec![f32::NAN; heads * hd];
            attend_group(&kv, p, local, 16, hd, &q, &mut sc, &mut group);
            for h in 0..heads {
                let mut alone = vec![f32::NAN; hd];
                attend_row(&kv, p, local, 16, &q[h * hd..(h + 1) * hd], &mut sc, &mut alone);
                assert_eq!(
                    group[h * hd..(h + 1) * hd].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "slots {slots} p {p} head {h}"
                );
            }
        }
    }

    /// An f16 cache gives, bit for bit, the f32 attention over its values
    /// widened: decode groups and prompt blocks, a global layer and a
    /// local one whose window wraps around its ring.
    #[test]
    fn an_f16_cache_is_the_f32_cache_of_its_values() {
        use half::f16;
        let mut r = rand::rngs::StdRng::seed_from_u64(11);
        let (hd, heads) = (16, 3);
        let q: Vec<f32> = (0..12 * 48).map(|_| r.random_range(-1.0f32..1.0)).collect();
        for (slots, window, local, p) in [(200, 0, false, 170), (100, 90, true, 250), (40, 0, false, 17)] {
            let (keys, values, slots, window) = cache(slots, window, p as u64);
            let half = |m: &[f32]| m.iter().map(|&x| <f16 as KvElem>::from_f32(x)).collect::<Vec<f16>>();
            let (k16, v16) = (half(&keys), half(&values));
            let wide = |m: &[f16]| m.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
            let (kw, vw) = (wide(&k16), wide(&v16));
            let c16 = Cache { keys: &k16, values: &v16, slots, kv_dim: 32, window };
            let c32 = Cache { keys: &kw, values: &vw, slots, kv_dim: 32, window };
            let mut sc = vec![f32::NAN; heads * 200];
            let (mut g16, mut g32) = (vec![f32::NAN; heads * hd], vec![f32::NAN; heads * hd]);
            attend_group(&c16, p, local, 16, hd, &q[..heads * hd], &mut sc, &mut g16);
            attend_group(&c32, p, local, 16, hd, &q[..heads * hd], &mut sc, &mut g32);
            assert_eq!(bits(&g16), bits(&g32), "group: slots {slots} p {p}");
            let first = p.saturating_sub(11);
            assert_eq!(
                bits(&by_blocks(&c16, &q, first, 12, 5, local)),
                bits(&by_blocks(&c32, &q, first, 12, 5, local)),
                "blocks: slots {slots} p {p}"
            );
        }
    }

    /// A block's query heads of one kv head, run together (the keys and
    /// values widened once), each get what they get alone, bit for bit,
    /// with f32 and f16 caches.
    #[test]
    fn a_block_of_heads_equals_each_head_alone() {
        use half::f16;
        let mut r = rand::rngs::StdRng::seed_from_u64(13);
        let (hd, ld_q, heads, len) = (16, 48, 3, 7);
        let q: Vec<f32> = (0..len * ld_q).map(|_| r.random_range(-1.0f32..1.0)).collect();
        for (slots, window, local, first) in [(60, 0, false, 30), (20, 8, true, 30)] {
            let (keys, values, slots, window) = cache(slots, window, first as u64);
            let (k16, v16): (Vec<f16>, Vec<f16>) =
                (keys.iter().map(|&x| f16::from_f32(x)).collect(), values.iter().map(|&x| f16::from_f32(x)).collect());
            let c16 = Cache { keys: &k16, values: &v16, slots, kv_dim: 32, window };
            let c32 = Cache { keys: &keys, values: &values, slots, kv_dim: 32, window };
            fn run<E: KvElem>(kv: &Cache<'_, E>, b: &Block, local: bool, q: &[f32]) -> Vec<Vec<f32>> {
                let (mut scores, mut outs) = (vec![f32::NAN; 12 * 256], vec![f32::NAN; 12 * 16]);
                let mut got = vec![Vec::new(); b.heads];
                attend_block(kv, b, local, q, &mut scores, &mut outs, &mut |h, o| got[h] = o.to_vec());
                got
            }
            let together = Block { first, len, kv_off: 16, hd, heads, ld_q };
            let (g32, g16) = (run(&c32, &together, local, &q), run(&c16, &together, local, &q));
            for h in 0..heads {
                let alone = Block { heads: 1, ..together };
                assert_eq!(bits(&g32[h]), bits(&run(&c32, &alone, local, &q[h * hd..])[0]), "f32 head {h}");
                assert_eq!(bits(&g16[h]), bits(&run(&c16, &alone, local, &q[h * hd..])[0]), "f16 head {h}");
            }
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }
}
