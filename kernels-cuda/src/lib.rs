//! CUDA kernels for spinfer: quantised GEMV and small-batch GEMM straight on
//! GGUF blocks, the sparse (gathered-row and gathered-column) products, and
//! the ternary formats.
//!
//! Feature `cuda` (off by default) builds the real backend on `cudarc` with
//! `dynamic-loading`: nothing is linked at build time, so the crate builds
//! without a CUDA toolkit; `libcuda` and `libnvrtc` are opened at run time.
//! The kernels are CUDA C (`src/cu/`), compiled by NVRTC for the device's
//! compute capability on first use of a format and cached on disk
//! ([`kernel_cache_dir`]). Without the feature a candle-style shim answers
//! [`CudaUnavailable::NotCompiled`].
//!
//! * [`probe`] describes device 0 or says why there is none; [`score`]
//!   turns that into a kernel-provider score (0 plus the reason when
//!   unavailable). Neither creates a context.
//! * [`CudaBackend`] owns the context: upload weights once
//!   ([`DeviceMatrix`]), then [`CudaBackend::gemv`] (dense or on gathered
//!   rows) and [`CudaBackend::axpy_rows`] (the sparse down projection on a
//!   neuron-major copy).
//! * [`compile_check`] compiles every format's kernels through NVRTC
//!   without a device: CI's guard against syntax and type errors.

mod error;
mod format;
mod synthetic;

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
mod cuda_disabled;

#[cfg(feature = "cuda")]
use cuda as imp;
#[cfg(not(feature = "cuda"))]
use cuda_disabled as imp;

pub use error::{CudaError, CudaUnavailable, Result};
pub use format::{AXPY_BATCHES, ActType, GEMV_BATCHES, WeightFormat, kernel_source};
pub use synthetic::{synthetic_acts, synthetic_matrix};

use format::{axpy_kernel, batch_for, gemv_kernel};

/// Score of a usable CUDA device (above every CPU provider; ggml likewise
/// prefers a GPU backend over any CPU variant).
pub const SCORE_CUDA: u32 = 1 << 10;

/// What [`probe`] found: CUDA device 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal (always 0 today).
    pub ordinal: usize,
    /// Devices the driver reports.
    pub device_count: usize,
    /// Device name, e.g. `"NVIDIA H100 80GB HBM3"`.
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Driver API version as reported by the driver (e.g. 12080).
    pub driver_version: i32,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "cuda:{} {} ({:.1} GiB, compute capability {major}.{minor}, driver api {}, {} device(s))",
            self.ordinal,
            self.name,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.driver_version,
            self.device_count
        )
    }
}

/// Describes CUDA device 0, or says why CUDA is unavailable. Never creates
/// a context and never panics.
///
/// # Errors
///
/// [`CudaUnavailable`] naming the reason.
pub fn probe() -> std::result::Result<DeviceInfo, CudaUnavailable> {
    imp::probe()
}

/// The provider score and a one-line explanation: `(0, reason)` when CUDA
/// is unavailable, `(SCORE_CUDA, device description)` otherwise.
pub fn score() -> (u32, String) {
    match probe() {
        Ok(dev) => (SCORE_CUDA, dev.to_string()),
        Err(why) => (0, why.to_string()),
    }
}

/// Where compiled kernels are cached: `$SPINFER_CUDA_CACHE`, else
/// `$XDG_CACHE_HOME/spinfer/cuda`, else `$HOME/.cache/spinfer/cuda`; `None`
/// when none is set (kernels are then compiled in every process).
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    let var = |k| std::env::var_os(k).filter(|v| !v.is_empty()).map(std::path::PathBuf::from);
    var("SPINFER_CUDA_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("spinfer/cuda")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/spinfer/cuda")))
}

/// Compiles every format's kernels through NVRTC for `arch` (e.g.
/// `"compute_90"`) without a device, returning the PTX size per format.
///
/// # Errors
///
/// [`CudaError::NoNvrtc`] without `libnvrtc`, [`CudaError::Compile`] with
/// the compiler's log, `NotCompiled` without feature `cuda`.
pub fn compile_check(arch: &str) -> Result<Vec<(WeightFormat, usize)>> {
    WeightFormat::ALL.into_iter().map(|f| Ok((f, imp::compile_ptx(f, arch)?.len()))).collect()
}

/// Element types of device buffers.
pub trait Elem: imp::ElemBound + Copy + Default + 'static {}
impl Elem for u8 {}
impl Elem for i32 {}
impl Elem for f32 {}

/// A buffer on the device.
pub struct DeviceBuf<T: Elem> {
    inner: imp::Buf<T>,
    len: usize,
}

impl<T: Elem> DeviceBuf<T> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A weight matrix uploaded once: `rows` rows of `cols` weights.
pub struct DeviceMatrix {
    buf: DeviceBuf<u8>,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

impl DeviceMatrix {
    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The block format.
    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.buf.len
    }
}

/// Activations on the device: `tokens` vectors of `len` elements.
pub struct DeviceActs {
    buf: DeviceBuf<u8>,
    act: ActType,
    tokens: usize,
    len: usize,
}

/// Row indices on the device, each checked below `bound` at upload (so a
/// kernel never reads outside a matrix of at least `bound` rows).
pub struct DeviceRows {
    buf: DeviceBuf<i32>,
    bound: usize,
}

impl DeviceRows {
    /// Number of indices.
    pub fn len(&self) -> usize {
        self.buf.len
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.buf.len == 0
    }
}

/// One GEMV launch, shapes checked (see [`CudaBackend::gemv`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read only by the cuda backend"))]
pub(crate) struct Gemv<'a> {
    kernel: String,
    format: WeightFormat,
    w: &'a imp::Buf<u8>,
    row_bytes: usize,
    cols: usize,
    x: &'a imp::Buf<u8>,
    x_byte_offset: usize,
    rows: Option<&'a imp::Buf<i32>>,
    n_out: usize,
    y_offset: usize,
}

