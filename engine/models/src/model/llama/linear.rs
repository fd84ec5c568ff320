//! A weight matrix bound to the kernel that multiplies by it (dense,
//! gathered rows, or rows already gathered), with the pack kernel's
//! fallback and the two-plane activations of [`Precision::Fast`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use spinfer_kernels::KernelError;
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::split::split_hi_lo;

use crate::model::precision::Precision;
use crate::model::{check_dims, load_vector};
use crate::{Error, Result};
use spinfer_formats::loader::Loader;
use spinfer_formats::tensor::TensorData;
use spinfer_kernel_select::registry::{Choice, KernelRegistry};

/// A weight matrix bound to the kernel that multiplies by it.
pub struct Linear {
    /// Canonical tensor name, for errors and reports.
    pub name: String,
    pub(crate) w: TensorData,
    pub desc: MatmulDesc,
    kernel: Arc<dyn MatmulKernel>,
    /// The built-in kernel that takes over if a pack kernel fails.
    fallback: Option<Arc<dyn MatmulKernel>>,
    /// Set once the pack kernel has failed: later calls go straight to the
    /// fallback.
    failed: AtomicBool,
    pub provider: String,
    pub choice: Choice,
    /// The other candidates and their recorded decode medians (ns).
    pub alternatives: Vec<(String, Option<u64>)>,
    bias: Option<Vec<f32>>,
    /// Feed activations as two 8-bit planes (see [`Precision::Fast`]).
    two_planes: bool,
    /// The kernel of the gathered-row products (the sparse gate and up
    /// projections read their kept rows in place): the gathered-row form
    /// of `kernel` when its pack offers one, else the built-in kernel
    /// ([`KernelRegistry::resolve_rows`]).
    rows_kernel: Option<Arc<dyn MatmulKernel>>,
    /// Who provides `rows_kernel`.
    pub rows_provider: String,
    /// For a pack's `rows_kernel`: the built-in kernel that takes over if
    /// it fails.
    rows_fallback: Option<Arc<dyn MatmulKernel>>,
    /// Set once the pack's gathered-row kernel has failed.
    rows_failed: AtomicBool,
}

/// One matmul call: `(x, n tokens, out, kernel scratch)`.
type RunFn<'a> = dyn Fn(&[f32], usize, &mut [f32], &mut Vec<u8>) -> Result<()> + 'a;

/// Reusable buffers of the matmul calls.
#[derive(Default)]
pub(crate) struct Scratch {
    /// The kernels' quantised activations.
    pub(crate) bytes: Vec<u8>,
    /// Two-plane activations `[hi; lo]` (2n, cols).
    pub(crate) planes: Vec<f32>,
    /// Their outputs (2n, rows).
    pub(crate) planes_out: Vec<f32>,
    /// Rows gathered for a sparse product.
    pub(crate) gathered: Vec<u8>,
}

impl Linear {
    pub(crate) fn load(
        loader: &dyn Loader,
        registry: &KernelRegistry,
        precision: Precision,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let t = loader.tensor(name)?;
        check_dims(loader, &t, &[cols, rows])?;
        let mut linear = Self::from_tensor(registry, precision, name, t.ty, t.data, rows, cols)?;
        let bias_name = name.replace(".weight", ".bias");
        if bias_name != name && loader.has_tensor(&bias_name) {
            linear.bias = Some(load_vector(loader, &bias_name, rows)?);
        }
        Ok(linear)
    }

    /// A matrix of `rows × cols` weights of type `ty` (no bias), bound to
    /// the kernel `registry` picks for it.
    pub(crate) fn from_tensor(
        registry: &KernelRegistry,
        precision: Precision,
        name: &str,
        ty: spinfer_kernels::GgmlType,
        data: TensorData,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let t = spinfer_formats::tensor::TensorView { name: name.to_string(), ty, dims: vec![cols, rows], data };
        let act = match precision {
            Precision::Fast | Precision::Int8 => ActType::fast_for(t.ty),
            Precision::Precise => ActType::F32,
        };
        let two_planes = precision == Precision::Fast && act != ActType::F32;
        let desc = MatmulDesc { wtype: t.ty, act, rows, cols };
        let r = registry.resolve(&desc)?;
        let (rows_provider, rows_kernel) = registry.resolve_rows(&desc, &r).unzip();
        let rows_fallback = (rows_provider.as_deref().is_some_and(|p| p != spinfer_kernel_select::registry::BUILTIN))
            .then(|| spinfer_kernel_select::registry::builtin_kernel(&desc).ok().map(Arc::from))
            .flatten();
        Ok(Self {
            name: name.to_string(),
            w: t.data,
            desc,
            kernel: r.kernel,
            fallback: r.fallback,
            failed: AtomicBool::new(false),
            provider: r.provider,
            choice: r.choice,
            alternatives: r.alternatives,
            rows_kernel,
            rows_provider: rows_provider.unwrap_or_default(),
            rows_fallback,
            rows_failed: AtomicBool::new(false),
            bias: None,
            two_planes,
        })
    }

    /// `out[t, :] = W · x[t, :] (+ b)` for `n` tokens.
    pub(crate) fn forward(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>| {
            let w = self.w.bytes();
            let err = |k: &dyn MatmulKernel, source| Error::Kernel { kernel: k.name().to_string(), source };
            match &self.fallback {
                Some(fb) if self.failed.load(Ordering::Relaxed) => {
                    fb.run(pool, w, x, n, out, bytes).map_err(|e| err(&**fb, e))
                }
                Some(fb) => self.kernel.run(pool, w, x, n, out, bytes).or_else(|e| {
                    // A failing pack disables itself; its operations move to
                    // the built-in kernels for the rest of the process.
                    tracing::error!(tensor = %self.name, kernel = self.kernel.name(), "{e}; falling back to {}", fb.name());
                    self.failed.store(true, Ordering::Relaxed);
                    fb.run(pool, w, x, n, out, bytes).map_err(|e| err(&**fb, e))
                }),
                None => self.kernel.run(pool, w, x, n, out, bytes).map_err(|e| err(&*self.kernel, e)),
            }
        };
        let rows = self.desc.rows;
        self.matmul(&run, rows, x, n, &mut out[..n * rows], scratch)?;
        if let Some(b) = &self.bias {
            for row in out[..n * rows].chunks_exact_mut(rows) {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            }
        }
        Ok(())
    }

