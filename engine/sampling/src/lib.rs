//! Token sampling: repetition penalty, top-k, top-p, min-p, temperature,
//! seeded randomness. The chain runs in llama.cpp's order (penalties,
//! top-k, top-p, min-p, temperature, draw); temperature 0 is greedy.
//! A [`TokenConstraint`] (structured outputs: a grammar, a JSON schema)
//! masks the logits before the chain.

use std::collections::HashMap;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A sampler setting out of range, named; a constraint that failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The output constraint could not go on (its grammar allows no token
    /// the model has, or it was given a token it forbids).
    #[error("output constraint: {0}")]
    Constraint(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplerParams {
    /// 0 = greedy (argmax after penalties).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches `top_p`; 1 = off.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the best; 0 = off.
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recent tokens; 1 = off.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    /// OpenAI's `frequency_penalty`: subtracted from a token's logit once
    /// for each time it was generated so far; 0 = off.
    pub frequency_penalty: f32,
    /// OpenAI's `presence_penalty`: subtracted once from the logit of
    /// every token generated so far; 0 = off.
    pub presence_penalty: f32,
    /// Added to the logits of these token ids (OpenAI's `logit_bias`,
    /// -100 to 100: -100 bans a token in effect, 100 forces it; -inf bans
    /// it outright); an id outside the logits is ignored.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl Default for SamplerParams {
    /// llama.cpp's defaults.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

impl SamplerParams {
    /// Greedy decoding with no penalties.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, repeat_penalty: 1.0, ..Self::default() }
    }

    /// Temperature 0, no penalty and no bias: the pick is then the first
    /// largest logit itself ([`argmax_logits`]).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0 && !self.changes_logits()
    }

    /// Whether a penalty or bias moves logits before the chain.
    fn changes_logits(&self) -> bool {
        self.repeat_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || !self.logit_bias.is_empty()
    }

    /// Rejects out-of-range values with a message naming the parameter.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::InvalidArgument(format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidArgument(format!("top-p must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::InvalidArgument(format!("min-p must be in [0, 1], got {}", self.min_p)));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return Err(Error::InvalidArgument(format!("repeat penalty must be > 0, got {}", self.repeat_penalty)));
        }
        for (name, v) in [("frequency penalty", self.frequency_penalty), ("presence penalty", self.presence_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::InvalidArgument(format!("{name} must be in [-2, 2], got {v}")));
            }
        }
        let in_range = |b: f32| b == f32::NEG_INFINITY || (-100.0..=100.0).contains(&b);
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !in_range(*b)) {
            return Err(Error::InvalidArgument(format!(
                "logit bias of token {t} must be in [-100, 100] (or -inf, a ban), got {b}"
            )));
        }
        Ok(())
    }
}

/// Which tokens may come next: a grammar or JSON schema the output must
/// follow. One per generation, stateful; the generation loop masks every
/// step's logits with it and commits the token chosen.
pub trait TokenConstraint: Send {
    /// Sets the logits of the tokens that may not come next to -inf
    /// (end-of-generation ids stay only where the output may end here).
    fn mask(&mut self, logits: &mut [f32]) -> Result<()>;
    /// Takes the token chosen (never an end-of-generation id). `true`: the
    /// output is complete and nothing may follow it.
    fn commit(&mut self, token: u32) -> Result<bool>;
}

/// Makes a fresh [`TokenConstraint`] for each generation that uses it (a
/// compiled grammar, cloned in its start state).
#[derive(Clone)]
pub struct ConstraintSource(Arc<dyn Fn() -> Result<Box<dyn TokenConstraint>> + Send + Sync>);

impl ConstraintSource {
    pub fn new(make: impl Fn() -> Result<Box<dyn TokenConstraint>> + Send + Sync + 'static) -> Self {
        Self(Arc::new(make))
    }

    /// A constraint in its start state.
    pub fn make(&self) -> Result<Box<dyn TokenConstraint>> {
        (self.0)()
    }
}

impl std::fmt::Debug for ConstraintSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConstraintSource(..)")
    }
}

