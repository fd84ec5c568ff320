//! Types shared by the WASM host (`wasm.rs`) and its stand-in without the
//! `wasm` feature (`wasm_disabled.rs`), so callers need no `cfg`.

/// The module ABI this host implements; a module (and its `pack.toml`
/// `abi_version`) must declare the same.
pub const WASM_ABI_VERSION: u32 = 1;

/// Upper bound of [`WasmLimits::timeout_ms`]: one minute per kernel call
/// (a larger budget is refused, so a looping module is always stopped).
pub const MAX_WASM_TIMEOUT_MS: u64 = 60_000;

/// Resource limits for one WASM pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WasmLimits {
    /// Cap on the module's linear memory (weights are resident there, so
    /// this must cover the weights the pack serves plus I/O buffers).
    pub max_memory_bytes: usize,
    /// Wall-clock budget of one kernel call (or one weight upload), at
    /// most [`MAX_WASM_TIMEOUT_MS`].
    pub timeout_ms: u64,
    /// Largest module accepted, in bytes (checked before compiling; the
    /// registry checks it before reading the file).
    pub max_module_bytes: usize,
    /// Fuel (roughly: wasm instructions) per call; `None` = unmetered.
    /// Metering costs some speed.
    pub fuel: Option<u64>,
}

impl Default for WasmLimits {
    /// 4 GiB (all of wasm32's address space), 10 s per call, 64 MiB
    /// modules, no fuel.
    fn default() -> Self {
        Self {
            max_memory_bytes: usize::try_from(4u64 << 30).unwrap_or(usize::MAX),
            timeout_ms: 10_000,
            max_module_bytes: 64 << 20,
            fuel: None,
        }
    }
}

/// Why a pack's module failed (and was disabled).
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
    /// A sampled output disagreed with the reference kernel (checked on
    /// every call: a stateful module can turn wrong after its first check).
    #[error("computed a wrong result: {0}")]
    WrongResult(String),
}
