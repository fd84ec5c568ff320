//! Built with feature `cuda`: the probe and the backend on `cudarc`'s driver
//! API and NVRTC, both loaded at run time (`dynamic-loading`).

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::driver::{result, sys};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use sha2::{Digest, Sha256};

use crate::backend::{Grid, KArg, Module};
use crate::{CudaError, CudaUnavailable, DeviceInfo, Result, kernel_cache_dir};

/// What device buffers may hold.
pub trait ElemBound: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Unpin {}
impl ElemBound for u8 {}
impl ElemBound for i32 {}
impl ElemBound for f32 {}

pub(crate) type Buf<T> = CudaSlice<T>;
pub(crate) type Pinned<T> = cudarc::driver::PinnedHostSlice<T>;
pub(crate) type Graph = CudaGraph;

pub(crate) fn probe() -> std::result::Result<DeviceInfo, CudaUnavailable> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by
    // its usual names and drops the handle; opening libcuda runs the
    // driver's own initialisers, which is what any CUDA use does. It must
    // come first: every other cudarc driver call panics (through
    // `culib()`) when the library is missing.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    // A driver older than the API version cudarc was built for lacks some
    // symbols, and cudarc panics on a missing symbol: keep that a reason,
    // not a crash.
    catch_unwind(query).unwrap_or_else(|_| {
        Err(CudaUnavailable::Driver {
            call: "driver api",
            detail: "the driver lacks a symbol of cuda 12.8 (driver too old?)".to_string(),
        })
    })
}

fn unavailable(call: &'static str) -> impl Fn(result::DriverError) -> CudaUnavailable {
    move |e| CudaUnavailable::Driver { call, detail: format!("{e:?}") }
}

fn driver(call: &'static str) -> impl Fn(result::DriverError) -> CudaError {
    move |e| CudaError::Driver { call, detail: format!("{e:?}") }
}

/// Device 0's attributes, without creating a context.
fn query() -> std::result::Result<DeviceInfo, CudaUnavailable> {
    result::init().map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => CudaUnavailable::NoDevice,
        _ => unavailable("cuInit")(e),
    })?;
    let count = result::device::get_count().map_err(unavailable("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(CudaUnavailable::NoDevice);
    }
    let mut driver_version = 0;
    // SAFETY: `cuDriverGetVersion` writes one int through the pointer, which
    // points to a live local.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result().map_err(unavailable("cuDriverGetVersion"))?;
    let dev = result::device::get(0).map_err(unavailable("cuDeviceGet"))?;
    let name = result::device::get_name(dev).map_err(unavailable("cuDeviceGetName"))?;
    // SAFETY: `dev` is a device handle the driver just returned for ordinal 0.
    let total_memory = unsafe { result::device::total_mem(dev) }.map_err(unavailable("cuDeviceTotalMem"))?;
    let attr = |a| {
        // SAFETY: as above, `dev` is a valid device handle; the attribute is
        // one of the driver's enum values.
        unsafe { result::device::get_attribute(dev, a) }.map_err(unavailable("cuDeviceGetAttribute"))
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(DeviceInfo {
        ordinal: 0,
        device_count: usize::try_from(count).unwrap_or(0),
        name,
        total_memory,
        compute_capability: (major, minor),
        driver_version,
    })
}

// === NVRTC ===

/// NVRTC's version, or `NoNvrtc` when the library cannot be opened.
fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: as for the driver: only dlopens libnvrtc by its usual names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: `nvrtcVersion` writes two ints through pointers to live locals.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }));
    match r {
        Ok(cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS) => Ok((major, minor)),
        _ => Err(CudaError::NoNvrtc),
    }
}

/// PTX of one module for `arch` (`compute_XY`), from the disk cache when
/// `cached` and a verified entry exists, else compiled by NVRTC (and cached).
pub(crate) fn compile_ptx(module: Module, src: &str, arch: &str, cached: bool) -> Result<String> {
    let (major, minor) = nvrtc_version()?;
    let key = hex(&Sha256::digest(format!("{src}\0{arch}\0nvrtc {major}.{minor}")));
    let path = kernel_cache_dir().map(|d| d.join(format!("{}-{arch}-{}.ptx", module.name(), &key[..16])));
    if let Some(ptx) = path.as_deref().filter(|_| cached).and_then(read_cached) {
        tracing::debug!(module = module.name(), arch, "cuda kernels from the cache");
        return Ok(ptx);
    }
    let t0 = std::time::Instant::now();
    let opts = CompileOptions { options: vec![format!("--gpu-architecture={arch}")], ..Default::default() };
    let ptx = catch_unwind(AssertUnwindSafe(|| compile_ptx_with_opts(src, opts)))
        .map_err(|_| CudaError::NoNvrtc)?
        .map_err(|e| compile_error(module, arch, e))?
        .to_src();
    tracing::info!(module = module.name(), arch, ms = t0.elapsed().as_millis(), "nvrtc compiled the cuda kernels");
    if let Some(p) = &path {
        write_cached(p, &ptx);
    }
    Ok(ptx)
}

