//! A chat or text completion's answer from the scheduler's events: whole
//! (one JSON body) or streamed (server-sent events in OpenAI's chunk
//! format, ending with `[DONE]`), with `usage`, `finish_reason`, the
//! echoed prompt and log-probabilities when asked for; `n` choices, each
//! from its own job, carry their index.

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
use crate::tool_reply::{Finish, ReplySplitter};
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
    /// Choices asked for (`n`), each one job; events carry its index.
    pub choices: usize,
    /// The model may call tools: its text is read back as a reply or calls
    /// ([`crate::tool_reply`]).
    pub tools: bool,
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

/// A chat answer's message and finish reason; with `tools`, the text is
/// read back into content or calls.
fn chat_message(tools: bool, text: String, reason: StopReason) -> (Value, &'static str) {
    if !tools {
        return (json!({"role": "assistant", "content": text}), finish_reason(reason));
    }
    let mut reply = ReplySplitter::new();
    let mut content = reply.push(&text).content;
    let Finish { content: rest, calls, .. } = reply.finish();
    content.push_str(&rest);
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": content}), finish_reason(reason));
    }
    let calls: Vec<Value> = calls.iter().map(|c| c.to_json()).collect();
    (json!({"role": "assistant", "content": null, "tool_calls": calls}), "tool_calls")
}

