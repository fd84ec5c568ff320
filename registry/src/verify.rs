//! Signing a pack and verifying it against a [`TrustPolicy`].

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{RegistryError, Result};
use crate::fsutil::{EXCERPT_CHARS, excerpt, read_capped, sha256_hex, write_atomic};
use crate::keys::{KeyPair, PublicKey};
use crate::manifest::{MANIFEST_FILE, Manifest, PackKind};
use crate::signature::{MAX_SIGNATURE_BYTES, PackSignature, SIGNATURE_FILE};

/// Default cap on a native (or CUDA) pack's artefact: 1 GiB.
pub const DEFAULT_MAX_ARTEFACT_BYTES: u64 = 1 << 30;
/// Default cap on a WASM pack's module: 64 MiB.
pub const DEFAULT_MAX_WASM_BYTES: u64 = 64 << 20;

/// Size caps [`verify_pack_with`] applies to the artefact before reading it into memory.
/// (`pack.toml` and `pack.sig` have fixed caps: [`MAX_MANIFEST_BYTES`](crate::MAX_MANIFEST_BYTES),
/// [`MAX_SIGNATURE_BYTES`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyLimits {
    /// Native and CUDA artefacts (default [`DEFAULT_MAX_ARTEFACT_BYTES`]).
    pub max_artefact_bytes: u64,
    /// WASM modules (default [`DEFAULT_MAX_WASM_BYTES`]).
    pub max_wasm_bytes: u64,
}

impl Default for VerifyLimits {
    fn default() -> Self {
        Self { max_artefact_bytes: DEFAULT_MAX_ARTEFACT_BYTES, max_wasm_bytes: DEFAULT_MAX_WASM_BYTES }
    }
}

/// A trusted signer, optionally limited to some pack names.
///
/// In TOML either a plain key string (trusted for every pack name) or a table:
///
/// ```toml
/// trusted = [
///   "ed25519:...",                                          # any pack
///   { key = "ed25519:...", names = ["cpu-simd", "gpu-*"] },  # only these names
/// ]
/// ```
///
/// A name pattern is a pack name, or a prefix followed by `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrustedKey {
    /// The signer.
    pub key: PublicKey,
    /// Pack names (or `prefix*` patterns) the key may sign; `None` = any name.
    pub names: Option<Vec<String>>,
}

impl TrustedKey {
    /// A key trusted for every pack name.
    pub fn any(key: PublicKey) -> Self {
        Self { key, names: None }
    }

    /// A key trusted only for `names` (pack names or `prefix*` patterns).
    ///
    /// # Errors
    /// [`RegistryError::InvalidKey`] naming a malformed pattern.
    pub fn for_names(key: PublicKey, names: impl IntoIterator<Item = impl Into<String>>) -> Result<Self> {
        let names: Vec<String> = names.into_iter().map(Into::into).collect();
        for n in &names {
            validate_pattern(n)?;
        }
        Ok(Self { key, names: Some(names) })
    }

    /// Whether this entry lets its key sign a pack named `name`.
    pub fn allows(&self, name: &str) -> bool {
        self.names.as_ref().is_none_or(|names| names.iter().any(|p| pattern_matches(p, name)))
    }
}

impl From<PublicKey> for TrustedKey {
    fn from(key: PublicKey) -> Self {
        Self::any(key)
    }
}

/// `name` or `prefix*`, with the pack-name alphabet.
fn validate_pattern(p: &str) -> Result<()> {
    let stem = p.strip_suffix('*').unwrap_or(p);
    let ok = (stem.is_empty() && p == "*") || crate::names::validate_name(stem).is_ok();
    if ok {
        Ok(())
    } else {
        Err(RegistryError::InvalidKey {
            path: None,
            message: format!(
                "pack name pattern {:?} must be a pack name ([a-z0-9-]+) or a prefix followed by `*`",
                excerpt(p, EXCERPT_CHARS)
            ),
        })
    }
}

fn pattern_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}

