//! A tool-calling answer read back ([`crate::tools`] holds the model to
//! it): `{"response": "..."}` becomes the message's content, streamed as
//! the string's characters arrive; `{"tool_calls": [...]}` becomes
//! OpenAI's `tool_calls`, streamed as OpenAI streams them (a call's id and
//! name once its name is whole, then its arguments' JSON text as it
//! comes). A whole answer's calls carry their arguments as the model wrote
//! them. An answer cut short (`max_tokens`) that is no longer JSON is given
//! as it is, as content (a stream that began its calls ends them there).

use rand::Rng;
use serde_json::{Value, json};

/// How a reply starts (the grammar writes exactly this).
const REPLY: &str = "{\"response\": \"";

/// A call the model made, as OpenAI lists it.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

impl Call {
    /// OpenAI's `{"id", "type": "function", "function": {name, arguments}}`.
    pub fn to_json(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// What is left once the answer is whole.
#[derive(Debug, Default, PartialEq)]
pub struct Finish {
    /// Content not yet given.
    pub content: String,
    /// The calls, when the answer is whole calls; none for a reply.
    pub calls: Vec<Call>,
    /// Calls were begun in [`Pushed::calls`] (a stream has sent them, and
    /// sends no content after them).
    pub streamed: bool,
}

/// What one piece of the answer completes.
#[derive(Debug, Default, PartialEq)]
pub struct Pushed {
    /// A reply's text.
    pub content: String,
    /// Calls begun and their arguments' text.
    pub calls: Vec<CallDelta>,
}

/// A call as it streams: OpenAI's `delta.tool_calls[]` entries.
#[derive(Clone, Debug, PartialEq)]
pub enum CallDelta {
    /// Call `index` begins: its id and name, no arguments yet.
    Start { index: usize, id: String, name: String },
    /// More of call `index`'s arguments.
    Arguments { index: usize, text: String },
}

impl CallDelta {
    pub fn to_json(&self) -> Value {
        match self {
            Self::Start { index, id, name } => {
                json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}})
            }
            Self::Arguments { index, text } => json!({"index": index, "function": {"arguments": text}}),
        }
    }
}

#[derive(Debug)]
enum State {
    /// Too little text to tell a reply from calls.
    Undecided,
    /// Inside the reply's string: decoded up to byte `at` of the text.
    Reply { at: usize, closed: bool },
    /// Calls (or text that is neither).
    Calls(CallReader),
}

/// How calls open, as the grammar writes them.
const CALLS: &str = "{\"tool_calls\": [";
const NAME: &str = "{\"name\": \"";
const ARGUMENTS: &str = "\", \"arguments\": ";

/// Reads `{"tool_calls": [{"name": "...", "arguments": {...}}, ...]}` as
/// it comes, in the grammar's compact layout.
#[derive(Debug, Default)]
struct CallReader {
    /// Bytes of the text read.
    at: usize,
    part: Part,
    calls: Vec<Call>,
}

#[derive(Debug, Default, PartialEq)]
enum Part {
    /// Before `{"tool_calls": [`.
    #[default]
    Open,
    /// Before a call's `{"name": "NAME", "arguments": `.
    Head,
    /// In a call's arguments: nesting depth, inside a string, after a `\`.
    Arguments { depth: usize, string: bool, escaped: bool },
    /// After a call's arguments: `}` and `, ` or `]}`.
    Tail,
    /// The calls are whole.
    Done,
    /// Not the grammar's layout: read whole at the end.
    Other,
}

