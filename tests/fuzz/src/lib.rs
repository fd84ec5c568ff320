//! Helpers shared by the fuzz targets in `fuzz_targets/`.
//!
//! Targets that need several files take one input holding them all,
//! separated by [`SEP`] (a line `--8<--`); a seed is the files joined with it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use spinfer_engine::model::{ModelOptions, Precision};

/// Separates the files of a multi-file input.
pub const SEP: &[u8] = b"\n--8<--\n";

/// The first `n - 1` parts of `data` separated by [`SEP`], then the rest (the
/// last part may contain `SEP`); missing parts are empty.
pub fn parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut out = Vec::with_capacity(n);
    let mut rest = data;
    while out.len() + 1 < n {
        match find(rest, SEP) {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + SEP.len()..];
            }
            None => {
                out.push(rest);
                rest = &[];
            }
        }
    }
    out.push(rest);
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A scratch directory private to this process (the targets write their
/// input to files: the engine opens models by path), under
/// `SPINFER_FUZZ_SCRATCH` (which `scripts/fuzz.sh` sets and removes
/// afterwards), else on tmpfs where there is one. Each input overwrites it.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = match std::env::var_os("SPINFER_FUZZ_SCRATCH") {
            Some(d) => PathBuf::from(d),
            None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
            None => std::env::temp_dir(),
        };
        let dir = base.join(format!("spinfer-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create scratch dir");
        dir
    })
}

/// A fresh, empty subdirectory `name` of [`scratch`].
pub fn fresh_dir(name: &str) -> PathBuf {
    let d = scratch().join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create scratch subdir");
    d
}

/// Small model options: one thread, a short context (the context length is
/// an operator's choice, not the file's; huge contexts are tested elsewhere).
pub fn small_options() -> ModelOptions {
    ModelOptions { precision: Precision::Fast, ctx: 32, threads: 1, ..ModelOptions::default() }
}

/// Text to tokenize with a tokenizer that loaded.
pub const TEXT: &str = "Hello, world! 123 héllo\n\tthe quick brown fox";

/// `r` as an `Option`; with `SPINFER_FUZZ_DEBUG` set, errors are printed
/// (to check that a seed gets as far as it should:
/// `SPINFER_FUZZ_DEBUG=1 tests/fuzz/target/<host>/release/gguf -runs=0 SEED`).
pub fn ok<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Option<T> {
    static DEBUG: OnceLock<bool> = OnceLock::new();
    match r {
        Ok(v) => {
            if *DEBUG.get_or_init(|| std::env::var_os("SPINFER_FUZZ_DEBUG").is_some()) {
                eprintln!("{what}: ok");
            }
            Some(v)
        }
        Err(e) => {
            if *DEBUG.get_or_init(|| std::env::var_os("SPINFER_FUZZ_DEBUG").is_some()) {
                eprintln!("{what}: {e}");
            }
            None
        }
    }
}

/// The largest single allocation a target may make: 1 GiB.
pub const MAX_ALLOC: usize = 1 << 30;

/// The system allocator, aborting on any single allocation over
/// [`MAX_ALLOC`] (libFuzzer then reports the input as a crash and saves it).
/// libFuzzer's own `-malloc_limit_mb` needs a sanitizer's allocator hooks,
/// which a stable build without sanitizers does not have.
pub struct LimitAlloc;

impl LimitAlloc {
    #[cold]
    fn over(size: usize) -> ! {
        use std::io::Write as _;
        // No allocation here: format into a stack buffer.
        let mut buf = [0u8; 96];
        let mut w = &mut buf[..];
        let _ = write!(w, "\n==spinfer-fuzz== allocation of {size} bytes, over the {MAX_ALLOC}-byte limit\n");
        let left = w.len();
        let _ = std::io::stderr().write_all(&buf[..buf.len() - left]);
        std::process::abort()
    }
}

// SAFETY: forwards to `System`, whose contract is the same; only adds a
// size check before each allocation.
unsafe impl std::alloc::GlobalAlloc for LimitAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC {
            Self::over(layout.size());
        }
        // SAFETY: the caller's layout contract is passed on unchanged.
        unsafe { std::alloc::System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        if layout.size() > MAX_ALLOC {
            Self::over(layout.size());
        }
        // SAFETY: as for `alloc`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if new_size > MAX_ALLOC {
            Self::over(new_size);
        }
        // SAFETY: as for `dealloc`; `new_size` is the caller's.
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: LimitAlloc = LimitAlloc;
