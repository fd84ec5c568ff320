//! `pack.toml`: what a pack is, which artefact it ships (pinned by sha256) and which kernels it offers.
//!
//! ```toml
//! name = "cpu-avx512"
//! version = "1.2.0"
//! abi_version = 1
//! kind = "native"             # "native" | "wasm" | "cuda"
//! min_host_version = "0.1.0"
//! description = "AVX-512 quantised matmul kernels"   # optional
//! authors = ["Jane Doe <jane@example.org>"]           # optional
//!
//! [artefact]
//! file = "libcpu_avx512.so"   # a plain file name inside the pack directory
//! sha256 = "<64 hex digits>"
//!
//! [[kernels]]
//! name = "avx512_q4_1"
//! op = "matmul"
//! weight = "q4_1"
//! act = "q8_1"
//! ```
//!
//! Unknown fields are rejected (a typo is an error, not a silently ignored setting).

use std::path::Path;

use semver::Version;
use serde::{Deserialize, Serialize};

use crate::error::{RegistryError, Result};
use crate::fsutil::{EXCERPT_CHARS, excerpt, read_capped};
use crate::names::validate_name;
pub use crate::names::{MANIFEST_FILE, MAX_NAME_LEN};

/// Largest accepted `pack.toml`, in bytes (64 KiB): a bigger file is refused before it is parsed
/// or its signature checked.
pub const MAX_MANIFEST_BYTES: u64 = 64 * 1024;

/// A parsed and validated `pack.toml`.
///
/// Fields are public so tools can build manifests (`spinfer pack new`) and print them
/// (`spinfer pack inspect`, via [`Serialize`]); call [`Manifest::validate`] after building one by hand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Manifest {
    /// Pack name, `[a-z0-9-]+`, starting with a letter or digit.
    pub name: String,
    /// Pack version (semver; a pre-release such as `1.0.0-rc.1` is allowed, build metadata is not).
    pub version: Version,
    /// Version of the kernel ABI the artefact was built against; the engine checks it, not this crate.
    pub abi_version: u32,
    /// How the artefact is loaded.
    pub kind: PackKind,
    /// Oldest spinfer host version the pack works with.
    pub min_host_version: Version,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub authors: Vec<String>,
    pub artefact: Artefact,
    /// Kernels it offers (may be empty for a pack that only offers loaders).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernels: Vec<KernelEntry>,
    /// Model-file loaders it offers; the host uses only the ones listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loaders: Vec<LoaderEntry>,
}

/// How the engine loads a pack's artefact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PackKind {
    /// A native shared library (`.so`/`.dylib`/`.dll`) exposing the stable-ABI root module.
    Native,
    /// A WebAssembly module run in the sandboxed wasm host.
    Wasm,
    /// A native library with CUDA kernels.
    Cuda,
}

/// The single file a pack ships, pinned by its sha256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artefact {
    /// Plain file name inside the pack directory (no directories, no `..`, not absolute).
    pub file: String,
    /// Lowercase hex sha256 of the file (uppercase is accepted and normalised by [`Manifest::parse`]).
    pub sha256: String,
}

/// One kernel the pack offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelEntry {
    /// Kernel name, unique within the pack, e.g. `avx512_q4_1`.
    pub name: String,
    /// Operation, e.g. `matmul`.
    pub op: String,
    /// Weight format, e.g. `q4_1`.
    pub weight: String,
    /// Activation format, e.g. `q8_1`.
    pub act: String,
}

/// One model-file loader the pack offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoaderEntry {
    /// The loader's name, as the library reports it (`npy_dir`).
    pub name: String,
}

/// What serde reads; versions stay strings so errors can name the field.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    name: String,
    version: String,
    abi_version: u32,
    kind: PackKind,
    min_host_version: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    authors: Vec<String>,
    artefact: Artefact,
    #[serde(default)]
    kernels: Vec<KernelEntry>,
    #[serde(default)]
    loaders: Vec<LoaderEntry>,
}

