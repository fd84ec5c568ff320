//! The generation loop: prefill the prompt in one batch, then decode token
//! by token (or a draft's tokens at once), streaming text as it becomes
//! valid UTF-8 and stopping on an end-of-generation token, a stop string,
//! the token budget or a full context.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use spinfer_models::{Error, Model, Result, Session};
use spinfer_tokenizer::Tokenizer;

use crate::{Continuation, DraftParams, DraftStats, Drafter, GenerateParams, StopReason};

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
    /// What speculative decoding did (all zero without drafts).
    pub draft: DraftStats,
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
    /// Runs `tokens` at the next positions, each row bit for bit as a
    /// decode step of it alone would, and returns every row's next-token
    /// logits (`tokens.len() x vocab`, row-major): a draft checked in one
    /// step. `None`: the session cannot (drafts are then not made).
    fn forward_rows(&mut self, tokens: &[u32]) -> Result<Option<&[f32]>> {
        let _ = tokens;
        Ok(None)
    }
    /// Drops the cached tokens after `pos` (a draft's rejected tokens).
    fn truncate(&mut self, pos: usize) -> Result<()> {
        Err(Error::InvalidArgument(format!("this session cannot go back to position {pos}")))
    }
}

/// The CPU model and a session of it.
pub struct CpuSession<'a> {
    model: &'a Model,
    session: &'a mut Session,
}

impl<'a> CpuSession<'a> {
    pub fn new(model: &'a Model, session: &'a mut Session) -> Self {
        Self { model, session }
    }
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
    fn forward_rows(&mut self, tokens: &[u32]) -> Result<Option<&[f32]>> {
        if tokens.len() > self.model.max_batch_tokens() {
            return Ok(None);
        }
        self.model.forward_decode_rows(self.session, tokens)?;
        let rows: Vec<usize> = (0..tokens.len()).collect();
        self.model.logits_of_rows(self.session, &rows).map(Some)
    }
    fn truncate(&mut self, pos: usize) -> Result<()> {
        self.session.truncate(pos)
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

    // Prefill: the whole prompt as one batch.
    let t = Instant::now();
    session.forward(&prompt_ids)?;
    timings.prefill = t.elapsed();

    let draft = decode(session, &mut cont, params.draft, &mut timings, on_text)?;
    let (text, tokens, stop_reason) = cont.finish(on_text);
    Ok(Generation { text, tokens, prompt_tokens: prompt_ids.len(), stop_reason, timings, draft })
}

/// Decodes `cont` in `session`, whose last forward call ran the prompt
/// (or its part after what the cache held), until the continuation ends;
/// with `draft` on, a step also checks a draft. Afterwards the session's
/// cache holds the first [`DecodeSession::pos`] tokens of
/// [`Continuation::history`] (the last token chosen is not run).
pub fn decode(
    session: &mut dyn DecodeSession,
    cont: &mut Continuation<'_>,
    draft: DraftParams,
    timings: &mut Timings,
    on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Result<DraftStats> {
    if draft.enabled() {
        draft.validate()?;
    }
    // Greedy without a penalty, the session may pick the token itself.
    let greedy = cont.is_greedy();
    let mut logits = Vec::new();
    let mut picked = next_choice(session, greedy, &mut logits)?;
    let mut drafter = draft.enabled().then(|| Drafter::new(draft));
    'decode: loop {
        // Choose the next token.
        let ts = Instant::now();
        let next = match picked {
            Some(token) => cont.next_chosen(token, session.pos(), session.ctx(), on_text)?,
            None => cont.next(&logits, session.pos(), session.ctx(), on_text)?,
        };
        timings.sample += ts.elapsed();
        let Some(mut next) = next else { break };
        let ts = Instant::now();
        // Run it with a draft of what follows while drafts are accepted:
        // each step then chooses the token after the last one accepted.
        while let Some(d) = &mut drafter {
            match draft_step(session, cont, d, next, on_text)? {
                Drafted::None => break,
                Drafted::Unable => {
                    drafter = None;
                    break;
                }
                Drafted::Next(token) => next = token,
                Drafted::Over => {
                    timings.decode += ts.elapsed();
                    break 'decode;
                }
            }
        }
        session.forward(&[next])?;
        picked = next_choice(session, greedy, &mut logits)?;
        timings.decode += ts.elapsed();
    }
    Ok(drafter.map(|d| d.stats()).unwrap_or_default())
}

/// What a step with a draft came to.
enum Drafted {
    /// Nothing to draft: run the token alone.
    None,
    /// The session cannot check drafts: stop making them.
    Unable,
    /// The token and the accepted part of a draft ran; this one is next.
    Next(u32),
    /// The continuation ended within the step.
    Over,
}

/// Runs `next` and a draft of what follows it in one step, then chooses
/// tokens from the step's rows while they agree with the draft, leaving
/// the session's cache at the last token chosen from its own logits.
fn draft_step(
    session: &mut dyn DecodeSession,
    cont: &mut Continuation<'_>,
    drafter: &mut Drafter,
    next: u32,
    on_text: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Result<Drafted> {
    let (pos, ctx) = (session.pos(), session.ctx());
    // Room: positions after `next`, and tokens still to choose after the
    // one its row chooses.
    let room = ctx.saturating_sub(pos + 1).min(cont.remaining().saturating_sub(1));
    let draft = drafter.propose(cont.history(), room);
    if draft.is_empty() {
        return Ok(Drafted::None);
    }
    let tokens: Vec<u32> = std::iter::once(next).chain(draft.iter().copied()).collect();
    let Some(rows) = session.forward_rows(&tokens)? else { return Ok(Drafted::Unable) };
    let (accepted, then) = cont.verify(&tokens[1..], rows, pos, ctx, on_text)?;
    drafter.record(tokens.len() - 1, accepted);
    session.truncate(pos + 1 + accepted)?;
    Ok(then.map_or(Drafted::Over, Drafted::Next))
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
