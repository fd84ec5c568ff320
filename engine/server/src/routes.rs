//! The HTTP side: axum routes, the API-key check, request counting, and
//! each endpoint's translation between OpenAI's shapes and the engine.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::answer;
use crate::chat::RenderOptions;
use crate::error::ApiError;
use crate::scheduler::{Events, Job};
use crate::state::{AppState, Served, body_of};
use crate::tokens;
use crate::tools::Tools;
use crate::wire::{self, Completion, Input};
use spinfer_engine::generate::{GenerateParams, encode_prompt};
use spinfer_engine::grammar::Spec;
use spinfer_engine::sampling::ConstraintSource;

pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.max_body;
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(embeddings))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route("/tokenizer_info", get(tokens::tokenizer_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Endpoints counted by name in the metrics (others count as "other").
const ENDPOINTS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/health",
    "/metrics",
];

/// Every request: the API key (on `/v1/` and the tokenizer's endpoints),
/// refusal while draining, and its count by endpoint and status.
async fn guard(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let endpoint = ENDPOINTS.iter().find(|e| **e == path).copied().unwrap_or("other");
    let api = path.starts_with("/v1/") || ["/tokenize", "/detokenize", "/tokenizer_info"].contains(&path.as_str());
    let response = if api && !authorized(&st.keys, req.headers()) {
        ApiError::unauthorized("a valid API key is required: 'Authorization: Bearer <key>'").into_response()
    } else if st.draining.load(Ordering::Acquire) && api {
        ApiError::unavailable("the server is shutting down").into_response()
    } else {
        next.run(req).await
    };
    st.metrics.request(endpoint, response.status().as_u16());
    response
}

fn authorized(keys: &[String], headers: &HeaderMap) -> bool {
    if keys.is_empty() {
        return true;
    }
    let Some(given) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return false };
    let Some(token) = given.strip_prefix("Bearer ") else { return false };
    // Compare every key in full, so the time taken does not tell how much
    // of a key matched.
    keys.iter().fold(false, |hit, k| hit | constant_time_eq(k.as_bytes(), token.trim().as_bytes()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn check_model(st: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if *m != st.model_name => Err(ApiError::model_not_found(m, &st.model_name)),
        _ => Ok(()),
    }
}

fn not_an_embedder(st: &AppState) -> Result<(), ApiError> {
    match st.served {
        Served::Embedder { .. } => Err(embedder_error(st)),
        Served::Generator { .. } => Ok(()),
    }
}

fn embedder_error(st: &AppState) -> ApiError {
    ApiError::invalid("model", format!("'{}' is an embedding model: use /v1/embeddings", st.model_name))
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

async fn chat(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    not_an_embedder(&st)?;
    let m = body_of(&st, body)?;
    let req = wire::chat(&m, st.max_tokens_cap)?;
    generate(st, req, true).await
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    not_an_embedder(&st)?;
    let m = body_of(&st, body)?;
    let req = wire::completion(&m, st.max_tokens_cap)?;
    generate(st, req, false).await
}

/// Chat and text completions: the prompt tokenized and checked, queued,
/// then answered whole or streamed.
async fn generate(st: Arc<AppState>, mut req: Completion, chat: bool) -> Result<Response, ApiError> {
    check_model(&st, &req.model)?;
    let Served::Generator { engine, scheduler, .. } = &st.served else {
        return Err(embedder_error(&st));
    };
    let vocab = engine.model.config.vocab_size;
    if let Some((id, _)) = req.sampler.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        return Err(ApiError::invalid("logit_bias", format!("token id {id} is outside the vocabulary of {vocab}")));
    }
    if let Some(id) = req.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(ApiError::invalid("stop_token_ids", format!("token id {id} is outside the vocabulary of {vocab}")));
    }
    // Rendering, tokenizing and compiling an output constraint take time
    // in proportion to the body: off the I/O threads.
    let input = std::mem::replace(&mut req.input, Input::Text(String::new()));
    // Tool calls are held to their format by a grammar of their own.
    let spec = req.constraint.take().or_else(|| req.tools.as_ref().map(|t| ("tools", t.spec())));
    let tools = req.tools.take();
    let render = std::mem::take(&mut req.render);
    let calls_tools = tools.is_some();
    let st2 = st.clone();
    let (ids, text, constraint) = tokio::task::spawn_blocking(move || {
        let (ids, text) = prompt_ids(&st2, input, tools.as_ref(), &render)?;
        let constraint = spec.map(|(field, spec)| constraint(&st2, field, &spec)).transpose()?;
        Ok::<_, ApiError>((ids, text, constraint))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let ctx = engine.model.options.ctx;
    let max_tokens = req.max_tokens.unwrap_or(st.max_tokens_cap).min(ctx - ids.len());
    let params = GenerateParams {
        max_tokens,
        sampler: req.sampler,
        stop: req.stop,
        add_bos: None,
        constraint,
        min_tokens: req.min_tokens,
        ignore_eos: req.ignore_eos,
        stop_tokens: std::mem::take(&mut req.stop_token_ids),
        // Drafts are the scheduler's (`[speculative]`), not a request's.
        draft: Default::default(),
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let now = Instant::now();
    let first_token = ids.first().copied();
    // One job per choice, each with its own seed (the request's, plus its
    // index), on one channel.
    let jobs = (0..req.n)
        .map(|i| {
            let mut params = params.clone();
            params.sampler.seed = params.sampler.seed.wrapping_add(i as u64);
            Job {
                prompt: ids.clone(),
                logprobs: req.logprobs,
                prompt_logprobs: req.echo && req.logprobs.is_some(),
                params,
                events: Events::new(tx.clone(), i),
                received: now,
                deadline: now + st.timeout,
            }
        })
        .collect();
    drop(tx);
    scheduler.submit(jobs)?;
    let shape = answer::Shape {
        engine: engine.clone(),
        model: st.model_name.clone(),
        id: request_id(if chat { "chatcmpl" } else { "cmpl" }),
        created: now_secs(),
        chat,
        logprobs: req.logprobs.is_some(),
        first_token,
        prompt_chars: text.chars().count(),
        echo: req.echo.then_some(text),
        include_usage: req.include_usage,
        choices: req.n,
        tools: calls_tools,
    };
    if req.stream { Ok(answer::stream(shape, rx).into_response()) } else { answer::whole(shape, rx).await }
}

/// `spec` (from the request's `field`) compiled for the model: a spec that
/// does not compile is a 400 naming the field.
fn constraint(st: &AppState, field: &str, spec: &Spec) -> Result<ConstraintSource, ApiError> {
    let Served::Generator { engine, .. } = &st.served else { return Err(embedder_error(st)) };
    engine.constraint(spec).map_err(|e| match e {
        spinfer_engine::Error::Grammar(spinfer_engine::grammar::Error::Spec(m)) => ApiError::invalid(field, m),
        e => ApiError::internal(e.to_string()),
    })
}

/// The prompt's token ids and text: the chat rendered with the model's
/// template (and the tools' instructions), the text, or the ids given (and their text); at most the
/// context less one position (one to generate).
fn prompt_ids(
    st: &AppState,
    input: Input,
    tools: Option<&Tools>,
    render: &RenderOptions,
) -> Result<(Vec<u32>, String), ApiError> {
    let Served::Generator { engine, template, .. } = &st.served else { return Err(embedder_error(st)) };
    let ctx = engine.model.options.ctx;
    let (prompt, chat) = match input {
        Input::Chat(messages) => {
            let t = template.as_ref().as_ref().ok_or_else(|| {
                ApiError::invalid("messages", "the model has no chat template: use /v1/completions with a prompt")
            })?;
            (crate::tools::render(t, &messages, tools, render)?, true)
        }
        Input::Text(p) => (p, false),
        Input::Tokens(ids) => {
            let vocab = engine.model.config.vocab_size;
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            if ids.is_empty() {
                return Err(ApiError::invalid("prompt", "the prompt has no tokens"));
            }
            if ids.len() > ctx - 1 {
                return Err(overflow(ids.len(), ctx, false));
            }
            let text = engine.tokenizer.decode(&ids).map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
            return Ok((ids, text));
        }
    };
    // A chat template opens with its own BOS when the model wants one.
    let add_bos = chat.then(|| crate::chat::add_bos(&engine.tokenizer, &prompt));
    let ids = encode_prompt(&engine.tokenizer, &prompt, add_bos, ctx - 1).map_err(|e| match e {
        spinfer_models::Error::ContextOverflow { needed, .. } => overflow(needed, ctx, chat),
        other => other.into(),
    })?;
    Ok((ids, prompt))
}

/// A prompt of `needed` tokens that leaves no room to generate.
fn overflow(needed: usize, ctx: usize, chat: bool) -> ApiError {
    ApiError {
        code: Some("context_length_exceeded"),
        ..ApiError::invalid(
            if chat { "messages" } else { "prompt" },
            format!("the prompt is {needed} tokens: the context holds {ctx}, and one is needed to generate"),
        )
    }
}

async fn embeddings(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let m = body_of(&st, body)?;
    let req = wire::embeddings(&m)?;
    check_model(&st, &req.model)?;
    let Served::Embedder { embedder, permits } = &st.served else {
        return Err(ApiError::invalid(
            "model",
            format!("'{}' is a generative model: /v1/embeddings serves sentence embedders (BERT)", st.model_name),
        ));
    };
    if let Some(d) = req.dimensions.filter(|&d| d != embedder.dimensions()) {
        return Err(ApiError::invalid(
            "dimensions",
            format!("the model gives {} dimensions, not {d}", embedder.dimensions()),
        ));
    }
    let _permit = permits.clone().acquire_owned().await.map_err(|_| ApiError::unavailable("shutting down"))?;
    let e = embedder.clone();
    let input = req.input;
    let out = tokio::task::spawn_blocking(move || {
        let texts: Vec<&str> = input.iter().map(String::as_str).collect();
        e.embed_batch_detailed(&texts)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))??;
    let tokens: usize = out.iter().map(|e| e.tokens).sum();
    let data: Vec<Value> = out
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let v = if req.base64 {
                let bytes: Vec<u8> = e.vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(e.vector)
            };
            json!({"object": "embedding", "index": i, "embedding": v})
        })
        .collect();
    let body = json!({"object": "list", "data": data, "model": st.model_name,
                      "usage": {"prompt_tokens": tokens, "total_tokens": tokens}});
    Ok(axum::Json(body).into_response())
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let m = json!({"id": st.model_name, "object": "model", "created": st.created, "owned_by": "spinfer"});
    axum::Json(json!({"object": "list", "data": [m]})).into_response()
}

/// Liveness and readiness: 200 while serving, 503 while draining.
async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.draining.load(Ordering::Acquire) {
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "draining"}))).into_response()
    } else {
        axum::Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], st.metrics.encode()).into_response()
}
