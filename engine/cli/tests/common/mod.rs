//! Shared by the CLI tests.

use std::path::{Path, PathBuf};

/// The SmolLM2 GGUF (`$SPINFER_MODEL` or the workspace's `models/`); `None`
/// to skip when absent locally, a failure when absent in CI.
pub fn smollm2() -> Option<PathBuf> {
    let model = std::env::var_os("SPINFER_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if model.exists() {
        return Some(model);
    }
    assert!(std::env::var_os("CI").is_none(), "{} missing in CI", model.display());
    eprintln!("skipping: {} not found", model.display());
    None
}
