//! The narrow interface between model code and weight files.
//!
//! A [`Loader`] hands out tensors by their canonical (GGUF) name and
//! describes the model's hyper-parameters; the model code never knows which
//! file format it reads. Implementations: [`crate::gguf::GgufFile`] and
//! [`crate::safetensors::SafetensorsModel`]. The plugin API will stabilise
//! this trait for third-party loaders.

use std::path::Path;

use crate::Result;
use crate::model::config::ModelConfig;
use crate::tensor::TensorView;

pub trait Loader: Send + Sync {
    /// The file or directory the weights come from (for error messages).
    fn path(&self) -> &Path;

    /// Hyper-parameters read from the file's metadata or `config.json`.
    fn config(&self) -> Result<ModelConfig>;

    /// The tensor with canonical GGUF name `name` (e.g. `blk.0.attn_q.weight`),
    /// or [`crate::Error::MissingTensor`].
    fn tensor(&self, name: &str) -> Result<TensorView>;

    /// Whether a tensor exists (for optional tensors such as biases).
    fn has_tensor(&self, name: &str) -> bool;

    /// Canonical names of all tensors, in file order.
    fn tensor_names(&self) -> Vec<String>;

    /// Total bytes of the weight files (for memory reports).
    fn file_size(&self) -> usize;
}

impl Loader for crate::gguf::GgufFile {
    fn path(&self) -> &Path {
        crate::gguf::GgufFile::path(self)
    }

    fn config(&self) -> Result<ModelConfig> {
        ModelConfig::from_gguf(self)
    }

    fn tensor(&self, name: &str) -> Result<TensorView> {
        crate::gguf::GgufFile::tensor(self, name)
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.tensor_info(name).is_some()
    }

    fn tensor_names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.name.clone()).collect()
    }

    fn file_size(&self) -> usize {
        crate::gguf::GgufFile::file_size(self)
    }
}
