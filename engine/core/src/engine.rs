//! [`Engine`]: a loaded model with its tokenizer, the unit applications
//! hold on to. Immutable after loading and `Send + Sync`: every request
//! opens its own [`Session`] (KV cache and buffers), weights are shared.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use spinfer_registry::{InstallRecord, PackKind, discover, verify_pack};

use crate::config::Config;
use crate::gguf::GgufFile;
use crate::loader::Loader;
use crate::model::{Model, ModelOptions, Session};
use crate::packs::{NativePack, WasmLimits, WasmPack, host_info};
use crate::registry::KernelProvider;
use crate::registry::KernelRegistry;
use crate::safetensors::SafetensorsModel;
use crate::tokenizer::Tokenizer;
use crate::tuning::HistoryStore;
use crate::{Error, Result};

pub struct Engine {
    pub model: Model,
    pub tokenizer: Tokenizer,
    path: PathBuf,
    file_size: usize,
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
        let path = path.as_ref();
        if !path.exists() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
            ));
        }
        // Weights first: a malformed model is reported before its tokenizer.
        let (loader, model, tokenizer) = if is_safetensors(path) {
            let st = SafetensorsModel::open(path)?;
            let model = Model::load(&st, registry, options)?;
            let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new(".")) };
            let tok = Tokenizer::from_json_file(&dir.join("tokenizer.json"))?;
            (Box::new(st) as Box<dyn Loader>, model, tok)
        } else {
            let g = GgufFile::open(path)?;
            let model = Model::load(&g, registry, options)?;
            let tok = Tokenizer::from_gguf(&g)?;
            (Box::new(g) as Box<dyn Loader>, model, tok)
        };
        if tokenizer.vocab_size() > model.config.vocab_size {
            return Err(Error::Tokenizer(format!(
                "{}: tokenizer has {} tokens but the model's vocabulary is {}",
                path.display(),
                tokenizer.vocab_size(),
                model.config.vocab_size
            )));
        }
        Ok(Self { model, tokenizer, path: path.to_path_buf(), file_size: loader.file_size() })
    }

    /// Loads the model an operator config names, with its packs, pins,
    /// exclusions and kernel history. Returns what happened to each pack
    /// found (a pack that fails verification or loading is skipped and
    /// reported, never fatal).
    pub fn from_config(config: &Config) -> Result<(Self, Vec<PackStatus>)> {
        let (registry, packs) = registry_from_config(config)?;
        let engine = Self::load_with(&config.model.path, config.model_options(), &registry)?;
        Ok((engine, packs))
    }

    pub fn path(&self) -> &Path {
        &self.path
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

/// A directory or a `.safetensors` file is read as a safetensors checkpoint.
pub fn is_safetensors(path: &Path) -> bool {
    path.is_dir() || path.extension().is_some_and(|e| e == "safetensors")
}

/// The outcome of one discovered pack.
#[derive(Clone, Debug)]
pub struct PackStatus {
    pub dir: PathBuf,
    /// The provider name (`name@version#hash`) it registered as, or why it
    /// was skipped.
    pub outcome: std::result::Result<String, String>,
}

/// The kernel registry an operator config describes: built-in kernels,
/// verified packs from `[packs]` (verify → downgrade check → open → ABI
/// check → score → register), pins, exclusions and the history store.
pub fn registry_from_config(c: &Config) -> Result<(KernelRegistry, Vec<PackStatus>)> {
    let mut registry = KernelRegistry::builtin();
    for (op, kernel) in &c.kernels.pin {
        registry.pin(op, kernel);
    }
    for name in &c.kernels.exclude {
        registry.exclude(name);
    }
    if let Some(h) = &c.packs.history {
        registry.set_history(HistoryStore::open(h)?);
    }
    let policy = c.trust_policy()?;
    let mut record = c.packs.install_record.as_ref().map(InstallRecord::open).transpose()?;
    let host = host_info();
    let limits = WasmLimits {
        max_memory_bytes: usize::try_from(c.wasm.max_memory_mb.saturating_mul(1 << 20)).unwrap_or(usize::MAX),
        timeout_ms: c.wasm.timeout_ms,
        fuel: c.wasm.fuel,
    };
    let mut status = Vec::new();
    for found in discover(&c.packs.dirs) {
        let dir = match found {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("pack discovery: {e}");
                status.push(PackStatus { dir: PathBuf::new(), outcome: Err(e.to_string()) });
                continue;
            }
        };
        let mut load = || -> Result<Arc<dyn KernelProvider>> {
            let pack = verify_pack(&dir, &policy)?;
            let name = &pack.manifest().name;
            if c.kernels.exclude.contains(name) {
                return Err(Error::Pack { pack: pack.id(), detail: "excluded by [kernels] exclude".into() });
            }
            if let Some(record) = record.as_mut() {
                let pinned = c
                    .kernels
                    .pin
                    .values()
                    .any(|k| k.starts_with(&format!("{name}/")) || k.starts_with(&format!("{name}:")));
                record.check_and_record(&pack, pinned)?;
            }
            Ok(match pack.manifest().kind {
                PackKind::Native => Arc::new(NativePack::load(&pack, &host)?),
                PackKind::Wasm => Arc::new(WasmPack::load(&pack, limits)?),
                PackKind::Cuda => {
                    return Err(Error::Pack { pack: pack.id(), detail: "cuda packs are not supported yet".into() });
                }
            })
        };
        match load() {
            Ok(provider) => {
                tracing::info!(pack = provider.name(), "registered kernel pack");
                status.push(PackStatus { dir, outcome: Ok(provider.name().to_string()) });
                registry.add_provider(provider);
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), "pack skipped: {e}");
                status.push(PackStatus { dir, outcome: Err(e.to_string()) });
            }
        }
    }
    Ok((registry, status))
}
