//! Finding pack directories on disk. Discovery only lists candidates; nothing is read beyond
//! directory entries and nothing is trusted until [`verify_pack`](crate::verify_pack).

use std::collections::HashSet;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use crate::error::{RegistryError, Result};
use crate::manifest::MANIFEST_FILE;

/// Environment variable with extra pack locations (`:`-separated on Unix, `;` on Windows).
pub const PACK_PATH_ENV: &str = "SPINFER_PACK_PATH";

/// Lists pack directories under `dirs` and under the entries of `SPINFER_PACK_PATH`.
///
/// See [`discover_with`] for the rules; this reads the environment variable and calls it.
pub fn discover(dirs: &[PathBuf]) -> Vec<Result<PathBuf>> {
    discover_with(dirs, std::env::var_os(PACK_PATH_ENV).as_deref())
}

/// Lists pack directories, with the value of `SPINFER_PACK_PATH` passed in (tests never touch the
/// process environment).
///
/// - Each of `dirs` is a *search directory*: every immediate, non-hidden subdirectory containing a
///   `pack.toml` is a pack. A search directory that does not exist is skipped (default locations
///   such as a per-user pack directory usually do not exist); any other I/O failure is an `Err`.
/// - Each entry of `pack_path` (split with [`std::env::split_paths`], empty entries ignored) is
///   either a pack directory itself (it contains `pack.toml`) or a search directory as above. An
///   entry that does not exist is an [`RegistryError::PackPathMissing`] error: the user asked for it.
///
/// Order is deterministic: sources in the order given (`dirs`, then `pack_path` entries), and
/// within one search directory the packs sorted by path. A directory reached twice is listed once,
/// at its first position, so callers may treat earlier results as higher priority.
pub fn discover_with(dirs: &[PathBuf], pack_path: Option<&OsStr>) -> Vec<Result<PathBuf>> {
    let mut out = Vec::new();
    for dir in dirs {
        scan_search_dir(dir, true, &mut out);
    }
    for entry in pack_path.map(|v| std::env::split_paths(v).collect::<Vec<_>>()).unwrap_or_default() {
        if entry.as_os_str().is_empty() {
            continue;
        }
        if is_pack_dir(&entry) {
            out.push(Ok(entry));
        } else if !entry.exists() {
            out.push(Err(RegistryError::PackPathMissing { path: entry }));
        } else {
            scan_search_dir(&entry, false, &mut out);
        }
    }
    let mut seen = HashSet::new();
    out.retain(|r| match r {
        Ok(p) => seen.insert(p.clone()),
        Err(_) => true,
    });
    out
}

/// Whether `dir` is a directory containing a `pack.toml` file.
pub fn is_pack_dir(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

fn scan_search_dir(dir: &Path, skip_missing: bool, out: &mut Vec<Result<PathBuf>>) {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if skip_missing && e.kind() == std::io::ErrorKind::NotFound => {
            tracing::debug!(path = %dir.display(), "pack search directory does not exist; skipped");
            return;
        }
        Err(e) => {
            out.push(Err(RegistryError::Io { path: dir.to_path_buf(), source: e }));
            return;
        }
    };
    let mut packs = Vec::new();
    for entry in entries {
        match entry {
            Ok(entry) => {
                let path = entry.path();
                let hidden = entry.file_name().to_string_lossy().starts_with('.');
                if !hidden && is_pack_dir(&path) {
                    packs.push(path);
                }
            }
            Err(e) => out.push(Err(RegistryError::Io { path: dir.to_path_buf(), source: e })),
        }
    }
    packs.sort();
    out.extend(packs.into_iter().map(Ok));
}
