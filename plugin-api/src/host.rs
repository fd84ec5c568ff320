//! Host side: loading a pack from a path with readable errors.
//!
//! [`load_pack`] dlopens the library, lets `abi_stable` check the interface
//! crate version and the layout of every type reachable from the root
//! module, and then compares [`PackModule::abi_version`] with
//! [`ABI_VERSION`]. When the layout check fails, the pack's ABI version is
//! still read (it is the first field in every ABI version) so that a pack
//! built for another ABI version gets the version message rather than a
//! layout dump; the dump stays available in [`LoadError::details`].
//!
//! Libraries are never unloaded (see `docs/plugin-abi.md`): every loaded
//! pack lives until the process exits.
//!
//! [`PackModule::abi_version`]: crate::PackModule::abi_version

use std::fmt;
use std::path::{Path, PathBuf};

use abi_stable::StableAbi;
use abi_stable::library::{LibHeader, LibraryError, RootModule, lib_header_from_path};
use abi_stable::sabi_types::VersionNumber;

use crate::module::{ABI_VERSION, PackModuleRef, check_abi, check_abi_version};

/// Why a pack did not load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoadErrorKind {
    /// The file could not be opened as a dynamic library.
    Open,
    /// The library is not an `abi_stable` library, or its root module is
    /// not a spinfer pack.
    NotAPack,
    /// The pack was built for another ABI version.
    AbiVersion,
    /// The pack was built against an older minor version of this crate
    /// than the host: `abi_stable` requires a pack to know every field,
    /// method and variant the host knows, so it must be rebuilt.
    OutdatedInterface,
    /// The pack's types do not match the host's (same ABI version, so the
    /// pack or the host was built from a modified interface crate).
    Layout,
    /// The pack's root-module constructor failed or panicked.
    Init,
}

/// A pack that did not load: one readable line (`Display`), plus the long
/// `abi_stable` report where there is one ([`LoadError::details`]).
#[derive(Clone, Debug)]
pub struct LoadError {
    path: PathBuf,
    kind: LoadErrorKind,
    summary: String,
    details: Option<String>,
}

impl LoadError {
    fn new(path: &Path, kind: LoadErrorKind, summary: impl Into<String>, details: Option<String>) -> Self {
        LoadError { path: path.to_path_buf(), kind, summary: summary.into(), details }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn kind(&self) -> LoadErrorKind {
        self.kind
    }

    /// The one-line reason, without the path.
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// `abi_stable`'s full report (layout differences can run to pages).
    pub fn details(&self) -> Option<&str> {
        self.details.as_deref()
    }
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot load pack {}: {}", self.path.display(), self.summary)
    }
}

impl std::error::Error for LoadError {}

/// Loads the pack at `path`: dlopen, `abi_stable` version and layout
/// checks, then the explicit ABI version check. The library stays loaded
/// for the rest of the process, whether or not the checks pass.
///
/// Each path is loaded on its own (this does not go through
/// `RootModule::load_from_file`, which caches one library per root-module
/// type for the whole process).
///
/// # Errors
///
/// A [`LoadError`] whose kind says which step failed.
pub fn load_pack(path: &Path) -> Result<PackModuleRef, LoadError> {
    let header = lib_header_from_path(path).map_err(|e| open_error(path, e))?;
    init_pack(path, header)
}

/// The checks of [`load_pack`] once the library is open (`path` only names
/// it in errors).
fn init_pack(path: &Path, header: &LibHeader) -> Result<PackModuleRef, LoadError> {
    let name = header.root_mod_consts().name().as_str();
    if name != PackModuleRef::NAME {
        return Err(LoadError::new(
            path,
            LoadErrorKind::NotAPack,
            format!("its root module is {name:?}, not a spinfer pack ({:?})", PackModuleRef::NAME),
            None,
        ));
    }
    match header.init_root_module::<PackModuleRef>() {
        Ok(module) => {
            check_abi(module).map_err(|msg| LoadError::new(path, LoadErrorKind::AbiVersion, msg, None))?;
            Ok(module)
        }
        Err(e @ (LibraryError::AbiInstability(_) | LibraryError::IncompatibleVersionNumber { .. })) => {
            let (kind, summary) = explain_mismatch(header);
            Err(LoadError::new(path, kind, summary, Some(e.to_string())))
        }
        Err(e @ LibraryError::RootModule { .. }) => Err(LoadError::new(
            path,
            LoadErrorKind::Init,
            "its root-module constructor failed (see details)",
            Some(e.to_string()),
        )),
        Err(e) => Err(LoadError::new(path, LoadErrorKind::NotAPack, first_line(&e.to_string()), Some(e.to_string()))),
    }
}