/// One gathered-row AXPY launch, shapes checked (see [`CudaBackend::axpy_rows`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "read only by the cuda backend"))]
pub(crate) struct Axpy<'a> {
    kernel: String,
    format: WeightFormat,
    batch: usize,
    w: &'a imp::Buf<u8>,
    row_bytes: usize,
    cols: usize,
    a: &'a imp::Buf<f32>,
    a_offset: usize,
    a_stride: usize,
    rows: &'a imp::Buf<i32>,
    n_rows: usize,
    y_offset: usize,
}

fn shape_err(op: &'static str, detail: String) -> CudaError {
    CudaError::Shape { op, detail }
}

/// One CUDA device: its context, stream and the kernels compiled so far.
pub struct CudaBackend {
    inner: imp::Backend,
    info: DeviceInfo,
}

impl CudaBackend {
    /// Opens device 0.
    ///
    /// # Errors
    ///
    /// [`CudaError::Unavailable`] naming why when there is no usable device.
    pub fn new() -> Result<Self> {
        let info = probe()?;
        let inner = imp::Backend::new(&info)?;
        Ok(Self { inner, info })
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

    /// Copies `src` into `dst` on the device (the bandwidth ceiling the
    /// benchmarks compare against).
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

    /// Uploads a weight matrix of `rows` rows of `cols` weights in `format`.
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] when `bytes` is not exactly that matrix.
    pub fn upload_matrix(&self, format: WeightFormat, rows: usize, cols: usize, bytes: &[u8]) -> Result<DeviceMatrix> {
        let row_bytes = format.row_bytes(cols)?;
        let want = rows.checked_mul(row_bytes).ok_or_else(|| shape_err("upload_matrix", format!("{rows} rows overflow")))?;
        if rows == 0 || bytes.len() != want || i32::try_from(rows).is_err() || i32::try_from(cols).is_err() {
            return Err(shape_err(
                "upload_matrix",
                format!("a {format} matrix of {rows} x {cols} is {want} bytes (and at most 2^31 rows), got {}", bytes.len()),
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
        if let Some((i, r)) = rows.iter().enumerate().find(|(_, r)| **r as usize >= bound || i32::try_from(**r).is_err()) {
            return Err(shape_err("upload_rows", format!("index {i} is row {r}, not below {bound}")));
        }
        let idx: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        Ok(DeviceRows { buf: self.upload(&idx)?, bound })
    }

    /// `y[t][i] = W[row(i)] · x[t]` for every token `t`: `row(i) = i` when
    /// `rows` is `None` (dense; `y` holds `tokens * rows`), else
    /// `rows[i]` (gathered; `y` holds `tokens * rows.len()`).
    ///
    /// # Errors
    ///
    /// [`CudaError::Shape`] on mismatched lengths; driver and compile errors.
    pub fn gemv(&self, w: &DeviceMatrix, x: &DeviceActs, rows: Option<&DeviceRows>, y: &mut DeviceBuf<f32>) -> Result<()> {
        let n_out = match rows {
            None => w.rows,
            Some(r) if r.bound <= w.rows => r.len(),
            Some(r) => return Err(shape_err("gemv", format!("row indices up to {} for a matrix of {} rows", r.bound, w.rows))),
        };
        if x.len != w.cols || y.len < x.tokens * n_out {
            return Err(shape_err(
                "gemv",
                format!(
                    "{} x {} weights, {} activations of {}, {n_out} outputs per token into {} values",
                    w.rows, w.cols, x.tokens, x.len, y.len
                ),
            ));
        }
        if n_out == 0 {
            return Ok(());
        }
        let mut t = 0;
        while t < x.tokens {
            let b = batch_for(x.tokens - t, &GEMV_BATCHES);
            let launch = Gemv {
                kernel: gemv_kernel(w.format, x.act, b),
                format: w.format,
                w: &w.buf.inner,
                row_bytes: w.row_bytes,
                cols: w.cols,
                x: &x.buf.inner,
                x_byte_offset: t * x.len * x.act.size(),
                rows: rows.map(|r| &r.buf.inner),
                n_out,
                y_offset: t * n_out,
            };
            self.inner.gemv(&launch, &mut y.inner)?;
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
        let mut t = 0;
        while t < tokens {
            let b = batch_for(tokens - t, &AXPY_BATCHES);
            let launch = Axpy {
                kernel: axpy_kernel(wt.format, b),
                format: wt.format,
                batch: b,
                w: &wt.buf.inner,
                row_bytes: wt.row_bytes,
                cols: wt.cols,
                a: &a.inner,
                a_offset: t * k,
                a_stride: k,
                rows: &rows.buf.inner,
                n_rows: k,
                y_offset: t * wt.cols,
            };
            self.inner.axpy_rows(&launch, &mut y.inner)?;
            t += b;
        }
        Ok(())
    }

    /// Waits for the device and reports any fault of the work queued so far.
    ///
    /// # Errors
    ///
    /// The driver's error.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_reasons_read_well() {
        assert_eq!(
            CudaUnavailable::NotCompiled { feature: "cuda" }.to_string(),
            "cuda support is not compiled in (build with feature `cuda`)"
        );
        let d = DeviceInfo {
            ordinal: 0,
            device_count: 1,
            name: "NVIDIA H100".into(),
            total_memory: 80 << 30,
            compute_capability: (9, 0),
            driver_version: 12080,
        };
        assert_eq!(
            d.to_string(),
            "cuda:0 NVIDIA H100 (80.0 GiB, compute capability 9.0, driver api 12080, 1 device(s))"
        );
    }
}
