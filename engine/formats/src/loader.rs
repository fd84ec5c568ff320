//! The narrow interface between model code and weight files.
//!
//! A [`Loader`] hands out tensors by their canonical (GGUF) name and
//! describes the model's hyper-parameters; the model code never knows which
//! file format it reads. Implementations: [`crate::gguf::GgufFile`] and
//! [`crate::safetensors::SafetensorsModel`]; a loader pack's loaders are
//! adapted to it by the packs crate.

use std::path::Path;

use spinfer_kernels::dequant::dequantize_row;

use crate::config::ModelConfig;
use crate::tensor::TensorView;
use crate::{Error, Result};

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

/// Checks a tensor's GGML-order dims.
pub fn check_dims(loader: &dyn Loader, t: &TensorView, want: &[usize]) -> Result<()> {
    if t.dims != want {
        return Err(Error::TensorShape {
            path: loader.path().to_path_buf(),
            tensor: t.name.clone(),
            got: t.dims.clone(),
            want: want.to_vec(),
        });
    }
    Ok(())
}

/// A 1-D tensor of `len` elements as f32 (norm weights, biases).
pub fn load_vector(loader: &dyn Loader, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = loader.tensor(name)?;
    check_dims(loader, &t, &[len])?;
    let mut out = vec![0.0; len];
    dequantize_row(t.ty, t.data.bytes(), &mut out).map_err(|e| Error::TensorType {
        path: loader.path().to_path_buf(),
        tensor: name.into(),
        ty: t.ty.to_string(),
        what: format!("cannot be read as a vector: {e}"),
    })?;
    Ok(out)
}
