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
    /// One 16-bit plane per 32 elements ([`crate::q16`]): fast mode's
    /// arithmetic for the 32-element formats on CPUs without VNNI.
    Q16,
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
            ActType::Q16 => "q16",
        }
    }
}

/// Which part of the weight matrix a product reads: the operation's form.
/// The sparse output head's cluster row ranges are a [`Form::GatheredRows`]
/// call whose list holds the ranges' rows: the row loop tiles runs of
/// consecutive rows exactly as the dense product does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Form {
    /// Every row: `out[t, r] = W[r, :] · x[t, :]`.
    #[default]
    Dense,
    /// The rows `idx` (the sparse gate and up projections, the head's
    /// clusters): `out[t, k] = W[idx[k], :] · x[t, :]`, read in place.
    GatheredRows,
    /// The AXPY over the columns `idx` (the sparse down projection):
    /// `out[t, r] = Σ_j x[t, j] · W[r, idx[j]]`.
    GatheredColumns,
}

impl Form {
    /// `""`, `"gathered-row "` or `"gathered-column "`: the prefix of an
    /// operation's name in reports, pins and logs.
    pub fn prefix(self) -> &'static str {
        match self {
            Form::Dense => "",
            Form::GatheredRows => "gathered-row ",
            Form::GatheredColumns => "gathered-column ",
        }
    }
}

/// One matmul operation: `out[t, r] = sum_c W[r, c] * x[t, c]` with `W`
/// of `rows x cols` elements of `wtype`, row-major, read in `form`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulDesc {
    pub wtype: GgmlType,
    pub act: ActType,
    pub rows: usize,
    pub cols: usize,
    pub form: Form,
}

impl MatmulDesc {
    /// The dense product over a `rows x cols` matrix of `wtype`.
    pub const fn dense(wtype: GgmlType, act: ActType, rows: usize, cols: usize) -> Self {
        Self { wtype, act, rows, cols, form: Form::Dense }
    }

    /// The same matrix read in `form`.
    pub const fn with_form(self, form: Form) -> Self {
        Self { form, ..self }
    }
}

/// What a call reads of the weights: all rows, or the listed rows or
/// columns (the data of the descriptor's [`Form`]).
#[derive(Clone, Copy, Debug)]
pub enum Select<'a> {
    /// Every row of `w` (as many as it holds; see [`MatmulCall::w`]).
    All,
    /// The rows `idx` of `w`, in output order.
    Rows(&'a [u32]),
    /// The strictly ascending columns `idx` of `w`; `x` holds one
    /// coefficient per listed column.
    Columns(&'a [u32]),
}

impl Select<'_> {
    /// The form this selection is a call of.
    pub fn form(&self) -> Form {
        match self {
            Select::All => Form::Dense,
            Select::Rows(_) => Form::GatheredRows,
            Select::Columns(_) => Form::GatheredColumns,
        }
    }
}

/// Returns a 64-byte aligned region of `bytes` bytes inside `scratch` (a
/// call's [`MatmulCall::scratch`]), growing the Vec if needed (never
/// shrinking it).
pub fn scratch_aligned(scratch: &mut Vec<u8>, bytes: usize) -> &mut [u8] {
    let need = bytes + 64;
    if scratch.len() < need {
        scratch.resize(need, 0);
    }
    let off = scratch.as_ptr().align_offset(64);
    &mut scratch[off..off + bytes]
}

/// One call of the kernel seam.
pub struct MatmulCall<'a> {
    /// The weights, row-major in the descriptor's `wtype`: all `rows` rows
    /// of the matrix. A dense call may pass fewer whole rows (rows gathered
    /// beforehand, e.g. from the FFN bundle); the built-in kernels serve
    /// any row count, a pack's kernels may require exactly `rows`.
    pub w: &'a [u8],
    /// Which rows or columns the product reads.
    pub select: Select<'a>,
    /// `n_tokens` activation rows: `cols` values each, or one per listed
    /// column for [`Select::Columns`].
    pub x: &'a [f32],
    pub n_tokens: usize,
    /// `n_tokens` output rows: one value per row computed (all rows, the
    /// listed rows, or all rows of the AXPY).
    pub out: &'a mut [f32],
    /// The kernel's reusable buffer (quantised activations); steady-state
    /// calls do not allocate.
    pub scratch: &'a mut Vec<u8>,
    /// The tokens are a prompt's (prefill): a kernel may run them on a
    /// prompt path that rounds differently from its decode path (each
    /// row's value still independent of the other rows and of
    /// `n_tokens`), such as the built-in AMX int8 tiles. Decode steps pass
    /// `false`, so a token gets the same value alone and in a batch.
    pub prefill: bool,
}

impl<'a> MatmulCall<'a> {
    /// A dense call: every row of `w`.
    pub fn dense(w: &'a [u8], x: &'a [f32], n_tokens: usize, out: &'a mut [f32], scratch: &'a mut Vec<u8>) -> Self {
        Self { w, select: Select::All, x, n_tokens, out, scratch, prefill: false }
    }

    /// This call, marked as a prompt's tokens or not ([`MatmulCall::prefill`]).
    #[must_use]
    pub fn prefill(self, prefill: bool) -> Self {
        Self { prefill, ..self }
    }

    /// The same call, borrowed again (to retry it on another kernel).
    pub fn reborrow(&mut self) -> MatmulCall<'_> {
        MatmulCall {
            w: self.w,
            select: self.select,
            x: self.x,
            n_tokens: self.n_tokens,
            out: self.out,
            scratch: self.scratch,
            prefill: self.prefill,
        }
    }
}

/// A matmul implementation. Implementations are stateless apart from
/// configuration, `Send + Sync`, and cheap to call per token.
pub trait MatmulKernel: Send + Sync {
    /// Stable identifier, e.g. `"avx512/q4_1*q8_1"`.
    fn name(&self) -> &str;

    /// Runs `call` over `pool`:
    ///
    /// * [`Select::All`]: `out[t * rows + r] = dot(W[r, :], x[t * cols ..
    ///   (t + 1) * cols])`;
    /// * [`Select::Rows`]: `out[t * k + j] = dot(W[idx[j], :], x[t * cols
    ///   ..])`, reading only the listed rows, each value equal to the dense
    ///   product's row `idx[j]`;
    /// * [`Select::Columns`]: `out[t * rows + r] = Σ_j x[t * k + j] · W[r,
    ///   idx[j]]`.
    ///
    /// Activations are quantised inside if the kernel's activation type
    /// asks for it, using `call.scratch`. A kernel answers
    /// [`KernelError::NotOffered`] for a form it does not serve (the
    /// registry offers kernels per form, so a resolved kernel is only
    /// called in its own).
    ///
    /// [`KernelError::NotOffered`]: crate::KernelError::NotOffered
    fn run(&self, pool: &ThreadPool, call: MatmulCall<'_>) -> Result<()>;
}

/// The error of a kernel asked for a form it does not serve.
pub fn not_offered(kernel: &dyn MatmulKernel, form: Form) -> crate::KernelError {
    let op = match form {
        Form::Dense => "dense matmul",
        Form::GatheredRows => "gathered-row matmul",
        Form::GatheredColumns => "gathered-column axpy",
    };
    crate::KernelError::NotOffered { kernel: kernel.name().to_string(), op }
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
