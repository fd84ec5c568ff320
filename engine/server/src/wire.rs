//! OpenAI's request shapes, read strictly: every field is checked by
//! name, a field that would change the result but is not implemented
//! (`best_of`, `suffix`…) is a 400 naming it, and an unknown
//! field is a 400 as OpenAI answers it ("unrecognized request argument").

use serde_json::{Map, Value};

use crate::chat::RenderOptions;
use crate::error::ApiError;
use crate::logprobs::MAX_TOP;
use crate::structured;
use crate::tools::{self, ChatMessage, Tools};
use spinfer_engine::grammar::Spec;
use spinfer_engine::sampling::SamplerParams;

/// Fields accepted and ignored: they never change the result.
const IGNORED: &[&str] = &["user", "metadata", "store", "service_tier"];

/// A chat or text completion request, checked.
#[derive(Debug)]
pub struct Completion {
    pub model: Option<String>,
    pub input: Input,
    /// `max_tokens` / `max_completion_tokens`; `None`: up to the context.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Log-probabilities of the tokens generated, with this many
    /// alternatives each (chat's `logprobs` + `top_logprobs`, the
    /// completions' `logprobs`).
    pub logprobs: Option<usize>,
    /// The completions' `echo`: the answer repeats the prompt, with its
    /// tokens' log-probabilities when `logprobs` is set.
    pub echo: bool,
    /// The output constraint and the field that set it.
    pub constraint: Option<(&'static str, Spec)>,
    /// vLLM's `min_tokens`: no end of generation before this many tokens.
    pub min_tokens: usize,
    /// vLLM's and llama-server's `ignore_eos`.
    pub ignore_eos: bool,
    /// vLLM's `stop_token_ids`: tokens that end the answer as an
    /// end-of-generation token does.
    pub stop_token_ids: Vec<u32>,
    /// Choices to generate (`n`), each its own sequence with its own seed.
    pub n: usize,
    /// Tools the model may call (chat only).
    pub tools: Option<Tools>,
    /// How the chat is rendered (chat only).
    pub render: RenderOptions,
}

#[derive(Debug)]
pub enum Input {
    Chat(Vec<ChatMessage>),
    Text(String),
    /// A prompt given as token ids (checked against the vocabulary later).
    Tokens(Vec<u32>),
}

/// An embeddings request, checked.
#[derive(Debug)]
pub struct Embeddings {
    pub model: Option<String>,
    pub input: Vec<String>,
    pub base64: bool,
    pub dimensions: Option<usize>,
}

/// Most inputs of one embeddings request (OpenAI's limit).
pub const MAX_EMBED_INPUTS: usize = 2048;
/// Most choices of one request (`n`): each is a sequence in a slot.
pub const MAX_CHOICES: usize = 16;
/// Most stop strings (OpenAI's limit).
const MAX_STOPS: usize = 4;

/// The body as a JSON object; invalid UTF-8 or JSON is a 400.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid UTF-8 (byte {})", e.valid_up_to())))?;
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("the body is not valid JSON: {e}"))),
    }
}

/// The fields chat and text completions both take (read by [`common`]).
const COMPLETION_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repeat_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "min_tokens",
    "ignore_eos",
    "repetition_penalty",
    "repeat_last_n",
    "stop_token_ids",
];

/// Most `stop_token_ids` of one request.
pub const MAX_STOP_TOKENS: usize = 64;

/// Most token ids of a prompt given as ids (a body of 1 MB holds fewer).
const MAX_PROMPT_IDS: usize = 1 << 20;

/// Rejects fields outside the lists `known` (and [`IGNORED`]).
pub(crate) fn check_fields(m: &Map<String, Value>, known: &[&[&str]]) -> Result<(), ApiError> {
    let known = |k: &str| known.iter().any(|l| l.contains(&k)) || IGNORED.contains(&k);
    match m.keys().find(|k| !known(k)) {
        Some(k) => Err(ApiError::invalid(k, format!("unrecognized request argument supplied: {k}"))),
        None => Ok(()),
    }
}

fn present<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

