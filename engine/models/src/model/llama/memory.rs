//! The model under a memory budget ([`crate::placement`]): which matrices
//! are copied into memory and which are read from storage per step, the
//! session's streamer, and token-embedding rows read from storage.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use spinfer_formats::config::ModelConfig;
use spinfer_formats::tensor::{TensorData, release_pages};

use super::linear::Chunk;
use super::{Linear, Model, ModelOptions, Session, Weights, session_bytes};
use crate::placement::{Fixed, Matrix, Placement, plan};
use crate::stream::{Item, StreamStats, Streamer, drop_cached, pin};
use crate::{Error, Result};
use spinfer_sparsity as sparse;

/// Tokens per forward step under a budget: bounds the activation buffers
/// (a prompt runs in steps of this many, each streaming the weights once).
pub const BUDGET_STEP: usize = 64;

/// How a loaded model keeps within its memory budget.
pub struct MemoryPlan {
    pub placement: Placement,
    /// The streamed items, in the order the forward pass uses them.
    items: Arc<[Item]>,
    /// The token embedding's file and offset when its rows are read from
    /// storage (`None`: they come from a resident copy).
    embd: Option<(Arc<File>, u64)>,
    /// Whether the FFN is served from its bundle (so its matrices are not
    /// in [`Placement::streamed`]'s forward order).
    ffn_in_bundle: bool,
    /// When the dense head is wholly resident: its window of the model
    /// file, and whether the resident copy also serves the (tied) token
    /// embedding, so [`MemoryPlan::release_output`] can give the copy up.
    output_mapped: Option<(TensorData, bool)>,
    /// Resident weight bytes locked in memory (`mlock`); less than
    /// `placement.resident_bytes` where the kernel does not allow it.
    pub pinned_bytes: u64,
}

impl MemoryPlan {
    /// Locks every resident weight chunk in memory (`mlock`, where
    /// permitted: the "pinned"), and records how many bytes are.
    fn pin_resident(&mut self, weights: &mut Weights) {
        let (mut pinned, mut refused) = (0u64, 0u64);
        let mut count = |ok: bool, n: usize| if ok { pinned += n as u64 } else { refused += n as u64 };
        for l in forward_order(weights, self.ffn_in_bundle) {
            match &l.streamed {
                Some(chunks) => {
                    for (_, c) in chunks {
                        if let Chunk::Resident(b) = c {
                            count(pin(b), b.len());
                        }
                    }
                }
                None if !l.w.is_mapped() => count(pin(l.w.bytes()), l.w.bytes().len()),
                None => {}
            }
        }
        self.pinned_bytes = pinned;
        if refused > 0 {
            tracing::warn!(
                pinned,
                refused,
                "mlock not permitted for all resident weights (RLIMIT_MEMLOCK); the rest stay ordinary memory, \
                 which only swap can evict"
            );
        } else {
            tracing::info!(pinned, "resident weights locked in memory (mlock)");
        }
    }

    /// Bytes read from storage per step for the matrices.
    pub fn streamed_bytes(&self) -> u64 {
        self.placement.streamed_bytes
    }

    /// Takes the dense head (last in the forward order, so its streamed
    /// items end the cycle) out of the streamed cycle, for a sparse head
    /// that computes next-token logits from its own rows: its resident
    /// chunks are freed and it is no longer read per step. Dense logits
    /// (`Model::logits`, perplexity) then read it through the file mapping,
    /// outside the budget. Called before the sparse head is built, so the
    /// head's tables take the dense head's room rather than sit on top of
    /// a full budget; [`MemoryPlan::promote`] then spends what is left
    /// (and recounts [`MemoryPlan::pinned_bytes`]).
    pub(super) fn release_output(&mut self, weights: &mut Weights) {
        let output = &mut weights.output;
        let Some(chunks) = output.streamed.take() else {
            // Wholly resident: back to its window of the file (the copy is
            // freed once nothing shares it), the tied embedding's rows too.
            if let Some((mapped, serves_embd)) = self.output_mapped.take() {
                self.placement.resident_bytes -= output.weight_bytes() as u64;
                if serves_embd {
                    weights.token_embd.data = mapped.clone();
                    self.embd = mapped.file_range().map(|(f, s)| (Arc::clone(f), s));
                }
                output.w = mapped;
            }
            return;
        };
        let row_bytes = output.weight_bytes() / output.desc.rows.max(1);
        for (r, c) in &chunks {
            let bytes = (r.len() * row_bytes) as u64;
            match c {
                Chunk::Streamed { .. } => self.placement.streamed_bytes -= bytes,
                Chunk::Resident(_) => self.placement.resident_bytes -= bytes,
            }
        }
        if let Some(last) = self.placement.streamed.last_mut() {
            *last = None;
        }
        tracing::info!(
            resident = self.placement.resident_bytes,
            streamed_per_step = self.placement.streamed_bytes,
            "the dense head leaves the streamed cycle"
        );
    }

