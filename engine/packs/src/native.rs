//! Native kernel packs: a verified `cdylib` loaded through the stable ABI of
//! `spinfer-plugin-api` and offered to the [`KernelRegistry`] as a
//! [`KernelProvider`].
//!
//! Loading follows ggml's backend order: verify (already done: the input is
//! a [`VerifiedPack`]) → open ([`load_pack`]: dlopen plus `abi_stable`'s
//! layout checks) → ABI version (named on both sides) → the library's name
//! must be the manifest's → `score(host)` (0 means "does not run here",
//! with a reason) → register (the caller's
//! [`KernelRegistry::add_provider`]).
//!
//! The bytes loaded are the bytes verified: the registry read the artefact
//! once and hashed it ([`VerifiedPack::artefact_bytes`]); those bytes are
//! copied into a sealed `memfd` (no write, grow or shrink possible, and no
//! further seals) and `dlopen`ed as `/proc/self/fd/N`. The pack directory's
//! file is never opened again, so swapping it after verification changes
//! nothing. A library is loaded once per content (sha256) per process.
//!
//! Libraries are never unloaded: a [`NativePack`] holds a `'static` root
//! module, and dropping it drops only the kernel objects. See
//! `docs/plugin-abi.md` ("Libraries are never unloaded").
//!
//! [`KernelRegistry`]: spinfer_kernel_select::registry::KernelRegistry
//! [`KernelRegistry::add_provider`]: spinfer_kernel_select::registry::KernelRegistry::add_provider

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use spinfer_kernels::kernel::{Form, MatmulCall, MatmulDesc, MatmulKernel, Select, not_offered};
use spinfer_kernels::pool::SyncPtr;
use spinfer_kernels::pool::{ThreadPool, chunk, chunk_aligned};
use spinfer_kernels::{GgmlType, KernelError};
use spinfer_plugin_api::abi_stable::std_types::RSliceMut;
use spinfer_plugin_api::{
    ABI_VERSION, CachePolicyBox, HostInfo, KernelBox, KernelDesc, Op, PackError, PackModuleRef, PredictorBox,
    PredictorSpec, WeightType, check_abi_version, load_pack,
};
use spinfer_registry::{PackKind, VerifiedPack, Version};

use crate::host::{HOST_VERSION, abi_act_type, abi_weight_type};
use crate::i2s::I2sFromTq2_0;
use crate::loaders::PackLoader;
use crate::{Error, Result};
use spinfer_kernel_select::registry::{KernelProvider, SparsityProvider};

/// Up to this many tokens (decode: 1, or 2 as the fast mode's two
/// activation planes) a pack kernel's work is split over the pool by
/// weight rows, as the built-in kernels split it, so the matrix streams
/// once; split by tokens, every thread would read all of it. Larger
/// batches split tokens.
const ROW_SPLIT_TOKENS: usize = 4;

