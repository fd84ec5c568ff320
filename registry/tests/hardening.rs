//! The registry's defences against a hostile pack directory (issue 15, section 2): bounded
//! `pack.toml`/`pack.sig` refused before anything is parsed, the signature checked over the raw
//! bytes before the manifest is parsed, symlinks refused, names bound to keys, downgrades keyed by
//! name (second key, stripped signature, deleted record). After every refusal a good pack still
//! verifies: nothing is left in a bad state.

use std::path::{Path, PathBuf};
use std::time::Instant;

use spinfer_registry::{
    InstallRecord, KeyPair, MAX_MANIFEST_BYTES, RegistryError, TrustPolicy, TrustedKey, VerifyLimits, Version,
    sha256_hex, sign_pack, verify_pack, verify_pack_with,
};

const ARTEFACT: &[u8] = b"\x7fELF pretend shared library";

fn manifest_text(name: &str, version: &str) -> String {
    format!(
        "name = \"{name}\"\nversion = \"{version}\"\nabi_version = 1\nkind = \"native\"\n\
         min_host_version = \"0.1.0\"\n\n[artefact]\nfile = \"libk.so\"\nsha256 = \"{}\"\n\n\
         [[kernels]]\nname = \"k\"\nop = \"matmul\"\nweight = \"q4_1\"\nact = \"q8_1\"\n",
        sha256_hex(ARTEFACT)
    )
}

fn write_pack(root: &Path, dir: &str, name: &str, version: &str, key: Option<&KeyPair>) -> PathBuf {
    let dir = root.join(dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("libk.so"), ARTEFACT).unwrap();
    std::fs::write(dir.join("pack.toml"), manifest_text(name, version)).unwrap();
    if let Some(k) = key {
        sign_pack(&dir, k).unwrap();
    }
    dir
}

fn key(seed: u8) -> KeyPair {
    KeyPair::from_seed(&[seed; 32])
}

