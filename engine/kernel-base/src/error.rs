//! The crate's one error type.

use crate::GgmlType;

/// Errors from kernel-level operations: shape and layout problems that the
/// caller passed in. Messages are lowercase and name the values involved.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    // === Layout errors ===
    #[error("row of {n} {ty} elements is not a multiple of the block size {block}")]
    RowNotBlockAligned { ty: GgmlType, n: usize, block: usize },
    #[error("{ty} buffer of {got} bytes does not hold {n} elements ({want} bytes needed)")]
    BufferSize { ty: GgmlType, n: usize, want: usize, got: usize },
    #[error("type {ty} is not supported by {what}")]
    Unsupported { ty: GgmlType, what: &'static str },
    /// The kernel does not offer this operation at all (e.g. the gathered
    /// rows of a [`crate::kernel::Select::Rows`] call to a ternary kernel).
    #[error("kernel {kernel} does not offer {op}")]
    NotOffered { kernel: String, op: &'static str },

    // === Shape errors ===
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },

    // === Kernels from packs ===
    /// A kernel provided by a pack (native or WASM) failed; `detail`
    /// carries the pack's own error.
    #[error("kernel {kernel} of pack {pack} failed: {detail}")]
    Pack { pack: String, kernel: String, detail: String },
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;
