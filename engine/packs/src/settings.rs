//! The operator config's pack sections (`[packs]`, `[kernels]`, `[wasm]`):
//! where packs are found, whose signatures are trusted, which kernels are
//! pinned or excluded, and the WASM sandbox's limits. The facade's `Config`
//! holds them; [`crate::load_registry`] acts on them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::{Error, Result};

/// At most 80 characters of an operator's setting, for error messages.
pub fn excerpt(s: &str) -> String {
    let mut out: String = s.chars().take(80).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PacksSection {
    /// Directories searched for packs (plus `SPINFER_PACK_PATH`). A trusted
    /// native pack runs with the full privileges of this process.
    #[serde(default)]
    pub dirs: Vec<PathBuf>,
    /// Public keys (`ed25519:<base64>`) whose signatures are trusted, each
    /// either a string (any pack name) or a table
    /// `{ key = "ed25519:...", names = ["cpu-simd", "vendor-*"] }` (only
    /// those pack names).
    #[serde(default)]
    pub trusted_keys: Vec<TrustedKeySetting>,
    /// Keys refused even if also listed as trusted.
    #[serde(default)]
    pub revoked_keys: Vec<String>,
    /// Load packs without a signature (logged loudly). Default false.
    #[serde(default)]
    pub allow_unsigned: bool,
    /// Where the highest version seen per pack name is kept (downgrade
    /// protection, always on). Default: [`default_install_record`]
    /// (`$XDG_DATA_HOME/spinfer/packs-installed.toml`).
    pub install_record: Option<PathBuf>,
    /// Where the install record's checksum (its witness, which detects a
    /// deleted or emptied record) is kept. Default: next to the history
    /// store when `history` is set, else `<install_record>.sum`.
    pub install_witness: Option<PathBuf>,
    /// Pack name → the one lower version accepted despite the install
    /// record (an explicit downgrade), e.g. `{ "cpu-simd" = "1.0.0" }`.
    /// Kernel pins never allow a downgrade.
    #[serde(default)]
    pub pinned_versions: BTreeMap<String, spinfer_registry::Version>,
    /// The kernel performance-history store. Default: none (no tuning data).
    pub history: Option<PathBuf>,
}

/// One `[packs] trusted_keys` entry: `"ed25519:..."` (any pack name) or
/// `{ key = "ed25519:...", names = [...] }` (only these pack names, or
/// `prefix*` patterns).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrustedKeySetting {
    pub key: String,
    /// `None`: any pack name.
    pub names: Option<Vec<String>>,
}

impl<'de> Deserialize<'de> for TrustedKeySetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            key: String,
            names: Vec<String>,
        }
        #[derive(Deserialize)]
        #[serde(
            untagged,
            expecting = "a key \"ed25519:<base64>\" or a table { key = \"ed25519:<base64>\", names = [...] }"
        )]
        enum Raw {
            Any(String),
            Named(Table),
        }
        Ok(match Raw::deserialize(d)? {
            Raw::Any(key) => TrustedKeySetting { key, names: None },
            Raw::Named(Table { key, names }) => TrustedKeySetting { key, names: Some(names) },
        })
    }
}

/// Where the install record lives when `[packs] install_record` is not
/// set: `$XDG_DATA_HOME/spinfer/packs-installed.toml`, else
/// `$HOME/.local/share/spinfer/packs-installed.toml`; `None` when neither
/// variable is set (then downgrade protection cannot persist, and the
/// engine says so).
pub fn default_install_record() -> Option<PathBuf> {
    let nonempty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from);
    let data = nonempty("XDG_DATA_HOME").or_else(|| nonempty("HOME").map(|h| h.join(".local/share")))?;
    Some(data.join("spinfer").join("packs-installed.toml"))
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
    /// Linear-memory cap per WASM pack, MiB (default 512, at most 4096:
    /// wasm32's whole address space). A module whose declared memory or
    /// data segments exceed it is refused before it is compiled.
    #[serde(default = "default_wasm_memory")]
    pub max_memory_mb: u64,
    /// Largest WASM module file accepted, MiB (default 64, at most 1024);
    /// checked before the file is read.
    #[serde(default = "default_wasm_module")]
    pub max_module_mb: u64,
    /// Wall-clock budget of one kernel call, ms (default 1000, at most
    /// [`MAX_WASM_TIMEOUT_MS`]).
    #[serde(default = "default_wasm_timeout")]
    pub timeout_ms: u64,
    /// Fuel per call; unset = no fuel metering.
    pub fuel: Option<u64>,
}

