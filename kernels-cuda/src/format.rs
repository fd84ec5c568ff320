//! The weight and activation formats the CUDA kernels read.

use crate::CudaError;

/// A weight matrix's block format: GGUF's quantised types plus spinfer's
/// I2_S (row-scaled 2-bit ternary, see `spinfer_kernels::dot::ternary`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types, reason = "names follow GGML's spelling")]
pub enum WeightFormat {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
    TQ1_0,
    TQ2_0,
    I2_S,
}

impl WeightFormat {
    /// Every format with CUDA kernels.
    pub const ALL: [WeightFormat; 11] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::TQ1_0,
        Self::TQ2_0,
        Self::I2_S,
    ];

    /// GGML's name (`"q4_K"`), also the kernels' name stem.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q8_0 => "q8_0",
            Self::Q4_K => "q4_K",
            Self::Q5_K => "q5_K",
            Self::Q6_K => "q6_K",
            Self::TQ1_0 => "tq1_0",
            Self::TQ2_0 => "tq2_0",
            Self::I2_S => "i2_s",
        }
    }

    /// The CUDA C struct that reads the format (`src/cu/formats.cuh`).
    pub(crate) const fn cuda_struct(self) -> &'static str {
        match self {
            Self::Q4_0 => "FmtQ4_0",
            Self::Q4_1 => "FmtQ4_1",
            Self::Q5_0 => "FmtQ5_0",
            Self::Q5_1 => "FmtQ5_1",
            Self::Q8_0 => "FmtQ8_0",
            Self::Q4_K => "FmtQ4_K",
            Self::Q5_K => "FmtQ5_K",
            Self::Q6_K => "FmtQ6_K",
            Self::TQ1_0 => "FmtTQ1_0",
            Self::TQ2_0 => "FmtTQ2_0",
            Self::I2_S => "FmtI2_S",
        }
    }

    /// Weights per block (I2_S: a row's length must be a multiple of 256).
    pub const fn block_elems(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4_K | Self::Q5_K | Self::Q6_K | Self::TQ1_0 | Self::TQ2_0 | Self::I2_S => 256,
        }
    }

    /// Bytes per block (I2_S: the code bytes of 256 weights; each row adds
    /// its 4-byte scale).
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4_K => 144,
            Self::Q5_K => 176,
            Self::Q6_K => 210,
            Self::TQ1_0 => 54,
            Self::TQ2_0 => 66,
            Self::I2_S => 64,
        }
    }

    /// Bytes of one row of `cols` weights, or an error naming the shape.
    pub fn row_bytes(self, cols: usize) -> Result<usize, CudaError> {
        let be = self.block_elems();
        if cols == 0 || !cols.is_multiple_of(be) {
            return Err(CudaError::Shape {
                op: "row_bytes",
                detail: format!("a {} row of {cols} weights is not a positive multiple of {be}", self.name()),
            });
        }
        let scale = if self == Self::I2_S { 4 } else { 0 };
        Ok(cols / be * self.block_bytes() + scale)
    }

    /// Parses GGML's name (`"q4_K"`, case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name().eq_ignore_ascii_case(name))
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Element type of the activations a GEMV reads (outputs are always f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActType {
    F32,
    F16,
    BF16,
}

impl ActType {
    /// Every activation type.
    pub const ALL: [ActType; 3] = [Self::F32, Self::F16, Self::BF16];

    /// The CUDA C struct that reads it (`src/cu/common.cuh`).
    pub(crate) const fn cuda_struct(self) -> &'static str {
        match self {
            Self::F32 => "ActF32",
            Self::F16 => "ActF16",
            Self::BF16 => "ActBF16",
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    /// `v` rounded to this type, as the kernels will read it.
    pub fn round(self, v: f32) -> f32 {
        match self {
            Self::F32 => v,
            Self::F16 => half::f16::from_f32(v).to_f32(),
            Self::BF16 => half::bf16::from_f32(v).to_f32(),
        }
    }

    /// The name used in reports (`"f32"`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
        }
    }
}

