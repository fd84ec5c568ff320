//! What a generation is asked for, and why it stopped.

use spinfer_sampling::{ConstraintSource, SamplerParams};
use spinfer_tokenizer::Held;

use crate::DraftParams;

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
    /// More tokens that end the generation as an end-of-generation token
    /// does (vLLM's `stop_token_ids`): not part of the output, held off by
    /// `min_tokens` (not by `ignore_eos`, as in vLLM).
    pub stop_tokens: Vec<u32>,
    /// Drafts from the context's n-grams checked a step at a time
    /// (speculative decoding; the output is the same with or without).
    pub draft: DraftParams,
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
            stop_tokens: Vec::new(),
            draft: DraftParams::default(),
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
