//! [`CudaBackend`]: uploads, the quantised products and timing. The other
//! transformer steps are in `ops.rs`.

use std::sync::Mutex;

use crate::buffers::{DeviceActs, DeviceBuf, DeviceMatrix, DeviceRows, Elem, HostBuf, Slice, SliceMut};
use crate::format::{axpy_kernel, batch_for, gemm_kernel, gemv_fused_kernel, gemv_kernel};
use crate::{AXPY_BATCHES, ActType, CudaError, DeviceInfo, GEMV_BATCHES, Result, WeightFormat, imp, probe};

/// A kernel argument, as the kernel's parameter list declares it.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read only by the cuda backend"))]
pub(crate) enum KArg {
    I32(i32),
    I64(i64),
    F32(f32),
    /// A device address (0 for a null pointer).
    Ptr(u64),
}

/// Which compiled module a kernel lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Module {
    /// One weight format's products (`gemv.cu` + `FORMAT(...)`).
    Format(WeightFormat),
    /// The format-independent steps (`ops.cu`).
    Ops,
}

impl Module {
    /// The module's name in reports and cache files.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Module::Format(f) => f.name(),
            Module::Ops => "ops",
        }
    }

    /// Its CUDA source.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "compiled only by the cuda backend"))]
    pub(crate) fn source(self) -> String {
        match self {
            Module::Format(f) => crate::format::kernel_source(f),
            Module::Ops => crate::format::ops_source(),
        }
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read only by the cuda backend"))]
pub(crate) struct Grid {
    pub blocks: (u32, u32),
    pub threads: u32,
    pub smem: u32,
}

pub(crate) fn shape_err(op: &'static str, detail: String) -> CudaError {
    CudaError::Shape { op, detail }
}

/// A count as a kernel's `int`, or an error naming it.
pub(crate) fn int(v: usize, what: &'static str) -> Result<i32> {
    i32::try_from(v).map_err(|_| shape_err("launch", format!("{what} {v} exceeds i32")))
}

/// Warps per GEMV block and outputs per warp (`GEMV_WARPS`, `GEMV_R` in gemv.cu).
const GEMV_WARPS: u32 = 8;
const GEMV_ROWS_PER_BLOCK: usize = GEMV_WARPS as usize * 2;
/// Outputs and tokens per GEMM tile (`GEMM_T` in gemv.cu).
const GEMM_TILE: usize = 64;

/// The extra arguments of a fused GEMV (`gemv_fused_*` in gemv.cu):
/// `PRO_*` mode and device addresses (0 for none).
pub(crate) struct FusedArgs {
    pub mode: i32,
    pub aux: u64,
    pub nw: u64,
    pub eps: f32,
    pub x_out: u64,
    pub pw: u64,
}

/// Launches captured once and replayed with one call (a decode step):
/// see [`CudaBackend::begin_capture`].
pub struct DeviceGraph {
    inner: imp::Graph,
}

/// One CUDA device: its context, stream and the kernels compiled so far.
/// All work goes to one stream, so it runs in the order it is issued.
pub struct CudaBackend {
    pub(crate) inner: imp::Backend,
    info: DeviceInfo,
    /// Partial sums of the gathered-row AXPY (grown on demand).
    scratch: Mutex<Option<DeviceBuf<f32>>>,
}

impl CudaBackend {
    /// Opens device 0.
    ///
    /// # Errors
    ///
    /// [`CudaError::Unavailable`] naming why when there is no usable device.
    pub fn new() -> Result<Self> {
        let info = probe()?;
        let inner = imp::Backend::new(&info, None)?;
        Ok(Self { inner, info, scratch: Mutex::default() })
    }

    /// Opens device 0 with the product kernels (GEMV, GEMM, AXPY, rows) of
    /// a CUDA pack: `products` has the shape of
    /// [`crate::products_source`] (ABI [`crate::PACK_ABI_VERSION`]) and is
    /// compiled per format on first use, in place of the built-in source.
    ///
    /// # Errors
    ///
    /// As [`CudaBackend::new`]; a source that does not compile fails at its
    /// first launch with [`CudaError::Compile`] and the compiler's log.
    pub fn with_products(products: &str) -> Result<Self> {
        let info = probe()?;
        let inner = imp::Backend::new(&info, Some(std::sync::Arc::from(products)))?;
        Ok(Self { inner, info, scratch: Mutex::default() })
    }

    /// The device.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// Copies `data` to the device.
    ///
    /// # Errors
    ///
    /// Driver errors (out of memory).
    pub fn upload<T: Elem>(&self, data: &[T]) -> Result<DeviceBuf<T>> {
        Ok(DeviceBuf { inner: self.inner.upload(data)?, len: data.len() })
    }

    /// A zeroed buffer of `len` elements.
    ///
    /// # Errors
    ///
    /// Driver errors (out of memory).
    pub fn alloc<T: Elem>(&self, len: usize) -> Result<DeviceBuf<T>> {
        Ok(DeviceBuf { inner: self.inner.alloc(len)?, len })
    }

    /// Copies a buffer back to the host.
    ///
    /// # Errors
    ///
    /// Driver errors, including a kernel fault reported at this sync point.
    pub fn download<T: Elem>(&self, buf: &DeviceBuf<T>) -> Result<Vec<T>> {
        self.inner.download(&buf.inner, buf.len)
    }

    /// Copies a slice back to the host.
    ///
    /// # Errors
    ///
    /// As [`CudaBackend::download`].
    pub fn download_slice<T: Elem>(&self, s: Slice<'_, T>) -> Result<Vec<T>> {
        let mut out = Vec::new();
        self.download_slice_into(s, &mut out)?;
        Ok(out)
    }

    /// Copies a slice back into `out` (resized to its length), reusing
    /// `out`'s allocation: a per-token download allocates nothing.
    ///
    /// # Errors
    ///
    /// As [`CudaBackend::download`].
    pub fn download_slice_into<T: Elem>(&self, s: Slice<'_, T>, out: &mut Vec<T>) -> Result<()> {
        out.resize(s.len, T::default());
        self.inner.download_range(&s.buf.inner, s.offset, out)
    }

    /// Kernels launched so far from the host (a graph's replay launches
    /// none): what a profiler's `--launch-skip` counts.
    pub fn launches(&self) -> u64 {
        self.inner.launches()
    }

    /// Copies a slice back into `out`, which must have its length.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] on another length; driver errors, including a
    /// kernel fault reported at this sync point.
    pub fn download_to<T: Elem>(&self, s: Slice<'_, T>, out: &mut [T]) -> Result<()> {
        if s.len != out.len() {
            return Err(shape_err("download_to", format!("{} elements into {}", s.len, out.len())));
        }
        self.inner.download_range(&s.buf.inner, s.offset, out)
    }

    /// Page-locked host memory for `len` elements.
    ///
    /// # Errors
    ///
    /// Driver errors (out of host memory).
    pub fn alloc_host<T: Elem>(&self, len: usize) -> Result<HostBuf<T>> {
        Ok(HostBuf { inner: self.inner.alloc_pinned(len)?, len })
    }

    /// Copies a slice into `dst` and returns it there once it has arrived.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] when `dst` is shorter than the slice; driver
    /// errors, including a kernel fault reported at this sync point.
    pub fn download_to_host<'h, T: Elem>(&self, s: Slice<'_, T>, dst: &'h mut HostBuf<T>) -> Result<&'h [T]> {
        if s.len > dst.len {
            return Err(shape_err("download_to_host", format!("{} elements into {}", s.len, dst.len)));
        }
        self.inner.download_pinned(&s.buf.inner, s.offset, s.len, &mut dst.inner)
    }

    /// Copies `src` into `dst` on the device.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] when the lengths differ; driver errors.
    pub fn copy<T: Elem>(&self, src: &DeviceBuf<T>, dst: &mut DeviceBuf<T>) -> Result<()> {
        if src.len != dst.len {
            return Err(shape_err("copy", format!("{} elements into {}", src.len, dst.len)));
        }
        self.inner.copy(&src.inner, &mut dst.inner)
    }

    /// Copies host values into a slice of a device buffer.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] when the lengths differ; driver errors.
    pub fn write<T: Elem>(&self, dst: SliceMut<'_, T>, src: &[T]) -> Result<()> {
        if dst.len != src.len() {
            return Err(shape_err("write", format!("{} values into {}", src.len(), dst.len)));
        }
        self.inner.write(&mut dst.buf.inner, dst.offset, src)
    }

    /// Waits for the device and reports any fault of the work queued so far.
    ///
    /// # Errors
    ///
    /// The driver's error.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }

    /// Starts recording the launches issued from now on (on this thread)
    /// instead of running them, until [`CudaBackend::end_capture`]. Nothing
    /// that waits for the device (downloads, writes, synchronisation) may
    /// be issued in between.
    ///
    /// # Errors
    ///
    /// The driver's error.
    pub fn begin_capture(&self) -> Result<()> {
        self.inner.begin_capture()
    }

    /// Ends a capture and instantiates what was recorded.
    ///
    /// # Errors
    ///
    /// The driver's error (for instance, an operation that may not be
    /// captured was issued during the capture).
    pub fn end_capture(&self) -> Result<DeviceGraph> {
        Ok(DeviceGraph { inner: self.inner.end_capture()? })
    }

    /// Runs a captured graph (asynchronously, in stream order).
    ///
    /// # Errors
    ///
    /// The driver's error.
    pub fn launch_graph(&self, g: &DeviceGraph) -> Result<()> {
        self.inner.launch_graph(&g.inner)
    }

    /// Milliseconds per call of `f`, timed with device events over `iters`
    /// calls after `warmup` untimed ones.
    ///
    /// # Errors
    ///
    /// `f`'s first error, or the driver's.
    pub fn time_ms(&self, warmup: usize, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
        for _ in 0..warmup {
            f()?;
        }
        let total = self.inner.time_ms(&mut || {
            for _ in 0..iters {
                f()?;
            }
            Ok(())
        })?;
        Ok(total / iters.max(1) as f64)
    }

    /// Uploads a weight matrix of `rows` rows of `cols` weights in `format`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] when `bytes` is not exactly that matrix.
    pub fn upload_matrix(&self, format: WeightFormat, rows: usize, cols: usize, bytes: &[u8]) -> Result<DeviceMatrix> {
        let row_bytes = format.row_bytes(cols)?;
        let want =
            rows.checked_mul(row_bytes).ok_or_else(|| shape_err("upload_matrix", format!("{rows} rows overflow")))?;
        if rows == 0 || bytes.len() != want || i32::try_from(rows).is_err() || i32::try_from(cols).is_err() {
            return Err(shape_err(
                "upload_matrix",
                format!(
                    "a {format} matrix of {rows} x {cols} is {want} bytes (and at most 2^31 rows), got {}",
                    bytes.len()
                ),
            ));
        }
        Ok(DeviceMatrix { buf: self.upload(bytes)?, format, rows, cols, row_bytes })
    }

    /// Uploads `tokens` activation vectors of `len` values, rounded to `act`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] when `values` is not `tokens * len` long.
    pub fn upload_acts(&self, act: ActType, tokens: usize, len: usize, values: &[f32]) -> Result<DeviceActs> {
        if tokens == 0 || tokens.checked_mul(len) != Some(values.len()) || i32::try_from(len).is_err() {
            return Err(shape_err("upload_acts", format!("{tokens} x {len} activations, got {} values", values.len())));
        }
        let bytes: Vec<u8> = match act {
            ActType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ActType::F16 => values.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
            ActType::BF16 => values.iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect(),
        };
        Ok(DeviceActs { buf: self.upload(&bytes)?, act, tokens, len })
    }

    /// Uploads row indices, each checked to be below `bound`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] naming the first index out of range.
    pub fn upload_rows(&self, rows: &[u32], bound: usize) -> Result<DeviceRows> {
        let mut buf = self.alloc::<i32>(rows.len())?;
        self.write_rows_into(&mut buf, rows, bound)?;
        Ok(DeviceRows { buf, bound, len: rows.len() })
    }

    /// Replaces the indices of `dst` with `rows` (at most its capacity),
    /// each checked below its bound: per-token indices without an
    /// allocation.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] naming the first index out of range, or more
    /// indices than `dst` holds.
    pub fn write_rows(&self, dst: &mut DeviceRows, rows: &[u32]) -> Result<()> {
        if rows.len() > dst.capacity() {
            return Err(shape_err("write_rows", format!("{} indices into room for {}", rows.len(), dst.capacity())));
        }
        let bound = dst.bound;
        self.write_rows_into(&mut dst.buf, rows, bound)?;
        dst.len = rows.len();
        Ok(())
    }

    fn write_rows_into(&self, dst: &mut DeviceBuf<i32>, rows: &[u32], bound: usize) -> Result<()> {
        if let Some((i, r)) =
            rows.iter().enumerate().find(|(_, r)| **r as usize >= bound || i32::try_from(**r).is_err())
        {
            return Err(shape_err("upload_rows", format!("index {i} is row {r}, not below {bound}")));
        }
        // Every index is at most i32::MAX (checked), so its u32 bits are
        // the i32 value: written as they are, no copy.
        let idx: &[i32] = bytemuck::cast_slice(rows);
        if idx.is_empty() {
            return Ok(());
        }
        self.write(
            dst.at_mut(0, idx.len()).ok_or_else(|| shape_err("write_rows", format!("{} indices", idx.len())))?,
            idx,
        )
    }

    /// The device address of element `offset` of `buf`.
    pub(crate) fn ptr<T: Elem>(&self, buf: &DeviceBuf<T>, offset: usize) -> u64 {
        self.inner.ptr(&buf.inner) + (offset * size_of::<T>()) as u64
    }

    /// `y[t][i] = W[row(i)] · x[t]` for every token `t`: `row(i) = i` when
    /// `rows` is `None` (dense; `y` holds `tokens * rows`), else
    /// `rows[i]` (gathered; `y` holds `tokens * rows.len()`).
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] on mismatched lengths; driver and compile errors.
    pub fn gemv(
        &self,
        w: &DeviceMatrix,
        x: &DeviceActs,
        rows: Option<&DeviceRows>,
        y: &mut DeviceBuf<f32>,
    ) -> Result<()> {
        if x.len != w.cols {
            return Err(shape_err("gemv", format!("{} x {} weights, activations of {}", w.rows, w.cols, x.len)));
        }
        let x_ptr = self.ptr(&x.buf, 0);
        let y = y.all_mut();
        self.gemv_ptrs(w, x.act, x_ptr, x.tokens, rows, y)
    }

    /// [`CudaBackend::gemv`] on f32 activations already on the device:
    /// `x` holds `tokens` rows of `cols`, `y` `tokens` rows of outputs.
    ///
    /// # Errors
    ///
    /// As [`CudaBackend::gemv`].
    pub fn gemv_f32(
        &self,
        w: &DeviceMatrix,
        x: Slice<'_, f32>,
        tokens: usize,
        rows: Option<&DeviceRows>,
        y: SliceMut<'_, f32>,
    ) -> Result<()> {
        if tokens == 0 || x.len != tokens * w.cols {
            return Err(shape_err("gemv", format!("{tokens} tokens of {} activations in {} values", w.cols, x.len)));
        }
        let x_ptr = self.ptr(x.buf, x.offset);
        self.gemv_ptrs(w, ActType::F32, x_ptr, tokens, rows, y)
    }

    fn gemv_ptrs(
        &self,
        w: &DeviceMatrix,
        act: ActType,
        x_ptr: u64,
        tokens: usize,
        rows: Option<&DeviceRows>,
        y: SliceMut<'_, f32>,
    ) -> Result<()> {
        let n_out = match rows {
            None => w.rows,
            Some(r) if r.bound <= w.rows => r.len(),
            Some(r) => {
                return Err(shape_err(
                    "gemv",
                    format!("row indices up to {} for a matrix of {} rows", r.bound, w.rows),
                ));
            }
        };
        if y.len < tokens * n_out {
            return Err(shape_err("gemv", format!("{tokens} tokens x {n_out} outputs into {} values", y.len)));
        }
        if n_out == 0 {
            return Ok(());
        }
        let rows_ptr = rows.map_or(0, |r| self.ptr(&r.buf, 0));
        let (w_ptr, y_base) = (self.ptr(&w.buf, 0), self.ptr(y.buf, y.offset));
        if tokens > GEMV_BATCHES[GEMV_BATCHES.len() - 1] {
            let (row_bytes, cols, n) = (KArg::I64(w.row_bytes as i64), int(w.cols, "cols")?, int(n_out, "outputs")?);
            // Many tokens (prefill): one tiled launch reads each weight
            // once per 64 tokens.
            let grid = Grid {
                blocks: (
                    int(n_out.div_ceil(GEMM_TILE), "blocks")? as u32,
                    int(tokens.div_ceil(GEMM_TILE), "blocks")? as u32,
                ),
                threads: 256,
                smem: 0,
            };
            let args = [
                KArg::Ptr(w_ptr),
                row_bytes,
                KArg::I32(cols),
                KArg::Ptr(x_ptr),
                KArg::I32(cols),
                KArg::I32(int(tokens, "tokens")?),
                KArg::Ptr(rows_ptr),
                KArg::I32(n),
                KArg::Ptr(y_base),
                KArg::I32(n),
            ];
            // SAFETY: the arguments follow gemm_* in gemv.cu (w, row_bytes,
            // cols, x, x_stride, n_tok, rows, n_out, y, y_stride); shapes
            // checked above as for the GEMV; the kernel guards the tiles'
            // edges.
            return unsafe { self.inner.launch(Module::Format(w.format), &gemm_kernel(w.format, act), grid, &args) };
        }
        self.gemv_launches(w, act, x_ptr, w.cols, tokens, rows_ptr, n_out, y_base, None)
    }

    /// The GEMV launches for `tokens` tokens (in batches of
    /// [`GEMV_BATCHES`]), token `t`'s activations at `x_ptr + t * x_stride`
    /// elements and its outputs at `y_base + t * n_out`; `fused` selects
    /// the fused variants (f32 activations) with their extra arguments,
    /// whose `aux` and `x_out` rows have `x_stride` too. Shapes are the
    /// caller's to check.
    #[allow(clippy::too_many_arguments, reason = "one launch's raw arguments, checked by the two callers")]
    pub(crate) fn gemv_launches(
        &self,
        w: &DeviceMatrix,
        act: ActType,
        x_ptr: u64,
        x_stride: usize,
        tokens: usize,
        rows_ptr: u64,
        n_out: usize,
        y_base: u64,
        fused: Option<&FusedArgs>,
    ) -> Result<()> {
        let (row_bytes, cols, n) = (KArg::I64(w.row_bytes as i64), int(w.cols, "cols")?, int(n_out, "outputs")?);
        let (w_ptr, stride) = (self.ptr(&w.buf, 0), int(x_stride, "x stride")?);
        let grid = Grid {
            blocks: (int(n_out.div_ceil(GEMV_ROWS_PER_BLOCK), "blocks")? as u32, 1),
            threads: 32 * GEMV_WARPS,
            smem: 0,
        };
        let mut t = 0;
        while t < tokens {
            let b = batch_for(tokens - t, &GEMV_BATCHES);
            let x_off = (t * x_stride) as u64;
            let mut args = vec![
                KArg::Ptr(w_ptr),
                row_bytes,
                KArg::I32(cols),
                KArg::Ptr(x_ptr + x_off * act.size() as u64),
                KArg::I32(stride),
                KArg::Ptr(rows_ptr),
                KArg::I32(n),
                KArg::Ptr(y_base + (t * n_out * 4) as u64),
                KArg::I32(n),
            ];
            let name = match fused {
                None => gemv_kernel(w.format, act, b),
                Some(f) => {
                    args.extend([
                        KArg::I32(f.mode),
                        KArg::Ptr(f.aux + x_off * 4),
                        KArg::Ptr(f.nw),
                        KArg::F32(f.eps),
                        KArg::Ptr(if f.x_out == 0 { 0 } else { f.x_out + x_off * 4 }),
                        KArg::Ptr(f.pw),
                    ]);
                    gemv_fused_kernel(w.format, b)
                }
            };
            // SAFETY: the arguments follow gemv_* in gemv.cu (w, row_bytes,
            // cols, x, x_stride, rows, n_out, y, y_stride), and gemv_fused_*
            // (the same, then mode, aux, nw, eps, x_out, pw); the callers
            // check that every row index is below the matrix's rows, that x
            // (and aux, x_out) hold this batch's tokens of `cols` values at
            // `x_stride`, nw and pw `cols` values (or null), and y their
            // `n_out` outputs.
            unsafe { self.inner.launch(Module::Format(w.format), &name, grid, &args)? };
            t += b;
        }
        Ok(())
    }

    /// The sparse down projection on a neuron-major copy `wt` (one row per
    /// FFN neuron): `y[t] = Σ_k a[t][k] · wt[rows[k]]` for `tokens` tokens,
    /// where `a` holds `tokens × rows.len()` values (the kept neurons'
    /// activations, in `rows` order) and `y` `tokens × cols`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] on mismatched lengths; driver and compile errors.
    pub fn axpy_rows(
        &self,
        wt: &DeviceMatrix,
        a: &DeviceBuf<f32>,
        tokens: usize,
        rows: &DeviceRows,
        y: &mut DeviceBuf<f32>,
    ) -> Result<()> {
        let k = rows.len();
        if rows.bound > wt.rows || tokens == 0 || a.len != tokens * k || y.len < tokens * wt.cols {
            return Err(shape_err(
                "axpy_rows",
                format!(
                    "{} x {} weights, indices below {}, {tokens} tokens of {k} activations in {} values, output of {}",
                    wt.rows, wt.cols, rows.bound, a.len, y.len
                ),
            ));
        }
        // A block of 8 warps per 32 items (AXPY_WARPS in gemv.cu); splits of
        // about 64 kept neurons (8 per warp), at most 128.
        let items = wt.cols / 32;
        let splits = k.div_ceil(64).clamp(1, 128);
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let part_len = splits * AXPY_BATCHES[AXPY_BATCHES.len() - 1] * wt.cols;
        let part = match scratch.as_ref() {
            Some(s) if s.len >= part_len => self.ptr(s, 0),
            _ => self.ptr(scratch.insert(self.alloc::<f32>(part_len)?), 0),
        };
        let (cols, n_rows) = (int(wt.cols, "cols")?, int(k, "rows")?);
        let mut t = 0;
        while t < tokens {
            let b = batch_for(tokens - t, &AXPY_BATCHES);
            let args = [
                KArg::Ptr(self.ptr(&wt.buf, 0)),
                KArg::I64(wt.row_bytes as i64),
                KArg::I32(cols),
                KArg::Ptr(self.ptr(a, t * k)),
                KArg::I32(n_rows),
                KArg::Ptr(self.ptr(&rows.buf, 0)),
                KArg::I32(n_rows),
                KArg::Ptr(part),
            ];
            let grid = Grid { blocks: (items.div_ceil(32) as u32, splits as u32), threads: 256, smem: 0 };
            // SAFETY: arguments follow axpy_rows_* in gemv.cu (w,
            // row_bytes, cols, a, a_stride, rows, n_rows, part); `a` holds
            // this batch's activations, the indices are below the matrix's
            // rows, and `part` holds splits x batch x cols floats.
            unsafe { self.inner.launch(Module::Format(wt.format), &axpy_kernel(wt.format, b), grid, &args)? };
            let n = int(b * wt.cols, "outputs")?;
            let args = [KArg::Ptr(part), KArg::I32(splits as i32), KArg::I32(n), KArg::Ptr(self.ptr(y, t * wt.cols))];
            let grid = Grid { blocks: ((n as u32).div_ceil(256), 1), threads: 256, smem: 0 };
            // SAFETY: follows sum_splits(part, splits, n, y): `part` holds
            // splits x n values written by the launch above (same stream),
            // `y` at least n from this batch's offset (checked above).
            unsafe { self.inner.launch(Module::Format(wt.format), "sum_splits", grid, &args)? };
            t += b;
        }
        Ok(())
    }
}
