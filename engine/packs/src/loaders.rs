//! Model-file loaders from native packs (`PackModule::loaders`): the host
//! asks each for its score on a path (`probe`) and opens the model with the
//! best one when its own formats (GGUF, safetensors) cannot read it.
//! [`PackModel`] adapts the pack's `TensorFile` to the engine's
//! [`spinfer_formats::Loader`]: tensor names mapped to the canonical ones,
//! every size checked against the tensor's type and shape before it is
//! allocated, the hyper-parameters read from the `config.json` the pack
//! serves as metadata.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use spinfer_formats::bounded::MAX_CONFIG_BYTES;
use spinfer_formats::safetensors::{config_from_hf, hf_to_canonical};
use spinfer_formats::tensor::{TensorData, TensorView};
use spinfer_formats::{Error as FileError, Loader, ModelConfig, Result as FileResult};
use spinfer_kernels::GgmlType;
use spinfer_plugin_api::abi_stable::std_types::{ROption, RSliceMut};
use spinfer_plugin_api::{LoaderBox, TensorFileBox};

use crate::host::ggml_type;

/// One pack loader, named `"<pack>/<loader>"`.
pub struct PackLoader {
    name: String,
    loader: Arc<LoaderBox>,
}

impl PackLoader {
    pub(crate) fn new(pack: &str, loader: LoaderBox) -> Self {
        Self { name: format!("{pack}/{}", loader.name()), loader: Arc::new(loader) }
    }

    /// `"<pack>/<loader>"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How well the loader reads `path`: 0 if it cannot.
    pub fn probe(&self, path: &Path) -> u32 {
        path.to_str().map_or(0, |p| self.loader.probe(p.into()))
    }

    /// Opens `path` through the pack.
    ///
    /// # Errors
    ///
    /// [`FileError::Format`] naming the path and the loader when the pack
    /// refuses the file or lists a tensor whose size does not match its type
    /// and shape, or two tensors with one name.
    pub fn open(&self, path: &Path) -> FileResult<PackModel> {
        let err = |detail: String| FileError::format(path, format!("loader {}: {detail}", self.name));
        let text = path.to_str().ok_or_else(|| err("the path is not UTF-8".into()))?;
        let file = self.loader.open(text.into()).into_result().map_err(|e| err(e.to_string()))?;
        PackModel::new(path, &self.name, file)
    }
}

/// A tensor as the pack lists it, checked.
struct Entry {
    /// The name the pack knows it by.
    stored: String,
    ty: GgmlType,
    /// GGML order (innermost first).
    dims: Vec<usize>,
    n_bytes: usize,
}

/// A model opened by a pack loader.
pub struct PackModel {
    path: PathBuf,
    loader: String,
    file: TensorFileBox,
    /// Canonical name → tensor.
    tensors: HashMap<String, Entry>,
    /// Canonical names in the pack's order.
    order: Vec<String>,
}

impl PackModel {
    fn new(path: &Path, loader: &str, file: TensorFileBox) -> FileResult<Self> {
        let err = |detail: String| FileError::format(path, format!("loader {loader}: {detail}"));
        let (mut tensors, mut order) = (HashMap::new(), Vec::new());
        for info in file.tensors() {
            let stored = info.name.to_string();
            let ty = ggml_type(info.wtype)
                .ok_or_else(|| err(format!("tensor {stored:?} has weight type {} (no host type)", info.wtype.0)))?;
            let mut dims = info
                .shape
                .iter()
                .map(|&d| usize::try_from(d).map_err(|_| err(format!("tensor {stored:?}: dimension {d} is too large"))))
                .collect::<FileResult<Vec<usize>>>()?;
            if dims.is_empty() {
                dims.push(1);
            }
            let want = dims[1..]
                .iter()
                .fold(ty.row_bytes(dims[0]).ok(), |n, &d| n.and_then(|n| n.checked_mul(d)))
                .ok_or_else(|| err(format!("tensor {stored:?}: shape {dims:?} is not a whole number of {ty} rows")))?;
            if u64::try_from(want).ok() != Some(info.n_bytes) {
                return Err(err(format!(
                    "tensor {stored:?}: {} bytes listed, its {ty} shape {dims:?} needs {want}",
                    info.n_bytes
                )));
            }
            let name = hf_to_canonical(&stored).unwrap_or_else(|| stored.clone());
            if tensors.contains_key(&name) {
                return Err(err(format!("two tensors are named {name:?}")));
            }
            order.push(name.clone());
            tensors.insert(name, Entry { stored, ty, dims, n_bytes: want });
        }
        Ok(Self { path: path.to_path_buf(), loader: loader.to_string(), file, tensors, order })
    }

    /// The loader that opened it (`"<pack>/<loader>"`).
    pub fn loader_name(&self) -> &str {
        &self.loader
    }

    fn err(&self, detail: String) -> FileError {
        FileError::format(&self.path, format!("loader {}: {detail}", self.loader))
    }
}

impl Loader for PackModel {
    fn path(&self) -> &Path {
        &self.path
    }

    /// From the Hugging Face `config.json` the pack serves as metadata.
    fn config(&self) -> FileResult<ModelConfig> {
        let ROption::RSome(text) = self.file.metadata("config.json".into()) else {
            return Err(self.err("serves no config.json (metadata key \"config.json\")".into()));
        };
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(self.err(format!("config.json of {} bytes (at most {MAX_CONFIG_BYTES})", text.len())));
        }
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| self.err(format!("config.json: invalid json: {e}")))?;
        let serde_json::Value::Object(map) = json else {
            return Err(self.err("config.json is not a JSON object".into()));
        };
        let dims = |n: &str| Ok(self.tensors.get(n).map(|e| e.dims.clone()));
        config_from_hf(&self.path, &map, &self.order, &dims)
    }

    fn tensor(&self, name: &str) -> FileResult<TensorView> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| FileError::MissingTensor { path: self.path.clone(), tensor: name.into() })?;
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(e.n_bytes)
            .map_err(|_| self.err(format!("tensor {:?}: {} bytes do not fit in memory", e.stored, e.n_bytes)))?;
        bytes.resize(e.n_bytes, 0);
        self.file
            .read_tensor(e.stored.as_str().into(), RSliceMut::from_mut_slice(&mut bytes))
            .into_result()
            .map_err(|err| self.err(format!("reading tensor {:?}: {err}", e.stored)))?;
        Ok(TensorView { name: name.to_string(), ty: e.ty, dims: e.dims.clone(), data: TensorData::owned(bytes) })
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn tensor_names(&self) -> Vec<String> {
        self.order.clone()
    }

    fn file_size(&self) -> usize {
        self.tensors.values().map(|e| e.n_bytes).sum()
    }
}