/// OpenAI's `usage`: `prompt_tokens_details.cached_tokens` counts the
/// prompt tokens the slot's prompt cache held.
fn usage(prompt: usize, cached: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Waits for the whole answer: every choice's.
pub async fn whole(shape: Shape, mut rx: mpsc::UnboundedReceiver<(usize, Event)>) -> Result<Response, ApiError> {
    let tok = &shape.engine.tokenizer;
    let n = shape.choices;
    let mut chosen: Vec<Vec<TokenLogprob>> = (0..n).map(|_| Vec::new()).collect();
    let mut text_lps: Vec<TextLogprobs> = (0..n).map(|_| shape.text_logprobs()).collect();
    let mut choices: Vec<Value> = vec![Value::Null; n];
    let mut usage_of = (0, 0, 0);
    while let Some((i, ev)) = rx.recv().await {
        let (Some(chosen), Some(text_lps)) = (chosen.get_mut(i), text_lps.get_mut(i)) else { continue };
        match ev {
            Event::Piece { logprob: Some(lp), .. } if shape.chat => chosen.push(lp),
            Event::Piece { logprob: Some(lp), .. } => text_lps.push(tok, lp.token, Some(&lp)),
            Event::Piece { .. } => {}
            Event::Prompt(lps) => lps.iter().for_each(|lp| text_lps.push(tok, lp.token, Some(lp))),
            Event::Failed(e) => return Err(e),
            Event::Done { reason, prompt_tokens, cached_tokens, completion_tokens, text } => {
                // The prompt is counted once (OpenAI's usage), its cached
                // part as the first choice found it.
                usage_of.0 = prompt_tokens;
                if i == 0 {
                    usage_of.1 = cached_tokens;
                }
                usage_of.2 += completion_tokens;
                let logprobs = match (shape.logprobs, shape.chat) {
                    (false, _) => Value::Null,
                    (true, true) => chat_content(tok, chosen),
                    (true, false) => text_lps.take(),
                };
                choices[i] = if shape.chat {
                    let (message, finish) = chat_message(shape.tools, text, reason);
                    json!({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs})
                } else {
                    let text = shape.echo.as_deref().unwrap_or_default().to_string() + &text;
                    json!({"index": i, "text": text, "finish_reason": finish_reason(reason), "logprobs": logprobs})
                };
                if choices.iter().all(|c| !c.is_null()) {
                    let body = json!({
                        "id": shape.id, "object": if shape.chat { "chat.completion" } else { "text_completion" },
                        "created": shape.created, "model": shape.model, "choices": choices,
                        "usage": usage(usage_of.0, usage_of.1, usage_of.2),
                    });
                    return Ok(axum::Json(body).into_response());
                }
            }
        }
    }
    Err(ApiError::internal("the request ended without an answer"))
}

/// What a stream keeps between events.
struct StreamState {
    text_lps: Vec<TextLogprobs>,
    /// Each choice's answer read back, when the model may call tools.
    replies: Vec<Option<ReplySplitter>>,
    done: usize,
    usage: (usize, usize, usize),
    ended: bool,
}

/// Choice `i`'s streamed delta of tool calls (OpenAI's `tool_calls`
/// pieces: a call's id and name, then its arguments' text).
fn calls_delta(i: usize, calls: Vec<Value>) -> Value {
    json!({"index": i, "delta": {"tool_calls": calls}, "finish_reason": null, "logprobs": null})
}

/// Server-sent events in OpenAI's chunk format, each choice's chunks
/// carrying its index, ending with `[DONE]` once every choice is done (or
/// at the first failure).
pub fn stream(
    shape: Shape,
    rx: mpsc::UnboundedReceiver<(usize, Event)>,
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
    let piece = move |i: usize, text: &str, finish: Option<&str>, logprobs: Value| {
        if chat {
            let delta = if finish.is_some() { json!({}) } else { json!({"content": text}) };
            json!({"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs})
        } else {
            json!({"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs})
        }
    };
    let n = shape.choices;
    let mut text_lps: Vec<TextLogprobs> = (0..n).map(|_| shape.text_logprobs()).collect();
    let first: Vec<SseEvent> = (0..n)
        .filter_map(|i| {
            if chat {
                let role = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null});
                Some(chunk(role, None))
            } else {
                shape.echo.as_deref().map(|p| {
                    let lps = if shape.logprobs { text_lps[i].take() } else { Value::Null };
                    chunk(piece(i, p, None, lps), None)
                })
            }
        })
        .collect();
    let (engine, logprobs, include_usage) = (shape.engine, shape.logprobs, shape.include_usage);
    let replies = (0..n).map(|_| shape.tools.then(ReplySplitter::new)).collect();
    let state = StreamState { text_lps, replies, done: 0, usage: (0, 0, 0), ended: false };
    let events = UnboundedReceiverStream::new(rx).scan(state, move |st, (i, ev)| {
        let tok = &engine.tokenizer;
        let out: Option<Vec<SseEvent>> = match (st.ended, st.text_lps.get_mut(i), ev) {
            (true, _, _) => None,
            (false, None, _) => Some(Vec::new()),
            (false, Some(lps_i), ev) => Some(match ev {
                Event::Piece { text, logprob } => {
                    let lps = match (logprob, chat) {
                        (Some(lp), true) => chat_content(tok, &[lp]),
                        (Some(lp), false) => {
                            lps_i.push(tok, lp.token, Some(&lp));
                            lps_i.take()
                        }
                        (None, _) => Value::Null,
                    };
                    // A reply's text comes out of its JSON string; calls
                    // as their names and arguments come.
                    let (text, calls) = match st.replies.get_mut(i).and_then(Option::as_mut) {
                        Some(reply) => {
                            let p = reply.push(&text);
                            (p.content, p.calls)
                        }
                        None => (text, Vec::new()),
                    };
                    let mut v = Vec::new();
                    if !(text.is_empty() && lps.is_null() && st.replies.get(i).is_some_and(Option::is_some)) {
                        v.push(chunk(piece(i, &text, None, lps), None));
                    }
                    if !calls.is_empty() {
                        let calls: Vec<Value> = calls.iter().map(|c| c.to_json()).collect();
                        v.push(chunk(calls_delta(i, calls), None));
                    }
                    v
                }
                Event::Prompt(lps) if logprobs => {
                    lps.iter().for_each(|lp| lps_i.push(tok, lp.token, Some(lp)));
                    vec![chunk(piece(i, "", None, lps_i.take()), None)]
                }
                Event::Prompt(_) => Vec::new(),
                Event::Failed(e) => {
                    st.ended = true;
                    vec![SseEvent::default().data(e.body().to_string()), SseEvent::default().data("[DONE]")]
                }
                Event::Done { reason, prompt_tokens, cached_tokens, completion_tokens, .. } => {
                    st.done += 1;
                    st.usage.0 = prompt_tokens;
                    if i == 0 {
                        st.usage.1 = cached_tokens;
                    }
                    st.usage.2 += completion_tokens;
                    let mut v = Vec::new();
                    let mut finish = finish_reason(reason);
                    if let Some(reply) = st.replies.get_mut(i).and_then(Option::take) {
                        let Finish { content, calls, streamed } = reply.finish();
                        if !streamed && !content.is_empty() {
                            v.push(chunk(piece(i, &content, None, Value::Null), None));
                        }
                        if !streamed && !calls.is_empty() {
                            // Calls read whole at the end (not in the grammar's layout).
                            let calls: Vec<Value> = calls
                                .iter()
                                .enumerate()
                                .map(|(k, c)| {
                                    let mut c = c.to_json();
                                    c["index"] = json!(k);
                                    c
                                })
                                .collect();
                            v.push(chunk(calls_delta(i, calls), None));
                        }
                        // Whole calls end the answer; calls cut short end it
                        // as the generation ended (`length`).
                        if !calls.is_empty() {
                            finish = "tool_calls";
                        }
                    }
                    v.push(chunk(piece(i, "", Some(finish), Value::Null), None));
                    if st.done == n {
                        st.ended = true;
                        if include_usage {
                            v.push(chunk(Value::Null, Some(usage(st.usage.0, st.usage.1, st.usage.2))));
                        }
                        v.push(SseEvent::default().data("[DONE]"));
                    }
                    v
                }
            }),
        };
        std::future::ready(out)
    });
    let all = futures_util::stream::iter(first).chain(events.flat_map(futures_util::stream::iter)).map(Ok);
    Sse::new(all).keep_alive(KeepAlive::default())
}