/// One line saying why `abi_stable` refused a spinfer pack.
fn explain_mismatch(header: &LibHeader) -> (LoadErrorKind, String) {
    explain(
        peek_abi_version(header),
        VersionNumber::new(header.version_strings()).ok(),
        VersionNumber::new(PackModuleRef::VERSION_STRINGS).ok(),
    )
}

/// The reason for a refused pack from its declared ABI version and the
/// interface versions of pack and host: another ABI version, an interface
/// older than the host's, or (same versions) types that differ anyway.
fn explain(pack_abi: Option<u32>, pack: Option<VersionNumber>, host: Option<VersionNumber>) -> (LoadErrorKind, String) {
    if let Some(Err(msg)) = pack_abi.map(check_abi_version) {
        return (LoadErrorKind::AbiVersion, msg);
    }
    let key = |v: &VersionNumber| (v.major, v.minor, v.patch);
    match (pack, host) {
        (Some(pack), Some(host)) if key(&pack) < key(&host) => (
            LoadErrorKind::OutdatedInterface,
            format!(
                "it was built against spinfer-plugin-api {pack}, older than this host's {host}; \
                 rebuild it against {host} or newer (pack ABI version {ABI_VERSION})"
            ),
        ),
        (pack, host) => {
            let show = |v: Option<VersionNumber>| v.map_or_else(|| "?".to_string(), |v| v.to_string());
            (
                LoadErrorKind::Layout,
                format!(
                    "its types do not match this host's although both use pack ABI version {ABI_VERSION} \
                     (pack built against spinfer-plugin-api {}, host {}; see details)",
                    show(pack),
                    show(host)
                ),
            )
        }
    }
}

fn open_error(path: &Path, e: LibraryError) -> LoadError {
    let full = e.to_string();
    let kind = match e {
        LibraryError::OpenError { .. } => LoadErrorKind::Open,
        _ => LoadErrorKind::NotAPack,
    };
    LoadError::new(path, kind, first_line(&full), Some(full))
}

fn first_line(s: &str) -> String {
    s.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("unknown error").to_string()
}

/// A prefix type holding only the first field of [`crate::PackModule`],
/// used to read a pack's ABI version when the full layout check failed.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = AbiVersionProbeRef)))]
struct AbiVersionProbe {
    #[sabi(last_prefix_field)]
    abi_version: u32,
}

/// The `abi_version` a spinfer pack declares, without checking the rest of
/// its layout; `None` if its root module could not be constructed.
fn peek_abi_version(header: &LibHeader) -> Option<u32> {
    // SAFETY: the caller checked that the root module is named
    // "spinfer_pack", and every ABI version of `PackModule` starts with
    // `abi_version: u32` (the rule this probe relies on, stated in
    // docs/plugin-abi.md). `abi_stable` stores a prefix type's fields at a
    // fixed, usize-aligned offset after its metadata (`WithMetadata_` holds
    // `AlignToUsize<T>`), so the probe's only field, read through its
    // prefix accessor without consulting the metadata, is that `u32`. The
    // pack's `LibHeader` already passed `abi_stable`'s own header and C ABI
    // checks, so the metadata layout is the same on both sides.
    let probe = unsafe { header.unchecked_layout::<AbiVersionProbeRef>() }.ok()?;
    Some(probe.abi_version())
}

#[cfg(test)]
// The fake root modules' generated field accessors are never called: only
// their layouts matter.
#[allow(dead_code, reason = "fake root modules exist for their layouts")]
mod tests {
    use abi_stable::declare_root_module_statics;
    use abi_stable::prefix_type::PrefixTypeTrait;
    use abi_stable::sabi_types::VersionStrings;

    use super::*;

