//! What every handler shares: the model served, the keys, the metrics,
//! the limits; and reading a request's body.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde_json::Value;
use tokio::sync::Semaphore;

use crate::chat::ChatTemplate;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::scheduler::Scheduler;
use crate::wire;
use spinfer_engine::Engine;
use spinfer_engine::embed::Embedder;

/// What the server runs: a generative model behind the scheduler, or a
/// sentence embedder.
pub enum Served {
    Generator { engine: Arc<Engine>, template: Box<Option<ChatTemplate>>, scheduler: Scheduler },
    Embedder { embedder: Arc<Embedder>, permits: Arc<Semaphore> },
}

pub struct AppState {
    pub served: Served,
    pub model_name: String,
    pub created: u64,
    pub keys: Vec<String>,
    pub metrics: Arc<Metrics>,
    pub draining: AtomicBool,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_cap: usize,
    pub timeout: Duration,
    pub max_body: usize,
}

/// The body, or a 413 / 400 in OpenAI's shape.
pub fn body_of(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<serde_json::Map<String, Value>, ApiError> {
    let bytes = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(st.max_body),
        _ => ApiError::bad_request(format!("cannot read the body: {e}")),
    })?;
    wire::object(&bytes)
}
