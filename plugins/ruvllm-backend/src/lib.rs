//! A [RuvLLM](https://crates.io/crates/ruvllm) backend running spinfer.
//!
//! [`SpinferBackend`] implements [`ruvllm::LlmBackend`], so RuvLLM (its
//! serving engine, sessions, SONA loops, anything that takes a
//! `Box<dyn LlmBackend>`) runs spinfer's engine, sparse FFN included,
//! unchanged:
//!
//! ```no_run
//! use ruvllm::{GenerateParams, LlmBackend, ModelConfig};
//! use spinfer_ruvllm::SpinferBackend;
//!
//! let mut backend: Box<dyn LlmBackend> = Box::new(SpinferBackend::new());
//! backend.load_model("models/SmolLM2-135M-Instruct.Q4_1.gguf", ModelConfig::default())?;
//! let text = backend.generate("The capital of France is", GenerateParams::default().with_temperature(0.0))?;
//! # Ok::<(), ruvllm::RuvLLMError>(())
//! ```
//!
//! What `load_model` accepts and how RuvLLM's parameters map onto spinfer's
//! is described on [`SpinferBackend`] and in the crate's README.

mod convert;
mod tokenizer;

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ruvllm::{
    ChatTemplate, DType, DeviceType, GenerateParams, GeneratedToken, GenerationOutput, LlmBackend, ModelConfig,
    ModelInfo, RuvLLMError, StreamEvent, TokenStream, Tokenizer,
};
use spinfer_engine::Engine;
use spinfer_engine::config::Config;
use spinfer_engine::engine::Output;
use spinfer_engine::generate::{self, StopReason};
use spinfer_engine::model::ModelOptions;
pub use spinfer_engine::model::{KvType, Precision, Requant};
pub use spinfer_engine::sparse::{PredictorKind, SparsityOptions};

pub use crate::tokenizer::SpinferTokenizer;

/// Whether the FFN runs sparse.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Sparsity {
    /// Use the calibration sidecar beside the model, `<model>.spinfer`
    /// (the model path with its extension replaced, as `spinfer calibrate`
    /// names it), when that file exists; dense otherwise.
    #[default]
    Auto,
    /// Always dense.
    Dense,
    /// This sidecar (and predictor); loading fails if it does not fit the model.
    Sidecar(SparsityOptions),
}

/// spinfer settings RuvLLM's [`ModelConfig`] has no field for. Set once,
/// when the backend is created; they apply to every `load_model`.
#[derive(Clone, Debug, Default)]
pub struct SpinferOptions {
    /// How activations meet quantised weights; `None` derives it from
    /// [`ModelConfig::dtype`]: `DType::F32` → [`Precision::Precise`],
    /// otherwise [`Precision::Fast`].
    pub precision: Option<Precision>,
    /// Threads per request; `None` = every core.
    pub threads: Option<usize>,
    pub sparsity: Sparsity,
    /// The KV cache's element type; `None` = the precision's own
    /// ([`ModelOptions::kv_type`]).
    pub kv_type: Option<KvType>,
    /// Quantise an f32, f16 or bf16 checkpoint's weight matrices as they
    /// load ([`ModelOptions::quantize`]); `None` = as stored.
    pub quantize: Option<Requant>,
    /// Speculative decoding from the context's own n-grams for every
    /// generation (outputs unchanged; [`generate::DraftParams`]); `None` =
    /// a `.toml` config's `[speculative]`, else none.
    pub draft: Option<generate::DraftParams>,
}

/// A RuvLLM backend on spinfer's engine. See the crate docs.
///
/// `load_model(model_id, config)`:
/// - `model_id` is a local path: a GGUF file, a safetensors checkpoint (a
///   directory with `config.json` and `tokenizer.json`), or a spinfer
///   operator config (`*.toml`: model, precision, context, threads, kernel
///   packs, sparsity; see spinfer's `docs/config.md`), which then decides
///   every option itself. Hub ids are not downloaded.
/// - `config.max_sequence_length` is the context (KV-cache length) of each
///   request; `config.dtype` picks the precision unless
///   [`SpinferOptions::precision`] does; `hidden_size`, `num_layers`,
///   `num_kv_heads` and `vocab_size`, when set, must match the file.
///   `architecture`, `quantization`, `use_flash_attention`, `rope_theta` and
///   `sliding_window` are hints spinfer does not need (it reads them from
///   the file); spinfer runs on the CPU whatever `device` says.
///
/// The loaded model is shared by all requests (`&self` methods may run
/// concurrently); each request runs in a session of its own, through
/// spinfer's library API ([`Engine::generate_stream`], [`Engine::embed`]),
/// so [`Engine::metrics`] counts RuvLLM's requests too.
pub struct SpinferBackend {
    options: SpinferOptions,
    loaded: Option<Loaded>,
}

