//! Causal attention over the caches of the sequences of one forward step:
//! one request's prompt, or several requests decoding together
//! ([`Model::forward_batch`]), or both.
//!
//! A decode row's head is dot products, a softmax and weighted sums of
//! values. A prompt's rows are taken in blocks of [`QUERY_BLOCK`]
//! consecutive positions; each head of a block is two GEMMs (`Q·Kᵀ`, then
//! `P·V`) over the block's keys, each row masked to its own span. A GEMM
//! output is one FMA chain in key order, and a masked key adds an exact
//! zero, so a prompt row gets the same numbers whatever block it falls in:
//! however its prompt was chunked or batched with others.

use std::cell::RefCell;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};

use spinfer_kernels::matmul::{BLayout, sgemm};
use spinfer_kernels::pool::{SyncPtr, ThreadPool};

use super::Model;
use super::kv::{KvCache, LayerKv, RowPos};

use crate::model::math;

/// Query rows of one prompt whose attention runs as one pair of GEMMs per
/// head.
pub(super) const QUERY_BLOCK: usize = 12;

/// Floats of one thread's scratch: a block's scores (`QUERY_BLOCK ×
/// score_len`) and outputs (`QUERY_BLOCK × head_dim`).
pub(super) fn scratch_floats(score_len: usize, head_dim: usize) -> usize {
    QUERY_BLOCK.saturating_mul(score_len.saturating_add(head_dim))
}

/// The operands of one layer's attention for every row of a step.
pub(super) struct Attention<'a> {
    pub pool: &'a ThreadPool,
    pub seqs: &'a [&'a mut KvCache],
    pub rows: &'a [RowPos],
    /// The step's rows as runs of `(rows, prompt)` (the matmuls' roles).
    pub roles: &'a [(usize, bool)],
    pub q: &'a [f32],          // (rows, n_heads * head_dim)
    pub att: &'a mut [f32],    // (rows, n_heads * head_dim): the output
    pub scores: &'a mut [f32], // (threads, scratch_floats(score_len, head_dim))
    pub score_len: usize,
    /// The work items' buffer (kept by the session: decode allocates
    /// nothing).
    pub items: &'a mut Vec<Item>,
}

/// A unit of work: one head of one decode row, or one head of a block of
/// consecutive prompt rows of one sequence.
#[derive(Clone, Copy)]
pub(super) struct Item {
    /// First row of the step, and number of rows.
    t: usize,
    len: usize,
    head: usize,
    prompt: bool,
    /// Keys read, summed over the rows: items go out costliest first.
    cost: usize,
}

impl Model {
    /// Causal multi-head attention of layer `l` for every row (GQA: each kv
    /// head serves n_heads / n_kv_heads query heads), each row over its own
    /// sequence's cache up to its position, a `local` layer over its window
    /// only. The work items go to the threads from a shared counter,
    /// costliest first (a prompt's late rows see more keys than its first).
    pub(super) fn attention(&self, a: Attention<'_>, l: usize, local: bool) {
        let (hd, n_heads) = (self.config.head_dim, self.config.n_heads);
        let Attention { pool, seqs, rows, roles, q, att, scores, score_len, items } = a;
        let per_thread = scratch_floats(score_len, hd);
        assert!(att.len() >= rows.len() * n_heads * hd && scores.len() >= pool.n_threads() * per_thread);
        plan(rows, roles, n_heads, items);
        let items = &*items;
        let next = AtomicUsize::new(0);
        let att = SyncPtr::new(att.as_mut_ptr());
        let scores = SyncPtr::new(scores.as_mut_ptr());
        pool.broadcast(&|ti, _| {
            // SAFETY: thread `ti` uses only its own `per_thread` floats of
            // `scores` (the buffer holds `threads * per_thread`, asserted
            // above), which outlives the broadcast.
            let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ti * per_thread), per_thread) };
            while let Some(&it) = items.get(next.fetch_add(1, Ordering::Relaxed)) {
                let kv = seqs[rows[it.t].seq].layer(l);
                // SAFETY: the item's rows `it.t..it.t + it.len`, head
                // `it.head`, of `att` (which holds every row, asserted
                // above) belong to it alone: items are disjoint (row, head)
                // sets, each handed out once by the counter.
                let out = |i: usize| unsafe {
                    std::slice::from_raw_parts_mut(att.get().add(((it.t + i) * n_heads + it.head) * hd), hd)
                };
                let qrow = |i: usize| &q[((it.t + i) * n_heads + it.head) * hd..][..hd];
                let kv_off = it.head / (n_heads / self.config.n_kv_heads) * hd;
                let first = rows[it.t].pos;
                if it.prompt {
                    let (scores, outs) = sc.split_at_mut(QUERY_BLOCK * score_len);
                    let block = Block { first, len: it.len, kv_off, hd, ld_q: n_heads * hd };
                    attend_block(&kv, &block, local, &q[(it.t * n_heads + it.head) * hd..], scores, outs);
                    for i in 0..it.len {
                        out(i).copy_from_slice(&outs[i * hd..(i + 1) * hd]);
                    }
                } else {
                    attend_row(&kv, first, local, kv_off, qrow(0), &mut sc[..score_len], out(0));
                }
            }
        });
    }
}