fn number(m: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
    let Some(v) = present(m, key) else { return Ok(None) };
    let x = v.as_f64().ok_or_else(|| ApiError::invalid(key, format!("{key} must be a number")))?;
    if !(lo..=hi).contains(&x) {
        return Err(ApiError::invalid(key, format!("{key} = {x} is out of range [{lo}, {hi}]")));
    }
    Ok(Some(x))
}

fn boolean(m: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match present(m, key) {
        None => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| ApiError::invalid(key, format!("{key} must be a boolean"))),
    }
}

fn string(m: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match present(m, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::invalid(key, format!("{key} must be a string"))),
    }
}

/// A field that is accepted only at the value that changes nothing.
fn only_default(m: &Map<String, Value>, key: &str, ok: impl Fn(&Value) -> bool, what: &str) -> Result<(), ApiError> {
    match present(m, key) {
        Some(v) if !ok(v) => Err(ApiError::invalid(key, format!("{key} is not supported: {what}"))),
        _ => Ok(()),
    }
}

/// `max_tokens`: a positive integer up to `cap`.
fn max_tokens(m: &Map<String, Value>, key: &str, cap: usize) -> Result<Option<usize>, ApiError> {
    let Some(v) = present(m, key) else { return Ok(None) };
    let n = v.as_i64().ok_or_else(|| ApiError::invalid(key, format!("{key} must be an integer")))?;
    if n <= 0 {
        return Err(ApiError::invalid(key, format!("{key} must be at least 1, got {n}")));
    }
    if n as u64 > cap as u64 {
        return Err(ApiError::invalid(key, format!("{key} = {n} is above this server's limit of {cap}")));
    }
    Ok(Some(n as usize))
}

/// A whole number in `[lo, hi]`.
fn integer(m: &Map<String, Value>, key: &str, lo: usize, hi: usize) -> Result<Option<usize>, ApiError> {
    match number(m, key, lo as f64, hi as f64)? {
        Some(x) if x.fract() != 0.0 => Err(ApiError::invalid(key, format!("{key} must be an integer"))),
        x => Ok(x.map(|x| x as usize)),
    }
}

/// vLLM's `add_generation_prompt`, `continue_final_message` and
/// `chat_template_kwargs` (an object of template variables other than the
/// server's own).
fn render_options(m: &Map<String, Value>) -> Result<RenderOptions, ApiError> {
    let add_generation_prompt = match present(m, "add_generation_prompt") {
        None => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| ApiError::invalid("add_generation_prompt", "add_generation_prompt must be a boolean"))?,
    };
    let continue_final_message = boolean(m, "continue_final_message")?;
    if continue_final_message && present(m, "add_generation_prompt").is_some() && add_generation_prompt {
        return Err(ApiError::invalid(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        ));
    }
    let kwargs = match present(m, "chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => return Err(ApiError::invalid("chat_template_kwargs", "chat_template_kwargs must be an object")),
    };
    if let Some(k) = kwargs.keys().find(|k| crate::chat::RESERVED.contains(&k.as_str())) {
        return Err(ApiError::invalid("chat_template_kwargs", format!("chat_template_kwargs may not set {k}")));
    }
    Ok(RenderOptions { add_generation_prompt, continue_final_message, kwargs })
}

/// vLLM's `stop_token_ids`: at most [`MAX_STOP_TOKENS`] token ids (the
/// vocabulary's bound is checked where the model is known).
fn stop_token_ids(m: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let Some(v) = present(m, "stop_token_ids") else { return Ok(Vec::new()) };
    let bad =
        || ApiError::invalid("stop_token_ids", format!("stop_token_ids must be at most {MAX_STOP_TOKENS} token ids"));
    let a = v.as_array().filter(|a| a.len() <= MAX_STOP_TOKENS).ok_or_else(bad)?;
    a.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad)).collect()
}

/// `min_tokens`: a count up to `cap` and to `max` (the request's `key`)
/// when that is given.
fn min_tokens(m: &Map<String, Value>, key: &str, max: Option<usize>, cap: usize) -> Result<usize, ApiError> {
    match (integer(m, "min_tokens", 0, cap)?, max) {
        (Some(n), Some(max)) if n > max => {
            Err(ApiError::invalid("min_tokens", format!("min_tokens = {n} is above {key} = {max}")))
        }
        (n, _) => Ok(n.unwrap_or(0)),
    }
}