fn compile_error(module: Module, arch: &str, e: CompileError) -> CudaError {
    let log = match e {
        CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
        other => format!("{other:?}"),
    };
    CudaError::Compile { module: module.name(), arch: arch.to_string(), log }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A cache entry is `// sha256 <hex>\n` then the PTX; an entry whose digest
/// does not match (torn write, tampering) is ignored and rewritten.
fn read_cached(path: &std::path::Path) -> Option<String> {
    const MAX: u64 = 64 << 20;
    if std::fs::metadata(path).ok()?.len() > MAX {
        return None;
    }
    let text = std::fs::read_to_string(path).ok()?;
    let (head, ptx) = text.split_once('\n')?;
    (head.strip_prefix("// sha256 ")? == hex(&Sha256::digest(ptx))).then(|| ptx.to_string())
}

fn write_cached(path: &std::path::Path, ptx: &str) {
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, format!("// sha256 {}\n{ptx}", hex(&Sha256::digest(ptx))))?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        tracing::warn!(path = %path.display(), error = %e, "could not cache the compiled cuda kernels");
    }
}

// === The backend ===

pub(crate) struct Backend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    modules: Mutex<HashMap<Module, Arc<CudaModule>>>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    launches: std::sync::atomic::AtomicU64,
    /// A pack's product kernels, compiled instead of the built-in ones.
    products: Option<Arc<str>>,
}

impl Backend {
    pub(crate) fn new(info: &DeviceInfo, products: Option<Arc<str>>) -> Result<Self> {
        let ctx = catch_unwind(|| CudaContext::new(0))
            .map_err(|_| CudaUnavailable::Driver { call: "cuCtxCreate", detail: "panicked".into() })?
            .map_err(driver("cuDevicePrimaryCtxRetain"))?;
        // All work goes to one stream of our own, in issue order: cudarc's
        // per-buffer events (for ordering across streams) are not needed.
        // SAFETY: nothing here uses a second stream (see above).
        unsafe { ctx.disable_event_tracking() };
        // Not the legacy default stream: graphs cannot be captured on it.
        let stream = ctx.new_stream().map_err(driver("cuStreamCreate"))?;
        let (major, minor) = info.compute_capability;
        Ok(Self {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            modules: Mutex::default(),
            functions: Mutex::default(),
            launches: std::sync::atomic::AtomicU64::new(0),
            products,
        })
    }

    fn function(&self, module: Module, name: &str) -> Result<CudaFunction> {
        let mut fns = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = fns.get(name) {
            return Ok(f.clone());
        }
        let m = {
            let mut mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            match mods.get(&module) {
                Some(m) => m.clone(),
                None => {
                    let src = match (module, &self.products) {
                        (Module::Format(f), Some(p)) => crate::format::format_source(p, f),
                        _ => module.source(),
                    };
                    let ptx = compile_ptx(module, &src, &self.arch, true)?;
                    let m = self.ctx.load_module(Ptx::from_src(ptx)).map_err(driver("cuModuleLoadData"))?;
                    mods.insert(module, m.clone());
                    m
                }
            }
        };
        let f = m.load_function(name).map_err(driver("cuModuleGetFunction"))?;
        fns.insert(name.to_string(), f.clone());
        Ok(f)
    }

    pub(crate) fn upload<T: crate::Elem>(&self, data: &[T]) -> Result<Buf<T>> {
        if data.is_empty() {
            return self.alloc(0);
        }
        self.stream.clone_htod(data).map_err(driver("cuMemcpyHtoD"))
    }

    pub(crate) fn alloc<T: crate::Elem>(&self, len: usize) -> Result<Buf<T>> {
        self.stream.alloc_zeros(len.max(1)).map_err(driver("cuMemAlloc"))
    }

    pub(crate) fn download<T: crate::Elem>(&self, buf: &Buf<T>, len: usize) -> Result<Vec<T>> {
        let mut v = self.stream.clone_dtoh(buf).map_err(driver("cuMemcpyDtoH"))?;
        v.truncate(len);
        Ok(v)
    }

    pub(crate) fn download_range<T: crate::Elem>(&self, buf: &Buf<T>, offset: usize, out: &mut [T]) -> Result<()> {
        if !out.is_empty() {
            let view = buf.slice(offset..offset + out.len());
            self.stream.memcpy_dtoh(&view, out).map_err(driver("cuMemcpyDtoH"))?;
        }
        Ok(())
    }

