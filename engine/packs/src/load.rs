//! Building the kernel registry from the operator's pack settings: discover,
//! verify, refuse duplicates and downgrades, open, check the ABI, score,
//! register. The only code in spinfer that opens a pack's artefact.

use std::path::PathBuf;
use std::sync::Arc;

use spinfer_kernel_select::registry::{KernelProvider, KernelRegistry, SparsityProvider};
use spinfer_kernel_select::tuning::HistoryStore;
use spinfer_registry::{InstallRecord, PackKind, VerifiedPack, VerifyLimits, discover, verify_pack_with};

use crate::loaders::PackLoader;
use crate::settings::{CudaSection, KernelsSection, PacksSection, WasmSection};
use crate::{CudaPack, Error, NativePack, Result, WasmLimits, WasmPack, host_info};

/// The outcome of one discovered pack.
#[derive(Clone, Debug)]
pub struct PackStatus {
    pub dir: PathBuf,
    /// The provider name (`name@version#hash`) it registered as, or why it
    /// was skipped.
    pub outcome: std::result::Result<String, String>,
}

/// The kernel registry an operator config describes: built-in kernels,
/// verified packs from `[packs]`, pins, exclusions and the history store.
///
/// Per pack found: verify (each file read once, signature before parsing,
/// the signer's right to the name; `[wasm] max_module_mb` caps a module
/// before it is read) → refuse every pack whose manifest name another
/// verified pack also has (naming both directories) → `[kernels] exclude`
/// by manifest name → the install record (downgrades and stripped
/// signatures, by name; a downgrade only through `[packs]
/// pinned_versions`) → open the verified bytes → ABI check → score →
/// register.
pub fn load_registry(
    packs: &PacksSection,
    kernels: &KernelsSection,
    wasm: &WasmSection,
    cuda: &CudaSection,
) -> Result<(KernelRegistry, Vec<PackStatus>)> {
    let loaded = load_packs(packs, kernels, wasm, cuda)?;
    Ok((loaded.registry, loaded.status))
}

/// What loading the operator's packs gives.
pub struct LoadedPacks {
    /// Built-in kernels, every loaded pack's kernels, predictors and cache
    /// policies, pins, exclusions and the history.
    pub registry: KernelRegistry,
    /// The model-file loaders the native packs offer (and list in their
    /// manifests), in discovery order.
    pub loaders: Vec<PackLoader>,
    /// What happened to each pack found.
    pub status: Vec<PackStatus>,
}