impl Manifest {
    /// Parses and validates the bytes of a `pack.toml`; `path` is only used in error messages.
    ///
    /// # Errors
    /// [`RegistryError::InvalidManifest`] naming `path` and, where known, the field.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self> {
        let text = std::str::from_utf8(bytes).map_err(|e| RegistryError::InvalidManifest {
            path: path.to_path_buf(),
            field: None,
            message: format!("not valid utf-8: {e}"),
        })?;
        let raw: RawManifest = toml::from_str(text).map_err(|e| RegistryError::InvalidManifest {
            path: path.to_path_buf(),
            field: None,
            message: describe_toml_error(text, &e),
        })?;
        let mut manifest = Self {
            version: parse_version(&raw.version, path, "version")?,
            min_host_version: parse_version(&raw.min_host_version, path, "min_host_version")?,
            name: raw.name,
            abi_version: raw.abi_version,
            kind: raw.kind,
            description: raw.description,
            authors: raw.authors,
            artefact: raw.artefact,
            kernels: raw.kernels,
            loaders: raw.loaders,
        };
        manifest.artefact.sha256.make_ascii_lowercase();
        manifest.validate_at(path)?;
        Ok(manifest)
    }

    /// Reads and parses `dir/pack.toml`, returning the manifest and the exact bytes read
    /// (the bytes a signature covers). The file is read as [`read_raw`](Self::read_raw) reads it.
    ///
    /// This parses an unverified manifest: [`verify_pack`](crate::verify_pack) checks the
    /// signature over [`read_raw`](Self::read_raw)'s bytes first and parses only then.
    ///
    /// # Errors
    /// As [`read_raw`](Self::read_raw), and [`RegistryError::InvalidManifest`].
    pub fn read(dir: &Path) -> Result<(Self, Vec<u8>)> {
        let bytes = Self::read_raw(dir)?;
        let manifest = Self::parse(&bytes, &dir.join(MANIFEST_FILE))?;
        Ok((manifest, bytes))
    }

    /// The raw bytes of `dir/pack.toml`, unparsed: opened once without following a symlink,
    /// a regular file of at most [`MAX_MANIFEST_BYTES`].
    ///
    /// # Errors
    /// [`RegistryError::MissingManifest`], [`RegistryError::Symlink`], [`RegistryError::NotAFile`],
    /// [`RegistryError::TooLarge`], [`RegistryError::Io`].
    pub fn read_raw(dir: &Path) -> Result<Vec<u8>> {
        let path = dir.join(MANIFEST_FILE);
        read_capped(&path, MAX_MANIFEST_BYTES, "pack manifest")?.ok_or(RegistryError::MissingManifest { path })
    }

    /// Checks the invariants serde cannot express: name syntax, semver form, artefact file name and
    /// hash syntax, kernel entries (at least one, unique names, `[a-z0-9_]+` identifiers).
    ///
    /// # Errors
    /// [`RegistryError::InvalidManifest`] naming the field (the path is `pack.toml`).
    pub fn validate(&self) -> Result<()> {
        self.validate_at(Path::new(MANIFEST_FILE))
    }

    /// `name@version`, the form used in messages and records.
    pub fn id(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }

    /// Whether a host of version `host` satisfies `min_host_version`.
    pub fn supports_host(&self, host: &Version) -> bool {
        *host >= self.min_host_version
    }

    /// Serialises the manifest as `pack.toml` text.
    pub fn to_toml_string(&self) -> String {
        // The manifest holds only strings, integers, arrays and tables: serialisation cannot fail.
        toml::to_string(self).expect("manifest serialises to toml")
    }

    fn validate_at(&self, path: &Path) -> Result<()> {
        let err = |field: &str, message: String| RegistryError::manifest_field(path, field, message);
        validate_name(&self.name).map_err(|m| err("name", m))?;
        for (field, v) in [("version", &self.version), ("min_host_version", &self.min_host_version)] {
            if !v.build.is_empty() {
                return Err(err(field, format!("build metadata (`+{}`) is not allowed in `{v}`", v.build)));
            }
        }
        validate_file_name(&self.artefact.file).map_err(|m| err("artefact.file", m))?;
        let sha = &self.artefact.sha256;
        if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(err(
                "artefact.sha256",
                format!("expected 64 hex digits, got {:?}", excerpt(sha, EXCERPT_CHARS)),
            ));
        }
        if self.kernels.is_empty() && self.loaders.is_empty() {
            return Err(err("kernels", "a pack must declare at least one [[kernels]] or [[loaders]] entry".into()));
        }
        for (i, l) in self.loaders.iter().enumerate() {
            validate_ident(&l.name).map_err(|m| err(&format!("loaders[{i}].name"), m))?;
            if self.loaders[..i].iter().any(|prev| prev.name == l.name) {
                return Err(err(&format!("loaders[{i}].name"), format!("duplicate loader name {:?}", l.name)));
            }
        }
        for (i, k) in self.kernels.iter().enumerate() {
            for (field, value) in [("name", &k.name), ("op", &k.op), ("weight", &k.weight), ("act", &k.act)] {
                validate_ident(value).map_err(|m| err(&format!("kernels[{i}].{field}"), m))?;
            }
            if self.kernels[..i].iter().any(|prev| prev.name == k.name) {
                return Err(err(&format!("kernels[{i}].name"), format!("duplicate kernel name {:?}", k.name)));
            }
        }
        Ok(())
    }
}

