//! The one error type of the crate.
//!
//! Every variant that concerns a pack names it as `name@version` (once the manifest has been read)
//! and the file or directory involved, so a message read in a log is enough to find the pack.

use std::path::{Path, PathBuf};

use semver::Version;

/// Result alias used throughout the crate.
pub type Result<T, E = RegistryError> = std::result::Result<T, E>;

/// Everything that can go wrong while reading, signing, verifying, recording or discovering packs.
///
/// Messages are lowercase without trailing punctuation. Keys are carried in their text form
/// (`ed25519:<base64>`) so the error stays small and printable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    // === Manifest errors ===
    /// The pack directory has no `pack.toml`.
    #[error("missing pack manifest {}", path.display())]
    MissingManifest { path: PathBuf },

    /// `pack.toml` is not valid TOML, has an unknown/missing field, or a field has a bad value.
    /// `field` is set when validation knows which field is wrong (`version`, `artefact.file`,
    /// `kernels[1].op`, ...); for syntax errors the message carries the line instead.
    #[error("invalid pack manifest {}: {}{message}", path.display(), field_prefix(field))]
    InvalidManifest { path: PathBuf, field: Option<String>, message: String },

    /// A pack file (`pack.toml`, `pack.sig`, the artefact) is larger than its cap; nothing of it
    /// was parsed.
    #[error("{what} {} is larger than the limit of {limit} bytes; refused before parsing", path.display())]
    TooLarge { path: PathBuf, what: &'static str, limit: u64 },

    /// A pack file is a symbolic link: refused (the bytes checked must be the pack's own).
    #[error("{} is a symbolic link; pack files must be regular files inside the pack directory", path.display())]
    Symlink { path: PathBuf },

    /// A pack file exists but is not a regular file (a directory, a FIFO, a device).
    #[error("{} is not a regular file", path.display())]
    NotAFile { path: PathBuf },

    // === Signature and trust errors ===
    /// No `pack.sig` and the trust policy does not allow unsigned packs.
    #[error("pack {pack} at {} is unsigned (no pack.sig) and unsigned packs are not allowed", dir.display())]
    Unsigned { pack: String, dir: PathBuf },

    /// `pack.sig` exists but cannot be parsed.
    #[error("malformed signature file {} of pack {pack}: {message}", path.display())]
    MalformedSignature { pack: String, path: PathBuf, message: String },

    /// The signing key is in the revoked list (checked before, and winning over, the trusted list).
    #[error("pack {pack} at {} is signed by revoked key {key}", dir.display())]
    RevokedKey { pack: String, dir: PathBuf, key: String },

    /// The signing key is not in the trusted list.
    #[error("pack {pack} at {} is signed by untrusted key {key}", dir.display())]
    UntrustedKey { pack: String, dir: PathBuf, key: String },

    /// The signing key is trusted, but not for this pack name (`names = [...]` of the trusted key).
    #[error(
        "pack {pack} at {} is signed by {key}, which the trust policy allows only for {allowed}",
        dir.display()
    )]
    NameNotAllowed { pack: String, dir: PathBuf, key: String, allowed: String },

    /// The signature does not verify against the exact bytes of `pack.toml`.
    #[error("bad signature for pack {pack}: {} does not match its signature (tampered manifest?)", path.display())]
    BadSignature { pack: String, path: PathBuf },

    // === Artefact errors ===
    /// The artefact named by `[artefact] file` does not exist or is not a regular file.
    #[error("pack {pack}: artefact {} is missing", path.display())]
    MissingArtefact { pack: String, path: PathBuf },

    /// The artefact's sha256 differs from the one pinned in the (signed) manifest.
    #[error(
        "pack {pack}: artefact {} has sha256 {actual} but the manifest pins {expected} (tampered artefact?)",
        path.display()
    )]
    ArtefactHashMismatch { pack: String, path: PathBuf, expected: String, actual: String },

    // === Install-record errors ===
    /// A lower version than the highest one recorded for the same pack name (whoever signed it).
    #[error(
        "refusing to downgrade pack {name} from {have} to {got} \
         (allow it explicitly with [packs] pinned_versions = {{ \"{name}\" = \"{got}\" }})"
    )]
    Downgrade { name: String, have: Version, got: Version },

    /// An unsigned pack whose name the install record knows as signed (a stripped signature).
    #[error(
        "pack {pack} at {} is unsigned, but pack {name} was installed signed before; \
         refusing the unsigned copy (a stripped signature?)",
        dir.display()
    )]
    StrippedSignature { pack: String, name: String, dir: PathBuf },

    /// The install record was deleted, emptied or changed outside spinfer: its witness (the
    /// checksum kept in a second file) does not match.
    #[error("install record {} {problem} (its witness {} says otherwise); {remedy}", path.display(), witness.display())]
    RecordTampered { path: PathBuf, witness: PathBuf, problem: &'static str, remedy: &'static str },

    /// The install-record file exists but cannot be parsed.
    #[error("invalid install record {}: {message}", path.display())]
    InvalidRecord { path: PathBuf, message: String },

    // === Key errors ===
    /// A public or secret key (text or file) cannot be parsed.
    #[error("invalid key{}: {message}", in_path(path))]
    InvalidKey { path: Option<PathBuf>, message: String },

    /// Key generation would overwrite an existing key file.
    #[error("key file {} already exists; refusing to overwrite it", path.display())]
    KeyExists { path: PathBuf },

    /// The operating system's random number generator failed.
    #[error("cannot generate a key: os random number generator failed: {message}")]
    Random { message: String },

    // === Discovery and I/O errors ===
    /// An entry of `SPINFER_PACK_PATH` does not exist.
    #[error("SPINFER_PACK_PATH entry {} does not exist", path.display())]
    PackPathMissing { path: PathBuf },

    /// Any other I/O failure, with the path it happened on.
    #[error("i/o error on {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

impl RegistryError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }

    pub(crate) fn manifest_field(path: &Path, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidManifest { path: path.to_path_buf(), field: Some(field.into()), message: message.into() }
    }
}

fn field_prefix(field: &Option<String>) -> String {
    field.as_ref().map(|f| format!("field `{f}`: ")).unwrap_or_default()
}

fn in_path(path: &Option<PathBuf>) -> String {
    path.as_ref().map(|p| format!(" in {}", p.display())).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_stays_small() {
        // Keep `Result<T, RegistryError>` cheap to return (clippy::result_large_err is 128 bytes).
        assert!(std::mem::size_of::<RegistryError>() <= 128, "{}", std::mem::size_of::<RegistryError>());
    }

    #[test]
    fn messages_name_field_and_path() {
        let e = RegistryError::manifest_field(Path::new("/p/pack.toml"), "version", "bad semver");
        assert_eq!(e.to_string(), "invalid pack manifest /p/pack.toml: field `version`: bad semver");
        let e = RegistryError::InvalidKey { path: None, message: "bad".into() };
        assert_eq!(e.to_string(), "invalid key: bad");
    }
}
