//! [`Session`]: one request's state — its KV cache, and the activation
//! buffers a forward step uses (grown on demand, never shrunk, so decode
//! allocates nothing). A batch of requests shares one session's buffers
//! ([`Model::forward_batch`]).

use spinfer_kernels::pool::ThreadPool;

use super::{AttnProbe, FfnProbe, HeadScratch, HeadStats, KvCache, Model, RowPos, Scratch, experimental};
use crate::Result;
use spinfer_sparsity::{self as sparse, SparsityStats};

/// Per-request state: the KV cache, the position, and reusable activation
/// buffers (grown on demand, never shrunk, so decode allocates nothing).
pub struct Session {
    pub(super) pool: ThreadPool,
    pub(super) kv: KvCache, // this session's own sequence
    pub(super) ctx: usize,
    pub(super) rows: Vec<RowPos>, // the current step's rows: their sequence and position
    pub(super) at_start: bool,    // the current step starts a sequence (its first position is 0)
    pub(super) x: Vec<f32>,       // residual stream (n, dim)
    pub(super) xn: Vec<f32>,      // normalised input of the current step (n, dim)
    pub(super) q: Vec<f32>,       // (n, n_heads * head_dim)
    pub(super) k: Vec<f32>,       // (n, kv_dim)
    pub(super) v: Vec<f32>,       // (n, kv_dim)
    pub(super) att: Vec<f32>,     // attention output (n, n_heads * head_dim)
    pub(super) scores: Vec<f32>,  // per-thread attention scratch (threads, attend::scratch_floats)
    pub(super) attn_items: Vec<super::attend::Item>, // the attention's work items
    pub(super) gate: Vec<f32>,    // (n, ffn_dim)
    pub(super) up: Vec<f32>,      // (n, ffn_dim)
    pub(super) tmp: Vec<f32>,     // projection output before the residual add (n, dim)
    pub(super) embd_row: Vec<u8>, // a token's embedding row read from storage (under a memory budget)
    pub(super) hidden: Vec<f32>,  // final-normed hidden states of the last forward call (tokens, dim)
    pub(super) last_tokens: usize, // tokens of the last forward call
    pub(super) logits: Vec<f32>,  // (rows requested, vocab)
    pub(super) scratch: Scratch,  // matmul buffers
    pub(super) head: HeadScratch, // sparse head buffers and counters
    pub(super) sparse: SparseScratch, // sparse FFN buffers and counters
    /// Called in each dense FFN with `(layer, input, gate, up)`
    /// (calibration collects its statistics here).
    pub(super) ffn_probe: Option<FfnProbe>,
    /// Called in each layer with `(layer, attention output)`.
    pub(super) attn_probe: Option<AttnProbe>,
}

/// Buffers and counters of the sparse FFN.
#[derive(Default)]
pub(super) struct SparseScratch {
    pub(super) idx: Vec<u32>,                      // kept neurons of the current token, ascending
    pub(super) pred: Vec<u32>,                     // neurons the low-rank predictor keeps (before the gate)
    pub(super) mask: Vec<u8>,                      // a pack predictor's mask (ffn_dim)
    pub(super) measure_truth: bool,                // compute the full gate to judge the predictor
    pub(super) truth: Vec<f32>,                    // |silu(gate)| in full (ffn_dim), when measuring
    pub(super) mags: Vec<f32>,                     // |activations| (top-K selection)
    pub(super) up: Vec<f32>,                       // up projection of the kept neurons (k)
    pub(super) h: Vec<f32>,                        // silu(gate) * up of the kept neurons (k)
    pub(super) keep: Vec<u32>,                     // positions in `pred` of the kept neurons (under a budget)
    pub(super) gathered: sparse::bundle::Gathered, // records from the FFN bundle (under a budget)
    pub(super) ahead_x: Vec<f32>,                  // the next layer's FFN input as predicted (look-ahead, dim)
    pub(super) ahead_act: Vec<f32>,                // the look-ahead predictor's activations (ffn_dim)
    pub(super) ahead: Vec<u32>,                    // the next layer's predicted neurons (look-ahead)
    pub(super) sentence: Vec<experimental::sentence_ffn::SentenceMask>, // per layer: this request's mask (sentence-level)
    pub(super) stats: SparsityStats,
}

