//! Weights under a memory budget: [`placement`] decides, per row chunk of
//! every matrix, what stays resident and what is read from storage each
//! step; [`stream`] reads the streamed chunks ahead of need on its own I/O
//! threads. Model-agnostic: the model crate says what its matrices are and
//! in which order a step uses them.

mod error;
pub mod placement;
pub mod stream;

pub use error::{Error, Result};
