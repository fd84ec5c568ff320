//! How activations meet quantised weights: a leaf the model's layers share.

/// How activations meet quantised weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// Integer dot products on two 8-bit activation planes (`x = hi + lo`,
    /// see `spinfer_kernels::split`): near-f32 accuracy, weights streamed
    /// once. The default.
    #[default]
    Fast,
    /// Integer dot products on one 8-bit activation plane: llama.cpp's
    /// numerics, the fastest prefill, max logit error ~1 on SmolLM2.
    Int8,
    /// f32 activations times weights dequantised on the fly: the function
    /// PyTorch computes on the dequantised model.
    Precise,
}
