//! `spinfer pack keygen | sign | verify | inspect` end to end: a signed pack
//! verifies against its key, a tampered one or an untrusted key fails with
//! a non-zero exit and a message naming the problem.

use std::path::Path;
use std::process::{Command, Output};

use sha2::{Digest, Sha256};

fn spinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_spinfer")).args(args).output().unwrap()
}

fn ok(args: &[&str]) -> String {
    let o = spinfer(args);
    assert!(o.status.success(), "spinfer {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn fails(args: &[&str]) -> String {
    let o = spinfer(args);
    assert_eq!(o.status.code(), Some(1), "spinfer {args:?} should fail: {}", String::from_utf8_lossy(&o.stdout));
    String::from_utf8(o.stderr).unwrap()
}

fn write_pack(dir: &Path, artefact: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("kernels.wasm"), artefact).unwrap();
    let sha = Sha256::digest(artefact).iter().map(|b| format!("{b:02x}")).collect::<String>();
    let manifest = format!(
        "name = \"demo-pack\"\nversion = \"1.0.0\"\nabi_version = 1\nkind = \"wasm\"\nmin_host_version = \"0.1.0\"\n\n\
         [artefact]\nfile = \"kernels.wasm\"\nsha256 = \"{sha}\"\n\n\
         [[kernels]]\nname = \"q4_1_f32\"\nop = \"matmul\"\nweight = \"q4_1\"\nact = \"f32\"\n"
    );
    std::fs::write(dir.join("pack.toml"), manifest).unwrap();
}

#[test]
fn keygen_sign_verify_inspect_and_tampering() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let keys = t.join("keys");
    std::fs::create_dir_all(&keys).unwrap();
    let public = ok(&["pack", "keygen", "--name", "author", "--dir", keys.to_str().unwrap()]);
    assert!(public.trim().starts_with("ed25519:"), "{public}");
    let (secret, pubfile) = (keys.join("author.key"), keys.join("author.pub"));

    let pack = t.join("demo");
    write_pack(&pack, b"\0asm\x01\0\0\0");
    let p = pack.to_str().unwrap();
    // Unsigned: refused, unless explicitly allowed.
    assert!(fails(&["pack", "verify", p]).contains("unsigned"));
    assert!(ok(&["pack", "verify", p, "--allow-unsigned"]).contains("unsigned"));

    ok(&["pack", "sign", "--key", secret.to_str().unwrap(), p]);
    let out = ok(&["pack", "verify", p, "--trust", pubfile.to_str().unwrap()]);
    assert!(out.contains("demo-pack@1.0.0") && out.contains(public.trim()), "{out}");
    // inspect says whether the signer is trusted, not only that the
    // signature verifies.
    let untrusted = ok(&["pack", "inspect", p]);
    assert!(untrusted.contains("signature valid") && untrusted.contains("NOT trusted"), "{untrusted}");
    let trusted = ok(&["pack", "inspect", p, "--trust", pubfile.to_str().unwrap()]);
    assert!(trusted.contains("signature valid") && !trusted.contains("NOT trusted"), "{trusted}");

    // Another key is not trusted.
    let other = ok(&["pack", "keygen", "--name", "other", "--dir", keys.to_str().unwrap()]);
    let e = fails(&["pack", "verify", p, "--trust", other.trim()]);
    assert!(e.contains("demo-pack") && e.to_lowercase().contains("trust"), "{e}");

    // Tampered artefact: hash mismatch.
    std::fs::write(pack.join("kernels.wasm"), b"\0asm\x01\0\0\x01").unwrap();
    let e = fails(&["pack", "verify", p, "--trust", public.trim()]);
    assert!(e.contains("kernels.wasm") || e.contains("sha256"), "{e}");

    // Tampered manifest: bad signature.
    write_pack(&pack, b"\0asm\x01\0\0\0");
    let m = std::fs::read_to_string(pack.join("pack.toml")).unwrap().replace("1.0.0", "1.0.1");
    std::fs::write(pack.join("pack.toml"), m).unwrap();
    let e = fails(&["pack", "verify", p, "--trust", public.trim()]);
    assert!(e.to_lowercase().contains("signature"), "{e}");
}
