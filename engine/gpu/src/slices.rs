//! Checked views of device buffers and the CUDA format of a tensor: the
//! small helpers every step of the forward pass uses.

use spinfer_formats::tensor::TensorView;
use spinfer_kernels_cuda::{DeviceBuf, Slice, SliceMut, WeightFormat};

use crate::{GpuError, Result};

/// Most tokens one pass through the layers takes; a longer
/// [`crate::GpuModel::forward`] runs in steps of this many (it bounds the
/// activation buffers).
pub const UBATCH: usize = 512;

pub(crate) fn internal(what: &str, off: usize, len: usize, have: usize) -> GpuError {
    GpuError::InvalidArgument(format!("{what}: {off}..{} is past its {have} values", off + len))
}

pub(crate) fn at<'a>(b: &'a DeviceBuf<f32>, what: &str, off: usize, len: usize) -> Result<Slice<'a, f32>> {
    b.at(off, len).ok_or_else(|| internal(what, off, len, b.len()))
}

pub(crate) fn at_mut<'a>(b: &'a mut DeviceBuf<f32>, what: &str, off: usize, len: usize) -> Result<SliceMut<'a, f32>> {
    let have = b.len();
    b.at_mut(off, len).ok_or_else(|| internal(what, off, len, have))
}

/// The CUDA format of a GGUF type, or an error naming the tensor.
pub(crate) fn format_of(t: &TensorView) -> Result<WeightFormat> {
    WeightFormat::from_name(t.ty.name()).ok_or_else(|| {
        let supported: Vec<&str> = WeightFormat::ALL.iter().map(|f| f.name()).collect();
        GpuError::UnsupportedType { tensor: t.name.clone(), ty: t.ty.to_string(), supported: supported.join(", ") }
    })
}
