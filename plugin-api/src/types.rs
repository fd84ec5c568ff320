//! FFI-safe data types: the operation and dtype catalogues, host
//! information, kernel descriptors and the records the other traits use.
//!
//! The catalogues ([`Op`], [`WeightType`], [`ActType`]) are open sets:
//! `#[repr(transparent)]` integer newtypes with associated constants, not
//! Rust enums. Adding a constant changes no type layout, so packs and hosts
//! built on either side of the addition still load each other; a value a
//! build does not know is simply "unsupported" to it (`name()` returns
//! `None`). `abi_stable`'s `WithNonExhaustive` enums would not give this:
//! its layout check refuses a library whose enum has fewer variants than the
//! loader's, so every new variant would lock out every older pack (see
//! `docs/plugin-abi.md`).
//!
//! Match on the constants like enum variants (`match op { Op::MAT_MUL => ..,
//! _ => .. }`); the wildcard arm is where unknown values go.

use std::fmt;

use abi_stable::StableAbi;
use abi_stable::std_types::{RString, RVec};

/// Implements `Debug`/`Display` from a `name()` returning `Option<&str>`:
/// the name, or `Type(value)` for values this build does not know.
macro_rules! named_debug_display {
    ($ty:ident) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(n) => f.write_str(n),
                    None => write!(f, "{}({})", stringify!($ty), self.0),
                }
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }
    };
}

// === Catalogues ===

/// The operation a [`crate::Kernel`] implements. All operations compute with
/// a weight matrix `W` of `rows x cols` elements, stored row-major in the
/// kernel's weight type, and f32 activations/outputs.
///
/// Values are never reused or renumbered; new operations get new values.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Op(pub u32);

impl Op {
    /// Retired (id 0 stays reserved): a one-token [`Op::MAT_MUL`], which the
    /// host never asked for; it asks for `MAT_MUL` with `n_tokens == 1`.
    #[deprecated(note = "retired: the host never calls it; offer MAT_MUL (docs/plugin-abi.md)")]
    pub const MAT_VEC: Op = Op(0);
    /// `out[t * rows + r] = dot(W[r, :], x[t * cols..(t + 1) * cols])` for
    /// `n_tokens` tokens.
    pub const MAT_MUL: Op = Op(1);
    /// Only the selected output rows: `out[t * k + j] = dot(W[idx[j], :], x[t])`
    /// for the `k` row indices `idx` (FFN up/gate projections under neuron
    /// sparsity). Served by [`crate::Kernel::run_sparse`].
    pub const GATHERED_ROW_MAT_VEC: Op = Op(2);
    /// Retired (id 3 stays reserved): an AXPY over a neuron-major copy of
    /// the down projection, which the model never holds; the host asks for
    /// [`Op::GATHERED_COLUMN_AXPY`] over `W` as stored instead.
    #[deprecated(note = "retired: the host never calls it; offer GATHERED_COLUMN_AXPY (docs/plugin-abi.md)")]
    pub const SPARSE_AXPY: Op = Op(3);
    /// Retired (id 4 stays reserved): a one-token [`Op::TERNARY_MAT_MUL`].
    #[deprecated(note = "retired: the host never calls it; offer TERNARY_MAT_MUL (docs/plugin-abi.md)")]
    pub const TERNARY_MAT_VEC: Op = Op(4);
    /// [`Op::MAT_MUL`] over ternary weights: TQ1_0 and TQ2_0 as the model
    /// stores them, and `WeightType::I2_S`, which the host makes by an
    /// exact repack of a model's TQ2_0 rows.
    pub const TERNARY_MAT_MUL: Op = Op(5);
    /// Only the selected input columns of `W` as the model stores it
    /// (row-major, `rows` outputs x `cols` inputs; the FFN down projection
    /// under neuron sparsity, where the inputs are the neurons):
    /// `out[t * rows + r] = sum_j x[t * k + j] * W[r, idx[j]]` for the `k`
    /// strictly ascending column indices `idx`. A pack usually repacks `W`
    /// input-major in [`crate::Kernel::prepare`]. The host may split `W`
    /// into contiguous ranges of rows (one per thread, each starting at a
    /// multiple of 32) and call once per range, each range a slice of its
    /// own, prepared once. Served by [`crate::Kernel::run_sparse`].
    pub const GATHERED_COLUMN_AXPY: Op = Op(6);

