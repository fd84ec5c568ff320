//! Small file-system helpers: atomic writes, streaming sha256, and the one way pack files are read
//! (opened once, no symlinks, regular files only, size-capped).

use std::io::{Read as _, Write as _};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest as _, Sha256};

use crate::error::{RegistryError, Result};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename.
///
/// Readers see either the old or the new contents, never a partial file.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Unique per process and per call, so concurrent writers never share a temporary file.
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let tmp = dir.join(format!(".{file_name}.tmp.{}.{n}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(RegistryError::Io { path: path.to_path_buf(), source: e });
    }
    Ok(())
}

/// Reads the regular file `path` into memory, refusing anything that could make the bytes read
/// differ from the bytes checked or exhaust memory. Returns `Ok(None)` if the file does not exist.
///
/// - opened once, with `O_NOFOLLOW` (a symlink as the last component is refused: [`RegistryError::Symlink`])
///   and `O_NONBLOCK` (a FIFO cannot block the open);
/// - the *opened handle* must be a regular file (`fstat`): [`RegistryError::NotAFile`];
/// - at most `limit` bytes: the size is checked before reading and the read itself is capped at
///   `limit + 1` bytes (a file growing meanwhile is caught too): [`RegistryError::TooLarge`].
///
/// The caller hashes and uses the returned bytes; the path is never reopened.
pub(crate) fn read_capped(path: &Path, limit: u64, what: &'static str) -> Result<Option<Vec<u8>>> {
    let mut file = match open_nofollow(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) if is_symlink_error(&e, path) => return Err(RegistryError::Symlink { path: path.to_path_buf() }),
        Err(e) => return Err(RegistryError::Io { path: path.to_path_buf(), source: e }),
    };
    let meta = file.metadata().map_err(RegistryError::io(path))?;
    if !meta.is_file() {
        return Err(RegistryError::NotAFile { path: path.to_path_buf() });
    }
    let too_large = || RegistryError::TooLarge { path: path.to_path_buf(), what, limit };
    if meta.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    (&mut file).take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(RegistryError::io(path))?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(Some(bytes))
}

#[cfg(unix)]
fn open_nofollow(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path)
}

#[cfg(not(unix))]
fn open_nofollow(path: &Path) -> std::io::Result<std::fs::File> {
    // No O_NOFOLLOW: refuse a symlink by its link metadata first (a race remains on such systems).
    if std::fs::symlink_metadata(path)?.file_type().is_symlink() {
        return Err(std::io::Error::other("symlink"));
    }
    std::fs::File::open(path)
}

/// Whether opening `path` failed because it is a symlink (`ELOOP` from `O_NOFOLLOW`).
fn is_symlink_error(e: &std::io::Error, path: &Path) -> bool {
    #[cfg(unix)]
    if e.raw_os_error() == Some(libc::ELOOP) {
        return true;
    }
    let _ = e;
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// At most `max` characters of `s` (plus `…` when cut): what error messages quote of untrusted input.
pub(crate) fn excerpt(s: &str, max: usize) -> String {
    let mut out: String = s.chars().take(max).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

/// How many characters of untrusted input an error message quotes.
pub(crate) const EXCERPT_CHARS: usize = 80;

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    to_hex(&Sha256::digest(bytes))
}

/// Lowercase hex sha256 of a file's contents, read in a streaming fashion.
///
/// # Errors
/// [`RegistryError::Io`] naming the file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file = std::fs::File::open(path).map_err(RegistryError::io(path))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher).map_err(RegistryError::io(path))?;
    Ok(to_hex(&hasher.finalize()))
}

fn to_hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_known_answer() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        write_atomic(&p, b"abc").unwrap();
        assert_eq!(sha256_file(&p).unwrap(), sha256_hex(b"abc"));
        write_atomic(&p, b"abcd").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"abcd");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "temporary file left behind");
    }
}
