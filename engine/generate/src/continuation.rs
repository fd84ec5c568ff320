//! One request's side of the generation loop: sampling, text, stop
//! strings, the token budget, and checking a draft's tokens.

use std::ops::ControlFlow;

use spinfer_models::{Error, Result};
use spinfer_sampling::{ConstraintSource, Sampler, TokenConstraint};
use spinfer_tokenizer::{StopWatcher, StreamDecoder, Tokenizer};

use crate::{GenerateParams, StopReason};

/// One request's side of the generation loop, apart from the model: it
/// samples each next token from the logits it is given, turns tokens into
/// text, watches for stop strings and the token budget. The loop above
/// drives one with one session; a server drives many with one batched
/// forward step ([`spinfer_models::Model::forward_batch`]).
pub struct Continuation<'t> {
    sampler: Sampler,
    /// The output constraint.
    constraint: Option<Box<dyn TokenConstraint>>,
    /// End-of-generation tokens are masked until this many tokens are
    /// generated (`usize::MAX`: always).
    eog_from: usize,
    /// The tokens that end the generation: the tokenizer's
    /// end-of-generation tokens and the request's stop tokens.
    eog: Vec<u32>,
    /// Those masked until `eog_from`: all of them (`min_tokens`), or the
    /// tokenizer's alone (`ignore_eos`, which keeps the stop tokens).
    held: Vec<u32>,
    /// The logits after masking (a constraint's, end-of-generation).
    masked: Vec<f32>,
    history: Vec<u32>,
    out: StopWatcher,
    decoder: StreamDecoder<'t>,
    tokens: Vec<u32>,
    max_tokens: usize,
    stop_reason: Option<StopReason>,
}

impl<'t> Continuation<'t> {
    /// A continuation of `prompt_ids` with `params`' sampler, stop strings
    /// and token budget.
    pub fn new(tokenizer: &'t Tokenizer, params: &GenerateParams, prompt_ids: &[u32]) -> Result<Self> {
        let eog: Vec<u32> = tokenizer.eog_ids().iter().chain(&params.stop_tokens).copied().collect();
        let held = if params.ignore_eos { tokenizer.eog_ids().to_vec() } else { eog.clone() };
        Ok(Self {
            sampler: Sampler::new(params.sampler.clone())?,
            constraint: params.constraint.as_ref().map(ConstraintSource::make).transpose()?,
            eog_from: if params.ignore_eos { usize::MAX } else { params.min_tokens },
            eog,
            held,
            masked: Vec::new(),
            history: prompt_ids.to_vec(),
            out: StopWatcher::new(params.stop.clone()),
            decoder: StreamDecoder::new(tokenizer),
            tokens: Vec::new(),
            max_tokens: params.max_tokens,
            stop_reason: (params.max_tokens == 0).then_some(StopReason::MaxTokens),
        })
    }

