//! The kernel seam: every matvec/matmul the model runs is described by an
//! operation descriptor ([`MatmulDesc`]: weight type, activation format,
//! shape) and resolved, once at load time, to a kernel object through a
//! [`KernelRegistry`]. Providers offer kernels; the registry picks the
//! highest-scoring provider's best candidate unless a pin says otherwise.
//!
//! Today one provider is built in (`cpu-builtin`: the scalar reference and
//! the AVX2/AVX-512 kernels of `spinfer-kernels`). Kernel packs (native,
//! WASM, CUDA) become further providers behind the same seam.

use std::collections::BTreeMap;
use std::sync::Arc;

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_kernels::kernel::{ActType, MatmulDesc, MatmulKernel};

use crate::{Error, Result};

/// Something that can offer kernels for operations (ggml-backend's "reg").
pub trait KernelProvider: Send + Sync {
    /// Stable provider name, e.g. `"cpu-builtin"`.
    fn name(&self) -> &str;

    /// How well this provider suits the host; 0 = unsupported. Higher wins.
    fn score(&self) -> u32;

    /// Kernels serving `desc`, best first; empty if unsupported.
    fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>>;
}

/// The provider built into the engine: `spinfer-kernels` on this CPU.
pub struct CpuBuiltin {
    features: CpuFeatures,
}

impl CpuBuiltin {
    pub fn new() -> Self {
        Self { features: CpuFeatures::detect() }
    }

    pub fn features(&self) -> CpuFeatures {
        self.features
    }
}

impl Default for CpuBuiltin {
    fn default() -> Self {
        Self::new()
    }
}

impl KernelProvider for CpuBuiltin {
    fn name(&self) -> &str {
        "cpu-builtin"
    }

    fn score(&self) -> u32 {
        // Always usable: the scalar reference runs anywhere. External packs
        // that score higher take precedence.
        1
    }

    fn kernels_for(&self, desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
        spinfer_kernels::kernel::candidates(desc, &self.features).into_iter().map(Arc::from).collect()
    }
}

/// Why a kernel was chosen (reported by `spinfer inspect` and later
/// `spinfer kernels`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// The operator pinned this kernel by name.
    Pinned,
    /// The best candidate of the highest-scoring provider.
    BestScore,
}

/// A resolved operation.
#[derive(Clone)]
pub struct Resolved {
    pub kernel: Arc<dyn MatmulKernel>,
    pub provider: String,
    pub choice: Choice,
}

/// Resolves operation descriptors to kernels.
pub struct KernelRegistry {
    providers: Vec<Arc<dyn KernelProvider>>,
    /// Kernel-name pins keyed by `"<wtype>*<act>"` (e.g. `"q4_1*q8_1"`).
    pins: BTreeMap<String, String>,
}

impl KernelRegistry {
    /// A registry holding only the built-in CPU provider.
    pub fn builtin() -> Self {
        Self { providers: vec![Arc::new(CpuBuiltin::new())], pins: BTreeMap::new() }
    }

    pub fn add_provider(&mut self, p: Arc<dyn KernelProvider>) {
        self.providers.push(p);
    }

    /// Forces the kernel named `kernel` for weight/activation pair `key`
    /// (`"q4_1*q8_1"`); resolution fails if no provider offers it.
    pub fn pin(&mut self, key: impl Into<String>, kernel: impl Into<String>) {
        self.pins.insert(key.into(), kernel.into());
    }

    /// Every kernel any usable provider offers for `desc`: providers by
    /// descending score (ties in registration order), each provider's
    /// kernels best first. The input of benchmark-driven selection.
    pub fn candidates(&self, desc: &MatmulDesc) -> Vec<(String, Arc<dyn MatmulKernel>)> {
        let mut providers: Vec<_> = self.providers.iter().filter(|p| p.score() > 0).collect();
        providers.sort_by_key(|p| std::cmp::Reverse(p.score()));
        providers.into_iter().flat_map(|p| p.kernels_for(desc).into_iter().map(|k| (p.name().to_string(), k))).collect()
    }

    /// Picks the kernel for `desc`.
    pub fn resolve(&self, desc: &MatmulDesc) -> Result<Resolved> {
        let key = pin_key(desc.wtype, desc.act);
        let mut providers: Vec<_> = self.providers.iter().filter(|p| p.score() > 0).collect();
        // Highest score first; ties keep registration order (deterministic).
        providers.sort_by_key(|p| std::cmp::Reverse(p.score()));
        if let Some(want) = self.pins.get(&key) {
            for p in &providers {
                if let Some(k) = p.kernels_for(desc).into_iter().find(|k| k.name() == want) {
                    return Ok(Resolved { kernel: k, provider: p.name().to_string(), choice: Choice::Pinned });
                }
            }
            return Err(Error::NoKernel { op: format!("{} (pinned kernel '{want}' is not offered)", describe(desc)) });
        }
        for p in &providers {
            if let Some(k) = p.kernels_for(desc).into_iter().next() {
                return Ok(Resolved { kernel: k, provider: p.name().to_string(), choice: Choice::BestScore });
            }
        }
        Err(Error::NoKernel { op: describe(desc) })
    }
}

/// `"q4_1*q8_1"`: the key pins and reports use for a weight/activation pair.
pub fn pin_key(w: spinfer_kernels::GgmlType, act: ActType) -> String {
    format!("{}*{}", w.name(), act.name())
}

/// Human-readable operation name, e.g. `"matmul q4_1*q8_1 1536x576"`.
pub fn describe(desc: &MatmulDesc) -> String {
    format!("matmul {} {}x{}", pin_key(desc.wtype, desc.act), desc.rows, desc.cols)
}
