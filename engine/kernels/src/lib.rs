//! spinfer's CPU compute layer: GGML block formats, dequantisation, activation
//! quantisation, dot products and multi-threaded matvec/matmul.
//!
//! Every kernel has a portable scalar reference; SIMD variants (AVX2,
//! AVX-512/VNNI) are chosen at run time from [`cpu::CpuFeatures`] and are
//! tested against the scalar reference on random inputs.
//!
//! This crate knows nothing about files or models: it takes byte slices and
//! shapes and returns numbers. The engine decides which kernel serves which
//! operation (its kernel seam); this crate offers the candidates.

pub mod blocks;
pub mod cpu;
pub mod dequant;
pub mod dot;
mod error;
pub mod kernel;
pub mod matmul;
pub mod pool;
pub mod quantize;
mod row_layout;
pub mod split;
mod types;
pub mod vec;

pub use error::{KernelError, Result};
pub use types::{GgmlType, QK_K};
