//! Structured outputs: the text a model generates made to follow a JSON
//! schema, a grammar (Lark, or GBNF through [`gbnf`]), a regular
//! expression or a list of choices.
//!
//! [llguidance](https://github.com/guidance-ai/llguidance) (the engine
//! behind vLLM's, SGLang's and llama.cpp's `guidance` back ends) compiles a
//! [`Spec`] against a vocabulary's token trie; at each step it gives the set
//! of tokens that keep the output a prefix of some text the grammar accepts,
//! and the generation loop sets every other token's logit to -inf before
//! sampling ([`spinfer_sampling::TokenConstraint`]). Masking happens after
//! the forward pass, so batching and kernels are untouched: a constrained
//! greedy generation is the unconstrained one wherever the model's own first
//! choice is allowed.
//!
//! - [`Grammars`]: one per model, built once (the vocabulary's trie and
//!   llguidance's per-vocabulary tables).
//! - [`Grammar`]: a compiled spec; [`Grammar::source`] hands out a fresh
//!   [`Guide`] per generation.
//! - Hostile specs are bounded by llguidance's [`ParserLimits`] (lexer fuel,
//!   grammar size, lexer states) and by [`MAX_CHOICES`].

pub mod gbnf;
mod vocab;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::TokEnv;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use spinfer_sampling::{ConstraintSource, TokenConstraint};
use spinfer_tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The spec does not compile (its syntax, an unsupported feature, a
    /// limit); the message is llguidance's.
    #[error("{0}")]
    Spec(String),
    /// The vocabulary cannot carry grammars.
    #[error("vocabulary: {0}")]
    Vocabulary(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The most choices a [`Spec::Choice`] may list.
pub const MAX_CHOICES: usize = 4096;

/// What the output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value valid under this JSON schema (llguidance's subset:
    /// types, properties, required, enum/const, anyOf, items, lengths,
    /// patterns, numeric bounds, local `$ref`s).
    JsonSchema(Value),
    /// Text in the language of a Lark grammar (llguidance's dialect; its
    /// `%json` and regex terminals included).
    Lark(String),
    /// Text in the language of a GBNF grammar (llama.cpp's format), read
    /// as llama.cpp reads it ([`gbnf`]).
    Gbnf(String),
    /// Text matching a regular expression in full (Rust `regex` syntax).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl Spec {
    /// A grammar in either format: GBNF when its first rule is `name ::=`
    /// ([`gbnf::looks_like_gbnf`]), else Lark.
    pub fn grammar(source: String) -> Self {
        if gbnf::looks_like_gbnf(&source) { Spec::Gbnf(source) } else { Spec::Lark(source) }
    }

    fn top_level(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Spec::JsonObject => TopLevelGrammar::from_json_schema(with_whitespace(json!({"type": "object"}))),
            Spec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(with_whitespace(schema.clone())),
            Spec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
            Spec::Gbnf(g) => TopLevelGrammar::from_lark(gbnf::to_lark(g).map_err(Error::Spec)?),
            Spec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Spec::Choice(items) => {
                if items.is_empty() || items.len() > MAX_CHOICES {
                    return Err(Error::Spec(format!("give 1 to {MAX_CHOICES} choices, not {}", items.len())));
                }
                let alts: Vec<String> = items.iter().map(|s| regex_syntax::escape(s)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alts.join("|")))
            }
        })
    }
}

/// JSON may have whitespace between tokens, at most 24 characters of it
/// at a time (an unbounded run lets a small model pad forever), unless the
/// schema sets llguidance's own `x-guidance` options.
fn with_whitespace(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut()
        && !o.contains_key("x-guidance")
    {
        o.insert("x-guidance".into(), json!({"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,24}"}));
    }
    schema
}

/// A model's vocabulary prepared for grammars: build once, compile many.
pub struct Grammars {
    factory: ParserFactory,
    /// End-of-generation ids: allowed exactly where the output may end.
    eog: Arc<[u32]>,
    eos: u32,
}

impl Grammars {
    /// Prepares `tokenizer`'s vocabulary for a model of `n_logits` output
    /// rows.
    pub fn new(tokenizer: &Tokenizer, n_logits: usize) -> Result<Self> {
        let env = catch_unwind(AssertUnwindSafe(|| vocab::TrieEnv::new(tokenizer, n_logits)))
            .map_err(|_| Error::Vocabulary("the token trie could not be built".into()))??;
        let eos = llguidance::toktrie::TokenizerEnv::tok_trie(&env).eos_token();
        let env: TokEnv = Arc::new(env);
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| Error::Vocabulary(e.to_string()))?;
        // llguidance's own logging goes to stderr; warnings are taken
        // through `tracing` instead (see `compile`).
        factory.quiet();
        *factory.limits_mut() = ParserLimits { verbose_errors: false, ..ParserLimits::default() };
        Ok(Self { factory, eog: tokenizer.eog_ids().into(), eos })
    }

    /// Compiles `spec`; errors name what is wrong with it.
    pub fn compile(&self, spec: &Spec) -> Result<Grammar> {
        let parser = self.factory.create_parser(spec.top_level()?).map_err(|e| Error::Spec(e.to_string()))?;
        let mut m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(Error::Spec(e));
        }
        for w in m.grammar_warnings() {
            tracing::warn!(warning = %w, "grammar");
        }
        Ok(Grammar { start: Arc::new(Mutex::new(m)), eog: self.eog.clone(), eos: self.eos })
    }
}

/// A compiled spec.
pub struct Grammar {
    /// The matcher in its start state, cloned for each generation.
    start: Arc<Mutex<Matcher>>,
    eog: Arc<[u32]>,
    eos: u32,
}

impl Grammar {
    /// A fresh [`Guide`] in the start state.
    pub fn guide(&self) -> Guide {
        let m = self.start.lock().unwrap_or_else(|p| p.into_inner()).deep_clone();
        Guide { m, eog: self.eog.clone(), eos: self.eos }
    }

    /// A source of fresh guides for `GenerateParams::constraint`.
    pub fn source(self) -> ConstraintSource {
        let g = Arc::new(self);
        ConstraintSource::new(move || Ok(Box::new(g.guide()) as Box<dyn TokenConstraint>))
    }
}

/// One generation's constraint state.
pub struct Guide {
    m: Matcher,
    eog: Arc<[u32]>,
    eos: u32,
}

fn failed(e: impl std::fmt::Display) -> spinfer_sampling::Error {
    spinfer_sampling::Error::Constraint(e.to_string())
}

impl TokenConstraint for Guide {
    fn mask(&mut self, logits: &mut [f32]) -> spinfer_sampling::Result<()> {
        let mut allowed = self.m.compute_mask().map_err(failed)?;
        if allowed.is_zero() {
            return Err(failed("the grammar allows no token here"));
        }
        // The trie knows one end token; the model may have several.
        if allowed.is_allowed(self.eos) {
            let n = allowed.len();
            for &t in self.eog.iter().filter(|&&t| (t as usize) < n) {
                allowed.allow_token(t);
            }
        }
        let words = allowed.as_slice().iter().chain(std::iter::repeat(&0));
        for (chunk, &word) in logits.chunks_mut(32).zip(words) {
            if word != u32::MAX {
                for (bit, l) in chunk.iter_mut().enumerate() {
                    if word >> bit & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> spinfer_sampling::Result<bool> {
        self.m.consume_token(token).map_err(failed)?;
        Ok(self.m.is_stopped())
    }
}

#[cfg(test)]
mod tests;