struct Loaded {
    /// Streams hold it too, so a model unloaded mid-stream is freed when
    /// the stream ends.
    engine: Arc<Engine>,
    tokenizer: SpinferTokenizer,
    info: ModelInfo,
    /// The drafts every generation checks.
    draft: generate::DraftParams,
}

impl Loaded {
    /// spinfer's parameters for RuvLLM's, with the backend's drafts.
    fn params(&self, p: &GenerateParams) -> ruvllm::Result<generate::GenerateParams> {
        Ok(generate::GenerateParams { draft: self.draft, ..convert::generate_params(p)? })
    }
}

impl Default for SpinferBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl SpinferBackend {
    /// A backend with default options (no model loaded).
    pub fn new() -> Self {
        Self::with_options(SpinferOptions::default())
    }

    pub fn with_options(options: SpinferOptions) -> Self {
        Self { options, loaded: None }
    }

    pub fn options(&self) -> &SpinferOptions {
        &self.options
    }

    /// The loaded engine, for what RuvLLM's trait does not expose
    /// (sparsity statistics, kernel choices).
    pub fn engine(&self) -> Option<&Engine> {
        self.loaded.as_ref().map(|l| &*l.engine)
    }

    fn loaded(&self) -> ruvllm::Result<&Loaded> {
        self.loaded.as_ref().ok_or_else(|| RuvLLMError::InvalidOperation("No model loaded".to_string()))
    }

    /// The engine `model_id` and `config` ask for, and the drafts of a
    /// `.toml` config's `[speculative]`.
    fn load_engine(
        &self,
        model_id: &str,
        config: &ModelConfig,
    ) -> ruvllm::Result<(Engine, Option<generate::DraftParams>)> {
        let path = Path::new(model_id);
        if model_id.is_empty() || !path.exists() {
            return Err(RuvLLMError::NotFound(format!(
                "spinfer: model '{model_id}': no such file or directory (spinfer loads local GGUF files, \
                 safetensors checkpoints and spinfer .toml configs; it does not download Hub ids)"
            )));
        }
        if matches!(config.device, DeviceType::Cuda(_)) {
            tracing::warn!(
                model = model_id,
                "spinfer runs on the CPU; ignoring ModelConfig::device {:?}",
                config.device
            );
        }
        if path.extension().is_some_and(|e| e == "toml") {
            let c = Config::load(path).map_err(|e| convert::load_error(model_id, e))?;
            let (engine, packs) = Engine::from_config(&c).map_err(|e| convert::load_error(model_id, e))?;
            for p in packs {
                if let Err(why) = p.outcome {
                    tracing::warn!(dir = %p.dir.display(), "kernel pack skipped: {why}");
                }
            }
            return Ok((engine, c.speculative.map(|s| s.draft_params())));
        }
        let defaults = ModelOptions::default();
        let options = ModelOptions {
            precision: self.options.precision.unwrap_or(match config.dtype {
                DType::F32 => Precision::Precise,
                DType::F16 | DType::Bf16 => Precision::Fast,
            }),
            ctx: config.max_sequence_length,
            threads: self.options.threads.unwrap_or(defaults.threads).max(1),
            sparsity: match &self.options.sparsity {
                Sparsity::Dense => None,
                Sparsity::Sidecar(o) => Some(o.clone()),
                Sparsity::Auto => {
                    let sidecar = sidecar_beside(path);
                    sidecar.exists().then(|| {
                        tracing::info!(sidecar = %sidecar.display(), "running the FFN sparse");
                        SparsityOptions::new(sidecar)
                    })
                }
            },
            mem_budget: None,
            kv_type: self.options.kv_type,
            quantize: self.options.quantize,
        };
        Ok((Engine::load(path, options).map_err(|e| convert::load_error(model_id, e))?, None))
    }
}

