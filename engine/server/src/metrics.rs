//! `GET /metrics`: Prometheus text (`prometheus-client`): requests by
//! endpoint and status, queue depth and busy slots, prompt tokens (run
//! and found in the prompt cache) and generated tokens, recent prefill and
//! decode throughput, time to first token, and the sparse FFN's kept
//! neurons when the model runs sparse.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub status: String,
}

pub struct Metrics {
    registry: Registry,
    pub requests: Family<RequestLabels, Counter>,
    pub queue_depth: Gauge,
    pub active_slots: Gauge,
    pub prompt_tokens: Counter,
    pub cached_prompt_tokens: Counter,
    pub generated_tokens: Counter,
    pub draft_tokens: Counter,
    pub draft_accepted_tokens: Counter,
    pub cancelled: Counter,
    pub prefill_tps: Gauge<f64, AtomicU64>,
    pub decode_tps: Gauge<f64, AtomicU64>,
    pub batch_rows: Histogram,
    pub ttft: Histogram,
    pub ffn_neurons_kept: Counter,
    pub ffn_neurons: Counter,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("spinfer");
        let m = Self {
            requests: Family::default(),
            queue_depth: Gauge::default(),
            active_slots: Gauge::default(),
            prompt_tokens: Counter::default(),
            cached_prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
            draft_tokens: Counter::default(),
            draft_accepted_tokens: Counter::default(),
            cancelled: Counter::default(),
            prefill_tps: Gauge::default(),
            decode_tps: Gauge::default(),
            batch_rows: Histogram::new([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0]),
            ttft: Histogram::new([0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]),
            ffn_neurons_kept: Counter::default(),
            ffn_neurons: Counter::default(),
            registry: Registry::default(),
        };
        registry.register("requests", "HTTP requests by endpoint and status", m.requests.clone());
        registry.register("queue_depth", "Requests waiting for a slot", m.queue_depth.clone());
        registry.register("active_slots", "Slots holding a request", m.active_slots.clone());
        registry.register("prompt_tokens", "Prompt tokens run", m.prompt_tokens.clone());
        registry.register(
            "cached_prompt_tokens",
            "Prompt tokens not run: their keys and values were in the slot's prompt cache",
            m.cached_prompt_tokens.clone(),
        );
        registry.register("generated_tokens", "Tokens generated", m.generated_tokens.clone());
        registry.register(
            "draft_tokens",
            "Speculative decoding: tokens drafted from the context's n-grams and checked",
            m.draft_tokens.clone(),
        );
        registry.register(
            "draft_accepted_tokens",
            "Speculative decoding: drafted tokens the model chose too (steps saved)",
            m.draft_accepted_tokens.clone(),
        );
        registry.register("cancelled_requests", "Requests cancelled (client gone, timeout)", m.cancelled.clone());
        registry.register(
            "prefill_tokens_per_second",
            "Prompt tokens per second of the last step that ran a prompt",
            m.prefill_tps.clone(),
        );
        registry.register(
            "decode_tokens_per_second",
            "Tokens per second, all sequences together, of the last decode-only step",
            m.decode_tps.clone(),
        );
        registry.register("batch_rows", "Tokens per forward step (all sequences)", m.batch_rows.clone());
        registry.register("time_to_first_token_seconds", "From request to its first token", m.ttft.clone());
        registry.register(
            "ffn_neurons_kept",
            "Sparse FFN: neurons computed (per token and layer)",
            m.ffn_neurons_kept.clone(),
        );
        registry.register("ffn_neurons", "Sparse FFN: neurons in the layers run (per token)", m.ffn_neurons.clone());
        Self { registry, ..m }
    }
}

impl Metrics {
    /// Counts one answered request.
    pub fn request(&self, endpoint: &str, status: u16) {
        self.requests.get_or_create(&RequestLabels { endpoint: endpoint.into(), status: status.to_string() }).inc();
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
