//! A model's vocabulary as llguidance sees it: every token's bytes in a
//! trie, control tokens behind the special-token marker so that no text
//! the grammar allows can ever spell them.

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use spinfer_tokenizer::Tokenizer;

use crate::{Error, Result};

/// The trie over a vocabulary of `n` logits (the model's output rows,
/// which may be more than the tokenizer's tokens: those extra rows are
/// never allowed).
pub(crate) struct TrieEnv {
    trie: TokTrie,
}

impl TrieEnv {
    pub(crate) fn new(tokenizer: &Tokenizer, n: usize) -> Result<Self> {
        let known = tokenizer.vocab_size();
        if n < known {
            return Err(Error::Vocabulary(format!(
                "the model has {n} output rows but its tokenizer {known} tokens; a grammar needs a row for every token"
            )));
        }
        let n32 = u32::try_from(n).map_err(|_| Error::Vocabulary(format!("{n} tokens are too many")))?;
        let eos = tokenizer
            .eos_id()
            .or_else(|| tokenizer.eog_ids().first().copied())
            .ok_or_else(|| Error::Vocabulary("the tokenizer names no end-of-generation token".into()))?;
        let mut words = Vec::with_capacity(n);
        for id in 0..known as u32 {
            let bytes = tokenizer.token_bytes(id).map_err(|e| Error::Vocabulary(e.to_string()))?;
            // Control tokens (and tokens of no bytes) are "special": the
            // marker byte never occurs in UTF-8 text.
            words.push(if tokenizer.is_control(id) || bytes.is_empty() { special(id, &bytes) } else { bytes });
        }
        words.extend((known as u32..n32).map(|id| special(id, &[])));
        let info = TokRxInfo { tok_end_of_turn: None, ..TokRxInfo::new(n32, eos) };
        Ok(Self { trie: TokTrie::from(&info, &words) })
    }
}

/// A special token's trie entry: the marker, then its name, or
/// `<[id]>` when it has none (llguidance's numeric form).
fn special(id: u32, name: &[u8]) -> Vec<u8> {
    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    // A name that is not a `<...>` tag could not be written in a grammar
    // (llguidance reads `<name>` as a special token); give it the id form.
    if name.len() > 2 && name.first() == Some(&b'<') && name.last() == Some(&b'>') && name.len() < 200 {
        w.extend_from_slice(name);
    } else {
        w.extend_from_slice(format!("<[{id}]>").as_bytes());
    }
    w
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Only forced tokens are ever tokenised by llguidance, and spinfer
    /// forces none: the trie's greedy split serves.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}