/// `logit_bias`: `{"token id": bias}`, biases in [-100, 100] (the ids are
/// checked against the vocabulary once the model is known).
fn logit_bias(m: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = present(m, "logit_bias") else { return Ok(Vec::new()) };
    let o = v.as_object().ok_or_else(|| ApiError::invalid("logit_bias", "logit_bias must be an object"))?;
    o.iter()
        .map(|(k, b)| {
            let id = k.parse::<u32>().map_err(|_| {
                ApiError::invalid("logit_bias", format!("logit_bias keys must be token ids, got {k:?}"))
            })?;
            match b.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    format!("the bias of token {id} must be a number in [-100, 100]"),
                )),
            }
        })
        .collect()
}

/// The fields chat and text completions share: sampling, stop, stream
/// and the unsupported ones.
fn common(m: &Map<String, Value>, cap: usize, key: &str) -> Result<Completion, ApiError> {
    let mut sampler = SamplerParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, ..SamplerParams::default() };
    if let Some(p) = number(m, "frequency_penalty", -2.0, 2.0)? {
        sampler.frequency_penalty = p as f32;
    }
    if let Some(p) = number(m, "presence_penalty", -2.0, 2.0)? {
        sampler.presence_penalty = p as f32;
    }
    sampler.logit_bias = logit_bias(m)?;
    if let Some(t) = number(m, "temperature", 0.0, 2.0)? {
        sampler.temperature = t as f32;
    }
    if let Some(p) = number(m, "top_p", f64::MIN_POSITIVE, 1.0)? {
        sampler.top_p = p as f32;
    }
    if let Some(k) = number(m, "top_k", 0.0, 1e9)? {
        sampler.top_k = k as usize;
    }
    if let Some(p) = number(m, "min_p", 0.0, 1.0)? {
        sampler.min_p = p as f32;
    }
    if let Some(p) = number(m, "repeat_penalty", f64::MIN_POSITIVE, 10.0)? {
        sampler.repeat_penalty = p as f32;
    }
    // llama-server's window: -1 the whole context, 0 none.
    match present(m, "repeat_last_n").map(Value::as_i64) {
        None => {}
        Some(Some(-1)) => sampler.repeat_last_n = usize::MAX,
        Some(Some(n)) if n >= 0 => sampler.repeat_last_n = n as usize,
        Some(_) => return Err(ApiError::invalid("repeat_last_n", "repeat_last_n must be an integer >= -1")),
    }
    // vLLM's: over the whole prompt and output.
    if let Some(p) = number(m, "repetition_penalty", f64::MIN_POSITIVE, 10.0)? {
        if present(m, "repeat_penalty").is_some() || present(m, "repeat_last_n").is_some() {
            return Err(ApiError::invalid(
                "repetition_penalty",
                "give repetition_penalty (vLLM's, over the whole context) or repeat_penalty and repeat_last_n \
                 (llama.cpp's), not both",
            ));
        }
        (sampler.repeat_penalty, sampler.repeat_last_n) = (p as f32, usize::MAX);
    }
    sampler.seed = match present(m, "seed") {
        None => rand::random(),
        Some(v) => v.as_i64().ok_or_else(|| ApiError::invalid("seed", "seed must be an integer"))? as u64,
    };
    let stop = match present(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= MAX_STOPS => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("stop", "stop must be a string or an array of strings"))?,
        Some(Value::Array(_)) => return Err(ApiError::invalid("stop", format!("at most {MAX_STOPS} stop strings"))),
        Some(_) => return Err(ApiError::invalid("stop", "stop must be a string or an array of strings")),
    };
    let stream = boolean(m, "stream")?;
    let include_usage = match present(m, "stream_options") {
        None => false,
        Some(Value::Object(o)) if stream => match o.keys().find(|k| *k != "include_usage") {
            Some(k) => return Err(ApiError::invalid("stream_options", format!("unrecognized stream option: {k}"))),
            None => boolean(o, "include_usage")
                .map_err(|_| ApiError::invalid("stream_options.include_usage", "include_usage must be a boolean"))?,
        },
        Some(Value::Object(_)) => {
            return Err(ApiError::invalid("stream_options", "stream_options is only allowed with stream = true"));
        }
        Some(_) => return Err(ApiError::invalid("stream_options", "stream_options must be an object")),
    };
    let max = max_tokens(m, key, cap)?;
    Ok(Completion {
        model: string(m, "model")?,
        input: Input::Text(String::new()),
        max_tokens: max,
        sampler,
        stop,
        stream,
        include_usage,
        logprobs: None,
        echo: false,
        constraint: structured::read(m)?,
        min_tokens: min_tokens(m, key, max, cap)?,
        ignore_eos: boolean(m, "ignore_eos")?,
        stop_token_ids: stop_token_ids(m)?,
        n: integer(m, "n", 1, MAX_CHOICES)?.unwrap_or(1),
        tools: None,
        render: RenderOptions::default(),
    })
}