    /// Spends the room the budget has left, less `reserved` bytes held
    /// outside the plan (a sparse head's tables), on streamed chunks, in
    /// forward order: each that fits is read into memory once and leaves
    /// the cycle (a streamed byte is read every step, so any that can stay
    /// should).
    /// The cycle's remaining items are renumbered, so a session opened
    /// before gets an error naming the change rather than wrong bytes
    /// (`Streamer::acquire` checks each item's offset); with nothing left
    /// streamed the ring goes too.
    pub(super) fn promote(&mut self, weights: &mut Weights, reserved: u64) -> Result<()> {
        let p = &mut self.placement;
        let used = p.fixed.session + p.fixed.work + p.ring_bytes + p.resident_bytes + reserved;
        let mut room = p.budget.saturating_sub(used);
        let mut items = Vec::new();
        let linears = forward_order(weights, self.ffn_in_bundle);
        for (l, planned) in linears.into_iter().zip(&mut p.streamed) {
            let (Some(chunks), Some(plan)) = (&mut l.streamed, planned.as_mut()) else { continue };
            for ((_, c), (_, resident)) in chunks.iter_mut().zip(plan.iter_mut()) {
                let Chunk::Streamed { item, offset } = *c else { continue };
                let it = &self.items[item];
                if it.len as u64 > room {
                    *c = Chunk::Streamed { item: items.len(), offset };
                    items.push(it.clone());
                    continue;
                }
                let mut v = Vec::new();
                v.try_reserve_exact(it.len).map_err(|e| {
                    Error::InvalidArgument(format!("{}: {} bytes to make resident: {e}", it.what, it.len))
                })?;
                v.resize(it.len, 0);
                it.file.read_exact_at(&mut v, it.offset).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "{}: reading {} bytes at offset {}: {e}",
                        it.what, it.len, it.offset
                    ))
                })?;
                drop_cached(&it.file, it.offset, it.len);
                *c = Chunk::Resident(v.into());
                *resident = true;
                room -= it.len as u64;
                p.resident_bytes += it.len as u64;
                p.streamed_bytes -= it.len as u64;
            }
            if plan.iter().all(|(_, resident)| *resident) {
                *planned = None;
            }
        }
        if items.is_empty() {
            (p.slots, p.ring_bytes) = (0, 0);
        }
        self.items = items.into();
        self.pin_resident(weights);
        Ok(())
    }
}

/// What one session needs besides the weights, under a budget: the KV cache
/// and tables, and activations for steps of [`BUDGET_STEP`] tokens plus one
/// row of logits (with the fast mode's two planes).
fn fixed(c: &ModelConfig, options: &ModelOptions) -> Result<Fixed> {
    let session = session_bytes(c, options.ctx, options.threads.max(1), options.kv_type())
        .ok_or_else(|| Error::InvalidArgument(format!("context size {}: the KV cache size overflows", options.ctx)))?;
    let (q_dim, kv_dim) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
    let per_token = 4 * c.dim + 2 * q_dim + 2 * kv_dim + 2 * c.ffn_dim;
    // The fast mode's two-plane inputs and outputs of the widest product
    // of a step, and one row of logits with its two planes.
    let widest = c.dim.max(c.ffn_dim).max(q_dim);
    let planes = 4 * widest;
    let floats = BUDGET_STEP * (per_token + planes) + 3 * c.vocab_size;
    Ok(Fixed { session, work: 4 * floats as u64 })
}