    /// The gathered-row product: `out[t, k] = W[idx[k], :] · x[t, :] (+ b)`,
    /// only the rows `idx` (the sparse gate and up projections). The
    /// built-in kernel of the same operation reads the rows in place
    /// (`MatmulKernel::run_rows`), so the numbers equal the dense product's
    /// rows; a kernel that cannot address single rows gets a compact copy.
    pub(crate) fn forward_rows(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        idx: &[u32],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let k = idx.len();
        if k == 0 {
            return Ok(());
        }
        let pack_failed = self.rows_failed.load(Ordering::Relaxed);
        let kernels = [(!pack_failed).then_some(self.rows_kernel.as_ref()).flatten(), self.rows_fallback.as_ref()];
        for kernel in kernels.into_iter().flatten() {
            let w = self.w.bytes();
            let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>| {
                kernel
                    .run_rows(pool, w, idx, x, n, out, bytes)
                    .map_err(|source| Error::Kernel { kernel: kernel.name().into(), source })
            };
            match self.matmul(&run, k, x, n, &mut out[..n * k], scratch) {
                Ok(()) => {
                    self.add_row_bias(idx, n, out);
                    return Ok(());
                }
                Err(Error::Kernel { source: KernelError::NotOffered { .. }, .. }) => break,
                // A pack's kernel failed: the built-in one from now on
                // (the pack kernel logged why).
                Err(Error::Kernel { source: KernelError::Pack { .. }, .. }) if self.rows_fallback.is_some() => {
                    self.rows_failed.store(true, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let row_bytes = self.w.bytes().len() / self.desc.rows;
        let mut rows = std::mem::take(&mut scratch.gathered);
        spinfer_sparse_kernels::gather_rows(pool, self.w.bytes(), row_bytes, idx, &mut rows)?;
        let r = self.forward_gathered(pool, x, n, &rows, idx, out, scratch);
        scratch.gathered = rows;
        r
    }

    /// [`Linear::forward_rows`] on rows already gathered: `rows` holds
    /// `W[idx[k], :]` for each `k`, in this matrix's format (e.g. from the
    /// FFN bundle under a memory budget; this matrix's own bytes are not
    /// read).
    #[allow(clippy::too_many_arguments, reason = "a matmul call: pool, input, rows and their indices, output, scratch")]
    pub(crate) fn forward_gathered(
        &self,
        pool: &ThreadPool,
        x: &[f32],
        n: usize,
        rows: &[u8],
        idx: &[u32],
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let k = idx.len();
        if k == 0 {
            return Ok(());
        }
        let desc = MatmulDesc { rows: k, ..self.desc };
        let kernel = spinfer_kernel_select::registry::builtin_kernel(&desc)?;
        let rows = &rows[..desc.wtype.row_bytes(desc.cols)? * k];
        let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>| {
            kernel
                .run(pool, rows, x, n, out, bytes)
                .map_err(|source| Error::Kernel { kernel: kernel.name().into(), source })
        };
        self.matmul(&run, k, x, n, &mut out[..n * k], scratch)?;
        self.add_row_bias(idx, n, out);
        Ok(())
    }

    /// Adds the bias of rows `idx` to `out` (`n × idx.len()`).
    fn add_row_bias(&self, idx: &[u32], n: usize, out: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in out[..n * idx.len()].chunks_exact_mut(idx.len()) {
                for (o, &j) in row.iter_mut().zip(idx) {
                    *o += b[j as usize];
                }
            }
        }
    }

    /// Runs `run` on `x` (n tokens) into `out` (n × rows), as two 8-bit
    /// planes in fast mode.
    fn matmul(
        &self,
        run: &RunFn,
        rows: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let cols = self.desc.cols;
        let x = &x[..n * cols];
        if !self.two_planes {
            return run(x, n, out, &mut scratch.bytes);
        }
        // Rows [hi; lo] as one batch of 2n tokens: the weights are streamed
        // once, and W·x = W·hi + W·lo.
        grow(&mut scratch.planes, 2 * n * cols);
        grow(&mut scratch.planes_out, 2 * n * rows);
        let (hi, lo) = scratch.planes[..2 * n * cols].split_at_mut(n * cols);
        split_hi_lo(self.desc.act, x, hi, lo)?;
        run(&scratch.planes[..2 * n * cols], 2 * n, &mut scratch.planes_out[..2 * n * rows], &mut scratch.bytes)?;
        let (a, b) = scratch.planes_out[..2 * n * rows].split_at(n * rows);
        for ((o, &u), &v) in out.iter_mut().zip(a).zip(b) {
            *o = u + v;
        }
        Ok(())
    }

    pub fn kernel_name(&self) -> &str {
        self.kernel.name()
    }

    /// The weight bytes, in the file's format.
    pub(crate) fn raw_weights(&self) -> &[u8] {
        self.w.bytes()
    }

    /// Whether the chosen (pack) kernel failed and the built-in fallback
    /// now serves this matrix.
    pub fn fell_back(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Bytes of weights read per token.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes().len()
    }
}

/// Grows `v` to at least `n` elements (buffers are never shrunk).
pub(crate) fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}
