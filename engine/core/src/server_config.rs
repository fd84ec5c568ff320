//! `[server]`: how `spinfer serve` listens, schedules and guards its
//! OpenAI-compatible API (`docs/config.md`, `docs/serving.md`); and
//! `[speculative]`: the drafts `serve`, `generate` and `chat` check.

use std::path::PathBuf;

use serde::Deserialize;
use spinfer_generate::DraftParams;

/// Most concurrent sequences a server may hold.
pub const MAX_SLOTS: usize = 256;
/// Most requests a server may queue.
pub const MAX_QUEUE: usize = 65_536;
/// Largest request body a server may accept, in KB.
pub const MAX_BODY_KB: usize = 64 * 1024;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerSection {
    /// Address to bind (`--host` overrides).
    pub host: String,
    /// Port (`--port` overrides; 0: any free port, printed at start).
    pub port: u16,
    /// The model's name in the API (`model` of requests, `/v1/models`);
    /// default: the model file's name without its extension.
    pub model_name: Option<String>,
    /// Sequences decoded together (each holds a KV cache of `model.ctx`).
    pub slots: usize,
    /// Requests waiting for a slot; one more is answered 429.
    pub queue: usize,
    /// Seconds a request may take, queueing included (then 504).
    pub request_timeout_s: u64,
    /// Largest request body, in KB (10^3 bytes; then 413).
    pub max_body_kb: usize,
    /// Largest `max_tokens` a request may ask for (default: the context).
    pub max_tokens: Option<usize>,
    /// Prompt tokens of one request run per step, so that a long prompt
    /// does not stall the others' decoding.
    pub prefill_chunk: usize,
    /// A finished request's slot keeps its prompt's keys and values, and
    /// a request sharing a prefix with it runs only the rest (outputs are
    /// unchanged; memory of the kept prompts stays held).
    pub prompt_cache: bool,
    /// Bearer keys a request must present (`Authorization: Bearer …`);
    /// empty with no `api_keys_file`: no authentication.
    pub api_keys: Vec<String>,
    /// A file of keys, one per line (`#` comments), read at start.
    pub api_keys_file: Option<PathBuf>,
    /// Origins allowed to call from a browser (`"*"`: any); empty: CORS off.
    pub cors_origins: Vec<String>,
    /// Seconds in-flight requests get to finish after SIGTERM.
    pub shutdown_timeout_s: u64,
    /// A Jinja chat template used instead of the model's own (for a model
    /// file without one, or with a broken one).
    pub chat_template_file: Option<PathBuf>,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            model_name: None,
            slots: 4,
            queue: 64,
            request_timeout_s: 600,
            max_body_kb: 1024,
            max_tokens: None,
            prefill_chunk: 256,
            prompt_cache: true,
            api_keys: Vec::new(),
            api_keys_file: None,
            cors_origins: Vec::new(),
            shutdown_timeout_s: 30,
            chat_template_file: None,
        }
    }
}

impl ServerSection {
    /// Range checks, each naming its key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let ranges: [(&str, usize, usize, usize); 4] = [
            ("slots", self.slots, 1, MAX_SLOTS),
            ("queue", self.queue, 0, MAX_QUEUE),
            ("max_body_kb", self.max_body_kb, 1, MAX_BODY_KB),
            ("prefill_chunk", self.prefill_chunk, 1, 512),
        ];
        for (key, v, lo, hi) in ranges {
            if !(lo..=hi).contains(&v) {
                return Err(format!("server.{key} = {v} is out of range: it must be between {lo} and {hi}"));
            }
        }
        if !(1..=86_400).contains(&self.request_timeout_s) {
            return Err("server.request_timeout_s must be between 1 and 86400".into());
        }
        if self.shutdown_timeout_s > 3_600 {
            return Err("server.shutdown_timeout_s must be at most 3600".into());
        }
        if self.max_tokens == Some(0) {
            return Err("server.max_tokens must be at least 1".into());
        }
        if self.model_name.as_deref().is_some_and(|n| n.is_empty() || n.len() > 256) {
            return Err("server.model_name must be 1 to 256 characters".into());
        }
        if let Some(k) = self.api_keys.iter().find(|k| k.len() < 8 || k.chars().any(char::is_whitespace)) {
            return Err(format!(
                "server.api_keys: key '{}…' must be at least 8 characters without spaces",
                k.chars().take(4).collect::<String>()
            ));
        }
        Ok(())
    }
}

