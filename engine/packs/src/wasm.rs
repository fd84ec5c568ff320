//! WebAssembly kernel packs: third-party matmul kernels run inside
//! wasmtime's sandbox.
//!
//! # Model
//!
//! * One process-wide [`wasmtime::Engine`] per fuel setting (fuel metering
//!   is an engine-wide compilation choice, so packs with and without a fuel
//!   budget use two engines). Both have epoch interruption on; a background
//!   thread per engine (holding only a weak handle) bumps the epoch every
//!   [`EPOCH_TICK`], so a kernel that runs past its time budget is stopped
//!   within budget + 2 ticks.
//! * Per pack: the module is compiled once, and one `Store` holds its single
//!   instance for the pack's lifetime, with a memory cap enforced by a
//!   resource limiter. Modules may import nothing (no host functions, no
//!   WASI): a kernel can only compute on its own linear memory.
//! * Weights are copied into the module's memory once per weight matrix
//!   (keyed by the host slice's address and length, plus a sampled
//!   fingerprint that catches a freed-and-reused address) and stay resident;
//!   activations are copied in and outputs copied out on every call.
//! * The `Store` sits behind a mutex: calls into one pack are serialised (a
//!   wasm instance is single-threaded; the engine's thread pool is not used).
//!   Packs do not block each other.
//! * Any failure inside the module (trap, timeout, fuel exhausted, memory
//!   cap, bad status, a wrong result) disables the pack: it stops offering
//!   kernels and every later call fails fast. The process never crashes
//!   because of a pack.
//! * The module compiled is [`VerifiedPack::artefact_bytes`], the bytes the
//!   registry hashed: the file is never read again. Before compiling, its
//!   size is checked against [`WasmLimits::max_module_bytes`] and its
//!   sections are walked: declared memory minimums and data segments must
//!   fit [`WasmLimits::max_memory_bytes`] (a module with a 600 MB data
//!   segment is refused, not compiled).
//! * Every call's result is spot-checked: one output, chosen anew on each
//!   call, is recomputed with the engine's scalar reference kernel; a
//!   disagreement is a [`WasmFault::WrongResult`] (the registry's
//!   check-once-at-selection cannot see a module that turns wrong later).
//!
//! # Module ABI (version [`WASM_ABI_VERSION`])
//!
//! Exports: `memory`; `spinfer_abi_version() -> i32`; `alloc(bytes) -> ptr`
//! (0 = out of memory); `spinfer_kernel_count() -> i32` and
//! `spinfer_kernel_wtype(i) -> i32` (GGML type id of kernel `i`'s weights;
//! activations are f32); and for each kernel
//! `matmul_<wtype>_f32(w, rows, cols, x, n_tokens, out) -> i32` (0 = ok)
//! computing `out[t * rows + r] = dot(W[r, :], x[t * cols ..])`, the
//! engine's precise-mode contract. `kernels-wasm/` is the reference
//! implementation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use spinfer_kernels::kernel::{ActType, Form, MatmulCall, MatmulDesc, MatmulKernel, Select, not_offered};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::{GgmlType, KernelError};
use spinfer_registry::{PackKind, VerifiedPack};
use wasmtime::{Config, Engine, Instance, Memory, Module, ResourceLimiter, Store, Trap, TypedFunc};

use super::wasm_types::{MAX_WASM_TIMEOUT_MS, WASM_ABI_VERSION, WasmFault, WasmLimits};
use crate::spot::{SpotCheck, fingerprint};
use crate::{Error, Result};
use spinfer_kernel_select::registry::KernelProvider;

/// Period of the epoch ticker that enforces time budgets.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// A loaded WASM kernel pack; a [`KernelProvider`].
pub struct WasmPack {
    inner: Arc<Inner>,
}

/// Shared between the pack and the kernels it hands out.
struct Inner {
    name: String,
    limits: WasmLimits,
    /// Kernels the manifest declares and the module implements.
    kernels: Vec<Decl>,
    state: Mutex<State>,
    disabled: AtomicBool,
    fault: Mutex<Option<WasmFault>>,
    uploads: AtomicUsize,
}

/// One kernel: manifest name and weight type (export
/// `matmul_<wtype>_f32`).
struct Decl {
    name: String,
    wtype: GgmlType,
}

/// `(w, rows, cols, x, n_tokens, out) -> status`.
type MatmulFn = TypedFunc<(u32, u32, u32, u32, u32, u32), i32>;

/// The instance and what lives in its memory.
struct State {
    store: Store<Host>,
    memory: Memory,
    alloc: TypedFunc<u32, u32>,
    funcs: HashMap<GgmlType, MatmulFn>,
    /// Resident weights: (host address, length) -> copy in wasm memory.
    weights: HashMap<(usize, usize), Resident>,
    /// Reused activation/output buffer: (offset, capacity in bytes).
    io: (u32, usize),
}

