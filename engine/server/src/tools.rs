//! Tool calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`,
//! in one format that every model can follow, whatever its chat template
//! knows (llama.cpp's "generic" format, in spirit):
//!
//! 1. The prompt: a system message lists the tools (name, description,
//!    JSON schema of the arguments) and asks for a JSON answer, either
//!    `{"tool_calls": [{"name": ..., "arguments": {...}}]}` or
//!    `{"response": "..."}`. Earlier turns are written the same way: an
//!    assistant's calls as that JSON, a tool's result under the `tool`
//!    role, or as a user message where the template drops that role.
//! 2. The output: a grammar ([`Tools::spec`]) holds the model to that
//!    JSON, each call's arguments to its tool's schema, compactly written
//!    (`", "` and `": "` separators, no other whitespace), so that
//!    [`crate::tool_reply`] can stream a reply's text as it comes.
//!
//! `tool_choice: "required"` drops the reply branch, a named function
//! allows only that tool, `parallel_tool_calls: false` one call.

use serde_json::{Map, Value, json};
use spinfer_engine::grammar::Spec;

use crate::chat::{ChatTemplate, Message, RenderOptions};
use crate::error::ApiError;

/// The request fields read here.
pub const FIELDS: &[&str] = &["tools", "tool_choice", "parallel_tool_calls"];
/// Most tools of one request (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Most bytes of a tool's name (OpenAI's limit).
const MAX_NAME: usize = 64;

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The JSON schema of its arguments (an object).
    pub parameters: Value,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// A call or a reply, as the model sees fit.
    Auto,
    /// At least one call.
    Required,
    /// One call of this tool.
    Named(String),
}

/// A request's tools, when it lets the model call them.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call in an answer (`parallel_tool_calls`, default
    /// true).
    pub parallel: bool,
}

/// A call in the history (an assistant message's `tool_calls`).
#[derive(Clone, Debug, PartialEq)]
pub struct PastCall {
    pub id: String,
    pub name: String,
    /// As the client sent it: JSON text, normally.
    pub arguments: String,
}

/// A chat message as the client sent it, tool fields included.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls.
    pub tool_calls: Vec<PastCall>,
    /// A tool's result: the call it answers.
    pub tool_call_id: Option<String>,
}

/// `tools`, `tool_choice`, `parallel_tool_calls`; `None` when the model
/// may not call tools (none given, or `tool_choice: "none"`).
pub fn read(m: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let present = |k: &str| m.get(k).filter(|v| !v.is_null());
    let parallel = match present("parallel_tool_calls") {
        None => true,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| ApiError::invalid("parallel_tool_calls", "parallel_tool_calls must be a boolean"))?,
    };
    let tools = match present("tools") {
        None => None,
        Some(v) => Some(tools(v)?),
    };
    let choice = match present("tool_choice") {
        None => None,
        Some(Value::String(s)) if s == "none" => return Ok(None),
        Some(Value::String(s)) if s == "auto" => Some(ToolChoice::Auto),
        Some(Value::String(s)) if s == "required" => Some(ToolChoice::Required),
        Some(Value::Object(o)) => Some(named(o, tools.as_deref().unwrap_or_default())?),
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
    };
    match (tools, choice) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(ApiError::invalid("tool_choice", "tool_choice is only allowed when tools are given")),
        (Some(tools), choice) => Ok(Some(Tools { tools, choice: choice.unwrap_or(ToolChoice::Auto), parallel })),
    }
}

/// `tools`: 1 to [`MAX_TOOLS`] `{"type": "function", "function": {name,
/// description, parameters, strict}}`, names distinct.
fn tools(v: &Value) -> Result<Vec<Tool>, ApiError> {
    let a = v.as_array().ok_or_else(|| ApiError::invalid("tools", "tools must be an array of functions"))?;
    if a.is_empty() || a.len() > MAX_TOOLS {
        return Err(ApiError::invalid("tools", format!("give 1 to {MAX_TOOLS} tools, not {}", a.len())));
    }
    let mut out: Vec<Tool> = Vec::with_capacity(a.len());
    for (i, t) in a.iter().enumerate() {
        let at = |f: &str| format!("tools[{i}]{f}");
        let o = t.as_object().ok_or_else(|| ApiError::invalid(&at(""), "a tool must be an object"))?;
        only(o, &["type", "function"], &at(""))?;
        if o.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(&at(".type"), "the only tool type is function"));
        }
        let f = o
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| ApiError::invalid(&at(".function"), "function must be an object with a name"))?;
        only(f, &["name", "description", "parameters", "strict"], &at(".function"))?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        check_name(name).map_err(|m| ApiError::invalid(&at(".function.name"), m))?;
        if out.iter().any(|t| t.name == name) {
            return Err(ApiError::invalid(&at(".function.name"), format!("two tools are named {name}")));
        }
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => return Err(ApiError::invalid(&at(".function.description"), "description must be a string")),
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => closed(p.clone()),
            Some(_) => {
                return Err(ApiError::invalid(&at(".function.parameters"), "parameters must be a JSON schema object"));
            }
        };
        out.push(Tool { name: name.to_string(), description, parameters });
    }
    Ok(out)
}