    /// Chooses the next token from `logits` (those after the last token
    /// run, the model's cache holding `pos` of `ctx` positions) and hands
    /// the text that became final to `on_text`. `Some(token)`: run it and
    /// call again with its logits; `None`: the continuation is over.
    pub fn next(
        &mut self,
        logits: &[f32],
        pos: usize,
        ctx: usize,
        on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Option<u32>> {
        if self.stop_reason.is_some() {
            return Ok(None);
        }
        let suppress = self.tokens.len() < self.eog_from;
        let next = if self.constraint.is_none() && !suppress {
            self.sampler.sample(logits, &self.history, self.tokens.len())
        } else {
            self.masked.clear();
            self.masked.extend_from_slice(logits);
            if let Some(c) = &mut self.constraint {
                c.mask(&mut self.masked)?;
            }
            if suppress {
                self.mask_eog();
            }
            self.sampler.sample(&self.masked, &self.history, self.tokens.len())
        };
        self.next_chosen(next, pos, ctx, on_text)
    }

    /// Masks the end-of-generation tokens in `masked`, unless a constraint
    /// left nothing else (its output is complete: it ends).
    fn mask_eog(&mut self) {
        let eog = &self.held;
        let other = |(i, l): (usize, &f32)| *l > f32::NEG_INFINITY && !eog.contains(&(i as u32));
        if self.constraint.is_some() && !self.masked.iter().enumerate().any(other) {
            return;
        }
        for &t in eog {
            if let Some(l) = self.masked.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Whether the sampler is plain greedy (temperature 0, no penalty, no
    /// constraint, end-of-generation tokens allowed): its pick is then the
    /// first largest logit, which a session may make itself
    /// ([`crate::DecodeSession::next_token_greedy`]).
    pub fn is_greedy(&self) -> bool {
        self.sampler.params().is_plain_greedy() && self.constraint.is_none() && self.eog_from == 0
    }

    /// [`Continuation::next`] with the token already chosen (by
    /// [`crate::DecodeSession::next_token_greedy`], when [`Continuation::is_greedy`]).
    pub fn next_chosen(
        &mut self,
        next: u32,
        pos: usize,
        ctx: usize,
        on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Option<u32>> {
        if self.stop_reason.is_some() {
            return Ok(None);
        }
        if self.eog.contains(&next) {
            return Ok(self.stop(StopReason::EndOfGeneration));
        }
        let complete = match &mut self.constraint {
            Some(c) => c.commit(next)?,
            None => false,
        };
        self.tokens.push(next);
        self.history.push(next);
        let piece = self.decoder.push(next)?;
        if let Some(held) = self.out.push(&piece, on_text) {
            return Ok(self.stop(held.into()));
        }
        if complete {
            return Ok(self.stop(StopReason::EndOfGeneration));
        }
        if self.tokens.len() >= self.max_tokens {
            return Ok(self.stop(StopReason::MaxTokens));
        }
        if pos >= ctx {
            return Ok(self.stop(StopReason::ContextFull));
        }
        Ok(Some(next))
    }

    /// Chooses tokens from the rows of a step that ran the last token
    /// chosen and then `drafted` (`rows`: one row of logits per token
    /// run, row-major, the first row's token at position `pos` of `ctx`),
    /// each from its own row as [`Continuation::next`] would, while they
    /// agree with the draft. Returns how many drafted tokens were chosen
    /// (the cache should keep the last token and those) and the token to
    /// run next (`None`: the continuation is over). So the text is the
    /// same as choosing one token per step; only fewer steps ran.
    pub fn verify(
        &mut self,
        drafted: &[u32],
        rows: &[f32],
        pos: usize,
        ctx: usize,
        on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<(usize, Option<u32>)> {
        let n = drafted.len() + 1;
        if rows.is_empty() || !rows.len().is_multiple_of(n) {
            return Err(Error::InvalidArgument(format!(
                "a step of {n} tokens gave {} logits, not one row per token",
                rows.len()
            )));
        }
        let mut chunks = rows.chunks_exact(rows.len() / n).enumerate();
        loop {
            // The last row's token is past the draft: the loop ends there.
            let Some((i, row)) = chunks.next() else { return Ok((n - 1, None)) };
            let Some(next) = self.next(row, pos + i + 1, ctx, on_text)? else { return Ok((i, None)) };
            if drafted.get(i) != Some(&next) {
                return Ok((i, Some(next)));
            }
        }
    }

    /// The prompt and the tokens chosen so far.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Tokens still to choose within `max_tokens`.
    pub fn remaining(&self) -> usize {
        self.max_tokens.saturating_sub(self.tokens.len())
    }

    /// Ends the continuation early (a cancelled request).
    pub fn cancel(&mut self) {
        self.stop_reason.get_or_insert(StopReason::Cancelled);
    }

    fn stop(&mut self, reason: StopReason) -> Option<u32> {
        self.stop_reason = Some(reason);
        None
    }

    /// Tokens generated so far (an end-of-generation token excluded).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Flushes the text held back (unless a stop string or a cancel ended
    /// it) and returns the whole text, the tokens and why it stopped.
    pub fn finish(mut self, on_text: &mut dyn FnMut(&str) -> ControlFlow<()>) -> (String, Vec<u32>, StopReason) {
        let mut reason = self.stop_reason.unwrap_or(StopReason::MaxTokens);
        if reason != StopReason::StopString && reason != StopReason::Cancelled {
            let rest = self.decoder.finish();
            if let Some(held) = self.out.push(&rest, on_text) {
                reason = held.into();
            }
            self.out.flush(on_text);
        }
        (self.out.into_text(), self.tokens, reason)
    }
}
