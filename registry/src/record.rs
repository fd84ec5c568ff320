//! Downgrade protection: the highest version seen per pack **name**, whoever signed it.
//!
//! An attacker who can write to a pack directory but cannot sign can still replace a pack with an
//! *older, genuinely signed* release that has a known bug, have a second trusted key sign an old
//! version, or strip the signature of a signed pack where unsigned packs are allowed. The install
//! record remembers, per pack name, the highest version accepted and whether it was signed, and
//! refuses anything lower (unless that exact version is explicitly allowed) and any unsigned copy
//! of a name that was installed signed. File format (TOML, rewritten atomically):
//!
//! ```toml
//! [[pack]]
//! name = "cpu-ref"
//! version = "1.2.0"
//! signed = true
//! ```
//!
//! (Records written before this format, with `signer = "ed25519:..."` or `"unsigned"` per entry,
//! are read and merged per name.)
//!
//! # The witness
//!
//! Deleting or emptying the record would silently reset the protection, so every write also
//! stores the record's sha256 in a second file, the *witness* (by default `<record>.sum`; the
//! engine keeps it next to the kernel history when there is one, so the two live in different
//! places). On open:
//!
//! - record and witness both missing: a fresh installation, an empty record;
//! - witness present, record missing, or present with another sha256 (emptied, edited, an old
//!   copy restored): [`RegistryError::RecordTampered`] — reported, never silently accepted;
//! - record present, witness missing: the witness is recreated from the record, with a warning
//!   (an upgrade from a record written before witnesses existed).
//!
//! Limits: the witness detects the loss or change of *one* file. Someone who can rewrite both
//! files (the same user as spinfer, usually) can reset the protection; keeping them in
//! separate, non-writable-by-others directories is the operator's part.
//!
//! Writers hold an exclusive lock (`<record>.lock`) while they read, merge and rewrite both
//! files, so concurrent processes never leave a record and a witness that disagree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use semver::Version;
use serde::{Deserialize, Serialize};

use crate::error::{RegistryError, Result};
use crate::fsutil::{read_capped, sha256_hex, write_atomic};
use crate::verify::VerifiedPack;

/// The `signer` value records of the previous format used for packs accepted without a signature.
pub const UNSIGNED_SIGNER: &str = "unsigned";

/// Largest install record or witness read (1 MiB: thousands of packs).
const MAX_RECORD_BYTES: u64 = 1 << 20;

/// What is recorded for one pack name.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    version: Version,
    /// Whether a signed copy was ever accepted under this name.
    signed: bool,
}

/// Persistent map pack name → (highest version seen, ever signed), with its witness.
#[derive(Debug, Clone)]
pub struct InstallRecord {
    path: PathBuf,
    witness: PathBuf,
    entries: BTreeMap<String, Entry>,
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
    version: Version,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    signed: Option<bool>,
    /// The previous format's per-signer key (read, never written).
    #[serde(default, skip_serializing)]
    signer: Option<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WitnessFile {
    record_sha256: String,
}

impl InstallRecord {
    /// Opens the record stored at `path`, with its witness at `<path>.sum`; a missing record
    /// (and witness) is an empty record, created on first write.
    ///
    /// # Errors
    /// [`RegistryError::Io`], [`RegistryError::InvalidRecord`], [`RegistryError::RecordTampered`].
    pub fn open(path: impl Into<PathBuf>) -> Result<Self> {
        let path = path.into();
        let witness = default_witness(&path);
        Self::open_with_witness(path, witness)
    }

    /// Opens the record at `path` with its witness at `witness` (see the module docs).
    ///
    /// # Errors
    /// As [`InstallRecord::open`].
    pub fn open_with_witness(path: impl Into<PathBuf>, witness: impl Into<PathBuf>) -> Result<Self> {
        let (path, witness) = (path.into(), witness.into());
        let _lock = lock(&path, false)?;
        let entries = load_checked(&path, &witness)?;
        Ok(Self { path, witness, entries })
    }

    /// Where the record lives.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where its witness lives.
    pub fn witness_path(&self) -> &Path {
        &self.witness
    }

