//! The root module every pack exports, and the host's version check.

use abi_stable::library::RootModule;
use abi_stable::sabi_types::VersionStrings;
use abi_stable::std_types::{RString, RVec};
use abi_stable::{StableAbi, declare_root_module_statics, package_version_strings};

use crate::traits::{CachePolicyBox, KernelBox, LoaderBox, PredictorBox};
use crate::types::{HostInfo, PredictorSpec};

/// Version of the pack ABI described by this crate. A pack stores the value
/// it was built with in [`PackModule::abi_version`]; the host refuses packs
/// whose value differs from its own (see [`check_abi`]).
///
/// Equal to this crate's major version, and bumped with it by any change
/// that is not an append; see `docs/plugin-abi.md`.
pub const ABI_VERSION: u32 = 1;

/// The root module of a pack: its entry points, as an append-only prefix
/// struct of function pointers.
///
/// A pack exports it with
///
/// ```ignore
/// #[abi_stable::export_root_module]
/// fn instantiate_root_module() -> PackModuleRef {
///     PackModule { abi_version: ABI_VERSION, name, score, kernels, loaders, predictors, cache_policies }
///         .leak_into_prefix()
/// }
/// ```
///
/// (with `use abi_stable::prefix_type::PrefixTypeTrait;`), and every function
/// marked `#[abi_stable::sabi_extern_fn]`.
///
/// Layout rules: `abi_version` is the first field in every ABI version, so a
/// host can read it from a pack whose other fields it does not understand;
/// new entry points are appended after [`PackModule::cache_policies`] (the
/// `last_prefix_field` of ABI version 1); their accessors on
/// [`PackModuleRef`] return `Option`, `None` for a pack built before the
/// field existed.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PackModuleRef)))]
pub struct PackModule {
    /// [`ABI_VERSION`] as the pack was built. First field, always.
    pub abi_version: u32,

    /// Human-readable pack name, e.g. `"cpu-portable"`.
    pub name: extern "C" fn() -> RString,

    /// How well the pack suits this host: 0 = unsupported (the host skips
    /// the pack), higher is preferred. Must be cheap and must not touch
    /// devices beyond checking that they exist.
    pub score: extern "C" fn(host: &HostInfo) -> u32,

    /// Every kernel the pack offers.
    pub kernels: extern "C" fn() -> RVec<KernelBox>,

    /// Every model-file loader the pack offers (often none).
    pub loaders: extern "C" fn() -> RVec<LoaderBox>,

    /// The neuron-activity predictors the pack can build for this model
    /// (often none).
    pub predictors: extern "C" fn(spec: &PredictorSpec) -> RVec<PredictorBox>,

    /// Fresh instances of every cache policy the pack offers, each for a
    /// cache of `capacity` neurons (often none).
    #[sabi(last_prefix_field)]
    pub cache_policies: extern "C" fn(capacity: u64) -> RVec<CachePolicyBox>,
}

impl RootModule for PackModuleRef {
    declare_root_module_statics! {PackModuleRef}

    const BASE_NAME: &'static str = "spinfer_pack";
    const NAME: &'static str = "spinfer_pack";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// Checks a pack's declared ABI version against this host's [`ABI_VERSION`].
///
/// # Errors
///
/// `"pack ABI version X is not supported by this host (host ABI version Y)"`.
pub fn check_abi_version(pack_version: u32) -> Result<(), String> {
    if pack_version == ABI_VERSION {
        Ok(())
    } else {
        Err(format!("pack ABI version {pack_version} is not supported by this host (host ABI version {ABI_VERSION})"))
    }
}

/// Checks a loaded root module's [`PackModule::abi_version`] (see
/// [`check_abi_version`]). [`crate::load_pack`] calls this after
/// `abi_stable`'s layout check.
///
/// # Errors
///
/// As [`check_abi_version`].
pub fn check_abi(module: PackModuleRef) -> Result<(), String> {
    check_abi_version(module.abi_version())
}

#[cfg(test)]
pub(crate) mod tests {
    use abi_stable::prefix_type::PrefixTypeTrait;
    use abi_stable::sabi_extern_fn;

    use super::*;

    #[sabi_extern_fn]
    fn name() -> RString {
        "fake".into()
    }

    #[sabi_extern_fn]
    fn score(_host: &HostInfo) -> u32 {
        7
    }

    #[sabi_extern_fn]
    fn kernels() -> RVec<KernelBox> {
        RVec::new()
    }

    #[sabi_extern_fn]
    fn loaders() -> RVec<LoaderBox> {
        RVec::new()
    }

    #[sabi_extern_fn]
    fn predictors(_spec: &PredictorSpec) -> RVec<PredictorBox> {
        RVec::new()
    }

    #[sabi_extern_fn]
    fn cache_policies(_capacity: u64) -> RVec<CachePolicyBox> {
        RVec::new()
    }

    /// A pack root module declaring `abi_version`, with empty entry points.
    pub(crate) fn fake_module(abi_version: u32) -> PackModuleRef {
        PackModule { abi_version, name, score, kernels, loaders, predictors, cache_policies }.leak_into_prefix()
    }

    #[test]
    fn abi_version_is_the_crate_major_version() {
        // abi_stable refuses packs built against another major version of
        // this crate before our own check runs; keeping both equal makes
        // its refusal and ours mean the same thing.
        assert_eq!(env!("CARGO_PKG_VERSION_MAJOR"), ABI_VERSION.to_string());
    }

    #[test]
    fn current_version_is_accepted() {
        let m = fake_module(ABI_VERSION);
        assert_eq!(check_abi(m), Ok(()));
        assert_eq!(m.name()().as_str(), "fake");
        assert_eq!(m.score()(&HostInfo::detect("test")), 7);
    }

    #[test]
    fn other_versions_are_rejected_naming_both() {
        let m = fake_module(ABI_VERSION + 1);
        let err = check_abi(m).unwrap_err();
        assert_eq!(
            err,
            format!(
                "pack ABI version {} is not supported by this host (host ABI version {ABI_VERSION})",
                ABI_VERSION + 1
            )
        );
        assert_eq!(
            check_abi_version(0).unwrap_err(),
            "pack ABI version 0 is not supported by this host (host ABI version 1)"
        );
    }
}
