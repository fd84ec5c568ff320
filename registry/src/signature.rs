//! `pack.sig`: an ed25519 signature over the exact bytes of `pack.toml`.
//!
//! Format: one line of text,
//!
//! ```text
//! ed25519:<base64 public key, 32 bytes>:<base64 signature, 64 bytes>
//! ```
//!
//! followed by an optional newline. The public key is a hint telling the verifier which key signed;
//! trust comes only from the [`TrustPolicy`](crate::TrustPolicy), never from the file. Because
//! `pack.toml` pins the artefact by sha256, the signature covers the artefact too.
//! The file can be checked without spinfer: base64-decode the last field and verify it over
//! `pack.toml` with any ed25519 tool.

use std::fmt;
use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use ed25519_dalek::Signature;

use crate::error::{RegistryError, Result};
use crate::keys::{KeyPair, PUBLIC_KEY_PREFIX, PublicKey};
pub use crate::names::SIGNATURE_FILE;

/// Largest accepted `pack.sig`, in bytes (1 KiB; a signature line is about 150): a bigger file is
/// refused before it is parsed.
pub const MAX_SIGNATURE_BYTES: u64 = 1024;

/// A parsed `pack.sig`.
#[derive(Clone, PartialEq, Eq)]
pub struct PackSignature {
    key: PublicKey,
    signature: Signature,
}

impl PackSignature {
    /// Signs the exact manifest bytes with `key`.
    pub fn sign(manifest_bytes: &[u8], key: &KeyPair) -> Self {
        Self { key: key.public_key(), signature: key.sign(manifest_bytes) }
    }

    /// The key that claims to have signed (not yet trusted, not yet verified).
    pub fn key(&self) -> &PublicKey {
        &self.key
    }

    /// Whether the signature verifies over `manifest_bytes` with the embedded key (strict ed25519).
    pub fn verifies(&self, manifest_bytes: &[u8]) -> bool {
        self.key.verify(manifest_bytes, &self.signature)
    }

    /// Parses the text form; the error message is completed into
    /// [`RegistryError::MalformedSignature`] by the caller, which knows the pack.
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let text = text.trim_end_matches(['\n', '\r']);
        let rest = text
            .strip_prefix(PUBLIC_KEY_PREFIX)
            .ok_or_else(|| format!("expected `{PUBLIC_KEY_PREFIX}<key>:<signature>`"))?;
        let (key_b64, sig_b64) = rest.split_once(':').ok_or("expected `ed25519:<key>:<signature>`")?;
        let key_bytes = crate::keys::decode32(key_b64).map_err(|e| format!("public key: {e}"))?;
        let key = PublicKey::from_bytes(&key_bytes).map_err(|e| e.to_string())?;
        let sig = B64.decode(sig_b64).map_err(|e| format!("signature: bad base64: {e}"))?;
        let sig = <[u8; 64]>::try_from(sig.as_slice())
            .map_err(|_| format!("signature: expected 64 bytes, got {}", sig.len()))?;
        Ok(Self { key, signature: Signature::from_bytes(&sig) })
    }

    /// Reads `dir/pack.sig` (opened once without following a symlink, a regular file of at most
    /// [`MAX_SIGNATURE_BYTES`]); `Ok(None)` if the file does not exist.
    ///
    /// # Errors
    /// [`RegistryError::Io`], [`RegistryError::Symlink`], [`RegistryError::NotAFile`],
    /// [`RegistryError::TooLarge`], or [`RegistryError::MalformedSignature`] attributed to `pack`.
    pub fn read(dir: &Path, pack: &str) -> Result<Option<Self>> {
        let path = dir.join(SIGNATURE_FILE);
        let Some(text) = crate::fsutil::read_capped(&path, MAX_SIGNATURE_BYTES, "pack signature")? else {
            return Ok(None);
        };
        let malformed =
            |message: String| RegistryError::MalformedSignature { pack: pack.into(), path: path.clone(), message };
        let text = String::from_utf8(text).map_err(|_| malformed("not valid utf-8".into()))?;
        Self::parse(&text).map(Some).map_err(malformed)
    }
}

impl fmt::Display for PackSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.key, B64.encode(self.signature.to_bytes()))
    }
}

impl fmt::Debug for PackSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PackSignature").field("key", &self.key).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_verify() {
        let kp = KeyPair::from_seed(&[1; 32]);
        let sig = PackSignature::sign(b"name = \"x\"\n", &kp);
        let text = format!("{sig}\n");
        assert_eq!(text.matches(':').count(), 2);
        let back = PackSignature::parse(&text).unwrap();
        assert_eq!(back, sig);
        assert!(back.verifies(b"name = \"x\"\n"));
        assert!(!back.verifies(b"name = \"y\"\n"));
        assert_eq!(back.key(), &kp.public_key());
    }

    #[test]
    fn malformed() {
        let kp = KeyPair::from_seed(&[1; 32]);
        let good = PackSignature::sign(b"m", &kp).to_string();
        let (head, _) = good.rsplit_once(':').unwrap();
        for bad in ["", "rsa:a:b", "ed25519:onlyone", &format!("{head}:AAAA"), &format!("{head}:!!")] {
            assert!(PackSignature::parse(bad).is_err(), "{bad:?}");
        }
    }
}