fn parse_version(text: &str, path: &Path, field: &str) -> Result<Version> {
    Version::parse(text).map_err(|e| {
        let text = excerpt(text, EXCERPT_CHARS);
        RegistryError::manifest_field(path, field, format!("{text:?} is not a semver version MAJOR.MINOR.PATCH: {e}"))
    })
}

/// `[a-z0-9_]+` (kernel names, ops, formats).
fn validate_ident(value: &str) -> std::result::Result<(), String> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return Err(format!("{:?} must match [a-z0-9_]+", excerpt(value, EXCERPT_CHARS)));
    }
    Ok(())
}

/// A single normal path component: no separators, not `.`/`..`, not hidden, not a pack metadata file.
pub(crate) fn validate_file_name(file: &str) -> std::result::Result<(), String> {
    let problem = if file.is_empty() {
        Some("is empty")
    } else if file.contains(['/', '\\', ':', '\0']) || Path::new(file).is_absolute() {
        Some("must be a plain file name inside the pack directory (no directories, no absolute path)")
    } else if file.starts_with('.') {
        Some("must not start with `.` (no `..`, no hidden files)")
    } else if file == MANIFEST_FILE || file == crate::names::SIGNATURE_FILE {
        Some("must not be the pack's own metadata file")
    } else {
        None
    };
    match problem {
        Some(p) => Err(format!("{:?} {p}", excerpt(file, EXCERPT_CHARS))),
        None => Ok(()),
    }
}