/// `schema` with `additionalProperties: false` on every object schema
/// that lists `properties` and does not say (OpenAI's strict schemas say
/// it; without it a model may add keys the function does not take).
fn closed(mut schema: Value) -> Value {
    fn walk(v: &mut Value) {
        let Some(o) = v.as_object_mut() else {
            if let Some(a) = v.as_array_mut() {
                a.iter_mut().for_each(walk);
            }
            return;
        };
        if o.contains_key("properties") && !o.contains_key("additionalProperties") {
            o.insert("additionalProperties".into(), Value::Bool(false));
        }
        for key in ["properties", "$defs", "definitions"] {
            if let Some(Value::Object(m)) = o.get_mut(key) {
                m.values_mut().for_each(walk);
            }
        }
        for key in ["items", "prefixItems", "anyOf", "allOf", "oneOf"] {
            if let Some(v) = o.get_mut(key) {
                walk(v);
            }
        }
    }
    walk(&mut schema);
    schema
}

/// A name of 1 to 64 letters, digits, `_` or `-` (OpenAI's rule; it also
/// keeps names out of the grammar's and the prompt's quoting).
fn check_name(name: &str) -> Result<(), String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(ok) {
        return Err(format!("a function name is 1 to {MAX_NAME} of a-z, A-Z, 0-9, _ and -, not {name:?}"));
    }
    Ok(())
}

fn only(o: &Map<String, Value>, allowed: &[&str], at: &str) -> Result<(), ApiError> {
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(&format!("{at}.{k}"), format!("unrecognized field {k}"))),
        None => Ok(()),
    }
}

/// `{"type": "function", "function": {"name": N}}`, N one of `tools`.
fn named(o: &Map<String, Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let name = match (o.get("type").and_then(Value::as_str), o.get("function").and_then(|f| f.get("name"))) {
        (Some("function"), Some(Value::String(n))) => n,
        _ => {
            return Err(ApiError::invalid(
                "tool_choice",
                "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ));
        }
    };
    if !tools.iter().any(|t| t.name == *name) {
        return Err(ApiError::invalid("tool_choice", format!("tool_choice names {name:?}, which is not in tools")));
    }
    Ok(ToolChoice::Named(name.clone()))
}

/// An assistant message's `tool_calls`: `[{id, type: "function",
/// function: {name, arguments}}]`; `at` names the field in errors.
pub fn past_calls(v: &Value, at: &str) -> Result<Vec<PastCall>, ApiError> {
    let bad = |i: usize, what: &str| ApiError::invalid(&format!("{at}[{i}]"), what.to_string());
    let a = v.as_array().ok_or_else(|| ApiError::invalid(at, "tool_calls must be an array"))?;
    if a.len() > MAX_TOOLS {
        return Err(ApiError::invalid(at, format!("at most {MAX_TOOLS} calls in a message")));
    }
    a.iter()
        .enumerate()
        .map(|(i, c)| {
            let f = c.get("function").ok_or_else(|| bad(i, "a call is {id, type, function: {name, arguments}}"))?;
            let (Some(name), Some(arguments)) =
                (f.get("name").and_then(Value::as_str), f.get("arguments").and_then(Value::as_str))
            else {
                return Err(bad(i, "a call's function has a name and arguments (a string)"));
            };
            let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
            Ok(PastCall { id: id.to_string(), name: name.to_string(), arguments: arguments.to_string() })
        })
        .collect()
}

impl Tools {
    fn allowed(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().filter(move |t| match &self.choice {
            ToolChoice::Named(n) => t.name == *n,
            _ => true,
        })
    }

    fn one_call(&self) -> bool {
        !self.parallel || matches!(self.choice, ToolChoice::Named(_))
    }

    /// The system prompt's part: the tools and the answer's format.
    pub fn instructions(&self) -> String {
        let mut s = String::from("You can call these tools (the arguments follow each one's JSON schema):\n");
        for t in &self.tools {
            let mut o = json!({"name": t.name, "parameters": t.parameters});
            if let Some(d) = &t.description {
                o["description"] = json!(d);
            }
            s.push_str(&o.to_string());
            s.push('\n');
        }
        let calls = match self.one_call() {
            true => "{\"tool_calls\": [{\"name\": \"<tool name>\", \"arguments\": {<its arguments>}}]} (one call)",
            false => {
                "{\"tool_calls\": [{\"name\": \"<tool name>\", \"arguments\": {<its arguments>}}]} \
                      (more calls in the list only when the request needs more than one)"
            }
        };
        s.push_str("\nAnswer with JSON only. ");
        match &self.choice {
            ToolChoice::Auto => s.push_str(&format!(
                "To call tools: {calls}. To answer the user directly: {{\"response\": \"<your answer>\"}}."
            )),
            ToolChoice::Required => s.push_str(&format!("Call tools: {calls}.")),
            ToolChoice::Named(n) => s.push_str(&format!("Call {n}: {calls}.")),
        }
        s
    }

    /// The grammar of an answer: a Lark grammar whose `%json` blocks are
    /// each tool's argument schema (each its own root, so its `$ref`s
    /// resolve as the client wrote them).
    pub fn spec(&self) -> Spec {
        // Compact JSON, the separators the history is written with.
        let guidance = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
        let with_guidance = |schema: &Value| {
            let mut s = schema.clone();
            if let Some(o) = s.as_object_mut() {
                o.insert("x-guidance".into(), guidance.clone());
            }
            s
        };
        let mut g = String::new();
        g.push_str(if self.one_call() {
            "calls: \"{\\\"tool_calls\\\": [\" call \"]}\"\n"
        } else {
            "calls: \"{\\\"tool_calls\\\": [\" call (\", \" call)* \"]}\"\n"
        });
        let names: Vec<String> = (0..self.allowed().count()).map(|i| format!("call_{i}")).collect();
        g.push_str(&format!("call: {}\n", names.join(" | ")));
        for (rule, t) in names.iter().zip(self.allowed()) {
            // Names are [A-Za-z0-9_-]: nothing to escape.
            g.push_str(&format!(
                "{rule}: \"{{\\\"name\\\": \\\"{}\\\", \\\"arguments\\\": \" %json {} \"}}\"\n",
                t.name,
                with_guidance(&t.parameters)
            ));
        }
        let start = match self.choice {
            ToolChoice::Auto => {
                let string = with_guidance(&json!({"type": "string"}));
                g.push_str(&format!("reply: \"{{\\\"response\\\": \" %json {string} \"}}\"\n"));
                "start: calls | reply\n"
            }
            _ => "start: calls\n",
        };
        Spec::Lark(format!("{start}{g}"))
    }
}

/// The messages the template sees: tool calls written as the JSON the
/// model answers with, tool results under the `tool` role when the
/// template shows it (`tool_role`), else as user messages (consecutive
/// ones merged, for templates that want turns to alternate), and the
/// tools' instructions in the system message.
pub fn history(messages: &[ChatMessage], tools: Option<&Tools>, tool_role: bool) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::with_capacity(messages.len() + 1);
    let mut was_result = false;
    for (i, m) in messages.iter().enumerate() {
        let is_result = m.role == "tool";
        let content = if !m.tool_calls.is_empty() {
            calls_text(&m.tool_calls)
        } else if is_result && !tool_role {
            let name = m.tool_call_id.as_deref().and_then(|id| call_name(&messages[..i], id));
            json!({"tool_result": {"name": name, "content": m.content}}).to_string()
        } else {
            m.content.clone()
        };
        match out.last_mut() {
            Some(last) if is_result && was_result && !tool_role => {
                last.content.push('\n');
                last.content.push_str(&content);
            }
            _ => {
                let role = if is_result && !tool_role { "user" } else { m.role.as_str() };
                out.push(Message { role: role.to_string(), content });
            }
        }
        was_result = is_result;
    }
    if let Some(t) = tools {
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{}", first.content, t.instructions());
            }
            _ => out.insert(0, Message { role: "system".into(), content: t.instructions() }),
        }
    }
    out
}

