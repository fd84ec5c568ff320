//! Quantisation on load (mistral.rs's "in-situ quantisation"): a checkpoint
//! of f32, f16 or bf16 weights served to the model as Q8_0, Q4_1 or Q4_0,
//! so that a Hugging Face checkpoint decodes from a fraction of the bytes,
//! on the same integer kernels as a GGUF file. Only 2-D weight matrices
//! whose rows split into 32-element blocks are quantised; norms, biases and
//! already-quantised tensors pass through unchanged. With a 4-bit type the
//! token embedding and the output head stay 8-bit (llama.cpp's
//! `llama-quantize` also keeps the head finer): they carry the most
//! error per bit. A mapped source's pages leave the resident set once
//! quantised. The quantisers are ggml's `quantize_row_*_ref`, operation for
//! operation.

use std::path::Path;

use half::f16;
use spinfer_kernels::GgmlType;
use spinfer_kernels::blocks::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use spinfer_kernels::dequant::dequantize_row;
use spinfer_kernels::quantize::quantize_row_q8_0_ref;

use crate::config::ModelConfig;
use crate::loader::Loader;
use crate::tensor::{TensorData, TensorView};
use crate::{Error, Result};

/// What weights are quantised to on load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Requant {
    /// 8-bit blocks of 32 with an f16 scale (ggml's Q8_0), 8.5 bits per
    /// weight.
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale and minimum (ggml's Q4_1), 5
    /// bits per weight.
    Q4_1,
    /// 4-bit blocks of 32 with an f16 scale (ggml's Q4_0), 4.5 bits per
    /// weight.
    Q4_0,
}