impl Serialize for TrustedKey {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Table<'a> {
            key: &'a PublicKey,
            names: &'a [String],
        }
        match &self.names {
            None => self.key.serialize(s),
            Some(names) => Table { key: &self.key, names }.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for TrustedKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            key: PublicKey,
            names: Vec<String>,
        }
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = TrustedKey;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a public key \"ed25519:...\" or a table { key = \"ed25519:...\", names = [...] }")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<TrustedKey, E> {
                v.parse::<PublicKey>().map(TrustedKey::any).map_err(E::custom)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> std::result::Result<TrustedKey, A::Error> {
                let t = Table::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                TrustedKey::for_names(t.key, t.names).map_err(serde::de::Error::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// Which signers the host accepts, and for which pack names.
///
/// Deserialisable so it can sit in a configuration file:
///
/// ```toml
/// [trust]
/// trusted = ["ed25519:...", { key = "ed25519:...", names = ["cpu-simd"] }]
/// revoked = ["ed25519:..."]
/// allow_unsigned = false
/// ```
///
/// The default trusts nobody and refuses unsigned packs, so every pack is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrustPolicy {
    /// Keys whose signatures are accepted, each for every pack name or for some names only.
    /// A key listed several times may sign the union of its entries' names.
    pub trusted: Vec<TrustedKey>,
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

    /// Adds a key trusted for every pack name.
    #[must_use]
    pub fn with_trusted(mut self, key: PublicKey) -> Self {
        self.trusted.push(TrustedKey::any(key));
        self
    }

    /// Adds a key trusted only for `names` (pack names or `prefix*` patterns).
    ///
    /// # Panics
    /// On a malformed pattern (build a [`TrustedKey`] with [`TrustedKey::for_names`] to get an error instead).
    #[must_use]
    pub fn with_trusted_for(mut self, key: PublicKey, names: &[&str]) -> Self {
        self.trusted.push(TrustedKey::for_names(key, names.iter().copied()).expect("valid pack name patterns"));
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

    /// Whether `key` is trusted (for some pack name) and not revoked.
    pub fn is_trusted(&self, key: &PublicKey) -> bool {
        !self.revoked.contains(key) && self.trusted.iter().any(|t| t.key == *key)
    }

    /// Whether `key` is trusted to sign a pack named `name`.
    pub fn allows(&self, key: &PublicKey, name: &str) -> bool {
        self.is_trusted(key) && self.trusted.iter().any(|t| t.key == *key && t.allows(name))
    }

    /// The names `key` may sign, for messages: `any name` or `"a", "b-*"`.
    fn allowed_names(&self, key: &PublicKey) -> String {
        let mut names = Vec::new();
        for t in self.trusted.iter().filter(|t| t.key == *key) {
            match &t.names {
                None => return "any name".into(),
                Some(n) => names.extend(n.iter().map(|n| format!("{n:?}"))),
            }
        }
        names.join(", ")
    }
}

/// A pack whose manifest, signature and artefact hash have been checked by [`verify_pack`].
///
/// Only [`verify_pack`] builds one, so holding a `VerifiedPack` is proof the checks passed. It
/// holds the artefact's bytes — exactly the bytes that were hashed — so a loader never reopens
/// the artefact's path (which an attacker who can write the pack directory could swap):
/// use [`artefact_bytes`](Self::artefact_bytes).
#[derive(Debug, Clone)]
pub struct VerifiedPack {
    manifest: Manifest,
    dir: PathBuf,
    artefact_path: PathBuf,
    artefact: Arc<[u8]>,
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

    /// `dir/<artefact.file>`, where the artefact was read from: for messages only. Load
    /// [`artefact_bytes`](Self::artefact_bytes), never this path (the file may have changed since).
    pub fn artefact_path(&self) -> &Path {
        &self.artefact_path
    }

    /// The artefact's bytes, read once and hashed: their sha256 is the one the (signed) manifest pins.
    pub fn artefact_bytes(&self) -> &[u8] {
        &self.artefact
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
    read_artefact(dir, &manifest, &VerifyLimits::default())?;
    let path = dir.join(SIGNATURE_FILE);
    write_atomic(&path, format!("{}\n", PackSignature::sign(&bytes, key)).as_bytes())?;
    tracing::debug!(pack = %manifest.id(), key = %key.public_key(), "signed {}", path.display());
    Ok(path)
}

/// Verifies the pack in `dir` against `policy`, with the default [`VerifyLimits`].
///
/// See [`verify_pack_with`].
///
/// # Errors
/// As [`verify_pack_with`].
pub fn verify_pack(dir: &Path, policy: &TrustPolicy) -> Result<VerifiedPack> {
    verify_pack_with(dir, policy, &VerifyLimits::default())
}

/// Verifies the pack in `dir` against `policy`.
///
/// Every file is opened once, without following symlinks, must be a regular file, and is read
/// with a size cap ([`MAX_MANIFEST_BYTES`](crate::MAX_MANIFEST_BYTES) for `pack.toml`,
/// [`MAX_SIGNATURE_BYTES`] for `pack.sig`, `limits` for the artefact). Order:
///
/// 1. read the raw bytes of `pack.toml` and `pack.sig` (nothing parsed yet);
/// 2. the signature, over the raw manifest bytes, **before** the manifest is parsed: revoked keys
///    are refused even if also trusted, then the key must be trusted, then the signature must
///    verify. Without `pack.sig` the pack is refused unless `policy.allow_unsigned`;
/// 3. parse and validate the manifest; the signer must be trusted for the manifest's `name`;
/// 4. read the artefact (capped by its kind's limit) and compare its sha256 with the manifest's.
///
/// Errors before step 3 name the pack by its directory (the manifest is not trusted yet).
///
/// # Errors
/// [`RegistryError::MissingManifest`], [`RegistryError::TooLarge`], [`RegistryError::Symlink`],
/// [`RegistryError::NotAFile`], [`RegistryError::InvalidManifest`], [`RegistryError::Unsigned`],
/// [`RegistryError::MalformedSignature`], [`RegistryError::RevokedKey`], [`RegistryError::UntrustedKey`],
/// [`RegistryError::BadSignature`], [`RegistryError::NameNotAllowed`], [`RegistryError::MissingArtefact`],
/// [`RegistryError::ArtefactHashMismatch`], [`RegistryError::Io`].
pub fn verify_pack_with(dir: &Path, policy: &TrustPolicy, limits: &VerifyLimits) -> Result<VerifiedPack> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let bytes = Manifest::read_raw(dir)?;
    let sig_path = dir.join(SIGNATURE_FILE);
    let sig = read_capped(&sig_path, MAX_SIGNATURE_BYTES, "pack signature")?;
    // Until the signature checks out, the manifest is not parsed: messages
    // use the name it claims (a plain scan, checked against the pack-name
    // alphabet) marked as unverified, or the directory's name.
    let label = claimed_name(&bytes).map_or_else(
        || dir.file_name().map_or_else(|| "?".to_string(), |n| excerpt(&n.to_string_lossy(), EXCERPT_CHARS)),
        |n| format!("{n} (name unverified)"),
    );
    let signer = match sig {
        None if policy.allow_unsigned => None,
        None => return Err(RegistryError::Unsigned { pack: label, dir: dir.to_path_buf() }),
        Some(raw) => {
            let malformed = |message: String| RegistryError::MalformedSignature {
                pack: label.clone(),
                path: sig_path.clone(),
                message,
            };
            let text = String::from_utf8(raw).map_err(|_| malformed("not valid utf-8".into()))?;
            let sig = PackSignature::parse(&text).map_err(malformed)?;
            let key = *sig.key();
            if policy.revoked.contains(&key) {
                return Err(RegistryError::RevokedKey { pack: label, dir: dir.to_path_buf(), key: key.to_string() });
            }
            if !policy.is_trusted(&key) {
                return Err(RegistryError::UntrustedKey { pack: label, dir: dir.to_path_buf(), key: key.to_string() });
            }
            if !sig.verifies(&bytes) {
                return Err(RegistryError::BadSignature { pack: label, path: manifest_path });
            }
            Some(key)
        }
    };
    let manifest = Manifest::parse(&bytes, &manifest_path)?;
    let id = manifest.id();
    match &signer {
        Some(key) if !policy.allows(key, &manifest.name) => {
            return Err(RegistryError::NameNotAllowed {
                pack: id,
                dir: dir.to_path_buf(),
                key: key.to_string(),
                allowed: policy.allowed_names(key),
            });
        }
        Some(_) => {}
        None => tracing::warn!(
            pack = %id,
            path = %dir.display(),
            "loading UNSIGNED pack {id} from {}: its code is not verified (allow_unsigned is set)",
            dir.display()
        ),
    }
    let (artefact_path, artefact) = read_artefact(dir, &manifest, limits)?;
    tracing::debug!(pack = %id, path = %dir.display(), signed = signer.is_some(), "verified pack");
    Ok(VerifiedPack { manifest, dir: dir.to_path_buf(), artefact_path, artefact: artefact.into(), signer })
}

/// The `name = "..."` a manifest claims, found by scanning its top-level
/// lines (no TOML parse), if it is a valid pack name: for messages about a
/// pack whose signature has not been checked yet.
fn claimed_name(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            break;
        }
        let Some(rest) = line.strip_prefix("name") else { continue };
        let Some(value) = rest.trim_start().strip_prefix('=') else { continue };
        let value = value.trim().strip_prefix('"')?.split('"').next()?;
        return crate::names::validate_name(value).is_ok().then(|| value.to_string());
    }
    None
}

/// Reads the artefact once (no symlink, a regular file, capped by its kind's limit) and checks
/// its sha256 against the manifest; returns its path and the bytes hashed.
fn read_artefact(dir: &Path, manifest: &Manifest, limits: &VerifyLimits) -> Result<(PathBuf, Vec<u8>)> {
    let path = dir.join(&manifest.artefact.file);
    let limit = match manifest.kind {
        PackKind::Wasm => limits.max_wasm_bytes,
        PackKind::Native | PackKind::Cuda => limits.max_artefact_bytes,
    };
    let Some(bytes) = read_capped(&path, limit, "pack artefact")? else {
        return Err(RegistryError::MissingArtefact { pack: manifest.id(), path });
    };
    // The bytes hashed are the pack's own file (no symlink was followed), so the hash printed on
    // a mismatch says nothing about any file outside the pack.
    let actual = sha256_hex(&bytes);
    if actual != manifest.artefact.sha256 {
        return Err(RegistryError::ArtefactHashMismatch {
            pack: manifest.id(),
            path,
            expected: manifest.artefact.sha256.clone(),
            actual,
        });
    }
    Ok((path, bytes))
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

        // Name-scoped keys: a table with `key` and `names`; unknown fields and bad patterns refused.
        let text = format!("trusted = [{{ key = \"{key}\", names = [\"cpu-simd\", \"gpu-*\"] }}]\n");
        let policy: TrustPolicy = toml::from_str(&text).unwrap();
        assert_eq!(policy, TrustPolicy::new().with_trusted_for(key, &["cpu-simd", "gpu-*"]));
        assert!(policy.allows(&key, "cpu-simd") && policy.allows(&key, "gpu-cuda"));
        assert!(!policy.allows(&key, "cpu-simd2") && !policy.allows(&key, "a-shadow"));
        assert_eq!(toml::from_str::<TrustPolicy>(&toml::to_string(&policy).unwrap()).unwrap(), policy);
        let e = toml::from_str::<TrustPolicy>(&format!("trusted = [{{ key = \"{key}\", names = [], x = 1 }}]"));
        assert!(e.unwrap_err().to_string().contains("unknown field `x`"));
        let e = toml::from_str::<TrustPolicy>(&format!("trusted = [{{ key = \"{key}\", names = [\"Bad Name\"] }}]"));
        assert!(e.unwrap_err().to_string().contains("Bad Name"));
        // Revoked wins over trusted.
        assert!(!TrustPolicy::new().with_trusted(key).with_revoked(key).is_trusted(&key));
    }
}
