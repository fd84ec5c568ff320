//! spinfer's kernel selection: the kernel registry (every provider's
//! kernels, pins and exclusions from the operator's TOML) and the tuner
//! whose measurements, kept per host in a ruvector-core history, decide
//! which kernel serves each operation.
//!
//! Not to be confused with `spinfer-registry`, which decides whether a
//! kernel pack is trusted (signatures, keys); this crate decides which
//! trusted kernel runs.
pub mod bound;
mod error;
pub mod op_names;
pub mod registry;
pub mod tuning;

pub use bound::BoundKernel;
pub use error::{Error, Result};
pub use registry::KernelRegistry;
