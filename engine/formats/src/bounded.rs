//! Reading small text files (configs, tokenizers) with a size cap: a
//! hostile or mistaken file is refused, naming it, instead of being read
//! whole into memory.

use std::io::Read as _;
use std::path::Path;

use crate::{Error, Result};

/// Largest JSON configuration read (`config.json`, an index file, a pooling
/// config; real ones are kilobytes).
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// Largest `tokenizer.json` read (a 262k-entry vocabulary with its merges
/// is about 35 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// The text of `path`, at most `max` bytes; `Ok(None)` when it does not
/// exist. `what` names the file's role in the error ("a model config").
pub fn read_text_opt(path: &Path, max: u64, what: &str) -> Result<Option<String>> {
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(Error::format(path, format!("is larger than {} MiB: not {what}", max >> 20)));
    }
    String::from_utf8(bytes)
        .map(Some)
        .map_err(|e| Error::format(path, format!("is not valid UTF-8 (byte {})", e.utf8_error().valid_up_to())))
}

/// [`read_text_opt`] for a file that must exist.
pub fn read_text(path: &Path, max: u64, what: &str) -> Result<String> {
    read_text_opt(path, max, what)?.ok_or_else(|| Error::io(path, std::io::Error::from(std::io::ErrorKind::NotFound)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_and_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, vec![b' '; 2 << 20]).unwrap();
        let e = read_text(&p, 1 << 20, "a model config").unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("larger than 1 MiB"), "{e}");
        std::fs::write(&p, "{}").unwrap();
        assert_eq!(read_text(&p, 1 << 20, "a model config").unwrap(), "{}");
        assert!(read_text_opt(&dir.path().join("none"), 1, "x").unwrap().is_none());
        assert!(read_text(&dir.path().join("none"), 1, "x").unwrap_err().to_string().contains("none"));
        std::fs::write(&p, b"\xff").unwrap();
        assert!(read_text(&p, 1 << 20, "x").unwrap_err().to_string().contains("UTF-8"));
    }
}