/// `POST /v1/chat/completions`.
pub fn chat(m: &Map<String, Value>, cap: usize) -> Result<Completion, ApiError> {
    const KNOWN: &[&str] = &[
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "functions",
        "function_call",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
    ];
    check_fields(m, &[COMPLETION_FIELDS, structured::FIELDS, tools::FIELDS, KNOWN])?;
    let top = number(m, "top_logprobs", 0.0, MAX_TOP as f64)?.map(|k| k as usize);
    let logprobs = match boolean(m, "logprobs")? {
        true => Some(top.unwrap_or(0)),
        false if top.is_some() => {
            return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs = true"));
        }
        false => None,
    };
    for key in ["functions", "function_call"] {
        only_default(m, key, |_| false, "the deprecated functions API: give tools and tool_choice")?;
    }
    let key = if present(m, "max_completion_tokens").is_some() { "max_completion_tokens" } else { "max_tokens" };
    let mut c = common(m, cap, key)?;
    c.input = Input::Chat(messages(m)?);
    c.render = render_options(m)?;
    c.logprobs = logprobs;
    c.tools = tools::read(m)?;
    if let (Some(_), Some((field, _))) = (&c.tools, &c.constraint) {
        return Err(ApiError::invalid(
            field,
            format!("{field} cannot be combined with tools: tool calls have their own format"),
        ));
    }
    Ok(c)
}

/// `messages`: a non-empty array of `{role, content}`, content a string
/// or an array of text parts; an assistant's may be `tool_calls` instead,
/// a tool's answers a `tool_call_id`.
fn messages(m: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(Value::Array(a)) = present(m, "messages") else {
        return Err(ApiError::invalid("messages", "messages must be an array of {role, content} objects"));
    };
    if a.is_empty() {
        return Err(ApiError::invalid("messages", "messages must not be empty"));
    }
    a.iter().enumerate().map(|(i, v)| message(i, v)).collect()
}

fn message(i: usize, v: &Value) -> Result<ChatMessage, ApiError> {
    let at = |f: &str| format!("messages[{i}].{f}");
    let o = v.as_object().ok_or_else(|| ApiError::invalid(&format!("messages[{i}]"), "must be an object"))?;
    let role = o.get("role").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(&at("role"), "role must be one of system, developer, user, assistant, tool")
    })?;
    let fields: &[&str] = match role {
        "system" | "developer" | "user" => &["role", "content", "name"],
        "assistant" => &["role", "content", "name", "tool_calls", "refusal", "annotations"],
        "tool" => &["role", "content", "tool_call_id"],
        _ => return Err(ApiError::invalid(&at("role"), format!("role '{role}' is not supported"))),
    };
    // A field sent as null is absent (clients echo a message's unset fields so).
    if let Some((k, _)) = o.iter().find(|(k, v)| !fields.contains(&k.as_str()) && !v.is_null()) {
        return Err(ApiError::invalid(&at(k), format!("message field '{k}' is not supported on a {role} message")));
    }
    let tool_calls = match o.get("tool_calls").filter(|v| !v.is_null()) {
        Some(v) => tools::past_calls(v, &at("tool_calls"))?,
        None => Vec::new(),
    };
    let content = match o.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                (Some("text"), Some(t)) => Ok(t),
                _ => Err(ApiError::invalid(&at("content"), "only text content parts are supported")),
            })
            .collect::<Result<String, _>>()?,
        // An assistant's calls stand for its content.
        None | Some(Value::Null) if !tool_calls.is_empty() => String::new(),
        _ => return Err(ApiError::invalid(&at("content"), "content must be a string or text parts")),
    };
    let tool_call_id = match (role, o.get("tool_call_id")) {
        ("tool", Some(Value::String(id))) => Some(id.clone()),
        ("tool", _) => return Err(ApiError::invalid(&at("tool_call_id"), "a tool message needs its tool_call_id")),
        _ => None,
    };
    // The developer role is OpenAI's new name for system.
    let role = if role == "developer" { "system" } else { role };
    Ok(ChatMessage { role: role.to_string(), content, tool_calls, tool_call_id })
}

