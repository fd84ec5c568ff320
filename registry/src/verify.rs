//! Signing a pack and verifying it against a [`TrustPolicy`].

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{RegistryError, Result};
use crate::fsutil::{sha256_file, write_atomic};
use crate::keys::{KeyPair, PublicKey};
use crate::manifest::{MANIFEST_FILE, Manifest};
use crate::signature::{PackSignature, SIGNATURE_FILE};

/// Which signers the host accepts.
///
/// Deserialisable so it can sit in a configuration file:
///
/// ```toml
/// [trust]
/// trusted = ["ed25519:..."]
/// revoked = ["ed25519:..."]
/// allow_unsigned = false
/// ```
///
/// The default trusts nobody and refuses unsigned packs, so every pack is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrustPolicy {
    /// Keys whose signatures are accepted.
    pub trusted: Vec<PublicKey>,
    /// Keys whose signatures are refused, even if also listed in `trusted`.
    pub revoked: Vec<PublicKey>,
    /// Load packs without `pack.sig` (development only; each one is logged as a warning).
    /// A pack that *has* a `pack.sig` is always checked, whatever this flag says.
    pub allow_unsigned: bool,
}

impl TrustPolicy {
    /// The refuse-everything policy (same as `Default`).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a trusted key.
    #[must_use]
    pub fn with_trusted(mut self, key: PublicKey) -> Self {
        self.trusted.push(key);
        self
    }

    /// Adds a revoked key.
    #[must_use]
    pub fn with_revoked(mut self, key: PublicKey) -> Self {
        self.revoked.push(key);
        self
    }

    /// Sets whether unsigned packs are loaded.
    #[must_use]
    pub fn with_unsigned_allowed(mut self, allow: bool) -> Self {
        self.allow_unsigned = allow;
        self
    }
}

/// A pack whose manifest, signature and artefact hash have been checked by [`verify_pack`].
///
/// Only [`verify_pack`] builds one, so holding a `VerifiedPack` is proof the checks passed.
/// The checks are a snapshot: the pack directory must not be writable by anyone the host
/// trusts less than itself, or the artefact could be swapped between verification and loading.
#[derive(Debug, Clone)]
pub struct VerifiedPack {
    manifest: Manifest,
    dir: PathBuf,
    artefact_path: PathBuf,
    signer: Option<PublicKey>,
}

impl VerifiedPack {
    /// The parsed manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The pack directory, as given to [`verify_pack`].
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `dir/<artefact.file>`, the file to load.
    pub fn artefact_path(&self) -> &Path {
        &self.artefact_path
    }

    /// The trusted key that signed the pack; `None` for an unsigned pack.
    pub fn signer(&self) -> Option<&PublicKey> {
        self.signer.as_ref()
    }

    /// Whether the pack was accepted without a signature (`allow_unsigned`).
    pub fn is_unsigned(&self) -> bool {
        self.signer.is_none()
    }

    /// `name@version`.
    pub fn id(&self) -> String {
        self.manifest.id()
    }

    /// Gives up the proof and keeps the manifest.
    pub fn into_manifest(self) -> Manifest {
        self.manifest
    }
}

/// Signs `dir/pack.toml` with `key`, writing `dir/pack.sig` atomically; returns the signature path.
///
/// Refuses to sign a pack that would not verify: the manifest must be valid and the artefact must
/// exist and match its pinned sha256.
///
/// # Errors
/// Manifest errors, [`RegistryError::MissingArtefact`], [`RegistryError::ArtefactHashMismatch`],
/// [`RegistryError::Io`].
pub fn sign_pack(dir: &Path, key: &KeyPair) -> Result<PathBuf> {
    let (manifest, bytes) = Manifest::read(dir)?;
    check_artefact(dir, &manifest)?;
    let path = dir.join(SIGNATURE_FILE);
    write_atomic(&path, format!("{}\n", PackSignature::sign(&bytes, key)).as_bytes())?;
    tracing::debug!(pack = %manifest.id(), key = %key.public_key(), "signed {}", path.display());
    Ok(path)
}