struct Resident {
    offset: u32,
    fingerprint: u64,
}

/// Host data of a pack's store: the memory limiter.
struct Host {
    cap: usize,
    /// Set when a growth was refused: (bytes wanted).
    denied: Option<usize>,
}

/// Returned from the limiter to make a refused `memory.grow` trap.
#[derive(Debug, thiserror::Error)]
#[error("memory limit: {wanted} bytes wanted, cap {cap}")]
struct MemoryDenied {
    wanted: usize,
    cap: usize,
}

impl ResourceLimiter for Host {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.cap {
            self.denied = Some(desired);
            // An error (not `Ok(false)`) traps, so a module cannot ignore the
            // refusal and the failure is reported as a memory-limit fault.
            return Err(wasmtime::Error::new(MemoryDenied { wanted: desired, cap: self.cap }));
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 10_000)
    }

    fn instances(&self) -> usize {
        1
    }

    fn memories(&self) -> usize {
        1
    }
}

/// The process-wide engine for `fuel` metering on or off (created on first
/// use, with its epoch ticker).
fn engine(fuel: bool) -> std::result::Result<Engine, String> {
    static ENGINES: [OnceLock<std::result::Result<Engine, String>>; 2] = [OnceLock::new(), OnceLock::new()];
    ENGINES[usize::from(fuel)]
        .get_or_init(|| {
            let mut config = Config::new();
            config.strategy(wasmtime::Strategy::Cranelift);
            config.epoch_interruption(true);
            config.consume_fuel(fuel);
            let engine = Engine::new(&config).map_err(|e| format!("creating the wasm engine: {e}"))?;
            let weak = engine.weak();
            std::thread::Builder::new()
                .name("spinfer-wasm-epoch".into())
                .spawn(move || {
                    // At least one tick apart, never closer: a deadline of
                    // n + 1 ticks then spans at least n full ticks, so a
                    // kernel is never stopped before its budget. (Ticking on
                    // a fixed grid would let a late tick and its on-time
                    // successor land closer together and stop it early.)
                    while let Some(engine) = weak.upgrade() {
                        engine.increment_epoch();
                        drop(engine);
                        std::thread::sleep(EPOCH_TICK);
                    }
                })
                .map_err(|e| format!("starting the wasm epoch ticker: {e}"))?;
            Ok(engine)
        })
        .clone()
}

