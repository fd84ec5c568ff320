//! The pack's root module obtained in process (the crate is also an rlib),
//! without dlopen.

mod common;

use spinfer_pack_cpu_simd::instantiate_root_module;
use spinfer_plugin_api::PackModuleRef;
use spinfer_plugin_api::abi_stable::library::RootModule;

#[test]
fn root_module_in_process() {
    let module = PackModuleRef::load_module_with(|| Ok::<_, ()>(instantiate_root_module())).unwrap();
    common::check_module(module);
}
