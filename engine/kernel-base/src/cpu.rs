//! Run-time CPU feature detection, with an optional cap.
//!
//! Every kernel picks its instruction set from [`CpuFeatures::detect`].
//! Setting `SPINFER_CPU=scalar` or `SPINFER_CPU=avx2` ([`CPU_CAP_ENV`])
//! caps what it reports, so a machine with AVX-512 also runs (and the test
//! suite also checks) the AVX2 and scalar paths that a CPU without
//! AVX-512, or without AVX2, would take; `avx512` switches off only the
//! AMX tile kernels. `native` (or unset) means whatever the CPU has.
//!
//! AMX counts only where the OS grants it: the CPU reports the tiles, XCR0
//! has their state enabled, and the kernel granted this process the tile
//! data (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); a CPUID flag alone is not
//! trusted (some virtual machines report AMX and fault on its first use).

use std::sync::OnceLock;

/// Environment variable capping the instruction sets the kernels use:
/// `scalar`, `avx2`, `avx512` (no AMX), `native` (the default).
pub const CPU_CAP_ENV: &str = "SPINFER_CPU";

/// Instruction-set extensions the kernels can use on this machine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512vnni: bool,
    /// Byte permutes (`vpermb`), used by the int8 AXPY.
    pub avx512vbmi: bool,
    /// bf16 dot products, used by the packed bf16 GEMM.
    pub avx512bf16: bool,
    /// AMX tiles with bf16 products, granted by the OS: the packed bf16
    /// GEMM's tile kernel.
    pub amx_bf16: bool,
    /// AMX tiles with int8 products, granted by the OS: the prompt (prefill)
    /// path of the 8-bit matmuls.
    pub amx_int8: bool,
}

/// The highest family of kernels [`CpuFeatures::detect`] may report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IsaCap {
    /// No SIMD extension: every kernel runs its scalar reference.
    Scalar,
    /// AVX2, FMA and F16C at most (no AVX-512).
    Avx2,
    /// AVX-512 at most (no AMX tiles).
    Avx512,
    /// Everything the CPU has.
    Native,
}

impl IsaCap {
    /// Parses a [`CPU_CAP_ENV`] value.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" => Some(Self::Scalar),
            "avx2" => Some(Self::Avx2),
            "avx512" => Some(Self::Avx512),
            "native" | "" => Some(Self::Native),
            _ => None,
        }
    }

    /// The cap set in the environment; an unknown value is ignored with a
    /// warning naming the variable.
    pub fn from_env() -> Self {
        match std::env::var(CPU_CAP_ENV) {
            Ok(v) => Self::parse(&v).unwrap_or_else(|| {
                tracing::warn!("{CPU_CAP_ENV}={v:?} is not one of scalar, avx2, avx512, native: ignored");
                Self::Native
            }),
            Err(_) => Self::Native,
        }
    }
}

impl CpuFeatures {
    /// The features the kernels may use: the running CPU's, capped by
    /// [`CPU_CAP_ENV`]. Read once per process (later changes to the
    /// variable are not seen), so the answer is the same for every kernel.
    pub fn detect() -> Self {
        static DETECTED: OnceLock<CpuFeatures> = OnceLock::new();
        *DETECTED.get_or_init(|| Self::native().capped(IsaCap::from_env()))
    }

    /// The running CPU's features, ignoring [`CPU_CAP_ENV`].
    pub fn native() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            Self {
                avx2: is_x86_feature_detected!("avx2"),
                fma: is_x86_feature_detected!("fma"),
                f16c: is_x86_feature_detected!("f16c"),
                avx512f: is_x86_feature_detected!("avx512f"),
                avx512bw: is_x86_feature_detected!("avx512bw"),
                avx512vl: is_x86_feature_detected!("avx512vl"),
                avx512vnni: is_x86_feature_detected!("avx512vnni"),
                avx512vbmi: is_x86_feature_detected!("avx512vbmi"),
                avx512bf16: is_x86_feature_detected!("avx512bf16"),
                amx_bf16: amx::granted(amx::BF16),
                amx_int8: amx::granted(amx::INT8),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Self::default()
        }
    }

    /// These features with everything above `cap` switched off.
    #[must_use]
    pub fn capped(self, cap: IsaCap) -> Self {
        match cap {
            IsaCap::Native => self,
            IsaCap::Avx512 => Self { amx_bf16: false, amx_int8: false, ..self },
            IsaCap::Avx2 => Self { avx2: self.avx2, fma: self.fma, f16c: self.f16c, ..Self::default() },
            IsaCap::Scalar => Self::default(),
        }
    }

    /// AVX2 + FMA: what the f32 vector helpers (`vec.rs`, attention,
    /// GELU) require.
    pub fn has_avx2_fma(&self) -> bool {
        self.avx2 && self.fma
    }

    /// AVX-512F + FMA: the 512-bit f32 helpers.
    pub fn has_avx512f_fma(&self) -> bool {
        self.avx512f && self.fma
    }

    /// AVX2 + FMA + F16C: what the AVX2 kernels require.
    pub fn has_avx2(&self) -> bool {
        self.avx2 && self.fma && self.f16c
    }

    /// AVX-512 F/BW/VL/VNNI on top of AVX2: what the AVX-512 kernels require.
    pub fn has_avx512(&self) -> bool {
        self.has_avx2() && self.avx512f && self.avx512bw && self.avx512vl && self.avx512vnni
    }

    /// Short human-readable list, e.g. `"avx2 fma f16c avx512f ..."`: the
    /// tuning history's host fingerprint. The extensions added later
    /// (VBMI, BF16) are left out so existing records keep matching.
    pub fn describe(&self) -> String {
        let mut v = Vec::new();
        for (on, name) in [
            (self.avx2, "avx2"),
            (self.fma, "fma"),
            (self.f16c, "f16c"),
            (self.avx512f, "avx512f"),
            (self.avx512bw, "avx512bw"),
            (self.avx512vl, "avx512vl"),
            (self.avx512vnni, "avx512vnni"),
        ] {
            if on {
                v.push(name);
            }
        }
        if v.is_empty() { "scalar".to_string() } else { v.join(" ") }
    }
}

