//! `loader-npy`, the reference loader pack: it teaches spinfer a model
//! format the host does not know, through the pack ABI's `Loader` and
//! `TensorFile`.
//!
//! The format: a directory holding the model's Hugging Face `config.json`
//! (and `tokenizer.json`), and one NumPy `.npy` file per tensor, named by
//! its Hugging Face name (`model.layers.0.self_attn.q_proj.weight.npy`),
//! f32 or f16, in C order. [`npy`] checks every header against its file
//! before the pack lists the tensor; the host maps the names to its own and
//! reads the hyper-parameters from `config.json` (the `metadata` key
//! `config.json`).

pub mod npy;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use spinfer_plugin_api::abi_stable::export_root_module;
use spinfer_plugin_api::abi_stable::prefix_type::PrefixTypeTrait;
use spinfer_plugin_api::abi_stable::sabi_extern_fn;
use spinfer_plugin_api::abi_stable::sabi_trait::TD_Opaque;
use spinfer_plugin_api::abi_stable::std_types::{RErr, ROk, ROption, RResult, RSliceMut, RStr, RString, RVec};
use spinfer_plugin_api::{
    ABI_VERSION, HostInfo, KernelBox, Loader, Loader_TO, LoaderBox, PackError, PackErrorKind, PackModule,
    PackModuleRef, TensorFile, TensorFile_TO, TensorFileBox, TensorInfo, WeightType,
};

/// The pack's name (its manifest's too).
pub const PACK_NAME: &str = "loader-npy";
/// The loader's name (listed in the manifest's `[[loaders]]`).
pub const LOADER_NAME: &str = "npy_dir";
/// Largest `config.json` served as metadata.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Reads directories of `.npy` tensors.
pub struct NpyLoader;

impl Loader for NpyLoader {
    fn name(&self) -> RString {
        LOADER_NAME.into()
    }

    /// 10 for a directory with a `config.json` and at least one `.npy` file
    /// (a cheap look at the listing), else 0.
    fn probe(&self, path: RStr<'_>) -> u32 {
        let dir = Path::new(path.as_str());
        if !dir.join("config.json").is_file() {
            return 0;
        }
        let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
        let any = entries.flatten().any(|e| e.path().extension().is_some_and(|x| x == "npy"));
        if any { 10 } else { 0 }
    }

    fn open(&self, path: RStr<'_>) -> RResult<TensorFileBox, PackError> {
        match NpyDir::open(Path::new(path.as_str())) {
            Ok(d) => ROk(TensorFile_TO::from_value(d, TD_Opaque)),
            Err(e) => RErr(e),
        }
    }
}

/// An opened directory: every `.npy` file's checked header.
pub struct NpyDir {
    dir: PathBuf,
    /// Tensor name → (file, header), in name order.
    tensors: BTreeMap<String, (PathBuf, npy::Header)>,
}

impl NpyDir {
    /// Lists and checks every `.npy` file of `dir`.
    ///
    /// # Errors
    ///
    /// `NotFound`/`Io` when the directory cannot be read, `InvalidArgument`
    /// naming the first bad file.
    pub fn open(dir: &Path) -> Result<Self, PackError> {
        let entries = std::fs::read_dir(dir).map_err(|e| io_error(dir, &e))?;
        let mut tensors = BTreeMap::new();
        for entry in entries {
            let path = entry.map_err(|e| io_error(dir, &e))?.path();
            if path.extension().is_none_or(|x| x != "npy") {
                continue;
            }
            let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_string) else {
                return Err(PackError::invalid_argument(format!("{}: not a UTF-8 file name", path.display())));
            };
            let header = npy::read_header(&path).map_err(PackError::invalid_argument)?;
            tensors.insert(name, (path, header));
        }
        if tensors.is_empty() {
            return Err(PackError::invalid_argument(format!("{}: no .npy tensors", dir.display())));
        }
        Ok(Self { dir: dir.to_path_buf(), tensors })
    }
}

fn io_error(path: &Path, e: &std::io::Error) -> PackError {
    let msg = format!("{}: {e}", path.display());
    if e.kind() == std::io::ErrorKind::NotFound {
        PackError::not_found(msg)
    } else {
        PackError::new(PackErrorKind::IO, msg)
    }
}

impl TensorFile for NpyDir {
    fn tensors(&self) -> RVec<TensorInfo> {
        self.tensors
            .iter()
            .map(|(name, (_, h))| TensorInfo {
                name: name.as_str().into(),
                wtype: match h.dtype {
                    npy::Dtype::F32 => WeightType::F32,
                    npy::Dtype::F16 => WeightType::F16,
                },
                // GGUF order: innermost first.
                shape: h.shape.iter().rev().copied().collect(),
                n_bytes: h.data_len,
            })
            .collect()
    }

    fn metadata(&self, key: RStr<'_>) -> ROption<RString> {
        match key.as_str() {
            "format" => ROption::RSome(LOADER_NAME.into()),
            "config.json" => {
                let path = self.dir.join("config.json");
                let fits = std::fs::metadata(&path).is_ok_and(|m| m.len() <= MAX_CONFIG_BYTES);
                match std::fs::read_to_string(&path) {
                    Ok(text) if fits => ROption::RSome(text.into()),
                    _ => ROption::RNone,
                }
            }
            _ => ROption::RNone,
        }
    }

    fn read_tensor(&self, name: RStr<'_>, mut out: RSliceMut<'_, u8>) -> RResult<(), PackError> {
        let Some((path, h)) = self.tensors.get(name.as_str()) else {
            return RErr(PackError::not_found(format!("no tensor {:?} in {}", name.as_str(), self.dir.display())));
        };
        if out.len() as u64 != h.data_len {
            return RErr(PackError::invalid_argument(format!(
                "{}: {} bytes asked, the tensor has {}",
                path.display(),
                out.len(),
                h.data_len
            )));
        }
        let read = File::open(path)
            .and_then(|mut f| f.seek(SeekFrom::Start(h.data_offset)).and_then(|_| f.read_exact(out.as_mut_slice())));
        match read {
            Ok(()) => ROk(()),
            Err(e) => RErr(io_error(path, &e)),
        }
    }
}

// === The root module ===

#[sabi_extern_fn]
fn name() -> RString {
    PACK_NAME.into()
}

/// Any host: the pack only reads files.
#[sabi_extern_fn]
fn score(_host: &HostInfo) -> u32 {
    1
}

#[sabi_extern_fn]
fn kernels() -> RVec<KernelBox> {
    RVec::new()
}

#[sabi_extern_fn]
fn loaders() -> RVec<LoaderBox> {
    RVec::from(vec![Loader_TO::from_value(NpyLoader, TD_Opaque)])
}

/// The pack's root module (`abi_version` first).
#[export_root_module]
pub fn instantiate_root_module() -> PackModuleRef {
    PackModule {
        abi_version: ABI_VERSION,
        name,
        score,
        kernels,
        loaders,
        predictors: spinfer_pack_kit::no_predictors,
        cache_policies: spinfer_pack_kit::no_cache_policies,
    }
    .leak_into_prefix()
}
