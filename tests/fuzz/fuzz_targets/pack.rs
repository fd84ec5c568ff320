//! `pack.toml` / `pack.sig` / the install record: the input is
//! `pack.toml SEP pack.sig SEP artefact SEP install-record`.
//!
//! The manifest and signature are parsed on their own, then laid out as a
//! pack directory and verified under three policies: trusting the fuzzer's
//! key, allowing unsigned packs, and trusting nobody. A `pack.sig` part that
//! is exactly `SIGN` is replaced by a valid signature of the manifest with
//! the trusted key, so the checks after the signature are reached too. A
//! pack that verifies goes through the install record (downgrade check).
#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use spinfer_fuzz::{fresh_dir, ok, parts};
use spinfer_registry::{InstallRecord, KeyPair, Manifest, PackSignature, TrustPolicy, sign_pack, verify_pack};

fn key() -> &'static KeyPair {
    static KEY: OnceLock<KeyPair> = OnceLock::new();
    KEY.get_or_init(|| KeyPair::from_seed(&[7; 32]))
}

fuzz_target!(|data: &[u8]| {
    let p = parts(data, 4);
    let (manifest, sig, artefact, record) = (p[0], p[1], p[2], p[3]);

    if let Some(m) = ok("manifest", Manifest::parse(manifest, Path::new("pack.toml"))) {
        let _ = m.validate();
        let _ = m.id();
        let _ = m.to_toml_string();
    }
    if let Ok(text) = std::str::from_utf8(sig) {
        if let Some(s) = ok("signature", PackSignature::parse(text)) {
            let _ = s.verifies(manifest);
        }
    }

    let dir = fresh_dir("pack");
    std::fs::write(dir.join("pack.toml"), manifest).expect("write");
    // The artefact goes where the manifest says, if that is a plain name;
    // and always under a fixed name the seeds use.
    if let Ok(m) = Manifest::parse(manifest, Path::new("pack.toml")) {
        let f = &m.artefact.file;
        if Path::new(f).file_name().is_some_and(|n| n == f.as_str()) && f != "pack.toml" && f != "pack.sig" {
            let _ = std::fs::write(dir.join(f), artefact);
        }
    }
    let _ = std::fs::write(dir.join("kernel.bin"), artefact);
    if sig == b"SIGN" {
        let _ = sign_pack(&dir, key());
    } else if !sig.is_empty() {
        std::fs::write(dir.join("pack.sig"), sig).expect("write");
    }

    let trusting = TrustPolicy::new().with_trusted(key().public_key());
    let unsigned = TrustPolicy::new().with_unsigned_allowed(true);
    let _ = verify_pack(&dir, &TrustPolicy::new());
    ok("verify (unsigned allowed)", verify_pack(&dir, &unsigned));
    if let Some(pack) = ok("verify (trusting)", verify_pack(&dir, &trusting)) {
        let _ = (pack.id(), pack.signer(), pack.artefact_path());
        let rec = dir.join("installed.toml");
        if !record.is_empty() {
            std::fs::write(&rec, record).expect("write");
        }
        if let Some(mut r) = ok("record", InstallRecord::open(&rec)) {
            ok("check_and_record", r.check_and_record(&pack, None));
            let _ = r.check_and_record(&pack, Some(&pack.manifest().version));
            let _ = InstallRecord::open(&rec);
        }
    }
});