/// The prompt for `messages` with `tools`: rendered with the instructions
/// as a system message, or, where the template refuses a system message,
/// at the head of the first user message.
pub fn render(
    template: &ChatTemplate,
    messages: &[ChatMessage],
    tools: Option<&Tools>,
    options: &RenderOptions,
) -> Result<String, ApiError> {
    let shown = history(messages, tools, template.shows_tool_role());
    let first = template.render_with(&shown, options);
    let (Err(e), Some(t)) = (&first, tools) else { return first };
    if messages.first().is_some_and(|m| m.role == "system") {
        return Err(e.clone());
    }
    let mut shown = history(messages, None, template.shows_tool_role());
    match shown.iter_mut().find(|m| m.role == "user") {
        Some(u) => u.content = format!("{}\n\n{}", t.instructions(), u.content),
        None => return Err(e.clone()),
    }
    template.render_with(&shown, options)
}

/// The name of the call `id` among the earlier messages.
fn call_name<'a>(earlier: &'a [ChatMessage], id: &str) -> Option<&'a str> {
    earlier.iter().rev().flat_map(|m| &m.tool_calls).find(|c| c.id == id).map(|c| c.name.as_str())
}

/// Calls as the model writes them: `{"tool_calls": [{"name": ...,
/// "arguments": ...}]}`, compact with `", "` and `": "`.
fn calls_text(calls: &[PastCall]) -> String {
    let items: Vec<Value> = calls
        .iter()
        .map(|c| {
            let args = serde_json::from_str::<Value>(&c.arguments).unwrap_or_else(|_| json!(c.arguments));
            json!({"name": c.name, "arguments": args})
        })
        .collect();
    compact(&json!({ "tool_calls": items }))
}

/// JSON with `", "` and `": "` separators and no other whitespace.
pub fn compact(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("[{}]", a.iter().map(compact).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => {
            let items: Vec<String> = o.iter().map(|(k, v)| format!("{}: {}", json!(k), compact(v))).collect();
            format!("{{{}}}", items.join(", "))
        }
        scalar => scalar.to_string(),
    }
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
