//! What a pack directory's metadata files are called and what a pack name
//! may be: the leaf the manifest, signature and key modules share.

/// The manifest's file name in a pack directory.
pub const MANIFEST_FILE: &str = "pack.toml";

/// The signature's file name in a pack directory.
pub const SIGNATURE_FILE: &str = "pack.sig";

/// Longest accepted pack name.
pub const MAX_NAME_LEN: usize = 64;

/// A pack (or key) name: `[a-z0-9-]+`, not starting with `-`, at most
/// [`MAX_NAME_LEN`] characters.
pub(crate) fn validate_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(format!("must be 1 to {MAX_NAME_LEN} characters, got {}", name.len()));
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') || name.starts_with('-') {
        return Err(format!("{name:?} must match [a-z0-9-]+ and not start with `-`"));
    }
    Ok(())
}