/// A stateful sampler (owns its RNG and reusable buffers).
pub struct Sampler {
    params: SamplerParams,
    rng: StdRng,
    cand: Vec<(u32, f32)>,
    /// Tokens and their counts, for the penalties (reused: the repetition
    /// penalty's set of tokens seen, then the generated tokens' counts).
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Result<Self> {
        params.validate()?;
        let rng = StdRng::seed_from_u64(params.seed);
        Ok(Self { params, rng, cand: Vec::new(), counts: HashMap::new() })
    }

    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// Picks the next token from `logits`. `history` holds every token so
    /// far, the prompt's then the generated ones, the last `generated` of
    /// them generated: the repetition penalty looks at the last
    /// `repeat_last_n` of all (llama.cpp), the frequency and presence
    /// penalties at the generated ones (OpenAI, vLLM).
    pub fn sample(&mut self, logits: &[f32], history: &[u32], generated: usize) -> u32 {
        let p = &self.params;
        // Greedy without a penalty: the arg-max of the logits themselves
        // (no candidate list; a 262,144-token vocabulary is 1 MB per token).
        if p.is_plain_greedy() {
            return argmax_logits(logits);
        }
        self.cand.clear();
        self.cand.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));

        // Logit biases first (llama.cpp's order), then the penalties.
        for &(t, b) in &p.logit_bias {
            if let Some(c) = self.cand.get_mut(t as usize) {
                c.1 += b;
            }
        }

        // Repetition penalty over the last `repeat_last_n` tokens (each
        // distinct token penalised once).
        if p.repeat_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(p.repeat_last_n)..];
            self.counts.clear();
            for &t in recent {
                if let Some(c) = self.cand.get_mut(t as usize)
                    && self.counts.insert(t, 1).is_none()
                {
                    c.1 = if c.1 > 0.0 { c.1 / p.repeat_penalty } else { c.1 * p.repeat_penalty };
                }
            }
        }

        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            self.counts.clear();
            for &t in &history[history.len().saturating_sub(generated)..] {
                *self.counts.entry(t).or_insert(0) += 1;
            }
            for (&t, &n) in &self.counts {
                if let Some(c) = self.cand.get_mut(t as usize) {
                    c.1 -= n as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }

        if p.temperature <= 0.0 {
            return argmax(&self.cand);
        }

        // Top-k, then sort the survivors best first.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_unstable_by(by_logit);

        // Top-p and min-p on the untempered distribution.
        let probs = softmax_of(&self.cand, 1.0);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = probs.len();
            for (i, &pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let cut = probs[0] * p.min_p;
            let keep = probs.iter().take(self.cand.len()).take_while(|&&pr| pr >= cut).count();
            self.cand.truncate(keep.max(1));
        }

        // Temperature, then draw.
        let probs = softmax_of(&self.cand, p.temperature);
        let r: f64 = self.rng.random();
        let mut cum = 0.0;
        for (c, pr) in self.cand.iter().zip(&probs) {
            cum += *pr as f64;
            if r < cum {
                return c.0;
            }
        }
        self.cand.last().map_or(0, |c| c.0)
    }
}

/// The first index of the largest logit (NaN never wins; 0 when no logit
/// is above -inf): the greedy pick, the same as the candidate list's
/// arg-max over `(i, logits[i])`. The maximum is taken over 16 independent
/// lanes (a max is exact in any order, and the lanes vectorise), then its
/// first position is found.
pub fn argmax_logits(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if max == f32::NEG_INFINITY {
        return 0;
    }
    logits.iter().position(|&v| v == max).map_or(0, |i| i as u32)
}

fn argmax(c: &[(u32, f32)]) -> u32 {
    let mut best = (0u32, f32::NEG_INFINITY);
    for &(i, l) in c {
        if l > best.1 {
            best = (i, l);
        }
    }
    best.0
}

