//! [`Engine`]: a loaded model with its tokenizer, the unit applications
//! hold on to. Immutable after loading (but for its metrics counters) and
//! `Send + Sync`: every request opens its own [`Session`] (KV cache and
//! buffers), weights are shared.
//!
//! The library face, for applications that embed spinfer:
//! - [`Engine::generate`], [`Engine::generate_stream`] (a callback per
//!   piece of text; `ControlFlow::Break` cancels) and [`Engine::stream`] (an
//!   iterator of pieces; dropping it cancels);
//! - [`Engine::logits`], [`Engine::tokenize`], [`Engine::detokenize`];
//! - [`Engine::embed`] / [`Engine::embed_batch`]: sentence vectors from the
//!   decoder (mean of the final-normed hidden states, L2-normalised), also
//!   through [`crate::provider::EmbeddingProvider`];
//! - [`Engine::metrics`]: counters since load.
//!
//! ```no_run
//! use std::ops::ControlFlow;
//! use spinfer_engine::Engine;
//! use spinfer_engine::generate::GenerateParams;
//! use spinfer_engine::model::ModelOptions;
//! use spinfer_engine::sampling::SamplerParams;
//!
//! let engine = Engine::load("models/SmolLM2-135M-Instruct.Q4_1.gguf", ModelOptions::default())?;
//! let params = GenerateParams { max_tokens: 32, sampler: SamplerParams::greedy(), ..Default::default() };
//! let out = engine.generate_stream("The capital of France is", &params, |piece| {
//!     print!("{piece}");
//!     ControlFlow::Continue(())
//! })?;
//! println!("\n{:?}, {:.1} tokens/s", out.stop_reason, out.metrics.decode_tokens_per_second());
//! let v = engine.embed("a sentence")?; // unit length, engine.dimensions() wide
//! # let _ = v;
//! # Ok::<(), spinfer_engine::Error>(())
//! ```

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::config::Config;
use crate::generate::{self, GenerateParams, StopReason, Timings};
use crate::gguf::GgufFile;
use crate::grammar::{Grammars, Spec};
use crate::head::HeadIndex;
use crate::loader::Loader;
use crate::metrics::{Counters, ratio};
pub use crate::metrics::{KernelInfo, Metrics, Output, RequestMetrics};
use crate::model::bert::l2_normalize;
use crate::model::{Model, ModelOptions, Session};
use crate::registry::KernelRegistry;
use crate::registry::describe;
use crate::safetensors::SafetensorsModel;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

use spinfer_packs::PackLoader;
pub use spinfer_packs::PackStatus;

pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// The model's chat template (Jinja): GGUF `tokenizer.chat_template`,
    /// or `chat_template` of a checkpoint's `tokenizer_config.json`.
    chat_template: Option<String>,
    path: PathBuf,
    file_size: usize,
    /// Cumulative counters of the requests served (see [`Engine::metrics`]).
    counters: Mutex<Counters>,
    /// The vocabulary's tables for output constraints, built on first use.
    grammars: OnceLock<Grammars>,
}

