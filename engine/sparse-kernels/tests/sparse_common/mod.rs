//! What the sparse kernels' tests and timings share besides the kernels'
//! own test support.

use spinfer_kernels::cpu::CpuFeatures;
use spinfer_sparse_kernels::AxpyIsa;

/// The AXPY instruction sets this CPU runs, scalar first.
pub fn isas() -> Vec<AxpyIsa> {
    let mut v = vec![AxpyIsa::Scalar];
    let f = CpuFeatures::detect();
    if f.has_avx2() {
        v.push(AxpyIsa::Avx2);
    }
    if f.has_avx2() && f.avx512f {
        v.push(AxpyIsa::Avx512);
    }
    v
}