/// Walks the module's sections before it is compiled: every declared
/// memory's minimum, and the data segments (in total and each active
/// segment's end), must fit `limits.max_memory_bytes`. Compiling and
/// instantiating such a module would cost memory the cap is meant to deny
/// (compiled data segments and memory images are not linear memory, so the
/// limiter never sees them).
fn prescan(bytes: &[u8], limits: &WasmLimits) -> std::result::Result<(), String> {
    use wasmparser::{DataKind, Operator, Parser, Payload};
    let cap = limits.max_memory_bytes as u64;
    let over = |what: String| {
        format!("{what} exceeds the memory limit of {cap} bytes ([wasm] max_memory_mb); refused before compiling")
    };
    let bad = |e: wasmparser::BinaryReaderError| format!("not a valid wasm module: {e}");
    let mut data_total: u64 = 0;
    for payload in Parser::new(0).parse_all(bytes) {
        match payload.map_err(bad)? {
            Payload::MemorySection(reader) => {
                for m in reader {
                    let m = m.map_err(bad)?;
                    let page = 1u64 << m.page_size_log2.unwrap_or(16);
                    let min = m.initial.saturating_mul(page);
                    if min > cap {
                        return Err(over(format!("a declared memory minimum of {min} bytes")));
                    }
                }
            }
            Payload::DataSection(reader) => {
                for d in reader {
                    let d = d.map_err(bad)?;
                    let len = d.data.len() as u64;
                    data_total = data_total.saturating_add(len);
                    if data_total > cap {
                        return Err(over(format!("{data_total} bytes of data segments")));
                    }
                    if let DataKind::Active { offset_expr, .. } = d.kind {
                        let offset = match offset_expr.get_operators_reader().read().map_err(bad)? {
                            Operator::I32Const { value } => u64::from(value as u32),
                            Operator::I64Const { value } => value as u64,
                            _ => 0,
                        };
                        let end = offset.saturating_add(len);
                        if end > cap {
                            return Err(over(format!("a data segment ending at byte {end}")));
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Epoch ticks to allow for `timeout_ms`: the deadline is relative to the
/// current epoch, which may be about to tick, so one extra tick.
fn deadline_ticks(timeout_ms: u64) -> u64 {
    timeout_ms.div_ceil(EPOCH_TICK.as_millis() as u64).max(1) + 1
}

impl WasmPack {
    /// Compiles and instantiates the module of `pack` (already verified by
    /// the registry) under `limits`. Refuses a pack that is not
    /// `kind = "wasm"`, whose module or manifest declares another ABI
    /// version (naming both), that imports anything, or that lacks an
    /// export for a kernel its manifest declares. Only manifest kernels
    /// with `op = "matmul"`, `act = "f32"` are offered.
    pub fn load(pack: &VerifiedPack, limits: WasmLimits) -> Result<Self> {
        let m = pack.manifest();
        let name = m.name.clone();
        let err = |detail: String| Error::Pack { pack: name.clone(), detail };
        if m.kind != PackKind::Wasm {
            return Err(err(format!("kind is {:?}, not wasm", m.kind)));
        }
        if m.abi_version != WASM_ABI_VERSION {
            return Err(err(format!(
                "pack.toml declares abi_version {}, this host implements wasm abi {WASM_ABI_VERSION}",
                m.abi_version
            )));
        }
        if !(1..=MAX_WASM_TIMEOUT_MS).contains(&limits.timeout_ms) {
            return Err(err(format!(
                "timeout_ms = {} is out of range: it must be between 1 and {MAX_WASM_TIMEOUT_MS} ([wasm] timeout_ms)",
                limits.timeout_ms
            )));
        }
        let path = pack.artefact_path();
        // The verified bytes, never the path again (it may have been swapped).
        let bytes = pack.artefact_bytes();
        if bytes.len() > limits.max_module_bytes {
            return Err(err(format!(
                "module {} is {} bytes, more than the limit of {} ([wasm] max_module_mb)",
                path.display(),
                bytes.len(),
                limits.max_module_bytes
            )));
        }
        prescan(bytes, &limits).map_err(|e| err(format!("module {}: {e}", path.display())))?;
        let engine = engine(limits.fuel.is_some()).map_err(&err)?;
        let module = Module::new(&engine, bytes).map_err(|e| err(format!("compiling {}: {e}", path.display())))?;
        if let Some(imp) = module.imports().next() {
            return Err(err(format!(
                "the module imports '{}::{}'; wasm packs may import nothing",
                imp.module(),
                imp.name()
            )));
        }

        let mut store = Store::new(&engine, Host { cap: limits.max_memory_bytes, denied: None });
        store.limiter(|h| h as &mut dyn ResourceLimiter);
        set_budget(&mut store, &limits).map_err(&err)?;
        let instance = Instance::new(&mut store, &module, &[]).map_err(|e| {
            let fault = classify(&e, &store, &limits);
            err(format!("instantiating: {}", fault.map_or_else(|| e.to_string(), |f| f.to_string())))
        })?;
        let abi: TypedFunc<(), u32> = typed(&instance, &mut store, "spinfer_abi_version").map_err(&err)?;
        let got = abi.call(&mut store, ()).map_err(|e| err(format!("spinfer_abi_version trapped: {e}")))?;
        if got != WASM_ABI_VERSION {
            return Err(err(format!("module implements wasm abi {got}, this host implements {WASM_ABI_VERSION}")));
        }
        let memory = instance
            .get_memory(&mut store, "memory")
            .ok_or_else(|| err("the module does not export its memory as 'memory'".into()))?;
        let alloc: TypedFunc<u32, u32> = typed(&instance, &mut store, "alloc").map_err(&err)?;
        let count: TypedFunc<(), u32> = typed(&instance, &mut store, "spinfer_kernel_count").map_err(&err)?;
        let wtype_of: TypedFunc<u32, u32> = typed(&instance, &mut store, "spinfer_kernel_wtype").map_err(&err)?;
        let n = count.call(&mut store, ()).map_err(|e| err(format!("spinfer_kernel_count trapped: {e}")))?;
        let mut table = Vec::new();
        for i in 0..n.min(256) {
            let id = wtype_of.call(&mut store, i).map_err(|e| err(format!("spinfer_kernel_wtype trapped: {e}")))?;
            if let Some(t) = GgmlType::from_u32(id) {
                table.push(t);
            }
        }

        let mut kernels = Vec::new();
        let mut funcs = HashMap::new();
        for k in m.kernels.iter().filter(|k| k.op == "matmul" && k.act == ActType::F32.name()) {
            let wtype = [GgmlType::F32, GgmlType::Q4_1, GgmlType::Q8_0]
                .into_iter()
                .chain(table.iter().copied())
                .find(|t| t.name() == k.weight)
                .ok_or_else(|| err(format!("kernel '{}': unknown weight type '{}'", k.name, k.weight)))?;
            if !table.contains(&wtype) {
                return Err(err(format!(
                    "kernel '{}': the manifest declares {}*f32 but the module's kernel table lacks it",
                    k.name, k.weight
                )));
            }
            let export = format!("matmul_{}_f32", wtype.name());
            let f: MatmulFn =
                typed(&instance, &mut store, &export).map_err(|e| err(format!("kernel '{}': {e}", k.name)))?;
            funcs.insert(wtype, f);
            kernels.push(Decl { name: k.name.clone(), wtype });
        }
        let state = State { store, memory, alloc, funcs, weights: HashMap::new(), io: (0, 0) };
        tracing::info!(pack = %name, kernels = kernels.len(), "loaded wasm pack");
        Ok(Self {
            inner: Arc::new(Inner {
                name,
                limits,
                kernels,
                state: Mutex::new(state),
                disabled: AtomicBool::new(false),
                fault: Mutex::new(None),
                uploads: AtomicUsize::new(0),
            }),
        })
    }

    /// Whether a failure has disabled the pack.
    pub fn is_disabled(&self) -> bool {
        self.inner.disabled.load(Ordering::Acquire)
    }

    /// The failure that disabled the pack, if any.
    pub fn fault(&self) -> Option<WasmFault> {
        self.inner.fault.lock().map(|f| f.clone()).unwrap_or(None)
    }

    /// Weight matrices copied into the module's memory so far (each is
    /// copied once, on its first use).
    pub fn weight_uploads(&self) -> usize {
        self.inner.uploads.load(Ordering::Relaxed)
    }

    /// The limits the pack runs under.
    pub fn limits(&self) -> WasmLimits {
        self.inner.limits
    }

    /// Names of the kernels the pack offers (manifest names).
    pub fn kernel_names(&self) -> Vec<String> {
        self.inner.kernels.iter().map(|k| k.name.clone()).collect()
    }
}

impl KernelProvider for WasmPack {
    fn name(&self) -> &str {
        &self.inner.name
    }

    /// 1 while usable (as the builtin provider: packs are chosen by pin or
    /// benchmark, not by default), 0 once disabled.
    fn score(&self) -> u32 {
        u32::from(!self.is_disabled())
    }

    /// Dense f32-activation kernels only (the WASM ABI has no gathered
    /// forms).
    fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
        if self.is_disabled() || desc.act != ActType::F32 || desc.form != Form::Dense {
            return Vec::new();
        }
        let Ok(row_bytes) = desc.wtype.row_bytes(desc.cols) else { return Vec::new() };
        self.inner
            .kernels
            .iter()
            .filter(|k| k.wtype == desc.wtype)
            .map(|k| {
                Arc::new(WasmKernel {
                    inner: Arc::clone(&self.inner),
                    name: k.name.clone(),
                    desc: *desc,
                    row_bytes,
                    spot: SpotCheck::new(*desc, row_bytes),
                }) as Arc<dyn MatmulKernel>
            })
            .collect()
    }
}

/// A pack kernel bound to one operation.
struct WasmKernel {
    inner: Arc<Inner>,
    name: String,
    desc: MatmulDesc,
    row_bytes: usize,
    spot: SpotCheck,
}

impl MatmulKernel for WasmKernel {
    fn name(&self) -> &str {
        &self.name
    }

    /// Runs on the calling thread (the pool is not used); see the module
    /// docs for the copy and locking model. Pack failures come back as
    /// `KernelError::Pack` carrying the pack error's message.
    fn run(&self, _pool: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
        let MatmulCall { w, select, x, n_tokens, out, .. } = call;
        if !matches!(select, Select::All) {
            return Err(not_offered(self, select.form()));
        }
        let d = &self.desc;
        let want = d.rows * self.row_bytes;
        if w.len() != want {
            return Err(KernelError::BufferSize { ty: d.wtype, n: d.rows * d.cols, want, got: w.len() });
        }
        if x.len() != n_tokens * d.cols || out.len() != n_tokens * d.rows {
            return Err(KernelError::Shape {
                op: "wasm",
                detail: format!(
                    "{n_tokens} tokens of {}x{}: got {} activations and {} outputs",
                    d.rows,
                    d.cols,
                    x.len(),
                    out.len()
                ),
            });
        }
        let to_kernel_error = |e: Error| KernelError::Pack {
            pack: self.inner.name.clone(),
            kernel: self.name.clone(),
            detail: e.to_string(),
        };
        self.inner.call(&self.name, d, w, x, n_tokens, out).map_err(to_kernel_error)?;
        self.spot_check(w, x, n_tokens, out).map_err(to_kernel_error)
    }
}

impl WasmKernel {
    /// One output of this call recomputed by the scalar reference
    /// ([`SpotCheck`]); a disagreement disables the pack.
    fn spot_check(&self, w: &[u8], x: &[f32], n_tokens: usize, out: &[f32]) -> Result<()> {
        self.spot.check(w, None, x, n_tokens, out).map_err(|e| self.inner.fail(&self.name, WasmFault::WrongResult(e)))
    }
}

/// Looks up a typed export, naming it on failure.
fn typed<P: wasmtime::WasmParams, R: wasmtime::WasmResults>(
    instance: &Instance,
    store: &mut Store<Host>,
    export: &str,
) -> std::result::Result<TypedFunc<P, R>, String> {
    instance.get_typed_func::<P, R>(&mut *store, export).map_err(|e| format!("export '{export}': {e}"))
}

/// Arms the time (and fuel) budget for one call into the module.
fn set_budget(store: &mut Store<Host>, limits: &WasmLimits) -> std::result::Result<(), String> {
    store.set_epoch_deadline(deadline_ticks(limits.timeout_ms));
    if let Some(fuel) = limits.fuel {
        store.set_fuel(fuel).map_err(|e| format!("setting fuel: {e}"))?;
    }
    Ok(())
}

/// Turns a wasmtime error from a call into a fault.
fn classify(e: &wasmtime::Error, store: &Store<Host>, limits: &WasmLimits) -> Option<WasmFault> {
    if let Some(wanted) = store.data().denied {
        return Some(WasmFault::MemoryLimit { wanted, cap: limits.max_memory_bytes });
    }
    if let Some(m) = e.downcast_ref::<MemoryDenied>() {
        return Some(WasmFault::MemoryLimit { wanted: m.wanted, cap: m.cap });
    }
    match e.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => Some(WasmFault::Timeout { timeout_ms: limits.timeout_ms }),
        Some(Trap::OutOfFuel) => Some(WasmFault::OutOfFuel { fuel: limits.fuel.unwrap_or(0) }),
        Some(t) => Some(WasmFault::Trap(t.to_string())),
        None => None,
    }
}

impl Inner {
    fn pack_error(&self, kernel: &str, detail: impl std::fmt::Display) -> Error {
        Error::Pack { pack: self.name.clone(), detail: format!("kernel '{kernel}': {detail}") }
    }

    /// Records `fault`, disables the pack and builds the error.
    fn fail(&self, kernel: &str, fault: WasmFault) -> Error {
        self.disabled.store(true, Ordering::Release);
        tracing::error!(pack = %self.name, kernel, %fault, "wasm pack failed; disabling it");
        if let Ok(mut f) = self.fault.lock() {
            f.get_or_insert(fault.clone());
        }
        self.pack_error(kernel, format_args!("{fault}; pack disabled"))
    }

    fn call(&self, kernel: &str, d: &MatmulDesc, w: &[u8], x: &[f32], n_tokens: usize, out: &mut [f32]) -> Result<()> {
        if self.disabled.load(Ordering::Acquire) {
            let why = self.fault.lock().ok().and_then(|f| f.clone());
            let why = why.map_or_else(|| "an earlier failure".to_string(), |f| f.to_string());
            return Err(self.pack_error(kernel, format_args!("pack is disabled after {why}")));
        }
        if n_tokens == 0 || d.rows == 0 {
            return Ok(());
        }
        let too_big = || self.pack_error(kernel, "operands exceed wasm32's 4 GiB address space");
        let u32_of = |v: usize| u32::try_from(v).map_err(|_| too_big());
        let (rows, cols, nt) = (u32_of(d.rows)?, u32_of(d.cols)?, u32_of(n_tokens)?);
        let x_bytes = std::mem::size_of_val(x);
        let out_bytes = std::mem::size_of_val(out);

        let mut guard = self.state.lock().map_err(|_| self.pack_error(kernel, "state poisoned by an earlier panic"))?;
        let st = &mut *guard;
        let func = st.funcs.get(&d.wtype).cloned().ok_or_else(|| self.pack_error(kernel, "no export for the type"))?;

        // Weights: resident after the first call.
        let key = (w.as_ptr() as usize, w.len());
        let fp = fingerprint(w);
        let w_off = match st.weights.get(&key) {
            Some(r) if r.fingerprint == fp => r.offset,
            _ => {
                let off = self.alloc(st, kernel, w.len())?;
                st.memory.write(&mut st.store, off as usize, w).map_err(|e| self.pack_error(kernel, e))?;
                st.weights.insert(key, Resident { offset: off, fingerprint: fp });
                self.uploads.fetch_add(1, Ordering::Relaxed);
                off
            }
        };

        // Activations in, outputs out, through one reused buffer.
        let need = x_bytes.checked_add(out_bytes).ok_or_else(too_big)?;
        if st.io.1 < need {
            let cap = need.max(st.io.1.saturating_mul(2));
            st.io = (self.alloc(st, kernel, cap)?, cap);
        }
        let x_off = st.io.0;
        let out_off = x_off.checked_add(u32_of(x_bytes)?).ok_or_else(too_big)?;
        st.memory
            .write(&mut st.store, x_off as usize, bytemuck::cast_slice(x))
            .map_err(|e| self.pack_error(kernel, e))?;

        set_budget(&mut st.store, &self.limits).map_err(|e| self.pack_error(kernel, e))?;
        match func.call(&mut st.store, (w_off, rows, cols, x_off, nt, out_off)) {
            Ok(0) => {}
            Ok(status) => return Err(self.fail(kernel, WasmFault::Status(status))),
            Err(e) => {
                let fault = classify(&e, &st.store, &self.limits).unwrap_or_else(|| WasmFault::Trap(e.to_string()));
                return Err(self.fail(kernel, fault));
            }
        }
        st.memory
            .read(&st.store, out_off as usize, bytemuck::cast_slice_mut(out))
            .map_err(|e| self.pack_error(kernel, e))?;
        Ok(())
    }

    /// `alloc(bytes)` in the module under the call budget; 0 or a trap is a
    /// fault.
    fn alloc(&self, st: &mut State, kernel: &str, bytes: usize) -> Result<u32> {
        let n = u32::try_from(bytes).map_err(|_| {
            self.fail(kernel, WasmFault::MemoryLimit { wanted: bytes, cap: self.limits.max_memory_bytes })
        })?;
        set_budget(&mut st.store, &self.limits).map_err(|e| self.pack_error(kernel, e))?;
        match st.alloc.call(&mut st.store, n) {
            Ok(0) => {
                let used = st.memory.data_size(&st.store);
                Err(self
                    .fail(kernel, WasmFault::MemoryLimit { wanted: used + bytes, cap: self.limits.max_memory_bytes }))
            }
            Ok(off) => Ok(off),
            Err(e) => {
                let fault = classify(&e, &st.store, &self.limits).unwrap_or_else(|| WasmFault::Trap(e.to_string()));
                Err(self.fail(kernel, fault))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::fixtures::{MATVEC_TRAPS_ON_BATCH, pack, wat_module};

    const DESC: MatmulDesc = MatmulDesc::dense(GgmlType::F32, ActType::F32, 4, 8);

    fn kernel(p: &WasmPack) -> Arc<dyn MatmulKernel> {
        p.kernels_for(&DESC).into_iter().next().expect("the pack offers its f32 kernel")
    }

    /// Runs the pack's kernel once on small operands.
    fn run(k: &dyn MatmulKernel, w: &[u8]) -> spinfer_kernels::Result<Vec<f32>> {
        let x = vec![1.0f32; 8];
        let mut out = vec![0.0f32; 4];
        k.run(&ThreadPool::new(1), MatmulCall::dense(w, &x, 1, &mut out, &mut Vec::new()))?;
        Ok(out)
    }

    fn limits(timeout_ms: u64) -> WasmLimits {
        WasmLimits { max_memory_bytes: 16 << 20, timeout_ms, fuel: None, ..WasmLimits::default() }
    }

    #[test]
    fn looping_kernel_is_interrupted_within_budget_and_pack_disabled() {
        let (_d, vp) = pack("test-loop", 1, &wat_module(1, "(loop $l (br $l)) (i32.const 0)"));
        let p = WasmPack::load(&vp, limits(100)).unwrap();
        let k = kernel(&p);
        let w = vec![0u8; 4 * 8 * 4];
        let t = Instant::now();
        let e = run(k.as_ref(), &w).unwrap_err().to_string();
        let ms = t.elapsed().as_millis();
        eprintln!("interrupted after {ms} ms (budget 100 ms)");
        // Never before the budget. After it: one epoch tick (10 ms) plus
        // however long the ticker thread and this one wait for a core; on
        // a loaded 2-core CI machine that has been tens of milliseconds,
        // so the bound is 2 s, still far below "never stops".
        assert!((100..=2_100).contains(&ms), "interrupted after {ms} ms, budget 100 ms");
        assert!(e.contains("pack test-loop") && e.contains("kernel 'test_loop_f32'") && e.contains("timed out"), "{e}");
        assert_eq!(p.fault(), Some(WasmFault::Timeout { timeout_ms: 100 }));
        assert!(p.is_disabled());
        assert_eq!(p.score(), 0);
        assert!(p.kernels_for(&DESC).is_empty());
        let again = run(k.as_ref(), &w).unwrap_err().to_string();
        assert!(again.contains("disabled"), "{again}");
    }

    #[test]
    fn growing_past_the_memory_cap_is_a_memory_fault() {
        let (_d, vp) = pack("test-grow", 1, &wat_module(1, "(drop (memory.grow (i32.const 1024))) (i32.const 0)"));
        let p = WasmPack::load(&vp, limits(5_000)).unwrap();
        let e = run(kernel(&p).as_ref(), &[0u8; 128]).unwrap_err().to_string();
        assert!(e.contains("memory limit"), "{e}");
        assert!(matches!(p.fault(), Some(WasmFault::MemoryLimit { cap, .. }) if cap == 16 << 20), "{:?}", p.fault());
        assert!(p.is_disabled());
    }

    #[test]
    fn initial_memory_above_the_cap_is_refused_at_load() {
        let (_d, vp) = pack("test-big", 1, &wat_module(1, "(i32.const 0)"));
        let tiny = WasmLimits { max_memory_bytes: 1024, ..limits(1000) };
        let e = WasmPack::load(&vp, tiny).err().expect("refused").to_string();
        assert!(e.contains("pack test-big") && e.contains("memory limit"), "{e}");
    }

    #[test]
    fn fuel_exhaustion_is_a_typed_fault() {
        let (_d, vp) = pack("test-fuel", 1, &wat_module(1, "(loop $l (br $l)) (i32.const 0)"));
        let p = WasmPack::load(&vp, WasmLimits { fuel: Some(100_000), ..limits(10_000) }).unwrap();
        let t = Instant::now();
        let e = run(kernel(&p).as_ref(), &[0u8; 128]).unwrap_err().to_string();
        assert!(t.elapsed() < Duration::from_secs(5), "fuel, not the timeout, stopped it");
        assert!(e.contains("out of fuel"), "{e}");
        assert_eq!(p.fault(), Some(WasmFault::OutOfFuel { fuel: 100_000 }));
    }

    #[test]
    fn wrong_abi_version_is_refused_naming_both() {
        let (_d, vp) = pack("test-abi", 1, &wat_module(7, "(i32.const 0)"));
        let e = WasmPack::load(&vp, limits(1000)).err().expect("refused").to_string();
        assert!(e.contains("pack test-abi") && e.contains("abi 7") && e.contains("implements 1"), "{e}");
        let (_d, vp) = pack("test-abi2", 3, &wat_module(1, "(i32.const 0)"));
        let e = WasmPack::load(&vp, limits(1000)).err().expect("refused").to_string();
        assert!(e.contains("abi_version 3") && e.contains("wasm abi 1"), "{e}");
    }

    #[test]
    fn imports_are_refused() {
        let wasm = wat::parse_str(r#"(module (import "env" "f" (func)) (memory (export "memory") 1))"#).unwrap();
        let (_d, vp) = pack("test-imp", 1, &wasm);
        let e = WasmPack::load(&vp, limits(1000)).err().expect("refused").to_string();
        assert!(e.contains("imports 'env::f'"), "{e}");
    }

    #[test]
    fn weights_are_uploaded_once_per_matrix() {
        let body = format!("(local $r i32) (local $c i32) (local $acc f32) {MATVEC_TRAPS_ON_BATCH}");
        let (_d, vp) = pack("test-once", 1, &wat_module(1, &body));
        let p = WasmPack::load(&vp, limits(1000)).unwrap();
        let k = kernel(&p);
        let w1: Vec<u8> = (0..32u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let w2: Vec<u8> = (0..32u32).flat_map(|i| (-(i as f32)).to_le_bytes()).collect();
        // Row r of w1 is 8r..8r+8, x is all ones: 64r + 28.
        for _ in 0..3 {
            assert_eq!(run(k.as_ref(), &w1).unwrap(), [28.0, 92.0, 156.0, 220.0]);
        }
        assert_eq!(p.weight_uploads(), 1);
        assert_eq!(run(k.as_ref(), &w2).unwrap(), [-28.0, -92.0, -156.0, -220.0]);
        assert_eq!(run(k.as_ref(), &w1).unwrap(), [28.0, 92.0, 156.0, 220.0]);
        assert_eq!(p.weight_uploads(), 2);
        assert!(!p.is_disabled());
    }

    /// A stateful module that is right for its first calls (so it passes
    /// the registry's check at selection) and wrong afterwards: the spot
    /// check of every call catches it, the call fails (callers fall back to
    /// the built-in kernels) and the pack is disabled.
    #[test]
    fn a_module_that_turns_wrong_later_is_caught_and_disabled() {
        let matvec = MATVEC_TRAPS_ON_BATCH.trim_end().strip_suffix("(i32.const 0)").unwrap();
        let body = format!(
            "(local $r i32) (local $c i32) (local $acc f32)
             (i32.store (i32.const 0) (i32.add (i32.load (i32.const 0)) (i32.const 1)))
             {matvec}
             (if (i32.gt_u (i32.load (i32.const 0)) (i32.const 5)) (then
               (f32.store (local.get 5) (f32.const 1000)) (f32.store offset=4 (local.get 5) (f32.const 1000))
               (f32.store offset=8 (local.get 5) (f32.const 1000)) (f32.store offset=12 (local.get 5) (f32.const 1000))))
             (i32.const 0)"
        );
        let (_d, vp) = pack("test-turns", 1, &wat_module(1, &body));
        let p = WasmPack::load(&vp, limits(1000)).unwrap();
        let k = kernel(&p);
        let w: Vec<u8> = (0..32u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        for call in 1..=5 {
            assert_eq!(run(k.as_ref(), &w).unwrap(), [28.0, 92.0, 156.0, 220.0], "call {call}");
        }
        let e = run(k.as_ref(), &w).unwrap_err().to_string();
        assert!(e.contains("wrong result") && e.contains("pack disabled"), "{e}");
        assert!(matches!(p.fault(), Some(WasmFault::WrongResult(_))), "{:?}", p.fault());
        assert!(p.is_disabled() && p.kernels_for(&DESC).is_empty());
        // Another pack still loads and computes.
        let body = format!("(local $r i32) (local $c i32) (local $acc f32) {MATVEC_TRAPS_ON_BATCH}");
        let (_d2, vp) = pack("test-good", 1, &wat_module(1, &body));
        let good = WasmPack::load(&vp, limits(1000)).unwrap();
        assert_eq!(run(kernel(&good).as_ref(), &w).unwrap(), [28.0, 92.0, 156.0, 220.0]);
    }

    #[test]
    fn oversized_modules_and_data_segments_are_refused_before_compiling() {
        // A module bigger than max_module_bytes.
        let body = format!("(local $r i32) (local $c i32) (local $acc f32) {MATVEC_TRAPS_ON_BATCH}");
        let wasm = wat_module(1, &body);
        let (_d, vp) = pack("test-size", 1, &wasm);
        let small = WasmLimits { max_module_bytes: wasm.len() - 1, ..limits(1000) };
        let e = WasmPack::load(&vp, small).err().expect("refused").to_string();
        assert!(e.contains("max_module_mb") && e.contains(&wasm.len().to_string()), "{e}");
        // 32 MiB of data segment under a 16 MiB memory cap: refused before
        // compiling (binary built by hand: a memory and one data segment).
        let leb = |mut v: u64, out: &mut Vec<u8>| loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        };
        let n = 32u64 << 20;
        let mut segment = vec![1u8, 0, 0x41]; // one segment, active in memory 0, i32.const
        leb(1024, &mut segment);
        segment.push(0x0b);
        leb(n, &mut segment);
        segment.resize(segment.len() + n as usize, 0);
        let mut with_data = b"\0asm\x01\0\0\0\x05\x03\x01\x00\x01\x0b".to_vec();
        leb(segment.len() as u64, &mut with_data);
        with_data.extend_from_slice(&segment);
        let (_d, vp) = pack("test-data", 1, &with_data);
        let t = Instant::now();
        let e = WasmPack::load(&vp, limits(1000)).err().expect("refused").to_string();
        assert!(e.contains("data segments") && e.contains("memory limit"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "refused without compiling");
        // A segment placed past the cap.
        let far = wat::parse_str(r#"(module (memory (export "memory") 1) (data (i32.const 0x7fff0000) "x"))"#).unwrap();
        let (_d, vp) = pack("test-far", 1, &far);
        let e = WasmPack::load(&vp, limits(1000)).err().expect("refused").to_string();
        assert!(e.contains("ending at byte") && e.contains("memory limit"), "{e}");
        // A good module still loads.
        let (_d, vp) = pack("test-ok", 1, &wasm);
        WasmPack::load(&vp, limits(1000)).unwrap();
    }

    #[test]
    fn timeout_above_the_bound_is_refused_at_load() {
        let (_d, vp) = pack("test-timeout", 1, &wat_module(1, "(i32.const 0)"));
        for bad in [u64::MAX, MAX_WASM_TIMEOUT_MS + 1, 0] {
            let e = WasmPack::load(&vp, limits(bad)).err().expect("refused").to_string();
            assert!(e.contains("timeout_ms") && e.contains("out of range"), "{e}");
        }
        WasmPack::load(&vp, limits(MAX_WASM_TIMEOUT_MS)).unwrap();
    }

    #[test]
    fn deadline_covers_the_budget() {
        assert_eq!(deadline_ticks(100), 11);
        assert_eq!(deadline_ticks(1), 2);
        assert_eq!(deadline_ticks(0), 2);
    }
}
