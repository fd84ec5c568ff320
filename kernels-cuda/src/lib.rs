//! CUDA for spinfer: device probing today, kernels in a later issue.
//!
//! Feature `cuda` (off by default) builds the real probe on `cudarc` with
//! `dynamic-loading`: nothing is linked at build time, so the crate builds
//! without a CUDA toolkit, and `libcuda` is opened at run time. Without the
//! feature a candle-style shim answers [`CudaUnavailable::NotCompiled`].
//!
//! * [`probe`] describes device 0 or says why there is none;
//! * [`score`] turns that into a kernel-provider score: 0 plus the reason
//!   when CUDA is unavailable (the host skips the provider).
//!
//! Neither creates a CUDA context: `cudarc::driver::CudaContext::new(0)`
//! panics on a machine without a driver, so the probe checks that the
//! driver library is present first and then only queries device
//! attributes.

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(not(feature = "cuda"))]
mod cuda_disabled;

#[cfg(feature = "cuda")]
use cuda as imp;
#[cfg(not(feature = "cuda"))]
use cuda_disabled as imp;

/// Score of a usable CUDA device (above every CPU provider; ggml likewise
/// prefers a GPU backend over any CPU variant).
pub const SCORE_CUDA: u32 = 1 << 10;

/// What [`probe`] found: CUDA device 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal (always 0 today).
    pub ordinal: usize,
    /// Devices the driver reports.
    pub device_count: usize,
    /// Device name, e.g. `"NVIDIA H100 80GB HBM3"`.
    pub name: String,
    /// Total device memory in bytes.
    pub total_memory: usize,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Driver API version as reported by the driver (e.g. 12080).
    pub driver_version: i32,
}

impl std::fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.compute_capability;
        write!(
            f,
            "cuda:{} {} ({:.1} GiB, compute capability {major}.{minor}, driver api {}, {} device(s))",
            self.ordinal,
            self.name,
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.driver_version,
            self.device_count
        )
    }
}

/// Why CUDA cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CudaUnavailable {
    /// This build has no CUDA support.
    #[error("cuda support is not compiled in (build with feature `{feature}`)")]
    NotCompiled { feature: &'static str },
    /// The CUDA driver library (`libcuda`) cannot be opened.
    #[error("the cuda driver library (libcuda) was not found: no nvidia driver installed")]
    NoDriver,
    /// The driver loaded but reports no device.
    #[error("the cuda driver reports no device")]
    NoDevice,
    /// A driver call failed.
    #[error("cuda driver error in {call}: {detail}")]
    Driver { call: &'static str, detail: String },
}

/// Describes CUDA device 0, or says why CUDA is unavailable. Never creates
/// a context and never panics.
///
/// # Errors
///
/// [`CudaUnavailable`] naming the reason.
pub fn probe() -> Result<DeviceInfo, CudaUnavailable> {
    imp::probe()
}

/// The provider score and a one-line explanation: `(0, reason)` when CUDA
/// is unavailable, `(SCORE_CUDA, device description)` otherwise.
pub fn score() -> (u32, String) {
    match probe() {
        Ok(dev) => (SCORE_CUDA, dev.to_string()),
        Err(why) => (0, why.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unavailable_reasons_read_well() {
        assert_eq!(
            CudaUnavailable::NotCompiled { feature: "cuda" }.to_string(),
            "cuda support is not compiled in (build with feature `cuda`)"
        );
        let d = DeviceInfo {
            ordinal: 0,
            device_count: 1,
            name: "NVIDIA H100".into(),
            total_memory: 80 << 30,
            compute_capability: (9, 0),
            driver_version: 12080,
        };
        assert_eq!(
            d.to_string(),
            "cuda:0 NVIDIA H100 (80.0 GiB, compute capability 9.0, driver api 12080, 1 device(s))"
        );
    }
}
