//! Hugging Face safetensors checkpoints: `config.json` plus one
//! `model.safetensors` or a sharded `model.safetensors.index.json` with its
//! shards, memory-mapped, tensors borrowed zero-copy.
//!
//! Tensors are served under their canonical GGUF names
//! (`model.layers.3.self_attn.q_proj.weight` is `blk.3.attn_q.weight`) with
//! GGML-order dims (an HF `[rows, cols]` tensor has dims `[cols, rows]`).
//! HF q/k weights are in the `rotate_half` layout, so [`ModelConfig::rope_style`]
//! is [`RopeStyle::NeoX`](crate::config::RopeStyle::NeoX). Tensor data is only guaranteed 8-byte aligned
//! (the format's rule); consumers must not assume more.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use spinfer_kernels::GgmlType;

use crate::config::ModelConfig;
use crate::gguf::GgufFile;
use crate::loader::Loader;
use crate::tensor::{TensorData, TensorView};
use crate::{Error, Result};

const SINGLE_FILE: &str = "model.safetensors";
const INDEX_FILE: &str = "model.safetensors.index.json";
const CONFIG_FILE: &str = "config.json";

pub use crate::hf_config::{HfLayout, config_from_hf};

/// Top-level tensors: (HF name, canonical name).
const GLOBAL_NAMES: [(&str, &str); 3] = [
    ("model.embed_tokens.weight", "token_embd.weight"),
    ("model.norm.weight", "output_norm.weight"),
    ("lm_head.weight", "output.weight"),
];

/// Per-layer modules: (HF module under `model.layers.N.`, canonical under `blk.N.`).
const LAYER_NAMES: [(&str, &str); 9] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Gemma 3's per-layer modules: its four norms around attention and the
/// FFN, and the QK-norms.
const GEMMA3_LAYER_NAMES: [(&str, &str); 13] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("self_attn.q_norm", "attn_q_norm"),
    ("self_attn.k_norm", "attn_k_norm"),
    ("input_layernorm", "attn_norm"),
    ("post_attention_layernorm", "post_attention_norm"),
    ("pre_feedforward_layernorm", "ffn_norm"),
    ("post_feedforward_layernorm", "post_ffw_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

fn layer_names(layout: HfLayout) -> &'static [(&'static str, &'static str)] {
    match layout {
        HfLayout::Llama => &LAYER_NAMES,
        HfLayout::Gemma3 => &GEMMA3_LAYER_NAMES,
    }
}

/// The canonical GGUF name of an HF tensor name of a Llama-layout
/// checkpoint, if it has one.
pub fn hf_to_canonical(name: &str) -> Option<String> {
    hf_to_canonical_in(name, HfLayout::Llama)
}

/// The canonical GGUF name of an HF tensor name in `layout`, if it has one.
pub fn hf_to_canonical_in(name: &str, layout: HfLayout) -> Option<String> {
    if let Some((_, c)) = GLOBAL_NAMES.iter().find(|(h, _)| *h == name) {
        return Some((*c).to_string());
    }
    let (layer, module, param) = split_layer_name(name, "model.layers.")?;
    let (_, c) = layer_names(layout).iter().find(|(h, _)| *h == module)?;
    Some(format!("blk.{layer}.{c}.{param}"))
}

/// The HF name of a canonical GGUF tensor name (Llama layout), if it has one.
pub fn canonical_to_hf(name: &str) -> Option<String> {
    canonical_to_hf_in(name, HfLayout::Llama)
}

/// The HF name of a canonical GGUF tensor name in `layout`, if it has one.
pub fn canonical_to_hf_in(name: &str, layout: HfLayout) -> Option<String> {
    if let Some((h, _)) = GLOBAL_NAMES.iter().find(|(_, c)| *c == name) {
        return Some((*h).to_string());
    }
    let (layer, module, param) = split_layer_name(name, "blk.")?;
    let (h, _) = layer_names(layout).iter().find(|(_, c)| *c == module)?;
    Some(format!("model.layers.{layer}.{h}.{param}"))
}

