//! What the server tests share: a `spinfer serve` child on a loopback
//! port, raw HTTP, the `openai` client script, `spinfer generate`.

#![allow(dead_code, reason = "each test binary uses a part of these helpers")]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub const KEY: &str = "sk-spinfer-test";

/// A `spinfer serve` child; SIGTERM on drop.
pub struct Served {
    pub child: Child,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl Served {
    pub fn start(model: &Path, server: &str, model_extra: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("spinfer.toml");
        let text = format!(
            "[model]\npath = {:?}\nthreads = 2\n{model_extra}\n[server]\nport = 0\n{server}\n",
            model.to_str().unwrap()
        );
        std::fs::write(&config, text).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_spinfer"))
            .args(["serve", "--config", config.to_str().unwrap()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.trim().rsplit("http://").next().unwrap().to_string();
        assert!(addr.contains(':'), "no address in {line:?}");
        Self { child, addr, _dir: dir }
    }

    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then the exit status (within `limit`).
    pub fn terminate(&mut self, limit: Duration) -> std::process::ExitStatus {
        let ok = Command::new("kill").args(["-TERM", &self.pid().to_string()]).status().unwrap();
        assert!(ok.success());
        self.terminate_wait(limit)
    }

    /// The exit status, within `limit`.
    pub fn terminate_wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(t.elapsed() < limit, "the server did not exit within {limit:?} of SIGTERM");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One HTTP/1.1 request on a fresh connection: (status, body).
pub fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head") + 4;
    let head = String::from_utf8_lossy(&raw[..head_end]).to_string();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = raw[head_end..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(std::str::from_utf8(&b[..i]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + n]);
        b = &b[i + 2 + n + 2..];
    }
    out
}

pub fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let auth = format!("Bearer {KEY}");
    let (st, b) = http(
        addr,
        "POST",
        path,
        &[("Authorization", &auth), ("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    );
    (st, serde_json::from_slice(&b).unwrap_or(Value::Null))
}

/// The text of a completion, whole or streamed (SSE assembled).
pub fn complete(addr: &str, prompt: &str, max_tokens: usize, stream: bool) -> String {
    let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream});
    let auth = format!("Bearer {KEY}");
    let (st, b) = http(addr, "POST", "/v1/completions", &[("Authorization", &auth)], body.to_string().as_bytes());
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    if !stream {
        let v: Value = serde_json::from_slice(&b).unwrap();
        return v["choices"][0]["text"].as_str().unwrap().to_string();
    }
    let text = String::from_utf8(b).unwrap();
    let mut out = String::new();
    let mut done = false;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
    }
    assert!(done, "the stream did not end with [DONE]: {text}");
    out
}

pub fn python_checks(mode: &str, served: &Served, expect: &Value) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("expect.json");
    std::fs::write(&path, expect.to_string()).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/server/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .args([mode, &served.url(), path.to_str().unwrap()])
        .output()
        .expect("python3 (scripts/test.sh installs the openai client)");
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "openai client checks failed:\n{so}\n{se}");
    eprintln!("{so}");
}

pub fn cli_generate(model: &Path, prompt: &str, n: usize) -> Value {
    cli_generate_with(model, prompt, n, &[])
}

/// `spinfer generate --temp 0 --json` with `extra` flags, which must succeed.
pub fn cli_generate_with(model: &Path, prompt: &str, n: usize, extra: &[&str]) -> Value {
    let out = cli_run(model, prompt, n, extra);
    assert!(out.status.success(), "{extra:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `spinfer generate --temp 0 --json` with `extra` flags, as it ends.
pub fn cli_run(model: &Path, prompt: &str, n: usize, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_spinfer"))
        .args(["generate", "-m", model.to_str().unwrap(), "-p", prompt, "-n", &n.to_string()])
        .args(["--temp", "0", "-t", "2", "-c", "1024", "--json"])
        .args(extra)
        .output()
        .unwrap()
}

/// A one-message chat as the server renders it with the model's template
/// (for SmolLM2, which adds no BOS: the CLI then runs the same tokens).
pub fn render_chat(model: &Path, question: &str) -> String {
    let msg = spinfer_server::chat::Message { role: "user".into(), content: question.into() };
    let (template, engine) = chat_template(model);
    let rendered = template.render(&[msg]).unwrap();
    assert!(
        !spinfer_server::chat::add_bos(&engine.tokenizer, &rendered),
        "SmolLM2 adds no BOS: a CLI run would differ"
    );
    rendered
}

/// The model's chat template as the server compiles it, and the model.
pub fn chat_template(model: &Path) -> (spinfer_server::chat::ChatTemplate, spinfer_engine::Engine) {
    let engine = spinfer_engine::Engine::load(model, Default::default()).unwrap();
    let template = spinfer_server::chat::ChatTemplate::for_engine(&engine, None).unwrap().expect("a chat template");
    (template, engine)
}

/// A metric's value from `/metrics` (NaN when absent).
pub fn metric(addr: &str, name: &str) -> f64 {
    let (_, m) = http(addr, "GET", "/metrics", &[], b"");
    let m = String::from_utf8(m).unwrap();
    m.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok())).unwrap_or(f64::NAN)
}