/// Verifies the pack in `dir` against `policy`.
///
/// Order: read and validate `pack.toml` → check `pack.sig` (revoked keys are refused even if also
/// trusted; then the key must be trusted; then the signature must verify over the exact manifest
/// bytes) → check the artefact's sha256 against the manifest. An unsigned pack is refused unless
/// `policy.allow_unsigned`, and then a warning naming the pack and its path is logged.
///
/// # Errors
/// [`RegistryError::MissingManifest`], [`RegistryError::InvalidManifest`], [`RegistryError::Unsigned`],
/// [`RegistryError::MalformedSignature`], [`RegistryError::RevokedKey`], [`RegistryError::UntrustedKey`],
/// [`RegistryError::BadSignature`], [`RegistryError::MissingArtefact`],
/// [`RegistryError::ArtefactHashMismatch`], [`RegistryError::Io`].
pub fn verify_pack(dir: &Path, policy: &TrustPolicy) -> Result<VerifiedPack> {
    let (manifest, bytes) = Manifest::read(dir)?;
    let id = manifest.id();
    let signer = match PackSignature::read(dir, &id)? {
        None if policy.allow_unsigned => {
            tracing::warn!(
                pack = %id,
                path = %dir.display(),
                "loading UNSIGNED pack {id} from {}: its code is not verified (allow_unsigned is set)",
                dir.display()
            );
            None
        }
        None => return Err(RegistryError::Unsigned { pack: id, dir: dir.to_path_buf() }),
        Some(sig) => {
            let key = *sig.key();
            if policy.revoked.contains(&key) {
                return Err(RegistryError::RevokedKey { pack: id, dir: dir.to_path_buf(), key: key.to_string() });
            }
            if !policy.trusted.contains(&key) {
                return Err(RegistryError::UntrustedKey { pack: id, dir: dir.to_path_buf(), key: key.to_string() });
            }
            if !sig.verifies(&bytes) {
                return Err(RegistryError::BadSignature { pack: id, path: dir.join(MANIFEST_FILE) });
            }
            Some(key)
        }
    };
    let artefact_path = check_artefact(dir, &manifest)?;
    tracing::debug!(pack = %id, path = %dir.display(), signed = signer.is_some(), "verified pack");
    Ok(VerifiedPack { manifest, dir: dir.to_path_buf(), artefact_path, signer })
}

/// Checks that the artefact exists, is a regular file and matches its pinned sha256.
fn check_artefact(dir: &Path, manifest: &Manifest) -> Result<PathBuf> {
    let path = dir.join(&manifest.artefact.file);
    let missing = || RegistryError::MissingArtefact { pack: manifest.id(), path: path.clone() };
    match std::fs::metadata(&path) {
        Ok(meta) if meta.is_file() => {}
        Ok(_) => return Err(missing()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(missing()),
        Err(e) => return Err(RegistryError::Io { path, source: e }),
    }
    let actual = sha256_file(&path)?;
    if actual != manifest.artefact.sha256 {
        return Err(RegistryError::ArtefactHashMismatch {
            pack: manifest.id(),
            path,
            expected: manifest.artefact.sha256.clone(),
            actual,
        });
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trust_policy_from_toml() {
        let key = KeyPair::from_seed(&[3; 32]).public_key();
        let text = format!("trusted = [\"{key}\"]\nallow_unsigned = true\n");
        let policy: TrustPolicy = toml::from_str(&text).unwrap();
        assert_eq!(policy, TrustPolicy::new().with_trusted(key).with_unsigned_allowed(true));
        assert!(toml::from_str::<TrustPolicy>("trusted = [\"ed25519:nope\"]").is_err());
        assert!(toml::from_str::<TrustPolicy>("allow_unsigned_packs = true").is_err());
    }
}
