//! Run-time CPU feature detection.

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
}

impl CpuFeatures {
    /// Detects the features of the running CPU.
    pub fn detect() -> Self {
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
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Self::default()
        }
    }

    /// AVX2 + FMA + F16C: what the AVX2 kernels require.
    pub fn has_avx2(&self) -> bool {
        self.avx2 && self.fma && self.f16c
    }

    /// AVX-512 F/BW/VL/VNNI on top of AVX2: what the AVX-512 kernels require.
    pub fn has_avx512(&self) -> bool {
        self.has_avx2() && self.avx512f && self.avx512bw && self.avx512vl && self.avx512vnni
    }

    /// Short human-readable list, e.g. `"avx2 fma f16c avx512f ..."`.
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