const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Engine>();
};

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("path", &self.path)
            .field("arch", &self.model.config.arch)
            .field("dim", &self.model.config.dim)
            .field("tokenizer", &self.tokenizer)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Loads a GGUF file, or a safetensors checkpoint (a directory with
    /// `config.json` and `tokenizer.json`, or a `.safetensors` file beside
    /// them), with the built-in kernels.
    pub fn load(path: impl AsRef<Path>, options: ModelOptions) -> Result<Self> {
        Self::load_with(path, options, &KernelRegistry::builtin())
    }

    /// As [`Engine::load`], resolving kernels through `registry`.
    pub fn load_with(path: impl AsRef<Path>, options: ModelOptions, registry: &KernelRegistry) -> Result<Self> {
        Self::open(path.as_ref(), options, registry, &[])
    }

    /// As [`Engine::load_with`]; a path the built-in formats cannot read is
    /// opened with the best-scoring of `loaders` (a pack's), if one reads it.
    fn open(path: &Path, options: ModelOptions, registry: &KernelRegistry, loaders: &[PackLoader]) -> Result<Self> {
        if !path.exists() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        // Weights first: a malformed model is reported before its tokenizer.
        let (loader, model, tokenizer, chat_template) = if let Some(pack) = pack_loader_for(path, loaders) {
            tracing::info!(path = %path.display(), loader = pack.name(), "opening the model with a pack's loader");
            let m = pack.open(path)?;
            let model = Model::load(&m, registry, options)?;
            let tok = Tokenizer::from_json_file(&path.join("tokenizer.json"))?;
            let template = chat_template_of_dir(path)?;
            (Box::new(m) as Box<dyn Loader>, model, tok, template)
        } else if is_safetensors(path) {
            let st = SafetensorsModel::open(path)?;
            let model = Model::load(&st, registry, options)?;
            let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new(".")) };
            let tok = Tokenizer::from_json_file(&dir.join("tokenizer.json"))?;
            let template = chat_template_of_dir(dir)?;
            (Box::new(st) as Box<dyn Loader>, model, tok, template)
        } else {
            let g = GgufFile::open(path)?;
            let model = Model::load(&g, registry, options)?;
            let tok = Tokenizer::from_gguf(&g)?;
            let template = g.get("tokenizer.chat_template").and_then(|v| v.as_str()).map(str::to_string);
            (Box::new(g) as Box<dyn Loader>, model, tok, template)
        };
        if tokenizer.vocab_size() > model.config.vocab_size {
            return Err(Error::Tokenizer(format!(
                "{}: tokenizer has {} tokens but the model's vocabulary is {}",
                path.display(),
                tokenizer.vocab_size(),
                model.config.vocab_size
            )));
        }
        Ok(Self {
            model,
            tokenizer,
            chat_template,
            path: path.to_path_buf(),
            file_size: loader.file_size(),
            counters: Mutex::new(Counters::default()),
            grammars: OnceLock::new(),
        })
    }

    /// Loads the model an operator config names, with its packs, pins,
    /// exclusions and kernel history. Returns what happened to each pack
    /// found (a pack that fails verification or loading is skipped and
    /// reported, never fatal).
    pub fn from_config(config: &Config) -> Result<(Self, Vec<PackStatus>)> {
        let spinfer_packs::LoadedPacks { registry, loaders, status: packs } =
            spinfer_packs::load_packs(&config.packs, &config.kernels, &config.wasm, &config.cuda)?;
        let mut engine = Self::open(&config.model.path, config.model_options(), &registry, &loaders)?;
        if let Some(h) = &config.head
            && h.mode == crate::config::HeadMode::Sparse
        {
            let path = h.index.as_deref().ok_or_else(|| {
                Error::InvalidArgument("head.mode = \"sparse\" needs head.index (spinfer calibrate-head)".into())
            })?;
            engine.model.release_dense_head();
            let index = HeadIndex::load(path, &HeadIndex::model_of(&engine.model))?;
            let probes = h.probes.unwrap_or(index.default_probes());
            engine.model.set_sparse_head(Some(index), probes, &registry)?;
        }
        Ok((engine, packs))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's chat template (Jinja source), if it ships one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Bytes of the model's weight files.
    pub fn file_size(&self) -> usize {
        self.file_size
    }

    /// A fresh session (empty KV cache) for one request.
    pub fn new_session(&self) -> Session {
        self.model.new_session()
    }
}

