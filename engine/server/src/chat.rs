//! The model's chat template (Jinja, from the GGUF's
//! `tokenizer.chat_template`), rendered with `minijinja` and its Python
//! compatibility methods (`.strip()`, `.startswith()`…) as Hugging Face
//! templates use them.

use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use serde_json::{Map, Value};

use std::path::Path;

use crate::error::{ApiError, Error, Result};
use spinfer_engine::Engine;
use spinfer_engine::tokenizer::Tokenizer;

/// One message as the template sees it (content flattened to text).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Most bytes of a chat template file.
const MAX_TEMPLATE_FILE: u64 = 1 << 20;

/// Instructions a template may run per render (a chat of hundreds of
/// messages takes a few thousand per message).
const TEMPLATE_FUEL: u64 = 10_000_000;

/// How a chat is rendered (vLLM's request fields).
#[derive(Clone, Debug, PartialEq)]
pub struct RenderOptions {
    /// The assistant's turn is opened at the end (`add_generation_prompt`).
    pub add_generation_prompt: bool,
    /// The last message, the assistant's, is left open for the answer to
    /// continue (`continue_final_message`: the prompt ends with its text).
    pub continue_final_message: bool,
    /// More variables for the template (`chat_template_kwargs`, such as
    /// `enable_thinking`).
    pub kwargs: Map<String, Value>,
}

impl Default for RenderOptions {
    fn default() -> Self {
        Self { add_generation_prompt: true, continue_final_message: false, kwargs: Map::new() }
    }
}

/// Template variables the server sets, which `chat_template_kwargs` may
/// not.
pub const RESERVED: &[&str] = &["messages", "add_generation_prompt", "bos_token", "eos_token"];

pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// Whether a `tool` message shows in the prompt (see
    /// [`ChatTemplate::shows_tool_role`]).
    tool_role: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos` and `eos` are the tokens' text
    /// (`bos_token`, `eos_token` in the template).
    pub fn new(source: &str, bos: String, eos: String) -> Result<Self> {
        let mut env = Environment::new();
        // A template is the model file's code: bound what it may run.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source.to_string()).map_err(|e| Error::Template(e.to_string()))?;
        let mut t = Self { env, bos, eos, tool_role: false };
        t.tool_role = t.probe_tool_role();
        Ok(t)
    }

    /// The template of `engine`'s model: the one in `file` when given,
    /// else the model file's own; `None` when neither is.
    pub fn for_engine(engine: &Engine, file: Option<&Path>) -> Result<Option<Self>> {
        let text = |id: Option<u32>| id.and_then(|i| token_text(&engine.tokenizer, i)).unwrap_or_default();
        let (bos, eos) = (text(engine.tokenizer.bos_id()), text(engine.tokenizer.eos_id()));
        let source = match file {
            Some(f) => spinfer_formats::bounded::read_text(f, MAX_TEMPLATE_FILE, "a chat template")
                .map_err(|e| Error::Template(e.to_string()))?,
            None => match engine.chat_template() {
                Some(s) => s.to_string(),
                None => return Ok(None),
            },
        };
        Self::new(&source, bos, eos).map(Some)
    }

    /// Whether the template writes a `tool` message's content (ChatML's
    /// do; others raise on the role or drop it, and tool results are then
    /// given as user messages).
    pub fn shows_tool_role(&self) -> bool {
        self.tool_role
    }

    fn probe_tool_role(&self) -> bool {
        const NEEDLE: &str = "spinfer-tool-result-7f3a";
        let msg = |role: &str, content: &str| Message { role: role.into(), content: content.into() };
        let probe = [msg("user", "Hi"), msg("assistant", "{}"), msg("tool", NEEDLE)];
        self.render(&probe).is_ok_and(|p| p.contains(NEEDLE))
    }

    /// The prompt for `messages`, ending with the assistant's turn opened.
    /// A template that raises (say, roles out of order) is the request's
    /// fault: a 400 with the template's message.
    pub fn render(&self, messages: &[Message]) -> std::result::Result<String, ApiError> {
        self.render_with(messages, &RenderOptions::default())
    }

    /// [`ChatTemplate::render`] with `options`.
    pub fn render_with(&self, messages: &[Message], options: &RenderOptions) -> std::result::Result<String, ApiError> {
        let t = self.env.get_template("chat").map_err(|e| ApiError::internal(e.to_string()))?;
        let mut vars = options.kwargs.clone();
        let open = options.add_generation_prompt && !options.continue_final_message;
        for (k, v) in [
            ("messages", serde_json::to_value(messages).map_err(|e| ApiError::internal(e.to_string()))?),
            ("add_generation_prompt", Value::Bool(open)),
            ("bos_token", Value::String(self.bos.clone())),
            ("eos_token", Value::String(self.eos.clone())),
        ] {
            vars.insert(k.into(), v);
        }
        let rendered = t.render(minijinja::value::Serde(&vars)).map_err(|e| {
            let detail = match e.kind() {
                ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid operation").to_string(),
                _ => e.to_string(),
            };
            ApiError::invalid("messages", format!("the model's chat template refused the messages: {detail}"))
        })?;
        if !options.continue_final_message {
            return Ok(rendered);
        }
        // The prompt ends with the final message's text: what the template
        // writes after it (the end of its turn) is cut.
        let last = messages.last().filter(|m| m.role == "assistant" && !m.content.is_empty());
        match last.and_then(|m| rendered.rfind(&m.content).map(|at| at + m.content.len())) {
            Some(end) => Ok(rendered[..end].to_string()),
            None => Err(ApiError::invalid(
                "continue_final_message",
                "continue_final_message needs a last message from the assistant with text the template shows",
            )),
        }
    }
}

/// Whether a rendered chat gets the tokenizer's BOS: as the tokenizer
/// does by default, unless the template already wrote it.
pub fn add_bos(tokenizer: &Tokenizer, rendered: &str) -> bool {
    let bos = tokenizer.bos_id().and_then(|b| token_text(tokenizer, b)).filter(|b| !b.is_empty());
    tokenizer.add_bos_default() && !bos.is_some_and(|b| rendered.starts_with(&b))
}

/// A token's text as written in templates (`<s>`, `<bos>`).
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> Option<String> {
    tokenizer.token_bytes(id).ok().and_then(|b| String::from_utf8(b).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
        {{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + \
        '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}\
        {{ '<|im_start|>assistant\\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    #[test]
    fn chatml_renders_with_the_assistant_turn_open() {
        let t = ChatTemplate::new(CHATML, "<s>".into(), "</s>".into()).unwrap();
        let p = t.render(&[msg("user", "Hi")]).unwrap();
        assert_eq!(
            p,
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_raise_exception_work() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}\
                   {{ bos_token }}{{ messages[0].content.strip() }}";
        let t = ChatTemplate::new(src, "<bos>".into(), "<eos>".into()).unwrap();
        assert_eq!(t.render(&[msg("user", "  x ")]).unwrap(), "<bos>x");
        let e = t.render(&[msg("system", "x")]).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("first must be user"), "{}", e.message);
    }

    #[test]
    fn the_tool_role_is_probed() {
        let chatml = ChatTemplate::new(CHATML, "<s>".into(), "</s>".into()).unwrap();
        assert!(chatml.shows_tool_role());
        let strict = "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
                      {{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}";
        let dropping = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}";
        for src in [strict, dropping] {
            assert!(!ChatTemplate::new(src, String::new(), String::new()).unwrap().shows_tool_role(), "{src}");
        }
    }

    #[test]
    fn render_options_open_continue_and_pass_variables() {
        let t = ChatTemplate::new(CHATML, "<s>".into(), "</s>".into()).unwrap();
        let chat = [msg("user", "Hi"), msg("assistant", "Hello, I")];
        let closed = RenderOptions { add_generation_prompt: false, ..RenderOptions::default() };
        assert!(t.render_with(&chat[..1], &closed).unwrap().ends_with("Hi<|im_end|>\n"));
        let cont = RenderOptions { continue_final_message: true, ..RenderOptions::default() };
        assert!(t.render_with(&chat, &cont).unwrap().ends_with("<|im_start|>assistant\nHello, I"));
        let e = t.render_with(&chat[..1], &cont).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("continue_final_message"));
        let thinking = ChatTemplate::new(
            "{{ messages[0].content }}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}",
            String::new(),
            String::new(),
        )
        .unwrap();
        assert_eq!(thinking.render(&chat[..1]).unwrap(), "Hi");
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
        let off = RenderOptions { kwargs, ..RenderOptions::default() };
        assert_eq!(thinking.render_with(&chat[..1], &off).unwrap(), "Hi /no_think");
    }

    #[test]
    fn a_broken_template_is_an_error_at_start() {
        assert!(ChatTemplate::new("{% for %}", String::new(), String::new()).is_err());
    }
}
