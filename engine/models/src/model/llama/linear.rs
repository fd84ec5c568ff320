//! A weight matrix bound to the kernel that multiplies by it (dense,
//! gathered rows, or rows already gathered), with the pack kernel's
//! fallback and the two-plane activations of [`Precision::Fast`].

use std::ops::Range;
use std::sync::Arc;

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, Form, MatmulCall, MatmulDesc, MatmulKernel, Select};
use spinfer_kernels::matmul::{fast_act, prompt_gemm_pays};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::split::split_hi_lo;

use crate::model::precision::Precision;
use crate::model::{check_dims, load_vector};
use crate::stream::Streamer;
use crate::{Error, Result};
use spinfer_formats::loader::Loader;
use spinfer_formats::tensor::TensorData;
use spinfer_kernel_select::BoundKernel;
use spinfer_kernel_select::registry::{BUILTIN, Choice, KernelRegistry};

/// A weight matrix bound to the kernel that multiplies by it.
pub struct Linear {
    /// Canonical tensor name, for errors and reports.
    pub name: String,
    pub(crate) w: TensorData,
    pub desc: MatmulDesc,
    /// The dense product's kernel (with the built-in fallback of a pack's).
    dense: BoundKernel,
    /// The gathered-row products' kernel (the sparse gate and up
    /// projections and the sparse head read their rows in place): the row
    /// form of the dense kernel when its pack offers one, else the best
    /// built-in one; `None` where no kernel serves the form (ternary
    /// weights), and such products run on a compact copy of the rows.
    rows: Option<BoundKernel>,
    /// The built-in kernel of the dense form, which serves any number of
    /// rows: the products over rows gathered beforehand (the FFN bundle
    /// under a memory budget, the compact copy above).
    compact: Arc<dyn MatmulKernel>,
    bias: Option<Vec<f32>>,
    /// Feed activations as two 8-bit planes (see [`Precision::Fast`]; not
    /// for its one 16-bit plane, [`ActType::Q16`]).
    two_planes: bool,
    /// In fast mode, the built-in f32-activation kernel that runs a
    /// prompt's dense products instead of the two planes where that pays
    /// ([`prompt_gemm_pays`]: an f32 GEMM over weights dequantised once).
    prompt: Option<Arc<dyn MatmulKernel>>,
    /// Under a memory budget, a matrix read from storage per step: its row
    /// chunks, each resident or an item of the session streamer's cycle.
    pub(crate) streamed: Option<Vec<(Range<usize>, Chunk)>>,
}

/// One matmul call on `(x, n tokens, out, kernel scratch, prefill)`, the
/// weights and row selection already bound.
type RunFn<'a> = dyn Fn(&[f32], usize, &mut [f32], &mut Vec<u8>, bool) -> Result<()> + 'a;

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
    /// A streamed chunk's output for several tokens (n, chunk rows).
    pub(crate) chunk_out: Vec<f32>,
    /// The session's weight streamer, under a memory budget (shared so a
    /// product can hold it while it lends the rest of the scratch out).
    pub(crate) stream: Option<Arc<Streamer>>,
    /// During a forward step, its rows as runs of `(rows, prompt)`: whether
    /// they are a prompt's tokens, which the kernels may run on their
    /// prompt path ([`MatmulCall::prefill`]). Products over another number
    /// of rows, and all products outside a step, take the decode path.
    pub(crate) roles: Vec<(usize, bool)>,
}