/// The step's work items into `items`, costliest first.
fn plan(rows: &[RowPos], roles: &[(usize, bool)], n_heads: usize, items: &mut Vec<Item>) {
    let all = [(rows.len(), false)];
    let roles = if roles.iter().map(|r| r.0).sum::<usize>() == rows.len() { roles } else { &all[..] };
    items.clear();
    let mut t = 0;
    for &(len, prompt) in roles {
        let end = t + len;
        while t < end {
            // A prompt's consecutive positions of one sequence, at most a
            // block; a decode row alone.
            let mut n = 1;
            while prompt
                && t + n < end
                && n < QUERY_BLOCK
                && rows[t + n].seq == rows[t].seq
                && rows[t + n].pos == rows[t].pos + n
            {
                n += 1;
            }
            let cost = (t..t + n).map(|r| rows[r].pos + 1).sum();
            items.extend((0..n_heads).map(|head| Item { t, len: n, head, prompt, cost }));
            t += n;
        }
    }
    items.sort_unstable_by_key(|it| std::cmp::Reverse(it.cost));
}

/// One head of one row at position `p`: `out = softmax(q·Kᵀ · scale) · V`
/// over the row's span, keys and values at column `kv_off` of the cache.
fn attend_row(kv: &LayerKv<'_>, p: usize, local: bool, kv_off: usize, q: &[f32], sc: &mut [f32], out: &mut [f32]) {
    let hd = q.len();
    let scale = 1.0 / (hd as f32).sqrt();
    let span = kv.span(p, local);
    let at = |j: usize| (j % kv.slots) * kv.kv_dim + kv_off;
    let sc = &mut sc[..span.len()];
    for (s, j) in sc.iter_mut().zip(span.clone()) {
        *s = math::dot(q, &kv.keys[at(j)..at(j) + hd]) * scale;
    }
    math::softmax(sc);
    out.fill(0.0);
    for (&w, j) in sc.iter().zip(span) {
        math::axpy(w, &kv.values[at(j)..at(j) + hd], out);
    }
}

/// One head of a block of prompt rows at positions `first..first + len`.
struct Block {
    first: usize,
    len: usize,
    /// Column of the head's keys and values in the cache.
    kv_off: usize,
    hd: usize,
    /// Stride between the rows' queries.
    ld_q: usize,
}

thread_local! {
    /// The packed operand of this thread's attention GEMMs.
    static PACKED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// [`attend_row`] for every row of `b` as two GEMMs: `scores (len × keys)
/// = Q·Kᵀ` over the union of the rows' spans, each row's span scaled and
/// softmaxed and the rest zeroed, then `outs (len × hd) = P·V`. `q` starts
/// at the first row's query (rows `b.ld_q` apart). A span that wraps
/// around a local layer's ring is two pieces, in position order.
fn attend_block(kv: &LayerKv<'_>, b: &Block, local: bool, q: &[f32], scores: &mut [f32], outs: &mut [f32]) {
    let hd = b.hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let last = b.first + b.len - 1;
    let keys = kv.span(b.first, local).start..last + 1;
    let n = keys.len();
    let q = &q[..(b.len - 1) * b.ld_q + hd];
    PACKED.with_borrow_mut(|packed| {
        // Scores, piece by piece of contiguous slots.
        for (cols, slots) in pieces(&keys, kv.slots) {
            let k = &kv.keys[slots.start * kv.kv_dim + b.kv_off..][..(slots.len() - 1) * kv.kv_dim + hd];
            let c = &mut scores[cols.start..][..(b.len - 1) * n + cols.len()];
            sgemm(b.len, cols.len(), hd, q, b.ld_q, k, kv.kv_dim, BLayout::Transposed, c, n, false, packed);
        }
        // Each row's own span: scaled and softmaxed; the rest weighs 0.
        for i in 0..b.len {
            let span = kv.span(b.first + i, local);
            let row = &mut scores[i * n..(i + 1) * n];
            let own = span.start - keys.start..span.end - keys.start;
            row[..own.start].fill(0.0);
            row[own.end..].fill(0.0);
            row[own.clone()].iter_mut().for_each(|s| *s *= scale);
            math::softmax(&mut row[own]);
        }
        // Weighted values, accumulated piece by piece in position order.
        let outs = &mut outs[..b.len * hd];
        for (i, (cols, slots)) in pieces(&keys, kv.slots).enumerate() {
            let v = &kv.values[slots.start * kv.kv_dim + b.kv_off..][..(slots.len() - 1) * kv.kv_dim + hd];
            let p = &scores[cols.start..][..(b.len - 1) * n + cols.len()];
            sgemm(b.len, hd, cols.len(), p, n, v, kv.kv_dim, BLayout::Normal, outs, hd, i > 0, packed);
        }
    });
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
    fn by_blocks(kv: &LayerKv<'_>, q: &[f32], first: usize, len: usize, split: usize, local: bool) -> Vec<f32> {
        let (hd, ld_q) = (16, 48);
        let mut out = vec![0.0; len * hd];
        let mut scores = vec![f32::NAN; QUERY_BLOCK * 64];
        let mut outs = vec![f32::NAN; QUERY_BLOCK * hd];
        for b0 in (0..len).step_by(split) {
            let n = split.min(len - b0);
            let b = Block { first: first + b0, len: n, kv_off: 16, hd, ld_q };
            attend_block(kv, &b, local, &q[b0 * ld_q..], &mut scores, &mut outs);
            out[b0 * hd..(b0 + n) * hd].copy_from_slice(&outs[..n * hd]);
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
        let q: Vec<f32> = (0..QUERY_BLOCK * 48).map(|_| r.random_range(-1.0f32..1.0)).collect();
        for (slots, window, local, first) in
            [(40, 0, false, 0), (40, 0, false, 17), (20, 8, true, 30), (20, 8, true, 7)]
        {
            let (keys, values, slots, window) = cache(slots, window, first as u64);
            let kv = LayerKv { keys: &keys, values: &values, slots, kv_dim: 32, window };
            let len = QUERY_BLOCK;
            let whole = by_blocks(&kv, &q, first, len, QUERY_BLOCK, local);
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
}