/// `POST /v1/completions`.
pub fn completion(m: &Map<String, Value>, cap: usize) -> Result<Completion, ApiError> {
    const KNOWN: &[&str] = &["prompt", "best_of", "echo", "suffix"];
    check_fields(m, &[COMPLETION_FIELDS, structured::FIELDS, KNOWN])?;
    only_default(m, "best_of", |v| v.as_i64() == Some(1), "best_of > 1")?;
    only_default(m, "suffix", |_| false, "suffix (insertion)")?;
    let mut c = common(m, cap, "max_tokens")?;
    c.logprobs = number(m, "logprobs", 0.0, MAX_TOP as f64)?.map(|k| k as usize);
    c.echo = boolean(m, "echo")?;
    c.input = prompt(m)?;
    Ok(c)
}

/// The completions' `prompt`: a string, token ids, or an array of one of
/// those (one prompt per request).
fn prompt(m: &Map<String, Value>) -> Result<Input, ApiError> {
    const WHAT: &str = "prompt must be a string, an array of token ids, or an array of one of those";
    let ids = |a: &[Value]| -> Result<Input, ApiError> {
        if a.len() > MAX_PROMPT_IDS {
            return Err(ApiError::invalid("prompt", format!("at most {MAX_PROMPT_IDS} token ids")));
        }
        let ids = a.iter().map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok())).collect::<Option<Vec<_>>>();
        ids.map(Input::Tokens).ok_or_else(|| ApiError::invalid("prompt", "a token id must be a non-negative integer"))
    };
    match present(m, "prompt") {
        Some(Value::String(s)) => Ok(Input::Text(s.clone())),
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => ids(a),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(Input::Text(s.clone())),
            Value::Array(inner) if inner.iter().all(Value::is_number) => ids(inner),
            _ => Err(ApiError::invalid("prompt", WHAT)),
        },
        Some(Value::Array(a)) if a.len() > 1 && a.iter().all(|v| v.is_string() || v.is_array()) => {
            Err(ApiError::invalid("prompt", "one prompt per request (an array of one prompt)"))
        }
        _ => Err(ApiError::invalid("prompt", WHAT)),
    }
}