impl Requant {
    pub fn name(self) -> &'static str {
        match self {
            Requant::Q8_0 => "q8_0",
            Requant::Q4_1 => "q4_1",
            Requant::Q4_0 => "q4_0",
        }
    }

    /// The type tensor `name` gets: 8-bit for the embedding and the head.
    fn for_tensor(self, name: &str) -> Requant {
        let coarse = matches!(self, Requant::Q4_0 | Requant::Q4_1);
        if coarse && (name.starts_with("token_embd.") || name.starts_with("output.")) { Requant::Q8_0 } else { self }
    }

    fn ggml(self) -> GgmlType {
        match self {
            Requant::Q8_0 => GgmlType::Q8_0,
            Requant::Q4_1 => GgmlType::Q4_1,
            Requant::Q4_0 => GgmlType::Q4_0,
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

/// ggml's `quantize_row_q4_0_ref` into `out`'s Q4_0 blocks (f16 `d`,
/// then 16 bytes of nibbles): per block the value of largest magnitude maps
/// to -8, `d = max / -8`, `q = min(15, trunc(x / d + 8.5))`.
fn quantize_row_q4_0(x: &[f32], out: &mut [u8]) {
    for (xb, yb) in x.chunks_exact(QK).zip(out.chunks_exact_mut(size_of::<BlockQ4_0>())) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xb {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        yb[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        nibbles(xb, &mut yb[2..], |v| ((v * id + 8.5) as i8).min(15) as u8);
    }
}

/// ggml's `quantize_row_q4_1_ref` into `out`'s Q4_1 blocks (f16 `d`, f16
/// `m`, 16 bytes of nibbles): `d = (max - min) / 15`, `m = min`,
/// `q = min(15, trunc((x - min) / d + 0.5))`.
fn quantize_row_q4_1(x: &[f32], out: &mut [u8]) {
    for (xb, yb) in x.chunks_exact(QK).zip(out.chunks_exact_mut(size_of::<BlockQ4_1>())) {
        let min = xb.iter().fold(f32::MAX, |m, &v| m.min(v));
        let max = xb.iter().fold(-f32::MAX, |m, &v| m.max(v));
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        yb[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        yb[2..4].copy_from_slice(&f16::from_f32(min).to_le_bytes());
        nibbles(xb, &mut yb[4..], |v| (((v - min) * id + 0.5) as i8).min(15) as u8);
    }
}

/// ggml's nibble order: element j in the low nibble of byte j, element
/// j + 16 in its high nibble.
fn nibbles(xb: &[f32], qs: &mut [u8], q: impl Fn(f32) -> u8) {
    for (j, b) in qs.iter_mut().enumerate().take(QK / 2) {
        *b = q(xb[j]) | (q(xb[QK / 2 + j]) << 4);
    }
}

/// Quantises one row of f32 to `to`'s blocks, as bytes (`q8` is the Q8_0
/// quantiser's block buffer).
fn quantize_row(to: Requant, x: &[f32], q8: &mut [BlockQ8_0], out: &mut [u8]) -> spinfer_kernels::Result<()> {
    match to {
        Requant::Q8_0 => {
            quantize_row_q8_0_ref(x, q8)?;
            // `BlockQ8_0` is ggml's block, `repr(C)` without padding.
            out.copy_from_slice(bytemuck::cast_slice::<BlockQ8_0, u8>(q8));
        }
        Requant::Q4_1 => quantize_row_q4_1(x, out),
        Requant::Q4_0 => quantize_row_q4_0(x, out),
    }
    Ok(())
}

/// `t` as `to`: each row dequantised to f32 and requantised, rows split
/// between the cores.
fn requantize(t: &TensorView, to: Requant, path: &Path) -> Result<TensorView> {
    let cols = t.dims[0];
    let err = |detail: String| Error::TensorType {
        path: path.to_path_buf(),
        tensor: t.name.clone(),
        ty: t.ty.name().into(),
        what: format!("cannot be quantised to {}: {detail}", to.name()),
    };
    let row_bytes = cols / QK * to.ggml().type_size();
    let quantise = |(x, q8): &mut (Vec<f32>, Vec<BlockQ8_0>), row: &[u8], out: &mut [u8]| {
        dequantize_row(t.ty, row, x)?;
        quantize_row(to, x, q8, out)
    };
    let q8_blocks = if to == Requant::Q8_0 { cols / QK } else { 0 };
    let init = || (vec![0f32; cols], vec![bytemuck::Zeroable::zeroed(); q8_blocks]);
    let out = t.map_rows(row_bytes, init, quantise).map_err(err)?;
    if t.data.is_mapped() {
        // SAFETY: mapped tensor data is a read-only file mapping; the pages
        // only leave the resident set (re-read if anything reads them).
        unsafe { crate::tensor::release_pages(t.data.bytes()) };
    }
    Ok(TensorView { name: t.name.clone(), ty: to.ggml(), dims: t.dims.clone(), data: TensorData::owned(out) })
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
        if !quantisable(&t) {
            return Ok(t);
        }
        requantize(&t, self.to.for_tensor(name), self.inner.path())
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
        let q = requantize(&t, Requant::Q8_0, Path::new("m")).unwrap();
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

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The 4-bit quantisers give gguf-py's bytes (`gguf.quants.quantize`,
    /// the `gguf` package's numpy port of ggml's reference, run once on
    /// these values): two blocks of a ramp, a block of zeros, a block whose
    /// largest magnitude is negative.
    #[test]
    fn the_4_bit_quantisers_are_ggmls() {
        let mut x: Vec<f32> = (0..64).map(|i| (((i * 37 % 101) as f64 - 50.0) * 0.013) as f32).collect();
        x.extend([0.0; 32]);
        x.extend((0..32).map(|i| (((i * 53 % 97) as f64 - 40.0) * 0.0071 * (1 + i % 5) as f64) as f32));
        let mut q = vec![0u8; 4 * 18];
        quantize_row_q4_0(&x, &mut q);
        assert_eq!(
            hex(&q),
            "332de046acf258bd1379df358be046acf26819ad740fb953fd9731eb852fca640ea842fd008088888888888888888888888888888888f5b269973b856c87c964d970985b971c8459"
        );
        let mut q = vec![0u8; 4 * 20];
        quantize_row_q4_1(&x, &mut q);
        assert_eq!(
            hex(&q),
            "8c2d33b9d0369bf257bd1369ce258ae0469cf258612dfeb89bf157ad0368ce248ad0469bf257bd130000000000000000000000000000000000000000e8311ebc8447c2597167158a056f469347e15a95"
        );
    }

    /// A float matrix served as Q4_0 or Q4_1 dequantises to within half a
    /// step of each block's grid; the embedding and the head stay Q8_0.
    #[test]
    fn a_4_bit_matrix_is_within_half_a_step_and_the_head_stays_8_bit() {
        let (rows, cols) = (4, 96);
        let x: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.01).collect();
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = TensorView {
            name: "blk.0.ffn_down.weight".into(),
            ty: GgmlType::F32,
            dims: vec![cols, rows],
            data: TensorData::owned(bytes),
        };
        for (to, step) in [(Requant::Q4_0, 0.48 / 8.0 * 1.001), (Requant::Q4_1, 0.96 / 15.0 * 1.001)] {
            let q = requantize(&t, to, Path::new("m")).unwrap();
            assert_eq!(q.ty, to.ggml());
            let mut back = vec![0f32; rows * cols];
            for (d, r) in back.chunks_mut(cols).zip(q.data.bytes().chunks(q.data.bytes().len() / rows)) {
                dequantize_row(q.ty, r, d).unwrap();
            }
            let max = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            // Q4_0's grid is asymmetric (-8..7): the far end may be a whole step off.
            let bound = if to == Requant::Q4_0 { step } else { step * 0.5 + 1e-3 };
            assert!(max <= bound, "{to:?}: {max} > {bound}");
        }
        for name in ["token_embd.weight", "output.weight"] {
            assert_eq!(Requant::Q4_0.for_tensor(name), Requant::Q8_0, "{name}");
        }
        assert_eq!(Requant::Q4_1.for_tensor("blk.3.attn_q.weight"), Requant::Q4_1);
    }
}
