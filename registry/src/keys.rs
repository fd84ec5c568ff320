//! ed25519 keys: the public key text form `ed25519:<base64>` and key files.
//!
//! `spinfer pack keygen NAME` writes two files with [`KeyPair::save`]:
//! - `NAME.key`: the 32-byte secret seed as `ed25519-secret:<base64>`, mode `0600`, never overwritten;
//! - `NAME.pub`: the public key as `ed25519:<base64>`, the line users put in their trust configuration.
//!
//! Base64 is the standard alphabet with padding (RFC 4648 §4); a public key is 44 characters after the prefix.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{RegistryError, Result};

/// Prefix of the public key text form.
pub const PUBLIC_KEY_PREFIX: &str = "ed25519:";
/// Prefix of the secret key file contents.
pub const SECRET_KEY_PREFIX: &str = "ed25519-secret:";

/// An ed25519 public key (a pack signer). Text form: `ed25519:<base64 of 32 bytes>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey(VerifyingKey);

impl PublicKey {
    /// Builds a key from its 32 raw bytes.
    ///
    /// # Errors
    /// [`RegistryError::InvalidKey`] if the bytes are not a valid curve point.
    pub fn from_bytes(bytes: &[u8; 32]) -> Result<Self> {
        VerifyingKey::from_bytes(bytes)
            .map(Self)
            .map_err(|e| RegistryError::InvalidKey { path: None, message: format!("not an ed25519 public key: {e}") })
    }

    /// The 32 raw bytes.
    pub fn to_bytes(&self) -> [u8; 32] {
        self.0.to_bytes()
    }

    /// Reads a `.pub` file (one `ed25519:<base64>` line; surrounding whitespace ignored).
    ///
    /// # Errors
    /// [`RegistryError::Io`] or [`RegistryError::InvalidKey`] naming the file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(RegistryError::io(path))?;
        text.trim().parse().map_err(|e| with_path(e, path))
    }

    /// Verifies `signature` over `message` (strict: rejects weak keys and malleable signatures).
    pub(crate) fn verify(&self, message: &[u8], signature: &Signature) -> bool {
        self.0.verify_strict(message, signature).is_ok()
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{PUBLIC_KEY_PREFIX}{}", B64.encode(self.0.as_bytes()))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl FromStr for PublicKey {
    type Err = RegistryError;

    fn from_str(s: &str) -> Result<Self> {
        let invalid = |message: String| RegistryError::InvalidKey { path: None, message };
        let b64 = s
            .strip_prefix(PUBLIC_KEY_PREFIX)
            .ok_or_else(|| invalid(format!("public key must start with `{PUBLIC_KEY_PREFIX}`, got {:?}", abbrev(s))))?;
        Self::from_bytes(&decode32(b64).map_err(invalid)?)
    }
}

impl Serialize for PublicKey {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for PublicKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A signing key pair. The secret half never appears in `Debug` output and is zeroed on drop.
#[derive(Clone)]
pub struct KeyPair(SigningKey);

/// The two files written by [`KeyPair::save`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFiles {
    /// `NAME.key`, the secret seed (mode `0600` on Unix).
    pub secret: PathBuf,
    /// `NAME.pub`, the public key text.
    pub public: PathBuf,
}

impl KeyPair {
    /// Generates a fresh key pair from the operating system's random number generator.
    ///
    /// # Errors
    /// [`RegistryError::Random`] if the OS generator fails.
    pub fn generate() -> Result<Self> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|e| RegistryError::Random { message: e.to_string() })?;
        let key = Self::from_seed(&seed);
        seed.fill(0);
        Ok(key)
    }

    /// Deterministic key pair from a 32-byte seed (tests, or keys kept in an external secret store).
    pub fn from_seed(seed: &[u8; 32]) -> Self {
        Self(SigningKey::from_bytes(seed))
    }

    /// The public half.
    pub fn public_key(&self) -> PublicKey {
        PublicKey(self.0.verifying_key())
    }

    pub(crate) fn sign(&self, message: &[u8]) -> Signature {
        self.0.sign(message)
    }

    /// Writes `dir/NAME.key` (secret, mode `0600`, created exclusively) and `dir/NAME.pub`.
    ///
    /// `name` must be a plain file stem (`[a-z0-9-]+`, like a pack name).
    ///
    /// # Errors
    /// [`RegistryError::KeyExists`] if either file already exists (nothing is overwritten),
    /// [`RegistryError::InvalidKey`] for a bad name, [`RegistryError::Io`] otherwise.
    pub fn save(&self, dir: &Path, name: &str) -> Result<KeyFiles> {
        crate::names::validate_name(name)
            .map_err(|m| RegistryError::InvalidKey { path: None, message: format!("key name {m}") })?;
        let files = KeyFiles { secret: dir.join(format!("{name}.key")), public: dir.join(format!("{name}.pub")) };
        for path in [&files.secret, &files.public] {
            if path.try_exists().map_err(RegistryError::io(path))? {
                return Err(RegistryError::KeyExists { path: path.clone() });
            }
        }
        let secret = format!("{SECRET_KEY_PREFIX}{}\n", B64.encode(self.0.as_bytes()));
        write_secret(&files.secret, secret.as_bytes())?;
        crate::fsutil::write_atomic(&files.public, format!("{}\n", self.public_key()).as_bytes())?;
        Ok(files)
    }

    /// Reads a `NAME.key` file written by [`KeyPair::save`].
    ///
    /// Logs a warning if the file is readable by group or others (Unix).
    ///
    /// # Errors
    /// [`RegistryError::Io`] or [`RegistryError::InvalidKey`] naming the file.
    pub fn load(path: &Path) -> Result<Self> {
        warn_if_exposed(path);
        let text = std::fs::read_to_string(path).map_err(RegistryError::io(path))?;
        let invalid = |message: String| RegistryError::InvalidKey { path: Some(path.to_path_buf()), message };
        let b64 = text
            .trim()
            .strip_prefix(SECRET_KEY_PREFIX)
            .ok_or_else(|| invalid(format!("secret key file must start with `{SECRET_KEY_PREFIX}`")))?;
        let mut seed = decode32(b64).map_err(invalid)?;
        let key = Self::from_seed(&seed);
        seed.fill(0);
        Ok(key)
    }
}

