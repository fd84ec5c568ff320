//! The tools' wire shapes, the prompt they write, and their grammar driven
//! by random logits over SmolLM2's real vocabulary: whatever the "model"
//! prefers, the answer reads back as calls of the allowed tools with
//! arguments in their schemas, or as a reply.

use std::path::Path;
use std::sync::OnceLock;

use serde_json::{Value, json};
use spinfer_engine::grammar::{Grammars, Spec};
use spinfer_engine::sampling::{TokenConstraint, argmax_logits};
use spinfer_engine::tokenizer::Tokenizer;

use super::*;
use crate::chat::RenderOptions;
use crate::tool_reply::{Finish, ReplySplitter};

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": false}}})
}

/// A tool whose schema uses a local `$ref`, resolved against its own root.
fn add() -> Value {
    json!({"type": "function", "function": {"name": "add",
        "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
                       "required": ["a", "b"], "additionalProperties": false,
                       "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 9}}}}})
}

fn tools_of(v: Value) -> Result<Option<Tools>, ApiError> {
    read(v.as_object().unwrap())
}

#[test]
fn tool_shapes_are_read_and_bad_ones_named() {
    let t = tools_of(json!({"tools": [weather(), add()], "parallel_tool_calls": false})).unwrap().unwrap();
    assert_eq!((t.tools.len(), &t.choice, t.parallel), (2, &ToolChoice::Auto, false));
    assert_eq!(t.tools[1].name, "add");
    let named = json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    assert_eq!(tools_of(named).unwrap().unwrap().choice, ToolChoice::Named("get_weather".into()));
    assert_eq!(tools_of(json!({"tools": [weather()], "tool_choice": "none"})).unwrap(), None);
    assert_eq!(tools_of(json!({"tool_choice": "none"})).unwrap(), None);
    let bare = json!({"tools": [{"type": "function", "function": {"name": "now"}}], "tool_choice": "required"});
    let t = tools_of(bare).unwrap().unwrap();
    assert_eq!(
        (&t.choice, &t.tools[0].parameters),
        (&ToolChoice::Required, &json!({"type": "object", "properties": {}}))
    );
    let fname = |name: &str| json!({"tools": [{"type": "function", "function": {"name": name}}]});
    for (body, param) in [
        (json!({"tools": []}), "tools"),
        (json!({"tools": {}}), "tools"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools[0].type"),
        (json!({"tools": [{"type": "function"}]}), "tools[0].function"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "x": 1}}]}), "tools[0].function.x"),
        (fname("has space"), "tools[0].function.name"),
        (fname(&"a".repeat(65)), "tools[0].function.name"),
        (fname(""), "tools[0].function.name"),
        (json!({"tools": [weather(), weather()]}), "tools[1].function.name"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"tools": [weather()], "tool_choice": "always"}), "tool_choice"),
        (
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tools": [weather()], "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
    ] {
        let e = tools_of(body.clone()).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
    }
    let calls = json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]);
    assert_eq!(
        past_calls(&calls, "m").unwrap(),
        [PastCall { id: "c1".into(), name: "f".into(), arguments: "{\"a\": 1}".into() }]
    );
    let e = past_calls(&json!([{"function": {"name": "f", "arguments": {}}}]), "m").unwrap_err();
    assert_eq!(e.param.as_deref(), Some("m[0]"));
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage { role: role.into(), content: content.into(), tool_calls: Vec::new(), tool_call_id: None }
}

/// A user asks, the assistant calls twice, both tools answer.
fn conversation() -> Vec<ChatMessage> {
    let call = |id: &str, args: &str| PastCall { id: id.into(), name: "get_weather".into(), arguments: args.into() };
    let result = |id: &str, content: &str| ChatMessage { tool_call_id: Some(id.into()), ..msg("tool", content) };
    vec![
        msg("user", "Weather in Paris and Oslo?"),
        ChatMessage {
            tool_calls: vec![call("c1", r#"{"city":"Paris","unit":"c"}"#), call("c2", "not json")],
            ..msg("assistant", "")
        },
        result("c1", "21"),
        result("c2", "9"),
    ]
}

#[test]
fn the_history_writes_calls_as_the_model_answers_and_results_by_role() {
    let tools = tools_of(json!({"tools": [weather()]})).unwrap().unwrap();
    let shown = history(&conversation(), Some(&tools), true);
    let roles: Vec<&str> = shown.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "tool"]);
    assert_eq!(shown[0].content, tools.instructions());
    assert!(shown[0].content.contains(r#""name":"get_weather""#), "{}", shown[0].content);
    assert_eq!(
        shown[2].content,
        r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, {"name": "get_weather", "arguments": "not json"}]}"#
    );
    assert_eq!((shown[3].content.as_str(), shown[4].content.as_str()), ("21", "9"));
    // Without the tool role: one user message holding both results, by name.
    let shown = history(&conversation(), None, false);
    let roles: Vec<&str> = shown.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "user"]);
    let result = |content: &str| json!({"tool_result": {"name": "get_weather", "content": content}}).to_string();
    assert_eq!(shown[2].content, format!("{}\n{}", result("21"), result("9")));
    // A system message of the client's keeps its text, the tools after it.
    let mut with_system = vec![msg("system", "Be brief.")];
    with_system.extend(conversation());
    let shown = history(&with_system, Some(&tools), true);
    assert_eq!(shown[0].content, format!("Be brief.\n\n{}", tools.instructions()));
}

