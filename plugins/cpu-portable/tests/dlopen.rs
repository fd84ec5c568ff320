//! The pack loaded the way the host loads it: dlopen of the built cdylib,
//! `abi_stable` version and layout checks, then the ABI version check.

mod common;

spinfer_pack_kit::dlopen_tests!("spinfer-pack-cpu-portable", "libspinfer_pack_cpu_portable.so", common::check_module);
