//! CUDA kernel packs: third-party product kernels (CUDA C) compiled by
//! NVRTC for the device and run on it behind the kernel registry's
//! `KernelProvider`.
//!
//! # Model
//!
//! * The artefact is CUDA C source shaped as
//!   [`spinfer_kernels_cuda::products_source`] (the GEMV and GEMM
//!   templates and the block readers; ABI
//!   [`spinfer_kernels_cuda::PACK_ABI_VERSION`]): what is compiled is
//!   [`VerifiedPack::artefact_bytes`], the bytes the registry hashed, never
//!   the file again. It is bounded ([`MAX_SOURCE_BYTES`]) and must be UTF-8.
//! * Load order, as the other packs: kind → size → ABI (naming both
//!   versions) → the declared kernels (op `matmul`, a weight format the
//!   CUDA kernels read, activations `f32`) → score from the device. Without
//!   a usable device (or without feature `cuda`) the pack registers with
//!   score 0 and the reason, and offers nothing.
//! * The device is opened, and a format's kernels compiled, on first use:
//!   a process that never selects a CUDA kernel creates no CUDA context.
//! * Weights are uploaded once per matrix (keyed by host address, length,
//!   shape and format, plus a sampled fingerprint) and stay resident
//!   within `[cuda] budget_mb`; past it a matrix is uploaded for the call
//!   and freed. Activations go up and outputs come down on every call, so
//!   the measured time of a candidate (`spinfer tune`) includes the
//!   transfers: a CUDA kernel wins an operation only where it pays for them.
//! * Calls are serialised (one stream per pack). Every call's result is
//!   spot-checked against the scalar reference; a failure or a
//!   disagreement disables the pack, which then offers nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use spinfer_kernel_select::registry::KernelProvider;
use spinfer_kernels::kernel::{ActType, Form, MatmulCall, MatmulDesc, MatmulKernel, Select, not_offered};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::{GgmlType, KernelError};
use spinfer_kernels_cuda::{CudaBackend, CudaError, DeviceBuf, DeviceMatrix, PACK_ABI_VERSION, WeightFormat};
use spinfer_registry::{PackKind, VerifiedPack};

use crate::spot::{SpotCheck, fingerprint};
use crate::{Error, Result};

/// Largest CUDA source a pack may ship (4 MiB; the built-in one is ~40 kB).
pub const MAX_SOURCE_BYTES: usize = 4 << 20;

/// The CUDA format of a GGUF weight type, if the kernels read it.
pub fn cuda_format(t: GgmlType) -> Option<WeightFormat> {
    WeightFormat::from_name(t.name())
}

/// A loaded CUDA kernel pack; a [`KernelProvider`].
pub struct CudaPack {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    source: String,
    /// Kernels the manifest declares: (name, weight type, format).
    kernels: Vec<(String, GgmlType, WeightFormat)>,
    score: u32,
    why: String,
    budget_bytes: u64,
    state: Mutex<Option<State>>,
    disabled: AtomicBool,
    /// Bytes copied to and from the device so far (weights, activations,
    /// outputs).
    transferred: AtomicU64,
}

/// The device side, opened on first use.
struct State {
    be: CudaBackend,
    /// (host address, length, columns, format) -> the device copy: the
    /// same bytes read as another shape are another matrix.
    resident: HashMap<(usize, usize, usize, WeightFormat), Resident>,
    resident_bytes: u64,
    x: Option<DeviceBuf<f32>>,
    y: Option<DeviceBuf<f32>>,
}

struct Resident {
    m: DeviceMatrix,
    fingerprint: u64,
}

