//! The matmul kernel abstraction that the engine's kernel seam resolves to.
//!
//! An operation is described by a [`MatmulDesc`] (weight type, activation
//! format, shape). `matmul::candidates` lists every implementation in this
//! crate that can serve it on the running CPU, best first; the engine picks
//! one at load time and calls it for every token. Native and WASM packs
//! offer further implementations of the same contract (`spinfer-packs`).

use crate::pool::ThreadPool;
use crate::{GgmlType, Result};

/// How activations are fed to a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types, reason = "names follow GGML's spelling")]
pub enum ActType {
    /// f32 activations; quantised weights are dequantised on the fly
    /// (precise mode, and F32/F16/BF16 weights).
    F32,
    /// Activations quantised per 32 elements (for Q4_0/Q5_0/Q8_0 weights).
    Q8_0,
    /// Q8_0 plus block sums (for Q4_1/Q5_1 weights).
    Q8_1,
    /// Activations quantised per 256 elements (for K-quant weights).
    Q8_K,
}

impl ActType {
    /// The activation format llama.cpp pairs with `w` in fast mode
    /// (`vec_dot_type`).
    pub fn fast_for(w: GgmlType) -> ActType {
        use GgmlType::*;
        match w {
            Q4_0 | Q5_0 | Q8_0 => ActType::Q8_0,
            Q4_1 | Q5_1 => ActType::Q8_1,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | TQ1_0 | TQ2_0 => ActType::Q8_K,
            F32 | F16 | BF16 | Q8_1 | Q8_K => ActType::F32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ActType::F32 => "f32",
            ActType::Q8_0 => "q8_0",
            ActType::Q8_1 => "q8_1",
            ActType::Q8_K => "q8_K",
        }
    }
}

/// One matmul operation: `out[t, r] = sum_c W[r, c] * x[t, c]` with `W`
/// of `rows x cols` elements of `wtype`, row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulDesc {
    pub wtype: GgmlType,
    pub act: ActType,
    pub rows: usize,
    pub cols: usize,
}

/// A matmul implementation. Implementations are stateless apart from
/// configuration, `Send + Sync`, and cheap to call per token.
pub trait MatmulKernel: Send + Sync {
    /// Stable identifier, e.g. `"avx512/q4_1*q8_1"`.
    fn name(&self) -> &str;

    /// `out[t * rows + r] = dot(W[r, :], x[t * cols .. (t + 1) * cols])` for
    /// `t in 0..n_tokens`. `w` holds `rows` rows of `desc.wtype`; `x` holds
    /// `n_tokens * cols` f32 activations (quantised inside if the kernel's
    /// activation type asks for it, using `scratch`); `out` holds
    /// `n_tokens * rows` floats. Work is spread over `pool`.
    fn run(
        &self,
        pool: &ThreadPool,
        w: &[u8],
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        scratch: &mut Vec<u8>,
    ) -> Result<()>;

    /// The gathered-row product (the sparse up projection): `out[t *
    /// idx.len() + k] = dot(W[idx[k], :], x[t * cols .. (t + 1) * cols])`,
    /// reading only the rows `idx` of `w` (which holds all `rows` rows) in
    /// place. Each value equals the dense product's row `idx[k]`. Kernels
    /// that cannot address single rows return [`KernelError::NotOffered`]
    /// (the default); callers then copy the rows and use [`Self::run`].
    ///
    /// [`KernelError::NotOffered`]: crate::KernelError::NotOffered
    #[allow(
        clippy::too_many_arguments,
        reason = "the kernel seam's call: weights, indices, activations, tokens, output, scratch; one call struct is issue 17's next step"
    )]
    fn run_rows(
        &self,
        pool: &ThreadPool,
        w: &[u8],
        idx: &[u32],
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let _ = (pool, w, idx, x, n_tokens, out, scratch);
        Err(crate::KernelError::NotOffered { kernel: self.name().to_string(), op: "gathered-row matmul" })
    }

    /// The gathered-column AXPY (the sparse down projection):
    /// `out[t * rows + r] = Σ_j x[t * k + j] · W[r, idx[j]]` over the `k` strictly
    /// ascending columns `idx` of `w` (all `rows x cols` of it, as the model
    /// stores it). Served by pack kernels of the ABI's
    /// `GATHERED_COLUMN_AXPY`, which keep their own repack of `w`; the
    /// built-in kernels answer [`KernelError::NotOffered`] (the default):
    /// the engine's own sparse down projection runs on its exact
    /// neuron-major repack (`spinfer_sparse_kernels::NeuronMajor`) instead.
    ///
    /// [`KernelError::NotOffered`]: crate::KernelError::NotOffered
    #[allow(
        clippy::too_many_arguments,
        reason = "the kernel seam's call: weights, indices, activations, tokens, output, scratch; one call struct is issue 17's next step"
    )]
    fn run_columns(
        &self,
        pool: &ThreadPool,
        w: &[u8],
        idx: &[u32],
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let _ = (pool, w, idx, x, n_tokens, out, scratch);
        Err(crate::KernelError::NotOffered { kernel: self.name().to_string(), op: "gathered-column axpy" })
    }
}

/// An error naming the first index of `idx` that is not below `n_rows`
/// (the rows of a gathered product, the columns of a gathered AXPY).
pub fn check_indices(op: &'static str, idx: &[u32], n_rows: usize) -> Result<()> {
    if let Some((k, &i)) = idx.iter().enumerate().find(|&(_, &i)| i as usize >= n_rows) {
        return Err(crate::KernelError::Shape {
            op,
            detail: format!("index {i} (position {k}) is out of range for {n_rows} rows"),
        });
    }
    Ok(())
}
