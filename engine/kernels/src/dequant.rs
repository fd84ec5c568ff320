//! Dequantisation of GGML blocks to f32 (the reference semantics of every
//! format). OWNED BY THE FORMATS HELPER: being written.

use crate::{GgmlType, KernelError, Result};

/// Dequantises one row: `src` holds whole blocks of `ty`, `dst` receives
/// `dst.len()` elements (a multiple of the block size).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let _ = (src, dst);
    Err(KernelError::Unsupported { ty, what: "dequantize_row (not built yet)" })
}
