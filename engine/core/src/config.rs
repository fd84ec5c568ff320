//! The operator's TOML file (`spinfer.toml`, `--config`): model, threads,
//! precision, packs and trust, kernel pins and exclusions, WASM limits,
//! the performance-history store. Every table rejects unknown keys, so a
//! typo is an error naming the key, not a silently ignored setting.
//! Reference: `docs/config.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::model::{ModelOptions, Precision};
use crate::sparse::cache::CachePolicyKind;
use crate::sparse::{PredictorKind, SparsityOptions};
use crate::{Error, Result};

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelSection,
    #[serde(default)]
    pub packs: PacksSection,
    #[serde(default)]
    pub kernels: KernelsSection,
    #[serde(default)]
    pub wasm: WasmSection,
    /// Sparse FFN; absent: dense.
    pub sparsity: Option<SparsitySection>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SparsitySection {
    /// The sidecar written by `spinfer calibrate`. Relative paths are
    /// resolved against the config file's directory.
    pub file: PathBuf,
    /// `"gate-threshold"`, `"top-k"`, `"input-magnitude"`, `"low-rank"`,
    /// `"sentence"`, or a pack's predictor as `"pack:<pack>/<name>"`
    /// (default: the sidecar's).
    pub predictor: Option<String>,
    /// A layer keeping more than this fraction of its neurons for a token
    /// runs dense for that token (default 0.85).
    pub dense_above: Option<f32>,
    /// Memory budget for the FFN weights and predictor, in MB (10^6
    /// bytes): hot neurons in RAM, cold ones read on demand from a repack
    /// beside the sidecar. Needs the low-rank predictor. Absent: no budget.
    pub ffn_budget_mb: Option<f64>,
    /// Which cold neurons stay cached under a budget: `"lru"`,
    /// `"freq-lru"` (default), or a pack's policy as `"pack:<pack>/<name>"`.
    pub cache_policy: Option<String>,
}

/// The name after `pack:` in a predictor or cache policy setting.
fn pack_object(setting: &str) -> Option<&str> {
    setting.strip_prefix("pack:")
}

/// Checks a predictor setting (`sparsity.predictor`, `--predictor`).
///
/// # Errors
///
/// A message listing the accepted values.
pub fn check_predictor(p: &str) -> std::result::Result<(), String> {
    match pack_object(p) {
        Some(name) if !name.is_empty() => Ok(()),
        None if PredictorKind::parse(p).is_some() => Ok(()),
        _ => Err(format!("predictor '{p}' is not one of {}, pack:<pack>/<name>", PredictorKind::names())),
    }
}

