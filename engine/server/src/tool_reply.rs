//! A tool-calling answer read back ([`crate::tools`] holds the model to
//! it): `{"response": "..."}` becomes the message's content, streamed as
//! the string's characters arrive; `{"tool_calls": [...]}` becomes
//! OpenAI's `tool_calls`, once the answer is whole. An answer cut short
//! (`max_tokens`) that is no longer JSON is given as it is, as content.

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
    /// The calls; none for a reply.
    pub calls: Vec<Call>,
}

#[derive(Debug)]
enum State {
    /// Too little text to tell a reply from calls.
    Undecided,
    /// Inside the reply's string: decoded up to byte `at` of the text.
    Reply { at: usize, closed: bool },
    /// Calls (or text that is neither): read when whole.
    Calls,
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
    /// completes (empty while calls are read or an escape is cut).
    pub fn push(&mut self, piece: &str) -> String {
        self.text.push_str(piece);
        if let State::Undecided = self.state {
            if self.text.starts_with(REPLY) {
                self.state = State::Reply { at: REPLY.len(), closed: false };
            } else if !REPLY.starts_with(self.text.as_str()) {
                self.state = State::Calls;
            }
        }
        match &mut self.state {
            State::Reply { at, closed } if !*closed => {
                let (out, used, end) = unescape(&self.text[*at..]);
                *at += used;
                *closed = end;
                out
            }
            _ => String::new(),
        }
    }

    /// The answer is whole: the calls, or what content is left.
    pub fn finish(self) -> Finish {
        match self.state {
            State::Reply { .. } => Finish::default(),
            State::Undecided => Finish { content: self.text, calls: Vec::new() },
            State::Calls => match calls(&self.text) {
                Some(calls) => Finish { content: String::new(), calls },
                None => Finish { content: self.text, calls: Vec::new() },
            },
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
        let mut s = ReplySplitter::new();
        let mut streamed = String::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut k = n.min(rest.len());
            while !rest.is_char_boundary(k) {
                k += 1;
            }
            streamed.push_str(&s.push(&rest[..k]));
            rest = &rest[k..];
        }
        (streamed, s.finish())
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
    fn calls_are_read_when_whole_with_fresh_ids() {
        let text = r#"{"tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]}"#;
        for n in [1, 7, text.len()] {
            let (streamed, fin) = split(text, n);
            assert_eq!(streamed, "");
            let got: Vec<(&str, &str)> = fin.calls.iter().map(|c| (c.name.as_str(), c.arguments.as_str())).collect();
            assert_eq!(got, [("f", r#"{"a":1}"#), ("g", "{}")]);
            assert!(fin.calls.iter().all(|c| c.id.len() == 29 && c.id.starts_with("call_")));
            assert_ne!(fin.calls[0].id, fin.calls[1].id);
        }
    }

    #[test]
    fn an_answer_cut_short_is_given_as_it_is() {
        let (s, fin) = split(r#"{"tool_calls": [{"name": "f", "argu"#, 3);
        assert_eq!(
            (s.as_str(), fin.content.as_str(), fin.calls.len()),
            ("", r#"{"tool_calls": [{"name": "f", "argu"#, 0)
        );
        let (s, fin) = split(r#"{"respo"#, 2);
        assert_eq!((s.as_str(), fin.content.as_str()), ("", r#"{"respo"#));
        let (s, fin) = split(r#"{"response": "half \u00"#, 4);
        assert_eq!((s.as_str(), fin), ("half ", Finish::default()));
        // A lone surrogate is U+FFFD.
        assert_eq!(split(r#"{"response": "\ud800x\ud800\u0041"}"#, 5).0, "\u{FFFD}x\u{FFFD}A");
        assert_eq!(split(r#"{"response": "\ud800"}"#, 1).0, "\u{FFFD}");
    }
}
