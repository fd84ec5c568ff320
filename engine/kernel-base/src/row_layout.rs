//! A row's size in bytes: the one part of [`GgmlType`] that can fail, kept
//! apart so the type (`types.rs`) and the error (`error.rs`) stay leaves.

use crate::{GgmlType, KernelError, Result};

impl GgmlType {
    /// Bytes taken by a row of `n` elements, or an error if `n` is not a
    /// multiple of the block size.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(KernelError::RowNotBlockAligned { ty: self, n, block: bs });
        }
        Ok(n / bs * self.type_size())
    }
}