/// Every matrix the forward pass multiplies by through [`Linear::forward`],
/// in that order: with a sparse FFN served from its bundle, the FFN
/// matrices are not (the bundle's records are).
fn forward_order(weights: &mut Weights, ffn_in_bundle: bool) -> Vec<&mut Linear> {
    let mut out = Vec::new();
    for l in &mut weights.layers {
        out.extend([&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo]);
        if !ffn_in_bundle {
            out.extend([&mut l.w_gate, &mut l.w_up, &mut l.w_down]);
        }
    }
    out.push(&mut weights.output);
    out
}

/// Under a memory budget with a sparse FFN: the sparsity options with the
/// FFN bundle's share of the budget (`ffn_budget_bytes`), and the share
/// left for the rest. The rest's matrices (attention, head) are read in
/// full every token when streamed, the FFN's cold records only when their
/// neurons fire, so the rest comes first: the FFN gets what is left once
/// all of it fits, and at least 40% of the room besides the fixed part
/// and the read-ahead ring otherwise. An FFN budget the operator set
/// explicitly is kept and taken out of the memory budget.
pub(super) fn split_budget(
    c: &ModelConfig,
    options: &ModelOptions,
    layers: &[super::Layer],
    output: &Linear,
) -> Result<Option<(sparse::SparsityOptions, u64)>> {
    let (Some(budget), Some(o)) = (options.mem_budget, &options.sparsity) else { return Ok(None) };
    let f = fixed(c, options)?;
    let ring = (crate::placement::MAX_SLOTS * crate::placement::CHUNK_BYTES) as u64;
    let rest: u64 =
        layers.iter().flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo]).chain([output]).map(|l| l.weight_bytes() as u64).sum();
    let room = budget.saturating_sub(f.session + f.work + ring);
    let ffn = match o.ffn_budget_bytes {
        Some(b) => b as u64,
        None => room.saturating_sub(rest).max(room * 2 / 5),
    };
    if ffn >= budget {
        return Err(Error::InvalidArgument(format!(
            "the FFN budget ({:.1} MB, --ffn-budget-mb) leaves nothing of the memory budget ({:.1} MB, \
             --mem-budget-mb) for the rest of the model",
            ffn as f64 / 1e6,
            budget as f64 / 1e6
        )));
    }
    let mut o = o.clone();
    o.ffn_budget_bytes = Some(ffn as usize);
    Ok(Some((o, budget - ffn)))
}

impl Model {
    /// Places `weights` under `budget` bytes: resident matrices are copied
    /// to memory and their file pages released; streamed ones get their
    /// chunks' items in the streamer's cycle.
    pub(super) fn place(
        weights: &mut Weights,
        c: &ModelConfig,
        options: &ModelOptions,
        budget: u64,
        ffn_in_bundle: bool,
    ) -> Result<MemoryPlan> {
        let fixed = fixed(c, options)?;
        let output_window = weights.output.w.clone();
        let mut linears = forward_order(weights, ffn_in_bundle);
        let mut matrices = Vec::with_capacity(linears.len());
        for l in &linears {
            let rows = l.desc.rows;
            matrices.push(Matrix { name: l.name.clone(), rows, row_bytes: l.w.bytes().len() / rows.max(1) });
        }
        let placement = plan(budget, fixed, &matrices)?;
        let mut items = Vec::new();
        for ((l, m), streamed) in linears.iter_mut().zip(&matrices).zip(&placement.streamed) {
            let Some(chunks) = streamed else {
                make_resident(l);
                continue;
            };
            let Some((file, start)) = l.w.file_range().map(|(f, s)| (Arc::clone(f), s)) else {
                return Err(Error::InvalidArgument(format!(
                    "{}: this tensor is not a window of a model file, so it cannot be streamed under the memory \
                     budget; raise --mem-budget-mb",
                    l.name
                )));
            };
            let what: Arc<str> = Arc::from(l.name.as_str());
            let mut bound = Vec::with_capacity(chunks.len());
            for (r, keep) in chunks {
                let bytes = r.start * m.row_bytes..r.end * m.row_bytes;
                if *keep {
                    bound.push((r.clone(), Chunk::Resident(l.w.copy_released(bytes))));
                    continue;
                }
                let item = Item {
                    file: Arc::clone(&file),
                    what: Arc::clone(&what),
                    offset: start + bytes.start as u64,
                    len: bytes.len(),
                };
                bound.push((r.clone(), Chunk::Streamed { item: items.len(), offset: item.offset }));
                items.push(item);
            }
            release(&l.w);
            l.streamed = Some(bound);
        }
        drop(linears);
        // Rows of the token embedding: from the resident head when tied,
        // else read from storage one row per token.
        let whole_head = weights.output.streamed.is_none() && output_window.is_mapped();
        let output_mapped = whole_head.then_some((output_window, c.tied_embeddings));
        let embd = if c.tied_embeddings && weights.output.streamed.is_none() {
            weights.token_embd.data = weights.output.w.clone();
            None
        } else {
            release(&weights.token_embd.data);
            weights.token_embd.data.file_range().map(|(f, s)| (Arc::clone(f), s))
        };
        tracing::info!(
            budget = placement.budget,
            resident = placement.resident_bytes,
            streamed_per_step = placement.streamed_bytes,
            ring = placement.ring_bytes,
            "memory budget placed"
        );
        let mut plan =
            MemoryPlan { placement, items: items.into(), embd, ffn_in_bundle, output_mapped, pinned_bytes: 0 };
        plan.pin_resident(weights);
        Ok(plan)
    }

