//! Streaming output: incremental detokenisation ([`StreamDecoder`]) and
//! stop strings held back from the stream ([`StopWatcher`]).

use std::ops::ControlFlow;

use super::Tokenizer;
use crate::Result;

/// Feeds token ids one at a time and yields only complete UTF-8 text: the
/// bytes of a character split across tokens are held back until the
/// character is complete. Bytes that can never form a character come out
/// as U+FFFD, as [`Tokenizer::decode`] would give them. Tokens are rendered
/// as they are (a SentencePiece token's leading `▁` is a space).
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(t: &'a Tokenizer) -> Self {
        Self { tok: t, pending: Vec::new() }
    }

    /// The text that `id` completes (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.pending.extend_from_slice(self.tok.bytes_of(id)?);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // `valid_up_to` marks a valid prefix.
                    out.push_str(std::str::from_utf8(&self.pending[start..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Invalid bytes that no later byte can fix.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + bad;
                        }
                        // An incomplete character at the end: wait for more.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        Ok(out)
    }

    /// Whatever is still held back (an unfinished character becomes U+FFFD).
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

/// Why [`StopWatcher::push`] ended the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// A stop string appeared; the text ends before it.
    StopString,
    /// The callback asked to stop.
    Cancelled,
}

/// Accumulates generated text, holding back the tail that could still turn
/// into a stop string, so streamed text never contains one.
pub struct StopWatcher {
    stops: Vec<String>,
    text: String,
    /// Bytes of `text` already handed to the callback.
    emitted: usize,
    hold: usize,
}

impl StopWatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let hold = stops.iter().map(|s| s.len()).max().unwrap_or(0).saturating_sub(1);
        Self { stops, text: String::new(), emitted: 0, hold }
    }

    /// Adds `piece`, handing `on_text` what can no longer become part of a
    /// stop string.
    pub fn push(&mut self, piece: &str, on_text: &mut dyn FnMut(&str) -> ControlFlow<()>) -> Option<Held> {
        self.text.push_str(piece);
        let search_from = self.emitted.saturating_sub(self.hold);
        let hit = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.text[search_from..].find(s.as_str()).map(|i| search_from + i))
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            self.flush(on_text);
            return Some(Held::StopString);
        }
        let mut safe = self.text.len().saturating_sub(self.hold);
        while !self.text.is_char_boundary(safe) {
            safe -= 1;
        }
        if safe > self.emitted {
            let flow = on_text(&self.text[self.emitted..safe]);
            self.emitted = safe;
            if flow.is_break() {
                return Some(Held::Cancelled);
            }
        }
        None
    }

    /// Hands `on_text` the text still held back.
    pub fn flush(&mut self, on_text: &mut dyn FnMut(&str) -> ControlFlow<()>) {
        if self.text.len() > self.emitted {
            let _ = on_text(&self.text[self.emitted..]);
            self.emitted = self.text.len();
        }
    }

    /// All the text so far (a stop string and what followed it cut off).
    pub fn into_text(self) -> String {
        self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, String, Option<Held>) {
        let mut w = StopWatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut streamed = String::new();
        let mut reason = None;
        for p in pieces {
            reason = w.push(p, &mut |s| {
                streamed.push_str(s);
                ControlFlow::Continue(())
            });
            if reason.is_some() {
                break;
            }
        }
        if reason.is_none() {
            w.flush(&mut |s| {
                streamed.push_str(s);
                ControlFlow::Continue(())
            });
        }
        (w.into_text(), streamed, reason)
    }

    #[test]
    fn stop_string_split_across_pieces_is_never_streamed() {
        let (text, streamed, reason) = run(&["\n\nThe"], &[" Paris", ".", "\n", "\n", "The", " answer"]);
        assert_eq!(text, " Paris.");
        assert_eq!(streamed, " Paris.");
        assert_eq!(reason, Some(Held::StopString));
    }

    #[test]
    fn without_stops_everything_streams() {
        let (text, streamed, reason) = run(&[], &["a", "é", "c"]);
        assert_eq!((text.as_str(), streamed.as_str(), reason), ("aéc", "aéc", None));
    }
}
