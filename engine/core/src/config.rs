//! The operator's TOML file (`spinfer.toml`, `--config`): model, threads,
//! precision, packs and trust, kernel pins and exclusions, WASM limits,
//! the performance-history store. Every table rejects unknown keys, so a
//! typo is an error naming the key, not a silently ignored setting.
//! Reference: `docs/config.md`.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::model::{KvType, ModelOptions, Precision, Requant};
pub use crate::server_config::{ServerSection, SpeculativeSection};
use crate::{Error, Result};
use spinfer_sparsity::cache::CachePolicyKind;
use spinfer_sparsity::{PredictorKind, SparsityOptions};

pub use spinfer_packs::settings::{
    CudaSection, KernelsSection, MAX_WASM_MEMORY_MB, MAX_WASM_MODULE_MB, MAX_WASM_TIMEOUT_MS, PacksSection,
    TrustedKeySetting, WasmSection, default_install_record, excerpt,
};

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
    #[serde(default)]
    pub cuda: CudaSection,
    /// Sparse FFN; absent: dense.
    pub sparsity: Option<SparsitySection>,
    /// The output head; absent: dense.
    pub head: Option<HeadSection>,
    /// One memory budget for weights, KV cache and work buffers; absent:
    /// the model file is mapped whole.
    pub memory: Option<MemorySection>,
    /// `spinfer serve`'s listener, scheduling and guards.
    #[serde(default)]
    pub server: ServerSection,
    /// Drafts from the context's n-grams (speculative decoding); absent:
    /// none.
    pub speculative: Option<SpeculativeSection>,
}

/// `[memory]`: decode within a memory budget.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MemorySection {
    /// Bytes held for weights, KV cache and work buffers, in MB (10^6
    /// bytes). What does not fit is read from storage per step, ahead of
    /// need; the process's code is outside the budget.
    pub budget_mb: f64,
}

/// Which output head computes the next-token logits.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum HeadMode {
    /// Every vocabulary row (exact).
    Dense,
    /// Only the rows of the best clusters of a head index
    /// (`spinfer calibrate-head`); see `spinfer_engine::head`.
    #[default]
    Sparse,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HeadSection {
    /// `"sparse"` (the default when the section is present) or `"dense"`.
    #[serde(default)]
    pub mode: HeadMode,
    /// The head index written by `spinfer calibrate-head` (needed for
    /// `sparse`). Relative paths are resolved against the config file's
    /// directory.
    pub index: Option<PathBuf>,
    /// Clusters whose rows get exact logits per token (default: an eighth
    /// of the index's clusters).
    pub probes: Option<usize>,
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
    /// `"freq-lru"`, `"sweep"` (default), `"window"` / `"window:K"` (the neurons of the last 5 / K
    /// tokens), or a pack's policy as `"pack:<pack>/<name>"`.
    pub cache_policy: Option<String>,
    /// Under a budget, read the next layer's predicted cold neurons ahead
    /// of need (default false).
    pub lookahead: Option<bool>,
}

/// The largest `memory.budget_mb` accepted (1 PB): beyond any machine.
pub const MAX_BUDGET_MB: f64 = 1e9;

/// At most 80 characters of `s`: what error messages quote of a setting.
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
        _ => Err(format!(
            "cache policy '{p}' is not one of lru, freq-lru, sweep, window, window:K (K in 1..=10000), pack:<pack>/<name>"
        )),
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
    /// KV cache element type, `"f32"` or `"f16"` (default: f32 in precise
    /// mode, f16 otherwise).
    pub kv_cache: Option<KvCacheSetting>,
    /// Quantise float weight matrices as they load: `"q8_0"`, `"q4_1"`
    /// or `"q4_0"` (default: as stored).
    pub quantize: Option<QuantizeSetting>,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QuantizeSetting {
    #[serde(rename = "q8_0")]
    Q8_0,
    #[serde(rename = "q4_1")]
    Q4_1,
    #[serde(rename = "q4_0")]
    Q4_0,
}

