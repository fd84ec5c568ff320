//! The generation loop: prefill the prompt in one batch, then decode token
//! by token, streaming text as it becomes valid UTF-8 and stopping on an
//! end-of-generation token, a stop string, the token budget or a full
//! context.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use crate::model::{Model, Session};
use crate::sampling::{ConstraintSource, Sampler, SamplerParams, TokenConstraint};
use crate::{Error, Result};
use spinfer_tokenizer::{Held, StopWatcher, StreamDecoder, Tokenizer};

#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Maximum number of tokens to generate.
    pub max_tokens: usize,
    pub sampler: SamplerParams,
    /// Generation stops before the first occurrence of any of these.
    pub stop: Vec<String>,
    /// Prepend BOS; `None` = the tokenizer's default.
    pub add_bos: Option<bool>,
    /// What the output must follow (a grammar, a JSON schema); `None`: any
    /// text.
    pub constraint: Option<ConstraintSource>,
    /// End-of-generation tokens may not be chosen before this many tokens
    /// are generated (vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// End-of-generation tokens are never chosen: the generation runs to
    /// `max_tokens`, a stop string or the context (llama.cpp's
    /// `--ignore-eos`, for benchmarks).
    pub ignore_eos: bool,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampler: SamplerParams::default(),
            stop: Vec::new(),
            add_bos: None,
            constraint: None,
            min_tokens: 0,
            ignore_eos: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-generation token was sampled, or the output constraint
    /// allows nothing more.
    EndOfGeneration,
    /// A stop string appeared.
    StopString,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The context is full.
    ContextFull,
    /// The streaming callback asked to stop.
    Cancelled,
}

impl From<Held> for StopReason {
    fn from(h: Held) -> Self {
        match h {
            Held::StopString => StopReason::StopString,
            Held::Cancelled => StopReason::Cancelled,
        }
    }
}

/// Time spent in each phase of a request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    pub tokenize: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    pub sample: Duration,
}

#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated continuation (stop string excluded).
    pub text: String,
    /// Generated token ids (an end-of-generation token is not included).
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub stop_reason: StopReason,
    pub timings: Timings,
}

impl Generation {
    /// Decode speed in tokens per second (tokens after the first, which
    /// comes from the prefill's logits).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1) as f64;
        let t = self.timings.decode.as_secs_f64();
        if t > 0.0 { n / t } else { 0.0 }
    }

    pub fn prefill_tokens_per_second(&self) -> f64 {
        let t = self.timings.prefill.as_secs_f64();
        if t > 0.0 { self.prompt_tokens as f64 / t } else { 0.0 }
    }
}

/// What the generation loop needs from a model and one of its sessions, so
/// that it drives the CPU model and other back ends (the GPU's
/// `spinfer_gpu::GpuModel`) alike.
pub trait DecodeSession {
    /// Positions the session holds.
    fn ctx(&self) -> usize;
    /// Tokens already in its cache.
    fn pos(&self) -> usize;
    /// Forgets the cached tokens.
    fn reset(&mut self);
    /// Runs `tokens` at the next positions.
    fn forward(&mut self, tokens: &[u32]) -> Result<()>;
    /// The logits for choosing the next token (after the last `forward`).
    fn next_token_logits(&mut self) -> Result<&[f32]>;
    /// The greedy next token (the first largest of those logits) where the
    /// session finds it cheaper than handing out the logits (a GPU picks
    /// it on the device); `None`: take [`DecodeSession::next_token_logits`].
    fn next_token_greedy(&mut self) -> Result<Option<u32>> {
        Ok(None)
    }
}

/// The CPU model and a session of it.
struct CpuSession<'a> {
    model: &'a Model,
    session: &'a mut Session,
}

impl DecodeSession for CpuSession<'_> {
    fn ctx(&self) -> usize {
        self.session.ctx()
    }
    fn pos(&self) -> usize {
        self.session.pos()
    }
    fn reset(&mut self) {
        self.session.reset();
    }
    fn forward(&mut self, tokens: &[u32]) -> Result<()> {
        self.model.forward(self.session, tokens)
    }
    fn next_token_logits(&mut self) -> Result<&[f32]> {
        self.model.next_token_logits(self.session)
    }
}

