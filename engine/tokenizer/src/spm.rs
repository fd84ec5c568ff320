//! SentencePiece-style tokenizer as llama.cpp runs it for
//! `tokenizer.ggml.model = "llama"`: spaces become `▁`, a `▁` is put in front
//! of the text (and after each special token) when `add_space_prefix`, the
//! text starts as one symbol per character, and the adjacent pair whose
//! concatenation is the highest-scoring token is merged until none is left.
//! A character with no token falls back to its `<0xNN>` byte tokens (or the
//! unknown token).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::{Table, TextIndex};
use super::{Frag, token_type};

pub(crate) struct Spm {
    token_to_id: TextIndex,
    scores: Vec<f32>,
    byte_ids: [Option<u32>; 256],
    unk: Option<u32>,
    pub(crate) add_space_prefix: bool,
}

/// Parses `<0xNN>`.
pub(crate) fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

const NONE: usize = usize::MAX;

struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

impl Spm {
    pub(crate) fn new(
        tokens: &[&str],
        scores: Vec<f32>,
        types: &[u8],
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Self {
        let token_to_id = TextIndex::new(tokens.iter().copied());
        let mut byte_ids = [None; 256];
        for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
            if ty == token_type::BYTE
                && let Some(b) = parse_byte_token(t)
            {
                byte_ids[b as usize].get_or_insert(i as u32);
            }
        }
        Self { token_to_id, scores, byte_ids, unk, add_space_prefix }
    }

    pub(crate) fn encode(&self, frags: &[Frag<'_>], out: &mut Vec<u32>) {
        let mut prev_special = true;
        for f in frags {
            match *f {
                Frag::Text(t) => {
                    let mut s = String::with_capacity(t.len() + 3);
                    if self.add_space_prefix && prev_special {
                        s.push('▁');
                    }
                    for c in t.chars() {
                        s.push(if c == ' ' { '▁' } else { c });
                    }
                    self.tokenize(&s, out);
                    prev_special = false;
                }
                Frag::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
            }
        }
    }

    fn lookup(&self, s: &str) -> Option<u32> {
        self.token_to_id.get(s)
    }

    fn tokenize(&self, text: &str, out: &mut Vec<u32>) {
        let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Sym { start, len: c.len_utf8(), prev: i.wrapping_sub(1), next: i + 1 });
        }
        let Some(last) = syms.last_mut() else { return };
        last.next = NONE;
        let mut heap = BinaryHeap::new();
        let try_add = |syms: &[Sym], heap: &mut BinaryHeap<Bigram>, left: usize, right: usize| {
            if left == NONE || right == NONE {
                return;
            }
            let (l, r) = (&syms[left], &syms[right]);
            let piece = &text[l.start..l.start + l.len + r.len];
            if let Some(id) = self.lookup(piece) {
                heap.push(Bigram { score: self.scores[id as usize], left, right, size: piece.len() });
            }
        };
        for i in 1..syms.len() {
            try_add(&syms, &mut heap, i - 1, i);
        }
        while let Some(bg) = heap.pop() {
            let (l, r) = (&syms[bg.left], &syms[bg.right]);
            // Outdated: one side has been merged into something else since.
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.size {
                continue;
            }
            let right_next = r.next;
            syms[bg.left].len += syms[bg.right].len;
            syms[bg.right].len = 0;
            syms[bg.left].next = right_next;
            if right_next != NONE {
                syms[right_next].prev = bg.left;
            }
            let prev = syms[bg.left].prev;
            try_add(&syms, &mut heap, prev, bg.left);
            try_add(&syms, &mut heap, bg.left, right_next);
        }
        let mut i = 0;
        while i != NONE {
            let s = &syms[i];
            let piece = &text[s.start..s.start + s.len];
            match self.lookup(piece) {
                Some(id) => out.push(id),
                // Only single characters can be missing: merges make tokens.
                None => {
                    for b in piece.bytes() {
                        out.extend(self.byte_ids[b as usize].or(self.unk));
                    }
                }
            }
            i = s.next;
        }
    }
}

/// Raw bytes of every token: `▁` is a space, `<0xNN>` byte tokens are their
/// byte, special tokens are their text, unused tokens are empty.
pub(crate) fn token_bytes(tokens: &[&str], types: &[u8]) -> Table {
    let mut table = Table::with_capacity(tokens.len());
    for (t, &ty) in tokens.iter().zip(types) {
        match ty {
            token_type::BYTE => match parse_byte_token(t) {
                Some(b) => table.push(&[b]),
                None => table.push(t.as_bytes()),
            },
            token_type::NORMAL if t.contains('▁') => table.push(t.replace('▁', " ").as_bytes()),
            token_type::UNUSED => table.push(&[]),
            _ => table.push(t.as_bytes()),
        }
    }
    table.shrink();
    table
}
