//! GPT-2 style byte-level BPE: text is split into words by the
//! pre-tokeniser's regexes, each word's UTF-8 bytes start as one symbol per
//! byte, and adjacent symbols are merged by merge rank (lowest first, leftmost
//! first among equals) until no merge applies. Results are cached per word.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use fancy_regex::Regex;

use super::token_type;
use super::vocab::{Table, TextIndex};
use crate::{Error, Result};

/// GPT-2's pre-tokeniser (also the `ByteLevel` regex of `tokenizers`).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Every digit on its own (`Digits(individual_digits)`), before GPT-2's regex.
const DIGIT: &str = r"\p{N}";

pub(crate) const SUPPORTED_PRE: &str =
    "default, gpt2, smollm, starcoder, refact, codeshell, exaone, minerva, qwen2, llama-bpe, llama3";

/// Regex stages and whether whole words found in the vocabulary skip the
/// merges (`ignore_merges`), by `tokenizer.ggml.pre` name.
fn pre_tokenizer(name: &str) -> Option<(&'static [&'static str], bool)> {
    Some(match name {
        "default" | "gpt2" => (&[GPT2], false),
        "smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva" => (&[DIGIT, GPT2], false),
        "qwen2" => (&[QWEN2], false),
        "llama-bpe" | "llama3" => (&[LLAMA3], true),
        _ => return None,
    })
}

/// Cached words before the cache is emptied (bounds memory on huge inputs).
const CACHE_CAP: usize = 1 << 18;

pub(crate) struct Bpe {
    stages: Vec<Regex>,
    ignore_merges: bool,
    /// Byte-level token text -> id.
    token_to_id: TextIndex,
    /// Id of the one-character token of each byte.
    byte_ids: [Option<u32>; 256],
    /// `(left << 32) | right` -> (rank, merged id).
    merges: HashMap<u64, (u32, u32)>,
    cache: Mutex<HashMap<String, Vec<u32>>>,
}

fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

impl Bpe {
    /// Errors are `(metadata key, detail)`.
    pub(crate) fn new(tokens: &[&str], merges: &[&str], pre: &str) -> Result<Self, (&'static str, String)> {
        let (patterns, ignore_merges) = pre_tokenizer(pre).ok_or_else(|| {
            ("tokenizer.ggml.pre", format!("names unknown pre-tokenizer '{pre}' (supported: {SUPPORTED_PRE})"))
        })?;
        let stages = patterns.iter().map(|p| Regex::new(p).expect("built-in pre-tokenizer regex")).collect();
        let token_to_id = TextIndex::new(tokens.iter().copied());
        let mut byte_ids = [None; 256];
        let mut buf = [0u8; 4];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = token_to_id.get(BYTE_TO_CHAR[b].encode_utf8(&mut buf));
        }
        let mut map = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            // Split at the first space after the first character (a token may be a lone space in some vocabularies).
            let split = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(i, _)| i);
            let Some(sp) = split else {
                return Err((
                    "tokenizer.ggml.merges",
                    format!("entry #{rank} '{m}' is not two tokens separated by a space"),
                ));
            };
            let (a, b) = (&m[..sp], &m[sp + 1..]);
            let look = |t: &str| {
                token_to_id.get(t).ok_or_else(|| {
                    (
                        "tokenizer.ggml.merges",
                        format!("entry #{rank} '{m}' uses token '{t}', which is not in the vocabulary"),
                    )
                })
            };
            let (ia, ib, ic) = (look(a)?, look(b)?, look(&format!("{a}{b}"))?);
            map.entry(pair(ia, ib)).or_insert((rank as u32, ic));
        }
        Ok(Self { stages, ignore_merges, token_to_id, byte_ids, merges: map, cache: Mutex::new(HashMap::new()) })
    }

    /// Appends the ids of `text` (which holds no special tokens) to `out`.
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        for w in self.split(text)? {
            self.encode_word(w, out);
        }
        Ok(())
    }

    /// Pre-tokenisation: each regex stage splits every piece further, keeping
    /// both the matches and the text between them.
    pub(crate) fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>> {
        let mut pieces = vec![text];
        for re in &self.stages {
            let mut next = Vec::with_capacity(pieces.len() * 2 + text.len() / 4);
            for p in pieces {
                let mut last = 0;
                for m in re.find_iter(p) {
                    let m = m.map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex failed: {e}")))?;
                    if m.start() > last {
                        next.push(&p[last..m.start()]);
                    }
                    if m.end() > m.start() {
                        next.push(m.as_str());
                    }
                    last = m.end();
                }
                if last < p.len() {
                    next.push(&p[last..]);
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }

    fn encode_word(&self, word: &str, out: &mut Vec<u32>) {
        if word.len() == 1 {
            out.extend(self.byte_ids[word.as_bytes()[0] as usize]);
            return;
        }
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ids) = cache.get(word) {
            out.extend_from_slice(ids);
            return;
        }
        drop(cache);
        let ids = self.bpe(word);
        out.extend_from_slice(&ids);
        cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= CACHE_CAP {
            cache.clear();
        }
        cache.insert(word.to_owned(), ids);
    }

    /// Merges one word. Bytes with no token in the vocabulary are dropped.
    fn bpe(&self, word: &str) -> Vec<u32> {
        if self.ignore_merges {
            let text: String = word.bytes().map(|b| BYTE_TO_CHAR[b as usize]).collect();
            if let Some(id) = self.token_to_id.get(&text) {
                return vec![id];
            }
        }
        const NONE: usize = usize::MAX;
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
            live: bool,
        }
        let ids: Vec<u32> = word.bytes().filter_map(|b| self.byte_ids[b as usize]).collect();
        let n = ids.len();
        let mut syms: Vec<Sym> = ids
            .iter()
            .enumerate()
            .map(|(i, &id)| Sym {
                id,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                live: true,
            })
            .collect();
        // Min-heap of (rank, left position, merged id).
        let mut heap = BinaryHeap::new();
        for i in 1..n {
            if let Some(&(rank, new)) = self.merges.get(&pair(ids[i - 1], ids[i])) {
                heap.push(Reverse((rank, i - 1, new)));
            }
        }
        while let Some(Reverse((rank, pos, new))) = heap.pop() {
            let next = syms[pos].next;
            if !syms[pos].live || next == NONE {
                continue;
            }
            // Stale entry: the pair at `pos` has changed since it was queued.
            match self.merges.get(&pair(syms[pos].id, syms[next].id)) {
                Some(&(r, _)) if r == rank => {}
                _ => continue,
            }
            syms[pos].id = new;
            syms[next].live = false;
            let after = syms[next].next;
            syms[pos].next = after;
            if after != NONE {
                syms[after].prev = pos;
            }
            let prev = syms[pos].prev;
            if prev != NONE
                && let Some(&(r, m)) = self.merges.get(&pair(syms[prev].id, new))
            {
                heap.push(Reverse((r, prev, m)));
            }
            if after != NONE
                && let Some(&(r, m)) = self.merges.get(&pair(new, syms[after].id))
            {
                heap.push(Reverse((r, pos, m)));
            }
        }
        let mut out = Vec::new();
        let mut i = if n == 0 { NONE } else { 0 };
        while i != NONE {
            out.push(syms[i].id);
            i = syms[i].next;
        }
        out
    }
}

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes map to themselves,
/// the other 68 bytes to U+0100.. in byte order.
pub(crate) const BYTE_TO_CHAR: [char; 256] = {
    let mut t = ['\0'; 256];
    let mut extra = 0u32;
    let mut b = 0usize;
    while b < 256 {
        let printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
        let c = if printable {
            b as u32
        } else {
            extra += 1;
            255 + extra
        };
        t[b] = match char::from_u32(c) {
            Some(c) => c,
            None => panic!("invalid byte-level char"),
        };
        b += 1;
    }
    t
};