impl CudaPack {
    /// Opens `pack` (verified by the registry): its source checked and kept,
    /// its device scored; `budget_mb` caps the weights kept on the device.
    ///
    /// # Errors
    ///
    /// Not `kind = "cuda"`, a source over [`MAX_SOURCE_BYTES`] or not
    /// UTF-8, another ABI version (naming both), or a declared kernel the
    /// CUDA host cannot serve (naming it).
    pub fn load(pack: &VerifiedPack, budget_mb: f64) -> Result<Self> {
        let m = pack.manifest();
        let err = |detail: String| Error::Pack { pack: pack.id(), detail };
        if m.kind != PackKind::Cuda {
            return Err(err(format!("kind {:?} is not a cuda pack", m.kind)));
        }
        let bytes = pack.artefact_bytes();
        if bytes.len() > MAX_SOURCE_BYTES {
            return Err(err(format!("CUDA source of {} bytes (at most {MAX_SOURCE_BYTES})", bytes.len())));
        }
        let source = std::str::from_utf8(bytes).map_err(|e| err(format!("CUDA source is not UTF-8: {e}")))?;
        if m.abi_version != PACK_ABI_VERSION {
            return Err(err(format!(
                "built for CUDA pack ABI {}, this host runs ABI {PACK_ABI_VERSION}",
                m.abi_version
            )));
        }
        let mut kernels = Vec::new();
        for k in &m.kernels {
            let wtype = GgmlType::ALL
                .into_iter()
                .find(|t| cuda_format(*t).is_some() && t.name().eq_ignore_ascii_case(&k.weight));
            let format = wtype.and_then(cuda_format);
            match (k.op.as_str(), k.act.as_str(), wtype, format) {
                ("matmul", "f32", Some(w), Some(f)) => kernels.push((k.name.clone(), w, f)),
                _ => {
                    return Err(err(format!(
                        "kernel {} ({} {} x {}): a CUDA pack offers op \"matmul\" with f32 activations on {}",
                        k.name,
                        k.op,
                        k.weight,
                        k.act,
                        GgmlType::ALL
                            .into_iter()
                            .filter(|t| cuda_format(*t).is_some())
                            .map(GgmlType::name)
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
            }
        }
        if !(budget_mb.is_finite() && budget_mb >= 0.0) {
            return Err(Error::InvalidArgument(format!("[cuda] budget_mb must be >= 0, got {budget_mb}")));
        }
        let (score, why) = spinfer_kernels_cuda::score();
        if score == 0 {
            tracing::info!(pack = %pack.id(), %why, "cuda pack registered with score 0");
        }
        Ok(Self {
            inner: Arc::new(Inner {
                name: pack.id(),
                source: source.to_string(),
                kernels,
                score,
                why,
                budget_bytes: (budget_mb * 1e6) as u64,
                state: Mutex::new(None),
                disabled: AtomicBool::new(false),
                transferred: AtomicU64::new(0),
            }),
        })
    }

    /// Why the pack scores what it does: the device, or why there is none.
    pub fn reason(&self) -> &str {
        &self.inner.why
    }

    /// Bytes copied between host and device so far.
    pub fn transferred_bytes(&self) -> u64 {
        self.inner.transferred.load(Ordering::Relaxed)
    }

    /// Names of the kernels the pack offers (manifest names).
    pub fn kernel_names(&self) -> Vec<String> {
        self.inner.kernels.iter().map(|k| k.0.clone()).collect()
    }
}

impl KernelProvider for CudaPack {
    fn name(&self) -> &str {
        &self.inner.name
    }

    /// 1 on a usable device (packs are chosen by pin or benchmark, not by
    /// default, as the WASM packs), 0 without one or once disabled.
    fn score(&self) -> u32 {
        u32::from(self.inner.score > 0 && !self.inner.disabled.load(Ordering::Acquire))
    }

    fn detail(&self) -> String {
        if self.inner.disabled.load(Ordering::Acquire) {
            return format!("disabled after a failure; {}", self.inner.why);
        }
        self.inner.why.clone()
    }

    /// f32-activation kernels, dense and gathered rows (the sparse gate/up).
    fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
        if self.score() == 0 || desc.act != ActType::F32 || desc.form == Form::GatheredColumns {
            return Vec::new();
        }
        let Ok(row_bytes) = desc.wtype.row_bytes(desc.cols) else { return Vec::new() };
        self.inner
            .kernels
            .iter()
            .filter(|k| k.1 == desc.wtype)
            .map(|k| {
                Arc::new(CudaKernel {
                    inner: Arc::clone(&self.inner),
                    name: k.0.clone(),
                    format: k.2,
                    desc: *desc,
                    row_bytes,
                    spot: SpotCheck::new(*desc, row_bytes),
                }) as Arc<dyn MatmulKernel>
            })
            .collect()
    }
}

/// A pack kernel bound to one operation.
struct CudaKernel {
    inner: Arc<Inner>,
    name: String,
    format: WeightFormat,
    desc: MatmulDesc,
    row_bytes: usize,
    spot: SpotCheck,
}

impl MatmulKernel for CudaKernel {
    fn name(&self) -> &str {
        &self.name
    }

    /// Runs on the device from the calling thread (the pool is not used);
    /// see the module docs for the copies.
    fn run(&self, _pool: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
        let MatmulCall { w, select, x, n_tokens, out, .. } = call;
        let d = &self.desc;
        let rows = match select {
            Select::All => None,
            Select::Rows(idx) => Some(idx),
            Select::Columns(_) => return Err(not_offered(self, select.form())),
        };
        if w.is_empty() || !w.len().is_multiple_of(self.row_bytes) {
            let want = w.len().div_ceil(self.row_bytes).max(1) * self.row_bytes;
            return Err(KernelError::BufferSize { ty: d.wtype, n: d.cols, want, got: w.len() });
        }
        let w_rows = w.len() / self.row_bytes;
        let width = rows.map_or(w_rows, <[u32]>::len);
        if n_tokens == 0 || x.len() != n_tokens * d.cols || out.len() != n_tokens * width {
            return Err(KernelError::Shape {
                op: "cuda",
                detail: format!(
                    "{n_tokens} tokens of {w_rows}x{}: got {} activations and {} outputs for {width} rows",
                    d.cols,
                    x.len(),
                    out.len()
                ),
            });
        }
        let fail = |detail: String| {
            self.inner.disabled.store(true, Ordering::Release);
            tracing::error!(pack = %self.inner.name, kernel = %self.name, %detail, "cuda pack failed; disabling it");
            KernelError::Pack { pack: self.inner.name.clone(), kernel: self.name.clone(), detail }
        };
        if self.inner.disabled.load(Ordering::Acquire) {
            return Err(KernelError::Pack {
                pack: self.inner.name.clone(),
                kernel: self.name.clone(),
                detail: "the pack was disabled by an earlier failure".into(),
            });
        }
        self.inner.call(self.format, w, w_rows, d.cols, rows, x, n_tokens, out).map_err(|e| fail(e.to_string()))?;
        self.spot.check(w, rows, x, n_tokens, out).map_err(|e| fail(format!("wrong result: {e}")))
    }
}

impl Inner {
    /// `out = W[rows] · x` on the device, `W` resident or uploaded.
    #[allow(clippy::too_many_arguments, reason = "one product's operands, spelled out")]
    fn call(
        &self,
        format: WeightFormat,
        w: &[u8],
        w_rows: usize,
        cols: usize,
        rows: Option<&[u32]>,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> spinfer_kernels_cuda::Result<()> {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let st = match &mut *guard {
            Some(st) => st,
            none => none.insert(State {
                be: CudaBackend::with_products(&self.source)?,
                resident: HashMap::new(),
                resident_bytes: 0,
                x: None,
                y: None,
            }),
        };
        let mut moved = (x.len() + out.len()) as u64 * 4;
        // The weights: resident, or uploaded (kept when the budget allows).
        let key = (w.as_ptr() as usize, w.len(), cols, format);
        let fp = fingerprint(w);
        let fresh = st.resident.get(&key).is_none_or(|r| r.fingerprint != fp);
        let mut temp = None;
        if fresh {
            moved += w.len() as u64;
            let m = st.be.upload_matrix(format, w_rows, cols, w)?;
            if let Some(old) = st.resident.remove(&key) {
                st.resident_bytes -= old.m.bytes() as u64;
            }
            if st.resident_bytes + w.len() as u64 <= self.budget_bytes {
                st.resident_bytes += w.len() as u64;
                st.resident.insert(key, Resident { m, fingerprint: fp });
            } else {
                temp = Some(m);
            }
        }
        let State { be, resident, x: xb, y: yb, .. } = st;
        let m = match &temp {
            Some(m) => m,
            None => &resident[&key].m,
        };
        let width = out.len() / n_tokens;
        // The activation and output buffers, grown to fit this call.
        let grow = |b: &mut Option<DeviceBuf<f32>>, n: usize| -> spinfer_kernels_cuda::Result<()> {
            if b.as_ref().is_none_or(|b| b.len() < n) {
                *b = Some(be.alloc(n)?);
            }
            Ok(())
        };
        grow(xb, x.len())?;
        grow(yb, out.len())?;
        let short = |what: &str| CudaError::Shape { op: "cuda pack", detail: format!("{what} buffer too short") };
        let (Some(xb), Some(yb)) = (xb.as_mut(), yb.as_mut()) else { return Err(short("work")) };
        be.write(xb.at_mut(0, x.len()).ok_or_else(|| short("activation"))?, x)?;
        let idx = rows.map(|r| be.upload_rows(r, w_rows)).transpose()?;
        let xs = xb.at(0, x.len()).ok_or_else(|| short("activation"))?;
        be.gemv_f32(m, xs, n_tokens, idx.as_ref(), yb.at_mut(0, n_tokens * width).ok_or_else(|| short("output"))?)?;
        be.download_to(yb.at(0, out.len()).ok_or_else(|| short("output"))?, out)?;
        self.transferred.fetch_add(moved, Ordering::Relaxed);
        Ok(())
    }
}
