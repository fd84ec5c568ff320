//! What spinfer's tests share, with no dependency on the engine (so every
//! crate's tests can use it): where the workspace, its test data and the
//! models are, and building pack libraries for dlopen tests. Random
//! operands come from `spinfer_kernels::random`, which the registry's check
//! of pack kernels uses too.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the workspace root exists")
}

/// `tests/data/<rel>`.
pub fn data(rel: &str) -> PathBuf {
    workspace().join("tests/data").join(rel)
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF: `$SPINFER_MODEL` or
/// `models/SmolLM2-135M-Instruct.Q4_1.gguf`. `None` (the test should skip)
/// when absent outside CI; in CI (`CI` set) a missing model is a failure,
/// so a broken download can never turn the suite green.
pub fn smollm2() -> Option<PathBuf> {
    model("SPINFER_MODEL", "models/SmolLM2-135M-Instruct.Q4_1.gguf", "")
}

/// The Gemma 3 270M Q4_K_M GGUF: `$SPINFER_GEMMA_MODEL` or
/// `models/gemma-3-270m-Q4_K_M.gguf`; absent as for [`smollm2`].
pub fn gemma3() -> Option<PathBuf> {
    model("SPINFER_GEMMA_MODEL", "models/gemma-3-270m-Q4_K_M.gguf", "")
}

/// The all-MiniLM-L6-v2 sentence-transformers directory:
/// `$SPINFER_EMBED_MODEL` or `models/all-MiniLM-L6-v2`; absent as for
/// [`smollm2`].
pub fn minilm() -> Option<PathBuf> {
    model("SPINFER_EMBED_MODEL", "models/all-MiniLM-L6-v2", "model.safetensors")
}

/// `$env` or `<workspace>/default`, if it (or `<it>/inside`, when given)
/// exists; else `None`
/// with a message outside CI, a panic in CI.
fn model(env: &str, default: &str, inside: &str) -> Option<PathBuf> {
    let p = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| workspace().join(default));
    let present = if inside.is_empty() { p.exists() } else { p.join(inside).exists() };
    if present {
        return Some(p);
    }
    if std::env::var_os("CI").is_some() {
        panic!("{} is missing in CI: scripts/fetch-models.sh should have fetched it", p.display());
    }
    eprintln!("skipping: {} not found (run scripts/fetch-models.sh, or set {env})", p.display());
    None
}

/// `target/<profile>`, from the running test executable's path
/// (`target/<profile>/deps/<test>-<hash>`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    exe.parent().and_then(Path::parent).expect("test executable inside target/<profile>/deps").to_path_buf()
}

/// Builds `packages` (pack cdylibs) for the running test's profile into its
/// target directory and returns the profile directory holding them.
/// `cargo test` builds a crate for the tests to link against but does not
/// reliably leave an up-to-date cdylib in `target/<profile>` (a stale one
/// from an older build would be tested instead), so this runs `cargo
/// build`, a no-op when the libraries are fresh. Callers keep the result
/// in a `OnceLock` to build once per test binary.
///
/// # Panics
///
/// When the build fails (the test cannot run without the library).
pub fn build_packages(packages: &[&str]) -> PathBuf {
    let dir = profile_dir();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_string(),
        Some(name) => name.to_string(),
        None => panic!("cannot tell the cargo profile from {}", dir.display()),
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut cmd = Command::new(cargo);
    cmd.arg("build");
    for p in packages {
        cmd.args(["-p", p]);
    }
    let status = cmd
        .args(["--profile", &profile, "--target-dir"])
        .arg(dir.parent().expect("target dir"))
        .current_dir(workspace())
        .status()
        .expect("running cargo build");
    assert!(status.success(), "cargo build of {packages:?} (profile {profile}) failed");
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_file_is_found_and_an_absent_one_is_not() {
        // A file (no `inside`) and a directory with a required file.
        let here = "tests/support/Cargo.toml";
        assert_eq!(model("SPINFER_TEST_SUPPORT_UNSET", here, ""), Some(workspace().join(here)));
        assert_eq!(
            model("SPINFER_TEST_SUPPORT_UNSET", "tests/support", "Cargo.toml"),
            Some(workspace().join("tests/support"))
        );
        if std::env::var_os("CI").is_none() {
            assert_eq!(model("SPINFER_TEST_SUPPORT_UNSET", "tests/support", "absent.bin"), None);
        }
    }
}
