//! A vocabulary's strings stored end to end, and an index from token text
//! to id over them. A `HashMap<String, u32>` and a `Vec<Vec<u8>>` for
//! Gemma 3's 262,144 tokens hold about 30 MB (two heap allocations a token
//! and a 32-byte bucket each); these hold about 7 MB, which a memory
//! budget (`--mem-budget-mb`) leaves to the weights.

use std::hash::BuildHasher;

use hashbrown::HashTable;

/// Byte strings stored end to end, addressed by index.
#[derive(Default)]
pub(crate) struct Table {
    data: Vec<u8>,
    /// `ends[i]` is where string `i` ends in `data`.
    ends: Vec<usize>,
}

impl Table {
    pub(crate) fn with_capacity(strings: usize) -> Self {
        Self { data: Vec::new(), ends: Vec::with_capacity(strings) }
    }

    pub(crate) fn push(&mut self, s: &[u8]) {
        self.data.extend_from_slice(s);
        self.ends.push(self.data.len());
    }

    /// String `i`; the caller checks `i < len()`.
    pub(crate) fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.data[start..self.ends[i]]
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Trims spare capacity once every string is in.
    pub(crate) fn shrink(&mut self) {
        self.data.shrink_to_fit();
        self.ends.shrink_to_fit();
    }
}

impl<'a> FromIterator<&'a [u8]> for Table {
    fn from_iter<I: IntoIterator<Item = &'a [u8]>>(it: I) -> Self {
        let it = it.into_iter();
        let mut t = Table::with_capacity(it.size_hint().0);
        for s in it {
            t.push(s);
        }
        t.shrink();
        t
    }
}

/// Token text -> id. On duplicate texts the first id wins, as in llama.cpp.
pub(crate) struct TextIndex {
    texts: Table,
    slots: HashTable<u32>,
    hasher: std::hash::RandomState,
}

impl TextIndex {
    pub(crate) fn new<'a>(tokens: impl ExactSizeIterator<Item = &'a str>) -> Self {
        let hasher = std::hash::RandomState::new();
        let mut slots = HashTable::with_capacity(tokens.len());
        let mut texts = Table::with_capacity(tokens.len());
        for (i, t) in tokens.enumerate() {
            texts.push(t.as_bytes());
            let h = hasher.hash_one(t.as_bytes());
            let texts = &texts;
            if slots.find(h, |&id: &u32| texts.get(id as usize) == t.as_bytes()).is_none() {
                slots.insert_unique(h, i as u32, |&id| hasher.hash_one(texts.get(id as usize)));
            }
        }
        texts.shrink();
        slots.shrink_to_fit(|&id| hasher.hash_one(texts.get(id as usize)));
        Self { texts, slots, hasher }
    }

    pub(crate) fn get(&self, text: &str) -> Option<u32> {
        let h = self.hasher.hash_one(text.as_bytes());
        self.slots.find(h, |&id| self.texts.get(id as usize) == text.as_bytes()).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_finds_every_text_and_the_first_of_duplicates() {
        let words = ["a", "", "b", "ab", "a", "▁the"];
        let ix = TextIndex::new(words.iter().copied());
        assert_eq!(ix.get("a"), Some(0), "the first id of a duplicate");
        assert_eq!(ix.get(""), Some(1));
        assert_eq!(ix.get("ab"), Some(3));
        assert_eq!(ix.get("▁the"), Some(5));
        assert_eq!(ix.get("c"), None);
        let t: Table = words.iter().map(|w| w.as_bytes()).collect();
        assert_eq!((0..t.len()).map(|i| t.get(i)).collect::<Vec<_>>(), words.map(str::as_bytes));
    }
}