impl CallReader {
    /// Reads what `text` adds past `self.at`.
    fn read(&mut self, text: &str, out: &mut Vec<CallDelta>) {
        loop {
            let rest = &text[self.at..];
            let expect = |lit: &str| {
                if rest.starts_with(lit) {
                    Some(true)
                } else if lit.starts_with(rest) {
                    None // wait for more
                } else {
                    Some(false)
                }
            };
            match self.part {
                Part::Open => match expect(CALLS) {
                    Some(true) => (self.at, self.part) = (self.at + CALLS.len(), Part::Head),
                    Some(false) => self.part = Part::Other,
                    None => return,
                },
                Part::Head => {
                    match expect(NAME) {
                        Some(true) => {}
                        Some(false) => {
                            self.part = Part::Other;
                            continue;
                        }
                        None => return,
                    }
                    // Tool names are letters, digits, `_` and `-`: no escapes.
                    let Some(end) = rest[NAME.len()..].find('"') else { return };
                    let after = &rest[NAME.len() + end..];
                    if !after.starts_with(ARGUMENTS) {
                        if ARGUMENTS.starts_with(after) {
                            return; // wait for more
                        }
                        self.part = Part::Other;
                        continue;
                    }
                    let name = rest[NAME.len()..NAME.len() + end].to_string();
                    let index = self.calls.len();
                    let id = call_id();
                    out.push(CallDelta::Start { index, id: id.clone(), name: name.clone() });
                    self.calls.push(Call { id, name, arguments: String::new() });
                    self.at += NAME.len() + end + ARGUMENTS.len();
                    self.part = Part::Arguments { depth: 0, string: false, escaped: false };
                }
                Part::Arguments { mut depth, mut string, mut escaped } => {
                    let mut used = 0;
                    let mut whole = false;
                    for c in rest.chars() {
                        used += c.len_utf8();
                        match (string, escaped, c) {
                            (true, true, _) => escaped = false,
                            (true, false, '\\') => escaped = true,
                            (true, false, '"') => string = false,
                            (true, false, _) => {}
                            (false, _, '"') => string = true,
                            (false, _, '{' | '[') => depth += 1,
                            (false, _, '}' | ']') => depth = depth.saturating_sub(1),
                            _ => {}
                        }
                        if depth == 0 && !string {
                            whole = true;
                            break;
                        }
                    }
                    if used > 0 {
                        let piece = rest[..used].to_string();
                        let index = self.calls.len() - 1;
                        self.calls[index].arguments.push_str(&piece);
                        out.push(CallDelta::Arguments { index, text: piece });
                        self.at += used;
                    }
                    if whole {
                        self.part = Part::Tail;
                    } else {
                        self.part = Part::Arguments { depth, string, escaped };
                        return;
                    }
                }
                Part::Tail => {
                    if let Some((lit, next)) =
                        [("}, ", Part::Head), ("}]}", Part::Done)].into_iter().find(|(lit, _)| rest.starts_with(lit))
                    {
                        (self.at, self.part) = (self.at + lit.len(), next);
                    } else if "}, ".starts_with(rest) || "}]}".starts_with(rest) {
                        return; // wait for more
                    } else {
                        self.part = Part::Other;
                    }
                }
                Part::Done => {
                    if !rest.is_empty() {
                        self.part = Part::Other;
                    }
                    return;
                }
                Part::Other => return,
            }
        }
    }
}

/// Reads one answer's text piece by piece.
#[derive(Debug)]
pub struct ReplySplitter {
    text: String,
    state: State,
}

impl Default for ReplySplitter {
    fn default() -> Self {
        Self::new()
    }
}

impl ReplySplitter {
    pub fn new() -> Self {
        Self { text: String::new(), state: State::Undecided }
    }

    /// Takes the next piece of the answer; returns the content it
    /// completes (empty while calls are read or an escape is cut) and the
    /// calls' deltas.
    pub fn push(&mut self, piece: &str) -> Pushed {
        self.text.push_str(piece);
        if let State::Undecided = self.state {
            if self.text.starts_with(REPLY) {
                self.state = State::Reply { at: REPLY.len(), closed: false };
            } else if !REPLY.starts_with(self.text.as_str()) {
                self.state = State::Calls(CallReader::default());
            }
        }
        let mut out = Pushed::default();
        match &mut self.state {
            State::Reply { at, closed } if !*closed => {
                let (text, used, end) = unescape(&self.text[*at..]);
                *at += used;
                *closed = end;
                out.content = text;
            }
            State::Calls(reader) => reader.read(&self.text, &mut out.calls),
            _ => {}
        }
        out
    }

    /// The answer is whole: the calls, or what content is left.
    pub fn finish(self) -> Finish {
        match self.state {
            State::Reply { .. } => Finish::default(),
            State::Undecided => Finish { content: self.text, ..Finish::default() },
            State::Calls(reader) => {
                let streamed = !reader.calls.is_empty();
                if reader.part == Part::Done {
                    return Finish { content: String::new(), calls: reader.calls, streamed };
                }
                match calls(&self.text).filter(|_| !streamed) {
                    Some(calls) => Finish { content: String::new(), calls, streamed },
                    None => Finish { content: self.text, calls: Vec::new(), streamed },
                }
            }
        }
    }
}

