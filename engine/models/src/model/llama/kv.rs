//! One sequence's KV cache, and causal attention over the caches of the
//! sequences of one forward step: one request's prompt, or several
//! requests decoding together ([`Model::forward_batch`]).

use spinfer_kernels::pool::{SyncPtr, ThreadPool, chunk};

use super::{Model, kv_positions};
use crate::model::math;
use crate::{Error, Result};

/// The keys and values of one sequence, every layer, and its position.
/// A [`super::Session`] holds one; a batch of requests holds one per
/// request and shares one session's buffers.
#[derive(Default)]
pub struct KvCache {
    /// Number of tokens already in the cache.
    pos: usize,
    ctx: usize,
    /// The local layers' window (0: every layer is global).
    window: usize,
    kv_dim: usize,
    start: Vec<usize>, // per layer: its first position slot
    len: Vec<usize>,   // per layer: its slots (`kv_positions`); position p in slot p % len
    keys: Vec<f32>,    // (layer slots, kv_dim)
    values: Vec<f32>,  // (layer slots, kv_dim)
}

impl KvCache {
    /// An empty cache of `ctx` positions for the model `m`. The caches are
    /// zero-initialised allocations: the OS maps their pages lazily, so
    /// memory is only committed for positions used.
    pub(super) fn new(m: &Model, ctx: usize) -> Self {
        let c = &m.config;
        let kv_dim = c.n_kv_heads * c.head_dim;
        let len: Vec<usize> = (0..c.n_layers).map(|l| kv_positions(c, l, ctx)).collect();
        let start: Vec<usize> = len.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let slots: usize = len.iter().sum();
        Self {
            pos: 0,
            ctx,
            window: c.sliding_window.map_or(0, |w| w.window),
            kv_dim,
            start,
            len,
            keys: vec![0.0; slots * kv_dim],
            values: vec![0.0; slots * kv_dim],
        }
    }

    /// Tokens currently in the cache.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Positions the cache holds.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Forgets the cached tokens (the memory is kept).
    pub fn reset(&mut self) {
        self.pos = 0;
    }

    /// Forgets the cached tokens and hands the memory of the positions
    /// used back to the system (a server's slot between requests); the
    /// cache stays usable, its pages mapped again when written.
    pub fn release(&mut self) {
        self.pos = 0;
        release_pages(&mut self.keys);
        release_pages(&mut self.values);
    }

    /// Drops cached tokens after `pos` (see [`super::Session::truncate`]).
    pub fn truncate(&mut self, pos: usize) -> Result<()> {
        // Only a ring shorter than the context wraps (and overwrites).
        let slack = self.len.iter().filter(|&&len| len < self.ctx).map(|&len| len - self.window).min();
        if let Some(slack) = slack
            && self.pos.saturating_sub(pos) > slack
        {
            return Err(Error::InvalidArgument(format!(
                "cannot go back {} positions: this model's local attention layers keep {slack} positions beyond \
                 their window",
                self.pos - pos
            )));
        }
        self.pos = self.pos.min(pos);
        Ok(())
    }

    /// Moves the position past `n` tokens just stored.
    pub(super) fn advance(&mut self, n: usize) {
        self.pos += n;
    }

    /// Stores layer `l`'s key and value of position `p` (in slot p mod
    /// the layer's length: a ring for a local layer).
    pub(super) fn store(&mut self, l: usize, p: usize, k: &[f32], v: &[f32]) {
        let slot = (self.start[l] + p % self.len[l]) * self.kv_dim;
        self.keys[slot..slot + self.kv_dim].copy_from_slice(k);
        self.values[slot..slot + self.kv_dim].copy_from_slice(v);
    }
}