    /// Every operation the host calls.
    pub const ALL: [Op; 4] = [Op::MAT_MUL, Op::GATHERED_ROW_MAT_VEC, Op::TERNARY_MAT_MUL, Op::GATHERED_COLUMN_AXPY];

    /// The retired ids (0, 3, 4): never reused, never called; a pack that
    /// still offers them loads, and those kernels are never chosen.
    pub const RETIRED: [u32; 3] = [0, 3, 4];

    /// Lowercase name (`"gathered_row_matvec"`); `None` for values this
    /// build does not know. Retired ids keep their names, for messages.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "matvec",
            1 => "matmul",
            2 => "gathered_row_matvec",
            3 => "sparse_axpy",
            4 => "ternary_matvec",
            5 => "ternary_matmul",
            6 => "gathered_column_axpy",
            _ => return None,
        })
    }

    /// True for the operations served by [`crate::Kernel::run_sparse`].
    pub const fn is_sparse(self) -> bool {
        matches!(self, Op::GATHERED_ROW_MAT_VEC | Op::GATHERED_COLUMN_AXPY)
    }
}

named_debug_display!(Op);

/// First value of the range for weight types outside mainline GGML; values
/// below it are GGML type ids.
pub const EXTENSION_TYPE_BASE: u32 = 1 << 16;

/// Element type of a weight matrix. Values below [`EXTENSION_TYPE_BASE`]
/// are GGML's numeric type ids (the `type` field of a GGUF tensor-info
/// record) and use GGML's block layouts bit for bit; types from elsewhere
/// are numbered from [`EXTENSION_TYPE_BASE`] up.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightType(pub u32);

#[allow(non_upper_case_globals, reason = "GGML's spelling of the K-quant names")]
impl WeightType {
    pub const F32: WeightType = WeightType(0);
    pub const F16: WeightType = WeightType(1);
    pub const Q4_0: WeightType = WeightType(2);
    pub const Q4_1: WeightType = WeightType(3);
    pub const Q5_0: WeightType = WeightType(6);
    pub const Q5_1: WeightType = WeightType(7);
    pub const Q8_0: WeightType = WeightType(8);
    pub const Q2_K: WeightType = WeightType(10);
    pub const Q3_K: WeightType = WeightType(11);
    pub const Q4_K: WeightType = WeightType(12);
    pub const Q5_K: WeightType = WeightType(13);
    pub const Q6_K: WeightType = WeightType(14);
    pub const BF16: WeightType = WeightType(30);
    pub const TQ1_0: WeightType = WeightType(34);
    pub const TQ2_0: WeightType = WeightType(35);
    /// bitnet.cpp's 2-bit ternary layout with a per-tensor scale (its GGML
    /// id differs between forks, so it lives in the extension range).
    pub const I2_S: WeightType = WeightType(EXTENSION_TYPE_BASE);