/// `{"tool_calls": [{"name", "arguments"}, ...]}` read into calls, each
/// with a fresh id; `None` for anything else.
fn calls(text: &str) -> Option<Vec<Call>> {
    let v: Value = serde_json::from_str(text).ok()?;
    let list = v.get("tool_calls")?.as_array()?;
    list.iter()
        .map(|c| {
            let name = c.get("name")?.as_str()?.to_string();
            let arguments = c.get("arguments")?.to_string();
            Some(Call { id: call_id(), name, arguments })
        })
        .collect::<Option<Vec<_>>>()
        .filter(|c| !c.is_empty())
}

/// `call_` and 24 random letters and digits, as OpenAI's ids look.
fn call_id() -> String {
    let mut rng = rand::rng();
    let tail: String = (0..24).map(|_| rng.sample(rand::distr::Alphanumeric) as char).collect();
    format!("call_{tail}")
}

/// Decodes a JSON string's body from the start of `s`: the text, the
/// bytes used, and whether the closing quote was reached. Stops before an
/// escape that is not whole yet.
fn unescape(s: &str) -> (String, usize, bool) {
    let mut out = String::new();
    let mut used = 0;
    let mut rest = s;
    loop {
        let Some(c) = rest.chars().next() else { return (out, used, false) };
        let n = match c {
            '"' => return (out, used + 1, true),
            '\\' => match escape(rest) {
                Some((ch, n)) => {
                    out.push(ch);
                    n
                }
                None => return (out, used, false),
            },
            c => {
                out.push(c);
                c.len_utf8()
            }
        };
        used += n;
        rest = &rest[n..];
    }
}

/// One escape at the start of `s` (which starts with `\`): the character
/// and its length, `None` when it is not whole yet. A lone surrogate
/// becomes U+FFFD.
fn escape(s: &str) -> Option<(char, usize)> {
    let b = s.as_bytes();
    let simple = match *b.get(1)? {
        b'n' => '\n',
        b't' => '\t',
        b'r' => '\r',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'u' => return unicode(s),
        other => other as char,
    };
    Some((simple, 2))
}

