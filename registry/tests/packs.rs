//! End-to-end tests of the pack trust chain: sign → verify, tampering, trust policy, downgrades,
//! manifest errors and discovery. Every pack is a few small files in a temporary directory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use spinfer_registry::{
    InstallRecord, KeyPair, Manifest, PackKind, RegistryError, TrustPolicy, Version, discover_with, sha256_hex,
    sign_pack, verify_pack,
};
use tempfile::TempDir;

const ARTEFACT: &[u8] = b"\x7fELF pretend shared library";

fn manifest_text(name: &str, version: &str, sha: &str) -> String {
    format!(
        r#"name = "{name}"
version = "{version}"
abi_version = 1
kind = "native"
min_host_version = "0.1.0"
description = "test pack"
authors = ["Test <test@example.org>"]

[artefact]
file = "libk.so"
sha256 = "{sha}"

[[kernels]]
name = "avx512_q4_1"
op = "matmul"
weight = "q4_1"
act = "q8_1"
"#
    )
}

/// Writes an unsigned pack `root/<dir_name>` and returns its path.
fn write_pack(root: &Path, dir_name: &str, name: &str, version: &str) -> PathBuf {
    let dir = root.join(dir_name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("libk.so"), ARTEFACT).unwrap();
    std::fs::write(dir.join("pack.toml"), manifest_text(name, version, &sha256_hex(ARTEFACT))).unwrap();
    dir
}

fn signed_pack(root: &Path, version: &str, key: &KeyPair) -> PathBuf {
    let dir = write_pack(root, &format!("cpu-ref-{version}"), "cpu-ref", version);
    sign_pack(&dir, key).unwrap();
    dir
}

fn key(seed: u8) -> KeyPair {
    KeyPair::from_seed(&[seed; 32])
}

fn trusting(k: &KeyPair) -> TrustPolicy {
    TrustPolicy::new().with_trusted(k.public_key())
}

fn tmp() -> TempDir {
    tempfile::tempdir().unwrap()
}

// === Signing and verification ===

#[test]
fn sign_then_verify_ok() {
    let root = tmp();
    let k = key(1);
    let dir = signed_pack(root.path(), "1.0.0", &k);
    let sig = std::fs::read_to_string(dir.join("pack.sig")).unwrap();
    assert!(sig.starts_with(&format!("{}:", k.public_key())) && sig.ends_with('\n'), "{sig}");

    let pack = verify_pack(&dir, &trusting(&k)).unwrap();
    assert_eq!(pack.id(), "cpu-ref@1.0.0");
    assert_eq!(pack.manifest().kind, PackKind::Native);
    assert_eq!(pack.manifest().kernels[0].name, "avx512_q4_1");
    assert_eq!(pack.dir(), dir);
    assert_eq!(pack.artefact_path(), dir.join("libk.so"));
    assert_eq!(pack.artefact_bytes(), ARTEFACT, "the bytes hashed are held for the loader");
    assert_eq!(pack.signer(), Some(&k.public_key()));
    assert!(!pack.is_unsigned());
}

#[test]
fn tampered_manifest_byte_is_a_bad_signature() {
    let root = tmp();
    let k = key(1);
    let dir = signed_pack(root.path(), "1.0.0", &k);
    let mut bytes = std::fs::read(dir.join("pack.toml")).unwrap();
    let pos = bytes.windows(9).position(|w| w == b"test pack").unwrap();
    bytes[pos] = b'b'; // "best pack": still a valid manifest, different bytes.
    std::fs::write(dir.join("pack.toml"), &bytes).unwrap();

    let e = verify_pack(&dir, &trusting(&k)).unwrap_err();
    assert!(matches!(e, RegistryError::BadSignature { .. }), "{e}");
    let msg = e.to_string();
    // Named by its directory: the manifest is not parsed before its signature checks out.
    assert!(msg.contains(&dir.display().to_string()) && msg.contains("pack.toml"), "{msg}");
}