/// The library API: generation, streaming, logits, tokenization,
/// embeddings and metrics. Every call opens its own [`Session`], so one
/// `Engine` (e.g. in an `Arc`) serves any number of threads at once; the
/// results do not depend on what other threads do.
impl Engine {
    /// Compiles an output constraint (a JSON schema, a grammar, a regular
    /// expression, choices) for this model, to set as
    /// [`GenerateParams::constraint`]. The vocabulary's tables are built on
    /// the first call (tens of milliseconds; about a second for a
    /// 262,144-token vocabulary). A spec that does not compile is an
    /// [`Error::Grammar`] naming the fault.
    pub fn constraint(&self, spec: &Spec) -> Result<crate::sampling::ConstraintSource> {
        let grammars = match self.grammars.get() {
            Some(g) => g,
            None => {
                let t0 = Instant::now();
                let built = Grammars::new(&self.tokenizer, self.model.config.vocab_size)?;
                tracing::info!(
                    took_ms = t0.elapsed().as_secs_f64() * 1e3,
                    "vocabulary prepared for output constraints"
                );
                self.grammars.get_or_init(|| built)
            }
        };
        Ok(grammars.compile(spec)?.source())
    }

    /// Generates a continuation of `prompt` (see [`Engine::generate_stream`]
    /// for the rules) and returns it whole.
    pub fn generate(&self, prompt: &str, params: &GenerateParams) -> Result<Output> {
        self.generate_stream(prompt, params, |_| ControlFlow::Continue(()))
    }

    /// Generates a continuation of `prompt`, handing each piece of text to
    /// `on_piece` as soon as it is final (valid UTF-8, never part of a stop
    /// string). Returning `ControlFlow::Break(())` cancels: generation stops
    /// at once with [`StopReason::Cancelled`], and the returned text holds
    /// the pieces streamed so far.
    ///
    /// The prompt is tokenized with BOS when `params.add_bos` (default: the
    /// tokenizer's choice) says so. A prompt with no tokens (the empty
    /// string, for a tokenizer that adds no BOS, as SmolLM2's) is an
    /// [`Error::InvalidArgument`]; a prompt longer than the context is an
    /// [`Error::ContextOverflow`].
    pub fn generate_stream(
        &self,
        prompt: &str,
        params: &GenerateParams,
        mut on_piece: impl FnMut(&str) -> ControlFlow<()>,
    ) -> Result<Output> {
        let t0 = Instant::now();
        let mut session = self.new_session();
        let generation = generate::generate(&self.model, &self.tokenizer, &mut session, prompt, params, &mut on_piece);
        let generation = match generation {
            Ok(g) => g,
            Err(e) => {
                self.counters().errors += 1;
                return Err(e.into());
            }
        };
        let sparse = self.sparse_counts(&session);
        let metrics = RequestMetrics {
            prompt_tokens: generation.prompt_tokens,
            generated_tokens: generation.tokens.len(),
            timings: generation.timings,
            total: t0.elapsed(),
            sparse_kept_fraction: sparse.map(|(active, slots)| ratio(active, slots)),
            draft: generation.draft,
        };
        {
            let mut c = self.counters();
            c.requests += 1;
            c.generate_requests += 1;
            c.cancelled += u64::from(generation.stop_reason == StopReason::Cancelled);
            c.prompt_tokens += generation.prompt_tokens as u64;
            c.generated_tokens += generation.tokens.len() as u64;
            c.decoded_tokens += generation.tokens.len().saturating_sub(1) as u64;
            c.draft_tokens += generation.draft.drafted as u64;
            c.draft_accepted_tokens += generation.draft.accepted as u64;
            c.add_timings(&generation.timings);
            if let Some((active, slots)) = sparse {
                c.sparse_active += active;
                c.sparse_slots += slots;
            }
            c.add_storage(&session);
        }
        Ok(Output { text: generation.text, tokens: generation.tokens, stop_reason: generation.stop_reason, metrics })
    }

