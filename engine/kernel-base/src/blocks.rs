//! `#[repr(C)]` layouts of GGML's quantised blocks, byte-for-byte as they
//! appear in a GGUF file (see ggml-common.h). Every struct is `Pod` with
//! alignment 1 or 2, so a `&[u8]` of whole blocks can be cast to a slice of
//! blocks when it is suitably aligned (GGUF data is 32-byte aligned); code
//! that cannot rely on alignment uses `bytemuck::pod_read_unaligned`.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::types::QK_K;

/// Elements per block of the 32-element ("legacy") formats.
pub const QK: usize = 32;

/// Q4_0: `x = d * (q - 8)`, q in 0..16; low nibbles hold elements 0..16,
/// high nibbles elements 16..32.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// Q4_1: `x = d * q + m`, q in 0..16; nibble order as Q4_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// Q5_0: `x = d * (q - 16)`; the fifth bit of element j is bit j of `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q5_1: `x = d * q + m`; fifth bits as Q5_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q8_0: `x = d * q`, q signed 8-bit. Also the activation format for
/// Q4_0/Q5_0/Q8_0 weights in fast mode.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// Q8_1: Q8_0 plus `s = d * sum(q)`; the activation format for Q4_1/Q5_1
/// weights (the sum folds the weights' offset `m` into one multiply).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK],
}

/// Q2_K: 16 sub-blocks of 16; `scales[i]` low nibble = scale, high nibble =
/// min; `x = d * sc * q - dmin * m`, q in 0..4.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

/// Q3_K: 16 sub-blocks of 16; 2 low bits in `qs`, high bit in `hmask`
/// (set bit = no subtraction of 4); 6-bit signed scales packed in 12 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: f16,
}

/// Q4_K: 8 sub-blocks of 32; 6-bit scales and mins packed in 12 bytes;
/// `x = d * sc * q - dmin * m`, q in 0..16.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: as Q4_K with a fifth bit per element in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: 16 sub-blocks of 16; 4 low bits in `ql`, 2 high bits in `qh`;
/// signed 8-bit scales; `x = d * sc * (q - 32)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// Q8_K: f32 scale, 256 signed bytes and the sums of each group of 16
/// (used to apply K-quant mins cheaply). Activation format for K-quants.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

/// TQ1_0: ternary, base-3 packed 5 (qs) and 4 (qh) trits per byte.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockTQ1_0 {
    pub qs: [u8; (QK_K - 4 * QK_K / 64) / 5],
    pub qh: [u8; QK_K / 64],
    pub d: f16,
}

/// TQ2_0: ternary, 2 bits per element (`q - 1` in {-1, 0, 1}).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockTQ2_0 {
    pub qs: [u8; QK_K / 4],
    pub d: f16,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgmlType;
    use std::mem::size_of;

    #[test]
    fn struct_sizes_match_type_sizes() {
        assert_eq!(size_of::<BlockQ4_0>(), GgmlType::Q4_0.type_size());
        assert_eq!(size_of::<BlockQ4_1>(), GgmlType::Q4_1.type_size());
        assert_eq!(size_of::<BlockQ5_0>(), GgmlType::Q5_0.type_size());
        assert_eq!(size_of::<BlockQ5_1>(), GgmlType::Q5_1.type_size());
        assert_eq!(size_of::<BlockQ8_0>(), GgmlType::Q8_0.type_size());
        assert_eq!(size_of::<BlockQ8_1>(), GgmlType::Q8_1.type_size());
        assert_eq!(size_of::<BlockQ2K>(), GgmlType::Q2_K.type_size());
        assert_eq!(size_of::<BlockQ3K>(), GgmlType::Q3_K.type_size());
        assert_eq!(size_of::<BlockQ4K>(), GgmlType::Q4_K.type_size());
        assert_eq!(size_of::<BlockQ5K>(), GgmlType::Q5_K.type_size());
        assert_eq!(size_of::<BlockQ6K>(), GgmlType::Q6_K.type_size());
        assert_eq!(size_of::<BlockQ8K>(), GgmlType::Q8_K.type_size());
        assert_eq!(size_of::<BlockTQ1_0>(), GgmlType::TQ1_0.type_size());
        assert_eq!(size_of::<BlockTQ2_0>(), GgmlType::TQ2_0.type_size());
    }
}