/// `<model>.spinfer`: the model path with its extension replaced.
pub fn sidecar_beside(model: &Path) -> PathBuf {
    model.with_extension("spinfer")
}

/// `ModelConfig` fields that, when set, must agree with the loaded file.
fn check_hints(model_id: &str, config: &ModelConfig, engine: &Engine) -> ruvllm::Result<()> {
    let c = &engine.model.config;
    let hints = [
        ("hidden_size", config.hidden_size, c.dim),
        ("num_layers", config.num_layers, c.n_layers),
        ("num_kv_heads", config.num_kv_heads, c.n_kv_heads),
        ("vocab_size", config.vocab_size, c.vocab_size),
    ];
    for (field, want, got) in hints {
        if let Some(want) = want
            && want != got
        {
            return Err(RuvLLMError::Config(format!(
                "spinfer: model '{model_id}': ModelConfig::{field} is {want} but the model's is {got}"
            )));
        }
    }
    Ok(())
}

/// One generation through spinfer's library API, errors in RuvLLM's terms.
fn generate(
    engine: &Engine,
    prompt: &str,
    params: &generate::GenerateParams,
    on_text: impl FnMut(&str) -> ControlFlow<()>,
) -> ruvllm::Result<Output> {
    engine.generate_stream(prompt, params, on_text).map_err(|e| convert::runtime_error("generate", e))
}

/// A streamed piece of text. spinfer streams text as it becomes final
/// (valid UTF-8, clear of stop strings), not token by token, so `id` is 0.
fn piece(text: &str) -> GeneratedToken {
    GeneratedToken { id: 0, text: text.to_string(), logprob: None, is_special: false }
}

impl LlmBackend for SpinferBackend {
    /// Loads `model_id` (see [`SpinferBackend`]). A model already loaded is
    /// replaced only once the new one has loaded: a failed load leaves it.
    fn load_model(&mut self, model_id: &str, config: ModelConfig) -> ruvllm::Result<()> {
        let (engine, configured) = self.load_engine(model_id, &config)?;
        check_hints(model_id, &config, &engine)?;
        let draft = self.options.draft.or(configured).unwrap_or_default();
        draft.validate().map_err(|e| RuvLLMError::Config(format!("spinfer: SpinferOptions::draft: {e}")))?;
        let info = convert::model_info(model_id, &engine);
        tracing::info!(
            model = model_id,
            params = info.num_parameters,
            ctx = info.max_context_length,
            sparse = engine.model.sparse.is_some(),
            "spinfer model loaded for RuvLLM"
        );
        let engine = Arc::new(engine);
        let tokenizer = SpinferTokenizer::new(Arc::clone(&engine));
        self.loaded = Some(Loaded { engine, tokenizer, info, draft });
        Ok(())
    }

    fn generate(&self, prompt: &str, params: GenerateParams) -> ruvllm::Result<String> {
        let loaded = self.loaded()?;
        let params = loaded.params(&params)?;
        Ok(generate(&loaded.engine, prompt, &params, |_| ControlFlow::Continue(()))?.text)
    }