impl From<QuantizeSetting> for Requant {
    fn from(q: QuantizeSetting) -> Self {
        match q {
            QuantizeSetting::Q8_0 => Requant::Q8_0,
            QuantizeSetting::Q4_1 => Requant::Q4_1,
            QuantizeSetting::Q4_0 => Requant::Q4_0,
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheSetting {
    F32,
    F16,
}

impl From<KvCacheSetting> for KvType {
    fn from(k: KvCacheSetting) -> Self {
        match k {
            KvCacheSetting::F32 => KvType::F32,
            KvCacheSetting::F16 => KvType::F16,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionSetting {
    #[default]
    Fast,
    Int8,
    Precise,
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
        if let Some(p) = c.packs.install_witness.as_mut() {
            abs(p);
        }
        if let Some(p) = c.packs.history.as_mut() {
            abs(p);
        }
        if let Some(sp) = c.sparsity.as_mut() {
            abs(&mut sp.file);
        }
        if let Some(p) = c.head.as_mut().and_then(|h| h.index.as_mut()) {
            abs(p);
        }
        if let Some(p) = c.server.api_keys_file.as_mut() {
            abs(p);
        }
        if let Some(p) = c.server.chat_template_file.as_mut() {
            abs(p);
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
        for k in self.packs.trusted_keys.iter().map(|t| &t.key).chain(&self.packs.revoked_keys) {
            if !k.starts_with("ed25519:") {
                return Err(format!("packs key '{}' must look like 'ed25519:<base64>'", excerpt(k)));
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
        if let Some(m) = &self.memory
            && !(m.budget_mb.is_finite() && m.budget_mb > 0.0 && m.budget_mb <= MAX_BUDGET_MB)
        {
            return Err(format!("memory.budget_mb must be a positive number of MB up to {MAX_BUDGET_MB}"));
        }
        if let Some(h) = &self.head {
            if h.mode == HeadMode::Sparse && h.index.is_none() {
                return Err("head.mode = \"sparse\" needs head.index (written by `spinfer calibrate-head`)".into());
            }
            if h.probes == Some(0) {
                return Err("head.probes must be at least 1".into());
            }
        }
        self.server.validate()?;
        if let Some(s) = &self.speculative {
            s.validate()?;
        }
        let w = &self.wasm;
        for (key, v, max) in [
            ("max_memory_mb", w.max_memory_mb, MAX_WASM_MEMORY_MB),
            ("max_module_mb", w.max_module_mb, MAX_WASM_MODULE_MB),
            ("timeout_ms", w.timeout_ms, MAX_WASM_TIMEOUT_MS),
        ] {
            if !(1..=max).contains(&v) {
                return Err(format!("[wasm] {key} = {v} is out of range: it must be between 1 and {max}"));
            }
        }
        let mb = self.cuda.budget_mb;
        if !(mb.is_finite() && (0.0..=MAX_BUDGET_MB).contains(&mb)) {
            return Err(format!("[cuda] budget_mb = {mb} is out of range: it must be between 0 and {MAX_BUDGET_MB}"));
        }
        Ok(())
    }

    /// The install record's path: see [`PacksSection::install_record_path`].
    pub fn install_record_path(&self) -> Option<PathBuf> {
        self.packs.install_record_path()
    }

    /// The install record witness's path: see [`PacksSection::install_witness_path`].
    pub fn install_witness_path(&self) -> Option<PathBuf> {
        self.packs.install_witness_path()
    }

    /// The trust policy of `[packs]`: see [`PacksSection::trust_policy`].
    pub fn trust_policy(&self) -> Result<spinfer_registry::TrustPolicy> {
        Ok(self.packs.trust_policy()?)
    }

    /// The model options this config asks for.
    pub fn model_options(&self) -> ModelOptions {
        let precision = match self.model.precision {
            PrecisionSetting::Fast => Precision::Fast,
            PrecisionSetting::Int8 => Precision::Int8,
            PrecisionSetting::Precise => Precision::Precise,
        };
        let kv_type = self.model.kv_cache.map(KvType::from);
        let quantize = self.model.quantize.map(Requant::from);
        let mut o = ModelOptions { precision, kv_type, quantize, ..ModelOptions::default() };
        if let Some(c) = self.model.ctx {
            o.ctx = c;
        }
        if let Some(t) = self.model.threads {
            o.threads = t;
        }
        o.mem_budget = self.memory.as_ref().map(|m| (m.budget_mb * 1e6) as u64);
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
            so.lookahead = sp.lookahead.unwrap_or(false);
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
        assert_eq!(c.model_options().kv_type, None);
    }

    #[test]
    fn quantize_on_load_parses_and_names_the_key() {
        let c = parse("[model]\npath = \"m\"\nquantize = \"q8_0\"\n").unwrap();
        assert_eq!(c.model_options().quantize, Some(Requant::Q8_0));
        for (name, want) in [("q4_1", Requant::Q4_1), ("q4_0", Requant::Q4_0)] {
            let c = parse(&format!("[model]\npath = \"m\"\nquantize = \"{name}\"\n")).unwrap();
            assert_eq!(c.model_options().quantize, Some(want));
        }
        assert_eq!(parse("[model]\npath = \"m\"\n").unwrap().model_options().quantize, None);
        let e = parse("[model]\npath = \"m\"\nquantize = \"q4_k\"\n").unwrap_err().to_string();
        assert!(e.contains("q4_k") && e.contains("quantize"), "{e}");
    }

    #[test]
    fn kv_cache_type_parses_and_names_the_key() {
        let c = parse("[model]\npath = \"m.gguf\"\nkv_cache = \"f32\"\n").unwrap();
        assert_eq!(c.model_options().kv_type, Some(KvType::F32));
        let c = parse("[model]\npath = \"m.gguf\"\nprecision = \"precise\"\nkv_cache = \"f16\"\n").unwrap();
        assert_eq!(c.model_options().kv_type(), KvType::F16);
        let e = parse("[model]\npath = \"m.gguf\"\nkv_cache = \"q8_0\"\n").unwrap_err().to_string();
        assert!(e.contains("q8_0") && e.contains("kv_cache"), "{e}");
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

    #[test]
    fn trusted_keys_strings_or_tables_and_wasm_bounds() {
        let key = "ed25519:6kpsY+KcUgq+9VB7Ey7F+ZVHdq6+vnuSQh7qaRRG0iw=";
        let text = format!(
            "[model]\npath = \"m.gguf\"\n[packs]\ntrusted_keys = [\"{key}\", {{ key = \"{key}\", names = [\"cpu-*\"] }}]\n\
             pinned_versions = {{ \"cpu-simd\" = \"1.0.0\" }}\n"
        );
        let c = parse(&text).unwrap();
        assert_eq!(c.packs.trusted_keys[1].names.as_deref(), Some(&["cpu-*".to_string()][..]));
        assert_eq!(c.packs.pinned_versions["cpu-simd"], spinfer_registry::Version::new(1, 0, 0));
        let policy = c.trust_policy().unwrap();
        assert_eq!(policy.trusted.len(), 2);
        let e = parse(&text.replace("names", "nmes")).unwrap_err().to_string();
        assert!(e.contains("nmes"), "{e}");
        let e = parse(&text.replace("cpu-*", "CPU")).unwrap().trust_policy().unwrap_err().to_string();
        assert!(e.contains("CPU"), "{e}");

        let base = "[model]\npath = \"m.gguf\"\n[wasm]\n";
        for bad in
            ["timeout_ms = 9223372036854775807", "timeout_ms = 60001", "max_memory_mb = 5000", "max_module_mb = 0"]
        {
            let e = parse(&format!("{base}{bad}\n")).unwrap_err().to_string();
            let key = bad.split(' ').next().unwrap();
            assert!(e.contains(&format!("[wasm] {key}")) && e.contains("out of range"), "{e}");
        }
        let c = parse(&format!("{base}timeout_ms = 60000\n")).unwrap();
        assert_eq!((c.wasm.timeout_ms, c.wasm.max_module_mb), (60_000, 64));

        let base = "[model]\npath = \"m.gguf\"\n[cuda]\n";
        assert_eq!(parse("[model]\npath = \"m.gguf\"\n").unwrap().cuda.budget_mb, 1024.0);
        assert_eq!(parse(&format!("{base}budget_mb = 0\n")).unwrap().cuda.budget_mb, 0.0);
        for bad in ["budget_mb = -1", "budget_mb = nan", "budget_mb = 1e300"] {
            let e = parse(&format!("{base}{bad}\n")).unwrap_err().to_string();
            assert!(e.contains("[cuda] budget_mb") && e.contains("out of range"), "{e}");
        }
        let e = parse(&format!("{base}budget = 5\n")).unwrap_err().to_string();
        assert!(e.contains("budget"), "{e}");
    }

    #[test]
    fn install_record_and_witness_locations() {
        let c = parse("[model]\npath = \"m.gguf\"\n[packs]\ninstall_record = \"/d/rec.toml\"\n").unwrap();
        assert_eq!(c.install_record_path(), Some(PathBuf::from("/d/rec.toml")));
        assert_eq!(c.install_witness_path(), Some(PathBuf::from("/d/rec.toml.sum")));
        let c =
            parse("[model]\npath = \"m.gguf\"\n[packs]\ninstall_record = \"/d/r\"\nhistory = \"/h/hist\"\n").unwrap();
        assert_eq!(c.install_witness_path(), Some(PathBuf::from("/h/hist.packs-installed.sum")));
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
                    let c = Config::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                    // The keys parse as ed25519 points, name patterns included.
                    c.trust_policy().unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                    seen += 1;
                }
            }
        }
        assert!(seen >= 2, "expected example configs in docs/, found {seen}");
    }

    #[test]
    fn memory_section() {
        let base = "[model]\npath = \"m.gguf\"\n";
        let c = parse(&format!("{base}[memory]\nbudget_mb = 60\n")).unwrap();
        assert_eq!(c.model_options().mem_budget, Some(60_000_000));
        assert_eq!(parse(base).unwrap().model_options().mem_budget, None);
        for bad in ["0", "-5", "1e12", "nan"] {
            let e = parse(&format!("{base}[memory]\nbudget_mb = {bad}\n")).unwrap_err().to_string();
            assert!(e.contains("memory.budget_mb"), "{bad}: {e}");
        }
        let e = parse(&format!("{base}[memory]\nbudget = 60\n")).unwrap_err().to_string();
        assert!(e.contains("budget"), "{e}");
    }

    #[test]
    fn head_section() {
        let base = "[model]\npath = \"m.gguf\"\n";
        let c = parse(&format!("{base}[head]\nindex = \"h.spinfer-head\"\nprobes = 512\n")).unwrap();
        let h = c.head.unwrap();
        assert_eq!((h.mode, h.probes), (HeadMode::Sparse, Some(512)));
        assert_eq!(parse(&format!("{base}[head]\nmode = \"dense\"\n")).unwrap().head.unwrap().mode, HeadMode::Dense);
        for (bad, says) in [
            ("[head]\nmode = \"sparse\"\n", "needs head.index"),
            ("[head]\nindex = \"h\"\nprobes = 0\n", "head.probes"),
            ("[head]\nindex = \"h\"\nclusters = 3\n", "unknown field"),
            ("[head]\nmode = \"fast\"\n", "unknown variant"),
        ] {
            let e = parse(&format!("{base}{bad}")).unwrap_err().to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    #[test]
    fn sparsity_budget_and_cache_policy() {
        let parse = |t: &str| Config::parse(t, Path::new("spinfer.toml"));
        let base = "[model]\npath = \"m.gguf\"\n[sparsity]\nfile = \"s.spinfer\"\npredictor = \"low-rank\"\n";
        let c = parse(&format!("{base}ffn_budget_mb = 20\ncache_policy = \"lru\"\nlookahead = true\n")).unwrap();
        let so = c.model_options().sparsity.unwrap();
        assert_eq!(so.ffn_budget_bytes, Some(20_000_000));
        assert_eq!(so.cache_policy, CachePolicyKind::Lru);
        assert_eq!(so.predictor, Some(PredictorKind::LowRank));
        assert!(so.lookahead);
        let so = parse(base).unwrap().model_options().sparsity.unwrap();
        assert_eq!((so.ffn_budget_bytes, so.cache_policy), (None, CachePolicyKind::Sweep));
        let e = parse(&format!("{base}ffn_budget_mb = -1\n")).unwrap_err().to_string();
        assert!(e.contains("ffn_budget_mb"), "{e}");
        let e = parse(&format!("{base}cache_policy = \"mru\"\n")).unwrap_err().to_string();
        assert!(e.contains("mru"), "{e}");
        let so = parse(&format!("{base}cache_policy = \"window:8\"\n")).unwrap().model_options().sparsity.unwrap();
        assert_eq!(so.cache_policy, CachePolicyKind::Window(8));
        let e = parse(&format!("{base}cache_policy = \"window:0\"\n")).unwrap_err().to_string();
        assert!(e.contains("window:K"), "{e}");
        // A pack's predictor and cache policy, by name.
        let packs = "[model]\npath = \"m.gguf\"\n[sparsity]\nfile = \"s.spinfer\"\npredictor = \"pack:acme/mlp\"\n";
        let so = parse(&format!("{packs}cache_policy = \"pack:fifo\"\n")).unwrap().model_options().sparsity.unwrap();
        assert_eq!((so.predictor, so.pack_predictor.as_deref()), (None, Some("acme/mlp")));
        assert_eq!((so.cache_policy, so.pack_cache_policy.as_deref()), (CachePolicyKind::Sweep, Some("fifo")));
        let e = parse(&format!("{base}cache_policy = \"pack:\"\n")).unwrap_err().to_string();
        assert!(e.contains("pack:<pack>/<name>"), "{e}");
    }
}