thread_local! {
    /// A pool thread's `tokens x rows` output of a row-split pack call,
    /// before it goes to the token-major output; reused from call to call.
    static PART: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A loaded, usable native pack: the engine-side provider of its kernels.
pub struct NativePack {
    /// `"{name}@{version}#{first 12 hex digits of the artefact's sha256}"`.
    provider_name: String,
    /// `"{name}@{version}"`.
    id: String,
    /// The manifest's name (equal to the name the library reports, or the
    /// pack is refused); its kernels are named `"{pack_name}:{kernel}"` on
    /// the engine side.
    pack_name: String,
    score: u32,
    kernels: Vec<(KernelDesc, Arc<KernelBox>)>,
    /// The loaders the signed manifest lists (`None` for a linked pack:
    /// every loader it offers).
    declared_loaders: Option<Vec<String>>,
    // The root module is `'static`: the library stays mapped for the rest
    // of the process whether or not this value lives. Never unload it:
    // kernel vtables, error payloads and any threads the pack started point
    // into the library's code (docs/plugin-abi.md).
    module: PackModuleRef,
}

impl NativePack {
    /// Opens a verified native pack, checks its ABI version and asks it how
    /// well it suits `host`.
    ///
    /// # Errors
    ///
    /// [`Error::Pack`] naming the pack (`name@version`) when the manifest is
    /// not for a native pack or for a newer host, when the library does not
    /// load (not a pack, another ABI or interface version, layout
    /// mismatch), when the manifest's and the library's ABI versions
    /// disagree, when the library reports another name than its manifest,
    /// and when the pack scores 0 on this host ("pack X@v: scores 0 on this
    /// host: ...").
    pub fn load(pack: &VerifiedPack, host: &HostInfo) -> Result<Self> {
        let m = pack.manifest();
        let id = pack.id();
        let err = |detail: String| Error::Pack { pack: id.clone(), detail };
        if m.kind != PackKind::Native {
            return Err(err(format!("is a {:?} pack, not a native one", m.kind).to_lowercase()));
        }
        let host_version = Version::parse(HOST_VERSION).map_err(|e| err(format!("host version: {e}")))?;
        if !m.supports_host(&host_version) {
            return Err(err(format!("needs spinfer {} or newer (this is {host_version})", m.min_host_version)));
        }
        // The manifest's claim first: a pack that says it is for another
        // ABI is not opened at all.
        check_abi_version(m.abi_version).map_err(|e| err(format!("manifest: {e}")))?;

        // Open: the verified bytes from a sealed memfd, dlopen + abi_stable
        // checks + the module's own ABI version.
        let module = load_verified_bytes(pack).map_err(&err)?;
        if module.abi_version() != m.abi_version {
            return Err(err(format!(
                "the library declares pack ABI version {} but its manifest says {} (host ABI version {ABI_VERSION})",
                module.abi_version(),
                m.abi_version
            )));
        }

        // A pack is named by its signed manifest: a library that calls
        // itself something else (a pack `a-shadow` shipping cpu-simd's
        // library, to capture its pins and escape its exclusion) is refused.
        let reported = (module.name())().to_string();
        if reported != m.name {
            return Err(err(format!(
                "the library calls itself {:?} but its signed manifest names the pack {:?}; refused \
                 (a pack is named by its manifest)",
                reported.chars().take(80).collect::<String>(),
                m.name
            )));
        }

        let sha = &m.artefact.sha256;
        let provider_name = format!("{id}#{}", &sha[..sha.len().min(12)]);
        let signer = pack.signer().map_or_else(|| "unsigned".to_string(), ToString::to_string);
        let declared = Some(m.loaders.iter().map(|l| l.name.clone()).collect());
        Self::from_module(module, id, m.name.clone(), provider_name, host, &signer, declared)
    }

    /// A pack linked into this program, from its `instantiate_root_module()`
    /// (as abi_stable's `load_module_with` does for tests): there is no
    /// artefact to verify, the code is part of the binary. The ABI version
    /// and the score are checked as for [`NativePack::load`]; the provider
    /// is named `"{name}@linked"`.
    ///
    /// # Errors
    ///
    /// As [`NativePack::load`] for the ABI version and the score.
    pub fn linked(module: PackModuleRef, host: &HostInfo) -> Result<Self> {
        let name = (module.name())().to_string();
        let id = format!("{name}@linked");
        check_abi_version(module.abi_version()).map_err(|e| Error::Pack { pack: id.clone(), detail: e })?;
        Self::from_module(module, id.clone(), name, id, host, "linked", None)
    }

    /// Score and kernels of an opened module named `pack_name`.
    fn from_module(
        module: PackModuleRef,
        id: String,
        pack_name: String,
        provider_name: String,
        host: &HostInfo,
        signer: &str,
        declared_loaders: Option<Vec<String>>,
    ) -> Result<Self> {
        let score = (module.score())(host);
        if score == 0 {
            return Err(Error::Pack {
                pack: id,
                detail: format!(
                    "scores 0 on this host: it does not run on {} with cpu features {} and {} cores \
                     (the pack's log says why)",
                    host.host_version, host.cpu_features, host.n_cores
                ),
            });
        }
        let kernels: Vec<(KernelDesc, Arc<KernelBox>)> =
            (module.kernels())().into_iter().map(|k| (k.describe(), Arc::new(k))).collect();
        tracing::info!(provider = %provider_name, score, kernels = kernels.len(), signer, "loaded native pack");
        Ok(NativePack { provider_name, id, pack_name, score, kernels, declared_loaders, module })
    }

    /// `name@version` of the pack.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The pack's name (`"cpu-simd"`): its manifest's, which the library
    /// must report too.
    pub fn pack_name(&self) -> &str {
        &self.pack_name
    }

    /// Every kernel the pack offers, as it describes them.
    pub fn kernel_descs(&self) -> impl Iterator<Item = &KernelDesc> {
        self.kernels.iter().map(|(d, _)| d)
    }

    /// The engine-side name of a pack kernel: `"{pack}:{kernel}"`, e.g.
    /// `"cpu-simd:avx512/q4_1*q8_1"`, so pins can tell a pack's kernel from
    /// the built-in one of the same name.
    pub fn kernel_name(&self, desc: &KernelDesc) -> String {
        format!("{}:{}", self.pack_name, desc.name)
    }

    /// Pack kernel `k` (described by `d`) bound to the operation `desc`.
    fn bind(&self, d: &KernelDesc, k: &Arc<KernelBox>, desc: &MatmulDesc) -> Arc<dyn MatmulKernel> {
        Arc::new(PackKernel {
            name: self.kernel_name(d),
            pack: self.provider_name.clone(),
            kernel: Arc::clone(k),
            op: d.op,
            desc: *desc,
            prepared: RwLock::new(HashSet::new()),
            failed: AtomicBool::new(false),
        })
    }

    /// The model-file loaders the pack offers that its signed manifest
    /// lists (a linked pack's: all it offers), each named
    /// `"<pack>/<loader>"`; one it offers but does not list is logged and
    /// left out.
    pub fn loaders(&self) -> Vec<PackLoader> {
        let mut out = Vec::new();
        for l in (self.module.loaders())() {
            let name = l.name().to_string();
            if self.declared_loaders.as_ref().is_some_and(|d| !d.contains(&name)) {
                tracing::warn!(pack = %self.id, loader = %name, "loader not listed in the signed manifest: not used");
                continue;
            }
            out.push(PackLoader::new(&self.pack_name, l));
        }
        out
    }

    /// The root module (for tools that list loaders, predictors, ...).
    pub fn module(&self) -> PackModuleRef {
        self.module
    }
}

/// Opens the verified bytes of `pack` as a library (see the module docs):
/// once per content per process, from a sealed memfd.
fn load_verified_bytes(pack: &VerifiedPack) -> std::result::Result<PackModuleRef, String> {
    use sha2::Digest as _;
    static LOADED: OnceLock<Mutex<HashMap<[u8; 32], PackModuleRef>>> = OnceLock::new();
    let bytes = pack.artefact_bytes();
    // Hashed again here (milliseconds): the library is keyed by the bytes
    // this function loads, whatever the caller claims about them.
    let sha: [u8; 32] = sha2::Sha256::digest(bytes).into();
    let mut loaded = LOADED.get_or_init(Mutex::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(m) = loaded.get(&sha) {
        return Ok(*m);
    }
    let path = sealed_copy(bytes, &pack.manifest().name)
        .map_err(|e| format!("copying the verified library into a sealed memfd: {e}"))?;
    let module = load_pack(&path).map_err(|e| {
        if let Some(d) = e.details() {
            tracing::debug!(pack = %pack.id(), "load details: {d}");
        }
        // The error names /proc/self/fd/N; name the pack's file instead.
        e.to_string().replace(&path.display().to_string(), &pack.artefact_path().display().to_string())
    })?;
    loaded.insert(sha, module);
    Ok(module)
}

/// Copies `bytes` into a new memfd, seals it (no write, shrink or grow, no
/// further seals) and returns `/proc/self/fd/N` for `dlopen`.
///
/// The descriptor stays open for the life of the process, like the library
/// mapped from it (libraries are never unloaded): glibc recognises an
/// already loaded library by its path name, so a number reused by a later
/// memfd would alias the earlier library.
#[cfg(target_os = "linux")]
fn sealed_copy(bytes: &[u8], name: &str) -> std::io::Result<std::path::PathBuf> {
    use std::io::Write as _;
    use std::os::fd::IntoRawFd as _;

    use memfd::{FileSeal, MemfdOptions};
    let mfd = MemfdOptions::default()
        .allow_sealing(true)
        .close_on_exec(true)
        .create(format!("spinfer-pack-{name}"))
        .map_err(std::io::Error::other)?;
    let mut file = mfd.as_file();
    file.write_all(bytes)?;
    file.flush()?;
    mfd.add_seals(&[FileSeal::SealShrink, FileSeal::SealGrow, FileSeal::SealWrite, FileSeal::SealSeal])
        .map_err(std::io::Error::other)?;
    let fd = mfd.into_file().into_raw_fd();
    Ok(std::path::PathBuf::from(format!("/proc/self/fd/{fd}")))
}

/// Without `memfd` there is no file that cannot be swapped between
/// verification and `dlopen`: native packs are refused.
#[cfg(not(target_os = "linux"))]
fn sealed_copy(_bytes: &[u8], _name: &str) -> std::io::Result<std::path::PathBuf> {
    Err(std::io::Error::other("native packs are loaded from a sealed memfd, which needs Linux"))
}

impl KernelProvider for NativePack {
    fn name(&self) -> &str {
        &self.provider_name
    }

    fn score(&self) -> u32 {
        self.score
    }

    /// The pack's kernels for `desc`, by form. Dense: its `MAT_MUL`
    /// kernels of the weight type; for ternary weights (TQ1_0, TQ2_0) its
    /// `TERNARY_MAT_MUL` ones, and for TQ2_0 also its I2_S kernels, fed an
    /// exact repack of the weights (`I2sFromTq2_0`). Gathered rows: its
    /// `GATHERED_ROW_MAT_VEC` kernels; gathered columns: its
    /// `GATHERED_COLUMN_AXPY` ones.
    fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
        let (w, a) = (abi_weight_type(desc.wtype), abi_act_type(desc.act));
        let ternary = matches!(desc.wtype, GgmlType::TQ1_0 | GgmlType::TQ2_0);
        let op_serves = |op: Op| match desc.form {
            Form::Dense => op == Op::MAT_MUL || (ternary && op == Op::TERNARY_MAT_MUL),
            Form::GatheredRows => op == Op::GATHERED_ROW_MAT_VEC,
            Form::GatheredColumns => op == Op::GATHERED_COLUMN_AXPY,
        };
        let serves =
            |d: &KernelDesc| d.act == a && d.accepts_shape(desc.rows, desc.cols) && op_serves(d.op) && d.wtype == w;
        let i2s = |d: &KernelDesc| {
            desc.wtype == GgmlType::TQ2_0
                && desc.form == Form::Dense
                && d.op == Op::TERNARY_MAT_MUL
                && d.wtype == WeightType::I2_S
                && d.act == a
                && d.accepts_shape(desc.rows, desc.cols)
        };
        let mut out: Vec<Arc<dyn MatmulKernel>> =
            self.kernels.iter().filter(|(d, _)| serves(d)).map(|(d, k)| self.bind(d, k, desc)).collect();
        for (d, k) in self.kernels.iter().filter(|(d, _)| i2s(d)) {
            out.push(Arc::new(I2sFromTq2_0::new(self.bind(d, k, desc), self.provider_name.clone(), desc.cols)));
        }
        out
    }
}

impl SparsityProvider for NativePack {
    fn name(&self) -> &str {
        KernelProvider::name(self)
    }

    fn score(&self) -> u32 {
        KernelProvider::score(self)
    }

    fn predictors(&self, spec: &PredictorSpec) -> Vec<PredictorBox> {
        (self.module.predictors())(spec).into_iter().collect()
    }

    fn cache_policies(&self, capacity: u64) -> Vec<CachePolicyBox> {
        (self.module.cache_policies())(capacity).into_iter().collect()
    }
}

/// A pack kernel bound to one operation descriptor, as a `spinfer-kernels`
/// [`MatmulKernel`]: calls cross the ABI to [`spinfer_plugin_api::Kernel::run`].
///
/// The host's thread pool does not cross the ABI: the pack computes on the
/// calling thread (a known cost, documented with the packs).
pub struct PackKernel {
    name: String,
    pack: String,
    kernel: Arc<KernelBox>,
    /// What the pack kernel serves: `MAT_MUL`/`TERNARY_MAT_MUL` (dense),
    /// `GATHERED_ROW_MAT_VEC` (gathered rows, through the ABI's
    /// `run_sparse`) or `GATHERED_COLUMN_AXPY` (gathered columns, likewise).
    op: Op,
    desc: MatmulDesc,
    /// Weight slices (address, length) already given to `prepare`.
    prepared: RwLock<HashSet<(usize, usize)>>,
    /// Set at the first error, so it is logged once.
    failed: AtomicBool,
}

impl PackKernel {
    /// True once a call returned an error (the engine should stop using it).
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    fn error(&self, what: &str, e: &PackError) -> KernelError {
        if !self.failed.swap(true, Ordering::Relaxed) {
            tracing::error!(kernel = %self.name, pack = %self.pack, "pack kernel failed in {what}: {e}");
        }
        KernelError::Pack { pack: self.pack.clone(), kernel: self.name.clone(), detail: format!("{what}: {e}") }
    }

    /// `prepare` once per weight slice of `rows` rows (the pack may key
    /// uploads by address).
    fn ensure_prepared(&self, w: &[u8], rows: usize) -> Result<(), KernelError> {
        let key = (w.as_ptr() as usize, w.len());
        if self.prepared.read().unwrap_or_else(PoisonError::into_inner).contains(&key) {
            return Ok(());
        }
        let mut set = self.prepared.write().unwrap_or_else(PoisonError::into_inner);
        if set.contains(&key) {
            return Ok(());
        }
        self.kernel.prepare(w.into(), rows, self.desc.cols).into_result().map_err(|e| self.error("prepare", &e))?;
        set.insert(key);
        Ok(())
    }
}

impl MatmulKernel for PackKernel {
    fn name(&self) -> &str {
        &self.name
    }

    /// The call in the pack kernel's own form (others answer
    /// `NotOffered`).
    fn run(&self, pool: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
        let MatmulCall { w, select, x, n_tokens, out, .. } = call;
        match (self.op, select) {
            (Op::GATHERED_ROW_MAT_VEC, Select::Rows(idx)) => self.run_rows(pool, w, idx, x, n_tokens, out),
            (Op::GATHERED_COLUMN_AXPY, Select::Columns(idx)) => self.run_columns(pool, w, idx, x, n_tokens, out),
            (Op::MAT_MUL | Op::TERNARY_MAT_MUL, Select::All) => self.run_dense(pool, w, x, n_tokens, out),
            _ => Err(not_offered(self, select.form())),
        }
    }
}

impl PackKernel {
    /// Pack kernels are single-threaded (the pool does not cross the ABI),
    /// so the work is spread over the host's pool here: weight rows for up
    /// to `ROW_SPLIT_TOKENS` tokens (decode, including the fast mode's
    /// two activation planes), tokens for a larger batch (prefill). Each
    /// thread writes a disjoint part of `out`.
    fn run_dense(
        &self,
        pool: &ThreadPool,
        w: &[u8],
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> spinfer_kernels::Result<()> {
        let (rows, cols) = (self.desc.rows, self.desc.cols);
        if !w.len().is_multiple_of(rows.max(1)) || x.len() != n_tokens * cols || out.len() != n_tokens * rows {
            return Err(KernelError::Shape {
                op: "pack kernel",
                detail: format!(
                    "{n_tokens} tokens of {rows}x{cols}: {} weight bytes, {} inputs, {} outputs",
                    w.len(),
                    x.len(),
                    out.len()
                ),
            });
        }
        let row_bytes = w.len() / rows.max(1);
        let out_ptr = SyncPtr::new(out.as_mut_ptr());
        let split_rows = n_tokens <= ROW_SPLIT_TOKENS;
        first_error(pool, |i, n| {
            // A few tokens split rows (in tiles of 16), a batch splits tokens.
            let (w_part, x_part, t_len, r_len, o_start) = if split_rows {
                let r = chunk_aligned(rows, i, n, 16);
                (&w[r.start * row_bytes..r.end * row_bytes], x, n_tokens, r.len(), r.start)
            } else {
                let t = chunk(n_tokens, i, n);
                (w, &x[t.start * cols..t.end * cols], t.len(), rows, t.start * rows)
            };
            if t_len == 0 || r_len == 0 {
                return Ok(());
            }
            let run = |o: &mut [f32]| {
                self.ensure_prepared(w_part, r_len).and_then(|()| {
                    self.kernel
                        .run(w_part.into(), x_part.into(), t_len, r_len, cols, RSliceMut::from_mut_slice(o))
                        .into_result()
                        .map_err(|e| self.error("run", &e))
                })
            };
            if split_rows {
                // SAFETY: rows `o_start..+r_len` of each token lie inside
                // `out` (`n_tokens x rows`), which outlives the broadcast,
                // and the threads' row ranges are disjoint.
                unsafe { into_columns(out_ptr, rows, o_start, r_len, t_len, run) }
            } else {
                // SAFETY: whole token rows `o_start..+t_len * rows`, inside
                // `out` and disjoint across threads.
                run(unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(o_start), t_len * r_len) })
            }
        })
    }

    /// The gathered-row form (a `GATHERED_ROW_MAT_VEC` kernel): the row list is split over the host's pool,
    /// each thread asking the pack for its part through `run_sparse`.
    fn run_rows(
        &self,
        pool: &ThreadPool,
        w: &[u8],
        idx: &[u32],
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> spinfer_kernels::Result<()> {
        let (rows, cols, k) = (self.desc.rows, self.desc.cols, idx.len());
        if !w.len().is_multiple_of(rows.max(1)) || x.len() != n_tokens * cols || out.len() != n_tokens * k {
            return Err(KernelError::Shape {
                op: "pack gathered-row kernel",
                detail: format!(
                    "{n_tokens} tokens of {k} rows of {rows}x{cols}: {} weight bytes, {} inputs, {} outputs",
                    w.len(),
                    x.len(),
                    out.len()
                ),
            });
        }
        self.ensure_prepared(w, rows)?;
        let out_ptr = SyncPtr::new(out.as_mut_ptr());
        first_error(pool, |i, n| {
            let r = chunk_aligned(k, i, n, 4);
            if r.is_empty() {
                return Ok(());
            }
            let part_idx = &idx[r.clone()];
            let run = |o: &mut [f32]| {
                self.kernel
                    .run_sparse(w.into(), x.into(), n_tokens, rows, cols, part_idx.into(), RSliceMut::from_mut_slice(o))
                    .into_result()
                    .map_err(|e| self.error("run_sparse", &e))
            };
            // SAFETY: outputs `r` of each token lie inside `out`
            // (`n_tokens x k`, `r.end <= k`), which outlives the broadcast,
            // and the threads' ranges are disjoint.
            unsafe { into_columns(out_ptr, k, r.start, r.len(), n_tokens, run) }
        })
    }

    /// The gathered-column AXPY (a `GATHERED_COLUMN_AXPY` kernel): the rows of `W` are split over the host's
    /// pool in ranges starting at multiples of 32, each thread asking the
    /// pack for its range (a weight slice of its own, prepared once)
    /// through `run_sparse`.
    fn run_columns(
        &self,
        pool: &ThreadPool,
        w: &[u8],
        idx: &[u32],
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> spinfer_kernels::Result<()> {
        let (rows, cols, k) = (self.desc.rows, self.desc.cols, idx.len());
        if rows == 0 || !w.len().is_multiple_of(rows) || x.len() != n_tokens * k || out.len() != n_tokens * rows {
            return Err(KernelError::Shape {
                op: "pack gathered-column kernel",
                detail: format!(
                    "{n_tokens} tokens of {k} columns of {rows}x{cols}: {} weight bytes, {} inputs, {} outputs",
                    w.len(),
                    x.len(),
                    out.len()
                ),
            });
        }
        let row_bytes = w.len() / rows;
        let out_ptr = SyncPtr::new(out.as_mut_ptr());
        first_error(pool, |i, n| {
            let r = chunk_aligned(rows, i, n, 32);
            if r.is_empty() {
                return Ok(());
            }
            let part = &w[r.start * row_bytes..r.end * row_bytes];
            self.ensure_prepared(part, r.len())?;
            let run = |o: &mut [f32]| {
                self.kernel
                    .run_sparse(
                        part.into(),
                        x.into(),
                        n_tokens,
                        r.len(),
                        cols,
                        idx.into(),
                        RSliceMut::from_mut_slice(o),
                    )
                    .into_result()
                    .map_err(|e| self.error("run_sparse", &e))
            };
            // SAFETY: rows `r` of each token lie inside `out` (`n_tokens x
            // rows`, `r.end <= rows`), which outlives the broadcast, and
            // the threads' ranges are disjoint.
            unsafe { into_columns(out_ptr, rows, r.start, r.len(), n_tokens, run) }
        })
    }
}

/// Runs `f` on every thread of `pool` and returns the first error any of
/// them met.
fn first_error(
    pool: &ThreadPool,
    f: impl Fn(usize, usize) -> spinfer_kernels::Result<()> + Sync,
) -> spinfer_kernels::Result<()> {
    let first = std::sync::Mutex::new(None);
    pool.broadcast(&|i, n| {
        if let Err(e) = f(i, n) {
            first.lock().unwrap_or_else(PoisonError::into_inner).get_or_insert(e);
        }
    });
    match first.into_inner().unwrap_or_else(PoisonError::into_inner) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Lets `run` write `n_tokens x len` values and puts token `t`'s at
/// `out[t * stride + start..][..len]`: in place for one token, through a
/// per-thread buffer for several.
///
/// # Safety
///
/// `out + t * stride + start .. + len` must be valid for writes for every
/// `t < n_tokens`, and no other thread may touch those ranges meanwhile.
unsafe fn into_columns(
    out: SyncPtr<f32>,
    stride: usize,
    start: usize,
    len: usize,
    n_tokens: usize,
    run: impl FnOnce(&mut [f32]) -> spinfer_kernels::Result<()>,
) -> spinfer_kernels::Result<()> {
    if n_tokens == 1 {
        // SAFETY: the caller's range for token 0.
        return run(unsafe { std::slice::from_raw_parts_mut(out.get().add(start), len) });
    }
    PART.with(|part| {
        let mut part = part.borrow_mut();
        part.clear();
        part.resize(n_tokens * len, 0.0);
        run(&mut part)?;
        for (t, p) in part.chunks_exact(len).enumerate() {
            // SAFETY: the caller's range for token `t < n_tokens`.
            unsafe { std::slice::from_raw_parts_mut(out.get().add(t * stride + start), len) }.copy_from_slice(p);
        }
        Ok(())
    })
}