/// `[speculative]`: drafts from the context's own n-grams, checked with
/// the next token in one step (vLLM's `speculative_config` with method
/// `ngram`). Outputs are the same with or without; present, the table
/// turns drafts on.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SpeculativeSection {
    /// `"ngram"`, the one method (prompt lookup).
    pub method: String,
    /// Most tokens per draft (1 to 16).
    pub num_speculative_tokens: usize,
    /// Longest n-gram looked up.
    pub prompt_lookup_max: usize,
    /// Shortest n-gram looked up.
    pub prompt_lookup_min: usize,
    /// `spinfer serve`: no drafts in a step where more requests than this
    /// decode (their rows already share the weights' reads; more rows
    /// cost compute).
    pub disable_by_batch_size: usize,
}

impl Default for SpeculativeSection {
    fn default() -> Self {
        let d = DraftParams::default();
        Self {
            method: "ngram".into(),
            num_speculative_tokens: 4,
            prompt_lookup_max: d.ngram_max,
            prompt_lookup_min: d.ngram_min,
            disable_by_batch_size: 1,
        }
    }
}

impl SpeculativeSection {
    /// The drafts this table describes.
    pub fn draft_params(&self) -> DraftParams {
        DraftParams {
            max_tokens: self.num_speculative_tokens,
            ngram_max: self.prompt_lookup_max,
            ngram_min: self.prompt_lookup_min,
        }
    }

    /// Range checks, each naming its key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.method != "ngram" {
            return Err(format!("speculative.method = {:?}: the one method is \"ngram\"", self.method));
        }
        if !(1..=DraftParams::MAX_TOKENS).contains(&self.num_speculative_tokens) {
            return Err(format!(
                "speculative.num_speculative_tokens = {} is out of range: it must be between 1 and {}",
                self.num_speculative_tokens,
                DraftParams::MAX_TOKENS
            ));
        }
        self.draft_params().validate().map_err(|_| {
            format!(
                "speculative.prompt_lookup_min = {} and prompt_lookup_max = {}: they must satisfy 1 <= min <= max <= {}",
                self.prompt_lookup_min,
                self.prompt_lookup_max,
                DraftParams::MAX_NGRAM
            )
        })?;
        if self.disable_by_batch_size > MAX_SLOTS {
            return Err(format!("speculative.disable_by_batch_size must be at most {MAX_SLOTS}"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::config::Config;
    use std::path::Path;

    fn parse(server: &str) -> Result<Config, String> {
        Config::parse(&format!("[model]\npath = \"m.gguf\"\n[server]\n{server}\n"), Path::new("s.toml"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn server_keys_are_range_checked_by_name() {
        assert_eq!(parse("").unwrap().server.slots, 4);
        for (bad, key) in [
            ("slots = 0", "server.slots"),
            ("slots = 100000", "server.slots"),
            ("max_body_kb = 0", "server.max_body_kb"),
            ("prefill_chunk = 4096", "server.prefill_chunk"),
            ("request_timeout_s = 0", "server.request_timeout_s"),
            ("max_tokens = 0", "server.max_tokens"),
            ("api_keys = [\"short\"]", "server.api_keys"),
            ("bogus = 1", "bogus"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn speculative_keys_are_checked_by_name() {
        let parse = |t: &str| {
            Config::parse(&format!("[model]\npath = \"m.gguf\"\n{t}\n"), Path::new("s.toml")).map_err(|e| e.to_string())
        };
        assert_eq!(parse("").unwrap().speculative, None);
        let s = parse("[speculative]").unwrap().speculative.unwrap();
        assert_eq!(s.draft_params().max_tokens, 4);
        let s = parse("[speculative]\nnum_speculative_tokens = 8\nprompt_lookup_min = 3").unwrap().speculative.unwrap();
        assert_eq!((s.draft_params().max_tokens, s.draft_params().ngram_min), (8, 3));
        for (bad, key) in [
            ("method = \"eagle\"", "speculative.method"),
            ("num_speculative_tokens = 0", "speculative.num_speculative_tokens"),
            ("num_speculative_tokens = 17", "speculative.num_speculative_tokens"),
            ("prompt_lookup_min = 5", "speculative.prompt_lookup_min"),
            ("prompt_lookup_max = 40", "prompt_lookup_max"),
            ("disable_by_batch_size = 100000", "speculative.disable_by_batch_size"),
            ("draft = 3", "draft"),
        ] {
            let e = parse(&format!("[speculative]\n{bad}")).unwrap_err();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }
}
