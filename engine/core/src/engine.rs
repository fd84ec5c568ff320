//! [`Engine`]: a loaded model with its tokenizer, the unit applications
//! hold on to. Immutable after loading and `Send + Sync`: every request
//! opens its own [`Session`] (KV cache and buffers), weights are shared.

use std::path::{Path, PathBuf};

use crate::gguf::GgufFile;
use crate::loader::Loader;
use crate::model::{Model, ModelOptions, Session};
use crate::registry::KernelRegistry;
use crate::safetensors::SafetensorsModel;
use crate::tokenizer::Tokenizer;
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
