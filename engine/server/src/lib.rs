//! `spinfer serve`: an OpenAI-compatible HTTP server (tokio + axum) over
//! one model, with continuous batching across requests.
//!
//! - [`routes`]: `POST /v1/chat/completions`, `/v1/completions`,
//!   `/v1/embeddings`, `GET /v1/models`, `/health`, `/metrics`; errors in
//!   OpenAI's shape ([`error::ApiError`]).
//! - [`scheduler`]: a fixed number of slots decoded together, one forward
//!   step for all of them, prompts read in chunks between their decode
//!   steps, a bounded queue (429 beyond it), the prompt cache.
//! - [`answer`], [`logprobs`]: a completion written whole or streamed,
//!   with log-probabilities in OpenAI's shapes.
//! - [`tokens`]: `/tokenize`, `/detokenize`, `/tokenizer_info` (vLLM's
//!   shapes), for clients that count tokens without the tokenizer.
//! - [`chat`]: the model's own chat template (minijinja).
//! - [`structured`], [`tools`], [`tool_reply`]: output constraints on the
//!   wire, and tool calling (the tools' prompt, grammar and answers).
//! - Shutdown (SIGTERM, SIGINT): stop accepting, let in-flight requests
//!   finish for `shutdown_timeout_s`, cancel the rest, return.
//!
//! Configuration: the `[server]` table of the operator's TOML
//! (`docs/config.md`); deployment: `docs/serving.md`.

pub mod answer;
pub mod chat;
pub mod error;
pub mod logprobs;
pub mod metrics;
pub mod routes;
pub mod scheduler;
pub mod state;
pub mod structured;
pub mod tokens;
pub mod tool_reply;
pub mod tools;
pub mod wire;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;

pub use error::{ApiError, Error, Result};
use spinfer_engine::Engine;
use spinfer_engine::config::{Config, PrecisionSetting, ServerSection};
use spinfer_engine::embed::{Embedder, EmbedderOptions};
use state::{AppState, Served};

/// Most bytes of an `api_keys_file`.
const MAX_KEYS_FILE: u64 = 1 << 20;

/// A loaded model behind the server's routes, ready to serve.
pub struct Server {
    state: Arc<AppState>,
    settings: ServerSection,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("model", &self.state.model_name).finish_non_exhaustive()
    }
}

impl Server {
    /// Loads the model `config` names (a sentence-transformers directory
    /// is served as an embedder) and starts the scheduler.
    pub fn new(config: &Config) -> Result<Self> {
        let s = config.server.clone();
        let path = &config.model.path;
        let model_name = s.model_name.clone().unwrap_or_else(|| default_model_name(path));
        let metrics = Arc::new(metrics::Metrics::default());
        let ctx = config.model_options().ctx;
        let (served, cap) = if is_sentence_embedder(path) {
            refuse_generator_settings(config)?;
            let embedder = Arc::new(Embedder::load(path, embedder_options(config))?);
            (Served::Embedder { embedder, permits: Arc::new(Semaphore::new(s.slots)) }, ctx)
        } else {
            let (engine, packs) = Engine::from_config(config)?;
            for p in &packs {
                tracing::info!(pack = ?p, "pack");
            }
            let engine = Arc::new(engine);
            let template = chat::ChatTemplate::for_engine(&engine, s.chat_template_file.as_deref())?;
            if template.is_none() {
                tracing::warn!("the model has no chat template: /v1/chat/completions will answer 400");
            }
            let scheduler = scheduler::Scheduler::start(
                engine.clone(),
                s.slots,
                s.queue,
                s.prefill_chunk,
                s.prompt_cache,
                drafts(config),
                metrics.clone(),
            )
            .map_err(|e| Error::Io { what: "starting the scheduler thread".into(), source: e })?;
            (
                Served::Generator { engine, template: Box::new(template), scheduler },
                s.max_tokens.unwrap_or(ctx).min(ctx),
            )
        };
        let mut keys = s.api_keys.clone();
        if let Some(f) = &s.api_keys_file {
            keys.extend(read_keys(f)?);
        }
        let state = Arc::new(AppState {
            served,
            model_name,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            keys,
            metrics,
            draining: AtomicBool::new(false),
            max_tokens_cap: cap,
            timeout: Duration::from_secs(s.request_timeout_s),
            max_body: s.max_body_kb * 1000,
        });
        Ok(Self { state, settings: s })
    }

    /// The name requests give as `model`.
    pub fn model_name(&self) -> &str {
        &self.state.model_name
    }

    /// Serves on `listener` until `shutdown` completes, then drains:
    /// `/health` turns 503 and new API requests are refused while
    /// in-flight ones get `shutdown_timeout_s` to finish.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let state = self.state.clone();
        let mut app = routes::router(state.clone());
        if !self.settings.cors_origins.is_empty() {
            app = app.layer(cors(&self.settings.cors_origins));
        }
        let grace = Duration::from_secs(self.settings.shutdown_timeout_s);
        // The shutdown signal turns the server to draining, then axum stops
        // accepting and waits for the open connections.
        let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: draining in-flight requests for up to {} s", grace.as_secs());
            state.draining.store(true, Ordering::Release);
            let _ = drain_tx.send(());
        });
        let mut served = tokio::spawn(async move { server.await });
        tokio::select! {
            r = &mut served => return served_result(r),
            _ = drain_rx => {}
        }
        // Connections still open after the grace period are cut.
        match tokio::time::timeout(grace, served).await {
            Ok(r) => served_result(r),
            Err(_) => {
                tracing::warn!("requests still running after the shutdown timeout are cancelled");
                Ok(())
            }
        }
    }
    /// Binds `[server] host:port` (or `addr`).
    pub async fn bind(&self, addr: Option<SocketAddr>) -> Result<TcpListener> {
        let text = format!("{}:{}", self.settings.host, self.settings.port);
        let addr = match addr {
            Some(a) => a,
            None => tokio::net::lookup_host(&text)
                .await
                .map_err(|e| Error::Io { what: format!("resolving {text}"), source: e })?
                .next()
                .ok_or_else(|| Error::Config(format!("server address '{text}' resolves to nothing")))?,
        };
        TcpListener::bind(addr).await.map_err(|e| Error::Io { what: format!("binding {addr}"), source: e })
    }
}

