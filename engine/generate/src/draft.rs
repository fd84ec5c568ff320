//! Drafts for speculative decoding from the context's own n-grams
//! (prompt lookup: vLLM's `ngram` method, llama.cpp's lookup decoding).
//! When the last few tokens occurred earlier in the prompt or the output,
//! the tokens that followed them then are a guess at what follows now;
//! the model checks the guess in the same step as the next token
//! ([`crate::DecodeSession::forward_rows`]), and a step that guessed right
//! yields several tokens for about one read of the weights. A wrong guess
//! costs only time: every token is still chosen from its own logits
//! ([`crate::Continuation::verify`]), so the output never changes.

use spinfer_models::{Error, Result};

/// How drafts are made (`--draft-max`, `[speculative]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DraftParams {
    /// Most tokens one draft proposes (vLLM's `num_speculative_tokens`,
    /// llama.cpp's `--draft-max`); 0: no drafts.
    pub max_tokens: usize,
    /// The longest n-gram looked up (`prompt_lookup_max`).
    pub ngram_max: usize,
    /// The shortest (`prompt_lookup_min`): shorter matches guess worse.
    pub ngram_min: usize,
}

impl Default for DraftParams {
    /// No drafts; when turned on, n-grams of 2 to 4 tokens.
    fn default() -> Self {
        Self { max_tokens: 0, ngram_max: 4, ngram_min: 2 }
    }
}

impl DraftParams {
    /// Most tokens a draft may hold: a step checks the draft and the next
    /// token as one batch, and the longer it is the more a miss costs.
    pub const MAX_TOKENS: usize = 16;
    /// The longest n-gram that may be looked up.
    pub const MAX_NGRAM: usize = 16;

    /// Checks the bounds, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.max_tokens > Self::MAX_TOKENS {
            return bad(format!("draft max_tokens must be at most {}, got {}", Self::MAX_TOKENS, self.max_tokens));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max || self.ngram_max > Self::MAX_NGRAM {
            return bad(format!(
                "draft n-gram lengths must satisfy 1 <= ngram_min <= ngram_max <= {}, got {}..={}",
                Self::MAX_NGRAM,
                self.ngram_min,
                self.ngram_max
            ));
        }
        Ok(())
    }

    /// Whether drafts are made at all.
    pub fn enabled(&self) -> bool {
        self.max_tokens > 0
    }
}

/// What drafting did in one generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DraftStats {
    /// Steps that checked a draft.
    pub drafts: usize,
    /// Tokens proposed.
    pub drafted: usize,
    /// Tokens proposed that the model chose too (each a step saved).
    pub accepted: usize,
}

/// One generation's drafter: the n-gram lookup and a draft length that
/// follows how much of the recent drafts was accepted.
#[derive(Clone, Debug)]
pub struct Drafter {
    params: DraftParams,
    /// Tokens to propose next time: doubled after a draft accepted whole,
    /// cut to one more than was accepted after a miss.
    len: usize,
    stats: DraftStats,
}

impl Drafter {
    pub fn new(params: DraftParams) -> Self {
        Self { params, len: params.max_tokens, stats: DraftStats::default() }
    }

    pub fn stats(&self) -> DraftStats {
        self.stats
    }

    /// A draft continuing `history` of at most `room` tokens: what followed
    /// the most recent earlier occurrence of its last n tokens, n from
    /// `ngram_max` down to `ngram_min`. Empty when nothing matches.
    pub fn propose<'h>(&self, history: &'h [u32], room: usize) -> &'h [u32] {
        let want = self.len.min(room);
        if want == 0 {
            return &[];
        }
        let p = &self.params;
        for n in (p.ngram_min..=p.ngram_max).rev() {
            if let Some(at) = earlier_occurrence(history, n) {
                let from = at + n;
                return &history[from..history.len().min(from + want)];
            }
        }
        &[]
    }

    /// Records that `accepted` of a draft of `drafted` tokens were taken.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.stats.drafts += 1;
        self.stats.drafted += drafted;
        self.stats.accepted += accepted;
        self.len = if accepted == drafted { (self.len * 2).min(self.params.max_tokens) } else { accepted + 1 };
    }
}

/// The start of the most recent occurrence of `history`'s last `n` tokens
/// before the one that ends it.
fn earlier_occurrence(history: &[u32], n: usize) -> Option<usize> {
    let len = history.len();
    if n == 0 || len <= n {
        return None;
    }
    let tail = &history[len - n..];
    (0..len - n).rev().find(|&i| history[i + n - 1] == tail[n - 1] && history[i..i + n] == *tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drafter(max_tokens: usize, ngram_min: usize, ngram_max: usize) -> Drafter {
        Drafter::new(DraftParams { max_tokens, ngram_max, ngram_min })
    }

    #[test]
    fn a_draft_is_what_followed_the_most_recent_match_of_the_longest_ngram() {
        let d = drafter(3, 1, 3);
        // "7 8" occurred twice: the later one (at 5) is followed by 4 9 1.
        let h = [7, 8, 1, 2, 3, 7, 8, 4, 9, 1, 7, 8];
        assert_eq!(d.propose(&h, 16), [4, 9, 1]);
        // "5 7 8" occurred at 0: the 3-gram wins over the later "7 8" at 6.
        let h = [5, 7, 8, 6, 6, 9, 7, 8, 2, 2, 5, 7, 8];
        assert_eq!(d.propose(&h, 16), [6, 6, 9]);
        // Room bounds the draft; the history's end bounds it too.
        assert_eq!(d.propose(&h, 2), [6, 6]);
        assert_eq!(d.propose(&[3, 4, 3], 16), [4, 3]);
    }

    #[test]
    fn no_match_or_no_room_proposes_nothing() {
        let d = drafter(4, 2, 3);
        assert!(d.propose(&[1, 2, 3, 4, 5], 16).is_empty());
        assert!(d.propose(&[1, 2], 16).is_empty());
        assert!(d.propose(&[], 16).is_empty());
        assert!(d.propose(&[1, 2, 1, 2], 0).is_empty());
        // A 1-gram would match, but the shortest looked up is 2.
        assert!(d.propose(&[9, 1, 5, 1], 16).is_empty());
        // Lengths out of bounds (refused by `validate`) propose nothing.
        assert!(drafter(4, 0, 0).propose(&[1, 2, 1, 2], 16).is_empty());
    }

    #[test]
    fn the_draft_length_follows_acceptance() {
        let mut d = drafter(8, 1, 2);
        let h = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2];
        assert_eq!(d.propose(&h, 16).len(), 8);
        d.record(8, 2);
        assert_eq!(d.propose(&h, 16).len(), 3);
        d.record(3, 3);
        assert_eq!(d.propose(&h, 16).len(), 6);
        d.record(6, 6);
        assert_eq!(d.propose(&h, 16).len(), 8);
        d.record(8, 0);
        assert_eq!(d.propose(&h, 16).len(), 1);
        assert_eq!(d.stats(), DraftStats { drafts: 4, drafted: 25, accepted: 11 });
    }

    #[test]
    fn bounds_are_checked() {
        assert!(DraftParams::default().validate().is_ok());
        for (max_tokens, ngram_min, ngram_max) in [(17, 2, 4), (4, 0, 4), (4, 5, 4), (4, 2, 17)] {
            let e = DraftParams { max_tokens, ngram_max, ngram_min }.validate().unwrap_err().to_string();
            assert!(e.contains("draft"), "{e}");
        }
    }
}