#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::x86_64::{__cpuid, __cpuid_count, _xgetbv};

    /// XCR0 bits of the tile configuration and tile data state.
    const XTILE_STATE: u64 = (1 << 17) | (1 << 18);
    const ARCH_GET_XCOMP_PERM: i64 = 0x1022;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    const SYS_ARCH_PRCTL: i64 = 158;

    unsafe extern "C" {
        fn syscall(number: i64, ...) -> i64;
    }

    /// CPUID.(7, 0):EDX bits of the AMX-BF16 and AMX-INT8 products.
    pub(super) const BF16: u32 = 1 << 22;
    pub(super) const INT8: u32 = 1 << 25;

    /// AMX-TILE and the product `kind` ([`BF16`] or [`INT8`]) reported, tile
    /// state enabled in XCR0, and this process granted the tile data.
    pub(super) fn granted(kind: u32) -> bool {
        // CPUID leaves 0 and 1 exist on every x86-64 CPU; leaf 7 is read
        // only when leaf 0 reports it.
        let (max, l1) = (__cpuid(0).eax, __cpuid(1));
        if max < 7 || l1.ecx & (1 << 27) == 0 {
            return false; // no leaf 7, or no OSXSAVE (no xgetbv)
        }
        let l7 = __cpuid_count(7, 0);
        let (tile, product) = (l7.edx & (1 << 24) != 0, l7.edx & kind != 0);
        // SAFETY: OSXSAVE is set, so xgetbv(0) is allowed.
        if !(tile && product) || unsafe { xcr0() } & XTILE_STATE != XTILE_STATE {
            return false;
        }
        request_tile_data()
    }

    /// # Safety
    /// The CPU must report OSXSAVE.
    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        // SAFETY: the caller checked OSXSAVE.
        unsafe { _xgetbv(0) }
    }

    /// Asks Linux for the tile data (a process-wide permission, granted
    /// once) and reads it back.
    #[cfg(target_os = "linux")]
    fn request_tile_data() -> bool {
        let mut granted: u64 = 0;
        // SAFETY: arch_prctl with these codes takes an integer, or a
        // pointer to a u64 it writes; both outlive the calls.
        unsafe {
            syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
                && syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, &raw mut granted) == 0
                && granted & (1 << XFEATURE_XTILEDATA) != 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tile_data() -> bool {
        false
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod amx {
    pub(super) const BF16: u32 = 0;
    pub(super) const INT8: u32 = 0;

    pub(super) fn granted(_kind: u32) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_parse_and_switch_features_off() {
        assert_eq!(IsaCap::parse("AVX2"), Some(IsaCap::Avx2));
        assert_eq!(IsaCap::parse("scalar"), Some(IsaCap::Scalar));
        assert_eq!(IsaCap::parse("native"), Some(IsaCap::Native));
        assert_eq!(IsaCap::parse("avx512"), Some(IsaCap::Avx512));
        assert_eq!(IsaCap::parse("sse9"), None);
        let all = CpuFeatures {
            avx2: true,
            fma: true,
            f16c: true,
            avx512f: true,
            avx512bw: true,
            avx512vl: true,
            avx512vnni: true,
            avx512vbmi: true,
            avx512bf16: true,
            amx_bf16: true,
            amx_int8: true,
        };
        assert_eq!(all.capped(IsaCap::Native), all);
        assert_eq!(all.capped(IsaCap::Avx512), CpuFeatures { amx_bf16: false, amx_int8: false, ..all });
        let avx2 = all.capped(IsaCap::Avx2);
        assert!(avx2.has_avx2() && avx2.has_avx2_fma() && !avx2.has_avx512() && !avx2.has_avx512f_fma());
        assert!(!avx2.avx512vbmi && !avx2.avx512bf16 && !avx2.amx_bf16 && !avx2.amx_int8);
        assert_eq!(all.capped(IsaCap::Scalar).describe(), "scalar");
        // A cap never adds what the CPU lacks.
        assert_eq!(CpuFeatures::default().capped(IsaCap::Native), CpuFeatures::default());
    }

    #[test]
    fn detect_follows_the_environment_cap() {
        let cap = IsaCap::from_env();
        assert_eq!(CpuFeatures::detect(), CpuFeatures::native().capped(cap));
        eprintln!("{CPU_CAP_ENV} cap {cap:?}: {}", CpuFeatures::detect().describe());
    }
}
