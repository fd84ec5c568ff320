//! The head's rows re-ordered so each cluster is contiguous: position `p`
//! of the copy holds row `members[p]` of the model's head, byte for byte
//! (its own quantisation, no requantisation). A probed cluster is then one
//! sequential read instead of one read per row scattered over the head.
//!
//! The copy lives beside the index (`<index>.rows`), mapped read-only; the
//! index header names its sha256, checked at load in 8 MiB slices whose
//! pages are released as they go (so the check does not make the whole
//! copy resident).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use sha2::{Digest, Sha256};

use super::HeadIndex;
use crate::{Error, Result};
use spinfer_formats::tensor::TensorData;

/// Where the copy of the index at `index` lives.
pub fn rows_path(index: &Path) -> PathBuf {
    let mut s = index.as_os_str().to_owned();
    s.push(".rows");
    PathBuf::from(s)
}

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes a head's rows (`head`: `vocab × row_bytes` bytes) in `index`'s
/// member order to `path` (through a temporary file renamed into place);
/// returns their sha256.
pub(crate) fn write(head: &[u8], row_bytes: usize, index: &HeadIndex, path: &Path) -> Result<String> {
    let tmp = path.with_extension("rows.partial");
    let file = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut hasher = Sha256::new();
    for &r in &index.members {
        let row = &head[r as usize * row_bytes..][..row_bytes];
        hasher.update(row);
        w.write_all(row).map_err(|e| Error::io(&tmp, e))?;
    }
    let file = w.into_inner().map_err(|e| Error::io(&tmp, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    Ok(hex(hasher.finalize()))
}

/// Maps the copy at `path`: `vocab × row_bytes` bytes whose sha256 is `sha256`.
pub(crate) fn open(path: &Path, vocab: usize, row_bytes: usize, sha256: &str) -> Result<TensorData> {
    let bad = |d: String| Error::format(path, format!("head rows: {d}"));
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let want = vocab as u64 * row_bytes as u64;
    if len != want {
        return Err(bad(format!("{len} bytes, expected {want} ({vocab} rows of {row_bytes} bytes)")));
    }
    // SAFETY: the file is mapped read-only and never written by this
    // process; its contents are checked against the index's sha256 below
    // before any use (a file changed afterwards by another process is
    // outside what a memory map can guard against, as for the model file).
    let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?);
    let mut hasher = Sha256::new();
    for part in map.chunks(8 << 20) {
        hasher.update(part);
        // SAFETY: `part` lies in `map`, a read-only file mapping.
        unsafe { spinfer_formats::tensor::release_pages(part) };
    }
    let got = hex(hasher.finalize());
    if got != sha256 {
        return Err(bad(format!("sha256 {got} is not the {sha256} the index names (rebuild with calibrate-head)")));
    }
    let n = map.len();
    Ok(TensorData::mapped(map, 0, n))
}
