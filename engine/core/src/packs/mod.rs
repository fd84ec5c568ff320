//! Kernel packs as kernel providers.
//!
//! A pack directory is first checked by `spinfer-registry` (`verify_pack`:
//! manifest, signature, artefact hash), which yields a
//! [`spinfer_registry::VerifiedPack`]; only then does the engine open the
//! artefact. [`native::NativePack`] loads a native (`cdylib`) pack following
//! ggml's backend order (verify → open → ABI version → score → register) and
//! serves its kernels behind the engine's [`crate::registry::KernelProvider`].

pub mod native;

pub use native::{NativePack, PackKernel, host_info};

#[cfg(feature = "wasm")]
mod wasm;
#[cfg(not(feature = "wasm"))]
#[path = "wasm_disabled.rs"]
mod wasm;
mod wasm_types;
pub use wasm::WasmPack;
pub use wasm_types::{MAX_WASM_TIMEOUT_MS, WASM_ABI_VERSION, WasmFault, WasmLimits};