/// A good signed pack verifies under `policy` (the registry is still usable after a refusal).
fn still_usable(root: &Path, k: &KeyPair, policy: &TrustPolicy) {
    let dir = write_pack(root, &format!("good-{}", rand_suffix()), "good", "1.0.0", Some(k));
    let p = verify_pack(&dir, policy).expect("a good pack still verifies after the refusal");
    assert_eq!(p.artefact_bytes(), ARTEFACT);
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Peak RSS (high-water mark) of this process in kB (Linux), or 0.
fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

#[test]
fn oversized_manifest_is_refused_before_parsing_quickly_and_with_bounded_memory() {
    let root = tempfile::tempdir().unwrap();
    let k = key(1);
    let policy = TrustPolicy::new().with_trusted(k.public_key());
    // 100 MB of manifest, unsigned, under the default policy (it once cost a 2.4 GB allocation).
    let dir = write_pack(root.path(), "huge", "huge", "1.0.0", None);
    // Written in 1 MB chunks, so this test's own peak RSS stays low before the check.
    {
        use std::io::Write as _;
        let mut f = std::fs::File::create(dir.join("pack.toml")).unwrap();
        f.write_all(manifest_text("huge", "1.0.0").as_bytes()).unwrap();
        f.write_all(b"description = \"").unwrap();
        let chunk = vec![b'x'; 1_000_000];
        for _ in 0..100 {
            f.write_all(&chunk).unwrap();
        }
        f.write_all(b"\"\n").unwrap();
    }
    let before = rss_kb();
    let t = Instant::now();
    for p in [TrustPolicy::new(), policy.clone(), TrustPolicy::new().with_unsigned_allowed(true)] {
        let e = verify_pack(&dir, &p).unwrap_err();
        assert!(matches!(e, RegistryError::TooLarge { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("pack.toml") && msg.contains(&MAX_MANIFEST_BYTES.to_string()), "{msg}");
        assert!(msg.len() < 300, "{msg}");
    }
    // Refused from fstat's size, before a byte is read: the proof is the resident set below, not
    // the time (tests assert no wall-clock bound; it is reported).
    eprintln!("three refusals of a 100 MB manifest: {} ms", t.elapsed().as_millis());
    let grown = rss_kb().saturating_sub(before);
    // Peak RSS did not grow by the file's size (100 MB): 16 MB leaves room for allocator noise.
    assert!(grown < 16_000, "peak RSS grew by {grown} kB");

    // An oversized pack.sig likewise.
    let dir = write_pack(root.path(), "bigsig", "bigsig", "1.0.0", None);
    std::fs::write(dir.join("pack.sig"), "a".repeat(2048)).unwrap();
    let e = verify_pack(&dir, &policy).unwrap_err();
    assert!(matches!(e, RegistryError::TooLarge { .. }) && e.to_string().contains("pack.sig"), "{e}");
    still_usable(root.path(), &k, &policy);
}

#[test]
fn unparsable_manifest_is_never_parsed_before_its_signature_checks_out() {
    let root = tempfile::tempdir().unwrap();
    let k = key(1);
    let policy = TrustPolicy::new().with_trusted(k.public_key());
    let garbage = "this is [not toml = \u{0}\u{1}".repeat(100);
    // Unsigned under the default policy: refused as unsigned, not as an invalid manifest.
    let dir = write_pack(root.path(), "garbage", "garbage", "1.0.0", None);
    std::fs::write(dir.join("pack.toml"), &garbage).unwrap();
    let e = verify_pack(&dir, &policy).unwrap_err();
    assert!(matches!(e, RegistryError::Unsigned { .. }), "{e}");
    // Signed by an untrusted key: refused for the key, the manifest unparsed.
    let signed_by_other = write_pack(root.path(), "garbage2", "garbage2", "1.0.0", Some(&key(9)));
    std::fs::write(signed_by_other.join("pack.toml"), &garbage).unwrap();
    let e = verify_pack(&signed_by_other, &policy).unwrap_err();
    assert!(matches!(e, RegistryError::UntrustedKey { .. }), "{e}");
    // Signed by the trusted key, then the manifest replaced: a bad signature, not a parse error.
    let swapped = write_pack(root.path(), "garbage3", "garbage3", "1.0.0", Some(&k));
    std::fs::write(swapped.join("pack.toml"), &garbage).unwrap();
    let e = verify_pack(&swapped, &policy).unwrap_err();
    assert!(matches!(e, RegistryError::BadSignature { .. }), "{e}");
    // Only when unsigned packs are allowed is it parsed, and the error quotes an excerpt only.
    let e = verify_pack(&dir, &TrustPolicy::new().with_unsigned_allowed(true)).unwrap_err();
    assert!(matches!(e, RegistryError::InvalidManifest { .. }), "{e}");
    assert!(e.to_string().len() < 400, "{e}");
    still_usable(root.path(), &k, &policy);
}

#[cfg(unix)]
#[test]
fn symlinked_manifest_signature_and_artefact_are_refused() {
    use std::os::unix::fs::symlink;
    let root = tempfile::tempdir().unwrap();
    let k = key(1);
    let policy = TrustPolicy::new().with_trusted(k.public_key());
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("secret");
    std::fs::write(&secret, b"outside the pack").unwrap();

    for (i, file) in ["pack.toml", "pack.sig", "libk.so"].into_iter().enumerate() {
        let dir = write_pack(root.path(), &format!("link{i}"), "link", "1.0.0", Some(&k));
        // The same bytes, through a symlink: still refused (the link could be retargeted).
        let real = outside.path().join(format!("{file}.{i}"));
        std::fs::rename(dir.join(file), &real).unwrap();
        symlink(&real, dir.join(file)).unwrap();
        let e = verify_pack(&dir, &policy).unwrap_err();
        assert!(matches!(e, RegistryError::Symlink { .. }), "{file}: {e}");
        assert!(e.to_string().contains(file) && e.to_string().contains("symbolic link"), "{e}");
    }
    // An artefact linked to a file outside the pack: refused, and no hash of that file printed.
    let dir = write_pack(root.path(), "outside", "outside", "1.0.0", Some(&k));
    std::fs::remove_file(dir.join("libk.so")).unwrap();
    symlink(&secret, dir.join("libk.so")).unwrap();
    let e = verify_pack(&dir, &policy).unwrap_err().to_string();
    assert!(!e.contains(&sha256_hex(b"outside the pack")), "{e}");
    // A directory or FIFO where a file should be: refused.
    let dir = write_pack(root.path(), "dir", "dir", "1.0.0", Some(&k));
    std::fs::remove_file(dir.join("libk.so")).unwrap();
    std::fs::create_dir(dir.join("libk.so")).unwrap();
    let e = verify_pack(&dir, &policy).unwrap_err();
    assert!(matches!(e, RegistryError::NotAFile { .. }), "{e}");
    still_usable(root.path(), &k, &policy);
}

#[test]
fn artefact_size_is_capped_before_reading() {
    let root = tempfile::tempdir().unwrap();
    let k = key(1);
    let policy = TrustPolicy::new().with_trusted(k.public_key());
    let dir = write_pack(root.path(), "p", "p", "1.0.0", Some(&k));
    let limits = VerifyLimits { max_artefact_bytes: 8, ..VerifyLimits::default() };
    let e = verify_pack_with(&dir, &policy, &limits).unwrap_err();
    assert!(matches!(e, RegistryError::TooLarge { limit: 8, .. }), "{e}");
    assert!(e.to_string().contains("libk.so"), "{e}");
    verify_pack(&dir, &policy).unwrap();
}

#[test]
fn names_are_bound_to_keys() {
    let root = tempfile::tempdir().unwrap();
    let (simd_key, other) = (key(1), key(2));
    let policy = TrustPolicy::new()
        .with_trusted_for(simd_key.public_key(), &["cpu-simd"])
        .with_trusted_for(other.public_key(), &["vendor-*"]);
    let ok = write_pack(root.path(), "simd", "cpu-simd", "1.0.0", Some(&simd_key));
    assert_eq!(verify_pack(&ok, &policy).unwrap().id(), "cpu-simd@1.0.0");
    let ok = write_pack(root.path(), "vendor", "vendor-gpu", "1.0.0", Some(&other));
    assert_eq!(verify_pack(&ok, &policy).unwrap().id(), "vendor-gpu@1.0.0");
    // The vendor key may not sign cpu-simd, nor the cpu-simd key a shadow pack.
    for (dir, name, k) in [("shadow1", "cpu-simd", &other), ("shadow2", "a-shadow", &simd_key)] {
        let dir = write_pack(root.path(), dir, name, "1.0.0", Some(k));
        let e = verify_pack(&dir, &policy).unwrap_err();
        assert!(matches!(e, RegistryError::NameNotAllowed { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(name) && msg.contains(&k.public_key().to_string()), "{msg}");
    }
    // String form: any name.
    let policy = TrustPolicy { trusted: vec![TrustedKey::any(other.public_key())], ..TrustPolicy::new() };
    still_usable(root.path(), &other, &policy);
}

#[test]
fn downgrade_via_second_key_stripped_signature_and_deleted_record_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (key(1), key(2));
    let policy =
        TrustPolicy::new().with_trusted(a.public_key()).with_trusted(b.public_key()).with_unsigned_allowed(true);
    let record = root.path().join("data/packs-installed.toml");
    let witness = root.path().join("history/packs-installed.sum");
    let open = || InstallRecord::open_with_witness(&record, &witness);
    let new = verify_pack(&write_pack(root.path(), "new", "cpu-simd", "2.0.0", Some(&a)), &policy).unwrap();
    open().unwrap().check_and_record(&new, None).unwrap();

    // Second trusted key, older version.
    let old_b = verify_pack(&write_pack(root.path(), "old-b", "cpu-simd", "1.0.0", Some(&b)), &policy).unwrap();
    let e = open().unwrap().check_and_record(&old_b, None).unwrap_err();
    assert!(matches!(e, RegistryError::Downgrade { .. }), "{e}");
    // Stripped signature (same version, even a higher one).
    let stripped = verify_pack(&write_pack(root.path(), "stripped", "cpu-simd", "3.0.0", None), &policy).unwrap();
    let e = open().unwrap().check_and_record(&stripped, None).unwrap_err();
    assert!(matches!(e, RegistryError::StrippedSignature { .. }), "{e}");
    // An explicitly allowed version passes.
    open().unwrap().check_and_record(&old_b, Some(&Version::new(1, 0, 0))).unwrap();

    // Deleted record: detected through the witness, not an empty record.
    let saved = std::fs::read(&record).unwrap();
    std::fs::remove_file(&record).unwrap();
    let e = open().unwrap_err();
    assert!(matches!(e, RegistryError::RecordTampered { .. }), "{e}");
    assert!(e.to_string().contains("deleted") && e.to_string().contains("packs-installed.sum"), "{e}");
    // Emptied record.
    std::fs::write(&record, "").unwrap();
    let e = open().unwrap_err().to_string();
    assert!(e.contains("emptied"), "{e}");
    // Edited record (version lowered by hand).
    std::fs::write(&record, String::from_utf8(saved.clone()).unwrap().replace("2.0.0", "0.1.0")).unwrap();
    let e = open().unwrap_err().to_string();
    assert!(e.contains("changed outside spinfer"), "{e}");
    // Restored: usable again, and still refusing the downgrade.
    std::fs::write(&record, &saved).unwrap();
    let mut rec = open().unwrap();
    assert_eq!(rec.highest("cpu-simd"), Some(&Version::new(2, 0, 0)));
    assert!(rec.check_and_record(&old_b, None).is_err());
    let newer = verify_pack(&write_pack(root.path(), "newer", "cpu-simd", "2.1.0", Some(&b)), &policy).unwrap();
    rec.check_and_record(&newer, None).unwrap();
}