/// Tokens one GEMV launch handles: the kernels are built for 1, 2, 4 and 8.
pub const GEMV_BATCHES: [usize; 4] = [1, 2, 4, 8];
/// Tokens one gathered-row AXPY launch handles: 1, 2 and 4.
pub const AXPY_BATCHES: [usize; 3] = [1, 2, 4];

/// The largest built batch that is at most `left` tokens.
pub(crate) fn batch_for(left: usize, built: &[usize]) -> usize {
    built.iter().copied().filter(|&b| b <= left).max().unwrap_or(1)
}

/// The built-in product kernels' source before instantiation: the shared
/// headers, the block readers and the GEMV/GEMM/AXPY templates. A CUDA pack
/// ships a source of this shape (ABI [`crate::PACK_ABI_VERSION`]).
pub fn products_source() -> String {
    format!("{}\n{}\n{}\n", include_str!("cu/common.cuh"), include_str!("cu/formats.cuh"), include_str!("cu/gemv.cu"))
}

/// The CUDA source of one format's kernels: `products` (see
/// [`products_source`]) and one `FORMAT(...)` line instantiating it.
pub fn format_source(products: &str, format: WeightFormat) -> String {
    format!("{products}\nFORMAT({}, {})\n", format.name(), format.cuda_struct())
}

/// The built-in CUDA source of one format's kernels.
pub fn kernel_source(format: WeightFormat) -> String {
    format_source(&products_source(), format)
}

/// The CUDA source of the format-independent steps (`ops.cu`).
pub fn ops_source() -> String {
    format!("{}\n{}\n", include_str!("cu/common.cuh"), include_str!("cu/ops.cu"))
}

/// Name of the GEMV kernel for a format, activation type and batch.
pub(crate) fn gemv_kernel(format: WeightFormat, act: ActType, batch: usize) -> String {
    format!("gemv_{}_{}_b{batch}", format.name(), act.cuda_struct())
}

/// Name of the fused GEMV kernel (f32 activations, a step fused into its
/// staging) for a format and batch.
pub(crate) fn gemv_fused_kernel(format: WeightFormat, batch: usize) -> String {
    format!("gemv_fused_{}_b{batch}", format.name())
}

/// Name of the many-token (tiled) kernel for a format and activation type.
pub(crate) fn gemm_kernel(format: WeightFormat, act: ActType) -> String {
    format!("gemm_{}_{}", format.name(), act.cuda_struct())
}

/// Name of the gathered-row AXPY kernel for a format and batch.
pub(crate) fn axpy_kernel(format: WeightFormat, batch: usize) -> String {
    format!("axpy_rows_{}_b{batch}", format.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_match_ggml_and_refuse_ragged_rows() {
        assert_eq!(WeightFormat::Q4_K.row_bytes(512).unwrap(), 288);
        assert_eq!(WeightFormat::I2_S.row_bytes(256).unwrap(), 68);
        assert!(WeightFormat::Q4_0.row_bytes(33).unwrap_err().to_string().contains("q4_0"));
        assert!(WeightFormat::Q6_K.row_bytes(0).is_err());
    }

    #[test]
    fn batches_split_into_built_kernels() {
        assert_eq!(batch_for(7, &GEMV_BATCHES), 4);
        assert_eq!(batch_for(9, &GEMV_BATCHES), 8);
        assert_eq!(batch_for(3, &AXPY_BATCHES), 2);
    }

    #[test]
    fn every_format_instantiates_its_kernels() {
        for f in WeightFormat::ALL {
            let src = kernel_source(f);
            assert!(src.contains(&format!("FORMAT({}, {})", f.name(), f.cuda_struct())));
            assert!(src.contains(&format!("struct {} ", f.cuda_struct())), "{f}");
        }
    }
}
