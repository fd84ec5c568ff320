//! Stand-in for `wasm.rs` when the engine is built without the `wasm`
//! feature: the same public types, and [`WasmPack::load`] refuses every pack.

use std::sync::Arc;

use spinfer_kernels::kernel::{MatmulDesc, MatmulKernel};
use spinfer_registry::VerifiedPack;

use crate::registry::KernelProvider;
use crate::{Error, Result};

/// The module ABI the `wasm` feature implements.
pub const WASM_ABI_VERSION: u32 = 1;

/// Resource limits for one WASM pack (unused without the `wasm` feature).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WasmLimits {
    pub max_memory_bytes: usize,
    pub timeout_ms: u64,
    pub fuel: Option<u64>,
}

impl Default for WasmLimits {
    fn default() -> Self {
        Self { max_memory_bytes: usize::try_from(4u64 << 30).unwrap_or(usize::MAX), timeout_ms: 10_000, fuel: None }
    }
}

/// Why a pack's module failed (never produced without the `wasm` feature).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WasmFault {
    #[error("timed out after {timeout_ms} ms (epoch interrupt)")]
    Timeout { timeout_ms: u64 },
    #[error("ran out of fuel ({fuel} units)")]
    OutOfFuel { fuel: u64 },
    #[error("memory limit: the module asked for {wanted} bytes of linear memory, the cap is {cap}")]
    MemoryLimit { wanted: usize, cap: usize },
    #[error("trapped: {0}")]
    Trap(String),
    #[error("returned status {0}")]
    Status(i32),
}

/// A WASM kernel pack; cannot be constructed without the `wasm` feature.
pub struct WasmPack {
    name: String,
}

impl WasmPack {
    /// Always fails: this build has no WebAssembly runtime.
    pub fn load(pack: &VerifiedPack, _limits: WasmLimits) -> Result<Self> {
        Err(Error::Pack {
            pack: pack.manifest().name.clone(),
            detail: "wasm packs need the `wasm` feature, which this build of spinfer does not include".into(),
        })
    }

    pub fn is_disabled(&self) -> bool {
        true
    }

    pub fn fault(&self) -> Option<WasmFault> {
        None
    }

    pub fn weight_uploads(&self) -> usize {
        0
    }

    pub fn limits(&self) -> WasmLimits {
        WasmLimits::default()
    }

    pub fn kernel_names(&self) -> Vec<String> {
        Vec::new()
    }
}

impl KernelProvider for WasmPack {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self) -> u32 {
        0
    }

    fn kernels_for(&self, _desc: &MatmulDesc) -> Vec<Arc<dyn MatmulKernel>> {
        Vec::new()
    }
}
