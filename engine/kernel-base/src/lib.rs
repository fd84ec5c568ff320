//! The base of spinfer's CPU compute layer, below the dot products and
//! matmul kernels of `spinfer-kernels` (which re-exports every module here
//! at its old path): GGML block formats and their reference semantics
//! (`blocks`, `dequant`), the activation quantisers (`quantize`) and
//! two-plane split (`split`), f32 vector maths (`vec`), run-time CPU
//! features (`cpu`), the thread pool (`pool`) and the kernel seam's types
//! (`kernel`: `MatmulDesc`, `Form`, `MatmulCall`, `MatmulKernel`).
//!
//! Like `spinfer-kernels`, it knows nothing about files or models: it takes
//! byte slices and shapes and returns numbers.

pub mod blocks;
pub mod cpu;
pub mod dequant;
pub mod drive;
pub mod elem;
mod error;
pub mod kernel;
pub mod pool;
pub mod q16;
pub mod quantize;
pub mod random;
mod row_layout;
pub mod split;
#[cfg(target_arch = "x86_64")]
pub mod tiles;
mod types;
pub mod vec;

pub use error::{KernelError, Result};
pub use types::{GgmlType, QK_K};