    /// Generation as an iterator of text pieces, run on a thread of its own
    /// (hence `Arc<Engine>`). Dropping the iterator cancels the generation
    /// (it stops before its next token; the drop waits for that). An error
    /// is the last item; after the last item, [`TextStream::output`] holds
    /// the whole [`Output`]. Panics only if the OS refuses a new thread.
    pub fn stream(self: &Arc<Self>, prompt: &str, params: &GenerateParams) -> TextStream {
        // A small buffer lets the generator run ahead of a slow reader by a
        // few pieces; a dropped receiver fails the next send, which cancels.
        let (tx, rx): (SyncSender<StreamMsg>, Receiver<StreamMsg>) = sync_channel(16);
        let (engine, prompt, params) = (Arc::clone(self), prompt.to_owned(), params.clone());
        let handle = std::thread::Builder::new()
            .name("spinfer-stream".into())
            .spawn(move || {
                let r =
                    engine.generate_stream(&prompt, &params, |piece| match tx.send(StreamMsg::Piece(piece.into())) {
                        Ok(()) => ControlFlow::Continue(()),
                        Err(_) => ControlFlow::Break(()),
                    });
                let _ = tx.send(StreamMsg::Done(Box::new(r)));
            })
            .expect("spawning the generation thread");
        TextStream { rx: Some(rx), handle: Some(handle), output: None }
    }

