//! What a request and the engine report: per-request metrics, the
//! engine's counters since load, and the kernel chosen per operation.

use std::time::Duration;

use spinfer_models::stream::StreamStats;

use crate::generate::{DraftStats, StopReason, Timings};
use crate::model::Session;

pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 1.0 } else { a as f64 / b as f64 }
}

/// The result of one generation request.
#[derive(Clone, Debug)]
pub struct Output {
    /// The generated continuation (a stop string excluded).
    pub text: String,
    /// Generated token ids (an end-of-generation token is not included).
    pub tokens: Vec<u32>,
    pub stop_reason: StopReason,
    pub metrics: RequestMetrics,
}

/// What one request cost.
#[derive(Clone, Debug, Default)]
pub struct RequestMetrics {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time per phase (tokenize, prefill, decode, sample).
    pub timings: Timings,
    /// Wall time of the whole call (session set-up included).
    pub total: Duration,
    /// Mean fraction of FFN neurons kept per token and layer, when the
    /// model runs sparse.
    pub sparse_kept_fraction: Option<f64>,
    /// What speculative decoding did (zero without drafts).
    pub draft: DraftStats,
}

impl RequestMetrics {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        per_second(self.prompt_tokens as u64, self.timings.prefill)
    }

    /// Decoded tokens per second (tokens after the first, which comes from
    /// the prefill's logits).
    pub fn decode_tokens_per_second(&self) -> f64 {
        per_second(self.generated_tokens.saturating_sub(1) as u64, self.timings.decode)
    }
}

fn per_second(n: u64, t: Duration) -> f64 {
    let s = t.as_secs_f64();
    if s > 0.0 { n as f64 / s } else { 0.0 }
}

/// Cumulative counters of an [`Engine`](crate::Engine) since load.
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    /// Successful calls: generations, logits, and one per embedded text.
    pub requests: u64,
    pub generate_requests: u64,
    /// Texts embedded.
    pub embed_requests: u64,
    /// Generations cancelled by their caller.
    pub cancelled: u64,
    /// Calls that returned an error.
    pub errors: u64,
    /// Tokens prefilled: prompts, [`Engine::logits`](crate::Engine::logits) inputs, embedded texts.
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Tokens run through the decode step (generated tokens but the first
    /// of each request).
    pub decoded_tokens: u64,
    /// Time per phase, summed over requests (concurrent requests each
    /// count their own time).
    pub timings: Timings,
    /// Tokens drafted from the context's n-grams, and those accepted
    /// (each a decode step saved).
    pub draft_tokens: u64,
    pub draft_accepted_tokens: u64,
    /// Mean fraction of FFN neurons kept per token and layer over all
    /// requests, when the model runs sparse (`None`: dense).
    pub sparse_kept_fraction: Option<f64>,
    /// The kernel chosen for each distinct operation.
    pub kernels: Vec<KernelInfo>,
    /// Embedded texts longer than the context, cut to it (each also logged
    /// as a warning).
    pub truncated_inputs: u64,
    /// Under a memory budget that streams weights: bytes read from storage,
    /// reads done ahead of need, stalls and time spent waiting, over all
    /// requests (`None` without one).
    pub storage: Option<StreamStats>,
}

impl Metrics {
    pub fn prefill_tokens_per_second(&self) -> f64 {
        per_second(self.prompt_tokens, self.timings.prefill)
    }

    pub fn decode_tokens_per_second(&self) -> f64 {
        per_second(self.decoded_tokens, self.timings.decode)
    }
}

/// The kernel bound to one operation (weight type, activation, shape).
#[derive(Clone, Debug)]
pub struct KernelInfo {
    /// E.g. `matmul q4_1*q8_1 576x576`.
    pub op: String,
    /// The first tensor of the model using it.
    pub tensor: String,
    pub kernel: String,
    pub provider: String,
    /// Why it was chosen.
    pub choice: String,
    /// Whether it failed and the built-in fallback took over.
    pub fell_back: bool,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Counters {
    pub(crate) requests: u64,
    pub(crate) generate_requests: u64,
    pub(crate) embed_requests: u64,
    pub(crate) cancelled: u64,
    pub(crate) errors: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) generated_tokens: u64,
    pub(crate) decoded_tokens: u64,
    pub(crate) draft_tokens: u64,
    pub(crate) draft_accepted_tokens: u64,
    pub(crate) tokenize: Duration,
    pub(crate) prefill: Duration,
    pub(crate) decode: Duration,
    pub(crate) sample: Duration,
    pub(crate) sparse_active: u64,
    pub(crate) sparse_slots: u64,
    pub(crate) truncated_inputs: u64,
    /// Under a memory budget: the sessions' streaming counters, summed.
    pub(crate) storage: Option<StreamStats>,
}

impl Counters {
    /// Adds a finished session's streaming counters (a session's counters
    /// start at zero, so each is added once).
    pub(crate) fn add_storage(&mut self, s: &Session) {
        if let Some(st) = s.stream_stats() {
            let t = self.storage.get_or_insert_with(StreamStats::default);
            t.bytes_read += st.bytes_read;
            t.prefetch_hits += st.prefetch_hits;
            t.stalls += st.stalls;
            t.stall_time += st.stall_time;
            t.resyncs += st.resyncs;
        }
    }

    pub(crate) fn add_timings(&mut self, t: &Timings) {
        self.tokenize += t.tokenize;
        self.prefill += t.prefill;
        self.decode += t.decode;
        self.sample += t.sample;
    }
}