fn unicode(s: &str) -> Option<(char, usize)> {
    let hex = |at: usize| s.get(at..at + 4).and_then(|h| u32::from_str_radix(h, 16).ok());
    let hi = hex(2)?;
    if !(0xD800..0xDC00).contains(&hi) {
        return Some((char::from_u32(hi).unwrap_or('\u{FFFD}'), 6));
    }
    // A high surrogate: its pair follows, or it is lone.
    let pair_so_far = s.as_bytes()[6..s.len().min(12)].iter().enumerate().all(|(i, &c)| match i {
        0 => c == b'\\',
        1 => c == b'u',
        _ => c.is_ascii_hexdigit(),
    });
    if pair_so_far && s.len() < 12 {
        return None;
    }
    match (s.get(6..8), hex(8)) {
        (Some("\\u"), Some(lo)) if (0xDC00..0xE000).contains(&lo) => {
            let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
            Some((char::from_u32(c).unwrap_or('\u{FFFD}'), 12))
        }
        _ => Some(('\u{FFFD}', 6)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `n` bytes (on character boundaries).
    fn split(text: &str, n: usize) -> (String, Finish) {
        let (streamed, _, fin) = split_calls(text, n);
        (streamed, fin)
    }

    /// [`split`], with the call deltas streamed.
    fn split_calls(text: &str, n: usize) -> (String, Vec<CallDelta>, Finish) {
        let mut s = ReplySplitter::new();
        let (mut streamed, mut deltas) = (String::new(), Vec::new());
        let mut rest = text;
        while !rest.is_empty() {
            let mut k = n.min(rest.len());
            while !rest.is_char_boundary(k) {
                k += 1;
            }
            let p = s.push(&rest[..k]);
            streamed.push_str(&p.content);
            deltas.extend(p.calls);
            rest = &rest[k..];
        }
        (streamed, deltas, s.finish())
    }

    /// Each call's name and its arguments' streamed text, put together.
    fn assembled(deltas: &[CallDelta]) -> Vec<(String, String, String)> {
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for d in deltas {
            match d {
                CallDelta::Start { index, id, name } => {
                    assert_eq!(*index, calls.len());
                    calls.push((id.clone(), name.clone(), String::new()));
                }
                CallDelta::Arguments { index, text } => calls[*index].2.push_str(text),
            }
        }
        calls
    }

    #[test]
    fn a_reply_streams_its_decoded_string_in_any_pieces() {
        let text = r#"{"response": "Hi \"you\"\n\u00e9\ud83d\ude00 \\ done"}"#;
        for n in 1..=text.len() {
            let (streamed, fin) = split(text, n);
            assert_eq!(streamed, "Hi \"you\"\né😀 \\ done", "pieces of {n}");
            assert_eq!(fin, Finish::default());
        }
    }

    #[test]
    fn calls_stream_as_they_come_with_fresh_ids() {
        let text = r#"{"tool_calls": [{"name": "f", "arguments": {"a": "}]\"{", "b": [1, {"c": 2}]}}, {"name": "g-2", "arguments": {}}]}"#;
        for n in 1..=text.len() {
            let (streamed, deltas, fin) = split_calls(text, n);
            assert_eq!(streamed, "");
            let got: Vec<(&str, &str)> = fin.calls.iter().map(|c| (c.name.as_str(), c.arguments.as_str())).collect();
            assert_eq!(got, [("f", r#"{"a": "}]\"{", "b": [1, {"c": 2}]}"#), ("g-2", "{}")], "pieces of {n}");
            assert!(fin.calls.iter().all(|c| c.id.len() == 29 && c.id.starts_with("call_")));
            assert_ne!(fin.calls[0].id, fin.calls[1].id);
            assert!(fin.streamed && fin.content.is_empty());
            // The deltas put together are the calls, ids included.
            let whole: Vec<_> = fin.calls.iter().map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone())).collect();
            assert_eq!(assembled(&deltas), whole, "pieces of {n}");
        }
        // A call's arguments come out before the call is whole.
        let (_, deltas, _) = split_calls(r#"{"tool_calls": [{"name": "f", "arguments": {"a": 1"#, 4);
        assert_eq!(assembled(&deltas)[0].2, r#"{"a": 1"#);
    }

    #[test]
    fn calls_in_another_layout_are_read_when_whole() {
        let text = r#"{"tool_calls":[{"name":"f","arguments":{"a":1}}]}"#;
        let (_, deltas, fin) = split_calls(text, 3);
        assert!(deltas.is_empty() && !fin.streamed);
        assert_eq!((fin.calls[0].name.as_str(), fin.calls[0].arguments.as_str()), ("f", r#"{"a":1}"#));
    }

    #[test]
    fn an_answer_cut_short_is_given_as_it_is() {
        let (s, fin) = split(r#"{"tool_calls": [{"name": "f", "argu"#, 3);
        assert_eq!(
            (s.as_str(), fin.content.as_str(), fin.calls.len(), fin.streamed),
            ("", r#"{"tool_calls": [{"name": "f", "argu"#, 0, false)
        );
        // Cut inside a call's arguments: the stream has begun the call.
        let (_, deltas, fin) = split_calls(r#"{"tool_calls": [{"name": "f", "arguments": {"a"#, 5);
        assert!(fin.streamed && fin.calls.is_empty() && assembled(&deltas)[0].2 == r#"{"a"#);
        let (s, fin) = split(r#"{"respo"#, 2);
        assert_eq!((s.as_str(), fin.content.as_str()), ("", r#"{"respo"#));
        let (s, fin) = split(r#"{"response": "half \u00"#, 4);
        assert_eq!((s.as_str(), fin), ("half ", Finish::default()));
        // A lone surrogate is U+FFFD.
        assert_eq!(split(r#"{"response": "\ud800x\ud800\u0041"}"#, 5).0, "\u{FFFD}x\u{FFFD}A");
        assert_eq!(split(r#"{"response": "\ud800"}"#, 1).0, "\u{FFFD}");
    }
}
