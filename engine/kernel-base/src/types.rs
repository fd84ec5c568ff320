//! Tensor element types as numbered by GGML/GGUF, with their block geometry.
//!
//! A quantised row of `n` elements is `n / block_size` blocks of `type_size`
//! bytes each; `n` must be a multiple of the block size.

/// Element type of a weight tensor, using GGML's numbering (the `type` field
/// of a GGUF tensor-info record).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
#[allow(non_camel_case_types, reason = "names follow GGML's spelling")]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
}

/// Elements per super-block of the K-quant family.
pub const QK_K: usize = 256;

impl GgmlType {
    /// All types this crate knows the layout of.
    pub const ALL: [GgmlType; 17] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q8_1,
        Self::Q2_K,
        Self::Q3_K,
        Self::Q4_K,
        Self::Q5_K,
        Self::Q6_K,
        Self::Q8_K,
        Self::BF16,
        Self::TQ1_0,
        Self::TQ2_0,
    ];

    /// Maps GGML's numeric id to a type; `None` for ids this crate does not
    /// support (IQ*, MXFP4, removed types, garbage).
    pub fn from_u32(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    /// Elements per block.
    pub const fn block_size(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 | Self::Q8_1 => 32,
            Self::Q2_K | Self::Q3_K | Self::Q4_K | Self::Q5_K | Self::Q6_K | Self::Q8_K | Self::TQ1_0 | Self::TQ2_0 => {
                QK_K
            }
        }
    }

    /// Bytes per block.
    pub const fn type_size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 2 + 16,
            Self::Q4_1 => 2 + 2 + 16,
            Self::Q5_0 => 2 + 4 + 16,
            Self::Q5_1 => 2 + 2 + 4 + 16,
            Self::Q8_0 => 2 + 32,
            Self::Q8_1 => 2 + 2 + 32,
            Self::Q2_K => QK_K / 16 + QK_K / 4 + 2 + 2,
            Self::Q3_K => QK_K / 8 + QK_K / 4 + 12 + 2,
            Self::Q4_K => 2 + 2 + 12 + QK_K / 2,
            Self::Q5_K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            Self::Q6_K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            Self::Q8_K => 4 + QK_K + QK_K / 16 * 2,
            Self::TQ1_0 => (QK_K - 4 * QK_K / 64) / 5 + QK_K / 64 + 2,
            Self::TQ2_0 => 2 + 64,
        }
    }

    /// GGML's name for the type (`"q4_1"`, `"f32"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q8_0 => "q8_0",
            Self::Q8_1 => "q8_1",
            Self::Q2_K => "q2_K",
            Self::Q3_K => "q3_K",
            Self::Q4_K => "q4_K",
            Self::Q5_K => "q5_K",
            Self::Q6_K => "q6_K",
            Self::Q8_K => "q8_K",
            Self::BF16 => "bf16",
            Self::TQ1_0 => "tq1_0",
            Self::TQ2_0 => "tq2_0",
        }
    }

    /// True for block-quantised types (everything but F32/F16/BF16).
    pub const fn is_quantized(self) -> bool {
        !matches!(self, Self::F32 | Self::F16 | Self::BF16)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_ggml() {
        // Values from ggml's type_traits table.
        let expect = [
            (GgmlType::Q4_0, 18),
            (GgmlType::Q4_1, 20),
            (GgmlType::Q5_0, 22),
            (GgmlType::Q5_1, 24),
            (GgmlType::Q8_0, 34),
            (GgmlType::Q8_1, 36),
            (GgmlType::Q2_K, 84),
            (GgmlType::Q3_K, 110),
            (GgmlType::Q4_K, 144),
            (GgmlType::Q5_K, 176),
            (GgmlType::Q6_K, 210),
            (GgmlType::Q8_K, 292),
            (GgmlType::TQ1_0, 54),
            (GgmlType::TQ2_0, 66),
        ];
        for (t, size) in expect {
            assert_eq!(t.type_size(), size, "{t}");
        }
    }

    #[test]
    fn unknown_ids_are_rejected() {
        assert_eq!(GgmlType::from_u32(4), None);
        assert_eq!(GgmlType::from_u32(16), None); // iq2_xxs
        assert_eq!(GgmlType::from_u32(12), Some(GgmlType::Q4_K));
    }
}
