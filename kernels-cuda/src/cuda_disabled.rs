//! Built without feature `cuda`: every probe answers "not compiled"
//! (the shape of candle's `cuda_backend` dummy module).

use crate::{CudaUnavailable, DeviceInfo};

pub(crate) fn probe() -> Result<DeviceInfo, CudaUnavailable> {
    Err(CudaUnavailable::NotCompiled { feature: "cuda" })
}