/// Generates a continuation of `prompt` in a fresh use of `session`
/// (its cache is reset). `on_text` receives each piece of text as soon as it
/// is final; returning `ControlFlow::Break(())` cancels.
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    session: &mut Session,
    prompt: &str,
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Result<Generation> {
    generate_with(&mut CpuSession { model, session }, tokenizer, prompt, params, on_text)
}

/// [`generate`] on any [`DecodeSession`].
pub fn generate_with(
    session: &mut dyn DecodeSession,
    tokenizer: &Tokenizer,
    prompt: &str,
    params: &GenerateParams,
    on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Result<Generation> {
    let mut timings = Timings::default();
    let t0 = Instant::now();
    let prompt_ids = encode_prompt(tokenizer, prompt, params.add_bos, session.ctx())?;
    timings.tokenize = t0.elapsed();
    let mut cont = Continuation::new(tokenizer, params, &prompt_ids)?;
    session.reset();

    // Prefill: the whole prompt as one batch. Greedy without a penalty,
    // the session may pick the token itself.
    let greedy = cont.is_greedy();
    let mut logits = Vec::new();
    let t = Instant::now();
    session.forward(&prompt_ids)?;
    let mut picked = next_choice(session, greedy, &mut logits)?;
    timings.prefill = t.elapsed();

    loop {
        let ts = Instant::now();
        let next = match picked {
            Some(token) => cont.next_chosen(token, session.pos(), session.ctx(), on_text)?,
            None => cont.next(&logits, session.pos(), session.ctx(), on_text)?,
        };
        timings.sample += ts.elapsed();
        let Some(next) = next else { break };
        let ts = Instant::now();
        session.forward(&[next])?;
        picked = next_choice(session, greedy, &mut logits)?;
        timings.decode += ts.elapsed();
    }
    let (text, tokens, stop_reason) = cont.finish(on_text);
    Ok(Generation { text, tokens, prompt_tokens: prompt_ids.len(), stop_reason, timings })
}

/// The session's own greedy pick when `greedy` and it has one, else its
/// next-token logits copied into `logits`.
fn next_choice(session: &mut dyn DecodeSession, greedy: bool, logits: &mut Vec<f32>) -> Result<Option<u32>> {
    if greedy && let Some(token) = session.next_token_greedy()? {
        return Ok(Some(token));
    }
    let l = session.next_token_logits()?;
    logits.clear();
    logits.extend_from_slice(l);
    Ok(None)
}

/// The prompt's token ids (BOS per `add_bos`, else the tokenizer's
/// default), checked to be non-empty and to fit a context of `ctx`.
pub fn encode_prompt(tokenizer: &Tokenizer, prompt: &str, add_bos: Option<bool>, ctx: usize) -> Result<Vec<u32>> {
    let add_bos = add_bos.unwrap_or_else(|| tokenizer.add_bos_default());
    let ids = tokenizer.encode(prompt, add_bos)?;
    if ids.is_empty() {
        return Err(Error::InvalidArgument("the prompt is empty (no tokens to condition on)".into()));
    }
    if ids.len() > ctx {
        return Err(Error::ContextOverflow { needed: ids.len(), ctx });
    }
    Ok(ids)
}

/// One request's side of the generation loop, apart from the model: it
/// samples each next token from the logits it is given, turns tokens into
/// text, watches for stop strings and the token budget. The loop above
/// drives one with one session; a server drives many with one batched
/// forward step ([`crate::model::Model::forward_batch`]).
pub struct Continuation<'t> {
    tokenizer: &'t Tokenizer,
    sampler: Sampler,
    /// The output constraint.
    constraint: Option<Box<dyn TokenConstraint>>,
    /// End-of-generation tokens are masked until this many tokens are
    /// generated (`usize::MAX`: always).
    eog_from: usize,
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
        Ok(Self {
            tokenizer,
            sampler: Sampler::new(params.sampler.clone())?,
            constraint: params.constraint.as_ref().map(ConstraintSource::make).transpose()?,
            eog_from: if params.ignore_eos { usize::MAX } else { params.min_tokens },
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
        let eog = self.tokenizer.eog_ids();
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
    /// ([`DecodeSession::next_token_greedy`]).
    pub fn is_greedy(&self) -> bool {
        self.sampler.params().is_plain_greedy() && self.constraint.is_none() && self.eog_from == 0
    }

    /// [`Continuation::next`] with the token already chosen (by
    /// [`DecodeSession::next_token_greedy`], when [`Continuation::is_greedy`]).
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
        if self.tokenizer.eog_ids().contains(&next) {
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