/// The byte a byte-level character stands for.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let u = c as u32;
    match u {
        33..=126 | 161..=172 | 174..=255 => Some(u as u8),
        256..=323 => NONPRINTABLE.get((u - 256) as usize).copied(),
        _ => None,
    }
}

const NONPRINTABLE: [u8; 68] = {
    let mut t = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        let printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
        if !printable {
            t[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    t
};

/// Bytes of a byte-level token text; characters outside the table are kept
/// as their UTF-8.
pub(crate) fn byte_level_decode(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut buf = [0u8; 4];
    for c in s.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes()),
        }
    }
    out
}

/// Raw bytes of every token of a byte-level vocabulary: control,
/// user-defined and unknown tokens are their text as written.
pub(crate) fn token_bytes(tokens: &[&str], types: &[u8]) -> Table {
    let mut table = Table::with_capacity(tokens.len());
    for (t, &ty) in tokens.iter().zip(types) {
        match ty {
            token_type::CONTROL | token_type::USER_DEFINED | token_type::UNKNOWN => table.push(t.as_bytes()),
            _ => table.push(&byte_level_decode(t)),
        }
    }
    table.shrink();
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_round_trips() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = BYTE_TO_CHAR[b as usize];
            assert!(seen.insert(c));
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(BYTE_TO_CHAR[b' ' as usize], 'Ġ');
        assert_eq!(BYTE_TO_CHAR[b'\n' as usize], 'Ċ');
        assert_eq!(byte_level_decode("ĠhiĊ"), b" hi\n");
    }

    #[test]
    fn gpt2_split_matches_reference_behaviour() {
        let b = Bpe::new(&["a"], &[], "smollm").unwrap();
        let s = b.split("Hello  world's 2018!\n\n  x").unwrap();
        assert_eq!(s, ["Hello", " ", " world", "'s", " ", "2", "0", "1", "8", "!", "\n\n ", " x"]);
        let b = Bpe::new(&["a"], &[], "llama-bpe").unwrap();
        assert_eq!(b.split("I'M 12345 ok").unwrap(), ["I", "'M", " ", "123", "45", " ok"]);
    }
}
