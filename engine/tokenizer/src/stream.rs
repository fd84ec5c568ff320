//! Incremental detokenisation for streaming output.

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
