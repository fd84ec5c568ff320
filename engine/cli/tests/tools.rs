//! Tool calling on SmolLM2: the server's calls are what `spinfer generate`
//! writes for the prompt with the tools' instructions under the tools'
//! grammar, alone and batched with other requests; `tool_choice: "none"`
//! answers as if no tools were given; bad tool fields are 400s naming
//! them; the official `openai` client reads calls (whole, streamed, and
//! through its pydantic function tools) and sends the results back.

use serde_json::{Value, json};
use spinfer_engine::grammar::Spec;
use spinfer_server::tools::{self, ChatMessage};

mod support;

use support::{Served, chat_template, cli_generate_with, post, python_checks};

fn tool_list() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 32},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "add", "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]}}}
    ])
}

const QUESTION: &str = "What is 17 plus 25?";

fn request(choice: Value, question: &str) -> Value {
    json!({"messages": [{"role": "user", "content": question}], "tools": tool_list(), "tool_choice": choice,
           "parallel_tool_calls": false, "temperature": 0, "max_tokens": 48})
}

/// `(name, arguments)` of a chat answer's calls.
fn calls_of(answer: &Value) -> Vec<(String, Value)> {
    let calls = answer["choices"][0]["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
    calls
        .iter()
        .map(|c| {
            let f = &c["function"];
            let args = serde_json::from_str(f["arguments"].as_str().unwrap()).unwrap();
            (f["name"].as_str().unwrap().to_string(), args)
        })
        .collect()
}

#[test]
fn the_server_calls_tools_as_generate_does_under_their_grammar() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    // What the server runs, built with its library: the chat with the
    // tools' instructions, and their grammar, given to `spinfer generate`.
    let body = request(json!("required"), QUESTION);
    let given = tools::read(body.as_object().unwrap()).unwrap().unwrap();
    let (template, _) = chat_template(&model);
    let user = ChatMessage { role: "user".into(), content: QUESTION.into(), tool_calls: vec![], tool_call_id: None };
    let prompt = tools::render(&template, &[user], Some(&given), &Default::default()).unwrap();
    let Spec::Lark(grammar) = given.spec() else { panic!("the tools' grammar is Lark") };
    let dir = tempfile::tempdir().unwrap();
    let grammar_file = dir.path().join("tools.lark");
    std::fs::write(&grammar_file, grammar).unwrap();
    let cli = cli_generate_with(&model, &prompt, 48, &["--grammar-file", grammar_file.to_str().unwrap()]);
    let text = cli["text"].as_str().unwrap();
    let cli_calls: Vec<(String, Value)> = serde_json::from_str::<Value>(text).unwrap_or_else(|e| panic!("{text}: {e}"))
        ["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap().to_string(), c["arguments"].clone()))
        .collect();
    assert_eq!(cli_calls.len(), 1, "one call (parallel_tool_calls: false): {text}");

    let served = Served::start(&model, "slots = 4", "ctx = 1024");
    let addr = served.addr.clone();
    let chat = |body: &Value| {
        let (st, v) = post(&addr, "/v1/chat/completions", body);
        assert_eq!(st, 200, "{body}: {v}");
        v
    };
    let v = chat(&body);
    let choice = &v["choices"][0];
    assert_eq!((choice["finish_reason"].as_str(), &choice["message"]["content"]), (Some("tool_calls"), &Value::Null));
    assert_eq!(calls_of(&v), cli_calls, "{v}");
    let id = choice["message"]["tool_calls"][0]["id"].as_str().unwrap();
    assert!(id.starts_with("call_") && choice["message"]["tool_calls"][0]["type"] == "function", "{v}");

    // `tool_choice: "none"`: the answer without tools.
    let plain = json!({"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 24});
    let mut none = plain.clone();
    none["tools"] = tool_list();
    none["tool_choice"] = json!("none");
    let want = chat(&plain)["choices"][0]["message"].clone();
    assert_eq!(chat(&none)["choices"][0]["message"], want);

    // Batched with each other and a plain request: the same answers.
    let named = request(json!({"type": "function", "function": {"name": "get_weather"}}), "Is it warm in Rome?");
    let auto = request(json!("auto"), "Tell me about Rome.");
    let alone: Vec<(Value, Value)> =
        [body.clone(), named, auto, plain].into_iter().map(|b| (b.clone(), chat(&b)["choices"][0].clone())).collect();
    assert_eq!(alone[1].1["message"]["tool_calls"][0]["function"]["name"], "get_weather", "{}", alone[1].1);
    let strip_ids = |mut c: Value| {
        for call in c["message"]["tool_calls"].as_array_mut().into_iter().flatten() {
            call["id"] = Value::Null;
        }
        c
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = alone
            .iter()
            .map(|(body, want)| {
                let chat = &chat;
                let strip = &strip_ids;
                s.spawn(move || assert_eq!(strip(chat(body)["choices"][0].clone()), strip(want.clone()), "{body}"))
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
    });

    // Bad tool fields are 400s naming them; the server keeps serving.
    let bad_schema = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}]);
    for (key, value, param) in [
        ("tool_choice", json!({"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        ("tools", bad_schema, "tools"),
        ("tools", json!([{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name"),
        ("response_format", json!({"type": "json_object"}), "response_format"),
    ] {
        let mut b = body.clone();
        b[key] = value;
        let (st, e) = post(&addr, "/v1/chat/completions", &b);
        assert_eq!((st, e["error"]["param"].as_str()), (400, Some(param)), "{key}: {e}");
    }
    let bad_history = json!({"messages": [{"role": "tool", "content": "42"}], "max_tokens": 4});
    let (st, e) = post(&addr, "/v1/chat/completions", &bad_history);
    assert_eq!((st, e["error"]["param"].as_str()), (400, Some("messages[0].tool_call_id")), "{e}");
    assert_eq!(calls_of(&chat(&body)), cli_calls);

    let expect = json!({"model": "SmolLM2-135M-Instruct.Q4_1", "question": QUESTION, "tools": tool_list(),
                        "calls": cli_calls.iter().map(|(n, a)| json!([n, a])).collect::<Vec<_>>()});
    python_checks("tools", &served, &expect);
}