fn softmax_of(c: &[(u32, f32)], temp: f32) -> Vec<f32> {
    let max = c.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
    let mut p: Vec<f32> = c.iter().map(|x| ((x.1 - max) / temp).exp()).collect();
    let s: f32 = p.iter().sum();
    for v in &mut p {
        *v /= s;
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_and_penalty_applies() {
        let logits = [0.1, 2.0, 1.9, -1.0];
        let mut s = Sampler::new(SamplerParams::greedy()).unwrap();
        assert_eq!(s.sample(&logits, &[], 0), 1);
        let mut s = Sampler::new(SamplerParams { repeat_penalty: 1.2, ..SamplerParams::greedy() }).unwrap();
        assert_eq!(s.sample(&logits, &[1], 0), 2);
    }

    /// The greedy fast path picks what the candidate list's arg-max picks:
    /// random logits with ties, NaNs, infinities and lengths around the
    /// lane count.
    #[test]
    fn greedy_fast_path_equals_the_candidate_argmax() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for len in [0usize, 1, 5, 15, 16, 17, 33, 1000, 262_144] {
            for case in 0..6 {
                let logits: Vec<f32> = (0..len)
                    .map(|_| {
                        let r = next();
                        match (case, r % 50) {
                            (1, 0) => f32::NAN,
                            (2, 0) => f32::NEG_INFINITY,
                            (3, _) => f32::NEG_INFINITY,
                            (4, 0) => f32::INFINITY,
                            (5, _) => (r % 4) as f32, // many ties
                            _ => (r >> 40) as f32 / (1u64 << 20) as f32 - 8.0,
                        }
                    })
                    .collect();
                let cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
                assert_eq!(argmax_logits(&logits), argmax(&cand), "length {len}, case {case}");
            }
        }
    }

    #[test]
    fn seeded_sampling_is_deterministic_and_respects_top_k() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.3).collect();
        let params =
            SamplerParams { temperature: 1.0, top_k: 3, top_p: 1.0, min_p: 0.0, seed: 42, ..Default::default() };
        let run = || {
            let mut s = Sampler::new(params.clone()).unwrap();
            (0..50).map(|_| s.sample(&logits, &[], 0)).collect::<Vec<_>>()
        };
        let a = run();
        assert_eq!(a, run());
        // The three best logits (value 1.8) are ids 6, 13, 20.
        assert!(a.iter().all(|t| [6, 13, 20].contains(t)), "{a:?}");
        assert!(a.iter().any(|&t| t != a[0]), "sampling never varied");
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let logits = [10.0, 9.0, 0.0, -5.0];
        for params in [
            SamplerParams { temperature: 1.0, top_k: 0, top_p: 0.5, min_p: 0.0, ..Default::default() },
            SamplerParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.5, ..Default::default() },
        ] {
            let mut s = Sampler::new(params).unwrap();
            for _ in 0..50 {
                assert_eq!(s.sample(&logits, &[], 0), 0);
            }
        }
    }

    /// OpenAI's penalties count only generated tokens; a bias moves one
    /// logit; each turns plain greedy off.
    #[test]
    fn frequency_presence_and_bias() {
        let logits = [3.0, 2.5, 2.4, 0.0];
        let greedy = SamplerParams::greedy();
        let pick = |params: SamplerParams, history: &[u32], generated: usize| {
            assert!(!params.is_plain_greedy());
            Sampler::new(params).unwrap().sample(&logits, history, generated)
        };
        // Token 0 generated twice: 3.0 - 2 * 0.3 = 2.4 loses to 2.5.
        let freq = SamplerParams { frequency_penalty: 0.3, ..greedy.clone() };
        assert_eq!(pick(freq.clone(), &[0, 0], 2), 1);
        assert_eq!(pick(freq.clone(), &[0, 0], 1), 0, "3.0 - 0.3: a prompt token is not counted");
        // Presence: once per distinct token, however often.
        let pres = SamplerParams { presence_penalty: 0.55, ..greedy.clone() };
        assert_eq!(pick(pres.clone(), &[0, 0, 0], 3), 1);
        assert_eq!(pick(SamplerParams { presence_penalty: 0.45, ..greedy.clone() }, &[0, 0, 0], 3), 0);
        // Negative values encourage repeats.
        assert_eq!(pick(SamplerParams { presence_penalty: -1.0, ..greedy.clone() }, &[3], 1), 0);
        assert_eq!(pick(SamplerParams { presence_penalty: -2.0, ..greedy.clone() }, &[2], 1), 2);
        // Bias: -100 bans, +100 forces; ids past the logits are ignored.
        assert_eq!(pick(SamplerParams { logit_bias: vec![(0, -100.0)], ..greedy.clone() }, &[], 0), 1);
        assert_eq!(pick(SamplerParams { logit_bias: vec![(3, 100.0), (99, 5.0)], ..greedy.clone() }, &[], 0), 3);
        // Sampled too, not only greedy: a banned token never comes.
        let mut s = Sampler::new(SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            logit_bias: vec![(0, -100.0)],
            ..Default::default()
        })
        .unwrap();
        assert!((0..200).all(|_| s.sample(&logits, &[], 0) != 0));
        for bad in [
            SamplerParams { frequency_penalty: 2.5, ..greedy.clone() },
            SamplerParams { presence_penalty: f32::NAN, ..greedy.clone() },
            SamplerParams { logit_bias: vec![(1, 101.0)], ..greedy.clone() },
        ] {
            assert!(Sampler::new(bad).is_err());
        }
    }

    #[test]
    fn invalid_params_are_rejected() {
        assert!(Sampler::new(SamplerParams { top_p: 0.0, ..Default::default() }).is_err());
        assert!(Sampler::new(SamplerParams { temperature: -1.0, ..Default::default() }).is_err());
    }
}
