//! spinfer's tokenizer behind RuvLLM's [`Tokenizer`] trait.

use std::sync::Arc;

use ruvllm::{SpecialTokens, Tokenizer};

use crate::convert::runtime_error;
use spinfer_engine::Engine;

/// The loaded model's tokenizer (GGUF byte-level BPE or SentencePiece, or
/// `tokenizer.json`), as RuvLLM sees it.
///
/// `encode` returns the text's tokens only (no BOS, like RuvLLM's Candle
/// backend); generation adds BOS itself when the model asks for it.
/// Special-token texts in the input (e.g. `<|im_start|>`) are matched as
/// single tokens. `decode` returns every token's text, specials included.
pub struct SpinferTokenizer {
    engine: Arc<Engine>,
}

impl SpinferTokenizer {
    pub(crate) fn new(engine: Arc<Engine>) -> Self {
        Self { engine }
    }

    fn inner(&self) -> &spinfer_engine::tokenizer::Tokenizer {
        &self.engine.tokenizer
    }

    /// The token ids that end a generation (EOS and end-of-turn tokens).
    pub fn end_of_generation_ids(&self) -> &[u32] {
        self.inner().eog_ids()
    }
}

impl Tokenizer for SpinferTokenizer {
    fn encode(&self, text: &str) -> ruvllm::Result<Vec<u32>> {
        self.inner().encode(text, false).map_err(|e| runtime_error("encode", e.into()))
    }

    fn decode(&self, tokens: &[u32]) -> ruvllm::Result<String> {
        self.inner().decode(tokens).map_err(|e| runtime_error("decode", e.into()))
    }

    fn vocab_size(&self) -> usize {
        self.inner().vocab_size()
    }

    fn special_tokens(&self) -> SpecialTokens {
        let t = self.inner();
        SpecialTokens { bos_token_id: t.bos_id(), eos_token_id: t.eos_id(), pad_token_id: None, unk_token_id: None }
    }
}
