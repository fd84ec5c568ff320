//! `spinfer chat` on SmolLM2: each turn's answer is what `spinfer generate
//! --temp 0` gives for the conversation rendered with the model's template
//! (so the cache carried between turns changes nothing), the cache serves
//! the earlier turns, `/reset` and `--system` do what they say, and a model
//! without a template, or a conversation past the context, is an error
//! that says what to do; a template given as a file serves `chat` and the
//! server alike.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use serde_json::{Value, json};
use spinfer_server::chat::Message;

mod support;

use support::{Served, chat_template, cli_generate, post};

fn chat(model: &Path, input: &str, extra: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_spinfer"))
        .args(["chat", "-m", model.to_str().unwrap(), "--temp", "0", "-n", "40", "-t", "2", "--json"])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The turns of a `--json` chat: one object per line.
fn turns(out: &Output) -> Vec<Value> {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn msg(role: &str, content: &str) -> Message {
    Message { role: role.into(), content: content.into() }
}

#[test]
fn each_turn_answers_as_generate_does_for_the_conversation_so_far() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let (template, _) = chat_template(&model);
    let want = |conversation: &[Message]| {
        let prompt = template.render(conversation).unwrap();
        cli_generate(&model, &prompt, 40)["text"].as_str().unwrap().to_string()
    };
    let (q1, q2, q3) = ("What is the capital of France?", "And of Italy?", "Name a colour.");
    let t = turns(&chat(&model, &format!("{q1}\n\n{q2}\n/reset\n{q3}\n"), &[]));
    assert_eq!(t.len(), 3, "{t:?}");
    let a1 = t[0]["assistant"].as_str().unwrap();
    assert_eq!(a1, want(&[msg("user", q1)]));
    let a2 = t[1]["assistant"].as_str().unwrap();
    assert_eq!(a2, want(&[msg("user", q1), msg("assistant", a1), msg("user", q2)]));
    // The second turn reads only what follows the first's prompt and answer.
    let first_len = t[0]["prompt_tokens"].as_u64().unwrap() + t[0]["completion_tokens"].as_u64().unwrap();
    assert!(t[1]["cached_tokens"].as_u64().unwrap() >= first_len - 1, "{t:?}");
    assert_eq!(t[2]["assistant"].as_str().unwrap(), want(&[msg("user", q3)]), "/reset starts again");

    let sys = "You answer in one word.";
    let t = turns(&chat(&model, &format!("{q1}\n"), &["--system", sys]));
    assert_eq!(t[0]["assistant"].as_str().unwrap(), want(&[msg("system", sys), msg("user", q1)]));
    // A line ending in `\` goes on on the next: one turn of two lines.
    let t = turns(&chat(&model, &format!("{q1}\\\n{q2}\n"), &[]));
    let two = format!("{q1}\n{q2}");
    assert_eq!((t.len(), t[0]["user"].as_str().unwrap()), (1, two.as_str()));
    assert_eq!(t[0]["assistant"].as_str().unwrap(), want(&[msg("user", &two)]));
}

/// Drafts from the conversation's n-grams (`--draft-max`) change no turn,
/// and the cache they leave serves the next turn as decoding one token at
/// a time does.
#[test]
fn drafts_change_no_turn() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let input = "Repeat this sentence: the quick brown fox jumps over the lazy dog.\nNow write it again in capitals.\n";
    let plain = turns(&chat(&model, input, &[]));
    let drafted = turns(&chat(&model, input, &["--draft-max", "4"]));
    assert_eq!(plain.len(), 2);
    for (a, b) in plain.iter().zip(&drafted) {
        for key in ["assistant", "prompt_tokens", "cached_tokens", "completion_tokens", "stop_reason"] {
            assert_eq!(a[key], b[key], "{key}: {a} vs {b}");
        }
    }
    let accepted: u64 = drafted.iter().map(|t| t["draft"]["accepted"].as_u64().unwrap()).sum();
    assert!(accepted > 10, "{drafted:?}");
    assert!(plain.iter().all(|t| t["draft"]["drafted"] == 0), "{plain:?}");
}

#[test]
fn what_cannot_run_says_what_to_do() {
    let Some(model) = spinfer_test_support::smollm2() else { return };
    let long = "word ".repeat(200);
    let out = chat(&model, &format!("{long}\n"), &["-c", "64"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("context") && err.contains("/reset"), "{err}");

    let Some(gemma) = spinfer_test_support::gemma3() else { return };
    let out = chat(&gemma, "Hi\n", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--chat-template-file"), "{err}");
    // Its own turn format, given as a file: the base model answers something.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gemma.jinja");
    let src = "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n\
               {{ m.content }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n";
    std::fs::write(&file, src).unwrap();
    let t = turns(&chat(&gemma, "Hi\n", &["--chat-template-file", file.to_str().unwrap()]));
    assert_eq!(t.len(), 1);
    assert!(t[0]["completion_tokens"].as_u64().unwrap() > 0, "{t:?}");
    // The server's `[server] chat_template_file`: the same answer.
    let served = Served::start(&gemma, &format!("chat_template_file = {:?}", file.to_str().unwrap()), "");
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "temperature": 0});
    let (st, v) = post(&served.addr, "/v1/chat/completions", &body);
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], t[0]["assistant"]);
}