/// One line: `line L, column C: <message> (in `<source line>`)`; the message and the source line
/// are cut to a short excerpt (the input may be hostile: no error message echoes all of it).
fn describe_toml_error(text: &str, e: &toml::de::Error) -> String {
    let message = excerpt(e.message().trim_end_matches('\n'), 2 * EXCERPT_CHARS);
    let Some(span) = e.span() else { return message.to_string() };
    let start = span.start.min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let line_no = text[..start].matches('\n').count() + 1;
    let column = text[line_start..start].chars().count() + 1;
    let source_line = excerpt(text[line_start..line_end].trim(), EXCERPT_CHARS);
    if source_line.is_empty() {
        format!("line {line_no}, column {column}: {message}")
    } else {
        format!("line {line_no}, column {column}: {message} (in `{source_line}`)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
name = "cpu-ref"
version = "1.2.3"
abi_version = 1
kind = "native"
min_host_version = "0.1.0"
description = "reference kernels"

[artefact]
file = "libcpu_ref.so"
sha256 = "ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0123456789"

[[kernels]]
name = "avx512_q4_1"
op = "matmul"
weight = "q4_1"
act = "q8_1"
"#;

    fn parse(text: &str) -> Result<Manifest> {
        Manifest::parse(text.as_bytes(), Path::new("/packs/x/pack.toml"))
    }

    fn field_of(e: RegistryError) -> Option<String> {
        match e {
            RegistryError::InvalidManifest { field, .. } => field,
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn parses_good_manifest_and_normalises_hash() {
        let m = parse(GOOD).unwrap();
        assert_eq!(m.id(), "cpu-ref@1.2.3");
        assert_eq!(m.kind, PackKind::Native);
        assert_eq!(m.artefact.sha256, "abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789");
        assert!(m.supports_host(&Version::new(0, 1, 0)) && !m.supports_host(&Version::new(0, 0, 9)));
        assert!(m.authors.is_empty());
    }

    #[test]
    fn serialised_manifest_round_trips() {
        let m = parse(GOOD).unwrap();
        assert_eq!(parse(&m.to_toml_string()).unwrap(), m);
    }

    #[test]
    fn versions_order_by_semver() {
        let v = |s| Version::parse(s).unwrap();
        assert!(v("1.10.0") > v("1.9.9") && v("1.0.0-rc.1") < v("1.0.0"));
    }

    #[test]
    fn kind_and_field_errors() {
        let e = parse(&GOOD.replace("\"native\"", "\"python\"")).unwrap_err().to_string();
        assert!(e.contains("unknown variant `python`") && e.contains("kind = \"python\""), "{e}");
        let e = parse(&GOOD.replace("abi_version = 1", "abi_version = \"one\"")).unwrap_err().to_string();
        assert!(e.contains("line 4") && e.contains("abi_version"), "{e}");
        assert_eq!(field_of(parse(&GOOD.replace("1.2.3", "1.2.3+build")).unwrap_err()).as_deref(), Some("version"));
        assert_eq!(
            field_of(parse(&GOOD.replace("\"0.1.0\"", "\"0.1\"")).unwrap_err()).as_deref(),
            Some("min_host_version")
        );
    }

    #[test]
    fn kernel_entries_are_checked() {
        let dup =
            format!("{GOOD}\n[[kernels]]\nname = \"avx512_q4_1\"\nop = \"matmul\"\nweight = \"q4_0\"\nact = \"f32\"\n");
        assert_eq!(field_of(parse(&dup).unwrap_err()).as_deref(), Some("kernels[1].name"));
        let bad_op = GOOD.replace("\"matmul\"", "\"Mat Mul\"");
        assert_eq!(field_of(parse(&bad_op).unwrap_err()).as_deref(), Some("kernels[0].op"));
        // Neither kernels nor loaders: refused, naming the field.
        let neither = GOOD.split("[[kernels]]").next().unwrap();
        assert_eq!(field_of(parse(neither).unwrap_err()).as_deref(), Some("kernels"));
        let mut m = parse(GOOD).unwrap();
        m.kernels.clear();
        assert_eq!(field_of(m.validate().unwrap_err()).as_deref(), Some("kernels"));
    }

    #[test]
    fn a_pack_may_offer_only_loaders() {
        let only = format!("{}[[loaders]]\nname = \"npy_dir\"\n", GOOD.split("[[kernels]]").next().unwrap());
        let m = parse(&only).unwrap();
        assert!(m.kernels.is_empty());
        assert_eq!(m.loaders, vec![LoaderEntry { name: "npy_dir".into() }]);
        let dup = format!("{only}[[loaders]]\nname = \"npy_dir\"\n");
        assert_eq!(field_of(parse(&dup).unwrap_err()).as_deref(), Some("loaders[1].name"));
        let bad = only.replace("npy_dir", "npy dir");
        assert_eq!(field_of(parse(&bad).unwrap_err()).as_deref(), Some("loaders[0].name"));
    }

    #[test]
    fn file_names() {
        for bad in ["", "../x", "a/b", "/etc/passwd", "..", ".hidden", "a\\b", "pack.sig", "pack.toml", "c:x"] {
            assert!(validate_file_name(bad).is_err(), "{bad:?}");
        }
        for good in ["libk.so", "kernels.wasm", "k-1.2_x.dll"] {
            assert!(validate_file_name(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn errors_quote_only_an_excerpt_of_the_input() {
        let long = "Xx".repeat(5_000);
        for text in [
            format!("{GOOD}\nbogus = \"{long}\"\n"),
            GOOD.replace("\"1.2.3\"", &format!("\"{long}\"")),
            GOOD.replace("\"matmul\"", &format!("\"{long}\"")),
            GOOD.replace("\"libcpu_ref.so\"", &format!("\"../{long}\"")),
            GOOD.replace("ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0123456789", &long),
            format!("{long} = ="),
        ] {
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.len() < 400, "{} chars: {e}", e.len());
        }
    }

    #[test]
    fn names() {
        for bad in ["", "Cpu", "cpu_ref", "-cpu", "cpu ref", &"a".repeat(65)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
        for good in ["cpu", "cpu-ref-2", "0x"] {
            assert!(validate_name(good).is_ok(), "{good:?}");
        }
    }
}