    /// Every weight type this build names.
    pub const ALL: [WeightType; 16] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::BF16,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q8_0,
        WeightType::Q2_K,
        WeightType::Q3_K,
        WeightType::Q4_K,
        WeightType::Q5_K,
        WeightType::Q6_K,
        WeightType::TQ1_0,
        WeightType::TQ2_0,
        WeightType::I2_S,
    ];

    /// GGML's name for the type (`"q4_1"`, `"bf16"`); `None` for values
    /// this build does not name.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self {
            WeightType::F32 => "f32",
            WeightType::F16 => "f16",
            WeightType::BF16 => "bf16",
            WeightType::Q4_0 => "q4_0",
            WeightType::Q4_1 => "q4_1",
            WeightType::Q5_0 => "q5_0",
            WeightType::Q5_1 => "q5_1",
            WeightType::Q8_0 => "q8_0",
            WeightType::Q2_K => "q2_K",
            WeightType::Q3_K => "q3_K",
            WeightType::Q4_K => "q4_K",
            WeightType::Q5_K => "q5_K",
            WeightType::Q6_K => "q6_K",
            WeightType::TQ1_0 => "tq1_0",
            WeightType::TQ2_0 => "tq2_0",
            WeightType::I2_S => "i2_s",
            _ => return None,
        })
    }

    /// GGML's numeric id; `None` for extension types.
    pub const fn ggml_id(self) -> Option<u32> {
        if self.0 < EXTENSION_TYPE_BASE { Some(self.0) } else { None }
    }

    /// The weight type with GGML numeric id `id` (named by this build or
    /// not); `None` if `id` is in the extension range.
    pub const fn from_ggml_id(id: u32) -> Option<WeightType> {
        if id < EXTENSION_TYPE_BASE { Some(WeightType(id)) } else { None }
    }
}

named_debug_display!(WeightType);

/// How activations are fed to a kernel: f32 as given, or quantised by the
/// kernel (into scratch memory of its own) to the named GGML block format
/// before the dot products. Values are GGML type ids, as for
/// [`WeightType`], and extension ids from [`EXTENSION_TYPE_BASE`] for
/// formats GGML does not have.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActType(pub u32);

#[allow(non_upper_case_globals, reason = "GGML's spelling of the K-quant names")]
impl ActType {
    /// f32 activations; quantised weights are dequantised on the fly.
    pub const F32: ActType = ActType(0);
    /// 32-element blocks, one scale (pairs with Q4_0/Q5_0/Q8_0).
    pub const Q8_0: ActType = ActType(8);
    /// Q8_0 plus block sums (pairs with Q4_1/Q5_1).
    pub const Q8_1: ActType = ActType(9);
    /// 256-element super-blocks (pairs with the K-quants and TQ*).
    pub const Q8_K: ActType = ActType(15);
    /// One 16-bit plane per 32 elements, an f32 scale and an f32 scaled
    /// sum per block (pairs with Q4_0/Q4_1/Q5_0/Q5_1/Q8_0): the host's fast
    /// mode on CPUs without VNNI. Not a GGML type, so numbered from
    /// [`EXTENSION_TYPE_BASE`].
    pub const Q16: ActType = ActType(EXTENSION_TYPE_BASE);

    /// Every activation type this build names.
    pub const ALL: [ActType; 5] = [ActType::F32, ActType::Q8_0, ActType::Q8_1, ActType::Q8_K, ActType::Q16];

    /// Name as GGML spells it (`"q8_K"`); `None` for values this build does
    /// not name.
    pub const fn name(self) -> Option<&'static str> {
        Some(match self {
            ActType::F32 => "f32",
            ActType::Q8_0 => "q8_0",
            ActType::Q8_1 => "q8_1",
            ActType::Q8_K => "q8_K",
            ActType::Q16 => "q16",
            _ => return None,
        })
    }
}

named_debug_display!(ActType);

// === Host information ===

/// A set of CPU instruction-set extensions, as bits.
///
/// New bits may be added without an ABI bump; packs ignore bits they do not
/// know. Bit positions never change meaning.
#[repr(transparent)]
#[derive(StableAbi, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CpuFeatureSet(pub u64);

impl CpuFeatureSet {
    pub const AVX2: CpuFeatureSet = CpuFeatureSet(1 << 0);
    pub const FMA: CpuFeatureSet = CpuFeatureSet(1 << 1);
    pub const F16C: CpuFeatureSet = CpuFeatureSet(1 << 2);
    pub const AVX512F: CpuFeatureSet = CpuFeatureSet(1 << 3);
    pub const AVX512BW: CpuFeatureSet = CpuFeatureSet(1 << 4);
    pub const AVX512VL: CpuFeatureSet = CpuFeatureSet(1 << 5);
    pub const AVX512VNNI: CpuFeatureSet = CpuFeatureSet(1 << 6);

