//! The Architecture Invariants of docs/ARCHITECTURE.md that a test can
//! check by reading the workspace: the crate layering, which crate may
//! open pack artefacts, what the kernels crate may touch, that library
//! code does not print, and the size limits on crates and files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use spinfer_tests::workspace;

/// Every workspace member's normal (not dev, not build) dependencies by
/// package name, from `cargo metadata`.
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1", "--offline"])
        .current_dir(workspace())
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata is JSON");
    let mut deps = BTreeMap::new();
    for p in meta["packages"].as_array().expect("packages") {
        let normal = p["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            .filter(|d| d["kind"].is_null())
            .map(|d| d["name"].as_str().expect("name").to_string())
            .collect();
        deps.insert(p["name"].as_str().expect("name").to_string(), normal);
    }
    deps
}

/// The engine's crates, bottom to top, with the engine crates each may use.
/// A crate uses only crates listed before it: the layering has no cycle by
/// construction, and a new dependency upward fails this test.
const LAYERS: &[(&str, &[&str])] = &[
    ("spinfer-kernel-base", &[]),
    ("spinfer-gemm", &["spinfer-kernel-base"]),
    ("spinfer-ternary", &["spinfer-kernel-base"]),
    ("spinfer-kernels", &["spinfer-kernel-base", "spinfer-gemm", "spinfer-ternary"]),
    ("spinfer-attention", &["spinfer-kernels"]),
    ("spinfer-sparse-kernels", &["spinfer-kernels"]),
    ("spinfer-formats", &["spinfer-kernels"]),
    ("spinfer-tokenizer", &["spinfer-formats"]),
    ("spinfer-kernel-select", &["spinfer-kernels", "spinfer-plugin-api", "spinfer-registry"]),
    (
        "spinfer-packs",
        &[
            "spinfer-kernels",
            "spinfer-kernels-cuda",
            "spinfer-formats",
            "spinfer-kernel-select",
            "spinfer-plugin-api",
            "spinfer-registry",
        ],
    ),
    (
        "spinfer-sparsity",
        &[
            "spinfer-kernels",
            "spinfer-sparse-kernels",
            "spinfer-formats",
            "spinfer-kernel-select",
            "spinfer-plugin-api",
        ],
    ),
    ("spinfer-storage", &[]),
    ("spinfer-sampling", &[]),
    ("spinfer-grammar", &["spinfer-tokenizer", "spinfer-sampling"]),
    (
        "spinfer-models",
        &[
            "spinfer-storage",
            "spinfer-sampling",
            "spinfer-kernels",
            "spinfer-attention",
            "spinfer-sparse-kernels",
            "spinfer-formats",
            "spinfer-tokenizer",
            "spinfer-kernel-select",
            "spinfer-sparsity",
            "spinfer-plugin-api",
        ],
    ),
    ("spinfer-generate", &["spinfer-models", "spinfer-sampling", "spinfer-tokenizer"]),
    (
        "spinfer-embed",
        &[
            "spinfer-kernels",
            "spinfer-formats",
            "spinfer-tokenizer",
            "spinfer-kernel-select",
            "spinfer-sparsity",
            "spinfer-models",
        ],
    ),
    (
        "spinfer-gpu",
        &["spinfer-kernels", "spinfer-formats", "spinfer-models", "spinfer-generate", "spinfer-kernels-cuda"],
    ),
];

#[test]
fn engine_crates_depend_only_downward() {
    let deps = dependencies();
    for (name, allowed) in LAYERS {
        let got = deps.get(*name).unwrap_or_else(|| panic!("{name} is not a workspace member"));
        for d in got.iter().filter(|d| d.starts_with("spinfer-")) {
            assert!(allowed.contains(&d.as_str()), "{name} depends on {d}, which its layer may not use");
        }
    }
    // The facade sits on top: nothing in the engine depends on it.
    for (name, d) in &deps {
        if LAYERS.iter().any(|(l, _)| l == name) {
            assert!(!d.contains("spinfer-engine"), "{name} depends on the facade spinfer-engine");
        }
    }
}

#[test]
fn only_the_packs_crate_links_wasmtime_and_memfd() {
    for (name, d) in dependencies() {
        for sandbox in ["wasmtime", "wasmparser", "memfd"] {
            assert!(!d.contains(sandbox) || name == "spinfer-packs", "{name} depends on {sandbox}");
        }
    }
}

#[test]
fn only_the_grammar_crate_links_llguidance() {
    for (name, d) in dependencies() {
        assert!(!d.contains("llguidance") || name == "spinfer-grammar", "{name} depends on llguidance");
    }
}

/// The non-test code of every `.rs` file under `dir` (a file's unit tests,
/// its `#[cfg(test)] mod`, by convention its last item, are cut off).
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") && !p.ends_with("tests.rs") && !is_test_file(&p) {
                let text = std::fs::read_to_string(&p).unwrap();
                // An inline test module at the end is not counted (a
                // `#[cfg(test)] mod x;` declaration is not one).
                let code = match text.find("#[cfg(test)]\nmod tests {") {
                    Some(i) => text[..i].to_string(),
                    None => text,
                };
                out.push((p, code));
            }
        }
    }
    out.sort();
    out
}

/// Test-only source files (`*_tests.rs`, `fixtures.rs`, `testing.rs`).
fn is_test_file(p: &Path) -> bool {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name.ends_with("_tests.rs") || name == "fixtures.rs" || name == "testing.rs"
}

/// Lines, comments and blank lines included (what `wc -l` counts).
fn lines(code: &str) -> usize {
    code.lines().count()
}

