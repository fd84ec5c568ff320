//! The tokenizer over HTTP, in vLLM's shapes (which llama-server's
//! mostly share): `POST /tokenize`, `POST /detokenize`, `GET
//! /tokenizer_info`. Evaluation harnesses (lm-evaluation-harness's remote
//! tokenizer) count and cut prompts with them, so a client needs no copy
//! of the model's tokenizer.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::{AppState, Served, body_of};
use crate::wire::check_fields;
use spinfer_engine::Engine;

fn engine(st: &AppState) -> Result<&Engine, ApiError> {
    match &st.served {
        Served::Generator { engine, .. } => Ok(engine),
        Served::Embedder { .. } => Err(ApiError::invalid(
            "model",
            format!("'{}' is an embedding model: the tokenizer endpoints serve generative models", st.model_name),
        )),
    }
}

/// `{"prompt": text}` (llama-server: `"content"`), `add_special_tokens`
/// (default true: the BOS the model's tokenizer adds) → `{"tokens",
/// "count", "max_model_len"}`.
pub async fn tokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let m = body_of(&st, body)?;
    check_fields(&m, &[&["model", "prompt", "content", "add_special_tokens", "add_special"]])?;
    let e = engine(&st)?;
    let text = ["prompt", "content"]
        .iter()
        .find_map(|k| m.get(*k))
        .ok_or_else(|| ApiError::invalid("prompt", "prompt must be the text to tokenize"))?;
    let text = text.as_str().ok_or_else(|| ApiError::invalid("prompt", "prompt must be a string"))?.to_string();
    let special = match ["add_special_tokens", "add_special"].iter().find_map(|k| m.get(*k)) {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| ApiError::invalid("add_special_tokens", "must be a boolean"))?,
    };
    let add_bos = special && e.tokenizer.add_bos_default();
    let st2 = st.clone();
    // Tokenizing takes time in proportion to the body: off the I/O threads.
    let encode = move || {
        let e = engine(&st2)?;
        e.tokenizer.encode(&text, add_bos).map_err(|err| ApiError::invalid("prompt", err.to_string()))
    };
    let ids = tokio::task::spawn_blocking(encode).await.map_err(|e| ApiError::internal(e.to_string()))??;
    let ctx = e.model.options.ctx;
    Ok(axum::Json(json!({"tokens": ids, "count": ids.len(), "max_model_len": ctx})).into_response())
}

/// `{"tokens": [ids]}` → `{"prompt": text}` (and llama-server's `"content"`).
pub async fn detokenize(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let m = body_of(&st, body)?;
    check_fields(&m, &[&["model", "tokens"]])?;
    let e = engine(&st)?;
    let ids = m
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok())).collect::<Option<Vec<_>>>())
        .ok_or_else(|| ApiError::invalid("tokens", "tokens must be an array of token ids"))?;
    let text = e.tokenizer.decode(&ids).map_err(|err| ApiError::invalid("tokens", err.to_string()))?;
    Ok(axum::Json(json!({"prompt": text, "content": text})).into_response())
}

/// The special tokens' texts, the chat template and the context.
pub async fn tokenizer_info(State(st): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let e = engine(&st)?;
    let t = &e.tokenizer;
    let text = |id: Option<u32>| id.and_then(|i| crate::chat::token_text(t, i));
    Ok(axum::Json(json!({
        "tokenizer_class": "spinfer",
        "bos_token": text(t.bos_id()),
        "eos_token": text(t.eos_id()),
        "pad_token": null,
        "add_bos_token": t.add_bos_default(),
        "chat_template": e.chat_template(),
        "model_max_length": e.model.options.ctx,
        "vocab_size": t.vocab_size(),
    }))
    .into_response())
}