#[test]
fn tampered_artefact_is_a_hash_mismatch() {
    let root = tmp();
    let k = key(1);
    let dir = signed_pack(root.path(), "1.0.0", &k);
    std::fs::write(dir.join("libk.so"), b"\x7fELF evil").unwrap();
    let e = verify_pack(&dir, &trusting(&k)).unwrap_err();
    match &e {
        RegistryError::ArtefactHashMismatch { pack, expected, actual, .. } => {
            assert_eq!(pack, "cpu-ref@1.0.0");
            assert_eq!(*expected, sha256_hex(ARTEFACT));
            assert_eq!(*actual, sha256_hex(b"\x7fELF evil"));
        }
        other => panic!("unexpected {other}"),
    }
    assert!(e.to_string().contains("libk.so"), "{e}");
}

#[test]
fn missing_artefact_and_missing_manifest() {
    let root = tmp();
    let k = key(1);
    let dir = signed_pack(root.path(), "1.0.0", &k);
    std::fs::remove_file(dir.join("libk.so")).unwrap();
    let e = verify_pack(&dir, &trusting(&k)).unwrap_err();
    assert!(matches!(e, RegistryError::MissingArtefact { .. }), "{e}");
    assert!(e.to_string().contains("cpu-ref@1.0.0"), "{e}");
    // Signing also refuses a pack that would not verify.
    assert!(matches!(sign_pack(&dir, &k), Err(RegistryError::MissingArtefact { .. })));

    let e = verify_pack(&root.path().join("nothing"), &trusting(&k)).unwrap_err();
    assert!(matches!(e, RegistryError::MissingManifest { .. }), "{e}");
}

// === Trust policy ===

#[test]
fn unsigned_refused_unless_allowed() {
    let root = tmp();
    let dir = write_pack(root.path(), "dev", "dev-pack", "0.1.0");
    let e = verify_pack(&dir, &TrustPolicy::new()).unwrap_err();
    assert!(matches!(e, RegistryError::Unsigned { .. }), "{e}");
    assert!(e.to_string().contains(&dir.display().to_string()), "{e}");

    let pack = verify_pack(&dir, &TrustPolicy::new().with_unsigned_allowed(true)).unwrap();
    assert!(pack.is_unsigned() && pack.signer().is_none());

    // Allowing unsigned packs does not excuse a broken signature.
    std::fs::write(dir.join("pack.sig"), "garbage\n").unwrap();
    let e = verify_pack(&dir, &TrustPolicy::new().with_unsigned_allowed(true)).unwrap_err();
    assert!(matches!(e, RegistryError::MalformedSignature { .. }), "{e}");
}