/// What the serving task ended with.
fn served_result(r: std::result::Result<std::io::Result<()>, tokio::task::JoinError>) -> Result<()> {
    match r {
        Ok(r) => r.map_err(|e| Error::Io { what: "serving".into(), source: e }),
        Err(e) => Err(Error::Io { what: "serving".into(), source: std::io::Error::other(e) }),
    }
}

/// SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

fn cors(origins: &[String]) -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowOrigin, Any, CorsLayer};
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| o.parse().ok()))
    };
    CorsLayer::new().allow_origin(allow).allow_methods(Any).allow_headers(Any)
}

fn default_model_name(path: &Path) -> String {
    let name = if path.is_dir() { path.file_name() } else { path.file_stem() };
    name.map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
}

/// A sentence-transformers directory (`modules.json`) or a BERT checkpoint.
fn is_sentence_embedder(path: &Path) -> bool {
    if !path.is_dir() {
        return false;
    }
    if path.join("modules.json").is_file() {
        return true;
    }
    let config = std::fs::read_to_string(path.join("config.json")).unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&config)
        .ok()
        .and_then(|v| v.get("model_type").and_then(|t| t.as_str()).map(|t| t == "bert"))
        .unwrap_or(false)
}

fn read_keys(path: &Path) -> Result<Vec<String>> {
    let io = |e| Error::Io { what: format!("reading API keys {}", path.display()), source: e };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > MAX_KEYS_FILE {
        return Err(Error::Config(format!("{}: {len} bytes, more than an API key file holds", path.display())));
    }
    let text = std::fs::read_to_string(path).map_err(io)?;
    let keys: Vec<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string).collect();
    if let Some(k) = keys.iter().find(|k| k.len() < 8 || k.contains(char::is_whitespace)) {
        let head: String = k.chars().take(4).collect();
        return Err(Error::Config(format!("{}: key '{head}…' is shorter than 8 characters", path.display())));
    }
    Ok(keys)
}

/// Settings of generative models, refused by name for a sentence embedder
/// rather than ignored.
fn refuse_generator_settings(config: &Config) -> Result<()> {
    let m = &config.model;
    let set = [
        ("[model] kv_cache", m.kv_cache.is_some()),
        ("[model] quantize", m.quantize.is_some()),
        ("[speculative]", config.speculative.is_some()),
    ];
    match set.iter().find(|(_, set)| *set) {
        Some((key, _)) => Err(Error::Config(format!(
            "{key} applies to generative models; {} is a sentence embedder: remove it",
            m.path.display()
        ))),
        None => Ok(()),
    }
}

/// The scheduler's drafts: `[speculative]`, or none.
fn drafts(config: &Config) -> scheduler::Drafts {
    match &config.speculative {
        Some(s) => scheduler::Drafts { params: s.draft_params(), max_batch: s.disable_by_batch_size },
        None => scheduler::Drafts::default(),
    }
}

/// The options of a served sentence embedder: `[model] threads`, and
/// `precision = "precise"` for f32 products (the other settings keep the
/// reduced-precision products, bf16 or i16, where the CPU makes them
/// faster).
fn embedder_options(config: &Config) -> EmbedderOptions {
    let mut o = EmbedderOptions::default();
    if let Some(t) = config.model.threads {
        o.threads = t;
    }
    if config.model.precision == PrecisionSetting::Precise {
        o.reduced_precision = false;
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedder_options_follow_the_model_section() {
        let parse = |toml: &str| Config::parse(toml, Path::new("spinfer.toml")).unwrap();
        let precise = embedder_options(&parse("[model]\npath = \"m\"\nprecision = \"precise\"\nthreads = 3\n"));
        assert!(!precise.reduced_precision);
        assert_eq!(precise.threads, 3);
        let fast = embedder_options(&parse("[model]\npath = \"m\"\n"));
        assert_eq!(fast.reduced_precision, EmbedderOptions::default().reduced_precision);
        assert!(refuse_generator_settings(&parse("[model]\npath = \"m\"\nthreads = 2\n")).is_ok());
        let e = refuse_generator_settings(&parse("[model]\npath = \"m\"\n[speculative]\n")).unwrap_err();
        assert!(e.to_string().contains("[speculative]"), "{e}");
        for key in ["quantize = \"q8_0\"", "kv_cache = \"f16\""] {
            let e = refuse_generator_settings(&parse(&format!("[model]\npath = \"m\"\n{key}\n"))).unwrap_err();
            let name = key.split(' ').next().unwrap();
            assert!(e.to_string().contains(&format!("[model] {name}")), "{e}");
        }
    }
}