impl Scratch {
    /// Sets the step's row roles: `lens[i]` rows, a prompt's if `prompt[i]`.
    pub(crate) fn set_roles(&mut self, lens: &[usize], prompt: &[bool]) {
        self.roles.clear();
        for (&len, &p) in lens.iter().zip(prompt) {
            match self.roles.last_mut() {
                Some((n, q)) if *q == p => *n += len,
                _ => self.roles.push((len, p)),
            }
        }
    }
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
    /// the kernels `registry` picks for its dense and gathered-row forms.
    pub(crate) fn from_tensor(
        registry: &KernelRegistry,
        precision: Precision,
        name: &str,
        ty: spinfer_kernels::GgmlType,
        data: TensorData,
        rows: usize,
        cols: usize,
    ) -> Result<Self> {
        let features = CpuFeatures::detect();
        let act = match precision {
            Precision::Fast | Precision::Int8 => ActType::fast_for(ty),
            Precision::Precise => ActType::F32,
        };
        let mut desc = MatmulDesc::dense(ty, act, rows, cols);
        let mut dense = registry.resolve(&desc)?;
        // Fast mode's one 16-bit plane where it pays (`fast_act`), unless
        // the operator pinned a kernel of the 8-bit planes or the registry
        // chose a pack's: that choice stands.
        let sixteen = precision == Precision::Fast && fast_act(&features, ty) == ActType::Q16;
        if sixteen && dense.provider == BUILTIN && dense.choice != Choice::Pinned {
            desc.act = ActType::Q16;
            dense = registry.resolve(&desc)?;
        }
        let act = desc.act;
        let gathered = desc.with_form(Form::GatheredRows);
        let rows_kernel = registry.resolve_gathered(&gathered, &dense.provider, dense.kernel.name()).ok();
        let fast = precision == Precision::Fast && act != ActType::F32;
        let two_planes = fast && act != ActType::Q16;
        let prompt = (fast && prompt_gemm_pays(&features, ty))
            .then(|| registry.builtin_kernel_for(&MatmulDesc { act: ActType::F32, ..desc }))
            .transpose()?;
        Ok(Self {
            name: name.to_string(),
            w: data,
            desc,
            compact: registry.builtin_kernel_for(&desc)?,
            dense: dense.into(),
            rows: rows_kernel.map(BoundKernel::from),
            bias: None,
            two_planes,
            prompt,
            streamed: None,
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
        let rows = self.desc.rows;
        match &self.streamed {
            Some(chunks) => self.forward_streamed(pool, chunks, x, n, &mut out[..n * rows], scratch)?,
            None => {
                let w = self.w.bytes();
                let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>, prefill: bool| {
                    self.dense
                        .run(pool, &self.name, MatmulCall::dense(w, x, n, out, bytes).prefill(prefill))
                        .map_err(|source| Error::Kernel { kernel: self.dense.active().name().into(), source })
                };
                self.matmul(&run, rows, x, n, &mut out[..n * rows], scratch, Some((pool, w)))?;
            }
        }
        if let Some(b) = &self.bias {
            for row in out[..n * rows].chunks_exact_mut(rows) {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            }
        }
        Ok(())
    }

    /// [`Linear::forward`] of a matrix streamed under a memory budget: each
    /// chunk of rows comes from the session's streamer (read ahead of
    /// need) and is multiplied as a matrix of its own. The built-in dense
    /// kernel serves any number of rows, so each row's value is the one the
    /// whole-matrix product gives (chunks start at multiples of 64 rows,
    /// the same tiles); a pack kernel may need the whole matrix, so the
    /// chunks of a pack's matrix run on the built-in kernel.
    fn forward_streamed(
        &self,
        pool: &ThreadPool,
        chunks: &[(Range<usize>, Chunk)],
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        // Needed only for the chunks that are read (a matrix may have
        // become wholly resident since the plan was made).
        let stream = scratch.stream.clone();
        let kernel = if self.dense.provider() == BUILTIN { self.dense.active() } else { &*self.compact };
        let rows = self.desc.rows;
        let mut part = std::mem::take(&mut scratch.chunk_out);
        let mut each = |range: &Range<usize>, chunk: &Chunk| -> Result<()> {
            let mut held = None;
            let w: &[u8] = match chunk {
                Chunk::Resident(b) => b,
                Chunk::Streamed { item, offset } => {
                    let Some(stream) = &stream else {
                        return Err(Error::InvalidArgument(format!(
                            "{}: the matrix is streamed under the memory budget, but this call has no session \
                             streamer",
                            self.name
                        )));
                    };
                    held.insert(stream.acquire(*item, *offset)?).bytes()
                }
            };
            let run = |x: &[f32], n: usize, out: &mut [f32], scratch: &mut Vec<u8>, prefill: bool| {
                kernel
                    .run(pool, MatmulCall::dense(w, x, n, out, scratch).prefill(prefill))
                    .map_err(|source| Error::Kernel { kernel: kernel.name().into(), source })
            };
            let k = range.len();
            if n == 1 {
                self.matmul(&run, k, x, 1, &mut out[range.clone()], scratch, None)?;
            } else {
                grow(&mut part, n * k);
                self.matmul(&run, k, x, n, &mut part[..n * k], scratch, Some((pool, w)))?;
                for (t, p) in part[..n * k].chunks_exact(k).enumerate() {
                    out[t * rows + range.start..t * rows + range.end].copy_from_slice(p);
                }
            }
            if let (Some(h), Some(stream)) = (held, &stream) {
                stream.release(h);
            }
            Ok(())
        };
        let r = chunks.iter().try_for_each(|(range, chunk)| each(range, chunk));
        scratch.chunk_out = part;
        r
    }

    /// The gathered-row product: `out[t, k] = W[idx[k], :] · x[t, :] (+ b)`,
    /// only the rows `idx` (the sparse gate and up projections). The
    /// gathered-row kernel reads the rows in place, so the numbers equal
    /// the dense product's rows; where no kernel serves the form, a compact
    /// copy of the rows goes to [`Linear::forward_gathered`].
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
        if let Some(kernel) = &self.rows {
            let w = self.w.bytes();
            let run = |x: &[f32], n: usize, out: &mut [f32], scratch: &mut Vec<u8>, prefill: bool| {
                let call = MatmulCall { w, select: Select::Rows(idx), x, n_tokens: n, out, scratch, prefill };
                kernel
                    .run(pool, &self.name, call)
                    .map_err(|source| Error::Kernel { kernel: kernel.active().name().into(), source })
            };
            self.matmul(&run, k, x, n, &mut out[..n * k], scratch, None)?;
            self.add_row_bias(idx, n, out);
            return Ok(());
        }
        let row_bytes = self.w.bytes().len() / self.desc.rows;
        let mut rows = std::mem::take(&mut scratch.gathered);
        spinfer_sparse_kernels::gather_rows(pool, self.w.bytes(), row_bytes, idx, &mut rows)?;
        let r = self.forward_gathered(pool, GatheredRows { x, n, rows: &rows, idx }, out, scratch);
        scratch.gathered = rows;
        r
    }

    /// [`Linear::forward_rows`] on rows already gathered (e.g. from the
    /// FFN bundle under a memory budget; this matrix's own bytes are not
    /// read), with the built-in kernel resolved at load.
    pub(crate) fn forward_gathered(
        &self,
        pool: &ThreadPool,
        g: GatheredRows<'_>,
        out: &mut [f32],
        scratch: &mut Scratch,
    ) -> Result<()> {
        let GatheredRows { x, n, rows, idx } = g;
        let k = idx.len();
        if k == 0 {
            return Ok(());
        }
        let rows = &rows[..self.desc.wtype.row_bytes(self.desc.cols)? * k];
        let run = |x: &[f32], n: usize, out: &mut [f32], bytes: &mut Vec<u8>, prefill: bool| {
            self.compact
                .run(pool, MatmulCall::dense(rows, x, n, out, bytes).prefill(prefill))
                .map_err(|source| Error::Kernel { kernel: self.compact.name().into(), source })
        };
        self.matmul(&run, k, x, n, &mut out[..n * k], scratch, Some((pool, rows)))?;
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
    /// planes in fast mode; a step's prompt rows and decode rows as
    /// separate calls ([`Scratch::roles`]). `dense` names the weights of a
    /// dense product (all `rows` rows of `w`), whose prompt rows may take
    /// [`Linear::prompt`]'s kernel instead.
    #[allow(clippy::too_many_arguments, reason = "the product's operands")]
    fn matmul(
        &self,
        run: &RunFn,
        rows: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
        dense: Option<(&ThreadPool, &[u8])>,
    ) -> Result<()> {
        let roles = std::mem::take(&mut scratch.roles);
        let result = if roles.iter().map(|r| r.0).sum::<usize>() == n {
            let (cols, mut at) = (self.desc.cols, 0);
            roles.iter().try_for_each(|&(len, prefill)| {
                let (x, out) = (&x[at * cols..(at + len) * cols], &mut out[at * rows..(at + len) * rows]);
                at += len;
                let dense = dense.filter(|_| prefill);
                self.matmul_planes(run, rows, x, len, out, scratch, prefill, dense)
            })
        } else {
            self.matmul_planes(run, rows, x, n, out, scratch, false, None)
        };
        scratch.roles = roles;
        result
    }

    /// One call of [`Linear::matmul`] (all rows of one role; `prompt`: the
    /// dense weights of a prompt's rows).
    #[allow(clippy::too_many_arguments, reason = "the product's operands and its role")]
    fn matmul_planes(
        &self,
        run: &RunFn,
        rows: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut Scratch,
        prefill: bool,
        prompt: Option<(&ThreadPool, &[u8])>,
    ) -> Result<()> {
        let cols = self.desc.cols;
        let x = &x[..n * cols];
        if let (Some(kernel), Some((pool, w))) = (&self.prompt, prompt) {
            return kernel
                .run(pool, MatmulCall::dense(w, x, n, out, &mut scratch.bytes).prefill(true))
                .map_err(|source| Error::Kernel { kernel: kernel.name().into(), source });
        }
        if !self.two_planes {
            return run(x, n, out, &mut scratch.bytes, prefill);
        }
        // Rows [hi; lo] as one batch of 2n tokens: the weights are streamed
        // once, and W·x = W·hi + W·lo.
        grow(&mut scratch.planes, 2 * n * cols);
        grow(&mut scratch.planes_out, 2 * n * rows);
        let (hi, lo) = scratch.planes[..2 * n * cols].split_at_mut(n * cols);
        split_hi_lo(self.desc.act, x, hi, lo)?;
        let (planes, planes_out) = (&scratch.planes[..2 * n * cols], &mut scratch.planes_out[..2 * n * rows]);
        run(planes, 2 * n, planes_out, &mut scratch.bytes, prefill)?;
        let (a, b) = scratch.planes_out[..2 * n * rows].split_at(n * rows);
        for ((o, &u), &v) in out.iter_mut().zip(a).zip(b) {
            *o = u + v;
        }
        Ok(())
    }

    /// The gathered-column AXPY over this matrix (the sparse down
    /// projection) in the arithmetic `act`, from the pack that serves the
    /// dense product, if it has that form
    /// ([`KernelRegistry::resolve_gathered`]); `None` leaves it to the
    /// engine's own neuron-major repack.
    pub(crate) fn columns_kernel(
        &self,
        registry: &KernelRegistry,
        act: ActType,
    ) -> Option<(String, Arc<dyn MatmulKernel>)> {
        let desc = MatmulDesc { act, ..self.desc }.with_form(Form::GatheredColumns);
        let r = registry.resolve_gathered(&desc, self.provider(), self.kernel_name()).ok()?;
        Some((r.provider, r.kernel))
    }

    /// The dense product's kernel.
    pub fn kernel_name(&self) -> &str {
        self.dense.chosen().name()
    }

    /// Who provides the dense product's kernel.
    pub fn provider(&self) -> &str {
        self.dense.provider()
    }

    /// Why the dense product's kernel was chosen.
    pub fn choice(&self) -> Choice {
        self.dense.choice()
    }

    /// The dense product's other candidates and their recorded decode
    /// medians (ns).
    pub fn alternatives(&self) -> &[(String, Option<u64>)] {
        self.dense.alternatives()
    }

    /// Who provides the gathered-row kernel (`cpu-builtin` for the compact
    /// copy where none serves the form).
    pub fn rows_provider(&self) -> &str {
        self.rows.as_ref().map_or(BUILTIN, BoundKernel::provider)
    }

    /// The weight bytes, in the file's format.
    pub(crate) fn raw_weights(&self) -> &[u8] {
        self.w.bytes()
    }

    /// Whether the chosen (pack) kernel failed and the built-in fallback
    /// now serves this matrix.
    pub fn fell_back(&self) -> bool {
        self.dense.has_failed_over()
    }

    /// Bytes of weights read per token.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes().len()
    }
}

/// Where a chunk of a streamed matrix's rows comes from.
pub(crate) enum Chunk {
    /// Copied into memory at load.
    Resident(Arc<[u8]>),
    /// Read from storage every step: this item of the streamer's cycle, at
    /// this offset of the model file.
    Streamed { item: usize, offset: u64 },
}

/// Rows gathered beforehand for [`Linear::forward_gathered`]: `rows` holds
/// `W[idx[k], :]` for each `k`, in the matrix's format, and `x` the `n`
/// tokens' activations.
pub(crate) struct GatheredRows<'a> {
    pub x: &'a [f32],
    pub n: usize,
    pub rows: &'a [u8],
    pub idx: &'a [u32],
}

/// Grows `v` to at least `n` elements (buffers are never shrunk).
pub(crate) fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}