/// Whether the canonical tensor `name` is an RMSNorm weight that `layout`
/// stores as Gemma's `w` of `x · (1 + w)`, where GGUF and the model hold
/// `1 + w`.
pub fn offset_norm(name: &str, layout: HfLayout) -> bool {
    layout == HfLayout::Gemma3 && name.ends_with("_norm.weight")
}

/// `<prefix>N.<module>.<weight|bias>` -> (N, module, param).
fn split_layer_name<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str, &'a str)> {
    let rest = name.strip_prefix(prefix)?;
    let (num, rest) = rest.split_once('.')?;
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) || (num.len() > 1 && num.starts_with('0')) {
        return None;
    }
    let (module, param) = rest.rsplit_once('.')?;
    matches!(param, "weight" | "bias").then_some((num.parse().ok()?, module, param))
}

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
    /// The open file `map` maps.
    file: Arc<File>,
}

struct Entry {
    /// Name in the file.
    hf_name: String,
    shard: usize,
    dtype: Dtype,
    /// HF (row-major) shape.
    shape: Vec<usize>,
    /// Absolute byte range in the shard.
    start: usize,
    len: usize,
}

/// An opened safetensors checkpoint.
pub struct SafetensorsModel {
    path: PathBuf,
    layout: HfLayout,
    config_path: PathBuf,
    config_json: serde_json::Map<String, Value>,
    shards: Vec<Shard>,
    /// Canonical name (or the HF name when there is no canonical one) -> entry.
    tensors: HashMap<String, Entry>,
    /// Keys of `tensors` in file order (shard by shard, by offset).
    order: Vec<String>,
}