    /// The logits (`vocab` values) after the last of `tokens`, run from an
    /// empty cache. An empty slice or an id outside the model's vocabulary
    /// is an [`Error::InvalidArgument`], more tokens than the context an
    /// [`Error::ContextOverflow`].
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let r = self.logits_inner(tokens);
        let mut c = self.counters();
        match &r {
            Ok(_) => {
                c.requests += 1;
                c.prompt_tokens += tokens.len() as u64;
            }
            Err(_) => c.errors += 1,
        }
        r
    }

    fn logits_inner(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument("logits need at least one token".into()));
        }
        self.check_ids(tokens)?;
        let mut session = self.new_session();
        let t = Instant::now();
        let logits = self.model.forward_last(&mut session, tokens)?.to_vec();
        let elapsed = t.elapsed();
        let sparse = self.sparse_counts(&session);
        let mut c = self.counters();
        c.prefill += elapsed;
        if let Some((active, slots)) = sparse {
            c.sparse_active += active;
            c.sparse_slots += slots;
        }
        c.add_storage(&session);
        Ok(logits)
    }

    /// Token ids of `text`, with BOS first when the tokenizer adds one by
    /// default (as [`Engine::generate`] does with default parameters).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(text, self.tokenizer.add_bos_default())?)
    }

    /// The text of `ids`; an id outside the vocabulary is an error.
    pub fn detokenize(&self, ids: &[u32]) -> Result<String> {
        Ok(self.tokenizer.decode(ids)?)
    }

    /// Width of [`Engine::embed`]'s vectors: the model's hidden size.
    pub fn dimensions(&self) -> usize {
        self.model.config.dim
    }

    /// A sentence embedding from the decoder: `text` is tokenized as
    /// [`Engine::tokenize`] does, run from an empty cache, and the
    /// final-normed hidden states (the output projection's input) are
    /// averaged over all its tokens (BOS included when the tokenizer adds
    /// one), then scaled to unit L2 norm. [`Engine::dimensions`] values.
    ///
    /// Texts longer than the context are cut to it (with a warning). A text
    /// with no tokens (the empty string, without BOS) is an
    /// [`Error::InvalidArgument`].
    pub fn embed(&self, text: &str) -> Result<Vec<f32>> {
        Ok(self.embed_batch(&[text])?.pop().unwrap_or_default())
    }

    /// [`Engine::embed`] for several texts, in order (one session reused).
    /// Fails as a whole if any text fails.
    pub fn embed_batch(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let r = self.embed_batch_inner(texts);
        if r.is_err() {
            self.counters().errors += 1;
        }
        r
    }

    fn embed_batch_inner(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::with_capacity(texts.len());
        let mut session: Option<Session> = None;
        for text in texts {
            let t0 = Instant::now();
            let mut ids = self.tokenize(text)?;
            let tokenize = t0.elapsed();
            if ids.is_empty() {
                return Err(Error::InvalidArgument("cannot embed a text with no tokens (the empty string)".into()));
            }
            let s = session.get_or_insert_with(|| self.new_session());
            let truncated = ids.len() > s.ctx();
            if truncated {
                tracing::warn!(tokens = ids.len(), ctx = s.ctx(), "text cut to the context size for embedding");
                ids.truncate(s.ctx());
            }
            s.reset();
            s.reset_sparsity_stats();
            let t1 = Instant::now();
            self.model.forward(s, &ids)?;
            let hidden = self.model.hidden_states(s, 0..ids.len());
            let dim = self.dimensions();
            let mut v = vec![0.0f32; dim];
            for row in hidden.chunks_exact(dim) {
                for (a, &h) in v.iter_mut().zip(row) {
                    *a += h;
                }
            }
            let inv = 1.0 / ids.len() as f32;
            v.iter_mut().for_each(|a| *a *= inv);
            l2_normalize(&mut v);
            let prefill = t1.elapsed();
            let sparse = self.sparse_counts(s);
            {
                let mut c = self.counters();
                c.requests += 1;
                c.embed_requests += 1;
                c.truncated_inputs += u64::from(truncated);
                c.prompt_tokens += ids.len() as u64;
                c.tokenize += tokenize;
                c.prefill += prefill;
                if let Some((active, slots)) = sparse {
                    c.sparse_active += active;
                    c.sparse_slots += slots;
                }
                c.add_storage(s);
            }
            out.push(v);
        }
        Ok(out)
    }

    /// Counters since load: requests, tokens, time per phase, the sparse
    /// FFN's mean kept fraction (when the model runs sparse) and the kernel
    /// chosen for each operation.
    pub fn metrics(&self) -> Metrics {
        let c = self.counters().clone();
        let kernels = self
            .model
            .kernel_choices()
            .into_iter()
            .map(|l| KernelInfo {
                op: describe(&l.desc),
                tensor: l.name.clone(),
                kernel: l.kernel_name().to_string(),
                provider: l.provider().to_string(),
                choice: l.choice().to_string(),
                fell_back: l.fell_back(),
            })
            .collect();
        Metrics {
            requests: c.requests,
            generate_requests: c.generate_requests,
            embed_requests: c.embed_requests,
            cancelled: c.cancelled,
            errors: c.errors,
            prompt_tokens: c.prompt_tokens,
            generated_tokens: c.generated_tokens,
            decoded_tokens: c.decoded_tokens,
            draft_tokens: c.draft_tokens,
            draft_accepted_tokens: c.draft_accepted_tokens,
            timings: Timings { tokenize: c.tokenize, prefill: c.prefill, decode: c.decode, sample: c.sample },
            sparse_kept_fraction: self.model.sparse.as_ref().map(|_| ratio(c.sparse_active, c.sparse_slots)),
            storage: c.storage,
            kernels,
            truncated_inputs: c.truncated_inputs,
        }
    }

    fn counters(&self) -> MutexGuard<'_, Counters> {
        // The counters are plain numbers: a panic elsewhere cannot leave
        // them inconsistent enough to matter.
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `(neurons kept, neurons available)` summed over the session's
    /// tokens and layers, when the model runs sparse.
    fn sparse_counts(&self, s: &Session) -> Option<(u64, u64)> {
        self.model.sparse.as_ref()?;
        let st = s.sparsity_stats();
        let (active, tokens) = st.layers.iter().fold((0u64, 0u64), |(a, t), c| (a + c.active, t + c.tokens));
        Some((active, tokens * st.ffn_dim as u64))
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => Err(Error::InvalidArgument(format!("token id {id} is outside the vocabulary (size {vocab})"))),
            None => Ok(()),
        }
    }
}

enum StreamMsg {
    Piece(String),
    Done(Box<Result<Output>>),
}

