//! How operations and providers are named in pins, history records and
//! reports: a leaf that the kernel registry and the tuner share.

use spinfer_kernels::kernel::{ActType, MatmulDesc};

/// The provider name of the kernels compiled into the engine.
pub const BUILTIN: &str = "cpu-builtin";

/// `"q4_1*q8_1"`: the key pins and reports use for a weight/activation pair.
pub fn pin_key(w: spinfer_kernels::GgmlType, act: ActType) -> String {
    format!("{}*{}", w.name(), act.name())
}

/// Human-readable operation name, e.g. `"matmul q4_1*q8_1 1536x576"` or
/// `"gathered-row matmul q4_1*q8_1 1536x576"`.
pub fn describe(desc: &MatmulDesc) -> String {
    format!("{}matmul {} {}x{}", desc.form.prefix(), pin_key(desc.wtype, desc.act), desc.rows, desc.cols)
}
