//! How activations meet quantised weights: a leaf the model's layers share.

/// How activations meet quantised weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Integer dot products on 16-bit activations: two 8-bit planes
    /// (`x = hi + lo`, see `spinfer_kernels::split`), or, for the
    /// 32-element formats on CPUs without VNNI, one 16-bit plane
    /// (`spinfer_kernels::q16`, `spinfer_kernels::matmul::fast_act`), which
    /// costs half as much there: near-f32 accuracy, weights streamed once.
    /// A prompt's products run as precise mode's f32 GEMM where that is
    /// faster (`spinfer_kernels::matmul::prompt_gemm_pays`: CPUs without
    /// AMX int8 tiles). The default.
    #[default]
    Fast,
    /// Integer dot products on one 8-bit activation plane: llama.cpp's
    /// numerics, max logit error ~1 on SmolLM2; the fastest decode.
    Int8,
    /// f32 activations times weights dequantised on the fly (a prompt's:
    /// dequantised once per product, into an f32 GEMM): the function
    /// PyTorch computes on the dequantised model.
    Precise,
}