/// `POST /v1/embeddings`.
pub fn embeddings(m: &Map<String, Value>) -> Result<Embeddings, ApiError> {
    check_fields(m, &[&["model", "input", "encoding_format", "dimensions"]])?;
    let input = match present(m, "input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.is_empty() => return Err(ApiError::invalid("input", "input must not be empty")),
        Some(Value::Array(a)) if a.len() > MAX_EMBED_INPUTS => {
            return Err(ApiError::invalid("input", format!("at most {MAX_EMBED_INPUTS} inputs per request")));
        }
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::invalid("input", "input must be a string or an array of strings"))?,
        _ => return Err(ApiError::invalid("input", "input must be a string or an array of strings")),
    };
    if input.iter().any(String::is_empty) {
        return Err(ApiError::invalid("input", "an input is the empty string"));
    }
    let base64 = match string(m, "encoding_format")?.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(f) => return Err(ApiError::invalid("encoding_format", format!("'{f}': use float or base64"))),
    };
    let dimensions = number(m, "dimensions", 1.0, 1e6)?.map(|d| d as usize);
    Ok(Embeddings { model: string(m, "model")?, input, base64, dimensions })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_of(v: Value) -> Result<Completion, ApiError> {
        chat(v.as_object().unwrap(), 100)
    }

    #[test]
    fn unsupported_and_unknown_fields_are_named() {
        let base = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (extra, param) in [
            (serde_json::json!({"n": 17}), "n"),
            (serde_json::json!({"n": 0}), "n"),
            (serde_json::json!({"n": 1.5}), "n"),
            (serde_json::json!({"logit_bias": {"one": 5}}), "logit_bias"),
            (serde_json::json!({"logit_bias": {"1": 101}}), "logit_bias"),
            (serde_json::json!({"logit_bias": [1]}), "logit_bias"),
            (serde_json::json!({"frequency_penalty": 2.5}), "frequency_penalty"),
            (serde_json::json!({"min_tokens": 5, "max_tokens": 4}), "min_tokens"),
            (serde_json::json!({"min_tokens": 1.5}), "min_tokens"),
            (serde_json::json!({"ignore_eos": 1}), "ignore_eos"),
            (serde_json::json!({"presence_penalty": "x"}), "presence_penalty"),
            (serde_json::json!({"tools": []}), "tools"),
            (serde_json::json!({"functions": [{"name": "f"}]}), "functions"),
            (serde_json::json!({"tool_choice": "auto"}), "tool_choice"),
            (
                serde_json::json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                                   "response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (serde_json::json!({"bogus": 1}), "bogus"),
            (serde_json::json!({"max_tokens": 0}), "max_tokens"),
            (serde_json::json!({"max_tokens": 101}), "max_tokens"),
            (serde_json::json!({"temperature": "hot"}), "temperature"),
            (serde_json::json!({"messages": []}), "messages"),
            (serde_json::json!({"repetition_penalty": 0}), "repetition_penalty"),
            (serde_json::json!({"repetition_penalty": 1.1, "repeat_penalty": 1.1}), "repetition_penalty"),
            (serde_json::json!({"repeat_last_n": -2}), "repeat_last_n"),
            (serde_json::json!({"repeat_last_n": 1.5}), "repeat_last_n"),
            (serde_json::json!({"stop_token_ids": [1.5]}), "stop_token_ids"),
            (serde_json::json!({"stop_token_ids": 7}), "stop_token_ids"),
            (serde_json::json!({"stop_token_ids": [-1]}), "stop_token_ids"),
            (serde_json::json!({"stop_token_ids": vec![1; MAX_STOP_TOKENS + 1]}), "stop_token_ids"),
            (serde_json::json!({"add_generation_prompt": 1}), "add_generation_prompt"),
            (
                serde_json::json!({"add_generation_prompt": true, "continue_final_message": true}),
                "continue_final_message",
            ),
            (serde_json::json!({"chat_template_kwargs": [1]}), "chat_template_kwargs"),
            (serde_json::json!({"chat_template_kwargs": {"messages": []}}), "chat_template_kwargs"),
        ] {
            let mut v = base.clone();
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let e = chat_of(v).unwrap_err();
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{}", e.message);
        }
        let ok = chat_of(base.clone()).unwrap();
        assert!(matches!(ok.input, Input::Chat(ref m) if m.len() == 1));
        let mut v = base;
        v.as_object_mut().unwrap().extend(
            serde_json::json!({"logit_bias": {"7": -100, "9": 2.5}, "frequency_penalty": 0.5, "presence_penalty": -1})
                .as_object()
                .unwrap()
                .clone(),
        );
        let s = chat_of(v).unwrap().sampler;
        assert_eq!((s.frequency_penalty, s.presence_penalty), (0.5, -1.0));
        let mut bias = s.logit_bias;
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, [(7, -100.0), (9, 2.5)]);
        // vLLM's repetition penalty covers the whole context; llama.cpp's
        // window is given by repeat_last_n (-1: all).
        let with = |extra: Value| {
            let mut v = serde_json::json!({"messages": [{"role": "user", "content": "hi"}]});
            v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            chat_of(v).unwrap()
        };
        let s = with(serde_json::json!({"repetition_penalty": 1.2})).sampler;
        assert_eq!((s.repeat_penalty, s.repeat_last_n), (1.2, usize::MAX));
        let s = with(serde_json::json!({"repeat_penalty": 1.1, "repeat_last_n": -1})).sampler;
        assert_eq!((s.repeat_penalty, s.repeat_last_n), (1.1, usize::MAX));
        assert_eq!(with(serde_json::json!({"repeat_last_n": 16})).sampler.repeat_last_n, 16);
        assert_eq!(with(serde_json::json!({"stop_token_ids": [2, 7]})).stop_token_ids, [2, 7]);
    }

    #[test]
    fn tool_calls_and_results_are_read_in_the_history() {
        let call = serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]);
        let msgs = serde_json::json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": call, "function_call": null, "refusal": null},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
        ]);
        let Input::Chat(m) = chat_of(serde_json::json!({"messages": msgs})).unwrap().input else { panic!() };
        assert_eq!((m[1].tool_calls.len(), m[1].content.as_str()), (1, ""));
        assert_eq!((m[2].tool_call_id.as_deref(), m[2].content.as_str()), (Some("c1"), "42"));
        for (msg, param) in [
            (serde_json::json!({"role": "user", "content": "x", "tool_calls": call}), "messages[0].tool_calls"),
            (serde_json::json!({"role": "assistant", "content": null}), "messages[0].content"),
            (serde_json::json!({"role": "tool", "content": "x"}), "messages[0].tool_call_id"),
            (serde_json::json!({"role": "function", "content": "x"}), "messages[0].role"),
        ] {
            let e = chat_of(serde_json::json!({"messages": [msg]})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{msg}: {}", e.message);
        }
    }

    #[test]
    fn a_prompt_is_text_or_token_ids_and_logprobs_are_read_per_endpoint() {
        let text = |v: Value| completion(v.as_object().unwrap(), 100);
        for (prompt, ids) in [
            (serde_json::json!([5, 6]), Some(vec![5, 6])),
            (serde_json::json!([[5, 6]]), Some(vec![5, 6])),
            (serde_json::json!(["hi"]), None),
            (serde_json::json!("hi"), None),
        ] {
            let c = text(serde_json::json!({"prompt": prompt, "logprobs": 2, "echo": true})).unwrap();
            assert_eq!((c.logprobs, c.echo), (Some(2), true));
            match (c.input, ids) {
                (Input::Tokens(got), Some(want)) => assert_eq!(got, want),
                (Input::Text(t), None) => assert_eq!(t, "hi"),
                (other, want) => panic!("{other:?} for {want:?}"),
            }
        }
        for bad in [serde_json::json!([[1], [2]]), serde_json::json!([1.5]), serde_json::json!({"a": 1})] {
            assert_eq!(text(serde_json::json!({"prompt": bad})).unwrap_err().param.as_deref(), Some("prompt"));
        }
        let msgs = serde_json::json!([{"role": "user", "content": "hi"}]);
        let c = chat_of(serde_json::json!({"messages": msgs, "logprobs": true, "top_logprobs": 4})).unwrap();
        assert_eq!(c.logprobs, Some(4));
        assert_eq!(chat_of(serde_json::json!({"messages": msgs, "logprobs": true})).unwrap().logprobs, Some(0));
        assert_eq!(chat_of(serde_json::json!({"messages": msgs})).unwrap().logprobs, None);
        let e = chat_of(serde_json::json!({"messages": msgs, "logprobs": true, "top_logprobs": 21})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = chat_of(serde_json::json!({"messages": msgs, "echo": true})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"), "echo is the completions' only");
    }

    #[test]
    fn invalid_utf8_and_json_are_bad_requests() {
        assert_eq!(object(b"{\"a\": \"\xff\"}").unwrap_err().status, 400);
        assert_eq!(object(b"{not json").unwrap_err().status, 400);
        assert_eq!(object(b"[1]").unwrap_err().status, 400);
    }
}