/// `[cuda]`: what CUDA packs may hold on the GPU.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CudaSection {
    /// Device memory a CUDA pack keeps weights resident in, MB (10^6
    /// bytes; default 1024). Past it, a matrix is uploaded for each call.
    #[serde(default = "default_cuda_budget")]
    pub budget_mb: f64,
}

fn default_cuda_budget() -> f64 {
    1024.0
}

impl Default for CudaSection {
    fn default() -> Self {
        Self { budget_mb: default_cuda_budget() }
    }
}

/// Upper bound of `[wasm] timeout_ms`: one minute per kernel call.
pub const MAX_WASM_TIMEOUT_MS: u64 = crate::wasm_types::MAX_WASM_TIMEOUT_MS;
/// Upper bound of `[wasm] max_memory_mb`: wasm32's 4 GiB.
pub const MAX_WASM_MEMORY_MB: u64 = 4096;
/// Upper bound of `[wasm] max_module_mb`.
pub const MAX_WASM_MODULE_MB: u64 = 1024;

fn default_wasm_memory() -> u64 {
    512
}

fn default_wasm_module() -> u64 {
    64
}

fn default_wasm_timeout() -> u64 {
    1000
}

impl Default for WasmSection {
    fn default() -> Self {
        Self {
            max_memory_mb: default_wasm_memory(),
            max_module_mb: default_wasm_module(),
            timeout_ms: default_wasm_timeout(),
            fuel: None,
        }
    }
}

impl PacksSection {
    /// The install record's path: `[packs] install_record`, else
    /// [`default_install_record`].
    pub fn install_record_path(&self) -> Option<PathBuf> {
        self.install_record.clone().or_else(default_install_record)
    }

    /// The install record witness's path: `[packs] install_witness`, else
    /// next to the history store (`<history>.packs-installed.sum`), else
    /// `<install_record>.sum`.
    pub fn install_witness_path(&self) -> Option<PathBuf> {
        let with_suffix = |p: &Path, suffix: &str| {
            let mut s = p.as_os_str().to_owned();
            s.push(suffix);
            PathBuf::from(s)
        };
        self.install_witness
            .clone()
            .or_else(|| self.history.as_deref().map(|h| with_suffix(h, ".packs-installed.sum")))
            .or_else(|| self.install_record_path().map(|r| with_suffix(&r, ".sum")))
    }

    /// The trust policy of `[packs]` (keys parsed; a malformed key or name
    /// pattern is an error naming it).
    pub fn trust_policy(&self) -> Result<spinfer_registry::TrustPolicy> {
        let parse = |k: &String| {
            k.parse::<spinfer_registry::PublicKey>()
                .map_err(|e| Error::InvalidArgument(format!("packs key '{}': {e}", excerpt(k))))
        };
        let trusted = |t: &TrustedKeySetting| {
            let key = parse(&t.key)?;
            match &t.names {
                None => Ok(spinfer_registry::TrustedKey::any(key)),
                Some(names) => spinfer_registry::TrustedKey::for_names(key, names.iter().cloned())
                    .map_err(|e| Error::InvalidArgument(format!("packs key '{}': {e}", excerpt(&t.key)))),
            }
        };
        Ok(spinfer_registry::TrustPolicy {
            trusted: self.trusted_keys.iter().map(trusted).collect::<Result<_>>()?,
            revoked: self.revoked_keys.iter().map(parse).collect::<Result<_>>()?,
            allow_unsigned: self.allow_unsigned,
        })
    }
}
