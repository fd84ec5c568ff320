//! Kernel packs as kernel providers.
//!
//! A pack directory is first checked by `spinfer-registry` (`verify_pack`:
//! manifest, signature, artefact hash), which yields a
//! [`spinfer_registry::VerifiedPack`]; only then does the engine open the
//! artefact. [`native::NativePack`] loads a native (`cdylib`) pack following
//! ggml's backend order (verify → open → ABI version → score → register) and
//! serves its kernels behind the kernel registry's `KernelProvider`;
//! [`WasmPack`] does the same for a sandboxed WebAssembly pack, and
//! [`CudaPack`] for a pack of CUDA C kernels (compiled by NVRTC, run on the
//! GPU).
//! [`load_registry`] does all of this for an operator's settings.
//!
//! Architecture invariant: this is the only crate that opens a pack's
//! artefact (links `libloading`/`memfd` or compiles WASM with wasmtime), and
//! it only opens bytes that `spinfer-registry` verified.

mod cuda;
mod error;
mod host;
mod i2s;
mod load;
mod loaders;
pub mod native;
pub mod settings;
mod spot;

pub use cuda::{CudaPack, MAX_SOURCE_BYTES as MAX_CUDA_SOURCE_BYTES, cuda_format};
pub use error::{Error, Result};
pub use host::{HOST_VERSION, abi_act_type, abi_weight_type, host_info};
pub use load::{LoadedPacks, PackStatus, load_packs, load_registry};
pub use loaders::{PackLoader, PackModel};
pub use native::{NativePack, PackKernel};

#[cfg(feature = "wasm")]
mod wasm;
#[cfg(not(feature = "wasm"))]
#[path = "wasm_disabled.rs"]
mod wasm;
mod wasm_types;
pub use wasm::WasmPack;
pub use wasm_types::{MAX_WASM_TIMEOUT_MS, WASM_ABI_VERSION, WasmFault, WasmLimits};
#[cfg(all(feature = "fixtures", feature = "wasm"))]
pub mod fixtures;
