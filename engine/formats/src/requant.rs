//! Quantisation on load (mistral.rs's "in-situ quantisation"): a checkpoint
//! of f32, f16 or bf16 weights served to the model as Q8_0, so that a
//! Hugging Face checkpoint decodes from a quarter (f32) or half (bf16) of
//! the bytes, on the same integer kernels as a GGUF file. Only 2-D weight
//! matrices whose rows split into 32-element blocks are quantised; norms,
//! biases and already-quantised tensors pass through unchanged. A mapped
//! source's pages leave the resident set once quantised.

use std::path::Path;

use spinfer_kernels::GgmlType;
use spinfer_kernels::blocks::BlockQ8_0;
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::quantize::quantize_row_q8_0_ref;

use crate::config::ModelConfig;
use crate::loader::Loader;
use crate::tensor::{TensorData, TensorView};
use crate::{Error, Result};

/// What weights are quantised to on load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requant {
    /// 8-bit blocks of 32 with an f16 scale (ggml's Q8_0).
    Q8_0,
}

impl Requant {
    pub fn name(self) -> &'static str {
        match self {
            Requant::Q8_0 => "q8_0",
        }
    }
}

/// `inner` with its float weight matrices quantised as they are read.
pub struct Requantized<'a> {
    inner: &'a dyn Loader,
    to: Requant,
}

impl<'a> Requantized<'a> {
    pub fn new(inner: &'a dyn Loader, to: Requant) -> Self {
        Self { inner, to }
    }
}

/// Whether `t` is a float weight matrix with whole 32-element blocks.
fn quantisable(t: &TensorView) -> bool {
    let float = matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
    let matrix = t.dims.len() == 2 && t.dims[0].is_multiple_of(32) && t.dims[1] > 1;
    float && matrix && t.name.ends_with(".weight") && !t.name.contains("norm")
}

/// `t` as Q8_0: each row dequantised to f32 and requantised, rows split
/// between the cores.
fn to_q8_0(t: &TensorView, path: &Path) -> Result<TensorView> {
    let cols = t.dims[0];
    let err = |detail: String| Error::TensorType {
        path: path.to_path_buf(),
        tensor: t.name.clone(),
        ty: t.ty.name().into(),
        what: format!("cannot be quantised to q8_0: {detail}"),
    };
    let blocks = cols / 32;
    let quantise = |(x, q): &mut (Vec<f32>, Vec<BlockQ8_0>), row: &[u8], out: &mut [u8]| {
        dequantize_row(t.ty, row, x)?;
        quantize_row_q8_0_ref(x, q)?;
        // `BlockQ8_0` is ggml's block, `repr(C)` without padding.
        out.copy_from_slice(bytemuck::cast_slice::<BlockQ8_0, u8>(q));
        Ok::<(), spinfer_kernels::KernelError>(())
    };
    let init = || (vec![0f32; cols], vec![bytemuck::Zeroable::zeroed(); blocks]);
    let out = t.map_rows(blocks * size_of::<BlockQ8_0>(), init, quantise).map_err(err)?;
    if t.data.is_mapped() {
        // SAFETY: mapped tensor data is a read-only file mapping; the pages
        // only leave the resident set (re-read if anything reads them).
        unsafe { crate::tensor::release_pages(t.data.bytes()) };
    }
    Ok(TensorView { name: t.name.clone(), ty: GgmlType::Q8_0, dims: t.dims.clone(), data: TensorData::owned(out) })
}

impl Loader for Requantized<'_> {
    fn path(&self) -> &Path {
        self.inner.path()
    }

    fn config(&self) -> Result<ModelConfig> {
        self.inner.config()
    }

    fn tensor(&self, name: &str) -> Result<TensorView> {
        let t = self.inner.tensor(name)?;
        match self.to {
            Requant::Q8_0 if quantisable(&t) => to_q8_0(&t, self.inner.path()),
            Requant::Q8_0 => Ok(t),
        }
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.inner.has_tensor(name)
    }

    fn tensor_names(&self) -> Vec<String> {
        self.inner.tensor_names()
    }

    fn file_size(&self) -> usize {
        self.inner.file_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_float_matrix_becomes_ggmls_q8_0_and_the_rest_passes_through() {
        let (rows, cols) = (3, 64);
        let x: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = TensorView {
            name: "blk.0.ffn_up.weight".into(),
            ty: GgmlType::F32,
            dims: vec![cols, rows],
            data: TensorData::owned(bytes),
        };
        assert!(quantisable(&t));
        let q = to_q8_0(&t, Path::new("m")).unwrap();
        assert_eq!((q.ty, q.data.bytes().len()), (GgmlType::Q8_0, rows * cols / 32 * 34));
        let mut back = vec![0f32; rows * cols];
        for (d, r) in back.chunks_mut(cols).zip(q.data.bytes().chunks(cols / 32 * 34)) {
            dequantize_row(GgmlType::Q8_0, r, d).unwrap();
        }
        // Q8_0's error: at most half a step (amax / 127 / 2) plus f16 scale rounding.
        let max = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(max <= 0.65 / 127.0 * 0.51 + 1e-4, "{max}");
        let norm = TensorView { name: "blk.0.attn_norm.weight".into(), ..t.clone() };
        let odd = TensorView { dims: vec![cols / 2 * 3, 2], ..t.clone() };
        assert!(!quantisable(&norm) && !quantisable(&TensorView { ty: GgmlType::Q4_0, ..t.clone() }));
        assert!(!quantisable(&TensorView { dims: vec![48, 4], ..odd }));
    }
}
