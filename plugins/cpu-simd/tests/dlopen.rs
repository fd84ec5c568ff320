//! The pack loaded the way the host loads it: dlopen of the built cdylib,
//! `abi_stable` version and layout checks, then the ABI version check.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use spinfer_plugin_api::abi_stable::library::lib_header_from_path;
use spinfer_plugin_api::{LoadErrorKind, PackModuleRef, load_pack};

const LIB_FILE: &str = "libspinfer_pack_cpu_simd.so";

/// `target/<profile>`, from this test executable's path
/// (`target/<profile>/deps/<test>-<hash>`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).expect("test executable inside target/<profile>/deps").to_path_buf()
}

/// The pack library, freshly built: `cargo test` builds the crate for the
/// tests to link against but does not reliably leave an up-to-date cdylib
/// in `target/<profile>` (build-notes pitfall 3; a stale one from an older
/// build would be tested instead), so run `cargo build` for the same
/// profile first. That is a no-op when the library is fresh. Done at most
/// once per test binary.
fn pack_library() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(build_library)
}

fn build_library() -> PathBuf {
    let dir = profile_dir();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_string(),
        Some(name) => name.to_string(),
        None => panic!("cannot tell the cargo profile from {}", dir.display()),
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let status = Command::new(cargo)
        .args(["build", "-p", "spinfer-pack-cpu-simd", "--profile", &profile, "--target-dir"])
        .arg(dir.parent().expect("target dir"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("running cargo build");
    assert!(status.success(), "cargo build -p spinfer-pack-cpu-simd --profile {profile} failed");
    let lib = dir.join(LIB_FILE);
    assert!(lib.exists(), "{} was not built", lib.display());
    lib
}

#[test]
fn root_module_from_cdylib() {
    let lib = pack_library();
    let module = lib_header_from_path(lib).unwrap().init_root_module::<PackModuleRef>().unwrap();
    common::check_module(module);
}

#[test]
fn load_pack_checks_and_loads() {
    let module = load_pack(pack_library()).unwrap();
    common::check_module(module);
}

#[test]
fn load_pack_reports_missing_files_in_one_line() {
    let Err(e) = load_pack(Path::new("/nonexistent/libnothing.so")) else { panic!("loaded a missing file") };
    assert_eq!(e.kind(), LoadErrorKind::Open);
    let msg = e.to_string();
    assert!(msg.starts_with("cannot load pack /nonexistent/libnothing.so: "), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
}
