//! Model definitions.
pub mod bert;
pub mod bert_sparse;
pub mod config;
pub mod llama;
pub mod math;

pub use config::{Arch, ModelConfig, RopeStyle};
pub use llama::{Model, ModelOptions, Precision, Session};

use spinfer_kernels::dequant::dequantize_row;

use crate::loader::Loader;
use crate::tensor::TensorView;
use crate::{Error, Result};

/// `x += y`, element-wise (residual connections).
pub(crate) fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Checks a tensor's GGML-order dims.
pub(crate) fn check_dims(loader: &dyn Loader, t: &TensorView, want: &[usize]) -> Result<()> {
    if t.dims != want {
        return Err(Error::TensorShape {
            path: loader.path().to_path_buf(),
            tensor: t.name.clone(),
            got: t.dims.clone(),
            want: want.to_vec(),
        });
    }
    Ok(())
}

/// A 1-D tensor of `len` elements as f32 (norm weights, biases).
pub(crate) fn load_vector(loader: &dyn Loader, name: &str, len: usize) -> Result<Vec<f32>> {
    let t = loader.tensor(name)?;
    check_dims(loader, &t, &[len])?;
    let mut out = vec![0.0; len];
    dequantize_row(t.ty, t.data.bytes(), &mut out).map_err(|e| Error::TensorType {
        path: loader.path().to_path_buf(),
        tensor: name.into(),
        ty: t.ty.to_string(),
        what: format!("cannot be read as a vector: {e}"),
    })?;
    Ok(out)
}
