//! Downgrade protection: the highest version seen per (pack name, signer key).
//!
//! An attacker who can write to a pack directory but cannot sign can still replace a pack with an
//! *older, genuinely signed* release that has a known bug. The install record remembers the
//! highest version accepted for each pack name and signer and refuses anything lower unless the
//! user pinned that version explicitly. File format (TOML, rewritten atomically):
//!
//! ```toml
//! [[pack]]
//! name = "cpu-ref"
//! signer = "ed25519:<base64>"   # or "unsigned"
//! version = "1.2.0"
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use semver::Version;
use serde::{Deserialize, Serialize};

use crate::error::{RegistryError, Result};
use crate::fsutil::write_atomic;
use crate::keys::PublicKey;
use crate::verify::VerifiedPack;

/// The `signer` value recorded for packs accepted without a signature.
pub const UNSIGNED_SIGNER: &str = "unsigned";

/// Persistent map (pack name, signer) → highest version seen.
#[derive(Debug, Clone)]
pub struct InstallRecord {
    path: PathBuf,
    highest: BTreeMap<(String, String), Version>,
}

#[derive(Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RecordFile {
    #[serde(default)]
    pack: Vec<RecordEntry>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordEntry {
    name: String,
    signer: String,
    version: Version,
}

impl InstallRecord {
    /// Opens the record stored at `path`; a missing file is an empty record (created on first write).
    ///
    /// # Errors
    /// [`RegistryError::Io`] or [`RegistryError::InvalidRecord`].
    pub fn open(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        let highest = load(&path)?;
        Ok(Self { path, highest })
    }

    /// Where the record lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The highest version recorded for `name` signed by `signer` (`None` = unsigned).
    pub fn highest(&self, name: &str, signer: Option<&PublicKey>) -> Option<&Version> {
        self.highest.get(&(name.to_string(), signer_key(signer)))
    }

    /// Refuses a downgrade and records upgrades.
    ///
    /// - no record, or a higher version: recorded and persisted (temporary file + rename);
    /// - the same version: accepted, nothing written;
    /// - a lower version: [`RegistryError::Downgrade`], unless `pinned`, in which case it is accepted
    ///   with a warning and the record keeps the higher version (unpinning refuses it again).
    ///
    /// Before updating, the file is re-read and merged (taking the maximum), so two processes
    /// recording different packs do not lose each other's entries in the common case.
    ///
    /// # Errors
    /// [`RegistryError::Downgrade`], [`RegistryError::Io`], [`RegistryError::InvalidRecord`].
    pub fn check_and_record(&mut self, pack: &VerifiedPack, pinned: bool) -> Result<()> {
        let manifest = pack.manifest();
        let key = (manifest.name.clone(), signer_key(pack.signer()));
        let got = &manifest.version;
        match self.highest.get(&key) {
            Some(have) if got < have => {
                if !pinned {
                    return Err(RegistryError::Downgrade {
                        name: manifest.name.clone(),
                        have: have.clone(),
                        got: got.clone(),
                    });
                }
                tracing::warn!(
                    pack = %pack.id(),
                    path = %pack.dir().display(),
                    "accepting pinned downgrade of pack {} from {have} to {got}",
                    manifest.name
                );
                Ok(())
            }
            Some(have) if got == have => Ok(()),
            _ => {
                for (k, v) in load(&self.path)? {
                    let slot = self.highest.entry(k).or_insert_with(|| v.clone());
                    if v > *slot {
                        *slot = v;
                    }
                }
                let slot = self.highest.entry(key).or_insert_with(|| got.clone());
                if got > slot {
                    *slot = got.clone();
                }
                self.save()
            }
        }
    }

    fn save(&self) -> Result<()> {
        let file = RecordFile {
            pack: self
                .highest
                .iter()
                .map(|((name, signer), version)| RecordEntry {
                    name: name.clone(),
                    signer: signer.clone(),
                    version: version.clone(),
                })
                .collect(),
        };
        let text = toml::to_string(&file).map_err(|e| RegistryError::InvalidRecord {
            path: self.path.clone(),
            message: format!("cannot serialise: {e}"),
        })?;
        if let Some(parent) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(RegistryError::io(parent))?;
        }
        write_atomic(&self.path, text.as_bytes())
    }
}

fn signer_key(signer: Option<&PublicKey>) -> String {
    signer.map_or_else(|| UNSIGNED_SIGNER.to_string(), ToString::to_string)
}

fn load(path: &Path) -> Result<BTreeMap<(String, String), Version>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(RegistryError::Io { path: path.to_path_buf(), source: e }),
    };
    let file: RecordFile = toml::from_str(&text)
        .map_err(|e| RegistryError::InvalidRecord { path: path.to_path_buf(), message: e.message().to_string() })?;
    let mut map = BTreeMap::new();
    for e in file.pack {
        let slot = map.entry((e.name, e.signer)).or_insert_with(|| e.version.clone());
        if e.version > *slot {
            *slot = e.version;
        }
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_file_is_empty_and_bad_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let rec = InstallRecord::open(dir.path().join("none.toml")).unwrap();
        assert!(rec.highest("x", None).is_none());
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[[pack]]\nname = \"x\"\n").unwrap();
        let e = InstallRecord::open(&bad).unwrap_err().to_string();
        assert!(e.contains("invalid install record") && e.contains("bad.toml"), "{e}");
    }
}