/// As [`load_registry`], keeping the packs' model-file loaders too.
pub fn load_packs(
    packs: &PacksSection,
    kernels: &KernelsSection,
    wasm: &WasmSection,
    cuda: &CudaSection,
) -> Result<LoadedPacks> {
    let mut registry = KernelRegistry::builtin();
    for (op, kernel) in &kernels.pin {
        registry.pin(op, kernel);
    }
    for name in &kernels.exclude {
        registry.exclude(name);
    }
    if let Some(h) = &packs.history {
        // A store another process held too long is not set at all (it
        // already said so, once): the registry then explains its choices as
        // having no history, not as measured on an empty one.
        let store = HistoryStore::open(h)?;
        if store.is_loaded() {
            registry.set_history(store);
        }
    }
    let policy = packs.trust_policy()?;
    let host = host_info();
    let mb = |v: u64| usize::try_from(v.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
    let limits = WasmLimits {
        max_memory_bytes: mb(wasm.max_memory_mb),
        timeout_ms: wasm.timeout_ms,
        max_module_bytes: mb(wasm.max_module_mb),
        fuel: wasm.fuel,
    };
    let verify_limits =
        VerifyLimits { max_wasm_bytes: wasm.max_module_mb.saturating_mul(1 << 20), ..VerifyLimits::default() };

    // 1. Verify everything found (nothing is loaded yet).
    let mut found: Vec<(PathBuf, std::result::Result<VerifiedPack, String>)> = Vec::new();
    for entry in discover(&packs.dirs) {
        match entry {
            Ok(dir) => {
                let verified = verify_pack_with(&dir, &policy, &verify_limits).map_err(|e| e.to_string());
                found.push((dir, verified));
            }
            Err(e) => found.push((PathBuf::new(), Err(format!("pack discovery: {e}")))),
        }
    }

    // 2. One name, one pack: two verified packs with the same manifest name
    // are both refused (which one is meant is not for the engine to guess).
    let mut dirs_of: std::collections::BTreeMap<String, Vec<PathBuf>> = Default::default();
    for (dir, v) in &found {
        if let Ok(p) = v {
            dirs_of.entry(p.manifest().name.clone()).or_default().push(dir.clone());
        }
    }
    for (dir, v) in &mut found {
        let Ok(p) = v else { continue };
        let dirs = &dirs_of[&p.manifest().name];
        if dirs.len() > 1 {
            let others: Vec<String> = dirs.iter().filter(|d| *d != dir).map(|d| d.display().to_string()).collect();
            *v = Err(format!(
                "pack {} at {} is refused: pack {} at {} has the same name (one name, one pack: remove or rename one)",
                p.id(),
                dir.display(),
                p.manifest().name,
                others.join(", ")
            ));
        }
    }

    // 3. The install record, opened only when there is a pack to check.
    let any = found.iter().any(|(_, v)| v.is_ok());
    let mut record: std::result::Result<Option<InstallRecord>, String> = Ok(None);
    if any {
        record = match (packs.install_record_path(), packs.install_witness_path()) {
            (Some(r), Some(w)) => InstallRecord::open_with_witness(r, w).map(Some).map_err(|e| e.to_string()),
            _ => {
                tracing::warn!(
                    "no data directory (neither [packs] install_record, XDG_DATA_HOME nor HOME is set): \
                     pack downgrades cannot be detected across runs"
                );
                Ok(None)
            }
        };
        if let Err(e) = &record {
            tracing::error!("{e}; every pack is refused until this is resolved");
        }
    }

    // 4. Load, in discovery order.
    let (mut status, mut loaders) = (Vec::new(), Vec::new());
    for (dir, verified) in found {
        let outcome = verified.map_err(Error::InvalidArgument).and_then(|pack| {
            let name = &pack.manifest().name;
            if kernels.exclude.contains(name) {
                return Err(Error::Pack { pack: pack.id(), detail: "excluded by [kernels] exclude".into() });
            }
            match record.as_mut() {
                Ok(Some(record)) => record.check_and_record(&pack, packs.pinned_versions.get(name))?,
                Ok(None) => {}
                Err(e) => return Err(Error::Pack { pack: pack.id(), detail: e.clone() }),
            }
            // A native pack offers kernels and may offer predictors and
            // cache policies: it is registered in both roles.
            Ok(match pack.manifest().kind {
                PackKind::Native => {
                    let native = Arc::new(NativePack::load(&pack, &host)?);
                    loaders.extend(native.loaders());
                    (Arc::clone(&native) as Arc<dyn KernelProvider>, Some(native as Arc<dyn SparsityProvider>))
                }
                PackKind::Wasm => (Arc::new(WasmPack::load(&pack, limits)?) as Arc<dyn KernelProvider>, None),
                PackKind::Cuda => (Arc::new(CudaPack::load(&pack, cuda.budget_mb)?) as Arc<dyn KernelProvider>, None),
            })
        });
        match outcome {
            Ok((provider, sparsity)) => {
                if let Some(s) = sparsity {
                    registry.add_sparsity_provider(s);
                }
                tracing::info!(pack = provider.name(), "registered kernel pack");
                status.push(PackStatus { dir, outcome: Ok(provider.name().to_string()) });
                registry.add_provider(provider);
            }
            Err(e) => {
                let msg = match e {
                    Error::InvalidArgument(m) => m,
                    other => other.to_string(),
                };
                tracing::warn!(dir = %dir.display(), "pack skipped: {msg}");
                status.push(PackStatus { dir, outcome: Err(msg) });
            }
        }
    }
    Ok(LoadedPacks { registry, loaders, status })
}