impl std::fmt::Debug for SafetensorsModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsModel")
            .field("path", &self.path)
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl SafetensorsModel {
    /// Opens a checkpoint directory (with `config.json` and `model.safetensors`
    /// or `model.safetensors.index.json` plus shards), a `.safetensors` file
    /// (with `config.json` beside it) or a `*.safetensors.index.json` file.
    /// Every file's header is validated; every tensor the index lists must be
    /// in its shard.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let meta = std::fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
        let (dir, index) = if meta.is_dir() {
            let (single, index) = (path.join(SINGLE_FILE), path.join(INDEX_FILE));
            if single.is_file() {
                (path.clone(), None)
            } else if index.is_file() {
                (path.clone(), Some(index))
            } else {
                let d = format!("directory holds neither {SINGLE_FILE} nor {INDEX_FILE}");
                return Err(Error::format(&path, d));
            }
        } else {
            let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
            let is_index =
                path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(".safetensors.index.json"));
            (dir, is_index.then(|| path.clone()))
        };

        let config_path = dir.join(CONFIG_FILE);
        let config_json = match read_json(&config_path)? {
            Value::Object(m) => m,
            _ => return Err(Error::format(&config_path, "must hold a json object")),
        };

        let mut model = Self {
            path: path.clone(),
            layout: HfLayout::of(&config_json),
            config_path,
            config_json,
            shards: Vec::new(),
            tensors: HashMap::new(),
            order: Vec::new(),
        };
        match index {
            None => {
                let file = if meta.is_dir() { path.join(SINGLE_FILE) } else { path.clone() };
                model.add_shard(file)?;
            }
            Some(index) => model.add_index(&dir, &index)?,
        }
        Ok(model)
    }

    /// Reads an index's `weight_map`, maps every shard it names and checks
    /// each listed tensor is in its shard.
    fn add_index(&mut self, dir: &Path, index: &Path) -> Result<()> {
        let json = read_json(index)?;
        let Some(map) = json.get("weight_map").and_then(Value::as_object) else {
            return Err(Error::format(index, "has no 'weight_map' object"));
        };
        let mut wanted: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| Error::format(index, format!("weight_map entry '{tensor}' is not a file name")))?;
            let plain = Path::new(file).components().all(|c| matches!(c, Component::Normal(_)));
            if file.is_empty() || !plain {
                let d = format!("weight_map entry '{tensor}' names '{file}', which is not a file inside the directory");
                return Err(Error::format(index, d));
            }
            wanted.entry(file).or_default().push(tensor);
        }
        if wanted.is_empty() {
            return Err(Error::format(index, "weight_map is empty"));
        }
        for (file, names) in wanted {
            let shard = self.add_shard(dir.join(file))?;
            let st_path = &self.shards[shard].path;
            for name in names {
                let key = hf_to_canonical_in(name, self.layout).unwrap_or_else(|| name.to_string());
                if !self.tensors.get(&key).is_some_and(|e| e.shard == shard && e.hf_name == name) {
                    let d = format!(
                        "tensor '{name}' is listed for shard '{file}' but {} does not contain it",
                        st_path.display()
                    );
                    return Err(Error::format(index, d));
                }
            }
        }
        Ok(())
    }

    /// Maps and validates one file and records its tensors; returns its index.
    fn add_shard(&mut self, path: PathBuf) -> Result<usize> {
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the file is mapped read-only. The engine's invariant is that
        // model files are not modified while loaded (as with llama.cpp and
        // candle); a concurrent truncation would be the user's error.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let (header_len, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| Error::format(&path, format!("invalid safetensors file: {}", lower_first(&e.to_string()))))?;
        let data_start = 8 + header_len;
        let shard = self.shards.len();
        // Offset order, so that errors are deterministic.
        let mut infos: Vec<_> = metadata.tensors().into_iter().collect();
        infos.sort_by_key(|(_, info)| info.data_offsets);
        for (hf_name, info) in infos {
            let key = hf_to_canonical_in(&hf_name, self.layout).unwrap_or_else(|| hf_name.clone());
            let (s, e) = info.data_offsets;
            let entry = Entry {
                hf_name,
                shard,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + s,
                len: e - s,
            };
            if entry.start + entry.len > map.len() {
                // read_metadata checked the offsets cover the file exactly.
                return Err(Error::format(&path, format!("tensor '{}' lies past the end of the file", entry.hf_name)));
            }
            if let Some(old) = self.tensors.get(&key) {
                let d = format!(
                    "tensor '{}' also appears as '{}' in {}",
                    entry.hf_name,
                    old.hf_name,
                    self.shards[old.shard].path.display()
                );
                return Err(Error::format(&path, d));
            }
            self.tensors.insert(key.clone(), entry);
            self.order.push(key);
        }
        self.shards.push(Shard { path, map: Arc::new(map), file: Arc::new(file) });
        Ok(shard)
    }

    /// The name in the file of the tensor served as `name`.
    pub fn file_name_of(&self, name: &str) -> Option<&str> {
        self.tensors.get(name).map(|e| e.hf_name.as_str())
    }

    /// The `config.json` this checkpoint was opened with.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }
}

impl Loader for SafetensorsModel {
    fn path(&self) -> &Path {
        &self.path
    }

    fn config(&self) -> Result<ModelConfig> {
        let names = self.tensor_names();
        let dims = |n: &str| self.has_tensor(n).then(|| self.tensor(n).map(|t| t.dims)).transpose();
        config_from_hf(&self.config_path, &self.config_json, &names, &dims)
    }

    fn tensor(&self, name: &str) -> Result<TensorView> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { path: self.path.clone(), tensor: name.into() })?;
        let shard = &self.shards[e.shard];
        let ty = match e.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(Error::TensorType {
                    path: shard.path.clone(),
                    tensor: e.hf_name.clone(),
                    ty: format!("{other:?}"),
                    what: "is not supported (supported: F32, F16, BF16)".into(),
                });
            }
        };
        let mut dims: Vec<usize> = e.shape.iter().rev().copied().collect();
        if dims.is_empty() {
            dims.push(1);
        }
        let data = TensorData::mapped_file(shard.map.clone(), shard.file.clone(), e.start, e.len);
        let view = TensorView { name: name.to_string(), ty, dims, data };
        if offset_norm(name, self.layout) {
            return plus_one(view, &shard.path);
        }
        Ok(view)
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Canonical names (HF names for tensors without one), in file order.
    fn tensor_names(&self) -> Vec<String> {
        self.order.clone()
    }

    fn file_size(&self) -> usize {
        self.shards.iter().map(|s| s.map.len()).sum()
    }
}