#[test]
fn only_the_packs_crate_opens_a_pack_library() {
    let ws = workspace();
    for dir in ["engine", "plugins/ruvllm-backend/src", "kernels-cuda/src"] {
        for (p, code) in sources(&ws.join(dir)) {
            if p.starts_with(ws.join("engine/packs")) {
                continue;
            }
            assert!(!code.contains("load_pack("), "{} opens a pack library", p.display());
        }
    }
}

/// Every product the model runs per token is resolved once, at load,
/// through the kernel registry: outside the registry itself, only the
/// offline k-means of the sparse head's index build asks for a built-in
/// kernel directly, and no engine code enumerates kernel candidates.
#[test]
fn products_are_resolved_at_load_through_the_registry() {
    let ws = workspace();
    for (p, code) in sources(&ws.join("engine")) {
        let rel = p.strip_prefix(&ws).unwrap().to_string_lossy().to_string();
        if rel.starts_with("engine/select/") || rel.starts_with("engine/kernels/") {
            continue;
        }
        if rel != "engine/models/src/head/kmeans.rs" {
            assert!(!code.contains("builtin_kernel("), "{rel} builds a kernel outside the registry");
        }
        // Packs bind their own kernels; the WASM pack's spot check keeps a
        // one-row scalar reference built once per kernel.
        if !rel.starts_with("engine/packs/") {
            assert!(!code.contains("matmul::candidates("), "{rel} picks a kernel outside the registry");
        }
    }
}

#[test]
fn the_kernels_crates_open_no_file_and_read_one_variable() {
    let base = workspace().join("engine/kernel-base/src");
    let others = ["engine/kernels/src", "engine/ternary/src", "engine/sparse-kernels/src"]
        .map(|d| sources(&workspace().join(d)));
    for (p, code) in sources(&base).into_iter().chain(others.into_iter().flatten()) {
        if p == base.join("cpu.rs") {
            // The one place that reads the environment (SPINFER_CPU, once)
            // and asks the CPU what it has.
            continue;
        }
        for banned in ["std::fs", "File::", "std::env", "env::var", "is_x86_feature_detected!"] {
            assert!(!code.contains(banned), "{} uses {banned}", p.display());
        }
    }
}

#[test]
fn library_code_does_not_print() {
    let ws = workspace();
    let libs = [
        "engine/kernels/src",
        "engine/sparse-kernels/src",
        "engine/formats/src",
        "engine/tokenizer/src",
        "engine/select/src",
        "engine/packs/src",
        "engine/sparsity/src",
        "engine/models/src",
        "engine/embed/src",
        "engine/core/src",
        "engine/gpu/src",
        "kernels-cuda/src",
        "registry/src",
        "plugin-api/src",
    ];
    for dir in libs {
        for (p, code) in sources(&ws.join(dir)) {
            for l in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
                for banned in ["println!", "eprintln!", "print!(", "dbg!("] {
                    assert!(!l.contains(banned), "{}: {banned} in library code (log with tracing)", p.display());
                }
            }
        }
    }
}

/// Source files still over the 700-line limit (tests excluded), each to
/// be split; the list may only shrink: a file that fits is an error here
/// until it is taken off.
const OVER_700: &[&str] = &[];

#[test]
fn no_source_file_is_over_700_lines() {
    let ws = workspace();
    let mut over = Vec::new();
    for dir in ["engine", "plugin-api/src", "plugins", "registry/src", "kernels-cuda/src"] {
        for (p, code) in sources(&ws.join(dir)) {
            let rel = p.strip_prefix(&ws).unwrap().to_string_lossy().into_owned();
            if rel.contains("/tests/") || rel.contains("/benches/") || rel.contains("/examples/") {
                continue;
            }
            let n = lines(&code);
            let listed = OVER_700.contains(&rel.as_str());
            assert!(n <= 700 || listed, "{rel}: {n} lines (at most 700; split it)");
            assert!(n > 700 || !listed, "{rel}: {n} lines now: take it off OVER_700");
            if n > 700 {
                over.push(rel);
            }
        }
    }
    eprintln!("files over 700 lines: {over:?}");
}

/// Library crates still over the 5,000-line limit (tests excluded); the
/// list may only shrink, as [`OVER_700`].
const OVER_5000: &[&str] = &[];

/// Every library crate of the workspace: a folder with a `src/lib.rs`
/// under `engine/` or `plugins/`, or one of the top-level library folders.
fn library_crates(ws: &Path) -> Vec<String> {
    let mut out: Vec<String> = ["registry", "plugin-api", "kernels-cuda"].map(String::from).to_vec();
    for parent in ["engine", "plugins"] {
        for e in std::fs::read_dir(ws.join(parent)).unwrap() {
            let p = e.unwrap().path();
            if p.join("src/lib.rs").is_file() {
                out.push(p.strip_prefix(ws).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn no_library_crate_is_over_5000_lines() {
    let ws = workspace();
    let crates = library_crates(&ws);
    assert!(crates.iter().any(|c| c == "engine/kernels") && crates.len() > 10, "{crates:?}");
    for dir in &crates {
        let n: usize = sources(&ws.join(dir).join("src")).iter().map(|(_, c)| lines(c)).sum();
        let listed = OVER_5000.contains(&dir.as_str());
        assert!(n <= 5000 || listed, "{dir}: {n} lines (at most 5000; split the crate)");
        assert!(n > 5000 || !listed, "{dir}: {n} lines now: take it off OVER_5000");
        eprintln!("{dir}: {n} lines");
    }
}
