//! Log-probabilities of tokens (`logprobs`, `top_logprobs`, and the prompt's
//! with `echo`): computed by the scheduler from the logits of the row that
//! chose (or, for a prompt, predicts) each token, and written in OpenAI's
//! two shapes, chat's `{"content": [...]}` and the completions' parallel
//! lists. A log-probability is of the model's distribution, the raw
//! logits' log-softmax, before temperature or any other sampling setting.

use serde_json::{Map, Value, json};

use spinfer_engine::perplexity::log_sum_exp;
use spinfer_engine::tokenizer::Tokenizer;

/// Most alternatives a request may ask for per token.
pub const MAX_TOP: usize = 20;

/// One token's log-probability and the `k` most likely tokens at its
/// position, most likely first.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// `token`'s entry under the logits `row`, with its `k` alternatives.
    pub fn of(row: &[f32], token: u32, k: usize) -> Self {
        let lse = log_sum_exp(row);
        let lp = |i: usize| (row[i] as f64 - lse) as f32;
        let top = top_k(row, k).into_iter().map(|i| (i as u32, lp(i))).collect();
        Self { token, logprob: lp(token as usize), top }
    }
}

/// Indices of the `k` largest values, largest first (ties: lower index
/// first), in one pass.
fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for (i, &x) in row.iter().enumerate() {
        if best.len() == k && best.last().is_none_or(|&j| x.total_cmp(&row[j]).is_le()) {
            continue;
        }
        let at = best.partition_point(|&j| row[j].total_cmp(&x).is_ge());
        best.insert(at, i);
        best.truncate(k);
    }
    best
}

/// A token's text (its bytes, lossily UTF-8) and its bytes; an id the
/// tokenizer does not know (a padded vocabulary row) is empty.
fn text_of(t: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = t.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat's `logprobs.content` entries.
pub fn chat_content(t: &Tokenizer, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, logprob: f32| {
        let (token, bytes) = text_of(t, id);
        json!({"token": token, "logprob": logprob, "bytes": bytes})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            let mut e = entry(lp.token, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The completions' `logprobs` object, built token by token: `tokens`,
/// `token_logprobs` and `top_logprobs` (null for a prompt's first token,
/// which nothing predicts) and each token's character offset in the text.
#[derive(Default)]
pub struct TextLogprobs {
    offset: usize,
    tokens: Vec<Value>,
    logprobs: Vec<Value>,
    top: Vec<Value>,
    offsets: Vec<usize>,
}

impl TextLogprobs {
    /// Offsets count from `offset` characters (the prompt's, unless it is echoed).
    pub fn starting_at(offset: usize) -> Self {
        Self { offset, ..Self::default() }
    }

    pub fn push(&mut self, t: &Tokenizer, token: u32, lp: Option<&TokenLogprob>) {
        let (text, _) = text_of(t, token);
        self.offsets.push(self.offset);
        self.offset += text.chars().count();
        self.tokens.push(text.into());
        self.logprobs.push(lp.map_or(Value::Null, |lp| lp.logprob.into()));
        self.top.push(lp.map_or(Value::Null, |lp| {
            let mut m = Map::new();
            for &(id, l) in &lp.top {
                m.entry(text_of(t, id).0).or_insert(l.into());
            }
            Value::Object(m)
        }));
    }

    /// The object of the tokens pushed since the last call.
    pub fn take(&mut self) -> Value {
        json!({
            "tokens": std::mem::take(&mut self.tokens),
            "token_logprobs": std::mem::take(&mut self.logprobs),
            "top_logprobs": std::mem::take(&mut self.top),
            "text_offset": std::mem::take(&mut self.offsets),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_the_log_softmax_and_the_top_k_in_order() {
        let row = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        let lp = TokenLogprob::of(&row, 2, 3);
        assert!((lp.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2], "largest first, ties by lower id");
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(TokenLogprob::of(&row, 0, 0).top.is_empty());
        assert_eq!(top_k(&row, 9), [1, 3, 2, 0, 4]);
    }
}
