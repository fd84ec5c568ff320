//! One step of the scheduling loop: plan the rows (decoding requests'
//! next tokens and drafts, then prompt chunks), run them as one
//! [`spinfer_engine::model::Model::forward_batch`], choose each sampling
//! request's tokens, and count what ran.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use spinfer_engine::model::KvCache;

use super::{Active, Event, Loop, Part};
use crate::error::ApiError;
use crate::logprobs::TokenLogprob;
use crate::metrics::Metrics;

impl Loop<'_> {
    /// The step's parts: every decoding request's next token (and a draft
    /// of what follows it, while few requests decode), then prompt chunks
    /// (oldest slot first) up to `prefill_chunk` tokens.
    fn plan(&self) -> (Vec<u32>, Vec<Part>) {
        let (mut tokens, mut parts) = (Vec::new(), Vec::new());
        let decoding = self.active.iter().flatten().filter(|a| a.next.is_some()).count();
        let drafts = decoding <= self.draft_batch;
        // Rows the step may hold beyond one per decoding request.
        let mut spare = self.engine.model.max_batch_tokens().saturating_sub(decoding);
        for (slot, a) in self.active.iter().enumerate() {
            let Some((a, tok)) = a.as_ref().and_then(|a| Some((a, a.next?))) else { continue };
            let draft = match &a.drafter {
                Some(d) if drafts => {
                    let kv = &self.kvs[slot];
                    // Positions after `tok`; tokens to choose after the one its row chooses.
                    let left = kv.ctx().saturating_sub(kv.pos() + 1).min(a.cont.remaining().saturating_sub(1));
                    d.propose(a.cont.history(), left.min(spare))
                }
                _ => &[],
            };
            tokens.push(tok);
            tokens.extend_from_slice(draft);
            parts.push(Part { slot, len: 1 + draft.len(), samples: true, prompt: false, decode: true });
            spare -= draft.len();
        }
        let mut room = self.prefill_chunk.min(self.engine.model.max_batch_tokens() - tokens.len());
        for (slot, a) in self.active.iter().enumerate() {
            let Some(a) = a.as_ref().filter(|a| a.prefilled < a.prompt.len()) else { continue };
            if room == 0 {
                break;
            }
            let len = (a.prompt.len() - a.prefilled).min(room);
            tokens.extend_from_slice(&a.prompt[a.prefilled..a.prefilled + len]);
            // As `Model::forward` of the whole prompt: a prompt of several
            // tokens runs on the prompt path, whatever its chunks.
            let prompt = a.prompt.len() > 1;
            parts.push(Part { slot, len, samples: a.prefilled + len == a.prompt.len(), prompt, decode: false });
            room -= len;
        }
        (tokens, parts)
    }

    /// One forward step over the planned parts, then sampling.
    pub(super) fn step(&mut self) {
        let (tokens, parts) = self.plan();
        if parts.is_empty() {
            return;
        }
        let t0 = Instant::now();
        let lens: Vec<usize> = parts.iter().map(|p| p.len).collect();
        let prompt: Vec<bool> = parts.iter().map(|p| p.prompt).collect();
        let mut refs: Vec<Option<&mut KvCache>> = self.kvs.iter_mut().map(Some).collect();
        let mut seqs: Vec<&mut KvCache> = parts.iter().filter_map(|p| refs[p.slot].take()).collect();
        if let Err(e) = self.engine.model.forward_batch(&mut self.work, &mut seqs, &tokens, &lens, &prompt) {
            tracing::error!(error = %e, "a batch step failed: its requests are failed");
            return self.fail(&parts, &e);
        }
        let took = t0.elapsed();
        if let Err(e) = self.send_prompt_logprobs(&parts) {
            tracing::error!(error = %e, "the output head failed: the step's requests are failed");
            return self.fail(&parts, &e);
        }
        // Rows whose logits choose a token: the last of a prompt's last
        // chunk, every row of a decoding part (its token's, then its
        // draft's).
        let mut rows = Vec::new();
        let mut end = 0;
        for p in &parts {
            end += p.len;
            if p.samples {
                rows.extend(end - p.sampled()..end);
            }
        }
        for p in parts.iter().filter(|p| !p.samples) {
            if let Some(a) = self.active[p.slot].as_mut() {
                a.prefilled += p.len;
            }
        }
        let vocab = self.engine.model.config.vocab_size;
        let logits = match self.engine.model.logits_of_rows(&mut self.work, &rows) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "the output head failed: the step's sampling requests are failed");
                return self.fail(parts.iter().filter(|p| p.samples), &e);
            }
        };
        let (mut finished, mut chosen, mut row, mut end) = (Vec::new(), 0, 0, 0);
        for p in &parts {
            end += p.len;
            if !p.samples {
                continue;
            }
            let sampled = p.sampled();
            let part_rows = &logits[row * vocab..(row + sampled) * vocab];
            row += sampled;
            let Some(a) = self.active[p.slot].as_mut() else { continue };
            a.prefilled = a.prompt.len();
            let kv = &mut self.kvs[p.slot];
            // The cache held `base` tokens before the first sampled row's.
            let base = kv.pos() - sampled;
            // Each row chooses a token while the tokens chosen are the draft's.
            let drafted = &tokens[end - sampled + 1..end];
            let mut taken = 0;
            for r in part_rows.chunks_exact(vocab) {
                taken += 1;
                match choose(a, &self.metrics, r, base + taken, kv.ctx()) {
                    Some(Some(t)) if drafted.get(taken - 1) == Some(&t) => {}
                    Some(next) => {
                        a.next = next;
                        break;
                    }
                    None => {
                        a.next = None;
                        break;
                    }
                }
            }
            chosen += taken;
            if sampled > 1 {
                // The cache keeps the token run and the draft's tokens chosen.
                let accepted = taken - 1;
                if let Some(d) = a.drafter.as_mut() {
                    d.record(sampled - 1, accepted);
                }
                self.metrics.draft_tokens.inc_by((sampled - 1) as u64);
                self.metrics.draft_accepted_tokens.inc_by(accepted as u64);
                if let Err(e) = kv.truncate(base + taken) {
                    let _ = a.events.send(Event::Failed(ApiError::internal(e.to_string())));
                    a.next = None;
                }
            }
            if a.next.is_none() {
                finished.push(p.slot);
            }
        }
        self.record_step(&parts, took, chosen);
        for slot in finished {
            self.finish(slot);
        }
    }

    /// The log-probabilities of the prompt tokens the step's prompt chunks
    /// predict, for the requests that asked for them (`echo` with
    /// `logprobs`): row i of a chunk predicts the prompt's next token. The
    /// head runs on a few rows at a time, bounding its logits' memory.
    fn send_prompt_logprobs(&mut self, parts: &[Part]) -> spinfer_models::Result<()> {
        const ROWS: usize = 16;
        let vocab = self.engine.model.config.vocab_size;
        let mut row0 = 0;
        for p in parts {
            let first = row0;
            row0 += p.len;
            let Some(a) = self.active[p.slot].as_ref() else { continue };
            let (Some(k), true) = (a.logprobs, a.prompt_logprobs && a.prefilled < a.prompt.len()) else { continue };
            // Prompt index of the chunk's first row; rows with a prompt token to predict.
            let at = a.prefilled;
            let n = p.len.min(a.prompt.len() - 1 - at);
            let mut out = Vec::with_capacity(n);
            for g in (0..n).step_by(ROWS) {
                let rows: Vec<usize> = (first + g..first + n.min(g + ROWS)).collect();
                let logits = self.engine.model.logits_of_rows(&mut self.work, &rows)?;
                for (j, row) in logits.chunks_exact(vocab).enumerate() {
                    out.push(TokenLogprob::of(row, a.prompt[at + g + j + 1], k));
                }
            }
            if !out.is_empty() {
                let _ = a.events.send(Event::Prompt(out));
            }
        }
        Ok(())
    }

    /// Fails the requests of `parts` with `e`, freeing their slots.
    fn fail<'p>(&mut self, parts: impl IntoIterator<Item = &'p Part>, e: &spinfer_models::Error) {
        let e = ApiError::internal(e.to_string());
        for p in parts {
            if let Some(a) = &self.active[p.slot] {
                let _ = a.events.send(Event::Failed(e.clone()));
            }
            self.free(p.slot);
        }
    }

    /// Counts the step: its rows, prompt tokens, and the `chosen` tokens
    /// (several for a request whose draft was accepted).
    fn record_step(&mut self, parts: &[Part], took: Duration, chosen: usize) {
        let decode_rows: usize = parts.iter().filter(|p| p.decode).map(|p| p.len).sum();
        let rows: usize = parts.iter().map(|p| p.len).sum();
        let prompt_rows = rows - decode_rows;
        // A prompt's first token is counted as a decode step's were.
        let generated = chosen - parts.iter().filter(|p| p.samples && !p.decode).count();
        let secs = took.as_secs_f64().max(1e-9);
        self.metrics.batch_rows.observe(rows as f64);
        self.metrics.prompt_tokens.inc_by(prompt_rows as u64);
        self.metrics.generated_tokens.inc_by(generated as u64);
        if prompt_rows > 0 {
            self.metrics.prefill_tps.set(prompt_rows as f64 / secs);
        } else {
            self.metrics.decode_tps.set(generated as f64 / secs);
        }
        if self.engine.model.sparse.is_some() {
            let st = self.work.sparsity_stats();
            let (active, tokens) = st.layers.iter().fold((0, 0), |(a, t), c| (a + c.active, t + c.tokens));
            let total = tokens * st.ffn_dim as u64;
            self.metrics.ffn_neurons_kept.inc_by(active.saturating_sub(self.ffn_seen.0));
            self.metrics.ffn_neurons.inc_by(total.saturating_sub(self.ffn_seen.1));
            self.ffn_seen = (active, total);
        }
    }
}