    /// The pieces of [`generate_stream_v2`](LlmBackend::generate_stream_v2)
    /// as they come; a generation error ends the iteration with an `Err`.
    fn generate_stream(
        &self,
        prompt: &str,
        params: GenerateParams,
    ) -> ruvllm::Result<Box<dyn Iterator<Item = ruvllm::Result<GeneratedToken>> + Send + '_>> {
        let stream = self.generate_stream_v2(prompt, params)?;
        Ok(Box::new(stream.filter_map(|event| match event {
            Ok(StreamEvent::Token(t)) => Some(Ok(t)),
            Ok(StreamEvent::Done { .. }) => None,
            Ok(StreamEvent::Error(e)) => Some(Err(RuvLLMError::Generation(e))),
            Err(e) => Some(Err(e)),
        })))
    }

    /// Generates on a thread of its own and streams text pieces as they
    /// become final, then `Done` (or `Error`). Dropping the stream cancels
    /// the generation at the next token.
    fn generate_stream_v2(&self, prompt: &str, params: GenerateParams) -> ruvllm::Result<TokenStream> {
        let loaded = self.loaded()?;
        let (engine, params) = (Arc::clone(&loaded.engine), loaded.params(&params)?);
        let prompt = prompt.to_string();
        let (tx, stream) = TokenStream::channel();
        std::thread::Builder::new()
            .name("spinfer-ruvllm-stream".into())
            .spawn(move || {
                let start = Instant::now();
                let result = generate(&engine, &prompt, &params, |text| {
                    match tx.send(StreamEvent::Token(piece(text))) {
                        Ok(()) => ControlFlow::Continue(()),
                        Err(_) => ControlFlow::Break(()), // the stream was dropped
                    }
                });
                let event = match result {
                    Ok(g) => {
                        let secs = start.elapsed().as_secs_f64();
                        StreamEvent::Done {
                            total_tokens: g.tokens.len(),
                            duration_ms: (secs * 1000.0) as u64,
                            tokens_per_second: if secs > 0.0 { g.tokens.len() as f64 / secs } else { 0.0 },
                        }
                    }
                    Err(e) => StreamEvent::Error(e.to_string()),
                };
                let _ = tx.send(event);
            })
            .map_err(|e| RuvLLMError::Backend(format!("spinfer: cannot start the streaming thread: {e}")))?;
        Ok(stream)
    }

    /// spinfer's own decode loop: exact token counts and finish reason;
    /// `on_token` gets each text piece as it becomes final (`id` 0).
    fn generate_detailed(
        &self,
        prompt: &str,
        params: GenerateParams,
        on_token: &mut dyn FnMut(&GeneratedToken) -> bool,
    ) -> ruvllm::Result<GenerationOutput> {
        let loaded = self.loaded()?;
        let params = loaded.params(&params)?;
        let g = generate(&loaded.engine, prompt, &params, |text| {
            if on_token(&piece(text)) { ControlFlow::Continue(()) } else { ControlFlow::Break(()) }
        })?;
        let eos = usize::from(g.stop_reason == StopReason::EndOfGeneration);
        Ok(GenerationOutput {
            text: g.text,
            prompt_tokens: g.metrics.prompt_tokens,
            completion_tokens: g.tokens.len() + eos,
            finish_reason: convert::finish_reason(g.stop_reason),
        })
    }

    /// Known from the vocabulary: ChatML (`<|im_start|>`, SmolLM2, Qwen),
    /// Llama 3 (`<|start_header_id|>`) or Gemma (`<start_of_turn>`) when
    /// the marker is a single token; otherwise `None`.
    fn chat_template(&self) -> Option<ChatTemplate> {
        let tok = &self.loaded.as_ref()?.engine.tokenizer;
        let single = |marker: &str| tok.encode(marker, false).is_ok_and(|ids| ids.len() == 1);
        if single("<|im_start|>") {
            Some(ChatTemplate::ChatML)
        } else if single("<|start_header_id|>") {
            Some(ChatTemplate::Llama3)
        } else if single("<start_of_turn>") {
            Some(ChatTemplate::Gemma)
        } else {
            None
        }
    }

    /// [`Engine::embed`]: the mean of the final-normed hidden states over
    /// the text's tokens (BOS included when the model adds one),
    /// L2-normalised, `hidden_size` floats. Texts longer than the context
    /// are cut to it.
    fn get_embeddings(&self, text: &str) -> ruvllm::Result<Vec<f32>> {
        self.loaded()?.engine.embed(text).map_err(|e| convert::runtime_error("embeddings", e))
    }

    fn tokenizer(&self) -> Option<&dyn Tokenizer> {
        self.loaded.as_ref().map(|l| &l.tokenizer as &dyn Tokenizer)
    }

    fn is_model_loaded(&self) -> bool {
        self.loaded.is_some()
    }

    fn model_info(&self) -> Option<ModelInfo> {
        self.loaded.as_ref().map(|l| l.info.clone())
    }

    /// Drops the engine (weights mapping, sessions). Streams still running
    /// keep it alive until they end.
    fn unload_model(&mut self) {
        self.loaded = None;
    }
}