    /// The streamer a new session needs, if any matrix is streamed (`None`
    /// with an error logged if it cannot start: the first streamed product
    /// then fails with a clear error).
    pub(super) fn new_streamer(&self) -> Option<Arc<Streamer>> {
        let plan = self.memory.as_ref().filter(|m| !m.items.is_empty())?;
        match Streamer::new(Arc::clone(&plan.items), plan.placement.slots) {
            Ok(s) => Some(Arc::new(s)),
            Err(e) => {
                tracing::error!("cannot start the weight streamer: {e}");
                None
            }
        }
    }

    /// Token `id`'s embedding row, read from storage into `s.embd_row` when
    /// the plan says so; `None` when it comes from memory.
    pub(super) fn embedding_row_from_storage(&self, s: &mut Session, id: usize, row_bytes: usize) -> Result<bool> {
        let Some((file, start)) = self.memory.as_ref().and_then(|m| m.embd.as_ref()) else { return Ok(false) };
        s.embd_row.resize(row_bytes, 0);
        let offset = start + (id * row_bytes) as u64;
        file.read_exact_at(&mut s.embd_row, offset).map_err(|e| {
            Error::InvalidArgument(format!("token_embd.weight: reading row {id} ({row_bytes} bytes at {offset}): {e}"))
        })?;
        drop_cached(file, offset, row_bytes);
        if let Some(st) = &s.scratch.stream {
            st.count_read(row_bytes);
        }
        Ok(true)
    }
}

impl Session {
    /// Counters of the weights streamed from storage (`None` when the model
    /// runs without a memory budget, or all of it fits).
    pub fn stream_stats(&self) -> Option<StreamStats> {
        self.scratch.stream.as_deref().map(Streamer::stats)
    }

    /// Zeroes the streaming counters.
    pub fn reset_stream_stats(&self) {
        if let Some(s) = &self.scratch.stream {
            s.reset_stats();
        }
    }
}

/// Copies `l`'s weights to memory and releases its file pages.
fn make_resident(l: &mut Linear) {
    if !l.w.is_mapped() {
        return;
    }
    let copy = TensorData::shared(l.w.copy_released(0..l.w.bytes().len()));
    release(&l.w);
    l.w = copy;
}

/// Drops the mapped pages of `data` from this process and the page cache.
fn release(data: &TensorData) {
    if !data.is_mapped() {
        return;
    }
    // SAFETY: `data` is a window of a read-only file mapping.
    unsafe { release_pages(data.bytes()) };
    if let Some((file, start)) = data.file_range() {
        drop_cached(file, start, data.bytes().len());
    }
}
