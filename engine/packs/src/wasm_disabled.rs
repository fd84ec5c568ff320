//! Stand-in for `wasm.rs` when the engine is built without the `wasm`
//! feature: the same public types, and [`WasmPack::load`] refuses every pack.

use std::sync::Arc;

use spinfer_kernels::kernel::{MatmulDesc, MatmulKernel};
use spinfer_registry::VerifiedPack;

use super::wasm_types::{WasmFault, WasmLimits};
use crate::{Error, Result};
use spinfer_kernel_select::registry::KernelProvider;

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