/// Chooses `a`'s next token from `row` (its cache then holding `pos` of
/// `ctx` positions) and sends the text that became final with the
/// token's log-probability. `Some(token)`: the token to run next (`None`
/// inside: the continuation is over); `None`: choosing failed, and the
/// request was told.
fn choose(a: &mut Active<'_>, metrics: &Metrics, row: &[f32], pos: usize, ctx: usize) -> Option<Option<u32>> {
    let (chosen, mut text) = (a.cont.tokens().len(), String::new());
    let mut on_text = |piece: &str| {
        text.push_str(piece);
        ControlFlow::Continue(())
    };
    match a.cont.next(row, pos, ctx, &mut on_text) {
        Ok(next) => {
            if !a.first_token {
                a.first_token = true;
                metrics.ttft.observe(a.received.elapsed().as_secs_f64());
            }
            // The token chosen, unless it ended the generation.
            let logprob = a.logprobs.and_then(|k| a.cont.tokens().get(chosen).map(|&t| TokenLogprob::of(row, t, k)));
            if !text.is_empty() || logprob.is_some() {
                let _ = a.events.send(Event::Piece { text, logprob });
            }
            Some(next)
        }
        Err(e) => {
            let _ = a.events.send(Event::Failed(e.into()));
            None
        }
    }
}
