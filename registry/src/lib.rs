//! Kernel-pack manifests, signatures, trust policy, downgrade protection and discovery.
//!
//! A *kernel pack* is third-party code the engine loads (a native library, a wasm module or a CUDA
//! library). This crate decides whether a pack on disk may be loaded; it never loads one itself.
//! **Architecture invariant:** data and crypto only — no `dlopen`, no wasm runtime, no `unsafe`.
//! See `docs/packs.md` for the user-facing description.
//!
//! # Pack layout
//!
//! ```text
//! cpu-avx512/            a pack directory
//! ├── pack.toml          the manifest (see [`Manifest`]); pins the artefact by sha256
//! ├── libcpu_avx512.so   the artefact ([`Artefact::file`])
//! └── pack.sig           ed25519 signature over the exact bytes of pack.toml (see [`PackSignature`])
//! ```
//!
//! # Core concepts
//!
//! - [`Manifest`]: a parsed, validated `pack.toml` (`Serialize`, for `spinfer pack inspect`).
//! - [`KeyPair`] / [`PublicKey`]: ed25519 keys; public text form `ed25519:<base64>`.
//! - [`sign_pack`]: writes `pack.sig`. [`verify_pack`] reads each file once (no symlinks, size
//!   caps), checks the signature over the raw manifest bytes *before* parsing them, then the
//!   manifest, the signer's right to the pack's name ([`TrustedKey`]) and the artefact hash, and
//!   returns a [`VerifiedPack`] holding the artefact bytes it hashed — the only way to get one,
//!   and the bytes a loader must load.
//! - [`InstallRecord`]: refuses downgrades per pack name (whoever signed) unless a version is
//!   explicitly allowed, refuses a stripped signature, and detects a deleted record (witness file).
//! - [`discover`]: lists pack directories in search directories and `SPINFER_PACK_PATH`.
//! - [`synthetic_shapes`]: the generic shape grid `spinfer tune --synthetic-shapes` measures.
//! - [`RegistryError`]: one error enum; messages name the pack (`name@version`) and path.
//!
//! # Example
//!
//! ```
//! use spinfer_registry::{sha256_hex, sign_pack, verify_pack, KeyPair, TrustPolicy};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let artefact = b"\0asm fake module";
//! std::fs::write(dir.path().join("k.wasm"), artefact)?;
//! std::fs::write(dir.path().join("pack.toml"), format!(
//!     "name = \"demo\"\nversion = \"1.0.0\"\nabi_version = 1\nkind = \"wasm\"\n\
//!      min_host_version = \"0.1.0\"\n[artefact]\nfile = \"k.wasm\"\nsha256 = \"{}\"\n\
//!      [[kernels]]\nname = \"dot_f32\"\nop = \"matmul\"\nweight = \"f32\"\nact = \"f32\"\n",
//!     sha256_hex(artefact)))?;
//!
//! let key = KeyPair::generate()?;
//! sign_pack(dir.path(), &key)?;
//!
//! let policy = TrustPolicy::new().with_trusted(key.public_key());
//! let pack = verify_pack(dir.path(), &policy)?;
//! assert_eq!(pack.id(), "demo@1.0.0");
//! assert_eq!(pack.signer(), Some(&key.public_key()));
//!
//! // Nobody trusted: refused.
//! assert!(verify_pack(dir.path(), &TrustPolicy::new()).is_err());
//! # Ok(())
//! # }
//! ```
#![forbid(unsafe_code)]

mod discover;
mod error;
mod fsutil;
mod keys;
mod manifest;
mod names;
mod record;
mod shapes;
mod signature;
mod verify;

pub use discover::{PACK_PATH_ENV, discover, discover_with, is_pack_dir};
pub use error::{RegistryError, Result};
pub use fsutil::{sha256_file, sha256_hex};
pub use keys::{KeyFiles, KeyPair, PUBLIC_KEY_PREFIX, PublicKey, SECRET_KEY_PREFIX};
pub use manifest::{Artefact, KernelEntry, MANIFEST_FILE, MAX_MANIFEST_BYTES, MAX_NAME_LEN, Manifest, PackKind};
pub use record::{InstallRecord, UNSIGNED_SIGNER};
/// Semantic versions (pack `version`, `min_host_version`), re-exported so callers need no `semver` dependency.
pub use semver::Version;
pub use shapes::{SYNTHETIC_COLS, SYNTHETIC_MAX_ELEMENTS, SYNTHETIC_ROWS, synthetic_shapes};
pub use signature::{MAX_SIGNATURE_BYTES, PackSignature, SIGNATURE_FILE};
pub use verify::{
    DEFAULT_MAX_ARTEFACT_BYTES, DEFAULT_MAX_WASM_BYTES, TrustPolicy, TrustedKey, VerifiedPack, VerifyLimits, sign_pack,
    verify_pack, verify_pack_with,
};