    /// The highest version recorded for the pack name `name`.
    pub fn highest(&self, name: &str) -> Option<&Version> {
        self.entries.get(name).map(|e| &e.version)
    }

    /// Whether a signed copy of `name` was ever accepted.
    pub fn was_signed(&self, name: &str) -> bool {
        self.entries.get(name).is_some_and(|e| e.signed)
    }

    /// Refuses downgrades and stripped signatures, and records upgrades.
    ///
    /// Keyed by the manifest's name alone, whoever signed the pack:
    /// - an unsigned pack whose name was installed signed: [`RegistryError::StrippedSignature`],
    ///   always;
    /// - no record, or a higher version: recorded and persisted;
    /// - the same version: accepted (a signed copy of a name recorded unsigned is recorded as signed);
    /// - a lower version: [`RegistryError::Downgrade`], unless `allowed` is exactly that version
    ///   (the operator's explicit `pinned_versions` entry), in which case it is accepted with a
    ///   warning and the record keeps the higher version (removing the entry refuses it again).
    ///
    /// Before updating, the file is re-read under the lock and merged (taking the maximum), so
    /// processes recording different packs keep each other's entries.
    ///
    /// # Errors
    /// [`RegistryError::Downgrade`], [`RegistryError::StrippedSignature`], [`RegistryError::Io`],
    /// [`RegistryError::InvalidRecord`], [`RegistryError::RecordTampered`].
    pub fn check_and_record(&mut self, pack: &VerifiedPack, allowed: Option<&Version>) -> Result<()> {
        let manifest = pack.manifest();
        let name = &manifest.name;
        let got = &manifest.version;
        let signed = !pack.is_unsigned();
        let stripped = |e: &Entry| e.signed && !signed;
        if self.entries.get(name).is_some_and(stripped) {
            return Err(RegistryError::StrippedSignature {
                pack: pack.id(),
                name: name.clone(),
                dir: pack.dir().to_path_buf(),
            });
        }
        match self.entries.get(name) {
            Some(have) if got < &have.version => {
                if allowed != Some(got) {
                    return Err(RegistryError::Downgrade {
                        name: name.clone(),
                        have: have.version.clone(),
                        got: got.clone(),
                    });
                }
                tracing::warn!(
                    pack = %pack.id(),
                    path = %pack.dir().display(),
                    "accepting downgrade of pack {name} from {} to {got}: allowed explicitly (pinned_versions)",
                    have.version
                );
                Ok(())
            }
            Some(have) if got == &have.version && (have.signed || !signed) => Ok(()),
            _ => {
                let _lock = lock(&self.path, true)?;
                for (k, v) in load_checked(&self.path, &self.witness)? {
                    merge(&mut self.entries, k, v);
                }
                // Another process may have recorded a signed copy meanwhile.
                if self.entries.get(name).is_some_and(stripped) {
                    return Err(RegistryError::StrippedSignature {
                        pack: pack.id(),
                        name: name.clone(),
                        dir: pack.dir().to_path_buf(),
                    });
                }
                merge(&mut self.entries, name.clone(), Entry { version: got.clone(), signed });
                self.save()
            }
        }
    }

    /// Writes the witness (the new record's sha256), then the record; called under the lock.
    fn save(&self) -> Result<()> {
        let file = RecordFile {
            pack: self
                .entries
                .iter()
                .map(|(name, e)| RecordEntry {
                    name: name.clone(),
                    version: e.version.clone(),
                    signed: Some(e.signed),
                    signer: None,
                })
                .collect(),
        };
        let text = toml::to_string(&file).map_err(|e| RegistryError::InvalidRecord {
            path: self.path.clone(),
            message: format!("cannot serialise: {e}"),
        })?;
        let witness = toml::to_string(&WitnessFile { record_sha256: sha256_hex(text.as_bytes()) }).map_err(|e| {
            RegistryError::InvalidRecord { path: self.witness.clone(), message: format!("cannot serialise: {e}") }
        })?;
        for p in [&self.path, &self.witness] {
            if let Some(parent) = p.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(RegistryError::io(parent))?;
            }
        }
        write_atomic(&self.witness, witness.as_bytes())?;
        write_atomic(&self.path, text.as_bytes())
    }
}

