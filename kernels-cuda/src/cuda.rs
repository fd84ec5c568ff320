//! Built with feature `cuda`: the probe on `cudarc`'s driver API, loaded at
//! run time (`dynamic-loading`).

use std::panic::catch_unwind;

use cudarc::driver::{result, sys};

use crate::{CudaUnavailable, DeviceInfo};

pub(crate) fn probe() -> Result<DeviceInfo, CudaUnavailable> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by
    // its usual names and drops the handle; opening libcuda runs the
    // driver's own initialisers, which is what any CUDA use does. It must
    // come first: every other cudarc driver call panics (through
    // `culib()`) when the library is missing.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    // A driver older than the API version cudarc was built for lacks some
    // symbols, and cudarc panics on a missing symbol: keep that a reason,
    // not a crash.
    catch_unwind(query).unwrap_or_else(|_| {
        Err(CudaUnavailable::Driver {
            call: "driver api",
            detail: "the driver lacks a symbol of cuda 12.8 (driver too old?)".to_string(),
        })
    })
}

fn driver_err(call: &'static str) -> impl Fn(result::DriverError) -> CudaUnavailable {
    move |e| CudaUnavailable::Driver { call, detail: format!("{e:?}") }
}

/// Device 0's attributes, without creating a context.
fn query() -> Result<DeviceInfo, CudaUnavailable> {
    result::init().map_err(|e| match e.0 {
        sys::CUresult::CUDA_ERROR_NO_DEVICE => CudaUnavailable::NoDevice,
        _ => driver_err("cuInit")(e),
    })?;
    let count = result::device::get_count().map_err(driver_err("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(CudaUnavailable::NoDevice);
    }
    let mut driver_version = 0;
    // SAFETY: `cuDriverGetVersion` writes one int through the pointer, which
    // points to a live local.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result().map_err(driver_err("cuDriverGetVersion"))?;
    let dev = result::device::get(0).map_err(driver_err("cuDeviceGet"))?;
    let name = result::device::get_name(dev).map_err(driver_err("cuDeviceGetName"))?;
    // SAFETY: `dev` is a device handle the driver just returned for ordinal 0.
    let total_memory = unsafe { result::device::total_mem(dev) }.map_err(driver_err("cuDeviceTotalMem"))?;
    let attr = |a| {
        // SAFETY: as above, `dev` is a valid device handle; the attribute is
        // one of the driver's enum values.
        unsafe { result::device::get_attribute(dev, a) }.map_err(driver_err("cuDeviceGetAttribute"))
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(DeviceInfo {
        ordinal: 0,
        device_count: usize::try_from(count).unwrap_or(0),
        name,
        total_memory,
        compute_capability: (major, minor),
        driver_version,
    })
}
