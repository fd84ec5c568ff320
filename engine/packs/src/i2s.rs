//! Pack kernels over I2_S (`Op::TERNARY_MAT_MUL` with `WeightType::I2_S`)
//! serving a model's TQ2_0 matrices. I2_S has no GGUF type (forks number it
//! differently), so a model never holds it: the host repacks each TQ2_0
//! weight slice once, exactly
//! ([`spinfer_kernels::dot::ternary::repack_tq2_0_to_i2s`]), and hands the
//! pack the repacked rows. A matrix whose block scales differ along a row
//! has no I2_S form: the call fails as a pack error, and the model moves
//! that matrix to its built-in kernel.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use spinfer_kernels::dot::ternary::repack_tq2_0_to_i2s;
use spinfer_kernels::kernel::{MatmulCall, MatmulKernel, Select, not_offered};
use spinfer_kernels::pool::ThreadPool;
use spinfer_kernels::{GgmlType, KernelError};

/// Weight slice (address, length) → its I2_S repack.
type Repacks = RwLock<HashMap<(usize, usize), Arc<[u8]>>>;

/// A pack's I2_S kernel, bound to a TQ2_0 operation of `cols` columns.
pub(crate) struct I2sFromTq2_0 {
    /// The pack kernel (its calls cross the ABI with I2_S rows).
    pub(crate) inner: Arc<dyn MatmulKernel>,
    pub(crate) pack: String,
    pub(crate) cols: usize,
    repacked: Repacks,
}

impl I2sFromTq2_0 {
    pub(crate) fn new(inner: Arc<dyn MatmulKernel>, pack: String, cols: usize) -> Self {
        Self { inner, pack, cols, repacked: RwLock::new(HashMap::new()) }
    }

    /// The I2_S form of the TQ2_0 rows `w`, made on first use.
    fn i2s(&self, w: &[u8]) -> Result<Arc<[u8]>, KernelError> {
        let key = (w.as_ptr() as usize, w.len());
        if let Some(v) = self.repacked.read().unwrap_or_else(PoisonError::into_inner).get(&key) {
            return Ok(Arc::clone(v));
        }
        let pack_error = |detail: String| KernelError::Pack {
            pack: self.pack.clone(),
            kernel: self.inner.name().to_string(),
            detail: format!("the TQ2_0 weights have no I2_S form: {detail}"),
        };
        let row_bytes = GgmlType::TQ2_0.row_bytes(self.cols).map_err(|e| pack_error(e.to_string()))?;
        if row_bytes == 0 || !w.len().is_multiple_of(row_bytes) {
            return Err(pack_error(format!("{} bytes are not whole rows of {row_bytes}", w.len())));
        }
        let v: Arc<[u8]> =
            repack_tq2_0_to_i2s(w, w.len() / row_bytes, self.cols).map_err(|e| pack_error(e.to_string()))?.into();
        self.repacked.write().unwrap_or_else(PoisonError::into_inner).insert(key, Arc::clone(&v));
        Ok(v)
    }
}

impl MatmulKernel for I2sFromTq2_0 {
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// The dense product on the repacked weights (the only form it
    /// serves).
    fn run(&self, pool: &ThreadPool, call: MatmulCall<'_>) -> spinfer_kernels::Result<()> {
        if !matches!(call.select, Select::All) {
            return Err(not_offered(self, call.select.form()));
        }
        let i2s = self.i2s(call.w)?;
        self.inner.run(pool, MatmulCall { w: &i2s, ..call })
    }
}