#[test]
fn untrusted_key_refused() {
    let root = tmp();
    let dir = signed_pack(root.path(), "1.0.0", &key(1));
    let e = verify_pack(&dir, &trusting(&key(2)).with_unsigned_allowed(true)).unwrap_err();
    match &e {
        RegistryError::UntrustedKey { key: k, .. } => assert_eq!(*k, key(1).public_key().to_string()),
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn revoked_key_refused_even_if_trusted() {
    let root = tmp();
    let k = key(1);
    let dir = signed_pack(root.path(), "1.0.0", &k);
    let policy = trusting(&k).with_revoked(k.public_key());
    let e = verify_pack(&dir, &policy).unwrap_err();
    assert!(matches!(e, RegistryError::RevokedKey { .. }), "{e}");
    assert!(e.to_string().contains("revoked key ed25519:"), "{e}");
}

#[test]
fn signature_by_other_key_claiming_trusted_key_fails() {
    // pack.sig names the trusted key but was produced by another key: bad signature.
    let root = tmp();
    let (trusted, attacker) = (key(1), key(2));
    let dir = signed_pack(root.path(), "1.0.0", &attacker);
    let text = std::fs::read_to_string(dir.join("pack.sig")).unwrap();
    let forged = text.replace(&attacker.public_key().to_string(), &trusted.public_key().to_string());
    std::fs::write(dir.join("pack.sig"), forged).unwrap();
    let e = verify_pack(&dir, &trusting(&trusted)).unwrap_err();
    assert!(matches!(e, RegistryError::BadSignature { .. }), "{e}");
}

// === Downgrade protection ===

#[test]
fn downgrade_refused_allowed_version_ok_upgrade_ok_and_persisted() {
    let root = tmp();
    let k = key(1);
    let policy = trusting(&k);
    let v = |s: &str| verify_pack(&signed_pack(root.path(), s, &k), &policy).unwrap();
    let record_path = root.path().join("state").join("installed.toml");

    let mut rec = InstallRecord::open(&record_path).unwrap();
    rec.check_and_record(&v("1.2.0"), None).unwrap();
    rec.check_and_record(&v("1.2.0"), None).unwrap(); // same version: fine
    match rec.check_and_record(&v("1.1.9"), None) {
        Err(RegistryError::Downgrade { name, have, got }) => {
            assert_eq!((name.as_str(), have, got), ("cpu-ref", Version::new(1, 2, 0), Version::new(1, 1, 9)));
        }
        other => panic!("expected downgrade, got {other:?}"),
    }
    // Allowing another version does not allow this one.
    assert!(rec.check_and_record(&v("1.1.9"), Some(&Version::new(1, 1, 8))).is_err());
    rec.check_and_record(&v("1.1.9"), Some(&Version::new(1, 1, 9))).unwrap(); // allowed: record not lowered
    assert_eq!(rec.highest("cpu-ref"), Some(&Version::new(1, 2, 0)));
    rec.check_and_record(&v("1.10.0"), None).unwrap(); // upgrade (semver order, not string order)

    // Persisted: a fresh handle sees 1.10.0 and refuses 1.2.0.
    let mut reopened = InstallRecord::open(&record_path).unwrap();
    assert_eq!(reopened.highest("cpu-ref"), Some(&Version::new(1, 10, 0)));
    let e = reopened.check_and_record(&v("1.2.0"), None).unwrap_err();
    assert!(e.to_string().contains("from 1.10.0 to 1.2.0") && e.to_string().contains("pinned_versions"), "{e}");
}

#[test]
fn downgrade_is_per_name_whoever_signs_and_unsigned_copies_of_signed_names_are_refused() {
    let root = tmp();
    let (a, b) = (key(1), key(2));
    let policy = TrustPolicy::new().with_trusted(a.public_key()).with_trusted(b.public_key());
    let mut rec = InstallRecord::open(root.path().join("rec.toml")).unwrap();
    rec.check_and_record(&verify_pack(&signed_pack(root.path(), "2.0.0", &a), &policy).unwrap(), None).unwrap();
    // A second trusted key signing an older version: still a downgrade.
    let other = tmp();
    let old = verify_pack(&signed_pack(other.path(), "1.0.0", &b), &policy).unwrap();
    let e = rec.check_and_record(&old, None).unwrap_err();
    assert!(matches!(e, RegistryError::Downgrade { .. }), "{e}");

    // The same name, unsigned (a stripped signature), even at a higher version.
    let dev = write_pack(root.path(), "dev", "cpu-ref", "9.0.0");
    let unsigned = verify_pack(&dev, &TrustPolicy::new().with_unsigned_allowed(true)).unwrap();
    let e = rec.check_and_record(&unsigned, None).unwrap_err();
    assert!(matches!(e, RegistryError::StrippedSignature { .. }), "{e}");
    assert!(e.to_string().contains("cpu-ref") && e.to_string().contains("signed"), "{e}");
    assert_eq!(rec.highest("cpu-ref"), Some(&Version::new(2, 0, 0)));
    let text = std::fs::read_to_string(root.path().join("rec.toml")).unwrap();
    assert_eq!(text.matches("[[pack]]").count(), 1, "{text}");
    assert!(text.contains("signed = true"), "{text}");
}

// === Manifest errors ===

fn manifest_error(text: &str) -> (Option<String>, String) {
    let e = Manifest::parse(text.as_bytes(), Path::new("/packs/p/pack.toml")).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("/packs/p/pack.toml"), "{msg}");
    match e {
        RegistryError::InvalidManifest { field, .. } => (field, msg),
        other => panic!("unexpected {other}"),
    }
}

#[test]
fn manifest_errors_name_the_field() {
    let good = manifest_text("cpu-ref", "1.0.0", &sha256_hex(ARTEFACT));
    Manifest::parse(good.as_bytes(), Path::new("pack.toml")).unwrap();

    let (_, msg) = manifest_error(&format!("{good}\n[extra]\nx = 1\n"));
    assert!(msg.contains("unknown field `extra`"), "{msg}");
    let (_, msg) = manifest_error(&good.replace("abi_version = 1", "abi_version = 1\nlicense = \"MIT\""));
    assert!(msg.contains("unknown field `license`") && msg.contains("line 4"), "{msg}");

    let (field, msg) = manifest_error(&good.replace("\"cpu-ref\"", "\"CPU_ref\""));
    assert_eq!(field.as_deref(), Some("name"), "{msg}");
    assert!(msg.contains("field `name`") && msg.contains("[a-z0-9-]+"), "{msg}");

    let (field, msg) = manifest_error(&good.replace("\"libk.so\"", "\"../x\""));
    assert_eq!(field.as_deref(), Some("artefact.file"), "{msg}");
    let (field, _) = manifest_error(&good.replace("\"libk.so\"", "\"/usr/lib/libk.so\""));
    assert_eq!(field.as_deref(), Some("artefact.file"));

    let (field, msg) = manifest_error(&good.replace("\"1.0.0\"", "\"1.0\""));
    assert_eq!(field.as_deref(), Some("version"), "{msg}");
    assert!(msg.contains("\"1.0\"") && msg.contains("semver"), "{msg}");

    let (field, msg) = manifest_error(&good.replace(&sha256_hex(ARTEFACT), "abc"));
    assert_eq!(field.as_deref(), Some("artefact.sha256"), "{msg}");

    let (_, msg) = manifest_error(&good.replace("op = \"matmul\"\n", ""));
    assert!(msg.contains("missing field `op`"), "{msg}");
}

#[test]
fn invalid_manifest_in_pack_dir_names_the_file() {
    let root = tmp();
    let dir = write_pack(root.path(), "p", "p", "1.0.0");
    std::fs::write(dir.join("pack.toml"), "name = \"p\"\nversion = 1.0.0\n").unwrap();
    let e = verify_pack(&dir, &TrustPolicy::new().with_unsigned_allowed(true)).unwrap_err();
    assert!(matches!(e, RegistryError::InvalidManifest { .. }), "{e}");
    assert!(e.to_string().contains(&dir.join("pack.toml").display().to_string()), "{e}");
}

// === Discovery ===

#[test]
fn discovery_is_sorted_and_includes_pack_path() {
    let a = tmp();
    let b = tmp();
    let extra = tmp();
    for n in ["zeta", "alpha", "mid"] {
        write_pack(a.path(), n, n, "1.0.0");
    }
    std::fs::create_dir(a.path().join("not-a-pack")).unwrap();
    write_pack(a.path(), ".hidden", "hidden", "1.0.0");
    std::fs::write(a.path().join("stray-file"), "x").unwrap();
    write_pack(b.path(), "beta", "beta", "1.0.0");
    let single = write_pack(extra.path(), "single", "single", "1.0.0");
    let missing = extra.path().join("does-not-exist");

    let dirs = vec![a.path().to_path_buf(), root_missing(&a)];
    let env = std::env::join_paths([single.clone(), b.path().to_path_buf(), a.path().join("alpha"), missing.clone()])
        .unwrap();
    let found = discover_with(&dirs, Some(&env));

    let ok: Vec<PathBuf> = found.iter().filter_map(|r| r.as_ref().ok().cloned()).collect();
    assert_eq!(
        ok,
        vec![a.path().join("alpha"), a.path().join("mid"), a.path().join("zeta"), single, b.path().join("beta")],
        "search dir sorted, then SPINFER_PACK_PATH entries in order, duplicates dropped"
    );
    let errs: Vec<&RegistryError> = found.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(errs.len(), 1);
    assert!(matches!(errs[0], RegistryError::PackPathMissing { path } if *path == missing));

    // Deterministic: same answer twice; no env value means only the search dirs.
    let again: Vec<_> = discover_with(&dirs, Some(&env)).into_iter().filter_map(Result::ok).collect();
    assert_eq!(again, ok);
    assert_eq!(discover_with(&dirs, None).len(), 3);
    assert_eq!(discover_with(&dirs, Some(&OsString::new())).len(), 3);
}

/// A search directory that does not exist (skipped silently).
fn root_missing(t: &TempDir) -> PathBuf {
    t.path().join("no-such-search-dir")
}