    /// Every bit defined by this build, with its name.
    pub const NAMED: [(CpuFeatureSet, &'static str); 7] = [
        (Self::AVX2, "avx2"),
        (Self::FMA, "fma"),
        (Self::F16C, "f16c"),
        (Self::AVX512F, "avx512f"),
        (Self::AVX512BW, "avx512bw"),
        (Self::AVX512VL, "avx512vl"),
        (Self::AVX512VNNI, "avx512vnni"),
    ];

    /// The empty set (a CPU with none of the extensions).
    pub const fn empty() -> Self {
        CpuFeatureSet(0)
    }

    /// True if every bit of `other` is set in `self`.
    pub const fn contains(self, other: CpuFeatureSet) -> bool {
        self.0 & other.0 == other.0
    }

    /// The union of both sets.
    #[must_use]
    pub const fn with(self, other: CpuFeatureSet) -> Self {
        CpuFeatureSet(self.0 | other.0)
    }

    /// The extensions of the running CPU.
    pub fn detect() -> Self {
        #[allow(unused_mut, reason = "only x86-64 sets bits")]
        let mut set = Self::empty();
        #[cfg(target_arch = "x86_64")]
        {
            for (bit, on) in [
                (Self::AVX2, is_x86_feature_detected!("avx2")),
                (Self::FMA, is_x86_feature_detected!("fma")),
                (Self::F16C, is_x86_feature_detected!("f16c")),
                (Self::AVX512F, is_x86_feature_detected!("avx512f")),
                (Self::AVX512BW, is_x86_feature_detected!("avx512bw")),
                (Self::AVX512VL, is_x86_feature_detected!("avx512vl")),
                (Self::AVX512VNNI, is_x86_feature_detected!("avx512vnni")),
            ] {
                if on {
                    set = set.with(bit);
                }
            }
        }
        set
    }
}

impl fmt::Display for CpuFeatureSet {
    /// Space-separated names of the known bits that are set, or `"none"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Self::NAMED.iter().filter(|(b, _)| self.contains(*b)).map(|(_, n)| *n).collect();
        if names.is_empty() { f.write_str("none") } else { f.write_str(&names.join(" ")) }
    }
}

/// What the host tells a pack about itself and the machine, so the pack can
/// score itself ([`crate::PackModule::score`]).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct HostInfo {
    /// The host's version, e.g. `"spinfer 0.1.0"`.
    pub host_version: RString,
    /// Instruction-set extensions of the CPU the host runs on.
    pub cpu_features: CpuFeatureSet,
    /// Logical CPU cores available to the process.
    pub n_cores: u32,
}

impl HostInfo {
    /// Describes the running machine (features detected, cores from
    /// `available_parallelism`) for a host called `host_version`.
    pub fn detect(host_version: &str) -> Self {
        let n_cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        HostInfo {
            host_version: host_version.into(),
            cpu_features: CpuFeatureSet::detect(),
            n_cores: u32::try_from(n_cores).unwrap_or(u32::MAX),
        }
    }
}

// === Kernel description ===

/// What a [`crate::Kernel`] computes and which shapes it accepts.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelDesc {
    /// Stable identifier inside the pack, e.g. `"scalar/q4_1*q8_1"`.
    pub name: RString,
    pub op: Op,
    pub wtype: WeightType,
    pub act: ActType,
    /// `cols` must be a multiple of this (the weight type's block size, or
    /// more for kernels that process several blocks at once). Never 0.
    pub cols_multiple: u32,
    /// `rows` must be a multiple of this (1 for any row count). Never 0.
    pub rows_multiple: u32,
}

impl KernelDesc {
    /// True if `rows x cols` satisfies the shape constraints.
    pub fn accepts_shape(&self, rows: usize, cols: usize) -> bool {
        let cm = usize::try_from(self.cols_multiple.max(1)).unwrap_or(usize::MAX);
        let rm = usize::try_from(self.rows_multiple.max(1)).unwrap_or(usize::MAX);
        cols.is_multiple_of(cm) && rows.is_multiple_of(rm)
    }
}

