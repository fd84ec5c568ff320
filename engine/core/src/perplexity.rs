//! Perplexity by the reference protocol: the token stream is cut into
//! non-overlapping windows of `ctx` tokens from the start; each window runs
//! from an empty cache and every token after the first is scored by the
//! logits of the position before it; ppl = exp(mean NLL).
//!
//! [`perplexity_after_prompt`] is the same with each window split into a
//! prompt, run first and not scored, and a continuation, run as a second
//! forward: what a predictor that chooses its neurons from the prompt
//! (sentence-level) needs to be measured on the text it did not see.

use spinfer_models::model::{Model, Session};
use spinfer_models::{Error, Result};

/// Rows of logits computed at once (bounds memory to rows × vocab floats).
const LOGIT_ROWS: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Perplexity {
    pub ppl: f64,
    /// Sum of negative log-likelihoods (nats).
    pub nll: f64,
    pub scored_tokens: usize,
    pub windows: usize,
}

/// Scores `tokens` in windows of `ctx`; at most `max_windows` windows if
/// given. `progress(done, total, running_ppl)` is called after each window.
pub fn perplexity(
    model: &Model,
    session: &mut Session,
    tokens: &[u32],
    ctx: usize,
    max_windows: Option<usize>,
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<Perplexity> {
    perplexity_after_prompt(model, session, tokens, ctx, 0, max_windows, progress)
}

/// As [`perplexity`], but each window's first `prompt` tokens are run as
/// one forward and not scored; the rest run as a second forward, whose
/// every token but the first is scored by the position before it
/// (`ctx − prompt − 1` per window). `prompt == 0` is [`perplexity`]: one
/// forward, `ctx − 1` scored.
pub fn perplexity_after_prompt(
    model: &Model,
    session: &mut Session,
    tokens: &[u32],
    ctx: usize,
    prompt: usize,
    max_windows: Option<usize>,
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<Perplexity> {
    if prompt + 2 > ctx && prompt > 0 {
        return Err(Error::InvalidArgument(format!(
            "a prompt of {prompt} tokens leaves nothing to score in a window of {ctx}"
        )));
    }
    let windows = count_windows(session, tokens, ctx, 0, max_windows)?;
    let split = |w: usize| tokens[w * ctx..(w + 1) * ctx].split_at(prompt);
    score_windows(model, session, windows, &split, progress)
}

/// As [`perplexity`], but each window runs as `prefix + window` from an
/// empty cache, the prefix unscored: `[<bos>] + window` is how a model that
/// needs its BOS (Gemma) is measured on text windows; the targets are those
/// of [`perplexity`] on the same windows (`ctx − 1` per window). The
/// session must hold `prefix.len() + ctx` positions.
pub fn perplexity_with_prefix(
    model: &Model,
    session: &mut Session,
    tokens: &[u32],
    ctx: usize,
    prefix: &[u32],
    max_windows: Option<usize>,
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<Perplexity> {
    let windows = count_windows(session, tokens, ctx, prefix.len(), max_windows)?;
    let split = |w: usize| (prefix, &tokens[w * ctx..(w + 1) * ctx]);
    score_windows(model, session, windows, &split, progress)
}

/// Whole windows of `ctx` tokens to score (at most `max_windows`), after
/// checking the session holds `extra + ctx` positions.
fn count_windows(
    session: &Session,
    tokens: &[u32],
    ctx: usize,
    extra: usize,
    max_windows: Option<usize>,
) -> Result<usize> {
    if ctx < 2 {
        return Err(Error::InvalidArgument(format!("perplexity window must be at least 2 tokens, got {ctx}")));
    }
    if ctx + extra > session.ctx() {
        return Err(Error::ContextOverflow { needed: ctx + extra, ctx: session.ctx() });
    }
    let available = tokens.len() / ctx;
    let windows = max_windows.map_or(available, |w| w.min(available));
    if windows == 0 {
        return Err(Error::InvalidArgument(format!(
            "the text has {} tokens, fewer than one window of {ctx}",
            tokens.len()
        )));
    }
    Ok(windows)
}

/// Runs window `w` as `split(w) = (prompt, continuation)` from an empty
/// cache, for each of `windows`: the prompt as one forward (unscored), the
/// continuation as a second, whose position i is scored on its token i + 1.
fn score_windows<'t>(
    model: &Model,
    session: &mut Session,
    windows: usize,
    split: &dyn Fn(usize) -> (&'t [u32], &'t [u32]),
    progress: &mut dyn FnMut(usize, usize, f64),
) -> Result<Perplexity> {
    let vocab = model.config.vocab_size;
    let (mut nll, mut scored) = (0f64, 0usize);
    for w in 0..windows {
        let (prompt, win) = split(w);
        session.reset();
        if !prompt.is_empty() {
            model.forward(session, prompt)?;
        }
        model.forward(session, win)?;
        let mut start = 0;
        while start < win.len() - 1 {
            let end = (start + LOGIT_ROWS).min(win.len() - 1);
            let logits = model.logits(session, start..end)?;
            for (r, row) in logits.chunks_exact(vocab).enumerate() {
                nll -= log_softmax_at(row, win[start + r + 1] as usize);
                scored += 1;
            }
            start = end;
        }
        progress(w + 1, windows, (nll / scored as f64).exp());
    }
    Ok(Perplexity { ppl: (nll / scored as f64).exp(), nll, scored_tokens: scored, windows })
}

/// `log softmax(row)[i]`, accumulated in f64.
pub fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    row[i] as f64 - log_sum_exp(row)
}

/// `log Σ exp(row)`, accumulated in f64 (`log softmax(row)[i]` is
/// `row[i]` less it).
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_definition() {
        let row = [1.0f32, 2.0, 3.0];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        assert!((log_softmax_at(&row, 2) - (3.0 - z.ln())).abs() < 1e-12);
    }
}
