//! The error type that crosses the library boundary.
//!
//! [`PackError`] is a plain `#[repr(C)]` struct (a [`PackErrorKind`] plus an
//! owned message), so a pack can return it from any trait method and the
//! host can keep it after the call. Conversions:
//!
//! * pack side: build one with [`PackError::new`] or the per-kind
//!   constructors ([`PackError::unsupported`], ...); `std::io::Error`
//!   converts with `From` (kind [`PackErrorKind::IO`]). A pack's own error
//!   types convert through their `Display` text:
//!   `PackError::new(kind, err.to_string())`.
//! * host side: `PackError` implements `std::error::Error + Send + Sync`, so
//!   `?` turns it into `anyhow::Error`/`Box<dyn Error>` and `thiserror`
//!   variants can wrap it with `#[from]`; the `RResult` the traits return
//!   becomes a `Result` with `.into_result()`.

use std::fmt;

use abi_stable::StableAbi;
use abi_stable::std_types::RString;

/// Broad class of a [`PackError`], for the host to decide what to do
/// (fall back to another kernel, report a bad model, give up).
///
/// An open set like the other catalogues: new kinds are new constants, and
/// a host treats kinds it does not know like [`PackErrorKind::INTERNAL`].
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PackErrorKind(pub u32);

impl PackErrorKind {
    /// The pack cannot serve this request (type, shape, operation or
    /// machine); the host should try another pack.
    pub const UNSUPPORTED: PackErrorKind = PackErrorKind(1);
    /// An argument is malformed (buffer length, index out of range).
    pub const INVALID_ARGUMENT: PackErrorKind = PackErrorKind(2);
    /// A named thing (file, tensor, metadata key) does not exist.
    pub const NOT_FOUND: PackErrorKind = PackErrorKind(3);
    /// Reading or writing a file failed.
    pub const IO: PackErrorKind = PackErrorKind(4);
    /// An accelerator or driver failed (out of device memory, launch error).
    pub const DEVICE: PackErrorKind = PackErrorKind(5);
    /// A bug or unexpected state inside the pack (including caught panics).
    pub const INTERNAL: PackErrorKind = PackErrorKind(6);

    /// Lowercase name used in messages (`"unsupported"`); `None` for kinds
    /// this build does not know.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self {
            PackErrorKind::UNSUPPORTED => "unsupported",
            PackErrorKind::INVALID_ARGUMENT => "invalid argument",
            PackErrorKind::NOT_FOUND => "not found",
            PackErrorKind::IO => "i/o error",
            PackErrorKind::DEVICE => "device error",
            PackErrorKind::INTERNAL => "internal error",
            _ => return None,
        })
    }
}

impl fmt::Display for PackErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "error of kind {}", self.0),
        }
    }
}

impl fmt::Debug for PackErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// An error returned by a pack: a kind and a lowercase message without
/// trailing punctuation. Displays as `"<kind>: <message>"`.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct PackError {
    pub kind: PackErrorKind,
    pub message: RString,
}

impl PackError {
    pub fn new(kind: PackErrorKind, message: impl Into<RString>) -> Self {
        PackError { kind, message: message.into() }
    }

    pub fn unsupported(message: impl Into<RString>) -> Self {
        Self::new(PackErrorKind::UNSUPPORTED, message)
    }

    pub fn invalid_argument(message: impl Into<RString>) -> Self {
        Self::new(PackErrorKind::INVALID_ARGUMENT, message)
    }

    pub fn not_found(message: impl Into<RString>) -> Self {
        Self::new(PackErrorKind::NOT_FOUND, message)
    }

    pub fn internal(message: impl Into<RString>) -> Self {
        Self::new(PackErrorKind::INTERNAL, message)
    }

    pub fn kind(&self) -> PackErrorKind {
        self.kind
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for PackError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for PackError {}

impl From<std::io::Error> for PackError {
    fn from(e: std::io::Error) -> Self {
        let kind = if e.kind() == std::io::ErrorKind::NotFound { PackErrorKind::NOT_FOUND } else { PackErrorKind::IO };
        PackError::new(kind, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_kind_and_message() {
        let e = PackError::unsupported("q2_K weights need q8_K activations");
        assert_eq!(e.to_string(), "unsupported: q2_K weights need q8_K activations");
        let boxed: Box<dyn std::error::Error + Send + Sync> = e.into();
        assert!(boxed.to_string().starts_with("unsupported"));
    }

    #[test]
    fn io_errors_convert() {
        let e: PackError = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file").into();
        assert_eq!(e.kind(), PackErrorKind::NOT_FOUND);
        let e: PackError = std::io::Error::other("disk on fire").into();
        assert_eq!(e.kind(), PackErrorKind::IO);
        assert_eq!(e.message(), "disk on fire");
    }

    #[test]
    fn unknown_kinds_still_display() {
        let e = PackError::new(PackErrorKind(42), "from a newer pack");
        assert_eq!(e.to_string(), "error of kind 42: from a newer pack");
    }
}