    /// What a future ABI version might look like: same first field, a
    /// different layout after it.
    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = FutureModuleRef)))]
    struct FutureModule {
        abi_version: u32,
        #[sabi(last_prefix_field)]
        something_new: u64,
    }

    impl RootModule for FutureModuleRef {
        declare_root_module_statics! {FutureModuleRef}
        const BASE_NAME: &'static str = "spinfer_pack";
        const NAME: &'static str = "spinfer_pack";
        const VERSION_STRINGS: VersionStrings = PackModuleRef::VERSION_STRINGS;
    }

    fn future_header(abi_version: u32) -> &'static LibHeader {
        let module = FutureModule { abi_version, something_new: 0 }.leak_into_prefix();
        Box::leak(Box::new(LibHeader::from_module(module)))
    }

    #[test]
    fn other_abi_version_with_other_layout_names_both_versions() {
        let e = init_pack(Path::new("libfuture.so"), future_header(ABI_VERSION + 1)).err().unwrap();
        assert_eq!(e.kind(), LoadErrorKind::AbiVersion);
        assert_eq!(
            e.to_string(),
            format!(
                "cannot load pack libfuture.so: pack ABI version {} is not supported by this host (host ABI version \
                 {ABI_VERSION})",
                ABI_VERSION + 1
            )
        );
        assert!(e.details().is_some_and(|d| d.len() > e.summary().len()), "the layout report is kept");
    }

    #[test]
    fn other_abi_version_with_same_layout_names_both_versions() {
        let module = crate::module::tests::fake_module(ABI_VERSION + 1);
        let header = Box::leak(Box::new(LibHeader::from_module(module)));
        let e = init_pack(Path::new("libnext.so"), header).err().unwrap();
        assert_eq!(e.kind(), LoadErrorKind::AbiVersion);
        assert!(e.summary().starts_with(&format!("pack ABI version {} is not supported", ABI_VERSION + 1)));
        assert!(e.details().is_none());
        let ok = Box::leak(Box::new(LibHeader::from_module(crate::module::tests::fake_module(ABI_VERSION))));
        assert!(init_pack(Path::new("libok.so"), ok).is_ok());
    }

    #[test]
    fn packs_built_against_an_older_interface_are_asked_to_rebuild() {
        let v = |major, minor, patch| Some(VersionNumber { major, minor, patch });
        let (kind, msg) = explain(Some(ABI_VERSION), v(1, 0, 3), v(1, 2, 0));
        assert_eq!(kind, LoadErrorKind::OutdatedInterface);
        assert_eq!(
            msg,
            format!(
                "it was built against spinfer-plugin-api 1.0.3, older than this host's 1.2.0; \
                 rebuild it against 1.2.0 or newer (pack ABI version {ABI_VERSION})"
            )
        );
        assert_eq!(explain(Some(ABI_VERSION), v(1, 2, 0), v(1, 2, 0)).0, LoadErrorKind::Layout);
        assert_eq!(explain(Some(ABI_VERSION), None, v(1, 2, 0)).0, LoadErrorKind::Layout);
        assert_eq!(explain(Some(ABI_VERSION + 1), v(1, 0, 0), v(1, 2, 0)).0, LoadErrorKind::AbiVersion);
    }

    #[test]
    fn same_abi_version_with_other_layout_is_a_layout_error() {
        let e = init_pack(Path::new("libodd.so"), future_header(ABI_VERSION)).err().unwrap();
        assert_eq!(e.kind(), LoadErrorKind::Layout);
        assert!(!e.to_string().contains('\n'), "{e}");
    }

    /// A root module that is not a spinfer pack at all.
    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = OtherModuleRef)))]
    struct OtherModule {
        #[sabi(last_prefix_field)]
        x: u8,
    }

    impl RootModule for OtherModuleRef {
        declare_root_module_statics! {OtherModuleRef}
        const BASE_NAME: &'static str = "other";
        const NAME: &'static str = "other";
        const VERSION_STRINGS: VersionStrings = PackModuleRef::VERSION_STRINGS;
    }

    #[test]
    fn foreign_root_modules_are_not_packs() {
        let header = Box::leak(Box::new(LibHeader::from_module(OtherModule { x: 0 }.leak_into_prefix())));
        let e = init_pack(Path::new("libother.so"), header).err().unwrap();
        assert_eq!(e.kind(), LoadErrorKind::NotAPack);
        assert_eq!(e.summary(), "its root module is \"other\", not a spinfer pack (\"spinfer_pack\")");
    }
}
