//! Causal attention over the caches of the sequences of one forward step:
//! one request's prompt, or several requests decoding together
//! ([`Model::forward_batch`]), or both.
//!
//! A decode row's heads that share a kv head run together
//! ([`attend_group`]: the cache is read once for them, and each head gets
//! what it would alone); a prompt's rows are taken in blocks of
//! [`QUERY_BLOCK`] consecutive positions, the heads of one kv head
//! together, each head two GEMMs ([`attend_block`]): a prompt row gets the
//! same numbers whatever block it falls in, however its prompt was chunked
//! or batched.

use std::sync::atomic::{AtomicUsize, Ordering};

use spinfer_attention::{Block, Cache, attend_block, attend_group};
use spinfer_kernels::elem::KvElem;
use spinfer_kernels::pool::{SyncPtr, ThreadPool};

use super::Model;
use super::kv::{KvCache, LayerCache, RowPos};

/// Query rows of one prompt whose attention runs as one pair of GEMMs per
/// head; also the most query heads of one decode item.
pub(super) const QUERY_BLOCK: usize = 12;

/// Floats of one thread's scratch: a block's scores (`QUERY_BLOCK ×
/// score_len`) and outputs (`QUERY_BLOCK × head_dim`); a decode item's
/// heads' scores fit in the first part.
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

/// A unit of work: the query heads that share a kv head (at most
/// [`QUERY_BLOCK`]) of one decode row, or of a block of consecutive prompt
/// rows of one sequence.
#[derive(Clone, Copy)]
pub(super) struct Item {
    /// First row of the step, and number of rows.
    t: usize,
    len: usize,
    /// First query head, and number of heads.
    head: usize,
    heads: usize,
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
        plan(rows, roles, n_heads, n_heads / self.config.n_kv_heads, items);
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
                // SAFETY: the item's rows `it.t..it.t + it.len`, heads
                // `it.head..it.head + it.heads` (consecutive in a row), of
                // `att` (which holds every row, asserted above) belong to
                // it alone: items are disjoint (row, head) sets, each
                // handed out once by the counter.
                let out = |i: usize| unsafe {
                    std::slice::from_raw_parts_mut(att.get().add(((it.t + i) * n_heads + it.head) * hd), it.heads * hd)
                };
                let q = &q[(it.t * n_heads + it.head) * hd..];
                let kv_off = it.head / (n_heads / self.config.n_kv_heads) * hd;
                let op = Op { it, first: rows[it.t].pos, kv_off, hd, ld_q: n_heads * hd, local, score_len };
                match seqs[rows[it.t].seq].layer(l) {
                    LayerCache::F32(kv) => op.run(&kv, q, sc, out),
                    LayerCache::F16(kv) => op.run(&kv, q, sc, out),
                }
            }
        });
    }
}

/// One item's attention, whatever its cache's element type.
struct Op {
    it: Item,
    /// The first row's position.
    first: usize,
    /// Column of the item's kv head in the cache.
    kv_off: usize,
    hd: usize,
    /// Stride between rows' queries.
    ld_q: usize,
    local: bool,
    score_len: usize,
}

impl Op {
    /// `q` starts at the item's first row and head; `sc` is the thread's
    /// scratch; `out(i)` is row `i`'s output for the item's heads.
    fn run<'o, E: KvElem>(&self, kv: &Cache<'_, E>, q: &[f32], sc: &mut [f32], out: impl Fn(usize) -> &'o mut [f32]) {
        let (it, hd) = (self.it, self.hd);
        if it.prompt {
            let (scores, outs) = sc.split_at_mut(QUERY_BLOCK * self.score_len);
            let (first, kv_off, ld_q) = (self.first, self.kv_off, self.ld_q);
            let block = Block { first, len: it.len, kv_off, hd, heads: it.heads, ld_q };
            attend_block(kv, &block, self.local, q, scores, outs, &mut |h, o| {
                for i in 0..it.len {
                    out(i)[h * hd..(h + 1) * hd].copy_from_slice(&o[i * hd..(i + 1) * hd]);
                }
            });
        } else {
            attend_group(kv, self.first, self.local, self.kv_off, hd, &q[..it.heads * hd], sc, out(0));
        }
    }
}

/// The step's work items into `items`, costliest first (`group`: query
/// heads per kv head).
fn plan(rows: &[RowPos], roles: &[(usize, bool)], n_heads: usize, group: usize, items: &mut Vec<Item>) {
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
            let cost: usize = (t..t + n).map(|r| rows[r].pos + 1).sum();
            // Each kv head's query heads together (its keys and values read,
            // or widened from f16, once for them), in runs of at most a
            // block (a decode row's scores fill the scratch's score rows).
            for kv_head in 0..n_heads / group {
                for h in (0..group).step_by(QUERY_BLOCK) {
                    let heads = QUERY_BLOCK.min(group - h);
                    let head = kv_head * group + h;
                    items.push(Item { t, len: n, head, heads, prompt, cost: cost * heads });
                }
            }
            t += n;
        }
    }
    items.sort_unstable_by_key(|it| std::cmp::Reverse(it.cost));
}