#[test]
fn a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn() {
    let src = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}\
               [{{ m.role }}] {{ m.content }}\n{% endfor %}";
    let t = ChatTemplate::new(src, String::new(), String::new()).unwrap();
    let tools = tools_of(json!({"tools": [weather()]})).unwrap().unwrap();
    let p = render(&t, &[msg("user", "Hi")], Some(&tools), &RenderOptions::default()).unwrap();
    assert_eq!(p, format!("[user] {}\n\nHi\n", tools.instructions()));
    // The client's own system message is not moved: the template's error.
    let e = render(&t, &[msg("system", "x"), msg("user", "Hi")], Some(&tools), &RenderOptions::default()).unwrap_err();
    assert!(e.message.contains("no system role"), "{}", e.message);
}

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/smollm2-135m-instruct/tokenizer.json");
        Tokenizer::from_json_file(&p).expect("tokenizer.json loads")
    })
}

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(tokenizer(), tokenizer().vocab_size()).expect("the vocabulary takes grammars"))
}

/// The answer under `spec` when the "model" ranks tokens at random (a
/// xorshift stream), within `max` tokens; whether it ended by itself.
fn walk(spec: &Spec, seed: u64, max: usize) -> (String, bool) {
    let t = tokenizer();
    let mut guide = grammars().compile(spec).expect("the tools' grammar compiles").guide();
    let mut state = seed * 2 + 1;
    let mut ids = Vec::new();
    for _ in 0..max {
        let mut logits: Vec<f32> = (0..t.vocab_size())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32
            })
            .collect();
        guide.mask(&mut logits).expect("a token is allowed");
        let next = argmax_logits(&logits);
        if t.is_eog(next) {
            return (t.decode(&ids).unwrap(), true);
        }
        ids.push(next);
        if guide.commit(next).expect("an allowed token commits") {
            return (t.decode(&ids).unwrap(), true);
        }
    }
    (t.decode(&ids).unwrap(), false)
}

fn read_back(text: &str) -> (String, Finish) {
    let mut r = ReplySplitter::new();
    let streamed = r.push(text).content;
    (streamed, r.finish())
}

/// A call of `weather()` or `add()` with arguments in its schema.
fn check_call(name: &str, args: &str) {
    let a: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{args}: {e}"));
    match name {
        "get_weather" => {
            assert!(a["city"].as_str().is_some_and(|c| c.chars().count() <= 12), "{args}");
            assert!(["c", "f"].contains(&a["unit"].as_str().unwrap_or_default()), "{args}");
            assert_eq!(a.as_object().unwrap().len(), 2, "{args}");
        }
        "add" => {
            for k in ["a", "b"] {
                assert!(a[k].as_u64().is_some_and(|n| n <= 9), "{args}");
            }
        }
        other => panic!("a call of {other}, which is not a tool"),
    }
}

#[test]
fn required_calls_are_of_the_tools_with_arguments_in_their_schemas() {
    let tools = tools_of(json!({"tools": [weather(), add()], "tool_choice": "required"})).unwrap().unwrap();
    let mut names = std::collections::HashSet::new();
    for seed in 1..=12 {
        let (text, done) = walk(&tools.spec(), seed, 400);
        assert!(done, "{text}");
        let (streamed, fin) = read_back(&text);
        assert!(streamed.is_empty() && fin.content.is_empty() && !fin.calls.is_empty(), "{text}");
        for c in &fin.calls {
            check_call(&c.name, &c.arguments);
            names.insert(c.name.clone());
        }
    }
    assert_eq!(names.len(), 2, "random logits should reach both tools: {names:?}");
}

#[test]
fn a_named_choice_or_no_parallel_calls_gives_one_call() {
    let named = json!({"tools": [weather(), add()], "tool_choice": {"type": "function", "function": {"name": "add"}}});
    let serial = json!({"tools": [weather(), add()], "tool_choice": "required", "parallel_tool_calls": false});
    for (body, only_add) in [(named, true), (serial, false)] {
        let spec = tools_of(body).unwrap().unwrap().spec();
        for seed in 1..=6 {
            let (text, done) = walk(&spec, seed, 400);
            let fin = read_back(&text).1;
            assert!(done && fin.calls.len() == 1, "{text}");
            assert!(!only_add || fin.calls[0].name == "add", "{text}");
            check_call(&fin.calls[0].name, &fin.calls[0].arguments);
        }
    }
}

#[test]
fn auto_answers_are_calls_or_a_reply() {
    let spec = tools_of(json!({"tools": [weather(), add()]})).unwrap().unwrap().spec();
    let (mut calls, mut replies) = (0, 0);
    for seed in 1..=16 {
        let (text, done) = walk(&spec, seed, 120);
        let (streamed, fin) = read_back(&text);
        if text.starts_with("{\"response\": \"") {
            replies += 1;
            // A reply's string is streamed, nothing is left for the end.
            assert!(fin.calls.is_empty() && fin.content.is_empty(), "{text}");
            let whole: Value = if done { serde_json::from_str(&text).unwrap() } else { json!({"response": streamed}) };
            assert!(whole["response"].as_str().unwrap().starts_with(&streamed), "{text}");
        } else {
            calls += 1;
            assert!(done && !fin.calls.is_empty(), "{text}");
            fin.calls.iter().for_each(|c| check_call(&c.name, &c.arguments));
        }
    }
    assert!(calls > 0 && replies > 0, "both branches should be reached: {calls} calls, {replies} replies");
}

#[test]
fn a_schema_the_grammar_cannot_take_is_an_error() {
    let bad = json!({"tools": [{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}, "required": ["x"]}}}]});
    let spec = tools_of(bad).unwrap().unwrap().spec();
    assert!(grammars().compile(&spec).is_err());
}

#[test]
fn compact_json_has_the_grammars_separators() {
    assert_eq!(compact(&json!({"a": [1, "x"], "b": {"c": null}})), r#"{"a": [1, "x"], "b": {"c": null}}"#);
}