impl fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyPair").field("public", &self.public_key()).finish_non_exhaustive()
    }
}

/// Decodes base64 into exactly 32 bytes.
pub(crate) fn decode32(b64: &str) -> std::result::Result<[u8; 32], String> {
    let bytes = B64.decode(b64.trim()).map_err(|e| format!("bad base64: {e}"))?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| format!("expected 32 bytes, got {}", bytes.len()))
}

fn with_path(e: RegistryError, path: &Path) -> RegistryError {
    match e {
        RegistryError::InvalidKey { message, .. } => {
            RegistryError::InvalidKey { path: Some(path.to_path_buf()), message }
        }
        other => other,
    }
}

fn abbrev(s: &str) -> String {
    s.chars().take(24).collect()
}

#[cfg(unix)]
fn write_secret(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file =
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path).map_err(|e| {
            match e.kind() {
                std::io::ErrorKind::AlreadyExists => RegistryError::KeyExists { path: path.to_path_buf() },
                _ => RegistryError::Io { path: path.to_path_buf(), source: e },
            }
        })?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(RegistryError::io(path))
}

#[cfg(not(unix))]
fn write_secret(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => RegistryError::KeyExists { path: path.to_path_buf() },
        _ => RegistryError::Io { path: path.to_path_buf(), source: e },
    })?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(RegistryError::io(path))
}

#[cfg(unix)]
fn warn_if_exposed(path: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(path = %path.display(), "secret key file {} is readable by group or others; chmod 600 it", path.display());
    }
}

#[cfg(not(unix))]
fn warn_if_exposed(_path: &Path) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_key_text_round_trip() {
        let pk = KeyPair::from_seed(&[7; 32]).public_key();
        let text = pk.to_string();
        assert!(text.starts_with("ed25519:") && text.len() == 8 + 44, "{text}");
        assert_eq!(text.parse::<PublicKey>().unwrap(), pk);
        assert_eq!(PublicKey::from_bytes(&pk.to_bytes()).unwrap(), pk);
    }

    #[test]
    fn bad_public_keys() {
        for bad in ["", "ed25519:", "rsa:AAAA", "ed25519:not base64!", "ed25519:AAAA"] {
            let e = bad.parse::<PublicKey>().unwrap_err().to_string();
            assert!(e.starts_with("invalid key"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn debug_hides_secret() {
        let kp = KeyPair::from_seed(&[42; 32]);
        let dbg = format!("{kp:?}");
        assert!(dbg.contains("ed25519:") && !dbg.contains(&B64.encode([42u8; 32])), "{dbg}");
    }

    #[test]
    fn generate_differs() {
        assert_ne!(KeyPair::generate().unwrap().public_key(), KeyPair::generate().unwrap().public_key());
    }

    #[test]
    fn save_load_and_refuse_overwrite() {
        let dir = tempfile::tempdir().unwrap();
        let kp = KeyPair::generate().unwrap();
        let files = kp.save(dir.path(), "release").unwrap();
        assert_eq!(KeyPair::load(&files.secret).unwrap().public_key(), kp.public_key());
        assert_eq!(PublicKey::load(&files.public).unwrap(), kp.public_key());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            assert_eq!(std::fs::metadata(&files.secret).unwrap().permissions().mode() & 0o777, 0o600);
        }
        assert!(matches!(kp.save(dir.path(), "release"), Err(RegistryError::KeyExists { .. })));
        assert!(kp.save(dir.path(), "../evil").is_err());
        std::fs::write(dir.path().join("bad.pub"), "ed25519:xyz\n").unwrap();
        let e = PublicKey::load(&dir.path().join("bad.pub")).unwrap_err().to_string();
        assert!(e.contains("bad.pub"), "{e}");
    }
}