    /// Page-locked host memory of `len` elements (zeroed), which copies
    /// from the device reach at full bus speed.
    pub(crate) fn alloc_pinned<T: crate::Elem>(&self, len: usize) -> Result<Pinned<T>> {
        // SAFETY: flags 0 (cached, not write-combined: the host reads it);
        // the memory is uninitialised until the fill below, and nothing
        // reads it before.
        let mut p = unsafe { self.stream.context().alloc_pinned_with_flags::<T>(len.max(1), 0) }
            .map_err(driver("cuMemHostAlloc"))?;
        p.as_mut_slice().map_err(driver("cuEventSynchronize"))?.fill(T::default());
        Ok(p)
    }

    /// Copies `len` elements of `buf` from `offset` into `dst` and waits
    /// for them: the first `len` elements of the returned slice.
    pub(crate) fn download_pinned<'h, T: crate::Elem>(
        &self,
        buf: &Buf<T>,
        offset: usize,
        len: usize,
        dst: &'h mut Pinned<T>,
    ) -> Result<&'h [T]> {
        if len > 0 {
            let view = buf.slice(offset..offset + len);
            // memcpy_dtoh copies the view's length (at most dst's, checked
            // by the caller), asynchronously.
            self.stream.memcpy_dtoh(&view, dst).map_err(driver("cuMemcpyDtoH"))?;
        }
        // With event tracking off (see `new`) the pinned slice's own event
        // is not recorded, so wait for the stream before reading.
        self.synchronize()?;
        Ok(&dst.as_slice().map_err(driver("cuEventSynchronize"))?[..len])
    }

    pub(crate) fn write<T: crate::Elem>(&self, dst: &mut Buf<T>, offset: usize, src: &[T]) -> Result<()> {
        let mut view = dst.slice_mut(offset..offset + src.len());
        self.stream.memcpy_htod(src, &mut view).map_err(driver("cuMemcpyHtoD"))
    }

    pub(crate) fn copy<T: crate::Elem>(&self, src: &Buf<T>, dst: &mut Buf<T>) -> Result<()> {
        self.stream.memcpy_dtod(src, dst).map_err(driver("cuMemcpyDtoD"))
    }

    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver("cuStreamSynchronize"))
    }

    /// The buffer's device address. All work goes to the one stream, in
    /// issue order, so the read/write events cudarc records for other
    /// streams are not needed (the guard is dropped at once).
    pub(crate) fn ptr<T: crate::Elem>(&self, buf: &Buf<T>) -> u64 {
        buf.device_ptr(&self.stream).0
    }

    /// Launches `name` from `module` with `args`.
    ///
    /// # Safety
    ///
    /// `args` must match the kernel's parameter list, and every pointer
    /// must address device memory that is live and large enough for what
    /// the kernel reads and writes with these arguments.
    pub(crate) unsafe fn launch(&self, module: Module, name: &str, grid: Grid, args: &[KArg]) -> Result<()> {
        let f = self.function(module, name)?;
        let cfg = LaunchConfig {
            grid_dim: (grid.blocks.0, grid.blocks.1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: grid.smem,
        };
        let mut b = self.stream.launch_builder(&f);
        for a in args {
            match a {
                KArg::I32(v) => b.arg(v),
                KArg::I64(v) => b.arg(v),
                KArg::F32(v) => b.arg(v),
                KArg::Ptr(v) => b.arg(v),
            };
        }
        // SAFETY: the caller guarantees the argument list and the memory.
        unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
        self.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    pub(crate) fn launches(&self) -> u64 {
        self.launches.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn begin_capture(&self) -> Result<()> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("cuStreamBeginCapture"))
    }

    pub(crate) fn end_capture(&self) -> Result<Graph> {
        self.stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("cuStreamEndCapture"))?
            .ok_or_else(|| CudaError::Driver { call: "cuStreamEndCapture", detail: "nothing was captured".into() })
    }

    pub(crate) fn launch_graph(&self, g: &Graph) -> Result<()> {
        g.launch().map_err(driver("cuGraphLaunch"))
    }

    pub(crate) fn time_ms(&self, run: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).map_err(driver("cuEventRecord"))?;
        run()?;
        let end = self.stream.record_event(flags).map_err(driver("cuEventRecord"))?;
        end.synchronize().map_err(driver("cuEventSynchronize"))?;
        Ok(f64::from(start.elapsed_ms(&end).map_err(driver("cuEventElapsedTime"))?))
    }
}