/// `1 + w` of a norm weight `w`, in f32.
fn plus_one(view: TensorView, path: &Path) -> Result<TensorView> {
    let n: usize = view.dims.iter().product();
    let mut w = vec![0f32; n];
    spinfer_kernels::dequant::dequantize_row(view.ty, view.data.bytes(), &mut w).map_err(|e| Error::TensorType {
        path: path.to_path_buf(),
        tensor: view.name.clone(),
        ty: format!("{:?}", view.ty),
        what: format!("cannot be read: {e}"),
    })?;
    let bytes: Vec<u8> = w.iter().flat_map(|x| (1.0 + x).to_le_bytes()).collect();
    Ok(TensorView { ty: GgmlType::F32, data: TensorData::owned(bytes), ..view })
}

/// Opens model weights: a directory, `.safetensors` or
/// `.safetensors.index.json` file as a [`SafetensorsModel`], anything else as
/// GGUF.
pub fn open_model(path: &Path) -> Result<Box<dyn Loader>> {
    if !path.exists() {
        return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory")));
    }
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if path.is_dir() || name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json") {
        Ok(Box::new(SafetensorsModel::open(path)?))
    } else {
        Ok(Box::new(GgufFile::open(path)?))
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = crate::bounded::read_text(path, crate::bounded::MAX_CONFIG_BYTES, "a model config")?;
    serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid json: {e}")))
}