/// Checks a cache policy setting (`sparsity.cache_policy`,
/// `--cache-policy`).
///
/// # Errors
///
/// A message listing the accepted values.
pub fn check_cache_policy(p: &str) -> std::result::Result<(), String> {
    match pack_object(p) {
        Some(name) if !name.is_empty() => Ok(()),
        None if CachePolicyKind::parse(p).is_some() => Ok(()),
        _ => Err(format!("cache policy '{p}' is not one of lru, freq-lru, pack:<pack>/<name>")),
    }
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// GGUF file, safetensors file or checkpoint directory. Relative paths
    /// are resolved against the config file's directory.
    pub path: PathBuf,
    /// `"fast"` (default), `"int8"` or `"precise"`.
    #[serde(default)]
    pub precision: PrecisionSetting,
    /// Context size per session (default 2048).
    pub ctx: Option<usize>,
    /// Threads per session (default: all cores).
    pub threads: Option<usize>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionSetting {
    #[default]
    Fast,
    Int8,
    Precise,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PacksSection {
    /// Directories searched for packs (plus `SPINFER_PACK_PATH`).
    #[serde(default)]
    pub dirs: Vec<PathBuf>,
    /// Public keys (`ed25519:<base64>`) whose signatures are trusted.
    #[serde(default)]
    pub trusted_keys: Vec<String>,
    /// Keys refused even if also listed as trusted.
    #[serde(default)]
    pub revoked_keys: Vec<String>,
    /// Load packs without a signature (logged loudly). Default false.
    #[serde(default)]
    pub allow_unsigned: bool,
    /// Where the highest version seen per pack and signer is kept
    /// (downgrade protection). Default: no record.
    pub install_record: Option<PathBuf>,
    /// The kernel performance-history store. Default: none (no tuning data).
    pub history: Option<PathBuf>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KernelsSection {
    /// Operation → kernel pins, e.g. `"matmul.q4_1" = "cpu-simd/avx512/q4_1*q8_1"`
    /// or `"q8_0*q8_0" = "avx2/q8_0*q8_0"`.
    #[serde(default)]
    pub pin: BTreeMap<String, String>,
    /// Pack names never used.
    #[serde(default)]
    pub exclude: Vec<String>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WasmSection {
    /// Linear-memory cap per WASM pack, MiB (default 512).
    #[serde(default = "default_wasm_memory")]
    pub max_memory_mb: u64,
    /// Wall-clock budget of one kernel call, ms (default 1000).
    #[serde(default = "default_wasm_timeout")]
    pub timeout_ms: u64,
    /// Fuel per call; unset = no fuel metering.
    pub fuel: Option<u64>,
}

fn default_wasm_memory() -> u64 {
    512
}

fn default_wasm_timeout() -> u64 {
    1000
}

impl Default for WasmSection {
    fn default() -> Self {
        Self { max_memory_mb: default_wasm_memory(), timeout_ms: default_wasm_timeout(), fuel: None }
    }
}

impl Config {
    /// Reads and validates `path`; relative paths inside are resolved
    /// against the file's directory.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut c = Self::parse(&text, path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        let abs = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        abs(&mut c.model.path);
        c.packs.dirs.iter_mut().for_each(abs);
        if let Some(p) = c.packs.install_record.as_mut() {
            abs(p);
        }
        if let Some(p) = c.packs.history.as_mut() {
            abs(p);
        }
        if let Some(sp) = c.sparsity.as_mut() {
            abs(&mut sp.file);
        }
        Ok(c)
    }

    /// Parses TOML text; `path` names the source in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let c: Config = toml::from_str(text).map_err(|e| Error::format(path, format!("invalid config: {e}")))?;
        c.validate().map_err(|d| Error::format(path, format!("invalid config: {d}")))?;
        Ok(c)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.model.path.as_os_str().is_empty() {
            return Err("model.path is empty".into());
        }
        if self.model.ctx == Some(0) {
            return Err("model.ctx must be at least 1".into());
        }
        if self.model.threads == Some(0) {
            return Err("model.threads must be at least 1".into());
        }
        for k in self.packs.trusted_keys.iter().chain(&self.packs.revoked_keys) {
            if !k.starts_with("ed25519:") {
                return Err(format!("packs key '{k}' must look like 'ed25519:<base64>'"));
            }
        }
        if let Some(sp) = &self.sparsity {
            if let Some(p) = &sp.predictor {
                check_predictor(p).map_err(|e| format!("sparsity.{e}"))?;
            }
            if sp.ffn_budget_mb.is_some_and(|b| !(b.is_finite() && b > 0.0)) {
                return Err("sparsity.ffn_budget_mb must be a positive number".into());
            }
            if let Some(p) = &sp.cache_policy {
                check_cache_policy(p).map_err(|e| format!("sparsity.{e}"))?;
            }
            if sp.dense_above.is_some_and(|d| !(0.0..=1.0).contains(&d)) {
                return Err("sparsity.dense_above must be between 0 and 1".into());
            }
        }
        if self.wasm.max_memory_mb == 0 || self.wasm.timeout_ms == 0 {
            return Err("wasm.max_memory_mb and wasm.timeout_ms must be positive".into());
        }
        Ok(())
    }

    /// The trust policy of `[packs]` (keys parsed; a malformed key is an
    /// error naming it).
    pub fn trust_policy(&self) -> Result<spinfer_registry::TrustPolicy> {
        let parse = |k: &String| {
            k.parse::<spinfer_registry::PublicKey>()
                .map_err(|e| Error::InvalidArgument(format!("packs key '{k}': {e}")))
        };
        Ok(spinfer_registry::TrustPolicy {
            trusted: self.packs.trusted_keys.iter().map(parse).collect::<Result<_>>()?,
            revoked: self.packs.revoked_keys.iter().map(parse).collect::<Result<_>>()?,
            allow_unsigned: self.packs.allow_unsigned,
        })
    }

    /// The model options this config asks for.
    pub fn model_options(&self) -> ModelOptions {
        let precision = match self.model.precision {
            PrecisionSetting::Fast => Precision::Fast,
            PrecisionSetting::Int8 => Precision::Int8,
            PrecisionSetting::Precise => Precision::Precise,
        };
        let mut o = ModelOptions { precision, ..ModelOptions::default() };
        if let Some(c) = self.model.ctx {
            o.ctx = c;
        }
        if let Some(t) = self.model.threads {
            o.threads = t;
        }
        o.sparsity = self.sparsity.as_ref().map(|sp| {
            let mut so = SparsityOptions::new(&sp.file);
            so.predictor = sp.predictor.as_deref().and_then(PredictorKind::parse);
            so.pack_predictor = sp.predictor.as_deref().and_then(pack_object).map(str::to_string);
            if let Some(d) = sp.dense_above {
                so.dense_above = d;
            }
            so.ffn_budget_bytes = sp.ffn_budget_mb.map(|mb| (mb * 1e6) as usize);
            if let Some(p) = sp.cache_policy.as_deref().and_then(CachePolicyKind::parse) {
                so.cache_policy = p;
            }
            so.pack_cache_policy = sp.cache_policy.as_deref().and_then(pack_object).map(str::to_string);
            so
        });
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config> {
        Config::parse(s, Path::new("spinfer.toml"))
    }

    #[test]
    fn minimal_config_has_defaults() {
        let c = parse("[model]\npath = \"m.gguf\"\n").unwrap();
        assert_eq!(c.model.precision, PrecisionSetting::Fast);
        assert!(!c.packs.allow_unsigned);
        assert_eq!(c.wasm.max_memory_mb, 512);
        assert_eq!(c.model_options().precision, Precision::Fast);
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = parse("[model]\npath = \"m.gguf\"\nthreds = 2\n").unwrap_err().to_string();
        assert!(e.contains("spinfer.toml") && e.contains("threds"), "{e}");
        let e = parse("[model]\npath = \"m.gguf\"\nprecision = \"fp8\"\n").unwrap_err().to_string();
        assert!(e.contains("fp8"), "{e}");
        let e = parse("[model]\npath = \"m.gguf\"\n[packs]\ntrusted_keys = [\"abc\"]\n").unwrap_err().to_string();
        assert!(e.contains("'abc'"), "{e}");
        let e = parse("[modle]\npath = \"m.gguf\"\n").unwrap_err().to_string();
        assert!(e.contains("modle"), "{e}");
        assert!(parse("[model]\npath = \"m.gguf\"\nctx = 0\n").unwrap_err().to_string().contains("model.ctx"));
    }

    /// Every example configuration shipped in `docs/` parses.
    #[test]
    fn every_example_config_in_docs_parses() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs");
        let mut seen = 0;
        let mut stack = vec![docs];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let p = entry.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|e| e == "toml") {
                    Config::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                    seen += 1;
                }
            }
        }
        assert!(seen >= 2, "expected example configs in docs/, found {seen}");
    }

    #[test]
    fn sparsity_budget_and_cache_policy() {
        let parse = |t: &str| Config::parse(t, Path::new("spinfer.toml"));
        let base = "[model]\npath = \"m.gguf\"\n[sparsity]\nfile = \"s.spinfer\"\npredictor = \"low-rank\"\n";
        let c = parse(&format!("{base}ffn_budget_mb = 20\ncache_policy = \"lru\"\n")).unwrap();
        let so = c.model_options().sparsity.unwrap();
        assert_eq!(so.ffn_budget_bytes, Some(20_000_000));
        assert_eq!(so.cache_policy, CachePolicyKind::Lru);
        assert_eq!(so.predictor, Some(PredictorKind::LowRank));
        let so = parse(base).unwrap().model_options().sparsity.unwrap();
        assert_eq!((so.ffn_budget_bytes, so.cache_policy), (None, CachePolicyKind::FreqLru));
        let e = parse(&format!("{base}ffn_budget_mb = -1\n")).unwrap_err().to_string();
        assert!(e.contains("ffn_budget_mb"), "{e}");
        let e = parse(&format!("{base}cache_policy = \"mru\"\n")).unwrap_err().to_string();
        assert!(e.contains("mru"), "{e}");
        // A pack's predictor and cache policy, by name.
        let packs = "[model]\npath = \"m.gguf\"\n[sparsity]\nfile = \"s.spinfer\"\npredictor = \"pack:acme/mlp\"\n";
        let so = parse(&format!("{packs}cache_policy = \"pack:fifo\"\n")).unwrap().model_options().sparsity.unwrap();
        assert_eq!((so.predictor, so.pack_predictor.as_deref()), (None, Some("acme/mlp")));
        assert_eq!((so.cache_policy, so.pack_cache_policy.as_deref()), (CachePolicyKind::FreqLru, Some("fifo")));
        let e = parse(&format!("{base}cache_policy = \"pack:\"\n")).unwrap_err().to_string();
        assert!(e.contains("pack:<pack>/<name>"), "{e}");
    }
}
