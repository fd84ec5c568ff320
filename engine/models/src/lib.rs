//! spinfer's Llama-family models: the forward pass (dense, sparse FFN,
//! sparse output head), sessions (`spinfer-sampling`'s sampler
//! re-exported as `sampling`), and the calibration that runs the model to
//! fit its sparsity sidecar. The generation loop is `spinfer-generate`'s. Perplexity by the reference protocol
//! is `spinfer-engine`'s (`spinfer_engine::perplexity`).
//!
//! Architecture invariant: the model reads weights only through
//! `spinfer_formats::Loader` and runs every matrix product through a kernel
//! the `spinfer-kernel-select` registry resolved at load.
pub mod calibrate;
mod error;
pub mod head;
pub mod model;

pub use spinfer_sampling as sampling;

pub use error::{Error, Result};
pub use model::{Model, ModelOptions, Precision, Session};
pub use spinfer_storage::{placement, stream};