fn lower_first(s: &str) -> String {
    let mut c = s.chars();
    c.next().map(|f| f.to_lowercase().chain(c).collect()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Arch, RopeStyle};
    use crate::fixtures::safetensors::*;
    use serde_json::json;

    fn err<T>(r: Result<T>) -> String {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn names_map_both_ways() {
        let pairs = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.layers.12.self_attn.o_proj.weight", "blk.12.attn_output.weight"),
            ("model.layers.0.self_attn.k_proj.bias", "blk.0.attn_k.bias"),
            ("model.layers.3.post_attention_layernorm.weight", "blk.3.ffn_norm.weight"),
            ("model.layers.7.mlp.down_proj.weight", "blk.7.ffn_down.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        for (hf, c) in pairs {
            assert_eq!(hf_to_canonical(hf).as_deref(), Some(c));
            assert_eq!(canonical_to_hf(c).as_deref(), Some(hf));
        }
        for bad in [
            "model.layers.01.mlp.up_proj.weight",
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.0.self_attn.rotary_emb.inv_freq",
        ] {
            assert_eq!(hf_to_canonical(bad), None, "{bad}");
        }
    }

    #[test]
    fn single_file_untied() {
        let dir = write_dir(&config("llama"), &[("model.safetensors", st_bytes(&tiny(true, false)))]);
        let m = SafetensorsModel::open(dir.path()).unwrap();
        let c = m.config().unwrap();
        assert_eq!((c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim), (Arch::Llama, 1, 8, 2, 1, 4));
        assert_eq!((c.ffn_dim, c.vocab_size, c.ctx_train, c.rope_style), (16, 10, 64, RopeStyle::NeoX));
        assert_eq!((c.rope_theta, c.rms_eps, c.tied_embeddings, c.qkv_bias), (100000.0, 1e-5, false, false));
        let k = m.tensor("blk.0.attn_k.weight").unwrap();
        assert_eq!((k.ty, k.dims.clone(), k.name.as_str()), (GgmlType::F32, vec![8, 4], "blk.0.attn_k.weight"));
        assert!(k.data.is_mapped());
        assert_eq!(k.data.bytes(), &f32s(32, 2.0)[..]);
        assert_eq!(m.tensor("blk.0.ffn_gate.weight").unwrap().ty, GgmlType::F16);
        assert_eq!(m.tensor("blk.0.ffn_up.weight").unwrap().ty, GgmlType::BF16);
        assert_eq!(m.tensor("output_norm.weight").unwrap().dims, vec![8]);
        assert_eq!(m.file_name_of("output.weight"), Some("lm_head.weight"));
        assert_eq!(m.tensor_names().len(), 12);
        let e = err(m.tensor("blk.1.attn_q.weight"));
        assert!(e.contains("tensor 'blk.1.attn_q.weight' not found"), "{e}");
        // The same checkpoint through the file and through open_model.
        let file = dir.path().join("model.safetensors");
        assert_eq!(SafetensorsModel::open(&file).unwrap().config().unwrap(), c);
        let l = open_model(dir.path()).unwrap();
        assert_eq!(l.config().unwrap(), c);
        assert_eq!(l.file_size(), std::fs::metadata(&file).unwrap().len() as usize);
    }

    #[test]
    fn tied_and_qwen2_bias() {
        // No lm_head: tied whatever the config says.
        let dir = write_dir(&config("llama"), &[("model.safetensors", st_bytes(&tiny(false, false)))]);
        assert!(SafetensorsModel::open(dir.path()).unwrap().config().unwrap().tied_embeddings);
        // lm_head present but tie_word_embeddings = true.
        let mut cfg = config("qwen2");
        cfg["tie_word_embeddings"] = json!(true);
        cfg["head_dim"] = Value::Null;
        let dir = write_dir(&cfg, &[("model.safetensors", st_bytes(&tiny(true, true)))]);
        let c = SafetensorsModel::open(dir.path()).unwrap().config().unwrap();
        assert_eq!((c.arch, c.tied_embeddings, c.qkv_bias, c.head_dim), (Arch::Qwen2, true, true, 4));
    }

    #[test]
    fn sharded_index() {
        let all = tiny(true, false);
        let (a, b) = all.split_at(5);
        let mut map = serde_json::Map::new();
        for (t, f) in a
            .iter()
            .map(|t| (t, "model-00001-of-00002.safetensors"))
            .chain(b.iter().map(|t| (t, "model-00002-of-00002.safetensors")))
        {
            map.insert(t.0.into(), json!(f));
        }
        let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
        let files = [
            ("model-00001-of-00002.safetensors", st_bytes(a)),
            ("model-00002-of-00002.safetensors", st_bytes(b)),
            ("model.safetensors.index.json", serde_json::to_vec(&index).unwrap()),
        ];
        let dir = write_dir(&config("mistral"), &files);
        let m = SafetensorsModel::open(dir.path()).unwrap();
        assert_eq!(m.tensor_names().len(), 12);
        assert_eq!(m.tensor("blk.0.ffn_down.weight").unwrap().dims, vec![16, 8]);
        assert_eq!(m.tensor("token_embd.weight").unwrap().data.bytes(), &f32s(80, 0.0)[..]);
        assert!(!m.config().unwrap().tied_embeddings);
        // The index file itself also opens.
        assert!(open_model(&dir.path().join("model.safetensors.index.json")).unwrap().has_tensor("output.weight"));

        // A tensor the index puts in a shard that lacks it.
        let mut bad = index.clone();
        bad["weight_map"]["model.norm.weight"] = json!("model-00001-of-00002.safetensors");
        std::fs::write(dir.path().join("model.safetensors.index.json"), serde_json::to_vec(&bad).unwrap()).unwrap();
        let e = err(SafetensorsModel::open(dir.path()));
        assert!(
            e.contains("model.safetensors.index.json")
                && e.contains("'model.norm.weight'")
                && e.contains("does not contain"),
            "{e}"
        );
        // A shard that is missing altogether.
        std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
        std::fs::write(dir.path().join("model.safetensors.index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
        let e = err(SafetensorsModel::open(dir.path()));
        assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
        // A shard name escaping the directory.
        bad["weight_map"]["model.norm.weight"] = json!("../x.safetensors");
        std::fs::write(dir.path().join("model.safetensors.index.json"), serde_json::to_vec(&bad).unwrap()).unwrap();
        assert!(err(SafetensorsModel::open(dir.path())).contains("not a file inside the directory"));
    }

    #[test]
    fn config_errors_name_the_key() {
        let st = st_bytes(&tiny(false, false));
        let check = |edit: &dyn Fn(&mut Value), want: &[&str]| {
            let mut cfg = config("llama");
            edit(&mut cfg);
            let dir = write_dir(&cfg, &[("model.safetensors", st.clone())]);
            let e = err(SafetensorsModel::open(dir.path()).and_then(|m| m.config()));
            assert!(e.contains("config.json"), "{e}");
            for w in want {
                assert!(e.contains(w), "{e} lacks {w}");
            }
        };
        check(&|c| drop(c.as_object_mut().unwrap().remove("hidden_size")), &["'hidden_size' is missing"]);
        check(&|c| c["num_attention_heads"] = json!("2"), &["'num_attention_heads' must be an unsigned integer"]);
        check(&|c| c["rms_norm_eps"] = json!(true), &["'rms_norm_eps' must be a number"]);
        check(&|c| c["model_type"] = json!("gpt_neox"), &["unsupported architecture 'gpt_neox'"]);
        // Checked against the tensor it sizes, naming the key.
        check(
            &|c| c["num_key_value_heads"] = json!(3),
            &["'num_key_value_heads' = 3", "blk.0.attn_k.weight has 4 rows"],
        );
        check(&|c| c["num_hidden_layers"] = json!(1u64 << 40), &["'num_hidden_layers' = 1099511627776", "1 block"]);
        check(&|c| c["intermediate_size"] = json!(u64::MAX), &["'intermediate_size'", "blk.0.ffn_gate.weight"]);
        check(&|c| c["vocab_size"] = json!(11), &["'vocab_size' = 11", "token_embd.weight has 10 rows"]);
        check(
            &|c| {
                let o = c.as_object_mut().unwrap();
                o.remove("model_type");
                o.remove("architectures");
            },
            &["'model_type' is missing"],
        );
        // transformers v5: rope_theta under rope_parameters; architectures alone.
        let mut cfg = config("llama");
        let o = cfg.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.remove("model_type");
        o.insert("rope_parameters".into(), json!({"rope_type": "default", "rope_theta": 5e5}));
        let dir = write_dir(&cfg, &[("model.safetensors", st.clone())]);
        assert_eq!(SafetensorsModel::open(dir.path()).unwrap().config().unwrap().rope_theta, 5e5);
        // Not a JSON object / missing config.json.
        let dir = write_dir(&json!([1]), &[("model.safetensors", st)]);
        assert!(err(SafetensorsModel::open(dir.path())).contains("json object"));
        std::fs::remove_file(dir.path().join("config.json")).unwrap();
        assert!(err(SafetensorsModel::open(dir.path())).contains("config.json"));
    }

    #[test]
    fn bad_files_give_clear_errors() {
        let mut t = tiny(false, false);
        t.push(("model.layers.0.self_attn.rotary_emb.inv_freq", "I64", vec![2], vec![0; 16]));
        let dir = write_dir(&config("llama"), &[("model.safetensors", st_bytes(&t))]);
        let m = SafetensorsModel::open(dir.path()).unwrap();
        let e = err(m.tensor("model.layers.0.self_attn.rotary_emb.inv_freq"));
        assert!(e.contains("model.safetensors") && e.contains("rotary_emb.inv_freq") && e.contains("I64"), "{e}");
        assert!(e.contains("not supported"), "{e}");

        let full = st_bytes(&tiny(false, false));
        for cut in [full.len() - 4, 20, 4] {
            let dir = write_dir(&config("llama"), &[("model.safetensors", full[..cut].to_vec())]);
            let e = err(SafetensorsModel::open(dir.path()));
            assert!(e.contains("model.safetensors: invalid safetensors file"), "{e}");
        }
        let empty = tempfile::tempdir().unwrap();
        assert!(err(SafetensorsModel::open(empty.path())).contains("neither model.safetensors"));
        let e = err(open_model(&empty.path().join("nope.gguf")));
        assert!(e.contains("nope.gguf") && e.contains("no such file"), "{e}");
    }
}
