//! Checked views of device buffers and the CUDA format of a tensor: the
//! small helpers every step of the forward pass uses.

use spinfer_formats::tensor::TensorView;
use spinfer_kernels::GgmlType;
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
    let f = match t.ty {
        GgmlType::Q4_0 => WeightFormat::Q4_0,
        GgmlType::Q4_1 => WeightFormat::Q4_1,
        GgmlType::Q5_0 => WeightFormat::Q5_0,
        GgmlType::Q5_1 => WeightFormat::Q5_1,
        GgmlType::Q8_0 => WeightFormat::Q8_0,
        GgmlType::Q4_K => WeightFormat::Q4_K,
        GgmlType::Q5_K => WeightFormat::Q5_K,
        GgmlType::Q6_K => WeightFormat::Q6_K,
        GgmlType::TQ1_0 => WeightFormat::TQ1_0,
        GgmlType::TQ2_0 => WeightFormat::TQ2_0,
        other => {
            let supported: Vec<&str> = WeightFormat::ALL.iter().map(|f| f.name()).collect();
            return Err(GpuError::UnsupportedType {
                tensor: t.name.clone(),
                ty: other.to_string(),
                supported: supported.join(", "),
            });
        }
    };
    Ok(f)
}