/// `madvise(DONTNEED)` on the whole pages inside `v`: their memory is
/// released and they read as zeros afterwards; advice only, so a failure
/// leaves the memory held and changes nothing else.
fn release_pages(v: &mut [f32]) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        const MADV_DONTNEED: i32 = 4;
        unsafe extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        let start = v.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(v);
        let (from, to) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
        if to > from {
            // SAFETY: [from, to) lies inside `v`'s allocation, which the
            // `&mut` borrow keeps from every other reader during the call.
            // Heap memory is private and anonymous: after DONTNEED its
            // pages stay mapped and read as zeros, a valid f32 (0.0), so
            // the slice stays valid and initialised.
            unsafe { madvise(from as *mut std::ffi::c_void, to - from, MADV_DONTNEED) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// Which sequence a row of the step belongs to, and its position there.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RowPos {
    pub seq: usize,
    pub pos: usize,
}

/// The operands of one layer's attention for every row of a step.
pub(super) struct Attention<'a> {
    pub pool: &'a ThreadPool,
    pub seqs: &'a [&'a mut KvCache],
    pub rows: &'a [RowPos],
    pub q: &'a [f32],          // (rows, n_heads * head_dim)
    pub att: &'a mut [f32],    // (rows, n_heads * head_dim): the output
    pub scores: &'a mut [f32], // (threads, score_len)
    pub score_len: usize,
}

impl Model {
    /// Causal multi-head attention of layer `l` for every row (GQA: each kv
    /// head serves n_heads / n_kv_heads query heads), each row over its own
    /// sequence's cache up to its position, a `local` layer over its window
    /// only.
    pub(super) fn attention(&self, a: Attention<'_>, l: usize, local: bool) {
        let c = &self.config;
        let (hd, n_heads) = (c.head_dim, c.n_heads);
        let group = n_heads / c.n_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let Attention { pool, seqs, rows, q, att, scores, score_len } = a;
        assert!(att.len() >= rows.len() * n_heads * hd && scores.len() >= pool.n_threads() * score_len);
        let att = SyncPtr::new(att.as_mut_ptr());
        let scores = SyncPtr::new(scores.as_mut_ptr());
        let work = rows.len() * n_heads;
        pool.broadcast(&|ti, nt| {
            // SAFETY: thread `ti` writes only its own row of `scores`
            // (`score_len` floats at `ti * score_len`; the buffer holds
            // `threads * score_len`, asserted above) and the `att` head
            // slices of its own work items; work items are disjoint across
            // threads, and both buffers outlive the broadcast, which
            // returns only when every thread is done.
            let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ti * score_len), score_len) };
            for item in chunk(work, ti, nt) {
                let (t, h) = (item / n_heads, item % n_heads);
                let RowPos { seq, pos: p } = rows[t];
                let kv = &seqs[seq];
                let (slots, kv_dim) = (kv.len[l], kv.kv_dim);
                let base = kv.start[l] * kv_dim;
                let keys = &kv.keys[base..base + slots * kv_dim];
                let values = &kv.values[base..base + slots * kv_dim];
                let window = if local { kv.window } else { usize::MAX };
                let qv = &q[(t * n_heads + h) * hd..(t * n_heads + h + 1) * hd];
                let kv_off = (h / group) * hd;
                // Positions first..=p, position j in slot j mod slots.
                let first = (p + 1).saturating_sub(window);
                let len = p + 1 - first;
                let at = |j: usize| ((first + j) % slots) * kv_dim + kv_off;
                for (j, sj) in sc[..len].iter_mut().enumerate() {
                    *sj = math::dot(qv, &keys[at(j)..at(j) + hd]) * scale;
                }
                math::softmax(&mut sc[..len]);
                // SAFETY: see above; this (t, h) slice belongs to this item.
                let out = unsafe { std::slice::from_raw_parts_mut(att.get().add((t * n_heads + h) * hd), hd) };
                out.fill(0.0);
                for (j, &w) in sc[..len].iter().enumerate() {
                    math::axpy(w, &values[at(j)..at(j) + hd], out);
                }
            }
        });
    }
}
