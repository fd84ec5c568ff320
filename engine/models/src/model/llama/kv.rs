//! One sequence's KV cache: every layer's keys and values by position
//! (a ring for a local layer), read by [`super::attend`], in f32 or f16
//! ([`KvType`]).

use half::f16;
use spinfer_attention::Cache;
use spinfer_kernels::elem::{KvElem, release_pages, store_row};

use super::{Model, kv_positions};
use crate::{Error, Result};

/// The element type of the KV cache (`--kv-cache`, `[model] kv_cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// f32: the keys and values exactly as computed.
    #[default]
    F32,
    /// IEEE f16 (llama.cpp's default): half the memory and half the bytes
    /// attention reads per token; each value is rounded once when stored
    /// (relative error at most 2^-11; magnitudes past 65504 saturate).
    F16,
}

impl KvType {
    /// Bytes per cached value.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => f32::BYTES,
            Self::F16 => f16::BYTES,
        }
    }
}

/// Every layer's keys and values, `(layer slots, kv_dim)` each.
enum Store {
    F32 { keys: Vec<f32>, values: Vec<f32> },
    F16 { keys: Vec<f16>, values: Vec<f16> },
}

impl Default for Store {
    fn default() -> Self {
        Self::F32 { keys: Vec::new(), values: Vec::new() }
    }
}

/// One layer's keys and values, of either element type.
pub(super) enum LayerCache<'a> {
    F32(Cache<'a, f32>),
    F16(Cache<'a, f16>),
}

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
    store: Store,
}

impl KvCache {
    /// An empty cache of `ctx` positions for the model `m`, of its
    /// options' [`KvType`]. The caches are zero-initialised allocations:
    /// the OS maps their pages lazily, so memory is only committed for
    /// positions used.
    pub(super) fn new(m: &Model, ctx: usize) -> Self {
        let c = &m.config;
        let kv_dim = c.n_kv_heads * c.head_dim;
        let len: Vec<usize> = (0..c.n_layers).map(|l| kv_positions(c, l, ctx)).collect();
        let start: Vec<usize> = len.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let n = len.iter().sum::<usize>() * kv_dim;
        let store = match m.options.kv_type() {
            KvType::F32 => Store::F32 { keys: vec![0.0; n], values: vec![0.0; n] },
            KvType::F16 => Store::F16 { keys: vec![f16::ZERO; n], values: vec![f16::ZERO; n] },
        };
        Self { pos: 0, ctx, window: c.sliding_window.map_or(0, |w| w.window), kv_dim, start, len, store }
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
        match &mut self.store {
            Store::F32 { keys, values } => {
                release_pages(keys);
                release_pages(values);
            }
            Store::F16 { keys, values } => {
                release_pages(keys);
                release_pages(values);
            }
        }
    }

    /// Makes this cache hold `src`'s first `n` tokens, as `src` truncated
    /// to `n` would (same model and context; a local layer's ring is
    /// copied whole, under [`KvCache::truncate`]'s limit).
    pub fn copy_prefix_from(&mut self, src: &KvCache, n: usize) -> Result<()> {
        if (self.ctx, self.kv_dim, &self.len) != (src.ctx, src.kv_dim, &src.len) || n > src.pos {
            return Err(Error::InvalidArgument("a KV prefix copied between caches of another shape".into()));
        }
        src.can_go_back_to(n)?;
        let rows: Vec<_> = (0..self.len.len())
            .map(|l| {
                let at = self.start[l] * self.kv_dim;
                at..at + if self.len[l] < self.ctx { self.len[l] } else { n } * self.kv_dim
            })
            .collect();
        match (&mut self.store, &src.store) {
            (Store::F32 { keys, values }, Store::F32 { keys: k, values: v }) => copy_rows(keys, values, k, v, &rows),
            (Store::F16 { keys, values }, Store::F16 { keys: k, values: v }) => copy_rows(keys, values, k, v, &rows),
            _ => return Err(Error::InvalidArgument("a KV prefix copied between element types".into())),
        }
        self.pos = n;
        Ok(())
    }

    /// Drops cached tokens after `pos` (see [`super::Session::truncate`]).
    pub fn truncate(&mut self, pos: usize) -> Result<()> {
        self.can_go_back_to(pos)?;
        self.pos = self.pos.min(pos);
        Ok(())
    }

    /// Whether the cache still holds what attention at `pos` needs.
    fn can_go_back_to(&self, pos: usize) -> Result<()> {
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
        Ok(())
    }

    /// Moves the position past `n` tokens just stored.
    pub(super) fn advance(&mut self, n: usize) {
        self.pos += n;
    }

    /// Layer `l`'s keys and values.
    pub(super) fn layer(&self, l: usize) -> LayerCache<'_> {
        match &self.store {
            Store::F32 { keys, values } => LayerCache::F32(self.cache(l, keys, values)),
            Store::F16 { keys, values } => LayerCache::F16(self.cache(l, keys, values)),
        }
    }

    fn cache<'a, E: KvElem>(&self, l: usize, keys: &'a [E], values: &'a [E]) -> Cache<'a, E> {
        let (slots, kv_dim) = (self.len[l], self.kv_dim);
        let rows = self.start[l] * kv_dim..(self.start[l] + slots) * kv_dim;
        Cache { keys: &keys[rows.clone()], values: &values[rows], slots, kv_dim, window: self.window }
    }

    /// Stores layer `l`'s key and value of position `p` (in slot p mod
    /// the layer's length: a ring for a local layer), rounded to the
    /// cache's element type.
    pub(super) fn store(&mut self, l: usize, p: usize, k: &[f32], v: &[f32]) {
        let slot = (self.start[l] + p % self.len[l]) * self.kv_dim;
        let row = slot..slot + self.kv_dim;
        match &mut self.store {
            Store::F32 { keys, values } => {
                keys[row.clone()].copy_from_slice(k);
                values[row].copy_from_slice(v);
            }
            Store::F16 { keys, values } => {
                store_row(&mut keys[row.clone()], k);
                store_row(&mut values[row], v);
            }
        }
    }
}

/// Copies `rows` of the keys and values `k`, `v` into `keys`, `values`.
fn copy_rows<E: Copy>(keys: &mut [E], values: &mut [E], k: &[E], v: &[E], rows: &[std::ops::Range<usize>]) {
    for r in rows {
        keys[r.clone()].copy_from_slice(&k[r.clone()]);
        values[r.clone()].copy_from_slice(&v[r.clone()]);
    }
}

/// Which sequence a row of the step belongs to, and its position there.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RowPos {
    pub seq: usize,
    pub pos: usize,
}