/// `<record>.sum`.
fn default_witness(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".sum");
    PathBuf::from(s)
}

/// Takes the record's lock (`<record>.lock`): exclusive for writers, shared for readers. Released
/// when the returned file is dropped. A record directory that does not exist yet needs no lock.
fn lock(path: &Path, exclusive: bool) -> Result<Option<std::fs::File>> {
    let mut s = path.as_os_str().to_owned();
    s.push(".lock");
    let lock_path = PathBuf::from(s);
    if exclusive && let Some(parent) = lock_path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(RegistryError::io(parent))?;
    }
    let file = match std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path) {
        Ok(f) => f,
        Err(e) if !exclusive && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(RegistryError::Io { path: lock_path, source: e }),
    };
    let locked = if exclusive { file.lock() } else { file.lock_shared() };
    locked.map_err(RegistryError::io(&lock_path))?;
    Ok(Some(file))
}

fn merge(map: &mut BTreeMap<String, Entry>, name: String, e: Entry) {
    match map.get_mut(&name) {
        Some(slot) => {
            if e.version > slot.version {
                slot.version = e.version;
            }
            slot.signed |= e.signed;
        }
        None => {
            map.insert(name, e);
        }
    }
}

/// Reads the record, checked against its witness (see the module docs).
fn load_checked(path: &Path, witness: &Path) -> Result<BTreeMap<String, Entry>> {
    let record = read_capped(path, MAX_RECORD_BYTES, "install record")?;
    let sum = read_capped(witness, MAX_RECORD_BYTES, "install record witness")?;
    let tampered = |problem| RegistryError::RecordTampered {
        path: path.to_path_buf(),
        witness: witness.to_path_buf(),
        problem,
        remedy: "restore it, or delete the witness to accept the record as it is \
                 (downgrade protection restarts from what it holds)",
    };
    match (&record, sum) {
        (None, None) => return Ok(BTreeMap::new()),
        (None, Some(_)) => return Err(tampered("was deleted")),
        (Some(bytes), Some(sum)) => {
            let text = String::from_utf8(sum).map_err(|_| RegistryError::InvalidRecord {
                path: witness.to_path_buf(),
                message: "not valid utf-8".into(),
            })?;
            let w: WitnessFile = toml::from_str(&text).map_err(|e| RegistryError::InvalidRecord {
                path: witness.to_path_buf(),
                message: e.message().to_string(),
            })?;
            if w.record_sha256 != sha256_hex(bytes) {
                let blank = bytes.iter().all(u8::is_ascii_whitespace);
                return Err(tampered(if blank { "was emptied" } else { "was changed outside spinfer" }));
            }
        }
        (Some(bytes), None) => {
            tracing::warn!(
                record = %path.display(),
                "install record {} has no witness {}; recreating it from the record",
                path.display(),
                witness.display()
            );
            let w = toml::to_string(&WitnessFile { record_sha256: sha256_hex(bytes) })
                .map_err(|e| RegistryError::InvalidRecord { path: witness.to_path_buf(), message: e.to_string() })?;
            if let Some(parent) = witness.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(RegistryError::io(parent))?;
            }
            write_atomic(witness, w.as_bytes())?;
        }
    }
    let bytes = record.unwrap_or_default();
    let text = String::from_utf8(bytes)
        .map_err(|_| RegistryError::InvalidRecord { path: path.to_path_buf(), message: "not valid utf-8".into() })?;
    let file: RecordFile = toml::from_str(&text)
        .map_err(|e| RegistryError::InvalidRecord { path: path.to_path_buf(), message: e.message().to_string() })?;
    let mut map = BTreeMap::new();
    for e in file.pack {
        let signed = e.signed.unwrap_or_else(|| e.signer.as_deref().is_some_and(|s| s != UNSIGNED_SIGNER));
        merge(&mut map, e.name, Entry { version: e.version, signed });
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
        assert!(rec.highest("x").is_none());
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "[[pack]]\nname = \"x\"\n").unwrap();
        let e = InstallRecord::open(&bad).unwrap_err().to_string();
        assert!(e.contains("invalid install record") && e.contains("bad.toml"), "{e}");
    }
}
