//! The server's errors: [`Error`] for starting it, [`ApiError`] for a
//! request, answered in OpenAI's shape
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Engine(#[from] spinfer_engine::Error),
    #[error(transparent)]
    Embed(#[from] spinfer_embed::Error),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Config(String),
    #[error("chat template: {0}")]
    Template(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// A request's failure, with its HTTP status.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`,
    /// `not_found_error`, `rate_limit_error`, `server_error`, `timeout`.
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// `Retry-After` seconds (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// 400: a field's value is wrong.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self { param: Some(param.into()), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    /// 400 with no one field at fault (malformed JSON).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self { code: Some("invalid_api_key"), ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message) }
    }

    pub fn model_not_found(model: &str, served: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model '{model}' does not exist: this server serves '{served}'"),
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("the body is over {limit} bytes"))
    }

    pub fn queue_full(queue: usize) -> Self {
        Self {
            retry_after: Some(1),
            code: Some("queue_full"),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!("every slot is busy and {queue} requests are waiting: retry later"),
            )
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { retry_after: Some(5), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message) }
    }

    pub fn timeout(seconds: u64) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", format!("the request took longer than {seconds} s"))
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The error object, as OpenAI writes it.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<spinfer_engine::Error> for ApiError {
    /// An engine error on a request: the request's fault (a context
    /// overflow, an invalid argument) or the server's.
    fn from(e: spinfer_engine::Error) -> Self {
        use spinfer_engine::Error as E;
        match e {
            E::ContextOverflow { needed, ctx } => Self {
                code: Some("context_length_exceeded"),
                ..Self::invalid("messages", format!("the prompt needs {needed} positions; the context holds {ctx}"))
            },
            E::InvalidArgument(m) => Self::bad_request(m),
            E::Tokenizer(m) => Self::bad_request(format!("tokenizer: {m}")),
            other => Self::internal(other.to_string()),
        }
    }
}

impl From<spinfer_models::Error> for ApiError {
    fn from(e: spinfer_models::Error) -> Self {
        spinfer_engine::Error::from(e).into()
    }
}

impl From<spinfer_embed::Error> for ApiError {
    fn from(e: spinfer_embed::Error) -> Self {
        spinfer_engine::Error::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}
