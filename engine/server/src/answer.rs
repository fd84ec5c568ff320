//! A chat or text completion's answer from the scheduler's events: whole
//! (one JSON body) or streamed (server-sent events in OpenAI's chunk
//! format, ending with `[DONE]`), with `usage`, `finish_reason`, the
//! echoed prompt and log-probabilities when asked for.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::error::ApiError;
use crate::logprobs::{TextLogprobs, TokenLogprob, chat_content};
use crate::scheduler::Event;
use spinfer_engine::Engine;
use spinfer_engine::generate::StopReason;

/// What the answer looks like besides the events.
pub struct Shape {
    pub engine: Arc<Engine>,
    pub model: String,
    pub id: String,
    pub created: u64,
    pub chat: bool,
    pub logprobs: bool,
    /// `echo`: the prompt's text, written before the answer.
    pub echo: Option<String>,
    /// The prompt's first token (the echo's, which nothing predicts) and
    /// its text's length in characters (where the completions' text
    /// offsets start without `echo`).
    pub first_token: Option<u32>,
    pub prompt_chars: usize,
    pub include_usage: bool,
}

impl Shape {
    /// The completions' log-probabilities object, its first token (which
    /// nothing predicts) already in when the prompt is echoed.
    fn text_logprobs(&self) -> TextLogprobs {
        match (&self.echo, self.first_token) {
            (Some(_), Some(first)) => {
                let mut t = TextLogprobs::starting_at(0);
                t.push(&self.engine.tokenizer, first, None);
                t
            }
            _ => TextLogprobs::starting_at(self.prompt_chars),
        }
    }
}

fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        _ => "stop",
    }
}

/// OpenAI's `usage`: `prompt_tokens_details.cached_tokens` counts the
/// prompt tokens the slot's prompt cache held.
fn usage(prompt: usize, cached: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Waits for the whole answer.
pub async fn whole(shape: Shape, mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let tok = &shape.engine.tokenizer;
    let (mut chosen, mut text_lps) = (Vec::<TokenLogprob>::new(), shape.text_logprobs());
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Piece { logprob: Some(lp), .. } if shape.chat => chosen.push(lp),
            Event::Piece { logprob: Some(lp), .. } => text_lps.push(tok, lp.token, Some(&lp)),
            Event::Piece { .. } => {}
            Event::Prompt(lps) => lps.iter().for_each(|lp| text_lps.push(tok, lp.token, Some(lp))),
            Event::Failed(e) => return Err(e),
            Event::Done { reason, prompt_tokens, cached_tokens, completion_tokens, text } => {
                let logprobs = match (shape.logprobs, shape.chat) {
                    (false, _) => Value::Null,
                    (true, true) => chat_content(tok, &chosen),
                    (true, false) => text_lps.take(),
                };
                let choice = if shape.chat {
                    json!({"index": 0, "message": {"role": "assistant", "content": text},
                           "finish_reason": finish_reason(reason), "logprobs": logprobs})
                } else {
                    let text = shape.echo.as_deref().unwrap_or_default().to_string() + &text;
                    json!({"index": 0, "text": text, "finish_reason": finish_reason(reason), "logprobs": logprobs})
                };
                let body = json!({
                    "id": shape.id, "object": if shape.chat { "chat.completion" } else { "text_completion" },
                    "created": shape.created, "model": shape.model, "choices": [choice],
                    "usage": usage(prompt_tokens, cached_tokens, completion_tokens),
                });
                return Ok(axum::Json(body).into_response());
            }
        }
    }
    Err(ApiError::internal("the request ended without an answer"))
}

/// Server-sent events in OpenAI's chunk format, ending with `[DONE]`.
pub fn stream(
    shape: Shape,
    rx: mpsc::UnboundedReceiver<Event>,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let object = if shape.chat { "chat.completion.chunk" } else { "text_completion" };
    let (id, created, model, chat) = (shape.id.clone(), shape.created, shape.model.clone(), shape.chat);
    let chunk = move |choice: Value, usage_v: Option<Value>| {
        let mut c = json!({"id": id, "object": object, "created": created, "model": model,
                           "choices": if choice.is_null() { json!([]) } else { json!([choice]) }});
        if let Some(u) = usage_v {
            c["usage"] = u;
        }
        SseEvent::default().data(c.to_string())
    };
    let piece = move |text: &str, finish: Option<&str>, logprobs: Value| {
        if chat {
            let delta = if finish.is_some() { json!({}) } else { json!({"content": text}) };
            json!({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs})
        } else {
            json!({"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs})
        }
    };
    let mut text_lps = shape.text_logprobs();
    let first = if chat {
        Some(chunk(json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}), None))
    } else {
        shape.echo.as_deref().map(|p| {
            let lps = if shape.logprobs { text_lps.take() } else { Value::Null };
            chunk(piece(p, None, lps), None)
        })
    };
    let (engine, logprobs, include_usage) = (shape.engine, shape.logprobs, shape.include_usage);
    let events = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let tok = &engine.tokenizer;
        let out: Vec<SseEvent> = match ev {
            Event::Piece { text, logprob } => {
                let lps = match (logprob, chat) {
                    (Some(lp), true) => chat_content(tok, &[lp]),
                    (Some(lp), false) => {
                        text_lps.push(tok, lp.token, Some(&lp));
                        text_lps.take()
                    }
                    (None, _) => Value::Null,
                };
                vec![chunk(piece(&text, None, lps), None)]
            }
            Event::Prompt(lps) if logprobs => {
                lps.iter().for_each(|lp| text_lps.push(tok, lp.token, Some(lp)));
                vec![chunk(piece("", None, text_lps.take()), None)]
            }
            Event::Prompt(_) => Vec::new(),
            Event::Failed(e) => {
                vec![SseEvent::default().data(e.body().to_string()), SseEvent::default().data("[DONE]")]
            }
            Event::Done { reason, prompt_tokens, cached_tokens, completion_tokens, .. } => {
                let mut v = vec![chunk(piece("", Some(finish_reason(reason)), Value::Null), None)];
                if include_usage {
                    v.push(chunk(Value::Null, Some(usage(prompt_tokens, cached_tokens, completion_tokens))));
                }
                v.push(SseEvent::default().data("[DONE]"));
                v
            }
        };
        futures_util::stream::iter(out)
    });
    let all = futures_util::stream::iter(first).chain(events).map(Ok);
    Sse::new(all).keep_alive(KeepAlive::default())
}