impl Session {
    /// Tokens currently in the KV cache.
    pub fn pos(&self) -> usize {
        self.kv.pos()
    }

    /// The session's context size.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Forgets the cached tokens (the buffers are kept).
    pub fn reset(&mut self) {
        self.kv.reset();
    }

    /// Drops cached tokens after `pos` (e.g. to re-run a suffix). A local
    /// (sliding-window) layer keeps [`super::UBATCH`]` - 1` positions beyond its
    /// window: going back further than that is an error (the positions it
    /// would need again are overwritten), and the session is unchanged.
    pub fn truncate(&mut self, pos: usize) -> Result<()> {
        self.kv.truncate(pos)
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// What the sparse FFN did in this session (empty when dense).
    pub fn sparsity_stats(&self) -> &SparsityStats {
        &self.sparse.stats
    }

    /// Also computes, for the predictors that choose before the gate
    /// (low-rank, pack, sentence-level), every token's full gate and counts
    /// how many truly active neurons (`|silu(gate)|` above the sidecar's
    /// gate threshold) the predictor selected: `SparsityStats::recall` and
    /// `precision`. Costs a dense gate projection per token and layer
    /// (`generate --stats`); never changes the output.
    pub fn set_measure_recall(&mut self, on: bool) {
        self.sparse.measure_truth = on;
    }

    /// What the sparse output head did in this session.
    pub fn head_stats(&self) -> &HeadStats {
        &self.head.stats
    }

    /// Resets the sparse FFN counters.
    pub fn reset_sparsity_stats(&mut self) {
        self.sparse.stats.layers.iter_mut().for_each(|c| *c = Default::default());
        self.sparse.stats.cache = Default::default();
    }

    /// Installs (or removes) a probe called in every dense FFN with
    /// `(layer, input, gate, up)` before the activation. Not called when
    /// the model runs sparse.
    pub fn set_ffn_probe(&mut self, probe: Option<FfnProbe>) {
        self.ffn_probe = probe;
    }

    /// Installs (or removes) a probe called in every layer with `(layer,
    /// attention output)` before the output projection.
    pub fn set_attn_probe(&mut self, probe: Option<AttnProbe>) {
        self.attn_probe = probe;
    }
}

impl Model {
    /// A fresh session with an empty KV cache of `options.ctx` positions.
    pub fn new_session(&self) -> Session {
        let c = &self.config;
        let ctx = self.options.ctx;
        let threads = self.options.threads.max(1);
        Session {
            pool: ThreadPool::new(threads),
            kv: KvCache::new(self, ctx),
            ctx,
            rows: Vec::new(),
            at_start: false,
            x: Vec::new(),
            xn: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            att: Vec::new(),
            scores: vec![0.0; threads * super::attend::scratch_floats(ctx, c.head_dim)],
            attn_items: Vec::new(),
            gate: Vec::new(),
            up: Vec::new(),
            tmp: Vec::new(),
            embd_row: Vec::new(),
            hidden: Vec::new(),
            last_tokens: 0,
            logits: Vec::new(),
            scratch: Scratch { stream: self.new_streamer(), ..Scratch::default() },
            head: HeadScratch::default(),
            sparse: SparseScratch {
                stats: SparsityStats {
                    ffn_dim: c.ffn_dim,
                    attn_dim: c.n_heads * c.head_dim,
                    layers: vec![Default::default(); c.n_layers],
                    ..Default::default()
                },
                ..Default::default()
            },
            ffn_probe: None,
            attn_probe: None,
        }
    }
}