// === Loader records ===

/// One tensor of a model file, as listed by [`crate::TensorFile::tensors`].
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The name as stored in the file (`"blk.0.ffn_up.weight"`).
    pub name: RString,
    pub wtype: WeightType,
    /// Dimensions, innermost (contiguous) first, as GGUF stores them.
    pub shape: RVec<u64>,
    /// Bytes [`crate::TensorFile::read_tensor`] writes for this tensor.
    pub n_bytes: u64,
}

// === Sparsity records ===

/// An FFN neuron: `index` within the FFN of transformer layer `layer`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NeuronId {
    pub layer: u32,
    pub index: u32,
}

/// The model a pack is asked to build predictors for
/// ([`crate::PackModule::predictors`]).
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq, Eq)]
pub struct PredictorSpec {
    /// Architecture name as in GGUF `general.architecture` (`"llama"`).
    pub arch: RString,
    /// Directory of the model, where trained predictor weights may live.
    pub model_dir: RString,
    pub n_layers: u32,
    /// Width of the hidden state the predictor sees.
    pub hidden_dim: u32,
    /// FFN neurons per layer (the length of the predicted mask).
    pub ffn_dim: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_ids_round_trip() {
        for t in WeightType::ALL {
            if let Some(id) = t.ggml_id() {
                assert_eq!(WeightType::from_ggml_id(id), Some(t), "{t}");
            }
        }
        assert_eq!(WeightType::from_ggml_id(12), Some(WeightType::Q4_K));
        assert_eq!(WeightType::I2_S.ggml_id(), None);
    }

    #[test]
    fn unknown_values_are_representable_and_unnamed() {
        let iq4_xs = WeightType::from_ggml_id(23).unwrap();
        assert_eq!(iq4_xs.name(), None);
        assert_eq!(iq4_xs.to_string(), "WeightType(23)");
        assert_eq!(format!("{:?}", Op(99)), "Op(99)");
        assert_eq!(format!("{:?}", ActType::Q8_K), "q8_K");
        // A retired id keeps its name; the host calls none of them.
        assert_eq!(Op(3).to_string(), "sparse_axpy");
        assert!(Op::RETIRED.iter().all(|&r| !Op::ALL.contains(&Op(r)) && !Op(r).is_sparse()));
        assert_eq!(Op::GATHERED_COLUMN_AXPY.to_string(), "gathered_column_axpy");
        assert!(Op::GATHERED_COLUMN_AXPY.is_sparse());
        let names: Vec<_> = WeightType::ALL.iter().map(|t| t.name().unwrap()).collect();
        let mut dedup = names.clone();
        dedup.sort_unstable();
        dedup.dedup();
        assert_eq!(dedup.len(), names.len(), "distinct names");
        let mut values: Vec<u32> = WeightType::ALL.iter().map(|t| t.0).collect();
        values.sort_unstable();
        values.dedup();
        assert_eq!(values.len(), WeightType::ALL.len(), "distinct values");
    }

    #[test]
    fn feature_bits() {
        let s = CpuFeatureSet::AVX2.with(CpuFeatureSet::FMA);
        assert!(s.contains(CpuFeatureSet::AVX2));
        assert!(!s.contains(CpuFeatureSet::AVX512F));
        assert_eq!(s.to_string(), "avx2 fma");
        assert_eq!(CpuFeatureSet::empty().to_string(), "none");
    }

    #[test]
    fn shape_constraints() {
        let d = KernelDesc {
            name: "t".into(),
            op: Op::MAT_MUL,
            wtype: WeightType::Q4_K,
            act: ActType::Q8_K,
            cols_multiple: 256,
            rows_multiple: 4,
        };
        assert!(d.accepts_shape(8, 512));
        assert!(!d.accepts_shape(6, 512));
        assert!(!d.accepts_shape(8, 100));
    }
}
