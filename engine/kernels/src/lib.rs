//! spinfer's CPU kernels: dot products and multi-threaded matvec/matmul
//! over GGML blocks, on top of `spinfer-kernel-base` (block formats,
//! dequantisation, activation quantisation, the thread pool and the kernel
//! seam), whose modules are re-exported here at their old paths.
//!
//! Every kernel has a portable scalar reference; SIMD variants (AVX2,
//! AVX-512/VNNI) are chosen at run time from [`cpu::CpuFeatures`] and are
//! tested against the scalar reference on random inputs.
//!
//! This crate knows nothing about files or models: it takes byte slices and
//! shapes and returns numbers. The engine decides which kernel serves which
//! operation (its kernel seam); this crate offers the candidates.

pub mod dot;
pub mod matmul;

pub use spinfer_kernel_base::{GgmlType, KernelError, QK_K, Result};
pub use spinfer_kernel_base::{blocks, cpu, dequant, elem, kernel, pool, q16, quantize, random, split, vec};