/// The pieces of one generation, from [`Engine::stream`]. Dropping it
/// cancels the generation.
pub struct TextStream {
    rx: Option<Receiver<StreamMsg>>,
    handle: Option<JoinHandle<()>>,
    output: Option<Output>,
}

impl TextStream {
    /// The finished generation's [`Output`], once the iterator has ended
    /// without an error.
    pub fn output(&self) -> Option<&Output> {
        self.output.as_ref()
    }

    /// Waits for the generation thread; a panic there is re-raised here.
    fn finish(&mut self) {
        self.rx = None;
        if let Some(h) = self.handle.take()
            && let Err(panic) = h.join()
        {
            std::panic::resume_unwind(panic);
        }
    }
}

impl Iterator for TextStream {
    type Item = Result<String>;

    fn next(&mut self) -> Option<Result<String>> {
        let msg = self.rx.as_ref()?.recv();
        match msg {
            Ok(StreamMsg::Piece(piece)) => Some(Ok(piece)),
            Ok(StreamMsg::Done(r)) => {
                self.finish();
                match *r {
                    Ok(out) => {
                        self.output = Some(out);
                        None
                    }
                    Err(e) => Some(Err(e)),
                }
            }
            // The thread ended without a result: it panicked.
            Err(_) => {
                self.finish();
                None
            }
        }
    }
}

impl Drop for TextStream {
    fn drop(&mut self) {
        // Disconnect first: the generator's next send fails and it stops.
        self.rx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl std::fmt::Debug for TextStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextStream").field("finished", &self.rx.is_none()).finish_non_exhaustive()
    }
}

/// The pack loader that opens `path`: none when a built-in format reads it
/// (a GGUF file, a safetensors file or checkpoint directory), else the one
/// whose `probe` scores highest (the first on ties), if any scores above 0.
fn pack_loader_for<'a>(path: &Path, loaders: &'a [PackLoader]) -> Option<&'a PackLoader> {
    let builtin = if path.is_dir() {
        ["model.safetensors", "model.safetensors.index.json"].iter().any(|f| path.join(f).is_file())
    } else {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let mut magic = [0u8; 4];
        let gguf = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic)).is_ok()
            && &magic == b"GGUF";
        gguf || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json")
    };
    if builtin {
        return None;
    }
    let mut best: Option<(u32, &PackLoader)> = None;
    for l in loaders {
        let score = l.probe(path);
        if score > 0 && best.is_none_or(|(b, _)| score > b) {
            best = Some((score, l));
        }
    }
    best.map(|(_, l)| l)
}

/// A directory or a `.safetensors` file is read as a safetensors checkpoint.
/// Largest `tokenizer_config.json` read for its chat template.
const MAX_TOKENIZER_CONFIG: u64 = 16 << 20;

/// `chat_template` of `dir/tokenizer_config.json`, if the file exists and
/// has one (a string; the list form of older checkpoints is not read).
fn chat_template_of_dir(dir: &Path) -> Result<Option<String>> {
    let path = dir.join("tokenizer_config.json");
    let Ok(meta) = std::fs::metadata(&path) else { return Ok(None) };
    if meta.len() > MAX_TOKENIZER_CONFIG {
        return Err(Error::format(&path, format!("{} bytes: larger than {MAX_TOKENIZER_CONFIG}", meta.len())));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Error::format(&path, format!("invalid JSON: {e}")))?;
    Ok(v.get("chat_template").and_then(|t| t.as_str()).map(str::to_string))
}

pub fn is_safetensors(path: &Path) -> bool {
    path.is_dir() || path.extension().is_some_and(|e| e == "safetensors")
}

/// The kernel registry an operator config describes: see
/// [`spinfer_packs::load_registry`].
pub fn registry_from_config(c: &Config) -> Result<(KernelRegistry, Vec<PackStatus>)> {
    Ok(spinfer_packs::load_registry(&c.packs, &c.kernels, &c.wasm, &c.cuda)?)
}
